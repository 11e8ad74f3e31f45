//! Bringing sandboxes back after the server itself restarted.
//!
//! A running machine that outlived the server and that its runtime can take
//! over (a VM: QEMU runs on in its own process group) is taken over as it
//! runs. Nothing else a runtime made is trusted across a restart: whatever a
//! sandbox was doing, its leftover processes are ended, and it is brought to
//! the state the user last asked for. No sandbox is lost and none is made twice.
//! Build sandboxes (never sandbox records) are all destroyed: their builds
//! ended with the server that ran them.

use cove_lifecycle::{DesiredState, SandboxState};
use cove_runtime::SandboxId;
use cove_store::SandboxRecord;

use super::Sandboxes;
use crate::failure::Failure;
use crate::shared::sandbox_id;
use crate::EngineError;

impl Sandboxes {
    /// Reconciles every stored sandbox with its runtime (after the snapshots
    /// part ended the builds of the last server).
    pub(crate) async fn recover_after_restart(&self) -> Result<(), EngineError> {
        for record in self.shared.store.list_sandboxes().await? {
            // A runner elsewhere has not reported since this server
            // started: its sandboxes are taken back when it first does
            // (`recover_runner`).
            if !self.shared.is_local(&record) {
                tracing::info!(sandbox = %record.id, runner = ?record.runner_id,
                    "on a runner elsewhere; left as recorded");
                continue;
            }
            let Ok(runtime) = self.shared.runtime(record.class).cloned() else {
                tracing::warn!(sandbox = %record.id, class = %record.class, "no runtime for its class");
                continue;
            };
            // A row no machine can be named by (a corrupt store) is left
            // as it is rather than keep every other sandbox from coming back.
            let Ok(sandbox) = sandbox_id(&record.id) else {
                tracing::warn!(sandbox = %record.id, "not a valid sandbox id; left as it is");
                continue;
            };
            let id = record.id.clone();
            if self.recover_one(runtime.as_ref(), &sandbox, record).await? {
                self.start_again(&id).await;
            }
        }
        Ok(())
    }

    /// Takes back the sandboxes of runner `runner_id`, on another machine,
    /// when it first reports to this server: one its runner still runs is
    /// taken over as it runs, the others are brought to the state their
    /// users asked for, as after a restart. Each under its lock, and only
    /// while this server has not started it since.
    async fn recover_runner(&self, runner_id: &str) -> Result<(), EngineError> {
        for record in self.shared.store.sandboxes_on_runner(runner_id).await? {
            let id = record.id.clone();
            let lock = self.shared.lock_for(&id);
            let guard = lock.lock().await;
            let Ok(record) = self.get(&id).await else {
                continue;
            };
            if self.shared.running(&id).is_some() {
                continue;
            }
            let (Ok(runtime), Ok(sandbox)) = (self.shared.runtime_of(&record), sandbox_id(&id))
            else {
                continue;
            };
            let start = self.recover_one(runtime.as_ref(), &sandbox, record).await;
            drop(guard);
            match start {
                Ok(true) => self.start_again(&id).await,
                Ok(false) => {}
                // One sandbox that cannot be brought back keeps no other.
                Err(error) => {
                    tracing::warn!(sandbox = %id, error = %crate::error::describe(&error), "taking it back")
                }
            }
        }
        Ok(())
    }

    /// Takes back the sandboxes of each runner elsewhere as it first says
    /// where it serves, until the process ends. Spawned once by the server.
    pub async fn run_runner_recoveries(&self) {
        let Some(mut arrived) = self.shared.arrived.lock().unwrap().take() else {
            return;
        };
        while let Some(runner) = arrived.recv().await {
            if let Err(error) = self.recover_runner(&runner).await {
                tracing::warn!(%runner, error = %crate::error::describe(&error), "taking back the runner's sandboxes");
            }
        }
    }

    /// Starts a sandbox recovery left to be started, logging how it went.
    async fn start_again(&self, id: &str) {
        match self.start(id).await {
            Ok(_) => tracing::info!(sandbox = %id, "started again after a restart"),
            Err(error) => {
                tracing::warn!(sandbox = %id, error = %crate::error::describe(&error), "starting it again after a restart failed")
            }
        }
    }

    /// Brings one sandbox to the state its user asked for; whether it is
    /// then to be started (by the caller, which holds no lock of it).
    async fn recover_one(
        &self,
        runtime: &dyn cove_runtime::Runtime,
        sandbox: &SandboxId,
        mut record: SandboxRecord,
    ) -> Result<bool, EngineError> {
        let id = record.id.clone();
        match record.state {
            // Half-made or half-deleted: finish the job, it never existed for the user
            // or the user wanted it gone.
            SandboxState::Creating | SandboxState::Destroying => {
                if let Err(error) = runtime.destroy(sandbox).await {
                    record.state = SandboxState::Error;
                    record.error_reason = Some(format!(
                        "cleanup after a restart failed: {}",
                        crate::error::describe(&error)
                    ));
                    self.shared.save_state(&mut record).await?;
                    return Ok(false);
                }
                self.shared.delete_sandbox(&record).await?;
                tracing::info!(sandbox = %id, "removed a sandbox left half-made or half-deleted");
            }
            // Interrupted while moving to or from the archive: if the archive
            // holds its copy, that is where its data is (the local copy may
            // be gone); a start unarchives it.
            SandboxState::Archiving | SandboxState::Unarchiving
                if self.archive_holds(&id).await =>
            {
                // A runner elsewhere drops its copy: the archive's is whole,
                // and the next start may place the sandbox on another.
                if self.shared.is_local(&record) {
                    let _ = runtime.stop(sandbox).await;
                } else {
                    let _ = runtime.destroy(sandbox).await;
                }
                record.runner_id = None;
                record.state = SandboxState::Archived;
                self.shared.save_state(&mut record).await?;
                tracing::info!(sandbox = %id, "back to archived after a server restart");
                return Ok(record.desired_state == DesiredState::Started);
            }
            // A paused machine's memory is on disk and nothing runs: keep it.
            SandboxState::Paused if !runtime.is_running(sandbox).await => {}
            // A machine that outlived the server (a VM) is taken over as
            // it runs, its processes intact.
            SandboxState::Started
                if record.desired_state == DesiredState::Started
                    && self.reattach(runtime, &record).await => {}
            _ => return self.end_leftovers(runtime, sandbox, record).await,
        }
        Ok(false)
    }

    /// Ends what is left of a sandbox's machine, then marks it stopped, to
    /// be started again if it was (or was becoming) started; an
    /// interrupted one stays stopped.
    async fn end_leftovers(
        &self,
        runtime: &dyn cove_runtime::Runtime,
        sandbox: &SandboxId,
        mut record: SandboxRecord,
    ) -> Result<bool, EngineError> {
        let id = record.id.clone();
        if let Err(error) = runtime.stop(sandbox).await {
            record.state = SandboxState::Error;
            record.error_reason = Some(format!(
                "ending leftovers after a restart failed: {}",
                crate::error::describe(&error)
            ));
            self.shared.save_state(&mut record).await?;
            return Ok(false);
        }
        let was = record.state;
        if record.desired_state == DesiredState::Started
            && matches!(
                was,
                SandboxState::Started
                    | SandboxState::Starting
                    | SandboxState::Unarchiving
                    | SandboxState::Reverting
            )
        {
            record.state = SandboxState::Stopped;
            self.shared.save_state(&mut record).await?;
            return Ok(true);
        }
        if was.is_transient() {
            record.state = SandboxState::Stopped;
            self.shared.save_state(&mut record).await?;
            tracing::info!(sandbox = %id, %was, "marked stopped after a server restart");
        }
        Ok(false)
    }

    /// Whether the runtime took the sandbox over as it runs; if so it is
    /// registered as running, as after a start.
    async fn reattach(&self, runtime: &dyn cove_runtime::Runtime, record: &SandboxRecord) -> bool {
        let spec = async {
            let snapshot = self.own_snapshot(record).await?;
            Ok::<_, Failure>(self.spec(record, &snapshot)?)
        };
        let spec = match spec.await {
            Ok(spec) => spec,
            Err(error) => {
                tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "cannot take it over");
                return false;
            }
        };
        match runtime.reattach(&spec).await {
            // Its TAP device went with the old server's network (a new
            // server clears every port it finds). A VM with volumes cannot
            // pause (QEMU cannot save a virtio-fs device): it is stopped and
            // booted again by the caller, on a fresh TAP device.
            Ok(Some(started)) if self.shared.network().is_some() && !record.volumes.is_empty() => {
                drop(started);
                tracing::info!(sandbox = %record.id, "its volumes keep it from pausing onto the new network; it is restarted");
                false
            }
            // Any other: a pause and a resume on a fresh TAP device keeps
            // every process and puts the machine back on the network.
            Ok(Some(started)) if self.shared.network().is_some() && record.class.can_pause() => {
                drop(started);
                let replugged = async {
                    runtime.pause(&spec.id).await?;
                    self.start_machine(runtime, record, spec).await
                }
                .await;
                match replugged {
                    Ok(started) => {
                        self.register_running(record, started);
                        tracing::info!(sandbox = %record.id, "still running after a server restart, on the network again");
                        true
                    }
                    Err(error) => {
                        tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "putting it back on the network failed; it is restarted");
                        false
                    }
                }
            }
            Ok(Some(started)) => {
                self.register_running(record, started);
                tracing::info!(sandbox = %record.id, "still running after a server restart");
                true
            }
            Ok(None) => false,
            Err(error) => {
                tracing::warn!(sandbox = %record.id, error = %crate::error::describe(&error), "taking it over failed; it is restarted");
                false
            }
        }
    }

    async fn archive_holds(&self, id: &str) -> bool {
        match &self.shared.config.archive {
            Some(archive) => archive.holds(id).await.unwrap_or_else(|error| {
                tracing::warn!(sandbox = %id, error = %crate::error::describe(&error), "cannot tell whether it is archived");
                false
            }),
            None => false,
        }
    }
}
