//! The audit log: the front end records each change asked of the control
//! API; the engine keeps it in the store.

use cove_store::{AuditQuery, AuditRecord};

use super::Access;
use crate::EngineError;

impl Access {
    pub async fn record_audit(&self, record: &AuditRecord) -> Result<(), EngineError> {
        Ok(self.shared.store.insert_audit(record).await?)
    }

    /// The records matching `query`, newest first, a page of `limit` after
    /// `offset`; and how many match in all.
    pub async fn audit_log(
        &self,
        query: &AuditQuery,
        offset: u64,
        limit: u64,
    ) -> Result<(Vec<AuditRecord>, u64), EngineError> {
        Ok(self.shared.store.audit_page(query, offset, limit).await?)
    }
}
