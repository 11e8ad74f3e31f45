//! Changing a sandbox's labels, timers and flags.

use std::collections::BTreeMap;

use cove_lifecycle::{MAX_MINUTES, MINUTE_MS};
use cove_store::SandboxRecord;

use super::Sandboxes;
use crate::{now_ms, EngineError};

/// One setting a user changes on an existing sandbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SettingChange {
    Labels(BTreeMap<String, String>),
    AutoStop(i64),
    AutoPause(i64),
    AutoArchive(i64),
    AutoDelete(i64),
    /// Resets the wall-clock deadline to now + minutes; 0 removes it.
    Ttl(i64),
    Public(bool),
}

impl Sandboxes {
    pub async fn change(
        &self,
        id_or_name: &str,
        change: SettingChange,
    ) -> Result<SandboxRecord, EngineError> {
        let id = self.get(id_or_name).await?.id;
        let lock = self.shared.lock_for(&id);
        let _guard = lock.lock().await;
        let mut record = self.get(&id).await?;
        let class = record.class;
        match change {
            SettingChange::Labels(labels) => record.labels = labels,
            SettingChange::AutoStop(m) => {
                record.timers = record.timers.with(class, |t| t.auto_stop = m)?
            }
            SettingChange::AutoPause(m) => {
                if m != 0 && !record.persistent {
                    return Err(EngineError::NotPersistent { id: record.id });
                }
                record.timers = record.timers.with(class, |t| t.auto_pause = m)?
            }
            SettingChange::AutoArchive(m) => {
                record.timers = record.timers.with(class, |t| t.auto_archive = m)?
            }
            SettingChange::AutoDelete(m) => {
                record.timers = record.timers.with(class, |t| t.auto_delete = m)?
            }
            SettingChange::Ttl(minutes) => {
                if !(0..=MAX_MINUTES).contains(&minutes) {
                    return Err(EngineError::Invalid {
                        field: "ttlMinutes",
                        reason: format!("must be 0 (off) to {MAX_MINUTES}, got {minutes}"),
                    });
                }
                record.ttl_minutes = minutes;
                record.ttl_deadline_ms = (minutes > 0).then(|| now_ms() + minutes * MINUTE_MS);
            }
            SettingChange::Public(public) => record.public = public,
        }
        let now = now_ms();
        record.updated_at_ms = now;
        record.last_activity_ms = record.last_activity_ms.max(now);
        self.shared.store.save_sandbox(&record).await?;
        Ok(record)
    }
}
