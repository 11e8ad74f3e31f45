//! The audit log: one row per change asked of the control API, newest first
//! when read.

use sqlx::any::AnyRow;
use sqlx::Row;

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

fn from_row(row: &AnyRow) -> Result<AuditRecord, StoreError> {
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

/// A value a filter compares with.
enum Value {
    Int(i64),
    Text(String),
}

/// The `WHERE` clause for `query`, its placeholders numbered from `$1` (so
/// the same text runs on SQLite and PostgreSQL), and the values they take.
fn filters(query: &AuditQuery) -> (String, Vec<Value>) {
    let mut clause = String::from(" WHERE 1 = 1");
    let mut values = Vec::new();
    let mut add = |condition: &str, value: Value| {
        values.push(value);
        clause.push_str(&format!(" AND {condition} ${}", values.len()));
    };
    if let Some(from) = query.from_ms {
        add("created_at_ms >=", Value::Int(from));
    }
    if let Some(to) = query.to_ms {
        add("created_at_ms <=", Value::Int(to));
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
            add(&format!("{column} ="), Value::Text(value.clone()));
        }
    }
    if let Some(status) = query.status_code {
        add("status_code =", Value::Int(i64::from(status)));
    }
    (clause, values)
}

fn bind_all<'q>(mut query: crate::Query<'q>, values: &'q [Value]) -> crate::Query<'q> {
    for value in values {
        query = match value {
            Value::Int(i) => query.bind(*i),
            Value::Text(t) => query.bind(t.as_str()),
        };
    }
    query
}

impl Store {
    pub async fn insert_audit(&self, record: &AuditRecord) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "INSERT INTO audit_log ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
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
        let (clause, values) = filters(query);
        let count_sql = format!("SELECT COUNT(*) FROM audit_log{clause}");
        let total: i64 = bind_all(sqlx::query(&count_sql), &values)
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?;
        let n = values.len();
        let select_sql = format!(
            "SELECT {COLUMNS} FROM audit_log{clause} ORDER BY seq DESC LIMIT ${} OFFSET ${}",
            n + 1,
            n + 2
        );
        let rows = bind_all(sqlx::query(&select_sql), &values)
            .bind(limit as i64)
            .bind(offset as i64)
            .fetch_all(&self.pool)
            .await?;
        let items = rows.iter().map(from_row).collect::<Result<_, _>>()?;
        Ok((items, total as u64))
    }
}
