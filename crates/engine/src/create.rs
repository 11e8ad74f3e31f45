//! Creating a sandbox: check everything first, then make it, and on any failure
//! leave nothing behind.

use std::collections::BTreeMap;

use cove_lifecycle::{
    DesiredState, SandboxState, TimerSettings, Transition, MAX_MINUTES, MINUTE_MS,
};
use cove_store::{SandboxRecord, SnapshotState, StoreError};

use crate::{now_ms, Engine, EngineError};

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
}

/// Names are used in URLs and as host names: keep them plain.
pub(crate) fn check_name(name: &str) -> Result<(), EngineError> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        Ok(())
    } else {
        Err(EngineError::Invalid {
            field: "name",
            reason: format!("{name:?} must be 1 to 63 letters, digits, '-', '_' or '.'"),
        })
    }
}

/// The vCPUs, memory (MiB) and disk (GiB) of a sandbox, from a request that
/// gives memory in GiB as Daytona's does; each defaults to `base`'s, is at
/// least 1 and within the ceilings.
pub(crate) fn sized(
    ceilings: crate::Ceilings,
    (cpu, memory_gib, disk_gib): (Option<i64>, Option<i64>, Option<i64>),
    base: &cove_store::SnapshotRecord,
) -> Result<(i64, i64, i64), EngineError> {
    let memory_mib = match memory_gib {
        Some(gib) => resource("memory", Some(gib), 1, ceilings.memory_gib)? * 1024,
        // A snapshot may hold less than a GiB (a 256 MiB VM).
        None if base.memory_mib > ceilings.memory_gib * 1024 => {
            return Err(EngineError::AboveCeiling {
                field: "memory",
                requested: (base.memory_mib + 1023) / 1024,
                ceiling: ceilings.memory_gib,
            })
        }
        None => base.memory_mib.max(1),
    };
    Ok((
        resource("cpu", cpu, base.cpu.max(1), ceilings.cpu)?,
        memory_mib,
        resource("disk", disk_gib, base.disk_gib.max(1), ceilings.disk_gib)?,
    ))
}

fn resource(
    field: &'static str,
    requested: Option<i64>,
    default: i64,
    ceiling: i64,
) -> Result<i64, EngineError> {
    let value = requested.unwrap_or(default);
    if value < 1 {
        return Err(EngineError::Invalid {
            field,
            reason: format!("must be at least 1, got {value}"),
        });
    }
    if value > ceiling {
        return Err(EngineError::AboveCeiling {
            field,
            requested: value,
            ceiling,
        });
    }
    Ok(value)
}

impl Engine {
    /// Creates and starts a sandbox. It is either `started` when this returns, or it
    /// does not exist at all.
    pub async fn create(&self, request: CreateSandbox) -> Result<SandboxRecord, EngineError> {
        let config = &self.inner.config;
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
                self.dockerfile_snapshot(text, &request.build_contexts)
                    .await?
            }
            None => self
                .inner
                .store
                .find_snapshot(&snapshot_name)
                .await?
                .ok_or_else(|| EngineError::SnapshotNotFound {
                    name: snapshot_name.clone(),
                })?,
        };
        if snapshot.state != SnapshotState::Active {
            return Err(EngineError::SnapshotNotActive {
                name: snapshot.name.clone(),
                state: snapshot.state.as_str(),
            });
        }
        crate::network::policy(&request.network)?;
        if request.network != cove_store::NetworkSettings::default() && self.network().is_none() {
            return Err(EngineError::NotImplemented {
                what: format!(
                    "network policies for {} sandboxes on this server (no sandbox networking)",
                    snapshot.class
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
        let (cpu, memory_mib, disk_gib) = sized(
            config.ceilings,
            (request.cpu, request.memory_gib, request.disk_gib),
            &snapshot,
        )?;
        if let Some(gpu) = request.gpu.filter(|gpu| *gpu != 0) {
            return Err(EngineError::AboveCeiling {
                field: "gpu",
                requested: gpu,
                ceiling: 0,
            });
        }
        // The image's USER, else the server's; root may always be asked for.
        let image_user = snapshot.image.user.clone();
        let default_user = image_user.clone().unwrap_or_else(|| config.os_user.clone());
        let user = request.user.clone().unwrap_or_else(|| default_user.clone());
        if user != config.os_user && Some(&user) != image_user.as_ref() {
            return Err(EngineError::Invalid {
                field: "user",
                reason: format!(
                    "{user:?} does not exist here; sandboxes of snapshot {} run as {default_user:?}",
                    snapshot.name
                ),
            });
        }
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
            snapshot.class,
            auto_stop,
            request.auto_pause,
            request.auto_archive,
            request.auto_delete,
        )?;
        let ttl_minutes = request.ttl_minutes.unwrap_or(0);
        if !(0..=MAX_MINUTES).contains(&ttl_minutes) {
            return Err(EngineError::Invalid {
                field: "ttlMinutes",
                reason: format!("must be 0 (off) to {MAX_MINUTES}, got {ttl_minutes}"),
            });
        }
        for key in request.env.keys() {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                return Err(EngineError::Invalid {
                    field: "env",
                    reason: format!("{key:?} is not a valid variable name"),
                });
            }
        }
        let id = uuid::Uuid::new_v4().to_string();
        let name = request.name.clone().unwrap_or_else(|| id.clone());
        check_name(&name)?;
        let volumes = self.resolve_mounts(&snapshot, &request.volumes).await?;

        let now = now_ms();
        let Transition::Run { during, .. } = Transition::create() else {
            unreachable!("create always runs")
        };
        let mut record = SandboxRecord {
            id: id.clone(),
            name: name.clone(),
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
            network: request.network.clone(),
            volumes,
        };
        // Checked before the row exists: no half-made sandbox for a class this
        // server cannot run.
        let runtime = self.runtime(record.class)?.clone();
        let lock = self.lock_for(&id);
        let _guard = lock.lock().await;
        self.inner
            .store
            .insert_sandbox(&record)
            .await
            .map_err(|e| match e {
                StoreError::Duplicate { .. } => EngineError::NameTaken { name },
                other => other.into(),
            })?;

        let spec = self.spec(&record, &snapshot);
        let made = async {
            runtime.prepare(&spec).await?;
            self.start_machine(runtime.as_ref(), &record, spec).await
        }
        .await;
        let started = match made {
            Ok(started) => started,
            Err(error) => {
                // No half-made sandbox: undo the runtime's work, then forget the row.
                if let Err(cleanup) = runtime.destroy(&id).await {
                    let cleanup = crate::error::describe(&cleanup);
                    tracing::error!(sandbox = %id, error = %cleanup, "cleanup after a failed create");
                }
                if let Err(cleanup) = self.release_network(&record).await {
                    let cleanup = crate::error::describe(&cleanup);
                    tracing::error!(sandbox = %id, error = %cleanup, "cleanup after a failed create");
                }
                self.inner.store.delete_sandbox(&id).await?;
                return Err(error.named(&id, "be created"));
            }
        };
        self.register_running(&id, started);
        record.state = SandboxState::Started;
        record.state_since_ms = now_ms();
        record.updated_at_ms = record.state_since_ms;
        self.inner.store.save_sandbox(&record).await?;
        tracing::info!(sandbox = %id, name = %record.name, snapshot = %record.snapshot, "created");
        Ok(record)
    }

    pub(crate) fn spec(
        &self,
        record: &SandboxRecord,
        snapshot: &cove_store::SnapshotRecord,
    ) -> cove_runtime::SandboxSpec {
        cove_runtime::SandboxSpec {
            id: record.id.clone(),
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
            volumes: self.volume_binds(record),
            workdir: snapshot.image.workdir.clone(),
            user: (record.os_user != self.inner.config.os_user).then(|| record.os_user.clone()),
            command: snapshot.image.command(),
        }
    }
}
