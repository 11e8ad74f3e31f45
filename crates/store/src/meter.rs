//! The meter: intervals of unchanged state and size, written in the same
//! transaction as the change that ends one and starts the next.

use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};

use crate::{SandboxRecord, SnapshotRecord, SnapshotState, Store, StoreError};

/// What an interval measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MeterKind {
    Sandbox,
    Snapshot,
}

impl MeterKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Sandbox => "sandbox",
            Self::Snapshot => "snapshot",
        }
    }
}

/// A resource, unchanged from `started_ms` to `ended_ms` (`None`: still so).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeterRecord {
    pub kind: MeterKind,
    pub resource_id: String,
    /// The organization the resource belongs to (and whose bill it is on).
    pub organization_id: String,
    pub name: String,
    /// The sandbox's or snapshot's state, as the store names it.
    pub state: String,
    pub cpu: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
    pub size_bytes: i64,
    pub started_ms: i64,
    pub ended_ms: Option<i64>,
}

/// The metered columns of a resource at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Measure {
    organization_id: String,
    state: String,
    cpu: i64,
    memory_mib: i64,
    disk_gib: i64,
    size_bytes: i64,
}

impl Measure {
    pub(crate) fn of_sandbox(s: &SandboxRecord) -> Measure {
        Measure {
            organization_id: s.organization_id.clone(),
            state: s.state.as_str().to_owned(),
            cpu: s.cpu,
            memory_mib: s.memory_mib,
            disk_gib: s.disk_gib,
            size_bytes: 0,
        }
    }

    /// A snapshot is metered while it is usable and a user's: the server's
    /// own images are not anyone's storage.
    pub(crate) fn of_snapshot(s: &SnapshotRecord) -> Option<Measure> {
        (s.state == SnapshotState::Active && !s.general).then(|| Measure {
            organization_id: s.organization_id.clone(),
            state: s.state.as_str().to_owned(),
            cpu: 0,
            memory_mib: 0,
            disk_gib: 0,
            size_bytes: s.size_bytes.unwrap_or(0),
        })
    }
}

const COLUMNS: &str =
    "kind, resource_id, organization_id, name, state, cpu, memory_mib, disk_gib, size_bytes, started_ms, ended_ms";

fn from_row(row: &AnyRow) -> Result<MeterRecord, StoreError> {
    let kind = match row.try_get::<String, _>("kind")?.as_str() {
        "sandbox" => MeterKind::Sandbox,
        "snapshot" => MeterKind::Snapshot,
        other => {
            return Err(StoreError::Corrupt {
                id: row.try_get("resource_id")?,
                reason: format!("meter kind {other:?}"),
            })
        }
    };
    Ok(MeterRecord {
        kind,
        resource_id: row.try_get("resource_id")?,
        organization_id: row.try_get("organization_id")?,
        name: row.try_get("name")?,
        state: row.try_get("state")?,
        cpu: row.try_get("cpu")?,
        memory_mib: row.try_get("memory_mib")?,
        disk_gib: row.try_get("disk_gib")?,
        size_bytes: row.try_get("size_bytes")?,
        started_ms: row.try_get("started_ms")?,
        ended_ms: row.try_get("ended_ms")?,
    })
}

/// Closes the resource's open interval at `at_ms` and opens one for
/// `measure` from then, unless the open one already measures that (`None`
/// closes without opening: the resource is gone or no longer metered). Time
/// never runs backwards: an interval ends no earlier than it started.
pub(crate) async fn meter(
    conn: &mut AnyConnection,
    kind: MeterKind,
    id: &str,
    name: &str,
    measure: Option<Measure>,
    at_ms: i64,
) -> Result<(), StoreError> {
    let open = sqlx::query(&format!(
        "SELECT seq, {COLUMNS} FROM meter WHERE kind = $1 AND resource_id = $2 AND ended_ms IS NULL"
    ))
    .bind(kind.as_str())
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    let mut from_ms = at_ms;
    if let Some(row) = open {
        let record = from_row(&row)?;
        let same = Measure {
            organization_id: record.organization_id,
            state: record.state,
            cpu: record.cpu,
            memory_mib: record.memory_mib,
            disk_gib: record.disk_gib,
            size_bytes: record.size_bytes,
        };
        if measure.as_ref() == Some(&same) && record.name == name {
            return Ok(());
        }
        from_ms = at_ms.max(record.started_ms);
        sqlx::query("UPDATE meter SET ended_ms = $1 WHERE seq = $2")
            .bind(from_ms)
            .bind(row.try_get::<i64, _>("seq")?)
            .execute(&mut *conn)
            .await?;
    }
    if let Some(m) = measure {
        sqlx::query(
            "INSERT INTO meter (kind, resource_id, organization_id, name, state, cpu, \
             memory_mib, disk_gib, size_bytes, started_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(kind.as_str())
        .bind(id)
        .bind(&m.organization_id)
        .bind(name)
        .bind(&m.state)
        .bind(m.cpu)
        .bind(m.memory_mib)
        .bind(m.disk_gib)
        .bind(m.size_bytes)
        .bind(from_ms)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

impl Store {
    /// Every interval with time in `[from_ms, to_ms)`, oldest first.
    pub async fn meter_intervals(
        &self,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<Vec<MeterRecord>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM meter WHERE started_ms < $2 \
             AND (ended_ms IS NULL OR ended_ms > $1) ORDER BY started_ms, seq"
        );
        let rows = sqlx::query(&sql)
            .bind(from_ms)
            .bind(to_ms)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(from_row).collect()
    }

    /// After a restart: every interval still open (the server stopped or
    /// crashed while it ran) ends at `at_ms`, and the same measure opens
    /// again from then, so the recovery's own changes split from here.
    pub async fn reopen_meters(&self, at_ms: i64) -> Result<usize, StoreError> {
        let mut tx = self.write().await?;
        let open = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM meter WHERE ended_ms IS NULL ORDER BY seq"
        ))
        .fetch_all(&mut *tx)
        .await?;
        let open: Vec<MeterRecord> = open.iter().map(from_row).collect::<Result<_, _>>()?;
        for record in &open {
            let measure = Measure {
                organization_id: record.organization_id.clone(),
                state: record.state.clone(),
                cpu: record.cpu,
                memory_mib: record.memory_mib,
                disk_gib: record.disk_gib,
                size_bytes: record.size_bytes,
            };
            // Closing first, then opening: `meter` would keep an equal one.
            meter(
                &mut tx,
                record.kind,
                &record.resource_id,
                &record.name,
                None,
                at_ms,
            )
            .await?;
            meter(
                &mut tx,
                record.kind,
                &record.resource_id,
                &record.name,
                Some(measure),
                at_ms,
            )
            .await?;
        }
        tx.commit().await?;
        Ok(open.len())
    }
}
