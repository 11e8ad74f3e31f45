//! `sort` and `order` of the list endpoints, as Daytona names them: the wire
//! names turned into the store's closed orders, an unknown one a 400 naming
//! what is allowed.

use cove_engine::{SandboxOrder, SandboxSortField, SnapshotRecord, SortDirection};

use crate::ApiError;

/// `GET /sandbox`'s fields: those of the SDK's `SandboxListSortField` and of
/// the deprecated paginated list, by wire name.
const SANDBOX_FIELDS: &[(&str, SandboxSortField)] = &[
    ("name", SandboxSortField::Name),
    ("cpu", SandboxSortField::Cpu),
    ("memoryGib", SandboxSortField::Memory),
    ("diskGib", SandboxSortField::Disk),
    ("lastActivityAt", SandboxSortField::LastActivityAt),
    ("createdAt", SandboxSortField::CreatedAt),
    ("id", SandboxSortField::Id),
    ("state", SandboxSortField::State),
    ("snapshot", SandboxSortField::Snapshot),
    // Every sandbox is in this server's one region, so the order by region
    // is the order among equals: creation time.
    ("region", SandboxSortField::CreatedAt),
    ("updatedAt", SandboxSortField::UpdatedAt),
];

const DIRECTIONS: &[(&str, SortDirection)] = &[
    ("asc", SortDirection::Ascending),
    ("desc", SortDirection::Descending),
];

/// Daytona's default for both lists: newest first.
const DEFAULT_DIRECTION: SortDirection = SortDirection::Descending;

fn pick<T: Copy>(what: &str, value: &str, allowed: &[(&'static str, T)]) -> Result<T, ApiError> {
    allowed
        .iter()
        .find(|(name, _)| *name == value)
        .map(|(_, item)| *item)
        .ok_or_else(|| {
            let names: Vec<&str> = allowed.iter().map(|(name, _)| *name).collect();
            ApiError::bad_request(format!(
                "unknown {what} {value:?}; use one of: {}",
                names.join(", ")
            ))
        })
}

fn direction(order: Option<&str>) -> Result<SortDirection, ApiError> {
    order.map_or(Ok(DEFAULT_DIRECTION), |order| {
        pick("order", order, DIRECTIONS)
    })
}

/// The order of `GET /sandbox?sort=..&order=..`; by default `createdAt`
/// `desc`, as Daytona lists.
pub(crate) fn sandbox_order(
    sort: Option<&str>,
    order: Option<&str>,
) -> Result<SandboxOrder, ApiError> {
    Ok(SandboxOrder {
        field: sort.map_or(Ok(SandboxSortField::CreatedAt), |sort| {
            pick("sort field", sort, SANDBOX_FIELDS)
        })?,
        direction: direction(order)?,
    })
}

/// What a list of snapshots is ordered by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SnapshotField {
    Name,
    State,
    CreatedAt,
    /// cove keeps no time of last use; a snapshot's last change stands in.
    UpdatedAt,
}

const SNAPSHOT_FIELDS: &[(&str, SnapshotField)] = &[
    ("name", SnapshotField::Name),
    ("state", SnapshotField::State),
    ("lastUsedAt", SnapshotField::UpdatedAt),
    ("createdAt", SnapshotField::CreatedAt),
];

/// Sorts snapshots as `GET /snapshots?sort=..&order=..` asks, before they
/// are paged; by default `createdAt` `desc`. Equals keep creation order in
/// the same direction, then names, so pages are stable.
pub(crate) fn sort_snapshots(
    snapshots: &mut [SnapshotRecord],
    sort: Option<&str>,
    order: Option<&str>,
) -> Result<(), ApiError> {
    let field = sort.map_or(Ok(SnapshotField::CreatedAt), |sort| {
        pick("sort field", sort, SNAPSHOT_FIELDS)
    })?;
    let direction = direction(order)?;
    snapshots.sort_by(|a, b| {
        let by_field = match field {
            SnapshotField::Name => a.name.cmp(&b.name),
            SnapshotField::State => a.state.as_str().cmp(b.state.as_str()),
            SnapshotField::CreatedAt => a.created_at_ms.cmp(&b.created_at_ms),
            SnapshotField::UpdatedAt => a.updated_at_ms.cmp(&b.updated_at_ms),
        };
        let ordering = by_field
            .then(a.created_at_ms.cmp(&b.created_at_ms))
            .then_with(|| a.name.cmp(&b.name));
        match direction {
            SortDirection::Ascending => ordering,
            SortDirection::Descending => ordering.reverse(),
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_orders_default_to_newest_first() {
        let order = sandbox_order(None, None).unwrap();
        assert_eq!(order.field, SandboxSortField::CreatedAt);
        assert_eq!(order.direction, SortDirection::Descending);
        let order = sandbox_order(Some("name"), Some("asc")).unwrap();
        assert_eq!(order.field, SandboxSortField::Name);
        assert_eq!(order.direction, SortDirection::Ascending);
        let order = sandbox_order(None, Some("asc")).unwrap();
        assert_eq!(order.field, SandboxSortField::CreatedAt);
        assert_eq!(order.direction, SortDirection::Ascending);
    }

    #[test]
    fn every_field_the_sdk_and_the_spec_name_is_known() {
        for name in [
            "name",
            "cpu",
            "memoryGib",
            "diskGib",
            "lastActivityAt",
            "createdAt",
            "id",
            "state",
            "snapshot",
            "region",
            "updatedAt",
        ] {
            sandbox_order(Some(name), None).unwrap();
        }
        assert_eq!(
            sandbox_order(Some("memoryGib"), None).unwrap().field,
            SandboxSortField::Memory
        );
    }

    #[test]
    fn unknown_fields_and_orders_name_what_is_allowed() {
        for (sort, order, named, allowed) in [
            (Some("size"), None, "\"size\"", "name, cpu, memoryGib"),
            (Some("Name"), None, "\"Name\"", "createdAt"),
            (None, Some("up"), "\"up\"", "asc, desc"),
            (Some("name"), Some("DESC"), "\"DESC\"", "asc, desc"),
        ] {
            let err = sandbox_order(sort, order).unwrap_err();
            assert_eq!(err.status, axum::http::StatusCode::BAD_REQUEST);
            assert!(err.message.contains(named), "{}", err.message);
            assert!(err.message.contains(allowed), "{}", err.message);
        }
        let mut none = Vec::new();
        let err = sort_snapshots(&mut none, Some("cpu"), None).unwrap_err();
        assert!(
            err.message.contains("name, state, lastUsedAt, createdAt"),
            "{}",
            err.message
        );
    }

    fn snapshot(name: &str, created_at_ms: i64) -> SnapshotRecord {
        SnapshotRecord::for_image(
            name,
            "/rootfs",
            cove_lifecycle::SandboxClass::Container,
            created_at_ms,
        )
    }

    #[test]
    fn snapshots_sort_by_the_field_asked_then_by_creation() {
        let mut snapshots = vec![snapshot("b", 2), snapshot("a", 3), snapshot("c", 1)];
        let names = |s: &[SnapshotRecord]| s.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        sort_snapshots(&mut snapshots, None, None).unwrap();
        assert_eq!(names(&snapshots), ["a", "b", "c"]);
        sort_snapshots(&mut snapshots, Some("name"), Some("desc")).unwrap();
        assert_eq!(names(&snapshots), ["c", "b", "a"]);
        sort_snapshots(&mut snapshots, Some("createdAt"), Some("asc")).unwrap();
        assert_eq!(names(&snapshots), ["c", "b", "a"]);
        // Equal states fall back to creation time.
        sort_snapshots(&mut snapshots, Some("state"), Some("asc")).unwrap();
        assert_eq!(names(&snapshots), ["c", "b", "a"]);
    }
}
