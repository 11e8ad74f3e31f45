//! SSH access rows: expiring grants to reach one sandbox through the SSH
//! gateway. Only a hash of each token is stored, and lookups go by that hash.

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{Store, StoreError};

/// One issued SSH access token (its hash; the token itself is never stored).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SshAccessRecord {
    pub id: String,
    pub sandbox_id: String,
    pub token_hash: String,
    pub expires_at_ms: i64,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

fn from_row(row: &AnyRow) -> Result<SshAccessRecord, StoreError> {
    Ok(SshAccessRecord {
        id: row.try_get("id")?,
        sandbox_id: row.try_get("sandbox_id")?,
        token_hash: row.try_get("token_hash")?,
        expires_at_ms: row.try_get("expires_at_ms")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
    })
}

impl Store {
    pub async fn add_ssh_access(&self, access: &SshAccessRecord) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO ssh_access (id, sandbox_id, token_hash, expires_at_ms, created_at_ms, \
             updated_at_ms) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&access.id)
        .bind(&access.sandbox_id)
        .bind(&access.token_hash)
        .bind(access.expires_at_ms)
        .bind(access.created_at_ms)
        .bind(access.updated_at_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The access whose token hashes to `token_hash`, expired or not.
    pub async fn find_ssh_access(
        &self,
        token_hash: &str,
    ) -> Result<Option<SshAccessRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT id, sandbox_id, token_hash, expires_at_ms, created_at_ms, updated_at_ms \
             FROM ssh_access WHERE token_hash = $1",
        )
        .bind(token_hash)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// Removes the sandbox's accesses (only the one with `token_hash` when
    /// given); returns how many went.
    pub async fn revoke_ssh_access(
        &self,
        sandbox_id: &str,
        token_hash: Option<&str>,
    ) -> Result<u64, StoreError> {
        let done = match token_hash {
            Some(hash) => {
                sqlx::query("DELETE FROM ssh_access WHERE sandbox_id = $1 AND token_hash = $2")
                    .bind(sandbox_id)
                    .bind(hash)
                    .execute(&self.pool)
                    .await?
            }
            None => {
                sqlx::query("DELETE FROM ssh_access WHERE sandbox_id = $1")
                    .bind(sandbox_id)
                    .execute(&self.pool)
                    .await?
            }
        };
        Ok(done.rows_affected())
    }

    /// Forgets every access that expired before `now_ms`.
    pub async fn prune_ssh_access(&self, now_ms: i64) -> Result<u64, StoreError> {
        Ok(
            sqlx::query("DELETE FROM ssh_access WHERE expires_at_ms <= $1")
                .bind(now_ms)
                .execute(&self.pool)
                .await?
                .rows_affected(),
        )
    }
}
