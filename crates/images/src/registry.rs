//! Pulling from a registry with `oci-client`: references, credentials, the
//! platform choice in multi-arch indexes, verified downloads into the blob cache.
//!
//! A registry is not trusted to send what it declared: a layer or
//! configuration download stops at the size its descriptor gives (a
//! configuration, parsed in memory, also at `MAX_CONFIG_BYTES`), so a
//! hostile registry cannot fill the cache's disk or the server's memory.
//! Manifests are read whole by `oci-client`, which has no cap of its own.
//!
//! Registries on loopback are spoken to over plain HTTP (tests run one); every
//! other registry over HTTPS unless the store lists it as an HTTP registry.

use std::fmt;
use std::io::BufReader;
use std::sync::Arc;

use futures_util::{StreamExt, TryStreamExt};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{DigestError, OciDistributionError, OciErrorCode};
use oci_client::manifest::{ImageIndexEntry, OciDescriptor, OciImageManifest, OciManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use tokio::io::AsyncWriteExt;

use crate::digest::{Digest, StreamHasher};
use crate::error::{io_err, ImageError, Result};
use crate::media;
use crate::progress::{Progress, Sink};
use crate::store::{ImageStore, LayerSource, PulledImage};

/// How many layers download at once.
const PARALLEL_DOWNLOADS: usize = 3;
/// Download progress is reported at most once per this many bytes.
const PROGRESS_STEP: u64 = 1 << 20;
/// Largest image configuration read: it is parsed in memory. Real ones are
/// a few KiB (a long history makes tens).
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// A username and password (or token) for one registry's basic authentication.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// The host (`host[:port]`, lower-case) a registry URL or image reference
/// names; Docker Hub's several names are all `docker.io`.
pub fn registry_host(url: &str) -> Result<String> {
    let rest = url
        .trim()
        .strip_prefix("https://")
        .or_else(|| url.trim().strip_prefix("http://"))
        .unwrap_or(url.trim());
    let host = rest
        .split('/')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    let valid = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'));
    if !valid {
        return Err(ImageError::NoRegistryHost {
            url: url.to_owned(),
        });
    }
    Ok(match host.as_str() {
        "index.docker.io"
        | "registry-1.docker.io"
        | "registry.hub.docker.com"
        | "hub.docker.com" => "docker.io".into(),
        _ => host,
    })
}

/// Parses a reference with Docker's defaults (`python:3.12-slim` is
/// `docker.io/library/python:3.12-slim`, tag `latest` when none is given) and
/// returns its full form.
pub fn normalize_reference(reference: &str) -> Result<String> {
    Ok(parse_reference(reference)?.whole())
}

fn parse_reference(reference: &str) -> Result<Reference> {
    reference
        .parse()
        .map_err(|e: oci_client::ParseError| ImageError::BadReference {
            reference: reference.to_owned(),
            reason: e.to_string(),
        })
}

/// Whether a registry host (`host` or `host:port`) is on this machine.
fn is_loopback(registry: &str) -> bool {
    let host = if let Some(rest) = registry.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else {
        registry.rsplit_once(':').map_or(registry, |(host, _)| host)
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl ImageStore {
    /// Pulls `reference` (Docker Hub by default) as linux/amd64 and returns its
    /// root filesystem, downloading and unpacking only what the cache lacks.
    /// A reference by digest that was pulled before needs no network.
    pub async fn pull(
        &self,
        reference: &str,
        credentials: Option<&Credentials>,
        progress: impl Fn(&Progress) + Send + Sync + 'static,
    ) -> Result<PulledImage> {
        let progress: Sink = Arc::new(progress);
        let parsed = parse_reference(reference)?;
        let label = parsed.whole();
        progress(&Progress::Resolving {
            reference: label.clone(),
        });

        if let Some(digest) = parsed.digest().and_then(Digest::parse) {
            if let Some(image) = self.image_for_manifest(&digest)? {
                progress(&Progress::Done {
                    id: image.id.clone(),
                    size_bytes: image.size_bytes,
                    cached: true,
                });
                return Ok(image);
            }
        }

        let registry = parsed.resolve_registry().to_owned();
        let http = is_loopback(&registry) || self.http_registries.contains(&registry);
        // Credentials are stored per client by oci-client, so each pull gets its
        // own client: one caller's credentials never serve another's pull.
        install_tls_provider();
        let client = Client::new(ClientConfig {
            protocol: if http {
                ClientProtocol::HttpsExcept(vec![registry.clone()])
            } else {
                ClientProtocol::Https
            },
            ..Default::default()
        });
        let auth = match credentials {
            Some(c) => RegistryAuth::Basic(c.username.clone(), c.password.clone()),
            None => RegistryAuth::Anonymous,
        };
        let puller = Puller {
            client,
            auth,
            reference: parsed,
            label,
            registry,
        };
        let (manifest, manifest_digest, index_digest) = puller.resolve().await?;
        media::check_config(&puller.label, &manifest.config.media_type)?;
        let config_bytes = puller.config(&manifest).await?;
        let parsed_config = crate::config::parse(&puller.label, &config_bytes)?;
        if parsed_config.diff_ids.len() != manifest.layers.len() {
            return Err(ImageError::invalid(
                &puller.label,
                format!(
                    "the manifest lists {} layers, the configuration {}",
                    manifest.layers.len(),
                    parsed_config.diff_ids.len()
                ),
            ));
        }
        let mut layers = Vec::with_capacity(manifest.layers.len());
        for (descriptor, diff_id) in manifest.layers.iter().zip(&parsed_config.diff_ids) {
            media::check_layer(&puller.label, &descriptor.media_type)?;
            let digest = Digest::parse(&descriptor.digest).ok_or_else(|| {
                ImageError::unsupported(
                    &puller.label,
                    format!("layer digest {} is not sha256", descriptor.digest),
                )
            })?;
            layers.push((descriptor, digest, diff_id.clone()));
        }
        progress(&Progress::Resolved {
            manifest_digest: Some(manifest_digest.to_string()),
            layers: layers.len(),
            total_bytes: layers.iter().map(|(d, _, _)| d.size.max(0) as u64).sum(),
        });

        let id = Digest::of_bytes(&config_bytes);
        let image = match self.cached_image(&id, Some(&manifest_digest))? {
            Some(image) => {
                progress(&Progress::Done {
                    id: image.id.clone(),
                    size_bytes: image.size_bytes,
                    cached: true,
                });
                image
            }
            None => {
                let count = layers.len();
                // The futures are made in a loop, not in a `map` closure over
                // borrowed items: that closure's lifetimes would make the
                // whole pull future non-`Send` (rust-lang/rust#102211).
                let mut downloads = Vec::with_capacity(count);
                for (index, (descriptor, digest, diff_id)) in layers.iter().enumerate() {
                    let progress = progress.clone();
                    let puller = &puller;
                    downloads.push(async move {
                        if self.layer_ready(diff_id) || self.blob_path(digest).exists() {
                            progress(&Progress::LayerCached {
                                layer: index + 1,
                                layers: count,
                                digest: digest.to_string(),
                            });
                            return Ok(());
                        }
                        puller
                            .download(self, descriptor, digest, index + 1, count, &progress)
                            .await
                    });
                }
                futures_util::stream::iter(downloads)
                    .buffer_unordered(PARALLEL_DOWNLOADS)
                    .try_collect::<Vec<()>>()
                    .await?;
                let store = self.clone();
                let label = puller.label.clone();
                let plan: Vec<(Digest, Digest)> = layers
                    .iter()
                    .map(|(_, d, diff)| (d.clone(), diff.clone()))
                    .collect();
                let manifest_digest = manifest_digest.clone();
                let progress = progress.clone();
                tokio::task::spawn_blocking(move || {
                    let sources = plan
                        .into_iter()
                        .map(|(blob, diff_id)| {
                            let path = store.blob_path(&blob);
                            LayerSource {
                                diff_id,
                                blob_digest: Some(blob),
                                open: Box::new(move || {
                                    let file = std::fs::File::open(&path)
                                        .map_err(io_err(&path, "open layer blob"))?;
                                    Ok(Box::new(BufReader::new(file)) as Box<dyn std::io::Read>)
                                }),
                            }
                        })
                        .collect();
                    store.build(
                        &label,
                        &config_bytes,
                        Some(&manifest_digest),
                        sources,
                        &progress,
                    )
                })
                .await
                .map_err(|e| {
                    ImageError::invalid(&puller.label, format!("unpacking stopped: {e}"))
                })??
            }
        };
        let id = Digest::parse(&image.id).expect("ids are digests");
        self.remember_manifest(&manifest_digest, &id)?;
        if let Some(index) = index_digest {
            // A later pull by the index digest finds the image too.
            self.remember_manifest(&index, &id)?;
        }
        Ok(image)
    }
}

/// Installs rustls's ring provider as the process default, which reqwest
/// needs because it is built without a provider of its own. Harmless when a
/// provider is already installed.
pub(crate) fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

struct Puller {
    client: Client,
    auth: RegistryAuth,
    reference: Reference,
    label: String,
    registry: String,
}

impl Puller {
    /// The linux/amd64 image manifest, its digest, and the digest of the index
    /// it was chosen from, if the reference named an index.
    async fn resolve(&self) -> Result<(OciImageManifest, Digest, Option<Digest>)> {
        let (manifest, digest) = self
            .client
            .pull_manifest(&self.reference, &self.auth)
            .await
            .map_err(|e| self.error(e))?;
        let digest = self.digest(&digest)?;
        let index = match manifest {
            OciManifest::Image(manifest) => return Ok((manifest, digest, None)),
            OciManifest::ImageIndex(index) => index,
        };
        let chosen = choose_platform(&index.manifests).ok_or_else(|| {
            let offered: Vec<String> = index
                .manifests
                .iter()
                .filter_map(|m| m.platform.as_ref())
                .map(|p| format!("{}/{}", p.os, p.architecture))
                .filter(|p| p != "unknown/unknown")
                .collect();
            ImageError::unsupported(
                &self.label,
                format!(
                    "it has no linux/amd64 variant (it offers: {})",
                    offered.join(", ")
                ),
            )
        })?;
        let platform_ref = self.reference.clone_with_digest(chosen.digest.clone());
        let (manifest, platform_digest) = self
            .client
            .pull_manifest(&platform_ref, &self.auth)
            .await
            .map_err(|e| self.error(e))?;
        match manifest {
            OciManifest::Image(manifest) => {
                Ok((manifest, self.digest(&platform_digest)?, Some(digest)))
            }
            OciManifest::ImageIndex(_) => Err(ImageError::unsupported(
                &self.label,
                "its linux/amd64 entry is another index (nested indexes are not followed)",
            )),
        }
    }

    fn digest(&self, text: &str) -> Result<Digest> {
        Digest::parse(text).ok_or_else(|| {
            ImageError::unsupported(&self.label, format!("manifest digest {text} is not sha256"))
        })
    }

    async fn config(&self, manifest: &OciImageManifest) -> Result<Vec<u8>> {
        let expected = Digest::parse(&manifest.config.digest).ok_or_else(|| {
            ImageError::unsupported(
                &self.label,
                format!("config digest {} is not sha256", manifest.config.digest),
            )
        })?;
        let limit = self.declared_size(&manifest.config, "configuration", &expected)?;
        if limit > MAX_CONFIG_BYTES {
            return Err(ImageError::invalid(
                &self.label,
                format!(
                    "its configuration {expected} declares {limit} bytes, more than the \
                     {MAX_CONFIG_BYTES} cove reads into memory"
                ),
            ));
        }
        let mut stream = self
            .client
            .pull_blob_stream(&self.reference, &manifest.config)
            .await
            .map_err(|e| self.error(e))?;
        let mut bytes = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.stream_error(&expected, e))?;
            if bytes.len() as u64 + chunk.len() as u64 > limit {
                return Err(self.oversized("configuration", &expected, limit));
            }
            bytes.extend_from_slice(&chunk);
        }
        if Digest::of_bytes(&bytes) != expected {
            return Err(ImageError::invalid(
                &self.label,
                "the configuration does not match its digest",
            ));
        }
        Ok(bytes)
    }

    /// The size a descriptor declares: the most a download of it may bring.
    fn declared_size(
        &self,
        descriptor: &OciDescriptor,
        what: &str,
        digest: &Digest,
    ) -> Result<u64> {
        u64::try_from(descriptor.size).map_err(|_| {
            ImageError::invalid(
                &self.label,
                format!(
                    "its {what} {digest} declares a negative size ({})",
                    descriptor.size
                ),
            )
        })
    }

    /// A blob whose registry sent more than its descriptor declared: a
    /// broken or hostile registry, stopped before it fills memory or disk.
    fn oversized(&self, what: &str, digest: &Digest, expected: u64) -> ImageError {
        ImageError::invalid(
            &self.label,
            format!(
                "registry {} sent more than the {expected} bytes the descriptor of {what} \
                 {digest} declares; the download was stopped",
                self.registry
            ),
        )
    }

    /// Downloads one blob into the cache: under its lock, into a `.partial`
    /// file, checked against its digest and size, then renamed into place.
    async fn download(
        &self,
        store: &ImageStore,
        descriptor: &OciDescriptor,
        digest: &Digest,
        layer: usize,
        layers: usize,
        progress: &Sink,
    ) -> Result<()> {
        let dir = store.subdir("blobs/sha256")?;
        let lock = {
            let store = store.clone();
            let digest = digest.clone();
            tokio::task::spawn_blocking(move || store.lock("blob", &digest))
                .await
                .map_err(|e| ImageError::invalid(&self.label, format!("locking stopped: {e}")))??
        };
        let path = store.blob_path(digest);
        if path.exists() {
            return Ok(());
        }
        let partial = dir.join(format!("{}.partial", digest.hex()));
        let fetched = self
            .fetch(&partial, descriptor, digest, layer, layers, progress)
            .await;
        if fetched.is_err() {
            // Best effort; the next attempt truncates it anyway.
            let _ = tokio::fs::remove_file(&partial).await;
        }
        fetched?;
        tokio::fs::rename(&partial, &path)
            .await
            .map_err(io_err(&path, "move the downloaded blob in place"))?;
        drop(lock);
        Ok(())
    }

    /// Streams one blob into `partial`, reporting progress, and checks it.
    async fn fetch(
        &self,
        partial: &std::path::Path,
        descriptor: &OciDescriptor,
        digest: &Digest,
        layer: usize,
        layers: usize,
        progress: &Sink,
    ) -> Result<()> {
        let mut stream = self
            .client
            .pull_blob_stream(&self.reference, descriptor)
            .await
            .map_err(|e| self.error(e))?;
        let total = self.declared_size(descriptor, "layer", digest)?;
        let mut file = tokio::fs::File::create(partial)
            .await
            .map_err(io_err(partial, "create"))?;
        let mut hasher = StreamHasher::new();
        let mut downloaded = 0u64;
        let mut reported = 0u64;
        let report = |downloaded| {
            progress(&Progress::Downloading {
                layer,
                layers,
                digest: digest.to_string(),
                downloaded,
                total,
            })
        };
        report(0);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.stream_error(digest, e))?;
            if downloaded + chunk.len() as u64 > total {
                return Err(self.oversized("layer", digest, total));
            }
            hasher.update(&chunk);
            file.write_all(&chunk)
                .await
                .map_err(io_err(partial, "write"))?;
            downloaded += chunk.len() as u64;
            if downloaded - reported >= PROGRESS_STEP {
                reported = downloaded;
                report(downloaded);
            }
        }
        if reported != downloaded || downloaded == 0 {
            report(downloaded);
        }
        // On disk before the rename: a blob in place must be whole after a crash.
        file.sync_all().await.map_err(io_err(partial, "sync"))?;
        let actual = hasher.finish();
        if actual != *digest || downloaded != total {
            return Err(ImageError::invalid(
                &self.label,
                format!("layer {digest} arrived as {downloaded} bytes with digest {actual}"),
            ));
        }
        Ok(())
    }

    fn stream_error(&self, digest: &Digest, e: std::io::Error) -> ImageError {
        if e.get_ref().is_some_and(|inner| inner.is::<DigestError>()) {
            ImageError::invalid(&self.label, format!("layer {digest}: {e}"))
        } else {
            ImageError::Unreachable {
                registry: self.registry.clone(),
                detail: format!("download of layer {digest} broke off: {e}"),
            }
        }
    }

    /// Sorts an `oci-client` error into the crate's classes.
    fn error(&self, e: OciDistributionError) -> ImageError {
        let not_found = |detail: String| ImageError::NotFound {
            reference: self.label.clone(),
            detail,
        };
        let unauthorized = |detail: String| ImageError::Unauthorized {
            registry: self.registry.clone(),
            reference: self.label.clone(),
            detail,
        };
        let unreachable = |detail: String| ImageError::Unreachable {
            registry: self.registry.clone(),
            detail,
        };
        match e {
            OciDistributionError::RegistryError { envelope, .. } => {
                let message = envelope
                    .errors
                    .iter()
                    .map(|e| format!("{:?}: {}", e.code, e.message))
                    .collect::<Vec<_>>()
                    .join("; ");
                let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|e| &e.code).collect();
                if codes.iter().any(|c| {
                    matches!(
                        c,
                        OciErrorCode::ManifestUnknown
                            | OciErrorCode::NameUnknown
                            | OciErrorCode::NotFound
                            | OciErrorCode::BlobUnknown
                    )
                }) {
                    not_found(message)
                } else if codes
                    .iter()
                    .any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied))
                {
                    // Docker Hub answers so for repositories that do not exist, too.
                    unauthorized(format!(
                        "{message} (the repository may not exist, or needs credentials)"
                    ))
                } else if codes.iter().any(|c| matches!(c, OciErrorCode::Unsupported)) {
                    ImageError::unsupported(&self.label, message)
                } else {
                    unreachable(message)
                }
            }
            OciDistributionError::UnauthorizedError { url } => unauthorized(format!(
                "{url} answered 401 (the repository may not exist, or needs credentials)"
            )),
            OciDistributionError::AuthenticationFailure(detail) => unauthorized(detail),
            OciDistributionError::ImageManifestNotFoundError(detail) => not_found(detail),
            OciDistributionError::ServerError { code, url, message } => match code {
                404 => not_found(format!("{url}: {message}")),
                401 | 403 => unauthorized(format!("{url} answered {code}: {message}")),
                _ => unreachable(format!("{url} answered {code}: {message}")),
            },
            OciDistributionError::RequestError(e) => unreachable(error_chain(&e)),
            OciDistributionError::DigestError(e) => ImageError::invalid(&self.label, e.to_string()),
            OciDistributionError::UnsupportedMediaTypeError(media_type) => {
                ImageError::unsupported(&self.label, format!("unknown manifest type {media_type}"))
            }
            OciDistributionError::UnsupportedSchemaVersionError(version) => {
                ImageError::unsupported(&self.label, format!("manifest schema version {version}"))
            }
            OciDistributionError::ManifestParsingError(detail)
            | OciDistributionError::VersionedParsingError(detail)
            | OciDistributionError::SpecViolationError(detail) => {
                ImageError::invalid(&self.label, detail)
            }
            other => unreachable(other.to_string()),
        }
    }
}

/// The first linux/amd64 image manifest of an index. Variants are ignored:
/// amd64 images do not use them (v2/v3 levels would all run here anyway).
fn choose_platform(entries: &[ImageIndexEntry]) -> Option<&ImageIndexEntry> {
    entries.iter().find(|entry| {
        let is_manifest = media::MANIFEST_TYPES.contains(&entry.media_type.as_str());
        is_manifest
            && entry.platform.as_ref().is_some_and(|p| {
                p.os.to_string() == "linux" && p.architecture.to_string() == "amd64"
            })
    })
}

/// An error and its causes on one line: reqwest hides the useful part
/// ("connection refused") in its sources.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_hosts_are_compared_without_scheme_path_or_case() {
        assert_eq!(registry_host("127.0.0.1:5000").unwrap(), "127.0.0.1:5000");
        assert_eq!(
            registry_host("https://Registry.Example.com/v2/").unwrap(),
            "registry.example.com"
        );
        assert_eq!(
            registry_host("https://registry.hub.docker.com").unwrap(),
            "docker.io"
        );
        assert_eq!(registry_host("docker.io").unwrap(), "docker.io");
        assert!(registry_host("").is_err());
        assert!(registry_host("not a host").is_err());
    }

    #[test]
    fn docker_hub_defaults() {
        assert_eq!(
            normalize_reference("python:3.12-slim").unwrap(),
            "docker.io/library/python:3.12-slim"
        );
        assert_eq!(
            normalize_reference("ubuntu").unwrap(),
            "docker.io/library/ubuntu:latest"
        );
        assert_eq!(
            normalize_reference("127.0.0.1:5000/team/app:v1").unwrap(),
            "127.0.0.1:5000/team/app:v1"
        );
        let err = normalize_reference("Bad Reference!").unwrap_err();
        assert_eq!(err.http_status(), 400);
    }

    #[test]
    fn docker_hub_is_reached_at_its_api_host() {
        let parsed = parse_reference("python:3.12-slim").unwrap();
        assert_eq!(parsed.resolve_registry(), "index.docker.io");
        assert_eq!(parsed.repository(), "library/python");
    }

    /// The engine spawns pulls on tokio tasks: the future must be `Send`.
    #[test]
    fn pull_future_is_send() {
        fn assert_send<T: Send>(_: &T) {}
        let store = ImageStore::new("/nonexistent");
        let future = store.pull("x", None, |_| {});
        assert_send(&future);
    }

    #[test]
    fn loopback_registries() {
        for host in [
            "localhost:5000",
            "127.0.0.1:5000",
            "127.1.2.3",
            "[::1]:5000",
            "localhost",
        ] {
            assert!(is_loopback(host), "{host}");
        }
        for host in [
            "registry-1.docker.io",
            "10.0.0.1:5000",
            "ghcr.io",
            "localhost.example.com",
        ] {
            assert!(!is_loopback(host), "{host}");
        }
    }
}
