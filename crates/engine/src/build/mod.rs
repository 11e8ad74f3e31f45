//! Building images from Dockerfiles (the SDK's `Image` builder).
//!
//! `FROM` names a snapshot on this server or an image to pull. Each `RUN` runs
//! in a build sandbox: a container made by the runtime like any sandbox, on
//! the base's root filesystem under the layers built so far, never registered
//! as a sandbox. When the command exits 0 the sandbox is stopped, its writable
//! layer captured read-only (as a snapshot of a sandbox is) and stacked as the
//! next layer, and the sandbox removed. `WORKDIR` also makes a layer (the
//! directory), and so do `COPY` and `ADD`: the files they name in the build
//! context (the archives the SDK uploaded, unpacked on this host) are
//! written as one tar archive that the build sandbox's agent unpacks at its
//! root (`copy.rs`). `ENV`, `ARG`, `USER`, `ENTRYPOINT` and `CMD` change only the
//! image's settings, which later steps and the sandboxes made from the image
//! see.
//!
//! Every step that makes a layer is cached under a hash of the base and every
//! instruction up to it (`build_steps` in the store), so a Dockerfile that
//! starts like an earlier one reuses that one's layers. Cached layers are
//! kept: snapshots stand on them without owning them.

mod agent;
mod copy;
mod dockerfile;
mod logs;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cove_lifecycle::SandboxClass;
use cove_store::{BuildStepRecord, ImageSettings, NetworkSettings, SnapshotRecord};
use sha2::{Digest as _, Sha256};

use dockerfile::StepKind;
pub use dockerfile::{parse_dockerfile, DockerfilePlan};
pub use logs::BuildLog;

use crate::{now_ms, Engine, EngineError};

/// How much of a failed step's output goes into the snapshot's error reason.
const OUTPUT_TAIL_BYTES: usize = 2000;
/// Every build sandbox's id starts so (a sandbox's id is a UUID, which
/// never does): restart recovery destroys the ones a crashed server left.
pub(crate) const BUILD_SANDBOX_PREFIX: &str = "build-";

/// What a build makes: the layers and settings of the finished image.
#[derive(Clone, Debug)]
pub(crate) struct BuiltImage {
    pub rootfs: String,
    /// Topmost first.
    pub layers: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub image: ImageSettings,
    /// A hash of the base and every instruction: the same for the same build.
    pub key: String,
}

/// Where a build is between steps.
struct Progress {
    image: BuiltImage,
    /// `ARG`s: visible to later `RUN`s, not kept in the image.
    args: BTreeMap<String, String>,
    /// A hash of the base and every instruction so far.
    key: [u8; 32],
}

impl Progress {
    /// Variables `$VAR` expands from: arguments under the environment.
    fn vars(&self) -> BTreeMap<String, String> {
        let mut vars = self.args.clone();
        vars.extend(self.image.env.clone());
        vars
    }

    fn advance(&mut self, text: &str) {
        let mut hash = Sha256::new();
        hash.update(self.key);
        hash.update(text.as_bytes());
        self.key = hash.finalize().into();
    }

    fn key_hex(&self) -> String {
        hex(&self.key)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a build step that makes a layer does in its build sandbox.
enum Action<'a> {
    /// Runs a command, as the image's user.
    Run {
        argv: Vec<String>,
        env: BTreeMap<String, String>,
        user: Option<String>,
    },
    /// Copies from the build context, as root.
    Copy {
        copy: &'a dockerfile::Copy,
        /// The destination, an image path (`copy::image_path`).
        dest: String,
        context: &'a Context,
    },
}

/// The build context of one build, unpacked on this host when the first
/// `COPY` that is not cached runs, and removed with the build.
struct Context {
    archives: Vec<PathBuf>,
    /// Scratch of the build: the unpacked context in `context/`, and the
    /// archive a step writes.
    dir: PathBuf,
    unpacked: tokio::sync::OnceCell<()>,
}

impl Context {
    /// The unpacked context's root, unpacking it the first time.
    async fn root(&self) -> Result<PathBuf, String> {
        let root = self.dir.join("context");
        self.unpacked
            .get_or_try_init(|| async {
                let archives = self.archives.clone();
                let into = root.clone();
                tokio::task::spawn_blocking(move || copy::unpack_contexts(&archives, &into))
                    .await
                    .map_err(|e| e.to_string())?
            })
            .await?;
        Ok(root)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if self.dir.exists() {
            if let Err(error) = std::fs::remove_dir_all(&self.dir) {
                tracing::warn!(dir = %self.dir.display(), %error, "removing a build's context");
            }
        }
    }
}

/// A build that failed: the message says which instruction and why.
fn failed(reason: String) -> EngineError {
    EngineError::BuildFailed { reason }
}

impl Engine {
    /// Builds `plan`, whose `COPY`s and `ADD`s read the uploaded build
    /// contexts `contexts`, writing what happens to `log`.
    pub(crate) async fn build_image(
        &self,
        plan: &DockerfilePlan,
        contexts: &[String],
        log: &BuildLog,
    ) -> Result<BuiltImage, EngineError> {
        log.line(format!("FROM {}", plan.base));
        let copies = plan
            .steps
            .iter()
            .any(|s| matches!(s.kind, StepKind::Copy(_)));
        let context = match copies {
            false => None,
            true => Some(Context {
                archives: self.context_archives(contexts)?,
                dir: self.build_scratch()?,
                unpacked: tokio::sync::OnceCell::new(),
            }),
        };
        let base = self.build_base(&plan.base).await?;
        let mut seed = Sha256::new();
        seed.update(b"cove-build-1\0");
        seed.update(base.id.as_bytes());
        let mut progress = Progress {
            image: BuiltImage {
                rootfs: base.rootfs.clone(),
                layers: base.layers.clone(),
                env: base.env.clone(),
                image: base.image.clone(),
                key: String::new(),
            },
            args: BTreeMap::new(),
            key: seed.finalize().into(),
        };
        let total = plan.steps.len();
        for (index, step) in plan.steps.iter().enumerate() {
            log.line(format!("STEP {}/{total}: {}", index + 1, step.text));
            progress.advance(&step.text);
            let vars = progress.vars();
            match &step.kind {
                StepKind::Run(command) => {
                    let action = Action::Run {
                        argv: command.argv(),
                        env: progress.vars(),
                        user: progress.image.image.user.clone(),
                    };
                    self.layer_step(&mut progress, log, &step.text, action)
                        .await?;
                }
                StepKind::Copy(copy) => {
                    // What is copied is named by the contexts' hashes.
                    progress.advance(&contexts.join(","));
                    let context = context.as_ref().expect("made for builds that copy");
                    let dest = dockerfile::expand(&copy.dest, &vars);
                    let mut dest_path =
                        copy::image_path(&dest, progress.image.image.workdir.as_deref());
                    if dest.ends_with('/') {
                        dest_path.push('/');
                    }
                    let action = Action::Copy {
                        copy,
                        dest: dest_path,
                        context,
                    };
                    self.layer_step(&mut progress, log, &step.text, action)
                        .await?;
                }
                StepKind::Workdir(dir) => {
                    let dir = dockerfile::expand(dir, &vars);
                    let dir = match &progress.image.image.workdir {
                        Some(current) if !dir.starts_with('/') => format!("{current}/{dir}"),
                        _ if !dir.starts_with('/') => format!("/{dir}"),
                        _ => dir,
                    };
                    // Made as root, then given to the image's user, as Docker does.
                    let mut script = format!("mkdir -p {}", agent::shell_quote(&dir));
                    if let Some(user) = &progress.image.image.user {
                        script.push_str(&format!(
                            " && chown {} {}",
                            agent::shell_quote(user),
                            agent::shell_quote(&dir)
                        ));
                    }
                    let action = Action::Run {
                        argv: vec!["/bin/sh".into(), "-c".into(), script],
                        env: BTreeMap::new(),
                        user: None,
                    };
                    self.layer_step(&mut progress, log, &step.text, action)
                        .await?;
                    progress.image.image.workdir = Some(dir);
                }
                StepKind::Env(text) => {
                    progress
                        .image
                        .env
                        .extend(dockerfile::parse_env(text, &vars)?);
                }
                StepKind::Arg { name, default } => {
                    let value = default
                        .as_deref()
                        .map(|d| dockerfile::expand(d, &vars))
                        .unwrap_or_default();
                    progress.args.insert(name.clone(), value);
                }
                StepKind::User(user) => {
                    progress.image.image.user = Some(dockerfile::expand(user, &vars));
                }
                StepKind::Entrypoint(command) => {
                    progress.image.image.entrypoint = command.argv();
                    // As in Docker, a new ENTRYPOINT drops an inherited CMD.
                    progress.image.image.cmd.clear();
                }
                StepKind::Cmd(command) => progress.image.image.cmd = command.argv(),
                StepKind::Metadata => {}
            }
        }
        log.line("build complete");
        progress.image.key = progress.key_hex();
        Ok(progress.image)
    }

    /// The snapshot a `FROM` names: one on this server (a snapshot or an
    /// image already pulled), else an image pulled from its registry.
    async fn build_base(&self, name: &str) -> Result<SnapshotRecord, EngineError> {
        let base = match self.inner.store.find_snapshot(name).await? {
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
        let Ok(runtime) = self.runtime(SandboxClass::Container).cloned() else {
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
            if !id.starts_with(BUILD_SANDBOX_PREFIX)
                || self
                    .inner
                    .store
                    .find_sandbox(&id)
                    .await?
                    .is_some_and(|record| record.id == id)
            {
                continue;
            }
            match runtime.destroy(&id).await {
                Ok(()) => {
                    tracing::info!(build = %id, "removed a build sandbox an earlier server left")
                }
                Err(error) => {
                    tracing::error!(build = %id, %error, "removing a build sandbox an earlier server left")
                }
            }
            if let Some(network) = self.network() {
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

    /// Does `action` in a build sandbox on the layers so far and stacks what
    /// it changed as a new layer, or reuses the layer cached for this step.
    async fn layer_step(
        &self,
        progress: &mut Progress,
        log: &BuildLog,
        text: &str,
        action: Action<'_>,
    ) -> Result<(), EngineError> {
        let key = progress.key_hex();
        if let Some(cached) = self.inner.store.find_build_step(&key).await? {
            log.line(" ---> using cache");
            progress.image.layers.insert(0, cached.layer);
            return Ok(());
        }
        let runtime = self.runtime(SandboxClass::Container)?.clone();
        let id = format!("{BUILD_SANDBOX_PREFIX}{}", uuid::Uuid::new_v4().simple());
        let capture_id = format!("build-{}", uuid::Uuid::new_v4().simple());
        let config = &self.inner.config;
        let spec = cove_runtime::SandboxSpec {
            id: id.clone(),
            hostname: "build".into(),
            rootfs: progress.image.rootfs.clone().into(),
            layers: progress.image.layers.iter().map(Into::into).collect(),
            resources: cove_runtime::Resources {
                cpu: config.ceilings.cpu as u32,
                memory_mib: config.ceilings.memory_gib as u64 * 1024,
                disk_gib: config.ceilings.disk_gib as u64,
            },
            env: progress.image.env.clone().into_iter().collect(),
            network: None,
            volumes: Vec::new(),
            workdir: progress.image.image.workdir.clone(),
            user: match &action {
                Action::Run { user, .. } => user.clone(),
                Action::Copy { .. } => None,
            },
            // A build step runs its RUN command, not the image's entrypoint.
            command: Vec::new(),
        };
        let outcome = self
            .run_build_sandbox(runtime.as_ref(), spec, &action, &capture_id)
            .await;
        if let Err(error) = runtime.destroy(&id).await {
            tracing::error!(build = %id, %error, "removing a build sandbox");
        }
        if let Some(network) = self.network() {
            if let Err(error) = network.release(&id).await {
                tracing::error!(build = %id, %error, "releasing a build sandbox's address");
            }
        }
        let (layer, executed) = outcome.map_err(|reason| failed(format!("{text}: {reason}")))?;
        for line in executed.result.lines() {
            log.line(line);
        }
        let Some(layer) = layer else {
            let mut tail = executed.result.trim_end().to_owned();
            if tail.len() > OUTPUT_TAIL_BYTES {
                let mut cut = tail.len() - OUTPUT_TAIL_BYTES;
                while !tail.is_char_boundary(cut) {
                    cut += 1;
                }
                tail = format!("...{}", &tail[cut..]);
            }
            let how = if executed.timed_out {
                format!("timed out after {} s", agent::RUN_TIMEOUT.as_secs())
            } else {
                format!("exited with code {}", executed.exit_code)
            };
            return Err(failed(format!("{text} {how}; output: {tail}")));
        };
        let layer = layer.display().to_string();
        let step = BuildStepRecord {
            cache_key: key,
            capture_id: capture_id.clone(),
            layer: layer.clone(),
            created_at_ms: now_ms(),
        };
        if !self.inner.store.insert_build_step(&step).await? {
            // Another build made this step meanwhile: use its layer.
            let _ = runtime.discard_capture(&capture_id).await;
            let theirs = self.inner.store.find_build_step(&step.cache_key).await?;
            progress
                .image
                .layers
                .insert(0, theirs.map(|s| s.layer).unwrap_or(layer));
            return Ok(());
        }
        progress.image.layers.insert(0, layer);
        Ok(())
    }

    /// Starts a build sandbox, does the step, stops it and captures its layer
    /// if the step succeeded.
    async fn run_build_sandbox(
        &self,
        runtime: &dyn cove_runtime::Runtime,
        mut spec: cove_runtime::SandboxSpec,
        action: &Action<'_>,
        capture_id: &str,
    ) -> Result<(Option<std::path::PathBuf>, agent::Executed), String> {
        if let Some(network) = self.network() {
            let policy =
                crate::network::policy(&NetworkSettings::default()).map_err(|e| e.to_string())?;
            let attachment = network
                .attach(&spec.id, &policy)
                .await
                .map_err(|e| format!("attaching the build sandbox to the network: {e}"))?;
            let cove_net::Link::Namespace(netns) = attachment.link else {
                return Err("the build sandbox was not given a network namespace".into());
            };
            spec.network = Some(cove_runtime::SandboxNetwork {
                link: cove_runtime::NetworkLink::Namespace(netns),
                resolv_conf: attachment.resolv_conf,
            });
        }
        runtime.prepare(&spec).await.map_err(|e| e.to_string())?;
        let started = runtime.start(&spec).await.map_err(|e| e.to_string())?;
        let cove_runtime::AgentEndpoint::Unix(socket) = &started.agent;
        let executed = match action {
            Action::Run { argv, env, .. } => {
                agent::execute(&spec.id, socket, argv, spec.workdir.as_deref(), env).await?
            }
            Action::Copy {
                copy,
                dest,
                context,
            } => copy_into(&spec.id, socket, copy, dest, context).await?,
        };
        runtime.stop(&spec.id).await.map_err(|e| e.to_string())?;
        if executed.exit_code != 0 {
            return Ok((None, executed));
        }
        let layer = runtime
            .capture(&spec.id, capture_id)
            .await
            .map_err(|e| e.to_string())?;
        Ok((Some(layer), executed))
    }
}

/// A `COPY`/`ADD` into build sandbox `sandbox`, whose agent listens on `socket`:
/// the sources are written as one archive and unpacked at its root.
async fn copy_into(
    sandbox: &str,
    socket: &Path,
    copy: &dockerfile::Copy,
    dest: &str,
    build: &Context,
) -> Result<agent::Executed, String> {
    let context = build.root().await?;
    let sources_text = copy.sources.clone();
    let sources = {
        let context = context.clone();
        tokio::task::spawn_blocking(move || copy::resolve_sources(&context, &sources_text))
            .await
            .map_err(|e| e.to_string())??
    };
    let image_dest = dest.trim_end_matches('/').to_owned();
    // As Docker: into a directory when the destination says so (a trailing
    // `/`), when there are several sources, or when it is one already.
    let dest_is_dir = dest.ends_with('/')
        || image_dest.is_empty()
        || sources.len() > 1
        || agent::is_dir(sandbox, socket, &format!("/{image_dest}")).await?;
    let archive = build.dir.join("copy.tar");
    let options = copy::Options::from(copy);
    let written = {
        let archive = archive.clone();
        tokio::task::spawn_blocking(move || {
            copy::write_archive(
                &context,
                &sources,
                &image_dest,
                dest_is_dir,
                options,
                &archive,
            )
        })
        .await
        .map_err(|e| e.to_string())??
    };
    let unpacked = agent::unpack(sandbox, socket, &archive, copy.chown.as_deref()).await;
    let _ = tokio::fs::remove_file(&archive).await;
    unpacked?;
    Ok(agent::Executed {
        exit_code: 0,
        result: format!(
            "copied {written} entries to /{}",
            dest.trim_start_matches('/')
        ),
        timed_out: false,
    })
}
