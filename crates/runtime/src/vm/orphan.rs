//! QEMU processes another server process started: after a restart they
//! still run (in their own process groups) and are found by their pid files.
//! Also the `launched-in` record of a directory whose QEMU was launched in
//! another (a warm VM a sandbox took: see `pool`), by which one is found.

use std::ffi::OsString;
use std::fs;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::confine::Jails;
use super::layout::VmLayout;
use super::qemu;

/// How long a process found through its pid file gets to exit on SIGTERM.
const TERM_TIMEOUT: Duration = Duration::from_secs(10);

/// The live process of a sandbox that another server process started, from
/// its pid file: alive and running QEMU on this sandbox's files (launched
/// on them here, or in the directory `launched-in` names).
pub(super) fn orphan_pid(layout: &VmLayout) -> Option<i32> {
    let pid: i32 = fs::read_to_string(layout.pid_file())
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let mut wanted = vec![qemu::name_argument(&layout.qmp())];
    if let Ok(launched_in) = fs::read(layout.launched_in()) {
        let launched_in = VmLayout::new(OsString::from_vec(launched_in).into());
        wanted.push(qemu::name_argument(&launched_in.qmp()));
    }
    let ours = cmdline
        .split(|b| *b == 0)
        .any(|arg| wanted.iter().any(|w| arg == w.as_bytes()));
    ours.then_some(pid)
}

/// Ends a QEMU process this runtime did not start and waits until it is
/// gone: gracefully with SIGTERM (QEMU flushes its disks and exits), SIGKILL
/// if it lingers; or at once with SIGKILL. Its jail is released after.
pub(super) async fn end_orphan(jails: &Jails, pid: i32, graceful: bool) {
    let jail = jails.adopt(pid);
    // A process the earlier server froze (a warm pause) acts on no signal
    // until thawed.
    if let Some(freezer) = jail.as_ref().map(|jail| jail.freezer()) {
        let _ = tokio::task::spawn_blocking(move || freezer.set(false)).await;
    }
    end_process(pid, graceful).await;
    if let Some(jail) = jail {
        let _ = tokio::task::spawn_blocking(move || jail.release()).await;
    }
}

async fn end_process(pid: i32, graceful: bool) {
    use nix::sys::signal::{kill, Signal};
    let pid = nix::unistd::Pid::from_raw(pid);
    let first = if graceful {
        Signal::SIGTERM
    } else {
        Signal::SIGKILL
    };
    let _ = kill(pid, first);
    let began = Instant::now();
    let mut killed = !graceful;
    // Not our child, so it cannot be waited for; a zombie is gone enough
    // (its parent, init after our restart, reaps it).
    while crate::process_alive(pid.as_raw()) {
        if !killed && began.elapsed() > TERM_TIMEOUT {
            let _ = kill(pid, Signal::SIGKILL);
            killed = true;
        }
        if began.elapsed() > 2 * TERM_TIMEOUT {
            tracing::error!(%pid, "qemu did not end after SIGKILL");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Forgets where the QEMU process of `layout` was launched, once it is gone
/// (or another is about to be launched there): the `launched-in` record and
/// the symbolic link that kept the old name.
pub(super) fn forget_launch(layout: &VmLayout) -> std::io::Result<()> {
    let record = layout.launched_in();
    let launched = match fs::read(&record) {
        Ok(launched) => PathBuf::from(OsString::from_vec(launched)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error),
    };
    if launched.is_symlink() {
        fs::remove_file(&launched)?;
    }
    fs::remove_file(record)
}
