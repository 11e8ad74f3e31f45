//! One QEMU process: started from the runtime's [`MachineSpec`], driven over
//! QMP, connected to its agent (see `bridge` for how a restored guest's stale
//! session is told apart). Knows nothing of sandboxes or storage.
//!
//! QEMU is started in its [`Jail`] (an unprivileged user, a cgroup): the
//! files and sockets it uses are opened or bound here and inherited (see
//! `qemu`), and files it writes later (saved device state) are handed to it
//! over QMP. The jail is released once the process is gone, before its end
//! is reported.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::sync::{oneshot, watch};

use super::bridge::Session;
use super::confine::{Freezer, Jail};
use super::qemu::{self, Descriptors, MachineSpec, Nic};
use super::qmp::{Qmp, QmpError};
use super::tap;

/// How long QEMU may take to open its QMP socket.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a migration to or from a file may take.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);
/// How often an adopted QEMU process (not our child) is checked for its end.
const ADOPTED_POLL: Duration = Duration::from_millis(200);
/// The nice value of a machine nothing waits for (see `MachineSpec`).
const BACKGROUND_NICE: i32 = 19;
/// How long QEMU may take to exit after `quit`.
const QUIT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    #[error("{action}")]
    Io {
        action: String,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error("qemu exited: {0}")]
    Exited(String),
    #[error("{0}")]
    Failed(String),
    #[error("enter the VM's jail")]
    Jail(#[source] super::confine::ConfineError),
}

fn io_error(action: impl Into<String>) -> impl FnOnce(io::Error) -> MachineError {
    let action = action.into();
    move |source| MachineError::Io { action, source }
}

/// How a machine begins.
#[derive(Clone, Debug)]
pub(super) enum Boot {
    /// From its disk.
    Cold,
    /// From memory: the RAM file already holds it; this is its device state.
    Restore { state: PathBuf },
}

/// Who learns of a machine's end: the sender is replaced when a paused
/// machine is started again for its sandbox (see [`Machine::renew_exit`]).
type ExitTo = Arc<Mutex<Option<oneshot::Sender<String>>>>;

/// A QEMU process this runtime started.
#[derive(Debug)]
pub(super) struct Machine {
    pub pid: u32,
    qmp: Qmp,
    /// `Some(description)` once the process has exited.
    exit: watch::Receiver<Option<String>>,
    exit_to: ExitTo,
    /// The freezer of its cgroup; `None` for an adopted process in no VM
    /// cgroup.
    freezer: Option<Freezer>,
    frozen: AtomicBool,
}

impl Machine {
    /// Starts QEMU in `jail` and, for a restore, loads the device state;
    /// the machine is then paused (call [`Machine::resume`]). A cold boot
    /// runs at once. `shares` are sockets connected to the virtiofsd of each
    /// of `spec.shares`. `exited` learns how the process ended, whenever it
    /// does. On failure nothing is left running and the jail is released.
    pub(super) async fn launch(
        program: &Path,
        spec: &MachineSpec,
        boot: &Boot,
        jail: Jail,
        shares: Vec<OwnedFd>,
        exited: oneshot::Sender<String>,
    ) -> Result<Machine, MachineError> {
        // Until the process runs, a failure releases the jail here; from
        // then on the process's exit does.
        let child = match spawn(program, spec, &jail, shares).await {
            Ok(child) => child,
            Err(error) => {
                release(jail).await;
                return Err(error);
            }
        };
        let pid = child.id().unwrap_or_default();
        let freezer = jail.freezer();
        let exit_to: ExitTo = Arc::new(Mutex::new(Some(exited)));
        let exit = watch_exit(child, jail, spec.qemu_log.clone(), exit_to.clone());
        let machine = Machine::attach(pid, spec, boot, &exit, exit_to, freezer).await;
        if machine.is_err() {
            kill_pid(pid);
            let mut exit = exit.clone();
            let _ = tokio::time::timeout(QUIT_TIMEOUT, exit.wait_for(Option::is_some)).await;
        }
        machine
    }

    /// Connects to the QMP of the QEMU process `pid` just started and, for
    /// a restore, loads the device state.
    async fn attach(
        pid: u32,
        spec: &MachineSpec,
        boot: &Boot,
        exit: &watch::Receiver<Option<String>>,
        exit_to: ExitTo,
        freezer: Freezer,
    ) -> Result<Machine, MachineError> {
        std::fs::write(&spec.pid_file, pid.to_string())
            .map_err(io_error(format!("write {}", spec.pid_file.display())))?;
        let qmp = connect_qmp(&spec.qmp_socket, exit).await?;
        let machine = Machine {
            pid,
            qmp,
            exit: exit.clone(),
            exit_to,
            freezer: Some(freezer),
            frozen: AtomicBool::new(false),
        };
        if let Boot::Restore { state } = boot {
            machine.load_state(state).await?;
        }
        Ok(machine)
    }

    /// Takes over a QEMU process an earlier server started (`pid`, found
    /// through its pid file), as it runs: its QMP socket accepts a new
    /// client once the old one is gone. It is not our child, so its end is
    /// noticed by polling; `exited` learns of it as for [`Machine::launch`].
    /// A process the earlier server froze (a warm pause) is thawed first:
    /// a frozen QEMU answers no QMP.
    pub(super) async fn adopt(
        pid: u32,
        qmp_socket: &Path,
        jail: Option<Jail>,
        exited: oneshot::Sender<String>,
    ) -> Result<Machine, MachineError> {
        let freezer = jail.as_ref().map(Jail::freezer);
        if let Some(freezer) = &freezer {
            set_frozen(freezer, false).await?;
        }
        let (exit_tx, exit) = watch::channel(None);
        let qmp = connect_qmp(qmp_socket, &exit).await?;
        let exit_to: ExitTo = Arc::new(Mutex::new(Some(exited)));
        let exit_to_task = exit_to.clone();
        tokio::spawn(async move {
            while crate::process_alive(pid as i32) {
                tokio::time::sleep(ADOPTED_POLL).await;
            }
            if let Some(jail) = jail {
                release(jail).await;
            }
            let description = format!("qemu (pid {pid}, adopted after a server restart) exited");
            let _ = exit_tx.send(Some(description.clone()));
            tell_exit(&exit_to_task, description);
        });
        Ok(Machine {
            pid,
            qmp,
            exit,
            exit_to,
            freezer,
            frozen: AtomicBool::new(false),
        })
    }

    /// A new receiver of the machine's end, in place of the one its last
    /// start handed out (which then learns nothing more): for a machine
    /// that paused warm and is started again.
    pub(super) fn renew_exit(&self) -> oneshot::Receiver<String> {
        let (sender, receiver) = oneshot::channel();
        let mut slot = self.exit_to.lock().unwrap_or_else(|p| p.into_inner());
        match self.exited() {
            Some(description) => {
                let _ = sender.send(description);
                *slot = None;
            }
            None => *slot = Some(sender),
        }
        receiver
    }

    /// Stops telling anyone of the machine's end: its receiver is told the
    /// runtime dropped it (a paused sandbox's machine is no longer watched).
    pub(super) fn forget_exit(&self) {
        self.exit_to
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
    }

    /// Moves every thread of QEMU to the background CPU priority, or back
    /// to the normal one (a warm machine a sandbox took). Nice values are
    /// per thread; threads QEMU starts later inherit the caller's.
    pub(super) fn set_background(&self, background: bool) {
        let nice = if background { BACKGROUND_NICE } else { 0 };
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid)) else {
            return;
        };
        for task in tasks.flatten() {
            let Ok(tid) = task.file_name().to_string_lossy().parse::<libc::id_t>() else {
                continue;
            };
            // SAFETY: a plain system call on a thread id; a thread that
            // ended meanwhile makes it fail, which changes nothing.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, tid, nice);
            }
        }
    }

    /// Freezes every process of the machine's cgroup (QEMU stops where it
    /// is and uses no CPU); its vCPUs should be stopped first.
    pub(super) async fn freeze(&self) -> Result<(), MachineError> {
        let freezer = self.freezer.as_ref().ok_or_else(|| {
            MachineError::Failed("the machine has no cgroup to freeze".to_owned())
        })?;
        self.frozen.store(true, Ordering::SeqCst);
        set_frozen(freezer, true).await
    }

    /// Thaws a frozen machine; nothing to do for one that is not.
    pub(super) async fn thaw(&self) -> Result<(), MachineError> {
        match &self.freezer {
            Some(freezer) if self.frozen.swap(false, Ordering::SeqCst) => {
                set_frozen(freezer, false).await
            }
            _ => Ok(()),
        }
    }

    /// Whether the process has exited, and how.
    pub(super) fn exited(&self) -> Option<String> {
        self.exit.borrow().clone()
    }

    async fn load_state(&self, state: &Path) -> Result<(), MachineError> {
        let file = File::open(state).map_err(io_error(format!("open {}", state.display())))?;
        self.set_migration_capabilities().await?;
        self.qmp.pass_fd("state", file.as_fd()).await?;
        self.qmp
            .execute("migrate-incoming", json!({ "uri": "fd:state" }))
            .await?;
        self.await_migration().await
    }

    /// Runs the vCPUs (after a restore, or a [`Machine::pause_vcpus`]).
    pub(super) async fn resume(&self) -> Result<(), MachineError> {
        self.qmp.execute("cont", json!({})).await?;
        Ok(())
    }

    /// Stops the vCPUs; block devices are flushed before this returns.
    pub(super) async fn pause_vcpus(&self) -> Result<(), MachineError> {
        self.qmp.execute("stop", json!({})).await?;
        Ok(())
    }

    /// Saves the device state of a paused machine to `path`; the RAM stays in
    /// its file (`x-ignore-shared`). The machine may be resumed afterwards.
    pub(super) async fn save_state(&self, path: &Path) -> Result<(), MachineError> {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)
            .map_err(io_error(format!("create {}", path.display())))?;
        self.set_migration_capabilities().await?;
        self.qmp.pass_fd("state", file.as_fd()).await?;
        self.qmp
            .execute("migrate", json!({ "uri": "fd:state" }))
            .await?;
        self.await_migration().await
    }

    /// Capabilities persist in a QEMU process and a stale one breaks the next
    /// migration, so every migration sets the one it needs explicitly.
    async fn set_migration_capabilities(&self) -> Result<(), MachineError> {
        self.qmp
            .execute(
                "migrate-set-capabilities",
                json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] }),
            )
            .await?;
        Ok(())
    }

    async fn await_migration(&self) -> Result<(), MachineError> {
        let began = Instant::now();
        loop {
            let info = self.qmp.execute("query-migrate", json!({})).await?;
            match info.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(()),
                Some(status @ ("failed" | "cancelled")) => {
                    let reason = info
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no reason given");
                    return Err(MachineError::Failed(format!(
                        "migration {status}: {reason}"
                    )));
                }
                _ => {}
            }
            if let Some(description) = self.exited() {
                return Err(MachineError::Exited(description));
            }
            if began.elapsed() > MIGRATION_TIMEOUT {
                return Err(MachineError::Failed(format!(
                    "migration did not finish within {MIGRATION_TIMEOUT:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Connects the NIC, launched on a hub port that leads nowhere, to the
    /// TAP device `device`: the TAP becomes a second port of that hub.
    pub(super) async fn plug_tap(&self, device: &str) -> Result<(), MachineError> {
        let tap = tap::open(device)
            .await
            .map_err(io_error(format!("open TAP device {device}")))?;
        self.qmp.pass_fd("uplink", tap.as_fd()).await?;
        self.qmp
            .execute(
                "netdev_add",
                json!({ "type": "tap", "id": "uplink", "fd": "uplink", "vhost": false }),
            )
            .await?;
        self.qmp
            .execute(
                "netdev_add",
                json!({ "type": "hubport", "id": "uplink-port", "hubid": 0, "netdev": "uplink" }),
            )
            .await?;
        Ok(())
    }

    /// Disconnects the TAP device [`Machine::plug_tap`] connected, closing
    /// QEMU's descriptor of it (the host may then delete the device); the
    /// NIC stays on its hub port. Nothing to do where none is plugged.
    pub(super) async fn unplug_tap(&self) -> Result<(), MachineError> {
        for id in ["uplink-port", "uplink"] {
            match self.qmp.execute("netdev_del", json!({ "id": id })).await {
                Ok(_) => {}
                Err(QmpError::Command { desc, .. }) if desc.contains("not found") => {}
                Err(error) => return Err(error.into()),
            }
        }
        Ok(())
    }

    /// Grows the root disk while the machine runs; the guest sees the change.
    pub(super) async fn resize_disk(&self, bytes: u64) -> Result<(), MachineError> {
        self.qmp
            .execute(
                "block_resize",
                json!({ "device": qemu::ROOT_DRIVE, "size": bytes }),
            )
            .await?;
        Ok(())
    }

    /// Connects to the agent and shakes hands, waiting for it at most
    /// `timeout` or until QEMU exits. Returns the session and the task that
    /// drives it.
    pub(super) async fn connect_agent(
        &self,
        chardev: &Path,
        timeout: Duration,
    ) -> Result<(Session, tokio::task::JoinHandle<()>), MachineError> {
        let mut exit = self.exit.clone();
        tokio::select! {
            connected = Session::connect(chardev, timeout) => connected
                .map_err(io_error(format!("connect to the agent at {}", chardev.display()))),
            _ = exit.wait_for(Option::is_some) => {
                Err(MachineError::Exited(self.exited().unwrap_or_default()))
            }
        }
    }

    /// Asks QEMU to exit and waits for it; kills it if it does not.
    pub(super) async fn quit(&self) {
        let _ = self.thaw().await;
        let _ = self.qmp.execute("quit", json!({})).await;
        let mut exit = self.exit.clone();
        let waited = tokio::time::timeout(QUIT_TIMEOUT, exit.wait_for(Option::is_some))
            .await
            .is_ok();
        if !waited {
            self.kill().await;
        }
    }

    /// Kills QEMU and waits until it is gone.
    pub(super) async fn kill(&self) {
        if self.exited().is_none() {
            kill_pid(self.pid);
        }
        // A frozen process dies only once thawed.
        let _ = self.thaw().await;
        let mut exit = self.exit.clone();
        let _gone = tokio::time::timeout(QUIT_TIMEOUT, exit.wait_for(Option::is_some))
            .await
            .is_ok();
    }
}

/// Starts QEMU in `jail` with the descriptors `spec` names (its TAP device
/// attached first, see `tap`); the runtime keeps none of them. Leaves the
/// jail to the caller.
async fn spawn(
    program: &Path,
    spec: &MachineSpec,
    jail: &Jail,
    shares: Vec<OwnedFd>,
) -> Result<tokio::process::Child, MachineError> {
    let tap = match &spec.nic {
        Nic::Unplugged => None,
        Nic::Tap { device, .. } => Some(
            tap::open(device)
                .await
                .map_err(io_error(format!("open TAP device {device}")))?,
        ),
    };
    let inherited = Inherited::open(spec, jail, tap, shares)?;
    let entry = jail.entry().map_err(MachineError::Jail)?;
    let log = File::create(&spec.qemu_log)
        .map_err(io_error(format!("create {}", spec.qemu_log.display())))?;
    let mut command = tokio::process::Command::new(program);
    command
        .args(qemu::arguments(spec, &inherited.numbers))
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        // Its own process group: a signal to the server's group (a
        // terminal's Ctrl-C) must not end the VMs, which outlive it.
        .process_group(0);
    let keep = inherited.raw();
    let nice = if spec.background { BACKGROUND_NICE } else { 0 };
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed: `Entry` and the list of
    // descriptor numbers were prepared before the fork, and marking every
    // descriptor close-on-exec, joining the cgroup, clearing close-on-exec,
    // setting the priority and changing ids are plain system calls that
    // allocate nothing.
    unsafe {
        command.pre_exec(move || {
            // Nothing the server inherited and did not open itself (a
            // caller's lock, a terminal) reaches QEMU: every descriptor
            // closes at exec but those QEMU is given, below.
            if libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            entry.join_cgroup()?;
            if nice != 0 && libc::setpriority(libc::PRIO_PROCESS, 0, nice) != 0 {
                return Err(io::Error::last_os_error());
            }
            for fd in &keep {
                if libc::fcntl(*fd, libc::F_SETFD, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            entry.become_user()
        });
    }
    let child = command
        .spawn()
        .map_err(io_error(format!("start {}", program.display())))?;
    // QEMU has its copies; the runtime keeps none.
    drop(inherited);
    Ok(child)
}

/// Waits for QEMU's end in the background: then releases its jail and
/// tells the returned watch and `exited` how it ended.
fn watch_exit(
    mut child: tokio::process::Child,
    jail: Jail,
    log: PathBuf,
    exit_to: ExitTo,
) -> watch::Receiver<Option<String>> {
    let (exit_tx, exit) = watch::channel(None);
    tokio::spawn(async move {
        let status = child.wait().await;
        let description = describe_exit(status, &log);
        release(jail).await;
        let _ = exit_tx.send(Some(description.clone()));
        tell_exit(&exit_to, description);
    });
    exit
}

fn tell_exit(exit_to: &ExitTo, description: String) {
    let sender = exit_to.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(sender) = sender {
        let _ = sender.send(description);
    }
}

/// Freezes or thaws a cgroup off the async threads (the kernel may take a
/// moment to report it frozen).
async fn set_frozen(freezer: &Freezer, frozen: bool) -> Result<(), MachineError> {
    let freezer = freezer.clone();
    tokio::task::spawn_blocking(move || freezer.set(frozen))
        .await
        .map_err(|e| MachineError::Failed(format!("the freezer's task failed: {e}")))?
        .map_err(|e| MachineError::Failed(format!("freezer: {e}")))
}

/// The descriptors a QEMU process inherits, open until it has them.
struct Inherited {
    numbers: Descriptors,
    held: Vec<OwnedFd>,
}

impl Inherited {
    /// Opens what `spec` names for QEMU: the files it writes made its
    /// jail's user's, the sockets bound afresh; `tap` is the TAP device of
    /// `spec.nic`, already attached.
    fn open(
        spec: &MachineSpec,
        jail: &Jail,
        tap: Option<OwnedFd>,
        shares: Vec<OwnedFd>,
    ) -> Result<Inherited, MachineError> {
        let mut held = Vec::new();
        let mut hold = |fd: OwnedFd| {
            let number = fd.as_raw_fd();
            held.push(fd);
            number
        };
        let owned_file = |path: &Path, append: bool| -> Result<OwnedFd, MachineError> {
            let file = OpenOptions::new()
                .read(!append)
                .write(true)
                .append(append)
                .create(append)
                .custom_flags(libc::O_NOFOLLOW)
                .open(path)
                .map_err(io_error(format!("open {}", path.display())))?;
            std::os::unix::fs::fchown(&file, Some(jail.uid()), Some(jail.uid())).map_err(
                io_error(format!("give {} to the VM's user", path.display())),
            )?;
            Ok(file.into())
        };
        let listener = |path: &Path| -> Result<OwnedFd, MachineError> {
            match std::fs::remove_file(path) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => {
                    return Err(io_error(format!("remove {}", path.display()))(error))
                }
                _ => {}
            }
            UnixListener::bind(path)
                .map(OwnedFd::from)
                .map_err(io_error(format!("listen on {}", path.display())))
        };
        let ram = hold(owned_file(&spec.ram_file, false)?);
        let disk = hold(owned_file(&spec.disk, false)?);
        let console = hold(owned_file(&spec.console_log, true)?);
        let qmp = hold(listener(&spec.qmp_socket)?);
        let agent = hold(listener(&spec.agent_chardev)?);
        let tap = tap.map(&mut hold);
        let shares = shares.into_iter().map(&mut hold).collect();
        Ok(Inherited {
            numbers: Descriptors {
                ram,
                disk,
                console,
                qmp,
                agent,
                tap,
                shares,
            },
            held,
        })
    }

    fn raw(&self) -> Vec<i32> {
        self.held.iter().map(AsRawFd::as_raw_fd).collect()
    }
}

/// Releases a jail off the async threads (it waits for processes to die).
pub(super) async fn release(jail: Jail) {
    let _ = tokio::task::spawn_blocking(move || jail.release()).await;
}

pub(super) fn kill_pid(pid: u32) {
    if pid > 0 {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

async fn connect_qmp(
    socket: &Path,
    exit: &watch::Receiver<Option<String>>,
) -> Result<Qmp, MachineError> {
    let began = Instant::now();
    loop {
        if let Some(description) = exit.borrow().clone() {
            return Err(MachineError::Exited(description));
        }
        match Qmp::connect(socket).await {
            Ok(qmp) => return Ok(qmp),
            Err(QmpError::Io(error))
                if matches!(
                    error.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                ) && began.elapsed() < QMP_TIMEOUT =>
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// The last `bytes` of a log (which QEMU or the guest writes, so it may be
/// of any size), on one line.
pub(super) fn log_tail(path: &Path, bytes: u64) -> String {
    let mut tail = Vec::new();
    let read = File::open(path).and_then(|mut file| {
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(bytes)))?;
        file.take(bytes).read_to_end(&mut tail)
    });
    if read.is_err() {
        return String::new();
    }
    String::from_utf8_lossy(&tail).trim().replace('\n', " | ")
}

fn describe_exit(status: io::Result<std::process::ExitStatus>, log: &Path) -> String {
    use std::os::unix::process::ExitStatusExt;
    let tail = log_tail(log, 400);
    let what = match status {
        Ok(status) => match (status.code(), status.signal()) {
            (Some(0), _) => "qemu exited".to_owned(),
            (Some(code), _) => format!("qemu exited with code {code}"),
            (None, Some(signal)) => format!("qemu was killed by signal {signal}"),
            (None, None) => "qemu ended".to_owned(),
        },
        Err(error) => format!("lost qemu: {error}"),
    };
    if tail.is_empty() {
        what
    } else {
        format!("{what}: {tail}")
    }
}
