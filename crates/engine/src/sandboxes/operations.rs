//! Running one lifecycle operation on an existing sandbox.
//!
//! Each operation is recorded in its transient state before its side effect and in
//! its final state after it, so a crash in between is seen and repaired on restart.

use std::time::Instant;

use cove_lifecycle::{plan, Operation, SandboxState, Transition};
use cove_store::SandboxRecord;

use super::effect::Effect;
use super::Sandboxes;
use crate::failure::Failure;
use crate::metrics::Measured;
use crate::runners::Need;
use crate::EngineError;

impl Sandboxes {
    /// Starts a stopped, paused or archived sandbox. One stopped on a
    /// draining runner moves first, through the archive, when another
    /// runner can take it; otherwise it starts where it is.
    pub async fn start(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        let record = self.get(id_or_name).await?;
        if self.moves_on_start(&record).await {
            tracing::info!(sandbox = %record.id, runner = ?record.runner_id,
                "moving off its draining runner through the archive");
            // A move that fails leaves it stopped where it is (or another
            // start moved it meanwhile): the start goes on from there.
            if let Err(error) = self.archive(&record.id).await {
                tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error),
                    "could not move it; starting it where it is");
            }
        }
        self.run(&record.id, Operation::Start).await
    }

    /// Whether a start of `record` moves it to another runner first: it is
    /// stopped on a draining runner, it can go to the archive, and another
    /// runner could take it from there.
    async fn moves_on_start(&self, record: &SandboxRecord) -> bool {
        let runner = (record.runner_id.as_deref()).unwrap_or(&self.shared.config.runner.id);
        if record.state != SandboxState::Stopped
            || !self.shared.is_draining(runner)
            || self.check_can_archive(record).is_err()
        {
            return false;
        }
        match self.need_from_archive(record).await {
            Ok(need) => self.shared.could_place_elsewhere(need, runner),
            Err(_) => false,
        }
    }

    /// What `record` needs of a runner to come back from the archive.
    async fn need_from_archive(
        &self,
        record: &SandboxRecord,
    ) -> Result<Need<'static>, EngineError> {
        let snapshot =
            (self.own_snapshot(record).await).map_err(|f| f.named(&record.id, "start"))?;
        let mut need = Need::archived(record);
        // As a create's: a runner elsewhere fetches captured layers from
        // this server (`Runners::layer_send`), but not a capture's memory.
        if snapshot.has_memory {
            need.here_only = need.here_only.or(Some("a snapshot with memory"));
        }
        Ok(need)
    }

    pub async fn stop(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        let record = self.run(id_or_name, Operation::Stop).await?;
        // Auto-delete 0 (ephemeral) deletes as soon as the sandbox stops.
        // A parent keeps existing while it has forks; it stays stopped.
        if record.state == SandboxState::Stopped && record.timers.auto_delete == 0 {
            return match self.delete(&record.id).await {
                Err(EngineError::HasForks { .. }) => Ok(record),
                other => other,
            };
        }
        Ok(record)
    }

    /// Deletes a sandbox and everything it made; the returned record is `destroyed`.
    /// A sandbox with fork children is refused (409) until they are deleted.
    pub async fn delete(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        self.run(id_or_name, Operation::Delete).await
    }

    pub async fn recover(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        self.run(id_or_name, Operation::Recover).await
    }

    /// Moves a stopped sandbox's filesystem to the archive; `start` brings it back.
    pub async fn archive(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        let record = self.get(id_or_name).await?;
        self.check_can_archive(&record)?;
        self.run(&record.id, Operation::Archive).await
    }

    /// Refuses an archive this server (501) or this class (400) cannot do.
    pub(crate) fn check_can_archive(&self, record: &SandboxRecord) -> Result<(), EngineError> {
        if self.shared.config.archive.is_none() {
            return Err(EngineError::NotImplemented {
                what: "archive without an archive location (serve --archive)".into(),
            });
        }
        // A runner elsewhere moves the storage itself, to the archive this
        // server would fetch it from.
        if let Some(remote) = self.shared.remote_of(record) {
            let shared = (self.shared.config.archive.as_ref()).filter(|a| a.is_shared());
            if !shared.is_some_and(|archive| remote.0.shares_archive(archive.location())) {
                return Err(EngineError::NotImplemented {
                    what: format!(
                        "archiving sandboxes on runner {}, on another machine, without an S3 \
                         archive that this server (serve --archive s3://...) and the runner \
                         (cove runner --archive) both name",
                        record.runner_id.as_deref().unwrap_or_default()
                    ),
                });
            }
        }
        if !self.shared.runtime_of(record)?.can_archive() {
            return Err(EngineError::Invalid {
                field: "sandbox",
                reason: format!("{} sandboxes cannot be archived yet", record.class),
            });
        }
        Ok(())
    }

    /// Pauses a started VM: its memory goes to disk and every process continues
    /// at the next start or resume. Refused (409) for a sandbox that is not
    /// persistent.
    pub async fn pause(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        let record = self.get(id_or_name).await?;
        if record.class.can_pause() && !record.persistent {
            return Err(EngineError::NotPersistent { id: record.id });
        }
        if !record.volumes.is_empty() {
            return Err(EngineError::HasVolumes {
                id: record.id,
                action: "pause",
                instead: "stop it instead",
            });
        }
        self.run(&record.id, Operation::Pause).await
    }

    /// Continues a paused sandbox from its memory (a started one stays as it is).
    pub async fn resume(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        self.run(id_or_name, Operation::Resume).await
    }

    /// Starts a paused or stopped sandbox from its disk, discarding saved memory
    /// (a one-way door: the memory cannot be recovered afterwards).
    pub async fn cold_start(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        self.run(id_or_name, Operation::ColdStart).await
    }

    /// Reclaims the capacity of spot sandboxes: each started one is paused if it
    /// is persistent and can pause, deleted otherwise (as seed 001 describes).
    /// Returns what happened, as (sandbox id, "paused" or "deleted").
    pub async fn reclaim_spot(&self) -> Result<Vec<(String, &'static str)>, EngineError> {
        let mut reclaimed = Vec::new();
        for record in self.shared.store.list_sandboxes().await? {
            if !record.spot || record.state != SandboxState::Started {
                continue;
            }
            let result = if record.persistent && record.class.can_pause() {
                self.pause(&record.id).await.map(|_| "paused")
            } else {
                self.delete(&record.id).await.map(|_| "deleted")
            };
            match result {
                Ok(what) => {
                    tracing::info!(sandbox = %record.id, what, "spot sandbox reclaimed");
                    reclaimed.push((record.id, what));
                }
                Err(error) => {
                    tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "reclaim failed")
                }
            }
        }
        Ok(reclaimed)
    }

    /// Runs `operation` under the sandbox's lock: operations on one sandbox wait
    /// their turn.
    pub async fn run(
        &self,
        id_or_name: &str,
        operation: Operation,
    ) -> Result<SandboxRecord, EngineError> {
        let effect = self.check_supported(operation)?;
        self.run_effect(id_or_name, operation, effect).await
    }

    /// Runs `operation` with the side effect given, under the sandbox's lock.
    pub(crate) async fn run_effect(
        &self,
        id_or_name: &str,
        operation: Operation,
        effect: Effect,
    ) -> Result<SandboxRecord, EngineError> {
        let id = self.get(id_or_name).await?.id;
        let lock = self.shared.lock_for(&id);
        let _guard = lock.lock().await;
        // Read again under the lock: the operation before ours may have changed it.
        let mut record = self.get(&id).await?;
        let transition = plan(operation, record.state, record.class).map_err(|source| {
            EngineError::Transition {
                id: id.clone(),
                source,
            }
        })?;
        let Transition::Run {
            during,
            success,
            desired,
        } = transition
        else {
            return Ok(record);
        };
        // Under the lock, so a fork in progress is seen: a parent keeps existing
        // while it has forks, whoever asks for the delete.
        if operation == Operation::Delete {
            self.check_no_forks(&record).await?;
        }
        // The plan says a start from the archive is an unarchive.
        let effect = match effect {
            Effect::Start if during == SandboxState::Unarchiving => Effect::Unarchive,
            other => other,
        };
        // A sandbox on its way to running takes a slot of its organization's
        // quota, checked and recorded under the admission lock. One coming
        // back from the archive keeps its disk again, so that counts too.
        let admitted = match success.is_running() && !crate::quota::occupies(&record) {
            true => {
                let keeps_disk_again = record.state == SandboxState::Archived;
                Some(self.shared.admit(&record, keeps_disk_again).await?)
            }
            false => None,
        };
        // From the archive a sandbox is placed anew (on a runner that
        // reaches that archive); in it, it is on none.
        if matches!(effect, Effect::Unarchive) {
            let need = self.need_from_archive(&record).await?;
            record.runner_id = Some(match self.shared.place(need, None) {
                Ok(runner) => runner,
                // When no runner takes it (its home drained, say), it comes
                // back on the server's own, as a stopped one starts where
                // it is.
                Err(refused) if self.shared.runtime(record.class).is_ok() => {
                    tracing::info!(sandbox = %record.id, why = %refused,
                        "back from the archive on this server's own runner");
                    self.shared.config.runner.id.clone()
                }
                Err(refused) => return Err(refused),
            });
        }
        // Where the sandbox is after its effect: in the archive, it is on no
        // runner.
        let in_archive_after = match effect {
            Effect::Archive => Some(true),
            Effect::Unarchive => Some(false),
            _ => None,
        };
        record.state = during;
        record.desired_state = desired;
        record.error_reason = None;
        self.shared.save_state(&mut record).await?;
        drop(admitted);

        // An unarchive that failed leaves the sandbox where its data is: in
        // the archive, to be started again; an archive that failed, stopped
        // with its storage where it was.
        let failed_state = match effect {
            Effect::Unarchive => SandboxState::Archived,
            Effect::Archive => SandboxState::Stopped,
            _ => SandboxState::Error,
        };
        let began = Instant::now();
        let applied = self.apply(effect, &record).await;
        self.shared.metrics.observe(
            Measured::Run(operation),
            record.class,
            applied.is_ok(),
            began.elapsed(),
        );
        if in_archive_after.is_some_and(|archived| archived == applied.is_ok()) {
            record.runner_id = None;
        }
        self.land(
            record,
            operation,
            applied.map(|()| success).map_err(|f| (f, failed_state)),
        )
        .await
    }

    /// Records where an operation's side effect left the sandbox: `success`,
    /// deleted, or the failed state with the reason.
    async fn land(
        &self,
        mut record: SandboxRecord,
        operation: Operation,
        outcome: Result<SandboxState, (Failure, SandboxState)>,
    ) -> Result<SandboxRecord, EngineError> {
        let id = record.id.clone();
        match outcome {
            Ok(SandboxState::Destroyed) => {
                self.shared.delete_sandbox(&record).await?;
                record.state = SandboxState::Destroyed;
                self.shared.forget(&id);
                // Its SSH access went with it.
                self.shared.ssh_access_revoked();
                tracing::info!(sandbox = %id, "deleted");
                Ok(record)
            }
            Ok(success) => {
                record.state = success;
                self.shared.save_state(&mut record).await?;
                tracing::info!(sandbox = %id, %operation, state = %record.state, "done");
                Ok(record)
            }
            Err((failure, state)) => {
                record.state = state;
                let reason = crate::error::describe(&failure);
                record.error_reason = Some(format!("{operation} failed: {reason}"));
                self.shared.save_state(&mut record).await?;
                tracing::warn!(sandbox = %id, %operation, %reason, "failed");
                Err(failure.named(&id, operation.as_str()))
            }
        }
    }

    fn check_supported(&self, operation: Operation) -> Result<Effect, EngineError> {
        match operation {
            // A start continues from saved memory (a resume) when there is some.
            Operation::Start | Operation::Recover | Operation::Resume => Ok(Effect::Start),
            Operation::ColdStart => Ok(Effect::ColdStart),
            Operation::Pause => Ok(Effect::Pause),
            Operation::Archive => Ok(Effect::Archive),
            Operation::Stop => Ok(Effect::Stop),
            Operation::Delete => Ok(Effect::Delete),
            other => Err(EngineError::NotImplemented {
                what: format!("sandbox {other}"),
            }),
        }
    }
}
