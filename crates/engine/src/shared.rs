//! What every part of the engine shares: the configuration, the store, the
//! runtimes, one lock per sandbox, the sandboxes that run and their idle clocks,
//! the feed of sandbox changes, and the operation metrics.
//!
//! Parts hold an `Arc<Shared>`; nothing here knows of sandboxes' operations,
//! snapshots' builds or access tokens.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cove_lifecycle::SandboxClass;
use cove_runtime::{AgentEndpoint, Runtime, RuntimeError, SandboxId};
use cove_store::{SandboxRecord, Store, StoreError};

use crate::activity::Activity;
use crate::events::{Events, Recorded};
use crate::metrics::Metrics;
use crate::{now_ms, EngineConfig, EngineError};

/// A sandbox the runtime reported running, and which start it came from.
#[derive(Clone, Debug)]
pub(crate) struct Running {
    pub(crate) agent: AgentEndpoint,
    /// Whose sandbox it is: a toolbox call by id is checked against it
    /// without a store read.
    pub(crate) organization_id: String,
    /// How a VM executes ("kvm" or "tcg"); `None` for containers.
    pub(crate) accelerator: Option<&'static str>,
    /// Tells a late exit notice of an earlier start from the current one.
    pub(crate) generation: u64,
}

/// What is told of an agent as its sandbox starts: the sandbox and where its
/// agent listens.
pub(crate) type AgentStarted = Box<dyn Fn(&str, &AgentEndpoint) + Send + Sync>;

pub(crate) struct Shared {
    pub(crate) config: EngineConfig,
    pub(crate) store: Store,
    runtimes: HashMap<SandboxClass, Arc<dyn Runtime>>,
    /// One lock per sandbox: operations on a sandbox run one after the other.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    running: Mutex<HashMap<String, Running>>,
    /// Told of each agent as its sandbox starts (`Engine::on_agent_started`).
    agent_started: std::sync::OnceLock<AgentStarted>,
    generation: AtomicU64,
    pub(crate) activity: Activity,
    /// Bumped whenever SSH access tokens go away (revoked, or with their
    /// sandbox): live SSH connections re-check their token when it changes.
    pub(crate) ssh_revocations: tokio::sync::watch::Sender<u64>,
    /// Every state the sandboxes are recorded in, as it is recorded.
    pub(crate) events: Events,
    /// Operations run, by outcome, and how long they took.
    pub(crate) metrics: Metrics,
    /// Held from a quota check until the sandbox it admitted is recorded as
    /// holding its slot, so two sandboxes never take the last one.
    admission: tokio::sync::Mutex<()>,
    /// Each organization's rate limits and counts, read from the store once:
    /// every API request consults them.
    organization_quotas: tokio::sync::RwLock<HashMap<String, cove_store::OrganizationQuotaRecord>>,
    /// The runners new sandboxes may go to and what each holds, kept here
    /// so a create places its sandbox without a store read.
    pub(crate) placement: std::sync::RwLock<crate::runners::Placement>,
    /// The runtimes of runners on other machines whose last report named
    /// their service, by runner id; kept in memory only (the key with them).
    pub(crate) remotes: std::sync::RwLock<HashMap<String, crate::remote::Remote>>,
    /// Runners elsewhere as each first says where it serves, for the
    /// sandboxes part to take their sandboxes back (`recover_runner`).
    pub(crate) arrivals: tokio::sync::mpsc::UnboundedSender<String>,
    pub(crate) arrived: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<String>>>,
    /// Images being sent to runners (`Runners::image_tar`), bounded.
    pub(crate) image_sends: crate::runners::ImageSends,
}

impl Shared {
    pub(crate) fn new(
        config: EngineConfig,
        store: Store,
        runtimes: HashMap<SandboxClass, Arc<dyn Runtime>>,
    ) -> Shared {
        let placement = crate::runners::Placement::of_local(&config.runner, &runtimes);
        let (arrivals, arrived) = tokio::sync::mpsc::unbounded_channel();
        Shared {
            arrivals,
            arrived: Mutex::new(Some(arrived)),
            placement: std::sync::RwLock::new(placement),
            remotes: std::sync::RwLock::default(),
            config,
            store,
            runtimes,
            locks: Mutex::default(),
            running: Mutex::default(),
            agent_started: std::sync::OnceLock::new(),
            generation: AtomicU64::default(),
            admission: tokio::sync::Mutex::default(),
            organization_quotas: tokio::sync::RwLock::default(),
            activity: Activity::default(),
            ssh_revocations: tokio::sync::watch::Sender::new(0),
            events: Events::new(),
            metrics: Metrics::default(),
            image_sends: crate::runners::ImageSends::default(),
        }
    }

    pub(crate) fn runtime(&self, class: SandboxClass) -> Result<&Arc<dyn Runtime>, EngineError> {
        self.runtimes
            .get(&class)
            .ok_or(EngineError::ClassUnavailable {
                class: class.as_str(),
            })
    }

    /// Whether `record` runs on this server's own runner (every sandbox
    /// from before runners does).
    pub(crate) fn is_local(&self, record: &SandboxRecord) -> bool {
        record
            .runner_id
            .as_deref()
            .is_none_or(|runner| runner == self.config.runner.id)
    }

    /// The runtime of `record`: this server's for its class, or the one of
    /// the runner elsewhere that holds it.
    pub(crate) fn runtime_of(
        &self,
        record: &SandboxRecord,
    ) -> Result<Arc<dyn Runtime>, EngineError> {
        let Some(runner) = record
            .runner_id
            .as_deref()
            .filter(|_| !self.is_local(record))
        else {
            return self.runtime(record.class).cloned();
        };
        match self.remotes.read().unwrap().get(runner) {
            Some(remote) => Ok(Arc::new(remote.clone())),
            None => Err(EngineError::RunnerAway {
                id: runner.to_owned(),
            }),
        }
    }

    /// The runner elsewhere that holds `record`, as this server drives it;
    /// `None` for a sandbox of this server's runner, or of one that has not
    /// said where it serves.
    pub(crate) fn remote_of(&self, record: &SandboxRecord) -> Option<crate::remote::Remote> {
        let runner = record
            .runner_id
            .as_deref()
            .filter(|_| !self.is_local(record))?;
        self.remotes.read().unwrap().get(runner).cloned()
    }

    /// Has every runner elsewhere delete its copy of captured layer
    /// `capture`, whose snapshot is deleted, in the background: a runner
    /// that cannot be reached keeps its copy (logged).
    pub(crate) fn discard_layer_on_runners(&self, capture: &str) {
        let remotes: Vec<crate::remote::Remote> =
            self.remotes.read().unwrap().values().cloned().collect();
        for remote in remotes {
            let capture = capture.to_owned();
            tokio::spawn(async move {
                if let Err(error) = remote.0.discard_layer(&capture).await {
                    let error = crate::error::describe(&error);
                    tracing::warn!(capture, %error, "a runner keeps its copy of a deleted snapshot's layer");
                }
            });
        }
    }

    /// Every class this server runs, with its runtime.
    pub(crate) fn runtimes(&self) -> impl Iterator<Item = (SandboxClass, &Arc<dyn Runtime>)> {
        self.runtimes
            .iter()
            .map(|(class, runtime)| (*class, runtime))
    }

    pub(crate) fn lock_for(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks
            .lock()
            .unwrap()
            .entry(id.to_owned())
            .or_default()
            .clone()
    }

    /// Admits `record` to run under its organization's quota (and, when
    /// `new`, to keep its disk: a new sandbox, or one from the archive): the
    /// guard returned is to be held until its row says it holds its slot.
    /// Without a quota, nothing is read.
    pub(crate) async fn admit(
        &self,
        record: &SandboxRecord,
        new: bool,
    ) -> Result<tokio::sync::MutexGuard<'_, ()>, EngineError> {
        let guard = self.admission.lock().await;
        let quota = self
            .store
            .region_quota(&record.organization_id, crate::quota::REGION_ID)
            .await?;
        if let Some(quota) = quota {
            let records = self.store.list_sandboxes().await?;
            let usage = crate::quota::Usage::of(
                records
                    .iter()
                    .filter(|r| r.organization_id == record.organization_id),
                &record.id,
            );
            crate::quota::admit(&quota, &usage, record, new)?;
        }
        Ok(guard)
    }

    /// Admits one more volume, or snapshot, of `organization_id` under its
    /// `volumeQuota` or `snapshotQuota`; the guard is to be held until its
    /// row is stored. The server's own images do not count.
    pub(crate) async fn admit_count(
        &self,
        organization_id: &str,
        kind: crate::quota::Counted,
    ) -> Result<tokio::sync::MutexGuard<'_, ()>, EngineError> {
        use crate::quota::Counted;
        let guard = self.admission.lock().await;
        let quota = self.organization_quota(organization_id).await?;
        let limit = match kind {
            Counted::Volumes => quota.volumes,
            Counted::Snapshots => quota.snapshots,
        };
        if let Some(limit) = limit {
            let used = self.count(organization_id, kind).await? as i64;
            crate::quota::admit_count(kind, limit, used)?;
        }
        Ok(guard)
    }

    /// How many volumes, or snapshots, `organization_id` keeps (the
    /// server's own images are no one's).
    pub(crate) async fn count(
        &self,
        organization_id: &str,
        kind: crate::quota::Counted,
    ) -> Result<usize, EngineError> {
        use crate::quota::Counted;
        Ok(match kind {
            Counted::Volumes => {
                let all = self.store.list_volumes().await?;
                all.iter()
                    .filter(|v| v.organization_id == organization_id)
                    .count()
            }
            Counted::Snapshots => {
                let all = self.store.list_snapshots().await?;
                all.iter()
                    .filter(|s| !s.general && s.organization_id == organization_id)
                    .count()
            }
        })
    }

    /// An organization's rate limits and counts (none when never set).
    pub(crate) async fn organization_quota(
        &self,
        organization_id: &str,
    ) -> Result<cove_store::OrganizationQuotaRecord, EngineError> {
        if let Some(known) = self.organization_quotas.read().await.get(organization_id) {
            return Ok(known.clone());
        }
        let mut cached = self.organization_quotas.write().await;
        let stored = self
            .store
            .organization_quota(organization_id)
            .await?
            .unwrap_or_default();
        cached.insert(organization_id.to_owned(), stored.clone());
        Ok(stored)
    }

    /// Replaces an organization's rate limits and counts and its region
    /// quota in one write.
    pub(crate) async fn set_quotas(
        &self,
        organization_id: &str,
        quota: &cove_store::OrganizationQuotaRecord,
        region: &cove_store::RegionQuotaRecord,
    ) -> Result<(), EngineError> {
        let mut cached = self.organization_quotas.write().await;
        self.store
            .save_quotas(organization_id, quota, region, now_ms())
            .await?;
        cached.insert(organization_id.to_owned(), quota.clone());
        Ok(())
    }

    /// Forgets a deleted organization's cached quota.
    pub(crate) async fn forget_quotas(&self, organization_id: &str) {
        self.organization_quotas
            .write()
            .await
            .remove(organization_id);
    }

    /// Forgets a deleted sandbox: its lock, its idle clock.
    pub(crate) fn forget(&self, id: &str) {
        self.activity.forget(id);
        self.locks.lock().unwrap().remove(id);
    }

    /// The sandbox with this id or name, of any organization: for ids the
    /// engine holds, or a caller resolved in its organization first.
    pub(crate) async fn sandbox(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        self.sandbox_in(None, id_or_name).await
    }

    /// The sandbox with this id or name in `organization_id` (`None`: in any).
    pub(crate) async fn sandbox_in(
        &self,
        organization_id: Option<&str>,
        id_or_name: &str,
    ) -> Result<SandboxRecord, EngineError> {
        let mut record = self
            .store
            .find_sandbox(organization_id, id_or_name)
            .await?
            .ok_or_else(|| EngineError::SandboxNotFound {
                id: id_or_name.to_owned(),
            })?;
        self.activity.apply(&mut record);
        Ok(record)
    }

    /// Every sandbox, oldest first.
    pub(crate) async fn sandboxes(&self) -> Result<Vec<SandboxRecord>, EngineError> {
        let mut records = self.store.list_sandboxes().await?;
        for record in &mut records {
            self.activity.apply(record);
        }
        Ok(records)
    }

    /// Records a sandbox's new state, which also resets its idle clock, and
    /// tells the event feed what changed.
    pub(crate) async fn save_state(&self, record: &mut SandboxRecord) -> Result<(), EngineError> {
        let now = now_ms();
        record.state_since_ms = now;
        record.updated_at_ms = now;
        // A state change is an event: it resets the idle clock.
        record.last_activity_ms = record.last_activity_ms.max(now);
        // What the row said before is read only when someone listens; the
        // callers' records may have been changed since they were read.
        let before = match self.events.has_subscribers() {
            true => self.store.find_sandbox(None, &record.id).await?,
            false => None,
        };
        self.store.save_sandbox(record).await?;
        if let Some(before) = before {
            self.events.changed(Recorded::of(&before), record);
        }
        Ok(())
    }

    /// Stores a new sandbox's row (in `creating`); it is announced when it
    /// leaves that state (`Events::changed`).
    pub(crate) async fn insert_sandbox(&self, record: &SandboxRecord) -> Result<(), StoreError> {
        self.store.insert_sandbox(record).await
    }

    /// Deletes a sandbox's row: from now on it is `destroyed`, which the
    /// event feed hears with `record` in that state.
    pub(crate) async fn delete_sandbox(&self, record: &SandboxRecord) -> Result<(), EngineError> {
        self.store.delete_sandbox(&record.id, now_ms()).await?;
        let mut destroyed = record.clone();
        destroyed.state = cove_lifecycle::SandboxState::Destroyed;
        destroyed.desired_state = cove_lifecycle::DesiredState::Destroyed;
        self.events.changed(Recorded::of(record), &destroyed);
        Ok(())
    }

    /// The network every sandbox joins; `None` on a server without one.
    pub(crate) fn network(&self) -> Option<&Arc<cove_net::Network>> {
        self.config.network.as_ref().map(|n| &n.0)
    }

    /// Remembers a started sandbox; returns the generation of this start.
    pub(crate) fn set_running(
        &self,
        record: &SandboxRecord,
        agent: AgentEndpoint,
        accelerator: Option<&'static str>,
    ) -> u64 {
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(hook) = self.agent_started.get() {
            hook(&record.id, &agent);
        }
        self.running.lock().unwrap().insert(
            record.id.clone(),
            Running {
                agent,
                organization_id: record.organization_id.clone(),
                accelerator,
                generation,
            },
        );
        generation
    }

    /// Forgets a sandbox's start if it is still the one of `generation`
    /// (any start with `None`); whether it was forgotten.
    pub(crate) fn forget_running(&self, id: &str, generation: Option<u64>) -> bool {
        let mut running = self.running.lock().unwrap();
        match (running.get(id), generation) {
            (Some(current), Some(generation)) if current.generation != generation => false,
            (Some(_), _) => running.remove(id).is_some(),
            (None, _) => false,
        }
    }

    /// Sets what is told of each agent as its sandbox starts; once.
    pub(crate) fn on_agent_started(&self, hook: AgentStarted) -> bool {
        self.agent_started.set(hook).is_ok()
    }

    pub(crate) fn forget_all_running(&self) {
        self.running.lock().unwrap().clear();
    }

    pub(crate) fn running(&self, id: &str) -> Option<Running> {
        self.running.lock().unwrap().get(id).cloned()
    }

    /// Tells live SSH connections that tokens went away.
    pub(crate) fn ssh_access_revoked(&self) {
        self.ssh_revocations.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// A stored sandbox's id, as the runtime takes it. The engine made it (a
/// UUID, or `build-` and one), so only a corrupt store fails here.
pub(crate) fn sandbox_id(id: &str) -> Result<SandboxId, EngineError> {
    SandboxId::parse(id).map_err(|_| {
        EngineError::runtime(id, "reach its machine")(RuntimeError::InvalidId { id: id.to_owned() })
    })
}
