//! Volume rows.

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{Store, StoreError, VolumeRecord};

const COLUMNS: &str = "id, organization_id, name, created_at_ms, updated_at_ms, last_used_at_ms";

fn from_row(row: &AnyRow) -> Result<VolumeRecord, StoreError> {
    Ok(VolumeRecord {
        id: row.try_get("id")?,
        organization_id: row.try_get("organization_id")?,
        name: row.try_get("name")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        last_used_at_ms: row.try_get("last_used_at_ms")?,
    })
}

impl Store {
    /// Inserts a new volume; a taken name is [`StoreError::Duplicate`].
    pub async fn insert_volume(&self, v: &VolumeRecord) -> Result<(), StoreError> {
        let sql = format!("INSERT INTO volumes ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)");
        sqlx::query(&sql)
            .bind(&v.id)
            .bind(&v.organization_id)
            .bind(&v.name)
            .bind(v.created_at_ms)
            .bind(v.updated_at_ms)
            .bind(v.last_used_at_ms)
            .execute(&self.pool)
            .await
            .map_err(|e| match e {
                sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Duplicate {
                    name: v.name.clone(),
                },
                other => other.into(),
            })?;
        Ok(())
    }

    /// The volume whose id or, failing that, whose name is `id_or_name`, of
    /// `organization_id` (`None`: of any organization).
    pub async fn find_volume(
        &self,
        organization_id: Option<&str>,
        id_or_name: &str,
    ) -> Result<Option<VolumeRecord>, StoreError> {
        let sql = crate::find_by_id_or_name_sql("volumes", COLUMNS);
        let row = sqlx::query(&sql)
            .bind(id_or_name)
            .bind(organization_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// Every volume, oldest first.
    pub async fn list_volumes(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        let sql = crate::list_sql("volumes", COLUMNS);
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await?;
        rows.iter().map(from_row).collect()
    }

    /// Records that a sandbox mounted the volume at `at_ms`.
    pub async fn touch_volume(&self, id: &str, at_ms: i64) -> Result<(), StoreError> {
        sqlx::query("UPDATE volumes SET last_used_at_ms = $1, updated_at_ms = $2 WHERE id = $3")
            .bind(at_ms)
            .bind(at_ms)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Removes a volume's row; false if there was none.
    pub async fn delete_volume(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM volumes WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }
}
