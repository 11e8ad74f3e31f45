//! Organizations: the tenants of a server. Every sandbox, snapshot, volume,
//! registry and API key belongs to one, and a handle scoped to one
//! ([`Engine::scoped`](crate::Engine::scoped)) neither sees nor touches
//! another's: a lookup there finds nothing, as if it did not exist.
//!
//! The default organization exists on every server (the store makes it);
//! what the server itself makes (its general snapshots) and what existed
//! before organizations belongs to it.

use std::sync::Arc;

use cove_store::{OrganizationRecord, StoreError};

use crate::access::Access;
use crate::quota::REGION_ID;
use crate::shared::Shared;
use crate::{now_ms, EngineError};

pub use cove_store::DEFAULT_ORGANIZATION;

/// Which organization's resources a handle sees, and who owns what it makes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum Scope {
    /// The server's own view (timers, recovery, the operator's admin routes,
    /// tests): every organization's resources; what it makes belongs to the
    /// default organization.
    #[default]
    Server,
    /// One organization's resources only.
    Organization(Arc<str>),
}

impl Scope {
    /// The organization lookups are limited to (`None`: every one).
    pub(crate) fn filter(&self) -> Option<&str> {
        match self {
            Scope::Server => None,
            Scope::Organization(id) => Some(id),
        }
    }

    /// Who owns what is made through this scope.
    pub(crate) fn owner(&self) -> &str {
        self.filter().unwrap_or(DEFAULT_ORGANIZATION)
    }

    /// Whether a resource of `organization_id` is seen through this scope.
    pub(crate) fn sees(&self, organization_id: &str) -> bool {
        self.filter().is_none_or(|id| id == organization_id)
    }

    /// `id` made unique across organizations for a resource whose id is
    /// derived from its content or name (pulled images, builds): the
    /// default organization keeps the plain id, as before organizations.
    pub(crate) fn owned_id(&self, id: &str) -> String {
        match self.owner() {
            DEFAULT_ORGANIZATION => id.to_owned(),
            owner => format!("{owner}/{id}"),
        }
    }
}

/// A name people read: 1 to 100 characters, none of them a control one.
fn check_organization_name(name: &str) -> Result<(), EngineError> {
    let count = name.chars().count();
    if name.trim().is_empty() || count > 100 || name.chars().any(char::is_control) {
        return Err(EngineError::Invalid {
            field: "name",
            reason: format!(
                "{name:?} must be 1 to 100 characters, not only spaces, without control characters"
            ),
        });
    }
    Ok(())
}

/// An organization that could not be deleted: what it still owns.
fn holdings_message(id: &str, holdings: &cove_store::OrganizationHoldings) -> String {
    let parts: Vec<String> = [
        (holdings.sandboxes, "sandbox", "sandboxes"),
        (holdings.snapshots, "snapshot", "snapshots"),
        (holdings.volumes, "volume", "volumes"),
    ]
    .into_iter()
    .filter(|(n, _, _)| *n > 0)
    .map(|(n, one, many)| format!("{n} {}", if n == 1 { one } else { many }))
    .collect();
    format!(
        "organization {id} still has {}; delete them first",
        parts.join(", ")
    )
}

/// Organizations: made and deleted by the operator.
#[derive(Clone)]
pub struct Organizations {
    shared: Arc<Shared>,
    /// Whose key cache forgets the keys a deleted organization takes along.
    access: Access,
}

impl Organizations {
    pub(crate) fn new(shared: Arc<Shared>, access: Access) -> Organizations {
        Organizations { shared, access }
    }

    /// Makes an organization named `name` (unique on the server).
    pub async fn create(
        &self,
        name: &str,
        default_region_id: Option<&str>,
    ) -> Result<OrganizationRecord, EngineError> {
        check_organization_name(name)?;
        let region = default_region_id.unwrap_or(REGION_ID);
        if region != REGION_ID {
            return Err(EngineError::Invalid {
                field: "defaultRegionId",
                reason: format!("this server has one region, {REGION_ID}, not {region:?}"),
            });
        }
        let now = now_ms();
        let record = OrganizationRecord {
            id: uuid::Uuid::new_v4().to_string(),
            name: name.to_owned(),
            default_region_id: region.to_owned(),
            created_at_ms: now,
            updated_at_ms: now,
        };
        match self.shared.store.insert_organization(&record).await {
            Ok(()) => {
                tracing::info!(organization = %record.id, name, "organization created");
                Ok(record)
            }
            Err(StoreError::Duplicate { name }) => Err(EngineError::OrganizationTaken { name }),
            Err(other) => Err(other.into()),
        }
    }

    /// The organization with this id.
    pub async fn get(&self, id: &str) -> Result<OrganizationRecord, EngineError> {
        self.shared
            .store
            .find_organization(id)
            .await?
            .ok_or_else(|| EngineError::OrganizationNotFound { id: id.to_owned() })
    }

    /// Every organization, oldest first.
    pub async fn list(&self) -> Result<Vec<OrganizationRecord>, EngineError> {
        Ok(self.shared.store.list_organizations().await?)
    }

    /// Deletes an organization with its keys, registries and quotas; refused
    /// (409) for the default one and while it owns sandboxes, snapshots or
    /// volumes.
    pub async fn delete(&self, id: &str) -> Result<(), EngineError> {
        let record = self.get(id).await?;
        if record.id == DEFAULT_ORGANIZATION {
            return Err(EngineError::OrganizationInUse {
                message: format!(
                    "organization {DEFAULT_ORGANIZATION} is the server's default; it cannot be deleted"
                ),
            });
        }
        match self.shared.store.delete_organization(id).await? {
            Ok(()) => {
                self.shared.forget_quotas(id).await;
                // Its keys went with it: refused from the next request on.
                self.access.forget_api_keys();
                tracing::info!(organization = %id, name = %record.name, "organization deleted");
                Ok(())
            }
            Err(holdings) => Err(EngineError::OrganizationInUse {
                message: holdings_message(id, &holdings),
            }),
        }
    }
}
