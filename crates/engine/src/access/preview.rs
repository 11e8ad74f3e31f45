//! Preview URLs: the sandbox's own preview token, signed preview URLs, and the
//! agent a preview request goes through.
//!
//! A preview is traffic of an application in the sandbox, not an interaction
//! with cove: unlike the toolbox it does not reset the idle clock, so a web
//! page left open does not keep a sandbox running forever.

use cove_store::SignedPreview;

use super::Access;
use crate::{now_ms, EngineError, SandboxRecord};

/// Random lower-case letters and digits: tokens end up in host names, which
/// browsers lower-case, and in URL paths.
pub(crate) fn random_token(len: usize) -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::thread_rng();
    (0..len)
        .map(|_| char::from(ALPHABET[rng.gen_range(0..ALPHABET.len())]))
        .collect()
}

/// 32 characters of 36 symbols: about 165 bits.
const TOKEN_LEN: usize = 32;

impl Access {
    /// The sandbox and its preview token, made on first use and stable after.
    pub async fn preview_token(
        &self,
        id_or_name: &str,
    ) -> Result<(SandboxRecord, String), EngineError> {
        let record = self.shared.sandbox(id_or_name).await?;
        let token = self
            .shared
            .store
            .preview_token(&record.id, &random_token(TOKEN_LEN))
            .await?;
        Ok((record, token))
    }

    /// A new signed preview of `port`, valid for `expires_in_s` seconds.
    pub async fn sign_preview(
        &self,
        id_or_name: &str,
        port: u16,
        expires_in_s: u32,
    ) -> Result<SignedPreview, EngineError> {
        let record = self.shared.sandbox(id_or_name).await?;
        let now = now_ms();
        let signed = SignedPreview {
            token: random_token(TOKEN_LEN),
            sandbox_id: record.id,
            port,
            expires_at_ms: now + i64::from(expires_in_s) * 1000,
        };
        self.shared.store.add_signed_preview(&signed, now).await?;
        Ok(signed)
    }

    /// Ends a signed preview of this sandbox and port now.
    pub async fn expire_signed_preview(
        &self,
        id_or_name: &str,
        port: u16,
        token: &str,
    ) -> Result<(), EngineError> {
        let record = self.shared.sandbox(id_or_name).await?;
        if self
            .shared
            .store
            .expire_signed_preview(&record.id, port, token, now_ms())
            .await?
        {
            Ok(())
        } else {
            Err(EngineError::SignedPreviewNotFound {
                id: record.id,
                port,
            })
        }
    }

    /// The signed preview with this token, expired or not.
    pub async fn signed_preview(&self, token: &str) -> Result<Option<SignedPreview>, EngineError> {
        Ok(self.shared.store.signed_preview(token).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_lower_case_alphanumeric() {
        let token = random_token(TOKEN_LEN);
        assert_eq!(token.len(), TOKEN_LEN);
        assert!(token
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()));
        assert_ne!(token, random_token(TOKEN_LEN));
    }
}
