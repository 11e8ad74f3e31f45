//! `cove serve`: builds the pieces (store, image, runtime, engine, HTTP) and runs them.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use cove_engine::{Archive, Ceilings, Engine, EngineConfig, Prices, SnapshotRecord};
use cove_images::{DefaultImageProgress, ImageStore};
use cove_lifecycle::SandboxClass;
use cove_runtime::container::{ContainerConfig, ContainerRuntime};
use cove_runtime::storage::Storage;
use cove_runtime::vm::{VmConfig, VmRuntime};
use cove_runtime::Runtime;
use cove_store::Store;

/// Where a server keeps its database and sandboxes unless told otherwise.
pub(crate) const DEFAULT_DATA_DIR: &str = "/var/lib/cove";
/// The images directory of a server on the default data dir (`<data-dir>/images`).
pub(crate) const DEFAULT_IMAGES_DIR: &str = "/var/lib/cove/images";

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    pub listen: SocketAddr,
    /// Where the database, sandboxes and (by default) images live.
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// The database: a `postgres://USER:PASSWORD@HOST/NAME` URL keeps every
    /// record in PostgreSQL instead of the SQLite file `cove.db` in the data
    /// directory (the default). One server per database.
    #[arg(long, env = "COVE_DATABASE")]
    pub database: Option<String>,
    /// Where root filesystems are built and cached; shared between servers.
    #[arg(long, env = "COVE_IMAGES_DIR")]
    pub images_dir: Option<PathBuf>,
    /// The static agent binary put into sandboxes (default: built by `cargo agent`).
    #[arg(long, env = "COVE_AGENT_BIN")]
    pub agent_bin: Option<PathBuf>,
    /// The URL clients reach this server at, if not the Host they use.
    #[arg(long, env = "COVE_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// The wildcard DNS domain of host-based preview URLs
    /// (`{port}-{sandboxId}.{domain}`, e.g. `preview.localhost`); without it
    /// preview URLs are path-based (`{public URL}/preview/{sandboxId}/{port}/`).
    #[arg(long, env = "COVE_PREVIEW_DOMAIN")]
    pub preview_domain: Option<String>,
    /// An API key accepted besides the stored ones; without it a key is created once.
    #[arg(long, env = "COVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Ceiling of vCPUs per sandbox.
    #[arg(long, default_value_t = 4)]
    pub max_cpu: i64,
    /// Ceiling of memory per sandbox, GiB.
    #[arg(long, default_value_t = 8)]
    pub max_memory: i64,
    /// Ceiling of disk per sandbox, GiB.
    #[arg(long, default_value_t = 20)]
    pub max_disk: i64,
    /// Size of the sandbox storage filesystem (a sparse btrfs image in the data dir), GiB.
    #[arg(long, default_value_t = 64)]
    pub storage_size_gib: u64,
    /// Host ids for sandboxes, `START:COUNT`: each running container maps
    /// its ids 0-65535 to a range of 65536 of its own from here, so its root
    /// is no one on the host, and each VM's QEMU and virtiofsd run as the
    /// first id of a range. Two servers on one host need pools apart.
    #[arg(long, env = "COVE_USERNS_POOL", default_value = "1879048192:4096", value_parser = cove_runtime::container::IdPool::parse)]
    pub userns_pool: cove_runtime::container::IdPool,
    /// How many container shims wait, forked into cgroups of their own, for
    /// the creates to come (a create then skips the cgroup join, 8-15 ms on
    /// cgroup v1 after a quiet spell); 0: every start makes its own. Two
    /// by default: a create takes one and the next is made in about 10 ms,
    /// before a client's next create. Each waiting shim is two idle
    /// processes. Cgroup v2 keeps none (it cannot rename a cgroup).
    #[arg(long, env = "COVE_CONTAINER_POOL", default_value_t = 2)]
    pub container_pool: usize,
    /// The most one volume may hold, GiB (a quota on its subvolume of the
    /// storage), so that no sandbox can fill the storage through a volume.
    #[arg(long, env = "COVE_VOLUME_SIZE_GIB", default_value_t = 20)]
    pub volume_size_gib: u64,
    /// Where archived sandboxes go: a directory, or `s3://bucket/prefix` with the
    /// usual AWS_* variables (AWS_ENDPOINT for an S3-compatible service).
    /// Default: `<data-dir>/archive`.
    #[arg(long, env = "COVE_ARCHIVE")]
    pub archive: Option<String>,
    #[command(flatten)]
    pub network: NetworkArgs,
    /// Seconds a runner on another machine may be silent before it is shown
    /// unresponsive and given no new sandbox; at least two of its reports
    /// (every 5 s).
    #[arg(long, env = "COVE_RUNNER_SILENCE", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(10..=86_400))]
    pub runner_silence: u64,
    /// The certificates (PEM) that runners' TLS certificates must chain
    /// to: with it, runners on other machines are reached over `https://`
    /// only (each started with `--tls-cert` and `--tls-key`), and one that
    /// reports a plain `http://` service is refused.
    #[arg(long, env = "COVE_RUNNER_CA")]
    pub runner_ca: Option<PathBuf>,
    /// The guest kernel and initramfs of VM sandboxes (made by `scripts/vm-assets`).
    /// Without them, or with `--no-vm`, VM snapshots answer 501.
    #[arg(long, env = "COVE_VM_ASSETS", default_value = "/var/tmp/cove/vm")]
    pub vm_assets: PathBuf,
    /// Serve no VM sandboxes (containers only).
    #[arg(long)]
    pub no_vm: bool,
    /// How many VMs of each size wait, already running, for the creates to
    /// come: of `daytona-vm-small` from the start, of another size from its
    /// first create on (four sizes at most); 0: every create starts its own
    /// QEMU. A waiting VM idles (its memory file and a QEMU process are what
    /// it costs).
    #[arg(long, env = "COVE_VM_WARM_POOL", default_value_t = 1)]
    pub vm_warm_pool: usize,
    /// How long a paused VM keeps its QEMU process, frozen (a resume then
    /// takes milliseconds), before its memory is saved and the process ends;
    /// memory pressure and a shutdown save it sooner. 0: every pause saves.
    #[arg(long, env = "COVE_WARM_PAUSE_MINUTES", default_value_t = 10.0, value_parser = minutes)]
    pub warm_pause_minutes: f64,
    /// Also serve the API over HTTPS on this address (with --tls-cert and
    /// --tls-key). The SDK uploads build contexts (an `Image`'s local files
    /// for COPY/ADD) over HTTPS only, to this listener.
    #[arg(long, env = "COVE_TLS_LISTEN", requires_all = ["tls_cert", "tls_key"])]
    pub tls_listen: Option<SocketAddr>,
    /// The certificate chain of the HTTPS listener (PEM).
    #[arg(long, env = "COVE_TLS_CERT", requires = "tls_listen")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of the HTTPS listener (PEM).
    #[arg(long, env = "COVE_TLS_KEY", requires = "tls_listen")]
    pub tls_key: Option<PathBuf>,
    /// Address of the SSH gateway (`ssh TOKEN@host -p PORT`, tokens from
    /// `POST /api/sandbox/{id}/ssh-access`); its host key is kept in the data dir.
    /// Loopback by default: pass e.g. `0.0.0.0:2222` to let other hosts in.
    #[arg(long, env = "COVE_SSH_LISTEN", default_value = "127.0.0.1:2222")]
    pub ssh_listen: SocketAddr,
    /// The only directory `POST /api/snapshots/import` (`cove image
    /// import`) reads image archives and layouts from; made owner-only if
    /// missing. Default: `<data-dir>/import`.
    #[arg(long, env = "COVE_IMPORT_DIR")]
    pub import_dir: Option<PathBuf>,
    /// The largest build context (an `Image`'s local files) a client may
    /// upload, GiB.
    #[arg(long, env = "COVE_MAX_BUILD_CONTEXT_GIB", default_value_t = 10)]
    pub max_build_context_gib: u64,
    /// How many build-context uploads in parts one set of push credentials
    /// may have in progress at once.
    #[arg(long, default_value_t = 16)]
    pub max_context_uploads: usize,
    /// Seconds an HTTP client has to send a request's headers (also the
    /// longest a kept-alive connection idles, and the time a TLS client has
    /// for its handshake); then the connection is closed.
    #[arg(long, env = "COVE_HEADER_READ_TIMEOUT", default_value_t = 20)]
    pub header_read_timeout: u64,
    /// Seconds an SSH client has to authenticate; then it is disconnected.
    #[arg(long, env = "COVE_SSH_AUTH_TIMEOUT", default_value_t = 20)]
    pub ssh_auth_timeout: u64,
    /// How often timers are checked, in milliseconds.
    #[arg(long, default_value_t = 1000, hide = true)]
    pub timer_tick_ms: u64,
    #[command(flatten)]
    pub prices: PriceArgs,
}

/// The price table of the bill (`GET /api/organizations/{id}/bill`,
/// `cove admin bill`). Memory, snapshot and credit defaults are seed 003's.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct PriceArgs {
    /// The currency the prices are in.
    #[arg(long, env = "COVE_PRICE_CURRENCY", default_value = "USD")]
    pub price_currency: String,
    /// Price of one vCPU running for an hour.
    #[arg(long, env = "COVE_PRICE_VCPU_HOUR", default_value_t = Prices::default().vcpu_hour)]
    pub price_vcpu_hour: f64,
    /// Price of one GB of memory running for an hour.
    #[arg(long, env = "COVE_PRICE_MEMORY_GB_HOUR", default_value_t = Prices::default().memory_gb_hour)]
    pub price_memory_gb_hour: f64,
    /// Price of one GB of sandbox disk kept for an hour (any state but archived).
    #[arg(long, env = "COVE_PRICE_DISK_GB_HOUR", default_value_t = Prices::default().disk_gb_hour)]
    pub price_disk_gb_hour: f64,
    /// Price of one GB of snapshots kept for a month, past the free GB.
    #[arg(long, env = "COVE_PRICE_SNAPSHOT_GB_MONTH", default_value_t = Prices::default().snapshot_gb_month)]
    pub price_snapshot_gb_month: f64,
    /// Snapshot storage that costs nothing, GB.
    #[arg(long, env = "COVE_SNAPSHOT_FREE_GB", default_value_t = Prices::default().snapshot_free_gb)]
    pub snapshot_free_gb: f64,
    /// Credits given each calendar month, taken off the bill.
    #[arg(long, env = "COVE_MONTHLY_CREDITS", default_value_t = Prices::default().monthly_credits)]
    pub monthly_credits: f64,
}

impl PriceArgs {
    /// The table, or why a price cannot be one.
    fn prices(&self) -> anyhow::Result<Prices> {
        let prices = Prices {
            currency: self.price_currency.clone(),
            vcpu_hour: self.price_vcpu_hour,
            memory_gb_hour: self.price_memory_gb_hour,
            disk_gb_hour: self.price_disk_gb_hour,
            snapshot_gb_month: self.price_snapshot_gb_month,
            snapshot_free_gb: self.snapshot_free_gb,
            monthly_credits: self.monthly_credits,
        };
        for (flag, value) in [
            ("--price-vcpu-hour", prices.vcpu_hour),
            ("--price-memory-gb-hour", prices.memory_gb_hour),
            ("--price-disk-gb-hour", prices.disk_gb_hour),
            ("--price-snapshot-gb-month", prices.snapshot_gb_month),
            ("--snapshot-free-gb", prices.snapshot_free_gb),
            ("--monthly-credits", prices.monthly_credits),
        ] {
            if !value.is_finite() || value < 0.0 {
                anyhow::bail!("{flag} must be a number of zero or more, not {value}");
            }
        }
        Ok(prices)
    }
}

/// How sandboxes meet the network: the flags of `serve` and of `cove runner`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct NetworkArgs {
    /// Give sandboxes no network at all (only loopback), instead of cove's bridge.
    #[arg(long)]
    pub no_network: bool,
    /// The host interface sandbox traffic leaves by (default: the default route's).
    #[arg(long, requires = "uplink_gateway")]
    pub uplink_interface: Option<String>,
    /// The next hop on the uplink interface (default: the default route's).
    #[arg(long, requires = "uplink_interface")]
    pub uplink_gateway: Option<std::net::Ipv4Addr>,
    /// DNS servers cove's resolver forwards sandbox queries to, comma-separated
    /// (default: the host's /etc/resolv.conf nameservers).
    #[arg(long, value_delimiter = ',')]
    pub dns: Vec<std::net::Ipv4Addr>,
    /// The private range sandbox addresses come from.
    #[arg(long, default_value = "10.77.0.0/16")]
    pub network_range: cove_net::Ipv4Net,
    /// Private, link-local or uplink-LAN ranges to open to sandboxes,
    /// comma-separated CIDRs (by default the host's world is closed: no
    /// sandbox reaches 169.254/16, 10/8, 172.16/12, 192.168/16, 100.64/10,
    /// loopback, multicast, reserved, or the uplink's subnet). Each sandbox's
    /// own policy still applies to an opened range.
    #[arg(long, env = "COVE_ALLOW_PRIVATE_EGRESS", value_delimiter = ',', value_parser = parse_cidr)]
    pub allow_private_egress: Vec<cove_net::Ipv4Net>,
    /// The bridge sandboxes are attached to (at most 8 characters).
    #[arg(long, default_value = "cove0")]
    pub bridge: String,
    /// The routing table sandbox traffic is routed by; also the priority of
    /// the rules that select it and the firewall mark of the resolver's own
    /// queries. Two servers on one host need their own (and their own
    /// --bridge and --network-range).
    #[arg(long, default_value_t = 7700)]
    pub route_table: u32,
}

pub(crate) fn progress_printer() -> impl FnMut(&DefaultImageProgress) {
    let tty = std::io::stderr().is_terminal();
    move |p: &DefaultImageProgress| {
        if tty {
            eprint!("\r\x1b[2K[image {:>4}] {}", p.step, p.message);
        } else if p.step % 25 == 1 || p.message.starts_with("Base system") {
            // Without a terminal, a line every 25 steps shows life without flooding logs.
            eprintln!("[image {:>4}] {}", p.step, p.message);
        }
    }
}

/// Builds everything and starts serving; returns the serving task once the
/// socket listens.
/// The running server and the network it made (to be removed at shutdown).
type Serving = (
    tokio::task::JoinHandle<()>,
    Option<Arc<cove_net::Network>>,
    cove_ssh::Gateway,
    (DataDirLock, Option<tokio::task::JoinHandle<()>>),
    Option<VmServing>,
    (Engine, Arc<Storage>, Arc<ContainerRuntime>),
);

/// The VM runtime and the task making its template (then filling its pool).
struct VmServing {
    runtime: Arc<VmRuntime>,
    warming: tokio::task::JoinHandle<()>,
}

/// The sandbox storage of `data_dir` (a sparse btrfs image of `size_gib`
/// GiB), mounted.
pub(crate) async fn open_storage(data_dir: &Path, size_gib: u64) -> anyhow::Result<Arc<Storage>> {
    let (image, dir) = (data_dir.join("storage.img"), data_dir.join("storage"));
    let storage =
        tokio::task::spawn_blocking(move || Storage::open(&image, &dir, size_gib << 30)).await??;
    Ok(Arc::new(storage))
}

/// The container runtime's settings for sandboxes on `storage`, their agent
/// `agent_binary`; pools and cgroups at their defaults.
pub(crate) fn container_config(
    storage: &Arc<Storage>,
    agent_binary: PathBuf,
) -> anyhow::Result<ContainerConfig> {
    let mut config = ContainerConfig::new(
        storage.root().join("sandboxes"),
        agent_binary,
        std::env::current_exe()?,
    );
    config.storage = Some(storage.clone());
    Ok(config)
}

/// Held while the server runs: one server per data directory.
type DataDirLock = nix::fcntl::Flock<std::fs::File>;

/// Unmounts the storage when dropped while armed, if this start mounted it.
struct UnmountOnError(Option<Arc<Storage>>);

impl Drop for UnmountOnError {
    fn drop(&mut self) {
        if let Some(storage) = self.0.take().filter(|s| s.mounted_here()) {
            if let Err(error) = storage.unmount() {
                tracing::warn!(%error, "unmounting the storage of a failed start");
            }
        }
    }
}

/// The import directory, made owner-only if missing and canonical, so a
/// client's absolute path can be compared with it.
fn import_dir(args: &ServeArgs, data_dir: &Path) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt as _;
    let dir = args
        .import_dir
        .clone()
        .unwrap_or_else(|| data_dir.join("import"));
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("create the import directory {}", dir.display()))?;
    }
    dir.canonicalize()
        .with_context(|| format!("the import directory {}", dir.display()))
}

/// Who this server's runner is: an id kept in the data directory (made at
/// its first start), so a restart is the same runner, and the host's name.
fn runner_identity(data_dir: &Path) -> anyhow::Result<cove_engine::RunnerIdentity> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = data_dir.join("runner-id");
    let id = match std::fs::read_to_string(&path) {
        Ok(text) => text.trim().to_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = uuid::Uuid::new_v4().to_string();
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .with_context(|| format!("create {}", path.display()))?;
            writeln!(file, "{id}")
                .and_then(|()| file.sync_all())
                .with_context(|| format!("write {}", path.display()))?;
            id
        }
        Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
    };
    if uuid::Uuid::try_parse(&id).is_err() {
        anyhow::bail!(
            "{} holds {id:?}, not a runner id (a UUID); remove it and a new one is made",
            path.display()
        );
    }
    Ok(cove_engine::RunnerIdentity {
        id,
        name: cove_engine::host_name(),
    })
}

/// Takes the data directory's lock, or says that another server has it.
fn lock_data_dir(data_dir: &Path) -> anyhow::Result<DataDirLock> {
    let path = data_dir.join("serve.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(lock),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => bail!(
            "data dir {} is in use by another cove server; give this one its own --data-dir",
            data_dir.display()
        ),
        Err((_, error)) => bail!("locking {}: {error}", path.display()),
    }
}

async fn start(args: ServeArgs) -> anyhow::Result<Serving> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    #[allow(unsafe_code)]
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        bail!("cove serve must run as root: it creates namespaces, mounts and cgroups");
    }
    // Checked before anything is made, so a bad flag leaves nothing behind.
    let prices = args.prices.prices()?;
    let data_dir = &args.data_dir;
    std::fs::create_dir_all(data_dir).with_context(|| format!("create {}", data_dir.display()))?;
    // The database (keys' hashes, environments, registry passwords) and the
    // SSH host key are in it: only root may even look.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("chmod 0700 {}", data_dir.display()))?;
    }
    let data_dir = data_dir.canonicalize()?;
    let data_lock = lock_data_dir(&data_dir)?;
    let descriptors = crate::descriptors::raise_limit();
    let caps = crate::descriptors::ConnectionCaps::for_limit(descriptors);
    tracing::info!(
        descriptors,
        reserved = crate::descriptors::ConnectionCaps::reserve(descriptors),
        http = caps.http,
        https = caps.https,
        ssh = caps.ssh,
        ssh_unauthenticated = caps.ssh_unauthenticated,
        "file descriptor limit and connection caps"
    );
    let header_read_timeout = Duration::from_secs(args.header_read_timeout.max(1));
    // The addresses first: a port in use fails before anything is made.
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listen on {}", args.listen))?;
    let tls = match &args.tls_listen {
        None => None,
        Some(addr) => {
            let config = tls_config(args.tls_cert.as_deref(), args.tls_key.as_deref())?;
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listen on {addr} (--tls-listen)"))?;
            Some((listener, config))
        }
    };
    let agent_binary = crate::agent_binary::locate(args.agent_bin.clone())?;
    let store = match &args.database {
        Some(url) => Store::connect(url).await?,
        None => Store::open(&data_dir.join("cove.db")).await?,
    };
    let database_holder = store.hold_alone().await?;

    let images_dir = args
        .images_dir
        .clone()
        .unwrap_or_else(|| data_dir.join("images"));
    let images = ImageStore::new(images_dir.clone());
    if !images.default_is_built() {
        eprintln!("building the default image (Debian bookworm with python3, git, curl, a desktop and language servers; a few minutes, once)");
    }
    let images_for_build = images.clone();
    let rootfs =
        tokio::task::spawn_blocking(move || images_for_build.ensure_default(progress_printer()))
            .await??;
    if std::io::stderr().is_terminal() {
        eprintln!();
    }

    let storage = open_storage(&data_dir, args.storage_size_gib).await?;
    // Until sandboxes may use it, a failed start unmounts what it mounted.
    let mut unmount_on_error = UnmountOnError(Some(storage.clone()));
    // The pools refill between requests, not during them.
    let quiet = cove_quiet::Quiet::default();
    let mut container_config = container_config(&storage, agent_binary)?;
    container_config.quiet = quiet.clone();
    container_config.userns_pool = args.userns_pool;
    container_config.shim_pool = args.container_pool;
    let agent_for_vms = container_config.agent_binary.clone();
    let container = Arc::new(ContainerRuntime::new(container_config)?);
    let ids = container.id_ranges();
    let mut runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> = HashMap::from([(
        SandboxClass::Container,
        container.clone() as Arc<dyn Runtime>,
    )]);
    let vm = open_vm_runtime(&args, storage.clone(), agent_for_vms, ids);
    if let Some(vm) = &vm {
        // Before the engine looks at any sandbox: the warm pauses of a
        // server that died are saved, so they resume like any pause.
        vm.recover_warm_paused().await;
        vm.keep_deepening();
        runtimes.insert(SandboxClass::LinuxVm, vm.clone() as Arc<dyn Runtime>);
    }
    let network = if args.network.no_network {
        None
    } else {
        Some(Arc::new(
            open_network(&args.network, &data_dir, &quiet).await?,
        ))
    };
    let config = EngineConfig {
        ceilings: Ceilings {
            cpu: args.max_cpu,
            memory_gib: args.max_memory,
            disk_gib: args.max_disk,
        },
        timer_tick: Duration::from_millis(args.timer_tick_ms),
        archive: Some(Archive::open(
            &args
                .archive
                .clone()
                .unwrap_or_else(|| data_dir.join("archive").display().to_string()),
            storage.root().join("archive-scratch"),
        )?),
        // The default image, and pulled images (blobs, layers and root
        // filesystems) in its `oci/` cache.
        images: Some(images.clone()),
        network: network.clone().map(cove_engine::NetworkHandle),
        // On the sandbox storage, so a volume is as durable as a sandbox's disk.
        volumes_dir: Some(storage.root().join("volumes")),
        volume_quota: Some(cove_engine::VolumeQuota {
            storage: storage.clone(),
            bytes: args.volume_size_gib << 30,
        }),
        build_contexts_dir: Some(data_dir.join("build-contexts")),
        context_limits: cove_engine::ContextLimits {
            max_bytes: args.max_build_context_gib << 30,
            max_uploads_per_grant: args.max_context_uploads,
        },
        import_dir: Some(import_dir(&args, &data_dir)?),
        data_dir: Some(data_dir.clone()),
        prices,
        runner: runner_identity(&data_dir)?,
        runner_silence: std::time::Duration::from_secs(args.runner_silence),
        runner_tls: args
            .runner_ca
            .as_deref()
            .map(|ca| client_tls(ca, "--runner-ca"))
            .transpose()?,
        ..EngineConfig::default()
    };
    let engine = Engine::new(config.clone(), store, runtimes);
    let now = cove_engine::now_ms();
    engine
        .snapshots()
        .register(&SnapshotRecord {
            id: "cove-default".into(),
            cpu: config.default_cpu,
            memory_mib: config.default_memory_gib * 1024,
            disk_gib: config.default_disk_gib,
            ..SnapshotRecord::for_image(
                &config.default_snapshot,
                &rootfs.display().to_string(),
                SandboxClass::Container,
                now,
            )
        })
        .await?;
    // VM snapshots by size, as Daytona names them. Without a VM runtime on this
    // server a create from them answers 501 saying so.
    // `tiny` is cove's: a 256 MiB guest.
    for (name, cpu, memory_mib) in [
        ("daytona-vm-tiny", 1, 256),
        ("daytona-vm-small", 1, 1024),
        ("daytona-vm-medium", 2, 2048),
        ("daytona-vm-large", 2, 4096),
    ] {
        engine
            .snapshots()
            .register(&SnapshotRecord {
                cpu,
                memory_mib,
                disk_gib: config.default_disk_gib,
                ..SnapshotRecord::for_image(
                    name,
                    &rootfs.display().to_string(),
                    SandboxClass::LinuxVm,
                    now,
                )
            })
            .await?;
    }
    unmount_on_error.0 = None;
    engine.recover_after_restart().await?;
    let vm = vm.map(|runtime| VmServing {
        warming: warm_vm_template(
            runtime.clone(),
            &rootfs,
            config.default_disk_gib,
            &config.os_user,
            args.vm_warm_pool,
        ),
        runtime,
    });

    let env_api_key = args.api_key.clone().filter(|k| !k.is_empty());
    if env_api_key.is_none() {
        if let Some(key) = engine.access().ensure_api_key().await? {
            eprintln!("created an API key; it is shown once, keep it:\n\n    {key}\n");
        }
    }
    let ssh = cove_ssh::Gateway::start(
        engine.clone(),
        cove_ssh::GatewayConfig {
            listen: args.ssh_listen,
            host_key: data_dir.join("ssh_host_ed25519_key"),
            auth_timeout: Duration::from_secs(args.ssh_auth_timeout.max(1)),
            max_connections: caps.ssh,
            max_unauthenticated: caps.ssh_unauthenticated,
        },
    )
    .await
    .context("starting the SSH gateway (or pass another --ssh-listen)")?;
    let tls_port = match &tls {
        Some((listener, _)) => Some(listener.local_addr()?.port()),
        None => None,
    };
    let app = cove_api::app(cove_api::AppState::new(
        engine.clone(),
        cove_api::ApiConfig {
            env_api_key,
            public_url: args.public_url.clone(),
            preview_domain: args.preview_domain.clone(),
            ssh_port: Some(ssh.local_addr().port()),
            tls_port,
            quiet,
        },
    ));
    let limits = |max_connections| cove_api::listener::ListenerLimits {
        header_read_timeout,
        tls_handshake_timeout: header_read_timeout,
        max_connections,
    };
    if let Some((listener, config)) = tls {
        tracing::info!(addr = %listener.local_addr()?, "serving HTTPS");
        tokio::spawn(cove_api::listener::serve(
            listener,
            Some(cove_api::listener::TlsAcceptor::from(config)),
            app.clone(),
            limits(caps.https),
        ));
    }
    let addr = listener.local_addr()?;
    // Last: nothing after this fails, so a failed start leaves no pool cgroup.
    container.fill_pool();
    let timers = engine.sandboxes().clone();
    tokio::spawn(async move { timers.run_timers().await });
    let runners = engine.runners().clone();
    tokio::spawn(async move { runners.run_check_ins().await });
    let sandboxes = engine.sandboxes().clone();
    tokio::spawn(async move { sandboxes.run_runner_recoveries().await });
    let serve = tokio::spawn(cove_api::listener::serve(
        listener,
        None,
        app,
        limits(caps.http),
    ));
    tracing::info!(%addr, data_dir = %data_dir.display(), "cove is serving; DAYTONA_API_URL=http://{addr}/api");
    Ok((
        serve,
        network,
        ssh,
        (data_lock, database_holder.map(keep_holding)),
        vm,
        (engine, storage, container),
    ))
}

/// Checks every two seconds that this server still holds its PostgreSQL
/// database, taking it again if PostgreSQL lost the connection holding it.
/// Should another server have taken it meanwhile, this one stops at once,
/// as a crash would (its containers end with it; the next start of its data
/// directory recovers them): a graceful stop would write to a database that
/// another server now acts on.
fn keep_holding(mut holder: cove_store::Holder) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut lost = false;
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            match holder.keep().await {
                Ok(()) if lost => {
                    tracing::info!("holding the database again");
                    lost = false;
                }
                Ok(()) => {}
                Err(cove_store::StoreError::InUse) => {
                    tracing::error!(
                        "another cove server took the database while this one could not reach it; stopping now"
                    );
                    eprintln!("cove: another cove server took the database; this one stops");
                    std::process::exit(75);
                }
                Err(error) => {
                    if !lost {
                        tracing::warn!(error = %error, "the database cannot be reached; trying again");
                    }
                    lost = true;
                }
            }
        }
    })
}

/// The client side of TLS trusting only the roots in `ca` (PEM), given as
/// `flag`: to runners (`serve --runner-ca`) and to the control plane
/// (`runner --control-ca`).
pub(crate) fn client_tls(ca: &Path, flag: &str) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in pem_certificates(ca)? {
        roots
            .add(cert)
            .with_context(|| format!("a certificate of {} ({flag})", ca.display()))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// Every certificate of the PEM file `path`; at least one.
fn pem_certificates(
    path: &Path,
) -> anyhow::Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    use rustls::pki_types::pem::PemObject as _;
    let certs = rustls::pki_types::CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("reading certificates from {}", path.display()))?;
    if certs.is_empty() {
        bail!("{} holds no PEM certificate", path.display());
    }
    Ok(certs)
}

/// The server side of TLS: `cert`'s chain and `key` (PEM), offering
/// HTTP/1.1. For `serve --tls-listen` and `cove runner --tls-cert`.
pub(crate) fn tls_config(
    cert: Option<&Path>,
    key: Option<&Path>,
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::PrivateKeyDer;
    let (Some(cert), Some(key)) = (cert, key) else {
        bail!("TLS needs both --tls-cert and --tls-key");
    };
    let chain = pem_certificates(cert)?;
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("reading a private key from {}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("the TLS certificate and key do not fit together")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The VM backend, when this host can run it: QEMU installed (`scripts/vm-setup`)
/// and the guest assets built (`scripts/vm-assets`). Without it the server still
/// serves containers, and VM creates answer 501 naming what is missing.
fn open_vm_runtime(
    args: &ServeArgs,
    storage: Arc<Storage>,
    agent_binary: PathBuf,
    ids: Arc<cove_runtime::container::IdRanges>,
) -> Option<Arc<VmRuntime>> {
    if args.no_vm {
        return None;
    }
    let mut config = VmConfig::new(storage, args.vm_assets.clone(), agent_binary);
    // QEMU and virtiofsd take their host ids from the containers' pool.
    config.ids = ids;
    config.warm_pause = (args.warm_pause_minutes > 0.0)
        .then(|| std::time::Duration::from_secs_f64(60.0 * args.warm_pause_minutes));
    match VmRuntime::new(config) {
        Ok(vm) => {
            tracing::info!(
                accelerator = vm.accelerator().name(),
                "VM sandboxes enabled"
            );
            Some(Arc::new(vm))
        }
        Err(error) => {
            tracing::warn!(%error, "VM sandboxes disabled (run scripts/vm-setup and scripts/vm-assets)");
            None
        }
    }
}

/// Boots the template of `daytona-vm-small` in the background, so the first VM
/// create continues from it instead of waiting for a boot (seconds under TCG).
/// A create that comes first waits for the same template, never makes a second.
/// Then keeps `pool` VMs of it waiting (see the runtime's `pool`).
fn warm_vm_template(
    vm: Arc<VmRuntime>,
    rootfs: &Path,
    disk_gib: i64,
    os_user: &str,
    pool: usize,
) -> tokio::task::JoinHandle<()> {
    let resources = cove_runtime::Resources {
        cpu: 1,
        memory_mib: 1024,
        disk_gib: disk_gib as u64,
    };
    let id = cove_runtime::SandboxId::parse("template-warmup").expect("a plain name is an id");
    let spec = cove_runtime::SandboxSpec {
        // Waiting machines run the toolbox agent of the user a sandbox of
        // the default snapshot runs as, as the engine names it.
        user: (os_user != "root").then(|| os_user.to_owned()),
        ..cove_runtime::SandboxSpec::bare(id, "template", rootfs.to_path_buf(), resources)
    };
    tokio::spawn(async move {
        let began = std::time::Instant::now();
        match vm.warm_template(&spec).await {
            Ok(()) => tracing::info!(
                elapsed_ms = began.elapsed().as_millis() as u64,
                "VM template ready"
            ),
            Err(error) => tracing::warn!(%error, "making the VM template"),
        }
        vm.keep_warm(spec, pool);
    })
}

/// A number of minutes, fractions allowed: finite and not negative.
fn minutes(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(minutes) if minutes.is_finite() && (0.0..=1e6).contains(&minutes) => Ok(minutes),
        _ => Err(format!(
            "{text:?} is not a number of minutes from 0 to 1000000"
        )),
    }
}

/// A CIDR as `--allow-private-egress` takes it: `a.b.c.d/n` or a bare address;
/// host bits are refused, not masked, since the operator wrote the range.
fn parse_cidr(text: &str) -> Result<cove_net::Ipv4Net, cove_net::PolicyError> {
    cove_net::Policy::parse_exact_cidr(text)
}

/// cove's sandbox network over the configured (or the host's default) uplink.
pub(crate) async fn open_network(
    args: &NetworkArgs,
    data_dir: &Path,
    quiet: &cove_quiet::Quiet,
) -> anyhow::Result<cove_net::Network> {
    let uplink = match (&args.uplink_interface, args.uplink_gateway) {
        (Some(interface), Some(gateway)) => cove_net::Uplink {
            interface: interface.clone(),
            gateway,
        },
        _ => cove_net::Uplink::detect()
            .await
            .context("finding the host's uplink for sandbox traffic (or pass --uplink-interface and --uplink-gateway, or --no-network)")?,
    };
    let dns = if args.dns.is_empty() {
        let host = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
        cove_net::nameservers(&host)
    } else {
        args.dns.clone()
    };
    if dns.is_empty() {
        bail!("no DNS server for sandboxes: pass --dns");
    }
    let mut config = cove_net::NetworkConfig::new(uplink, dns, data_dir.join("net"));
    config.range = args.network_range;
    config.bridge = args.bridge.clone();
    config.route_table = args.route_table;
    config.rule_priority = args.route_table;
    config.allow_private_egress = args.allow_private_egress.clone();
    config.quiet = quiet.clone();
    cove_net::Network::new(config)
        .await
        .context("setting up the sandbox network (needs nftables; or pass --no-network)")
}

pub(crate) async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let (serve, network, ssh, _data_lock, vm, (engine, storage, container)) = start(args).await?;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // A server that fails cleans up as one that is told to stop does.
    let served: anyhow::Result<()> = tokio::select! {
        result = serve => match result {
            Ok(()) => Ok(()),
            Err(panicked) => Err(panicked.into()),
        },
        _ = tokio::signal::ctrl_c() => {
            tracing::info!("interrupted; sandboxes are brought back on the next start");
            Ok(())
        }
        _ = terminate.recv() => {
            tracing::info!("terminated; sandboxes are brought back on the next start");
            Ok(())
        }
    };
    ssh.shutdown().await;
    if let Some(vm) = vm {
        // A template still being made is given up now, while the storage
        // still holds the pid file its QEMU is found by (the making's guard
        // ends it); dropped with the runtime later, it would find nothing.
        vm.warming.abort();
        let _ = vm.warming.await;
        // Sandboxes outlive the server; the VMs waiting for a create do not,
        // and paused ones leave with their memory saved.
        vm.runtime.end_pool().await;
        vm.runtime.deepen_all().await;
    }
    // Containers end with the server; they go now, with their cgroups,
    // once the engine no longer takes their ends for failures.
    engine.forget_all_running();
    let ended = container.end_sandboxes().await;
    if ended > 0 {
        tracing::info!(
            containers = ended,
            "containers ended; the next start brings them back"
        );
    }
    // The shims waiting for a create, and their cgroups, go too.
    container.end_pool().await;
    if let Some(network) = network {
        // The bridge, firewall tables and routes go; addresses stay on disk.
        if let Err(error) = network.shutdown().await {
            tracing::error!(%error, "removing the sandbox network");
        }
    }
    release_storage(&engine, &storage).await;
    served
}

/// With no sandbox left, nothing needs the sandbox storage until the next
/// start: unmounting it lets its loop device go, rather than leaving both
/// behind a server that is gone.
async fn release_storage(engine: &Engine, storage: &Storage) {
    match engine.sandboxes().list().await {
        Ok(sandboxes) if sandboxes.is_empty() => match storage.unmount() {
            Ok(()) => {
                tracing::info!(storage = %storage.root().display(), "no sandbox left; storage unmounted")
            }
            Err(error) => tracing::warn!(%error, "unmounting the storage, with no sandbox left"),
        },
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "listing sandboxes before unmounting the storage"),
    }
}
