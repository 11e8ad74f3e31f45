//! A VM's volumes: one `virtiofsd` per volume, serving the volume's host
//! directory over a vhost-user socket that QEMU's `vhost-user-fs-device`
//! connects to; the guest mounts it as `virtiofs` by its tag.
//!
//! virtiofsd runs in its own process group, like QEMU, so it outlives a
//! server restart with the VM it serves. It sandboxes itself into the shared
//! directory (mount namespace and pivot_root), so nothing the guest asks for
//! resolves outside the volume. It exits once QEMU, its only client, has
//! gone; [`end`] is for a VM that never got that far.
//!
//! QEMU cannot save a machine with a vhost-user-fs device, so a VM with
//! volumes always boots cold and never pauses.

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use super::layout::VmLayout;
use super::qemu::Share;
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
    let mut child = tokio::process::Command::new(virtiofsd)
        .arg("--socket-path")
        .arg(&socket)
        .arg("--shared-dir")
        .arg(&volume.source)
        // Another sandbox (a container through a bind mount, or another
        // VM) may change the files at any time: the guest caches nothing.
        .args(["--cache", "never", "--sandbox", "namespace"])
        .args(["--log-level", "error"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(|e| format!("start {}: {e}", virtiofsd.display()))?;
    let pid = child.id().unwrap_or_default();
    fs::write(layout.share_pid(index), pid.to_string())
        .map_err(|e| format!("write {}: {e}", layout.share_pid(index).display()))?;
    let began = Instant::now();
    while !socket.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            let log = fs::read_to_string(&log_path).unwrap_or_default();
            return Err(format!(
                "virtiofsd for volume {} exited ({status}): {}",
                volume.source.display(),
                log.trim()
            ));
        }
        if began.elapsed() > READY_TIMEOUT {
            return Err(format!(
                "virtiofsd for volume {} made no socket within {READY_TIMEOUT:?}",
                volume.source.display()
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
