//! Images for cove, in one place: the default Debian image, a reference
//! (`python:3.12-slim`) or an offline image (OCI layout, `docker save`
//! tarball) made a root filesystem directory that a sandbox can use as its
//! read-only overlay lower layer, plus the image's configuration (env,
//! working directory, user, entrypoint, cmd); built images flattened for VMs.
//!
//! - `store.rs`: [`ImageStore`], the one image directory of a server, and the
//!   content-addressed cache in it; each blob downloaded once, each layer
//!   unpacked once, each root filesystem assembled once, under locks.
//! - `default_image.rs`: the default Debian root filesystem (debootstrap).
//! - `registry.rs`: pulls with `oci-client` (Docker Hub defaults, basic auth,
//!   plain HTTP for loopback registries, linux/amd64 out of multi-arch indexes).
//! - `import.rs`: OCI layouts and docker-save archives.
//! - `layer.rs` unpacks one layer tar, `stack.rs` stacks layers (whiteouts),
//!   both through `fsat.rs`, which never follows a symlink.
//! - `flatten.rs`: [`flatten`], a built image's overlayfs layers merged into
//!   one tree for a VM's base disk.
//! - `build/`: Dockerfile builds, whose steps run in sandboxes through the
//!   [`build::BuildHost`] trait that cove-engine implements.
//!
//! **Invariant:** knows nothing of sandbox runtimes, HTTP APIs or the
//! database (no cove crate is a dependency). Errors carry an [`ErrorKind`]
//! whose [`ErrorKind::http_status`] an API can answer with.
//!
//! Unpacking sets owners, setuid bits, device-free trees and file capabilities,
//! so it must run as root (as the server does).

pub mod build;
mod compression;
mod config;
mod default_image;
mod digest;
mod error;
mod flatten;
mod fsat;
mod import;
mod layer;
mod media;
mod npm_tools;
mod progress;
mod registry;
mod stack;
mod store;
mod transfer;
mod users;

pub use config::ImageConfig;
pub use default_image::{
    DefaultImageProgress, COMPLETE_MARKER, DEFAULT_PACKAGES, DEFAULT_SUITE, DEFAULT_USER,
};
pub use error::{ErrorKind, ImageError, Result};
pub use flatten::flatten;
pub use progress::Progress;
pub use registry::{normalize_reference, registry_host, Credentials, MAX_CONFIG_BYTES};
pub use store::{ImageStore, PulledImage};
pub use transfer::{receive_rootfs, send_rootfs, sweep_incoming};
pub use users::{image_users, PASSWD_LIMIT};
