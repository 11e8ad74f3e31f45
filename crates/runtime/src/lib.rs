//! The machines behind sandboxes.
//!
//! [`Runtime`] is the one interface the engine drives; each sandbox class has a
//! backend behind it ([`container`], [`vm`]), and [`fake`]
//! stands in for them in tests of everything above. Root filesystems come
//! to it as paths (`SandboxSpec::rootfs`, `::layers`); cove-images makes
//! them. This crate knows nothing of HTTP, JSON APIs or the database.

pub mod beneath;
pub mod container;
mod error;
pub mod fake;
pub mod send_stream;
pub mod storage;
pub mod timeline;
pub mod vm;

use std::path::{Path, PathBuf};

use async_trait::async_trait;

pub use cove_protocol::SandboxId;
pub use error::RuntimeError;

/// Resources of one sandbox, already checked against the server's ceilings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resources {
    pub cpu: u32,
    pub memory_mib: u64,
    pub disk_gib: u64,
}

/// Everything a backend needs to make and boot one sandbox.
#[derive(Clone, Debug)]
pub struct SandboxSpec {
    /// Globally unique id, checked once when it was made; names every host
    /// object the backend makes.
    pub id: SandboxId,
    pub hostname: String,
    /// The read-only root filesystem the sandbox starts from.
    pub rootfs: PathBuf,
    /// Read-only layers over `rootfs`, topmost first: the captures of the snapshot
    /// the sandbox was created from. Empty for a sandbox made from an image.
    pub layers: Vec<PathBuf>,
    pub resources: Resources,
    /// Environment every process in the sandbox gets.
    pub env: Vec<(String, String)>,
    /// The network made for the sandbox (by cove-net); `None` leaves it with
    /// only a loopback interface.
    pub network: Option<SandboxNetwork>,
    /// Host directories (volumes) mounted into the sandbox.
    pub volumes: Vec<VolumeBind>,
    /// The directory commands start in (the image's WORKDIR); `None` is the
    /// user's home.
    pub workdir: Option<String>,
    /// The user every sandbox process runs as (the image's USER, a name or
    /// uid, optionally `:group`); `None` is root.
    pub user: Option<String>,
    /// The image's ENTRYPOINT followed by its CMD, which the agent starts in
    /// its `entrypoint` session at every start (a VM's at every boot and at
    /// the first start from another machine's memory); empty: nothing.
    pub command: Vec<String>,
}

impl SandboxSpec {
    /// A sandbox of `rootfs` with `resources` and nothing else: no layers,
    /// environment, network, volumes, user, workdir or command.
    pub fn bare(
        id: SandboxId,
        hostname: &str,
        rootfs: PathBuf,
        resources: Resources,
    ) -> SandboxSpec {
        SandboxSpec {
            id,
            hostname: hostname.to_owned(),
            rootfs,
            layers: Vec::new(),
            resources,
            env: Vec::new(),
            network: None,
            volumes: Vec::new(),
            workdir: None,
            user: None,
            command: Vec::new(),
        }
    }
}

/// A host directory mounted read-write at `target` inside a sandbox.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VolumeBind {
    /// The volume's own directory on the host (`{volumes}/{id}`), which no
    /// sandbox can replace.
    pub root: PathBuf,
    /// The directory inside the volume that is mounted (relative, checked by
    /// the engine); sandboxes write this tree, so it is opened with
    /// [`beneath::open_dir`], never as a host path.
    #[serde(default)]
    pub subpath: Option<PathBuf>,
    /// Absolute and normal (no `..`), checked by the engine.
    pub target: PathBuf,
}

/// A network prepared for one sandbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxNetwork {
    pub link: NetworkLink,
    /// The sandbox's `/etc/resolv.conf`.
    pub resolv_conf: String,
}

/// How a sandbox meets the network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NetworkLink {
    /// A network namespace file (a bind mount) a container joins; its `eth0`
    /// is configured already.
    Namespace(PathBuf),
    /// A TAP device a VM's NIC uses; the guest configures itself with these.
    Tap(TapLink),
}

/// A VM's TAP device and the settings of the guest's NIC behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TapLink {
    pub device: String,
    pub mac: [u8; 6],
    pub address: std::net::Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: std::net::Ipv4Addr,
}

/// How the server reaches the agent inside a running sandbox: a Unix socket
/// on this host, or, for a sandbox on a runner elsewhere, a tunnel through
/// that runner (cove-agent-client's `Endpoint`).
pub use cove_agent_client::Endpoint as AgentEndpoint;

/// A running sandbox, as `start` hands it back.
#[derive(Debug)]
pub struct Started {
    pub agent: AgentEndpoint,
    /// Resolves when the sandbox's init exits for whatever reason, with a description.
    pub exited: tokio::sync::oneshot::Receiver<String>,
    /// How the machine executes, for logs and the sandbox's info: `None` for a
    /// container, `Some("kvm")` or `Some("tcg")` for a VM.
    pub accelerator: Option<&'static str>,
}

/// What a runtime holds at this moment, for the server's metrics: read from
/// its own tables (no process scan, no file walk), so a scrape costs a lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    /// Agents serving live sandboxes: one per running sandbox (a
    /// container's on the host, a VM's in its guest).
    pub agents: usize,
    /// QEMU processes on the host: running VMs', and the warm pool's.
    pub qemu_processes: usize,
    /// Machines waiting in a warm pool to become sandboxes.
    pub warm: usize,
}

/// One class of sandbox machine. Every method is idempotent where a retry after a
/// crash may call it twice (`stop`, `destroy`).
#[async_trait]
pub trait Runtime: Send + Sync + 'static {
    /// Makes the sandbox's own storage (its writable layer). Nothing runs yet.
    async fn prepare(&self, spec: &SandboxSpec) -> Result<(), RuntimeError>;
    /// Boots the sandbox from its storage; returns once the agent accepts connections.
    async fn start(&self, spec: &SandboxSpec) -> Result<Started, RuntimeError>;
    /// Ends every process of the sandbox and keeps its storage.
    async fn stop(&self, id: &SandboxId) -> Result<(), RuntimeError>;
    /// Removes everything `prepare` and `start` made: processes, mounts, cgroups, files.
    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError>;
    /// Whether any process of the sandbox is alive.
    async fn is_running(&self, id: &SandboxId) -> bool;
    /// The ids of every sandbox this runtime holds storage for, whether the
    /// engine knows it or not (restart recovery destroys the build
    /// sandboxes a crashed server left). Backends that keep none say none.
    async fn sandbox_ids(&self) -> Result<Vec<String>, RuntimeError> {
        Ok(Vec::new())
    }
    /// What this runtime holds now (see [`Census`]).
    fn census(&self) -> Census {
        Census::default()
    }
    /// For a runtime of machines: the accelerator they run on (`kvm`,
    /// `tcg`) and why it was chosen.
    fn accelerator(&self) -> Option<(&'static str, &'static str)> {
        None
    }
    /// Takes over a machine that outlived an earlier server process, as it
    /// runs (a server restart then loses none of its processes). `None` when
    /// nothing of the sandbox runs or this backend cannot take a machine
    /// over; the caller then stops what is left and starts it again.
    async fn reattach(&self, _spec: &SandboxSpec) -> Result<Option<Started>, RuntimeError> {
        Ok(None)
    }
    /// Captures the sandbox's writable layer, consistently, as the read-only layer
    /// `capture_id`; a running sandbox keeps running (it is frozen for the
    /// instant of the copy). Returns the layer's path.
    async fn capture(&self, id: &SandboxId, capture_id: &str) -> Result<PathBuf, RuntimeError>;
    /// Deletes the layer made by `capture`.
    async fn discard_capture(&self, capture_id: &str) -> Result<(), RuntimeError>;
    /// Replaces the writable layer of a stopped sandbox with a writable copy of a
    /// capture taken from it. A capture that holds memory becomes the sandbox's
    /// saved memory, so its next `start` continues from it.
    async fn revert(&self, spec: &SandboxSpec, capture_id: &str) -> Result<(), RuntimeError>;

    /// Makes capture `capture_id` here from the `btrfs send` stream of one
    /// taken on another machine (a runner's sandbox, snapshotted for the
    /// control plane to keep). Answers its layer, as `capture` would.
    async fn receive_capture(
        &self,
        capture_id: &str,
        _stream: Box<dyn std::io::Read + Send>,
    ) -> Result<PathBuf, RuntimeError> {
        Err(unsupported(capture_id, "receiving a captured layer"))
    }

    /// Writes the sandbox's own storage (what it wrote; not its image or snapshot
    /// layers) to `dest` as one file, for archiving. The sandbox is stopped.
    async fn export_storage(&self, id: &SandboxId, _dest: &Path) -> Result<(), RuntimeError> {
        Err(unsupported(id, "archiving"))
    }
    /// Rebuilds the storage of an archived (destroyed) sandbox from a file
    /// `export_storage` wrote.
    async fn import_storage(&self, spec: &SandboxSpec, _src: &Path) -> Result<(), RuntimeError> {
        Err(unsupported(&spec.id, "archiving"))
    }
    /// Whether `export_storage` and `import_storage` work.
    fn can_archive(&self) -> bool {
        false
    }
    /// Why sandboxes of this runtime cannot have volumes here, if they
    /// cannot (a missing host tool, named).
    fn volumes_unavailable(&self) -> Option<String> {
        None
    }

    // What follows is for classes that keep memory (VMs). For them `start`
    // continues from saved memory when the sandbox's storage holds some (after
    // `pause`, `fork`, a `revert` to a memory capture, or a `prepare` whose top
    // layer holds memory) and boots from disk otherwise.

    /// Ends the machine with its memory and device state saved in its storage;
    /// every process continues where it was at the next `start`.
    async fn pause(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        Err(unsupported(id, "pause"))
    }
    /// Forgets the memory a paused sandbox saved, so its next `start` boots.
    async fn discard_memory(&self, _id: &SandboxId) -> Result<(), RuntimeError> {
        Ok(())
    }
    /// Like `capture`, with the machine's memory: a sandbox whose top layer is this
    /// capture continues from it instead of booting. The machine keeps running.
    async fn capture_with_memory(
        &self,
        id: &SandboxId,
        _capture_id: &str,
    ) -> Result<PathBuf, RuntimeError> {
        Err(unsupported(id, "memory snapshots"))
    }
    /// Makes `child`'s storage a copy of running sandbox `parent`'s disk and
    /// memory, freezing the parent only while it is copied. The caller then
    /// `start`s the child, which continues from that memory.
    async fn fork(&self, parent: &SandboxId, _child: &SandboxSpec) -> Result<(), RuntimeError> {
        Err(unsupported(parent, "fork"))
    }
    /// Like `fork`, for every one of `children` from one instant of the
    /// parent: a backend that can freezes the parent once for them all. On
    /// an error the caller destroys every child (some may hold copies).
    async fn fork_many(
        &self,
        parent: &SandboxId,
        children: &[SandboxSpec],
    ) -> Result<(), RuntimeError> {
        for child in children {
            self.fork(parent, child).await?;
        }
        Ok(())
    }
}

/// An id names a directory (and a cgroup): one plain path component.
pub(crate) fn check_id(id: &str) -> Result<(), RuntimeError> {
    match cove_protocol::SandboxId::parse(id) {
        Ok(_) => Ok(()),
        Err(_) => Err(RuntimeError::InvalidId { id: id.to_owned() }),
    }
}

/// Whether process `pid` exists and has not ended: a zombie (`Z`, or `X`
/// while it is being reaped) has ended, whether it waits for us or, not our
/// child, for init. The state is read after the last `)`, since a command
/// name may hold spaces and parentheses.
pub(crate) fn process_alive(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            state.starts_with('Z') || state.starts_with('X')
        })
}

/// Runs blocking work off the async threads; the work is given the
/// sandbox's id to name in its errors.
pub(crate) async fn blocking<T: Send + 'static>(
    id: &str,
    work: impl FnOnce(&str) -> Result<T, RuntimeError> + Send + 'static,
) -> Result<T, RuntimeError> {
    let owned = id.to_owned();
    tokio::task::spawn_blocking(move || work(&owned))
        .await
        .map_err(|source| RuntimeError::Task {
            id: id.to_owned(),
            what: "blocking",
            source,
        })?
}

fn unsupported(id: impl AsRef<str>, what: &str) -> RuntimeError {
    RuntimeError::unsupported(id.as_ref(), what)
}
