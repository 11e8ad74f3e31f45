//! The service of a runner on another machine (`cove runner --listen`): the
//! control plane drives this machine's container runtime through it, and
//! reaches each sandbox's agent through it. Its wire is
//! `cove_engine::remote`'s, which the control plane's client speaks.
//!
//! Every route takes the key this process made at start and reported in its
//! healthcheck (`serviceKey`), compared in constant time; the runner's own
//! token, which the control plane keeps only hashed, is not it. A sandbox's
//! agent is a byte stream after `GET /sandboxes/{id}/agent` with
//! `Upgrade: cove-agent`: the service splices it to the agent's Unix socket
//! and reads nothing of it.
//!
//! | route | does |
//! |---|---|
//! | `POST /sandboxes/{id}/prepare` | makes its storage ([`RemoteSpec`]) |
//! | `POST /sandboxes/{id}/start` | boots it |
//! | `GET /sandboxes/{id}/exit` | answers once that start ended, with why |
//! | `POST /sandboxes/{id}/stop` | ends its processes, keeps its storage |
//! | `PUT /sandboxes/{id}/network` | a new egress policy, applied at once if it runs |
//! | `POST /sandboxes/{id}/archive` | sends its storage to the archive (it stays here until deleted) |
//! | `POST /sandboxes/{id}/unarchive` | fetches its storage from the archive ([`RemoteSpec`]) |
//! | `DELETE /sandboxes/{id}` | removes everything of it |
//! | `GET /sandboxes/{id}` | whether it runs |
//! | `GET /sandboxes/{id}/agent` | the agent's byte stream (upgrade) |
//! | `POST /sandboxes/{id}/capture/{capture}` | captures its writable layer, read-only (a snapshot) |
//! | `POST /sandboxes/{id}/revert/{capture}` | reverts it, stopped, to a capture of it ([`RemoteSpec`]; the capture fetched if gone) |
//! | `GET /layers/{capture}` | a capture as a `btrfs send` stream, for the control plane to keep |
//! | `DELETE /layers/{capture}` | deletes its copy of a captured layer (the snapshot's deletion) |

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cove_engine::remote::{
    FailureKind, RemoteArchived, RemoteExit, RemoteFailure, RemoteSpec, RemoteStarted, RemoteState,
};
use cove_engine::NetworkSettings;
use cove_net::{Deletion, Link, LinkKind};
use cove_runtime::container::ContainerRuntime;
use cove_runtime::{AgentEndpoint, NetworkLink, Runtime, RuntimeError, SandboxId, SandboxNetwork};
use tokio::sync::watch;

/// What the service holds: the runtime, where images are, its key, and the
/// sandboxes it started.
pub(crate) struct Service {
    pub(crate) runtime: Arc<ContainerRuntime>,
    /// This runner's own sandbox network; `None`: loopback only.
    pub(crate) network: Option<Arc<cove_net::Network>>,
    /// Where stopped sandboxes move to and from (`--archive`).
    pub(crate) archive: Option<cove_engine::Archive>,
    pub(crate) images: PathBuf,
    /// Where images this runner lacks are fetched from.
    control: Control,
    pub(crate) key: String,
    runs: Mutex<HashMap<String, Run>>,
    /// Each start's number, so the end of one is not taken for another's.
    starts: AtomicU64,
    /// Per sandbox: held while its start, stop or delete changes its
    /// network, and while the end of a start gives its port back.
    gates: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Per image: held while it is fetched, so it is fetched once.
    fetches: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
    /// Which images under `images` runners fetched and still use.
    image_users: Arc<crate::runner_images::ImageUsers>,
}

/// Waits for the gate of `key` among `gates` (made at its first use) and
/// holds it while the guard lives.
async fn pass<K: std::hash::Hash + Eq>(
    gates: &Mutex<HashMap<K, Arc<tokio::sync::Mutex<()>>>>,
    key: K,
) -> tokio::sync::OwnedMutexGuard<()> {
    let gate = gates.lock().unwrap().entry(key).or_default().clone();
    gate.lock_owned().await
}

/// The control plane this runner reports to, as an image is fetched from it.
pub(crate) struct Control {
    /// Its API URL (`…/api`).
    pub(crate) url: String,
    pub(crate) http: reqwest::Client,
    /// This runner's token.
    pub(crate) token: String,
}

impl Control {
    /// What the control plane says this runner keeps of `what` (`GET
    /// /runners/me/{what}`, the list under `field`); `None`, said in the
    /// log, when it cannot be asked: the caller then keeps everything.
    async fn kept(&self, what: &str, field: &str) -> Option<std::collections::HashSet<String>> {
        let url = format!("{}/runners/me/{what}", self.url);
        let listed = async {
            let response = (self.http.get(&url))
                .bearer_auth(&self.token)
                .send()
                .await?
                .error_for_status()?;
            response.json::<serde_json::Value>().await
        };
        let listed = match listed.await {
            Ok(listed) => listed,
            Err(error) => {
                let error = cove_engine::describe(&error);
                tracing::warn!(%error, what, "cannot ask the control plane what to keep; keeping all");
                return None;
            }
        };
        let kept = serde_json::from_value(listed[field].clone());
        kept.inspect_err(|error| {
            tracing::warn!(%error, what, "the control plane's list of what to keep is unreadable; keeping all");
        })
        .ok()
    }
}

/// What a runner reads a download from the control plane through, on a
/// blocking thread.
type Download = tokio_util::io::SyncIoBridge<
    tokio_util::io::StreamReader<
        std::pin::Pin<Box<dyn futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send>>,
        bytes::Bytes,
    >,
>;

impl Control {
    /// `GET url` with this runner's token, as a reader of its body, which
    /// fails once it stops moving ([`cove_engine::remote::steady`]); a
    /// refusal is an error with its status and the first of its words.
    async fn download(&self, url: reqwest::Url) -> Result<Download, String> {
        use futures_util::TryStreamExt as _;
        let path = url.path().to_owned();
        let response = (self.http.get(url))
            .bearer_auth(&self.token)
            .timeout(FETCH_TIMEOUT)
            .send()
            .await
            .map_err(|e| cove_engine::describe(&e))?;
        let status = response.status();
        if !status.is_success() {
            // The first chunk of its words is enough to say why.
            let mut response = response;
            let chunk = response.chunk().await.ok().flatten().unwrap_or_default();
            let message: String = String::from_utf8_lossy(&chunk).chars().take(500).collect();
            return Err(format!("{status}: {message}"));
        }
        let stream = response.bytes_stream().map_err(std::io::Error::other);
        // A control plane's answer that stalls would hold this runner's
        // receives (one at a time) for the whole of FETCH_TIMEOUT.
        let stream = cove_engine::remote::steady(stream, format!("the answer of {path}"));
        let stream: std::pin::Pin<Box<dyn futures_util::Stream<Item = _> + Send>> =
            Box::pin(stream);
        Ok(tokio_util::io::SyncIoBridge::new(
            tokio_util::io::StreamReader::new(stream),
        ))
    }
}

/// How long fetching one image may take.
const FETCH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// Where image transfers unpack under the images directory until whole.
const INCOMING: &str = ".incoming";

/// One start of a sandbox: its agent, and why it ended once it has.
#[derive(Clone)]
struct Run {
    number: u64,
    agent: AgentEndpoint,
    ended: watch::Receiver<Option<String>>,
}

impl Service {
    pub(crate) fn new(
        runtime: Arc<ContainerRuntime>,
        network: Option<Arc<cove_net::Network>>,
        archive: Option<cove_engine::Archive>,
        images: PathBuf,
        control: Control,
        key: String,
    ) -> Service {
        let swept = cove_images::sweep_incoming(&images.join(INCOMING));
        if swept > 0 {
            tracing::info!(
                swept,
                "removed image transfers a runner before left unfinished"
            );
        }
        let swept = runtime.sweep_capture_transfers();
        if swept > 0 {
            tracing::info!(
                swept,
                "removed captured-layer transfers a runner before left unfinished"
            );
        }
        let image_users = Arc::new(crate::runner_images::ImageUsers::new(
            &images,
            &control.token,
        ));
        Service {
            image_users,
            runtime,
            network,
            archive,
            images,
            control,
            key,
            runs: Mutex::default(),
            starts: AtomicU64::new(0),
            gates: Mutex::default(),
            fetches: Mutex::default(),
        }
    }

    /// Fetches `image` (a plain path under the images directory) from the
    /// control plane into `rootfs`, unless a fetch before this one, waited
    /// for, already did.
    async fn fetch_image(
        &self,
        image: &str,
        rootfs: &std::path::Path,
        marker: Option<&str>,
    ) -> Result<(), Refusal> {
        // Held until the image is in place, even if this answer is given
        // up (its caller gone): a retry then waits for it, not fetches twice.
        let held = pass(&self.fetches, rootfs.to_owned()).await;
        if current(rootfs, marker) {
            return Ok(());
        }
        if rootfs.is_dir() {
            // An older build at the same path: moved aside, not deleted, since
            // sandboxes running here still have it under their root; the
            // next runner of this directory sweeps it (`sweep_incoming`).
            let aside = self.images.join(INCOMING).join(format!(
                "{}-stale-{}",
                std::process::id(),
                uuid::Uuid::new_v4().simple()
            ));
            let moved = std::fs::create_dir_all(self.images.join(INCOMING))
                .and_then(|()| std::fs::rename(rootfs, &aside));
            if let Err(error) = moved {
                return Err(refuse(
                    500,
                    FailureKind::Other,
                    format!("moving aside the older copy of image {image}: {error}"),
                ));
            }
            tracing::info!(image, aside = %aside.display(), "the control plane's image was rebuilt; fetching it anew");
        }
        let failed = |why: String| {
            refuse(
                500,
                FailureKind::Other,
                format!("fetching image {image} from the control plane: {why}"),
            )
        };
        let mut url = reqwest::Url::parse(&format!("{}/runners/me/images/", self.control.url))
            .map_err(|e| failed(e.to_string()))?;
        url.path_segments_mut()
            .map_err(|()| failed("the control plane's URL cannot take a path".into()))?
            .pop_if_empty()
            .extend(image.split('/'));
        let began = std::time::Instant::now();
        let reader = self.control.download(url).await.map_err(failed)?;
        let (into, incoming) = (rootfs.to_owned(), self.images.join(INCOMING));
        let bytes = tokio::task::spawn_blocking(move || {
            let received = cove_images::receive_rootfs(reader, &into, &incoming);
            drop(held);
            received
        })
        .await
        .map_err(|e| failed(e.to_string()))?
        .map_err(|e| failed(cove_engine::describe(&e)))?;
        if let Err(error) = self.image_users.mark_fetched(image) {
            // Only its deletion once unused is lost.
            tracing::warn!(image, %error, "cannot record the fetch of an image");
        }
        tracing::info!(
            image,
            bytes,
            took_ms = began.elapsed().as_millis() as u64,
            "fetched an image from the control plane"
        );
        Ok(())
    }

    /// Deletes the images this runner (or another sharing its images
    /// directory) fetched that no sandbox placed on it uses any more, as
    /// the control plane lists them (`GET /runners/me/images`), unless
    /// another runner marks it used ([`crate::runner_images`]). Called,
    /// like [`Service::sweep_layers`], before this start serves. Without
    /// the control plane's answer every image stays. Answers how many went.
    pub(crate) async fn sweep_images(&self) -> usize {
        let Some(keep) = self.control.kept("images", "images").await else {
            return 0;
        };
        let (users, aside) = (self.image_users.clone(), self.images.join(INCOMING));
        let swept = tokio::task::spawn_blocking(move || users.sweep(&keep, &aside)).await;
        match swept {
            Ok(Ok(deleted)) => {
                for image in &deleted {
                    tracing::info!(image, "deleted an image no sandbox here uses any more");
                }
                deleted.len()
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "cannot delete the images no sandbox here uses");
                0
            }
            Err(error) => {
                tracing::warn!(%error, "the sweep of images ended early");
                0
            }
        }
    }

    /// Deletes the captured layers this runner fetched that no sandbox
    /// placed on it starts from any more, as the control plane lists them
    /// (`GET /runners/me/layers`): their snapshots were deleted while this
    /// runner could not be told. Called before the control plane learns
    /// this start's service, so no fetch or start is on. Without the
    /// control plane's answer every copy stays. Answers how many went.
    pub(crate) async fn sweep_layers(&self) -> usize {
        let Some(keep) = self.control.kept("layers", "captures").await else {
            return 0;
        };
        let mut swept = 0;
        for capture in self.runtime.capture_ids() {
            // Only fetched layers (capture ids); never an archive's snapshot.
            if uuid::Uuid::parse_str(&capture).is_err() || keep.contains(&capture) {
                continue;
            }
            match self.runtime.discard_capture(&capture).await {
                Ok(()) => swept += 1,
                Err(error) => {
                    let error = cove_engine::describe(&error);
                    tracing::warn!(capture, %error, "cannot delete a captured layer no sandbox here uses");
                }
            }
        }
        swept
    }

    /// Fetches captured layer `capture` from the control plane onto this
    /// runner's storage, unless a fetch before this one, waited for,
    /// already did.
    async fn fetch_layer(&self, capture: &str) -> Result<(), Refusal> {
        let layer = self.runtime.captured_layer(capture);
        let held = pass(&self.fetches, layer.clone()).await;
        if layer.is_dir() {
            return Ok(());
        }
        let failed = |why: String| {
            refuse(
                500,
                FailureKind::Other,
                format!("fetching captured layer {capture} from the control plane: {why}"),
            )
        };
        let url = reqwest::Url::parse(&format!("{}/runners/me/layers/{capture}", self.control.url))
            .map_err(|e| failed(e.to_string()))?;
        let began = std::time::Instant::now();
        let reader = self.control.download(url).await.map_err(failed)?;
        // Whole or not at all: a stream cut short fails `btrfs receive`
        // (its end command is missing), and nothing is moved into place.
        // The gate goes with the stream into the receive, so it stays held
        // until the capture is in place even if this answer is given up.
        let reader = Holding(reader, held);
        (self.runtime.receive_capture(capture, reader).await)
            .map_err(|e| failed(cove_engine::describe(&e)))?;
        tracing::info!(
            capture,
            took_ms = began.elapsed().as_millis() as u64,
            "fetched a captured layer from the control plane"
        );
        Ok(())
    }

    /// Waits for sandbox `id`'s gate (see `gates`) and holds it while the
    /// answer lives.
    async fn enter(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        pass(&self.gates, id.to_owned()).await
    }

    /// Once start `number` of sandbox `id` ended by itself (no stop or
    /// delete took it first, and no later start is on), its network port
    /// goes back, as a server's own sandbox's does.
    async fn ended_by_itself(&self, id: &str, number: u64) {
        let _held = self.enter(id).await;
        let current = (self.runs.lock().unwrap().get(id)).is_some_and(|run| run.number == number);
        if current {
            if let Err(Refusal(_, failure)) = self.detach(id).await {
                tracing::warn!(sandbox = %id, error = %failure.message, "after it ended by itself");
            }
        }
    }

    /// Attaches sandbox `id` to this runner's network with the policy its
    /// start carries, as it is about to start (a port left by an earlier
    /// run goes first). A start without a policy is refused rather than
    /// given the open default; without a network, only the default is taken.
    async fn attach(
        &self,
        id: &str,
        settings: Option<NetworkSettings>,
    ) -> Result<Option<SandboxNetwork>, Refusal> {
        let Some(network) = &self.network else {
            if settings.is_some_and(|s| s != NetworkSettings::default()) {
                return Err(no_network());
            }
            return Ok(None);
        };
        let Some(settings) = settings else {
            return Err(refuse(
                400,
                FailureKind::Other,
                format!("the start of {id} carries no egress policy; this runner has a network"),
            ));
        };
        let policy = policy_of(&settings)?;
        let _ = network.detach(id, Deletion::Now).await;
        let attachment = network
            .attach_as(id, &policy, LinkKind::Namespace)
            .await
            .map_err(|error| network_failure(id, "attach it to the network", &error))?;
        let Link::Namespace(netns) = attachment.link else {
            return Err(refuse(
                500,
                FailureKind::Other,
                "the network made no namespace",
            ));
        };
        Ok(Some(SandboxNetwork {
            link: NetworkLink::Namespace(netns),
            resolv_conf: attachment.resolv_conf,
        }))
    }

    /// Takes sandbox `id` off the network.
    async fn detach(&self, id: &str) -> Result<(), Refusal> {
        match &self.network {
            Some(network) => match network.detach(id, Deletion::Now).await {
                Ok(()) | Err(cove_net::NetError::NotAttached { .. }) => Ok(()),
                Err(error) => Err(network_failure(id, "detach it from the network", &error)),
            },
            None => Ok(()),
        }
    }

    /// Sandbox `id`'s start by this process, while it has not ended.
    fn live_run(&self, id: &str) -> Option<Run> {
        let runs = self.runs.lock().unwrap();
        runs.get(id)
            .filter(|run| run.ended.borrow().is_none())
            .cloned()
    }

    /// Stops every sandbox it started, for a clean exit.
    pub(crate) async fn stop_all(&self) {
        let ids: Vec<String> = self
            .runs
            .lock()
            .unwrap()
            .drain()
            .map(|(id, _)| id)
            .collect();
        for id in ids {
            let Ok(sandbox) = SandboxId::parse(&id) else {
                continue;
            };
            if let Err(error) = self.runtime.stop(&sandbox).await {
                tracing::warn!(sandbox = %id, error = %cove_engine::describe(&error), "stopping at exit");
            }
        }
    }
}

pub(crate) fn router(service: Arc<Service>, quiet: cove_quiet::Quiet) -> Router {
    Router::new()
        .route("/sandboxes/{id}/prepare", post(prepare))
        .route("/sandboxes/{id}/start", post(start))
        .route("/sandboxes/{id}/exit", get(exit))
        .route("/sandboxes/{id}/stop", post(stop))
        .route("/sandboxes/{id}/network", axum::routing::put(set_network))
        .route("/sandboxes/{id}/archive", post(archive))
        .route("/sandboxes/{id}/unarchive", post(unarchive))
        .route("/sandboxes/{id}", get(running).delete(destroy))
        .route("/sandboxes/{id}/agent", get(agent))
        .route("/sandboxes/{id}/capture/{capture}", post(capture))
        .route("/sandboxes/{id}/revert/{capture}", post(revert))
        .route("/layers/{capture}", get(send_layer).delete(discard_layer))
        .layer(axum::middleware::from_fn_with_state(
            quiet,
            cove_api::hold_quiet,
        ))
        .layer(axum::middleware::from_fn_with_state(
            service.clone(),
            authorize,
        ))
        .with_state(service)
}

/// A refusal in the wire's shape.
struct Refusal(u16, RemoteFailure);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(self.1)).into_response()
    }
}

impl From<RuntimeError> for Refusal {
    fn from(error: RuntimeError) -> Refusal {
        let (status, failure) = RemoteFailure::of(&error);
        Refusal(status, failure)
    }
}

fn refuse(status: u16, kind: FailureKind, message: impl Into<String>) -> Refusal {
    Refusal(
        status,
        RemoteFailure {
            kind,
            message: message.into(),
        },
    )
}

async fn authorize(
    State(service): State<Arc<Service>>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let given = bearer(request.headers()).unwrap_or_default();
    if !cove_engine::constant_time_eq(given.as_bytes(), service.key.as_bytes()) {
        return refuse(
            401,
            FailureKind::Other,
            "this runner's service takes its own key",
        )
        .into_response();
    }
    next.run(request).await
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

/// The checked egress policy of `settings`; a bad one is the control
/// plane's request to fix (400).
fn policy_of(settings: &NetworkSettings) -> Result<cove_net::Policy, Refusal> {
    cove_engine::network_policy(settings)
        .map_err(|error| refuse(400, FailureKind::Other, cove_engine::describe(&error)))
}

fn no_network() -> Refusal {
    refuse(
        501,
        FailureKind::Unsupported,
        "a network policy on a runner without a sandbox network (--no-network)",
    )
}

fn network_failure(id: &str, step: &str, error: &cove_net::NetError) -> Refusal {
    let message = format!("sandbox {id}: {step}: {}", cove_engine::describe(error));
    refuse(500, FailureKind::Other, message)
}

fn sandbox(id: &str) -> Result<SandboxId, Refusal> {
    SandboxId::parse(id).map_err(|e| refuse(400, FailureKind::Other, e.to_string()))
}

/// Whether the path `image` under `images` passes through a symbolic link
/// there (an image's own link to `/`, say): such a path leads out of the
/// images directory, and is refused.
pub(crate) fn through_a_link(images: &std::path::Path, image: &str) -> bool {
    let mut beneath = images.to_path_buf();
    std::path::Path::new(image).components().any(|part| {
        beneath.push(part);
        beneath.is_symlink()
    })
}

/// A reader that holds `G` (a fetch's gate) as long as it lives.
struct Holding<R, G>(R, G);

impl<R: std::io::Read, G> std::io::Read for Holding<R, G> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

/// Whether this runner's copy of an image at `rootfs` is there and of the
/// build the control plane's marker names (any copy, when it names none).
fn current(rootfs: &std::path::Path, marker: Option<&str>) -> bool {
    rootfs.is_dir()
        && marker.is_none_or(|marker| {
            cove_engine::remote::image_marker(rootfs).as_deref() == Some(marker)
        })
}

/// The runtime's spec of sandbox `id`, its image fetched from the control
/// plane first if this runner does not hold it yet.
async fn spec_of(
    service: &Service,
    id: SandboxId,
    spec: RemoteSpec,
) -> Result<cove_runtime::SandboxSpec, Refusal> {
    let bad = |message| refuse(400, FailureKind::Other, message);
    let rootfs = spec.image_path(&service.images).map_err(bad)?;
    if through_a_link(&service.images, &spec.image) {
        return Err(bad(format!(
            "image {:?} goes through a symbolic link under the images directory",
            spec.image
        )));
    }
    // Marked before it is looked at: a sweep by a runner sharing this
    // images directory then leaves it, or has moved it aside already.
    let marked = service.image_users.clone();
    let image = spec.image.clone();
    (tokio::task::spawn_blocking(move || marked.mark_used(&image)).await)
        .map_err(std::io::Error::other)
        .and_then(|marked| marked)
        .map_err(|error| {
            let message = format!("marking image {} as used here: {error}", spec.image);
            refuse(500, FailureKind::Other, message)
        })?;
    let marker = spec.image_marker.as_deref();
    if !current(&rootfs, marker) {
        service.fetch_image(&spec.image, &rootfs, marker).await?;
    }
    for capture in &spec.layers {
        if !cove_engine::remote::plain_capture(capture) {
            return Err(bad(format!("{capture:?} is not a capture id")));
        }
        service.fetch_layer(capture).await?;
    }
    let runtime = &service.runtime;
    spec.into_spec(id, &service.images, |capture| {
        runtime.captured_layer(capture)
    })
    .map_err(bad)
}

/// `capture` if it can name a capture ([`cove_engine::remote::plain_capture`]), else 400.
fn capture_id(capture: &str) -> Result<&str, Refusal> {
    match cove_engine::remote::plain_capture(capture) {
        true => Ok(capture),
        false => Err(refuse(
            400,
            FailureKind::Other,
            format!("{capture:?} is not a capture id"),
        )),
    }
}

/// Captures sandbox `id`'s writable layer as capture `capture`, read-only,
/// for the control plane to fetch (`GET /layers/{capture}`); a running
/// sandbox is frozen only for the instant of the copy. This runner keeps
/// it until the control plane deletes its snapshot.
async fn capture(
    State(service): State<Arc<Service>>,
    Path((id, capture)): Path<(String, String)>,
) -> Result<StatusCode, Refusal> {
    let sandbox = sandbox(&id)?;
    let capture = capture_id(&capture)?;
    let _held = service.enter(&id).await;
    service.runtime.capture(&sandbox, capture).await?;
    tracing::info!(sandbox = %id, capture, "captured for a snapshot");
    Ok(StatusCode::NO_CONTENT)
}

/// Reverts stopped sandbox `id` to capture `capture`, taken of it: fetched
/// from the control plane first if this runner no longer holds it (it was
/// started here again after the capture moved, or this runner swept it).
async fn revert(
    State(service): State<Arc<Service>>,
    Path((id, capture)): Path<(String, String)>,
    Json(spec): Json<RemoteSpec>,
) -> Result<StatusCode, Refusal> {
    let capture = capture_id(&capture)?;
    let spec = spec_of(&service, sandbox(&id)?, spec).await?;
    service.fetch_layer(capture).await?;
    let _held = service.enter(&id).await;
    service.runtime.revert(&spec, capture).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Capture `capture` of this runner's as the `btrfs send` stream the
/// control plane receives (and checks) into its own store of layers;
/// cut off, not ended, if the send fails.
async fn send_layer(
    State(service): State<Arc<Service>>,
    Path(capture): Path<String>,
) -> Result<Response, Refusal> {
    let capture = capture_id(&capture)?;
    let layer = service.runtime.captured_layer(capture);
    let subvolume = layer.parent().filter(|dir| dir.is_dir()).ok_or_else(|| {
        let message = format!("this runner holds no capture {capture}");
        refuse(404, FailureKind::Other, message)
    })?;
    let what = format!("capture {capture} to the control plane");
    let stream = cove_engine::send_subvolume(subvolume, what, ()).map_err(|why| {
        refuse(
            500,
            FailureKind::Other,
            format!("sending capture {capture}: {why}"),
        )
    })?;
    let headers = [(header::CONTENT_TYPE, "application/octet-stream")];
    Ok((headers, axum::body::Body::from_stream(stream)).into_response())
}

/// Deletes this runner's copy of captured layer `capture`, fetched for a
/// snapshot the control plane deleted (which it refuses while any sandbox
/// uses it). A layer this runner does not hold is no error.
async fn discard_layer(
    State(service): State<Arc<Service>>,
    Path(capture): Path<String>,
) -> Result<StatusCode, Refusal> {
    let capture = capture_id(&capture)?;
    let layer = service.runtime.captured_layer(capture);
    // After a fetch of it that is on, so what that fetch puts in place goes too.
    let _held = pass(&service.fetches, layer.clone()).await;
    if layer.parent().is_some_and(std::path::Path::exists) {
        service.runtime.discard_capture(capture).await?;
        tracing::info!(
            capture,
            "deleted a captured layer whose snapshot was deleted"
        );
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn prepare(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
    Json(spec): Json<RemoteSpec>,
) -> Result<StatusCode, Refusal> {
    let spec = spec_of(&service, sandbox(&id)?, spec).await?;
    service.runtime.prepare(&spec).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn start(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
    Json(spec): Json<RemoteSpec>,
) -> Result<Json<RemoteStarted>, Refusal> {
    let sandbox = sandbox(&id)?;
    let settings = spec.network.clone();
    let mut spec = spec_of(&service, sandbox.clone(), spec).await?;
    let _held = service.enter(&id).await;
    // A retried start must not take a running sandbox off its network.
    if service.runtime.is_running(&sandbox).await {
        return Err(RuntimeError::AlreadyRunning { id }.into());
    }
    spec.network = service.attach(&id, settings).await?;
    let started = match service.runtime.start(&spec).await {
        Ok(started) => started,
        Err(error) => {
            let _ = service.detach(&id).await;
            return Err(error.into());
        }
    };
    let (tell, ended) = watch::channel(None);
    let exited = started.exited;
    let number = service.starts.fetch_add(1, Ordering::Relaxed);
    let (watcher, ending) = (service.clone(), id.clone());
    tokio::spawn(async move {
        let why = exited
            .await
            .unwrap_or_else(|_| "the runner's runtime dropped it".into());
        let _ = tell.send(Some(why));
        watcher.ended_by_itself(&ending, number).await;
    });
    let run = Run {
        number,
        agent: started.agent,
        ended,
    };
    service.runs.lock().unwrap().insert(id, run);
    Ok(Json(RemoteStarted {
        accelerator: started.accelerator.map(str::to_owned),
    }))
}

/// Answers once the sandbox's current start has ended, with why; at once
/// when it ended already, and 409 (not running) when it was never started
/// by this process.
async fn exit(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
) -> Result<Json<RemoteExit>, Refusal> {
    let run = service.runs.lock().unwrap().get(&id).cloned();
    let Some(mut run) = run else {
        return Err(RuntimeError::NotRunning { id }.into());
    };
    let ended = run
        .ended
        .wait_for(Option::is_some)
        .await
        .map(|why| why.clone().unwrap_or_default())
        .unwrap_or_else(|_| "the runner's runtime dropped it".into());
    Ok(Json(RemoteExit { reason: ended }))
}

async fn stop(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
) -> Result<StatusCode, Refusal> {
    let sandbox = sandbox(&id)?;
    let _held = service.enter(&id).await;
    service.runs.lock().unwrap().remove(&id);
    service.runtime.stop(&sandbox).await?;
    service.detach(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn destroy(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
) -> Result<StatusCode, Refusal> {
    let sandbox = sandbox(&id)?;
    let _held = service.enter(&id).await;
    service.runs.lock().unwrap().remove(&id);
    service.runtime.destroy(&sandbox).await?;
    if let Some(network) = &service.network {
        network
            .release(&id)
            .await
            .map_err(|error| network_failure(&id, "release its network address", &error))?;
    }
    service.gates.lock().unwrap().remove(&id);
    Ok(StatusCode::NO_CONTENT)
}

/// This runner's archive, or the refusal of a runner that keeps none.
fn archive_of(service: &Service) -> Result<&cove_engine::Archive, Refusal> {
    service.archive.as_ref().ok_or_else(|| {
        refuse(
            501,
            FailureKind::Unsupported,
            "archiving on a runner without an archive (cove runner --archive)",
        )
    })
}

/// A move to or from the archive that failed, said as the wire says it.
fn move_failure(id: &str, error: cove_engine::MoveError) -> Refusal {
    let error = match error {
        cove_engine::MoveError::Runtime(error) => return error.into(),
        cove_engine::MoveError::Archive(error) => error,
    };
    let message = format!("sandbox {id}: {}", cove_engine::describe(&error));
    // An object that is not there will not be there on a retry.
    match error.is_missing() {
        true => refuse(500, FailureKind::Other, message),
        false => refuse(503, FailureKind::Busy, message),
    }
}

/// Sends a stopped sandbox's storage to the archive. Its copy here stays
/// until the control plane deletes it, once the archive holds it.
async fn archive(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
) -> Result<Json<RemoteArchived>, Refusal> {
    let sandbox = sandbox(&id)?;
    let archive = archive_of(&service)?;
    let _held = service.enter(&id).await;
    let bytes = (archive.send(service.runtime.as_ref(), &sandbox).await)
        .map_err(|error| move_failure(&id, error))?;
    tracing::info!(sandbox = %id, bytes, to = archive.location(), "archived");
    Ok(Json(RemoteArchived { bytes }))
}

/// Fetches a sandbox's storage from the archive, ready to start here. The
/// archive's copy stays: the control plane removes it once it is back.
async fn unarchive(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
    Json(spec): Json<RemoteSpec>,
) -> Result<StatusCode, Refusal> {
    let spec = spec_of(&service, sandbox(&id)?, spec).await?;
    let archive = archive_of(&service)?;
    let _held = service.enter(&id).await;
    (archive.fetch(service.runtime.as_ref(), &spec).await)
        .map_err(|error| move_failure(&id, error))?;
    tracing::info!(sandbox = %id, from = archive.location(), "unarchived");
    Ok(StatusCode::NO_CONTENT)
}

/// Applies the sandbox's new egress policy at once if it runs (its next
/// start carries it anyway). A runner without a network takes only the
/// default.
async fn set_network(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
    Json(settings): Json<NetworkSettings>,
) -> Result<StatusCode, Refusal> {
    sandbox(&id)?;
    let policy = policy_of(&settings)?;
    let Some(network) = &service.network else {
        if settings == NetworkSettings::default() {
            return Ok(StatusCode::NO_CONTENT);
        }
        return Err(no_network());
    };
    if service.live_run(&id).is_some() {
        network
            .set_policy(&id, &policy)
            .await
            .map_err(|error| network_failure(&id, "apply the policy", &error))?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Whether the sandbox runs from a start of this process, whose agent it
/// can reach (what a runner before it left is stopped at its start).
async fn running(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
) -> Result<Json<RemoteState>, Refusal> {
    let sandbox = sandbox(&id)?;
    let started_here = service.live_run(&id).is_some();
    Ok(Json(RemoteState {
        running: started_here && service.runtime.is_running(&sandbox).await,
    }))
}

/// Switches the connection to a byte stream to the sandbox's agent.
async fn agent(
    State(service): State<Arc<Service>>,
    Path(id): Path<String>,
    mut request: Request,
) -> Result<Response, Refusal> {
    let wants = request.headers().get(header::UPGRADE).is_some_and(|p| {
        p.as_bytes()
            .eq_ignore_ascii_case(cove_agent_client::RUNNER_TUNNEL_PROTOCOL.as_bytes())
    });
    if !wants {
        return Err(refuse(
            400,
            FailureKind::Other,
            format!(
                "ask with Upgrade: {}",
                cove_agent_client::RUNNER_TUNNEL_PROTOCOL
            ),
        ));
    }
    let Some(run) = service.live_run(&id) else {
        return Err(RuntimeError::NotRunning { id }.into());
    };
    let AgentEndpoint::Unix(socket) = run.agent else {
        return Err(refuse(
            500,
            FailureKind::Other,
            "the agent is not on this machine",
        ));
    };
    let mut agent = tokio::net::UnixStream::connect(&socket)
        .await
        .map_err(|e| {
            refuse(
                502,
                FailureKind::Other,
                format!("the agent of {id} did not answer: {e}"),
            )
        })?;
    let upgrade = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        match upgrade.await {
            Ok(upgraded) => {
                let mut upgraded = hyper_util::rt::TokioIo::new(upgraded);
                let _ = tokio::io::copy_bidirectional(&mut upgraded, &mut agent).await;
            }
            Err(error) => tracing::debug!(sandbox = %id, %error, "agent tunnel not upgraded"),
        }
    });
    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(
        header::UPGRADE,
        HeaderValue::from_static(cove_agent_client::RUNNER_TUNNEL_PROTOCOL),
    );
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::through_a_link;

    /// Attack: a control plane names an image through a link an image the
    /// runner holds has (to `/`); the runner would look outside its images.
    #[test]
    fn an_image_path_through_a_link_is_caught() {
        let images = tempfile::tempdir().unwrap();
        let rootfs = images.path().join("debian/rootfs");
        std::fs::create_dir_all(rootfs.join("etc")).unwrap();
        std::os::unix::fs::symlink("/", rootfs.join("escape")).unwrap();
        assert!(through_a_link(images.path(), "debian/rootfs/escape/etc"));
        assert!(through_a_link(images.path(), "debian/rootfs/escape"));
        assert!(!through_a_link(images.path(), "debian/rootfs"));
        assert!(!through_a_link(images.path(), "debian/rootfs/etc"));
        assert!(!through_a_link(images.path(), "other/rootfs"));
    }
}
