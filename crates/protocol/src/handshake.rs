//! The handshake that starts every session on a VM's agent channel (the
//! virtio-serial port), both halves' pure parts: the lines, the parsers and
//! the constants. The I/O is the runtime's `vm::bridge` (host) and the
//! agent's `vm::session` (guest), which explain why it looks like this.
//!
//! 1. The host sends [`FILLER_BYTES`] bytes of 0xff, then
//!    `COVE-HOST-HELLO <nonce> t=<unix ns>\n` ([`host_hello`]), and repeats
//!    the hello line (with a fresh time) until it is answered.
//! 2. The guest reads past anything before a hello ([`find_hello`]),
//!    answers `COVE-GUEST-HELLO <nonce>\n` ([`guest_answer`]) once, and
//!    drops the repeats that follow ([`classify`]).
//! 3. The host reads past anything before the answer ([`after_answer`]);
//!    yamux runs from there, the host as client, frames to the guest split
//!    at [`SPLIT_SEND_SIZE`].

/// What a host's hello line starts with.
pub const HOST_HELLO: &[u8] = b"COVE-HOST-HELLO ";
/// What the guest's answer starts with.
pub const GUEST_HELLO: &[u8] = b"COVE-GUEST-HELLO ";
/// Largest data frame the host sends (yamux's default, set explicitly
/// because the filler's length depends on it).
pub const SPLIT_SEND_SIZE: usize = 16 << 10;
/// Longer than a frame header and the largest frame body together: a stale
/// yamux session in a restored guest reads it as no valid frame and fails.
pub const FILLER_BYTES: usize = SPLIT_SEND_SIZE + 4096;
/// The byte the filler is made of (yamux version 0 is valid, 0xff is not).
pub const FILLER: u8 = 0xff;
/// Longest hello line accepted after its prefix; the host sends 32 hex
/// digits of nonce and a time.
pub const MAX_HELLO_REST: usize = 96;
/// What a reader looking for a hello keeps of what it has seen: anything
/// older cannot be part of one.
pub const HELLO_WINDOW: usize = HOST_HELLO.len() + MAX_HELLO_REST + 1;

/// A host's hello line, with the host's clock for a restored guest (whose
/// clock stopped when its memory was saved).
pub fn host_hello(nonce: &str, unix_ns: u128) -> String {
    format!("{}{nonce} t={unix_ns}\n", text(HOST_HELLO))
}

/// The guest's answer to the hello carrying `nonce`.
pub fn guest_answer(nonce: &str) -> String {
    format!("{}{nonce}\n", text(GUEST_HELLO))
}

/// The start every repeat of the hello carrying `nonce` shares (the time
/// after it differs).
pub fn repeat_line(nonce: &str) -> Vec<u8> {
    [HOST_HELLO, nonce.as_bytes()].concat()
}

fn text(prefix: &'static [u8]) -> &'static str {
    std::str::from_utf8(prefix).expect("the prefixes are ASCII")
}

/// One hello of the host: `COVE-HOST-HELLO <nonce> t=<unix ns>\n`.
#[derive(Debug, PartialEq, Eq)]
pub struct Hello<'a> {
    pub nonce: &'a str,
    /// The host's clock when it sent the hello.
    pub unix_ns: Option<u64>,
}

/// Parses what follows the prefix of a hello line (without the newline).
pub fn parse_hello(rest: &[u8]) -> Option<Hello<'_>> {
    let text = std::str::from_utf8(rest).ok()?;
    let mut words = text.split(' ');
    let nonce = words.next()?;
    if nonce.is_empty() || !nonce.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return None;
    }
    let mut unix_ns = None;
    for word in words {
        match word.strip_prefix("t=") {
            Some(time) => unix_ns = Some(time.parse().ok()?),
            None => return None,
        }
    }
    Some(Hello { nonce, unix_ns })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Where a hello line ends in `buf`: the hello and the index just past its
/// newline. Bytes before the hello are stale and skipped; a bad or
/// oversized hello does not hide a good one after it.
pub fn find_hello(buf: &[u8]) -> Option<(Hello<'_>, usize)> {
    let mut from = 0;
    while let Some(found) = find(&buf[from..], HOST_HELLO) {
        let start = from + found + HOST_HELLO.len();
        let rest = &buf[start..];
        let window = &rest[..rest.len().min(MAX_HELLO_REST + 1)];
        match window.iter().position(|b| *b == b'\n') {
            // Unfinished: wait for more.
            None if rest.len() <= MAX_HELLO_REST => return None,
            Some(end) => {
                if let Some(hello) = parse_hello(&rest[..end]) {
                    return Some((hello, start + end + 1));
                }
            }
            None => {}
        }
        from = start;
    }
    None
}

/// What the start of a guest's pending input is, with respect to a
/// repeated hello that starts with [`repeat_line`].
#[derive(Debug, PartialEq, Eq)]
pub enum Repeat {
    /// A whole repeat this many bytes long: drop it.
    Whole(usize),
    /// Could still become one: read more.
    Partial,
    /// Something else: repeats are over.
    No,
}

/// Classifies the start of `pending` against the repeat `line`.
pub fn classify(pending: &[u8], line: &[u8]) -> Repeat {
    if pending.len() <= line.len() {
        return if line.starts_with(pending) {
            Repeat::Partial
        } else {
            Repeat::No
        };
    }
    if !pending.starts_with(line) || !matches!(pending[line.len()], b' ' | b'\n') {
        return Repeat::No;
    }
    let rest = &pending[line.len()..];
    let window = &rest[..rest.len().min(MAX_HELLO_REST + 1)];
    match window.iter().position(|b| *b == b'\n') {
        Some(end) => Repeat::Whole(line.len() + end + 1),
        None if rest.len() <= MAX_HELLO_REST => Repeat::Partial,
        None => Repeat::No,
    }
}

/// The host's side: what follows `wanted` (the guest's answer) in `seen`,
/// once it is there; otherwise trims `seen` to what could still be the
/// start of it, so stale bytes never pile up.
pub fn after_answer(seen: &mut Vec<u8>, wanted: &[u8]) -> Option<Vec<u8>> {
    if let Some(at) = find(seen, wanted) {
        return Some(seen[at + wanted.len()..].to_vec());
    }
    if seen.len() > wanted.len() {
        seen.drain(..seen.len() - wanted.len());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lines_are_what_the_other_side_parses() {
        let hello = host_hello("abc123", 7);
        assert_eq!(hello, "COVE-HOST-HELLO abc123 t=7\n");
        let (parsed, end) = find_hello(hello.as_bytes()).unwrap();
        assert_eq!(
            parsed,
            Hello {
                nonce: "abc123",
                unix_ns: Some(7)
            }
        );
        assert_eq!(end, hello.len());
        assert_eq!(guest_answer("abc123"), "COVE-GUEST-HELLO abc123\n");
        let line = repeat_line("abc123");
        assert_eq!(
            classify(hello.as_bytes(), &line),
            Repeat::Whole(hello.len())
        );
    }

    #[test]
    fn a_hello_is_found_after_stale_bytes() {
        let buf = b"\x00\x02garbageCOVE-HOST-HELLO abc123 t=1700000000000000000\nyamux";
        let (hello, end) = find_hello(buf).unwrap();
        assert_eq!(hello.nonce, "abc123");
        assert_eq!(hello.unix_ns, Some(1_700_000_000_000_000_000));
        assert_eq!(&buf[end..], b"yamux");
        let (hello, _) = find_hello(b"COVE-HOST-HELLO n0\n").unwrap();
        assert_eq!((hello.nonce, hello.unix_ns), ("n0", None));
    }

    #[test]
    fn an_unfinished_malformed_or_oversized_hello_is_not_taken() {
        assert!(find_hello(b"COVE-HOST-HELLO abc").is_none());
        assert!(find_hello(b"COVE-HOST-HELLO a b\n").is_none());
        assert!(find_hello(b"COVE-HOST-HELLO a t=x\n").is_none());
        assert!(find_hello(b"COVE-HOST-HELLO a t=99999999999999999999999\n").is_none());
        assert!(find_hello(b"COVE-HOST-HELLO \n").is_none());
        assert!(find_hello(b"COVE-HOST-HELLO a\xff\n").is_none());
        assert!(find_hello(b"COVE-HOST-HELLO a-b\n").is_none());
        let long = format!("COVE-HOST-HELLO {}\n", "a".repeat(MAX_HELLO_REST + 1));
        assert!(find_hello(long.as_bytes()).is_none());
        // Oversized with no newline at all: given up on, not waited for.
        let endless = format!("COVE-HOST-HELLO {}", "a".repeat(10 * MAX_HELLO_REST));
        assert!(find_hello(endless.as_bytes()).is_none());
        // A bad hello does not hide a good one after it.
        let (hello, _) = find_hello(b"COVE-HOST-HELLO a b\nCOVE-HOST-HELLO ok\n").unwrap();
        assert_eq!(hello.nonce, "ok");
        let after_long = format!("{long}COVE-HOST-HELLO ok t=1\n");
        assert_eq!(find_hello(after_long.as_bytes()).unwrap().0.nonce, "ok");
    }

    #[test]
    fn repeats_are_told_from_what_follows() {
        let line = b"COVE-HOST-HELLO n";
        assert_eq!(
            classify(b"COVE-HOST-HELLO n t=5\n\x00\x00", line),
            Repeat::Whole(22)
        );
        assert_eq!(classify(b"COVE-HOST-HELLO n\n", line), Repeat::Whole(18));
        assert_eq!(classify(b"COVE-HOST-HELLO n t=", line), Repeat::Partial);
        assert_eq!(classify(b"COVE-HO", line), Repeat::Partial);
        assert_eq!(classify(b"", line), Repeat::Partial);
        assert_eq!(classify(b"\x00\x01\x00", line), Repeat::No);
        assert_eq!(classify(b"COVE-HOST-HELLO m t=1\n", line), Repeat::No);
        assert_eq!(classify(b"COVE-HOST-HELLO nn\n", line), Repeat::No);
        let endless = [line.as_slice(), b" ", &[b'x'; MAX_HELLO_REST + 1]].concat();
        assert_eq!(classify(&endless, line), Repeat::No);
    }

    #[test]
    fn the_answer_is_found_after_stale_bytes() {
        let wanted = guest_answer("abc");
        let wanted = wanted.as_bytes();
        let mut seen = b"old yamux bytesCOVE-GUEST-HELLO wrong\nCOVE-GUEST-HE".to_vec();
        assert_eq!(after_answer(&mut seen, wanted), None);
        assert!(seen.len() <= wanted.len());
        seen.extend_from_slice(b"LLO abc\nrest");
        let mut seen = [b"xx".as_slice(), &seen].concat();
        assert_eq!(after_answer(&mut seen, wanted).unwrap(), b"rest");
    }

    #[test]
    fn what_is_kept_while_waiting_stays_bounded() {
        let wanted = guest_answer("abc");
        let mut seen = vec![FILLER; 1 << 20];
        assert_eq!(after_answer(&mut seen, wanted.as_bytes()), None);
        assert_eq!(seen.len(), wanted.len());
    }
}
