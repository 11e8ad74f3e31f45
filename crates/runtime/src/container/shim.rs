//! The container shim: `cove __container-init`, a fresh single-threaded process the
//! server spawns per start, with its settings on stdin and a parent-death signal, so it
//! (and with it the container) never outlives the server that supervises it. It unshares the namespaces (or joins the network
//! namespace the network side prepared), binds
//! the agent's listening socket, forks the container init (PID 1 of the new pid namespace),
//! reports `ready <pid>` or `error <message>` on stdout and then supervises: it exits with
//! the init's status, and on SIGTERM/SIGINT/SIGHUP it SIGKILLs the init, which takes the
//! whole pid namespace with it. The shim puts the init into the sandbox's cgroups and
//! stays out of them itself, so the cgroup holds exactly the container's processes. It must run before any thread exists: unshare of the
//! mount namespace and fork both need a single-threaded process.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;

use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::signal::{kill, signal, sigprocmask, SigHandler, SigSet, SigmaskHow, Signal};
use nix::sys::stat::{umask, Mode};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{dup2, execve, fork, pipe2, ForkResult, Pid};
use seccompiler::BpfProgram;

use super::init_args::{InitArgs, ShimReport, LISTEN_FD_ENV};
use super::layout::SandboxLayout;
use super::rootfs::{self, AGENT_PATH};
use super::step::{io, sys, StepError};
use super::{harden, seccomp};
use crate::timeline::Timeline;

/// The most the server writes to a shim's stdin (the settings, env included).
const MAX_ARGS_BYTES: u64 = 16 << 20;

/// Entry point of the shim; the `cove` binary calls it first thing when `argv[1]` is
/// `__container-init`. The settings come on stdin (see `init_args`); stdin is then
/// `/dev/null` for everything after.
pub fn container_init_main() -> ! {
    // A dead init or server must show as EPIPE, not kill the shim; a constructor-run
    // shim (tests) gets here before Rust's runtime has set this.
    // SAFETY: ignoring a signal installs no handler code.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigIgn) };
    let mut timeline = Timeline::start("container shim");
    let args = read_args().and_then(|json| InitArgs::decode(&json).map_err(StepError::Settings));
    // The server names the sandbox beside the report.
    let code = match args {
        Ok(args) => match launch(&args, &mut timeline) {
            Ok(init) => {
                report(&ShimReport::Ready {
                    init_pid: init.as_raw(),
                    steps: timeline.summary(),
                });
                supervise(init)
            }
            Err(error) => {
                report(&ShimReport::Error(error.report()));
                1
            }
        },
        Err(error) => {
            report(&ShimReport::Error(error.report()));
            2
        }
    };
    std::process::exit(code)
}

/// The settings document, read to the end of stdin, which then becomes `/dev/null`.
fn read_args() -> Result<Vec<u8>, StepError> {
    let mut json = Vec::new();
    std::io::stdin()
        .lock()
        .take(MAX_ARGS_BYTES + 1)
        .read_to_end(&mut json)
        .map_err(io(|| "read the settings on stdin".into()))?;
    if json.len() as u64 > MAX_ARGS_BYTES {
        return Err(StepError::Refused(format!(
            "settings on stdin exceed {MAX_ARGS_BYTES} bytes"
        )));
    }
    let null = fs::File::open("/dev/null").map_err(io(|| "open /dev/null".into()))?;
    dup2(null.as_raw_fd(), 0).map_err(sys(|| "stdin from /dev/null".into()))?;
    Ok(json)
}

fn report(report: &ShimReport) {
    let mut out = std::io::stdout().lock();
    // The server may be gone; there is nobody else to tell.
    let _ = out
        .write_all(report.to_line().as_bytes())
        .and_then(|()| out.flush());
}

/// Makes the shim `command` will spawn inherit descriptor `fd` (it is
/// close-on-exec in the server), at the same number.
pub(super) fn inherit(command: &mut tokio::process::Command, fd: i32) {
    // SAFETY: runs in the child between fork and exec, where only async-signal-safe
    // calls are allowed: fcntl is one system call with integer arguments.
    unsafe {
        command.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Makes the shim `command` will spawn get SIGKILL when the thread that spawns it
/// (a runtime worker, living as long as the server) ends: a server that crashes or
/// stops takes its containers with it, and restart recovery brings them back, so no
/// container runs unsupervised. The container init has the same signal for the shim.
pub(super) fn die_with_parent(command: &mut tokio::process::Command) {
    // SAFETY: runs in the child between fork and exec, where only async-signal-safe
    // calls are allowed: prctl is one system call with integer arguments.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn supervised_signals() -> SigSet {
    let mut set = SigSet::empty();
    for sig in [
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
    ] {
        set.add(sig);
    }
    set
}

/// Everything up to a running agent; returns the host pid of the container init.
fn launch(args: &InitArgs, timeline: &mut Timeline) -> Result<Pid, StepError> {
    timeline.step("shim_read_settings");
    let (error_read, go_write, child) = fork_init(args, timeline)?;
    // The first cgroup migration after a quiet spell waits for an RCU grace
    // period (cgroup v1's threadgroup rwsem, 7-15 ms here): done while the init
    // builds its root on the other core, and the init waits for it before exec.
    let joined = join_cgroups(args, child);
    timeline.step("shim_join_cgroups");
    if joined.is_ok() {
        let _ = fs::File::from(go_write).write_all(b"g");
    } else {
        drop(go_write); // EOF: the init gives up before exec
    }
    let message = read_to_end(error_read);
    timeline.step("init_root_and_exec");
    if message.is_empty() && joined.is_ok() {
        return Ok(child); // EOF without a word: execve succeeded
    }
    let _ = waitpid(child, None);
    // An init that failed on its own (and so could not be moved) says why.
    match joined {
        Err(join_error) if message.is_empty() || message == NOT_PLACED => Err(join_error),
        _ => Err(StepError::Init(message)),
    }
}

/// Makes the namespaces and the agent's socket and forks the container init;
/// returns the pipe its report comes on, the pipe that lets it go on, and its pid.
fn fork_init(
    args: &InitArgs,
    timeline: &mut Timeline,
) -> Result<(OwnedFd, OwnedFd, Pid), StepError> {
    let mut flags = CloneFlags::CLONE_NEWUTS | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWPID;
    match &args.network {
        // The network side made and configured the namespace; the container
        // only enters it, before anything in it runs.
        Some(network) => join_network(&network.netns)?,
        None => flags |= CloneFlags::CLONE_NEWNET,
    }
    // Before the PID namespace: the first child forked after that becomes its
    // init, and the namespace dies with it.
    let userns = super::userns::inherited(args.userns_fd)?;
    unshare(flags).map_err(sys(|| "unshare namespaces".into()))?;
    // In the sandbox's network namespace now, joined or new; repeated on every
    // start. It belongs to the host's user namespace, where the sandbox's root
    // has no capability: ports below 1024 must need none, and ping uses ICMP
    // datagram sockets.
    write_sysctl("net/ipv4/ip_unprivileged_port_start", "0")?;
    harden::allow_unprivileged_ping()?;
    timeline.step("shim_namespaces");

    let socket = SandboxLayout {
        dir: args.sandbox_dir.clone(),
    }
    .agent_socket();
    super::layout::check_socket_path(&socket)?;
    match fs::remove_file(&socket) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
            return Err(io(|| format!("remove stale socket {}", socket.display()))(
                err,
            ))
        }
        _ => {}
    }
    // A path socket works across network namespaces; the server connects to it directly.
    let listener =
        UnixListener::bind(&socket).map_err(io(|| format!("bind {}", socket.display())))?;

    // Prepared before fork so the init only applies them.
    let filters = seccomp::seccomp_filters()?;
    let keep = harden::kept_caps(args.keep_mknod);
    let env = exec_env(args, listener.as_raw_fd())?;
    timeline.step("shim_socket_and_filters");

    let (error_read, error_write) = pipe2(OFlag::O_CLOEXEC).map_err(sys(|| "error pipe".into()))?;
    let (go_read, go_write) = pipe2(OFlag::O_CLOEXEC).map_err(sys(|| "go pipe".into()))?;
    let mut old_mask = SigSet::empty();
    sigprocmask(
        SigmaskHow::SIG_BLOCK,
        Some(&supervised_signals()),
        Some(&mut old_mask),
    )
    .map_err(sys(|| "block signals".into()))?;

    // SAFETY: the shim is single-threaded (it runs before the binary starts any thread),
    // so the child may allocate and use any library call.
    match unsafe { fork() }.map_err(sys(|| "fork the container init".into()))? {
        ForkResult::Child => {
            drop(error_read);
            drop(go_write);
            let message = container_init(
                args, &listener, &userns, &filters, keep, &env, &old_mask, go_read,
            );
            let mut pipe = fs::File::from(error_write);
            let _ = pipe.write_all(message.as_bytes());
            // SAFETY: _exit skips the parent's atexit handlers and buffered stdout, which
            // this forked copy must not run or flush.
            unsafe { libc::_exit(1) }
        }
        ForkResult::Parent { child } => {
            timeline.step("shim_fork");
            drop(error_write);
            drop(go_read);
            // Only the container holds the socket now: once it dies, connects fail.
            drop(listener);
            Ok((error_read, go_write, child))
        }
    }
}

fn join_network(netns: &std::path::Path) -> Result<(), StepError> {
    let file = fs::File::open(netns)
        .map_err(io(|| format!("open network namespace {}", netns.display())))?;
    setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(sys(|| {
        format!("join network namespace {}", netns.display())
    }))
}

/// Puts the container init (not the shim) into the sandbox's cgroups: a cgroup kill then
/// ends the container but not the shim, which reaps the init and exits with its status.
fn join_cgroups(args: &InitArgs, init: Pid) -> Result<(), StepError> {
    let pid = init.as_raw().to_string();
    for procs in &args.cgroup_procs {
        fs::write(procs, &pid).map_err(io(|| format!("join cgroup {}", procs.display())))?;
    }
    Ok(())
}

const NOT_PLACED: &str = "the shim did not place the container in its cgroups";

/// Blocks until the shim has put this process into its cgroups; EOF means it failed.
fn wait_for_cgroups(go: OwnedFd) -> Result<(), StepError> {
    let mut byte = [0u8; 1];
    match fs::File::from(go).read(&mut byte) {
        Ok(1) => Ok(()),
        _ => Err(StepError::Refused(NOT_PLACED.to_string())),
    }
}

fn read_to_end(fd: OwnedFd) -> String {
    let mut message = String::new();
    let _ = fs::File::from(fd).read_to_string(&mut message);
    message
}

fn exec_env(args: &InitArgs, listen_fd: RawFd) -> Result<Vec<CString>, StepError> {
    let listen_fd = listen_fd.to_string();
    args.env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .chain([(LISTEN_FD_ENV, listen_fd.as_str())])
        .map(|(k, v)| {
            CString::new(format!("{k}={v}"))
                .map_err(|_| StepError::Refused(format!("env {k} contains a NUL byte")))
        })
        .collect()
}

/// A sysctl of the namespaces the shim is in (`/proc/sys/{name}`).
fn write_sysctl(name: &str, value: &str) -> Result<(), StepError> {
    let path = format!("/proc/sys/{name}");
    fs::write(&path, value).map_err(io(|| format!("write {path}")))
}

/// The forked container init: returns only with the reason it could not exec the agent.
#[allow(clippy::too_many_arguments)]
fn container_init(
    args: &InitArgs,
    listener: &UnixListener,
    userns: &OwnedFd,
    filters: &[BpfProgram],
    keep_caps: u64,
    env: &[CString],
    old_mask: &SigSet,
    go: OwnedFd,
) -> String {
    let result = (|| -> Result<std::convert::Infallible, StepError> {
        die_with_the_shim()?;
        unshare(CloneFlags::CLONE_NEWNS).map_err(sys(|| "unshare mount namespace".into()))?;
        umask(Mode::from_bits_truncate(0o022));
        rootfs::build(args, userns)?;

        // stderr is the console log the server opened; stdout joins it.
        dup2(2, 1).map_err(sys(|| "redirect stdout".into()))?;
        mark_fds_cloexec();
        let fd = listener.as_raw_fd();
        fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty()))
            .map_err(sys(|| "pass the listening socket".into()))?;
        // Rust ignores SIGPIPE and an ignored signal survives execve: give it back.
        // SAFETY: installing the default disposition runs no code of ours.
        unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) }
            .map_err(sys(|| "reset SIGPIPE".into()))?;
        sigprocmask(SigmaskHow::SIG_SETMASK, Some(old_mask), None)
            .map_err(sys(|| "restore signal mask".into()))?;

        wait_for_cgroups(go)?;
        // Its own cgroup is the root of what it sees; then it becomes the
        // sandbox's root, which is no one on the host.
        unshare(CloneFlags::CLONE_NEWCGROUP).map_err(sys(|| "unshare cgroup namespace".into()))?;
        enter_user_namespace(userns)?;
        // Changing its ids cleared the death signal set above; set it again.
        die_with_the_shim()?;
        let path = CString::new(AGENT_PATH).expect("constant has no NUL");
        let argv = [
            CString::new("cove-agent").expect("no NUL"),
            CString::new("init").expect("no NUL"),
        ];
        harden::confine_syscalls(filters)?;
        harden::drop_capabilities(keep_caps)?;
        execve(&path, &argv, env).map_err(sys(|| format!("execve {AGENT_PATH}")))
    })();
    match result {
        Err(error) => error.report(),
        Ok(never) => match never {},
    }
}

/// SIGKILL for the container init when the shim dies. The kernel clears it at
/// every change of the process's user, group or file-system ids.
fn die_with_the_shim() -> Result<(), StepError> {
    // SAFETY: prctl with integer arguments only.
    if unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        )
    } != 0
    {
        return Err(StepError::Io {
            step: "set parent death signal".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Joins the sandbox's user namespace as its root (host ids `id_base`): the
/// capabilities kept from here on are the namespace's, over its own ids only.
fn enter_user_namespace(userns: &OwnedFd) -> Result<(), StepError> {
    use nix::unistd::{setgroups, setresgid, setresuid, Gid, Uid};
    setns(userns.as_fd(), CloneFlags::CLONE_NEWUSER)
        .map_err(sys(|| "join the user namespace".into()))?;
    setgroups(&[]).map_err(sys(|| "clear groups".into()))?;
    let root = (Gid::from_raw(0), Uid::from_raw(0));
    setresgid(root.0, root.0, root.0).map_err(sys(|| "become the sandbox's root group".into()))?;
    setresuid(root.1, root.1, root.1).map_err(sys(|| "become the sandbox's root".into()))
}

/// Descriptors the shim inherited or opened must not reach the agent.
fn mark_fds_cloexec() {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range only changes descriptor flags; failure (old kernel) leaves
    // Rust's default of CLOEXEC on everything it opened.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        )
    };
}

/// Waits for the container init; forwards a stop request as SIGKILL to it.
fn supervise(init: Pid) -> i32 {
    let signals = supervised_signals();
    loop {
        let Ok(sig) = signals.wait() else { continue };
        if sig != Signal::SIGCHLD {
            // PID 1 of a namespace ignores SIGTERM unless it handles it; SIGKILL from the
            // parent namespace always ends it and every process in its namespace.
            let _ = kill(init, Signal::SIGKILL);
            continue;
        }
        match waitpid(init, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => return code,
            Ok(WaitStatus::Signaled(_, sig, _)) => return 128 + sig as i32,
            Ok(_) => {}
            Err(_) => return 1,
        }
    }
}
