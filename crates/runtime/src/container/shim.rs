//! The container shim: `cove __container-init SUPERVISOR SERVER_PID`, a fresh
//! single-threaded process the server spawns, which first sets itself a parent-death
//! signal, so it (and with it the container) never outlives the server that
//! supervises it. It is made for no sandbox: it unshares a PID
//! namespace, forks the container init (PID 1 of it) and reports `waiting <pid>`; the
//! server puts that init into cgroups (the slow step on cgroup v1, done ahead of any
//! request when the shim waits in the pool) and, when a sandbox starts, sends the
//! sandbox's settings with its user namespace and console log as descriptors on the
//! shim's stdin, a Unix socket only the init reads. The init joins or makes the
//! sandbox's other namespaces, binds the agent's listening socket, builds the root and
//! execs the agent; the shim reports `ready <pid> <steps>` or `error <message>` on
//! stdout and then supervises: it exits with the init's status, and on
//! SIGTERM/SIGINT/SIGHUP it SIGKILLs the init, which takes the whole pid namespace with
//! it. The shim itself stays out of the cgroups, so they hold exactly the container's
//! processes. It must run before any thread exists: fork needs a single-threaded
//! process. Nothing a sandbox controls runs before the agent's exec, which happens
//! only after the settings came, in the sandbox's user namespace, with its
//! capabilities cut and its seccomp filter on.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;

use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::signal::{kill, signal, sigprocmask, SigHandler, SigSet, SigmaskHow, Signal};
use nix::sys::stat::{umask, Mode};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{dup2, execve, fork, pipe2, ForkResult, Pid};

use super::init_args::{InitArgs, ShimReport, LISTEN_FD_ENV};
use super::layout::SandboxLayout;
use super::rootfs::{self, AGENT_PATH};
use super::step::{io, sys, StepError};
use super::{harden, seccomp};
use crate::timeline::Timeline;

/// The most the server sends a shim's init (the settings, env included).
pub(super) const MAX_ARGS_BYTES: u64 = 16 << 20;

/// How the init tells the shim, before its exec, how long its steps took.
const STEPS_PREFIX: &str = "ok ";

/// Entry point of the shim; the `cove` binary calls it first thing when `argv[1]` is
/// `__container-init`.
pub fn container_init_main() -> ! {
    // A dead init or server must show as EPIPE, not kill the shim; a constructor-run
    // shim (tests) gets here before Rust's runtime has set this.
    // SAFETY: ignoring a signal installs no handler code.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigIgn) };
    let code = match die_with_server(server_pid()).and_then(|()| fork_init()) {
        Ok((init, reports)) => {
            report(&ShimReport::Waiting {
                init_pid: init.as_raw(),
            });
            // Only the init reads the settings: if it dies, the server's send fails
            // rather than waits.
            let _ = stdin_from_null();
            match await_exec(init, reports) {
                Ok(steps) => {
                    report(&ShimReport::Ready {
                        init_pid: init.as_raw(),
                        steps,
                    });
                    hand_over_supervision(init);
                    supervise(init)
                }
                Err(error) => {
                    report(&ShimReport::Error(error.report()));
                    1
                }
            }
        }
        Err(error) => {
            report(&ShimReport::Error(error.report()));
            2
        }
    };
    std::process::exit(code)
}

/// The argument after the subcommand: the small static program that
/// supervises the init once it runs (`cove-agent supervise PID`).
fn supervisor() -> Option<CString> {
    let path = std::env::args_os().nth(2)?;
    CString::new(path.into_encoded_bytes()).ok()
}

/// The argument after that: the pid of the server that spawned this shim.
fn server_pid() -> Option<i32> {
    std::env::args().nth(3)?.parse().ok()
}

/// Replaces this process with the supervisor, which then does what
/// [`supervise`] does. This binary is large and position-independent: its
/// relocated read-only data (~1.2 MiB) is private to each process once the
/// init's exec leaves this one the last to map it; the supervisor's is a few
/// KiB. Everything the supervision needs survives the exec: the init stays
/// this pid's child, the blocked signals stay blocked (one that came in the
/// meantime stays pending), and the parent-death signal stays set. Returns
/// only if there is no supervisor or the exec failed; the caller then
/// supervises itself.
fn hand_over_supervision(init: Pid) {
    let Some(program) = supervisor() else { return };
    let args = [
        c"cove-agent".to_owned(),
        c"supervise".to_owned(),
        CString::new(init.as_raw().to_string()).expect("digits hold no NUL"),
    ];
    let env: [CString; 0] = [];
    let _ = execve(&program, &args, &env);
}

fn stdin_from_null() -> Result<(), StepError> {
    let null = fs::File::open("/dev/null").map_err(io(|| "open /dev/null".into()))?;
    dup2(null.as_raw_fd(), 0).map_err(sys(|| "stdin from /dev/null".into()))?;
    Ok(())
}

fn report(report: &ShimReport) {
    let mut out = std::io::stdout().lock();
    // The server may be gone; there is nobody else to tell.
    let _ = out
        .write_all(report.to_line().as_bytes())
        .and_then(|()| out.flush());
}

/// Makes this shim get SIGKILL when the thread that spawned it (a runtime worker,
/// living as long as the server) ends: a server that crashes or stops takes its
/// containers with it, and restart recovery brings them back, so no container runs
/// unsupervised. The container init has the same signal for the shim.
///
/// The shim sets it itself, first thing, rather than the server between fork and
/// exec: a spawn with no code to run in the child is a `posix_spawn` (a vfork),
/// which copies none of the server's page tables. A fork did, holding the server's
/// memory map locked meanwhile, which stalled every server thread that faulted a
/// page, at the moment a start had just answered. `server` is the pid the spawner
/// gave: a parent that already died before the signal was set shows as another.
fn die_with_server(server: Option<i32>) -> Result<(), StepError> {
    die_with_parent()?;
    match server {
        Some(pid) if nix::unistd::getppid().as_raw() != pid => Err(StepError::Refused(format!(
            "the server (pid {pid}) ended before the shim started"
        ))),
        _ => Ok(()),
    }
}

/// Sets the niceness of the single-threaded process `pid` (a shim or its init,
/// which the server made and which have one thread each).
pub(super) fn reprioritise(pid: u32, nice: i32) -> std::io::Result<()> {
    // SAFETY: one system call with integer arguments.
    match unsafe { libc::setpriority(libc::PRIO_PROCESS, pid, nice) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
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

/// Forks the container init into a new PID namespace; returns its pid and the pipe
/// its report comes on. The init waits for its settings.
fn fork_init() -> Result<(Pid, OwnedFd), StepError> {
    let (report_read, report_write) =
        pipe2(OFlag::O_CLOEXEC).map_err(sys(|| "report pipe".into()))?;
    let mut old_mask = SigSet::empty();
    sigprocmask(
        SigmaskHow::SIG_BLOCK,
        Some(&supervised_signals()),
        Some(&mut old_mask),
    )
    .map_err(sys(|| "block signals".into()))?;
    // The first child forked after this becomes the namespace's init, and the
    // namespace dies with it.
    unshare(CloneFlags::CLONE_NEWPID).map_err(sys(|| "unshare the PID namespace".into()))?;
    // SAFETY: the shim is single-threaded (it runs before the binary starts any thread),
    // so the child may allocate and use any library call.
    match unsafe { fork() }.map_err(sys(|| "fork the container init".into()))? {
        ForkResult::Child => {
            drop(report_read);
            let mut pipe = fs::File::from(report_write);
            let message = container_init(&mut pipe, &old_mask);
            let _ = pipe.write_all(message.as_bytes());
            // SAFETY: _exit skips the parent's atexit handlers and buffered stdout, which
            // this forked copy must not run or flush.
            unsafe { libc::_exit(1) }
        }
        ForkResult::Parent { child } => Ok((child, report_read)),
    }
}

/// Waits for the init's exec: end of file after its steps means it ran the agent.
fn await_exec(init: Pid, reports: OwnedFd) -> Result<String, StepError> {
    let message = read_to_end(reports);
    let (steps, rest) = match message.strip_prefix(STEPS_PREFIX) {
        Some(after) => after.split_once('\n').unwrap_or((after, "")),
        None => ("", message.as_str()),
    };
    if !rest.is_empty() {
        let _ = waitpid(init, None);
        return Err(StepError::Init(rest.to_owned()));
    }
    // `<when the init was about to exec> <its steps>`
    let Some((exec_began, steps)) = steps.split_once(' ') else {
        let _ = waitpid(init, None);
        return Err(StepError::Refused(
            "the container init ended before it was given a sandbox".into(),
        ));
    };
    let exec_us =
        crate::timeline::monotonic_ns().saturating_sub(exec_began.parse().unwrap_or(0)) / 1000;
    Ok(format!(
        "{steps} init_exec={:.2}ms",
        exec_us as f64 / 1000.0
    ))
}

/// The settings, the sandbox's user namespace and its console log, as the server
/// sends them on stdin: a 16-byte header (the settings' length and when they were
/// sent, on the monotonic clock) with both descriptors attached, then the settings
/// document. Returns the time they were sent too.
fn receive_settings() -> Result<(InitArgs, OwnedFd, OwnedFd, u64), StepError> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut header = [0u8; 16];
    let mut space = nix::cmsg_space!([RawFd; 2]);
    let (got, fds) = {
        let mut parts = [std::io::IoSliceMut::new(&mut header)];
        let message = recvmsg::<()>(0, &mut parts, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
            .map_err(sys(|| "receive the settings".into()))?;
        let mut fds = Vec::new();
        for cmsg in message
            .cmsgs()
            .map_err(sys(|| "read the descriptors".into()))?
        {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                // SAFETY: the kernel just installed these descriptors for this
                // process; nothing else owns them.
                fds.extend(
                    received
                        .into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        (message.bytes, fds)
    };
    if got == 0 {
        return Err(StepError::Refused("the server sent no settings".into()));
    }
    let mut stdin = std::io::stdin().lock();
    stdin
        .read_exact(&mut header[got..])
        .map_err(io(|| "read the settings' length".into()))?;
    let len = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
    let sent_ns = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
    if len > MAX_ARGS_BYTES {
        return Err(StepError::Refused(format!(
            "settings exceed {MAX_ARGS_BYTES} bytes"
        )));
    }
    let mut json = vec![0u8; len as usize];
    stdin
        .read_exact(&mut json)
        .map_err(io(|| "read the settings".into()))?;
    let args = InitArgs::decode(&json).map_err(StepError::Settings)?;
    let mut fds = fds.into_iter();
    let (Some(userns), Some(console), None) = (fds.next(), fds.next(), fds.next()) else {
        return Err(StepError::Refused(
            "the settings came without exactly a user namespace and a console".into(),
        ));
    };
    // `inherited` owns the number from here (a refused one is left to the exit).
    let userns = super::userns::inherited(std::os::fd::IntoRawFd::into_raw_fd(userns))?;
    Ok((args, userns, console, sent_ns))
}

/// Joins or makes the sandbox's network namespace and makes its UTS and IPC ones.
fn enter_namespaces(args: &InitArgs) -> Result<(), StepError> {
    let mut flags = CloneFlags::CLONE_NEWUTS | CloneFlags::CLONE_NEWIPC;
    match &args.network {
        // The network side made and configured the namespace; the container
        // only enters it, before anything in it runs.
        Some(network) => join_network(&network.netns)?,
        None => flags |= CloneFlags::CLONE_NEWNET,
    }
    unshare(flags).map_err(sys(|| "unshare namespaces".into()))?;
    // In the sandbox's network namespace now, joined or new; repeated on every
    // start. It belongs to the host's user namespace, where the sandbox's root
    // has no capability: ports below 1024 must need none, and ping uses ICMP
    // datagram sockets.
    write_sysctl("net/ipv4/ip_unprivileged_port_start", "0")?;
    harden::allow_unprivileged_ping()
}

/// The agent's listening socket, bound in the sandbox's directory.
fn bind_agent_socket(args: &InitArgs) -> Result<UnixListener, StepError> {
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
    UnixListener::bind(&socket).map_err(io(|| format!("bind {}", socket.display())))
}

fn join_network(netns: &std::path::Path) -> Result<(), StepError> {
    let file = fs::File::open(netns)
        .map_err(io(|| format!("open network namespace {}", netns.display())))?;
    setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(sys(|| {
        format!("join network namespace {}", netns.display())
    }))
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

/// The forked container init: waits for its sandbox's settings, then makes the
/// sandbox and execs its agent; returns only with the reason it could not. Its
/// steps' times go to `report` just before the exec.
fn container_init(report: &mut fs::File, old_mask: &SigSet) -> String {
    let result = (|| -> Result<std::convert::Infallible, StepError> {
        die_with_parent()?;
        let (args, userns, console, sent_ns) = receive_settings()?;
        let mut timeline = Timeline::start("container init");
        timeline.step_since("init_woken", sent_ns);
        stdin_from_null()?;
        // stderr is the console log the server opened; stdout joins it.
        dup2(console.as_raw_fd(), 2).map_err(sys(|| "redirect stderr".into()))?;
        dup2(2, 1).map_err(sys(|| "redirect stdout".into()))?;
        drop(console);
        timeline.step("init_settings");
        enter_namespaces(&args)?;
        timeline.step("init_namespaces");
        let listener = bind_agent_socket(&args)?;
        let filters = seccomp::seccomp_filters()?;
        let keep = harden::kept_caps(args.keep_mknod);
        let env = exec_env(&args, listener.as_raw_fd())?;
        timeline.step("init_socket_and_filters");

        unshare(CloneFlags::CLONE_NEWNS).map_err(sys(|| "unshare mount namespace".into()))?;
        umask(Mode::from_bits_truncate(0o022));
        rootfs::build(&args, &userns)?;
        timeline.step("init_root");

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

        // The server placed this process in the sandbox's cgroups before it sent
        // the settings. Its own cgroup is the root of what it sees; then it
        // becomes the sandbox's root, which is no one on the host.
        unshare(CloneFlags::CLONE_NEWCGROUP).map_err(sys(|| "unshare cgroup namespace".into()))?;
        enter_user_namespace(&userns)?;
        // Changing its ids cleared the death signal set above; set it again.
        die_with_parent()?;
        let path = CString::new(AGENT_PATH).expect("constant has no NUL");
        let argv = [
            CString::new("cove-agent").expect("no NUL"),
            CString::new("init").expect("no NUL"),
        ];
        timeline.step("init_enter");
        harden::confine_syscalls(&filters)?;
        harden::drop_capabilities(keep)?;
        timeline.step("init_confine");
        // The report pipe is close-on-exec: the shim sees these steps, then its end.
        let _ = report.write_all(
            format!(
                "{STEPS_PREFIX}{} {}\n",
                crate::timeline::monotonic_ns(),
                timeline.summary()
            )
            .as_bytes(),
        );
        execve(&path, &argv, &env).map_err(sys(|| format!("execve {AGENT_PATH}")))
    })();
    match result {
        Err(error) => error.report(),
        Ok(never) => match never {},
    }
}

/// SIGKILL for this process when its parent dies: the shim's is the server,
/// the container init's the shim. The kernel clears it at every change of the
/// process's user, group or file-system ids.
fn die_with_parent() -> Result<(), StepError> {
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
