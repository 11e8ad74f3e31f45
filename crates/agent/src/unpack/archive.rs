//! Unpacking one tar stream under a root directory, as the contract in the
//! module above says. Knows nothing of HTTP.

use std::fs::{self, FileTimes, Permissions};
use std::io::{self, Read, Write as _};
use std::os::unix::fs::{
    DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _,
};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::sys::stat::{utimensat, UtimensatFlags};
use nix::sys::time::TimeSpec;
use tar::EntryType;

use super::{Owner, UnpackError};

/// What is wrong with an entry's header; the entry is refused, told this.
#[derive(Debug, thiserror::Error)]
enum BadHeader {
    #[error("its header has a bad {field}: {cause}")]
    Field {
        field: &'static str,
        cause: io::Error,
    },
    #[error("its header has a bad {field}: {value} is out of range")]
    OutOfRange { field: &'static str, value: u64 },
    #[error("its link target is empty")]
    EmptyLink,
    #[error("its link target is unreadable: {cause}")]
    UnreadableLink { cause: io::Error },
}

fn bad(field: &'static str) -> impl FnOnce(io::Error) -> BadHeader {
    move |cause| BadHeader::Field { field, cause }
}

/// The mode of parent directories the stream does not list.
const PARENT_MODE: u32 = 0o755;

/// Bytes copied per write into an unpacked file.
const COPY_BUFFER: usize = 128 << 10;

/// Unpacks the tar stream `archive` under `root` as the module doc says and
/// returns how many entries were unpacked. Symbolic links on the way are
/// followed wherever they lead, so `root` is meant to be the process's `/`.
pub fn unpack(archive: impl Read, root: &Path, owner: Option<Owner>) -> Result<u64, UnpackError> {
    let mut unpacker = Unpacker {
        root,
        owner,
        directories: Vec::new(),
        entries: 0,
        buffer: vec![0; COPY_BUFFER],
    };
    let mut archive = tar::Archive::new(archive);
    let unreadable =
        |place: String| move |source: io::Error| UnpackError::Archive { place, source };
    let mut place = "at its start".to_string();
    for entry in archive.entries().map_err(unreadable(place.clone()))? {
        let mut entry = entry.map_err(unreadable(place.clone()))?;
        place = format!("after entry {:?}", entry_name(&entry));
        unpacker.entry(&mut entry)?;
    }
    unpacker.finish()
}

/// A directory entry's mode and mtime, set once the stream is through.
struct Directory {
    entry: String,
    path: PathBuf,
    mode: u32,
    mtime: u64,
}

/// What an entry makes, checked before anything is written for it.
enum Kind {
    File,
    Directory,
    Symlink(PathBuf),
    /// The target's path on disk.
    HardLink(PathBuf),
}

/// What an entry's header says about the entry itself.
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: u64,
}

struct Unpacker<'a> {
    root: &'a Path,
    owner: Option<Owner>,
    directories: Vec<Directory>,
    entries: u64,
    buffer: Vec<u8>,
}

impl Unpacker<'_> {
    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), UnpackError> {
        let name = entry_name(entry);
        let refused = |reason: String| UnpackError::Refused {
            entry: name.clone(),
            reason,
        };
        let entry_type = entry.header().entry_type();
        if entry_type == EntryType::XGlobalHeader {
            return Ok(());
        }
        let relative = entry
            .path()
            .map_err(|e| refused(format!("its name is unreadable: {e}")))
            .and_then(|path| below_root(&path).map_err(|why| refused(format!("its name {why}"))))?;
        if relative.as_os_str().is_empty() {
            // `./`: the root itself is the sandbox's, not the stream's.
            return Ok(());
        }
        let path = self.root.join(&relative);
        let kind = match entry_type {
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => Kind::File,
            EntryType::Directory => Kind::Directory,
            EntryType::Symlink => {
                Kind::Symlink(link_target(entry).map_err(|bad| refused(bad.to_string()))?)
            }
            EntryType::Link => {
                let target = link_target(entry).map_err(|bad| refused(bad.to_string()))?;
                let relative_target = below_root(&target).map_err(|why| {
                    refused(format!("its link target {:?} {why}", target.display()))
                })?;
                let target = self.root.join(relative_target);
                check_link_target(&target, &name)?;
                Kind::HardLink(target)
            }
            other => {
                return Err(refused(format!(
                    "it is {}; only files, directories, symbolic links and hard links are unpacked",
                    describe(other)
                )))
            }
        };
        let meta = self
            .meta(entry.header())
            .map_err(|bad| refused(bad.to_string()))?;

        self.create_parents(&relative, &name)?;
        match kind {
            Kind::File => self.file(entry, &path, &name, &meta)?,
            Kind::Directory => self.directory(&path, &name, &meta)?,
            Kind::Symlink(target) => {
                make_room(&path, &name)?;
                std::os::unix::fs::symlink(&target, &path).map_err(io_error(
                    &name,
                    "create symbolic link",
                    &path,
                ))?;
                std::os::unix::fs::lchown(&path, Some(meta.uid), Some(meta.gid))
                    .map_err(io_error(&name, "set the owner of", &path))?;
                set_mtime(&path, meta.mtime, UtimensatFlags::NoFollowSymlink).map_err(io_error(
                    &name,
                    "set the mtime of",
                    &path,
                ))?;
            }
            Kind::HardLink(target) => {
                if target != path {
                    make_room(&path, &name)?;
                    fs::hard_link(&target, &path).map_err(io_error(
                        &name,
                        "create hard link",
                        &path,
                    ))?;
                }
                set_link_owner(&path, &meta).map_err(io_error(&name, "set the owner of", &path))?;
            }
        }
        self.entries += 1;
        Ok(())
    }

    fn meta(&self, header: &tar::Header) -> Result<Meta, BadHeader> {
        let mode = header.mode().map_err(bad("mode"))?;
        let mtime = header.mtime().map_err(bad("mtime"))?;
        let (uid, gid) = match self.owner {
            Some(owner) => (owner.uid.as_raw(), owner.gid.as_raw()),
            None => {
                let id = |field: &'static str, value: io::Result<u64>| {
                    let value = value.map_err(bad(field))?;
                    u32::try_from(value).map_err(|_| BadHeader::OutOfRange { field, value })
                };
                (id("uid", header.uid())?, id("gid", header.gid())?)
            }
        };
        Ok(Meta {
            mode: mode & 0o7777,
            uid,
            gid,
            mtime,
        })
    }

    /// Creates the directories on the way to `relative` that do not exist;
    /// existing ones (and symbolic links to them) are left as they are.
    fn create_parents(&self, relative: &Path, name: &str) -> Result<(), UnpackError> {
        let mut dir = self.root.to_path_buf();
        for part in relative.parent().into_iter().flat_map(Path::components) {
            dir.push(part);
            match fs::metadata(&dir) {
                Ok(meta) if meta.is_dir() => {}
                Ok(_) => {
                    return Err(UnpackError::Refused {
                        entry: name.to_string(),
                        reason: format!("{} in its path is not a directory", dir.display()),
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    fs::DirBuilder::new()
                        .mode(PARENT_MODE)
                        .create(&dir)
                        .map_err(io_error(name, "create directory", &dir))?;
                    // The contract's mode, not what the umask leaves of it.
                    fs::set_permissions(&dir, Permissions::from_mode(PARENT_MODE))
                        .map_err(io_error(name, "set the mode of", &dir))?;
                }
                Err(e) => return Err(io_error(name, "inspect", &dir)(e)),
            }
        }
        Ok(())
    }

    fn file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        path: &Path,
        name: &str,
        meta: &Meta,
    ) -> Result<(), UnpackError> {
        make_room(path, name)?;
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(io_error(name, "create file", path))?;
        let size = entry.size();
        let mut written = 0u64;
        loop {
            let n = match entry.read(&mut self.buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(UnpackError::Archive {
                        place: format!("inside entry {name:?}"),
                        source,
                    })
                }
            };
            file.write_all(&self.buffer[..n])
                .map_err(io_error(name, "write", path))?;
            written += n as u64;
        }
        if written != size {
            return Err(UnpackError::Archive {
                place: format!("inside entry {name:?}"),
                source: io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("it ends after {written} of the entry's {size} bytes"),
                ),
            });
        }
        // Owner before mode: a change of owner clears setuid and setgid.
        std::os::unix::fs::fchown(&file, Some(meta.uid), Some(meta.gid)).map_err(io_error(
            name,
            "set the owner of",
            path,
        ))?;
        file.set_permissions(Permissions::from_mode(meta.mode))
            .map_err(io_error(name, "set the mode of", path))?;
        let mtime = SystemTime::UNIX_EPOCH + Duration::from_secs(meta.mtime);
        file.set_times(FileTimes::new().set_accessed(mtime).set_modified(mtime))
            .map_err(io_error(name, "set the mtime of", path))?;
        Ok(())
    }

    fn directory(&mut self, path: &Path, name: &str, meta: &Meta) -> Result<(), UnpackError> {
        // `metadata` follows symbolic links: a link to a directory is kept.
        let is_dir = match fs::metadata(path) {
            Ok(existing) => existing.is_dir(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(io_error(name, "inspect", path)(e)),
        };
        if !is_dir {
            make_room(path, name)?;
            // Owner-only until the stream is through; see `finish`.
            fs::DirBuilder::new()
                .mode(0o700)
                .create(path)
                .map_err(io_error(name, "create directory", path))?;
        }
        std::os::unix::fs::chown(path, Some(meta.uid), Some(meta.gid)).map_err(io_error(
            name,
            "set the owner of",
            path,
        ))?;
        self.directories.push(Directory {
            entry: name.to_string(),
            path: path.to_path_buf(),
            mode: meta.mode,
            mtime: meta.mtime,
        });
        Ok(())
    }

    /// Sets the directories' modes and mtimes, last listed first: writing
    /// into a directory changes its mtime, and its mode may forbid writing.
    fn finish(self) -> Result<u64, UnpackError> {
        for dir in self.directories.iter().rev() {
            fs::set_permissions(&dir.path, Permissions::from_mode(dir.mode)).map_err(io_error(
                &dir.entry,
                "set the mode of",
                &dir.path,
            ))?;
            set_mtime(&dir.path, dir.mtime, UtimensatFlags::FollowSymlink).map_err(io_error(
                &dir.entry,
                "set the mtime of",
                &dir.path,
            ))?;
        }
        Ok(self.entries)
    }
}

fn entry_name<R: Read>(entry: &tar::Entry<'_, R>) -> String {
    String::from_utf8_lossy(&entry.path_bytes()).into_owned()
}

/// `path` as a path below the root (empty for the root itself), or why it is
/// not one.
fn below_root(path: &Path) -> Result<PathBuf, &'static str> {
    let mut relative = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => relative.push(part),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err("is absolute; names must be relative to the root")
            }
            Component::ParentDir => return Err("has a `..` component"),
        }
    }
    Ok(relative)
}

fn link_target<R: Read>(entry: &tar::Entry<'_, R>) -> Result<PathBuf, BadHeader> {
    match entry.link_name() {
        Ok(Some(target)) if !target.as_os_str().is_empty() => Ok(target.into_owned()),
        Ok(_) => Err(BadHeader::EmptyLink),
        Err(cause) => Err(BadHeader::UnreadableLink { cause }),
    }
}

/// A hard link needs an existing target that is not a directory.
fn check_link_target(target: &Path, name: &str) -> Result<(), UnpackError> {
    let refused = |reason: String| UnpackError::Refused {
        entry: name.to_string(),
        reason,
    };
    match fs::symlink_metadata(target) {
        Ok(meta) if meta.is_dir() => Err(refused(format!(
            "its link target {} is a directory",
            target.display()
        ))),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(refused(format!(
            "its link target {} does not exist",
            target.display()
        ))),
        Err(e) => Err(io_error(name, "inspect", target)(e)),
    }
}

/// Clears `path` for a new non-directory: an existing file or symbolic link
/// goes, an existing directory is refused.
fn make_room(path: &Path, name: &str) -> Result<(), UnpackError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => Err(UnpackError::Refused {
            entry: name.to_string(),
            reason: format!("{} is an existing directory", path.display()),
        }),
        Ok(_) => fs::remove_file(path).map_err(io_error(name, "replace", path)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error(name, "inspect", path)(e)),
    }
}

/// A hard link is its target's inode, which may have its own entry's owner and
/// mode already. Any `chown` of a file clears setuid and setgid, even to the
/// same ids, so only a different owner is set, and the mode put back after.
fn set_link_owner(path: &Path, meta: &Meta) -> io::Result<()> {
    let existing = fs::symlink_metadata(path)?;
    if (existing.uid(), existing.gid()) == (meta.uid, meta.gid) {
        return Ok(());
    }
    std::os::unix::fs::lchown(path, Some(meta.uid), Some(meta.gid))?;
    if existing.is_symlink() {
        return Ok(());
    }
    fs::set_permissions(path, Permissions::from_mode(existing.mode() & 0o7777))
}

fn set_mtime(path: &Path, mtime: u64, flag: UtimensatFlags) -> io::Result<()> {
    let time = TimeSpec::from_duration(Duration::from_secs(mtime));
    utimensat(None, path, &time, &time, flag).map_err(io::Error::from)
}

fn describe(kind: EntryType) -> String {
    match kind {
        EntryType::Char => "a character device".to_string(),
        EntryType::Block => "a block device".to_string(),
        EntryType::Fifo => "a fifo".to_string(),
        other => format!("of tar type {:?}", char::from(other.as_byte())),
    }
}

fn io_error<'a>(
    entry: &'a str,
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> UnpackError + 'a {
    move |source| UnpackError::Io {
        entry: entry.to_string(),
        action,
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use nix::unistd::{Gid, Uid};

    use super::*;

    /// Tar streams for the tests; entries belong to the test's own user, so
    /// only the `owner` test needs root.
    struct Stream(tar::Builder<Vec<u8>>);

    fn header(kind: EntryType, mode: u32, mtime: u64) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_mtime(mtime);
        header.set_uid(Uid::effective().as_raw().into());
        header.set_gid(Gid::effective().as_raw().into());
        header.set_size(0);
        header
    }

    impl Stream {
        fn new() -> Self {
            Self(tar::Builder::new(Vec::new()))
        }

        fn file(mut self, name: &str, mode: u32, mtime: u64, data: &[u8]) -> Self {
            let mut header = header(EntryType::Regular, mode, mtime);
            header.set_size(data.len() as u64);
            self.0.append_data(&mut header, name, data).unwrap();
            self
        }

        fn dir(mut self, name: &str, mode: u32, mtime: u64) -> Self {
            let mut header = header(EntryType::Directory, mode, mtime);
            self.0.append_data(&mut header, name, io::empty()).unwrap();
            self
        }

        fn link(mut self, kind: EntryType, name: &str, target: &str) -> Self {
            let mut header = header(kind, 0o777, 1_600_000_000);
            self.0.append_link(&mut header, name, target).unwrap();
            self
        }

        /// An entry whose name the builder would refuse to write.
        fn raw(mut self, kind: EntryType, name: &str, link: &str) -> Self {
            let mut header = header(kind, 0o644, 1_600_000_000);
            header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
            header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
            header.set_cksum();
            self.0.append(&header, io::empty()).unwrap();
            self
        }

        fn bytes(self) -> Vec<u8> {
            self.0.into_inner().unwrap()
        }

        fn unpack_in(self, root: &Path) -> Result<u64, UnpackError> {
            unpack(&self.bytes()[..], root, None)
        }
    }

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    fn mtime(path: &Path) -> i64 {
        fs::symlink_metadata(path).unwrap().mtime()
    }

    fn refused_entry(error: UnpackError) -> String {
        match error {
            UnpackError::Refused { entry, .. } => entry,
            other => panic!("expected a refusal, got {other}"),
        }
    }

    /// Everything under `dir`, relative, sorted.
    fn listing(dir: &Path) -> Vec<String> {
        let mut names = Vec::new();
        let mut pending = vec![dir.to_path_buf()];
        while let Some(next) = pending.pop() {
            for entry in fs::read_dir(next).unwrap() {
                let path = entry.unwrap().path();
                names.push(path.strip_prefix(dir).unwrap().display().to_string());
                if fs::symlink_metadata(&path).unwrap().is_dir() {
                    pending.push(path);
                }
            }
        }
        names.sort();
        names
    }

    #[test]
    fn files_and_directories_land_with_their_modes_and_mtimes() {
        let root = tempfile::tempdir().unwrap();
        let count = Stream::new()
            .dir("./", 0o700, 1)
            .dir("app/", 0o750, 1_500_000_000)
            .file("app/main.py", 0o644, 1_600_000_000, b"print('hi')\n")
            .file("app/run", 0o4755, 1_600_000_001, b"#!/bin/sh\n")
            .file(
                "./app/deep/er/data.bin",
                0o600,
                1_600_000_002,
                &[7; 100_000],
            )
            .unpack_in(root.path())
            .unwrap();
        assert_eq!(count, 4, "the root entry is not counted");

        let app = root.path().join("app");
        assert_eq!(fs::read(app.join("main.py")).unwrap(), b"print('hi')\n");
        assert_eq!(mode(&app.join("main.py")), 0o644);
        assert_eq!(mtime(&app.join("main.py")), 1_600_000_000);
        assert_eq!(mode(&app.join("run")), 0o4755, "setuid survives");
        assert_eq!(
            fs::read(app.join("deep/er/data.bin")).unwrap(),
            [7; 100_000]
        );
        // Directories the stream did not list: 0755, the unpacker's owner.
        assert_eq!(mode(&app.join("deep")), 0o755);
        assert_eq!(mode(&app.join("deep/er")), 0o755);
        assert_eq!(
            fs::metadata(app.join("deep")).unwrap().uid(),
            Uid::effective().as_raw()
        );
        // A listed directory keeps its header's mtime although files came after.
        assert_eq!(mode(&app), 0o750);
        assert_eq!(mtime(&app), 1_500_000_000);
        assert_ne!(mode(root.path()), 0o700, "the root is not the stream's");
    }

    #[test]
    fn links_are_made_as_links() {
        let root = tempfile::tempdir().unwrap();
        Stream::new()
            .file("app/main.py", 0o644, 1_600_000_000, b"code")
            .link(EntryType::Symlink, "app/current", "main.py")
            .link(EntryType::Symlink, "app/dangling", "/nowhere/at/all")
            .link(EntryType::Link, "app/copy.py", "app/main.py")
            .unpack_in(root.path())
            .unwrap();
        let app = root.path().join("app");
        assert_eq!(
            fs::read_link(app.join("current")).unwrap(),
            Path::new("main.py")
        );
        assert_eq!(fs::read(app.join("current")).unwrap(), b"code");
        assert_eq!(mtime(&app.join("current")), 1_600_000_000);
        assert_eq!(
            fs::read_link(app.join("dangling")).unwrap(),
            Path::new("/nowhere/at/all"),
            "a symbolic link's target is data, never resolved"
        );
        let original = fs::metadata(app.join("main.py")).unwrap();
        let link = fs::symlink_metadata(app.join("copy.py")).unwrap();
        assert_eq!((link.ino(), link.nlink()), (original.ino(), 2));
    }

    #[test]
    fn parent_and_absolute_paths_are_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        fs::create_dir(&root).unwrap();
        for (kind, name, link) in [
            (EntryType::Regular, "../escaped", ""),
            (EntryType::Regular, "app/../../escaped", ""),
            (EntryType::Directory, "/escaped/", ""),
            (EntryType::Symlink, "/escaped", "app"),
            (EntryType::Link, "app/escaped", "../outside"),
            (EntryType::Link, "app/escaped", "/etc/passwd"),
        ] {
            let error = Stream::new()
                .raw(kind, name, link)
                .unpack_in(&root)
                .unwrap_err();
            assert_eq!(error.status(), StatusCode::BAD_REQUEST);
            assert!(error.to_string().contains(name), "{error}");
            assert_eq!(refused_entry(error), name);
        }
        assert_eq!(listing(dir.path()), ["root"], "nothing was written");
    }

    #[test]
    fn existing_files_are_replaced_and_existing_directories_kept() {
        let root = tempfile::tempdir().unwrap();
        let app = root.path().join("app");
        fs::create_dir(&app).unwrap();
        fs::set_permissions(&app, Permissions::from_mode(0o700)).unwrap();
        fs::write(app.join("kept.txt"), "kept").unwrap();
        fs::write(app.join("main.py"), "old").unwrap();
        std::os::unix::fs::symlink("kept.txt", app.join("link")).unwrap();
        std::os::unix::fs::symlink("../usr", app.join("dir-link")).unwrap();
        // A merged-/usr image: /lib is a link, and entries under lib/ follow it.
        fs::create_dir_all(root.path().join("usr/lib")).unwrap();
        std::os::unix::fs::symlink("usr/lib", root.path().join("lib")).unwrap();

        Stream::new()
            .dir("app", 0o755, 1_500_000_000)
            .file("app/main.py", 0o640, 1_600_000_000, b"new")
            .file("app/link", 0o644, 1_600_000_000, b"a file now")
            .file("app/dir-link", 0o644, 1_600_000_000, b"a file too")
            .dir("lib", 0o755, 1_500_000_000)
            .file("lib/libx.so", 0o755, 1_600_000_000, b"elf")
            .unpack_in(root.path())
            .unwrap();
        assert_eq!(fs::read(app.join("kept.txt")).unwrap(), b"kept");
        assert_eq!(fs::read(app.join("main.py")).unwrap(), b"new");
        assert_eq!(mode(&app.join("main.py")), 0o640);
        assert_eq!(mode(&app), 0o755, "a kept directory takes the entry's mode");
        assert!(fs::symlink_metadata(app.join("link")).unwrap().is_file());
        assert_eq!(fs::read(app.join("dir-link")).unwrap(), b"a file too");
        assert_eq!(fs::read(app.join("kept.txt")).unwrap(), b"kept");
        assert!(fs::symlink_metadata(root.path().join("lib"))
            .unwrap()
            .is_symlink());
        assert_eq!(
            fs::read(root.path().join("usr/lib/libx.so")).unwrap(),
            b"elf"
        );

        let error = Stream::new()
            .file("app", 0o644, 1, b"a file where a directory is")
            .unpack_in(root.path())
            .unwrap_err();
        assert_eq!(refused_entry(error), "app");
        assert!(app.join("kept.txt").exists());
    }

    #[test]
    fn devices_fifos_and_short_streams_are_bad_requests() {
        let root = tempfile::tempdir().unwrap();
        for kind in [EntryType::Char, EntryType::Block, EntryType::Fifo] {
            let error = Stream::new()
                .raw(kind, "dev/thing", "")
                .unpack_in(root.path())
                .unwrap_err();
            assert!(error.to_string().contains("dev/thing"), "{error}");
            assert_eq!(refused_entry(error), "dev/thing");
        }
        assert!(listing(root.path()).is_empty());

        let whole = Stream::new().file("big", 0o644, 1, &[1; 10_000]).bytes();
        let error = unpack(&whole[..5_000], root.path(), None).unwrap_err();
        assert!(matches!(error, UnpackError::Archive { .. }), "{error}");
        assert_eq!(error.status(), StatusCode::BAD_REQUEST);
        assert!(
            error.to_string().contains("inside entry \"big\""),
            "{error}"
        );

        let error = unpack(&b"not a tar stream"[..], root.path(), None).unwrap_err();
        assert!(matches!(error, UnpackError::Archive { .. }), "{error}");
    }

    #[test]
    fn an_owner_goes_to_every_entry_but_not_to_created_parents() {
        if !Uid::effective().is_root() {
            eprintln!("skipped: changing owners needs root");
            return;
        }
        let root = tempfile::tempdir().unwrap();
        let owner = Owner {
            uid: Uid::from_raw(4242),
            gid: Gid::from_raw(77),
        };
        let stream = Stream::new()
            .dir("app/sub", 0o2775, 1)
            .file("app/sub/run", 0o6755, 1, b"x")
            .link(EntryType::Symlink, "app/sub/link", "run")
            .link(EntryType::Link, "app/sub/hard", "app/sub/run")
            .bytes();
        assert_eq!(unpack(&stream[..], root.path(), Some(owner)).unwrap(), 4);
        let ids = |path: &str| {
            let meta = fs::symlink_metadata(root.path().join(path)).unwrap();
            (meta.uid(), meta.gid())
        };
        for path in ["app/sub", "app/sub/run", "app/sub/link", "app/sub/hard"] {
            assert_eq!(ids(path), (4242, 77), "{path}");
        }
        assert_eq!(ids("app"), (0, 0), "a created parent stays the unpacker's");
        assert_eq!(mode(&root.path().join("app/sub/run")), 0o6755);
        assert_eq!(mode(&root.path().join("app/sub")), 0o2775);

        // Without an owner the header's ids apply.
        let mut header = header(EntryType::Regular, 0o644, 1);
        header.set_uid(1234);
        header.set_gid(5678);
        let mut builder = tar::Builder::new(Vec::new());
        builder
            .append_data(&mut header, "theirs", io::empty())
            .unwrap();
        unpack(&builder.into_inner().unwrap()[..], root.path(), None).unwrap();
        assert_eq!(ids("theirs"), (1234, 5678));
    }

    #[test]
    fn owner_specs_resolve_as_docker_chown_does() {
        let ids = |spec: &str| {
            let owner = Owner::parse(spec).unwrap();
            (owner.uid.as_raw(), owner.gid.as_raw())
        };
        assert_eq!(ids("4242"), (4242, 4242), "a uid alone is also the gid");
        assert_eq!(ids("4242:77"), (4242, 77));
        assert_eq!(ids("root"), (0, 0));
        assert_eq!(ids("root:4242"), (0, 4242));
        // A user whose primary group differs still gets its uid as the gid,
        // by name and by number (`USER` would take the primary group).
        let passwd = fs::read_to_string("/etc/passwd").unwrap();
        let other_group = passwd.lines().find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            let uid: u32 = fields.get(2)?.parse().ok()?;
            let gid: u32 = fields.get(3)?.parse().ok()?;
            (uid != gid).then(|| (fields[0].to_string(), uid))
        });
        if let Some((name, uid)) = other_group {
            assert_eq!(ids(&name), (uid, uid), "{name}");
            assert_eq!(ids(&uid.to_string()), (uid, uid), "{name}");
        }
        for spec in ["no-such-user-here", "root:no-such-group", ""] {
            let error = Owner::parse(spec).unwrap_err();
            assert_eq!(error.status(), StatusCode::BAD_REQUEST);
            assert!(
                matches!(&error, UnpackError::UnknownOwner { spec: s, .. } if s == spec),
                "{error}"
            );
        }
        assert!(Owner::parse("no-such-user-here")
            .unwrap_err()
            .to_string()
            .contains("no-such-user-here"));
    }
}
