//! Snapshots: named, read-only captures of a sandbox's filesystem that new
//! sandboxes start from, and that their source sandbox can revert to.
//!
//! A snapshot of a sandbox is its writable layer captured by the runtime, stacked
//! on the layers of the snapshot the sandbox came from; a sandbox created from it
//! mounts those layers read-only under a fresh writable layer, so nothing is copied.

use cove_lifecycle::{Operation, SandboxClass};
use cove_store::{SandboxRecord, SnapshotRecord, SnapshotState, StoreError};

use crate::create::check_name;
use crate::failure::Failure;
use crate::operations::Effect;
use crate::{now_ms, Engine, EngineError};

/// What a user asked a capture to be.
#[derive(Clone, Debug)]
pub(crate) struct CaptureRequest {
    name: String,
    /// Capture the machine's memory too (a started VM).
    memory: bool,
}

impl Engine {
    /// Captures the filesystem of a sandbox (started or stopped) as snapshot `name`.
    /// A started sandbox keeps running. Returns the sandbox, back in its state.
    pub async fn snapshot(
        &self,
        id_or_name: &str,
        name: &str,
        include_memory: bool,
    ) -> Result<SandboxRecord, EngineError> {
        let record = self.get(id_or_name).await?;
        check_name(name).map_err(|_| EngineError::Invalid {
            field: "name",
            reason: format!(
                "snapshot name {name:?} must be 1 to 63 letters, digits, '-', '_' or '.'"
            ),
        })?;
        if include_memory && record.class == SandboxClass::Container {
            return Err(EngineError::Invalid {
                field: "includeMemory",
                reason: "container sandboxes do not support memory snapshots; \
                         take a filesystem snapshot (includeMemory false) or use a VM sandbox"
                    .into(),
            });
        }
        if include_memory && record.state != cove_lifecycle::SandboxState::Started {
            return Err(EngineError::Invalid {
                field: "includeMemory",
                reason: format!(
                    "a memory snapshot needs a started sandbox; {} is {}",
                    record.id, record.state
                ),
            });
        }
        if include_memory && !record.volumes.is_empty() {
            return Err(EngineError::HasVolumes {
                id: record.id,
                action: "take a memory snapshot",
                instead: "take one without memory",
            });
        }
        if self.inner.store.find_snapshot(name).await?.is_some() {
            return Err(EngineError::SnapshotTaken {
                name: name.to_owned(),
            });
        }
        let request = CaptureRequest {
            name: name.to_owned(),
            memory: include_memory,
        };
        self.run_effect(&record.id, Operation::Snapshot, Effect::Capture(request))
            .await
    }

    /// Rewinds a sandbox to a snapshot taken from it; a started sandbox is
    /// started again on the restored filesystem.
    pub async fn revert(
        &self,
        id_or_name: &str,
        snapshot: &str,
    ) -> Result<SandboxRecord, EngineError> {
        let record = self.get(id_or_name).await?;
        let found = self.get_snapshot(snapshot).await?;
        let capture_id = match (&found.source_sandbox, &found.capture_id) {
            (Some(source), Some(capture)) if *source == record.id => capture.clone(),
            _ => {
                return Err(EngineError::Invalid {
                    field: "snapshot",
                    reason: format!(
                        "snapshot {} was not taken from sandbox {}; a sandbox reverts only to its own snapshots",
                        found.name, record.id
                    ),
                })
            }
        };
        self.run_effect(
            &record.id,
            Operation::Revert,
            Effect::Restore { capture_id },
        )
        .await
    }

    /// The snapshot with this id or name.
    pub async fn get_snapshot(&self, id_or_name: &str) -> Result<SnapshotRecord, EngineError> {
        self.inner
            .store
            .find_snapshot(id_or_name)
            .await?
            .ok_or_else(|| EngineError::SnapshotNotFound {
                name: id_or_name.to_owned(),
            })
    }

    /// Makes an inactive snapshot usable again for new sandboxes.
    pub async fn activate_snapshot(&self, id_or_name: &str) -> Result<SnapshotRecord, EngineError> {
        let mut snapshot = self.get_snapshot(id_or_name).await?;
        if snapshot.state != SnapshotState::Inactive {
            return Err(EngineError::Invalid {
                field: "snapshot",
                reason: format!(
                    "snapshot {} is {}; only an inactive snapshot can be activated",
                    snapshot.name,
                    snapshot.state.as_str()
                ),
            });
        }
        snapshot.state = SnapshotState::Active;
        snapshot.updated_at_ms = now_ms();
        self.inner.store.save_snapshot(&snapshot).await?;
        tracing::info!(snapshot = %snapshot.name, "snapshot activated");
        Ok(snapshot)
    }

    /// Keeps a snapshot (and the sandboxes made from it) but refuses new
    /// sandboxes from it until it is activated again.
    pub async fn deactivate_snapshot(
        &self,
        id_or_name: &str,
    ) -> Result<SnapshotRecord, EngineError> {
        let mut snapshot = self.get_snapshot(id_or_name).await?;
        if snapshot.general {
            return Err(EngineError::Invalid {
                field: "snapshot",
                reason: format!(
                    "{} is provided by the server and cannot be deactivated",
                    snapshot.name
                ),
            });
        }
        if snapshot.state != SnapshotState::Active {
            return Err(EngineError::Invalid {
                field: "snapshot",
                reason: format!(
                    "snapshot {} is {}; only an active snapshot can be deactivated",
                    snapshot.name,
                    snapshot.state.as_str()
                ),
            });
        }
        snapshot.state = SnapshotState::Inactive;
        snapshot.updated_at_ms = now_ms();
        self.inner.store.save_snapshot(&snapshot).await?;
        tracing::info!(snapshot = %snapshot.name, "snapshot deactivated");
        Ok(snapshot)
    }

    /// Deletes a snapshot nothing depends on: no sandbox runs on it and no other
    /// snapshot is stacked on it.
    pub async fn delete_snapshot(&self, id_or_name: &str) -> Result<SnapshotRecord, EngineError> {
        let snapshot = self.get_snapshot(id_or_name).await?;
        if snapshot.general {
            return Err(EngineError::Invalid {
                field: "snapshot",
                reason: format!(
                    "{} is provided by the server and cannot be deleted",
                    snapshot.name
                ),
            });
        }
        let mut users: Vec<String> = Vec::new();
        let all = self.inner.store.list_snapshots().await?;
        // Only a snapshot that owns its top layer (a capture) can pull it from
        // under others; built images share cached layers they do not own.
        let top = snapshot
            .capture_id
            .as_ref()
            .and_then(|_| snapshot.layers.first());
        for other in all.iter().filter(|o| o.id != snapshot.id) {
            if top.is_some_and(|layer| other.layers.contains(layer)) {
                users.push(format!("snapshot {}", other.name));
            }
        }
        for sandbox in self.inner.store.list_sandboxes().await? {
            if sandbox.snapshot == snapshot.name {
                users.push(format!("sandbox {}", sandbox.name));
            }
        }
        if !users.is_empty() {
            return Err(EngineError::InUse {
                what: format!("snapshot {}", snapshot.name),
                users,
            });
        }
        if let Some(capture) = &snapshot.capture_id {
            let runtime = self.runtime(snapshot.class)?;
            runtime
                .discard_capture(capture)
                .await
                .map_err(EngineError::runtime(&snapshot.id, "delete its snapshot"))?;
        }
        self.inner.store.delete_snapshot(&snapshot.id).await?;
        self.inner.builds.lock().unwrap().remove(&snapshot.id);
        tracing::info!(snapshot = %snapshot.name, "snapshot deleted");
        Ok(snapshot)
    }

    /// The snapshot a sandbox was created from, which holds its lower layers.
    pub(crate) async fn own_snapshot(
        &self,
        record: &SandboxRecord,
    ) -> Result<SnapshotRecord, Failure> {
        self.inner
            .store
            .find_snapshot(&record.snapshot)
            .await
            .map_err(EngineError::from)?
            .ok_or_else(|| Failure::SnapshotGone {
                name: record.snapshot.clone(),
            })
    }

    /// The side effect of a snapshot: capture, then record the new snapshot.
    pub(crate) async fn capture(
        &self,
        record: &SandboxRecord,
        request: CaptureRequest,
    ) -> Result<(), Failure> {
        let runtime = self.runtime(record.class)?.clone();
        let base = self.own_snapshot(record).await?;
        let capture_id = uuid::Uuid::new_v4().to_string();
        let layer = if request.memory {
            runtime.capture_with_memory(&record.id, &capture_id).await
        } else {
            runtime.capture(&record.id, &capture_id).await
        }?;
        let now = now_ms();
        let snapshot = SnapshotRecord {
            id: capture_id.clone(),
            name: request.name.clone(),
            class: record.class,
            state: SnapshotState::Active,
            error_reason: None,
            rootfs: base.rootfs.clone(),
            layers: std::iter::once(layer.display().to_string())
                .chain(base.layers.clone())
                .collect(),
            capture_id: Some(capture_id.clone()),
            source_sandbox: Some(record.id.clone()),
            cpu: record.cpu,
            gpu: record.gpu,
            memory_mib: record.memory_mib,
            disk_gib: record.disk_gib,
            size_bytes: None,
            has_memory: request.memory,
            env: base.env.clone(),
            image: base.image.clone(),
            general: false,
            created_at_ms: now,
            updated_at_ms: now,
        };
        if let Err(error) = self.inner.store.insert_snapshot(&snapshot).await {
            // No orphan capture when the name was taken meanwhile.
            let _ = runtime.discard_capture(&capture_id).await;
            return Err(match error {
                StoreError::Duplicate { name } => EngineError::SnapshotTaken { name },
                other => other.into(),
            }
            .into());
        }
        tracing::info!(sandbox = %record.id, snapshot = %request.name, "snapshot taken");
        Ok(())
    }
}
