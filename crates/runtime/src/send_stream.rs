//! Checks a `btrfs send` stream before `btrfs receive` runs it as root.
//!
//! A stream is a list of commands the receiver carries out under its
//! destination (`receive --chroot` confines its paths there), but two of them
//! reach past it: `SNAPSHOT` starts the new subvolume from one already on the
//! receiver's filesystem, and `CLONE` copies extents from any subvolume the
//! receiver finds by UUID, which it opens from the mount's root, outside the
//! chroot. A stream made by another machine (a runner's capture) could read
//! another sandbox's files that way. So a captured layer's stream must be one
//! whole subvolume (one `SUBVOL` first, one `END` last, nothing after), in
//! protocol version 1, whose clones come only from that subvolume itself
//! (what `btrfs send` makes of reflinked files inside it), whose paths are
//! relative and never go up, and whose only device nodes are overlayfs
//! whiteouts (character device 0:0). Everything else a sandbox can write
//! (names, modes, owners, extended attributes, symbolic links) passes as it is.

use std::io::{self, Read};
use std::path::Path;

const MAGIC: &[u8; 13] = b"btrfs-stream\0";

/// The largest command taken: a version 1 sender fills 64 KiB buffers.
const COMMAND_LIMIT: usize = 1 << 20;

// Commands (`enum btrfs_send_cmd`), version 1.
const C_SUBVOL: u16 = 1;
const C_SNAPSHOT: u16 = 2;
const C_MKNOD: u16 = 5;
const C_LINK: u16 = 10;
const C_CLONE: u16 = 16;
const C_END: u16 = 21;
/// The last command of version 1 (`UPDATE_EXTENT`).
const C_LAST_V1: u16 = 22;

// Attributes (`BTRFS_SEND_A_*`).
const A_UUID: u16 = 1;
const A_MODE: u16 = 5;
const A_RDEV: u16 = 8;
const A_PATH: u16 = 15;
const A_PATH_TO: u16 = 16;
const A_PATH_LINK: u16 = 17;
const A_CLONE_UUID: u16 = 20;
const A_CLONE_PATH: u16 = 22;
/// The last attribute of version 1 (`CLONE_LEN`).
const A_LAST_V1: u16 = 24;

const S_IFMT: u64 = 0o170000;
const S_IFCHR: u64 = 0o020000;

/// Why a stream was refused, or the file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("the btrfs send stream is refused: {0}")]
    Refused(String),
    #[error("reading the btrfs send stream: {0}")]
    Io(#[from] io::Error),
}

/// Checks the stream in the file at `path` (see the module's words).
pub fn check_file(path: &Path) -> Result<(), StreamError> {
    let file = std::fs::File::open(path)?;
    check(io::BufReader::with_capacity(256 << 10, file))
}

/// Checks the stream `input` (see the module's words).
pub fn check(mut input: impl Read) -> Result<(), StreamError> {
    let refuse = |why: String| Err(StreamError::Refused(why));
    let mut header = [0u8; 17];
    let whole = match read_whole(&mut input, &mut header) {
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => false,
        read => read?,
    };
    if !whole || &header[..13] != MAGIC {
        return refuse("it does not start as a btrfs send stream".into());
    }
    let version = u32::from_le_bytes(header[13..17].try_into().expect("4 bytes"));
    if version != 1 {
        return refuse(format!(
            "it is of protocol version {version}; only 1 is taken"
        ));
    }
    let mut subvolume: Option<Vec<u8>> = None;
    let mut ended = false;
    let mut payload = Vec::new();
    let mut number = 0u64;
    loop {
        let mut head = [0u8; 10];
        if !read_whole(&mut input, &mut head).map_err(cut_short(number + 1))? {
            break;
        }
        number += 1;
        if ended {
            return refuse("it goes on after its end".into());
        }
        let length = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
        let command = u16::from_le_bytes(head[4..6].try_into().expect("2 bytes"));
        if length > COMMAND_LIMIT {
            return refuse(format!("command {number} is {length} bytes long"));
        }
        payload.resize(length, 0);
        read_whole(&mut input, &mut payload).map_err(cut_short(number))?;
        let attributes = attributes(&payload)
            .map_err(|why| StreamError::Refused(format!("command {number}: {why}")))?;
        let last = |kind: u16| {
            (attributes.iter().rev())
                .find(|(t, _)| *t == kind)
                .map(|(_, value)| *value)
        };
        for (kind, value) in &attributes {
            let is_path = matches!(*kind, A_PATH | A_PATH_TO | A_CLONE_PATH)
                || (*kind == A_PATH_LINK && command == C_LINK);
            if is_path && !plain_path(value) {
                return refuse(format!(
                    "command {number} names {:?}, which is absolute or goes up",
                    String::from_utf8_lossy(value)
                ));
            }
        }
        match (command, &subvolume) {
            (C_SUBVOL, None) => {
                let uuid = last(A_UUID).filter(|uuid| uuid.len() == 16);
                let Some(uuid) = uuid else {
                    return refuse("its subvolume has no UUID".into());
                };
                subvolume = Some(uuid.to_vec());
            }
            (C_SUBVOL, Some(_)) => return refuse("it holds more than one subvolume".into()),
            (C_SNAPSHOT, _) => {
                return refuse("it builds on a subvolume of the receiver's (incremental)".into())
            }
            (_, None) => return refuse("it does not start with its subvolume".into()),
            (C_CLONE, Some(own)) => {
                let clones_itself = (attributes.iter())
                    .filter(|(t, _)| *t == A_CLONE_UUID)
                    .all(|(_, uuid)| uuid == own)
                    && last(A_CLONE_UUID).is_some();
                if !clones_itself {
                    return refuse(format!(
                        "command {number} clones from another subvolume than its own"
                    ));
                }
            }
            (C_MKNOD, Some(_)) => {
                let mode = last(A_MODE).and_then(number_of);
                let rdev = last(A_RDEV).and_then(number_of);
                let whiteout = mode.is_some_and(|mode| mode & S_IFMT == S_IFCHR) && rdev == Some(0);
                if !whiteout {
                    return refuse(format!(
                        "command {number} makes a device node (only overlayfs whiteouts are taken)"
                    ));
                }
            }
            (C_END, Some(_)) => ended = true,
            (unknown, Some(_)) if unknown == 0 || unknown > C_LAST_V1 => {
                return refuse(format!(
                    "command {number} is unknown to version 1 ({command})"
                ))
            }
            _ => {}
        }
    }
    match (subvolume, ended) {
        (None, _) => refuse("it holds no subvolume".into()),
        (Some(_), false) => refuse("it ends before its end command".into()),
        (Some(_), true) => Ok(()),
    }
}

/// Fills `buf` from `input`: `false` if it ended before the first byte,
/// `UnexpectedEof` if it ended after it.
fn read_whole(input: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < buf.len() {
        match input.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(true)
}

/// A read that ended mid-command is the stream's fault, said so.
fn cut_short(number: u64) -> impl Fn(io::Error) -> StreamError {
    move |error| match error.kind() {
        io::ErrorKind::UnexpectedEof => {
            StreamError::Refused(format!("it is cut short in command {number}"))
        }
        _ => StreamError::Io(error),
    }
}

/// The attributes of a command's payload, in order.
fn attributes(payload: &[u8]) -> Result<Vec<(u16, &[u8])>, String> {
    let mut found = Vec::new();
    let mut rest = payload;
    while !rest.is_empty() {
        if rest.len() < 4 {
            return Err("an attribute is cut short".into());
        }
        let kind = u16::from_le_bytes([rest[0], rest[1]]);
        let length = u16::from_le_bytes([rest[2], rest[3]]) as usize;
        if kind == 0 || kind > A_LAST_V1 {
            return Err(format!("attribute {kind} is unknown to version 1"));
        }
        let Some(value) = rest.get(4..4 + length) else {
            return Err("an attribute is longer than its command".into());
        };
        found.push((kind, value));
        rest = &rest[4 + length..];
    }
    Ok(found)
}

/// Whether a path a command names stays under the subvolume: relative,
/// no `..`, no NUL.
fn plain_path(path: &[u8]) -> bool {
    !path.starts_with(b"/")
        && !path.contains(&0)
        && path.split(|b| *b == b'/').all(|part| part != b"..")
}

/// A number attribute (little-endian, 1 to 8 bytes).
fn number_of(value: &[u8]) -> Option<u64> {
    (1..=8).contains(&value.len()).then(|| {
        let mut bytes = [0u8; 8];
        bytes[..value.len()].copy_from_slice(value);
        u64::from_le_bytes(bytes)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: [u8; 16] = [7; 16];

    fn attribute(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut out = kind.to_le_bytes().to_vec();
        out.extend((value.len() as u16).to_le_bytes());
        out.extend(value);
        out
    }

    fn command(kind: u16, attributes: &[Vec<u8>]) -> Vec<u8> {
        let payload: Vec<u8> = attributes.concat();
        let mut out = (payload.len() as u32).to_le_bytes().to_vec();
        out.extend(kind.to_le_bytes());
        out.extend([0u8; 4]); // the receiver checks the CRC; this does not
        out.extend(payload);
        out
    }

    fn stream(commands: &[Vec<u8>]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend(1u32.to_le_bytes());
        out.extend(commands.concat());
        out
    }

    fn subvol() -> Vec<u8> {
        command(
            C_SUBVOL,
            &[attribute(A_PATH, b"capture"), attribute(A_UUID, &OWN)],
        )
    }

    fn end() -> Vec<u8> {
        command(C_END, &[])
    }

    fn mkfile(path: &[u8]) -> Vec<u8> {
        command(3, &[attribute(A_PATH, path)])
    }

    fn refusal(bytes: Vec<u8>) -> String {
        match check(bytes.as_slice()) {
            Err(StreamError::Refused(why)) => why,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_whole_subvolume_of_files_links_and_whiteouts_is_taken() {
        let whiteout = command(
            C_MKNOD,
            &[
                attribute(A_PATH, b"etc/gone"),
                attribute(A_MODE, &(S_IFCHR | 0o644).to_le_bytes()),
                attribute(A_RDEV, &0u64.to_le_bytes()),
            ],
        );
        let symlink = command(
            8,
            &[
                attribute(A_PATH, b"up"),
                attribute(A_PATH_LINK, b"/etc/../.."),
            ],
        );
        let clone = command(
            C_CLONE,
            &[
                attribute(A_PATH, b"b"),
                attribute(A_CLONE_UUID, &OWN),
                attribute(A_CLONE_PATH, b"a"),
            ],
        );
        let bytes = stream(&[subvol(), mkfile(b"a"), whiteout, symlink, clone, end()]);
        check(bytes.as_slice()).unwrap();
    }

    #[test]
    fn a_clone_from_another_subvolume_is_refused() {
        let clone = command(
            C_CLONE,
            &[
                attribute(A_PATH, b"b"),
                attribute(A_CLONE_UUID, &[9; 16]),
                attribute(A_CLONE_PATH, b"secret"),
            ],
        );
        let why = refusal(stream(&[subvol(), mkfile(b"b"), clone, end()]));
        assert!(why.contains("clones from another subvolume"), "{why}");
        // Naming its own UUID once and another's last is still another's.
        let clone = command(
            C_CLONE,
            &[
                attribute(A_PATH, b"b"),
                attribute(A_CLONE_UUID, &OWN),
                attribute(A_CLONE_UUID, &[9; 16]),
            ],
        );
        let why = refusal(stream(&[subvol(), clone, end()]));
        assert!(why.contains("clones from another subvolume"), "{why}");
    }

    #[test]
    fn an_incremental_stream_is_refused() {
        let snapshot = command(
            C_SNAPSHOT,
            &[attribute(A_PATH, b"capture"), attribute(A_UUID, &OWN)],
        );
        let why = refusal(stream(&[snapshot, end()]));
        assert!(why.contains("incremental"), "{why}");
    }

    #[test]
    fn paths_that_are_absolute_or_go_up_are_refused() {
        for path in [&b"/etc/passwd"[..], b"../x", b"a/../../x", b"a/.."] {
            let why = refusal(stream(&[subvol(), mkfile(path), end()]));
            assert!(why.contains("absolute or goes up"), "{why}");
        }
        // A hard link's source is a path too; a symbolic link's target is not.
        let link = command(
            C_LINK,
            &[attribute(A_PATH, b"x"), attribute(A_PATH_LINK, b"../y")],
        );
        let why = refusal(stream(&[subvol(), link, end()]));
        assert!(why.contains("absolute or goes up"), "{why}");
    }

    #[test]
    fn a_device_node_is_refused() {
        let device = command(
            C_MKNOD,
            &[
                attribute(A_PATH, b"sda"),
                attribute(A_MODE, &(0o060000u64 | 0o600).to_le_bytes()),
                attribute(A_RDEV, &(8u64 << 8).to_le_bytes()),
            ],
        );
        let why = refusal(stream(&[subvol(), device, end()]));
        assert!(why.contains("device node"), "{why}");
        let character = command(
            C_MKNOD,
            &[
                attribute(A_PATH, b"mem"),
                attribute(A_MODE, &(S_IFCHR | 0o600).to_le_bytes()),
                attribute(A_RDEV, &((1u64 << 8) | 1).to_le_bytes()),
            ],
        );
        let why = refusal(stream(&[subvol(), character, end()]));
        assert!(why.contains("device node"), "{why}");
    }

    #[test]
    fn streams_not_of_one_whole_subvolume_are_refused() {
        let cases = [
            (
                stream(&[mkfile(b"a"), end()]),
                "does not start with its subvolume",
            ),
            (
                stream(&[subvol(), subvol(), end()]),
                "more than one subvolume",
            ),
            (
                stream(&[subvol(), mkfile(b"a")]),
                "ends before its end command",
            ),
            (
                stream(&[subvol(), end(), mkfile(b"a")]),
                "goes on after its end",
            ),
            (stream(&[]), "holds no subvolume"),
            (
                b"not a stream at all".to_vec(),
                "does not start as a btrfs send stream",
            ),
            (
                stream(&[subvol(), command(25, &[]), end()]),
                "unknown to version 1",
            ),
            (
                stream(&[subvol(), command(3, &[attribute(40, b"x")]), end()]),
                "unknown to version 1",
            ),
        ];
        for (bytes, expected) in cases {
            let why = refusal(bytes);
            assert!(why.contains(expected), "{why} (expected {expected})");
        }
        let mut version_two = stream(&[subvol(), end()]);
        version_two[13] = 2;
        assert!(refusal(version_two).contains("protocol version 2"));
        let mut cut = stream(&[subvol(), mkfile(b"a"), end()]);
        cut.truncate(cut.len() - 14);
        assert!(refusal(cut).contains("cut short"));
    }
}
