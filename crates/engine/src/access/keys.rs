//! API keys: only their hashes are stored, with a name, Daytona's
//! permissions, an expiry and a masked form for listings.
//!
//! The server operator's key (made at first start, or `COVE_API_KEY`) has
//! every permission. Any other key has the permissions it was made with,
//! never more than the key that made it.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use cove_store::ApiKeyRecord;
use sha2::{Digest, Sha256};

use super::Access;
use crate::{now_ms, EngineError};

/// The stored form of an API key.
pub fn hash_api_key(key: &str) -> String {
    hash_secret(key)
}

/// SHA-256 in hex: how secrets (API keys, SSH access tokens) are stored and
/// looked up, so the database never holds one in clear.
pub(crate) fn hash_secret(secret: &str) -> String {
    let digest = Sha256::digest(secret.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `a` and `b` are equal, in a time that does not depend on where
/// they differ (secrets are compared with it).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

macro_rules! permissions {
    ($($variant:ident => $name:literal,)*) => {
        /// What a key may do beyond reading, by Daytona's names
        /// (`CreateApiKey.permissions`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Permission {
            $($variant,)*
        }

        impl Permission {
            pub const ALL: &'static [Permission] = &[$(Permission::$variant,)*];

            /// The wire name, as `write:sandboxes`.
            pub fn name(self) -> &'static str {
                match self {
                    $(Permission::$variant => $name,)*
                }
            }
        }
    };
}

permissions! {
    WriteRegistries => "write:registries",
    DeleteRegistries => "delete:registries",
    WriteSnapshots => "write:snapshots",
    DeleteSnapshots => "delete:snapshots",
    WriteSandboxes => "write:sandboxes",
    DeleteSandboxes => "delete:sandboxes",
    ReadVolumes => "read:volumes",
    WriteVolumes => "write:volumes",
    DeleteVolumes => "delete:volumes",
    WriteRegions => "write:regions",
    DeleteRegions => "delete:regions",
    ReadRunners => "read:runners",
    WriteRunners => "write:runners",
    DeleteRunners => "delete:runners",
    ReadAuditLogs => "read:audit_logs",
    ManageApiKeys => "manage:api_keys",
    ManageSecrets => "manage:secrets",
    ReadLimits => "read:limits",
    ManageSso => "manage:sso",
    ReadBilling => "read:billing",
    ManageBilling => "manage:billing",
}

impl Permission {
    /// The permission named `name`, or an error listing the names there are.
    pub fn parse(name: &str) -> Result<Permission, EngineError> {
        Permission::ALL
            .iter()
            .copied()
            .find(|p| p.name() == name)
            .ok_or_else(|| EngineError::Invalid {
                field: "permissions",
                reason: format!(
                    "unknown permission {name:?}; the permissions are {}",
                    Permission::ALL
                        .iter()
                        .map(|p| p.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }
}

/// The key a request came with, and what it may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The organization the request acts in: the key's own, or for the
    /// operator the one it named (the default organization otherwise).
    pub organization_id: String,
    pub key_name: String,
    /// The key's masked form, as listings show it.
    pub key_masked: String,
    /// The server operator's key: every permission.
    pub operator: bool,
    permissions: BTreeSet<Permission>,
}

impl Caller {
    /// The operator, by a key named `key_name`.
    pub fn operator(key_name: impl Into<String>, key_masked: impl Into<String>) -> Caller {
        Caller {
            organization_id: crate::DEFAULT_ORGANIZATION.into(),
            key_name: key_name.into(),
            key_masked: key_masked.into(),
            operator: true,
            permissions: BTreeSet::new(),
        }
    }

    /// The operator, acting in `organization_id`.
    pub fn in_organization(self, organization_id: &str) -> Caller {
        Caller {
            organization_id: organization_id.to_owned(),
            ..self
        }
    }

    pub fn may(&self, permission: Permission) -> bool {
        self.operator || self.permissions.contains(&permission)
    }

    /// Ok if the caller may do what `permission` allows, else a 403 naming it.
    pub fn require(&self, permission: Permission) -> Result<(), EngineError> {
        if self.may(permission) {
            Ok(())
        } else {
            Err(EngineError::Forbidden {
                permission: permission.name(),
            })
        }
    }

    /// Every permission the caller has.
    pub fn permissions(&self) -> Vec<Permission> {
        if self.operator {
            Permission::ALL.to_vec()
        } else {
            self.permissions.iter().copied().collect()
        }
    }
}

/// What a presented key turned out to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyCheck {
    Accepted(Caller),
    /// A stored key past its `expiresAt`.
    Expired {
        name: String,
    },
    Unknown,
}

/// A key as listed: never its value, only the masked form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiKeyInfo {
    pub name: String,
    pub masked: String,
    pub permissions: Vec<Permission>,
    pub created_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    pub last_used_at_ms: Option<i64>,
    pub operator: bool,
}

impl ApiKeyInfo {
    fn of(record: &ApiKeyRecord) -> ApiKeyInfo {
        ApiKeyInfo {
            name: record.name.clone(),
            masked: record.masked.clone(),
            permissions: if record.operator {
                Permission::ALL.to_vec()
            } else {
                permissions_of(record).into_iter().collect()
            },
            created_at_ms: record.created_at_ms,
            expires_at_ms: record.expires_at_ms,
            last_used_at_ms: record.last_used_at_ms,
            operator: record.operator,
        }
    }
}

/// A new key's value, shown once.
pub struct NewApiKey {
    pub info: ApiKeyInfo,
    pub value: String,
}

/// The longest key name accepted.
const MAX_NAME_LEN: usize = 100;
/// How often a key's `lastUsedAt` is written: a busy key must not cost a
/// write per request.
const TOUCH_EVERY_MS: i64 = 60_000;

/// Stored permission names; a name this build does not know is dropped
/// (it grants nothing).
fn permissions_of(record: &ApiKeyRecord) -> BTreeSet<Permission> {
    record
        .permissions
        .iter()
        .filter_map(|name| Permission::parse(name).ok())
        .collect()
}

fn new_secret() -> String {
    use rand::Rng;
    let bytes: [u8; 24] = rand::thread_rng().gen();
    format!(
        "cove_{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

/// The listed form of `key`: its first nine and last three characters.
fn mask(key: &str) -> String {
    let head: String = key.chars().take(9).collect();
    let tail: String = key
        .chars()
        .skip(key.chars().count().saturating_sub(3))
        .collect();
    format!("{head}{}{tail}", "*".repeat(20))
}

fn check_name(name: &str) -> Result<(), EngineError> {
    let reason = if name.trim().is_empty() {
        "a key needs a name"
    } else if name.chars().count() > MAX_NAME_LEN {
        "names are at most 100 characters"
    } else if name.chars().any(char::is_control) || name.contains('/') {
        "names may not contain control characters or '/'"
    } else {
        return Ok(());
    };
    Err(EngineError::Invalid {
        field: "name",
        reason: format!("{name:?}: {reason}"),
    })
}

impl Access {
    /// The stored keys, read once and kept until a key is made or deleted:
    /// checking a key must not cost a query per request.
    async fn keys(&self) -> Result<Arc<Vec<ApiKeyRecord>>, EngineError> {
        if let Some(keys) = self.api_keys.read().unwrap().clone() {
            return Ok(keys);
        }
        let keys = Arc::new(self.shared.store.api_keys().await?);
        *self.api_keys.write().unwrap() = Some(keys.clone());
        Ok(keys)
    }

    fn forget_keys(&self) {
        *self.api_keys.write().unwrap() = None;
    }

    /// Reads the keys from the store again at the next check: after keys
    /// were deleted elsewhere (with their organization).
    pub(crate) fn forget_api_keys(&self) {
        self.forget_keys();
    }

    /// Creates the operator's key if none is stored yet and returns it; it is
    /// shown once and never stored in clear.
    pub async fn ensure_api_key(&self) -> Result<Option<String>, EngineError> {
        if self.keys().await?.iter().any(|k| k.operator) {
            return Ok(None);
        }
        let value = new_secret();
        let record = ApiKeyRecord {
            hash: hash_api_key(&value),
            organization_id: crate::DEFAULT_ORGANIZATION.into(),
            name: "operator".into(),
            permissions: Vec::new(),
            masked: mask(&value),
            created_at_ms: now_ms(),
            expires_at_ms: None,
            last_used_at_ms: None,
            operator: true,
        };
        let stored = self.shared.store.insert_api_key(&record).await?;
        self.forget_keys();
        if !stored {
            return Err(EngineError::ApiKeyTaken { name: record.name });
        }
        Ok(Some(value))
    }

    /// Who `key` is, if it is a stored key that has not expired.
    pub async fn check_api_key(&self, key: &str) -> Result<KeyCheck, EngineError> {
        let hash = hash_api_key(key);
        let keys = self.keys().await?;
        let Some(record) = keys
            .iter()
            .find(|stored| constant_time_eq(stored.hash.as_bytes(), hash.as_bytes()))
        else {
            return Ok(KeyCheck::Unknown);
        };
        let now = now_ms();
        if record.expires_at_ms.is_some_and(|at| at <= now) {
            return Ok(KeyCheck::Expired {
                name: record.name.clone(),
            });
        }
        self.touch(record, now).await?;
        Ok(KeyCheck::Accepted(Caller {
            organization_id: record.organization_id.clone(),
            key_name: record.name.clone(),
            key_masked: record.masked.clone(),
            operator: record.operator,
            permissions: permissions_of(record),
        }))
    }

    /// Writes the key's last use, at most once a minute per key.
    async fn touch(&self, record: &ApiKeyRecord, now: i64) -> Result<(), EngineError> {
        {
            let mut touched = self.touched.lock().unwrap();
            let last = touched
                .get(&record.hash)
                .copied()
                .or(record.last_used_at_ms);
            if last.is_some_and(|at| now - at < TOUCH_EVERY_MS) {
                return Ok(());
            }
            touched.insert(record.hash.clone(), now);
        }
        self.shared.store.touch_api_key(&record.hash, now).await?;
        Ok(())
    }

    /// A new key of the caller's organization named `name` with
    /// `permissions`, which must all be the caller's own; its value is
    /// returned once and never stored.
    pub async fn create_api_key(
        &self,
        caller: &Caller,
        name: &str,
        permissions: &[Permission],
        expires_at_ms: Option<i64>,
    ) -> Result<NewApiKey, EngineError> {
        caller.require(Permission::ManageApiKeys)?;
        check_name(name)?;
        for permission in permissions {
            caller.require(*permission)?;
        }
        let now = now_ms();
        if let Some(at) = expires_at_ms {
            if at <= now {
                return Err(EngineError::Invalid {
                    field: "expiresAt",
                    reason: "the time is in the past; a key must expire later than now".into(),
                });
            }
        }
        let value = new_secret();
        let permissions: BTreeSet<Permission> = permissions.iter().copied().collect();
        let record = ApiKeyRecord {
            hash: hash_api_key(&value),
            organization_id: caller.organization_id.clone(),
            name: name.to_owned(),
            permissions: permissions.iter().map(|p| p.name().to_owned()).collect(),
            masked: mask(&value),
            created_at_ms: now,
            expires_at_ms,
            last_used_at_ms: None,
            operator: false,
        };
        if !self.shared.store.insert_api_key(&record).await? {
            return Err(EngineError::ApiKeyTaken { name: name.into() });
        }
        self.forget_keys();
        Ok(NewApiKey {
            info: ApiKeyInfo::of(&record),
            value,
        })
    }

    /// Every stored key of `organization_id`, masked, oldest first.
    pub async fn api_keys(&self, organization_id: &str) -> Result<Vec<ApiKeyInfo>, EngineError> {
        Ok(self
            .fresh_keys()
            .await?
            .iter()
            .filter(|k| k.organization_id == organization_id)
            .map(ApiKeyInfo::of)
            .collect())
    }

    /// The stored key of `organization_id` named `name`, masked.
    pub async fn api_key(
        &self,
        organization_id: &str,
        name: &str,
    ) -> Result<ApiKeyInfo, EngineError> {
        self.fresh_keys()
            .await?
            .iter()
            .find(|k| k.organization_id == organization_id && k.name == name)
            .map(ApiKeyInfo::of)
            .ok_or_else(|| EngineError::ApiKeyNotFound { name: name.into() })
    }

    /// The keys as stored now, last uses included (the cache keeps the ones
    /// read at its fill).
    async fn fresh_keys(&self) -> Result<Vec<ApiKeyRecord>, EngineError> {
        Ok(self.shared.store.api_keys().await?)
    }

    /// Deletes the caller's organization's key named `name`; from then on
    /// it is refused. The operator's key stays.
    pub async fn delete_api_key(&self, caller: &Caller, name: &str) -> Result<(), EngineError> {
        caller.require(Permission::ManageApiKeys)?;
        let key = self.api_key(&caller.organization_id, name).await?;
        if key.operator {
            return Err(EngineError::OperatorKey { name: name.into() });
        }
        let deleted = self
            .shared
            .store
            .delete_api_key(&caller.organization_id, name)
            .await?;
        self.forget_keys();
        if !deleted {
            return Err(EngineError::ApiKeyNotFound { name: name.into() });
        }
        Ok(())
    }
}

/// Last uses written, by key hash (see [`TOUCH_EVERY_MS`]).
pub(super) type Touched = HashMap<String, i64>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_stable_hex() {
        assert_eq!(hash_api_key("abc").len(), 64);
        assert_eq!(hash_api_key("abc"), hash_api_key("abc"));
        assert_ne!(hash_api_key("abc"), hash_api_key("abd"));
        assert!(constant_time_eq(b"x", b"x"));
        assert!(!constant_time_eq(b"x", b"xy"));
    }

    #[test]
    fn permissions_round_trip_by_name_and_unknown_ones_are_named() {
        for permission in Permission::ALL {
            assert_eq!(Permission::parse(permission.name()).unwrap(), *permission);
        }
        let error = Permission::parse("write:everything")
            .unwrap_err()
            .to_string();
        assert!(error.contains("write:everything"), "{error}");
        assert!(error.contains("delete:sandboxes"), "{error}");
    }

    #[test]
    fn a_caller_may_only_what_it_was_given_and_the_operator_everything() {
        let caller = Caller {
            organization_id: crate::DEFAULT_ORGANIZATION.into(),
            key_name: "ci".into(),
            key_masked: "cove_****".into(),
            operator: false,
            permissions: [Permission::WriteSandboxes].into(),
        };
        assert!(caller.may(Permission::WriteSandboxes));
        let refused = caller.require(Permission::DeleteSandboxes).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "this API key lacks the permission delete:sandboxes"
        );
        let operator = Caller::operator("operator", "cove_****");
        assert!(Permission::ALL.iter().all(|p| operator.may(*p)));
        assert_eq!(operator.permissions().len(), Permission::ALL.len());
    }

    #[test]
    fn masks_show_only_the_ends() {
        let key = "cove_0123456789abcdef0123456789abcdef0123456789abcdef";
        let masked = mask(key);
        assert!(masked.starts_with("cove_0123"));
        assert!(masked.ends_with("def"));
        assert!(!masked.contains("456789abcdef0123"));
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("ci key").is_ok());
        for bad in ["", "  ", "a/b", "a\nb", &"x".repeat(101)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
