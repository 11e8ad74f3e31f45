//! Which media types this crate accepts as layers of a container image.

use crate::error::{ImageError, Result};

const LAYER_TYPES: &[&str] = &[
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar.zstd",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
];

pub(crate) const CONFIG_TYPES: &[&str] = &[
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
];

pub(crate) const MANIFEST_TYPES: &[&str] = &[
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];

pub(crate) const INDEX_TYPES: &[&str] = &[
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// Refuses blobs that are not filesystem layers (artifacts such as Helm
/// charts or WebAssembly modules use the same manifests).
pub(crate) fn check_layer(reference: &str, media_type: &str) -> Result<()> {
    if LAYER_TYPES.contains(&media_type) {
        Ok(())
    } else {
        Err(ImageError::unsupported(
            reference,
            format!("layer type {media_type} is not a filesystem layer"),
        ))
    }
}

pub(crate) fn check_config(reference: &str, media_type: &str) -> Result<()> {
    if CONFIG_TYPES.contains(&media_type) {
        Ok(())
    } else {
        Err(ImageError::unsupported(
            reference,
            format!("it is not a container image (config type {media_type})"),
        ))
    }
}
