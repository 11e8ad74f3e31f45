//! The idle clock of each sandbox.
//!
//! Every API or toolbox interaction resets it. Writing each one to the database
//! would put a disk write on the path of every command, so interactions are kept
//! in memory and flushed by the timer loop; a restart loses at most one tick,
//! which only delays an idle timer.

use std::collections::HashMap;
use std::sync::Mutex;

use cove_store::{SandboxRecord, Store, StoreError};

#[derive(Debug, Default)]
pub(crate) struct Activity {
    latest: Mutex<HashMap<String, i64>>,
}

impl Activity {
    pub(crate) fn touch(&self, id: &str, at_ms: i64) {
        let mut latest = self.latest.lock().unwrap();
        let entry = latest.entry(id.to_owned()).or_insert(at_ms);
        *entry = (*entry).max(at_ms);
    }

    /// Brings a stored record up to the latest interaction seen in memory.
    pub(crate) fn apply(&self, record: &mut SandboxRecord) {
        if let Some(at) = self.latest.lock().unwrap().get(&record.id) {
            record.last_activity_ms = record.last_activity_ms.max(*at);
        }
    }

    pub(crate) fn forget(&self, id: &str) {
        self.latest.lock().unwrap().remove(id);
    }

    /// Writes what was seen since the last flush.
    pub(crate) async fn flush(&self, store: &Store) -> Result<(), StoreError> {
        let pending: Vec<(String, i64)> = self.latest.lock().unwrap().drain().collect();
        for (id, at) in pending {
            store.record_activity(&id, at).await?;
        }
        Ok(())
    }
}
