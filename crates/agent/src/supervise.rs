//! `cove-agent supervise PID`: what a container shim becomes once its init
//! runs (see the runtime's `container::shim`). It runs on the host, outside
//! every sandbox namespace, as the shim did, and only waits: it exits with the
//! init's status, and on SIGTERM, SIGINT or SIGHUP it SIGKILLs the init, which
//! takes the whole PID namespace with it. The shim execs this small static
//! binary rather than staying itself so that each sandbox does not keep a
//! private copy of the server binary's relocated data.
//!
//! The shim blocked these signals before it forked the init and the block
//! survives the exec; a signal that arrived in between is still pending, so
//! none is lost. The init is this process's child (an exec keeps the pid).

use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// The signals the shim blocked; the same set is waited for here.
fn supervised() -> SigSet {
    let mut set = SigSet::empty();
    for signal in [
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
    ] {
        set.add(signal);
    }
    set
}

/// Waits for the init `pid` to end and returns the exit code the shim's
/// parent reads: the init's own, 128 + its signal, or 1 if it is not this
/// process's child.
pub fn supervise(pid: i32) -> i32 {
    let init = Pid::from_raw(pid);
    let signals = supervised();
    // Blocked already when the shim exec'd this; blocked again in case a
    // caller did not, so that sigwait receives them.
    let _ = signals.thread_block();
    loop {
        // An init that ended before the exec left a zombie and a pending
        // SIGCHLD; the check first makes either enough.
        match waitpid(init, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => return code,
            Ok(WaitStatus::Signaled(_, signal, _)) => return 128 + signal as i32,
            Ok(_) => {}
            Err(_) => return 1,
        }
        let Ok(signal) = signals.wait() else { continue };
        if signal != Signal::SIGCHLD {
            // PID 1 of a namespace ignores SIGTERM unless it handles it;
            // SIGKILL from the parent namespace always ends it.
            let _ = kill(init, Signal::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn a_child_that_is_not_ours_is_reported_as_one() {
        // pid 1 is never this test's child.
        assert_eq!(supervise(1), 1);
    }

    #[test]
    fn the_supervisor_passes_on_the_exit_code_of_an_init_that_already_ended() {
        let child = Command::new("sh").args(["-c", "exit 7"]).spawn().unwrap();
        let pid = child.id() as i32;
        // Not waited for by `Child`: left a zombie for the supervisor.
        std::mem::forget(child);
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(supervise(pid), 7);
    }
}
