//! Sandbox rows.

use cove_lifecycle::TimerSettings;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::meter::{meter, Measure, MeterKind};
use crate::{SandboxRecord, Store, StoreError};

const COLUMNS: &str =
    "id, organization_id, name, snapshot, class, state, desired_state, error_reason, os_user, \
    cpu, gpu, memory_mib, disk_gib, env, labels, public, auto_stop, auto_pause, auto_archive, \
    auto_delete, ttl_minutes, ttl_deadline_ms, created_at_ms, updated_at_ms, state_since_ms, \
    last_activity_ms, persistent, spot, parent_id, network, volumes, linked_sandbox_id, runner_id";

fn corrupt(id: &str, reason: impl ToString) -> StoreError {
    StoreError::Corrupt {
        id: id.to_owned(),
        reason: reason.to_string(),
    }
}

fn from_row(row: &AnyRow) -> Result<SandboxRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let text = |column: &str| -> Result<String, StoreError> { Ok(row.try_get(column)?) };
    let undecodable = |column: &'static str| {
        let id = id.clone();
        move |source| StoreError::Undecodable { id, column, source }
    };
    let json = |column: &'static str| -> Result<_, StoreError> {
        serde_json::from_str(&text(column)?).map_err(undecodable(column))
    };
    Ok(SandboxRecord {
        organization_id: text("organization_id")?,
        name: text("name")?,
        snapshot: text("snapshot")?,
        class: text("class")?.parse().map_err(|e| corrupt(&id, e))?,
        state: text("state")?.parse().map_err(|e| corrupt(&id, e))?,
        desired_state: text("desired_state")?
            .parse()
            .map_err(|e| corrupt(&id, e))?,
        error_reason: row.try_get("error_reason")?,
        os_user: text("os_user")?,
        cpu: row.try_get("cpu")?,
        gpu: row.try_get("gpu")?,
        memory_mib: row.try_get("memory_mib")?,
        disk_gib: row.try_get("disk_gib")?,
        env: json("env")?,
        labels: json("labels")?,
        public: row.try_get::<i64, _>("public")? != 0,
        timers: TimerSettings {
            auto_stop: row.try_get("auto_stop")?,
            auto_pause: row.try_get("auto_pause")?,
            auto_archive: row.try_get("auto_archive")?,
            auto_delete: row.try_get("auto_delete")?,
        },
        ttl_minutes: row.try_get("ttl_minutes")?,
        ttl_deadline_ms: row.try_get("ttl_deadline_ms")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        state_since_ms: row.try_get("state_since_ms")?,
        last_activity_ms: row.try_get("last_activity_ms")?,
        persistent: row.try_get::<i64, _>("persistent")? != 0,
        spot: row.try_get::<i64, _>("spot")? != 0,
        parent_id: row.try_get("parent_id")?,
        linked_sandbox_id: row.try_get("linked_sandbox_id")?,
        runner_id: row.try_get("runner_id")?,
        network: serde_json::from_str(&text("network")?).map_err(undecodable("network"))?,
        volumes: serde_json::from_str(&text("volumes")?).map_err(undecodable("volumes"))?,
        id,
    })
}

/// What a list of sandboxes is ordered by: one of their columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SandboxSortField {
    Id,
    Name,
    State,
    Snapshot,
    Cpu,
    Memory,
    Disk,
    CreatedAt,
    UpdatedAt,
    LastActivityAt,
}

impl SandboxSortField {
    fn column(self) -> &'static str {
        match self {
            Self::Id => "id",
            Self::Name => "name",
            Self::State => "state",
            Self::Snapshot => "snapshot",
            Self::Cpu => "cpu",
            Self::Memory => "memory_mib",
            Self::Disk => "disk_gib",
            Self::CreatedAt => "created_at_ms",
            Self::UpdatedAt => "updated_at_ms",
            Self::LastActivityAt => "last_activity_ms",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortDirection {
    Ascending,
    Descending,
}

/// A field and a direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SandboxOrder {
    pub field: SandboxSortField,
    pub direction: SortDirection,
}

/// The statement of [`Store::list_sandboxes_ordered`]: the field, then
/// creation time and rowid (which orders rows made in the same millisecond)
/// as tie-breaks, all in one direction. Only names from the closed
/// [`SandboxSortField`] reach the text.
fn ordered_sql(order: SandboxOrder) -> String {
    let direction = match order.direction {
        SortDirection::Ascending => "ASC",
        SortDirection::Descending => "DESC",
    };
    format!(
        "SELECT {COLUMNS} FROM sandboxes WHERE ($1 IS NULL OR organization_id = $1) \
         ORDER BY {column} {direction}, \
         created_at_ms {direction}, rowid {direction}",
        column = order.field.column()
    )
}

impl Store {
    /// Inserts a new sandbox; a taken name or id is [`StoreError::Duplicate`].
    pub async fn insert_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        self.write_sandbox(false, s).await.map_err(|e| match e {
            StoreError::Query(sqlx::Error::Database(db)) if db.is_unique_violation() => {
                StoreError::Duplicate {
                    name: s.name.clone(),
                }
            }
            other => other,
        })
    }

    /// Replaces the row of an existing sandbox.
    pub async fn save_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        self.write_sandbox(true, s).await
    }

    /// Writes the row and, in the same transaction, the meter: a change of
    /// state or size (dated by `updated_at_ms`) ends one interval and starts
    /// the next.
    async fn write_sandbox(&self, upsert: bool, s: &SandboxRecord) -> Result<(), StoreError> {
        let sql = crate::write_row_sql("sandboxes", COLUMNS, upsert);
        let mut transaction = self.write().await?;
        sqlx::query(&sql)
            .bind(&s.id)
            .bind(&s.organization_id)
            .bind(&s.name)
            .bind(&s.snapshot)
            .bind(s.class.as_str())
            .bind(s.state.as_str())
            .bind(s.desired_state.as_str())
            .bind(&s.error_reason)
            .bind(&s.os_user)
            .bind(s.cpu)
            .bind(s.gpu)
            .bind(s.memory_mib)
            .bind(s.disk_gib)
            .bind(serde_json::to_string(&s.env).expect("a string map serializes"))
            .bind(serde_json::to_string(&s.labels).expect("a string map serializes"))
            .bind(i64::from(s.public))
            .bind(s.timers.auto_stop)
            .bind(s.timers.auto_pause)
            .bind(s.timers.auto_archive)
            .bind(s.timers.auto_delete)
            .bind(s.ttl_minutes)
            .bind(s.ttl_deadline_ms)
            .bind(s.created_at_ms)
            .bind(s.updated_at_ms)
            .bind(s.state_since_ms)
            .bind(s.last_activity_ms)
            .bind(i64::from(s.persistent))
            .bind(i64::from(s.spot))
            .bind(&s.parent_id)
            .bind(serde_json::to_string(&s.network).expect("settings serialize"))
            .bind(serde_json::to_string(&s.volumes).expect("mounts serialize"))
            .bind(&s.linked_sandbox_id)
            .bind(&s.runner_id)
            .execute(&mut *transaction)
            .await?;
        let measure = Some(Measure::of_sandbox(s));
        let at_ms = if upsert {
            s.updated_at_ms
        } else {
            s.created_at_ms
        };
        meter(
            &mut transaction,
            MeterKind::Sandbox,
            &s.id,
            &s.name,
            measure,
            at_ms,
        )
        .await?;
        transaction.commit().await?;
        Ok(())
    }

    /// The sandbox whose id or, failing that, whose name is `id_or_name`, of
    /// `organization_id` (`None`: of any organization).
    pub async fn find_sandbox(
        &self,
        organization_id: Option<&str>,
        id_or_name: &str,
    ) -> Result<Option<SandboxRecord>, StoreError> {
        let sql = crate::find_by_id_or_name_sql("sandboxes", COLUMNS);
        let row = sqlx::query(&sql)
            .bind(id_or_name)
            .bind(organization_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// Every sandbox, oldest first.
    pub async fn list_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let sql = crate::list_sql("sandboxes", COLUMNS);
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await?;
        rows.iter().map(from_row).collect()
    }

    /// Every sandbox placed on runner `runner_id`, oldest first (as
    /// [`Self::list_sandboxes`] orders them).
    pub async fn sandboxes_on_runner(
        &self,
        runner_id: &str,
    ) -> Result<Vec<SandboxRecord>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM sandboxes WHERE runner_id = $1 \
             ORDER BY created_at_ms, rowid"
        );
        let rows = sqlx::query(&sql)
            .bind(runner_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(from_row).collect()
    }

    /// The sandboxes linked to `id` (whose `linked_sandbox_id` it is).
    pub async fn sandboxes_linked_to(&self, id: &str) -> Result<Vec<SandboxRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM sandboxes WHERE linked_sandbox_id = $1");
        let rows = sqlx::query(&sql).bind(id).fetch_all(&self.pool).await?;
        rows.iter().map(from_row).collect()
    }

    /// Every sandbox of `organization_id` (`None`: of all) in `order`; rows
    /// equal in its field keep creation order in the same direction, so
    /// pages cut from it are stable.
    pub async fn list_sandboxes_ordered(
        &self,
        organization_id: Option<&str>,
        order: SandboxOrder,
    ) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = sqlx::query(&ordered_sql(order))
            .bind(organization_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(from_row).collect()
    }

    /// Whether `name` is a sandbox's name in `organization_id`, or any
    /// sandbox's id.
    pub async fn name_taken(&self, organization_id: &str, name: &str) -> Result<bool, StoreError> {
        let row = sqlx::query(
            "SELECT 1 FROM sandboxes WHERE (name = $1 AND organization_id = $2) OR id = $1",
        )
        .bind(name)
        .bind(organization_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.is_some())
    }

    /// Deletes a sandbox's row and what only it uses (its SSH access tokens),
    /// and ends its time on the meter at `at_ms`.
    pub async fn delete_sandbox(&self, id: &str, at_ms: i64) -> Result<(), StoreError> {
        // Its preview tokens and SSH access go with it: a new sandbox never
        // inherits them.
        let mut transaction = self.pool.begin().await?;
        for statement in [
            "DELETE FROM preview_tokens WHERE sandbox_id = $1",
            "DELETE FROM signed_previews WHERE sandbox_id = $1",
            "DELETE FROM ssh_access WHERE sandbox_id = $1",
            "DELETE FROM sandboxes WHERE id = $1",
        ] {
            sqlx::query(statement)
                .bind(id)
                .execute(&mut *transaction)
                .await?;
        }
        meter(&mut transaction, MeterKind::Sandbox, id, "", None, at_ms).await?;
        transaction.commit().await?;
        Ok(())
    }

    /// Records interactions in one statement per sandbox; only moves the clock forward.
    pub async fn record_activity(&self, id: &str, at_ms: i64) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE sandboxes SET last_activity_ms = \
             CASE WHEN $2 > last_activity_ms THEN $2 ELSE last_activity_ms END WHERE id = $1",
        )
        .bind(id)
        .bind(at_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}
