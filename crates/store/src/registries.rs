//! Docker registry credential rows.

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{DockerRegistryRecord, Store, StoreError};

const COLUMNS: &str =
    "id, organization_id, name, url, username, password, project, registry_type, created_at_ms, updated_at_ms";

fn from_row(row: &AnyRow) -> Result<DockerRegistryRecord, StoreError> {
    Ok(DockerRegistryRecord {
        id: row.try_get("id")?,
        organization_id: row.try_get("organization_id")?,
        name: row.try_get("name")?,
        url: row.try_get("url")?,
        username: row.try_get("username")?,
        password: row.try_get("password")?,
        project: row.try_get("project")?,
        registry_type: row.try_get("registry_type")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
    })
}

impl Store {
    /// Inserts or replaces a registry.
    pub async fn save_registry(&self, r: &DockerRegistryRecord) -> Result<(), StoreError> {
        sqlx::query(&crate::write_row_sql("docker_registries", COLUMNS, true))
            .bind(&r.id)
            .bind(&r.organization_id)
            .bind(&r.name)
            .bind(&r.url)
            .bind(&r.username)
            .bind(&r.password)
            .bind(&r.project)
            .bind(&r.registry_type)
            .bind(r.created_at_ms)
            .bind(r.updated_at_ms)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn find_registry(
        &self,
        id: &str,
    ) -> Result<Option<DockerRegistryRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM docker_registries WHERE id = $1");
        let row = sqlx::query(&sql)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// Every registry, oldest first.
    pub async fn list_registries(&self) -> Result<Vec<DockerRegistryRecord>, StoreError> {
        let sql = crate::list_sql("docker_registries", COLUMNS);
        let rows = sqlx::query(&sql).fetch_all(&self.pool).await?;
        rows.iter().map(from_row).collect()
    }

    pub async fn delete_registry(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM docker_registries WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
