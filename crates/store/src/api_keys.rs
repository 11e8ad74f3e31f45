//! API keys. Only a hash of each key is stored, with the key's name, its
//! permissions (Daytona's wire names, as the engine gives them) and a masked
//! form for listings.

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{Store, StoreError};

/// One API key (its hash; the key itself is never stored).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiKeyRecord {
    pub hash: String,
    /// The organization the key acts in.
    pub organization_id: String,
    /// Unique among the organization's keys.
    pub name: String,
    /// Permission names; the operator's key has every permission whatever
    /// this says.
    pub permissions: Vec<String>,
    /// The key's first and last characters, the rest starred.
    pub masked: String,
    pub created_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    pub last_used_at_ms: Option<i64>,
    /// The server operator's key (made at first start).
    pub operator: bool,
}

const COLUMNS: &str =
    "hash, organization_id, name, permissions, masked, created_at_ms, expires_at_ms, last_used_at_ms, operator";

fn from_row(row: &AnyRow) -> Result<ApiKeyRecord, StoreError> {
    let permissions: String = row.try_get("permissions")?;
    Ok(ApiKeyRecord {
        hash: row.try_get("hash")?,
        organization_id: row.try_get("organization_id")?,
        name: row.try_get("name")?,
        permissions: permissions
            .split(',')
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect(),
        masked: row.try_get("masked")?,
        created_at_ms: row.try_get("created_at_ms")?,
        expires_at_ms: row.try_get("expires_at_ms")?,
        last_used_at_ms: row.try_get("last_used_at_ms")?,
        operator: row.try_get::<i64, _>("operator")? != 0,
    })
}

impl Store {
    /// Stores `key`; false (and nothing stored) if its name is taken.
    pub async fn insert_api_key(&self, key: &ApiKeyRecord) -> Result<bool, StoreError> {
        let done = sqlx::query(&format!(
            "INSERT INTO api_keys ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (organization_id, name) DO NOTHING"
        ))
        .bind(&key.hash)
        .bind(&key.organization_id)
        .bind(&key.name)
        .bind(key.permissions.join(","))
        .bind(&key.masked)
        .bind(key.created_at_ms)
        .bind(key.expires_at_ms)
        .bind(key.last_used_at_ms)
        .bind(i64::from(key.operator))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Every key, oldest first.
    pub async fn api_keys(&self) -> Result<Vec<ApiKeyRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM api_keys ORDER BY created_at_ms, name"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(from_row).collect()
    }

    /// Removes the key named `name` of `organization_id`; false if there
    /// was none.
    pub async fn delete_api_key(
        &self,
        organization_id: &str,
        name: &str,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM api_keys WHERE organization_id = $1 AND name = $2")
            .bind(organization_id)
            .bind(name)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Records that the key with `hash` was used at `at_ms`.
    pub async fn touch_api_key(&self, hash: &str, at_ms: i64) -> Result<(), StoreError> {
        sqlx::query("UPDATE api_keys SET last_used_at_ms = $1 WHERE hash = $2")
            .bind(at_ms)
            .bind(hash)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
