//! A VM's volumes: one `virtiofsd` per volume, serving the volume's host
//! directory over a vhost-user socket that QEMU's `vhost-user-fs-device`
//! connects to; the guest mounts it as `virtiofs` by its tag.
//!
//! virtiofsd runs in its own process group, like QEMU, so it outlives a
//! server restart with the VM it serves, and in the VM's jail (`confine`):
//! its cgroup, and as root of a user namespace that maps the jail's id
//! range (the same map as a container's: guest uid 0 is on-disk uid 0 is
//! host uid `base`), so on the host it is an unprivileged user.
//!
//! The directory it serves is never given to it as a path inside the
//! volume, which sandboxes write (a subpath swapped for a symlink to `/`
//! would serve the host's root): the runtime opens it with
//! [`crate::beneath`] and clones its mount from that descriptor, idmapped
//! through the jail's user namespace; the child, between fork and exec,
//! enters a mount namespace of its own, mounts the clone on `/tmp` there
//! (never on the host's), and enters the user namespace. virtiofsd then
//! sandboxes itself into it (mount namespace and pivot_root), so nothing
//! the guest asks for resolves outside it. Its listening socket is bound
//! here and inherited (`--fd`), and the runtime connects QEMU's end of it
//! before either starts, so neither needs to reach the sandbox's directory.
//! It exits once QEMU, its only client, has gone; the jail's release ends
//! one that did not.
//!
//! QEMU cannot save a machine with a vhost-user-fs device, so a VM with
//! volumes always boots cold and never pauses.

#![allow(unsafe_code)]

use std::fs;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use super::confine::{self, ConfineError, Entry, Jail};
use super::layout::VmLayout;
use crate::beneath::{self, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOSUID};
use crate::VolumeBind;

/// Where the volume is mounted in virtiofsd's own mount namespace: a
/// directory every host has and an unprivileged user can reach.
const SERVED_AT: &std::ffi::CStr = c"/tmp";

/// Why a VM's volumes could not be served.
#[derive(Debug, thiserror::Error)]
pub enum SharesError {
    #[error(transparent)]
    Jail(#[from] ConfineError),
    #[error("cannot {action} {}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{volume}")]
    Volume {
        volume: String,
        #[source]
        source: beneath::BeneathError,
    },
    #[error("{volume}: copy its mount")]
    Mount {
        volume: String,
        #[source]
        source: std::io::Error,
    },
    #[error("start {} for {volume}", virtiofsd.display())]
    Spawn {
        virtiofsd: PathBuf,
        volume: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SharesError {
    let path = path.to_owned();
    move |source| SharesError::Io {
        action,
        path,
        source,
    }
}

/// The mount tag of the `index`th volume, which the guest mounts it by.
pub(super) fn tag(index: usize) -> String {
    format!("cove-vol{index}")
}

/// Where virtiofsd is: `COVE_VIRTIOFSD`, else the first of the usual places
/// (Debian's package, `cargo install`, the PATH).
pub fn find_virtiofsd() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("COVE_VIRTIOFSD") {
        return Some(PathBuf::from(path));
    }
    let mut candidates: Vec<PathBuf> = vec![
        "/usr/libexec/virtiofsd".into(),
        "/usr/lib/qemu/virtiofsd".into(),
    ];
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|dir| dir.join("virtiofsd")));
    }
    candidates.into_iter().find(|p| p.is_file())
}

/// Starts a virtiofsd for each volume, in `jail`, and returns for each a
/// socket connected to it, for QEMU. On failure none of them is left
/// running (the caller releases the jail).
pub(super) async fn start(
    virtiofsd: &Path,
    layout: &VmLayout,
    volumes: &[VolumeBind],
    jail: &Jail,
) -> Result<Vec<OwnedFd>, SharesError> {
    let userns = jail.namespace().await?;
    let entry = jail.entry()?;
    let mut connections = Vec::with_capacity(volumes.len());
    for (index, volume) in volumes.iter().enumerate() {
        let started = start_one(virtiofsd, layout, index, volume, &userns, &entry);
        connections.push(started?);
    }
    Ok(connections)
}

fn start_one(
    virtiofsd: &Path,
    layout: &VmLayout,
    index: usize,
    volume: &VolumeBind,
    userns: &OwnedFd,
    entry: &Entry,
) -> Result<OwnedFd, SharesError> {
    let socket = layout.share_socket(index);
    let _ = fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).map_err(io("listen on", &socket))?;
    // Waits in the listener's queue until virtiofsd accepts it.
    let connection = UnixStream::connect(&socket).map_err(io("connect to", &socket))?;
    let log_path = layout.share_log(index);
    let log = fs::File::create(&log_path).map_err(io("create", &log_path))?;
    let shared = SharedDir::prepare(volume, userns)?;
    let listening = listener.as_raw_fd();
    let mut command = tokio::process::Command::new(virtiofsd);
    command
        .arg("--fd")
        .arg(listening.to_string())
        .arg("--shared-dir")
        .arg(SERVED_AT.to_str().unwrap_or("/tmp"))
        // Another sandbox (a container through a bind mount, or another
        // VM) may change the files at any time: the guest caches nothing.
        .args(["--cache", "never", "--sandbox", "namespace"])
        // Raising the limit needs a capability of the host's namespace.
        .args(["--rlimit-nofile", "0"])
        .args(["--log-level", "error"])
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .process_group(0);
    let tree = shared.tree.as_raw_fd();
    let userns = userns.as_raw_fd();
    let entry = entry.clone();
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it makes system calls on
    // descriptors and data prepared before the fork, and allocates nothing.
    unsafe {
        command.pre_exec(move || enter(&entry, tree, listening, userns));
    }
    let child = command.spawn().map_err(|source| SharesError::Spawn {
        virtiofsd: virtiofsd.to_owned(),
        volume: shared.name.clone(),
        source,
    })?;
    // Dropped without a kill: it lives as long as QEMU (tokio reaps it).
    drop(child);
    Ok(connection.into())
}

fn volume_name(volume: &VolumeBind) -> String {
    let id = volume
        .root
        .file_name()
        .unwrap_or_default()
        .to_string_lossy();
    match &volume.subpath {
        Some(subpath) => format!("volume {id} (subpath {})", subpath.display()),
        None => format!("volume {id}"),
    }
}

/// What a virtiofsd's child needs to mount its volume: a detached clone of
/// the volume directory's mount, idmapped through the jail's namespace.
struct SharedDir {
    name: String,
    tree: OwnedFd,
}

impl SharedDir {
    fn prepare(volume: &VolumeBind, userns: &OwnedFd) -> Result<Self, SharesError> {
        let name = volume_name(volume);
        let subpath = volume.subpath.as_deref().unwrap_or(Path::new(""));
        let dir = beneath::open_dir(&volume.root, subpath, Some(beneath::SHARED_DIR_MODE))
            .map_err(|source| SharesError::Volume {
                volume: name.clone(),
                source,
            })?;
        let tree = beneath::clone_tree_mapped(
            dir.as_fd(),
            MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
            Some(userns.as_fd()),
        )
        .map_err(|source| SharesError::Mount {
            volume: name.clone(),
            source,
        })?;
        Ok(Self { name, tree })
    }
}

/// In the virtiofsd child before exec: the jail's cgroup, a private mount
/// namespace with the volume's clone on [`SERVED_AT`], the listening socket
/// kept open, then root of the jail's user namespace. Allocation-free (see
/// the caller).
fn enter(
    entry: &Entry,
    tree: libc::c_int,
    listening: libc::c_int,
    userns: libc::c_int,
) -> std::io::Result<()> {
    entry.join_cgroup()?;
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
    nix::mount::mount(
        None::<&str>,
        c"/",
        None::<&str>,
        nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE,
        None::<&str>,
    )?;
    beneath::attach_at_path(tree, SERVED_AT)?;
    // SAFETY: plain system calls on descriptors opened before the fork.
    unsafe {
        if libc::fcntl(listening, libc::F_SETFD, 0) != 0
            || libc::setns(userns, libc::CLONE_NEWUSER) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    confine::no_new_privileges()?;
    // SAFETY: id changes inside the new namespace, where 0 is the jail's
    // first host id; root there keeps the capabilities virtiofsd needs
    // over the files of its (idmapped) volume only.
    unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0
            || libc::setresgid(0, 0, 0) != 0
            || libc::setresuid(0, 0, 0) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Removes the sockets of a VM's virtiofsds (the processes end with QEMU,
/// or with the release of its jail).
pub(super) fn end(layout: &VmLayout) {
    for index in 0.. {
        let socket = layout.share_socket(index);
        if fs::remove_file(&socket).is_err() && !layout.share_log(index).exists() {
            break;
        }
    }
}

/// The end of each virtiofsd's log, for an error.
pub(super) fn logs(layout: &VmLayout, count: usize) -> String {
    (0..count)
        .map(|index| {
            let tail = super::machine::log_tail(&layout.share_log(index), 300);
            format!("virtiofsd {index}: {tail}")
        })
        .collect::<Vec<_>>()
        .join("; ")
}
