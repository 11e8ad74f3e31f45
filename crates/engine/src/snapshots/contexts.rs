//! Build contexts: the files a Dockerfile's `COPY` and `ADD` read.
//!
//! The SDK's `Image` builder does not send them with the Dockerfile: it asks
//! for temporary object-storage credentials (`push-access`), uploads each
//! context as `{organization}/{hash}/context.tar` to an S3 endpoint, and names
//! the hashes in `buildInfo.contextHashes`. cove is that S3 endpoint (the API
//! crate speaks the protocol); this module keeps the grants it hands out and
//! the uploaded archives, one file per hash under the contexts directory.
//! Archives are written to a temporary file and renamed into place, so a
//! context is either whole or absent.
//!
//! Uploads are bounded (`ContextLimits`): a context larger than the limit
//! (a single `PUT`, or all the parts of a multipart upload together) is
//! refused as it streams in, and whatever of it was written is removed,
//! the whole multipart upload with it; one grant may have only so many
//! multipart uploads in progress.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::{Stream, StreamExt as _};
use rand::distributions::{Alphanumeric, DistString as _};
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt as _;

use super::Snapshots;
use crate::config::ContextLimits;
use crate::{now_ms, EngineError};

/// How long push credentials are good for. The SDK retries an upload for at
/// most four minutes with the credentials it was given.
const GRANT_MS: i64 = 60 * 60 * 1000;

/// Temporary credentials for uploading build contexts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushGrant {
    pub organization_id: String,
    pub access_key: String,
    pub secret: String,
    pub session_token: String,
    pub expires_at_ms: i64,
}

/// An uploaded object, as a `HEAD` describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContextObject {
    pub size: u64,
    pub modified_ms: i64,
    pub etag: String,
}

/// The checksum a client declared for a body (`x-amz-content-sha256`).
pub type DeclaredSha256 = Option<[u8; 32]>;

/// The uploaded contexts and the grants to upload them.
#[derive(Debug)]
pub(crate) struct ContextStore {
    dir: PathBuf,
    limits: ContextLimits,
    grants: Mutex<HashMap<String, PushGrant>>,
    /// Multipart uploads in progress, by id.
    uploads: Mutex<HashMap<String, Upload>>,
}

/// A multipart upload in progress.
#[derive(Debug)]
struct Upload {
    /// The key it will complete.
    key: String,
    /// The grant that started it.
    access_key: String,
    budget: Arc<Budget>,
}

/// The bytes an upload has written so far, across parts written at once.
#[derive(Debug, Default)]
struct Budget {
    used: AtomicU64,
    /// Set once the upload went over the limit: every part still being
    /// written stops too.
    refused: AtomicBool,
}

impl Budget {
    /// No longer counts `bytes` (of a part replaced or refused).
    fn release(&self, bytes: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                Some(used.saturating_sub(bytes))
            });
    }
}

impl ContextStore {
    pub(crate) fn new(dir: PathBuf, limits: ContextLimits) -> ContextStore {
        ContextStore {
            dir,
            limits,
            grants: Mutex::default(),
            uploads: Mutex::default(),
        }
    }

    /// The archive of context `name`, if it was uploaded.
    pub(crate) fn archive(&self, name: &ContextName) -> Option<PathBuf> {
        let path = self.dir.join(name.relative()?).join("context.tar");
        path.is_file().then_some(path)
    }

    fn scratch(&self) -> PathBuf {
        self.dir.join(".uploads")
    }
}

/// A build context: an organization's upload under the hash the SDK named
/// it by. Contexts are the organization's own: another organization naming
/// the same hash finds nothing, and cannot write over it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ContextName {
    pub(crate) organization: String,
    pub(crate) hash: String,
}

impl ContextName {
    /// Where it is kept under the contexts directory: `{hash}` for the
    /// default organization (as before organizations), `{org}/{hash}` for
    /// another; `None` for a name that is no hash or no organization's id.
    fn relative(&self) -> Option<PathBuf> {
        if !is_hash(&self.hash) {
            return None;
        }
        if self.organization == crate::DEFAULT_ORGANIZATION {
            return Some(PathBuf::from(&self.hash));
        }
        // Organizations other than the default are UUIDs, which no hash
        // (letters and digits) can be.
        uuid::Uuid::try_parse(&self.organization).ok()?;
        Some(Path::new(&self.organization).join(&self.hash))
    }
}

/// Context hashes are the SDK's MD5 in hex; anything path-like is refused.
fn is_hash(text: &str) -> bool {
    !text.is_empty() && text.len() <= 128 && text.chars().all(|c| c.is_ascii_alphanumeric())
}

fn invalid_key(key: &str) -> EngineError {
    EngineError::Invalid {
        field: "object key",
        reason: format!(
            "{key:?}: build contexts are stored as {{organizationId}}/{{hash}}/context.tar"
        ),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `body` to `path`, checking it against `declared` and counting
/// it in `budget`, which may hold at most `limit` bytes; answers its size
/// and SHA-256. On any failure the file is removed and the body's bytes no
/// longer count.
async fn write_body<S, E>(
    path: &Path,
    body: S,
    declared: DeclaredSha256,
    budget: &Budget,
    limit: u64,
    key: &str,
) -> Result<(u64, [u8; 32]), EngineError>
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let mut size = 0u64;
    let written = write_counted(path, body, declared, budget, limit, key, &mut size).await;
    if written.is_err() {
        budget.release(size);
        let _ = tokio::fs::remove_file(path).await;
    }
    written
}

async fn write_counted<S, E>(
    path: &Path,
    mut body: S,
    declared: DeclaredSha256,
    budget: &Budget,
    limit: u64,
    key: &str,
    size: &mut u64,
) -> Result<(u64, [u8; 32]), EngineError>
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let too_large = || EngineError::ContextTooLarge {
        key: key.to_owned(),
        limit_bytes: limit,
    };
    let io = |e: std::io::Error| EngineError::io("write", path)(e);
    let mut file = tokio::fs::File::create(path).await.map_err(io)?;
    let mut hash = Sha256::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| EngineError::Invalid {
            field: "body",
            reason: format!("the upload broke off: {e}"),
        })?;
        let len = chunk.len() as u64;
        *size += len;
        let total = budget.used.fetch_add(len, Ordering::SeqCst) + len;
        if total > limit || budget.refused.load(Ordering::SeqCst) {
            budget.refused.store(true, Ordering::SeqCst);
            return Err(too_large());
        }
        hash.update(&chunk);
        file.write_all(&chunk).await.map_err(io)?;
    }
    file.flush().await.map_err(io)?;
    let digest: [u8; 32] = hash.finalize().into();
    if declared.is_some_and(|d| d != digest) {
        return Err(EngineError::Invalid {
            field: "body",
            reason: "its SHA-256 is not the x-amz-content-sha256 it was signed with".into(),
        });
    }
    Ok((*size, digest))
}

impl Snapshots {
    fn contexts(&self) -> Result<&ContextStore, EngineError> {
        self.contexts
            .as_deref()
            .ok_or_else(|| EngineError::NotImplemented {
                what: "build contexts (this server has no contexts directory)".into(),
            })
    }

    /// Removes what builds and uploads of an earlier server left: their
    /// scratch directories (its builds ended with it, and its upload ids
    /// were in its memory). Finished contexts stay.
    pub(crate) fn clear_context_scratch(&self) {
        let Ok(contexts) = self.contexts() else {
            return;
        };
        for dir in [contexts.scratch(), contexts.dir.join(".builds")] {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {
                    tracing::info!(dir = %dir.display(), "removed an earlier server's build scratch")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    tracing::warn!(dir = %dir.display(), %error, "removing build scratch")
                }
            }
        }
    }

    /// The directory build contexts are kept in.
    pub(crate) fn contexts_dir(&self) -> Result<&Path, EngineError> {
        Ok(&self.contexts()?.dir)
    }

    /// New credentials for uploading build contexts of `organization_id`.
    pub fn issue_push_grant(&self, organization_id: &str) -> Result<PushGrant, EngineError> {
        let contexts = self.contexts()?;
        let mut rng = rand::thread_rng();
        let grant = PushGrant {
            organization_id: organization_id.to_owned(),
            access_key: format!("COVE{}", Alphanumeric.sample_string(&mut rng, 16)).to_uppercase(),
            secret: Alphanumeric.sample_string(&mut rng, 40),
            session_token: Alphanumeric.sample_string(&mut rng, 64),
            expires_at_ms: now_ms() + GRANT_MS,
        };
        let mut grants = contexts.grants.lock().unwrap();
        let now = now_ms();
        grants.retain(|_, g| g.expires_at_ms > now);
        grants.insert(grant.access_key.clone(), grant.clone());
        Ok(grant)
    }

    /// The grant with this access key, unless it expired.
    pub fn push_grant(&self, access_key: &str) -> Option<PushGrant> {
        let contexts = self.contexts().ok()?;
        let grants = contexts.grants.lock().unwrap();
        grants
            .get(access_key)
            .filter(|g| g.expires_at_ms > now_ms())
            .cloned()
    }

    /// The context `key` names, if `grant` may write it: its organization's.
    fn context_key(&self, grant: &PushGrant, key: &str) -> Result<ContextName, EngineError> {
        let parts: Vec<&str> = key.split('/').collect();
        match parts.as_slice() {
            [organization, hash, "context.tar"]
                if *organization == grant.organization_id && is_hash(hash) =>
            {
                let name = ContextName {
                    organization: grant.organization_id.clone(),
                    hash: (*hash).to_owned(),
                };
                name.relative()
                    .map(|_| name)
                    .ok_or_else(|| invalid_key(key))
            }
            _ => Err(invalid_key(key)),
        }
    }

    /// What is stored under `key`, if anything.
    pub async fn head_context(
        &self,
        grant: &PushGrant,
        key: &str,
    ) -> Result<Option<ContextObject>, EngineError> {
        let name = self.context_key(grant, key)?;
        let Some(path) = self.contexts()?.archive(&name) else {
            return Ok(None);
        };
        let meta = tokio::fs::metadata(&path)
            .await
            .map_err(EngineError::io("read", &path))?;
        let modified_ms = meta
            .modified()
            .ok()
            .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        Ok(Some(ContextObject {
            size: meta.len(),
            modified_ms,
            etag: format!("{:x}-{}", meta.len(), name.hash),
        }))
    }

    /// Stores `body` as the object `key` (a whole upload); answers its ETag.
    pub async fn put_context<S, E>(
        &self,
        grant: &PushGrant,
        key: &str,
        body: S,
        declared: DeclaredSha256,
    ) -> Result<String, EngineError>
    where
        S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        let name = self.context_key(grant, key)?;
        let contexts = self.contexts()?;
        let scratch = contexts.scratch();
        make_dir(&scratch).await?;
        let temp = scratch.join(format!("put-{}", uuid::Uuid::new_v4().simple()));
        let budget = Budget::default();
        let (size, digest) = write_body(
            &temp,
            body,
            declared,
            &budget,
            contexts.limits.max_bytes,
            key,
        )
        .await?;
        self.install_context(&name, &temp).await?;
        tracing::info!(key, size, "build context stored");
        Ok(hex(&digest[..16]))
    }

    /// Starts a multipart upload of `key`; answers its id.
    pub async fn start_context_upload(
        &self,
        grant: &PushGrant,
        key: &str,
    ) -> Result<String, EngineError> {
        self.context_key(grant, key)?;
        let contexts = self.contexts()?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        {
            let mut uploads = contexts.uploads.lock().unwrap();
            let limit = contexts.limits.max_uploads_per_grant;
            let in_progress = uploads
                .values()
                .filter(|u| u.access_key == grant.access_key)
                .count();
            if in_progress >= limit {
                return Err(EngineError::TooManyUploads { limit });
            }
            uploads.insert(
                id.clone(),
                Upload {
                    key: key.to_owned(),
                    access_key: grant.access_key.clone(),
                    budget: Arc::default(),
                },
            );
        }
        if let Err(error) = make_dir(&contexts.scratch().join(&id)).await {
            contexts.uploads.lock().unwrap().remove(&id);
            return Err(error);
        }
        tracing::info!(key, upload = %id, "build context upload in parts started");
        Ok(id)
    }

    /// The scratch directory and byte budget of an upload in progress.
    fn upload(&self, key: &str, upload_id: &str) -> Result<(PathBuf, Arc<Budget>), EngineError> {
        let contexts = self.contexts()?;
        let uploads = contexts.uploads.lock().unwrap();
        match uploads.get(upload_id) {
            Some(upload) if upload.key == key => {
                Ok((contexts.scratch().join(upload_id), upload.budget.clone()))
            }
            _ => Err(EngineError::Invalid {
                field: "uploadId",
                reason: format!("{upload_id:?} is no upload of {key} in progress"),
            }),
        }
    }

    /// Stores part `number` (1..=10000) of a multipart upload; answers its ETag.
    pub async fn put_context_part<S, E>(
        &self,
        grant: &PushGrant,
        key: &str,
        upload_id: &str,
        number: u32,
        body: S,
        declared: DeclaredSha256,
    ) -> Result<String, EngineError>
    where
        S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        self.context_key(grant, key)?;
        if !(1..=10_000).contains(&number) {
            return Err(EngineError::Invalid {
                field: "partNumber",
                reason: format!("{number} is not between 1 and 10000"),
            });
        }
        let (dir, budget) = self.upload(key, upload_id)?;
        let limit = self.contexts()?.limits.max_bytes;
        // Written beside the part it may replace, so a part sent again
        // counts once.
        let part = dir.join(format!("{number:05}"));
        let temp = dir.join(format!("{number:05}.{}", uuid::Uuid::new_v4().simple()));
        let replaced = tokio::fs::metadata(&part).await.map_or(0, |m| m.len());
        budget.release(replaced);
        let written = write_body(&temp, body, declared, &budget, limit, key).await;
        if budget.refused.load(Ordering::SeqCst) {
            // It can never complete: drop all of it, not just this part.
            self.drop_upload(upload_id, &dir).await;
            return Err(EngineError::ContextTooLarge {
                key: key.to_owned(),
                limit_bytes: limit,
            });
        }
        let (size, digest) = match written {
            Ok(written) => written,
            Err(error) => {
                // The part it would have replaced stays, and counts again.
                budget.used.fetch_add(replaced, Ordering::SeqCst);
                return Err(error);
            }
        };
        if let Err(e) = tokio::fs::rename(&temp, &part).await {
            budget.release(size);
            let _ = tokio::fs::remove_file(&temp).await;
            return Err(EngineError::io("move in place", &part)(e));
        }
        Ok(hex(&digest[..16]))
    }

    /// Joins the parts of a multipart upload, in the order given, into the
    /// object; answers its ETag.
    pub async fn complete_context_upload(
        &self,
        grant: &PushGrant,
        key: &str,
        upload_id: &str,
        parts: &[u32],
    ) -> Result<String, EngineError> {
        let name = self.context_key(grant, key)?;
        let (dir, _) = self.upload(key, upload_id)?;
        if parts.is_empty() || parts.windows(2).any(|w| w[0] >= w[1]) {
            return Err(EngineError::Invalid {
                field: "CompleteMultipartUpload",
                reason: "name the parts once each, in ascending order".into(),
            });
        }
        let joined = dir.join("joined");
        let io = |e: std::io::Error| EngineError::io("join the parts into", &joined)(e);
        let mut out = tokio::fs::File::create(&joined).await.map_err(io)?;
        for number in parts {
            let mut part = tokio::fs::File::open(dir.join(format!("{number:05}")))
                .await
                .map_err(|_| EngineError::Invalid {
                    field: "CompleteMultipartUpload",
                    reason: format!("part {number} of {key} was never uploaded"),
                })?;
            tokio::io::copy(&mut part, &mut out).await.map_err(io)?;
        }
        out.flush().await.map_err(io)?;
        drop(out);
        self.install_context(&name, &joined).await?;
        self.abort_context_upload(grant, key, upload_id).await?;
        tracing::info!(key, parts = parts.len(), "build context stored");
        Ok(format!("{}-{}", &name.hash, parts.len()))
    }

    /// Drops a multipart upload and its parts.
    pub async fn abort_context_upload(
        &self,
        grant: &PushGrant,
        key: &str,
        upload_id: &str,
    ) -> Result<(), EngineError> {
        self.context_key(grant, key)?;
        let (dir, _) = self.upload(key, upload_id)?;
        self.drop_upload(upload_id, &dir).await;
        Ok(())
    }

    /// Forgets a multipart upload and removes its parts.
    async fn drop_upload(&self, upload_id: &str, dir: &Path) {
        if let Ok(contexts) = self.contexts() {
            contexts.uploads.lock().unwrap().remove(upload_id);
        }
        let _ = tokio::fs::remove_dir_all(dir).await;
    }

    /// Moves a finished upload into place as context `name`.
    async fn install_context(&self, name: &ContextName, file: &Path) -> Result<(), EngineError> {
        let relative = name.relative().ok_or_else(|| EngineError::Invalid {
            field: "object key",
            reason: format!("{:?} is no build context's name", name.hash),
        })?;
        let dir = self.contexts()?.dir.join(relative);
        make_dir(&dir).await?;
        tokio::fs::rename(file, dir.join("context.tar"))
            .await
            .map_err(EngineError::io("store as context", dir.join("context.tar")))
    }

    /// The archives of `hashes` this handle's organization uploaded, or
    /// which one it never did.
    pub(crate) fn context_archives(&self, hashes: &[String]) -> Result<Vec<PathBuf>, EngineError> {
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let contexts = self.contexts()?;
        hashes
            .iter()
            .map(|hash| {
                let name = ContextName {
                    organization: self.scope.owner().to_owned(),
                    hash: hash.clone(),
                };
                contexts.archive(&name).ok_or_else(|| EngineError::Invalid {
                    field: "buildInfo.contextHashes",
                    reason: format!(
                        "no build context {hash} was uploaded to this server's object storage"
                    ),
                })
            })
            .collect()
    }
}

async fn make_dir(dir: &Path) -> Result<(), EngineError> {
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(EngineError::io("create", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_hashes_name_contexts() {
        assert!(is_hash("0123456789abcdef0123456789abcdef"));
        assert!(!is_hash(""));
        assert!(!is_hash(".."));
        assert!(!is_hash("a/b"));
    }

    #[test]
    fn a_context_is_kept_under_its_organization() {
        let name = |organization: &str, hash: &str| ContextName {
            organization: organization.into(),
            hash: hash.into(),
        };
        let team = "8d6958cd-b263-468b-b85c-ea4651ce84d3";
        assert_eq!(name("cove", "ab12").relative(), Some(PathBuf::from("ab12")));
        assert_eq!(
            name(team, "ab12").relative(),
            Some(Path::new(team).join("ab12"))
        );
        // Neither part may name a path of its own.
        assert_eq!(name("..", "ab12").relative(), None);
        assert_eq!(name(team, "../x").relative(), None);
        assert_eq!(name("team/..", "ab12").relative(), None);
    }
}
