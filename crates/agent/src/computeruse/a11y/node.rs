//! What an accessible object is on the wire: its id (which finds it again),
//! and the node the SDK sees (`ComputerUseAccessibilityNode`), built from
//! what the application answered, clipped, since the application is the
//! sandbox's code and may answer anything.

use serde::Serialize;
use zbus::names::BusName;
use zbus::zvariant::ObjectPath;

use super::A11yError;

/// The longest id a request may name: a bus name is at most 255 bytes, and
/// no accessible needs an object path longer than a few hundred.
const MAX_ID_LEN: usize = 2048;

/// One accessible object: the bus connection that serves it and its path
/// there. On the wire `<bus name>:<object path>`, as Daytona's daemon writes
/// it: an object path starts with `/` and a bus name holds none, so the `:`
/// before the first `/` separates them, whether the name is unique (`:1.42`)
/// or well known (`org.a11y.atspi.Registry`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct NodeId {
    bus_name: BusName<'static>,
    path: ObjectPath<'static>,
}

impl NodeId {
    /// A reference an application gave (`GetChildren`), checked as D-Bus
    /// checks names; `None` for one that is not a bus name and path.
    pub(crate) fn new(bus_name: &str, path: &str) -> Option<Self> {
        Some(Self {
            bus_name: BusName::try_from(bus_name).ok()?.into_owned(),
            path: ObjectPath::try_from(path).ok()?.into_owned(),
        })
    }

    /// Reads an id a client sent back; 400 naming what is wrong with it.
    pub(crate) fn parse(id: &str) -> Result<Self, A11yError> {
        let invalid = |why: &str| A11yError::InvalidId {
            id: clip(id, 128),
            why: why.to_owned(),
        };
        if id.len() > MAX_ID_LEN {
            return Err(invalid("longer than 2048 bytes"));
        }
        let slash = id.find('/').ok_or_else(|| invalid("no object path"))?;
        let bus_name = id[..slash]
            .strip_suffix(':')
            .ok_or_else(|| invalid("no ':' before the object path"))?;
        if bus_name.is_empty() {
            return Err(invalid("no bus name"));
        }
        let bus_name = BusName::try_from(bus_name).map_err(|_| invalid("not a bus name"))?;
        let path = ObjectPath::try_from(&id[slash..]).map_err(|_| invalid("not an object path"))?;
        Ok(Self {
            bus_name: bus_name.into_owned(),
            path: path.into_owned(),
        })
    }

    pub(crate) fn bus_name(&self) -> &BusName<'static> {
        &self.bus_name
    }

    pub(crate) fn path(&self) -> &ObjectPath<'static> {
        &self.path
    }
}

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.bus_name, self.path)
    }
}

/// `AccessibilityBounds`: the node's extents in screen coordinates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Bounds {
    pub(crate) x: i32,
    pub(crate) y: i32,
    pub(crate) width: i32,
    pub(crate) height: i32,
}

/// `ComputerUseAccessibilityNode`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Node {
    pub(crate) id: String,
    pub(crate) role: String,
    pub(crate) name: String,
    pub(crate) description: String,
    pub(crate) states: Vec<&'static str>,
    pub(crate) actions: Vec<String>,
    pub(crate) bounds: Bounds,
    /// `None` when the children were not looked at (below `maxDepth`, or a
    /// find's flat list); `Some` (maybe empty) when they were.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) children: Option<Vec<Node>>,
}

impl Node {
    /// Roughly what the node costs once written as JSON, so a walk can
    /// stop before its answer grows past its budget.
    pub(crate) fn weight(&self) -> usize {
        const FIXED: usize = 160;
        FIXED
            + self.id.len()
            + self.role.len()
            + self.name.len()
            + self.description.len()
            + self.states.iter().map(|s| s.len() + 3).sum::<usize>()
            + self.actions.iter().map(|a| a.len() + 3).sum::<usize>()
    }
}

/// AT-SPI's `StateType`, by bit number in `GetState`'s two words
/// (at-spi2-core `xml/Registry.xml`); the names are the enum's, lower case
/// with underscores, as Daytona's daemon writes them. Bits beyond the list
/// are not named.
const STATE_NAMES: [&str; 44] = [
    "invalid",
    "active",
    "armed",
    "busy",
    "checked",
    "collapsed",
    "defunct",
    "editable",
    "enabled",
    "expandable",
    "expanded",
    "focusable",
    "focused",
    "has_tooltip",
    "horizontal",
    "iconified",
    "modal",
    "multi_line",
    "multiselectable",
    "opaque",
    "pressed",
    "resizable",
    "selectable",
    "selected",
    "sensitive",
    "showing",
    "single_line",
    "stale",
    "transient",
    "vertical",
    "visible",
    "manages_descendants",
    "indeterminate",
    "required",
    "truncated",
    "animated",
    "invalid_entry",
    "supports_autocompletion",
    "selectable_text",
    "is_default",
    "visited",
    "checkable",
    "has_popup",
    "read_only",
];

/// The bit of the `active` state: the window the user is in.
pub(crate) const STATE_ACTIVE: usize = 1;

/// The names of the states set in `words` (`GetState`'s `au`); only the
/// first two words mean anything.
pub(crate) fn state_names(words: &[u32]) -> Vec<&'static str> {
    STATE_NAMES
        .iter()
        .enumerate()
        .filter(|(bit, _)| has_state(words, *bit))
        .map(|(_, name)| *name)
        .collect()
}

pub(crate) fn has_state(words: &[u32], bit: usize) -> bool {
    words
        .get(bit / 32)
        .is_some_and(|word| word & (1 << (bit % 32)) != 0)
}

/// `text` cut to at most `max` bytes, at a character boundary.
pub(crate) fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_for_unique_and_well_known_names() {
        for text in [
            ":1.42:/org/a11y/atspi/accessible/7",
            "org.a11y.atspi.Registry:/org/a11y/atspi/accessible/root",
            ":1.0:/",
        ] {
            let id = NodeId::parse(text).unwrap();
            assert_eq!(id.to_string(), text);
        }
        let id = NodeId::parse(":1.42:/a/b").unwrap();
        assert_eq!(id.bus_name().as_str(), ":1.42");
        assert_eq!(id.path().as_str(), "/a/b");
        assert_eq!(NodeId::new(":1.42", "/a/b"), Some(id));
    }

    #[test]
    fn malformed_ids_are_refused_with_the_reason() {
        for (text, why) in [
            ("", "no object path"),
            ("org.foo", "no object path"),
            ("org.foo/a", "no ':' before"),
            (":/a", "no bus name"),
            ("not a name:/a", "not a bus name"),
            (":1.2:/a//b", "not an object path"),
            (":1.2:/a/", "not an object path"),
            (":1.2:/a-b", "not an object path"),
        ] {
            let error = NodeId::parse(text).unwrap_err();
            assert!(matches!(error, A11yError::InvalidId { .. }), "{text}");
            assert!(error.to_string().contains(why), "{text}: {error}");
        }
        let long = format!(":1.2:/{}", "a".repeat(MAX_ID_LEN));
        assert!(NodeId::parse(&long).is_err());
        assert_eq!(NodeId::new("", "/a"), None);
        assert_eq!(NodeId::new(":1.2", "a"), None);
    }

    #[test]
    fn states_are_named_by_bit_and_unknown_bits_ignored() {
        // active (1), enabled (8), focusable (11), showing (25), visible (30);
        // word 1: is_default (39), and bit 63, which has no name.
        let words = [
            (1 << 1) | (1 << 8) | (1 << 11) | (1 << 25) | (1 << 30),
            (1 << 7) | (1 << 31),
        ];
        assert_eq!(
            state_names(&words),
            [
                "active",
                "enabled",
                "focusable",
                "showing",
                "visible",
                "is_default"
            ]
        );
        assert!(has_state(&words, STATE_ACTIVE));
        assert!(!has_state(&words[..0], STATE_ACTIVE));
        assert!(state_names(&[]).is_empty());
    }

    #[test]
    fn text_is_clipped_at_a_character_boundary() {
        assert_eq!(clip("hello", 10), "hello");
        assert_eq!(clip("hello", 3), "hel");
        assert_eq!(clip("héllo", 2), "h");
    }
}
