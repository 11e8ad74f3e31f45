//! Forks: a new sandbox with a copy of a running VM's disk and memory, and the
//! tree of who was forked from whom.
//!
//! The parent goes through `forking` while the runtime copies it (it is frozen
//! only for the copy) and lands back in `started`; the child is made like any
//! new sandbox: it is either `started` when `fork` returns or it never existed.

use cove_lifecycle::{plan, DesiredState, Operation, SandboxState, Transition};
use cove_store::SandboxRecord;

use super::Sandboxes;
use crate::checks::check_name;
use crate::metrics::Measured;
use crate::shared::sandbox_id;
use crate::{now_ms, EngineError};

impl Sandboxes {
    /// Forks started sandbox `id_or_name` into a new sandbox named `name` (or
    /// its id). Returns the child, `started`.
    pub async fn fork(
        &self,
        id_or_name: &str,
        name: Option<&str>,
    ) -> Result<SandboxRecord, EngineError> {
        let parent_id = self.get(id_or_name).await?.id;
        let lock = self.shared.lock_for(&parent_id);
        let _guard = lock.lock().await;
        let mut parent = self.get(&parent_id).await?;
        if !parent.volumes.is_empty() {
            return Err(EngineError::HasVolumes {
                id: parent.id,
                action: "fork",
                instead: "take a snapshot without memory and create from it",
            });
        }
        let transition = plan(Operation::Fork, parent.state, parent.class).map_err(|source| {
            EngineError::Transition {
                id: parent.id.clone(),
                source,
            }
        })?;
        let Transition::Run { during, .. } = transition else {
            unreachable!("a fork always runs")
        };
        let child_id = uuid::Uuid::new_v4().to_string();
        let child_name = name.map(str::to_owned).unwrap_or_else(|| child_id.clone());
        check_name(&child_name)?;
        let snapshot = self
            .own_snapshot(&parent)
            .await
            .map_err(|failure| failure.named(&parent.id, "fork"))?;

        let child = child_of(&parent, child_id.clone(), child_name);
        // Checked before the child's row exists.
        let runtime = self.shared.runtime(parent.class)?.clone();
        let parent_sandbox = sandbox_id(&parent.id)?;
        let spec = self.spec(&child, &snapshot)?;
        let child_lock = self.shared.lock_for(&child_id);
        let _child_guard = child_lock.lock().await;
        let saga = self
            .begin_new(child, Measured::Run(Operation::Fork))
            .await?;

        parent.state = during;
        self.shared.save_state(&mut parent).await?;
        let copied = runtime.fork(&parent_sandbox, &spec).await;
        // The parent is running again whatever became of the child, unless the
        // copy ended it.
        parent.state = if runtime.is_running(&parent_sandbox).await {
            SandboxState::Started
        } else {
            parent.error_reason = Some("the sandbox ended while it was forked".into());
            SandboxState::Error
        };
        self.shared.save_state(&mut parent).await?;
        let made = match copied {
            Ok(()) => {
                self.start_machine(runtime.as_ref(), saga.record(), spec)
                    .await
            }
            Err(error) => Err(error.into()),
        };
        let child = saga.finish(made, &parent.id, "fork").await?;
        tracing::info!(parent = %parent.id, child = %child.id, name = %child.name, "forked");
        Ok(child)
    }

    /// The sandbox `id_or_name` was forked from, if it still exists.
    pub async fn fork_parent(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        let record = self.get(id_or_name).await?;
        let Some(parent) = record.parent_id else {
            return Err(EngineError::Invalid {
                field: "sandbox",
                reason: format!("sandbox {} was not forked from another sandbox", record.id),
            });
        };
        self.get(&parent).await
    }

    /// The sandboxes forked directly from `id_or_name`, oldest first.
    pub async fn forks(&self, id_or_name: &str) -> Result<Vec<SandboxRecord>, EngineError> {
        let record = self.get(id_or_name).await?;
        Ok(self
            .list()
            .await?
            .into_iter()
            .filter(|s| s.parent_id.as_deref() == Some(record.id.as_str()))
            .collect())
    }

    /// The fork parents of `id_or_name`, nearest first, as far back as they exist.
    pub async fn fork_ancestors(
        &self,
        id_or_name: &str,
    ) -> Result<Vec<SandboxRecord>, EngineError> {
        let record = self.get(id_or_name).await?;
        let mut ancestors: Vec<SandboxRecord> = Vec::new();
        let mut next = record.parent_id;
        while let Some(id) = next {
            // A deleted ancestor ends the chain; a cycle cannot be stored, but
            // never loop on a corrupt one.
            let Ok(parent) = self.get(&id).await else {
                break;
            };
            if ancestors.iter().any(|a| a.id == parent.id) || parent.id == record.id {
                break;
            }
            next = parent.parent_id.clone();
            ancestors.push(parent);
        }
        Ok(ancestors)
    }

    /// Refuses to delete a sandbox that still has fork children.
    pub(crate) async fn check_no_forks(&self, record: &SandboxRecord) -> Result<(), EngineError> {
        let children: Vec<String> = self
            .shared
            .store
            .list_sandboxes()
            .await?
            .into_iter()
            .filter(|s| s.parent_id.as_deref() == Some(record.id.as_str()))
            .map(|s| s.name)
            .collect();
        if children.is_empty() {
            Ok(())
        } else {
            Err(EngineError::HasForks {
                id: record.id.clone(),
                children,
            })
        }
    }
}

/// The record of a new fork of `parent`: its settings, a new identity, and
/// its own clocks.
fn child_of(parent: &SandboxRecord, id: String, name: String) -> SandboxRecord {
    let now = now_ms();
    SandboxRecord {
        id,
        name,
        state: SandboxState::Creating,
        desired_state: DesiredState::Started,
        error_reason: None,
        parent_id: Some(parent.id.clone()),
        // A fork is nobody's link: links are made at create only.
        linked_sandbox_id: None,
        ttl_deadline_ms: (parent.ttl_minutes > 0)
            .then(|| now + parent.ttl_minutes * cove_lifecycle::MINUTE_MS),
        created_at_ms: now,
        updated_at_ms: now,
        state_since_ms: now,
        last_activity_ms: now,
        ..parent.clone()
    }
}
