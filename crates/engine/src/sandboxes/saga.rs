//! The saga of a new sandbox, shared by create and fork: record it, let the
//! runtime make and start it, and on any failure undo both, so a new sandbox
//! is either `started` or never existed.

use std::time::Instant;

use cove_lifecycle::SandboxState;
use cove_runtime::{SandboxId, Started};
use cove_store::{SandboxRecord, StoreError};

use super::Sandboxes;
use crate::failure::Failure;
use crate::metrics::Measured;
use crate::shared::sandbox_id;
use crate::EngineError;

/// A new sandbox whose row is stored: until [`Saga::finish`] it is undone
/// on failure (the runtime's work destroyed, its address released, its row
/// deleted).
pub(super) struct Saga<'a> {
    sandboxes: &'a Sandboxes,
    record: SandboxRecord,
    /// The record's id, checked before the row was stored: the undo never
    /// fails for want of it.
    sandbox: SandboxId,
    /// What made it (a create, a fork), for the logs of an undo and the
    /// metrics.
    operation: Measured,
    /// When its row was stored: the operation's time runs from there.
    began: Instant,
}

impl Sandboxes {
    /// Stores a new sandbox's record; a name in use is refused (409) and
    /// leaves nothing behind.
    pub(super) async fn begin_new(
        &self,
        record: SandboxRecord,
        operation: Measured,
    ) -> Result<Saga<'_>, EngineError> {
        let sandbox = sandbox_id(&record.id)?;
        let _admitted = self.shared.admit(&record, true).await?;
        self.shared
            .insert_sandbox(&record)
            .await
            .map_err(|e| match e {
                StoreError::Duplicate { .. } => EngineError::NameTaken {
                    name: record.name.clone(),
                },
                other => other.into(),
            })?;
        Ok(Saga {
            sandboxes: self,
            record,
            sandbox,
            operation,
            began: Instant::now(),
        })
    }
}

impl Saga<'_> {
    pub(super) fn record(&self) -> &SandboxRecord {
        &self.record
    }

    /// Ends the saga with what the runtime made of it: the sandbox started
    /// (registered and recorded `started`), or it is undone and the failure
    /// returned, named as `operation` on sandbox `blamed`.
    pub(super) async fn finish(
        self,
        made: Result<Started, Failure>,
        blamed: &str,
        operation: &'static str,
    ) -> Result<SandboxRecord, EngineError> {
        self.sandboxes.shared.metrics.observe(
            self.operation,
            self.record.class,
            made.is_ok(),
            self.began.elapsed(),
        );
        let started = match made {
            Ok(started) => started,
            Err(error) => {
                self.undo().await?;
                return Err(error.named(blamed, operation));
            }
        };
        let mut record = self.record;
        self.sandboxes.register_running(&record, started);
        record.state = SandboxState::Started;
        self.sandboxes.shared.save_state(&mut record).await?;
        Ok(record)
    }

    /// Undoes the runtime's work and the network's, then forgets the row.
    /// A cleanup that fails is logged: the row goes whatever it says.
    /// Also for a sandbox that did not fail itself but goes with others
    /// made with it (a fork into many).
    pub(super) async fn undo(self) -> Result<(), EngineError> {
        let id = &self.record.id;
        let sandboxes = self.sandboxes;
        let destroyed = match sandboxes.shared.runtime_of(&self.record) {
            Ok(runtime) => runtime.destroy(&self.sandbox).await.map_err(Failure::from),
            Err(error) => Err(error.into()),
        };
        let released = sandboxes.release_network(&self.record).await;
        for cleanup in [destroyed, released].into_iter().filter_map(Result::err) {
            let cleanup = crate::error::describe(&cleanup);
            tracing::error!(sandbox = %id, error = %cleanup, what = self.operation.as_str(), "cleanup after a failed new sandbox");
        }
        sandboxes.shared.delete_sandbox(&self.record).await?;
        Ok(())
    }
}
