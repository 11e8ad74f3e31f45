//! Organizations: who owns sandboxes, snapshots, volumes, registries and keys.

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{Store, StoreError};

/// One organization.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OrganizationRecord {
    pub id: String,
    /// Unique on the server.
    pub name: String,
    pub default_region_id: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// What an organization still owns, by kind: why it cannot be deleted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OrganizationHoldings {
    pub sandboxes: i64,
    pub snapshots: i64,
    pub volumes: i64,
}

const COLUMNS: &str = "id, name, default_region_id, created_at_ms, updated_at_ms";

fn from_row(row: &AnyRow) -> Result<OrganizationRecord, StoreError> {
    Ok(OrganizationRecord {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        default_region_id: row.try_get("default_region_id")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
    })
}

impl Store {
    /// Stores `organization`; a taken id or name is [`StoreError::Duplicate`].
    pub async fn insert_organization(
        &self,
        organization: &OrganizationRecord,
    ) -> Result<(), StoreError> {
        self.write_organization(organization, "")
            .await
            .map_err(|e| match e {
                sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Duplicate {
                    name: organization.name.clone(),
                },
                other => other.into(),
            })
    }

    /// Stores `organization` unless one with its id exists.
    pub async fn ensure_organization(
        &self,
        organization: &OrganizationRecord,
    ) -> Result<(), StoreError> {
        Ok(self
            .write_organization(organization, " ON CONFLICT (id) DO NOTHING")
            .await?)
    }

    async fn write_organization(
        &self,
        organization: &OrganizationRecord,
        on_conflict: &'static str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(&format!(
            "INSERT INTO organizations ({COLUMNS}) VALUES ($1, $2, $3, $4, $5){on_conflict}"
        ))
        .bind(&organization.id)
        .bind(&organization.name)
        .bind(&organization.default_region_id)
        .bind(organization.created_at_ms)
        .bind(organization.updated_at_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn find_organization(
        &self,
        id: &str,
    ) -> Result<Option<OrganizationRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM organizations WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// Every organization, oldest first.
    pub async fn list_organizations(&self) -> Result<Vec<OrganizationRecord>, StoreError> {
        let rows = sqlx::query(&crate::list_sql("organizations", COLUMNS))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(from_row).collect()
    }

    /// Deletes organization `id` with its keys, registries and quotas, in one
    /// transaction, if it owns no sandbox, snapshot or volume; returns what
    /// it still owns otherwise (and deletes nothing). Its audit rows and
    /// meter intervals stay: they are history.
    pub async fn delete_organization(
        &self,
        id: &str,
    ) -> Result<Result<(), OrganizationHoldings>, StoreError> {
        let mut tx = self.write().await?;
        let mut holdings = OrganizationHoldings::default();
        for (sql, slot) in [
            (
                "SELECT COUNT(*) FROM sandboxes WHERE organization_id = $1",
                &mut holdings.sandboxes,
            ),
            (
                "SELECT COUNT(*) FROM snapshots WHERE organization_id = $1 AND general = 0",
                &mut holdings.snapshots,
            ),
            (
                "SELECT COUNT(*) FROM volumes WHERE organization_id = $1",
                &mut holdings.volumes,
            ),
        ] {
            *slot = sqlx::query_scalar(sql).bind(id).fetch_one(&mut *tx).await?;
        }
        if holdings != OrganizationHoldings::default() {
            return Ok(Err(holdings));
        }
        for sql in [
            "DELETE FROM api_keys WHERE organization_id = $1",
            "DELETE FROM docker_registries WHERE organization_id = $1",
            "DELETE FROM region_quotas WHERE organization_id = $1",
            "DELETE FROM organization_quotas WHERE organization_id = $1",
            "DELETE FROM organizations WHERE id = $1",
        ] {
            sqlx::query(sql).bind(id).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(Ok(()))
    }
}
