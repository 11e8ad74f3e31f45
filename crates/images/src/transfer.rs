//! An image's root filesystem sent whole from one machine to another: the
//! control plane writes the rootfs it holds as a tar ([`send_rootfs`]), and a
//! runner that lacks it unpacks that tar into its own images directory
//! ([`receive_rootfs`]).
//!
//! The sender walks a tree this server made (a debootstrap, a flattened
//! image) without following a symbolic link: links go as links, a file
//! linked more than once goes once and then as hard links to its first
//! path, and each entry's extended attributes go in a PAX header
//! (`SCHILY.xattr.NAME`, which the unpacker reads). Sockets are left out;
//! so are devices, which the unpacker would skip anyway (a sandbox gets its
//! own `/dev`).
//!
//! The receiver takes the stream as a layer (`layer.rs`): `..` is refused
//! and nothing is created through a symbolic link. It unpacks into a
//! directory of its own (under an `incoming` directory on the same
//! filesystem, named by its process) and renames it into place only once the
//! whole tar has been read, so a transfer cut short never leaves a partial
//! image where a start would take it for a whole one; what a dead process
//! left there is swept ([`sweep_incoming`]).

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tar::{EntryType, Header, HeaderMode};

use crate::error::{io_err, ImageError, Result};

/// A tar's block: its end is two of zeros.
const TAR_BLOCK: usize = 512;

/// Writes the tree at `rootfs` to `out` as a tar: `./` first, then every
/// entry below it, each directory's entries in name order. On a failure
/// nothing more is written, not even the tar's end: a reader sees a tar
/// cut off, never a whole one that lacks entries.
pub fn send_rootfs(rootfs: &Path, out: impl Write) -> Result<()> {
    let mut builder = tar::Builder::new(Stoppable {
        inner: out,
        stopped: false,
    });
    builder.mode(HeaderMode::Complete);
    builder.follow_symlinks(false);
    let mut sender = Sender {
        root: rootfs,
        builder,
        first_paths: HashMap::new(),
    };
    if let Err(error) = sender.entry(Path::new("")) {
        // The builder ends the tar as it is dropped: not this one.
        sender.builder.get_mut().stopped = true;
        return Err(error);
    }
    sender
        .builder
        .into_inner()
        .and_then(|mut out| out.flush())
        .map_err(io_err(rootfs, "finish the tar of"))
}

/// A writer that refuses every write once `stopped`.
struct Stoppable<W> {
    inner: W,
    stopped: bool,
}

impl<W: Write> Write for Stoppable<W> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        if self.stopped {
            return Err(io::Error::other("the tar was given up"));
        }
        self.inner.write(bytes)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

struct Sender<'a, W: Write> {
    root: &'a Path,
    builder: tar::Builder<W>,
    /// The path each multiply-linked file was first sent under, by (device, inode).
    first_paths: HashMap<(u64, u64), PathBuf>,
}

impl<W: Write> Sender<'_, W> {
    /// Sends `relative` (the root when empty) and, for a directory, what it holds.
    fn entry(&mut self, relative: &Path) -> Result<()> {
        let path = self.root.join(relative);
        let meta = fs::symlink_metadata(&path).map_err(io_err(&path, "read"))?;
        let kind = meta.file_type();
        use std::os::unix::fs::FileTypeExt as _;
        if kind.is_socket() || kind.is_block_device() || kind.is_char_device() {
            return Ok(());
        }
        let name = if relative.as_os_str().is_empty() {
            PathBuf::from("./")
        } else {
            relative.to_owned()
        };
        self.xattrs(&path, &name)?;
        let mut header = Header::new_gnu();
        header.set_metadata_in_mode(&meta, HeaderMode::Complete);
        let written = if kind.is_symlink() {
            let target = fs::read_link(&path).map_err(io_err(&path, "read the link"))?;
            header.set_size(0);
            self.builder.append_link(&mut header, &name, &target)
        } else if kind.is_file() && meta.nlink() > 1 {
            match self.first_paths.get(&(meta.dev(), meta.ino())) {
                Some(first) => {
                    header.set_entry_type(EntryType::Link);
                    header.set_size(0);
                    let first = first.clone();
                    self.builder.append_link(&mut header, &name, &first)
                }
                None => {
                    self.first_paths
                        .insert((meta.dev(), meta.ino()), name.clone());
                    self.file(&mut header, &name, &path)
                }
            }
        } else if kind.is_file() {
            self.file(&mut header, &name, &path)
        } else {
            header.set_size(0);
            self.builder.append_data(&mut header, &name, io::empty())
        };
        written.map_err(io_err(&path, "send"))?;
        if kind.is_dir() {
            let mut names = Vec::new();
            for child in fs::read_dir(&path).map_err(io_err(&path, "list"))? {
                names.push(child.map_err(io_err(&path, "list"))?.file_name());
            }
            names.sort();
            for child in names {
                self.entry(&relative.join(child))?;
            }
        }
        Ok(())
    }

    fn file(&mut self, header: &mut Header, name: &Path, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt as _;
        // Whatever took its place since it was read, no link is followed.
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(path)?;
        // The size the header says is what goes, even if the file changed.
        let size = header.size()?;
        self.builder.append_data(
            header,
            name,
            file.take(size).chain(io::repeat(0)).take(size),
        )
    }

    /// A PAX header with the extended attributes of `path`, when it has any.
    fn xattrs(&mut self, path: &Path, name: &Path) -> Result<()> {
        let mut records = Vec::new();
        let names = match xattr::list(path) {
            Ok(names) => names,
            // A filesystem without extended attributes has none to send.
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOTSUP.raw_os_error()) => {
                return Ok(())
            }
            Err(e) => return Err(io_err(path, "list the extended attributes of")(e)),
        };
        for attr in names {
            let Some(value) =
                xattr::get(path, &attr).map_err(io_err(path, "read an extended attribute of"))?
            else {
                continue;
            };
            pax_record(&mut records, b"SCHILY.xattr.", attr.as_bytes(), &value);
        }
        if records.is_empty() {
            return Ok(());
        }
        let mut header = Header::new_ustar();
        header.set_entry_type(EntryType::XHeader);
        header.set_mode(0o644);
        header.set_size(records.len() as u64);
        // The name is informative only: the header applies to the next entry.
        let mut pax_name = b"PaxHeaders/".to_vec();
        pax_name.extend(name.as_os_str().as_bytes().iter().take(80));
        header
            .set_path(Path::new(std::ffi::OsStr::from_bytes(&pax_name)))
            .or_else(|_| header.set_path("PaxHeaders/entry"))
            .map_err(io_err(path, "name the PAX header of"))?;
        header.set_cksum();
        self.builder
            .append(&header, records.as_slice())
            .map_err(io_err(path, "send the extended attributes of"))
    }
}

/// Appends one PAX record, `LEN KEY=VALUE\n`, where LEN counts the whole
/// record, its own digits included.
fn pax_record(out: &mut Vec<u8>, prefix: &[u8], key: &[u8], value: &[u8]) {
    let rest = 1 + prefix.len() + key.len() + 1 + value.len() + 1;
    let mut length = rest + 1;
    while length != rest + length.to_string().len() {
        length = rest + length.to_string().len();
    }
    out.extend_from_slice(length.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(prefix);
    out.extend_from_slice(key);
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

/// Unpacks a root filesystem's tar read from `reader` to `into`, which must
/// not exist yet: into a directory of its own under `incoming` first (on the
/// same filesystem as `into`), renamed to `into` once the tar ended well. If
/// another transfer put `into` there meanwhile, that one stays and this one
/// is removed. Answers how many bytes of file content the image holds.
pub fn receive_rootfs(reader: impl Read, into: &Path, incoming: &Path) -> Result<u64> {
    let label = into.display().to_string();
    let parent = into
        .parent()
        .ok_or_else(|| ImageError::invalid(&label, "names no directory to unpack into"))?;
    fs::create_dir_all(parent).map_err(io_err(parent, "create"))?;
    fs::create_dir_all(incoming).map_err(io_err(incoming, "create"))?;
    let partial = incoming.join(format!(
        "{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    fs::create_dir(&partial).map_err(io_err(&partial, "create"))?;
    let unpacked = crate::layer::unpack(reader, &partial, &label).and_then(|(meta, mut rest)| {
        // The tar ends with two zero blocks, of which the unpacker read the
        // first: the second must follow, and then the stream's own end. A
        // stream that stops early (empty, or cut between two entries) or
        // breaks (a sender that failed, a connection lost) is refused.
        let mut end = Vec::new();
        rest.read_to_end(&mut end).map_err(|e| {
            ImageError::invalid(&label, format!("the stream broke after the tar: {e}"))
        })?;
        if end.len() < TAR_BLOCK || end.iter().any(|&b| b != 0) {
            return Err(ImageError::invalid(
                &label,
                "the stream stopped before the tar's end",
            ));
        }
        if meta.external_links.is_empty() {
            Ok(meta.file_bytes)
        } else {
            Err(ImageError::invalid(
                &label,
                "the tar holds hard links to files it does not hold",
            ))
        }
    });
    let placed = unpacked.and_then(|bytes| match fs::rename(&partial, into) {
        Ok(()) => Ok(bytes),
        // Another transfer of the same image was first: keep its copy.
        Err(e)
            if into.is_dir()
                && [rustix::io::Errno::EXIST, rustix::io::Errno::NOTEMPTY]
                    .iter()
                    .any(|errno| e.raw_os_error() == Some(errno.raw_os_error())) =>
        {
            let _ = fs::remove_dir_all(&partial);
            Ok(bytes)
        }
        Err(e) => Err(io_err(into, "move into place")(e)),
    });
    if placed.is_err() {
        let _ = fs::remove_dir_all(&partial);
    }
    placed
}

/// Removes what transfers into `incoming` left when their process died
/// mid-way (each is named by its process's pid); those of live processes
/// stay. Answers how many went.
pub fn sweep_incoming(incoming: &Path) -> usize {
    let Ok(entries) = fs::read_dir(incoming) else {
        return 0;
    };
    let mut swept = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name
            .to_str()
            .and_then(|name| name.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<i32>().ok());
        let alive = pid.is_some_and(|pid| {
            rustix::process::Pid::from_raw(pid).is_some_and(|pid| {
                rustix::process::test_kill_process(pid) != Err(rustix::io::Errno::SRCH)
            })
        });
        if !alive && fs::remove_dir_all(entry.path()).is_ok() {
            swept += 1;
        }
    }
    swept
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    fn sample(root: &Path) {
        fs::create_dir_all(root.join("etc/deep/er")).unwrap();
        fs::write(root.join("etc/hostname"), "sample\n").unwrap();
        fs::set_permissions(root.join("etc/hostname"), fs::Permissions::from_mode(0o640)).unwrap();
        fs::write(root.join("etc/deep/er/long"), vec![7u8; 300_000]).unwrap();
        fs::hard_link(root.join("etc/hostname"), root.join("etc/hostname.again")).unwrap();
        symlink("../etc/hostname", root.join("etc/deep/up")).unwrap();
        symlink("/", root.join("escape")).unwrap();
        let long = "n".repeat(150);
        fs::write(root.join(&long), "a long name").unwrap();
        std::os::unix::fs::chown(root.join("etc/hostname"), Some(1234), Some(5678)).unwrap();
        xattr::set(root.join("etc/deep/er/long"), "user.cove", b"kept").unwrap();
    }

    #[test]
    fn a_rootfs_arrives_as_it_was_sent() {
        if !cove_testenv::root("sending a root filesystem with its owners") {
            return;
        }
        let scratch = tempfile::tempdir_in("/var/tmp").unwrap();
        let sent = scratch.path().join("sent");
        fs::create_dir(&sent).unwrap();
        sample(&sent);
        let mut tar = Vec::new();
        send_rootfs(&sent, &mut tar).unwrap();
        let into = scratch.path().join("images/debian/rootfs");
        let incoming = scratch.path().join("images/.incoming");
        let bytes = receive_rootfs(tar.as_slice(), &into, &incoming).unwrap();
        assert_eq!(bytes, 7 + 300_000 + 11);

        let meta = fs::metadata(into.join("etc/hostname")).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o7777),
            (1234, 5678, 0o640)
        );
        let again = fs::metadata(into.join("etc/hostname.again")).unwrap();
        assert_eq!(again.ino(), meta.ino(), "a hard link stays one file");
        assert_eq!(
            fs::read_link(into.join("etc/deep/up")).unwrap(),
            Path::new("../etc/hostname")
        );
        assert_eq!(fs::read_link(into.join("escape")).unwrap(), Path::new("/"));
        assert_eq!(
            fs::read(into.join("etc/deep/er/long")).unwrap(),
            vec![7u8; 300_000]
        );
        assert_eq!(
            xattr::get(into.join("etc/deep/er/long"), "user.cove")
                .unwrap()
                .as_deref(),
            Some(&b"kept"[..])
        );
        assert_eq!(
            fs::read_to_string(into.join("n".repeat(150))).unwrap(),
            "a long name"
        );
        // Nothing is left of the transfer.
        assert_eq!(fs::read_dir(&incoming).unwrap().count(), 0);
    }

    /// Attack: a tar that plants a symbolic link and then writes through it.
    /// Nothing lands outside, and nothing is left where the image would be.
    #[test]
    fn a_tar_that_writes_through_a_link_is_refused_and_leaves_nothing() {
        let scratch = tempfile::tempdir().unwrap();
        let outside = scratch.path().join("outside");
        fs::create_dir(&outside).unwrap();
        let header = |kind: EntryType, size: u64, mode: u32| {
            let mut header = Header::new_gnu();
            header.set_entry_type(kind);
            header.set_size(size);
            header.set_mode(mode);
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            header
        };
        let mut builder = tar::Builder::new(Vec::new());
        let mut link = header(EntryType::Symlink, 0, 0o777);
        builder.append_link(&mut link, "etc", &outside).unwrap();
        let mut file = header(EntryType::Regular, 4, 0o644);
        builder
            .append_data(&mut file, "etc/passwd", &b"evil"[..])
            .unwrap();
        let tar = builder.into_inner().unwrap();
        let into = scratch.path().join("images/x/rootfs");
        let incoming = scratch.path().join("images/.incoming");
        let error = receive_rootfs(tar.as_slice(), &into, &incoming).unwrap_err();
        assert!(error.to_string().contains("symbolic link"), "{error}");
        assert!(!outside.join("passwd").exists());
        assert!(!into.exists());
        assert_eq!(fs::read_dir(&incoming).unwrap().count(), 0);
    }

    /// A transfer cut short leaves nothing where the image would be.
    #[test]
    fn a_tar_cut_short_leaves_nothing() {
        let scratch = tempfile::tempdir().unwrap();
        let sent = scratch.path().join("sent");
        fs::create_dir_all(sent.join("etc")).unwrap();
        fs::write(sent.join("etc/big"), vec![1u8; 100_000]).unwrap();
        let mut tar = Vec::new();
        send_rootfs(&sent, &mut tar).unwrap();
        tar.truncate(tar.len() / 2);
        let into = scratch.path().join("images/y/rootfs");
        let incoming = scratch.path().join("images/.incoming");
        assert!(receive_rootfs(tar.as_slice(), &into, &incoming).is_err());
        assert!(!into.exists());
        assert_eq!(fs::read_dir(&incoming).unwrap().count(), 0);
    }

    /// What a dead process left goes; a live one's transfer stays.
    #[test]
    fn only_the_dead_transfers_are_swept() {
        let scratch = tempfile::tempdir().unwrap();
        let live = scratch.path().join(format!("{}-abc", std::process::id()));
        // Past the kernel's pid_max, so no process has it.
        let dead = scratch.path().join("2147483646-def");
        let unnamed = scratch.path().join("junk");
        for dir in [&live, &dead, &unnamed] {
            fs::create_dir_all(dir.join("etc")).unwrap();
        }
        assert_eq!(sweep_incoming(scratch.path()), 2);
        assert!(live.is_dir() && !dead.exists() && !unnamed.exists());
    }

    /// A sender that fails midway (the tree gone under it) ends no tar:
    /// the receiver takes nothing of it.
    #[test]
    fn a_sender_that_fails_ends_no_tar() {
        let scratch = tempfile::tempdir().unwrap();
        let mut written = Vec::new();
        assert!(send_rootfs(&scratch.path().join("gone"), &mut written).is_err());
        assert!(written.is_empty(), "{} bytes written", written.len());
        let into = scratch.path().join("images/z/rootfs");
        let incoming = scratch.path().join("images/.incoming");
        assert!(receive_rootfs(written.as_slice(), &into, &incoming).is_err());
        assert!(!into.exists());
    }

    /// A stream that stops between two entries, with no tar end, is not taken.
    #[test]
    fn a_tar_cut_between_entries_is_not_taken() {
        let scratch = tempfile::tempdir().unwrap();
        let sent = scratch.path().join("sent");
        fs::create_dir_all(sent.join("etc")).unwrap();
        fs::write(sent.join("etc/a"), b"a").unwrap();
        let mut tar = Vec::new();
        send_rootfs(&sent, &mut tar).unwrap();
        // `./`, `etc/` and the file, each a header block (and the file a
        // block of content), then the two blocks of the end.
        assert_eq!(tar.len(), 6 * TAR_BLOCK);
        let into = scratch.path().join("images/v/rootfs");
        let incoming = scratch.path().join("images/.incoming");
        for cut in [4, 2, 0] {
            let error = receive_rootfs(&tar[..cut * TAR_BLOCK], &into, &incoming).unwrap_err();
            assert!(
                error.to_string().contains("before the tar's end"),
                "{cut}: {error}"
            );
            assert!(!into.exists());
        }
        receive_rootfs(tar.as_slice(), &into, &incoming).unwrap();
        assert_eq!(fs::read(into.join("etc/a")).unwrap(), b"a");
    }

    /// A whole tar whose stream then breaks (the sender's failure, after
    /// the tar's end, or a connection lost) is not taken.
    #[test]
    fn a_tar_whose_stream_breaks_after_its_end_is_not_taken() {
        struct ThenBroken<'a>(&'a [u8]);
        impl Read for ThenBroken<'_> {
            fn read(&mut self, into: &mut [u8]) -> io::Result<usize> {
                if self.0.is_empty() {
                    return Err(io::Error::other("connection reset"));
                }
                let n = self.0.read(into)?;
                Ok(n)
            }
        }
        let scratch = tempfile::tempdir().unwrap();
        let sent = scratch.path().join("sent");
        fs::create_dir_all(sent.join("etc")).unwrap();
        fs::write(sent.join("etc/small"), b"x").unwrap();
        let mut tar = Vec::new();
        send_rootfs(&sent, &mut tar).unwrap();
        let into = scratch.path().join("images/w/rootfs");
        let incoming = scratch.path().join("images/.incoming");
        let error = receive_rootfs(ThenBroken(&tar), &into, &incoming).unwrap_err();
        assert!(error.to_string().contains("connection reset"), "{error}");
        assert!(!into.exists());
        assert_eq!(fs::read_dir(&incoming).unwrap().count(), 0);
        // The same bytes, ended well, are taken.
        receive_rootfs(tar.as_slice(), &into, &incoming).unwrap();
        assert_eq!(fs::read(into.join("etc/small")).unwrap(), b"x");
    }

    #[test]
    fn a_pax_record_counts_its_own_length() {
        let mut out = Vec::new();
        pax_record(&mut out, b"SCHILY.xattr.", b"user.a", b"v");
        assert_eq!(out, b"25 SCHILY.xattr.user.a=v\n");
        assert_eq!(out.len(), 25);
        let mut long = Vec::new();
        pax_record(&mut long, b"k", b"", &[b'x'; 95]);
        assert_eq!(long.len(), 102);
        assert!(long.starts_with(b"102 k="));
    }
}
