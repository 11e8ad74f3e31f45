//! The snapshots part of the engine: the images sandboxes are created from.
//!
//! A snapshot is pulled from a registry, built from a Dockerfile (with the
//! build contexts uploaded for it), imported, or captured from a sandbox (see
//! the sandboxes part). This part lists, activates, deactivates and deletes
//! them, and runs their pulls and builds.

mod build;
mod contexts;
mod images;
mod registries;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cove_store::{SnapshotRecord, SnapshotState};

use crate::organizations::Scope;
use crate::shared::Shared;
use crate::{now_ms, EngineError};

pub use build::{parse_dockerfile, BuildLog, DockerfilePlan};
pub use contexts::{ContextObject, DeclaredSha256, PushGrant};
pub use images::ImageSnapshotRequest;
pub use registries::{registry_host, RegistryRequest};

/// Snapshots and their builds. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Snapshots {
    shared: Arc<Shared>,
    /// Build logs of image builds since the server started, by snapshot id.
    builds: Arc<Mutex<HashMap<String, Arc<BuildLog>>>>,
    /// Uploaded build contexts and the grants to upload them.
    contexts: Option<Arc<contexts::ContextStore>>,
    /// Whose snapshots (and registries) these are, besides the general ones.
    scope: Scope,
}

impl Snapshots {
    pub(crate) fn new(shared: Arc<Shared>) -> Snapshots {
        let contexts = shared.config.build_contexts_dir.clone().map(|dir| {
            Arc::new(contexts::ContextStore::new(
                dir,
                shared.config.context_limits,
            ))
        });
        Snapshots {
            shared,
            builds: Arc::default(),
            contexts,
            scope: Scope::Server,
        }
    }

    /// These snapshots as `scope` sees them.
    pub(crate) fn scoped(&self, scope: Scope) -> Snapshots {
        Snapshots {
            scope,
            ..self.clone()
        }
    }

    /// Every snapshot sandboxes (of this handle's organization) can be
    /// created from: its own and the general ones.
    pub async fn list(&self) -> Result<Vec<SnapshotRecord>, EngineError> {
        let mut all = self.shared.store.list_snapshots().await?;
        all.retain(|s| s.general || self.scope.sees(&s.organization_id));
        Ok(all)
    }

    /// Registers a snapshot (the server's own default image, for one).
    pub async fn register(&self, snapshot: &SnapshotRecord) -> Result<(), EngineError> {
        Ok(self.shared.store.save_snapshot(snapshot).await?)
    }

    /// The snapshot with this id or name (of this handle's organization, or
    /// a general one).
    pub async fn get(&self, id_or_name: &str) -> Result<SnapshotRecord, EngineError> {
        self.shared
            .store
            .find_snapshot(self.scope.filter(), id_or_name)
            .await?
            .ok_or_else(|| EngineError::SnapshotNotFound {
                name: id_or_name.to_owned(),
            })
    }

    /// Makes an inactive snapshot usable again for new sandboxes.
    pub async fn activate(&self, id_or_name: &str) -> Result<SnapshotRecord, EngineError> {
        let mut snapshot = self.get(id_or_name).await?;
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
        self.shared.store.save_snapshot(&snapshot).await?;
        tracing::info!(snapshot = %snapshot.name, "snapshot activated");
        Ok(snapshot)
    }

    /// Keeps a snapshot (and the sandboxes made from it) but refuses new
    /// sandboxes from it until it is activated again.
    pub async fn deactivate(&self, id_or_name: &str) -> Result<SnapshotRecord, EngineError> {
        let mut snapshot = self.get(id_or_name).await?;
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
        self.shared.store.save_snapshot(&snapshot).await?;
        tracing::info!(snapshot = %snapshot.name, "snapshot deactivated");
        Ok(snapshot)
    }

    /// Deletes a snapshot nothing depends on: no sandbox runs on it and no other
    /// snapshot is stacked on it.
    pub async fn delete(&self, id_or_name: &str) -> Result<SnapshotRecord, EngineError> {
        let snapshot = self.get(id_or_name).await?;
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
        let all = self.shared.store.list_snapshots().await?;
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
        for sandbox in self.shared.store.list_sandboxes().await? {
            if sandbox.snapshot == snapshot.name
                && sandbox.organization_id == snapshot.organization_id
            {
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
            let runtime = self.shared.runtime(snapshot.class)?;
            runtime
                .discard_capture(capture)
                .await
                .map_err(EngineError::runtime(&snapshot.id, "delete its snapshot"))?;
            self.shared.discard_layer_on_runners(capture);
        }
        self.shared
            .store
            .delete_snapshot(&snapshot.id, crate::now_ms())
            .await?;
        self.builds.lock().unwrap().remove(&snapshot.id);
        tracing::info!(snapshot = %snapshot.name, "snapshot deleted");
        Ok(snapshot)
    }

    /// Ends what the last server was building: a build does not survive its
    /// server. Its snapshots are marked failed, its scratch and build
    /// sandboxes removed.
    pub(crate) async fn recover_after_restart(&self) -> Result<(), EngineError> {
        // A build does not survive its server: say so rather than build forever.
        for mut snapshot in self.shared.store.list_snapshots().await? {
            if matches!(
                snapshot.state,
                cove_store::SnapshotState::Building
                    | cove_store::SnapshotState::Pending
                    | cove_store::SnapshotState::Pulling
            ) {
                snapshot.state = cove_store::SnapshotState::Error;
                snapshot.error_reason = Some(
                    "the server restarted while the image was being pulled or built; delete the snapshot and create it again"
                        .into(),
                );
                snapshot.updated_at_ms = crate::now_ms();
                self.shared.store.save_snapshot(&snapshot).await?;
                tracing::warn!(snapshot = %snapshot.name, "build interrupted by a restart");
            }
        }
        self.clear_context_scratch();
        self.remove_leftover_build_sandboxes().await
    }
}
