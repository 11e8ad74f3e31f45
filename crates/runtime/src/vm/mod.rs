//! The VM backend: a sandbox is a QEMU microVM whose memory lives in a file,
//! so it survives pause and resume, memory snapshots and forks.
//!
//! Module map: `qemu` (the command line, the accelerator), `qmp` (the QMP
//! client), `machine` (one QEMU process: launch, save, restore, quit),
//! `bridge` (the agent channel: yamux over virtio-serial, served to the
//! server as a Unix socket), `running` (a VM that runs: its QEMU process
//! and agent session), `start` (how a VM starts, decided as a value:
//! warm, restore or cold), `guard` (what a start has begun, ended if it
//! fails), `boot` (a VM brought up and told who it is),
//! `copy` (freezing a VM while its files are cloned), `disk` (base images,
//! qcow2), `reflink` (block sharing copies), `layout` (a sandbox's files),
//! `saved` (`machine.json`), `template` (pre-booted machines that new
//! sandboxes continue from), `pool` (template machines already running,
//! waiting to be taken by a create), `warm` (paused machines whose QEMU
//! process is kept, frozen), `orphan` (QEMU processes of an earlier server).
//!
//! Everything of a sandbox lives in `{storage}/vms/{id}/` on the btrfs
//! storage, where a copy of a RAM file or a disk is a reflink: pause writes
//! only the device state (the RAM is its file), and a fork or a memory
//! capture freezes the VM only while its files are cloned. QEMU processes run
//! in their own process groups and outlive the server; after a restart they
//! are found again through their pid files.

mod boot;
mod bridge;
mod confine;
mod copy;
mod disk;
mod guard;
mod layout;
mod machine;
mod orphan;
mod pool;
mod qemu;
mod qmp;
mod reflink;
mod running;
mod saved;
mod shares;
mod start;
mod tap;
mod template;
mod warm;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::oneshot;

use crate::storage::Storage;
use crate::SandboxId;
use crate::{blocking, check_id, AgentEndpoint, Runtime, RuntimeError, SandboxSpec, Started};
use boot::Identity;
use bridge::Bridge;
use copy::{clone_saved, discard_memory_files};
use layout::VmLayout;
use orphan::{end_orphan, forget_launch, orphan_pid};
use running::RunningVm;
use saved::SavedMachine;
use start::{VmStart, Wanted};

pub use boot::IdentityError;
pub use confine::ConfineError;
pub use disk::{DiskError, AGENT_IN_GUEST};
pub use machine::MachineError;
pub use qemu::{choose_accelerator, detect_accelerator, Accelerator, HostFacts};
pub use qmp::QmpError;
pub use shares::find_virtiofsd;
pub use shares::SharesError;

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
    /// How long the first identity call after a boot or restore may go
    /// unanswered before the runtime connects to the agent again and
    /// repeats it (see `boot`); it normally takes well under a second.
    pub identity_timeout: Duration,
    /// The virtio-fs daemon that serves volumes to VMs; without it a VM
    /// cannot have volumes.
    pub virtiofsd: Option<PathBuf>,
    /// The host id ranges QEMU and virtiofsd run as (see `confine`): the
    /// container runtime's, so that no two sandboxes share a host id.
    pub ids: Arc<crate::container::IdRanges>,
    /// How long a pause keeps the VM's QEMU process, frozen, before saving
    /// its memory and ending it (see `warm`); `None`: every pause saves.
    pub warm_pause: Option<Duration>,
}

impl VmConfig {
    /// Debian's QEMU paths, automatic accelerator, templates on.
    pub fn new(storage: Arc<Storage>, assets_dir: PathBuf, agent_binary: PathBuf) -> VmConfig {
        VmConfig {
            storage,
            assets_dir,
            agent_binary,
            qemu: QEMU.into(),
            qemu_img: QEMU_IMG.into(),
            firmware: FIRMWARE.into(),
            accelerator: None,
            templates: true,
            boot_timeout: Duration::from_secs(180),
            identity_timeout: Duration::from_secs(20),
            virtiofsd: shares::find_virtiofsd(),
            ids: Arc::new(crate::container::IdRanges::new(
                crate::container::IdPool::default(),
            )),
            warm_pause: Some(Duration::from_secs(600)),
        }
    }

    /// Where this data dir links the base disks it uses (see `disk`):
    /// beside the storage's image, on the host's filesystem like the cache,
    /// since a hard link cannot cross into the btrfs storage.
    pub fn base_links(&self) -> PathBuf {
        self.storage.image().with_file_name(disk::REFERENCES)
    }

    pub fn kernel(&self) -> PathBuf {
        self.assets_dir.join(KERNEL)
    }

    pub fn initramfs(&self) -> PathBuf {
        self.assets_dir.join(INITRAMFS)
    }
}

/// Where Debian puts what VMs need from the host.
const QEMU: &str = "/usr/bin/qemu-system-x86_64";
const QEMU_IMG: &str = "/usr/bin/qemu-img";
const FIRMWARE: &str = "/usr/share/qemu/qboot.rom";
/// The guest's files in the assets directory (made by `scripts/vm-assets`).
const KERNEL: &str = "vmlinux";
const INITRAMFS: &str = "initramfs.cpio";

/// The first of `files` (what it is, where) that cannot be found.
fn first_missing<const N: usize>(
    files: [(&'static str, PathBuf); N],
) -> Option<(&'static str, PathBuf, std::io::Error)> {
    files
        .into_iter()
        .find_map(|(what, path)| fs::metadata(&path).err().map(|error| (what, path, error)))
}

/// Whether this host could run VM sandboxes with the guest files in
/// `assets_dir` and Debian's QEMU: the accelerator they would use, or what
/// is missing. For a runner reporting what it offers; it starts nothing.
pub fn probe(assets_dir: &Path) -> Result<Accelerator, String> {
    let files = [
        ("qemu", PathBuf::from(QEMU)),
        ("qemu-img", PathBuf::from(QEMU_IMG)),
        ("firmware", PathBuf::from(FIRMWARE)),
        (
            "guest kernel (run scripts/vm-assets)",
            assets_dir.join(KERNEL),
        ),
        (
            "initramfs (run scripts/vm-assets)",
            assets_dir.join(INITRAMFS),
        ),
    ];
    match first_missing(files) {
        Some((what, path, error)) => Err(format!("no {what} at {}: {error}", path.display())),
        None => Ok(choose_accelerator(&HostFacts::read()).0),
    }
}

pub struct VmRuntime {
    config: VmConfig,
    accelerator: Accelerator,
    /// Why this accelerator, in words.
    accelerator_reason: &'static str,
    tsc_khz: Option<u64>,
    running: Mutex<HashMap<String, Arc<tokio::sync::Mutex<RunningVm>>>>,
    /// Base disks by image, with the agent file stamp they were made for.
    bases: Mutex<HashMap<PathBuf, (String, PathBuf)>>,
    pool: pool::Pool,
    parking: warm::Parking,
    jails: confine::Jails,
}

impl std::fmt::Debug for VmRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmRuntime")
            .field("config", &self.config)
            .field("accelerator", &self.accelerator)
            .finish_non_exhaustive()
    }
}

fn io_error(id: &str, action: impl Into<String>) -> impl FnOnce(io::Error) -> RuntimeError {
    let id = id.to_owned();
    let action = action.into();
    move |source| RuntimeError::Io { id, action, source }
}

fn confine_error(id: &str) -> impl FnOnce(confine::ConfineError) -> RuntimeError {
    let id = id.to_owned();
    move |source| RuntimeError::Confine { id, source }
}

fn remove_if_present(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(error),
        _ => Ok(()),
    }
}

impl VmRuntime {
    /// Checks the config against the host and picks the accelerator.
    pub fn new(config: VmConfig) -> Result<VmRuntime, RuntimeError> {
        let id = "-";
        let files = [
            ("agent binary", config.agent_binary.clone()),
            ("qemu", config.qemu.clone()),
            ("qemu-img", config.qemu_img.clone()),
            ("firmware", config.firmware.clone()),
            ("guest kernel (run scripts/vm-assets)", config.kernel()),
            ("initramfs (run scripts/vm-assets)", config.initramfs()),
        ];
        if let Some((what, path, error)) = first_missing(files) {
            return Err(io_error(id, format!("find the {what} {}", path.display()))(
                error,
            ));
        }
        let facts = HostFacts::read();
        let (accelerator, accelerator_reason) = match config.accelerator {
            Some(chosen) => (chosen, "set by the server's configuration"),
            None => choose_accelerator(&facts),
        };
        let tsc_khz = facts.tsc_khz();
        let jails =
            confine::Jails::new(config.ids.clone(), accelerator).map_err(confine_error(id))?;
        jails.sweep();
        for path in [config.kernel(), config.initramfs(), config.firmware.clone()] {
            confine::check_public(&path).map_err(confine_error(id))?;
        }
        for dir in ["vms", "captures", "vm-templates"] {
            let path = config.storage.root().join(dir);
            fs::create_dir_all(&path).map_err(RuntimeError::file(id, "create", &path))?;
        }
        // Before any VM is made: templates a newer make replaced go, the
        // bases this data dir's disks name are linked, and the shared cache
        // keeps only bases some data dir links.
        template::sweep_superseded(&config.storage.root().join("vm-templates"));
        disk::sync_references(
            config.storage.root(),
            &config.base_links(),
            &config.assets_dir,
        )
        .map_err(|source| RuntimeError::Disk {
            id: id.to_owned(),
            source,
        })?;
        tracing::info!(
            accelerator = accelerator.name(),
            why = accelerator_reason,
            "VM runtime ready"
        );
        Ok(VmRuntime {
            config,
            accelerator,
            accelerator_reason,
            tsc_khz,
            running: Mutex::default(),
            bases: Mutex::default(),
            pool: pool::Pool::default(),
            parking: warm::Parking::default(),
            jails,
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
        let layout = self.layout(id);
        layout
            .check_socket_paths()
            .map_err(|refused| RuntimeError::start(id, refused.to_string()))?;
        if !layout.dir.exists() {
            let limit = (spec.resources.disk_gib << 30)
                + 2 * (spec.resources.memory_mib << 20)
                + SUBVOLUME_SLACK;
            self.config
                .storage
                .create_limited(&layout.dir, limit)
                .map_err(RuntimeError::storage(id, "make the sandbox's subvolume"))?;
            fs::set_permissions(&layout.dir, fs::Permissions::from_mode(0o700))
                .map_err(RuntimeError::file(id, "chmod", &layout.dir))?;
            reflink::set_nocow(&layout.dir).map_err(RuntimeError::file(
                id,
                "make nocow",
                &layout.dir,
            ))?;
        }
        Ok(layout)
    }

    /// Removes a directory `make_dir` made (a subvolume, or a plain
    /// directory where it is none), if it is there.
    async fn remove_dir(&self, id: &str, dir: &Path) -> Result<(), RuntimeError> {
        let storage = self.config.storage.clone();
        let dir = dir.to_owned();
        blocking(id, move |id| {
            if dir.exists() && storage.delete_subvolume(&dir).is_err() {
                fs::remove_dir_all(&dir).map_err(RuntimeError::file(id, "remove", &dir))?;
            }
            Ok(())
        })
        .await
    }

    fn make_capture_dir(&self, id: &str, capture: &VmLayout) -> Result<(), RuntimeError> {
        fs::create_dir_all(&capture.dir).map_err(RuntimeError::file(id, "create", &capture.dir))?;
        reflink::set_nocow(&capture.dir).map_err(RuntimeError::file(id, "make nocow", &capture.dir))
    }

    async fn template_for(&self, spec: &SandboxSpec) -> Result<VmLayout, RuntimeError> {
        let id = spec.id.as_str();
        let base = self.base_for(id, &spec.rootfs).await?;
        template::ensure(
            self,
            id,
            &spec.rootfs,
            &base,
            spec.resources.cpu.max(1),
            spec.resources.memory_mib,
        )
        .await
    }

    /// The base disk of an image. Its key hashes the whole agent binary, so
    /// the answer is remembered for as long as the agent file looks the same.
    async fn base_for(&self, id: &str, rootfs: &Path) -> Result<PathBuf, RuntimeError> {
        let stamp = disk::file_stamp(&self.config.agent_binary).map_err(RuntimeError::file(
            id,
            "read",
            &self.config.agent_binary,
        ))?;
        if let Some((known, base)) = self.bases.lock().expect("bases lock").get(rootfs) {
            if *known == stamp && base.exists() {
                return Ok(base.clone());
            }
        }
        let (cache, owned_rootfs, agent, references) = (
            self.config.assets_dir.clone(),
            rootfs.to_owned(),
            self.config.agent_binary.clone(),
            self.config.base_links(),
        );
        let base = blocking(id, move |id| {
            disk::ensure_base(&cache, &owned_rootfs, &agent, &references).map_err(|source| {
                RuntimeError::Disk {
                    id: id.to_owned(),
                    source,
                }
            })
        })
        .await?;
        self.bases
            .lock()
            .expect("bases lock")
            .insert(rootfs.to_owned(), (stamp, base.clone()));
        Ok(base)
    }
}

#[async_trait]
impl Runtime for VmRuntime {
    async fn prepare(&self, spec: &SandboxSpec) -> Result<(), RuntimeError> {
        let id = spec.id.as_str();
        if self.claim_warm(spec).await {
            return Ok(());
        }
        let layout = self.make_dir(spec)?;
        if layout.disk().exists() {
            return Ok(());
        }
        // QEMU cannot save a virtio-fs device, so a VM with volumes never
        // continues from memory: it boots cold from the disk alone.
        let cold = !spec.volumes.is_empty();
        if let Some(top) = spec.layers.first() {
            let from = VmLayout::new(top.clone());
            return blocking(id, move |id| {
                if from.has_memory() && !cold {
                    clone_saved(&from, &layout)
                } else {
                    reflink::clone_file(&from.disk(), &layout.disk())
                }
                .map_err(RuntimeError::file(id, "copy the layer", &from.dir))
            })
            .await;
        }
        if self.config.templates && !cold {
            let template = self.template_for(spec).await?;
            return blocking(id, move |id| {
                clone_saved(&template, &layout).map_err(RuntimeError::file(
                    id,
                    "copy the template",
                    &template.dir,
                ))
            })
            .await;
        }
        let base = self.base_for(id, &spec.rootfs).await?;
        let qemu_img = self.config.qemu_img.clone();
        let bytes = spec.resources.disk_gib << 30;
        blocking(id, move |id| {
            disk::create_overlay(&qemu_img, &base, &layout.disk(), bytes).map_err(|source| {
                RuntimeError::Disk {
                    id: id.to_owned(),
                    source,
                }
            })
        })
        .await
    }

    async fn start(&self, spec: &SandboxSpec) -> Result<Started, RuntimeError> {
        if let Some(started) = self.unpark(spec).await {
            return started;
        }
        let began = Instant::now();
        let id = spec.id.as_str();
        // Frozen by an earlier server: continued from its memory, saved now.
        self.deepen(id).await?;
        let layout = self.layout(id);
        let warm = self.claimed_or_prepared(spec, &layout).await?;
        let (taken, restoring) = (warm.is_some(), warm.is_some() || layout.has_memory());
        let (mut guard, exited_rx) = self.start_decided(spec, &layout, warm).await?;
        let served = match guard.running_mut() {
            Some(vm) => Bridge::serve(&layout.agent_socket(), vm.session.clone())
                .map(|bridge| vm.bridge = Some(bridge)),
            None => Err(io::Error::other("the VM has no agent session")),
        };
        if let Err(error) = served {
            guard.abort().await;
            return Err(io_error(
                id,
                format!("serve {}", layout.agent_socket().display()),
            )(error));
        }
        let vm = guard
            .commit()
            .ok_or_else(|| RuntimeError::other(id, "its start ended without its agent"))?;
        self.running
            .lock()
            .expect("running map lock")
            .insert(id.to_owned(), Arc::new(tokio::sync::Mutex::new(vm)));
        tracing::info!(
            sandbox = id,
            accelerator = self.accelerator.name(),
            from_memory = restoring,
            warm = taken,
            elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm started"
        );
        Ok(Started {
            agent: AgentEndpoint::Unix(layout.agent_socket()),
            exited: exited_rx,
            accelerator: Some(self.accelerator.name()),
        })
    }

    fn volumes_unavailable(&self) -> Option<String> {
        self.config.virtiofsd.is_none().then(|| {
            "volumes in VM sandboxes on this host: virtiofsd was not found \
             (scripts/vm-setup builds it; or set COVE_VIRTIOFSD)"
                .to_owned()
        })
    }

    async fn stop(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let id = id.as_str();
        let layout = self.layout(id);
        if self.end_parked(id).await {
            // Flushed and ended: its memory goes below.
        } else if let Some(vm) = self.take_running(id) {
            let mut vm = vm.lock().await;
            // Guest writes still in its page cache would be lost with the VM.
            if !vm.flush_guest_disks().await {
                tracing::warn!(
                    sandbox = id,
                    "the agent did not flush its disks before the stop"
                );
            }
            vm.bridge.take();
            vm.machine.quit().await;
        } else if let Some(pid) = orphan_pid(&layout) {
            end_orphan(&self.jails, pid, true).await;
        } else {
            self.flush_paused_disk(id, false).await?;
        }
        shares::end(&layout);
        let _ = remove_if_present(&layout.agent_socket());
        if layout.dir.exists() {
            discard_memory_files(&layout).map_err(io_error(id, "discard its memory"))?;
        }
        Ok(())
    }

    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let id = id.as_str();
        let layout = self.layout(id);
        if let Some(warm) = self.pool.claimed(id) {
            warm.vm.machine.kill().await;
        }
        self.kill_parked(id).await;
        if let Some(vm) = self.take_running(id) {
            let vm = vm.lock().await;
            vm.machine.kill().await;
        }
        if let Some(pid) = orphan_pid(&layout) {
            end_orphan(&self.jails, pid, false).await;
        }
        shares::end(&layout);
        if let Err(error) = forget_launch(&layout) {
            tracing::warn!(sandbox = id, %error, "removing the old name of a warm VM");
        }
        self.remove_dir(id, &layout.dir).await
    }

    /// Each VM this process runs is a QEMU process with an agent in its
    /// guest; the warm pool's machines are QEMU processes too (their agents
    /// serve no sandbox yet), as are those a create took but has not started.
    fn accelerator(&self) -> Option<(&'static str, &'static str)> {
        Some((self.accelerator.name(), self.accelerator_reason))
    }

    fn census(&self) -> crate::Census {
        let running = self.running.lock().expect("running map lock").len();
        let (waiting, claimed) = self.pool.counts();
        crate::Census {
            agents: running,
            qemu_processes: running + waiting + claimed + self.parking.count(),
            warm: waiting,
        }
    }

    async fn is_running(&self, id: &SandboxId) -> bool {
        let id = id.as_str();
        // Paused, though its QEMU process is kept.
        if self.parking.holds(id) || self.layout(id).warm_paused().exists() {
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

    async fn reattach(&self, spec: &SandboxSpec) -> Result<Option<Started>, RuntimeError> {
        let id = spec.id.as_str();
        if self.running(id).is_some() {
            return Err(RuntimeError::AlreadyRunning { id: id.to_owned() });
        }
        let layout = self.layout(id);
        let Some(pid) = orphan_pid(&layout) else {
            return Ok(None);
        };
        let (exited_tx, exited_rx) = oneshot::channel();
        let mut vm = self.take_over(id, &layout, pid as u32, exited_tx).await?;
        match Bridge::serve(&layout.agent_socket(), vm.session.clone()) {
            Ok(bridge) => vm.bridge = Some(bridge),
            Err(error) => {
                return Err(io_error(
                    id,
                    format!("serve {}", layout.agent_socket().display()),
                )(error))
            }
        }
        self.running
            .lock()
            .expect("running map lock")
            .insert(id.to_owned(), Arc::new(tokio::sync::Mutex::new(vm)));
        tracing::info!(sandbox = id, %pid, "took over a running vm after a server restart");
        Ok(Some(Started {
            agent: AgentEndpoint::Unix(layout.agent_socket()),
            exited: exited_rx,
            accelerator: Some(self.accelerator.name()),
        }))
    }

    async fn capture(&self, id: &SandboxId, capture_id: &str) -> Result<PathBuf, RuntimeError> {
        let id = id.as_str();
        check_id(capture_id)?;
        let source = self.layout(id);
        let dest = self.capture_layout(capture_id);
        self.make_capture_dir(id, &dest)?;
        let (from, to) = (source.disk(), dest.disk());
        let copy = move |id: &str| {
            reflink::clone_file(&from, &to).map_err(RuntimeError::file(
                id,
                "clone the disk to",
                &to,
            ))
        };
        let copied = match self.running(id) {
            Some(vm) => {
                let vm = vm.lock().await;
                // What the guest has written but holds in its page cache
                // belongs in the capture too; flushed while it still runs.
                if !vm.flush_guest_disks().await {
                    tracing::warn!(
                        sandbox = id,
                        "the agent did not flush its disks before a capture"
                    );
                }
                self.with_vm_frozen(id, &vm, None, copy).await
            }
            None => {
                async {
                    self.flush_paused_disk(id, true).await?;
                    blocking(id, copy).await
                }
                .await
            }
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
        blocking(capture_id, move |id| match fs::remove_dir_all(&dir) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => {
                Err(RuntimeError::file(id, "remove", dir)(error))
            }
            _ => Ok(()),
        })
        .await
    }

    async fn revert(&self, spec: &SandboxSpec, capture_id: &str) -> Result<(), RuntimeError> {
        let id = spec.id.as_str();
        check_id(capture_id)?;
        if self.is_running(&spec.id).await {
            return Err(RuntimeError::Running {
                id: id.to_owned(),
                action: "be reverted",
            });
        }
        let layout = self.make_dir(spec)?;
        let capture = self.capture_layout(capture_id);
        blocking(id, move |id| {
            if !capture.disk().exists() {
                return Err(RuntimeError::other(
                    id,
                    format!("capture {} does not exist", capture.dir.display()),
                ));
            }
            if capture.has_memory() {
                clone_saved(&capture, &layout)
            } else {
                discard_memory_files(&layout)
                    .and_then(|()| reflink::clone_replacing(&capture.disk(), &layout.disk()))
            }
            .map_err(RuntimeError::file(id, "copy the capture", &capture.dir))
        })
        .await
    }

    async fn pause(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let id = id.as_str();
        let began = Instant::now();
        let Some(vm) = self.take_running(id) else {
            return Err(RuntimeError::NotRunning { id: id.to_owned() });
        };
        let layout = self.layout(id);
        let vm = match self.park(id, &layout, vm).await {
            Ok(()) => {
                tracing::info!(
                    sandbox = id,
                    elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
                    "vm paused warm"
                );
                return Ok(());
            }
            Err(vm) => vm,
        };
        let mut guard = vm.lock().await;
        // What the guest wrote but holds in its page cache is not flushed
        // first (that was most of a pause): it is saved with the memory, and
        // written out if that memory is ever dropped (`flush_paused_disk`).
        let partial = match save_device_state(&guard.machine, &layout).await {
            Ok(partial) => partial,
            Err(error) => {
                // The VM keeps running as it was.
                let _ = guard.machine.resume().await;
                drop(guard);
                self.running
                    .lock()
                    .expect("running map lock")
                    .insert(id.to_owned(), vm);
                return Err(RuntimeError::machine(id, "save its state")(error));
            }
        };
        let saved_ms = began.elapsed().as_secs_f64() * 1e3;
        guard.bridge.take();
        keep_saved_memory(
            id,
            &guard.machine,
            &layout,
            &partial,
            Some(id.to_owned()),
            false,
        )
        .await?;
        drop(guard);
        tracing::info!(
            sandbox = id,
            saved_ms,
            elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm paused"
        );
        Ok(())
    }

    async fn discard_memory(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let (sandbox, id) = (id, id.as_str());
        if self.end_parked(id).await {
            let layout = self.layout(id);
            return discard_memory_files(&layout).map_err(io_error(id, "discard its memory"));
        }
        if self.is_running(sandbox).await {
            // A running VM's RAM file is its live memory, not a saved one.
            return Ok(());
        }
        let layout = self.layout(id);
        if !layout.dir.exists() {
            return Ok(());
        }
        self.flush_paused_disk(id, false).await?;
        discard_memory_files(&layout).map_err(io_error(id, "discard its memory"))
    }

    async fn capture_with_memory(
        &self,
        id: &SandboxId,
        capture_id: &str,
    ) -> Result<PathBuf, RuntimeError> {
        let id = id.as_str();
        check_id(capture_id)?;
        let dest = self.capture_layout(capture_id);
        self.make_capture_dir(id, &dest)?;
        if let Err(error) = self.copy_memory(id, dest.clone()).await {
            let _ = fs::remove_dir_all(&dest.dir);
            return Err(error);
        }
        Ok(dest.dir)
    }

    async fn fork(&self, parent: &SandboxId, child: &SandboxSpec) -> Result<(), RuntimeError> {
        let parent = parent.as_str();
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

    async fn fork_many(
        &self,
        parent: &SandboxId,
        children: &[SandboxSpec],
    ) -> Result<(), RuntimeError> {
        let parent = parent.as_str();
        let began = Instant::now();
        let dests = children
            .iter()
            .map(|child| self.make_dir(child))
            .collect::<Result<Vec<_>, _>>()?;
        self.copy_memory_to_all(parent, dests).await?;
        tracing::info!(
            sandbox = parent,
            children = children.len(),
            elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm forked into many"
        );
        Ok(())
    }
}

impl VmRuntime {
    /// The warm VM `prepare` took for `spec`, if it took one; the sandbox's
    /// files are made first where its disk is missing (a start without a
    /// create: the engine prepares only at a create).
    async fn claimed_or_prepared(
        &self,
        spec: &SandboxSpec,
        layout: &VmLayout,
    ) -> Result<Option<pool::WarmVm>, RuntimeError> {
        let id = spec.id.as_str();
        if let Some(warm) = self.pool.claimed(id) {
            return Ok(Some(warm));
        }
        if self.is_running(&spec.id).await {
            return Err(RuntimeError::AlreadyRunning { id: id.to_owned() });
        }
        if !layout.disk().exists() {
            self.prepare(spec).await?;
            return Ok(self.pool.claimed(id));
        }
        Ok(None)
    }

    /// Gathers the facts, decides how `spec`'s VM starts (see `start`) and
    /// starts it that way. Returns the guard of the running VM, for the
    /// caller to commit, and what learns of its end.
    async fn start_decided(
        &self,
        spec: &SandboxSpec,
        layout: &VmLayout,
        warm: Option<pool::WarmVm>,
    ) -> Result<(guard::StartGuard, oneshot::Receiver<String>), RuntimeError> {
        let id = spec.id.as_str();
        let facts = self.start_facts(id, layout, Wanted::of(spec), warm)?;
        let (restore, plan) = match start::decide(facts) {
            Ok(VmStart::Warm(warm)) => return self.start_warm(spec, warm).await,
            Ok(VmStart::Restore(plan)) => (true, plan),
            Ok(VmStart::Cold(plan)) => (false, plan),
            Err(refusal) => return Err(RuntimeError::start(id, refusal.reason())),
        };
        let identity = Identity::of(spec)?;
        let (exited_tx, exited_rx) = oneshot::channel();
        let guard = self
            .bring_up_planned(id, layout, &identity, restore, plan, exited_tx)
            .await?;
        Ok((guard, exited_rx))
    }
}

/// Stops the vCPUs and saves the device state to `state.partial`.
async fn save_device_state(
    machine: &machine::Machine,
    layout: &VmLayout,
) -> Result<PathBuf, machine::MachineError> {
    machine.pause_vcpus().await?;
    let partial = layout.dir.join("state.partial");
    machine.save_state(&partial).await?;
    Ok(partial)
}

/// Ends the QEMU of a VM whose device state was saved to `partial`, and
/// makes that the sandbox's saved memory, continued by `owner` alone
/// without an identity call.
async fn keep_saved_memory(
    id: &str,
    machine: &machine::Machine,
    layout: &VmLayout,
    partial: &Path,
    owner: Option<String>,
    disk_current: bool,
) -> Result<(), RuntimeError> {
    machine.quit().await;
    let machine = SavedMachine::read(&layout.machine()).map(|machine| SavedMachine {
        owner,
        disk_current,
        ..machine
    });
    machine
        .and_then(|machine| machine.write(&layout.machine()))
        .map_err(RuntimeError::file(id, "update", layout.machine()))?;
    fs::rename(partial, layout.state()).map_err(RuntimeError::file(
        id,
        "move in place",
        layout.state(),
    ))
}

impl VmRuntime {
    /// Brings the disk of a VM that paused without flushing up to date with
    /// its memory: the VM continues from that memory for a moment (without
    /// its network, and as itself: no identity call), its agent flushes,
    /// and then it is saved again (`keep_memory`) or simply ends, its
    /// memory about to be dropped. Nothing to do for any other VM.
    async fn flush_paused_disk(&self, id: &str, keep_memory: bool) -> Result<(), RuntimeError> {
        self.deepen(id).await?;
        let layout = self.layout(id);
        if !layout.has_memory() {
            return Ok(());
        }
        let machine_file = layout.machine();
        let saved = SavedMachine::read(&machine_file).map_err(RuntimeError::file(
            id,
            "read",
            &machine_file,
        ))?;
        if saved.disk_current {
            return Ok(());
        }
        if let Some(why) = saved.incompatibility(self.accelerator) {
            tracing::warn!(
                sandbox = id,
                %why,
                "the disk of this paused VM cannot be flushed: its memory cannot be restored here"
            );
            return Ok(());
        }
        let began = Instant::now();
        let owner = saved.owner.clone();
        SavedMachine {
            owner: Some(id.to_owned()),
            ..saved.clone()
        }
        .write(&machine_file)
        .map_err(RuntimeError::file(id, "update", &machine_file))?;
        let disk_bytes = disk::qcow2_size(&layout.disk()).map_err(|source| RuntimeError::Disk {
            id: id.to_owned(),
            source,
        })?;
        // Which NIC backend the memory was saved on is not recorded: a hub
        // port is tried first when the memory is to be saved again, so it
        // stays loadable where it was; a TAP loads either kind.
        let tries: &[bool] = if keep_memory { &[false, true] } else { &[true] };
        let mut brought_up = Err(RuntimeError::other(id, "no attempt to continue it"));
        for &tap in tries {
            let identity = Identity::for_flush(saved.cpus, saved.memory_mib, disk_bytes, tap)
                .map_err(io_error(id, "name a TAP device for the flush"))?;
            let (exited, _) = oneshot::channel();
            brought_up = self.bring_up(id, &layout, &identity, exited).await;
            if brought_up.is_ok() {
                break;
            }
        }
        let mut vm = brought_up?;
        if !vm.flush_guest_disks().await {
            vm.machine.kill().await;
            return Err(RuntimeError::other(
                id,
                "its agent did not flush the disk it paused with unwritten changes",
            ));
        }
        if keep_memory {
            let partial = match save_device_state(&vm.machine, &layout).await {
                Ok(partial) => partial,
                Err(error) => {
                    vm.machine.kill().await;
                    return Err(RuntimeError::machine(
                        id,
                        "save its memory again after flushing its disk",
                    )(error));
                }
            };
            vm.bridge.take();
            keep_saved_memory(id, &vm.machine, &layout, &partial, owner, true).await?;
        } else {
            vm.machine.quit().await;
        }
        tracing::info!(
            sandbox = id,
            keep_memory,
            elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
            "flushed the disk of a paused vm"
        );
        Ok(())
    }
}
