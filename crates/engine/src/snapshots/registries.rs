//! Credentials for image registries (`/api/docker-registry`): kept in the
//! store, and given to a pull whose image lives on the registry's host
//! (cove-images' `registry_host` says which host a URL names).

use cove_store::DockerRegistryRecord;

pub use cove_images::registry_host;

use super::Snapshots;
use crate::{now_ms, EngineError};

/// What a user asked a registry to be; on update, a `None` password keeps
/// the stored one.
#[derive(Clone, Default)]
pub struct RegistryRequest {
    pub name: String,
    pub url: String,
    pub username: String,
    pub password: Option<String>,
    pub project: Option<String>,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> EngineError {
    EngineError::Invalid {
        field,
        reason: reason.into(),
    }
}

impl Snapshots {
    pub async fn create_registry(
        &self,
        request: RegistryRequest,
    ) -> Result<DockerRegistryRecord, EngineError> {
        let password = request
            .password
            .clone()
            .filter(|p| !p.is_empty())
            .ok_or_else(|| invalid("password", "a registry needs a password (or token)"))?;
        let now = now_ms();
        let record = DockerRegistryRecord {
            id: uuid::Uuid::new_v4().to_string(),
            organization_id: self.scope.owner().to_owned(),
            password,
            registry_type: "organization".into(),
            created_at_ms: now,
            updated_at_ms: now,
            ..checked(request)?
        };
        self.shared.store.save_registry(&record).await?;
        tracing::info!(registry = %record.name, url = %record.url, "docker registry added");
        Ok(record)
    }

    /// The registries of this handle's organization.
    pub async fn registries(&self) -> Result<Vec<DockerRegistryRecord>, EngineError> {
        let mut all = self.shared.store.list_registries().await?;
        all.retain(|r| self.scope.sees(&r.organization_id));
        Ok(all)
    }

    pub async fn get_registry(&self, id: &str) -> Result<DockerRegistryRecord, EngineError> {
        self.shared
            .store
            .find_registry(id)
            .await?
            .filter(|r| self.scope.sees(&r.organization_id))
            .ok_or_else(|| EngineError::RegistryNotFound { id: id.to_owned() })
    }

    pub async fn update_registry(
        &self,
        id: &str,
        request: RegistryRequest,
    ) -> Result<DockerRegistryRecord, EngineError> {
        let current = self.get_registry(id).await?;
        let password = request
            .password
            .clone()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| current.password.clone());
        let record = DockerRegistryRecord {
            id: current.id,
            organization_id: current.organization_id,
            password,
            registry_type: current.registry_type,
            created_at_ms: current.created_at_ms,
            updated_at_ms: now_ms(),
            ..checked(request)?
        };
        self.shared.store.save_registry(&record).await?;
        Ok(record)
    }

    pub async fn delete_registry(&self, id: &str) -> Result<DockerRegistryRecord, EngineError> {
        let record = self.get_registry(id).await?;
        self.shared.store.delete_registry(&record.id).await?;
        tracing::info!(registry = %record.name, "docker registry removed");
        Ok(record)
    }

    /// The credentials for pulling `reference`: of a registry of the
    /// pulling organization on its host, preferring one whose project is the
    /// image's first path component. Another organization's are never used.
    pub(crate) async fn credentials_for(
        &self,
        reference: &str,
    ) -> Result<Option<cove_images::Credentials>, EngineError> {
        let Ok(full) = cove_images::normalize_reference(reference) else {
            return Ok(None);
        };
        let (host, path) = full.split_once('/').unwrap_or((full.as_str(), ""));
        let host = registry_host(host).unwrap_or_default();
        let mut registries = self.shared.store.list_registries().await?;
        registries.retain(|r| r.organization_id == self.scope.owner());
        let on_host: Vec<&DockerRegistryRecord> = registries
            .iter()
            .filter(|r| registry_host(&r.url).is_ok_and(|h| h == host))
            .collect();
        let in_project = |r: &&&DockerRegistryRecord| {
            !r.project.is_empty() && path.starts_with(&format!("{}/", r.project))
        };
        let chosen = on_host
            .iter()
            .find(in_project)
            .or_else(|| on_host.iter().find(|r| r.project.is_empty()))
            .or_else(|| on_host.first());
        Ok(chosen.map(|r| cove_images::Credentials {
            username: r.username.clone(),
            password: r.password.clone(),
        }))
    }
}

/// The request's fields, checked (everything but the password).
fn checked(request: RegistryRequest) -> Result<DockerRegistryRecord, EngineError> {
    if request.name.trim().is_empty() {
        return Err(invalid("name", "a registry needs a name"));
    }
    registry_host(&request.url).map_err(|error| invalid("url", error.to_string()))?;
    if request.username.is_empty() {
        return Err(invalid("username", "a registry needs a username"));
    }
    Ok(DockerRegistryRecord {
        id: String::new(),
        organization_id: String::new(),
        name: request.name,
        url: request.url.trim().to_owned(),
        username: request.username,
        password: String::new(),
        project: request.project.unwrap_or_default(),
        registry_type: String::new(),
        created_at_ms: 0,
        updated_at_ms: 0,
    })
}
