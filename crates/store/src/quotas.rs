//! Region quotas: what an organization may use in one region.

use sqlx::Row;

use crate::{Store, StoreError};

/// An organization's limits in a region; `None` is no limit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionQuotaRecord {
    pub organization_id: String,
    pub region_id: String,
    /// vCPUs of its running sandboxes together.
    pub total_cpu: Option<i64>,
    /// Memory of its running sandboxes together, GiB.
    pub total_memory_gib: Option<i64>,
    /// Disk of its sandboxes that are not archived, GiB.
    pub total_disk_gib: Option<i64>,
    pub max_running_sandboxes: Option<i64>,
    pub max_cpu_per_sandbox: Option<i64>,
    pub max_memory_per_sandbox: Option<i64>,
    pub max_disk_per_sandbox: Option<i64>,
    pub updated_at_ms: i64,
}

const COLUMNS: &str = "organization_id, region_id, total_cpu, total_memory_gib, total_disk_gib, \
    max_running_sandboxes, max_cpu_per_sandbox, max_memory_per_sandbox, max_disk_per_sandbox, \
    updated_at_ms";

impl Store {
    /// The quota of `organization_id` in `region_id`, if one was set.
    pub async fn region_quota(
        &self,
        organization_id: &str,
        region_id: &str,
    ) -> Result<Option<RegionQuotaRecord>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM region_quotas WHERE organization_id = ?1 AND region_id = ?2"
        );
        let row = sqlx::query(&sql)
            .bind(organization_id)
            .bind(region_id)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        Ok(Some(RegionQuotaRecord {
            organization_id: row.try_get("organization_id")?,
            region_id: row.try_get("region_id")?,
            total_cpu: row.try_get("total_cpu")?,
            total_memory_gib: row.try_get("total_memory_gib")?,
            total_disk_gib: row.try_get("total_disk_gib")?,
            max_running_sandboxes: row.try_get("max_running_sandboxes")?,
            max_cpu_per_sandbox: row.try_get("max_cpu_per_sandbox")?,
            max_memory_per_sandbox: row.try_get("max_memory_per_sandbox")?,
            max_disk_per_sandbox: row.try_get("max_disk_per_sandbox")?,
            updated_at_ms: row.try_get("updated_at_ms")?,
        }))
    }

    /// Sets (replaces) a region quota.
    pub async fn save_region_quota(&self, q: &RegionQuotaRecord) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO region_quotas ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) \
             ON CONFLICT(organization_id, region_id) DO UPDATE SET \
             total_cpu = excluded.total_cpu, total_memory_gib = excluded.total_memory_gib, \
             total_disk_gib = excluded.total_disk_gib, \
             max_running_sandboxes = excluded.max_running_sandboxes, \
             max_cpu_per_sandbox = excluded.max_cpu_per_sandbox, \
             max_memory_per_sandbox = excluded.max_memory_per_sandbox, \
             max_disk_per_sandbox = excluded.max_disk_per_sandbox, \
             updated_at_ms = excluded.updated_at_ms"
        );
        sqlx::query(&sql)
            .bind(&q.organization_id)
            .bind(&q.region_id)
            .bind(q.total_cpu)
            .bind(q.total_memory_gib)
            .bind(q.total_disk_gib)
            .bind(q.max_running_sandboxes)
            .bind(q.max_cpu_per_sandbox)
            .bind(q.max_memory_per_sandbox)
            .bind(q.max_disk_per_sandbox)
            .bind(q.updated_at_ms)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
