//! The VM backend: a sandbox is a QEMU microVM whose memory lives in a file,
//! so it survives pause and resume, memory snapshots and forks.
//!
//! Module map: `qemu` (the command line, the accelerator), `qmp` (the QMP
//! client), `machine` (one QEMU process: launch, save, restore, quit),
//! `bridge` (the agent channel: yamux over virtio-serial, served to the
//! server as a Unix socket), `disk` (base images, qcow2), `reflink` (block
//! sharing copies), `layout` (a sandbox's files), `saved` (`machine.json`),
//! `template` (pre-booted machines that new sandboxes continue from).
//!
//! Everything of a sandbox lives in `{storage}/vms/{id}/` on the btrfs
//! storage, where a copy of a RAM file or a disk is a reflink: pause writes
//! only the device state (the RAM is its file), and a fork or a memory
//! capture freezes the VM only while its files are cloned. QEMU processes run
//! in their own process groups and outlive the server; after a restart they
//! are found again through their pid files.

mod bridge;
mod disk;
mod layout;
mod machine;
mod qemu;
mod qmp;
mod reflink;
mod saved;
mod template;

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use tokio::sync::oneshot;

use crate::storage::Storage;
use crate::{AgentEndpoint, Runtime, RuntimeError, SandboxSpec, Started};
use bridge::{Bridge, Session};
use layout::VmLayout;
use machine::{Boot, Machine};
use saved::SavedMachine;

pub use disk::AGENT_IN_GUEST;
pub use qemu::{detect_accelerator, Accelerator, HostFacts};

/// How long a restored VM's agent may take to reopen its port.
const RESTORE_AGENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the agent may take to flush its disks before a stop.
const SYNC_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a process found through its pid file gets to exit on SIGTERM.
const TERM_TIMEOUT: Duration = Duration::from_secs(10);
/// Room in a sandbox's subvolume beyond its disk and memory: device state,
/// logs, qcow2 metadata, and blocks briefly counted twice while a RAM page
/// shared with a copy is rewritten.
const SUBVOLUME_SLACK: u64 = 1 << 30;

/// What the VM backend needs from the host.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// The btrfs storage: sandboxes in `vms/`, captures in `captures/`,
    /// templates in `vm-templates/`.
    pub storage: Arc<Storage>,
    /// `vmlinux` and `initramfs.cpio` (made by `scripts/vm-assets`); base
    /// disks are cached in its `bases/`.
    pub assets_dir: PathBuf,
    /// The static cove-agent, written into every base disk.
    pub agent_binary: PathBuf,
    pub qemu: PathBuf,
    pub qemu_img: PathBuf,
    /// qboot, the firmware of microvm.
    pub firmware: PathBuf,
    /// `None` picks KVM where it works, TCG elsewhere.
    pub accelerator: Option<Accelerator>,
    /// Whether a sandbox made from an image continues from a pre-booted
    /// template instead of booting (see `template`).
    pub templates: bool,
    /// How long a cold boot may take until the agent answers.
    pub boot_timeout: Duration,
}

impl VmConfig {
    /// Debian's QEMU paths, automatic accelerator, templates on.
    pub fn new(storage: Arc<Storage>, assets_dir: PathBuf, agent_binary: PathBuf) -> VmConfig {
        VmConfig {
            storage,
            assets_dir,
            agent_binary,
            qemu: "/usr/bin/qemu-system-x86_64".into(),
            qemu_img: "/usr/bin/qemu-img".into(),
            firmware: "/usr/share/qemu/qboot.rom".into(),
            accelerator: None,
            templates: true,
            boot_timeout: Duration::from_secs(180),
        }
    }

    pub fn kernel(&self) -> PathBuf {
        self.assets_dir.join("vmlinux")
    }

    pub fn initramfs(&self) -> PathBuf {
        self.assets_dir.join("initramfs.cpio")
    }
}

/// A VM this runtime started and that runs.
struct RunningVm {
    machine: Machine,
    session: Session,
    /// Serves `agent.sock`; dropped to stop it.
    bridge: Option<Bridge>,
    driver: tokio::task::JoinHandle<()>,
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        self.bridge.take();
        self.driver.abort();
    }
}

pub struct VmRuntime {
    config: VmConfig,
    accelerator: Accelerator,
    tsc_khz: Option<u64>,
    running: Mutex<HashMap<String, Arc<tokio::sync::Mutex<RunningVm>>>>,
    /// Base disks by image, with the agent file stamp they were made for.
    bases: Mutex<HashMap<PathBuf, (String, PathBuf)>>,
}

impl std::fmt::Debug for VmRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmRuntime")
            .field("config", &self.config)
            .field("accelerator", &self.accelerator)
            .finish_non_exhaustive()
    }
}

fn other(id: &str, reason: impl Into<String>) -> RuntimeError {
    RuntimeError::Other {
        id: id.to_owned(),
        reason: reason.into(),
    }
}

fn io_error(id: &str, action: impl Into<String>) -> impl FnOnce(io::Error) -> RuntimeError {
    let id = id.to_owned();
    let action = action.into();
    move |source| RuntimeError::Io { id, action, source }
}

fn start_error(id: &str, reason: impl Into<String>) -> RuntimeError {
    RuntimeError::Start {
        id: id.to_owned(),
        reason: reason.into(),
    }
}

/// An id names a directory: one plain path component.
fn check_id(id: &str) -> Result<(), RuntimeError> {
    let plain = !id.is_empty()
        && id != "."
        && id != ".."
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if plain {
        Ok(())
    } else {
        Err(other(
            id,
            "id must be 1 to 128 of [A-Za-z0-9._-] and not . or ..",
        ))
    }
}

/// Runs blocking work off the async threads; a failure names the sandbox.
async fn blocking<T: Send + 'static>(
    id: &str,
    work: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, RuntimeError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| other(id, e.to_string()))?
        .map_err(|reason| other(id, reason))
}

fn remove_if_present(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(error),
        _ => Ok(()),
    }
}

/// The end of a log, for errors.
fn log_tail(path: &Path) -> String {
    let text = fs::read(path).unwrap_or_default();
    let tail = &text[text.len().saturating_sub(600)..];
    String::from_utf8_lossy(tail).trim().replace('\n', " | ")
}

/// Forgets saved memory: the device state first, so a half-done discard never
/// looks like a usable memory.
fn discard_memory_files(layout: &VmLayout) -> io::Result<()> {
    remove_if_present(&layout.state())?;
    remove_if_present(&layout.machine())?;
    remove_if_present(&layout.ram())
}

/// Copies saved memory and disk from one directory to another (reflinks),
/// replacing what is there; the device state last.
fn clone_saved(from: &VmLayout, to: &VmLayout) -> io::Result<()> {
    remove_if_present(&to.state())?;
    reflink::clone_replacing(&from.disk(), &to.disk())?;
    reflink::clone_replacing(&from.ram(), &to.ram())?;
    reflink::clone_replacing(&from.machine(), &to.machine())?;
    reflink::clone_replacing(&from.state(), &to.state())
}

/// The live process of a sandbox that another server process started, from
/// its pid file: alive and running QEMU on this sandbox's files.
fn orphan_pid(layout: &VmLayout) -> Option<i32> {
    let pid: i32 = fs::read_to_string(layout.pid_file())
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let wanted = qemu::qmp_argument(&layout.qmp());
    let ours = cmdline
        .split(|b| *b == 0)
        .any(|arg| arg == wanted.as_bytes());
    ours.then_some(pid)
}

/// Ends a QEMU process this runtime did not start: SIGTERM (QEMU flushes its
/// disks and exits), SIGKILL if it lingers.
async fn end_orphan(pid: i32) {
    use nix::sys::signal::{kill, Signal};
    let pid = nix::unistd::Pid::from_raw(pid);
    let _ = kill(pid, Signal::SIGTERM);
    let began = Instant::now();
    while kill(pid, None).is_ok() && began.elapsed() < TERM_TIMEOUT {
        // Not our child, so it cannot be waited for; its /proc entry goes
        // once its parent (init, after our restart) reaps it.
        if fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| stat.split_whitespace().nth(2) == Some("Z"))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = kill(pid, Signal::SIGKILL);
}

impl VmRuntime {
    /// Checks the config against the host and picks the accelerator.
    pub fn new(config: VmConfig) -> Result<VmRuntime, RuntimeError> {
        let id = "-";
        for (what, path) in [
            ("agent binary", config.agent_binary.clone()),
            ("qemu", config.qemu.clone()),
            ("qemu-img", config.qemu_img.clone()),
            ("firmware", config.firmware.clone()),
            ("guest kernel (run scripts/vm-assets)", config.kernel()),
            ("initramfs (run scripts/vm-assets)", config.initramfs()),
        ] {
            fs::metadata(&path)
                .map_err(io_error(id, format!("find the {what} {}", path.display())))?;
        }
        let facts = HostFacts::read();
        let accelerator = config
            .accelerator
            .unwrap_or_else(|| detect_accelerator(&facts));
        let tsc_khz = facts.tsc_khz();
        for dir in ["vms", "captures", "vm-templates"] {
            let path = config.storage.root().join(dir);
            fs::create_dir_all(&path)
                .map_err(io_error(id, format!("create {}", path.display())))?;
        }
        tracing::info!(accelerator = accelerator.name(), "VM runtime ready");
        Ok(VmRuntime {
            config,
            accelerator,
            tsc_khz,
            running: Mutex::default(),
            bases: Mutex::default(),
        })
    }

    /// The accelerator every VM of this runtime uses.
    pub fn accelerator(&self) -> Accelerator {
        self.accelerator
    }

    /// Makes the template for sandboxes of `spec`'s image and resources now
    /// rather than at the first create (for a server's start-up).
    pub async fn warm_template(&self, spec: &SandboxSpec) -> Result<(), RuntimeError> {
        self.template_for(spec).await.map(|_| ())
    }

    fn layout(&self, id: &str) -> VmLayout {
        VmLayout::new(layout::sandbox_dir(self.config.storage.root(), id))
    }

    fn capture_layout(&self, capture_id: &str) -> VmLayout {
        VmLayout::new(self.config.storage.root().join("captures").join(capture_id))
    }

    fn running(&self, id: &str) -> Option<Arc<tokio::sync::Mutex<RunningVm>>> {
        self.running
            .lock()
            .expect("running map lock")
            .get(id)
            .cloned()
    }

    fn take_running(&self, id: &str) -> Option<Arc<tokio::sync::Mutex<RunningVm>>> {
        self.running.lock().expect("running map lock").remove(id)
    }

    /// The sandbox's directory: a subvolume capped at its disk, twice its
    /// memory and some slack. Made once.
    fn make_dir(&self, spec: &SandboxSpec) -> Result<VmLayout, RuntimeError> {
        let id = spec.id.as_str();
        check_id(id)?;
        let layout = self.layout(id);
        layout
            .check_socket_paths()
            .map_err(|r| start_error(id, r))?;
        if !layout.dir.exists() {
            let limit = (spec.resources.disk_gib << 30)
                + 2 * (spec.resources.memory_mib << 20)
                + SUBVOLUME_SLACK;
            self.config
                .storage
                .create_limited(&layout.dir, limit)
                .map_err(|e| other(id, e.to_string()))?;
            fs::set_permissions(&layout.dir, fs::Permissions::from_mode(0o700))
                .map_err(io_error(id, format!("chmod {}", layout.dir.display())))?;
            reflink::set_nocow(&layout.dir)
                .map_err(io_error(id, format!("make {} nocow", layout.dir.display())))?;
        }
        Ok(layout)
    }

    fn make_capture_dir(&self, id: &str, capture: &VmLayout) -> Result<(), RuntimeError> {
        fs::create_dir_all(&capture.dir)
            .map_err(io_error(id, format!("create {}", capture.dir.display())))?;
        reflink::set_nocow(&capture.dir).map_err(io_error(
            id,
            format!("make {} nocow", capture.dir.display()),
        ))
    }

    fn machine_spec(
        &self,
        name: String,
        layout: &VmLayout,
        cpus: u32,
        memory_mib: u64,
        incoming: bool,
    ) -> qemu::MachineSpec {
        qemu::MachineSpec {
            name,
            accelerator: self.accelerator,
            tsc_khz: self.tsc_khz,
            cpus,
            memory_mib,
            firmware: self.config.firmware.clone(),
            kernel: self.config.kernel(),
            initramfs: self.config.initramfs(),
            ram_file: layout.ram(),
            disk: layout.disk(),
            console_log: layout.console(),
            qemu_log: layout.qemu_log(),
            agent_chardev: layout.chardev(),
            qmp_socket: layout.qmp(),
            pid_file: layout.pid_file(),
            incoming,
        }
    }

    /// Boots or restores the machine in `layout`, connects its agent and
    /// tells it who it is. On failure nothing of the machine is left running.
    async fn bring_up(
        &self,
        id: &str,
        layout: &VmLayout,
        identity: &Identity,
        exited: oneshot::Sender<String>,
    ) -> Result<RunningVm, RuntimeError> {
        let saved = if layout.has_memory() {
            let saved = SavedMachine::read(&layout.machine())
                .map_err(io_error(id, format!("read {}", layout.machine().display())))?;
            if let Some(why) = saved.incompatibility(self.accelerator) {
                return Err(start_error(
                    id,
                    format!("its saved memory cannot be restored: {why}"),
                ));
            }
            Some(saved)
        } else {
            None
        };
        let disk_bytes = identity.disk_bytes;
        let current_disk =
            disk::qcow2_size(&layout.disk()).map_err(|e| start_error(id, e.to_string()))?;
        if current_disk > disk_bytes {
            return Err(start_error(
                id,
                format!("its disk is {current_disk} bytes, more than the {disk_bytes} asked for; disks cannot shrink"),
            ));
        }
        let (cpus, memory_mib, boot) = match &saved {
            Some(saved) => (
                saved.cpus,
                saved.memory_mib,
                Boot::Restore {
                    state: layout.state(),
                },
            ),
            None => {
                // A cold boot starts from zeroed memory (a sparse file).
                let ram = layout.ram();
                let prepared =
                    fs::File::create(&ram).and_then(|file| file.set_len(identity.memory_mib << 20));
                prepared.map_err(io_error(id, format!("make {}", ram.display())))?;
                if current_disk < disk_bytes {
                    let (qemu_img, disk) = (self.config.qemu_img.clone(), layout.disk());
                    blocking(id, move || {
                        disk::resize(&qemu_img, &disk, disk_bytes).map_err(|e| e.to_string())
                    })
                    .await?;
                }
                (identity.cpus, identity.memory_mib, Boot::Cold)
            }
        };
        if saved.is_none() {
            // Describes the running machine, for the saves to come.
            SavedMachine::new(self.accelerator, cpus, memory_mib)
                .write(&layout.machine())
                .map_err(io_error(
                    id,
                    format!("write {}", layout.machine().display()),
                ))?;
        }
        // A RAM file just cloned (template, snapshot, fork) has nothing in the
        // page cache, and a restored guest faulting it in page by page is
        // slow; reading it in while QEMU starts and loads its state is not.
        let warmed = saved.as_ref().map(|_| {
            let ram = layout.ram();
            tokio::task::spawn_blocking(move || reflink::read_ahead(&ram))
        });
        let spec = self.machine_spec(
            format!("cove-{id}"),
            layout,
            cpus,
            memory_mib,
            saved.is_some(),
        );
        let began = Instant::now();
        let machine = Machine::launch(&self.config.qemu, &spec, &boot, exited)
            .await
            .map_err(|e| {
                start_error(id, format!("{e}; console: {}", log_tail(&layout.console())))
            })?;
        let launched = began.elapsed();
        if let Some(warmed) = warmed {
            if let Ok(Err(error)) = warmed.await {
                tracing::debug!(sandbox = id, %error, "could not read the RAM file ahead");
            }
        }
        let connected = async {
            let agent_timeout = if saved.is_some() {
                // From here the memory diverges from the saved state.
                remove_if_present(&layout.state()).map_err(|source| machine::MachineError::Io {
                    action: format!("remove {}", layout.state().display()),
                    source,
                })?;
                machine.resume().await?;
                // Disks become writable (active) only once the VM runs; the
                // guest is told of the new size and the agent waits for it.
                if current_disk < disk_bytes {
                    machine.resize_disk(disk_bytes).await?;
                }
                RESTORE_AGENT_TIMEOUT
            } else {
                self.config.boot_timeout
            };
            machine
                .connect_agent(&layout.chardev(), agent_timeout)
                .await
        }
        .await;
        let (session, driver) = match connected {
            Ok(connected) => connected,
            Err(error) => {
                machine.kill().await;
                return Err(start_error(
                    id,
                    format!("{error}; console: {}", log_tail(&layout.console())),
                ));
            }
        };
        let connected = began.elapsed();
        let running = RunningVm {
            machine,
            session,
            bridge: None,
            driver,
        };
        // A boot may follow a disk resize; a restore grew the disk just now or not at all.
        let grow_root = saved.is_none() || current_disk < disk_bytes;
        if let Err(reason) = identity.apply(&running.session, grow_root).await {
            running.machine.kill().await;
            return Err(start_error(id, reason));
        }
        tracing::debug!(
            sandbox = id,
            launched_ms = launched.as_secs_f64() * 1e3,
            agent_connected_ms = connected.as_secs_f64() * 1e3,
            identity_applied_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm brought up"
        );
        Ok(running)
    }

    /// Stops a running VM for the instant of `work` (which copies its files),
    /// then lets it run on. With `state`, the device state is saved there first.
    async fn with_vm_frozen<T: Send + 'static>(
        &self,
        id: &str,
        vm: &RunningVm,
        state: Option<PathBuf>,
        work: impl FnOnce() -> Result<T, String> + Send + 'static,
    ) -> Result<T, RuntimeError> {
        let began = Instant::now();
        vm.machine
            .pause_vcpus()
            .await
            .map_err(|e| other(id, format!("stop the vCPUs: {e}")))?;
        let saved = match &state {
            Some(path) => vm.machine.save_state(path).await.map_err(|e| e.to_string()),
            None => Ok(()),
        };
        let result = match saved {
            Ok(()) => blocking(id, work).await,
            Err(reason) => Err(other(id, format!("save the device state: {reason}"))),
        };
        let resumed = vm.machine.resume().await;
        tracing::debug!(
            sandbox = id,
            frozen_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm frozen for a copy"
        );
        resumed.map_err(|e| other(id, format!("continue the vCPUs: {e}")))?;
        result
    }

    /// Copies a sandbox's disk and memory into `dest` (a sandbox or capture
    /// directory): from its running VM, frozen only while the files are
    /// cloned, or from the memory it saved when paused.
    async fn copy_memory(&self, id: &str, dest: VmLayout) -> Result<(), RuntimeError> {
        let source = self.layout(id);
        let Some(vm) = self.running(id) else {
            if !source.has_memory() {
                return Err(other(
                    id,
                    "it is neither running nor paused with its memory",
                ));
            }
            return blocking(id, move || {
                clone_saved(&source, &dest).map_err(|e| e.to_string())
            })
            .await;
        };
        let vm = vm.lock().await;
        // Written out while the VM still runs, so the clone under the freeze
        // has only what was dirtied since to flush.
        let ram = source.ram();
        blocking(id, move || {
            fs::File::open(&ram)
                .and_then(|file| file.sync_data())
                .map_err(|e| format!("flush {}: {e}", ram.display()))
        })
        .await?;
        let machine = SavedMachine::read(&source.machine())
            .map_err(io_error(id, format!("read {}", source.machine().display())))?;
        let state_partial = dest.dir.join("state.partial");
        let (from, to, partial) = (source.clone(), dest.clone(), state_partial.clone());
        self.with_vm_frozen(id, &vm, Some(state_partial.clone()), move || {
            remove_if_present(&to.state()).map_err(|e| e.to_string())?;
            reflink::clone_replacing(&from.ram(), &to.ram())
                .map_err(|e| format!("clone the RAM file: {e}"))?;
            reflink::clone_replacing(&from.disk(), &to.disk())
                .map_err(|e| format!("clone the disk: {e}"))?;
            Ok(partial)
        })
        .await
        .inspect_err(|_| {
            let _ = fs::remove_file(&state_partial);
        })?;
        drop(vm);
        machine
            .write(&dest.machine())
            .map_err(io_error(id, format!("write {}", dest.machine().display())))?;
        fs::rename(&state_partial, dest.state()).map_err(io_error(
            id,
            format!("move {} in place", dest.state().display()),
        ))
    }

    async fn template_for(&self, spec: &SandboxSpec) -> Result<VmLayout, RuntimeError> {
        let id = spec.id.as_str();
        let base = self.base_for(id, &spec.rootfs).await?;
        template::ensure(
            self,
            id,
            &base,
            spec.resources.cpu.max(1),
            spec.resources.memory_mib,
        )
        .await
    }

    /// The base disk of an image. Its key hashes the whole agent binary, so
    /// the answer is remembered for as long as the agent file looks the same.
    async fn base_for(&self, id: &str, rootfs: &Path) -> Result<PathBuf, RuntimeError> {
        let stamp = disk::file_stamp(&self.config.agent_binary).map_err(io_error(
            id,
            format!("read {}", self.config.agent_binary.display()),
        ))?;
        if let Some((known, base)) = self.bases.lock().expect("bases lock").get(rootfs) {
            if *known == stamp && base.exists() {
                return Ok(base.clone());
            }
        }
        let (cache, owned_rootfs, agent) = (
            self.config.assets_dir.clone(),
            rootfs.to_owned(),
            self.config.agent_binary.clone(),
        );
        let base = blocking(id, move || {
            disk::ensure_base(&cache, &owned_rootfs, &agent).map_err(|e| e.to_string())
        })
        .await?;
        self.bases
            .lock()
            .expect("bases lock")
            .insert(rootfs.to_owned(), (stamp, base.clone()));
        Ok(base)
    }
}

/// Who a VM is, told to its agent after every boot and restore.
struct Identity {
    hostname: String,
    env: BTreeMap<String, String>,
    cpus: u32,
    memory_mib: u64,
    disk_bytes: u64,
}

impl Identity {
    fn of(spec: &SandboxSpec) -> Identity {
        Identity {
            hostname: spec.hostname.clone(),
            env: spec.env.iter().cloned().collect(),
            cpus: spec.resources.cpu.max(1),
            memory_mib: spec.resources.memory_mib,
            disk_bytes: spec.resources.disk_gib << 30,
        }
    }

    async fn apply(&self, session: &Session, grow_root: bool) -> Result<(), String> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        let entropy = bridge::random_hex(64).map_err(|e| format!("read random bytes: {e}"))?;
        let body = serde_json::json!({
            "hostname": self.hostname,
            "env": self.env,
            "unixTimeNs": now,
            "entropy": entropy,
            "growRoot": grow_root,
            "diskBytes": self.disk_bytes,
        });
        let (status, answer) = session
            .post("/cove/vm/identity", &body.to_string())
            .await
            .map_err(|e| format!("tell the agent its identity: {e}"))?;
        if status != 200 {
            return Err(format!(
                "the agent refused its identity ({status}): {answer}"
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl Runtime for VmRuntime {
    async fn prepare(&self, spec: &SandboxSpec) -> Result<(), RuntimeError> {
        let id = spec.id.as_str();
        let layout = self.make_dir(spec)?;
        if layout.disk().exists() {
            return Ok(());
        }
        if let Some(top) = spec.layers.first() {
            let from = VmLayout::new(top.clone());
            return blocking(id, move || {
                if from.has_memory() {
                    clone_saved(&from, &layout)
                } else {
                    reflink::clone_file(&from.disk(), &layout.disk())
                }
                .map_err(|e| format!("copy the layer {}: {e}", from.dir.display()))
            })
            .await;
        }
        if self.config.templates {
            let template = self.template_for(spec).await?;
            return blocking(id, move || {
                clone_saved(&template, &layout)
                    .map_err(|e| format!("copy the template {}: {e}", template.dir.display()))
            })
            .await;
        }
        let base = self.base_for(id, &spec.rootfs).await?;
        let qemu_img = self.config.qemu_img.clone();
        let bytes = spec.resources.disk_gib << 30;
        blocking(id, move || {
            disk::create_overlay(&qemu_img, &base, &layout.disk(), bytes).map_err(|e| e.to_string())
        })
        .await
    }

    async fn start(&self, spec: &SandboxSpec) -> Result<Started, RuntimeError> {
        let began = Instant::now();
        let id = spec.id.as_str();
        check_id(id)?;
        if self.is_running(id).await {
            return Err(start_error(id, "already running"));
        }
        let layout = self.layout(id);
        if !layout.disk().exists() {
            self.prepare(spec).await?;
        }
        let restoring = layout.has_memory();
        let (exited_tx, exited_rx) = oneshot::channel();
        let mut vm = self
            .bring_up(id, &layout, &Identity::of(spec), exited_tx)
            .await?;
        let bridge = Bridge::serve(&layout.agent_socket(), vm.session.clone());
        match bridge {
            Ok(bridge) => vm.bridge = Some(bridge),
            Err(error) => {
                vm.machine.kill().await;
                return Err(io_error(
                    id,
                    format!("serve {}", layout.agent_socket().display()),
                )(error));
            }
        }
        self.running
            .lock()
            .expect("running map lock")
            .insert(id.to_owned(), Arc::new(tokio::sync::Mutex::new(vm)));
        tracing::info!(
            sandbox = id,
            accelerator = self.accelerator.name(),
            from_memory = restoring,
            elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm started"
        );
        Ok(Started {
            agent: AgentEndpoint::Unix(layout.agent_socket()),
            exited: exited_rx,
            accelerator: Some(self.accelerator.name()),
        })
    }

    async fn stop(&self, id: &str) -> Result<(), RuntimeError> {
        check_id(id)?;
        let layout = self.layout(id);
        if let Some(vm) = self.take_running(id) {
            let mut vm = vm.lock().await;
            // Guest writes still in its page cache would be lost with the VM.
            let synced =
                tokio::time::timeout(SYNC_TIMEOUT, vm.session.post("/cove/vm/sync", "{}")).await;
            if !matches!(synced, Ok(Ok((200, _)))) {
                tracing::warn!(
                    sandbox = id,
                    "the agent did not flush its disks before the stop"
                );
            }
            vm.bridge.take();
            vm.machine.quit().await;
        } else if let Some(pid) = orphan_pid(&layout) {
            end_orphan(pid).await;
        }
        let _ = remove_if_present(&layout.agent_socket());
        if layout.dir.exists() {
            discard_memory_files(&layout).map_err(io_error(id, "discard its memory"))?;
        }
        Ok(())
    }

    async fn destroy(&self, id: &str) -> Result<(), RuntimeError> {
        check_id(id)?;
        let layout = self.layout(id);
        if let Some(vm) = self.take_running(id) {
            let vm = vm.lock().await;
            vm.machine.kill().await;
        }
        if let Some(pid) = orphan_pid(&layout) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let storage = self.config.storage.clone();
        blocking(id, move || {
            if !layout.dir.exists() {
                return Ok(());
            }
            if storage.delete_subvolume(&layout.dir).is_err() {
                fs::remove_dir_all(&layout.dir)
                    .map_err(|e| format!("remove {}: {e}", layout.dir.display()))?;
            }
            Ok(())
        })
        .await
    }

    async fn is_running(&self, id: &str) -> bool {
        if check_id(id).is_err() {
            return false;
        }
        if let Some(vm) = self.running(id) {
            let vm = vm.lock().await;
            if vm.machine.exited().is_none() {
                return true;
            }
            drop(vm);
            self.take_running(id);
            return false;
        }
        orphan_pid(&self.layout(id)).is_some()
    }

    async fn capture(&self, id: &str, capture_id: &str) -> Result<PathBuf, RuntimeError> {
        check_id(id)?;
        check_id(capture_id)?;
        let source = self.layout(id);
        let dest = self.capture_layout(capture_id);
        self.make_capture_dir(id, &dest)?;
        let (from, to) = (source.disk(), dest.disk());
        let copy =
            move || reflink::clone_file(&from, &to).map_err(|e| format!("clone the disk: {e}"));
        let copied = match self.running(id) {
            Some(vm) => {
                let vm = vm.lock().await;
                // What the guest has written but holds in its page cache
                // belongs in the capture too; flushed while it still runs.
                let synced =
                    tokio::time::timeout(SYNC_TIMEOUT, vm.session.post("/cove/vm/sync", "{}"))
                        .await;
                if !matches!(synced, Ok(Ok((200, _)))) {
                    tracing::warn!(
                        sandbox = id,
                        "the agent did not flush its disks before a capture"
                    );
                }
                self.with_vm_frozen(id, &vm, None, copy).await
            }
            None => blocking(id, copy).await,
        };
        if let Err(error) = copied {
            let _ = fs::remove_dir_all(&dest.dir);
            return Err(error);
        }
        Ok(dest.dir)
    }

    async fn discard_capture(&self, capture_id: &str) -> Result<(), RuntimeError> {
        check_id(capture_id)?;
        let dir = self.capture_layout(capture_id).dir;
        blocking(capture_id, move || match fs::remove_dir_all(&dir) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => {
                Err(format!("remove {}: {error}", dir.display()))
            }
            _ => Ok(()),
        })
        .await
    }

    async fn restore(&self, spec: &SandboxSpec, capture_id: &str) -> Result<(), RuntimeError> {
        let id = spec.id.as_str();
        check_id(id)?;
        check_id(capture_id)?;
        if self.is_running(id).await {
            return Err(other(id, "cannot restore a running sandbox"));
        }
        let layout = self.make_dir(spec)?;
        let capture = self.capture_layout(capture_id);
        blocking(id, move || {
            if !capture.disk().exists() {
                return Err(format!("capture {} does not exist", capture.dir.display()));
            }
            if capture.has_memory() {
                clone_saved(&capture, &layout)
            } else {
                discard_memory_files(&layout)
                    .and_then(|()| reflink::clone_replacing(&capture.disk(), &layout.disk()))
            }
            .map_err(|e| format!("copy the capture {}: {e}", capture.dir.display()))
        })
        .await
    }

    async fn pause(&self, id: &str) -> Result<(), RuntimeError> {
        check_id(id)?;
        let began = Instant::now();
        let Some(vm) = self.take_running(id) else {
            return Err(other(id, "it is not running"));
        };
        let mut guard = vm.lock().await;
        let layout = self.layout(id);
        let saved = async {
            guard.machine.pause_vcpus().await?;
            let partial = layout.dir.join("state.partial");
            guard.machine.save_state(&partial).await?;
            Ok::<_, machine::MachineError>(partial)
        }
        .await;
        let partial = match saved {
            Ok(partial) => partial,
            Err(error) => {
                // The VM keeps running as it was.
                let _ = guard.machine.resume().await;
                drop(guard);
                self.running
                    .lock()
                    .expect("running map lock")
                    .insert(id.to_owned(), vm);
                return Err(other(id, format!("save its state: {error}")));
            }
        };
        guard.bridge.take();
        guard.machine.quit().await;
        drop(guard);
        fs::rename(&partial, layout.state()).map_err(io_error(
            id,
            format!("move {} in place", layout.state().display()),
        ))?;
        tracing::info!(
            sandbox = id,
            elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm paused"
        );
        Ok(())
    }

    async fn discard_memory(&self, id: &str) -> Result<(), RuntimeError> {
        check_id(id)?;
        if self.is_running(id).await {
            // A running VM's RAM file is its live memory, not a saved one.
            return Ok(());
        }
        let layout = self.layout(id);
        if !layout.dir.exists() {
            return Ok(());
        }
        discard_memory_files(&layout).map_err(io_error(id, "discard its memory"))
    }

    async fn capture_with_memory(
        &self,
        id: &str,
        capture_id: &str,
    ) -> Result<PathBuf, RuntimeError> {
        check_id(id)?;
        check_id(capture_id)?;
        let dest = self.capture_layout(capture_id);
        self.make_capture_dir(id, &dest)?;
        if let Err(error) = self.copy_memory(id, dest.clone()).await {
            let _ = fs::remove_dir_all(&dest.dir);
            return Err(error);
        }
        Ok(dest.dir)
    }

    async fn fork(&self, parent: &str, child: &SandboxSpec) -> Result<(), RuntimeError> {
        check_id(parent)?;
        let began = Instant::now();
        let dest = self.make_dir(child)?;
        self.copy_memory(parent, dest).await?;
        tracing::info!(
            sandbox = parent,
            child = %child.id,
            elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm forked"
        );
        Ok(())
    }
}
