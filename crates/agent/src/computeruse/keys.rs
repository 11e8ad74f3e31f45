//! Key names as computer-use clients send them (`enter`, `ctrl`, `F5`, `a`,
//! `Page_Up`, `cmd`) and characters to type, as X keysyms.

use x11rb::protocol::xproto::Keysym;

pub const SHIFT: Keysym = 0xffe1;
const CONTROL: Keysym = 0xffe3;
const ALT: Keysym = 0xffe9;
const SUPER: Keysym = 0xffeb;

/// Names of keys that are not one character, lower case and without `_`, `-`
/// or spaces (so `Page_Up`, `page-up` and `pageup` are one name).
const NAMED: &[(&str, Keysym)] = &[
    ("enter", 0xff0d),
    ("return", 0xff0d),
    ("tab", 0xff09),
    ("esc", 0xff1b),
    ("escape", 0xff1b),
    ("backspace", 0xff08),
    ("delete", 0xffff),
    ("del", 0xffff),
    ("insert", 0xff63),
    ("home", 0xff50),
    ("end", 0xff57),
    ("left", 0xff51),
    ("up", 0xff52),
    ("right", 0xff53),
    ("down", 0xff54),
    ("pageup", 0xff55),
    ("prior", 0xff55),
    ("pagedown", 0xff56),
    ("next", 0xff56),
    ("space", 0x20),
    ("menu", 0xff67),
    ("print", 0xff61),
    ("printscreen", 0xff61),
    ("pause", 0xff13),
    ("capslock", 0xffe5),
    ("numlock", 0xff7f),
    ("scrolllock", 0xff14),
    ("shift", SHIFT),
    ("lshift", SHIFT),
    ("shiftl", SHIFT),
    ("rshift", 0xffe2),
    ("shiftr", 0xffe2),
    ("ctrl", CONTROL),
    ("control", CONTROL),
    ("lctrl", CONTROL),
    ("controll", CONTROL),
    ("rctrl", 0xffe4),
    ("controlr", 0xffe4),
    ("alt", ALT),
    ("lalt", ALT),
    ("altl", ALT),
    ("option", ALT),
    ("ralt", 0xffea),
    ("altr", 0xffea),
    ("cmd", SUPER),
    ("command", SUPER),
    ("super", SUPER),
    ("superl", SUPER),
    ("win", SUPER),
    ("windows", SUPER),
    ("meta", SUPER),
    ("minus", 0x2d),
    ("plus", 0x2b),
    ("equal", 0x3d),
    ("comma", 0x2c),
    ("period", 0x2e),
    ("slash", 0x2f),
    ("backslash", 0x5c),
    ("semicolon", 0x3b),
    ("apostrophe", 0x27),
    ("quote", 0x27),
    ("grave", 0x60),
    ("bracketleft", 0x5b),
    ("bracketright", 0x5d),
];

/// The keysym of a character typed as text.
pub fn char_keysym(c: char) -> Keysym {
    match c {
        '\n' | '\r' => 0xff0d,
        '\t' => 0xff09,
        '\u{8}' => 0xff08,
        '\u{1b}' => 0xff1b,
        ' '..='~' | '\u{a0}'..='\u{ff}' => c as Keysym,
        // X's rule for the rest of Unicode.
        _ => 0x0100_0000 | c as Keysym,
    }
}

/// The keysym of a key name; `None` if it names no key.
pub fn named(name: &str) -> Option<Keysym> {
    let mut chars = name.chars();
    if let (Some(c), None) = (chars.next(), chars.next()) {
        return Some(char_keysym(c));
    }
    let key: String = name
        .chars()
        .filter(|c| !matches!(c, '_' | '-' | ' '))
        .flat_map(char::to_lowercase)
        .collect();
    if let Some(&(_, sym)) = NAMED.iter().find(|(n, _)| *n == key) {
        return Some(sym);
    }
    let number = key.strip_prefix('f')?.parse::<u32>().ok()?;
    (1..=35).contains(&number).then(|| 0xffbe + number - 1)
}

/// The keysym of a modifier name (`ctrl`, `alt`, `shift`, `cmd` and their
/// spellings); `None` if it is not a modifier.
pub fn modifier(name: &str) -> Option<Keysym> {
    named(name).filter(|sym| (0xffe1..=0xffee).contains(sym))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_in_every_common_spelling() {
        assert_eq!(named("Return"), Some(0xff0d));
        assert_eq!(named("enter"), Some(0xff0d));
        assert_eq!(named("Page_Up"), Some(0xff55));
        assert_eq!(named("page-down"), Some(0xff56));
        assert_eq!(named("F5"), Some(0xffc2));
        assert_eq!(named("f12"), Some(0xffc9));
        assert_eq!(named("a"), Some(0x61));
        assert_eq!(named("A"), Some(0x41));
        assert_eq!(named("é"), Some(0xe9));
        assert_eq!(named("€"), Some(0x0100_20ac));
        assert_eq!(named("CTRL"), Some(0xffe3));
        assert_eq!(named("nonsense"), None);
        assert_eq!(named("f0"), None);
        assert_eq!(named(""), None);
    }

    #[test]
    fn only_modifiers_are_modifiers() {
        assert_eq!(modifier("ctrl"), Some(0xffe3));
        assert_eq!(modifier("cmd"), Some(0xffeb));
        assert_eq!(modifier("Shift"), Some(SHIFT));
        assert_eq!(modifier("a"), None);
        assert_eq!(modifier("enter"), None);
    }

    #[test]
    fn text_characters() {
        assert_eq!(char_keysym('\n'), 0xff0d);
        assert_eq!(char_keysym('h'), 0x68);
        assert_eq!(char_keysym('Z'), 0x5a);
        assert_eq!(char_keysym('ж'), 0x0100_0436);
    }
}
