//! The sandboxes part of the engine: every sandbox's lifecycle.
//!
//! It takes an operation, asks the lifecycle whether it is allowed, records
//! the transient state, drives the runtime and the network, and records where
//! the sandbox landed. Creating and forking share one saga (`saga.rs`);
//! captures and reverts, timers and the recovery after a restart are here too.

mod capture;
mod create;
mod effect;
mod forks;
mod network;
mod operations;
mod recovery;
mod running;
mod saga;
mod settings;
mod timers;

use std::sync::Arc;

use cove_runtime::AgentEndpoint;
use cove_store::{SandboxOrder, SandboxRecord, SandboxSortField, SortDirection};

use crate::organizations::Scope;
use crate::shared::Shared;
use crate::{EngineError, SandboxState, Snapshots, Volumes};

pub use create::CreateSandbox;
pub use forks::MAX_FORK_CHILDREN;

pub use settings::SettingChange;

/// Sandboxes and what they run. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Sandboxes {
    shared: Arc<Shared>,
    /// Where a sandbox's image comes from (and a Dockerfile is built).
    snapshots: Snapshots,
    /// What a sandbox mounts.
    volumes: Volumes,
    /// Whose sandboxes these are.
    scope: Scope,
}

impl Sandboxes {
    pub(crate) fn new(shared: Arc<Shared>, snapshots: Snapshots, volumes: Volumes) -> Sandboxes {
        Sandboxes {
            shared,
            snapshots,
            volumes,
            scope: Scope::Server,
        }
    }

    /// These sandboxes as `scope` sees them (with its snapshots and volumes).
    pub(crate) fn scoped(&self, scope: Scope) -> Sandboxes {
        Sandboxes {
            shared: self.shared.clone(),
            snapshots: self.snapshots.scoped(scope.clone()),
            volumes: self.volumes.scoped(scope.clone()),
            scope,
        }
    }

    /// The sandbox with this id or name (in this handle's organization).
    pub async fn get(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        self.shared
            .sandbox_in(self.scope.filter(), id_or_name)
            .await
    }

    /// Every sandbox (of this handle's organization), oldest first.
    pub async fn list(&self) -> Result<Vec<SandboxRecord>, EngineError> {
        let mut records = self.shared.sandboxes().await?;
        records.retain(|r| self.scope.sees(&r.organization_id));
        Ok(records)
    }

    /// Every sandbox in `order`, which the store's query gives (ties in
    /// creation order), so any page cut from the list is consistent.
    pub async fn list_ordered(
        &self,
        order: SandboxOrder,
    ) -> Result<Vec<SandboxRecord>, EngineError> {
        let mut records = self
            .shared
            .store
            .list_sandboxes_ordered(self.scope.filter(), order)
            .await?;
        for record in &mut records {
            self.shared.activity.apply(record);
        }
        if order.field == SandboxSortField::LastActivityAt {
            // Recent interactions are held in memory until the next timer
            // tick; the stored column may lag them. A stable sort keeps the
            // query's order among equals.
            match order.direction {
                SortDirection::Ascending => records.sort_by_key(|r| r.last_activity_ms),
                SortDirection::Descending => {
                    records.sort_by_key(|r| std::cmp::Reverse(r.last_activity_ms))
                }
            }
        }
        Ok(records)
    }

    /// Where the agent of a started sandbox listens; counts as an interaction.
    pub async fn toolbox(&self, id_or_name: &str) -> Result<(String, AgentEndpoint), EngineError> {
        // A running sandbox of this organization named by its id (what the
        // SDKs send) needs no store read; a name, or a sandbox that does
        // not run, is looked up and answered as `agent` does.
        let running = self
            .shared
            .running(id_or_name)
            .filter(|running| self.scope.sees(&running.organization_id));
        if let Some(running) = running {
            self.touch(id_or_name);
            return Ok((id_or_name.to_owned(), running.agent));
        }
        let (record, agent) = self.agent(id_or_name).await?;
        self.touch(&record.id);
        Ok((record.id, agent))
    }

    /// Where the agent of a started sandbox listens, without counting as an
    /// interaction (previews are application traffic, not use of cove).
    pub async fn agent(
        &self,
        id_or_name: &str,
    ) -> Result<(SandboxRecord, AgentEndpoint), EngineError> {
        let record = self.get(id_or_name).await?;
        let running = (record.state == SandboxState::Started)
            .then(|| self.shared.running(&record.id))
            .flatten();
        match running {
            Some(running) => Ok((record, running.agent)),
            None => Err(EngineError::NotStarted {
                id: record.id,
                state: record.state,
            }),
        }
    }

    /// How a running VM executes ("kvm" or "tcg"); `None` for containers and
    /// for sandboxes that are not running.
    pub fn accelerator(&self, id: &str) -> Option<&'static str> {
        self.shared.running(id).and_then(|r| r.accelerator)
    }

    /// Resets the idle clock of a sandbox.
    pub fn touch(&self, id: &str) {
        self.shared.activity.touch(id, crate::now_ms());
    }
}
