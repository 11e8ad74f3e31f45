//! OCI images for cove: a reference (`python:3.12-slim`) or an offline image
//! (OCI layout, `docker save` tarball) becomes a root filesystem directory that a
//! sandbox can use as its read-only overlay lower layer, plus the image's
//! configuration (env, working directory, user, entrypoint, cmd).
//!
//! - `registry.rs`: pulls with `oci-client` (Docker Hub defaults, basic auth,
//!   plain HTTP for loopback registries, linux/amd64 out of multi-arch indexes).
//! - `import.rs`: OCI layouts and docker-save archives.
//! - `store.rs`: the content-addressed cache; each blob downloaded once, each
//!   layer unpacked once, each root filesystem assembled once, under locks.
//! - `layer.rs` unpacks one layer tar, `flatten.rs` stacks layers (whiteouts),
//!   both through `fsat.rs`, which never follows a symlink.
//!
//! **Invariant:** knows nothing of sandboxes, HTTP APIs or the database. Errors
//! carry an [`ErrorKind`] whose [`ErrorKind::http_status`] an API can answer with.
//!
//! Unpacking sets owners, setuid bits, device-free trees and file capabilities,
//! so it must run as root (as the server does).

mod compression;
mod config;
mod digest;
mod error;
mod flatten;
mod fsat;
mod import;
mod layer;
mod media;
mod progress;
mod registry;
mod store;

pub use config::ImageConfig;
pub use error::{ErrorKind, ImageError, Result};
pub use progress::Progress;
pub use registry::{normalize_reference, Credentials, MAX_CONFIG_BYTES};
pub use store::{ImageStore, PulledImage};
