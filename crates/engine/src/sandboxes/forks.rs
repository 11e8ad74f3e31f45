//! Forks: a new sandbox with a copy of a running VM's disk and memory, and the
//! tree of who was forked from whom.
//!
//! The parent goes through `forking` while the runtime copies it (it is frozen
//! only for the copy) and lands back in `started`; the child is made like any
//! new sandbox: it is either `started` when `fork` returns or it never existed.

use std::time::Instant;

use cove_lifecycle::{plan, DesiredState, Operation, SandboxState, Transition};
use cove_store::SandboxRecord;

use super::saga::Saga;
use super::Sandboxes;
use crate::checks::check_name;
use crate::metrics::Measured;
use crate::runners::Need;
use crate::shared::sandbox_id;
use crate::{now_ms, EngineError};

/// The most children one fork may make at once: each is a new sandbox
/// started at the same moment, and a request for more is likely a mistake.
pub const MAX_FORK_CHILDREN: usize = 32;

impl Sandboxes {
    /// Forks started sandbox `id_or_name` into a new sandbox named `name` (or
    /// its id). Returns the child, `started`.
    pub async fn fork(
        &self,
        id_or_name: &str,
        name: Option<&str>,
    ) -> Result<SandboxRecord, EngineError> {
        let mut children = self
            .fork_many(id_or_name, &[name.map(str::to_owned)])
            .await?;
        Ok(children.remove(0))
    }

    /// Forks started sandbox `id_or_name` into one new sandbox per entry of
    /// `names` (each named so, or by its id), all from one instant of the
    /// parent, which is frozen once for them all; the children then start
    /// at the same time. Returns them, `started`, in the order of `names`.
    ///
    /// All or nothing: each child counts against the quota as a create
    /// does, and if any child cannot be made (refused, or its copy or start
    /// fails) every child made so far is removed and the error is that
    /// child's. The parent runs on in every case.
    pub async fn fork_many(
        &self,
        id_or_name: &str,
        names: &[Option<String>],
    ) -> Result<Vec<SandboxRecord>, EngineError> {
        check_fork_count(names)?;
        let began = Instant::now();
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
        let children: Vec<SandboxRecord> = names
            .iter()
            .map(|name| {
                let child_id = uuid::Uuid::new_v4().to_string();
                let child_name = name.clone().unwrap_or_else(|| child_id.clone());
                check_name(&child_name)?;
                Ok(child_of(&parent, child_id, child_name))
            })
            .collect::<Result<_, EngineError>>()?;
        // A child is a copy made on its parent's runner: that one must be
        // able to take it.
        let runner =
            (parent.runner_id.clone()).unwrap_or_else(|| self.shared.config.runner.id.clone());
        if !self.shared.is_local(&parent) {
            return Err(EngineError::NotImplemented {
                what: format!("forking a sandbox on runner {runner}, on another machine,"),
            });
        }
        for child in &children {
            self.shared.place(Need::of(child), Some(&runner))?;
        }
        let snapshot = self
            .own_snapshot(&parent)
            .await
            .map_err(|failure| failure.named(&parent.id, "fork"))?;
        // Checked before any child's row exists.
        let runtime = self.shared.runtime_of(&parent)?;
        let parent_sandbox = sandbox_id(&parent.id)?;
        let specs = children
            .iter()
            .map(|child| self.spec(child, &snapshot))
            .collect::<Result<Vec<_>, _>>()?;

        let mut child_guards = Vec::with_capacity(children.len());
        let mut sagas = Vec::with_capacity(children.len());
        for child in children {
            child_guards.push(self.shared.lock_for(&child.id).lock_owned().await);
            // Each child is admitted (and counted against the quota) as it
            // is stored; a refusal removes the ones stored before it.
            match self.begin_new(child, Measured::Run(Operation::Fork)).await {
                Ok(saga) => sagas.push(saga),
                Err(error) => {
                    undo_all(sagas).await;
                    return Err(error);
                }
            }
        }

        parent.state = during;
        self.shared.save_state(&mut parent).await?;
        let copied = runtime.fork_many(&parent_sandbox, &specs).await;
        // The parent is running again whatever became of the children,
        // unless the copy ended it.
        parent.state = if runtime.is_running(&parent_sandbox).await {
            SandboxState::Started
        } else {
            parent.error_reason = Some("the sandbox ended while it was forked".into());
            SandboxState::Error
        };
        self.shared.save_state(&mut parent).await?;
        let copied_ms = began.elapsed().as_secs_f64() * 1e3;
        if let Err(error) = copied {
            let mut sagas = sagas.into_iter();
            let first = sagas.next().expect("at least one child");
            undo_all(sagas.collect()).await;
            return Err(first
                .finish(Err(error.into()), &parent.id, "fork")
                .await
                .expect_err("a failed fork fails"));
        }

        // The children start at once: under TCG each restore is mostly
        // waiting for its own QEMU process.
        let starts = sagas.iter().zip(specs).map(|(saga, spec)| {
            let (runtime, parent_sandbox) = (runtime.as_ref(), &parent_sandbox);
            async move {
                let started = self.start_machine(runtime, saga.record(), spec).await;
                tracing::debug!(
                    parent = %parent_sandbox,
                    child = %saga.record().id,
                    ok = started.is_ok(),
                    since_fork_ms = began.elapsed().as_secs_f64() * 1e3,
                    "fork child started"
                );
                started
            }
        });
        let made = futures_util::future::join_all(starts).await;
        let made_ms = began.elapsed().as_secs_f64() * 1e3;
        if let Some(failed) = made.iter().position(Result::is_err) {
            let mut failing = None;
            let mut others = Vec::with_capacity(sagas.len());
            for (index, (saga, made)) in sagas.into_iter().zip(made).enumerate() {
                if index == failed {
                    failing = Some((saga, made));
                } else {
                    // A child that started goes with the rest: its QEMU is
                    // ended by the undo's destroy.
                    others.push(saga);
                }
            }
            undo_all(others).await;
            let (saga, made) = failing.expect("the failed child");
            return Err(saga
                .finish(made, &parent.id, "fork")
                .await
                .expect_err("a failed start fails"));
        }
        let mut records = Vec::with_capacity(sagas.len());
        for (saga, made) in sagas.into_iter().zip(made) {
            records.push(saga.finish(made, &parent.id, "fork").await?);
        }
        drop(child_guards);
        for child in &records {
            tracing::info!(parent = %parent.id, child = %child.id, name = %child.name, "forked");
        }
        tracing::debug!(
            parent = %parent.id,
            children = records.len(),
            copied_ms,
            started_ms = made_ms,
            "fork into many done"
        );
        Ok(records)
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

/// Refuses a fork into no children, too many, or two of one name.
fn check_fork_count(names: &[Option<String>]) -> Result<(), EngineError> {
    if names.is_empty() || names.len() > MAX_FORK_CHILDREN {
        return Err(EngineError::Invalid {
            field: "count",
            reason: format!(
                "a fork makes 1 to {MAX_FORK_CHILDREN} children, not {}",
                names.len()
            ),
        });
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(twice) = names.iter().flatten().find(|name| !seen.insert(*name)) {
        return Err(EngineError::Invalid {
            field: "names",
            reason: format!("the name {twice} is given twice"),
        });
    }
    Ok(())
}

/// Undoes the sagas of children that go because another failed.
async fn undo_all(sagas: Vec<Saga<'_>>) {
    for saga in sagas {
        let id = saga.record().id.clone();
        if let Err(error) = saga.undo().await {
            let error = crate::error::describe(&error);
            tracing::error!(sandbox = %id, %error, "removing a fork child after another failed");
        }
    }
}
