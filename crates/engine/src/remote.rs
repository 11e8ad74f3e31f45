//! Sandboxes on a runner on another machine: [`RemoteRuntime`] is the
//! [`Runtime`] the engine drives for them, a client of the runner's service
//! (`cove runner`), and the wire both ends speak ([`RemoteSpec`],
//! [`RemoteFailure`], ...), kept here so they cannot drift apart.
//!
//! The runner's service takes the key the runner reported in its last
//! healthcheck, which the control plane keeps only in memory. Answers are
//! read up to [`ANSWER_LIMIT`]: a runner is trusted to run its sandboxes,
//! not to bound what it sends. A sandbox's agent is reached through the
//! runner ([`AgentEndpoint::Runner`]).
//!
//! A sandbox's network there is the runner's own: its egress policy goes
//! with its start ([`RemoteSpec::network`]). A stopped sandbox's storage
//! moves between the runner and the archive the control plane uses (an S3
//! location both name the same): the runner sends and fetches it itself,
//! so a sandbox's bytes never pass through the control plane. An image is
//! named by its path under the images directory; a runner that does not hold
//! it fetches it from the control plane (`GET /api/runners/me/images/...`,
//! which serves only the images of sandboxes placed on that runner), and
//! likewise the captured layers of a snapshot taken from a sandbox, named
//! by their capture ids (`GET /api/runners/me/layers/{capture}`). A
//! snapshot of a sandbox there is captured by the runner and streamed to
//! the control plane (`GET /layers/{capture}` on its service), which keeps
//! every snapshot's layers. Every such transfer must keep moving
//! ([`steady`]). What a runner elsewhere does not do yet is refused by
//! name: volumes, memory snapshots, pauses and forks.

use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use cove_agent_client::{RunnerTls, RunnerTunnel};
use cove_runtime::{
    AgentEndpoint, Resources, Runtime, RuntimeError, SandboxId, SandboxSpec, Started,
};
use serde::{Deserialize, Serialize};

/// The most of a runner's answer that is read.
pub const ANSWER_LIMIT: usize = 64 << 10;
/// How long one operation on a runner may take before it is given up.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(120);
/// How long moving a sandbox's storage to or from the archive may take.
const MOVE_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// How long to wait before asking again after a runner could not be reached
/// while a sandbox of it runs.
const RETRY_EVERY: Duration = Duration::from_secs(2);

/// The least a transfer between a control plane and a runner (an image, a
/// captured layer) must move in each [`STEADY_WINDOW`]: one that stalls or
/// trickles would hold what waits on it (a runner's receives go one at a
/// time) until its whole timeout.
pub const STEADY_FLOOR: u64 = 1 << 20;
/// See [`STEADY_FLOOR`].
pub const STEADY_WINDOW: Duration = Duration::from_secs(30);

/// `stream`, ended with a `TimedOut` error naming `what` as soon as a
/// window of [`STEADY_WINDOW`] passes in which it moved less than
/// [`STEADY_FLOOR`] (and had not ended).
pub fn steady<S>(
    stream: S,
    what: String,
) -> impl futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static
where
    S: futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + Unpin + 'static,
{
    steady_by(stream, what, STEADY_FLOOR, STEADY_WINDOW)
}

fn steady_by<S>(
    stream: S,
    what: String,
    floor: u64,
    window: Duration,
) -> impl futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static
where
    S: futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + Unpin + 'static,
{
    use futures_util::StreamExt as _;
    struct Watched<S> {
        stream: S,
        window_ends: tokio::time::Instant,
        moved: u64,
        ended: bool,
    }
    let first = Watched {
        stream,
        window_ends: tokio::time::Instant::now() + window,
        moved: 0,
        ended: false,
    };
    let too_slow = move |moved: u64| {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "{what} moved {moved} bytes in {} s, less than the {} KiB a transfer must move in that time",
                window.as_secs(),
                floor >> 10
            ),
        )
    };
    futures_util::stream::unfold(first, move |mut at| {
        let too_slow = too_slow.clone();
        async move {
            if at.ended {
                return None;
            }
            loop {
                let next = tokio::time::timeout_at(at.window_ends, at.stream.next()).await;
                let now = tokio::time::Instant::now();
                if let Ok(Some(Ok(chunk))) = &next {
                    at.moved += chunk.len() as u64;
                }
                if now >= at.window_ends {
                    if at.moved < floor && !matches!(next, Ok(None)) {
                        at.ended = true;
                        return Some((Err(too_slow(at.moved)), at));
                    }
                    at.moved = 0;
                    at.window_ends = now + window;
                }
                match next {
                    Ok(Some(Ok(chunk))) => return Some((Ok(chunk), at)),
                    Ok(Some(Err(error))) => {
                        at.ended = true;
                        return Some((Err(error), at));
                    }
                    Ok(None) => return None,
                    Err(_elapsed) => continue,
                }
            }
        }
    })
}

/// A sandbox as the control plane asks a runner elsewhere to make and start it.
/// A runner refuses a field it does not know rather than run without it (a
/// layer, say).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RemoteSpec {
    pub hostname: String,
    /// The image's root filesystem, relative to the images directory: the
    /// same path under the runner's.
    pub image: String,
    pub cpu: u32,
    pub memory_mib: u64,
    pub disk_gib: u64,
    pub env: Vec<(String, String)>,
    pub workdir: Option<String>,
    pub user: Option<String>,
    pub command: Vec<String>,
    /// Its egress policy, on a runner with a network (which refuses a
    /// start without one rather than open the default).
    #[serde(default)]
    pub network: Option<cove_store::NetworkSettings>,
    /// The captured layers over the image, topmost first, by capture id:
    /// each is `captures/{id}/upper` on the runner's storage, as on the
    /// control plane's.
    #[serde(default)]
    pub layers: Vec<String>,
    /// What the image's build marker (`.complete`) says on the control
    /// plane, when it has one (the default image): a runner's copy that says
    /// otherwise is of an older build at the same path, and is fetched anew.
    #[serde(default)]
    pub image_marker: Option<String>,
}

/// The most of an image's build marker that is read.
const MARKER_LIMIT: u64 = 256;

/// What the build marker of the image at `rootfs` says, if it has one. An
/// image's files are its maker's (a user's built or pulled image may hold
/// a `/.complete` of its own): only a regular file there is read, never
/// through a symbolic link, and never waiting on a FIFO.
pub fn image_marker(rootfs: &Path) -> Option<String> {
    let marker = rootfs.join(cove_images::COMPLETE_MARKER);
    cove_runtime::beneath::read_regular(&marker, MARKER_LIMIT).ok()
}

/// The capture id of a captured layer, `.../captures/{id}/upper` (where a
/// container runtime keeps it), if `layer` is one.
pub fn capture_of_layer(layer: &Path) -> Option<&str> {
    let capture = layer.parent()?;
    let id = capture.file_name()?.to_str()?;
    let captures = capture.parent()?.file_name()?;
    (layer.file_name()? == "upper" && captures == "captures" && plain_capture(id)).then_some(id)
}

/// Whether `id` can name a capture: a runner puts it in a path, so only
/// letters, digits and dashes (the control plane's are UUIDs).
pub fn plain_capture(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// `image` as a path relative to an images directory, if it is a plain one:
/// not empty, no root, no `.` or `..`. A runner is given its image by such a
/// path and asks the control plane for it by the same.
pub fn plain_image(image: &str) -> Option<&Path> {
    let relative = Path::new(image);
    let plain = !image.is_empty()
        && relative
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    plain.then_some(relative)
}

impl RemoteSpec {
    /// `spec` for a runner elsewhere, whose images directory has the layout
    /// of `images` (the control plane's). What a runner cannot be given yet
    /// is refused, named.
    pub fn of(spec: &SandboxSpec, images: &Path, runner: &str) -> Result<RemoteSpec, RuntimeError> {
        let refuse = |what: &str| RuntimeError::Unsupported {
            id: spec.id.to_string(),
            what: what.to_owned(),
            why: format!("on runner {runner}, on another machine, yet"),
        };
        let layers = spec
            .layers
            .iter()
            .map(|layer| capture_of_layer(layer).map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| refuse("a layer that is not a container's capture"))?;
        if !spec.volumes.is_empty() {
            return Err(refuse("volumes"));
        }
        if spec.network.is_some() {
            return Err(refuse("a network"));
        }
        let image = spec
            .rootfs
            .strip_prefix(images)
            .ok()
            .and_then(Path::to_str)
            .ok_or_else(|| refuse("an image outside the images directory"))?;
        Ok(RemoteSpec {
            hostname: spec.hostname.clone(),
            image: image.to_owned(),
            cpu: spec.resources.cpu,
            memory_mib: spec.resources.memory_mib,
            disk_gib: spec.resources.disk_gib,
            env: spec.env.clone(),
            workdir: spec.workdir.clone(),
            user: spec.user.clone(),
            command: spec.command.clone(),
            network: None,
            layers,
            image_marker: image_marker(&spec.rootfs),
        })
    }

    /// Where the image is under `images`. The image must be a plain
    /// relative path there ([`plain_image`]).
    pub fn image_path(&self, images: &Path) -> Result<PathBuf, String> {
        plain_image(&self.image)
            .map(|relative| images.join(relative))
            .ok_or_else(|| {
                format!(
                    "image {:?} is not a plain path under the images directory",
                    self.image
                )
            })
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a spec of strings and numbers is JSON")
    }

    /// The runner's side: the spec of sandbox `id`, its image found under
    /// `images` (where the runner put it, [`RemoteSpec::image_path`]) and
    /// each captured layer where `layer` says it is.
    pub fn into_spec(
        self,
        id: SandboxId,
        images: &Path,
        layer: impl Fn(&str) -> PathBuf,
    ) -> Result<SandboxSpec, String> {
        let rootfs = self.image_path(images)?;
        if !rootfs.is_dir() {
            return Err(format!(
                "this runner holds no image at {} (its images directory is {})",
                rootfs.display(),
                images.display()
            ));
        }
        let resources = Resources {
            cpu: self.cpu,
            memory_mib: self.memory_mib,
            disk_gib: self.disk_gib,
        };
        let mut spec = SandboxSpec::bare(id, &self.hostname, rootfs, resources);
        spec.env = self.env;
        spec.workdir = self.workdir;
        spec.user = self.user;
        spec.command = self.command;
        for capture in &self.layers {
            let path = layer(capture);
            if !plain_capture(capture) || !path.is_dir() {
                return Err(format!("this runner holds no captured layer {capture:?}"));
            }
            spec.layers.push(path);
        }
        Ok(spec)
    }
}

/// A runner's refusal: what kind of failure, for the control plane to act
/// on as it would on its own runtime's, and the runner's words.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteFailure {
    pub kind: FailureKind,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FailureKind {
    NotRunning,
    AlreadyRunning,
    Unsupported,
    Busy,
    Other,
}

impl RemoteFailure {
    /// How a runner says `error`, with the HTTP status it answers.
    pub fn of(error: &RuntimeError) -> (u16, RemoteFailure) {
        let (status, kind) = match error {
            RuntimeError::NotRunning { .. } => (409, FailureKind::NotRunning),
            RuntimeError::AlreadyRunning { .. } => (409, FailureKind::AlreadyRunning),
            RuntimeError::Unsupported { .. } => (501, FailureKind::Unsupported),
            error if error.is_transient() => (503, FailureKind::Busy),
            _ => (500, FailureKind::Other),
        };
        let message = crate::error::describe(error);
        (status, RemoteFailure { kind, message })
    }

    /// The error the control plane's engine sees, for sandbox `id` on `runner`.
    fn into_error(self, id: &str, runner: &str) -> RuntimeError {
        let id = id.to_owned();
        match self.kind {
            FailureKind::NotRunning => RuntimeError::NotRunning { id },
            FailureKind::AlreadyRunning => RuntimeError::AlreadyRunning { id },
            FailureKind::Unsupported => RuntimeError::Unsupported {
                id,
                what: self.message,
                why: format!("on runner {runner}"),
            },
            FailureKind::Busy => RuntimeError::Busy {
                id,
                reason: format!("runner {runner}: {}", self.message),
            },
            FailureKind::Other => RuntimeError::Other {
                id,
                reason: format!("runner {runner}: {}", self.message),
            },
        }
    }
}

/// A runner's answer to a start.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RemoteStarted {
    pub accelerator: Option<String>,
}

/// A runner's answer to whether a sandbox runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RemoteState {
    pub running: bool,
}

/// A runner's answer once a sandbox's start ended: why.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RemoteExit {
    pub reason: String,
}

/// A runner's answer once it moved a sandbox's storage to the archive.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RemoteArchived {
    pub bytes: u64,
}

/// The ids of the sandboxes a runner holds storage for.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RemoteIds {
    pub ids: Vec<String>,
}

/// Where a runner's service listens and the key it takes, as the runner's
/// last healthcheck said.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Service {
    /// `http(s)://host:port`, without a trailing slash.
    base: String,
    /// `host:port`.
    address: String,
    key: String,
    /// Set for an `https://` service.
    tls: Option<RunnerTls>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of logs.
        f.debug_struct("Service")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl Service {
    /// The service at `api_url` taking `key`: an `https://` URL when this
    /// server was given the roots runners' certificates chain to (`tls`),
    /// an `http://` one when it was not. `None` for any other URL, or one
    /// that names no host and port.
    pub(crate) fn new(
        api_url: &str,
        key: &str,
        tls: Option<&Arc<rustls::ClientConfig>>,
    ) -> Option<Service> {
        let url = url::Url::parse(api_url).ok()?;
        let host = url.host_str()?;
        let port = url.port_or_known_default()?;
        let tls = match (url.scheme(), tls) {
            ("http", None) => None,
            ("https", Some(config)) => {
                // The certificate names the host as the URL does (an IPv6
                // address without its brackets).
                let name = host.trim_start_matches('[').trim_end_matches(']');
                Some(RunnerTls {
                    config: config.clone(),
                    server_name: rustls::pki_types::ServerName::try_from(name.to_owned()).ok()?,
                })
            }
            _ => return None,
        };
        // An IPv6 host comes bracketed already.
        let address = format!("{host}:{port}");
        Some(Service {
            base: format!("{}://{address}", url.scheme()),
            address,
            key: key.to_owned(),
            tls,
        })
    }

    /// The URL form this server takes, for messages.
    pub(crate) fn expected(tls: bool) -> &'static str {
        match tls {
            true => {
                "an https://HOST:PORT URL (this server takes runners over TLS only: --runner-ca)"
            }
            false => "an http://HOST:PORT URL (https:// needs --runner-ca on this server)",
        }
    }
}

/// The runtime of every sandbox of one runner on another machine.
pub(crate) struct RemoteRuntime {
    /// The runner's name, for messages.
    runner: String,
    service: RwLock<Service>,
    /// Whether the runner gives its sandboxes a network (its own bridge),
    /// as its last report said.
    networked: AtomicBool,
    /// Set once the runner reported it no longer serves: what still
    /// waits on its sandboxes ends.
    retired: AtomicBool,
    /// Set while the runner is silent past the server's limit: a watch
    /// that cannot reach it ends.
    silent: AtomicBool,
    /// The archive the runner moves stopped sandboxes to and from, as its
    /// last report named it; `None`: it keeps none.
    archive: RwLock<Option<String>>,
    /// The egress policy of each sandbox about to start, sent with its start.
    policies: std::sync::Mutex<std::collections::HashMap<String, cove_store::NetworkSettings>>,
    /// The control plane's images directory: a sandbox's image is named to
    /// the runner by its path under it.
    images: PathBuf,
    /// The control plane's own container runtime, which keeps the captured
    /// layers of every snapshot: one taken of a sandbox on this runner is
    /// received into it. `None`: this server runs no containers.
    layers: Option<Arc<dyn Runtime>>,
    http: reqwest::Client,
}

impl RemoteRuntime {
    pub(crate) fn new(
        runner: &str,
        service: Service,
        images: PathBuf,
        layers: Option<Arc<dyn Runtime>>,
    ) -> RemoteRuntime {
        let mut http = reqwest::Client::builder();
        // Every runner's service is reached as this server was told to
        // (`--runner-ca`), so the first one's TLS holds for all.
        if let Some(tls) = &service.tls {
            http = http.tls_backend_preconfigured((*tls.config).clone());
        }
        let http = http
            .no_proxy()
            // A runner names its own address; where its answers point
            // is not followed.
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(5))
            // Under the runner listener's idle limit (20 s), so a pooled
            // connection is dropped here before the runner closes it.
            .pool_idle_timeout(Duration::from_secs(10))
            // A watch's long poll on a machine that vanished (no reset)
            // ends within about 25 s, and is asked again.
            .tcp_keepalive(Duration::from_secs(10))
            .tcp_keepalive_interval(Duration::from_secs(5))
            .tcp_keepalive_retries(3)
            .build()
            .expect("a client without proxies, and with rustls configured by cove, builds");
        RemoteRuntime {
            runner: runner.to_owned(),
            service: RwLock::new(service),
            networked: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            silent: AtomicBool::new(false),
            archive: RwLock::default(),
            policies: std::sync::Mutex::default(),
            images,
            layers,
            http,
        }
    }

    /// Takes the service a new report names (the runner restarted, or moved).
    pub(crate) fn set_service(&self, service: Service) {
        *self.service.write().unwrap() = service;
    }

    fn service(&self) -> Service {
        self.service.read().unwrap().clone()
    }

    /// Records whether the runner gives its sandboxes a network.
    pub(crate) fn set_networked(&self, networked: bool) {
        self.networked.store(networked, Ordering::Relaxed);
    }

    pub(crate) fn networked(&self) -> bool {
        self.networked.load(Ordering::Relaxed)
    }

    /// Records whether the runner is silent past the server's limit
    /// (unresponsive).
    pub(crate) fn set_silent(&self, silent: bool) {
        self.silent.store(silent, Ordering::Relaxed);
    }

    /// Records the archive the runner named (`None`: it keeps none).
    pub(crate) fn set_archive(&self, location: Option<&str>) {
        *self.archive.write().unwrap() = location.map(str::to_owned);
    }

    /// Whether the runner moves sandboxes to and from the archive at
    /// `location` (a shared one: an S3 location both name).
    pub(crate) fn shares_archive(&self, location: &str) -> bool {
        self.archive.read().unwrap().as_deref() == Some(location)
    }

    /// Has the runner move stopped sandbox `id`'s storage to its archive;
    /// how many bytes went. Its copy there stays until it is destroyed.
    pub(crate) async fn archive(&self, id: &SandboxId) -> Result<u64, RuntimeError> {
        let path = format!("/sandboxes/{id}/archive");
        let body = self
            .call(
                id.as_str(),
                reqwest::Method::POST,
                &path,
                None,
                Some(MOVE_TIMEOUT),
            )
            .await?;
        let archived: RemoteArchived = self.read(id.as_str(), &body)?;
        Ok(archived.bytes)
    }

    /// Has the runner bring sandbox `spec`'s storage back from its archive,
    /// ready to start there. The archive's copy stays, for the control
    /// plane to remove once the sandbox is back.
    pub(crate) async fn unarchive(&self, spec: &SandboxSpec) -> Result<(), RuntimeError> {
        self.post_spec(spec, "unarchive", MOVE_TIMEOUT).await
    }

    /// Posts sandbox `spec`, as the runner is given it, to its `action`
    /// route, taking at most `timeout`.
    async fn post_spec(
        &self,
        spec: &SandboxSpec,
        action: &str,
        timeout: Duration,
    ) -> Result<(), RuntimeError> {
        let remote = RemoteSpec::of(spec, &self.images, &self.runner)?.to_json();
        let path = format!("/sandboxes/{}/{action}", spec.id);
        let id = spec.id.as_str();
        (self
            .call(
                id,
                reqwest::Method::POST,
                &path,
                Some(remote),
                Some(timeout),
            )
            .await)
            .map(drop)
    }

    /// The runner no longer serves (it reported no service): the watches
    /// of its sandboxes end, saying so.
    pub(crate) fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
    }

    /// Sandbox `id`'s egress policy for its next start, which carries it
    /// (a runner with a network refuses a start without one).
    pub(crate) fn policy_for_start(&self, id: &str, settings: &cove_store::NetworkSettings) {
        let mut policies = self.policies.lock().unwrap();
        policies.insert(id.to_owned(), settings.clone());
    }

    /// Gives sandbox `id` the egress policy `settings` on its runner: from
    /// its next start, and at once if it runs.
    pub(crate) async fn set_network(
        &self,
        id: &str,
        settings: &cove_store::NetworkSettings,
    ) -> Result<(), RuntimeError> {
        let path = format!("/sandboxes/{id}/network");
        let body = Some(serde_json::to_value(settings).expect("settings of strings are JSON"));
        self.call(
            id,
            reqwest::Method::PUT,
            &path,
            body,
            Some(OPERATION_TIMEOUT),
        )
        .await
        .map(drop)
    }

    /// Calls `method path` on the runner for sandbox `id`; the answer's body
    /// on success, the runner's refusal (or why it could not be reached) as
    /// the error.
    async fn call(
        &self,
        id: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
        timeout: Option<Duration>,
    ) -> Result<Vec<u8>, RuntimeError> {
        let response = self.answer(id, method, path, body, timeout).await?;
        read_bounded(response)
            .await
            .map_err(|e| self.unreachable(id, e.to_string()))
    }

    /// Sends `method path` to the runner for sandbox `id`: its answer if it
    /// succeeded, its body still to read, else the runner's refusal (or why
    /// it could not be reached) as the error.
    async fn answer(
        &self,
        id: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
        timeout: Option<Duration>,
    ) -> Result<reqwest::Response, RuntimeError> {
        let service = self.service();
        let mut request = self
            .http
            .request(method, format!("{}{path}", service.base))
            .bearer_auth(&service.key);
        if let Some(timeout) = timeout {
            request = request.timeout(timeout);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .map_err(|e| self.unreachable(id, crate::error::describe(&e)))?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let body = read_bounded(response)
            .await
            .map_err(|e| self.unreachable(id, e.to_string()))?;
        let failure = serde_json::from_slice::<RemoteFailure>(&body).unwrap_or(RemoteFailure {
            kind: FailureKind::Other,
            message: format!("answered {status}"),
        });
        Err(failure.into_error(id, &self.runner))
    }

    /// Sandbox `id`'s runner could not be reached, for `why`.
    fn unreachable(&self, id: &str, why: String) -> RuntimeError {
        RuntimeError::Busy {
            id: id.to_owned(),
            reason: format!("runner {} could not be reached: {why}", self.runner),
        }
    }

    /// `call`, then the answer as `T`.
    async fn call_json<T: for<'de> Deserialize<'de>>(
        &self,
        id: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<T, RuntimeError> {
        let body = self
            .call(id, method, path, body, Some(OPERATION_TIMEOUT))
            .await?;
        self.read(id, &body)
    }

    /// A runner's answer about sandbox `id` as `T`.
    fn read<T: for<'de> Deserialize<'de>>(&self, id: &str, body: &[u8]) -> Result<T, RuntimeError> {
        serde_json::from_slice(body).map_err(|error| RuntimeError::Other {
            id: id.to_owned(),
            reason: format!(
                "runner {} answered what cove cannot read: {error}",
                self.runner
            ),
        })
    }

    async fn operation(
        &self,
        id: &str,
        method: reqwest::Method,
        path: &str,
    ) -> Result<(), RuntimeError> {
        self.call(id, method, path, None, Some(OPERATION_TIMEOUT))
            .await
            .map(drop)
    }

    /// Has the runner delete its copy of captured layer `capture` (its
    /// snapshot is deleted); one it does not hold is no error.
    pub(crate) async fn discard_layer(&self, capture: &str) -> Result<(), RuntimeError> {
        let path = format!("/layers/{capture}");
        self.operation(capture, reqwest::Method::DELETE, &path)
            .await
    }

    /// Receives the runner's captured layer `capture` (taken of sandbox
    /// `id`) into `layers`, the control plane's own store of them, as a
    /// `btrfs send` stream (`GET /layers/{capture}`), which the receive
    /// checks before running it. Answers the layer here.
    async fn fetch_capture(
        &self,
        id: &str,
        capture: &str,
        layers: &Arc<dyn Runtime>,
    ) -> Result<PathBuf, RuntimeError> {
        use futures_util::TryStreamExt as _;
        let path = format!("/layers/{capture}");
        let response =
            (self.answer(id, reqwest::Method::GET, &path, None, Some(MOVE_TIMEOUT))).await?;
        let stream = response.bytes_stream().map_err(std::io::Error::other);
        let what = format!("capture {capture} from runner {}", self.runner);
        let stream = Box::pin(steady(stream, what));
        let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(stream));
        layers
            .receive_capture(capture, Box::new(reader))
            .await
            .map_err(|error| RuntimeError::Other {
                id: id.to_owned(),
                reason: format!(
                    "receiving its capture from runner {}: {}",
                    self.runner,
                    crate::error::describe(&error)
                ),
            })
    }

    /// Waits for sandbox `id`'s start on the runner to end; why it ended.
    /// A runner that cannot be reached is asked again; one that no longer
    /// runs the sandbox (it restarted) ends it.
    async fn exit_of(self: Arc<Self>, id: String) -> String {
        loop {
            if self.retired.load(Ordering::Relaxed) {
                return format!("runner {} stopped serving", self.runner);
            }
            let path = format!("/sandboxes/{id}/exit");
            match self
                .call(&id, reqwest::Method::GET, &path, None, None)
                .await
            {
                Ok(body) => {
                    return serde_json::from_slice::<RemoteExit>(&body).map_or_else(
                        |_| format!("runner {} said it ended", self.runner),
                        |exit| exit.reason,
                    )
                }
                Err(RuntimeError::NotRunning { .. }) => {
                    return format!("runner {} no longer runs it", self.runner)
                }
                // Silent and out of reach: its sandboxes are not known to
                // run. Back, it says which still do (a recover starts them).
                Err(_) if self.silent.load(Ordering::Relaxed) => {
                    return format!(
                        "runner {} stopped reporting and cannot be reached",
                        self.runner
                    )
                }
                Err(error) => {
                    tracing::debug!(sandbox = %id, runner = %self.runner,
                        error = %crate::error::describe(&error), "waiting on a sandbox elsewhere");
                    tokio::time::sleep(RETRY_EVERY).await;
                }
            }
        }
    }
}

impl RemoteRuntime {
    /// Sandbox `id` as it runs on the runner: its agent through the runner,
    /// and its end watched there.
    fn watch(self: Arc<Self>, id: &str, accelerator: Option<&str>) -> Started {
        let service = self.service();
        let (tell, exited) = tokio::sync::oneshot::channel();
        let watch = self.exit_of(id.to_owned());
        tokio::spawn(async move {
            let _ = tell.send(watch.await);
        });
        Started {
            agent: AgentEndpoint::Runner(RunnerTunnel {
                address: service.address,
                sandbox: id.to_owned(),
                key: service.key,
                tls: service.tls,
            }),
            exited,
            accelerator: match accelerator {
                Some("kvm") => Some("kvm"),
                Some("tcg") => Some("tcg"),
                _ => None,
            },
        }
    }
}

/// A response's body, up to [`ANSWER_LIMIT`].
async fn read_bounded(mut response: reqwest::Response) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > ANSWER_LIMIT {
            return Err(format!(
                "its answer is longer than {} KiB",
                ANSWER_LIMIT >> 10
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// A remote runtime as the engine keeps it: shared, so a start's exit
/// watch outlives the call.
#[derive(Clone)]
pub(crate) struct Remote(pub(crate) Arc<RemoteRuntime>);

#[async_trait]
impl Runtime for Remote {
    /// The runner moves storage to and from its archive itself
    /// ([`RemoteRuntime::archive`]); whether that archive is this server's
    /// is checked before.
    fn can_archive(&self) -> bool {
        self.0.archive.read().unwrap().is_some()
    }

    async fn prepare(&self, spec: &SandboxSpec) -> Result<(), RuntimeError> {
        // The first sandbox of an image there waits for the runner to
        // fetch the image from this server: as long as a move may take.
        self.0.post_spec(spec, "prepare", MOVE_TIMEOUT).await
    }

    async fn start(&self, spec: &SandboxSpec) -> Result<Started, RuntimeError> {
        let mut remote = RemoteSpec::of(spec, &self.0.images, &self.0.runner)?;
        let id = spec.id.as_str();
        remote.network = self.0.policies.lock().unwrap().remove(id);
        let remote = remote.to_json();
        let path = format!("/sandboxes/{id}/start");
        let started: RemoteStarted = self
            .0
            .call_json(id, reqwest::Method::POST, &path, Some(remote))
            .await?;
        Ok(self.0.clone().watch(id, started.accelerator.as_deref()))
    }

    async fn stop(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let path = format!("/sandboxes/{id}/stop");
        self.0
            .operation(id.as_str(), reqwest::Method::POST, &path)
            .await
    }

    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let path = format!("/sandboxes/{id}");
        self.0
            .operation(id.as_str(), reqwest::Method::DELETE, &path)
            .await
    }

    async fn is_running(&self, id: &SandboxId) -> bool {
        let path = format!("/sandboxes/{id}");
        self.0
            .call_json::<RemoteState>(id.as_str(), reqwest::Method::GET, &path, None)
            .await
            .is_ok_and(|state| state.running)
    }

    /// Takes over a sandbox its runner still runs (this server restarted;
    /// the runner did not).
    async fn reattach(&self, spec: &SandboxSpec) -> Result<Option<Started>, RuntimeError> {
        let id = spec.id.as_str();
        let path = format!("/sandboxes/{id}");
        let state: RemoteState = self
            .0
            .call_json(id, reqwest::Method::GET, &path, None)
            .await?;
        if !state.running {
            return Ok(None);
        }
        Ok(Some(self.0.clone().watch(id, None)))
    }

    /// The runner captures the sandbox's layer, and this server receives
    /// it into its own store of layers, where every snapshot's are: a
    /// sandbox of the snapshot may then go to any runner. The runner keeps
    /// its copy (for a revert there) until the snapshot is deleted.
    async fn capture(&self, id: &SandboxId, capture_id: &str) -> Result<PathBuf, RuntimeError> {
        let Some(layers) = self.0.layers.clone() else {
            return Err(self.0.unsupported(
                id,
                "snapshots (this server runs no containers to keep their layers)",
            ));
        };
        let path = format!("/sandboxes/{id}/capture/{capture_id}");
        self.0
            .operation(id.as_str(), reqwest::Method::POST, &path)
            .await?;
        let received = self.0.fetch_capture(id.as_str(), capture_id, &layers).await;
        if received.is_err() {
            if let Err(error) = self.0.discard_layer(capture_id).await {
                tracing::warn!(sandbox = %id, capture = capture_id, runner = %self.0.runner,
                    error = %crate::error::describe(&error), "cannot delete a capture that did not come over");
            }
        }
        received
    }

    /// Deletes both copies of a capture `capture` made: the runner's and
    /// this server's.
    async fn discard_capture(&self, capture_id: &str) -> Result<(), RuntimeError> {
        let runner = self.0.discard_layer(capture_id).await;
        if let Some(layers) = &self.0.layers {
            layers.discard_capture(capture_id).await?;
        }
        runner
    }

    /// The runner reverts the stopped sandbox to its capture, fetching it
    /// from this server first if it no longer holds it.
    async fn revert(&self, spec: &SandboxSpec, capture_id: &str) -> Result<(), RuntimeError> {
        if !plain_capture(capture_id) {
            return Err(RuntimeError::Other {
                id: spec.id.to_string(),
                reason: format!("{capture_id:?} is not a capture id"),
            });
        }
        self.0
            .post_spec(spec, &format!("revert/{capture_id}"), MOVE_TIMEOUT)
            .await
    }
}

impl RemoteRuntime {
    fn unsupported(&self, id: &SandboxId, what: &str) -> RuntimeError {
        RuntimeError::Unsupported {
            id: id.to_string(),
            what: what.to_owned(),
            why: format!("on runner {}, on another machine, yet", self.runner),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream of `chunks` chunks of `size` bytes, one every `every`, then
    /// (with `stall`) nothing ever again.
    fn paced(
        chunks: usize,
        size: usize,
        every: Duration,
        stall: bool,
    ) -> impl futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + Unpin + 'static
    {
        use futures_util::StreamExt as _;
        let sent = futures_util::stream::iter(0..chunks).then(move |_| async move {
            tokio::time::sleep(every).await;
            Ok(bytes::Bytes::from(vec![7u8; size]))
        });
        let after = futures_util::stream::pending().take(usize::from(stall));
        Box::pin(sent.chain(after))
    }

    async fn drain(
        stream: impl futures_util::Stream<Item = std::io::Result<bytes::Bytes>>,
    ) -> Result<usize, std::io::Error> {
        use futures_util::StreamExt as _;
        let mut stream = std::pin::pin!(stream);
        let mut total = 0;
        let guard = Duration::from_secs(20);
        while let Some(chunk) = tokio::time::timeout(guard, stream.next())
            .await
            .expect("the watched stream ends or fails, never hangs")
        {
            total += chunk?.len();
        }
        Ok(total)
    }

    #[tokio::test]
    async fn a_transfer_that_keeps_moving_passes_whole() {
        let window = Duration::from_millis(300);
        let stream = paced(30, 4096, Duration::from_millis(10), false);
        let moved = drain(steady_by(stream, "a layer".into(), 1000, window)).await;
        assert_eq!(moved.unwrap(), 30 * 4096);
    }

    #[tokio::test]
    async fn a_transfer_that_stalls_or_trickles_is_ended_naming_it() {
        let window = Duration::from_millis(300);
        let stalled = paced(1, 10, Duration::ZERO, true);
        let error = drain(steady_by(
            stalled,
            "capture c from runner r".into(),
            1000,
            window,
        ))
        .await
        .unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
        assert!(
            error
                .to_string()
                .contains("capture c from runner r moved 10 bytes"),
            "{error}"
        );
        // Ten bytes every 50 ms never stalls, and is still too slow.
        let trickle = paced(1000, 10, Duration::from_millis(50), false);
        let error = drain(steady_by(trickle, "an image".into(), 1000, window))
            .await
            .unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
    }

    fn spec(rootfs: &str) -> SandboxSpec {
        let resources = Resources {
            cpu: 1,
            memory_mib: 512,
            disk_gib: 1,
        };
        SandboxSpec::bare(
            SandboxId::parse("sbx-1").unwrap(),
            "one",
            rootfs.into(),
            resources,
        )
    }

    #[test]
    fn an_image_is_named_by_its_path_under_the_images_directory_and_found_there() {
        let images = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(images.path().join("debian/rootfs")).unwrap();
        let on_control = spec("/var/images/debian/rootfs");
        let remote = RemoteSpec::of(&on_control, Path::new("/var/images"), "r1").unwrap();
        assert_eq!(remote.image, "debian/rootfs");
        let on_runner = remote
            .clone()
            .into_spec(SandboxId::parse("sbx-1").unwrap(), images.path(), no_layer)
            .unwrap();
        assert_eq!(on_runner.rootfs, images.path().join("debian/rootfs"));
        assert_eq!(on_runner.resources, on_control.resources);
    }

    /// Attack: a user's image whose `/.complete` is a link to a host file,
    /// or a FIFO that would hold the create forever. Neither is read.
    #[test]
    fn an_image_marker_is_read_only_from_a_regular_file() {
        let root = tempfile::tempdir().unwrap();
        let marker = root.path().join(cove_images::COMPLETE_MARKER);
        assert_eq!(image_marker(root.path()), None);
        std::fs::write(&marker, "cove-default 4\n").unwrap();
        assert_eq!(
            image_marker(root.path()).as_deref(),
            Some("cove-default 4\n")
        );
        std::fs::remove_file(&marker).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &marker).unwrap();
        assert_eq!(image_marker(root.path()), None);
        std::fs::remove_file(&marker).unwrap();
        let made = std::process::Command::new("mkfifo").arg(&marker).status();
        assert!(made.unwrap().success());
        assert_eq!(image_marker(root.path()), None);
    }

    fn no_layer(capture: &str) -> PathBuf {
        panic!("asked for layer {capture} of a spec with none")
    }

    #[test]
    fn captured_layers_go_by_capture_id_and_are_found_where_the_runner_keeps_them() {
        let (images, captures) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::fs::create_dir_all(images.path().join("debian/rootfs")).unwrap();
        let mut on_control = spec("/var/images/debian/rootfs");
        on_control.layers = vec![
            "/srv/storage/captures/2f1c-b/upper".into(),
            "/srv/storage/captures/0a9e-a/upper".into(),
        ];
        let remote = RemoteSpec::of(&on_control, Path::new("/var/images"), "r1").unwrap();
        assert_eq!(remote.layers, ["2f1c-b", "0a9e-a"]);
        let layer = |capture: &str| captures.path().join(capture).join("upper");
        let error = (remote.clone())
            .into_spec(SandboxId::parse("sbx-1").unwrap(), images.path(), layer)
            .unwrap_err();
        assert!(
            error.contains("holds no captured layer \"2f1c-b\""),
            "{error}"
        );
        for capture in ["2f1c-b", "0a9e-a"] {
            std::fs::create_dir_all(layer(capture)).unwrap();
        }
        let on_runner = remote
            .into_spec(SandboxId::parse("sbx-1").unwrap(), images.path(), layer)
            .unwrap();
        assert_eq!(on_runner.layers, [layer("2f1c-b"), layer("0a9e-a")]);
    }

    /// Attack: a control plane (or whoever took its place) names a layer
    /// that would leave where the runner keeps its captures.
    #[test]
    fn a_capture_id_that_is_not_plain_is_refused() {
        let images = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(images.path().join("debian/rootfs")).unwrap();
        for capture in ["..", "../../etc", "a/b", "", "x\0"] {
            let mut remote = RemoteSpec::of(
                &spec("/var/images/debian/rootfs"),
                Path::new("/var/images"),
                "r1",
            )
            .unwrap();
            remote.layers = vec![capture.into()];
            let error = remote
                .into_spec(SandboxId::parse("sbx-1").unwrap(), images.path(), |c| {
                    images.path().join(c)
                })
                .unwrap_err();
            assert!(
                error.contains("holds no captured layer"),
                "{capture}: {error}"
            );
        }
        for layer in [
            "/srv/storage/captures/../upper",
            "/srv/other/x/upper",
            "/srv/captures/x/lower",
        ] {
            assert_eq!(capture_of_layer(Path::new(layer)), None, "{layer}");
        }
    }

    /// Attack: a control plane (or whoever took its place) names an image
    /// outside the runner's images directory. The runner refuses it.
    #[test]
    fn an_image_path_that_leaves_the_images_directory_is_refused() {
        let images = tempfile::tempdir().unwrap();
        for image in ["../../etc", "/etc", "", "debian/../../x"] {
            let remote = RemoteSpec {
                hostname: "one".into(),
                image: image.into(),
                cpu: 1,
                memory_mib: 512,
                disk_gib: 1,
                env: Vec::new(),
                workdir: None,
                user: None,
                command: Vec::new(),
                network: None,
                layers: Vec::new(),
                image_marker: None,
            };
            let error = remote
                .into_spec(SandboxId::parse("sbx-1").unwrap(), images.path(), no_layer)
                .unwrap_err();
            assert!(error.contains("not a plain path"), "{image}: {error}");
        }
    }

    #[test]
    fn what_a_runner_elsewhere_cannot_be_given_yet_is_refused_by_name() {
        let mut layered = spec("/var/images/debian/rootfs");
        layered.layers.push("/var/vm/one/disk.qcow2".into());
        let error = RemoteSpec::of(&layered, Path::new("/var/images"), "r1").unwrap_err();
        assert!(
            error
                .to_string()
                .contains("a layer that is not a container's capture"),
            "{error}"
        );
        let elsewhere = spec("/opt/rootfs");
        let error = RemoteSpec::of(&elsewhere, Path::new("/var/images"), "r1").unwrap_err();
        assert!(
            error.to_string().contains("outside the images directory"),
            "{error}"
        );
        assert!(error.to_string().contains("runner r1"), "{error}");
    }

    #[test]
    fn a_service_is_reached_at_the_host_and_port_of_its_url() {
        let service = Service::new("http://10.0.0.7:3100/", "k", None).unwrap();
        assert_eq!(service.address, "10.0.0.7:3100");
        assert_eq!(service.base, "http://10.0.0.7:3100");
        assert!(service.tls.is_none());
        assert!(Service::new("https://10.0.0.7", "k", None).is_none());
        assert!(Service::new("http://", "k", None).is_none());
        assert!(Service::new("ftp://10.0.0.7:21", "k", None).is_none());
    }

    /// Attack: a runner (or whoever took its address) reports a plain
    /// `http://` service to a server told to reach runners over TLS only.
    /// It is not taken, so nothing is sent to it in the clear.
    #[test]
    fn a_server_given_runner_roots_takes_only_https_services() {
        let roots = rustls::RootCertStore::empty();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = Arc::new(
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        );
        assert!(Service::new("http://10.0.0.7:3100", "k", Some(&config)).is_none());
        let service = Service::new("https://runner-2.internal:3100", "k", Some(&config)).unwrap();
        assert_eq!(service.base, "https://runner-2.internal:3100");
        let tls = service.tls.clone().unwrap();
        assert_eq!(tls.server_name.to_str(), "runner-2.internal");
        let v6 = Service::new("https://[fd00::7]:3100", "k", Some(&config)).unwrap();
        assert_eq!(v6.address, "[fd00::7]:3100");
        // Its client takes the configuration as it is.
        let _ = RemoteRuntime::new("r1", service, PathBuf::new(), None);
    }
}
