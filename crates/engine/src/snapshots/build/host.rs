//! The engine as cove-images' [`BuildHost`]: a build step's sandbox is a
//! container the runtime prepares and starts like any sandbox (on the
//! network with the default policy, when there is one) but that is never
//! a sandbox record; its commands and copies go to its agent
//! (`build/agent.rs`); its layer is a runtime capture, as for snapshots,
//! recorded in the store's `build_steps` under the step's cache key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use cove_images::build::{BuildHost, Executed, StepSandbox};
use cove_lifecycle::SandboxClass;
use cove_store::{BuildStepRecord, NetworkSettings};

use super::agent;
use crate::shared::sandbox_id;
use crate::shared::Shared;
use crate::{now_ms, EngineError};

/// What went wrong on the engine's side of a build.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BuildHostError {
    /// The engine (store, runtime lookup): the build ends with this error.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The build sandbox could not be put on the network.
    #[error("attaching the build sandbox to the network: {0}")]
    Network(#[source] cove_net::NetError),
    #[error("the build sandbox was not given a network namespace")]
    NoNamespace,
    /// The runtime failed to make, stop or capture the build sandbox.
    #[error(transparent)]
    Runtime(#[from] cove_runtime::RuntimeError),
    /// The build sandbox's agent failed or refused; what it said.
    #[error(transparent)]
    Agent(#[from] super::agent::BuildAgentError),
}

/// A started build sandbox: its id and its agent.
pub(crate) struct BuildSandbox {
    id: cove_runtime::SandboxId,
    agent: cove_runtime::AgentEndpoint,
}

/// Build steps on this engine's container runtime, network and store.
pub(crate) struct EngineBuildHost {
    shared: std::sync::Arc<Shared>,
    /// Whose build this is: its steps are cached for that organization
    /// only, so another cannot plant a layer under a key it can predict
    /// (a step's key names its contexts by hash, not by their bytes).
    scope: crate::organizations::Scope,
}

impl EngineBuildHost {
    pub(crate) fn new(
        shared: std::sync::Arc<Shared>,
        scope: crate::organizations::Scope,
    ) -> EngineBuildHost {
        EngineBuildHost { shared, scope }
    }

    /// The stored key of a step: the build's own, in its organization.
    fn cache_key(&self, key: &str) -> String {
        self.scope.owned_id(key)
    }

    fn runtime(&self) -> Result<std::sync::Arc<dyn cove_runtime::Runtime>, EngineError> {
        Ok(self.shared.runtime(SandboxClass::Container)?.clone())
    }
}

#[async_trait]
impl BuildHost for EngineBuildHost {
    type Sandbox = BuildSandbox;
    type Error = BuildHostError;

    async fn cached_layer(&self, key: &str) -> Result<Option<String>, BuildHostError> {
        let found = self
            .shared
            .store
            .find_build_step(&self.cache_key(key))
            .await
            .map_err(EngineError::from)?;
        Ok(found.map(|step| step.layer))
    }

    async fn keep_layer(
        &self,
        key: &str,
        capture_id: &str,
        layer: &Path,
    ) -> Result<String, BuildHostError> {
        let store = &self.shared.store;
        let layer = layer.display().to_string();
        let step = BuildStepRecord {
            cache_key: self.cache_key(key),
            capture_id: capture_id.to_owned(),
            layer: layer.clone(),
            created_at_ms: now_ms(),
        };
        if store
            .insert_build_step(&step)
            .await
            .map_err(EngineError::from)?
        {
            return Ok(layer);
        }
        // Another build made this step meanwhile: use its layer.
        let _ = self.runtime()?.discard_capture(capture_id).await;
        let theirs = store
            .find_build_step(&self.cache_key(key))
            .await
            .map_err(EngineError::from)?;
        Ok(theirs.map(|s| s.layer).unwrap_or(layer))
    }

    async fn start(&self, sandbox: &StepSandbox) -> Result<BuildSandbox, BuildHostError> {
        let runtime = self.runtime()?;
        let ceilings = &self.shared.config.ceilings;
        let mut spec = cove_runtime::SandboxSpec {
            id: sandbox_id(&sandbox.id)?,
            hostname: "build".into(),
            rootfs: sandbox.rootfs.clone(),
            layers: sandbox.layers.clone(),
            resources: cove_runtime::Resources {
                cpu: ceilings.cpu as u32,
                memory_mib: ceilings.memory_gib as u64 * 1024,
                disk_gib: ceilings.disk_gib as u64,
            },
            env: sandbox.env.clone().into_iter().collect(),
            network: None,
            volumes: Vec::new(),
            workdir: sandbox.workdir.clone(),
            user: sandbox.user.clone(),
            // A build step runs its RUN command, not the image's entrypoint.
            command: Vec::new(),
        };
        if let Some(network) = self.shared.network() {
            let policy = crate::network::policy(&NetworkSettings::default())?;
            let attachment = network
                .attach(&spec.id, &policy)
                .await
                .map_err(BuildHostError::Network)?;
            let cove_net::Link::Namespace(netns) = attachment.link else {
                return Err(BuildHostError::NoNamespace);
            };
            spec.network = Some(cove_runtime::SandboxNetwork {
                link: cove_runtime::NetworkLink::Namespace(netns),
                resolv_conf: attachment.resolv_conf,
            });
        }
        runtime.prepare(&spec).await?;
        let started = runtime.start(&spec).await?;
        Ok(BuildSandbox {
            id: spec.id,
            agent: started.agent,
        })
    }

    async fn run(
        &self,
        sandbox: &BuildSandbox,
        argv: &[String],
        env: &BTreeMap<String, String>,
        workdir: Option<&str>,
    ) -> Result<Executed, BuildHostError> {
        let executed = agent::execute(&sandbox.id, &sandbox.agent, argv, workdir, env)
            .await
            .map_err(BuildHostError::Agent)?;
        Ok(Executed {
            exit_code: executed.exit_code,
            output: executed.result,
            timed_out: executed.timed_out,
        })
    }

    async fn is_dir(&self, sandbox: &BuildSandbox, path: &str) -> Result<bool, BuildHostError> {
        agent::is_dir(&sandbox.id, &sandbox.agent, path)
            .await
            .map_err(BuildHostError::Agent)
    }

    async fn unpack(
        &self,
        sandbox: &BuildSandbox,
        archive: &Path,
        owner: Option<&str>,
    ) -> Result<(), BuildHostError> {
        agent::unpack(&sandbox.id, &sandbox.agent, archive, owner)
            .await
            .map_err(BuildHostError::Agent)
    }

    async fn stop(&self, sandbox: &BuildSandbox) -> Result<(), BuildHostError> {
        Ok(self.runtime()?.stop(&sandbox.id).await?)
    }

    async fn capture(
        &self,
        sandbox: &BuildSandbox,
        capture_id: &str,
    ) -> Result<PathBuf, BuildHostError> {
        Ok(self.runtime()?.capture(&sandbox.id, capture_id).await?)
    }

    async fn destroy(&self, id: &str) {
        match self
            .runtime()
            .and_then(|runtime| Ok((runtime, sandbox_id(id)?)))
        {
            Ok((runtime, sandbox)) => {
                if let Err(error) = runtime.destroy(&sandbox).await {
                    tracing::error!(build = %id, %error, "removing a build sandbox");
                }
            }
            Err(error) => tracing::error!(build = %id, %error, "removing a build sandbox"),
        }
        if let Some(network) = self.shared.network() {
            if let Err(error) = network.release(id).await {
                tracing::error!(build = %id, %error, "releasing a build sandbox's address");
            }
        }
    }

    fn run_timeout(&self) -> Duration {
        agent::RUN_TIMEOUT
    }
}
