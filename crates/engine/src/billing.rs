//! Billing: the meter's intervals (written by the store with every change of
//! a sandbox's state or size, and of a snapshot) priced by `cove-billing`
//! at the server's price table; and the organization's quota and what it
//! uses now (`quota.rs` has the rules).

use std::sync::Arc;

use cove_billing::{Bill, Interval, Metered};
use cove_lifecycle::SandboxState;
use cove_store::{MeterKind, MeterRecord, OrganizationQuotaRecord, RegionQuotaRecord};

use crate::quota::{QuotaChange, Usage, ORGANIZATION_ID, REGION_ID};
use crate::shared::Shared;
use crate::{now_ms, EngineError};

#[derive(Clone)]
pub struct Billing {
    shared: Arc<Shared>,
    /// The organization's rate limits, read from the store once: every API
    /// request consults them.
    limits: Arc<tokio::sync::RwLock<Option<OrganizationQuotaRecord>>>,
}

impl Billing {
    pub(crate) fn new(shared: Arc<Shared>) -> Billing {
        Billing {
            shared,
            limits: Arc::default(),
        }
    }

    /// The organization's rate limits and counts (none when never set).
    pub async fn organization_quota(&self) -> Result<OrganizationQuotaRecord, EngineError> {
        if let Some(known) = self.limits.read().await.as_ref() {
            return Ok(known.clone());
        }
        let mut cached = self.limits.write().await;
        let stored = self
            .shared
            .store
            .organization_quota(ORGANIZATION_ID)
            .await?
            .unwrap_or_default();
        *cached = Some(stored.clone());
        Ok(stored)
    }

    /// Replaces the organization's rate limits and counts.
    pub async fn set_organization_quota(
        &self,
        quota: &OrganizationQuotaRecord,
    ) -> Result<(), EngineError> {
        let mut cached = self.limits.write().await;
        self.shared
            .store
            .save_organization_quota(ORGANIZATION_ID, quota, now_ms())
            .await?;
        *cached = Some(quota.clone());
        Ok(())
    }

    /// The bill of `[from_ms, to_ms)`: what was metered in it up to now.
    pub async fn bill(&self, from_ms: i64, to_ms: i64) -> Result<Bill, EngineError> {
        let bad = |reason: String| EngineError::Invalid {
            field: "to",
            reason,
        };
        let records = self.shared.store.meter_intervals(from_ms, to_ms).await?;
        let intervals: Vec<Interval> = records.into_iter().filter_map(interval).collect();
        cove_billing::bill(
            &intervals,
            from_ms,
            to_ms,
            now_ms(),
            &self.shared.config.prices,
        )
        .map_err(|e| bad(e.0))
    }

    /// The organization's quota in the server's region (no limits when
    /// none was set).
    pub async fn region_quota(&self) -> Result<RegionQuotaRecord, EngineError> {
        let stored = self
            .shared
            .store
            .region_quota(ORGANIZATION_ID, REGION_ID)
            .await?;
        Ok(stored.unwrap_or_else(|| RegionQuotaRecord {
            organization_id: ORGANIZATION_ID.into(),
            region_id: REGION_ID.into(),
            ..RegionQuotaRecord::default()
        }))
    }

    /// Changes the quota; sandboxes already running keep running, the
    /// next to start is held to it.
    pub async fn update_region_quota(
        &self,
        change: &QuotaChange,
    ) -> Result<RegionQuotaRecord, EngineError> {
        let mut quota = self.region_quota().await?;
        change.apply(&mut quota)?;
        quota.updated_at_ms = now_ms();
        self.shared.store.save_region_quota(&quota).await?;
        Ok(quota)
    }

    /// What the organization's sandboxes use now, and how many snapshots
    /// and volumes it keeps.
    pub async fn usage(&self) -> Result<(Usage, usize, usize), EngineError> {
        let sandboxes = self.shared.store.list_sandboxes().await?;
        let snapshots = self.shared.store.list_snapshots().await?;
        let volumes = self.shared.store.list_volumes().await?;
        Ok((
            Usage::of(&sandboxes, ""),
            snapshots.iter().filter(|s| !s.general).count(),
            volumes.len(),
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
