//! Starting a sandbox's machine on the network, and watching it run: a
//! machine that ends by itself puts its sandbox in `error`.

use cove_lifecycle::SandboxState;
use cove_net::Deletion;
use cove_runtime::timeline::Timeline;
use cove_runtime::Started;
use cove_store::SandboxRecord;

use super::Sandboxes;
use crate::failure::Failure;

impl Sandboxes {
    /// Starts a sandbox's machine on the network: attached right before
    /// (linked to its peers as it starts), and detached again if the start
    /// fails.
    pub(crate) async fn start_machine(
        &self,
        runtime: &dyn cove_runtime::Runtime,
        record: &SandboxRecord,
        spec: cove_runtime::SandboxSpec,
    ) -> Result<Started, Failure> {
        let mut timeline = Timeline::start("start");
        self.start_machine_timed(runtime, record, spec, &mut timeline)
            .await
    }

    /// [`Self::start_machine`], noting its steps on the caller's timeline.
    pub(crate) async fn start_machine_timed(
        &self,
        runtime: &dyn cove_runtime::Runtime,
        record: &SandboxRecord,
        mut spec: cove_runtime::SandboxSpec,
        timeline: &mut Timeline,
    ) -> Result<Started, Failure> {
        spec.network = self.attach_network(record).await?;
        timeline.step("attach_network");
        // Its links need only its address: the store is asked for its
        // peers while the machine starts.
        let (started, ()) = tokio::join!(runtime.start(&spec), self.relink(record));
        match started {
            Ok(started) => Ok(started),
            Err(error) => {
                if let Err(detach) = self.detach_network(record, Deletion::Now).await {
                    let detach = crate::error::describe(&detach);
                    tracing::warn!(sandbox = %record.id, error = %detach, "after a failed start");
                }
                Err(error.into())
            }
        }
    }

    /// Remembers a started sandbox and watches for its end.
    pub(crate) fn register_running(&self, record: &SandboxRecord, started: Started) {
        let generation = self
            .shared
            .set_running(record, started.agent, started.accelerator);
        let sandboxes = self.clone();
        let id = record.id.clone();
        let exited = started.exited;
        tokio::spawn(async move {
            let why = exited
                .await
                .unwrap_or_else(|_| "its runtime dropped it".into());
            sandboxes.on_exit(&id, generation, &why).await;
        });
    }

    pub(crate) fn forget_running(&self, id: &str) {
        self.shared.forget_running(id, None);
    }

    /// A sandbox ended by itself (not by stop or delete, which forget it first).
    async fn on_exit(&self, id: &str, generation: u64, why: &str) {
        let lock = self.shared.lock_for(id);
        let _guard = lock.lock().await;
        if !self.shared.forget_running(id, Some(generation)) {
            return;
        }
        let Ok(mut record) = self.get(id).await else {
            return;
        };
        if record.state == SandboxState::Started {
            if let Err(error) = self.detach_network(&record, Deletion::Now).await {
                tracing::warn!(sandbox = %id, error = %crate::error::describe(&error), "after an unexpected exit");
            }
            record.state = SandboxState::Error;
            record.error_reason = Some(format!("the sandbox exited unexpectedly: {why}"));
            if let Err(error) = self.shared.save_state(&mut record).await {
                tracing::error!(sandbox = %id, error = %crate::error::describe(&error), "recording an unexpected exit");
            }
            tracing::warn!(sandbox = %id, why, "exited unexpectedly");
        }
    }
}
