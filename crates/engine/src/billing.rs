//! Billing: the meter's intervals (written by the store with every change of
//! a sandbox's state or size, and of a snapshot) priced by `cove-billing`
//! at the server's price table; and the organization's quota and what it
//! uses now (`quota.rs` has the rules).

use std::sync::Arc;

use cove_billing::{Bill, Interval, Metered};
use cove_lifecycle::SandboxState;
use cove_store::{MeterKind, MeterRecord, OrganizationQuotaRecord, RegionQuotaRecord};

use crate::quota::{Counted, QuotaChange, Usage, REGION_ID};
use crate::shared::Shared;
use crate::{now_ms, EngineError};

#[derive(Clone)]
pub struct Billing {
    shared: Arc<Shared>,
}

impl Billing {
    pub(crate) fn new(shared: Arc<Shared>) -> Billing {
        Billing { shared }
    }

    /// An organization's rate limits and counts (none when never set).
    pub async fn organization_quota(
        &self,
        organization_id: &str,
    ) -> Result<OrganizationQuotaRecord, EngineError> {
        self.shared.organization_quota(organization_id).await
    }

    /// Replaces an organization's rate limits and counts, and changes its
    /// per-sandbox ceilings (`PATCH /api/organizations/{id}/quota`): both in
    /// one write, or neither.
    pub async fn update_organization_quota(
        &self,
        organization_id: &str,
        quota: &OrganizationQuotaRecord,
        ceilings: &QuotaChange,
    ) -> Result<(), EngineError> {
        let region = self.changed_region_quota(organization_id, ceilings).await?;
        self.shared
            .set_quotas(organization_id, quota, &region)
            .await
    }

    /// The bill of an organization for `[from_ms, to_ms)`: what was metered
    /// in it up to now.
    pub async fn bill(
        &self,
        organization_id: &str,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<Bill, EngineError> {
        let bad = |reason: String| EngineError::Invalid {
            field: "to",
            reason,
        };
        let records = self.shared.store.meter_intervals(from_ms, to_ms).await?;
        let intervals: Vec<Interval> = records
            .into_iter()
            .filter(|r| r.organization_id == organization_id)
            .filter_map(interval)
            .collect();
        cove_billing::bill(
            &intervals,
            from_ms,
            to_ms,
            now_ms(),
            &self.shared.config.prices,
        )
        .map_err(|e| bad(e.0))
    }

    /// An organization's quota in the server's region (no limits when
    /// none was set).
    pub async fn region_quota(
        &self,
        organization_id: &str,
    ) -> Result<RegionQuotaRecord, EngineError> {
        let stored = self
            .shared
            .store
            .region_quota(organization_id, REGION_ID)
            .await?;
        Ok(stored.unwrap_or_else(|| RegionQuotaRecord {
            organization_id: organization_id.into(),
            region_id: REGION_ID.into(),
            ..RegionQuotaRecord::default()
        }))
    }

    /// Changes the quota; sandboxes already running keep running, the
    /// next to start is held to it.
    pub async fn update_region_quota(
        &self,
        organization_id: &str,
        change: &QuotaChange,
    ) -> Result<RegionQuotaRecord, EngineError> {
        let quota = self.changed_region_quota(organization_id, change).await?;
        self.shared.store.save_region_quota(&quota).await?;
        Ok(quota)
    }

    /// An organization's region quota with `change` made, not yet stored.
    async fn changed_region_quota(
        &self,
        organization_id: &str,
        change: &QuotaChange,
    ) -> Result<RegionQuotaRecord, EngineError> {
        let mut quota = self.region_quota(organization_id).await?;
        change.apply(&mut quota)?;
        quota.updated_at_ms = now_ms();
        Ok(quota)
    }

    /// What an organization's sandboxes use now, and how many snapshots
    /// and volumes it keeps.
    pub async fn usage(&self, organization_id: &str) -> Result<(Usage, usize, usize), EngineError> {
        let sandboxes = self.shared.store.list_sandboxes().await?;
        let ours = sandboxes
            .iter()
            .filter(|s| s.organization_id == organization_id);
        Ok((
            Usage::of(ours, ""),
            self.shared
                .count(organization_id, Counted::Snapshots)
                .await?,
            self.shared.count(organization_id, Counted::Volumes).await?,
        ))
    }
}

/// A stored interval as the bill reads it; a sandbox state this build does
/// not know (a newer server's) is left out rather than guessed at.
fn interval(record: MeterRecord) -> Option<Interval> {
    let metered = match record.kind {
        MeterKind::Sandbox => Metered::Sandbox {
            state: record.state.parse::<SandboxState>().ok()?,
            cpu: record.cpu,
            memory_mib: record.memory_mib,
            disk_gib: record.disk_gib,
        },
        MeterKind::Snapshot => Metered::Snapshot {
            size_bytes: record.size_bytes,
        },
    };
    Some(Interval {
        resource_id: record.resource_id,
        name: record.name,
        metered,
        started_ms: record.started_ms,
        ended_ms: record.ended_ms,
    })
}
