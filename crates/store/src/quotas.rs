//! Region quotas: what an organization may use in one region.

use serde::{Deserialize, Serialize};
use sqlx::{AnyConnection, Row};

use crate::{Store, StoreError};

/// Requests of one kind allowed per window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLimit {
    pub requests: u64,
    pub window_seconds: u64,
}

/// An organization's rate limits and counts; `None` is no limit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct OrganizationQuotaRecord {
    /// Every request to the control API.
    pub authenticated: Option<RateLimit>,
    /// Sandbox creates (and forks).
    pub sandbox_create: Option<RateLimit>,
    /// Sandbox starts, stops, pauses, resumes, archives and deletes.
    pub sandbox_lifecycle: Option<RateLimit>,
    /// How many volumes may exist.
    pub volumes: Option<i64>,
    /// How many snapshots (not counting the server's own images) may exist.
    pub snapshots: Option<i64>,
}

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
    /// The rate limits and counts of `organization_id`, if any were set.
    pub async fn organization_quota(
        &self,
        organization_id: &str,
    ) -> Result<Option<OrganizationQuotaRecord>, StoreError> {
        let row =
            sqlx::query("SELECT settings FROM organization_quotas WHERE organization_id = $1")
                .bind(organization_id)
                .fetch_optional(&self.pool)
                .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let settings: String = row.try_get("settings")?;
        serde_json::from_str(&settings)
            .map(Some)
            .map_err(|source| StoreError::Undecodable {
                id: organization_id.to_owned(),
                column: "settings",
                source,
            })
    }

    /// Sets (replaces) an organization's rate limits and counts.
    pub async fn save_organization_quota(
        &self,
        organization_id: &str,
        quota: &OrganizationQuotaRecord,
        at_ms: i64,
    ) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await?;
        write_organization_quota(&mut conn, organization_id, quota, at_ms).await
    }

    /// Sets (replaces) an organization's rate limits and counts and its
    /// region quota together: both or neither.
    pub async fn save_quotas(
        &self,
        organization_id: &str,
        quota: &OrganizationQuotaRecord,
        region: &RegionQuotaRecord,
        at_ms: i64,
    ) -> Result<(), StoreError> {
        let mut tx = self.write().await?;
        write_organization_quota(&mut tx, organization_id, quota, at_ms).await?;
        write_region_quota(&mut tx, region).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The quota of `organization_id` in `region_id`, if one was set.
    pub async fn region_quota(
        &self,
        organization_id: &str,
        region_id: &str,
    ) -> Result<Option<RegionQuotaRecord>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM region_quotas WHERE organization_id = $1 AND region_id = $2"
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
        let mut conn = self.pool.acquire().await?;
        write_region_quota(&mut conn, q).await
    }
}

async fn write_organization_quota(
    conn: &mut AnyConnection,
    organization_id: &str,
    quota: &OrganizationQuotaRecord,
    at_ms: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO organization_quotas (organization_id, settings, updated_at_ms) \
         VALUES ($1, $2, $3) ON CONFLICT(organization_id) DO UPDATE SET \
         settings = excluded.settings, updated_at_ms = excluded.updated_at_ms",
    )
    .bind(organization_id)
    .bind(serde_json::to_string(quota).expect("a quota serializes"))
    .bind(at_ms)
    .execute(conn)
    .await?;
    Ok(())
}

async fn write_region_quota(
    conn: &mut AnyConnection,
    q: &RegionQuotaRecord,
) -> Result<(), StoreError> {
    let sql = format!(
        "INSERT INTO region_quotas ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
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
        .execute(conn)
        .await?;
    Ok(())
}
