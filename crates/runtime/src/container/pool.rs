//! Shims made ahead of the sandboxes they will serve: each one's container init is
//! forked and already waits in cgroups of its own, so a start only renames those
//! cgroups to the sandbox, writes its limits and sends its settings. Joining a cgroup
//! is the slow step of a container start on cgroup v1 (the first migration after a
//! quiet spell waits for an RCU grace period, 8-15 ms here), and spawning the shim
//! costs another 1.5 ms; both happen here in the background.
//!
//! A waiting shim is made for no sandbox and is used by exactly one: the pool hands
//! each out once, and what is left at shutdown is killed and its cgroups removed
//! ([`ShimPool::close`]). Its cgroups are named `pool@{tag}.{n}` beside the sandboxes'
//! (a sandbox id never holds `@`); the tag is the server's state directory's, so a
//! new server sweeps what a crashed one of its own left ([`ShimMaker::sweep`]) and
//! never another server's. The waiting init is the server's own code running as host
//! root, blocked on a socket only the server writes to; nothing of a sandbox runs in
//! it until it has become that sandbox's root (see `shim`).
//!
//! Cgroup v2 cannot rename a cgroup, so there the pool stays empty and every start
//! makes its shim on the request path.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

use super::cgroup::{self, CgroupBackend, CgroupLimits};
use super::init_args::{InitArgs, ShimReport, SUBCOMMAND};
use super::shim;
use crate::RuntimeError;

/// How long a shim may take to fork its init and say so.
const WAITING_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `close` waits for a refill in flight.
const REFILL_WAIT: Duration = Duration::from_secs(10);
/// The niceness a shim is made at for the pool: the lowest, so that loading
/// and relocating the binary (~3 ms of CPU) and forking the init take only CPU
/// time that no start, command or store write wants. At normal priority they
/// landed in the middle of the start that took the previous shim, and on 2
/// cores held its store write off the CPU for as long.
const POOL_NICE: i32 = 19;

/// A shim whose container init waits, in the cgroups named `cgroup`, for a sandbox.
pub(super) struct WaitingShim {
    pub(super) child: Child,
    pub(super) reports: BufReader<ChildStdout>,
    /// The server's end of the shim's stdin.
    control: UnixStream,
    pub(super) init_pid: i32,
    /// The name its cgroups have now.
    pub(super) cgroup: String,
}

impl WaitingShim {
    /// Sends the init its sandbox: `args`, with the sandbox's user namespace and
    /// console log attached. Blocks (small writes into a socket buffer, unless the
    /// environment is large).
    pub(super) fn send(
        &self,
        args: &InitArgs,
        userns: &OwnedFd,
        console: &OwnedFd,
    ) -> io::Result<()> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        use std::io::Write;
        let json = args.encode();
        if json.len() as u64 > shim::MAX_ARGS_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("settings exceed {} bytes", shim::MAX_ARGS_BYTES),
            ));
        }
        // The length, then when it was sent (the init times its wake-up).
        let mut header = [0u8; 16];
        header[..8].copy_from_slice(&(json.len() as u64).to_le_bytes());
        header[8..].copy_from_slice(&crate::timeline::monotonic_ns().to_le_bytes());
        let fds = [userns.as_raw_fd(), console.as_raw_fd()];
        let attached = [ControlMessage::ScmRights(&fds)];
        let mut sent = sendmsg::<()>(
            self.control.as_raw_fd(),
            &[io::IoSlice::new(&header)],
            &attached,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(io::Error::from)?;
        let mut control = &self.control;
        while sent < header.len() {
            sent += control.write(&header[sent..])?;
        }
        control.write_all(json.as_bytes())
    }

    /// Whether the shim and its init still wait (neither has exited; an init
    /// that died is a zombie of the shim until the shim notices).
    pub(super) fn is_alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None)) && crate::process_alive(self.init_pid)
    }

    /// Raises a shim made for the pool, and its init, to the normal priority:
    /// from now on they are a sandbox's start. The shim is still the server's
    /// unreaped child, so its pid is its own; the init is checked alive just
    /// before (`is_alive`).
    pub(super) fn to_normal_priority(&self) -> io::Result<()> {
        let shim = self
            .child
            .id()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the shim has been reaped"))?;
        shim::reprioritise(shim, 0)?;
        shim::reprioritise(self.init_pid as u32, 0)
    }
}

/// What makes waiting shims: the binary, the cgroups, the limits of a pool cgroup.
pub(super) struct ShimMaker {
    pub(super) init_exe: PathBuf,
    /// What a shim execs into to supervise its running init (the agent
    /// binary's `supervise` mode; see `shim`).
    supervisor: PathBuf,
    pub(super) cgroups: Arc<dyn CgroupBackend>,
    pub(super) pids_max: u64,
    /// Names this server's pool cgroups: `pool@{tag}.`.
    pub(super) prefix: String,
    next: AtomicU32,
}

impl ShimMaker {
    pub(super) fn new(
        init_exe: PathBuf,
        supervisor: PathBuf,
        cgroups: Arc<dyn CgroupBackend>,
        pids_max: u64,
        state_dir: &std::path::Path,
    ) -> Self {
        Self {
            init_exe,
            supervisor,
            cgroups,
            pids_max,
            prefix: format!(
                "pool@{:016x}.",
                fnv1a(state_dir.as_os_str().as_encoded_bytes())
            ),
            next: AtomicU32::new(0),
        }
    }

    /// Spawns a shim at niceness `nice` and waits for its init's pid. Must run
    /// on a thread that lives as long as the server (a runtime worker, not a
    /// blocking-pool thread): the shim dies with the thread that spawned it.
    pub(super) async fn spawn(&self, id: &str, nice: i32) -> Result<WaitingShim, RuntimeError> {
        let (control, theirs) = UnixStream::pair().map_err(|source| RuntimeError::Io {
            id: id.to_owned(),
            action: "make the shim's socket".into(),
            source,
        })?;
        let mut command = Command::new(&self.init_exe);
        command
            .arg(SUBCOMMAND)
            .arg(&self.supervisor)
            .arg(std::process::id().to_string())
            .env_clear()
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // No pre-exec code: the spawn stays a vfork (see `shim::die_with_server`).
        let mut child = command.spawn().map_err(|source| RuntimeError::Io {
            id: id.to_owned(),
            action: format!("spawn {}", self.init_exe.display()),
            source,
        })?;
        // The spawn returned at the exec: the shim has yet to load and
        // relocate the binary (most of its cost) and to fork its init, which
        // inherits this.
        if let (Some(pid), true) = (child.id(), nice != 0) {
            if let Err(error) = shim::reprioritise(pid, nice) {
                tracing::debug!(pid, %error, "a pool shim keeps the normal priority");
            }
        }
        let mut reports = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let mut line = String::new();
        let read = tokio::time::timeout(WAITING_TIMEOUT, reports.read_line(&mut line)).await;
        let failure = match read {
            Ok(Ok(n)) if n > 0 => match ShimReport::parse(&line) {
                Ok(ShimReport::Waiting { init_pid }) => {
                    return Ok(WaitingShim {
                        child,
                        reports,
                        control,
                        init_pid,
                        cgroup: String::new(),
                    })
                }
                Ok(ShimReport::Error(report)) => RuntimeError::Shim {
                    id: id.to_owned(),
                    report,
                },
                Ok(ShimReport::Ready { .. }) | Err(_) => {
                    RuntimeError::start(id, format!("unexpected shim report {line:?}"))
                }
            },
            Ok(Ok(_)) => RuntimeError::start(id, "the shim exited without forking its init"),
            Ok(Err(source)) => RuntimeError::Io {
                id: id.to_owned(),
                action: "read the shim's report".into(),
                source,
            },
            Err(_) => RuntimeError::start(
                id,
                format!("the shim did not fork its init within {WAITING_TIMEOUT:?}"),
            ),
        };
        let _ = child.start_kill();
        let _ = child.wait().await;
        Err(failure)
    }

    /// Makes cgroups named `name` with `limits` and moves the shim's init into them
    /// (the slow step). On failure the shim is ended and the cgroups removed.
    pub(super) async fn place(
        &self,
        mut shim: WaitingShim,
        name: &str,
        limits: CgroupLimits,
    ) -> Result<WaitingShim, RuntimeError> {
        let cgroups = Arc::clone(&self.cgroups);
        let (owned, pid) = (name.to_owned(), shim.init_pid);
        let placed = tokio::task::spawn_blocking(move || {
            cgroups.create(&owned, &limits)?;
            cgroups.join(&owned, pid)
        })
        .await;
        shim.cgroup = name.to_owned();
        match placed {
            Ok(Ok(())) => Ok(shim),
            Ok(Err(source)) => {
                self.discard(shim).await;
                Err(RuntimeError::Cgroup {
                    id: name.to_owned(),
                    source,
                })
            }
            Err(source) => {
                self.discard(shim).await;
                Err(RuntimeError::Task {
                    id: name.to_owned(),
                    what: "place the shim",
                    source,
                })
            }
        }
    }

    /// A waiting shim in cgroups of the pool (no CPU or memory limit: nothing runs
    /// in them until they are a sandbox's).
    async fn make_for_pool(&self) -> Result<WaitingShim, RuntimeError> {
        let name = format!(
            "{}{}",
            self.prefix,
            self.next.fetch_add(1, Ordering::Relaxed)
        );
        let shim = self.spawn(&name, POOL_NICE).await?;
        let limits = CgroupLimits {
            cpu_quota_us: None,
            cpu_period_us: cgroup::CPU_PERIOD_US,
            memory_bytes: None,
            pids_max: self.pids_max,
        };
        self.place(shim, &name, limits).await
    }

    /// Ends a shim that will serve no sandbox and removes its cgroups.
    pub(super) async fn discard(&self, mut shim: WaitingShim) {
        let _ = shim.child.start_kill();
        let _ = shim.child.wait().await;
        if shim.cgroup.is_empty() {
            return;
        }
        let cgroups = Arc::clone(&self.cgroups);
        let name = shim.cgroup.clone();
        let removed =
            tokio::task::spawn_blocking(move || cgroup::kill_and_remove(cgroups.as_ref(), &name))
                .await;
        if !matches!(removed, Ok(Ok(()))) {
            tracing::error!(cgroup = %shim.cgroup, "cannot remove a pool shim's cgroups");
        }
    }

    /// Kills and removes the pool cgroups a previous server of this state
    /// directory left (its shims died with it; their cgroups stay behind).
    pub(super) fn sweep(&self) -> Vec<String> {
        let mut swept = Vec::new();
        for name in self.cgroups.children() {
            if name.starts_with(&self.prefix) {
                match cgroup::kill_and_remove(self.cgroups.as_ref(), &name) {
                    Ok(()) => swept.push(name),
                    Err(error) => {
                        tracing::error!(cgroup = %name, %error, "cannot remove a pool cgroup a previous run left")
                    }
                }
            }
        }
        swept
    }
}

/// Waiting shims, refilled in the background up to `target`.
pub(super) struct ShimPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    target: usize,
    maker: Arc<ShimMaker>,
    quiet: cove_quiet::Quiet,
    refill: cove_quiet::Refill,
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    ready: Vec<WaitingShim>,
    refilling: bool,
    closed: bool,
}

impl ShimPool {
    pub(super) fn new(target: usize, maker: Arc<ShimMaker>, quiet: cove_quiet::Quiet) -> Self {
        Self {
            inner: Arc::new(PoolInner {
                target,
                maker,
                quiet,
                refill: cove_quiet::Refill::default(),
                state: Mutex::default(),
            }),
        }
    }

    /// A waiting shim of the pool, if one is ready. The caller refills once
    /// its start is done: placing a new shim in its cgroups holds the kernel's
    /// cgroup lock for a grace period, and the start should not wait on it.
    pub(super) fn take(&self) -> Option<WaitingShim> {
        let mut state = self.inner.lock();
        let shim = state.ready.pop();
        if shim.is_some() && state.ready.is_empty() {
            self.inner.refill.emptied();
        }
        shim
    }

    /// How many shims wait ready.
    pub(super) fn ready(&self) -> usize {
        self.inner.lock().ready.len()
    }

    /// The host pids of the waiting inits.
    pub(super) fn init_pids(&self) -> Vec<i32> {
        self.inner
            .lock()
            .ready
            .iter()
            .map(|shim| shim.init_pid)
            .collect()
    }

    /// Tops the pool up in the background; nothing without a tokio runtime.
    pub(super) fn refill(&self) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        {
            let mut state = self.inner.lock();
            if state.refilling || state.closed || state.ready.len() >= self.inner.target {
                return;
            }
            state.refilling = true;
        }
        let inner = Arc::clone(&self.inner);
        // A task, not a blocking thread: the shim dies with the thread that
        // spawned it, and runtime workers live as long as the server.
        tokio::spawn(async move {
            loop {
                // Once requests leave the host quiet: placing the shim in its
                // cgroups holds the kernel's cgroup lock for a grace period,
                // and its spawn takes a core. An empty pool refills at once,
                // since its next start spawns a shim anyway.
                let is_empty = || inner.lock().ready.is_empty();
                inner.refill.turn(&inner.quiet, is_empty).await;
                {
                    // Closed while it waited: nothing to make.
                    let mut state = inner.lock();
                    if state.closed {
                        state.refilling = false;
                        return;
                    }
                }
                let made = inner.maker.make_for_pool().await;
                let unwanted = {
                    let mut state = inner.lock();
                    match made {
                        Ok(shim) if !state.closed => {
                            state.ready.push(shim);
                            None
                        }
                        Ok(shim) => Some(shim),
                        Err(error) => {
                            tracing::error!(error = %chain(&error), "cannot make a container shim for the pool");
                            state.refilling = false;
                            return;
                        }
                    }
                };
                // Closed while it was made (see `close`).
                if let Some(shim) = unwanted {
                    inner.maker.discard(shim).await;
                }
                let mut state = inner.lock();
                if state.closed || state.ready.len() >= inner.target {
                    state.refilling = false;
                    return;
                }
            }
        });
    }

    /// Stops refilling, ends the waiting shims and removes their cgroups; a
    /// refill in flight finishes first, discarding what it made.
    pub(super) async fn close(&self) {
        let ready = {
            let mut state = self.inner.lock();
            state.closed = true;
            std::mem::take(&mut state.ready)
        };
        // A refill waiting for quiet stops waiting, and ends.
        self.inner.refill.emptied();
        for shim in ready {
            self.inner.maker.discard(shim).await;
        }
        let began = std::time::Instant::now();
        while self.inner.lock().refilling && began.elapsed() < REFILL_WAIT {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl PoolInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().expect("shim pool lock")
    }
}

/// An error and its causes, on one line.
fn chain(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    line
}

/// FNV-1a, 64 bits: a name for the state directory that stays the same across
/// builds (std's hasher promises no such thing).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_names_are_no_sandbox_id_and_differ_per_state_directory() {
        let cgroups: Arc<dyn CgroupBackend> =
            Arc::from(cgroup::detect(std::path::Path::new("/nonexistent"), "cove"));
        let maker = |dir: &str| {
            ShimMaker::new(
                "/bin/true".into(),
                "/bin/true".into(),
                Arc::clone(&cgroups),
                10,
                std::path::Path::new(dir),
            )
        };
        let (a, b) = (maker("/var/lib/cove/a"), maker("/var/lib/cove/b"));
        assert_ne!(a.prefix, b.prefix);
        assert_eq!(a.prefix, maker("/var/lib/cove/a").prefix);
        assert!(crate::check_id(&format!("{}0", a.prefix)).is_err());
    }
}
