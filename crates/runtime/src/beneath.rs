//! Paths inside trees a sandbox can write, opened without following its links.
//!
//! A volume, a container's root filesystem and a subpath of either can hold
//! any symlink a sandbox made, and another sandbox sharing the volume can swap
//! a directory for a symlink at any moment. Host code running as root that
//! resolves such a path as text would follow the link onto the host (a volume
//! subpath `x` that is `ln -s / x` bound the host's root into a sandbox).
//! So every such path is walked here from a descriptor of its trusted root,
//! one component at a time, with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`: a symlink anywhere is
//! refused, and a rename racing the walk cannot lead it out. What comes back
//! is an `O_PATH` descriptor, and mounts are made from descriptors
//! (`open_tree`, `mount_setattr`, `move_mount`), so no path is resolved again
//! between the check and its use.
//!
//! Owns no files; every function takes the roots it is given as trusted (they
//! are host paths the sandbox cannot reach, like `{volumes}/{id}` or the
//! mount point of a container's root).
#![allow(unsafe_code)]

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// `openat2`'s resolve flags for a path in a sandbox-writable tree.
const RESOLVE_CONFINED: u64 =
    libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
/// How often a walk is tried again when a concurrent rename made the kernel
/// give up (`EAGAIN`).
const RENAME_RETRIES: usize = 8;

// From <linux/mount.h> (kernel ABI; not all of them are exported by libc).
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x04;
const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
/// `mount_setattr`'s `MOUNT_ATTR_NOSUID`.
pub const MOUNT_ATTR_NOSUID: u64 = 0x02;
/// `mount_setattr`'s `MOUNT_ATTR_NODEV`.
pub const MOUNT_ATTR_NODEV: u64 = 0x04;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Why a path inside a sandbox-writable tree was refused. `path` is the part
/// of the relative path walked so far, never a host path.
#[derive(Debug, thiserror::Error)]
pub enum BeneathError {
    #[error("{} is a symlink, which cove never follows here", .path.display())]
    Symlink { path: PathBuf },
    #[error("{} is not a directory", .path.display())]
    NotDirectory { path: PathBuf },
    #[error("{} does not exist", .path.display())]
    Missing { path: PathBuf },
    #[error("{} is not a plain relative path", .path.display())]
    NotRelative { path: PathBuf },
    #[error("open {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Opens `path` to read it only if it is a regular file: not through a
/// symlink as its last component, and never waiting on a FIFO. For a small
/// file whose name someone else could have made anything (an image's
/// marker, a disk header QEMU writes).
pub fn open_regular(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    Ok(file)
}

/// At most `limit` bytes of the text of [`open_regular`]'s `path`.
pub fn read_regular(path: &Path, limit: u64) -> io::Result<String> {
    use std::io::Read as _;
    let mut text = String::new();
    open_regular(path)?.take(limit).read_to_string(&mut text)?;
    Ok(text)
}

/// Opens the trusted root itself (`O_PATH`, a directory, not a symlink).
pub fn open_root(root: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(root.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: a NUL-terminated path and integer flags; the returned descriptor
    // is owned by the OwnedFd below and by nothing else.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by open and is not owned elsewhere.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Directories made inside a volume (subpaths): writable by every user of
/// every sandbox sharing it, as the volume's root is.
pub const SHARED_DIR_MODE: u32 = 0o777;
/// Directories made in a sandbox's own tree (mount points).
pub const PRIVATE_DIR_MODE: u32 = 0o755;

/// The directory `relative` under `root`, as an `O_PATH` descriptor; with
/// `create: Some(mode)`, missing directories are made with that mode (the
/// umask aside) one at a time. Refuses `..`, absolute paths, symlinks and
/// non-directories anywhere on the way.
pub fn open_dir(
    root: &Path,
    relative: &Path,
    create: Option<u32>,
) -> Result<OwnedFd, BeneathError> {
    let root_fd = open_root(root).map_err(|source| BeneathError::Io {
        path: PathBuf::from("."),
        source,
    })?;
    open_dir_at(&root_fd, relative, create)
}

/// [`open_dir`] from an already open trusted root.
pub fn open_dir_at(
    root: &OwnedFd,
    relative: &Path,
    create: Option<u32>,
) -> Result<OwnedFd, BeneathError> {
    let mut walked = PathBuf::new();
    let mut current: Option<OwnedFd> = None;
    for component in relative.components() {
        let name = match component {
            Component::Normal(name) => name,
            Component::CurDir => continue,
            _ => {
                return Err(BeneathError::NotRelative {
                    path: relative.to_owned(),
                })
            }
        };
        walked.push(name);
        let parent = current.as_ref().unwrap_or(root);
        let name = CString::new(name.as_bytes()).map_err(|_| BeneathError::NotRelative {
            path: walked.clone(),
        })?;
        current = Some(step(parent, &name, create, &walked)?);
    }
    match current {
        Some(fd) => Ok(fd),
        None => root.try_clone().map_err(|source| BeneathError::Io {
            path: PathBuf::from("."),
            source,
        }),
    }
}

/// Opens one component under `parent`, making it first when asked.
fn step(
    parent: &OwnedFd,
    name: &CStr,
    create: Option<u32>,
    walked: &Path,
) -> Result<OwnedFd, BeneathError> {
    let mut made = false;
    let mut retries = 0;
    loop {
        match openat2_dir(parent, name) {
            Ok(fd) => return Ok(fd),
            Err(err) => match err.raw_os_error() {
                Some(libc::ENOENT) if create.is_some() && !made => {
                    mkdirat(parent, name, create.unwrap_or(PRIVATE_DIR_MODE)).map_err(
                        |source| BeneathError::Io {
                            path: walked.to_owned(),
                            source,
                        },
                    )?;
                    made = true;
                }
                Some(libc::ENOENT) => {
                    return Err(BeneathError::Missing {
                        path: walked.to_owned(),
                    })
                }
                Some(libc::ELOOP) | Some(libc::EXDEV) => {
                    return Err(BeneathError::Symlink {
                        path: walked.to_owned(),
                    })
                }
                Some(libc::ENOTDIR) => {
                    return Err(if is_symlink(parent, name) {
                        BeneathError::Symlink {
                            path: walked.to_owned(),
                        }
                    } else {
                        BeneathError::NotDirectory {
                            path: walked.to_owned(),
                        }
                    })
                }
                Some(libc::EAGAIN) if retries < RENAME_RETRIES => retries += 1,
                _ => {
                    return Err(BeneathError::Io {
                        path: walked.to_owned(),
                        source: err,
                    })
                }
            },
        }
    }
}

fn openat2_dir(parent: &OwnedFd, name: &CStr) -> io::Result<OwnedFd> {
    let how = OpenHow {
        flags: (libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: RESOLVE_CONFINED,
    };
    // SAFETY: `how` is a live open_how of the size passed, `name` is
    // NUL-terminated; the kernel only reads both.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            parent.as_raw_fd(),
            name.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat2 returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// Makes `name` in `parent` with `mode` exactly (a `fchmodat` after the
/// `mkdirat`, which the umask would cut).
fn mkdirat(parent: &OwnedFd, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: a directory descriptor, a NUL-terminated name and a mode.
    let rc = unsafe { libc::mkdirat(parent.as_raw_fd(), name.as_ptr(), mode) };
    if rc == 0 {
        // SAFETY: as above; AT_SYMLINK_NOFOLLOW is not supported by
        // fchmodat, but the entry was made a directory by this call.
        let rc = unsafe { libc::fchmodat(parent.as_raw_fd(), name.as_ptr(), mode, 0) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        return Ok(());
    }
    let err = io::Error::last_os_error();
    // Made by someone else meanwhile: the next open checks what it is.
    if err.raw_os_error() == Some(libc::EEXIST) {
        return Ok(());
    }
    Err(err)
}

fn is_symlink(parent: &OwnedFd, name: &CStr) -> bool {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `stat` is written by the kernel before it is read, and only
    // when the call succeeded.
    let rc = unsafe {
        libc::fstatat(
            parent.as_raw_fd(),
            name.as_ptr(),
            stat.as_mut_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    // SAFETY: rc == 0 means fstatat filled `stat`.
    rc == 0 && (unsafe { stat.assume_init() }.st_mode & libc::S_IFMT) == libc::S_IFLNK
}

/// A detached copy of the mount tree at `dir` (`open_tree(OPEN_TREE_CLONE)`,
/// recursive) with `attrs` (`MOUNT_ATTR_*`) set on every mount of it, ready
/// for [`attach`]. Made in the caller's mount namespace.
pub fn clone_tree(dir: BorrowedFd<'_>, attrs: u64) -> io::Result<OwnedFd> {
    clone_tree_mapped(dir, attrs, None)
}

/// [`clone_tree`], and with `userns` an idmapped mount: a file of owner N on
/// disk shows as (and is written by) id N of that user namespace, so a
/// container's root sees its files as its own and writes them as owner 0.
pub fn clone_tree_mapped(
    dir: BorrowedFd<'_>,
    attrs: u64,
    userns: Option<BorrowedFd<'_>>,
) -> io::Result<OwnedFd> {
    // SAFETY: an O_PATH descriptor, an empty NUL-terminated path and flags.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            dir.as_raw_fd(),
            c"".as_ptr(),
            OPEN_TREE_CLONE
                | libc::O_CLOEXEC as libc::c_uint
                | libc::AT_EMPTY_PATH as libc::c_uint
                | libc::AT_RECURSIVE as libc::c_uint,
        )
    };
    if tree < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: open_tree returned a new descriptor that nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(tree as libc::c_int) };
    let attrs = attrs
        | if userns.is_some() {
            MOUNT_ATTR_IDMAP
        } else {
            0
        };
    if attrs != 0 {
        let attr = MountAttr {
            attr_set: attrs,
            attr_clr: 0,
            propagation: 0,
            userns_fd: userns.map_or(0, |fd| fd.as_raw_fd() as u64),
        };
        // SAFETY: `attr` is a live mount_attr of the size passed; the kernel
        // only reads it.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(tree)
}

/// Mounts a detached tree from [`clone_tree`] on the directory `target`
/// refers to (an `O_PATH` descriptor from [`open_dir`]), in the caller's mount
/// namespace.
pub fn attach(tree: BorrowedFd<'_>, target: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: two descriptors, empty NUL-terminated paths and flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            target.as_raw_fd(),
            c"".as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Mounts a detached tree on the host-owned directory `target`. Makes no
/// allocation, so a child may call it between fork and exec.
pub fn attach_at_path(tree: libc::c_int, target: &CStr) -> io::Result<()> {
    // SAFETY: a descriptor, NUL-terminated paths and flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree,
            c"".as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn tree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("a/b")).unwrap();
        fs::write(dir.path().join("a/file"), "x").unwrap();
        symlink("/", dir.path().join("a/to-root")).unwrap();
        symlink("b", dir.path().join("a/to-b")).unwrap();
        symlink("/nowhere", dir.path().join("dangling")).unwrap();
        dir
    }

    fn refusal(root: &Path, relative: &str, create: bool) -> BeneathError {
        open_dir(
            root,
            Path::new(relative),
            create.then_some(PRIVATE_DIR_MODE),
        )
        .unwrap_err()
    }

    #[test]
    fn plain_directories_open_and_missing_ones_are_made_one_at_a_time() {
        let dir = tree();
        open_dir(dir.path(), Path::new("a/b"), None).unwrap();
        open_dir(dir.path(), Path::new("./a/./b"), None).unwrap();
        open_dir(dir.path(), Path::new(""), None).unwrap();
        open_dir(dir.path(), Path::new("a/new/deeper"), Some(SHARED_DIR_MODE)).unwrap();
        assert!(dir.path().join("a/new/deeper").is_dir());
        // Made with the mode asked for, whatever the umask.
        use std::os::unix::fs::PermissionsExt as _;
        for made in ["a/new", "a/new/deeper"] {
            let mode = fs::metadata(dir.path().join(made))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o7777, SHARED_DIR_MODE, "{made}");
        }
        open_dir(dir.path(), Path::new("a/own"), Some(PRIVATE_DIR_MODE)).unwrap();
        let mode = fs::metadata(dir.path().join("a/own"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, PRIVATE_DIR_MODE);
        assert!(matches!(
            refusal(dir.path(), "a/missing", false),
            BeneathError::Missing { path } if path == Path::new("a/missing")
        ));
    }

    #[test]
    fn a_symlink_anywhere_is_refused_even_one_inside_the_tree() {
        let dir = tree();
        for (path, walked) in [
            ("a/to-root", "a/to-root"),
            ("a/to-root/etc", "a/to-root"),
            ("a/to-b", "a/to-b"),
            ("dangling", "dangling"),
            ("dangling/made", "dangling"),
        ] {
            for create in [false, true] {
                match refusal(dir.path(), path, create) {
                    BeneathError::Symlink { path: at } => assert_eq!(at, Path::new(walked)),
                    other => panic!("{path} (create {create}): {other}"),
                }
            }
        }
        // Nothing was made through the dangling link.
        assert!(!Path::new("/nowhere").exists());
    }

    #[test]
    fn parents_absolute_paths_and_files_are_refused() {
        let dir = tree();
        for bad in ["..", "a/../../etc", "/etc", "a/.."] {
            assert!(
                matches!(
                    refusal(dir.path(), bad, true),
                    BeneathError::NotRelative { .. }
                ),
                "{bad}"
            );
        }
        assert!(matches!(
            refusal(dir.path(), "a/file/x", true),
            BeneathError::NotDirectory { path } if path == Path::new("a/file")
        ));
    }

    #[test]
    fn a_symlinked_root_is_refused() {
        let dir = tree();
        assert!(open_root(&dir.path().join("a/to-root")).is_err());
    }
}
