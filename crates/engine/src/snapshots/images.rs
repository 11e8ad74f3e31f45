//! Snapshots made from container images: a registry reference (`python:3.12-slim`)
//! pulled through cove-images, or the Dockerfile the SDK's `Image` builder sends.
//!
//! An image becomes an ordinary snapshot whose root filesystem is the unpacked
//! image and whose environment is the image's; the agent is not copied in (the
//! container backend mounts it into every sandbox). A snapshot is made once per
//! reference (or per Dockerfile text) and reused. Dockerfiles are built by
//! cove-images' builder, driven from `build/`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cove_images::Progress;

use cove_lifecycle::SandboxClass;
use cove_store::{SnapshotRecord, SnapshotState};
use sha2::{Digest as _, Sha256};

use cove_images::build::BuiltImage;

use super::build::{parse_dockerfile, stored_settings, BuildLog};
use super::Snapshots;
use crate::checks::sized;
use crate::{now_ms, EngineError};

impl Snapshots {
    /// The snapshot of a registry image, pulled on first use. Its name is the
    /// normalized reference (`docker.io/library/python:3.12-slim`).
    pub async fn image_snapshot(&self, reference: &str) -> Result<SnapshotRecord, EngineError> {
        let label = reference.to_owned();
        self.pull_image(reference, move |progress| {
            tracing::info!(image = %label, "{progress}");
        })
        .await
    }

    /// [`Engine::image_snapshot`], telling `progress` each step of a pull (an
    /// image pulled before reports nothing).
    async fn pull_image(
        &self,
        reference: &str,
        progress: impl Fn(&Progress) + Send + Sync + 'static,
    ) -> Result<SnapshotRecord, EngineError> {
        let name =
            cove_images::normalize_reference(reference).map_err(|e| image_error(reference, e))?;
        if let Some(found) = self
            .shared
            .store
            .find_snapshot(self.scope.filter(), &name)
            .await?
        {
            match found.state {
                SnapshotState::Active => return Ok(found),
                SnapshotState::Inactive => {
                    return Err(EngineError::SnapshotNotActive {
                        name: found.name,
                        state: found.state.as_str(),
                    })
                }
                _ => {}
            }
        }
        let images = self.image_store()?;
        let credentials = self.credentials_for(reference).await?;
        let pulled = images
            .pull(reference, credentials.as_ref(), progress)
            .await
            .map_err(|e| image_error(reference, e))?;
        let snapshot = snapshot_of(&self.shared.config, &self.scope, &name, &pulled);
        self.shared.store.save_snapshot(&snapshot).await?;
        tracing::info!(image = %name, rootfs = %pulled.rootfs.display(), "image snapshot ready");
        Ok(snapshot)
    }

    /// The snapshot built from a Dockerfile, made once per Dockerfile text
    /// and build contexts (for a sandbox created from an `Image`); the build
    /// runs before this returns.
    pub async fn dockerfile_snapshot(
        &self,
        text: &str,
        contexts: &[String],
    ) -> Result<SnapshotRecord, EngineError> {
        let plan = parse_dockerfile(text)?;
        let mut hash = Sha256::new();
        hash.update(text.as_bytes());
        for context in contexts {
            hash.update(b"\0");
            hash.update(context.as_bytes());
        }
        let digest = hash.finalize();
        let name = format!(
            "cove-build-{}",
            digest[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        );
        if let Some(found) = self
            .shared
            .store
            .find_snapshot(self.scope.filter(), &name)
            .await?
        {
            return Ok(found);
        }
        // Kept by the snapshot's id, which is its organization's own.
        let id = self.scope.owned_id(&name);
        let log = self.new_build_log(&id);
        let built = self.build_image(&plan, contexts, &log).await;
        if let Err(error) = &built {
            log.line(format!("error: {error}"));
        }
        self.finish_log(&id, &log).await;
        let config = &self.shared.config;
        let snapshot = built_snapshot(
            SnapshotRecord {
                cpu: config.default_cpu,
                memory_mib: config.default_memory_gib * 1024,
                disk_gib: config.default_disk_gib,
                general: false,
                id,
                organization_id: self.scope.owner().to_owned(),
                ..SnapshotRecord::for_image(&name, "", SandboxClass::Container, now_ms())
            },
            built?,
        );
        self.shared.store.save_snapshot(&snapshot).await?;
        tracing::info!(snapshot = %name, layers = snapshot.layers.len(), "image built");
        Ok(snapshot)
    }

    fn new_build_log(&self, snapshot_id: &str) -> Arc<BuildLog> {
        let log = Arc::new(BuildLog::default());
        self.builds
            .lock()
            .unwrap()
            .insert(snapshot_id.to_owned(), log.clone());
        log
    }

    /// Ends a build's log and keeps its lines, so they outlive this server.
    /// Kept first, so whoever sees the log end can also read it back.
    async fn finish_log(&self, snapshot_id: &str, log: &BuildLog) {
        let (lines, _) = log.read_all();
        if let Err(error) = self.shared.store.save_build_log(snapshot_id, &lines).await {
            tracing::error!(snapshot = %snapshot_id, %error, "keeping a build log");
        }
        log.finish();
    }

    /// The build log of a snapshot: the live one while it builds; the kept
    /// one once its build has ended (under this server or an earlier one);
    /// else what its state says.
    pub async fn build_log(&self, id_or_name: &str) -> Result<Arc<BuildLog>, EngineError> {
        let snapshot = self.get(id_or_name).await?;
        if let Some(log) = self.builds.lock().unwrap().get(&snapshot.id) {
            return Ok(log.clone());
        }
        if let Some(lines) = self.shared.store.find_build_log(&snapshot.id).await? {
            return Ok(Arc::new(BuildLog::finished(lines)));
        }
        let lines = match (snapshot.state, snapshot.error_reason) {
            (SnapshotState::Error, Some(reason)) => vec![format!("error: {reason}")],
            (SnapshotState::Building | SnapshotState::Pending | SnapshotState::Pulling, _) => {
                vec!["the build log was lost when the server restarted".into()]
            }
            _ => Vec::new(),
        };
        Ok(Arc::new(BuildLog::finished(lines)))
    }

    /// Registers snapshot `name` as `building` and builds its Dockerfile in
    /// the background: it becomes `active`, or `error` with the reason (and
    /// the build log says which instruction). A Dockerfile that cannot be
    /// read is refused at once, and nothing is registered.
    async fn start_build(
        &self,
        mut snapshot: SnapshotRecord,
        text: &str,
        contexts: &[String],
    ) -> Result<SnapshotRecord, EngineError> {
        let plan = match parse_dockerfile(text) {
            Err(error @ EngineError::Invalid { .. }) => return Err(error),
            other => other,
        };
        snapshot.state = SnapshotState::Building;
        if let Err(error) = &plan {
            snapshot.state = SnapshotState::Error;
            snapshot.error_reason = Some(error.to_string());
        }
        self.insert_new_snapshot(&snapshot).await?;
        let log = self.new_build_log(&snapshot.id);
        let plan = match plan {
            Ok(plan) => plan,
            Err(error) => {
                log.line(format!("error: {error}"));
                self.finish_log(&snapshot.id, &log).await;
                return Ok(snapshot);
            }
        };
        let engine = self.clone();
        let record = snapshot.clone();
        let contexts = contexts.to_vec();
        tokio::spawn(async move {
            let mut built = engine.build_image(&plan, &contexts, &log).await;
            if let (Ok(image), SandboxClass::LinuxVm) = (&mut built, record.class) {
                log.line("flattening the layers for a VM's disk");
                if let Err(error) = engine.flatten_for_vm(image).await {
                    built = Err(error);
                }
            }
            let mut record = record;
            record.updated_at_ms = now_ms();
            match built {
                Ok(built) => record = built_snapshot(record, built),
                Err(error) => {
                    log.line(format!("error: {error}"));
                    tracing::warn!(snapshot = %record.name, %error, "image build failed");
                    record.state = SnapshotState::Error;
                    record.error_reason = Some(error.to_string());
                }
            }
            engine.record_finished(&record).await;
            if record.state == SnapshotState::Active {
                tracing::info!(snapshot = %record.name, "image built");
            }
            engine.finish_log(&record.id, &log).await;
        });
        Ok(snapshot)
    }
}

/// `named` (a user's snapshot) made `active` on the image snapshot `source`:
/// its files, layers, environment and size, with `named`'s name, class and
/// resources.
fn from_image(named: SnapshotRecord, source: SnapshotRecord) -> SnapshotRecord {
    SnapshotRecord {
        id: named.id,
        organization_id: named.organization_id,
        name: named.name,
        class: named.class,
        cpu: named.cpu,
        memory_mib: named.memory_mib,
        disk_gib: named.disk_gib,
        general: false,
        created_at_ms: named.created_at_ms,
        updated_at_ms: now_ms(),
        state: SnapshotState::Active,
        error_reason: None,
        ..source
    }
}

/// `snapshot` made `active` on what a build made (in its class).
fn built_snapshot(snapshot: SnapshotRecord, built: BuiltImage) -> SnapshotRecord {
    SnapshotRecord {
        state: SnapshotState::Active,
        error_reason: None,
        rootfs: built.rootfs,
        layers: built.layers,
        env: built.env,
        image: stored_settings(built.settings),
        ..snapshot
    }
}

/// A snapshot a user asked to be made from an image.
#[derive(Clone, Debug, Default)]
pub struct ImageSnapshotRequest {
    pub name: String,
    /// A registry reference (`imageName`), or
    pub image: Option<String>,
    /// a Dockerfile (`buildInfo.dockerfileContent`),
    pub dockerfile: Option<String>,
    /// with the uploaded build contexts its `COPY`s read (`buildInfo.contextHashes`).
    pub build_contexts: Vec<String>,
    pub class: Option<SandboxClass>,
    pub cpu: Option<i64>,
    pub memory_gib: Option<i64>,
    pub disk_gib: Option<i64>,
}

impl Snapshots {
    /// Registers snapshot `name` made from a registry image (returned
    /// `active` once pulled) or a Dockerfile (returned `building`; see
    /// `start_build`).
    pub async fn create_image_snapshot(
        &self,
        request: ImageSnapshotRequest,
    ) -> Result<SnapshotRecord, EngineError> {
        check_snapshot_name(&request.name)?;
        if self
            .shared
            .store
            .find_snapshot(self.scope.filter(), &request.name)
            .await?
            .is_some()
        {
            return Err(EngineError::SnapshotTaken { name: request.name });
        }
        let class = request.class.unwrap_or(SandboxClass::Container);
        self.shared.runtime(class)?;
        match (&request.image, &request.dockerfile) {
            (Some(image), None) => self.start_pull(&request, class, image).await,
            (None, Some(text)) => {
                let snapshot = self.new_named_snapshot(&request, class)?;
                self.start_build(snapshot, text, &request.build_contexts)
                    .await
            }
            _ => Err(EngineError::Invalid {
                field: "imageName",
                reason: "give exactly one of imageName and buildInfo.dockerfileContent".into(),
            }),
        }
    }

    /// The record of a snapshot a user asked for, sized within the ceilings,
    /// before its files exist.
    fn new_named_snapshot(
        &self,
        request: &ImageSnapshotRequest,
        class: SandboxClass,
    ) -> Result<SnapshotRecord, EngineError> {
        let config = &self.shared.config;
        let defaults = SnapshotRecord {
            cpu: config.default_cpu,
            memory_mib: config.default_memory_gib * 1024,
            disk_gib: config.default_disk_gib,
            ..SnapshotRecord::for_image("", "", class, 0)
        };
        let (cpu, memory_mib, disk_gib) = sized(
            config.ceilings,
            (request.cpu, request.memory_gib, request.disk_gib),
            &defaults,
        )?;
        let now = now_ms();
        Ok(SnapshotRecord {
            id: uuid::Uuid::new_v4().to_string(),
            organization_id: self.scope.owner().to_owned(),
            name: request.name.clone(),
            cpu,
            memory_mib,
            disk_gib,
            general: false,
            created_at_ms: now,
            updated_at_ms: now,
            ..defaults
        })
    }

    /// Registers snapshot `request.name` made from registry image `image`.
    /// The pull runs in the background and writes its progress to the
    /// snapshot's build log; this waits only until the registry has answered
    /// for the image, so an unknown image is an error (404 naming it) and
    /// nothing is registered. An image pulled before makes the snapshot
    /// `active` at once; else it is `pulling`, then `active` or `error`.
    async fn start_pull(
        &self,
        request: &ImageSnapshotRequest,
        class: SandboxClass,
        image: &str,
    ) -> Result<SnapshotRecord, EngineError> {
        let snapshot = SnapshotRecord {
            state: SnapshotState::Pulling,
            ..self.new_named_snapshot(request, class)?
        };
        let log = self.new_build_log(&snapshot.id);
        let (resolved_tx, mut resolved) = tokio::sync::oneshot::channel::<()>();
        let resolved_tx = Mutex::new(Some(resolved_tx));
        let (engine, reference, pull_log) = (self.clone(), image.to_owned(), log.clone());
        let mut pull = tokio::spawn(async move {
            engine
                .pull_image(&reference, move |progress| {
                    if matches!(progress, Progress::Resolved { .. }) {
                        if let Some(tx) = resolved_tx.lock().unwrap().take() {
                            let _ = tx.send(());
                        }
                    }
                    pull_log.line(progress.to_string());
                })
                .await
        });
        let finished = tokio::select! {
            joined = &mut pull => Some(joined),
            Ok(()) = &mut resolved => None,
        };
        if let Some(joined) = finished {
            let pulled = joined
                .map_err(|source| EngineError::Task {
                    what: "snapshot",
                    id: request.name.clone(),
                    operation: "pull its image",
                    source,
                })
                .and_then(|pulled| pulled);
            let source = match pulled {
                Ok(source) => source,
                Err(error) => {
                    self.builds.lock().unwrap().remove(&snapshot.id);
                    return Err(error);
                }
            };
            self.finish_log(&snapshot.id, &log).await;
            let snapshot = from_image(snapshot, source);
            self.insert_new_snapshot(&snapshot).await?;
            return Ok(snapshot);
        }
        self.insert_new_snapshot(&snapshot).await?;
        let engine = self.clone();
        let record = snapshot.clone();
        tokio::spawn(async move {
            let record = match pull.await {
                Ok(Ok(source)) => from_image(record, source),
                failed => {
                    let reason = match failed {
                        Ok(Err(error)) => error.to_string(),
                        Err(error) => format!("the pull stopped: {error}"),
                        Ok(Ok(_)) => unreachable!("matched above"),
                    };
                    log.line(format!("error: {reason}"));
                    tracing::warn!(snapshot = %record.name, %reason, "image pull failed");
                    SnapshotRecord {
                        state: SnapshotState::Error,
                        error_reason: Some(reason),
                        updated_at_ms: now_ms(),
                        ..record
                    }
                }
            };
            engine.record_finished(&record).await;
            engine.finish_log(&record.id, &log).await;
        });
        Ok(snapshot)
    }

    /// Saves what a background build or pull ended with, unless the
    /// snapshot was deleted meanwhile.
    async fn record_finished(&self, record: &SnapshotRecord) {
        let still_there = matches!(
            self.shared.store.find_snapshot(None, &record.id).await,
            Ok(Some(_))
        );
        if still_there {
            if let Err(error) = self.shared.store.save_snapshot(record).await {
                tracing::error!(snapshot = %record.name, %error, "recording a build or pull");
            }
        }
    }

    async fn insert_new_snapshot(&self, snapshot: &SnapshotRecord) -> Result<(), EngineError> {
        let _admitted = self
            .shared
            .admit_count(&snapshot.organization_id, crate::quota::Counted::Snapshots)
            .await?;
        self.shared
            .store
            .insert_snapshot(snapshot)
            .await
            .map_err(|e| match e {
                cove_store::StoreError::Duplicate { name } => EngineError::SnapshotTaken { name },
                other => other.into(),
            })
    }

    /// Registers snapshot `name` from an OCI layout directory or a `docker save`
    /// tarball at `path` inside this server's import directory (relative to
    /// it, or absolute under it). An API client names the path, so nothing
    /// outside that directory is ever read: not through `..`, not through a
    /// symbolic link (cove-images opens it with `openat2(RESOLVE_BENEATH |
    /// RESOLVE_NO_SYMLINKS)`).
    pub async fn import_image_snapshot(
        &self,
        name: &str,
        path: &std::path::Path,
    ) -> Result<SnapshotRecord, EngineError> {
        check_snapshot_name(name)?;
        let import_dir =
            self.shared
                .config
                .import_dir
                .clone()
                .ok_or_else(|| EngineError::NotImplemented {
                    what: "image imports without an import directory (serve --import-dir)".into(),
                })?;
        if self
            .shared
            .store
            .find_snapshot(self.scope.filter(), name)
            .await?
            .is_some()
        {
            return Err(EngineError::SnapshotTaken {
                name: name.to_owned(),
            });
        }
        let images = self.image_store()?;
        let label = path.display().to_string();
        let source = path.to_owned();
        let root = import_dir.clone();
        let pulled = tokio::task::spawn_blocking(move || {
            images.import_beneath(&root, &source, None, move |progress| {
                tracing::info!(image = %label, "{progress}");
            })
        })
        .await
        .map_err(|source| EngineError::Task {
            what: "snapshot",
            id: name.to_owned(),
            operation: "import its image",
            source,
        })?
        .map_err(|e| match e {
            cove_images::ImageError::OutsideRoot { reason, .. } => EngineError::OutsideImportDir {
                path: path.display().to_string(),
                import_dir,
                reason: reason.to_owned(),
            },
            other => image_error(&path.display().to_string(), other),
        })?;
        let snapshot = snapshot_of(&self.shared.config, &self.scope, name, &pulled);
        self.insert_new_snapshot(&snapshot).await?;
        tracing::info!(snapshot = %name, from = %path.display(), "image imported");
        Ok(snapshot)
    }

    /// Makes a built image one directory, as a VM's base disk is made from:
    /// the layers merged over the root filesystem (once per build, kept in
    /// the image cache beside pulled images).
    async fn flatten_for_vm(&self, image: &mut BuiltImage) -> Result<(), EngineError> {
        if image.layers.is_empty() {
            return Ok(());
        }
        let images = self.image_store()?;
        let key = image.key.clone();
        let rootfs = std::path::PathBuf::from(&image.rootfs);
        let layers: Vec<std::path::PathBuf> = image.layers.iter().map(Into::into).collect();
        let dest =
            tokio::task::spawn_blocking(move || images.flatten_built(&key, &rootfs, &layers))
                .await
                .map_err(|source| EngineError::Task {
                    what: "image",
                    id: image.key.clone(),
                    operation: "be flattened",
                    source,
                })?
                .map_err(|e| EngineError::BuildFailed {
                    reason: e.to_string(),
                })?;
        image.rootfs = dest.display().to_string();
        image.layers.clear();
        Ok(())
    }

    fn image_store(&self) -> Result<cove_images::ImageStore, EngineError> {
        self.shared
            .config
            .images
            .clone()
            .ok_or_else(|| EngineError::NotImplemented {
                what: "images without an image cache (serve --images-dir)".into(),
            })
    }
}

/// Snapshot names are used in URLs: letters, digits, '-', '_', '.' and ':'.
fn check_snapshot_name(name: &str) -> Result<(), EngineError> {
    let valid = !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
    if valid {
        Ok(())
    } else {
        Err(EngineError::Invalid {
            field: "name",
            reason: format!(
                "snapshot name {name:?} must be 1 to 128 letters, digits, '-', '_', '.' or ':'"
            ),
        })
    }
}

/// An active container snapshot of an unpacked image.
fn snapshot_of(
    config: &crate::EngineConfig,
    scope: &crate::organizations::Scope,
    name: &str,
    pulled: &cove_images::PulledImage,
) -> SnapshotRecord {
    let env: BTreeMap<String, String> = pulled
        .config
        .env
        .iter()
        .filter_map(|entry| entry.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    SnapshotRecord {
        id: scope.owned_id(&format!("{name}@{}", pulled.id)),
        organization_id: scope.owner().to_owned(),
        cpu: config.default_cpu,
        memory_mib: config.default_memory_gib * 1024,
        disk_gib: config.default_disk_gib,
        size_bytes: i64::try_from(pulled.size_bytes).ok(),
        env,
        // What its containers run, and as whom (its USER; without one, root
        // unless it has the server's default user).
        image: cove_store::ImageSettings {
            workdir: pulled.config.working_dir.clone().filter(|d| !d.is_empty()),
            user: pulled.config.user.clone(),
            entrypoint: pulled.config.entrypoint.clone(),
            cmd: pulled.config.cmd.clone(),
        },
        general: false,
        ..SnapshotRecord::for_image(
            name,
            &pulled.rootfs.display().to_string(),
            SandboxClass::Container,
            now_ms(),
        )
    }
}

fn image_error(reference: &str, error: cove_images::ImageError) -> EngineError {
    EngineError::Image {
        reference: reference.to_owned(),
        status: error.kind().http_status(),
        reason: error.to_string(),
    }
}
