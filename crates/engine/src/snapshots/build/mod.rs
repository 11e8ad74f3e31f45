//! Image builds, the engine's side: cove-images' builder
//! (`cove_images::build`) decides what each Dockerfile step does; the engine
//! resolves `FROM` to a snapshot, hands over the uploaded build context,
//! runs the steps through its [`BuildHost`](cove_images::build::BuildHost)
//! (`build_host.rs`, over `agent.rs`), and removes build sandboxes a crashed
//! server left.

pub(crate) mod agent;
mod host;

use std::path::PathBuf;

use cove_images::build::{BaseImage, BuildContext, BuildError, BuiltImage, DockerfileError};
use cove_lifecycle::SandboxClass;
use cove_store::SnapshotRecord;

pub use cove_images::build::{BuildLog, DockerfilePlan};

use super::Snapshots;
use crate::shared::sandbox_id;
use crate::EngineError;
use host::{BuildHostError, EngineBuildHost};

/// Parses a Dockerfile into the steps cove can build: a malformed one is
/// [`EngineError::Invalid`], one with an instruction cove does not build is
/// [`EngineError::NotImplemented`] naming it.
pub fn parse_dockerfile(text: &str) -> Result<DockerfilePlan, EngineError> {
    Ok(cove_images::build::parse_dockerfile(text)?)
}

impl From<DockerfileError> for EngineError {
    fn from(error: DockerfileError) -> EngineError {
        match error {
            DockerfileError::Invalid { reason } => EngineError::Invalid {
                field: "buildInfo.dockerfileContent",
                reason,
            },
            DockerfileError::Unsupported { what } => EngineError::NotImplemented {
                what: format!("building images with {what}"),
            },
        }
    }
}

impl From<BuildError<BuildHostError>> for EngineError {
    fn from(error: BuildError<BuildHostError>) -> EngineError {
        match error {
            BuildError::Dockerfile(error) => error.into(),
            BuildError::Host(BuildHostError::Engine(error)) => error,
            // A step's failure says which instruction and why.
            other => EngineError::BuildFailed {
                reason: other.to_string(),
            },
        }
    }
}

/// An image's settings as the store keeps them.
pub(crate) fn stored_settings(
    settings: cove_images::build::ImageSettings,
) -> cove_store::ImageSettings {
    cove_store::ImageSettings {
        workdir: settings.workdir,
        user: settings.user,
        entrypoint: settings.entrypoint,
        cmd: settings.cmd,
    }
}

impl Snapshots {
    /// Builds `plan`, whose `COPY`s and `ADD`s read the uploaded build
    /// contexts `contexts`, writing what happens to `log`.
    pub(crate) async fn build_image(
        &self,
        plan: &DockerfilePlan,
        contexts: &[String],
        log: &BuildLog,
    ) -> Result<BuiltImage, EngineError> {
        log.line(format!("FROM {}", plan.base));
        let context = match plan.copies() {
            false => None,
            true => Some(BuildContext::new(
                self.context_archives(contexts)?,
                self.build_scratch()?,
            )),
        };
        let base = self.build_base(&plan.base).await?;
        let base = BaseImage {
            id: base.id,
            rootfs: base.rootfs,
            layers: base.layers,
            env: base.env,
            settings: cove_images::build::ImageSettings {
                workdir: base.image.workdir,
                user: base.image.user,
                entrypoint: base.image.entrypoint,
                cmd: base.image.cmd,
            },
        };
        let host = EngineBuildHost::new(self.shared.clone(), self.scope.clone());
        Ok(cove_images::build::build(&host, plan, base, context.as_ref(), contexts, log).await?)
    }

    /// The snapshot a `FROM` names: one on this server (a snapshot or an
    /// image already pulled), else an image pulled from its registry.
    async fn build_base(&self, name: &str) -> Result<SnapshotRecord, EngineError> {
        let base = match self
            .shared
            .store
            .find_snapshot(self.scope.filter(), name)
            .await?
        {
            Some(found) => found,
            None => self.image_snapshot(name).await?,
        };
        if base.state != cove_store::SnapshotState::Active {
            return Err(EngineError::SnapshotNotActive {
                name: base.name,
                state: base.state.as_str(),
            });
        }
        if base.class != SandboxClass::Container || base.has_memory {
            return Err(EngineError::NotImplemented {
                what: format!(
                    "building on {} (a {} snapshot{}); FROM a container image",
                    base.name,
                    base.class,
                    if base.has_memory { " with memory" } else { "" }
                ),
            });
        }
        Ok(base)
    }

    /// Destroys, through the runtime, every build sandbox an earlier server
    /// left: a build does not survive its server, and such a sandbox is no
    /// sandbox record, so nothing else would ever end its processes or
    /// remove its cgroup and directory. Call at start, before any build.
    pub(crate) async fn remove_leftover_build_sandboxes(&self) -> Result<(), EngineError> {
        let Ok(runtime) = self.shared.runtime(SandboxClass::Container).cloned() else {
            return Ok(());
        };
        let ids = match runtime.sandbox_ids().await {
            Ok(ids) => ids,
            Err(error) => {
                tracing::error!(%error, "listing the build sandboxes an earlier server left");
                return Ok(());
            }
        };
        for id in ids {
            if !id.starts_with(cove_images::build::BUILD_SANDBOX_PREFIX)
                || self
                    .shared
                    .store
                    .find_sandbox(None, &id)
                    .await?
                    .is_some_and(|record| record.id == id)
            {
                continue;
            }
            // The runtime lists only names that are ids; one that is not is
            // none of cove's to remove.
            let Ok(sandbox) = sandbox_id(&id) else {
                continue;
            };
            match runtime.destroy(&sandbox).await {
                Ok(()) => {
                    tracing::info!(build = %id, "removed a build sandbox an earlier server left")
                }
                Err(error) => {
                    tracing::error!(build = %id, %error, "removing a build sandbox an earlier server left")
                }
            }
            if let Some(network) = self.shared.network() {
                if let Err(error) = network.release(&id).await {
                    tracing::error!(build = %id, %error, "releasing a leftover build sandbox's address");
                }
            }
        }
        Ok(())
    }

    /// Scratch space for one build, beside the uploaded contexts.
    fn build_scratch(&self) -> Result<PathBuf, EngineError> {
        let dir = self
            .contexts_dir()?
            .join(".builds")
            .join(uuid::Uuid::new_v4().simple().to_string());
        std::fs::create_dir_all(&dir).map_err(EngineError::io("create", &dir))?;
        Ok(dir)
    }
}
