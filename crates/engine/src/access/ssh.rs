//! SSH access: expiring tokens that let the SSH gateway into one sandbox. A
//! token is random (192 bits), shown once when issued, and stored only as its
//! hash, so lookups go by hash and never compare secrets byte by byte.

use rand::Rng;

pub use cove_store::SshAccessRecord;

use super::keys::hash_secret;
use super::Access;
use crate::{now_ms, EngineError, SandboxRecord};

/// How long a token lives when the client does not say (Daytona's default).
pub(crate) const DEFAULT_SSH_ACCESS_MINUTES: i64 = 60;
/// The longest a token may live: 30 days.
pub const MAX_SSH_ACCESS_MINUTES: i64 = 30 * 24 * 60;

const MINUTE_MS: i64 = 60_000;

/// A token just issued: the only time it exists in clear.
#[derive(Clone, Debug)]
pub struct IssuedSshAccess {
    pub token: String,
    pub record: SshAccessRecord,
}

fn new_token() -> String {
    let bytes: [u8; 24] = rand::thread_rng().gen();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Access {
    /// Issues a token for the sandbox with this id or name, valid for
    /// `expires_in_minutes` (default 60, at most 30 days).
    pub async fn create_ssh_access(
        &self,
        id_or_name: &str,
        expires_in_minutes: Option<i64>,
    ) -> Result<IssuedSshAccess, EngineError> {
        let minutes = expires_in_minutes.unwrap_or(DEFAULT_SSH_ACCESS_MINUTES);
        if !(1..=MAX_SSH_ACCESS_MINUTES).contains(&minutes) {
            return Err(EngineError::Invalid {
                field: "expiresInMinutes",
                reason: format!("must be between 1 and {MAX_SSH_ACCESS_MINUTES}, got {minutes}"),
            });
        }
        let sandbox = self.shared.sandbox(id_or_name).await?;
        let now = now_ms();
        // Expired rows are useless; issuing is a fine moment to drop them.
        self.shared.store.prune_ssh_access(now).await?;
        let token = new_token();
        let record = SshAccessRecord {
            id: uuid::Uuid::new_v4().to_string(),
            sandbox_id: sandbox.id,
            token_hash: hash_secret(&token),
            expires_at_ms: now + minutes * MINUTE_MS,
            created_at_ms: now,
            updated_at_ms: now,
        };
        self.shared.store.add_ssh_access(&record).await?;
        tracing::info!(sandbox = %record.sandbox_id, access = %record.id, minutes, "ssh access issued");
        Ok(IssuedSshAccess { token, record })
    }

    /// Revokes one token of the sandbox, or all of them when `token` is
    /// `None`; revoking a token that is not (or no longer) there is not an error.
    pub async fn revoke_ssh_access(
        &self,
        id_or_name: &str,
        token: Option<&str>,
    ) -> Result<SandboxRecord, EngineError> {
        let sandbox = self.shared.sandbox(id_or_name).await?;
        let hash = token.map(hash_secret);
        let revoked = self
            .shared
            .store
            .revoke_ssh_access(&sandbox.id, hash.as_deref())
            .await?;
        tracing::info!(sandbox = %sandbox.id, revoked, "ssh access revoked");
        if revoked > 0 {
            self.shared.ssh_access_revoked();
        }
        Ok(sandbox)
    }

    /// Changes whenever tokens may have gone away (revoked, or deleted with
    /// their sandbox); a holder of a token re-validates it then. The SSH
    /// gateway closes a live connection whose token no longer validates.
    pub fn ssh_access_revocations(&self) -> tokio::sync::watch::Receiver<u64> {
        self.shared.ssh_revocations.subscribe()
    }

    /// The id of the sandbox `token` opens, if it is known, unexpired and its
    /// sandbox still exists.
    pub async fn validate_ssh_access(&self, token: &str) -> Result<Option<String>, EngineError> {
        self.validate_ssh_access_at(token, now_ms()).await
    }

    /// [`Engine::validate_ssh_access`] at a given time (milliseconds since the epoch).
    pub async fn validate_ssh_access_at(
        &self,
        token: &str,
        at_ms: i64,
    ) -> Result<Option<String>, EngineError> {
        if token.is_empty() {
            return Ok(None);
        }
        let Some(access) = self
            .shared
            .store
            .find_ssh_access(&hash_secret(token))
            .await?
        else {
            return Ok(None);
        };
        if access.expires_at_ms <= at_ms {
            return Ok(None);
        }
        Ok(Some(access.sandbox_id))
    }
}
