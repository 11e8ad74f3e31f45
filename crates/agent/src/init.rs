//! `cove-agent init`: the agent as PID 1 of a container.
//!
//! PID 1 forks before any thread exists; the child becomes the server, the
//! parent stays a tiny loop that reaps every zombie (orphans are reparented to
//! it) and forwards termination signals to the server, because the kernel
//! drops signals a PID 1 has no handler for. When the server exits, PID 1
//! exits with its status, which ends the container.
#![allow(unsafe_code)]

use nix::sys::signal::{kill, SigSet, SigmaskHow, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};

/// Signals passed on to the server child.
const FORWARDED: [Signal; 6] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

/// Forks; returns in the child (which goes on to serve), never returns in
/// the parent. Must be called while the process is single-threaded.
pub fn split_off_server() -> nix::Result<()> {
    let all = SigSet::all();
    let mut previous = SigSet::empty();
    // Blocked before the fork so no signal arrives between fork and sigwait.
    nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&all), Some(&mut previous))?;
    // SAFETY: the caller guarantees the process is single-threaded, so the
    // child can safely run arbitrary code after the fork.
    match unsafe { fork() }? {
        ForkResult::Child => {
            nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&previous), None)?;
            Ok(())
        }
        ForkResult::Parent { child } => std::process::exit(supervise(child, &all)),
    }
}

/// The PID 1 loop: wait for a signal, reap or forward, until `server` exits.
fn supervise(server: Pid, signals: &SigSet) -> i32 {
    loop {
        let Ok(signal) = signals.wait() else { continue };
        if FORWARDED.contains(&signal) {
            let _ = kill(server, signal);
        }
        if signal != Signal::SIGCHLD {
            continue;
        }
        // One SIGCHLD may stand for many exits: reap until none is left.
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) if pid == server => return code,
                Ok(WaitStatus::Signaled(pid, signal, _)) if pid == server => {
                    return 128 + signal as i32
                }
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => {}
            }
        }
    }
}
