//! Creating a sandbox: check everything first, then make it, and on any failure
//! leave nothing behind.

use std::collections::BTreeMap;

use cove_lifecycle::{
    DesiredState, SandboxClass, TimerSettings, Transition, MAX_MINUTES, MINUTE_MS,
};
use cove_store::{SandboxRecord, SnapshotState};

use super::Sandboxes;
use cove_runtime::timeline::Timeline;

use crate::checks::{check_name, sized};
use crate::metrics::Measured;
use crate::runners::Need;
use crate::shared::sandbox_id;
use crate::{now_ms, EngineError};

/// What a user asked for. `None` means "the default".
#[derive(Clone, Debug, Default)]
pub struct CreateSandbox {
    pub name: Option<String>,
    pub snapshot: Option<String>,
    pub user: Option<String>,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub public: bool,
    pub cpu: Option<i64>,
    pub gpu: Option<i64>,
    pub memory_gib: Option<i64>,
    pub disk_gib: Option<i64>,
    pub auto_stop: Option<i64>,
    pub auto_pause: Option<i64>,
    pub auto_archive: Option<i64>,
    pub auto_delete: Option<i64>,
    pub ttl_minutes: Option<i64>,
    /// May pause (cove extension, as in seed 001); defaults to "not ephemeral".
    pub persistent: Option<bool>,
    /// cove may reclaim it: paused if persistent, deleted otherwise.
    pub spot: bool,
    /// Expose /dev/kvm inside the sandbox (nested virtualization).
    pub kvm: bool,
    /// A Dockerfile to build the sandbox's image from (the SDK's `image=`),
    /// instead of a snapshot.
    pub dockerfile: Option<String>,
    /// The uploaded build contexts its `COPY`s read (`buildInfo.contextHashes`).
    pub build_contexts: Vec<String>,
    /// Egress policy (networkBlockAll, networkAllowList, domainAllowList).
    pub network: cove_store::NetworkSettings,
    /// Volumes to mount, by id or name.
    pub volumes: Vec<cove_store::VolumeMount>,
    /// The sandbox (id or name) to share a private network with; the new
    /// sandbox must be ephemeral.
    pub linked_sandbox: Option<String>,
}

impl Sandboxes {
    /// Creates and starts a sandbox. It is either `started` when this returns, or it
    /// does not exist at all.
    pub async fn create(&self, request: CreateSandbox) -> Result<SandboxRecord, EngineError> {
        let mut timeline = Timeline::start("create");
        let snapshot = self.snapshot_for(&request).await?;
        // Checked before the row exists (and before placement, which would
        // find no runner for it): no half-made sandbox for a class this
        // server cannot run.
        self.shared.runtime(snapshot.class)?;
        let record = self.new_record(request, &snapshot).await?;
        let runtime = self.shared.runtime_of(&record)?;
        let spec = self.spec(&record, &snapshot)?;
        timeline.step("check");
        let lock = self.shared.lock_for(&record.id);
        let _guard = lock.lock().await;
        let saga = self.begin_new(record, Measured::Create).await?;
        timeline.step("store_creating");
        let made = async {
            runtime.prepare(&spec).await?;
            timeline.step("prepare");
            let started = self
                .start_machine_timed(runtime.as_ref(), saga.record(), spec, &mut timeline)
                .await;
            timeline.step("start");
            started
        }
        .await;
        let id = saga.record().id.clone();
        let record = saga.finish(made, &id, "be created").await?;
        timeline.step("store_started");
        timeline.log(&id);
        tracing::info!(sandbox = %record.id, name = %record.name, snapshot = %record.snapshot, "created");
        Ok(record)
    }

    /// The active snapshot a new sandbox is made from: the one named, the
    /// server's default, or one built from the request's Dockerfile.
    async fn snapshot_for(
        &self,
        request: &CreateSandbox,
    ) -> Result<cove_store::SnapshotRecord, EngineError> {
        let config = &self.shared.config;
        let snapshot_name = request
            .snapshot
            .clone()
            .unwrap_or_else(|| config.default_snapshot.clone());
        if snapshot_name.to_ascii_lowercase().starts_with("windows") {
            return Err(EngineError::NoWindows {
                name: snapshot_name,
            });
        }
        let snapshot = match &request.dockerfile {
            Some(text) => {
                self.snapshots
                    .dockerfile_snapshot(text, &request.build_contexts)
                    .await?
            }
            None => self.snapshots.get(&snapshot_name).await?,
        };
        if snapshot.state != SnapshotState::Active {
            return Err(EngineError::SnapshotNotActive {
                name: snapshot.name.clone(),
                state: snapshot.state.as_str(),
            });
        }
        Ok(snapshot)
    }

    /// The record of a new sandbox, `creating`, once every field of the
    /// request is checked.
    async fn new_record(
        &self,
        request: CreateSandbox,
        snapshot: &cove_store::SnapshotRecord,
    ) -> Result<SandboxRecord, EngineError> {
        self.check_machine(&request, snapshot.class)?;
        let network = crate::network::normalised(request.network.clone())?;
        let (cpu, memory_mib, disk_gib) = sized(
            self.shared.config.ceilings,
            (request.cpu, request.memory_gib, request.disk_gib),
            snapshot,
        )?;
        let user = self.user_for(request.user.as_deref(), snapshot).await?;
        let linked_sandbox_id = self.link_target(&request).await?;
        let (timers, persistent) = timers_for(&request, snapshot.class)?;
        let ttl_minutes = request.ttl_minutes.unwrap_or(0);
        if !(0..=MAX_MINUTES).contains(&ttl_minutes) {
            return Err(EngineError::Invalid {
                field: "ttlMinutes",
                reason: format!("must be 0 (off) to {MAX_MINUTES}, got {ttl_minutes}"),
            });
        }
        check_env(&request.env)?;
        let id = uuid::Uuid::new_v4().to_string();
        let name = request.name.clone().unwrap_or_else(|| id.clone());
        check_name(&name)?;
        let volumes = self
            .volumes
            .resolve_mounts(snapshot, &request.volumes)
            .await?;
        let now = now_ms();
        let Transition::Run { during, .. } = Transition::create() else {
            unreachable!("create always runs")
        };
        let mut record = SandboxRecord {
            id,
            organization_id: self.scope.owner().to_owned(),
            name,
            snapshot: snapshot.name.clone(),
            class: snapshot.class,
            state: during,
            desired_state: DesiredState::Started,
            error_reason: None,
            os_user: user,
            cpu,
            gpu: 0,
            memory_mib,
            disk_gib,
            env: request.env,
            labels: request.labels,
            public: request.public,
            timers,
            ttl_minutes,
            ttl_deadline_ms: (ttl_minutes > 0).then(|| now + ttl_minutes * MINUTE_MS),
            created_at_ms: now,
            updated_at_ms: now,
            state_since_ms: now,
            last_activity_ms: now,
            persistent,
            spot: request.spot,
            parent_id: None,
            linked_sandbox_id,
            network,
            volumes,
            runner_id: None,
        };
        // Last, once the request is known to be good: a refusal here says
        // only that no runner can take it now.
        let mut need = Need::of(&record);
        // A runner elsewhere fetches a captured layer from this server
        // (`Runners::layer_send`), but not a capture's memory.
        if snapshot.has_memory {
            need.here_only = need.here_only.or(Some("a snapshot with memory"));
        }
        record.runner_id = Some(self.shared.place(need, None)?);
        Ok(record)
    }

    /// Refuses what no sandbox here can have: a bad network policy (or one
    /// without networking), nested KVM, a GPU.
    fn check_machine(
        &self,
        request: &CreateSandbox,
        class: cove_lifecycle::SandboxClass,
    ) -> Result<(), EngineError> {
        crate::network::policy(&request.network)?;
        if request.network != cove_store::NetworkSettings::default()
            && self.shared.network().is_none()
        {
            return Err(EngineError::NotImplemented {
                what: format!(
                    "network policies for {class} sandboxes on this server (no sandbox networking)"
                ),
            });
        }
        if request.kvm {
            return Err(EngineError::Invalid {
                field: "kvm",
                reason: "cove does not offer nested virtualization: /dev/kvm cannot be \
                         exposed inside a sandbox on this server; create it without kvm"
                    .into(),
            });
        }
        if let Some(gpu) = request.gpu.filter(|gpu| *gpu != 0) {
            return Err(EngineError::AboveCeiling {
                field: "gpu",
                requested: gpu,
                ceiling: 0,
            });
        }
        Ok(())
    }

    /// The sandbox a new one links to, checked as Daytona does: the new one
    /// is ephemeral, and the one it links to exists and is linked to nobody.
    /// It must be running too: the link is its network's.
    async fn link_target(&self, request: &CreateSandbox) -> Result<Option<String>, EngineError> {
        let Some(wanted) = request.linked_sandbox.as_deref() else {
            return Ok(None);
        };
        let invalid = |reason: String| EngineError::Invalid {
            field: "linkedSandbox",
            reason,
        };
        if request.auto_delete != Some(0) {
            return Err(invalid(
                "a linked sandbox must be ephemeral: create it with autoDeleteInterval 0 \
                 (ephemeral=True)"
                    .into(),
            ));
        }
        if self.shared.network().is_none() {
            return Err(EngineError::NotImplemented {
                what: "linking sandboxes on a server without the sandbox network".into(),
            });
        }
        let target = self.get(wanted).await?;
        if let Some(owner) = &target.linked_sandbox_id {
            return Err(invalid(format!(
                "sandbox {} is itself linked (to {owner}); link to that one instead",
                target.name
            )));
        }
        if target.state != cove_lifecycle::SandboxState::Started {
            return Err(EngineError::NotStarted {
                id: target.id,
                state: target.state,
            });
        }
        Ok(Some(target.id))
    }

    /// The user a sandbox runs as: the one asked for if the image has it
    /// (root and numeric ids always do, as with Docker's `USER`), else the
    /// image's `USER`, else the server's default user (`daytona`) where the
    /// image has one, else root.
    async fn user_for(
        &self,
        requested: Option<&str>,
        snapshot: &cove_store::SnapshotRecord,
    ) -> Result<String, EngineError> {
        let users = image_users(snapshot).await;
        let known = |name: &str| users.iter().any(|user| user == name);
        let os_user = &self.shared.config.os_user;
        let default_user = match &snapshot.image.user {
            Some(user) => user.clone(),
            None if known(os_user) => os_user.clone(),
            None => "root".to_owned(),
        };
        let Some(user) = requested.filter(|user| !user.is_empty()) else {
            return Ok(default_user);
        };
        let name = user.split_once(':').map_or(user, |(name, _)| name);
        // Without a readable /etc/passwd the agent checks, as the sandbox starts.
        if users.is_empty() || known(name) || name.parse::<u32>().is_ok() || user == default_user {
            return Ok(user.to_owned());
        }
        Err(EngineError::Invalid {
            field: "user",
            reason: format!(
                "{name:?} is not in the /etc/passwd of snapshot {}; its sandboxes run as \
                 {default_user:?} unless asked for another user of that file",
                snapshot.name
            ),
        })
    }

    pub(crate) fn spec(
        &self,
        record: &SandboxRecord,
        snapshot: &cove_store::SnapshotRecord,
    ) -> Result<cove_runtime::SandboxSpec, EngineError> {
        Ok(cove_runtime::SandboxSpec {
            id: sandbox_id(&record.id)?,
            hostname: record.name.chars().take(63).collect(),
            rootfs: snapshot.rootfs.clone().into(),
            layers: snapshot.layers.iter().map(Into::into).collect(),
            resources: cove_runtime::Resources {
                cpu: record.cpu as u32,
                memory_mib: record.memory_mib as u64,
                disk_gib: record.disk_gib as u64,
            },
            // The image's variables first, the sandbox's own over them.
            env: snapshot
                .env
                .iter()
                .filter(|(k, _)| !record.env.contains_key(*k))
                .chain(record.env.iter())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            network: None,
            volumes: self.volumes.binds(record),
            workdir: snapshot.image.workdir.clone(),
            user: (record.os_user != "root").then(|| record.os_user.clone()),
            command: snapshot.image.command(),
        })
    }
}

/// The user names of a snapshot's image, its captured layers first; none
/// when they cannot be read (the agent then checks the user as it starts).
async fn image_users(snapshot: &cove_store::SnapshotRecord) -> Vec<String> {
    let roots: Vec<std::path::PathBuf> = snapshot
        .layers
        .iter()
        .chain(std::iter::once(&snapshot.rootfs))
        .map(Into::into)
        .collect();
    let read = tokio::task::spawn_blocking(move || cove_images::image_users(&roots)).await;
    match read {
        Ok(Ok(users)) => users,
        Ok(Err(error)) => {
            tracing::warn!(snapshot = %snapshot.name, %error, "reading the image's users");
            Vec::new()
        }
        Err(_) => Vec::new(),
    }
}

/// The timers of a new sandbox, and whether it is persistent (may pause).
fn timers_for(
    request: &CreateSandbox,
    class: SandboxClass,
) -> Result<(TimerSettings, bool), EngineError> {
    let ephemeral = request.auto_delete == Some(0);
    if ephemeral && request.persistent == Some(true) {
        return Err(EngineError::Invalid {
            field: "persistent",
            reason: "an ephemeral sandbox (autoDeleteInterval 0) cannot be persistent".into(),
        });
    }
    let persistent = request.persistent.unwrap_or(!ephemeral);
    let mut auto_stop = request.auto_stop;
    if !persistent {
        if request.auto_pause.is_some_and(|minutes| minutes != 0) {
            return Err(EngineError::Invalid {
                field: "autoPauseInterval",
                reason: "a sandbox that is not persistent cannot pause".into(),
            });
        }
        // Without pause, idle sandboxes stop as containers do.
        if auto_stop.is_none() && request.auto_pause.is_none() {
            auto_stop = Some(cove_lifecycle::DEFAULT_AUTO_STOP);
        }
    }
    let timers = TimerSettings::resolve(
        class,
        auto_stop,
        request.auto_pause,
        request.auto_archive,
        request.auto_delete,
    )?;
    Ok((timers, persistent))
}

/// Variable names the environment can hold.
fn check_env(env: &BTreeMap<String, String>) -> Result<(), EngineError> {
    for key in env.keys() {
        if key.is_empty() || key.contains('=') || key.contains('\0') {
            return Err(EngineError::Invalid {
                field: "env",
                reason: format!("{key:?} is not a valid variable name"),
            });
        }
    }
    Ok(())
}
