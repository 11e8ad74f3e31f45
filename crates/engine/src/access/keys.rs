//! API keys: only their hashes are stored.

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

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Access {
    /// Creates a key if none is stored yet and returns it; it is shown once and
    /// never stored in clear.
    pub async fn ensure_api_key(&self) -> Result<Option<String>, EngineError> {
        if !self.shared.store.api_key_hashes().await?.is_empty() {
            return Ok(None);
        }
        use rand::Rng;
        let bytes: [u8; 24] = rand::thread_rng().gen();
        let key: String = format!(
            "cove_{}",
            bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        self.shared
            .store
            .add_api_key_hash(&hash_api_key(&key), now_ms())
            .await?;
        *self.api_keys.write().unwrap() = None;
        Ok(Some(key))
    }

    /// Whether `key` is one of the stored keys.
    pub async fn verify_api_key(&self, key: &str) -> Result<bool, EngineError> {
        let hash = hash_api_key(key);
        let cached = self.api_keys.read().unwrap().clone();
        let hashes = match cached {
            Some(hashes) => hashes,
            None => {
                let hashes = self.shared.store.api_key_hashes().await?;
                *self.api_keys.write().unwrap() = Some(hashes.clone());
                hashes
            }
        };
        Ok(hashes
            .iter()
            .any(|stored| constant_time_eq(stored.as_bytes(), hash.as_bytes())))
    }
}

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
}
