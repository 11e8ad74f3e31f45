//! Building images from Dockerfiles (the SDK's `Image` builder).
//!
//! `FROM` names a base the host resolves (a snapshot on the server or a
//! pulled image). Each `RUN` runs in a build sandbox the host makes on the
//! base's root filesystem under the layers built so far ([`BuildHost`]).
//! When the command exits 0 the sandbox is stopped, its writable layer
//! captured read-only and stacked as the next layer, and the sandbox
//! removed. `WORKDIR` also makes a layer (the directory), and so do `COPY`
//! and `ADD`: the files they name in the build context (the archives the
//! SDK uploaded, unpacked on this host) are written as one tar archive that
//! the build sandbox unpacks at its root (`copy.rs`). `ENV`, `ARG`, `USER`,
//! `ENTRYPOINT` and `CMD` change only the image's settings, which later
//! steps and the sandboxes made from the image see.
//!
//! Every step that makes a layer is cached under a hash of the base and every
//! instruction up to it (the host keeps the records), so a Dockerfile that
//! starts like an earlier one reuses that one's layers. Cached layers are
//! kept: snapshots stand on them without owning them.
//!
//! - `dockerfile.rs` reads a Dockerfile into a [`DockerfilePlan`].
//! - `host.rs` is the [`BuildHost`] trait; `error.rs` [`BuildError`].
//! - `copy.rs` chooses and archives the files of a `COPY`/`ADD`.
//! - `logs.rs` is [`BuildLog`], a build's bounded, followable log.

mod copy;
mod dockerfile;
mod error;
mod host;
mod logs;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::PathBuf;

use sha2::{Digest as _, Sha256};

pub use copy::CopyError;
use dockerfile::StepKind;
pub use dockerfile::{parse_dockerfile, DockerfileError, DockerfilePlan};
pub use error::{BuildError, StepError};
pub use host::{BaseImage, BuildHost, Executed, ImageSettings, StepSandbox};
pub use logs::BuildLog;

/// How much of a failed step's output goes into the error.
const OUTPUT_TAIL_BYTES: usize = 2000;
/// Every build sandbox's id starts so (a sandbox's id is a UUID, which
/// never does): restart recovery destroys the ones a crashed server left.
pub const BUILD_SANDBOX_PREFIX: &str = "build-";

/// What a build makes: the layers and settings of the finished image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuiltImage {
    pub rootfs: String,
    /// Topmost first.
    pub layers: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub settings: ImageSettings,
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

/// One word for a POSIX shell.
fn shell_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
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
        context: &'a BuildContext,
    },
}

/// The build context of one build, unpacked on this host when the first
/// `COPY` that is not cached runs; its scratch directory is removed with it.
pub struct BuildContext {
    archives: Vec<PathBuf>,
    /// Scratch of the build: the unpacked context in `context/`, and the
    /// archive a step writes.
    dir: PathBuf,
    unpacked: tokio::sync::OnceCell<()>,
}

impl BuildContext {
    /// The context of the uploaded `archives` (later ones over earlier
    /// ones), unpacked when needed under `scratch`, an empty directory this
    /// build owns.
    pub fn new(archives: Vec<PathBuf>, scratch: PathBuf) -> BuildContext {
        BuildContext {
            archives,
            dir: scratch,
            unpacked: tokio::sync::OnceCell::new(),
        }
    }

    /// The unpacked context's root, unpacking it the first time.
    async fn root<E: std::error::Error + 'static>(&self) -> Result<PathBuf, StepError<E>> {
        let root = self.dir.join("context");
        self.unpacked
            .get_or_try_init(|| async {
                let archives = self.archives.clone();
                let into = root.clone();
                tokio::task::spawn_blocking(move || copy::unpack_contexts(&archives, &into))
                    .await?
                    .map_err(StepError::Copy)
            })
            .await?;
        Ok(root)
    }
}

impl Drop for BuildContext {
    fn drop(&mut self) {
        if self.dir.exists() {
            if let Err(error) = std::fs::remove_dir_all(&self.dir) {
                tracing::warn!(dir = %self.dir.display(), %error, "removing a build's context");
            }
        }
    }
}

/// Builds `plan` on `base` through `host`, writing what happens to `log`.
/// `context` is the build context its `COPY`s and `ADD`s read (required
/// when [`DockerfilePlan::copies`]). The caller writes the `FROM` line.
pub async fn build<H: BuildHost>(
    host: &H,
    plan: &DockerfilePlan,
    base: BaseImage,
    context: Option<&BuildContext>,
    context_hashes: &[String],
    log: &BuildLog,
) -> Result<BuiltImage, BuildError<H::Error>> {
    let mut seed = Sha256::new();
    seed.update(b"cove-build-1\0");
    seed.update(base.id.as_bytes());
    let mut progress = Progress {
        image: BuiltImage {
            rootfs: base.rootfs,
            layers: base.layers,
            env: base.env,
            settings: base.settings,
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
                    user: progress.image.settings.user.clone(),
                };
                layer_step(host, &mut progress, log, &step.text, action).await?;
            }
            StepKind::Copy(copy) => {
                // What is copied is named by the contexts' hashes.
                progress.advance(&context_hashes.join(","));
                let context = context.expect("given for builds that copy");
                let dest = dockerfile::expand(&copy.dest, &vars);
                let mut dest_path =
                    copy::image_path(&dest, progress.image.settings.workdir.as_deref());
                if dest.ends_with('/') {
                    dest_path.push('/');
                }
                let action = Action::Copy {
                    copy,
                    dest: dest_path,
                    context,
                };
                layer_step(host, &mut progress, log, &step.text, action).await?;
            }
            StepKind::Workdir(dir) => {
                let dir = dockerfile::expand(dir, &vars);
                let dir = match &progress.image.settings.workdir {
                    Some(current) if !dir.starts_with('/') => format!("{current}/{dir}"),
                    _ if !dir.starts_with('/') => format!("/{dir}"),
                    _ => dir,
                };
                // Made as root, then given to the image's user, as Docker does.
                let mut script = format!("mkdir -p {}", shell_quote(&dir));
                if let Some(user) = &progress.image.settings.user {
                    script.push_str(&format!(
                        " && chown {} {}",
                        shell_quote(user),
                        shell_quote(&dir)
                    ));
                }
                let action = Action::Run {
                    argv: vec!["/bin/sh".into(), "-c".into(), script],
                    env: BTreeMap::new(),
                    user: None,
                };
                layer_step(host, &mut progress, log, &step.text, action).await?;
                progress.image.settings.workdir = Some(dir);
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
                progress.image.settings.user = Some(dockerfile::expand(user, &vars));
            }
            StepKind::Entrypoint(command) => {
                progress.image.settings.entrypoint = command.argv();
                // As in Docker, a new ENTRYPOINT drops an inherited CMD.
                progress.image.settings.cmd.clear();
            }
            StepKind::Cmd(command) => progress.image.settings.cmd = command.argv(),
            StepKind::Metadata => {}
        }
    }
    log.line("build complete");
    progress.image.key = progress.key_hex();
    Ok(progress.image)
}

/// Does `action` in a build sandbox on the layers so far and stacks what
/// it changed as a new layer, or reuses the layer cached for this step.
async fn layer_step<H: BuildHost>(
    host: &H,
    progress: &mut Progress,
    log: &BuildLog,
    text: &str,
    action: Action<'_>,
) -> Result<(), BuildError<H::Error>> {
    let key = progress.key_hex();
    if let Some(cached) = host.cached_layer(&key).await.map_err(BuildError::Host)? {
        log.line(" ---> using cache");
        progress.image.layers.insert(0, cached);
        return Ok(());
    }
    let id = format!("{BUILD_SANDBOX_PREFIX}{}", uuid::Uuid::new_v4().simple());
    let capture_id = format!("build-{}", uuid::Uuid::new_v4().simple());
    let sandbox = StepSandbox {
        id: id.clone(),
        rootfs: progress.image.rootfs.clone().into(),
        layers: progress.image.layers.iter().map(Into::into).collect(),
        env: progress.image.env.clone(),
        workdir: progress.image.settings.workdir.clone(),
        user: match &action {
            Action::Run { user, .. } => user.clone(),
            Action::Copy { .. } => None,
        },
    };
    let outcome = run_step(host, &sandbox, &action, &capture_id).await;
    host.destroy(&id).await;
    let (layer, executed) = outcome.map_err(|error| BuildError::Step {
        step: text.to_owned(),
        error,
    })?;
    for line in executed.output.lines() {
        log.line(line);
    }
    let Some(layer) = layer else {
        let mut tail = executed.output.trim_end().to_owned();
        if tail.len() > OUTPUT_TAIL_BYTES {
            let mut cut = tail.len() - OUTPUT_TAIL_BYTES;
            while !tail.is_char_boundary(cut) {
                cut += 1;
            }
            tail = format!("...{}", &tail[cut..]);
        }
        let how = if executed.timed_out {
            format!("timed out after {} s", host.run_timeout().as_secs())
        } else {
            format!("exited with code {}", executed.exit_code)
        };
        return Err(BuildError::Exited {
            step: text.to_owned(),
            how,
            output_tail: tail,
        });
    };
    let kept = host
        .keep_layer(&key, &capture_id, &layer)
        .await
        .map_err(BuildError::Host)?;
    progress.image.layers.insert(0, kept);
    Ok(())
}

/// Starts a build sandbox, does the step, stops it and captures its layer
/// if the step succeeded.
async fn run_step<H: BuildHost>(
    host: &H,
    spec: &StepSandbox,
    action: &Action<'_>,
    capture_id: &str,
) -> Result<(Option<PathBuf>, Executed), StepError<H::Error>> {
    let sandbox = host.start(spec).await.map_err(StepError::Host)?;
    let executed = match action {
        Action::Run { argv, env, .. } => host
            .run(&sandbox, argv, env, spec.workdir.as_deref())
            .await
            .map_err(StepError::Host)?,
        Action::Copy {
            copy,
            dest,
            context,
        } => copy_into(host, &sandbox, copy, dest, context).await?,
    };
    host.stop(&sandbox).await.map_err(StepError::Host)?;
    if executed.exit_code != 0 {
        return Ok((None, executed));
    }
    let layer = host
        .capture(&sandbox, capture_id)
        .await
        .map_err(StepError::Host)?;
    Ok((Some(layer), executed))
}

/// A `COPY`/`ADD` into a build sandbox: the sources are written as one
/// archive and unpacked at its root.
async fn copy_into<H: BuildHost>(
    host: &H,
    sandbox: &H::Sandbox,
    copy: &dockerfile::Copy,
    dest: &str,
    build: &BuildContext,
) -> Result<Executed, StepError<H::Error>> {
    let context = build.root().await?;
    let sources_text = copy.sources.clone();
    let sources = {
        let context = context.clone();
        tokio::task::spawn_blocking(move || copy::resolve_sources(&context, &sources_text))
            .await??
    };
    let image_dest = dest.trim_end_matches('/').to_owned();
    // As Docker: into a directory when the destination says so (a trailing
    // `/`), when there are several sources, or when it is one already.
    let dest_is_dir = dest.ends_with('/')
        || image_dest.is_empty()
        || sources.len() > 1
        || host
            .is_dir(sandbox, &format!("/{image_dest}"))
            .await
            .map_err(StepError::Host)?;
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
        .await??
    };
    let unpacked = host.unpack(sandbox, &archive, copy.chown.as_deref()).await;
    let _ = tokio::fs::remove_file(&archive).await;
    unpacked.map_err(StepError::Host)?;
    Ok(Executed {
        exit_code: 0,
        output: format!(
            "copied {written} entries to /{}",
            dest.trim_start_matches('/')
        ),
        timed_out: false,
    })
}
