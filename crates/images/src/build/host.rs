//! The seam between the builder and what runs its steps: [`BuildHost`].
//!
//! The builder decides what a step does, in which order, what is cached and
//! what a failure says; the host owns the sandboxes, their agents and the
//! cache's records. cove-engine implements it on its container runtime, its
//! network and its store; the builder's tests implement it with a fake that
//! records every call.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;

/// An image's WORKDIR, USER, ENTRYPOINT and CMD, as a build changes them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageSettings {
    /// Where commands start; `None` is the user's home.
    pub workdir: Option<String>,
    /// Who the image's processes run as; `None` is root.
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

/// What a build's `FROM` names, resolved by the host (a snapshot on the
/// server, or a pulled image).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BaseImage {
    /// Names the base in cache keys: the same id has the same files.
    pub id: String,
    pub rootfs: String,
    /// Topmost first.
    pub layers: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub settings: ImageSettings,
}

/// The build sandbox of one step: a container on the image so far, never a
/// sandbox record. Its id starts with [`BUILD_SANDBOX_PREFIX`].
///
/// [`BUILD_SANDBOX_PREFIX`]: super::BUILD_SANDBOX_PREFIX
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepSandbox {
    pub id: String,
    pub rootfs: PathBuf,
    /// Topmost first.
    pub layers: Vec<PathBuf>,
    /// The image's environment, which every process of the sandbox gets.
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    /// Who the step runs as: the image's USER for `RUN`, root otherwise.
    pub user: Option<String>,
}

/// What a command run in a build sandbox did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Executed {
    pub exit_code: i32,
    /// Its whole output.
    pub output: String,
    /// Whether it was killed at [`BuildHost::run_timeout`].
    pub timed_out: bool,
}

/// Where the builder's steps run and its layers are kept.
///
/// For each step not cached, the builder calls `start`, then `run` (or
/// `is_dir` and `unpack`), then `stop` and, if the step succeeded,
/// `capture` and `keep_layer`; `destroy` always comes last, whatever
/// failed before, even `start`.
#[async_trait]
pub trait BuildHost: Send + Sync {
    /// A started build sandbox.
    type Sandbox: Send + Sync;
    /// What the host's own failures are. Failures in the cache
    /// (`cached_layer`, `keep_layer`) end the build as they are; failures in a
    /// step's sandbox are reported as that step's.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The layer cached for a step's key, if one was built before.
    async fn cached_layer(&self, key: &str) -> Result<Option<String>, Self::Error>;

    /// Keeps `layer`, the capture `capture_id`, as the step with `key`, and
    /// answers the layer to stack: another build may have kept one for the
    /// same key meanwhile, and then that one is used and this one dropped.
    async fn keep_layer(
        &self,
        key: &str,
        capture_id: &str,
        layer: &Path,
    ) -> Result<String, Self::Error>;

    /// Makes and starts a build sandbox.
    async fn start(&self, sandbox: &StepSandbox) -> Result<Self::Sandbox, Self::Error>;

    /// Runs `argv` in the sandbox, in `workdir`, with `env` added, as the
    /// sandbox's user; answers when it ends.
    async fn run(
        &self,
        sandbox: &Self::Sandbox,
        argv: &[String],
        env: &BTreeMap<String, String>,
        workdir: Option<&str>,
    ) -> Result<Executed, Self::Error>;

    /// Whether `path` (absolute, in the sandbox) is a directory; a path that
    /// does not exist is not.
    async fn is_dir(&self, sandbox: &Self::Sandbox, path: &str) -> Result<bool, Self::Error>;

    /// Unpacks the tar archive `archive` (on this host) at the sandbox's
    /// root, inside the sandbox, every entry owned by `owner` (`--chown`).
    async fn unpack(
        &self,
        sandbox: &Self::Sandbox,
        archive: &Path,
        owner: Option<&str>,
    ) -> Result<(), Self::Error>;

    /// Stops the sandbox's processes.
    async fn stop(&self, sandbox: &Self::Sandbox) -> Result<(), Self::Error>;

    /// Captures what the stopped sandbox changed, read-only, as the layer
    /// `capture_id`; answers where it is.
    async fn capture(
        &self,
        sandbox: &Self::Sandbox,
        capture_id: &str,
    ) -> Result<PathBuf, Self::Error>;

    /// Removes the build sandbox `id` and all it holds; reports its own
    /// failures (the step's outcome stands).
    async fn destroy(&self, id: &str);

    /// How long a `RUN` may take before it is killed.
    fn run_timeout(&self) -> Duration;
}
