//! The filters of `GET /api/sandbox`, as Daytona's API names them: labels,
//! states, regions, an id or name prefix (case-insensitive), snapshot names,
//! classes, CPU, memory and disk bounds, public, and creation and last
//! activity times (`lastEvent*`, which the SDKs fill from `last_activity_*`). A filter cove cannot answer (`isRecoverable`, `autoDestroyAt*`) is
//! a 400 naming it rather than a list that ignores it.

use std::collections::BTreeMap;

use cove_engine::SandboxRecord;

use crate::ApiError;

/// Every filter of one list request; empty ones match everything.
#[derive(Debug, Default)]
pub(crate) struct SandboxFilter {
    labels: BTreeMap<String, String>,
    states: Vec<String>,
    regions: Vec<String>,
    id_prefix: Option<String>,
    name_prefix: Option<String>,
    snapshots: Vec<String>,
    classes: Vec<String>,
    cpu: Bounds,
    memory_gib: Bounds,
    disk_gib: Bounds,
    public: Option<bool>,
    created_ms: Bounds,
    last_event_ms: Bounds,
}

/// Inclusive bounds; `None` is open.
#[derive(Debug, Default, Clone, Copy)]
struct Bounds {
    min: Option<f64>,
    max: Option<f64>,
}

impl Bounds {
    fn holds(&self, value: f64) -> bool {
        self.min.is_none_or(|min| value >= min) && self.max.is_none_or(|max| value <= max)
    }
}

impl SandboxFilter {
    /// Takes `key=value` if it is a filter; `Ok(false)`: not one.
    pub(crate) fn take(&mut self, key: &str, value: &str) -> Result<bool, ApiError> {
        match key {
            "labels" => {
                self.labels = serde_json::from_str(value).map_err(|e| {
                    ApiError::bad_request(format!("labels must be a JSON object of strings: {e}"))
                })?
            }
            "states" => self.states.push(value.to_owned()),
            "regionIds" | "regions" => self.regions.push(value.to_owned()),
            "id" => self.id_prefix = Some(value.to_lowercase()),
            "name" => self.name_prefix = Some(value.to_lowercase()),
            "snapshots" => self.snapshots.push(value.to_owned()),
            "sandboxClasses" => self.classes.push(value.to_owned()),
            "minCpu" => self.cpu.min = Some(number(key, value)?),
            "maxCpu" => self.cpu.max = Some(number(key, value)?),
            "minMemoryGiB" => self.memory_gib.min = Some(number(key, value)?),
            "maxMemoryGiB" => self.memory_gib.max = Some(number(key, value)?),
            "minDiskGiB" => self.disk_gib.min = Some(number(key, value)?),
            "maxDiskGiB" => self.disk_gib.max = Some(number(key, value)?),
            "isPublic" => self.public = Some(boolean(key, value)?),
            "createdAtAfter" => self.created_ms.min = Some(instant(key, value)?),
            "createdAtBefore" => self.created_ms.max = Some(instant(key, value)?),
            "lastEventAfter" => self.last_event_ms.min = Some(instant(key, value)?),
            "lastEventBefore" => self.last_event_ms.max = Some(instant(key, value)?),
            // Every sandbox is shown: cove keeps no deleted ones, and its
            // warm VMs are no sandboxes until a create claims one.
            "includeErroredDeleted" | "includeWarm" => {
                boolean(key, value)?;
            }
            "isRecoverable" | "autoDestroyAtAfter" | "autoDestroyAtBefore" => {
                return Err(ApiError::bad_request(format!(
                    "cove cannot filter sandboxes by {key}; leave it out"
                )))
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    pub(crate) fn matches(&self, sandbox: &SandboxRecord) -> bool {
        let prefixed = |prefix: &Option<String>, text: &str| {
            prefix
                .as_ref()
                .is_none_or(|prefix| text.to_lowercase().starts_with(prefix))
        };
        let listed =
            |wanted: &[String], value: &str| wanted.is_empty() || wanted.iter().any(|w| w == value);
        let in_region =
            self.regions.is_empty() || self.regions.iter().any(|r| crate::regions::is_known(r));
        in_region
            && (self.labels.iter()).all(|(k, v)| sandbox.labels.get(k) == Some(v))
            && listed(&self.states, sandbox.state.wire())
            && prefixed(&self.id_prefix, &sandbox.id)
            && prefixed(&self.name_prefix, &sandbox.name)
            && listed(&self.snapshots, &sandbox.snapshot)
            && listed(&self.classes, sandbox.class.as_str())
            && self.cpu.holds(sandbox.cpu as f64)
            && self.memory_gib.holds(sandbox.memory_mib as f64 / 1024.0)
            && self.disk_gib.holds(sandbox.disk_gib as f64)
            && self.public.is_none_or(|public| public == sandbox.public)
            && self.created_ms.holds(sandbox.created_at_ms as f64)
            && self.last_event_ms.holds(sandbox.last_activity_ms as f64)
    }
}

fn number(key: &str, value: &str) -> Result<f64, ApiError> {
    value
        .parse::<f64>()
        .ok()
        .filter(|n| n.is_finite())
        .ok_or_else(|| ApiError::bad_request(format!("{key} must be a number, not {value:?}")))
}

pub(crate) fn boolean(key: &str, value: &str) -> Result<bool, ApiError> {
    match value {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(ApiError::bad_request(format!(
            "{key} must be true or false, not {value:?}"
        ))),
    }
}

/// An ISO 8601 time, as milliseconds since the epoch. RFC 3339 and what the
/// SDKs send besides: the Python SDK writes `+0000` offsets without a colon,
/// and a naive `datetime` with none at all (taken as UTC).
pub(crate) fn instant(key: &str, value: &str) -> Result<f64, ApiError> {
    let rfc3339 = &time::format_description::well_known::Rfc3339;
    let at = time::OffsetDateTime::parse(&as_rfc3339(value), rfc3339).map_err(|e| {
        ApiError::bad_request(format!(
            "{key} must be an RFC 3339 time such as 2024-01-01T00:00:00Z, not {value:?}: {e}"
        ))
    })?;
    Ok((at.unix_timestamp_nanos() / 1_000_000) as f64)
}

/// `value` with its offset written as RFC 3339 wants it: `+hh:mm` or `Z`.
fn as_rfc3339(value: &str) -> String {
    // `2025-06-09 12:00:00+00:00`, as Daytona's own examples write times.
    let value = &match value.as_bytes().get(10) {
        Some(b' ') => format!("{}T{}", &value[..10], &value[11..]),
        _ => value.to_owned(),
    };
    let Some((_, clock)) = value.split_once('T') else {
        return value.to_owned();
    };
    if clock.ends_with(['Z', 'z']) {
        return value.to_owned();
    }
    match clock.rfind(['+', '-']) {
        Some(sign) => {
            let offset = &clock[sign + 1..];
            if offset.len() == 4 && offset.bytes().all(|b| b.is_ascii_digit()) {
                let cut = value.len() - 2;
                format!("{}:{}", &value[..cut], &value[cut..])
            } else {
                value.to_owned()
            }
        }
        None => format!("{value}Z"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, name: &str, cpu: i64, memory_mib: i64) -> SandboxRecord {
        // 2024-01-01T00:00:00Z
        let created = 1_704_067_200_000;
        SandboxRecord {
            snapshot: "daytona-small".into(),
            cpu,
            memory_mib,
            created_at_ms: created,
            updated_at_ms: created,
            state_since_ms: created,
            last_activity_ms: created,
            ..SandboxRecord::sample(id, name)
        }
    }

    fn filter(pairs: &[(&str, &str)]) -> SandboxFilter {
        let mut filter = SandboxFilter::default();
        for (key, value) in pairs {
            assert!(filter.take(key, value).unwrap(), "{key} is a filter");
        }
        filter
    }

    #[test]
    fn prefixes_ignore_case_and_bounds_include_their_ends() {
        let sandbox = record("83644e08-aaaa", "Probe-B", 2, 2048);
        assert!(filter(&[("id", "83644E")]).matches(&sandbox));
        assert!(!filter(&[("id", "644e")]).matches(&sandbox));
        assert!(filter(&[("name", "probe-")]).matches(&sandbox));
        assert!(!filter(&[("name", "probe-a")]).matches(&sandbox));
        assert!(filter(&[("minCpu", "2"), ("maxCpu", "2")]).matches(&sandbox));
        assert!(!filter(&[("minCpu", "8")]).matches(&sandbox));
        assert!(filter(&[("minMemoryGiB", "2")]).matches(&sandbox));
        assert!(!filter(&[("maxMemoryGiB", "1")]).matches(&sandbox));
        assert!(!filter(&[("snapshots", "nope")]).matches(&sandbox));
        assert!(filter(&[("snapshots", "nope"), ("snapshots", "daytona-small")]).matches(&sandbox));
        assert!(filter(&[("sandboxClasses", "container")]).matches(&sandbox));
        assert!(!filter(&[("sandboxClasses", "linux-vm")]).matches(&sandbox));
        assert!(filter(&[("createdAtAfter", "2023-12-31T23:59:59Z")]).matches(&sandbox));
        assert!(!filter(&[("createdAtBefore", "2023-12-31T23:59:59Z")]).matches(&sandbox));
        assert!(filter(&[("isPublic", "false")]).matches(&sandbox));
        // A naive time is UTC; an offset may lack its colon (Python's %z).
        assert!(filter(&[("createdAtAfter", "2024-01-01T00:59:59.5+0100")]).matches(&sandbox));
        assert!(!filter(&[("createdAtAfter", "2024-01-01T00:00:00.5-0000")]).matches(&sandbox));
        assert!(filter(&[("lastEventAfter", "2023-12-31T23:59:59.5")]).matches(&sandbox));
        assert!(!filter(&[("lastEventAfter", "2024-01-01T00:00:00.001")]).matches(&sandbox));
    }

    #[test]
    fn bad_values_and_unanswerable_filters_are_refused() {
        let mut filter = SandboxFilter::default();
        assert!(filter.take("minCpu", "lots").is_err());
        assert!(filter.take("isPublic", "yes").is_err());
        assert!(filter.take("createdAtAfter", "yesterday").is_err());
        let refused = filter.take("isRecoverable", "true").unwrap_err();
        assert!(
            refused.message.contains("isRecoverable"),
            "{}",
            refused.message
        );
        assert!(!filter.take("cursor", "0").unwrap());
    }
}
