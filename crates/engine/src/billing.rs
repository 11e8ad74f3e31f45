//! Billing: the meter's intervals (written by the store with every change of
//! a sandbox's state or size, and of a snapshot) priced by `cove-billing`
//! at the server's price table.

use std::sync::Arc;

use cove_billing::{Bill, Interval, Metered};
use cove_lifecycle::SandboxState;
use cove_store::{MeterKind, MeterRecord};

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

    /// The bill of `[from_ms, to_ms)`: what was metered in it up to now.
    pub async fn bill(&self, from_ms: i64, to_ms: i64) -> Result<Bill, EngineError> {
        let bad = |reason: String| EngineError::Invalid {
            field: "to",
            reason,
        };
        if to_ms <= from_ms {
            return Err(bad("the period must end after it starts".into()));
        }
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
