//! Snapshots: named, read-only captures of a sandbox's filesystem that new
//! sandboxes start from, and that their source sandbox can revert to.
//!
//! A snapshot of a sandbox is its writable layer captured by the runtime, stacked
//! on the layers of the snapshot the sandbox came from; a sandbox created from it
//! mounts those layers read-only under a fresh writable layer, so nothing is copied.

use cove_lifecycle::{Operation, SandboxClass};
use cove_store::{SandboxRecord, SnapshotRecord, SnapshotState, StoreError};

use super::effect::{CaptureRequest, Effect};
use super::Sandboxes;
use crate::checks::check_name;
use crate::failure::Failure;
use crate::{now_ms, EngineError};

impl Sandboxes {
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
        let org = Some(record.organization_id.as_str());
        if self.shared.store.find_snapshot(org, name).await?.is_some() {
            return Err(EngineError::SnapshotTaken {
                name: name.to_owned(),
            });
        }
        // Refused before the sandbox is touched; the check is made again
        // where the snapshot's row is stored, for a snapshot made meanwhile.
        drop(
            self.shared
                .admit_count(&record.organization_id, crate::quota::Counted::Snapshots)
                .await?,
        );
        let request = CaptureRequest {
            name: name.to_owned(),
            memory: include_memory,
        };
        self.run_effect(&record.id, Operation::Snapshot, Effect::Capture(request))
            .await
    }

    /// Rewinds a sandbox to a snapshot taken from it; a started sandbox is
    /// started again on the reverted filesystem.
    pub async fn revert(
        &self,
        id_or_name: &str,
        snapshot: &str,
    ) -> Result<SandboxRecord, EngineError> {
        let record = self.get(id_or_name).await?;
        let found = self.snapshots.get(snapshot).await?;
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
        self.run_effect(&record.id, Operation::Revert, Effect::Revert { capture_id })
            .await
    }

    /// The snapshot a sandbox was created from, which holds its lower layers.
    pub(crate) async fn own_snapshot(
        &self,
        record: &SandboxRecord,
    ) -> Result<SnapshotRecord, Failure> {
        self.shared
            .store
            .find_snapshot(Some(&record.organization_id), &record.snapshot)
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
        sandbox: &cove_runtime::SandboxId,
        request: CaptureRequest,
    ) -> Result<(), Failure> {
        let runtime = self.shared.runtime_of(record)?;
        let base = self.own_snapshot(record).await?;
        let capture_id = uuid::Uuid::new_v4().to_string();
        let layer = if request.memory {
            runtime.capture_with_memory(sandbox, &capture_id).await
        } else {
            runtime.capture(sandbox, &capture_id).await
        }?;
        let now = now_ms();
        let snapshot = SnapshotRecord {
            id: capture_id.clone(),
            organization_id: record.organization_id.clone(),
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
        let admitted = self
            .shared
            .admit_count(&record.organization_id, crate::quota::Counted::Snapshots)
            .await;
        let inserted = match admitted {
            Ok(_admitted) => self.shared.store.insert_snapshot(&snapshot).await,
            Err(refused) => {
                let _ = runtime.discard_capture(&capture_id).await;
                return Err(refused.into());
            }
        };
        if let Err(error) = inserted {
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
