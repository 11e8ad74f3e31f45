//! Running one lifecycle operation on an existing sandbox.
//!
//! Each operation is recorded in its transient state before its side effect and in
//! its final state after it, so a crash in between is seen and repaired on restart.

use cove_lifecycle::{plan, Operation, SandboxState, Transition};
use cove_runtime::Started;
use cove_store::SandboxRecord;

use crate::archive::ArchiveError;
use crate::failure::Failure;
use crate::{now_ms, Engine, EngineError, Running};

impl Engine {
    pub async fn start(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        self.run(id_or_name, Operation::Start).await
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
        if self.inner.config.archive.is_none() {
            return Err(EngineError::NotImplemented {
                what: "archive without an archive location (serve --archive)".into(),
            });
        }
        if !self.runtime(record.class)?.can_archive() {
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
        for record in self.inner.store.list_sandboxes().await? {
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
        let lock = self.lock_for(&id);
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
        record.state = during;
        record.desired_state = desired;
        record.error_reason = None;
        self.save_state(&mut record).await?;

        let effect_kind = effect.clone();
        match self.apply(effect, &record).await {
            Ok(()) => {
                record.state = success;
                if success == SandboxState::Destroyed {
                    self.inner.store.delete_sandbox(&id).await?;
                    self.inner.activity.forget(&id);
                    // Its SSH access went with it.
                    self.ssh_access_revoked();
                    self.inner.locks.lock().unwrap().remove(&id);
                    tracing::info!(sandbox = %id, "deleted");
                    return Ok(record);
                }
                self.save_state(&mut record).await?;
                tracing::info!(sandbox = %id, %operation, state = %record.state, "done");
                Ok(record)
            }
            Err(failure) => {
                // A start from the archive that failed leaves the sandbox where
                // its data is: in the archive, to be started again.
                let from_archive =
                    during == SandboxState::Restoring && matches!(effect_kind, Effect::Boot);
                record.state = if from_archive {
                    SandboxState::Archived
                } else {
                    SandboxState::Error
                };
                let reason = crate::error::describe(&failure);
                record.error_reason = Some(format!("{operation} failed: {reason}"));
                self.save_state(&mut record).await?;
                tracing::warn!(sandbox = %id, %operation, %reason, "failed");
                Err(failure.named(&id, operation.as_str()))
            }
        }
    }

    fn check_supported(&self, operation: Operation) -> Result<Effect, EngineError> {
        match operation {
            Operation::Start | Operation::Recover | Operation::Resume => Ok(Effect::Boot),
            Operation::ColdStart => Ok(Effect::ColdBoot),
            Operation::Pause => Ok(Effect::Pause),
            Operation::Archive => Ok(Effect::Archive),
            Operation::Stop => Ok(Effect::Halt),
            Operation::Delete => Ok(Effect::Destroy),
            other => Err(EngineError::NotImplemented {
                what: format!("sandbox {other}"),
            }),
        }
    }

    async fn apply(&self, effect: Effect, record: &SandboxRecord) -> Result<(), Failure> {
        if let Effect::Capture(request) = effect {
            return self.capture(record, request).await;
        }
        let runtime = self.runtime(record.class)?.clone();
        match effect {
            Effect::Boot | Effect::ColdBoot => {
                let snapshot = self.own_snapshot(record).await?;
                let spec = self.spec(record, &snapshot);
                // `restoring` on a start: the sandbox comes back from the archive.
                if record.state == SandboxState::Restoring {
                    self.unarchive(runtime.as_ref(), &spec).await?;
                }
                // A leftover of an earlier run (a crash, a failed stop) must not
                // linger. A paused machine is not running, and stopping it would
                // drop the memory it is about to continue from.
                self.forget_running(&record.id);
                let keeps_memory = record.class.can_pause() && matches!(effect, Effect::Boot);
                if !keeps_memory || runtime.is_running(&record.id).await {
                    runtime.stop(&record.id).await?;
                }
                if matches!(effect, Effect::ColdBoot) {
                    runtime.discard_memory(&record.id).await?;
                }
                let started = self.start_machine(runtime.as_ref(), record, spec).await?;
                self.register_running(&record.id, started);
                Ok(())
            }
            Effect::Pause => {
                self.forget_running(&record.id);
                runtime.pause(&record.id).await?;
                self.detach_network(record).await
            }
            Effect::Halt => {
                self.forget_running(&record.id);
                runtime.stop(&record.id).await?;
                self.detach_network(record).await
            }
            Effect::Destroy => {
                self.forget_running(&record.id);
                runtime.destroy(&record.id).await?;
                self.release_network(record).await?;
                // Only an archived sandbox has a copy there; an unreachable archive
                // must not keep a sandbox from being deleted.
                if let Some(archive) = &self.inner.config.archive {
                    if let Err(error) = archive.remove(&record.id).await {
                        tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "left its archive copy");
                    }
                }
                Ok(())
            }
            Effect::Archive => {
                let archive = self
                    .inner
                    .config
                    .archive
                    .clone()
                    .ok_or(ArchiveError::NotConfigured)?;
                let file = archive.scratch_file(&record.id);
                let moved = async {
                    runtime.export_storage(&record.id, &file).await?;
                    let bytes = archive.upload(&record.id, &file).await?;
                    tracing::info!(sandbox = %record.id, bytes, to = archive.location(), "archived");
                    Ok::<(), Failure>(())
                }
                .await;
                let _ = tokio::fs::remove_file(&file).await;
                moved?;
                // Only once the archive holds it does the local copy go. From here
                // the sandbox is archived whatever the cleanup says: its data is
                // safe in the archive, and a start restores it from there.
                if let Err(error) = self.release_network(record).await {
                    tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "after archiving");
                }
                if let Err(error) = runtime.destroy(&record.id).await {
                    tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "removing the local copy after archiving");
                }
                Ok(())
            }
            Effect::Restore { capture_id } => {
                let own = self.own_snapshot(record).await?;
                let spec = self.spec(record, &own);
                let was_running = runtime.is_running(&record.id).await;
                self.forget_running(&record.id);
                runtime.stop(&record.id).await?;
                self.detach_network(record).await?;
                runtime.restore(&spec, &capture_id).await?;
                if was_running {
                    let started = self.start_machine(runtime.as_ref(), record, spec).await?;
                    self.register_running(&record.id, started);
                }
                Ok(())
            }
            Effect::Capture(_) => unreachable!("handled above"),
        }
    }

    /// Starts a sandbox's machine on the network: attached right before, and
    /// detached again if the start fails.
    pub(crate) async fn start_machine(
        &self,
        runtime: &dyn cove_runtime::Runtime,
        record: &SandboxRecord,
        mut spec: cove_runtime::SandboxSpec,
    ) -> Result<Started, Failure> {
        spec.network = self.attach_network(record).await?;
        match runtime.start(&spec).await {
            Ok(started) => Ok(started),
            Err(error) => {
                if let Err(detach) = self.detach_network(record).await {
                    let detach = crate::error::describe(&detach);
                    tracing::warn!(sandbox = %record.id, error = %detach, "after a failed start");
                }
                Err(error.into())
            }
        }
    }

    /// Brings an archived sandbox's storage back from the archive.
    async fn unarchive(
        &self,
        runtime: &dyn cove_runtime::Runtime,
        spec: &cove_runtime::SandboxSpec,
    ) -> Result<(), Failure> {
        let archive = self
            .inner
            .config
            .archive
            .clone()
            .ok_or(ArchiveError::NotConfigured)?;
        let file = archive.scratch_file(&spec.id);
        let restored = async {
            archive.download(&spec.id, &file).await?;
            runtime.import_storage(spec, &file).await?;
            Ok::<(), Failure>(())
        }
        .await;
        let _ = tokio::fs::remove_file(&file).await;
        restored?;
        archive.remove(&spec.id).await?;
        tracing::info!(sandbox = %spec.id, "restored from the archive");
        Ok(())
    }

    pub(crate) async fn save_state(&self, record: &mut SandboxRecord) -> Result<(), EngineError> {
        let now = now_ms();
        record.state_since_ms = now;
        record.updated_at_ms = now;
        // A state change is an event: it resets the idle clock.
        record.last_activity_ms = record.last_activity_ms.max(now);
        self.inner.store.save_sandbox(record).await?;
        Ok(())
    }

    /// Remembers a started sandbox and watches for its end.
    pub(crate) fn register_running(&self, id: &str, started: Started) {
        use std::sync::atomic::Ordering;
        let generation = self.inner.generation.fetch_add(1, Ordering::Relaxed) + 1;
        self.inner.running.lock().unwrap().insert(
            id.to_owned(),
            Running {
                agent: started.agent,
                accelerator: started.accelerator,
                generation,
            },
        );
        let engine = self.clone();
        let id = id.to_owned();
        let exited = started.exited;
        tokio::spawn(async move {
            let why = exited
                .await
                .unwrap_or_else(|_| "its runtime dropped it".into());
            engine.on_exit(&id, generation, &why).await;
        });
    }

    fn forget_running(&self, id: &str) {
        self.inner.running.lock().unwrap().remove(id);
    }

    /// A sandbox ended by itself (not by stop or delete, which forget it first).
    async fn on_exit(&self, id: &str, generation: u64, why: &str) {
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        {
            let mut running = self.inner.running.lock().unwrap();
            match running.get(id) {
                Some(current) if current.generation == generation => {
                    running.remove(id);
                }
                _ => return,
            }
        }
        let Ok(mut record) = self.get(id).await else {
            return;
        };
        if record.state == SandboxState::Started {
            if let Err(error) = self.detach_network(&record).await {
                tracing::warn!(sandbox = %id, error = %crate::error::describe(&error), "after an unexpected exit");
            }
            record.state = SandboxState::Error;
            record.error_reason = Some(format!("the sandbox exited unexpectedly: {why}"));
            if let Err(error) = self.save_state(&mut record).await {
                tracing::error!(sandbox = %id, error = %crate::error::describe(&error), "recording an unexpected exit");
            }
            tracing::warn!(sandbox = %id, why, "exited unexpectedly");
        }
    }
}

/// The side effect behind an operation.
#[derive(Clone, Debug)]
pub(crate) enum Effect {
    /// Start: continue from saved memory if the machine has some, else boot.
    Boot,
    /// Start from disk, discarding saved memory.
    ColdBoot,
    /// Save memory and end the machine.
    Pause,
    /// Move the stopped sandbox's storage to the archive.
    Archive,
    Halt,
    Destroy,
    /// Capture the writable layer as a new snapshot.
    Capture(crate::snapshots::CaptureRequest),
    /// Replace the writable layer with a capture taken from the sandbox.
    Restore {
        capture_id: String,
    },
}
