//! `cove runner`: this machine as a runner of a control plane on another.
//!
//! The operator registers the runner on the control plane
//! (`POST /api/runners`, `cove admin add-runner`), which answers its token
//! once. With that token, `cove runner` checks in at start
//! (`GET /api/runners/me`) and then reports its host every few seconds
//! (`POST /api/runners/healthcheck`, Daytona's shape): its size, its load,
//! and the classes of sandbox it could run. The control plane lists it with
//! its load, shows it unresponsive when the reports stop, and can delete it,
//! which ends the process at its next report. Without `--listen` that is
//! all: it opens no listener and starts nothing. With it, the runner serves
//! its container runtime (`runner_service`), reports where and with which
//! key, and the control plane places containers on it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use anyhow::{bail, Context};
use cove_engine::RunnerUsage;
use cove_runtime::container::ContainerRuntime;
use cove_runtime::Runtime as _;

use crate::runner_service::Service;
use serde_json::{json, Value};

#[derive(clap::Args, Debug)]
pub(crate) struct RunnerArgs {
    /// The control plane's API URL, as clients use it
    /// (`https://HOST:PORT/api`, or `http://` on a network you trust: the
    /// reports carry the key the control plane reaches this runner with).
    #[arg(long, env = "COVE_CONTROL_URL")]
    control: String,
    /// Trust only these roots (PEM) for an `https://` `--control`, instead
    /// of the system's: the CA of the control plane's `--tls-cert`.
    #[arg(long, env = "COVE_CONTROL_CA")]
    control_ca: Option<PathBuf>,
    /// This runner's token, as `POST /api/runners` answered it. Prefer the
    /// environment variable: the process's arguments are visible to every
    /// user of the machine.
    #[arg(long, env = "COVE_RUNNER_TOKEN", hide_env_values = true)]
    token: String,
    /// Where this runner keeps its sandboxes (made mode 0700); the disk it
    /// reports is this directory's filesystem.
    #[arg(long)]
    data_dir: PathBuf,
    /// The guest kernel and initramfs of VM sandboxes; without them (or
    /// with `--no-vm`) the runner offers containers only.
    #[arg(long, env = "COVE_VM_ASSETS", default_value = "/var/tmp/cove/vm")]
    vm_assets: PathBuf,
    #[arg(long)]
    no_vm: bool,
    /// Serve sandboxes: the control plane places containers here and
    /// drives them through this address (`HOST:PORT`). Without it the
    /// runner only reports.
    #[arg(long, env = "COVE_RUNNER_LISTEN")]
    listen: Option<std::net::SocketAddr>,
    /// The URL the control plane reaches `--listen` at (default:
    /// `http://`, or `https://` with `--tls-cert`, and the address it is
    /// bound to).
    #[arg(long, env = "COVE_RUNNER_ADVERTISE")]
    advertise: Option<String>,
    /// Serve `--listen` over TLS with this certificate chain (PEM), which
    /// must chain to the control plane's `--runner-ca` and name the host
    /// of the advertised URL.
    #[arg(long, env = "COVE_RUNNER_TLS_CERT", requires_all = ["listen", "tls_key"])]
    tls_cert: Option<PathBuf>,
    /// The private key of `--tls-cert` (PEM).
    #[arg(long, env = "COVE_RUNNER_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Where root filesystems are, laid out as the control plane's (a
    /// sandbox's image is named by its path under it); one not here yet is
    /// fetched from the control plane when a sandbox needs it.
    #[arg(long, env = "COVE_IMAGES_DIR", default_value = "/var/tmp/cove/images")]
    images_dir: PathBuf,
    /// The static agent binary put into sandboxes (default: built by `cargo agent`).
    #[arg(long, env = "COVE_AGENT_BIN")]
    agent_bin: Option<PathBuf>,
    /// Size of the sandbox storage filesystem (a sparse btrfs image in the data dir), GiB.
    #[arg(long, default_value_t = 64)]
    storage_size_gib: u64,
    /// The host ids containers' user namespaces map to (`FIRST:RANGES` of
    /// 65536); apart from every other runner's and server's on the host.
    #[arg(long, env = "COVE_USERNS_POOL", default_value = "1879048192:4096", value_parser = cove_runtime::container::IdPool::parse)]
    userns_pool: cove_runtime::container::IdPool,
    /// The cgroup its containers go under (`{controller}/{parent}/{id}`):
    /// apart from a server's (`cove`) and every other runner's on the host,
    /// since a runtime starting sweeps what it finds there.
    #[arg(long, default_value = "cove-runner", value_parser = plain_name)]
    cgroup_parent: String,
    /// Container shims kept ready for the next creates, as `serve`'s
    /// (cgroup v1; cgroup v2 keeps none).
    #[arg(long, env = "COVE_CONTAINER_POOL", default_value_t = 2)]
    container_pool: usize,
    /// The archive stopped sandboxes move through (`s3://bucket/prefix`,
    /// with the usual AWS_* variables): the control plane's, named the
    /// same, so a sandbox archived here starts on any runner that shares
    /// it, and one from another starts here. Without it, sandboxes here
    /// cannot be archived or moved.
    #[arg(long, env = "COVE_ARCHIVE")]
    archive: Option<String>,
    /// The network its sandboxes get: its own bridge, range and routes
    /// (`--no-network`: loopback only).
    #[command(flatten)]
    network: crate::serve::NetworkArgs,
}

fn plain_name(text: &str) -> Result<String, String> {
    let plain = !text.is_empty()
        && text.len() <= 64
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    match plain {
        true => Ok(text.to_owned()),
        false => Err("give 1 to 64 letters, digits, '-' or '_'".into()),
    }
}

pub(crate) async fn run(args: RunnerArgs) -> anyhow::Result<()> {
    make_private_dir(&args.data_dir)?;
    // Taken from here on, so a SIGTERM while the runner makes its storage
    // and network ends it once they are made, taking them down again.
    let terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let control = control_client(&args)?;
    let serving = match args.listen {
        Some(listen) => Some(serve(&args, listen, &control).await?),
        None => None,
    };
    let reported = report_until_gone(&args, control, serving.as_ref(), terminate).await;
    if let Some(serving) = serving {
        serving.end().await;
    }
    reported
}

/// What `--listen` runs: the service, where it is reached, and its storage.
struct Serving {
    service: Arc<Service>,
    url: String,
    storage: Arc<cove_runtime::storage::Storage>,
    task: tokio::task::JoinHandle<()>,
}

impl Serving {
    /// Stops the sandboxes it started and the service; the storage is
    /// unmounted when no sandbox keeps anything on it.
    async fn end(self) {
        self.task.abort();
        self.service.stop_all().await;
        self.service.runtime.end_pool().await;
        if let Some(network) = &self.service.network {
            // The bridge, firewall tables and routes go; addresses stay on disk.
            if let Err(error) = network.shutdown().await {
                tracing::error!(%error, "removing the sandbox network");
            }
        }
        match self.service.runtime.sandbox_ids().await {
            Ok(ids) if ids.is_empty() => {
                if let Err(error) = self.storage.unmount() {
                    tracing::warn!(%error, "unmounting the storage, with no sandbox left");
                }
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(error = %cove_engine::describe(&error), "listing sandboxes at exit")
            }
        }
    }
}

/// Opens the container runtime on this runner's storage and serves it at
/// `listen`. Whatever ran before (a runner killed) is stopped first: its
/// storage stays, for the control plane to start again.
async fn serve(
    args: &RunnerArgs,
    listen: std::net::SocketAddr,
    (control, http): &(String, reqwest::Client),
) -> anyhow::Result<Serving> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    #[allow(unsafe_code)]
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        bail!("cove runner --listen must run as root: it creates namespaces, mounts and cgroups");
    }
    let tls = match &args.tls_cert {
        Some(_) => Some(crate::serve::tls_config(
            args.tls_cert.as_deref(),
            args.tls_key.as_deref(),
        )?),
        None => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("listen on {listen}"))?;
    let url = match &args.advertise {
        Some(url) => url.trim_end_matches('/').to_owned(),
        None if listen.ip().is_unspecified() => {
            bail!("--listen {listen} names no address the control plane can dial: give --advertise {scheme}://THIS-HOST:PORT")
        }
        None => format!("{scheme}://{}", listener.local_addr()?),
    };
    if !url.starts_with(&format!("{scheme}://")) {
        bail!("--advertise {url} must be a {scheme}:// URL: the service is served over {scheme}");
    }
    let agent_binary = crate::agent_binary::locate(args.agent_bin.clone())?;
    let data_dir = args.data_dir.canonicalize()?;
    let storage = crate::serve::open_storage(&data_dir, args.storage_size_gib).await?;
    // The pools refill between the control plane's calls, not during them.
    let quiet = cove_quiet::Quiet::default();
    let mut config = crate::serve::container_config(&storage, agent_binary)?;
    config.quiet = quiet.clone();
    config.userns_pool = args.userns_pool;
    config.cgroup_parent = args.cgroup_parent.clone();
    config.shim_pool = args.container_pool;
    let runtime = Arc::new(ContainerRuntime::new(config)?);
    let archive = match &args.archive {
        Some(location) => {
            // What a move cut short left there (a runner killed mid-way).
            let scratch = storage.root().join("archive-scratch");
            let _ = std::fs::remove_dir_all(&scratch);
            Some(
                cove_engine::Archive::open(location, scratch)
                    .with_context(|| format!("opening the archive {location}"))?,
            )
        }
        None => None,
    };
    let network = match args.network.no_network {
        true => None,
        false => Some(Arc::new(
            crate::serve::open_network(&args.network, &data_dir, &quiet).await?,
        )),
    };
    for id in runtime.sandbox_ids().await? {
        let Ok(sandbox) = cove_runtime::SandboxId::parse(&id) else {
            continue;
        };
        if let Err(error) = runtime.stop(&sandbox).await {
            tracing::warn!(sandbox = %id, error = %cove_engine::describe(&error), "stopping what a runner before left");
        }
    }
    let key = format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    runtime.fill_pool();
    let service = Arc::new(Service::new(
        runtime,
        network,
        archive,
        args.images_dir.clone(),
        crate::runner_service::Control {
            url: control.clone(),
            http: http.clone(),
            token: args.token.clone(),
        },
        key,
    ));
    // Before the control plane learns this start's key: nothing is on yet.
    let swept = service.sweep_layers().await;
    if swept > 0 {
        tracing::info!(
            swept,
            "deleted captured layers whose snapshots were deleted while this runner was away"
        );
    }
    let swept = service.sweep_images().await;
    if swept > 0 {
        tracing::info!(swept, "deleted fetched images no sandbox placed here uses");
    }
    let app = crate::runner_service::router(service.clone(), quiet);
    // The listener of `serve`'s API: its header and handshake timeouts and
    // its cap on connections hold here too.
    let tls = tls.map(cove_api::listener::TlsAcceptor::from);
    // A long poll per running sandbox holds a connection: the cap is the
    // descriptor budget's, as `serve`'s API gets, not the default 1024.
    let descriptors = crate::descriptors::raise_limit();
    let limits = cove_api::listener::ListenerLimits {
        max_connections: crate::descriptors::ConnectionCaps::for_limit(descriptors).http,
        ..Default::default()
    };
    let task = tokio::spawn(cove_api::listener::serve(listener, tls, app, limits));
    tracing::info!(%url, images = %args.images_dir.display(), "runner serving containers");
    Ok(Serving {
        service,
        url,
        storage,
        task,
    })
}

/// The control plane's URL and a client for it, trusting `--control-ca`
/// alone when given.
fn control_client(args: &RunnerArgs) -> anyhow::Result<(String, reqwest::Client)> {
    let control = args.control.trim_end_matches('/').to_owned();
    let mut http = reqwest::Client::builder();
    match &args.control_ca {
        Some(ca) => {
            if !control.starts_with("https://") {
                bail!("--control-ca is for an https:// control plane, not {control}");
            }
            let tls = crate::serve::client_tls(ca, "--control-ca")?;
            http = http.tls_backend_preconfigured((*tls).clone());
        }
        None if control.starts_with("http://") && !on_loopback(&control) => tracing::warn!(
            %control,
            "reports to the control plane, and the service key in them, travel unencrypted: give an https:// --control on a network you do not trust"
        ),
        None => {}
    }
    let http = http
        .no_proxy()
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .context("building the HTTP client")?;
    Ok((control, http))
}

/// Checks in, then reports every few seconds until the process is told to
/// end or the control plane no longer knows this runner.
async fn report_until_gone(
    args: &RunnerArgs,
    (control, http): (String, reqwest::Client),
    serving: Option<&Serving>,
    mut terminate: tokio::signal::unix::Signal,
) -> anyhow::Result<()> {
    let me = tokio::select! {
        me = call(http.get(format!("{control}/runners/me")), &args.token) => me,
        _ = terminate.recv() => return Ok(()),
    };
    let me = me.with_context(|| format!("checking in with the control plane at {control}"))?;
    tracing::info!(
        runner = me["id"].as_str().unwrap_or_default(),
        name = me["name"].as_str().unwrap_or_default(),
        %control,
        "runner checked in"
    );
    let mut tick = tokio::time::interval(cove_engine::CHECK_IN_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = terminate.recv() => return Ok(()),
        }
        let report = report(
            &args.data_dir,
            (!args.no_vm).then_some(&*args.vm_assets),
            serving,
        );
        let sent = call(
            http.post(format!("{control}/runners/healthcheck"))
                .json(&report),
            &args.token,
        )
        .await;
        match sent {
            Ok(_) => {}
            Err(Refused::Unknown(message)) => {
                bail!("the control plane no longer knows this runner (deleted?): {message}")
            }
            Err(error) => tracing::warn!(%error, "runner report not taken; trying again"),
        }
    }
}

/// Whether `url` names this machine's loopback, where nothing on the way can
/// read a plain connection.
fn on_loopback(url: &str) -> bool {
    let Some(host) = reqwest::Url::parse(url)
        .ok()
        .and_then(|url| url.host_str().map(str::to_owned))
    else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Why a call to the control plane failed, said as its answer said it.
#[derive(Debug)]
enum Refused {
    /// A 401: the token is no runner's (never was, or its runner was deleted).
    Unknown(String),
    Other(String),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Unknown(message) | Refused::Other(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for Refused {}

/// Sends `request` with the runner's token; its JSON answer, if any.
async fn call(request: reqwest::RequestBuilder, token: &str) -> Result<Value, Refused> {
    let response = request
        .bearer_auth(token)
        .send()
        .await
        .map_err(|error| Refused::Other(cove_engine::describe(&error)))?;
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    if status.is_success() {
        return Ok(value);
    }
    let message = value["message"]
        .as_str()
        .map_or_else(|| text.clone(), str::to_owned);
    let message = format!("{status}: {message}");
    if status == reqwest::StatusCode::UNAUTHORIZED {
        Err(Refused::Unknown(message))
    } else {
        Err(Refused::Other(message))
    }
}

/// Daytona's `RunnerHealthcheck` for this host now, with cove's
/// `sandboxClasses` and `accelerator`.
fn report(data_dir: &Path, vm_assets: Option<&Path>, serving: Option<&Serving>) -> Value {
    let host = cove_engine::measure_host(data_dir);
    let RunnerUsage { cpu, memory, disk } = host.usage;
    // The service runs containers only: a runner that serves offers no
    // VMs, whatever the host could run.
    let vm = vm_assets
        .filter(|_| serving.is_none())
        .map(cove_runtime::vm::probe);
    let mut classes = vec!["container"];
    let accelerator = match vm {
        Some(Ok(accelerator)) => {
            classes.push("linux-vm");
            Some(accelerator.name())
        }
        Some(Err(missing)) => {
            tracing::debug!(%missing, "no VM sandboxes on this runner");
            None
        }
        None => None,
    };
    json!({
        "appVersion": env!("CARGO_PKG_VERSION"),
        "metrics": {
            "cpu": host.cpu,
            "memoryGiB": host.memory_gib,
            "diskGiB": host.disk_gib,
            "currentCpuLoadAverage": cpu / 100.0 * host.cpu as f64,
            "currentCpuUsagePercentage": cpu,
            "currentMemoryUsagePercentage": memory,
            "currentDiskUsagePercentage": disk,
            // Nothing runs here yet.
            "currentAllocatedCpu": 0,
            "currentAllocatedMemoryGiB": 0,
            "currentAllocatedDiskGiB": 0,
            "currentSnapshotCount": 0,
            "currentStartedSandboxes": 0,
        },
        "serviceHealth": [{"serviceName": "runner", "healthy": true}],
        "sandboxClasses": classes,
        "accelerator": accelerator,
        "apiUrl": serving.map(|s| &s.url),
        "serviceKey": serving.map(|s| &s.service.key),
        "sandboxNetwork": serving.is_some_and(|s| s.service.network.is_some()),
        "archive": serving.and_then(|s| s.service.archive.as_ref()).map(|a| a.location()),
    })
}

/// Makes `dir` (and its parents) and leaves it to its owner alone (0700).
fn make_private_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("making {} private", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::on_loopback;

    #[test]
    fn only_a_loopback_control_plane_is_spared_the_plain_http_warning() {
        for url in [
            "http://127.0.0.1:3000/api",
            "http://127.8.0.1/api",
            "http://localhost:3000/api",
            "http://[::1]:3000/api",
        ] {
            assert!(on_loopback(url), "{url}");
        }
        for url in [
            "http://10.0.0.5:3000/api",
            "http://control.example:3000/api",
            "http://localhost.example/api",
            "http://[::2]/api",
            "not a url",
        ] {
            assert!(!on_loopback(url), "{url}");
        }
    }
}
