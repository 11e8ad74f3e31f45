//! Archive: a stopped sandbox's own filesystem moved to object storage and back.
//!
//! The runtime writes the sandbox's storage as one file (`export_storage`) and
//! later rebuilds it from that file (`import_storage`); this module moves the
//! file to and from an [`ObjectStore`]: a local directory by default, any
//! S3-compatible service by configuration. The file lives in a scratch
//! directory only while it moves.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cove_runtime::{Runtime, RuntimeError, SandboxId, SandboxSpec};
use futures_util::StreamExt as _;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt as _, WriteMultipart};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// Parts of a multipart upload; S3 needs at least 5 MiB per part.
const PART_BYTES: usize = 16 << 20;

/// Why an archive could not be opened, or a sandbox moved to or from it.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("archive {location}: give an absolute directory, a file:// URL or an s3:// URL")]
    NotAbsolute { location: String },
    #[error("archive {location} is not a URL")]
    Url {
        location: String,
        #[source]
        source: url::ParseError,
    },
    #[error("no archive location is configured (serve --archive)")]
    NotConfigured,
    /// A runner said it archived a sandbox, and the archive holds nothing
    /// of it (the runner names another store under the same location?).
    #[error("the archive {location} holds no copy of {id} after its runner sent it")]
    NotThere { id: String, location: String },
    #[error("cannot {action} {}", path.display())]
    File {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The object store (a directory or an S3 service) refused.
    #[error("{action}")]
    Store {
        action: String,
        #[source]
        source: object_store::Error,
    },
}

/// Why a sandbox's storage did not move to or from the archive: the
/// runtime's side (writing or rebuilding it) or the store's.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Archive(#[from] ArchiveError),
}

impl ArchiveError {
    /// Whether the store said the object is not there.
    pub fn is_missing(&self) -> bool {
        matches!(
            self,
            ArchiveError::Store {
                source: object_store::Error::NotFound { .. },
                ..
            }
        )
    }
}

fn file(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ArchiveError {
    let path = path.to_owned();
    move |source| ArchiveError::File {
        action,
        path,
        source,
    }
}

fn store(action: String) -> impl FnOnce(object_store::Error) -> ArchiveError {
    move |source| ArchiveError::Store { action, source }
}

/// Where archived sandboxes go.
#[derive(Clone)]
pub struct Archive {
    store: Arc<dyn ObjectStore>,
    /// Scratch space for the file being moved (on the same host as the storage).
    scratch: PathBuf,
    /// The location, for messages.
    location: String,
}

impl std::fmt::Debug for Archive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Archive")
            .field("location", &self.location)
            .finish()
    }
}

impl Archive {
    /// Opens the archive at `location`: an absolute directory path (or a
    /// `file://` URL), or `s3://bucket[/prefix]`, configured from the usual
    /// `AWS_*` variables (`AWS_ENDPOINT`, `AWS_ALLOW_HTTP`, `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`).
    pub fn open(location: &str, scratch: PathBuf) -> Result<Archive, ArchiveError> {
        let open = || format!("open the archive {location}");
        let store: Arc<dyn ObjectStore> = if location.starts_with("s3://") {
            let store = AmazonS3Builder::from_env()
                .with_url(location)
                .build()
                .map_err(store(open()))?;
            Arc::new(prefixed(store, location)?)
        } else {
            let dir = location.strip_prefix("file://").unwrap_or(location);
            if !Path::new(dir).is_absolute() {
                return Err(ArchiveError::NotAbsolute {
                    location: location.to_owned(),
                });
            }
            std::fs::create_dir_all(dir).map_err(file("create the archive", Path::new(dir)))?;
            let store = LocalFileSystem::new_with_prefix(dir).map_err(store(open()))?;
            Arc::new(store)
        };
        std::fs::create_dir_all(&scratch).map_err(file("create the archive scratch", &scratch))?;
        Ok(Archive {
            store,
            scratch,
            location: location.to_owned(),
        })
    }

    pub fn location(&self) -> &str {
        &self.location
    }

    /// Whether other machines can reach this archive: an S3 location is,
    /// a directory is this machine's own. Sandboxes move between runners
    /// only through a shared one.
    pub fn is_shared(&self) -> bool {
        self.location.starts_with("s3://")
    }

    /// A scratch file for sandbox `id`.
    fn scratch_file(&self, id: &str) -> PathBuf {
        self.scratch.join(format!("{id}.storage"))
    }

    fn key(id: &str) -> ObjectPath {
        ObjectPath::from(format!("sandboxes/{id}/storage"))
    }

    /// Sends stopped sandbox `id`'s storage from `runtime` to the archive,
    /// through a scratch file removed after; how many bytes went.
    pub async fn send(&self, runtime: &dyn Runtime, id: &SandboxId) -> Result<u64, MoveError> {
        let file = self.scratch_file(id.as_str());
        let sent = async {
            runtime.export_storage(id, &file).await?;
            Ok(self.upload(id.as_str(), &file).await?)
        }
        .await;
        let _ = tokio::fs::remove_file(&file).await;
        sent
    }

    /// Rebuilds sandbox `spec`'s storage in `runtime` from the archive,
    /// through a scratch file removed after. The archive's copy stays.
    pub async fn fetch(&self, runtime: &dyn Runtime, spec: &SandboxSpec) -> Result<(), MoveError> {
        let file = self.scratch_file(spec.id.as_str());
        let fetched = async {
            self.download(spec.id.as_str(), &file).await?;
            Ok(runtime.import_storage(spec, &file).await?)
        }
        .await;
        let _ = tokio::fs::remove_file(&file).await;
        fetched
    }

    /// Uploads `file` as the archive of sandbox `id`, streamed in parts.
    async fn upload(&self, id: &str, path: &Path) -> Result<u64, ArchiveError> {
        let key = Self::key(id);
        let upload = self
            .store
            .put_multipart(&key)
            .await
            .map_err(store(format!("start the upload to {}", self.location)))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let mut source = tokio::fs::File::open(path)
            .await
            .map_err(file("open", path))?;
        let mut buffer = vec![0u8; PART_BYTES];
        let mut total = 0u64;
        loop {
            let read = match source.read(&mut buffer).await {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    writer.abort().await.ok();
                    return Err(file("read", path)(e));
                }
            };
            // Bounded memory: wait while too many parts are in flight.
            if let Err(e) = writer.wait_for_capacity(4).await {
                writer.abort().await.ok();
                return Err(store(format!("upload to {}", self.location))(e));
            }
            writer.write(&buffer[..read]);
            total += read as u64;
        }
        writer
            .finish()
            .await
            .map_err(store(format!("finish the upload to {}", self.location)))?;
        Ok(total)
    }

    /// Downloads the archive of sandbox `id` into `file`.
    async fn download(&self, id: &str, path: &Path) -> Result<(), ArchiveError> {
        let key = Self::key(id);
        let got = self.store.get(&key).await.map_err(store(format!(
            "get the archive of {id} in {}",
            self.location
        )))?;
        let mut out = tokio::fs::File::create(path)
            .await
            .map_err(file("create", path))?;
        let mut stream = got.into_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(store(format!("download from {}", self.location)))?;
            out.write_all(&chunk).await.map_err(file("write", path))?;
        }
        out.sync_all().await.map_err(file("write", path))?;
        Ok(())
    }

    /// Whether the archive holds a complete copy of sandbox `id` (an upload
    /// becomes visible only once it finished).
    pub async fn holds(&self, id: &str) -> Result<bool, ArchiveError> {
        match self.store.head(&Self::key(id)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(store(format!("look for the archive of {id}"))(e)),
        }
    }

    /// Deletes the archive of sandbox `id`, if there is one.
    pub(crate) async fn remove(&self, id: &str) -> Result<(), ArchiveError> {
        match self.store.delete(&Self::key(id)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(store(format!("delete the archive of {id}"))(e)),
        }
    }
}

/// An S3 store whose keys live under the URL's path, if it has one.
fn prefixed(
    store: object_store::aws::AmazonS3,
    location: &str,
) -> Result<object_store::prefix::PrefixStore<object_store::aws::AmazonS3>, ArchiveError> {
    let url = url::Url::parse(location).map_err(|source| ArchiveError::Url {
        location: location.to_owned(),
        source,
    })?;
    let prefix = url.path().trim_matches('/').to_owned();
    Ok(object_store::prefix::PrefixStore::new(store, prefix))
}
