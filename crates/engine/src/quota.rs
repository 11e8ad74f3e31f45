//! Quotas: what an organization's sandboxes may use at once in a region.
//!
//! A sandbox holds a running slot, its vCPUs and its memory while it runs or
//! is on its way to running (`creating`, `starting`, `resuming`, ... with
//! `started` as its goal); stopped, paused, archived and failed ones do not.
//! Its disk counts in every state but archived. Admission is checked, under
//! one lock, where a sandbox comes to hold a slot: a create or fork (before
//! its row is stored) and a start or resume (before its transient state is),
//! so two requests can never both take the last slot.

use cove_lifecycle::{DesiredState, SandboxState};
use cove_store::{RegionQuotaRecord, SandboxRecord};

use crate::EngineError;

/// The one region of a server, the `target` of every sandbox.
pub const REGION_ID: &str = cove_store::DEFAULT_REGION;

/// Whether `record` holds a running slot, its vCPUs and its memory.
pub(crate) fn occupies(record: &SandboxRecord) -> bool {
    record.state.is_running()
        || (record.state.is_transient() && record.desired_state == DesiredState::Started)
}

/// What an organization's sandboxes use now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub running: i64,
    pub cpu: i64,
    pub memory_gib: i64,
    pub disk_gib: i64,
}

impl Usage {
    /// The use of `records`, leaving out the sandbox `except` (the one being
    /// admitted, whose row may say it is on its way already).
    pub(crate) fn of<'a>(
        records: impl IntoIterator<Item = &'a SandboxRecord>,
        except: &str,
    ) -> Usage {
        let mut usage = Usage::default();
        for record in records.into_iter().filter(|r| r.id != except) {
            usage.add(record);
        }
        usage
    }

    /// Counts `record` in: its CPU and memory while it runs (or is on its
    /// way to), its disk unless it is archived.
    pub(crate) fn add(&mut self, record: &SandboxRecord) {
        if occupies(record) {
            self.running += 1;
            self.cpu += record.cpu;
            self.memory_gib += memory_gib(record);
        }
        if record.state != SandboxState::Archived {
            self.disk_gib += record.disk_gib;
        }
    }
}

/// A sandbox's memory in whole GiB, rounded up, as quotas count it.
pub(crate) fn memory_gib(record: &SandboxRecord) -> i64 {
    (record.memory_mib + 1023) / 1024
}

/// Whether `sandbox`, about to run (and to exist, when `new`), fits `quota`
/// beside `usage`; a refusal names the quota, its limit and the use.
pub(crate) fn admit(
    quota: &RegionQuotaRecord,
    usage: &Usage,
    sandbox: &SandboxRecord,
    new: bool,
) -> Result<(), EngineError> {
    let ceilings = [
        (
            "maxCpuPerSandbox",
            quota.max_cpu_per_sandbox,
            sandbox.cpu,
            "vCPUs",
        ),
        (
            "maxMemoryPerSandbox",
            quota.max_memory_per_sandbox,
            memory_gib(sandbox),
            "GiB of memory",
        ),
        (
            "maxDiskPerSandbox",
            quota.max_disk_per_sandbox,
            sandbox.disk_gib,
            "GiB of disk",
        ),
    ];
    for (name, limit, asked, unit) in ceilings {
        if let Some(limit) = limit.filter(|&limit| asked > limit) {
            return Err(EngineError::Invalid {
                field: name,
                reason: format!(
                    "the sandbox asks for {asked} {unit}, above the organization's {name} of {limit}"
                ),
            });
        }
    }
    let disk_added = if new { sandbox.disk_gib } else { 0 };
    let totals = [
        (
            "maxRunningSandboxes",
            quota.max_running_sandboxes,
            usage.running,
            1,
            "sandboxes running",
        ),
        (
            "totalCpuQuota",
            quota.total_cpu,
            usage.cpu,
            sandbox.cpu,
            "vCPUs running",
        ),
        (
            "totalMemoryQuota",
            quota.total_memory_gib,
            usage.memory_gib,
            memory_gib(sandbox),
            "GiB of memory running",
        ),
        (
            "totalDiskQuota",
            quota.total_disk_gib,
            usage.disk_gib,
            disk_added,
            "GiB of disk kept",
        ),
    ];
    for (quota, limit, used, asked, what) in totals {
        if let Some(limit) = limit.filter(|&limit| used + asked > limit) {
            return Err(EngineError::QuotaExceeded {
                quota,
                limit,
                message: format!(
                    "quota {quota} is {limit} and {used} {what} already; this sandbox needs {asked} more \
                     (stop, pause or archive one, or ask the operator to raise it)"
                ),
            });
        }
    }
    Ok(())
}

/// What an organization keeps a count of under a quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counted {
    Volumes,
    Snapshots,
}

/// Whether one more of `kind` fits `limit` beside the `used` ones.
pub(crate) fn admit_count(kind: Counted, limit: i64, used: i64) -> Result<(), EngineError> {
    let (quota, what) = match kind {
        Counted::Volumes => ("volumeQuota", "volumes"),
        Counted::Snapshots => ("snapshotQuota", "snapshots"),
    };
    if used < limit {
        return Ok(());
    }
    Err(EngineError::QuotaExceeded {
        quota,
        limit,
        message: format!(
            "quota {quota} is {limit} and {used} {what} exist already \
             (delete one, or ask the operator to raise it)"
        ),
    })
}

/// A change of a region quota: `None` leaves a field as it is, `Some(None)`
/// lifts its limit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuotaChange {
    pub total_cpu: Option<Option<i64>>,
    pub total_memory_gib: Option<Option<i64>>,
    pub total_disk_gib: Option<Option<i64>>,
    pub max_running_sandboxes: Option<Option<i64>>,
    pub max_cpu_per_sandbox: Option<Option<i64>>,
    pub max_memory_per_sandbox: Option<Option<i64>>,
    pub max_disk_per_sandbox: Option<Option<i64>>,
}

impl QuotaChange {
    /// `quota` with this change made, or the first field below zero.
    pub(crate) fn apply(&self, quota: &mut RegionQuotaRecord) -> Result<(), EngineError> {
        let fields = [
            ("totalCpuQuota", self.total_cpu, &mut quota.total_cpu),
            (
                "totalMemoryQuota",
                self.total_memory_gib,
                &mut quota.total_memory_gib,
            ),
            (
                "totalDiskQuota",
                self.total_disk_gib,
                &mut quota.total_disk_gib,
            ),
            (
                "maxRunningSandboxes",
                self.max_running_sandboxes,
                &mut quota.max_running_sandboxes,
            ),
            (
                "maxCpuPerSandbox",
                self.max_cpu_per_sandbox,
                &mut quota.max_cpu_per_sandbox,
            ),
            (
                "maxMemoryPerSandbox",
                self.max_memory_per_sandbox,
                &mut quota.max_memory_per_sandbox,
            ),
            (
                "maxDiskPerSandbox",
                self.max_disk_per_sandbox,
                &mut quota.max_disk_per_sandbox,
            ),
        ];
        let mut changed = Vec::new();
        for (name, change, field) in fields {
            if let Some(value) = change {
                if let Some(v) = value.filter(|v| *v < 0) {
                    return Err(EngineError::Invalid {
                        field: name,
                        reason: format!(
                            "{name} must be zero or more, or null for no limit, not {v}"
                        ),
                    });
                }
                changed.push((field, value));
            }
        }
        for (field, value) in changed {
            *field = value;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str, state: SandboxState, desired: DesiredState) -> SandboxRecord {
        let mut record = cove_store::SandboxRecord::sample(id, id);
        record.state = state;
        record.desired_state = desired;
        record.cpu = 2;
        record.memory_mib = 2048;
        record.disk_gib = 5;
        record
    }

    fn unlimited() -> RegionQuotaRecord {
        RegionQuotaRecord {
            organization_id: crate::DEFAULT_ORGANIZATION.into(),
            region_id: REGION_ID.into(),
            ..RegionQuotaRecord::default()
        }
    }

    #[test]
    fn running_and_starting_sandboxes_hold_slots_and_stopped_paused_archived_ones_do_not() {
        use DesiredState as D;
        use SandboxState as S;
        let records = [
            sandbox("a", S::Started, D::Started),
            sandbox("b", S::Starting, D::Started),
            sandbox("c", S::Stopped, D::Stopped),
            sandbox("d", S::Paused, D::Paused),
            sandbox("e", S::Archived, D::Archived),
            sandbox("f", S::Stopping, D::Stopped),
            sandbox("g", S::Error, D::Started),
        ];
        let usage = Usage::of(&records, "none");
        assert_eq!(
            usage,
            Usage {
                running: 2,
                cpu: 4,
                memory_gib: 4,
                disk_gib: 6 * 5,
            }
        );
        // The sandbox being admitted is not counted against itself.
        assert_eq!(Usage::of(&records, "a").running, 1);
    }

    #[test]
    fn a_sandbox_past_a_total_is_refused_naming_the_quota_its_limit_and_the_use() {
        let quota = RegionQuotaRecord {
            max_running_sandboxes: Some(1),
            ..unlimited()
        };
        let new = sandbox("n", SandboxState::Creating, DesiredState::Started);
        admit(&quota, &Usage::default(), &new, true).unwrap();
        let busy = Usage {
            running: 1,
            cpu: 2,
            memory_gib: 2,
            disk_gib: 5,
        };
        let error = admit(&quota, &busy, &new, true).unwrap_err();
        let text = error.to_string();
        assert!(text.contains("maxRunningSandboxes is 1"), "{text}");
        assert!(text.contains("1 sandboxes running"), "{text}");
        assert_eq!(error.kind(), crate::ErrorKind::Forbidden);

        let cpu = RegionQuotaRecord {
            total_cpu: Some(3),
            ..unlimited()
        };
        let text = admit(&cpu, &busy, &new, true).unwrap_err().to_string();
        assert!(text.contains("totalCpuQuota is 3"), "{text}");
        // Disk counts for a new sandbox only: a start adds none.
        let disk = RegionQuotaRecord {
            total_disk_gib: Some(8),
            ..unlimited()
        };
        assert!(admit(&disk, &busy, &new, true).is_err());
        admit(&disk, &busy, &new, false).unwrap();
    }

    #[test]
    fn a_count_quota_admits_up_to_its_limit_and_names_itself_past_it() {
        admit_count(Counted::Snapshots, 2, 1).unwrap();
        let error = admit_count(Counted::Snapshots, 2, 2).unwrap_err();
        assert_eq!(error.kind(), crate::ErrorKind::Forbidden);
        assert!(
            error
                .to_string()
                .contains("snapshotQuota is 2 and 2 snapshots"),
            "{error}"
        );
        assert!(admit_count(Counted::Volumes, 0, 0)
            .unwrap_err()
            .to_string()
            .contains("volumeQuota is 0"));
    }

    #[test]
    fn a_sandbox_above_a_per_sandbox_ceiling_is_a_bad_request() {
        let quota = RegionQuotaRecord {
            max_memory_per_sandbox: Some(1),
            ..unlimited()
        };
        let new = sandbox("n", SandboxState::Creating, DesiredState::Started);
        let error = admit(&quota, &Usage::default(), &new, true).unwrap_err();
        assert_eq!(error.kind(), crate::ErrorKind::BadRequest);
        assert!(error.to_string().contains("maxMemoryPerSandbox"), "{error}");
    }

    #[test]
    fn a_change_sets_lifts_or_leaves_each_field_and_refuses_negatives_whole() {
        let mut q = RegionQuotaRecord {
            total_cpu: Some(4),
            max_disk_per_sandbox: Some(9),
            ..unlimited()
        };
        let change = QuotaChange {
            max_running_sandboxes: Some(Some(2)),
            total_cpu: Some(None),
            ..QuotaChange::default()
        };
        change.apply(&mut q).unwrap();
        assert_eq!(q.max_running_sandboxes, Some(2));
        assert_eq!(q.total_cpu, None);
        assert_eq!(q.max_disk_per_sandbox, Some(9));
        let bad = QuotaChange {
            max_disk_per_sandbox: Some(Some(1)),
            total_memory_gib: Some(Some(-1)),
            ..QuotaChange::default()
        };
        assert!(bad.apply(&mut q).is_err());
        assert_eq!(
            q.max_disk_per_sandbox,
            Some(9),
            "nothing of a refused change is made"
        );
    }
}
