//! The image directory of one server (`serve --images-dir`): the default
//! Debian root filesystem (`default_image.rs`), and the content-addressed
//! cache of pulled and imported images, and built images flattened for VMs.
//!
//! ```text
//! <dir>/debian-bookworm/rootfs/           the default image (debootstrap)
//! <dir>/oci/blobs/sha256/<hex>            downloaded blobs, verified, as the registry sent them
//! <dir>/oci/layers/sha256/<diff id>/      one unpacked layer: root/ and meta.json
//! <dir>/oci/images/sha256/<config hex>/   one image: rootfs/, config.json, image.json
//! <dir>/oci/manifests/sha256/<hex>        manifest digest -> image id, for pulls by digest
//! <dir>/oci/locks/                        flock files, one per blob, layer and image
//! <dir>/oci/built/<build key>/            a built image flattened for a VM (`flatten.rs`)
//! ```
//!
//! Every entry is built under its lock in a `.partial` sibling and renamed into
//! place, so a present entry is always complete, a crashed build is redone, and
//! two processes needing the same entry build it once (the second waits for the
//! lock, then finds it done). Images are keyed by the digest of their
//! configuration, which names the layers' content: the same image pulled from a
//! registry and imported from a tarball shares one root filesystem.

use std::fs;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::compression;
use crate::config::{self, ImageConfig};
use crate::digest::{Digest, HashingReader};
use crate::error::{io_err, ImageError, Result};
use crate::fsat;
use crate::layer::{self, LayerMeta};
use crate::progress::{Progress, Sink};
use crate::stack::{self, LayerDir};

/// A root filesystem ready to be a sandbox's read-only lower layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PulledImage {
    /// The image id: the digest of its configuration (`sha256:...`). It names
    /// the root filesystem in the cache; the same content has the same id
    /// whichever registry or tarball it came from.
    pub id: String,
    /// The digest of the platform manifest this call resolved, when there is
    /// one (registries and OCI layouts; not docker-save tarballs, nor
    /// [`ImageStore::image`]).
    pub manifest_digest: Option<String>,
    /// The unpacked root filesystem. Never write to it.
    pub rootfs: PathBuf,
    pub config: ImageConfig,
    /// Bytes of file content in the root filesystem.
    pub size_bytes: u64,
}

/// Kept beside a finished root filesystem.
#[derive(Serialize, Deserialize)]
struct ImageRecord {
    size_bytes: u64,
    layers: Vec<String>,
}

/// Where a layer's bytes come from when it must be unpacked.
pub(crate) struct LayerSource<'a> {
    /// The digest of the uncompressed tar (from the image configuration).
    pub diff_id: Digest,
    /// The digest of the blob as stored, when known (not in docker-save tarballs).
    pub blob_digest: Option<Digest>,
    pub open: Box<dyn FnOnce() -> Result<Box<dyn Read + 'a>> + 'a>,
}

/// The images of one server, in one directory. The directory must be on
/// one filesystem (root filesystems are hard links into the layer cache).
#[derive(Clone, Debug)]
pub struct ImageStore {
    pub(crate) dir: PathBuf,
    pub(crate) http_registries: Vec<String>,
}

/// Where pulled and imported images are cached, under the image directory.
const CACHE_DIR: &str = "oci";

impl ImageStore {
    pub fn new(dir: impl Into<PathBuf>) -> ImageStore {
        ImageStore {
            dir: dir.into(),
            http_registries: Vec::new(),
        }
    }

    /// Registries (`host` or `host:port`) to reach over plain HTTP. Loopback
    /// registries (`localhost`, `127.0.0.0/8`, `[::1]`) always are.
    pub fn with_http_registries<S: Into<String>>(
        mut self,
        registries: impl IntoIterator<Item = S>,
    ) -> Self {
        self.http_registries = registries.into_iter().map(Into::into).collect();
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cache of pulled, imported and flattened images.
    pub(crate) fn cache_dir(&self) -> PathBuf {
        self.dir.join(CACHE_DIR)
    }

    /// An image already in the cache, by id (`sha256:...`).
    pub fn image(&self, id: &str) -> Result<Option<PulledImage>> {
        let Some(digest) = Digest::parse(id) else {
            return Err(ImageError::BadReference {
                reference: id.to_owned(),
                reason: "an image id is sha256:<64 hex digits>".into(),
            });
        };
        self.cached_image(&digest, None)
    }

    pub(crate) fn cached_image(
        &self,
        id: &Digest,
        manifest_digest: Option<&Digest>,
    ) -> Result<Option<PulledImage>> {
        let dir = self.image_dir(id);
        let record_path = dir.join("image.json");
        let record = match fs::read(&record_path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&record_path, "read")(e)),
        };
        let record: ImageRecord = serde_json::from_slice(&record).map_err(|e| {
            io_err(&record_path, "parse")(io::Error::new(io::ErrorKind::InvalidData, e))
        })?;
        let config_path = dir.join("config.json");
        let config_bytes = fs::read(&config_path).map_err(io_err(&config_path, "read"))?;
        let parsed = config::parse(&id.to_string(), &config_bytes)?;
        Ok(Some(PulledImage {
            id: id.to_string(),
            manifest_digest: manifest_digest.map(ToString::to_string),
            rootfs: dir.join("rootfs"),
            config: parsed.config,
            size_bytes: record.size_bytes,
        }))
    }

    pub(crate) fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.cache_dir().join("blobs/sha256").join(digest.hex())
    }

    fn layer_dir(&self, diff_id: &Digest) -> PathBuf {
        self.cache_dir().join("layers/sha256").join(diff_id.hex())
    }

    pub(crate) fn layer_ready(&self, diff_id: &Digest) -> bool {
        self.layer_dir(diff_id).join("meta.json").exists()
    }

    fn image_dir(&self, id: &Digest) -> PathBuf {
        self.cache_dir().join("images/sha256").join(id.hex())
    }

    fn manifest_link(&self, manifest: &Digest) -> PathBuf {
        self.cache_dir()
            .join("manifests/sha256")
            .join(manifest.hex())
    }

    /// Creates `<dir>/oci/<sub>` and returns it.
    pub(crate) fn subdir(&self, sub: &str) -> Result<PathBuf> {
        let path = self.cache_dir().join(sub);
        fs::create_dir_all(&path).map_err(io_err(&path, "create cache directory"))?;
        Ok(path)
    }

    /// Takes the lock of one cache entry; held until the file is dropped. Blocking.
    pub(crate) fn lock(&self, kind: &str, digest: &Digest) -> Result<fs::File> {
        let path = self
            .subdir("locks")?
            .join(format!("{kind}-{}.lock", digest.hex()));
        fsat::lock_file(&path).map_err(io_err(&path, "lock"))
    }

    /// The image a manifest digest was last resolved to, if it is still cached.
    pub(crate) fn image_for_manifest(&self, manifest: &Digest) -> Result<Option<PulledImage>> {
        let link = self.manifest_link(manifest);
        let id = match fs::read_to_string(&link) {
            Ok(id) => id,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&link, "read")(e)),
        };
        match Digest::parse(id.trim()) {
            Some(id) => self.cached_image(&id, Some(manifest)),
            None => Ok(None),
        }
    }

    pub(crate) fn remember_manifest(&self, manifest: &Digest, id: &Digest) -> Result<()> {
        let dir = self.subdir("manifests/sha256")?;
        let tmp = dir.join(format!("{}.{}.tmp", manifest.hex(), std::process::id()));
        fs::write(&tmp, id.to_string()).map_err(io_err(&tmp, "write"))?;
        let link = self.manifest_link(manifest);
        fs::rename(&tmp, &link).map_err(io_err(&link, "write"))
    }

    /// Unpacks (once) every layer, then assembles (once) the root filesystem of
    /// the image whose configuration is `config_bytes`. Blocking.
    pub(crate) fn build(
        &self,
        reference: &str,
        config_bytes: &[u8],
        manifest_digest: Option<&Digest>,
        layers: Vec<LayerSource<'_>>,
        progress: &Sink,
    ) -> Result<PulledImage> {
        let id = Digest::of_bytes(config_bytes);
        let parsed = config::parse(reference, config_bytes)?;
        if parsed.diff_ids != layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>() {
            return Err(ImageError::invalid(
                reference,
                "the layers do not match the configuration's diff_ids",
            ));
        }
        if let Some(image) = self.cached_image(&id, manifest_digest)? {
            progress(&Progress::Done {
                id: image.id.clone(),
                size_bytes: image.size_bytes,
                cached: true,
            });
            return Ok(image);
        }
        let count = layers.len();
        let mut metas = Vec::with_capacity(count);
        for (index, source) in layers.into_iter().enumerate() {
            let diff_id = source.diff_id.clone();
            metas.push((
                diff_id,
                self.ensure_layer(reference, source, index + 1, count, progress)?,
            ));
        }
        let image = self.assemble(
            reference,
            &id,
            config_bytes,
            &metas,
            manifest_digest,
            progress,
        )?;
        progress(&Progress::Done {
            id: image.id.clone(),
            size_bytes: image.size_bytes,
            cached: false,
        });
        Ok(image)
    }

    fn ensure_layer(
        &self,
        reference: &str,
        source: LayerSource<'_>,
        index: usize,
        count: usize,
        progress: &Sink,
    ) -> Result<LayerMeta> {
        let dir = self.layer_dir(&source.diff_id);
        if !self.layer_ready(&source.diff_id) {
            self.subdir("layers/sha256")?;
            let _lock = self.lock("layer", &source.diff_id)?;
            if !self.layer_ready(&source.diff_id) {
                progress(&Progress::Unpacking {
                    layer: index,
                    layers: count,
                    digest: source.diff_id.to_string(),
                });
                let partial = dir.with_extension("partial");
                fsat::remove_tree(&partial)
                    .map_err(io_err(&partial, "remove an unfinished layer"))?;
                let built = self.unpack_layer(reference, source, &partial);
                if built.is_err() {
                    // Best effort: a failed unpack is redone from scratch anyway.
                    let _ = fsat::remove_tree(&partial);
                }
                built?;
                fs::rename(&partial, &dir)
                    .map_err(io_err(&dir, "move the unpacked layer in place"))?;
            }
        }
        let meta_path = dir.join("meta.json");
        let bytes = fs::read(&meta_path).map_err(io_err(&meta_path, "read"))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| io_err(&meta_path, "parse")(io::Error::new(io::ErrorKind::InvalidData, e)))
    }

    fn unpack_layer(&self, reference: &str, source: LayerSource<'_>, partial: &Path) -> Result<()> {
        let root = partial.join("root");
        fs::create_dir_all(&root).map_err(io_err(&root, "create"))?;
        let name = source.diff_id.to_string();
        let corrupt = |e: io::Error| {
            ImageError::invalid(reference, format!("layer {name} is unreadable: {e}"))
        };
        let mut raw = HashingReader::new((source.open)()?);
        let (meta, diff_id) = {
            let mut buffered = BufReader::with_capacity(1 << 20, &mut raw);
            let decoded = compression::decoder(&mut buffered).map_err(corrupt)?;
            let (meta, plain) = layer::unpack(HashingReader::new(decoded), &root, &name)?;
            let (diff_id, _) = plain.finish().map_err(corrupt)?;
            // The blob digest covers any bytes after the compressed stream too.
            io::copy(&mut buffered, &mut io::sink()).map_err(corrupt)?;
            (meta, diff_id)
        };
        let (blob_digest, _) = raw.finish().map_err(corrupt)?;
        if let Some(expected) = &source.blob_digest {
            if *expected != blob_digest {
                return Err(ImageError::invalid(
                    reference,
                    format!("layer blob {expected} has digest {blob_digest}"),
                ));
            }
        }
        if diff_id != source.diff_id {
            return Err(ImageError::invalid(
                reference,
                format!(
                    "layer {} unpacks to content with digest {diff_id}",
                    source.diff_id
                ),
            ));
        }
        let meta_path = partial.join("meta.json");
        let json = serde_json::to_vec(&meta)
            .map_err(|e| io_err(&meta_path, "encode")(io::Error::other(e)))?;
        fs::write(&meta_path, json).map_err(io_err(&meta_path, "write"))
    }

    fn assemble(
        &self,
        reference: &str,
        id: &Digest,
        config_bytes: &[u8],
        layers: &[(Digest, LayerMeta)],
        manifest_digest: Option<&Digest>,
        progress: &Sink,
    ) -> Result<PulledImage> {
        self.subdir("images/sha256")?;
        let _lock = self.lock("image", id)?;
        if let Some(image) = self.cached_image(id, manifest_digest)? {
            return Ok(image);
        }
        progress(&Progress::Assembling {
            layers: layers.len(),
        });
        let dir = self.image_dir(id);
        let partial = dir.with_extension("partial");
        fsat::remove_tree(&partial).map_err(io_err(&partial, "remove an unfinished image"))?;
        let built = self.assemble_into(reference, &partial, config_bytes, layers);
        if built.is_err() {
            let _ = fsat::remove_tree(&partial);
        }
        built?;
        fs::rename(&partial, &dir).map_err(io_err(&dir, "move the assembled image in place"))?;
        self.cached_image(id, manifest_digest)?
            .ok_or_else(|| ImageError::invalid(reference, "the assembled image vanished"))
    }

    fn assemble_into(
        &self,
        reference: &str,
        partial: &Path,
        config_bytes: &[u8],
        layers: &[(Digest, LayerMeta)],
    ) -> Result<()> {
        let rootfs = partial.join("rootfs");
        fs::create_dir_all(&rootfs).map_err(io_err(&rootfs, "create"))?;
        let dirs: Vec<LayerDir<'_>> = layers
            .iter()
            .map(|(diff_id, meta)| LayerDir {
                root: self.layer_dir(diff_id).join("root"),
                meta,
                name: diff_id.to_string(),
            })
            .collect();
        stack::stack(&dirs, &rootfs)?;
        let skipped: u64 = layers.iter().map(|(_, m)| m.skipped_devices).sum();
        if skipped > 0 {
            tracing::info!(
                reference,
                skipped,
                "device nodes in the image were left out"
            );
        }
        let record = ImageRecord {
            size_bytes: stack::content_size(&rootfs)?,
            layers: layers.iter().map(|(d, _)| d.to_string()).collect(),
        };
        let config_path = partial.join("config.json");
        fs::write(&config_path, config_bytes).map_err(io_err(&config_path, "write"))?;
        let record_path = partial.join("image.json");
        let json = serde_json::to_vec(&record)
            .map_err(|e| io_err(&record_path, "encode")(io::Error::other(e)))?;
        fs::write(&record_path, json).map_err(io_err(&record_path, "write"))
    }
}
