//! Preview tokens of sandboxes and signed preview URLs.

use sqlx::Row;

use crate::{Store, StoreError};

/// A signed preview URL's token: which port of which sandbox it opens, and until when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignedPreview {
    pub token: String,
    pub sandbox_id: String,
    pub port: u16,
    pub expires_at_ms: i64,
}

/// Expired signed tokens are kept this long so a late request is told the
/// URL expired rather than that it never existed.
const KEEP_EXPIRED_MS: i64 = 24 * 60 * 60 * 1000;

impl Store {
    /// The sandbox's preview token: `candidate` if it has none yet, else the
    /// one it already has (so concurrent first requests agree).
    pub async fn preview_token(
        &self,
        sandbox_id: &str,
        candidate: &str,
    ) -> Result<String, StoreError> {
        sqlx::query(
            "INSERT INTO preview_tokens (sandbox_id, token) VALUES ($1, $2) \
             ON CONFLICT (sandbox_id) DO NOTHING",
        )
        .bind(sandbox_id)
        .bind(candidate)
        .execute(&self.pool)
        .await?;
        Ok(
            sqlx::query_scalar("SELECT token FROM preview_tokens WHERE sandbox_id = $1")
                .bind(sandbox_id)
                .fetch_one(&self.pool)
                .await?,
        )
    }

    /// Records a signed preview and forgets those long expired.
    pub async fn add_signed_preview(
        &self,
        signed: &SignedPreview,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM signed_previews WHERE expires_at_ms < $1")
            .bind(now_ms - KEEP_EXPIRED_MS)
            .execute(&self.pool)
            .await?;
        sqlx::query(
            "INSERT INTO signed_previews (token, sandbox_id, port, expires_at_ms) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(&signed.token)
        .bind(&signed.sandbox_id)
        .bind(i64::from(signed.port))
        .bind(signed.expires_at_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn signed_preview(&self, token: &str) -> Result<Option<SignedPreview>, StoreError> {
        let row = sqlx::query(
            "SELECT token, sandbox_id, port, expires_at_ms FROM signed_previews WHERE token = $1",
        )
        .bind(token)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|row| {
            let token: String = row.try_get("token")?;
            let port: i64 = row.try_get("port")?;
            Ok(SignedPreview {
                port: u16::try_from(port).map_err(|_| StoreError::Corrupt {
                    id: token.clone(),
                    reason: format!("port {port} out of range"),
                })?,
                token,
                sandbox_id: row.try_get("sandbox_id")?,
                expires_at_ms: row.try_get("expires_at_ms")?,
            })
        })
        .transpose()
    }

    /// Moves the deadline of a signed preview of this sandbox and port to
    /// `now_ms` at the latest; false when there is no such signed preview.
    pub async fn expire_signed_preview(
        &self,
        sandbox_id: &str,
        port: u16,
        token: &str,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE signed_previews SET expires_at_ms = CASE WHEN $1 < expires_at_ms THEN $1 ELSE expires_at_ms END \
             WHERE token = $2 AND sandbox_id = $3 AND port = $4",
        )
        .bind(now_ms)
        .bind(token)
        .bind(sandbox_id)
        .bind(i64::from(port))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }
}
