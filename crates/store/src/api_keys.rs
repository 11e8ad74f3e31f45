//! API key hashes. The keys themselves are never stored.

use crate::{Store, StoreError};

impl Store {
    pub async fn add_api_key_hash(&self, hash: &str, at_ms: i64) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO api_keys (hash, created_at_ms) VALUES (?, ?)")
            .bind(hash)
            .bind(at_ms)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn api_key_hashes(&self) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar("SELECT hash FROM api_keys")
            .fetch_all(&self.pool)
            .await?)
    }
}
