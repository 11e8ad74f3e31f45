//! Snapshot rows.

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::meter::{meter, Measure, MeterKind};
use crate::{BuildStepRecord, ImageSettings, SnapshotRecord, SnapshotState, Store, StoreError};

const COLUMNS: &str = "id, organization_id, name, class, state, error_reason, rootfs, cpu, gpu, memory_mib, \
    disk_gib, size_bytes, general, created_at_ms, updated_at_ms, layers, capture_id, source_sandbox, has_memory, env, workdir, image_user, \
    entrypoint, cmd";

fn from_row(row: &AnyRow) -> Result<SnapshotRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let corrupt = |reason: String| StoreError::Corrupt {
        id: id.clone(),
        reason,
    };
    let undecodable = |column: &'static str| {
        let id = id.clone();
        move |source| StoreError::Undecodable { id, column, source }
    };
    let class: String = row.try_get("class")?;
    let state: String = row.try_get("state")?;
    Ok(SnapshotRecord {
        organization_id: row.try_get("organization_id")?,
        name: row.try_get("name")?,
        class: class.parse().map_err(|e| corrupt(format!("class: {e}")))?,
        state: SnapshotState::parse(&state).ok_or_else(|| corrupt(format!("state {state:?}")))?,
        error_reason: row.try_get("error_reason")?,
        rootfs: row.try_get("rootfs")?,
        layers: serde_json::from_str(&row.try_get::<String, _>("layers")?)
            .map_err(undecodable("layers"))?,
        capture_id: row.try_get("capture_id")?,
        source_sandbox: row.try_get("source_sandbox")?,
        cpu: row.try_get("cpu")?,
        gpu: row.try_get("gpu")?,
        memory_mib: row.try_get("memory_mib")?,
        disk_gib: row.try_get("disk_gib")?,
        size_bytes: row.try_get("size_bytes")?,
        general: row.try_get::<i64, _>("general")? != 0,
        has_memory: row.try_get::<i64, _>("has_memory")? != 0,
        env: serde_json::from_str(&row.try_get::<String, _>("env")?).map_err(undecodable("env"))?,
        image: ImageSettings {
            workdir: row.try_get("workdir")?,
            user: row.try_get("image_user")?,
            entrypoint: serde_json::from_str(&row.try_get::<String, _>("entrypoint")?)
                .map_err(undecodable("entrypoint"))?,
            cmd: serde_json::from_str(&row.try_get::<String, _>("cmd")?)
                .map_err(undecodable("cmd"))?,
        },
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        id,
    })
}

impl Store {
    /// Inserts a new snapshot; a taken name is [`StoreError::Duplicate`].
    pub async fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<(), StoreError> {
        self.write_snapshot(false, s).await.map_err(|e| match e {
            StoreError::Query(sqlx::Error::Database(db)) if db.is_unique_violation() => {
                StoreError::Duplicate {
                    name: s.name.clone(),
                }
            }
            other => other,
        })
    }

    /// Inserts or replaces a snapshot.
    pub async fn save_snapshot(&self, s: &SnapshotRecord) -> Result<(), StoreError> {
        self.write_snapshot(true, s).await
    }

    /// Writes the row and, in the same transaction, the meter of its storage.
    async fn write_snapshot(&self, upsert: bool, s: &SnapshotRecord) -> Result<(), StoreError> {
        let sql = crate::write_row_sql("snapshots", COLUMNS, upsert);
        let mut tx = self.write().await?;
        sqlx::query(&sql)
            .bind(&s.id)
            .bind(&s.organization_id)
            .bind(&s.name)
            .bind(s.class.as_str())
            .bind(s.state.as_str())
            .bind(&s.error_reason)
            .bind(&s.rootfs)
            .bind(s.cpu)
            .bind(s.gpu)
            .bind(s.memory_mib)
            .bind(s.disk_gib)
            .bind(s.size_bytes)
            .bind(i64::from(s.general))
            .bind(s.created_at_ms)
            .bind(s.updated_at_ms)
            .bind(serde_json::to_string(&s.layers).expect("strings serialize"))
            .bind(&s.capture_id)
            .bind(&s.source_sandbox)
            .bind(i64::from(s.has_memory))
            .bind(serde_json::to_string(&s.env).expect("a string map serializes"))
            .bind(&s.image.workdir)
            .bind(&s.image.user)
            .bind(serde_json::to_string(&s.image.entrypoint).expect("strings serialize"))
            .bind(serde_json::to_string(&s.image.cmd).expect("strings serialize"))
            .execute(&mut *tx)
            .await?;
        let measure = Measure::of_snapshot(s);
        let at_ms = if upsert {
            s.updated_at_ms
        } else {
            s.created_at_ms
        };
        meter(&mut tx, MeterKind::Snapshot, &s.id, &s.name, measure, at_ms).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The snapshot whose id or, failing that, whose name is `id_or_name`,
    /// among those `organization_id` sees: its own, preferred, and the
    /// general ones (`None`: among all, the server's own lookups, where a
    /// name is ambiguous and the oldest non-general row of it wins).
    pub async fn find_snapshot(
        &self,
        organization_id: Option<&str>,
        id_or_name: &str,
    ) -> Result<Option<SnapshotRecord>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM snapshots WHERE (id = $1 OR name = $1) \
             AND ($2 IS NULL OR organization_id = $2 OR general = 1) \
             ORDER BY CASE WHEN id = $1 THEN 0 ELSE 1 END, general, created_at_ms LIMIT 1"
        );
        let row = sqlx::query(&sql)
            .bind(id_or_name)
            .bind(organization_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// Deletes a snapshot and its build log, and ends its storage's time on
    /// the meter at `at_ms`.
    pub async fn delete_snapshot(&self, id: &str, at_ms: i64) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM snapshots WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM build_logs WHERE snapshot_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        meter(&mut tx, MeterKind::Snapshot, id, "", None, at_ms).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Keeps the finished build log of snapshot `id`, replacing any earlier one.
    pub async fn save_build_log(&self, id: &str, lines: &[String]) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO build_logs (snapshot_id, lines) VALUES ($1, $2) \
             ON CONFLICT (snapshot_id) DO UPDATE SET lines = excluded.lines",
        )
        .bind(id)
        .bind(serde_json::to_string(lines).expect("strings serialize"))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The kept build log of snapshot `id`, if its build ended under some server.
    pub async fn find_build_log(&self, id: &str) -> Result<Option<Vec<String>>, StoreError> {
        let text: Option<String> =
            sqlx::query_scalar("SELECT lines FROM build_logs WHERE snapshot_id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(text.map(|t| serde_json::from_str(&t).unwrap_or_default()))
    }

    pub async fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>, StoreError> {
        let sql = crate::list_sql("snapshots", COLUMNS);
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await?;
        rows.iter().map(from_row).collect()
    }
}

impl Store {
    /// The cached build step with this key.
    pub async fn find_build_step(
        &self,
        cache_key: &str,
    ) -> Result<Option<BuildStepRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT cache_key, capture_id, layer, created_at_ms FROM build_steps WHERE cache_key = $1",
        )
        .bind(cache_key)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|row| {
            Ok(BuildStepRecord {
                cache_key: row.try_get("cache_key")?,
                capture_id: row.try_get("capture_id")?,
                layer: row.try_get("layer")?,
                created_at_ms: row.try_get("created_at_ms")?,
            })
        })
        .transpose()
    }

    /// Remembers a built step; a step built twice at once keeps the first
    /// (answered `false`, so the caller discards its own copy).
    pub async fn insert_build_step(&self, step: &BuildStepRecord) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "INSERT INTO build_steps (cache_key, capture_id, layer, created_at_ms) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (cache_key) DO NOTHING",
        )
        .bind(&step.cache_key)
        .bind(&step.capture_id)
        .bind(&step.layer)
        .bind(step.created_at_ms)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}
