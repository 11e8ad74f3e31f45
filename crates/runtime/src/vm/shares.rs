//! A VM's volumes: one `virtiofsd` per volume, serving the volume's host
//! directory over a vhost-user socket that QEMU's `vhost-user-fs-device`
//! connects to; the guest mounts it as `virtiofs` by its tag.
//!
//! virtiofsd runs in its own process group, like QEMU, so it outlives a
//! server restart with the VM it serves. The directory it serves is never
//! given to it as a path inside the volume, which sandboxes write (a subpath
//! swapped for a symlink to `/` would serve the host's root): the runtime
//! opens it with [`crate::beneath`], clones its mount from that descriptor,
//! and the child, between fork and exec, enters a mount namespace of its own
//! and mounts the clone on an empty host-owned directory, which is what
//! virtiofsd serves. virtiofsd then sandboxes itself into it (mount namespace
//! and pivot_root), so nothing the guest asks for resolves outside it. It exits once QEMU, its only client, has
//! gone; [`end`] is for a VM that never got that far.
//!
//! QEMU cannot save a machine with a vhost-user-fs device, so a VM with
//! volumes always boots cold and never pauses.

#![allow(unsafe_code)]

use std::ffi::{CStr, CString};
use std::fs;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use super::layout::VmLayout;
use super::qemu::Share;
use crate::beneath::{self, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOSUID};
use crate::VolumeBind;

/// How long virtiofsd may take to make its socket.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

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

/// Starts a virtiofsd for each volume and returns the shares QEMU gets,
/// once every socket is there. On failure none of them is left running.
pub(super) async fn start(
    virtiofsd: &Path,
    layout: &VmLayout,
    volumes: &[VolumeBind],
) -> Result<Vec<Share>, String> {
    let mut shares = Vec::with_capacity(volumes.len());
    for (index, volume) in volumes.iter().enumerate() {
        match start_one(virtiofsd, layout, index, volume).await {
            Ok(share) => shares.push(share),
            Err(reason) => {
                end(layout).await;
                return Err(reason);
            }
        }
    }
    Ok(shares)
}

async fn start_one(
    virtiofsd: &Path,
    layout: &VmLayout,
    index: usize,
    volume: &VolumeBind,
) -> Result<Share, String> {
    let socket = layout.share_socket(index);
    let _ = fs::remove_file(&socket);
    let log_path = layout.share_log(index);
    let log =
        fs::File::create(&log_path).map_err(|e| format!("create {}: {e}", log_path.display()))?;
    let shared = SharedDir::prepare(layout, index, volume)?;
    let mut command = tokio::process::Command::new(virtiofsd);
    command
        .arg("--socket-path")
        .arg(&socket)
        .arg("--shared-dir")
        .arg(&shared.mount_point)
        // Another sandbox (a container through a bind mount, or another
        // VM) may change the files at any time: the guest caches nothing.
        .args(["--cache", "never", "--sandbox", "namespace"])
        .args(["--log-level", "error"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .process_group(0);
    let tree = shared.tree.as_raw_fd();
    let target = shared.mount_point_c.clone();
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it makes system calls on a
    // descriptor and C strings prepared before the fork, and allocates nothing.
    unsafe {
        command.pre_exec(move || enter_shared_dir(tree, &target));
    }
    let mut child = command
        .spawn()
        .map_err(|e| format!("start {} for {}: {e}", virtiofsd.display(), shared.name))?;
    drop(shared);
    let pid = child.id().unwrap_or_default();
    fs::write(layout.share_pid(index), pid.to_string())
        .map_err(|e| format!("write {}: {e}", layout.share_pid(index).display()))?;
    let began = Instant::now();
    while !socket.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            let log = fs::read_to_string(&log_path).unwrap_or_default();
            return Err(format!(
                "virtiofsd for {} exited ({status}): {}",
                volume_name(volume),
                log.trim()
            ));
        }
        if began.elapsed() > READY_TIMEOUT {
            return Err(format!(
                "virtiofsd for {} made no socket within {READY_TIMEOUT:?}",
                volume_name(volume)
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Dropped without a kill: it lives as long as QEMU (tokio reaps it).
    drop(child);
    Ok(Share {
        tag: tag(index),
        socket,
    })
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
/// the volume directory's mount, and the empty directory to put it on.
struct SharedDir {
    name: String,
    tree: OwnedFd,
    mount_point: PathBuf,
    mount_point_c: CString,
}

impl SharedDir {
    fn prepare(layout: &VmLayout, index: usize, volume: &VolumeBind) -> Result<Self, String> {
        let name = volume_name(volume);
        let subpath = volume.subpath.as_deref().unwrap_or(Path::new(""));
        let dir = beneath::open_dir(&volume.root, subpath, true)
            .map_err(|error| format!("{name}: {error}"))?;
        let tree = beneath::clone_tree(dir.as_fd(), MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
            .map_err(|error| format!("{name}: copy its mount: {error}"))?;
        let mount_point = layout.share_mount(index);
        match fs::create_dir(&mount_point) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(format!("create {}: {e}", mount_point.display()))
            }
            _ => {}
        }
        let mount_point_c = CString::new(mount_point.as_os_str().as_bytes())
            .map_err(|_| format!("{} contains a NUL byte", mount_point.display()))?;
        Ok(Self {
            name,
            tree,
            mount_point,
            mount_point_c,
        })
    }
}

/// In the virtiofsd child before exec: a private mount namespace, the
/// volume's clone mounted on `target`. Allocation-free (see the caller).
fn enter_shared_dir(tree: libc::c_int, target: &CStr) -> std::io::Result<()> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
    nix::mount::mount(
        None::<&str>,
        c"/",
        None::<&str>,
        nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE,
        None::<&str>,
    )?;
    beneath::attach_at_path(tree, target)
}

/// Ends the virtiofsd processes of `layout` that still run, found by their
/// pid files (and recognised by their socket argument, so a reused pid is
/// left alone).
pub(super) async fn end(layout: &VmLayout) {
    for index in 0.. {
        let pid_file = layout.share_pid(index);
        let Ok(text) = fs::read_to_string(&pid_file) else {
            break;
        };
        if let Ok(pid) = text.trim().parse::<i32>() {
            if serves(pid, &layout.share_socket(index)) {
                super::orphan::end_orphan(pid, false).await;
            }
        }
        let _ = fs::remove_file(&pid_file);
        let _ = fs::remove_file(layout.share_socket(index));
        let _ = fs::remove_dir(layout.share_mount(index));
    }
}

/// Whether process `pid` is a virtiofsd serving `socket`.
fn serves(pid: i32, socket: &Path) -> bool {
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    cmdline
        .split(|b| *b == 0)
        .any(|arg| arg == socket.as_os_str().as_bytes())
}
