//! The audit log: one row per change asked of the control API, newest first
//! when read.

use sqlx::sqlite::SqliteRow;
use sqlx::{QueryBuilder, Row, Sqlite};

use crate::{Store, StoreError};

/// One audited request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRecord {
    pub id: String,
    /// The organization the request acted in.
    pub organization_id: String,
    pub created_at_ms: i64,
    /// The name of the key the request came with.
    pub key_name: String,
    /// That key's masked form.
    pub key_masked: String,
    /// What was asked: `create`, `stop`, `delete`, ...
    pub action: String,
    /// What kind of resource: `sandbox`, `snapshot`, `volume`, ...
    pub target_type: String,
    pub target_id: Option<String>,
    pub status_code: u16,
    pub error_message: Option<String>,
    pub user_agent: Option<String>,
}

/// Which rows to read; every field that is set must match.
#[derive(Clone, Debug, Default)]
pub struct AuditQuery {
    pub organization_id: Option<String>,
    pub from_ms: Option<i64>,
    pub to_ms: Option<i64>,
    pub action: Option<String>,
    pub target_type: Option<String>,
    pub target_id: Option<String>,
    pub status_code: Option<u16>,
    pub key_name: Option<String>,
}

const COLUMNS: &str =
    "id, organization_id, created_at_ms, key_name, key_masked, action, target_type, target_id, \
    status_code, error_message, user_agent";

fn from_row(row: &SqliteRow) -> Result<AuditRecord, StoreError> {
    Ok(AuditRecord {
        id: row.try_get("id")?,
        organization_id: row.try_get("organization_id")?,
        created_at_ms: row.try_get("created_at_ms")?,
        key_name: row.try_get("key_name")?,
        key_masked: row.try_get("key_masked")?,
        action: row.try_get("action")?,
        target_type: row.try_get("target_type")?,
        target_id: row.try_get("target_id")?,
        status_code: row.try_get::<i64, _>("status_code")? as u16,
        error_message: row.try_get("error_message")?,
        user_agent: row.try_get("user_agent")?,
    })
}

/// `WHERE` clauses for `query`, pushed onto `builder`.
fn push_filters(builder: &mut QueryBuilder<'_, Sqlite>, query: &AuditQuery) {
    builder.push(" WHERE 1 = 1");
    if let Some(from) = query.from_ms {
        builder.push(" AND created_at_ms >= ").push_bind(from);
    }
    if let Some(to) = query.to_ms {
        builder.push(" AND created_at_ms <= ").push_bind(to);
    }
    let texts = [
        ("organization_id", &query.organization_id),
        ("action", &query.action),
        ("target_type", &query.target_type),
        ("target_id", &query.target_id),
        ("key_name", &query.key_name),
    ];
    for (column, value) in texts {
        if let Some(value) = value {
            builder
                .push(format_args!(" AND {column} = "))
                .push_bind(value.clone());
        }
    }
    if let Some(status) = query.status_code {
        builder
            .push(" AND status_code = ")
            .push_bind(i64::from(status));
    }
}

impl Store {
    pub async fn insert_audit(&self, record: &AuditRecord) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "INSERT INTO audit_log ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        ))
        .bind(&record.id)
        .bind(&record.organization_id)
        .bind(record.created_at_ms)
        .bind(&record.key_name)
        .bind(&record.key_masked)
        .bind(&record.action)
        .bind(&record.target_type)
        .bind(&record.target_id)
        .bind(i64::from(record.status_code))
        .bind(&record.error_message)
        .bind(&record.user_agent)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The rows matching `query`, newest first, `limit` of them after skipping
    /// `offset`; and how many match in all.
    pub async fn audit_page(
        &self,
        query: &AuditQuery,
        offset: u64,
        limit: u64,
    ) -> Result<(Vec<AuditRecord>, u64), StoreError> {
        let mut count = QueryBuilder::new("SELECT COUNT(*) FROM audit_log");
        push_filters(&mut count, query);
        let total: i64 = count.build_query_scalar().fetch_one(&self.pool).await?;

        let mut select = QueryBuilder::new(format!("SELECT {COLUMNS} FROM audit_log"));
        push_filters(&mut select, query);
        select
            .push(" ORDER BY seq DESC LIMIT ")
            .push_bind(limit as i64)
            .push(" OFFSET ")
            .push_bind(offset as i64);
        let rows = select.build().fetch_all(&self.pool).await?;
        let items = rows.iter().map(from_row).collect::<Result<_, _>>()?;
        Ok((items, total as u64))
    }
}
