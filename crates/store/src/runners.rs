//! Runner rows: the machines sandboxes run on, what each offers, what its
//! host last reported, and whether new sandboxes may go to it.

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{Store, StoreError};

const COLUMNS: &str = "id, name, region, classes, accelerator, cpu, memory_gib, disk_gib, \
    app_version, unschedulable, draining, usage, created_at_ms, updated_at_ms, last_checked_ms, \
    tags, api_url, proxy_url";

/// One runner.
#[derive(Clone, Debug, PartialEq)]
pub struct RunnerRecord {
    pub id: String,
    pub name: String,
    /// The region it serves (a server's one region, `us`, for now).
    pub region: String,
    /// The classes of sandbox it runs (`container`, `linux-vm`).
    pub classes: Vec<String>,
    /// How its VMs execute (`kvm`, `tcg`); `None` without VMs.
    pub accelerator: Option<String>,
    /// What its host has: vCPUs, GiB of memory, GiB of disk for sandboxes.
    pub cpu: i64,
    pub memory_gib: i64,
    pub disk_gib: i64,
    pub app_version: String,
    /// Set by the operator: no new sandbox is placed on it (Daytona's
    /// scheduling switch).
    pub unschedulable: bool,
    /// Set by the operator before taking it down: no new sandbox is placed
    /// on it; those it holds stay until they are moved or deleted.
    pub draining: bool,
    /// What its host last reported.
    pub usage: RunnerUsage,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// When it last reported; `None` before its first report.
    pub last_checked_ms: Option<i64>,
    /// The operator's words for it (Daytona's runner tags).
    pub tags: Vec<String>,
    /// Where a runner on another machine serves its API and its proxy, as it
    /// last reported them; `None` for the server's own.
    pub api_url: Option<String>,
    pub proxy_url: Option<String>,
}

/// What a runner on another machine reports of itself at each check-in.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunnerReport {
    pub classes: Vec<String>,
    pub accelerator: Option<String>,
    pub cpu: i64,
    pub memory_gib: i64,
    pub disk_gib: i64,
    pub app_version: String,
    pub usage: RunnerUsage,
    pub api_url: Option<String>,
    pub proxy_url: Option<String>,
}

/// A runner's host as it last reported it, in percent.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunnerUsage {
    /// The one-minute load average over the vCPUs.
    pub cpu: f64,
    pub memory: f64,
    /// Of the filesystem sandboxes' storage is on.
    pub disk: f64,
}

fn from_row(row: &AnyRow) -> Result<RunnerRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let json = |column: &'static str| -> Result<String, StoreError> { Ok(row.try_get(column)?) };
    let undecodable = |column: &'static str| {
        let id = id.clone();
        move |source| StoreError::Undecodable { id, column, source }
    };
    Ok(RunnerRecord {
        name: row.try_get("name")?,
        region: row.try_get("region")?,
        classes: serde_json::from_str(&json("classes")?).map_err(undecodable("classes"))?,
        accelerator: row.try_get("accelerator")?,
        cpu: row.try_get("cpu")?,
        memory_gib: row.try_get("memory_gib")?,
        disk_gib: row.try_get("disk_gib")?,
        app_version: row.try_get("app_version")?,
        unschedulable: row.try_get::<i64, _>("unschedulable")? != 0,
        draining: row.try_get::<i64, _>("draining")? != 0,
        usage: serde_json::from_str(&json("usage")?).map_err(undecodable("usage"))?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        last_checked_ms: row.try_get("last_checked_ms")?,
        tags: serde_json::from_str(&json("tags")?).map_err(undecodable("tags"))?,
        api_url: row.try_get("api_url")?,
        proxy_url: row.try_get("proxy_url")?,
        id,
    })
}

/// A change the operator makes to a runner; `None` leaves a switch as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunnerSwitches {
    pub unschedulable: Option<bool>,
    pub draining: Option<bool>,
}

/// `query` with `r`'s values bound to `$1` to `$18`, in [`COLUMNS`]' order.
fn bind_columns<'q>(query: crate::Query<'q>, r: &'q RunnerRecord) -> crate::Query<'q> {
    query
        .bind(&r.id)
        .bind(&r.name)
        .bind(&r.region)
        .bind(serde_json::to_string(&r.classes).expect("strings serialize"))
        .bind(&r.accelerator)
        .bind(r.cpu)
        .bind(r.memory_gib)
        .bind(r.disk_gib)
        .bind(&r.app_version)
        .bind(i64::from(r.unschedulable))
        .bind(i64::from(r.draining))
        .bind(serde_json::to_string(&r.usage).expect("numbers serialize"))
        .bind(r.created_at_ms)
        .bind(r.updated_at_ms)
        .bind(r.last_checked_ms)
        .bind(serde_json::to_string(&r.tags).expect("strings serialize"))
        .bind(&r.api_url)
        .bind(&r.proxy_url)
}

impl Store {
    /// Records a runner as it starts: a new one is inserted; a known one
    /// (the same id) has what it offers replaced and keeps its creation
    /// time and the operator's switches, so a drained runner that restarts
    /// stays drained. Returns the row as stored.
    pub async fn register_runner(&self, r: &RunnerRecord) -> Result<RunnerRecord, StoreError> {
        let sql = format!(
            "INSERT INTO runners ({COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18) \
             ON CONFLICT(id) DO UPDATE SET name = excluded.name, region = excluded.region, \
             classes = excluded.classes, accelerator = excluded.accelerator, \
             cpu = excluded.cpu, memory_gib = excluded.memory_gib, disk_gib = excluded.disk_gib, \
             app_version = excluded.app_version, usage = excluded.usage, \
             updated_at_ms = excluded.updated_at_ms, last_checked_ms = excluded.last_checked_ms"
        );
        bind_columns(sqlx::query(&sql), r)
            .execute(&self.pool)
            .await?;
        self.find_runner(&r.id)
            .await?
            .ok_or_else(|| StoreError::Corrupt {
                id: r.id.clone(),
                reason: "the runner row written is not there".into(),
            })
    }

    /// Records a runner's report of its host at `at_ms`. False when no
    /// runner has that id.
    pub async fn runner_checked_in(
        &self,
        id: &str,
        usage: RunnerUsage,
        at_ms: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE runners SET usage = $2, last_checked_ms = $3 WHERE id = $1")
            .bind(id)
            .bind(serde_json::to_string(&usage).expect("numbers serialize"))
            .bind(at_ms)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Sets the operator's switches of runner `id`; `None` when there is no
    /// such runner.
    pub async fn switch_runner(
        &self,
        id: &str,
        switches: RunnerSwitches,
        at_ms: i64,
    ) -> Result<Option<RunnerRecord>, StoreError> {
        sqlx::query(
            "UPDATE runners SET \
             unschedulable = CASE WHEN $2 IS NULL THEN unschedulable ELSE $2 END, \
             draining = CASE WHEN $3 IS NULL THEN draining ELSE $3 END, \
             updated_at_ms = $4 WHERE id = $1",
        )
        .bind(id)
        .bind(switches.unschedulable.map(i64::from))
        .bind(switches.draining.map(i64::from))
        .bind(at_ms)
        .execute(&self.pool)
        .await?;
        self.find_runner(id).await
    }

    pub async fn find_runner(&self, id: &str) -> Result<Option<RunnerRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM runners WHERE id = $1");
        let row = sqlx::query(&sql)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// Every runner, oldest first.
    pub async fn list_runners(&self) -> Result<Vec<RunnerRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM runners ORDER BY created_at_ms, id");
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await?;
        rows.iter().map(from_row).collect()
    }

    /// Records a runner on another machine, registered by the operator, with
    /// the hash of the token it reports with. False when the id is taken.
    pub async fn create_runner(
        &self,
        r: &RunnerRecord,
        token_hash: &str,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "INSERT INTO runners ({COLUMNS}, token_hash) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19) \
             ON CONFLICT(id) DO NOTHING"
        );
        let done = bind_columns(sqlx::query(&sql), r)
            .bind(token_hash)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// The runner whose token hashes to `token_hash`.
    pub async fn runner_by_token(
        &self,
        token_hash: &str,
    ) -> Result<Option<RunnerRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM runners WHERE token_hash = $1");
        let row = sqlx::query(&sql)
            .bind(token_hash)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// Records what runner `id` reported of itself at `at_ms`; `None` when
    /// there is no such runner.
    pub async fn runner_reported(
        &self,
        id: &str,
        report: &RunnerReport,
        at_ms: i64,
    ) -> Result<Option<RunnerRecord>, StoreError> {
        sqlx::query(
            "UPDATE runners SET classes = $2, accelerator = $3, cpu = $4, memory_gib = $5, \
             disk_gib = $6, app_version = $7, usage = $8, api_url = $9, proxy_url = $10, \
             last_checked_ms = $11 WHERE id = $1",
        )
        .bind(id)
        .bind(serde_json::to_string(&report.classes).expect("strings serialize"))
        .bind(&report.accelerator)
        .bind(report.cpu)
        .bind(report.memory_gib)
        .bind(report.disk_gib)
        .bind(&report.app_version)
        .bind(serde_json::to_string(&report.usage).expect("numbers serialize"))
        .bind(&report.api_url)
        .bind(&report.proxy_url)
        .bind(at_ms)
        .execute(&self.pool)
        .await?;
        self.find_runner(id).await
    }

    /// Deletes runner `id` if no sandbox names it (in one statement, so a
    /// sandbox placed meanwhile keeps it). False when it holds sandboxes or
    /// does not exist.
    pub async fn delete_empty_runner(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "DELETE FROM runners WHERE id = $1 \
             AND NOT EXISTS (SELECT 1 FROM sandboxes WHERE runner_id = $1)",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Deletes runner `id` whatever it holds (one the operator says is lost
    /// for good); false when it does not exist.
    pub async fn delete_runner(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM runners WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Gives every sandbox that has no runner (rows from before runners) to
    /// runner `id`, except archived ones, which are on no runner until a
    /// start places them; returns how many it took.
    pub async fn claim_unplaced_sandboxes(&self, id: &str) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "UPDATE sandboxes SET runner_id = $1 WHERE runner_id IS NULL AND state <> 'archived'",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}
