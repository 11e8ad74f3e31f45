//! The side effects behind lifecycle operations: an operation (see
//! `operations.rs`) picks one as a value, records the transient state, and
//! applies it here.

use cove_net::Deletion;
use cove_runtime::{Runtime, SandboxId};
use cove_store::SandboxRecord;

use super::Sandboxes;
use crate::archive::ArchiveError;
use crate::error::EngineError;
use crate::failure::Failure;
use crate::shared::sandbox_id;

/// The side effect behind an operation.
#[derive(Clone, Debug)]
pub(crate) enum Effect {
    /// Start the machine: from its saved memory if it has some (a resume),
    /// else from its disk.
    Start,
    /// Start from disk, discarding saved memory.
    ColdStart,
    /// Bring the storage back from the archive, then start.
    Unarchive,
    /// Save memory and end the machine.
    Pause,
    /// End the machine; its disk stays.
    Stop,
    /// End the machine and remove everything it had.
    Delete,
    /// Move the stopped sandbox's storage to the archive.
    Archive,
    /// Capture the writable layer as a new snapshot.
    Capture(CaptureRequest),
    /// Replace the writable layer with a capture taken from the sandbox.
    Revert { capture_id: String },
}

/// What a user asked a capture to be.
#[derive(Clone, Debug)]
pub(crate) struct CaptureRequest {
    pub(super) name: String,
    /// Capture the machine's memory too (a started VM).
    pub(super) memory: bool,
}

impl Sandboxes {
    pub(super) async fn apply(
        &self,
        effect: Effect,
        record: &SandboxRecord,
    ) -> Result<(), Failure> {
        let runtime = match self.shared.runtime_of(record) {
            Err(EngineError::RunnerAway { id: runner }) if self.is_lost(&runner).await? => {
                // What it held went with it: a delete forgets the record,
                // anything else is refused.
                if matches!(effect, Effect::Delete) {
                    tracing::info!(sandbox = %record.id, %runner, "deleted; its runner was lost");
                    self.forget_running(&record.id);
                    return Ok(());
                }
                return Err(EngineError::RunnerLost {
                    id: record.id.clone(),
                    runner,
                }
                .into());
            }
            other => other?,
        };
        let runtime = runtime.as_ref();
        let id = &record.id;
        // Parsed once: the effects below name the machine by it.
        let sandbox = sandbox_id(id)?;
        match effect {
            Effect::Start | Effect::ColdStart | Effect::Unarchive => {
                self.start_effect(runtime, record, &effect).await
            }
            Effect::Pause => {
                self.forget_running(id);
                runtime.pause(&sandbox).await?;
                self.detach_network(record, Deletion::Background).await
            }
            Effect::Stop => {
                self.forget_running(id);
                runtime.stop(&sandbox).await?;
                self.detach_network(record, Deletion::Now).await
            }
            Effect::Delete => self.delete_effect(runtime, record, &sandbox).await,
            Effect::Archive => self.archive_effect(runtime, record, &sandbox).await,
            Effect::Capture(request) => self.capture(record, &sandbox, request).await,
            Effect::Revert { capture_id } => self.revert_effect(runtime, record, &capture_id).await,
        }
    }

    /// Whether `runner` is no longer registered: deleted as lost.
    async fn is_lost(&self, runner: &str) -> Result<bool, EngineError> {
        Ok(self.shared.store.find_runner(runner).await?.is_none())
    }

    /// Starts the machine, after bringing its storage back for an unarchive
    /// and dropping its memory for a cold start.
    async fn start_effect(
        &self,
        runtime: &dyn Runtime,
        record: &SandboxRecord,
        effect: &Effect,
    ) -> Result<(), Failure> {
        let snapshot = self.own_snapshot(record).await?;
        let spec = self.spec(record, &snapshot)?;
        if !matches!(effect, Effect::Unarchive) {
            return self.boot(runtime, record, spec, effect).await;
        }
        let archive = self.archive_store()?;
        let id = spec.id.clone();
        let started = async {
            self.unarchive(runtime, record, &archive, &spec).await?;
            self.boot(runtime, record, spec, effect).await
        }
        .await;
        match &started {
            // Back and running: the archive's copy is no longer its data.
            Ok(()) => {
                if let Err(error) = archive.remove(&record.id).await {
                    tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "left its archive copy after unarchiving");
                }
            }
            // The archive's copy is still whole, and the sandbox stays
            // archived: what the runner it was placed on holds of it goes.
            Err(_) => {
                self.forget_running(&record.id);
                if let Err(error) = runtime.destroy(&id).await {
                    tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "removing what a failed unarchive left");
                }
                if let Err(error) = self.release_network(record).await {
                    tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "after a failed unarchive");
                }
            }
        }
        started
    }

    /// Boots the machine on its storage (dropping its memory for a cold
    /// start).
    async fn boot(
        &self,
        runtime: &dyn Runtime,
        record: &SandboxRecord,
        spec: cove_runtime::SandboxSpec,
        effect: &Effect,
    ) -> Result<(), Failure> {
        // A leftover of an earlier run (a crash, a failed stop) must not
        // linger. A paused machine is not running, and stopping it would
        // drop the memory it is about to continue from.
        self.forget_running(&record.id);
        let keeps_memory = record.class.can_pause() && matches!(effect, Effect::Start);
        if !keeps_memory || runtime.is_running(&spec.id).await {
            runtime.stop(&spec.id).await?;
        }
        if matches!(effect, Effect::ColdStart) {
            runtime.discard_memory(&spec.id).await?;
        }
        let started = self.start_machine(runtime, record, spec).await?;
        self.register_running(record, started);
        Ok(())
    }

    async fn delete_effect(
        &self,
        runtime: &dyn Runtime,
        record: &SandboxRecord,
        sandbox: &SandboxId,
    ) -> Result<(), Failure> {
        self.forget_running(&record.id);
        runtime.destroy(sandbox).await?;
        self.release_network(record).await?;
        // Only an archived sandbox has a copy there; an unreachable archive
        // must not keep a sandbox from being deleted.
        if let Some(archive) = &self.shared.config.archive {
            if let Err(error) = archive.remove(&record.id).await {
                tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "left its archive copy");
            }
        }
        Ok(())
    }

    async fn archive_effect(
        &self,
        runtime: &dyn Runtime,
        record: &SandboxRecord,
        sandbox: &SandboxId,
    ) -> Result<(), Failure> {
        let archive = self.archive_store()?;
        // An older copy (one left behind) must not pass for this one, were
        // this archive to be cut short.
        archive.remove(&record.id).await?;
        if let Some(remote) = self.shared.remote_of(record) {
            // Its runner sends it to the same archive itself; the runner's
            // copy goes only once this server sees it there.
            let bytes = remote.0.archive(sandbox).await?;
            if !archive.holds(&record.id).await? {
                return Err(ArchiveError::NotThere {
                    id: record.id.clone(),
                    location: archive.location().to_owned(),
                }
                .into());
            }
            tracing::info!(sandbox = %record.id, bytes, to = archive.location(), runner = ?record.runner_id, "archived");
        } else {
            let bytes = archive.send(runtime, sandbox).await?;
            tracing::info!(sandbox = %record.id, bytes, to = archive.location(), "archived");
        }
        // Only once the archive holds it does the local copy go. From here
        // the sandbox is archived whatever the cleanup says: its data is
        // safe in the archive, and a start unarchives it from there.
        if let Err(error) = self.release_network(record).await {
            tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "after archiving");
        }
        if let Err(error) = runtime.destroy(sandbox).await {
            tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "removing the local copy after archiving");
        }
        Ok(())
    }

    /// Puts a capture of the sandbox back as its writable layer; a machine
    /// that ran is started again on it.
    async fn revert_effect(
        &self,
        runtime: &dyn Runtime,
        record: &SandboxRecord,
        capture_id: &str,
    ) -> Result<(), Failure> {
        let own = self.own_snapshot(record).await?;
        let spec = self.spec(record, &own)?;
        let was_running = runtime.is_running(&spec.id).await;
        self.forget_running(&record.id);
        runtime.stop(&spec.id).await?;
        self.detach_network(record, Deletion::Now).await?;
        runtime.revert(&spec, capture_id).await?;
        if was_running {
            let started = self.start_machine(runtime, record, spec).await?;
            self.register_running(record, started);
        }
        Ok(())
    }

    fn archive_store(&self) -> Result<crate::Archive, ArchiveError> {
        self.shared
            .config
            .archive
            .clone()
            .ok_or(ArchiveError::NotConfigured)
    }

    /// Brings an archived sandbox's storage back from the archive, onto
    /// the runner it was placed on (which fetches it itself when it is
    /// elsewhere).
    async fn unarchive(
        &self,
        runtime: &dyn Runtime,
        record: &SandboxRecord,
        archive: &crate::Archive,
        spec: &cove_runtime::SandboxSpec,
    ) -> Result<(), Failure> {
        if let Some(remote) = self.shared.remote_of(record) {
            remote.0.unarchive(spec).await?;
        } else {
            archive.fetch(runtime, spec).await?;
        }
        tracing::info!(sandbox = %spec.id, runner = ?record.runner_id, "unarchived");
        Ok(())
    }
}
