//! The container backend: a sandbox is a set of Linux namespaces over an overlayfs of its
//! image and its own writable layer, confined by a cgroup, with the agent as PID 1.
//!
//! The server process (multi-threaded, tokio) never forks with work to do after the
//! fork: `start` takes a shim (`cove __container-init`, see `shim`) whose init already
//! waits in cgroups of its own from the pool (`pool`), or makes one, renames those
//! cgroups to the sandbox and writes its limits, and sends the init its settings; the
//! init builds the container and the shim answers with one line. Module map:
//! `layout` (host paths of a sandbox), `cgroup` (limits, membership, kill),
//! `init_args` (server to shim message), `shim` (the shim and container init),
//! `pool` (shims made ahead, their cgroups, their sweep),
//! `rootfs` (mounts and pivot_root), `harden` (capabilities, no_new_privs, installing
//! the seccomp programs, unprivileged ping), `seccomp` (the syscall allow-list),
//! `loopback` (the only interface of a sandbox without a network).
//!
//! Everything a container mounts lives in its own mount namespace, so the host is clean
//! once its processes are gone; the host objects are the cgroup and `{state_dir}/{id}`.

pub(crate) mod cgroup;
mod harden;
mod init_args;
mod layout;
mod loopback;
mod pool;
mod rootfs;
mod seccomp;
mod shim;
mod step;
mod userns;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::AsyncBufReadExt;
use tokio::process::Child;
use tokio::sync::{oneshot, watch};

use crate::timeline::Timeline;
use crate::SandboxId;
use crate::{
    blocking, check_id, AgentEndpoint, NetworkLink, Runtime, RuntimeError, SandboxNetwork,
    SandboxSpec, Started,
};
use cgroup::{CgroupBackend, CgroupLimits};
use init_args::{InitArgs, ShimReport};
use layout::SandboxLayout;
use pool::{ShimMaker, ShimPool, WaitingShim};

pub use cgroup::CgroupError;
pub use layout::PathRefused;
pub use shim::container_init_main;
pub use userns::{IdPool, IdPoolError, IdRanges, UsernsError};

/// How long the shim may take to build a container before `start` gives up.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `stop` waits for a killed shim to be reaped after the cgroup is empty.
const SHIM_EXIT_TIMEOUT: Duration = Duration::from_secs(5);
/// Names the sysfs directory of the sandbox's quota group for the agent.
const DISK_QGROUP_ENV: &str = "COVE_DISK_QGROUP";
/// Where the cgroup controllers are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

#[derive(Clone, Debug)]
pub struct ContainerConfig {
    /// Per-sandbox directories: `{state_dir}/{id}/{upper,work,rootfs,run}`.
    pub state_dir: PathBuf,
    /// The static cove-agent on the host, bind-mounted read-only into each container.
    pub agent_binary: PathBuf,
    /// The `cove` binary itself; spawned as `<init_exe> __container-init`.
    pub init_exe: PathBuf,
    /// Cgroups are `{controller root}/{cgroup_parent}/{id}`.
    pub cgroup_parent: String,
    /// `pids.max` of every sandbox.
    pub pids_max: u64,
    /// Enforces each sandbox's disk size with a project quota on its directory;
    /// `state_dir` must then be on this storage. Without it disk is not limited.
    pub storage: Option<Arc<crate::storage::Storage>>,
    /// The host ids sandboxes' user namespaces map to, a range of 65536 each.
    pub userns_pool: IdPool,
    /// How many shims wait, in cgroups of their own, for the next starts (see
    /// `pool`); 0 makes each on the request path. Ignored on cgroup v2.
    pub shim_pool: usize,
    /// The pool refills a shim only once requests leave the host quiet (or
    /// the pool is empty).
    pub quiet: cove_quiet::Quiet,
}

impl ContainerConfig {
    /// A config with the default cgroup parent `cove` and 4096 pids per sandbox.
    pub fn new(state_dir: PathBuf, agent_binary: PathBuf, init_exe: PathBuf) -> Self {
        Self {
            state_dir,
            agent_binary,
            init_exe,
            cgroup_parent: "cove".into(),
            pids_max: 4096,
            storage: None,
            userns_pool: IdPool::default(),
            shim_pool: 0,
            quiet: cove_quiet::Quiet::default(),
        }
    }
}

pub struct ContainerRuntime {
    config: ContainerConfig,
    cgroups: Arc<dyn CgroupBackend>,
    /// Shims this process started, by sandbox id; the flag turns true when one exits.
    shims: Arc<Mutex<HashMap<String, watch::Receiver<bool>>>>,
    /// The user-namespace id ranges of the sandboxes this process started
    /// (shared with the VM runtime: see [`ContainerRuntime::id_ranges`]).
    ids: Arc<userns::IdRanges>,
    maker: Arc<ShimMaker>,
    pool: ShimPool,
    /// Held by each receive of a captured layer from its measure of the
    /// free space to its end: two at once would each take their budget
    /// from the same free space (`receive_capture`).
    receiving: Arc<Mutex<()>>,
}

impl std::fmt::Debug for ContainerRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContainerRuntime")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn cgroup_error(id: &str) -> impl FnOnce(CgroupError) -> RuntimeError {
    let id = id.to_owned();
    move |source| RuntimeError::Cgroup { id, source }
}

impl ContainerRuntime {
    /// Checks the config against the host and makes the state directory.
    pub fn new(config: ContainerConfig) -> Result<Self, RuntimeError> {
        let id = "-";
        for (what, path) in [
            ("agent binary", &config.agent_binary),
            ("init executable", &config.init_exe),
        ] {
            fs::metadata(path).map_err(|source| RuntimeError::Io {
                id: id.to_owned(),
                action: format!("find the {what} {}", path.display()),
                source,
            })?;
        }
        if config.cgroup_parent.is_empty() || config.cgroup_parent.contains("..") {
            return Err(RuntimeError::other(
                id,
                "cgroup_parent must be a plain name",
            ));
        }
        fs::create_dir_all(&config.state_dir).map_err(RuntimeError::file(
            id,
            "create the state directory",
            &config.state_dir,
        ))?;
        let cgroups: Arc<dyn CgroupBackend> = Arc::from(cgroup::detect(
            Path::new(CGROUP_ROOT),
            &config.cgroup_parent,
        ));
        let maker = Arc::new(ShimMaker::new(
            config.init_exe.clone(),
            config.agent_binary.clone(),
            Arc::clone(&cgroups),
            config.pids_max,
            &config.state_dir,
        ));
        let swept = maker.sweep();
        if !swept.is_empty() {
            tracing::info!(cgroups = ?swept, "removed the shim pool a previous run left");
        }
        let target = if cgroups.renames() {
            config.shim_pool
        } else {
            0
        };
        let pool = ShimPool::new(target, Arc::clone(&maker), config.quiet.clone());
        Ok(Self {
            ids: Arc::new(userns::IdRanges::new(config.userns_pool)),
            config,
            cgroups,
            shims: Arc::default(),
            maker,
            pool,
            receiving: Arc::default(),
        })
    }

    /// Starts filling the pool of waiting shims (`shim_pool` of them), in the
    /// background. A server calls it once nothing of its start can fail any
    /// more, so a start that fails leaves no pool cgroup behind.
    pub fn fill_pool(&self) {
        self.pool.refill();
    }

    /// Ends the shims waiting in the pool and removes their cgroups; call at
    /// shutdown (they would die with the server anyway, their cgroups not).
    pub async fn end_pool(&self) {
        self.pool.close().await;
    }
    /// Ends every container this runtime started and removes their cgroups,
    /// as the server stops (its containers end with it anyway, when its
    /// threads do, but their cgroups would stay behind, and for good if the
    /// data directory is never started again). The next start brings the
    /// sandboxes back. Returns how many it ended.
    pub async fn end_sandboxes(&self) -> usize {
        let ids: Vec<String> = self
            .shims
            .lock()
            .expect("shim map lock")
            .keys()
            .cloned()
            .collect();
        let mut ended = 0;
        for id in ids {
            match self.kill_all(&id).await {
                Ok(()) => ended += 1,
                Err(error) => {
                    tracing::warn!(sandbox = %id, %error, "ending a container as the server stops")
                }
            }
        }
        ended
    }

    /// How many shims wait in the pool (for tests and diagnostics).
    pub fn pooled_shims(&self) -> usize {
        self.pool.ready()
    }

    /// The host pids of the pool's waiting container inits (for tests).
    pub fn pooled_init_pids(&self) -> Vec<i32> {
        self.pool.init_pids()
    }

    fn layout(&self, id: &str) -> SandboxLayout {
        SandboxLayout::new(&self.config.state_dir, id)
    }

    /// The host id ranges of this runtime's pool, for the VM runtime: its
    /// QEMU and virtiofsd processes take their ids from the same pool, so
    /// no VM process ever shares a host id with a container.
    pub fn id_ranges(&self) -> Arc<userns::IdRanges> {
        self.ids.clone()
    }

    /// The cgroup `cgroup.procs` files of a sandbox (for tests and diagnostics).
    pub fn cgroup_procs_files(&self, id: &str) -> Vec<PathBuf> {
        self.cgroups.procs_files(id)
    }

    fn storage(&self, id: &str) -> Result<&Arc<crate::storage::Storage>, RuntimeError> {
        self.config
            .storage
            .as_ref()
            .ok_or_else(|| RuntimeError::Unsupported {
                id: id.to_owned(),
                what: "snapshots".to_owned(),
                why: "without the sandbox storage (btrfs), which this runtime was not given"
                    .to_owned(),
            })
    }

    /// Where captures live: beside the sandboxes, on the same storage.
    fn captures_dir(&self) -> PathBuf {
        let storage_root = self
            .config
            .state_dir
            .parent()
            .unwrap_or(&self.config.state_dir);
        storage_root.join("captures")
    }

    fn capture_dir(&self, capture_id: &str) -> PathBuf {
        self.captures_dir().join(capture_id)
    }

    /// Where receives of captures from another host write until whole.
    fn capture_transfers_dir(&self) -> PathBuf {
        self.captures_dir().join(".incoming")
    }

    /// The layer of capture `capture_id`: what a sandbox of a snapshot
    /// taken from a sandbox mounts under its own (`SandboxSpec::layers`).
    pub fn captured_layer(&self, capture_id: &str) -> PathBuf {
        self.capture_dir(capture_id).join("upper")
    }

    /// The names of the captures on this runtime's storage (`captures/`,
    /// without the transfers under way there).
    pub fn capture_ids(&self) -> Vec<String> {
        let entries = fs::read_dir(self.captures_dir())
            .into_iter()
            .flatten()
            .flatten();
        entries
            .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
            .filter_map(|entry| entry.file_name().into_string().ok())
            .filter(|name| !name.starts_with('.'))
            .collect()
    }

    /// Removes what receives of captures left under `captures/.incoming`
    /// when their process died mid-way (each is named by its pid): the
    /// stream and any subvolume made of it. Answers how many went.
    pub fn sweep_capture_transfers(&self) -> usize {
        let incoming = self.capture_transfers_dir();
        let (Some(storage), Ok(entries)) = (&self.config.storage, fs::read_dir(&incoming)) else {
            return 0;
        };
        let mut swept = 0;
        for entry in entries.flatten() {
            let pid = (entry.file_name().to_str())
                .and_then(|name| name.split_once('-'))
                .and_then(|(pid, _)| pid.parse::<i32>().ok());
            if pid.is_some_and(crate::process_alive) {
                continue;
            }
            let into = entry.path().join("into");
            for made in fs::read_dir(&into).into_iter().flatten().flatten() {
                if let Err(error) = storage.delete_subvolume(&made.path()) {
                    tracing::warn!(path = %made.path().display(), %error, "cannot delete a capture a runner before left half-received");
                }
            }
            if fs::remove_dir_all(entry.path()).is_ok() {
                swept += 1;
            }
        }
        swept
    }

    /// Makes capture `capture_id` here from the `btrfs send` stream of
    /// another host's (a runner given a snapshot taken on the control
    /// plane, or the control plane given a runner's): received under
    /// `captures/.incoming`, checked (`send_stream`: one whole subvolume,
    /// cloning from nothing else here), put in place only once whole, and
    /// deleted when anything fails. Answers its layer. A
    /// capture already here is kept as it is. Receives run one at a time,
    /// each measuring the free space once the one before it is done.
    pub async fn receive_capture(
        &self,
        capture_id: &str,
        mut stream: impl std::io::Read + Send + 'static,
    ) -> Result<PathBuf, RuntimeError> {
        check_id(capture_id)?;
        let storage = self.storage(capture_id)?.clone();
        let dest = self.capture_dir(capture_id);
        let incoming = self.capture_transfers_dir().join(format!(
            "{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        let receiving = Arc::clone(&self.receiving);
        blocking(capture_id, move |id| {
            // A receive that panicked left nothing this one relies on.
            let _one_at_a_time = receiving.lock().unwrap_or_else(|e| e.into_inner());
            let file = RuntimeError::file;
            fs::create_dir_all(&incoming).map_err(file(id, "create", &incoming))?;
            let sent = incoming.join("stream");
            let received = (|| {
                let mut out = fs::File::create(&sent).map_err(file(id, "create", &sent))?;
                // Spooled on the storage sandboxes write to, and written
                // once more by the receive: a layer larger than this
                // storage can take fails here, saying so, rather than
                // fill the disk under the sandboxes running on it.
                let usage = crate::storage::filesystem_usage(&incoming)
                    .map_err(RuntimeError::storage(id, "measure the storage"))?;
                let budget = spool_budget(usage);
                let copied = io::copy(&mut io::Read::take(&mut stream, budget + 1), &mut out)
                    .map_err(file(id, "write", &sent))?;
                if copied > budget {
                    return Err(RuntimeError::other(
                        id,
                        format!(
                            "the captured layer is larger than this runner's storage can \
                             take now ({} MiB free; a layer may take {} MiB of it)",
                            usage.available >> 20,
                            budget >> 20
                        ),
                    ));
                }
                // Only a whole subvolume that takes nothing from another of
                // this storage's: a runner's capture is made by another machine.
                crate::send_stream::check_file(&sent)
                    .map_err(|error| RuntimeError::other(id, error.to_string()))?;
                let made = storage
                    .receive(&sent, &incoming.join("into"))
                    .map_err(RuntimeError::storage(id, "receive the capture"))?;
                if made.file_name().and_then(|n| n.to_str()) != Some(id) {
                    let _ = storage.delete_subvolume(&made);
                    return Err(RuntimeError::other(
                        id,
                        format!("the stream held {}, not capture {id}", made.display()),
                    ));
                }
                // A read-only subvolume cannot be renamed (its `..` would
                // change): a read-only snapshot of it, instant, takes its place.
                let placed = match dest.exists() {
                    true => Ok(()),
                    false => (storage.snapshot(&made, &dest, true))
                        .map_err(RuntimeError::storage(id, "put the capture in place")),
                };
                let _ = storage.delete_subvolume(&made);
                placed
            })();
            let _ = fs::remove_dir_all(&incoming);
            received.map(|()| dest.join("upper"))
        })
        .await
    }

    fn make_dirs(&self, spec: &SandboxSpec) -> Result<SandboxLayout, RuntimeError> {
        let id = spec.id.as_str();
        let layout = self.layout(id);
        for path in spec.layers.iter().chain([&spec.rootfs, &layout.dir]) {
            layout::check_overlay_path(path)
                .map_err(|refused| RuntimeError::start(id, refused.to_string()))?;
        }
        layout::check_socket_path(&layout.agent_socket())
            .map_err(|refused| RuntimeError::start(id, refused.to_string()))?;
        if let Some(storage) = &self.config.storage {
            if !layout.dir.exists() {
                // A subvolume capped at the disk size holds every layer of the sandbox.
                fs::create_dir_all(&self.config.state_dir).map_err(RuntimeError::file(
                    id,
                    "create",
                    &self.config.state_dir,
                ))?;
                storage
                    .create_limited(&layout.dir, spec.resources.disk_gib << 30)
                    .map_err(RuntimeError::storage(id, "make the sandbox's subvolume"))?;
            }
        }
        // Only root on the host may look into a sandbox's layer and socket.
        fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(&layout.dir)
            .map_err(RuntimeError::file(id, "create", &layout.dir))?;
        fs::set_permissions(&layout.dir, fs::Permissions::from_mode(0o700))
            .map_err(RuntimeError::file(id, "chmod", &layout.dir))?;
        for dir in layout.dirs() {
            fs::create_dir_all(&dir).map_err(RuntimeError::file(id, "create", &dir))?;
        }
        Ok(layout)
    }

    /// Kills every process of the sandbox, waits until its cgroup is empty and removes it.
    async fn kill_all(&self, id: &str) -> Result<(), RuntimeError> {
        let cgroups = Arc::clone(&self.cgroups);
        let owned = id.to_string();
        tokio::task::spawn_blocking(move || cgroup::kill_and_remove(cgroups.as_ref(), &owned))
            .await
            .map_err(|source| RuntimeError::Task {
                id: id.to_owned(),
                what: "kill",
                source,
            })?
            .map_err(cgroup_error(id))?;
        let shim = self.shims.lock().expect("shim map lock").remove(id);
        if let Some(mut exited) = shim {
            // The shim was in the cgroup, so it is dead; this waits only for its reaping.
            let _ = tokio::time::timeout(SHIM_EXIT_TIMEOUT, exited.wait_for(|done| *done)).await;
        }
        // No process of the sandbox is left to hold its ids.
        self.ids.release(id);
        Ok(())
    }

    /// Reads the shim's one line; on failure cleans up what `start` made.
    async fn await_shim(
        &self,
        id: &str,
        shim: &mut WaitingShim,
        console: &Path,
    ) -> Result<(i32, String), RuntimeError> {
        let mut line = String::new();
        let read = tokio::time::timeout(START_TIMEOUT, shim.reports.read_line(&mut line)).await;
        let child = &mut shim.child;
        let failure = match read {
            Ok(Ok(n)) if n > 0 => match ShimReport::parse(&line) {
                Ok(ShimReport::Ready { init_pid, steps }) => return Ok((init_pid, steps)),
                Ok(ShimReport::Waiting { .. }) => {
                    RuntimeError::start(id, format!("unexpected shim report {line:?}"))
                }
                Ok(ShimReport::Error(report)) => RuntimeError::Shim {
                    id: id.to_owned(),
                    report,
                },
                Err(unreadable) => RuntimeError::start(id, unreadable.to_string()),
            },
            Ok(Ok(_)) => {
                let status = child
                    .wait()
                    .await
                    .map(|s| s.to_string())
                    .unwrap_or_else(|e| e.to_string());
                RuntimeError::start(
                    id,
                    format!(
                        "shim exited ({status}) without a report; console: {}",
                        console_tail(console)
                    ),
                )
            }
            Ok(Err(source)) => RuntimeError::Io {
                id: id.to_owned(),
                action: "read the shim's report".to_owned(),
                source,
            },
            Err(_) => {
                RuntimeError::start(id, format!("shim did not report within {START_TIMEOUT:?}"))
            }
        };
        let _ = child.start_kill();
        let _ = child.wait().await;
        let _ = self.kill_all(id).await;
        Err(failure)
    }
}

/// The network namespace a container's init joins, if it has a network.
fn init_network(spec: &SandboxSpec) -> Result<Option<init_args::InitNetwork>, RuntimeError> {
    match &spec.network {
        None => Ok(None),
        Some(SandboxNetwork {
            link: NetworkLink::Namespace(netns),
            resolv_conf,
        }) => Ok(Some(init_args::InitNetwork {
            netns: netns.clone(),
            resolv_conf: resolv_conf.clone(),
        })),
        Some(_) => Err(RuntimeError::start(
            &spec.id,
            "a container joins a network namespace, not a TAP device",
        )),
    }
}

impl ContainerRuntime {
    /// Takes a host id range and its user namespace for the sandbox of
    /// `spec`; on failure gives the range back.
    async fn take_ids(&self, spec: &SandboxSpec) -> Result<(u32, Arc<OwnedFd>), RuntimeError> {
        let id = spec.id.as_str();
        let id_base = self.ids.take(id).map_err(|exhausted| RuntimeError::Busy {
            id: id.to_owned(),
            reason: exhausted.to_string(),
        })?;
        let ids = self.ids.clone();
        let userns = blocking(id, move |id| {
            ids.namespace(id_base)
                .map_err(|source| RuntimeError::Userns {
                    id: id.to_owned(),
                    source,
                })
        })
        .await
        .inspect_err(|_| self.ids.release(id))?;
        Ok((id_base, userns))
    }

    /// A shim whose init waits in the sandbox's cgroups, with `limits`: one of
    /// the pool's, its cgroups renamed to the sandbox's, or one made now (which
    /// pays the cgroup join here). The step's name says which.
    async fn shim_for(
        &self,
        id: &str,
        limits: CgroupLimits,
    ) -> Result<(WaitingShim, &'static str), RuntimeError> {
        while let Some(mut shim) = self.pool.take() {
            if !shim.is_alive() {
                // Killed while it waited: it serves no one, and the start
                // takes the next or makes one.
                tracing::warn!(sandbox = id, cgroup = %shim.cgroup, "a pool shim had died; discarded");
                self.maker.discard(shim).await;
                continue;
            }
            if let Err(error) = shim.to_normal_priority() {
                tracing::warn!(sandbox = id, %error, "a pool shim keeps its low priority");
            }
            let cgroups = Arc::clone(&self.cgroups);
            let (from, to) = (shim.cgroup.clone(), id.to_owned());
            // A few file operations: not worth a blocking thread's hop.
            let adopted = cgroups
                .rename(&from, &to)
                .and_then(|()| cgroups.set_limits(&to, &limits));
            match adopted {
                Ok(()) => {
                    shim.cgroup = to;
                    return Ok((shim, "shim_from_pool"));
                }
                Err(error) => {
                    // Whatever half was renamed goes with the shim; the start
                    // goes on with a shim made now.
                    tracing::warn!(sandbox = id, %error, "cannot adopt a pool shim's cgroups");
                    self.maker.discard(shim).await;
                    let cgroups = Arc::clone(&self.cgroups);
                    let owned = id.to_owned();
                    let _ = tokio::task::spawn_blocking(move || {
                        cgroup::kill_and_remove(cgroups.as_ref(), &owned)
                    })
                    .await;
                    break;
                }
            }
        }
        let shim = self.maker.spawn(id, 0).await?;
        let shim = self.maker.place(shim, id, limits).await?;
        Ok((shim, "shim_made"))
    }

    /// What the shim is told to make of the sandbox of `spec`.
    fn init_args(
        &self,
        spec: &SandboxSpec,
        layout: &SandboxLayout,
        network: Option<init_args::InitNetwork>,
        id_base: u32,
    ) -> InitArgs {
        let id = spec.id.as_str();
        let mut env = init_args::agent_env(spec);
        if let Some(qgroup) =
            (self.config.storage.as_ref()).and_then(|storage| storage.qgroup_sysfs_dir(&layout.dir))
        {
            // The container's read-only /sys shows it; the agent reads its disk there.
            env.push((DISK_QGROUP_ENV.to_owned(), qgroup.display().to_string()));
        }
        InitArgs {
            id: id.to_string(),
            hostname: spec.hostname.clone(),
            rootfs: spec.rootfs.clone(),
            layers: spec.layers.clone(),
            sandbox_dir: layout.dir.clone(),
            agent_binary: self.config.agent_binary.clone(),
            cgroup_views: self.cgroups.views(id),
            env,
            keep_mknod: self.cgroups.confines_devices(),
            network,
            volumes: spec.volumes.clone(),
            id_base,
        }
    }

    /// Waits for the shim's end in the background; the receiver learns how
    /// it ended.
    fn watch_shim(&self, id: &str, mut child: Child) -> oneshot::Receiver<String> {
        let (exited_tx, exited_rx) = oneshot::channel();
        let (done_tx, done_rx) = watch::channel(false);
        self.shims
            .lock()
            .expect("shim map lock")
            .insert(id.to_string(), done_rx);
        tokio::spawn(async move {
            let description = describe_exit(child.wait().await);
            let _ = done_tx.send(true);
            let _ = exited_tx.send(description);
        });
        exited_rx
    }
}

/// The end of the console log, for start errors.
fn console_tail(path: &Path) -> String {
    let text = fs::read(path).unwrap_or_default();
    let tail = &text[text.len().saturating_sub(512)..];
    String::from_utf8_lossy(tail).trim().replace('\n', " | ")
}

fn describe_exit(status: io::Result<std::process::ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(status) => match (status.code(), status.signal()) {
            (Some(code), _) if code > 128 => {
                format!("container init was killed by signal {}", code - 128)
            }
            (Some(code), _) => format!("container init exited with code {code}"),
            (None, Some(9)) => "container was killed".to_string(),
            (None, signal) => format!(
                "container shim was killed by signal {}",
                signal.unwrap_or(0)
            ),
        },
        Err(err) => format!("lost the container shim: {err}"),
    }
}

#[async_trait]
impl Runtime for ContainerRuntime {
    async fn prepare(&self, spec: &SandboxSpec) -> Result<(), RuntimeError> {
        self.make_dirs(spec).map(|_| ())
    }

    async fn start(&self, spec: &SandboxSpec) -> Result<Started, RuntimeError> {
        let mut timeline = Timeline::start("container started");
        let id = spec.id.as_str();
        let network = init_network(spec)?;
        let layout = self.make_dirs(spec)?;
        if self.is_running(&spec.id).await {
            return Err(RuntimeError::AlreadyRunning { id: id.to_owned() });
        }
        timeline.step("dirs");
        let (id_base, userns) = self.take_ids(spec).await?;
        timeline.step("user_namespace");
        let limits = CgroupLimits::new(&spec.resources, self.config.pids_max);
        let (mut shim, how) = self
            .shim_for(id, limits)
            .await
            .inspect_err(|_| self.ids.release(id))?;
        timeline.step(how);
        let console_path = layout.console();
        let args = self.init_args(spec, &layout, network, id_base);
        let sent = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&console_path)
            .map_err(RuntimeError::file(id, "open", &console_path))
            .and_then(|console| {
                shim.send(&args, &userns, &OwnedFd::from(console))
                    .map_err(|source| RuntimeError::Io {
                        id: id.to_owned(),
                        action: "send the container init its settings".into(),
                        source,
                    })
            });
        if let Err(error) = sent {
            let _ = shim.child.start_kill();
            let _ = shim.child.wait().await;
            let _ = self.kill_all(id).await;
            return Err(error);
        }
        timeline.step("send_settings");
        let (init_pid, shim_steps) = self.await_shim(id, &mut shim, &console_path).await?;
        timeline.step("shim_ready");
        let exited_rx = self.watch_shim(id, shim.child);
        self.pool.refill();
        tracing::debug!(sandbox = id, init_pid, steps = %shim_steps, "container shim");
        timeline.log(id);
        Ok(Started {
            agent: AgentEndpoint::Unix(layout.agent_socket()),
            exited: exited_rx,
            accelerator: None,
        })
    }

    async fn stop(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let id = id.as_str();
        self.kill_all(id).await
    }

    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let id = id.as_str();
        self.kill_all(id).await?;
        let dir = self.layout(id).dir;
        blocking(id, move |id| match fs::remove_dir_all(&dir) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => {
                Err(RuntimeError::file(id, "remove", dir)(err))
            }
            _ => Ok(()),
        })
        .await
    }

    async fn capture(&self, id: &SandboxId, capture_id: &str) -> Result<PathBuf, RuntimeError> {
        let (sandbox, id) = (id, id.as_str());
        check_id(capture_id)?;
        let storage = self.storage(id)?.clone();
        let source = self.layout(id).dir;
        let dest = self.capture_dir(capture_id);
        let cgroups = Arc::clone(&self.cgroups);
        let running = self.is_running(sandbox).await;
        blocking(id, move |id| {
            if let Some(parent) = dest.parent() {
                fs::create_dir_all(parent).map_err(RuntimeError::file(id, "create", parent))?;
            }
            // Write out pending data first, while the sandbox still runs: the
            // snapshot must flush what is dirty, and 1 GB just written took 2.5 s
            // of freeze without this. Frozen, no process is halfway through a
            // sequence of writes, and only what was written since is flushed.
            storage
                .flush(&source)
                .map_err(RuntimeError::storage(id, "flush the sandbox's writes"))?;
            if running {
                cgroups.set_frozen(id, true).map_err(cgroup_error(id))?;
            }
            let copied = storage
                .snapshot(&source, &dest, true)
                .map_err(RuntimeError::storage(id, "snapshot the sandbox"));
            if running {
                cgroups.set_frozen(id, false).map_err(cgroup_error(id))?;
            }
            copied.map(|()| dest.join("upper"))
        })
        .await
    }

    async fn receive_capture(
        &self,
        capture_id: &str,
        stream: Box<dyn std::io::Read + Send>,
    ) -> Result<PathBuf, RuntimeError> {
        ContainerRuntime::receive_capture(self, capture_id, stream).await
    }

    async fn discard_capture(&self, capture_id: &str) -> Result<(), RuntimeError> {
        check_id(capture_id)?;
        let storage = self.storage(capture_id)?.clone();
        let dir = self.capture_dir(capture_id);
        blocking(capture_id, move |id| {
            storage
                .delete_subvolume(&dir)
                .map_err(RuntimeError::storage(id, "delete the capture"))
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
        let storage = self.storage(id)?.clone();
        let dir = self.layout(id).dir;
        let capture = self.capture_dir(capture_id);
        let bytes = spec.resources.disk_gib << 30;
        blocking(id, move |id| {
            if !capture.is_dir() {
                return Err(RuntimeError::other(
                    id,
                    format!("capture {} does not exist", capture.display()),
                ));
            }
            storage
                .delete_subvolume(&dir)
                .map_err(RuntimeError::storage(id, "delete the sandbox's subvolume"))?;
            storage
                .snapshot(&capture, &dir, false)
                .map_err(RuntimeError::storage(id, "copy the capture"))?;
            storage
                .limit(&dir, bytes)
                .map_err(RuntimeError::storage(id, "limit the sandbox's subvolume"))
        })
        .await
    }

    async fn is_running(&self, id: &SandboxId) -> bool {
        let id = id.as_str();
        self.cgroups.pids(id).is_ok_and(|pids| !pids.is_empty())
    }

    /// A shim that has not exited is a container whose agent serves (build
    /// sandboxes included); containers have no QEMU and no warm pool.
    fn census(&self) -> crate::Census {
        let shims = self.shims.lock().expect("shim map lock");
        crate::Census {
            agents: shims.values().filter(|exited| !*exited.borrow()).count(),
            ..crate::Census::default()
        }
    }

    async fn sandbox_ids(&self) -> Result<Vec<String>, RuntimeError> {
        let dir = self.config.state_dir.clone();
        blocking("-", move |id| {
            let entries = match fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
                Err(e) => return Err(RuntimeError::file(id, "list", dir)(e)),
            };
            let mut ids = Vec::new();
            for entry in entries {
                let entry = entry.map_err(RuntimeError::file(id, "list", &dir))?;
                let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
                if let (true, Some(name)) = (is_dir, entry.file_name().to_str()) {
                    if check_id(name).is_ok() {
                        ids.push(name.to_owned());
                    }
                }
            }
            ids.sort();
            Ok(ids)
        })
        .await
    }

    fn can_archive(&self) -> bool {
        self.config.storage.is_some()
    }

    async fn export_storage(&self, id: &SandboxId, dest: &Path) -> Result<(), RuntimeError> {
        let (sandbox, id) = (id, id.as_str());
        if self.is_running(sandbox).await {
            return Err(RuntimeError::Running {
                id: id.to_owned(),
                action: "be archived",
            });
        }
        let storage = self.storage(id)?.clone();
        let dir = self.layout(id).dir;
        // A send needs a read-only subvolume: a snapshot of the sandbox's, kept
        // only while the stream is written.
        let frozen = self.capture_dir(&format!("archive-{id}"));
        let dest = dest.to_owned();
        blocking(id, move |id| {
            if let Some(parent) = frozen.parent() {
                fs::create_dir_all(parent).map_err(RuntimeError::file(id, "create", parent))?;
            }
            let delete = RuntimeError::storage(id, "delete the archive's snapshot");
            storage.delete_subvolume(&frozen).map_err(delete)?;
            storage
                .snapshot(&dir, &frozen, true)
                .map_err(RuntimeError::storage(id, "snapshot the sandbox"))?;
            let sent = storage
                .send(&frozen, &dest)
                .map_err(RuntimeError::storage(id, "send the sandbox's storage"));
            let dropped = storage
                .delete_subvolume(&frozen)
                .map_err(RuntimeError::storage(id, "delete the archive's snapshot"));
            sent.and(dropped)
        })
        .await
    }

    async fn import_storage(&self, spec: &SandboxSpec, src: &Path) -> Result<(), RuntimeError> {
        let id = spec.id.as_str();
        let storage = self.storage(id)?.clone();
        let dir = self.layout(id).dir;
        let incoming = self.capture_dir(&format!("incoming-{id}"));
        let bytes = spec.resources.disk_gib << 30;
        let src = src.to_owned();
        blocking(id, move |id| {
            // Whatever a failed import left behind goes first.
            if incoming.exists() {
                let list = RuntimeError::file(id, "list", &incoming);
                for entry in fs::read_dir(&incoming).map_err(list)? {
                    let entry = entry.map_err(RuntimeError::file(id, "list", &incoming))?;
                    storage
                        .delete_subvolume(&entry.path())
                        .map_err(RuntimeError::storage(id, "delete a failed import"))?;
                }
            }
            let received = storage
                .receive(&src, &incoming)
                .map_err(RuntimeError::storage(id, "receive the sandbox's storage"))?;
            storage
                .delete_subvolume(&dir)
                .map_err(RuntimeError::storage(id, "delete the sandbox's subvolume"))?;
            let made = storage
                .snapshot(&received, &dir, false)
                .and_then(|()| storage.limit(&dir, bytes))
                .map_err(RuntimeError::storage(id, "make the sandbox's subvolume"));
            storage
                .delete_subvolume(&received)
                .map_err(RuntimeError::storage(id, "delete the received subvolume"))?;
            let _ = fs::remove_dir(&incoming);
            made
        })
        .await
    }
}

/// The most a captured layer's stream may take on a storage of `usage`: it
/// is written twice (spooled, then received), and a twentieth of the
/// storage stays free for the sandboxes on it.
fn spool_budget(usage: crate::storage::FilesystemUsage) -> u64 {
    let reserve = (usage.used + usage.available) / 20;
    usage.available.saturating_sub(reserve) / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_may_take_half_of_what_is_free_above_a_twentieth() {
        use crate::storage::FilesystemUsage;
        let gib = 1 << 30;
        let usage = |used, available| FilesystemUsage { used, available };
        assert_eq!(spool_budget(usage(10 * gib, 10 * gib)), 9 * gib / 2);
        assert_eq!(spool_budget(usage(19 * gib, gib)), 0);
        assert_eq!(spool_budget(usage(0, 0)), 0);
    }

    #[test]
    fn ids_are_single_path_components() {
        for good in ["sb1", "a-b_c.d", "0123456789abcdef"] {
            assert!(check_id(good).is_ok(), "{good}");
        }
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(129)] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn exit_descriptions_name_the_cause() {
        use std::os::unix::process::ExitStatusExt;
        let status = |raw| Ok(std::process::ExitStatus::from_raw(raw));
        assert_eq!(
            describe_exit(status(0)),
            "container init exited with code 0"
        );
        assert_eq!(
            describe_exit(status(137 << 8)),
            "container init was killed by signal 9"
        );
        assert_eq!(describe_exit(status(9)), "container was killed");
    }
}
