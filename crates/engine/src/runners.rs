//! Runners: the machines sandboxes run on, and where a new sandbox goes.
//!
//! A one-machine server is a control plane and one runner in one process:
//! its runner is registered at start (`register_local`), reports its host
//! every few seconds (`run_check_ins`), and is where every sandbox goes
//! unless the operator drained it or took it out of scheduling. Placement
//! ([`choose`]) is written for many runners: it passes over those that
//! cannot take the sandbox, saying why, and picks the one with the most
//! room among the rest.
//!
//! A runner on another machine is registered by the operator ([`Runners::create`],
//! which answers its token once), and reports itself with that token
//! ([`Runners::report`]). It is listed, switched and deleted like the
//! server's own, and shown unresponsive when it falls silent; this server
//! does not place sandboxes on it yet (placement names it and says so).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cove_lifecycle::{SandboxClass, SandboxState};
use cove_store::{RunnerRecord, RunnerReport, RunnerSwitches, RunnerUsage};

use crate::access::{hash_secret, random_token};
use crate::checks::check_word;
use crate::quota::Usage;
use crate::shared::Shared;
use crate::{now_ms, EngineError};

/// How often the server's own runner reports its host.
pub const CHECK_IN_EVERY: Duration = Duration::from_secs(5);

/// How long a runner may be silent by default before it is unresponsive:
/// shown so, and given no new sandbox (`EngineConfig::runner_silence`).
pub const RUNNER_SILENCE: Duration = Duration::from_secs(30);

/// What every runner token starts with: it tells a runner's token from an
/// API key at a glance (in a log, in a leak report) and before any lookup.
pub const RUNNER_TOKEN_PREFIX: &str = "cove_runner_";

/// Random characters after the prefix: 40 of 36 symbols, about 206 bits.
const RUNNER_TOKEN_LEN: usize = 40;

/// The most tags a runner carries.
const MAX_TAGS: usize = 16;

/// A runner on another machine, as the operator registers it.
#[derive(Clone, Debug, Default)]
pub struct NewRunner {
    pub name: String,
    pub region: String,
    pub tags: Vec<String>,
}

/// Who the server's own runner is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunnerIdentity {
    /// Stable across restarts of the same data directory.
    pub id: String,
    /// The host's name, for people.
    pub name: String,
}

impl Default for RunnerIdentity {
    fn default() -> Self {
        RunnerIdentity {
            id: "local".into(),
            name: host_name(),
        }
    }
}

/// The host's name (the kernel's); `localhost` when it has none.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Whether a runner takes work, as Daytona names its states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunnerState {
    /// Registered, not reported yet.
    Initializing,
    Ready,
    /// Silent for longer than it should be.
    Unresponsive,
}

impl RunnerState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Initializing => "initializing",
            Self::Ready => "ready",
            Self::Unresponsive => "unresponsive",
        }
    }
}

/// A runner with what is allocated on it now.
#[derive(Clone, Debug)]
pub struct RunnerView {
    pub record: RunnerRecord,
    pub state: RunnerState,
    /// Its sandboxes: running ones' CPU and memory, every one's disk but
    /// an archived one's (as quotas count them).
    pub allocated: Usage,
    /// Sandboxes whose storage it holds, in any state.
    pub sandboxes: i64,
    /// Snapshots it can start sandboxes from.
    pub snapshots: i64,
}

impl RunnerView {
    /// The share of its CPU and memory still unallocated (the smaller of
    /// the two), 0 to 100: Daytona's `availabilityScore`, and what
    /// placement prefers more of.
    pub fn availability(&self) -> f64 {
        (room(&self.record, self.allocated, 0, 0) * 100.0).clamp(0.0, 100.0)
    }
}

/// What would be left of `runner`'s CPU and memory, as a share (the smaller
/// of the two; below 0 when overcommitted), with `allocated` and `cpu`
/// vCPUs and `memory_gib` more taken.
fn room(runner: &RunnerRecord, allocated: Usage, cpu: i64, memory_gib: i64) -> f64 {
    let left = |capacity: i64, used: i64, wanted: i64| {
        1.0 - (used + wanted) as f64 / capacity.max(1) as f64
    };
    left(runner.cpu, allocated.cpu, cpu).min(left(
        runner.memory_gib,
        allocated.memory_gib,
        memory_gib,
    ))
}

/// What a runner elsewhere says of its service in a report: cove's fields
/// of the healthcheck. No `Debug`: the key is a secret.
#[derive(Clone, Copy, Default)]
pub struct ServiceReport<'a> {
    /// The key its service takes (`serviceKey`); `None`: it serves nothing.
    pub key: Option<&'a str>,
    /// Whether it gives its sandboxes a network of its own.
    pub networked: bool,
    /// The archive it moves stopped sandboxes to and from (`--archive`).
    pub archive: Option<&'a str>,
}

/// What a new sandbox needs of a runner.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Need<'a> {
    pub(crate) class: SandboxClass,
    pub(crate) region: &'a str,
    pub(crate) cpu: i64,
    pub(crate) memory_gib: i64,
    /// What the sandbox has that only this server's own runner gives yet
    /// (a link, volumes, a captured snapshot), named; `None`: any runner
    /// will do.
    pub(crate) here_only: Option<&'static str>,
    /// Its storage is in this server's archive: a runner elsewhere must
    /// share that archive to take it.
    pub(crate) archived: bool,
}

impl Need<'static> {
    /// What `sandbox` needs, in the server's one region.
    pub(crate) fn of(sandbox: &cove_store::SandboxRecord) -> Need<'static> {
        let here_only = if sandbox.linked_sandbox_id.is_some() {
            Some("a link to another sandbox")
        } else if !sandbox.volumes.is_empty() {
            Some("volumes")
        } else {
            None
        };
        Need {
            class: sandbox.class,
            region: crate::quota::REGION_ID,
            cpu: sandbox.cpu,
            memory_gib: crate::quota::memory_gib(sandbox),
            here_only,
            archived: false,
        }
    }
}

impl Need<'static> {
    /// What `sandbox` needs to come back from the archive.
    pub(crate) fn archived(sandbox: &cove_store::SandboxRecord) -> Need<'static> {
        Need {
            archived: true,
            ..Need::of(sandbox)
        }
    }
}

/// What placement reads: the runners as last recorded, and what each holds
/// (counted from the rows at every check-in, and counted up at every
/// placement in between, so a burst of creates spreads).
pub(crate) struct Placement {
    runners: Vec<RunnerRecord>,
    load: HashMap<String, Usage>,
}

impl Placement {
    /// The server's own runner alone, until it is registered.
    pub(crate) fn of_local(
        identity: &RunnerIdentity,
        runtimes: &HashMap<SandboxClass, Arc<dyn cove_runtime::Runtime>>,
    ) -> Placement {
        let unmeasured = Host {
            cpu: 1,
            memory_gib: 1,
            disk_gib: 1,
            usage: RunnerUsage::default(),
        };
        let runtimes = runtimes.iter().map(|(class, runtime)| (*class, runtime));
        Placement {
            runners: vec![local_record(identity, runtimes, &unmeasured, None)],
            load: HashMap::new(),
        }
    }
}

/// The server's own runner: `identity` on `host`, running the classes of
/// `runtimes` (sorted), reported at `at_ms` (`None`: not yet).
fn local_record<'a>(
    identity: &RunnerIdentity,
    runtimes: impl Iterator<Item = (SandboxClass, &'a Arc<dyn cove_runtime::Runtime>)>,
    host: &Host,
    at_ms: Option<i64>,
) -> RunnerRecord {
    let mut classes = Vec::new();
    let mut accelerator = None;
    for (class, runtime) in runtimes {
        classes.push(class.as_str().to_owned());
        if class == SandboxClass::LinuxVm {
            accelerator = runtime.accelerator().map(|(name, _)| name.to_owned());
        }
    }
    classes.sort_unstable();
    RunnerRecord {
        id: identity.id.clone(),
        name: identity.name.clone(),
        region: crate::quota::REGION_ID.into(),
        classes,
        accelerator,
        cpu: host.cpu,
        memory_gib: host.memory_gib,
        disk_gib: host.disk_gib,
        app_version: env!("CARGO_PKG_VERSION").into(),
        unschedulable: false,
        draining: false,
        usage: host.usage,
        created_at_ms: at_ms.unwrap_or(0),
        updated_at_ms: at_ms.unwrap_or(0),
        last_checked_ms: at_ms,
        tags: Vec::new(),
        api_url: None,
        proxy_url: None,
    }
}

impl Shared {
    /// Keeps `record` as placement's view of its runner.
    fn set_runner(&self, record: RunnerRecord) {
        let mut placement = self.placement.write().unwrap();
        match placement.runners.iter_mut().find(|r| r.id == record.id) {
            Some(known) => *known = record,
            None => placement.runners.push(record),
        }
    }

    /// How runners' states are judged now.
    fn judge(&self) -> Judge<'_> {
        Judge {
            local: &self.config.runner.id,
            now_ms: now_ms(),
            silence_ms: self.config.runner_silence.as_millis() as i64,
        }
    }

    /// Drives runner `record` through `service` from now on (a new one
    /// replaces the old: the runner restarted or moved), or, with `None`,
    /// no longer.
    fn serve_through(
        &self,
        record: &RunnerRecord,
        service: Option<crate::remote::Service>,
        serves: &ServiceReport<'_>,
    ) {
        let mut remotes = self.remotes.write().unwrap();
        match (service, remotes.get(&record.id)) {
            (None, _) => {
                if let Some(gone) = remotes.remove(&record.id) {
                    gone.0.retire();
                }
            }
            (Some(service), Some(known)) => {
                known.0.set_service(service);
                // It reports: it is not silent, whatever the last check-in judged.
                known.0.set_silent(false);
                known.0.set_networked(serves.networked);
                known.0.set_archive(serves.archive);
            }
            (Some(service), None) => {
                let images = (self.config.images.as_ref())
                    .map_or_else(PathBuf::new, |images| images.dir().to_owned());
                let layers = self.runtime(SandboxClass::Container).ok().cloned();
                let runtime =
                    crate::remote::RemoteRuntime::new(&record.name, service, images, layers);
                runtime.set_networked(serves.networked);
                runtime.set_archive(serves.archive);
                tracing::info!(runner = %record.id, name = %record.name, "driving the runner at its service");
                remotes.insert(record.id.clone(), crate::remote::Remote(Arc::new(runtime)));
                // Nobody listens in an engine that runs no recoveries.
                let _ = self.arrivals.send(record.id.clone());
            }
        }
    }

    /// Tells each runner elsewhere that this server drives whether it has
    /// fallen silent: the watches of a silent one's sandboxes end when it
    /// cannot be reached, so they show `error` rather than `started`.
    fn judge_silence(&self) {
        let judge = self.judge();
        let placement = self.placement.read().unwrap();
        for (id, remote) in self.remotes.read().unwrap().iter() {
            let silent = (placement.runners.iter().find(|r| &r.id == id))
                .is_some_and(|r| judge.state(r) == RunnerState::Unresponsive);
            remote.0.set_silent(silent);
        }
    }

    /// Forgets runner `id` (deleted).
    fn forget_runner(&self, id: &str) {
        self.remotes.write().unwrap().remove(id);
        let mut placement = self.placement.write().unwrap();
        placement.runners.retain(|r| r.id != id);
        placement.load.remove(id);
    }

    /// The runner a new sandbox needing `need` goes to (see [`choose`]);
    /// `only` limits the choice to one runner (a fork's, which is its
    /// parent's). What it takes is counted on the runner at once.
    pub(crate) fn place(&self, need: Need<'_>, only: Option<&str>) -> Result<String, EngineError> {
        self.pick(need, &|r| only.is_none_or(|only| r.id == only), true)
    }

    /// Whether runner `id` is draining, as placement last saw it.
    pub(crate) fn is_draining(&self, id: &str) -> bool {
        let placement = self.placement.read().unwrap();
        placement.runners.iter().any(|r| r.id == id && r.draining)
    }

    /// Whether a runner other than `except` could take a sandbox needing
    /// `need` now; nothing is counted.
    pub(crate) fn could_place_elsewhere(&self, need: Need<'_>, except: &str) -> bool {
        self.pick(need, &|r| r.id != except, false).is_ok()
    }

    /// The runner, of those `admits`, a sandbox needing `need` goes to;
    /// with `count`, what it takes is counted on it at once.
    fn pick(
        &self,
        need: Need<'_>,
        admits: &dyn Fn(&RunnerRecord) -> bool,
        count: bool,
    ) -> Result<String, EngineError> {
        let mut placement = self.placement.write().unwrap();
        let Placement { runners, load } = &mut *placement;
        let candidates = runners
            .iter()
            .filter(|r| admits(r))
            .map(|r| (r, load.get(&r.id).copied().unwrap_or_default()));
        // This process's runtimes, and those of runners elsewhere that
        // said where they serve.
        let judge = self.judge();
        let remotes = self.remotes.read().unwrap();
        let networked_here = self.network().is_some();
        // Sandboxes move between machines only through a shared archive.
        let shared_archive = (self.config.archive.as_ref())
            .filter(|archive| archive.is_shared())
            .map(crate::Archive::location);
        let drives = |runner: &RunnerRecord| match runner.id == judge.local {
            true => Ok(()),
            false => drives_elsewhere(
                remotes.get(&runner.id).map(|remote| &*remote.0),
                &need,
                networked_here,
                shared_archive,
            ),
        };
        let chosen = choose(candidates, need, judge, &drives)?.id.clone();
        if !count {
            return Ok(chosen);
        }
        let usage = load.entry(chosen.clone()).or_default();
        usage.running += 1;
        usage.cpu += need.cpu;
        usage.memory_gib += need.memory_gib;
        Ok(chosen)
    }
}

/// Whether this server places a sandbox needing `need` on a runner
/// elsewhere, driven through `remote` (`None`: it has not said where it
/// serves), or why not. `networked_here`: this server's sandboxes have a
/// network; `shared_archive`: this server's archive, when other machines
/// reach it.
fn drives_elsewhere(
    remote: Option<&crate::remote::RemoteRuntime>,
    need: &Need<'_>,
    networked_here: bool,
    shared_archive: Option<&str>,
) -> Result<(), String> {
    let Some(remote) = remote else {
        return Err("runs on another machine and has not said where it serves \
             (cove runner --listen) since this server started"
            .to_owned());
    };
    if networked_here && !remote.networked() {
        Err(
            "runs on another machine without a sandbox network (cove runner \
             --no-network), and this server's sandboxes have one"
                .to_owned(),
        )
    } else if let Some(what) = need.here_only {
        Err(format!(
            "runs on another machine, where sandboxes cannot have {what} yet"
        ))
    } else if need.archived && !shared_archive.is_some_and(|at| remote.shares_archive(at)) {
        Err(match shared_archive {
            Some(at) => format!(
                "runs on another machine and does not keep its archive at {at} \
                 (cove runner --archive), where this sandbox is"
            ),
            None => "runs on another machine, and this server's archive is a \
                     directory of its own (serve --archive s3://... is shared)"
                .to_owned(),
        })
    } else {
        Ok(())
    }
}

/// How many images are sent to one runner at once, and to all of them.
const IMAGE_SENDS_PER_RUNNER: usize = 2;
const IMAGE_SENDS: usize = 8;

/// The images being sent to runners: a send waits for a place among
/// [`IMAGE_SENDS_PER_RUNNER`] for its runner and [`IMAGE_SENDS`] in all,
/// so no runner holds every thread that sends, however many it asks for.
pub(crate) struct ImageSends {
    all: Arc<tokio::sync::Semaphore>,
    per_runner: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
}

impl Default for ImageSends {
    fn default() -> ImageSends {
        ImageSends {
            all: Arc::new(tokio::sync::Semaphore::new(IMAGE_SENDS)),
            per_runner: std::sync::Mutex::default(),
        }
    }
}

impl ImageSends {
    /// Waits for a place for a send to runner `id`: its runner's first,
    /// so a runner waiting on its own sends takes no place of the others.
    async fn take(&self, id: &str) -> [tokio::sync::OwnedSemaphorePermit; 2] {
        let own = {
            let mut per_runner = self.per_runner.lock().unwrap();
            per_runner
                .entry(id.to_owned())
                .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(IMAGE_SENDS_PER_RUNNER)))
                .clone()
        };
        let own = own.acquire_owned().await.expect("never closed");
        let all = self
            .all
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
        [own, all]
    }
}

/// An image's root filesystem as a tar, as it is written
/// ([`Runners::image_tar`]).
pub type ImageTar =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send>>;

/// What `body` yields, then an error if `sent` (the sender's end) says it
/// failed: an HTTP answer of it is then cut off rather than ended cleanly,
/// so a runner never takes part of a transfer for the whole.
fn then_failure(
    body: impl tokio::io::AsyncRead + Send + 'static,
    sent: impl std::future::Future<Output = Result<(), String>> + Send + 'static,
    what: String,
) -> ImageTar {
    use futures_util::StreamExt as _;
    let ended = futures_util::stream::once(async move {
        let failure = sent.await.err()?;
        tracing::warn!(error = %failure, "sending {what} failed");
        Some(Err(std::io::Error::other(failure)))
    })
    .filter_map(std::future::ready);
    Box::pin(tokio_util::io::ReaderStream::new(body).chain(ended))
}

/// The read-only subvolume at `subvolume` as a `btrfs send` stream
/// (`Storage::send_command`), written as it is read, holding `held` until
/// the sender ends. A send that fails ends the stream with an error, so its
/// HTTP answer is cut off, never ended cleanly; a reader that goes away ends
/// the send. `what` names the transfer in its failure's log.
pub fn send_subvolume(
    subvolume: &Path,
    what: String,
    held: impl Send + 'static,
) -> Result<ImageTar, String> {
    let command =
        cove_runtime::storage::Storage::send_command(subvolume).map_err(|e| e.to_string())?;
    let child = tokio::process::Command::from(command)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| e.to_string())?;
    let (stdout, sent) = output_of(child, "btrfs send");
    let sent = async move {
        let sent = sent.await;
        drop(held);
        sent
    };
    Ok(then_failure(stdout, sent, what))
}

/// The most of a sending program's stderr kept for its error.
const STDERR_KEPT: usize = 4096;

/// The standard output of `child` (its stdout and stderr piped), and
/// whether it then exited well: with an error naming `program` and the end
/// of its stderr when not. Its stderr is read from now on, beside whoever
/// reads its stdout: a program that says much there never blocks with its
/// stdout unread (a pipe holds 64 KiB), and only the last
/// [`STDERR_KEPT`] bytes are held.
fn output_of(
    mut child: tokio::process::Child,
    program: &'static str,
) -> (
    tokio::process::ChildStdout,
    impl std::future::Future<Output = Result<(), String>> + Send + 'static,
) {
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let said = tokio::spawn(async move {
        use tokio::io::AsyncReadExt as _;
        let mut kept = std::collections::VecDeque::new();
        let mut buffer = [0; 4096];
        while let Ok(n @ 1..) = stderr.read(&mut buffer).await {
            kept.extend(&buffer[..n]);
            let excess = kept.len().saturating_sub(STDERR_KEPT);
            kept.drain(..excess);
        }
        String::from_utf8_lossy(kept.make_contiguous())
            .trim()
            .to_owned()
    });
    // The child is killed if this is dropped unfinished (kill_on_drop),
    // which ends the stderr reader too.
    let exited = async move {
        let status = child.wait().await.map_err(|e| e.to_string())?;
        let said = said.await.unwrap_or_default();
        match status.success() {
            true => Ok(()),
            false => Err(format!("{program} {status}: {said}")),
        }
    };
    (stdout, exited)
}

/// Runners as the engine sees them: the operator's view and switches, and
/// the check-ins of the server's own runner.
#[derive(Clone)]
pub struct Runners {
    shared: Arc<Shared>,
}

impl Runners {
    pub(crate) fn new(shared: Arc<Shared>) -> Runners {
        Runners { shared }
    }

    /// The server's own runner's id.
    pub fn local_id(&self) -> &str {
        &self.shared.config.runner.id
    }

    /// Records the server's own runner as it starts (keeping the switches
    /// the operator set before a restart) and gives it the sandboxes from
    /// before runners. Called once at start-up, before any create.
    pub(crate) async fn register_local(&self) -> Result<(), EngineError> {
        let host = self.measure();
        let local = local_record(
            &self.shared.config.runner,
            self.shared.runtimes(),
            &host,
            Some(now_ms()),
        );
        let record = self.shared.store.register_runner(&local).await?;
        let claimed = self
            .shared
            .store
            .claim_unplaced_sandboxes(&record.id)
            .await?;
        if claimed > 0 {
            tracing::info!(claimed, runner = %record.id, "sandboxes from before runners placed on this runner");
        }
        tracing::info!(runner = %record.id, name = %record.name, draining = record.draining,
            unschedulable = record.unschedulable, "runner registered");
        self.shared.set_runner(record);
        Ok(())
    }

    /// Reports the server's own runner's host every [`CHECK_IN_EVERY`],
    /// until the process ends.
    pub async fn run_check_ins(&self) {
        let mut tick = tokio::time::interval(CHECK_IN_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(error) = self.check_in().await {
                tracing::warn!(error = %crate::describe(&error), "runner check-in");
            }
        }
    }

    /// One report of the server's own runner's host.
    pub async fn check_in(&self) -> Result<(), EngineError> {
        let usage = self.measure().usage;
        let now = now_ms();
        let id = self.local_id();
        if self.shared.store.runner_checked_in(id, usage, now).await? {
            if let Some(record) = self.shared.store.find_runner(id).await? {
                self.shared.set_runner(record);
            }
        }
        let sandboxes = self.shared.store.list_sandboxes().await?;
        let load = allocations(&sandboxes, id)
            .into_iter()
            .map(|(runner, (usage, _))| (runner, usage))
            .collect();
        self.shared.placement.write().unwrap().load = load;
        self.shared.judge_silence();
        Ok(())
    }

    /// Every runner, oldest first, in the region `region` if one is named.
    pub async fn list(&self, region: Option<&str>) -> Result<Vec<RunnerView>, EngineError> {
        let records = self.shared.store.list_runners().await?;
        let views = self.views(records).await?;
        Ok(views
            .into_iter()
            .filter(|view| region.is_none_or(|region| view.record.region == region))
            .collect())
    }

    pub async fn get(&self, id: &str) -> Result<RunnerView, EngineError> {
        let record = self
            .shared
            .store
            .find_runner(id)
            .await?
            .ok_or_else(|| EngineError::RunnerNotFound { id: id.to_owned() })?;
        let mut views = self.views(vec![record]).await?;
        Ok(views.remove(0))
    }

    /// The runner holding sandbox `sandbox` (by id or name, of any
    /// organization: the operator asks).
    pub async fn of_sandbox(&self, sandbox: &str) -> Result<RunnerView, EngineError> {
        let record = self
            .shared
            .store
            .find_sandbox(None, sandbox)
            .await?
            .ok_or_else(|| EngineError::SandboxNotFound {
                id: sandbox.to_owned(),
            })?;
        if record.state == SandboxState::Archived {
            return Err(EngineError::OnNoRunner { id: record.id });
        }
        let id = record
            .runner_id
            .unwrap_or_else(|| self.local_id().to_owned());
        self.get(&id).await
    }

    /// Sets the operator's switches of runner `id`: while it is draining or
    /// unschedulable, no new sandbox goes to it.
    pub async fn switch(
        &self,
        id: &str,
        switches: RunnerSwitches,
    ) -> Result<RunnerView, EngineError> {
        let record = self
            .shared
            .store
            .switch_runner(id, switches, now_ms())
            .await?
            .ok_or_else(|| EngineError::RunnerNotFound { id: id.to_owned() })?;
        tracing::info!(runner = %record.id, draining = record.draining,
            unschedulable = record.unschedulable, "runner switched");
        self.shared.set_runner(record.clone());
        let mut views = self.views(vec![record]).await?;
        Ok(views.remove(0))
    }

    /// Registers a runner on another machine: a record, `initializing` until
    /// it first reports, and the token it reports with, answered here once
    /// and kept only as its hash.
    pub async fn create(&self, new: NewRunner) -> Result<(RunnerRecord, String), EngineError> {
        check_word("name", &new.name)?;
        if new.region != crate::quota::REGION_ID {
            return Err(EngineError::Invalid {
                field: "regionId",
                reason: format!(
                    "unknown region {:?}: this server's one region is {:?}",
                    new.region,
                    crate::quota::REGION_ID
                ),
            });
        }
        if new.tags.len() > MAX_TAGS {
            return Err(EngineError::Invalid {
                field: "tags",
                reason: format!(
                    "{} tags; a runner carries at most {MAX_TAGS}",
                    new.tags.len()
                ),
            });
        }
        for tag in &new.tags {
            check_word("tags", tag)?;
        }
        let store = &self.shared.store;
        if store
            .list_runners()
            .await?
            .iter()
            .any(|r| r.name == new.name)
        {
            return Err(EngineError::RunnerTaken { name: new.name });
        }
        let token = format!("{RUNNER_TOKEN_PREFIX}{}", random_token(RUNNER_TOKEN_LEN));
        let now = now_ms();
        let record = RunnerRecord {
            id: uuid::Uuid::new_v4().to_string(),
            name: new.name,
            region: new.region,
            classes: Vec::new(),
            accelerator: None,
            cpu: 0,
            memory_gib: 0,
            disk_gib: 0,
            app_version: String::new(),
            unschedulable: false,
            draining: false,
            usage: RunnerUsage::default(),
            created_at_ms: now,
            updated_at_ms: now,
            last_checked_ms: None,
            tags: new.tags,
            api_url: None,
            proxy_url: None,
        };
        if !store.create_runner(&record, &hash_secret(&token)).await? {
            return Err(EngineError::RunnerTaken { name: record.name });
        }
        tracing::info!(runner = %record.id, name = %record.name, "runner registered by the operator");
        self.shared.set_runner(record.clone());
        Ok((record, token))
    }

    /// The root filesystem runner `id` asks for by `image`, a path under
    /// this server's images directory as the runner was given it
    /// ([`crate::remote::RemoteSpec`]). Only the image of a sandbox placed
    /// on that runner is served, so a runner's token reaches no other
    /// organization's snapshots; any other path is
    /// [`EngineError::ImageNotServed`], whether or not it exists.
    pub async fn image_for(&self, id: &str, image: &str) -> Result<PathBuf, EngineError> {
        let not_served = || EngineError::ImageNotServed {
            image: image.to_owned(),
        };
        let relative = crate::remote::plain_image(image).ok_or_else(|| EngineError::Invalid {
            field: "image",
            reason: format!("{image:?} is not a plain path under the images directory"),
        })?;
        let images = self.shared.config.images.as_ref().ok_or_else(not_served)?;
        let wanted = images.dir().join(relative);
        let placed = self.snapshots_on_runner(id).await?;
        if placed.iter().any(|s| Path::new(&s.rootfs) == wanted) && wanted.is_dir() {
            return Ok(wanted);
        }
        Err(not_served())
    }

    /// The images of the sandboxes placed on runner `id` (and of the
    /// snapshots taken of them), as paths under this server's images
    /// directory: what that runner keeps of the images it fetched.
    pub async fn images_on(&self, id: &str) -> Result<Vec<String>, EngineError> {
        let Some(images) = self.shared.config.images.as_ref() else {
            return Ok(Vec::new());
        };
        let mut found = std::collections::BTreeSet::new();
        for snapshot in self.snapshots_on_runner(id).await? {
            let relative = Path::new(&snapshot.rootfs).strip_prefix(images.dir());
            found.extend(relative.ok().and_then(Path::to_str).map(str::to_owned));
        }
        Ok(found.into_iter().collect())
    }

    /// The snapshots the sandboxes placed on runner `id` start from, and
    /// those taken from them: what its token may fetch of them, and
    /// nothing else.
    async fn snapshots_on_runner(
        &self,
        id: &str,
    ) -> Result<Vec<cove_store::SnapshotRecord>, EngineError> {
        let store = &self.shared.store;
        let mut snapshots = Vec::new();
        let sandboxes = store.sandboxes_on_runner(id).await?;
        for sandbox in &sandboxes {
            let snapshot = store
                .find_snapshot(Some(&sandbox.organization_id), &sandbox.snapshot)
                .await?;
            snapshots.extend(snapshot);
        }
        // And those taken from them, which a revert there needs.
        let on_it: std::collections::HashSet<&str> = sandboxes
            .iter()
            .map(|sandbox| sandbox.id.as_str())
            .collect();
        let taken = store
            .list_snapshots()
            .await?
            .into_iter()
            .filter(|snapshot| {
                (snapshot.source_sandbox.as_deref()).is_some_and(|source| on_it.contains(source))
            });
        snapshots.extend(taken);
        Ok(snapshots)
    }

    /// [`Runners::image_for`], as the tar a runner unpacks
    /// (`cove_images::send_rootfs`), written as it is read. A failure while
    /// writing ends the stream with an error, so an HTTP answer of it is cut
    /// off rather than ended cleanly: a runner never takes a partial image
    /// for a whole one.
    pub async fn image_tar(&self, id: &str, image: &str) -> Result<ImageTar, EngineError> {
        let rootfs = self.image_for(id, image).await?;
        // Each send holds a blocking thread while its reader is slow: a
        // runner gets two at a time, and all runners together a few.
        let permits = self.shared.image_sends.take(id).await;
        tracing::info!(runner = %id, image, "sending an image to a runner");
        let (reader, writer) = tokio::io::duplex(256 << 10);
        let writer = tokio_util::io::SyncIoBridge::new(writer);
        let sending = tokio::task::spawn_blocking(move || {
            let sent = cove_images::send_rootfs(&rootfs, writer);
            drop(permits);
            sent
        });
        let sent = async move {
            match sending.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(error)) => Err(crate::error::describe(&error)),
                Err(error) => Err(error.to_string()),
            }
        };
        Ok(then_failure(
            reader,
            sent,
            format!("image {image} to runner {id}"),
        ))
    }

    /// The subvolume of captured layer `capture` (a capture id), if a
    /// sandbox placed on runner `id` is of a snapshot that has it, or a
    /// snapshot taken from such a sandbox has it (a revert there); any
    /// other is [`EngineError::LayerNotServed`], whether or not it exists.
    pub async fn layer_for(&self, id: &str, capture: &str) -> Result<PathBuf, EngineError> {
        if !crate::remote::plain_capture(capture) {
            return Err(EngineError::Invalid {
                field: "capture",
                reason: format!("{capture:?} is not a capture id"),
            });
        }
        for snapshot in self.snapshots_on_runner(id).await? {
            let layer = (snapshot.layers.iter().map(Path::new))
                .find(|layer| crate::remote::capture_of_layer(layer) == Some(capture));
            if let Some(subvolume) = layer.and_then(Path::parent).filter(|s| s.is_dir()) {
                return Ok(subvolume.to_owned());
            }
        }
        Err(EngineError::LayerNotServed {
            capture: capture.to_owned(),
        })
    }

    /// The capture ids of every captured layer a sandbox placed on runner
    /// `id` starts from or was captured as: what that runner keeps of the
    /// layers it holds.
    pub async fn layers_on(&self, id: &str) -> Result<Vec<String>, EngineError> {
        let mut captures = std::collections::BTreeSet::new();
        for snapshot in self.snapshots_on_runner(id).await? {
            let layers = snapshot.layers.iter().map(Path::new);
            captures.extend(
                layers
                    .filter_map(crate::remote::capture_of_layer)
                    .map(str::to_owned),
            );
        }
        Ok(captures.into_iter().collect())
    }

    /// [`Runners::layer_for`], as the `btrfs send` stream a runner receives
    /// (owners, modes, extended attributes and overlayfs whiteouts kept),
    /// written as it is read. A send that fails ends the stream with an
    /// error, so its HTTP answer is cut off, never ended cleanly; a reader
    /// that goes away ends the send.
    pub async fn layer_send(&self, id: &str, capture: &str) -> Result<ImageTar, EngineError> {
        let subvolume = self.layer_for(id, capture).await?;
        let permits = self.shared.image_sends.take(id).await;
        tracing::info!(runner = %id, capture, "sending a captured layer to a runner");
        let what = format!("captured layer {capture} to runner {id}");
        send_subvolume(&subvolume, what, permits).map_err(|reason| EngineError::LayerSend {
            capture: capture.to_owned(),
            reason,
        })
    }

    /// The runner `token` belongs to; `None` when it is no runner's.
    pub async fn authenticate(&self, token: &str) -> Result<Option<RunnerRecord>, EngineError> {
        if !token.starts_with(RUNNER_TOKEN_PREFIX) {
            return Ok(None);
        }
        Ok(self
            .shared
            .store
            .runner_by_token(&hash_secret(token))
            .await?)
    }

    /// Records what runner `id`, on another machine, reports of itself
    /// (every few seconds: nothing is counted here). With `service_key`,
    /// the runner serves sandboxes at its `apiUrl` to whoever presents that
    /// key: from now on this server drives it there. The key is kept in
    /// memory only; a runner that reports none is not driven.
    pub async fn report(
        &self,
        id: &str,
        report: RunnerReport,
        serves: ServiceReport<'_>,
    ) -> Result<(), EngineError> {
        check_report(&report)?;
        let service = match serves.key {
            Some(key) => Some(service_of(
                &report,
                key,
                self.shared.config.runner_tls.as_ref(),
            )?),
            None => None,
        };
        if let Some(archive) = serves.archive {
            check_archive(archive)?;
        }
        let record = self
            .shared
            .store
            .runner_reported(id, &report, now_ms())
            .await?
            .ok_or_else(|| EngineError::RunnerNotFound { id: id.to_owned() })?;
        self.shared.serve_through(&record, service, &serves);
        self.shared.set_runner(record);
        Ok(())
    }

    /// Deletes runner `id`, and with it its token. The server's own runner
    /// cannot go, nor can one that still holds sandboxes, unless `lost`:
    /// the operator says its machine is gone for good (it must have stopped
    /// reporting), and each sandbox it held shows `error` saying its files
    /// went with it, to be deleted (never started again from nothing).
    pub async fn delete(&self, id: &str, lost: bool) -> Result<(), EngineError> {
        if id == self.local_id() {
            return Err(EngineError::RunnerInUse {
                message: format!(
                    "runner {id} is this server's own and cannot be deleted; \
                     drain it to keep new sandboxes off it"
                ),
            });
        }
        let store = &self.shared.store;
        let record = store
            .find_runner(id)
            .await?
            .ok_or_else(|| EngineError::RunnerNotFound { id: id.to_owned() })?;
        if lost {
            return self.delete_lost(record).await;
        }
        if !store.delete_empty_runner(id).await? {
            let held = store.sandboxes_on_runner(id).await?.len();
            if held == 0 {
                return Err(EngineError::RunnerNotFound { id: id.to_owned() });
            }
            return Err(EngineError::RunnerInUse {
                message: format!(
                    "runner {} ({id}) holds {held} sandbox{}; drain it \
                     (PATCH /api/runners/{id}/draining) and delete or move them first",
                    record.name,
                    if held == 1 { "" } else { "es" }
                ),
            });
        }
        tracing::info!(runner = %id, name = %record.name, "runner deleted");
        self.shared.forget_runner(id);
        Ok(())
    }

    /// Deletes runner `record`, silent, with what it held.
    async fn delete_lost(&self, record: RunnerRecord) -> Result<(), EngineError> {
        let id = &record.id;
        if self.shared.judge().state(&record) == RunnerState::Ready {
            return Err(EngineError::RunnerInUse {
                message: format!(
                    "runner {} ({id}) still reports, so it is not lost; drain it \
                     (PATCH /api/runners/{id}/draining) and delete or move its sandboxes, \
                     or stop it first",
                    record.name
                ),
            });
        }
        let store = &self.shared.store;
        if !store.delete_runner(id).await? {
            return Err(EngineError::RunnerNotFound { id: id.clone() });
        }
        self.shared.forget_runner(id);
        // Each sandbox it held says so; one placed on it meanwhile finds it
        // lost at its next operation (`Sandboxes::apply`).
        let held = store.sandboxes_on_runner(id).await?;
        for sandbox in &held {
            let lock = self.shared.lock_for(&sandbox.id);
            let _guard = lock.lock().await;
            self.shared.forget_running(&sandbox.id, None);
            let Some(mut now) = store.find_sandbox(None, &sandbox.id).await? else {
                continue;
            };
            if now.runner_id.as_deref() != Some(id.as_str()) {
                continue;
            }
            now.state = SandboxState::Error;
            now.error_reason = Some(
                EngineError::RunnerLost {
                    id: now.id.clone(),
                    runner: format!("{} ({id})", record.name),
                }
                .to_string(),
            );
            self.shared.save_state(&mut now).await?;
        }
        tracing::warn!(runner = %id, name = %record.name, sandboxes = held.len(),
            "runner deleted as lost, with the sandboxes it held");
        Ok(())
    }

    /// `records` with what each holds, counted from the sandboxes' rows.
    async fn views(&self, records: Vec<RunnerRecord>) -> Result<Vec<RunnerView>, EngineError> {
        let sandboxes = self.shared.store.list_sandboxes().await?;
        let snapshots = self.shared.store.list_snapshots().await?.len() as i64;
        let judge = self.shared.judge();
        let mut held = allocations(&sandboxes, judge.local);
        Ok(records
            .into_iter()
            .map(|record| {
                let (allocated, sandboxes) = held.remove(&record.id).unwrap_or_default();
                let here = record.id == judge.local;
                RunnerView {
                    state: judge.state(&record),
                    allocated,
                    sandboxes,
                    // Snapshots are kept by this server, for its own runner.
                    snapshots: if here { snapshots } else { 0 },
                    record,
                }
            })
            .collect())
    }

    /// The server's own host, measured now.
    fn measure(&self) -> Host {
        let config = &self.shared.config;
        let disk_path = (config.volume_quota.as_ref())
            .map(|quota| quota.storage.root().to_owned())
            .or_else(|| config.data_dir.clone())
            .unwrap_or_else(|| "/".into());
        measure_host(&disk_path)
    }
}

/// This host's size and use, measured now (a few small reads of /proc and
/// one statvfs of `disk_path`, the filesystem sandboxes' storage is on).
pub fn measure_host(disk_path: &std::path::Path) -> Host {
    let cpu = std::thread::available_parallelism().map_or(1, |n| n.get() as i64);
    let (memory_total, memory_available) = memory_kib().unwrap_or((0, 0));
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    let disk = cove_runtime::storage::filesystem_usage(disk_path).ok();
    let disk_total = disk.map_or(0, |d| d.used + d.available);
    Host {
        cpu,
        memory_gib: (memory_total >> 20) as i64,
        disk_gib: (disk_total >> 30) as i64,
        usage: RunnerUsage {
            cpu: percent(load, cpu as f64),
            memory: percent(
                memory_total.saturating_sub(memory_available) as f64,
                memory_total as f64,
            ),
            disk: percent(disk.map_or(0, |d| d.used) as f64, disk_total as f64),
        },
    }
}

/// What a runner's host has, and how much of it is in use.
#[derive(Clone, Copy, Debug)]
pub struct Host {
    pub cpu: i64,
    pub memory_gib: i64,
    pub disk_gib: i64,
    pub usage: RunnerUsage,
}

/// Refuses a runner's report that cannot be true: an unknown or repeated
/// class, an accelerator without VMs, a negative size or share (a share of
/// CPU may pass 100: it is load over vCPUs), a version or URL that is not
/// one.
fn check_report(report: &RunnerReport) -> Result<(), EngineError> {
    let invalid = |field: &'static str, reason: String| EngineError::Invalid { field, reason };
    for (i, class) in report.classes.iter().enumerate() {
        if class.parse::<SandboxClass>().is_err() {
            return Err(invalid(
                "sandboxClasses",
                format!("unknown class {class:?}: cove runs container and linux-vm"),
            ));
        }
        if report.classes[..i].contains(class) {
            return Err(invalid(
                "sandboxClasses",
                format!("{class:?} is named twice"),
            ));
        }
    }
    if let Some(accelerator) = &report.accelerator {
        if !matches!(accelerator.as_str(), "kvm" | "tcg") {
            return Err(invalid(
                "accelerator",
                format!("{accelerator:?}: a VM runs under kvm or tcg"),
            ));
        }
        if !report.classes.iter().any(|c| c == "linux-vm") {
            return Err(invalid(
                "accelerator",
                "given for a runner that runs no linux-vm sandboxes".into(),
            ));
        }
    }
    for (field, size) in [
        ("metrics.cpu", report.cpu),
        ("metrics.memoryGiB", report.memory_gib),
        ("metrics.diskGiB", report.disk_gib),
    ] {
        if size < 0 {
            return Err(invalid(field, format!("{size} is below 0")));
        }
    }
    let usage = report.usage;
    for (field, share) in [
        ("metrics.currentCpuUsagePercentage", usage.cpu),
        ("metrics.currentMemoryUsagePercentage", usage.memory),
        ("metrics.currentDiskUsagePercentage", usage.disk),
    ] {
        if !(share.is_finite() && share >= 0.0) {
            return Err(invalid(field, format!("{share} is not a share in percent")));
        }
    }
    let version = &report.app_version;
    if version.is_empty() || version.len() > 64 || !version.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(
            "appVersion",
            format!("{version:?}: give 1 to 64 printable characters"),
        ));
    }
    for (field, url) in [("apiUrl", &report.api_url), ("proxyUrl", &report.proxy_url)] {
        let Some(url) = url else { continue };
        let fits = url.len() <= 2048
            && (url.starts_with("http://") || url.starts_with("https://"))
            && url.bytes().all(|b| b.is_ascii_graphic());
        if !fits {
            return Err(invalid(
                field,
                format!("{url:?}: give an http:// or https:// URL"),
            ));
        }
    }
    Ok(())
}

/// A runner's archive location: only compared with this server's, never
/// opened, but kept and shown in messages, so short and printable.
fn check_archive(location: &str) -> Result<(), EngineError> {
    if location.is_empty() || location.len() > 1024 || location.chars().any(char::is_control) {
        return Err(EngineError::Invalid {
            field: "archive",
            reason:
                "give the runner's archive location (--archive), up to 1024 printable characters"
                    .into(),
        });
    }
    Ok(())
}

/// The service a runner serves sandboxes at: its report's `apiUrl`, an
/// `http://` URL with a host, and `key`, which it made (1 to 128 letters,
/// digits, `-` or `_`: it goes into a header as it is).
fn service_of(
    report: &RunnerReport,
    key: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<crate::remote::Service, EngineError> {
    let invalid = |field: &'static str, reason: String| EngineError::Invalid { field, reason };
    if key.is_empty()
        || key.len() > 128
        || !key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(invalid(
            "serviceKey",
            "give 1 to 128 letters, digits, '-' or '_'".into(),
        ));
    }
    let Some(url) = &report.api_url else {
        return Err(invalid(
            "apiUrl",
            "a runner that gives a serviceKey says where it serves: give its http:// URL".into(),
        ));
    };
    crate::remote::Service::new(url, key, tls).ok_or_else(|| {
        invalid(
            "apiUrl",
            format!(
                "{url:?}: a runner's service is reached at {}",
                crate::remote::Service::expected(tls.is_some())
            ),
        )
    })
}

/// `part` of `whole` in percent, to two decimals; 0 of nothing.
fn percent(part: f64, whole: f64) -> f64 {
    if whole <= 0.0 {
        return 0.0;
    }
    (part / whole * 10_000.0).round() / 100.0
}

/// `MemTotal` and `MemAvailable` of /proc/meminfo, in KiB.
fn memory_kib() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|line| line.starts_with(name))?;
        line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
}

/// What a runner's state is judged by.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Judge<'a> {
    /// The server's own runner, ready while the server runs: it is this
    /// process.
    pub(crate) local: &'a str,
    pub(crate) now_ms: i64,
    /// How long another runner may be silent and still be ready.
    pub(crate) silence_ms: i64,
}

impl Judge<'_> {
    /// `record`'s state now.
    fn state(&self, record: &RunnerRecord) -> RunnerState {
        match record.last_checked_ms {
            _ if record.id == self.local => RunnerState::Ready,
            None => RunnerState::Initializing,
            Some(at) if self.now_ms - at > self.silence_ms => RunnerState::Unresponsive,
            Some(_) => RunnerState::Ready,
        }
    }
}

/// The runner a new sandbox goes to: of those that can take it (in its
/// region, running its class, ready, neither draining nor unschedulable,
/// and one this server `drives` for this sandbox, or the reason it does not),
/// the one with the most room for CPU and memory after it, then the one
/// holding fewer sandboxes, then by id. Runners are not refused for being
/// full: like Daytona's, they are overcommitted, and organizations' quotas
/// bound what each may use. A refusal names why each runner was passed
/// over.
pub(crate) fn choose<'a>(
    runners: impl IntoIterator<Item = (&'a RunnerRecord, Usage)>,
    need: Need<'_>,
    judge: Judge<'_>,
    drives: &dyn Fn(&RunnerRecord) -> Result<(), String>,
) -> Result<&'a RunnerRecord, EngineError> {
    let mut passed_over = Vec::new();
    let mut best: Option<(&RunnerRecord, f64, i64)> = None;
    for (runner, allocated) in runners {
        let why_not = if runner.region != need.region {
            Some(format!("is in region {:?}", runner.region))
        } else if !runner.classes.iter().any(|c| c == need.class.as_str()) {
            Some(format!("does not run {} sandboxes", need.class.as_str()))
        } else if runner.draining {
            Some(format!(
                "is draining (`cove admin drain {} --undo` ends that)",
                runner.id
            ))
        } else if runner.unschedulable {
            Some(format!(
                "is unschedulable (PATCH /api/runners/{}/scheduling with \
                 {{\"unschedulable\": false}} ends that)",
                runner.id
            ))
        } else {
            match judge.state(runner) {
                RunnerState::Ready => drives(runner).err(),
                state => Some(format!("is {}", state.as_str())),
            }
        };
        if let Some(why) = why_not {
            passed_over.push(format!("runner {} ({}) {why}", runner.name, runner.id));
            continue;
        }
        let score = room(runner, allocated, need.cpu, need.memory_gib);
        let better = match best {
            None => true,
            Some((held, best_score, best_running)) => {
                (score, -allocated.running, std::cmp::Reverse(&runner.id))
                    > (best_score, -best_running, std::cmp::Reverse(&held.id))
            }
        };
        if better {
            best = Some((runner, score, allocated.running));
        }
    }
    match best {
        Some((runner, _, _)) => Ok(runner),
        None if passed_over.is_empty() => Err(EngineError::NoRunner {
            reason: "no runner is registered".into(),
        }),
        None => Err(EngineError::NoRunner {
            reason: passed_over.join("; "),
        }),
    }
}

/// What `sandboxes` hold on each runner, as quotas count it ([`Usage`]),
/// and how many each holds; a row without a runner is `local`'s.
pub(crate) fn allocations<'a>(
    sandboxes: impl IntoIterator<Item = &'a cove_store::SandboxRecord>,
    local: &str,
) -> HashMap<String, (Usage, i64)> {
    let mut by_runner: HashMap<String, (Usage, i64)> = HashMap::new();
    for sandbox in sandboxes {
        let runner = sandbox.runner_id.as_deref().unwrap_or(local);
        let (usage, held) = by_runner.entry(runner.to_owned()).or_default();
        usage.add(sandbox);
        *held += 1;
    }
    by_runner
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runner(id: &str) -> RunnerRecord {
        RunnerRecord {
            id: id.into(),
            name: format!("host-{id}"),
            region: "us".into(),
            classes: vec!["container".into(), "linux-vm".into()],
            accelerator: None,
            cpu: 8,
            memory_gib: 32,
            disk_gib: 100,
            app_version: "0".into(),
            unschedulable: false,
            draining: false,
            usage: RunnerUsage::default(),
            created_at_ms: 0,
            updated_at_ms: 0,
            last_checked_ms: Some(1_000),
            tags: Vec::new(),
            api_url: None,
            proxy_url: None,
        }
    }

    const SILENCE_MS: i64 = 30_000;

    fn judge(local: &str, now_ms: i64) -> Judge<'_> {
        Judge {
            local,
            now_ms,
            silence_ms: SILENCE_MS,
        }
    }

    fn need(class: SandboxClass) -> Need<'static> {
        Need {
            class,
            region: "us",
            cpu: 1,
            memory_gib: 1,
            here_only: None,
            archived: false,
        }
    }

    fn used(cpu: i64, memory_gib: i64, running: i64) -> Usage {
        Usage {
            running,
            cpu,
            memory_gib,
            disk_gib: 0,
        }
    }

    #[test]
    fn the_runner_with_the_most_room_is_chosen() {
        let (a, b, c) = (runner("a"), runner("b"), runner("c"));
        let chosen = choose(
            [
                (&a, used(6, 4, 6)),
                (&b, used(2, 20, 2)),
                (&c, used(2, 4, 2)),
            ],
            need(SandboxClass::Container),
            judge("none", 2_000),
            &|_| Ok(()),
        )
        .unwrap();
        assert_eq!(chosen.id, "c");
        // Even: the one running fewer, then the first id.
        let chosen = choose(
            [
                (&a, used(2, 4, 3)),
                (&b, used(2, 4, 2)),
                (&c, used(2, 4, 2)),
            ],
            need(SandboxClass::Container),
            judge("none", 2_000),
            &|_| Ok(()),
        )
        .unwrap();
        assert_eq!(chosen.id, "b");
    }

    #[test]
    fn runners_that_cannot_take_it_are_passed_over_and_named() {
        let mut draining = runner("d");
        draining.draining = true;
        let mut unschedulable = runner("u");
        unschedulable.unschedulable = true;
        let mut containers_only = runner("k");
        containers_only.classes = vec!["container".into()];
        let mut elsewhere = runner("e");
        elsewhere.region = "eu".into();
        let mut silent = runner("s");
        silent.last_checked_ms = Some(0);
        let mut new = runner("n");
        new.last_checked_ms = None;
        let all = [
            &draining,
            &unschedulable,
            &containers_only,
            &elsewhere,
            &silent,
            &new,
        ];
        let err = choose(
            all.iter().map(|r| (*r, Usage::default())),
            need(SandboxClass::LinuxVm),
            judge("none", SILENCE_MS + 1_000),
            &|_| Ok(()),
        )
        .unwrap_err();
        let message = err.to_string();
        for expected in [
            "runner host-d (d) is draining",
            "runner host-u (u) is unschedulable",
            "runner host-k (k) does not run linux-vm sandboxes",
            "runner host-e (e) is in region \"eu\"",
            "runner host-s (s) is unresponsive",
            "runner host-n (n) is initializing",
        ] {
            assert!(message.contains(expected), "{expected:?} in {message}");
        }
        assert_eq!(err.kind(), crate::ErrorKind::ServiceUnavailable);
        // The containers-only runner takes a container.
        let chosen = choose(
            all.iter().map(|r| (*r, Usage::default())),
            need(SandboxClass::Container),
            judge("none", SILENCE_MS + 1_000),
            &|_| Ok(()),
        )
        .unwrap();
        assert_eq!(chosen.id, "k");
        // The server's own runner is never unresponsive: it is this process.
        let chosen = choose(
            [(&silent, Usage::default())],
            need(SandboxClass::Container),
            judge("s", SILENCE_MS * 10),
            &|_| Ok(()),
        )
        .unwrap();
        assert_eq!(chosen.id, "s");
        let none = choose(
            [],
            need(SandboxClass::Container),
            judge("s", 0),
            &|_| Ok(()),
        )
        .unwrap_err();
        assert!(
            none.to_string().contains("no runner is registered"),
            "{none}"
        );
    }

    #[test]
    fn a_sandbox_from_the_archive_goes_elsewhere_only_to_a_runner_sharing_it() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let service = crate::remote::Service::new("http://127.0.0.1:9", "k", None).unwrap();
        let remote = crate::remote::RemoteRuntime::new("r", service, PathBuf::new(), None);
        let at = "s3://bucket/cove";
        let mut archived = need(SandboxClass::Container);
        archived.archived = true;
        // A runner with no archive, or another one, cannot fetch it.
        let refused = drives_elsewhere(Some(&remote), &archived, false, Some(at)).unwrap_err();
        assert!(
            refused.contains("does not keep its archive at s3://bucket/cove"),
            "{refused}"
        );
        remote.set_archive(Some("s3://bucket/other"));
        assert!(drives_elsewhere(Some(&remote), &archived, false, Some(at)).is_err());
        // The same location: it can, and a new sandbox needs no archive.
        remote.set_archive(Some(at));
        assert_eq!(
            drives_elsewhere(Some(&remote), &archived, false, Some(at)),
            Ok(())
        );
        let fresh = need(SandboxClass::Container);
        assert_eq!(drives_elsewhere(Some(&remote), &fresh, false, None), Ok(()));
        // A directory of this server's own is shared with no machine.
        let refused = drives_elsewhere(Some(&remote), &archived, false, None).unwrap_err();
        assert!(refused.contains("directory of its own"), "{refused}");
        // What passed over it before still does.
        let refused = drives_elsewhere(Some(&remote), &archived, true, Some(at)).unwrap_err();
        assert!(refused.contains("without a sandbox network"), "{refused}");
        let refused = drives_elsewhere(None, &fresh, false, None).unwrap_err();
        assert!(
            refused.contains("has not said where it serves"),
            "{refused}"
        );
    }

    #[test]
    fn a_runner_this_server_does_not_drive_is_passed_over_and_named() {
        let (here, there) = (runner("here"), runner("there"));
        let drives = |r: &RunnerRecord| match r.id.as_str() {
            "here" => Ok(()),
            _ => Err("has not said where it serves".to_owned()),
        };
        // "there" has more room, but only "here" is driven.
        let chosen = choose(
            [(&here, used(6, 20, 6)), (&there, Usage::default())],
            need(SandboxClass::Container),
            judge("here", 2_000),
            &drives,
        )
        .unwrap();
        assert_eq!(chosen.id, "here");
        let mut drained = here.clone();
        drained.draining = true;
        let err = choose(
            [(&drained, Usage::default()), (&there, Usage::default())],
            need(SandboxClass::Container),
            judge("here", 2_000),
            &drives,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("runner host-there (there) has not said where it serves"),
            "{err}"
        );
    }

    /// Attack: a runner's key goes into a header of every call to it, as it
    /// is; one with a line break would add headers of the runner's choosing.
    #[test]
    fn a_service_is_taken_only_with_a_plain_key_at_an_http_url() {
        let mut report = RunnerReport {
            api_url: Some("http://10.1.2.3:3100".into()),
            ..RunnerReport::default()
        };
        assert!(service_of(&report, "a-Plain_key0", None).is_ok());
        for key in ["", "two words", "line\r\nX-Evil: 1", &"k".repeat(129)] {
            let err = service_of(&report, key, None).unwrap_err().to_string();
            assert!(err.contains("serviceKey"), "{key:?}: {err}");
        }
        for url in [None, Some("https://10.1.2.3:3100"), Some("http://")] {
            report.api_url = url.map(str::to_owned);
            let err = service_of(&report, "key", None).unwrap_err().to_string();
            assert!(err.contains("apiUrl"), "{url:?}: {err}");
        }
    }

    #[test]
    fn a_report_that_cannot_be_true_is_refused_naming_its_field() {
        let good = RunnerReport {
            classes: vec!["container".into(), "linux-vm".into()],
            accelerator: Some("kvm".into()),
            cpu: 8,
            memory_gib: 32,
            disk_gib: 100,
            app_version: "0.1.0".into(),
            usage: RunnerUsage::default(),
            api_url: Some("http://10.1.0.2:3000".into()),
            proxy_url: None,
        };
        check_report(&good).unwrap();
        let field = |report: RunnerReport| match check_report(&report) {
            Err(EngineError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let with = |change: fn(&mut RunnerReport)| {
            let mut report = good.clone();
            change(&mut report);
            report
        };
        assert_eq!(
            field(with(|r| r.classes.push("gpu".into()))),
            "sandboxClasses"
        );
        assert_eq!(
            field(with(|r| r.classes.push("container".into()))),
            "sandboxClasses"
        );
        assert_eq!(field(with(|r| r.classes.truncate(1))), "accelerator");
        assert_eq!(
            field(with(|r| r.accelerator = Some("hvf".into()))),
            "accelerator"
        );
        assert_eq!(field(with(|r| r.cpu = -1)), "metrics.cpu");
        assert_eq!(
            field(with(|r| r.usage.memory = f64::NAN)),
            "metrics.currentMemoryUsagePercentage"
        );
        assert_eq!(field(with(|r| r.app_version = String::new())), "appVersion");
        assert_eq!(
            field(with(|r| r.api_url = Some("file:///etc".into()))),
            "apiUrl"
        );
        assert_eq!(
            field(with(|r| r.proxy_url = Some("http://a b".into()))),
            "proxyUrl"
        );
        assert!(check_word("name", "rack-2.node_1").is_ok());
        for bad in ["", "a b", "ä", &"x".repeat(64)] {
            assert!(check_word("name", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn allocations_count_running_compute_and_unarchived_disk_per_runner() {
        use cove_lifecycle::{DesiredState, SandboxState};
        let mut on_a = cove_store::SandboxRecord::sample("1", "one");
        on_a.runner_id = Some("a".into());
        on_a.memory_mib = 1536;
        let mut stopped = cove_store::SandboxRecord::sample("2", "two");
        stopped.runner_id = Some("a".into());
        stopped.state = SandboxState::Stopped;
        stopped.desired_state = DesiredState::Stopped;
        let mut archived = stopped.clone();
        archived.id = "3".into();
        archived.state = SandboxState::Archived;
        let old = cove_store::SandboxRecord::sample("4", "four");
        let found = allocations([&on_a, &stopped, &archived, &old], "local");
        assert_eq!(found["a"], (used(1, 2, 1).with_disk(6), 3));
        assert_eq!(found["local"], (used(1, 1, 1).with_disk(3), 1));
    }

    impl Usage {
        fn with_disk(self, disk_gib: i64) -> Usage {
            Usage { disk_gib, ..self }
        }
    }

    #[test]
    fn percent_is_rounded_and_zero_of_nothing() {
        assert_eq!(percent(1.0, 3.0), 33.33);
        assert_eq!(percent(5.0, 0.0), 0.0);
    }

    fn piped(script: &str) -> tokio::process::Child {
        tokio::process::Command::new("sh")
            .args(["-c", script])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    }

    #[tokio::test]
    async fn a_sender_that_says_much_on_stderr_still_sends_and_ends() {
        use tokio::io::AsyncReadExt as _;
        // 256 KiB on stderr before a word on stdout: unread, it would fill
        // the pipe and the stdout below would never come.
        let child = piped("head -c 262144 /dev/zero >&2; echo sent");
        let (mut stdout, exited) = output_of(child, "sender");
        let mut out = String::new();
        let read = stdout.read_to_string(&mut out);
        tokio::time::timeout(Duration::from_secs(20), read)
            .await
            .expect("stdout ends")
            .unwrap();
        assert_eq!(out, "sent\n");
        assert_eq!(exited.await, Ok(()));
    }

    #[tokio::test]
    async fn a_failed_sender_is_named_with_the_end_of_its_stderr() {
        let script = "head -c 10000 /dev/zero | tr '\\0' a >&2; echo ' the end' >&2; exit 3";
        let (_, exited) = output_of(piped(script), "sender");
        let error = exited.await.unwrap_err();
        assert!(error.starts_with("sender exit status: 3: "), "{error}");
        assert!(error.ends_with("a the end"), "{error}");
        assert!(error.len() < STDERR_KEPT + 40, "{} bytes", error.len());
    }
}
