//! The one error type of the crate, and the classes a front end maps to HTTP.
//!
//! `fuzz/fuzz_targets/tar_unpack.rs` compiles `layer.rs`, `fsat.rs` and
//! `error.rs` on their own (`#[path]`): they use nothing else of this crate.

use std::path::PathBuf;

/// What kind of failure an [`ImageError`] is, for a front end to choose a status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The reference does not parse (HTTP 400).
    BadReference,
    /// The registry has no such repository, tag or digest, or the import source
    /// holds no such image (HTTP 404).
    NotFound,
    /// The registry refused the credentials, or wants some (HTTP 401).
    Unauthorized,
    /// The registry could not be reached or failed on its side (HTTP 502).
    Unreachable,
    /// The image exists but cove cannot run it: no linux/amd64 variant, not a
    /// container image, an unknown layer format (HTTP 400).
    Unsupported,
    /// The image is broken or hostile: digest mismatch, corrupt layer, a path
    /// that leaves the root filesystem (HTTP 422).
    InvalidImage,
    /// A local filesystem operation failed (HTTP 500).
    Io,
}

impl ErrorKind {
    /// The HTTP status an API should answer with.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorKind::BadReference | ErrorKind::Unsupported => 400,
            ErrorKind::Unauthorized => 401,
            ErrorKind::NotFound => 404,
            ErrorKind::InvalidImage => 422,
            ErrorKind::Io => 500,
            ErrorKind::Unreachable => 502,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// HTTP 400.
    #[error("bad image reference {reference:?}: {reason}")]
    BadReference { reference: String, reason: String },
    /// HTTP 400: a registry URL that names no host.
    #[error("{url:?} names no registry host; give host[:port], e.g. registry.example.com or 127.0.0.1:5000")]
    NoRegistryHost { url: String },
    /// HTTP 404.
    #[error("image {reference} not found: {detail}")]
    NotFound { reference: String, detail: String },
    /// HTTP 401.
    #[error("registry {registry} refused access to {reference}: {detail}")]
    Unauthorized {
        registry: String,
        reference: String,
        detail: String,
    },
    /// HTTP 502.
    #[error("registry {registry} is unreachable or failed: {detail}")]
    Unreachable { registry: String, detail: String },
    /// HTTP 400.
    #[error("image {reference} is not supported: {reason}")]
    Unsupported { reference: String, reason: String },
    /// HTTP 422.
    #[error("image {reference} is invalid: {reason}")]
    InvalidImage { reference: String, reason: String },
    /// HTTP 422: a layer entry that would leave the root filesystem or go through
    /// a symbolic link. Nothing of it was written outside the layer directory.
    #[error("layer {layer} has an unsafe entry {entry:?}: {reason}")]
    UnsafeLayer {
        layer: String,
        entry: String,
        reason: &'static str,
    },
    /// HTTP 400: an import path that would read outside the directory
    /// imports are confined to. Nothing was read.
    #[error("{} is refused: {reason}; imports are read only from inside {}", path.display(), root.display())]
    OutsideRoot {
        path: PathBuf,
        root: PathBuf,
        reason: &'static str,
    },
    /// HTTP 500: the default image cannot be built on this host.
    #[error("debootstrap was not found; install it (apt-get install debootstrap) to build the default image")]
    NoDebootstrap,
    /// HTTP 500.
    #[error("debootstrap failed ({status}); its output is in {}", log.display())]
    Debootstrap { status: String, log: PathBuf },
    /// HTTP 500: a built image's layers could not be merged into one tree
    /// (`flatten.rs`); `reason` is what the merge said.
    #[error("flattening the image's layers into {}: {reason}", dest.display())]
    Flatten { dest: PathBuf, reason: String },
    /// HTTP 422: a package fetched for the default image is not the one
    /// pinned (`npm_tools.rs`); nothing of it was unpacked.
    #[error("npm package {package} does not match its pinned integrity {expected} (got {actual}); nothing was installed")]
    NpmIntegrity {
        package: String,
        expected: String,
        actual: String,
    },
    /// HTTP 500.
    #[error("{action} {path}")]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl ImageError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            ImageError::BadReference { .. }
            | ImageError::OutsideRoot { .. }
            | ImageError::NoRegistryHost { .. } => ErrorKind::BadReference,
            ImageError::NotFound { .. } => ErrorKind::NotFound,
            ImageError::Unauthorized { .. } => ErrorKind::Unauthorized,
            ImageError::Unreachable { .. } => ErrorKind::Unreachable,
            ImageError::Unsupported { .. } => ErrorKind::Unsupported,
            ImageError::InvalidImage { .. }
            | ImageError::UnsafeLayer { .. }
            | ImageError::NpmIntegrity { .. } => ErrorKind::InvalidImage,
            ImageError::Io { .. }
            | ImageError::NoDebootstrap
            | ImageError::Debootstrap { .. }
            | ImageError::Flatten { .. } => ErrorKind::Io,
        }
    }

    /// The HTTP status an API should answer with.
    pub fn http_status(&self) -> u16 {
        self.kind().http_status()
    }

    pub(crate) fn invalid(reference: &str, reason: impl Into<String>) -> ImageError {
        ImageError::InvalidImage {
            reference: reference.to_owned(),
            reason: reason.into(),
        }
    }

    pub(crate) fn unsupported(reference: &str, reason: impl Into<String>) -> ImageError {
        ImageError::Unsupported {
            reference: reference.to_owned(),
            reason: reason.into(),
        }
    }
}

pub type Result<T, E = ImageError> = std::result::Result<T, E>;

/// Builds a closure for `map_err` that wraps an I/O error with its path and action.
pub(crate) fn io_err(
    path: impl Into<PathBuf>,
    action: &'static str,
) -> impl FnOnce(std::io::Error) -> ImageError {
    let path = path.into();
    move |source| ImageError::Io {
        path,
        action,
        source,
    }
}
