//! Filesystem operations relative to directory handles that never follow a
//! symbolic link.
//!
//! A layer is hostile input: an earlier entry (or an earlier layer) can plant a
//! symlink to `/` so that a later path through it lands on the host. Every
//! operation here therefore starts from an open directory and walks one
//! component at a time with `O_NOFOLLOW`, and creates, removes and changes
//! entries with the `*at` calls on the parent's handle. Nothing in this crate
//! writes into a root filesystem through a path string.
//!
//! `fuzz/fuzz_targets/tar_unpack.rs` compiles `layer.rs`, `fsat.rs` and
//! `error.rs` on their own (`#[path]`): they use nothing else of this crate.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat, Timespec, Timestamps, XattrFlags};

/// Largest xattr name list and value the kernel allows (XATTR_LIST_MAX, XATTR_SIZE_MAX).
const XATTR_MAX: usize = 64 * 1024;

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// Opens a directory by path (the root of a layer or a root filesystem, which
/// this crate made itself).
pub(crate) fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        rustix::fs::CWD,
        path,
        dir_flags(),
        Mode::empty(),
    )?)
}

/// Opens the directory `name` inside `parent`; fails (ELOOP, ENOTDIR) if it is
/// a symlink or not a directory.
pub(crate) fn open_subdir(parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        parent,
        name,
        dir_flags(),
        Mode::empty(),
    )?)
}

/// `lstat` of `name` in `parent`; `None` if it does not exist.
pub(crate) fn lstat_at(parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<Stat>> {
    match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) => Ok(Some(stat)),
        Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

pub(crate) fn file_type(stat: &Stat) -> FileType {
    FileType::from_raw_mode(stat.st_mode)
}

/// The names in a directory, sorted, without `.` and `..`.
pub(crate) fn read_names(dir: BorrowedFd<'_>) -> io::Result<Vec<OsString>> {
    let mut reader = rustix::fs::Dir::read_from(dir)?;
    let mut names = Vec::new();
    while let Some(entry) = reader.read() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(OsString::from_vec(name.to_vec()));
        }
    }
    names.sort();
    Ok(names)
}

/// Removes `name` from `parent` whatever it is, a whole tree for a directory,
/// never following a symlink. A missing name is not an error.
pub(crate) fn remove_at(parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    // `..` would be the parent's parent: never a name to remove.
    if name.is_empty() || name == "." || name == ".." || name.as_bytes().contains(&b'/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("refusing to remove {name:?}: not a single name"),
        ));
    }
    let Some(stat) = lstat_at(parent, name)? else {
        return Ok(());
    };
    if file_type(&stat) == FileType::Directory {
        let dir = open_subdir(parent, name)?;
        remove_children(dir.as_fd())?;
        rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)?;
    } else {
        rustix::fs::unlinkat(parent, name, AtFlags::empty())?;
    }
    Ok(())
}

/// Empties a directory, keeping the directory itself.
pub(crate) fn remove_children(dir: BorrowedFd<'_>) -> io::Result<()> {
    for name in read_names(dir)? {
        remove_at(dir, &name)?;
    }
    Ok(())
}

/// Removes a directory tree by path if it exists (a stale `.partial` build).
pub(crate) fn remove_tree(path: &Path) -> io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::other(
            "refusing to remove a path without a parent",
        ));
    };
    let parent = match open_dir(parent) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    remove_at(parent.as_fd(), name)
}

/// Where a walk through a relative path stopped, when it could not go on.
#[derive(Debug)]
pub(crate) enum WalkError {
    /// A component is a symbolic link: following it could leave the root.
    ThroughSymlink,
    /// A component exists but is not a directory.
    NotADirectory,
    /// A component does not exist (only when not creating).
    Missing,
    Io(io::Error),
}

impl From<io::Error> for WalkError {
    fn from(e: io::Error) -> Self {
        WalkError::Io(e)
    }
}

impl From<rustix::io::Errno> for WalkError {
    fn from(e: rustix::io::Errno) -> Self {
        WalkError::Io(e.into())
    }
}

/// Opens the directory at `components` under `root`, one component at a time,
/// refusing symlinks. With `create`, missing directories are made (mode 0755)
/// and reported to `created` with their depth, so a layer can tell implied
/// directories from ones its tar named.
pub(crate) fn walk(
    root: BorrowedFd<'_>,
    components: &[OsString],
    create: bool,
    mut created: impl FnMut(usize),
) -> Result<OwnedFd, WalkError> {
    let mut current = rustix::fs::openat(root, ".", dir_flags(), Mode::empty())?;
    for (depth, name) in components.iter().enumerate() {
        match lstat_at(current.as_fd(), name)? {
            None if create => {
                rustix::fs::mkdirat(
                    current.as_fd(),
                    name.as_os_str(),
                    Mode::from_raw_mode(0o755),
                )?;
                created(depth + 1);
            }
            None => return Err(WalkError::Missing),
            Some(stat) => match file_type(&stat) {
                FileType::Directory => {}
                FileType::Symlink => return Err(WalkError::ThroughSymlink),
                _ => return Err(WalkError::NotADirectory),
            },
        }
        current = open_subdir(current.as_fd(), name)?;
    }
    Ok(current)
}

/// Opens (creating if needed) and exclusively locks a lock file. The lock is
/// held until the returned file is dropped.
pub(crate) fn lock_file(path: &Path) -> io::Result<File> {
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)?;
    Ok(file)
}

pub(crate) fn timestamps(mtime: Timespec) -> Timestamps {
    Timestamps {
        last_access: mtime,
        last_modification: mtime,
    }
}

/// The extended attributes of an open file or directory.
pub(crate) fn list_xattrs(fd: BorrowedFd<'_>) -> io::Result<Vec<(OsString, Vec<u8>)>> {
    let mut names = vec![0u8; XATTR_MAX];
    let len = match rustix::fs::flistxattr(fd, &mut names[..]) {
        Ok(len) => len,
        Err(rustix::io::Errno::NOTSUP) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    let mut value = vec![0u8; XATTR_MAX];
    for name in names[..len].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let name = OsStr::from_bytes(name);
        let n = rustix::fs::fgetxattr(fd, name, &mut value[..])?;
        out.push((name.to_owned(), value[..n].to_vec()));
    }
    Ok(out)
}

pub(crate) fn set_xattr(fd: BorrowedFd<'_>, name: &OsStr, value: &[u8]) -> io::Result<()> {
    Ok(rustix::fs::fsetxattr(fd, name, value, XattrFlags::empty())?)
}

pub(crate) fn remove_xattr(fd: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    Ok(rustix::fs::fremovexattr(fd, name)?)
}

/// Sets an xattr on a symlink itself. There is no `lsetxattrat`, so the path
/// goes through `/proc/self/fd/<parent>`: the kernel resolves that magic link
/// to the directory already open, and `lsetxattr` does not follow the last
/// component, so nothing outside the root can be reached.
pub(crate) fn set_link_xattr(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    attr: &OsStr,
    value: &[u8],
) -> io::Result<()> {
    let path = proc_path(parent, name);
    Ok(rustix::fs::lsetxattr(
        &path,
        attr,
        value,
        XattrFlags::empty(),
    )?)
}

fn proc_path(parent: BorrowedFd<'_>, name: &OsStr) -> std::path::PathBuf {
    use std::os::fd::AsRawFd;
    Path::new("/proc/self/fd")
        .join(parent.as_raw_fd().to_string())
        .join(name)
}
