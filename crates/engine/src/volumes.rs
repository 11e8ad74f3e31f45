//! Volumes: directories that outlive sandboxes, mounted into them at create
//! (`volumes: [{volumeId, mountPath, subpath}]`) and shared between them.
//! Each is a directory `{volumes_dir}/{id}` on the node; a volume some
//! sandbox mounts cannot be deleted.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use cove_lifecycle::SandboxClass;
use cove_store::{SandboxRecord, SnapshotRecord, StoreError, VolumeMount, VolumeRecord};

use crate::checks::check_name;
use crate::organizations::Scope;
use crate::shared::Shared;
use crate::{now_ms, EngineError};

/// The mode of a new volume's root directory.
const VOLUME_ROOT_MODE: u32 = 0o777;

/// Paths a volume may not cover: the kernel's and the agent's.
const RESERVED: &[&str] = &["/proc", "/sys", "/dev", "/run"];

fn invalid(field: &'static str, reason: String) -> EngineError {
    EngineError::Invalid { field, reason }
}

/// An absolute path without `.`, `..` or empty parts, not `/` and not under a
/// reserved directory.
fn check_mount_path(path: &str) -> Result<(), EngineError> {
    let field = "volumes.mountPath";
    let normal = path.starts_with('/')
        && !path.contains('\0')
        && path[1..]
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..");
    if !normal || path == "/" {
        return Err(invalid(
            field,
            format!("{path:?} must be an absolute path like /home/data, without '.' or '..'"),
        ));
    }
    if let Some(reserved) = RESERVED
        .iter()
        .find(|r| path == **r || path.starts_with(&format!("{r}/")))
    {
        return Err(invalid(
            field,
            format!("{path:?} is under {reserved}, which the sandbox's system owns"),
        ));
    }
    Ok(())
}

/// A relative path inside the volume, without `..`.
fn check_subpath(subpath: &str) -> Result<(), EngineError> {
    let plain = !subpath.contains('\0')
        && Path::new(subpath)
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if plain {
        Ok(())
    } else {
        Err(invalid(
            "volumes.subpath",
            format!("{subpath:?} must be a relative path inside the volume, without '..'"),
        ))
    }
}

/// Volumes: directories sandboxes mount. Cheap to clone.
#[derive(Clone)]
pub struct Volumes {
    shared: Arc<Shared>,
    /// Whose volumes these are.
    scope: Scope,
}

impl Volumes {
    pub(crate) fn new(shared: Arc<Shared>) -> Volumes {
        Volumes {
            shared,
            scope: Scope::Server,
        }
    }

    /// These volumes as `scope` sees them.
    pub(crate) fn scoped(&self, scope: Scope) -> Volumes {
        Volumes {
            shared: self.shared.clone(),
            scope,
        }
    }

    fn volumes_dir(&self) -> Result<&Path, EngineError> {
        self.shared
            .config
            .volumes_dir
            .as_deref()
            .ok_or_else(|| EngineError::NotImplemented {
                what: "volumes on this server (no volume directory configured)".into(),
            })
    }

    fn volume_dir(&self, id: &str) -> Result<PathBuf, EngineError> {
        Ok(self.volumes_dir()?.join(id))
    }

    /// Makes a volume (an empty directory) named `name`.
    pub async fn create(&self, name: &str) -> Result<VolumeRecord, EngineError> {
        check_name(name)?;
        let now = now_ms();
        let record = VolumeRecord {
            id: uuid::Uuid::new_v4().to_string(),
            organization_id: self.scope.owner().to_owned(),
            name: name.to_owned(),
            created_at_ms: now,
            updated_at_ms: now,
            last_used_at_ms: None,
        };
        let dir = self.volume_dir(&record.id)?;
        let _admitted = self
            .shared
            .admit_count(&record.organization_id, crate::quota::Counted::Volumes)
            .await?;
        self.make_volume_dir(&record.id, &dir).await?;
        if let Err(error) = self.shared.store.insert_volume(&record).await {
            self.remove_volume_dir(&dir).await;
            return Err(match error {
                StoreError::Duplicate { name } => EngineError::VolumeTaken { name },
                other => other.into(),
            });
        }
        tracing::info!(volume = %record.id, name = %record.name, "volume created");
        Ok(record)
    }

    /// Every volume (of this handle's organization), oldest first.
    pub async fn list(&self) -> Result<Vec<VolumeRecord>, EngineError> {
        let mut all = self.shared.store.list_volumes().await?;
        all.retain(|v| self.scope.sees(&v.organization_id));
        Ok(all)
    }

    /// The volume with this id or name (in this handle's organization).
    pub async fn get(&self, id_or_name: &str) -> Result<VolumeRecord, EngineError> {
        self.shared
            .store
            .find_volume(self.scope.filter(), id_or_name)
            .await?
            .ok_or_else(|| EngineError::VolumeNotFound {
                name: id_or_name.to_owned(),
            })
    }

    /// Deletes a volume and its files; refused while a sandbox mounts it.
    pub async fn delete(&self, id_or_name: &str) -> Result<(), EngineError> {
        let volume = self.get(id_or_name).await?;
        let users: Vec<String> = self
            .shared
            .store
            .list_sandboxes()
            .await?
            .into_iter()
            .filter(|s| s.volumes.iter().any(|m| m.volume_id == volume.id))
            .map(|s| s.name)
            .collect();
        if !users.is_empty() {
            return Err(EngineError::InUse {
                what: format!("volume {}", volume.name),
                users,
            });
        }
        self.shared.store.delete_volume(&volume.id).await?;
        let dir = self.volume_dir(&volume.id)?;
        self.remove_volume_dir(&dir).await;
        tracing::info!(volume = %volume.id, name = %volume.name, "volume deleted");
        Ok(())
    }

    /// A new volume's directory: with a quota, a subvolume capped at its size.
    /// Its root is writable by every user (mode 0777), as Daytona's volumes
    /// are: the sandboxes sharing it may run as different users (the default
    /// `daytona`, root, an image's own).
    async fn make_volume_dir(&self, id: &str, dir: &Path) -> Result<(), EngineError> {
        self.make_empty_volume_dir(id, dir).await?;
        // The directory was made just now, inside the server's own tree: no
        // sandbox has seen it yet.
        tokio::fs::set_permissions(dir, std::fs::Permissions::from_mode(VOLUME_ROOT_MODE))
            .await
            .map_err(EngineError::io("open up", dir))
    }

    async fn make_empty_volume_dir(&self, id: &str, dir: &Path) -> Result<(), EngineError> {
        let parent = dir.parent().unwrap_or(dir).to_owned();
        tokio::fs::create_dir_all(&parent)
            .await
            .map_err(EngineError::io("create", &parent))?;
        let Some(quota) = self.shared.config.volume_quota.clone() else {
            return tokio::fs::create_dir(dir)
                .await
                .map_err(EngineError::io("create", dir));
        };
        let dir = dir.to_owned();
        tokio::task::spawn_blocking(move || quota.storage.create_limited(&dir, quota.bytes))
            .await
            .map_err(|source| EngineError::Task {
                what: "volume",
                id: id.to_owned(),
                operation: "be created",
                source,
            })?
            .map_err(|source| EngineError::VolumeStorage {
                id: id.to_owned(),
                operation: "be created",
                source,
            })
    }

    /// Removes a volume's files: its subvolume, or a plain directory (a
    /// volume made without a quota).
    async fn remove_volume_dir(&self, dir: &Path) {
        let owned = dir.to_owned();
        let storage = self.shared.config.volume_quota.clone().map(|q| q.storage);
        let removed = tokio::task::spawn_blocking(move || {
            let subvolume = storage.as_ref().map(|s| s.delete_subvolume(&owned));
            match subvolume {
                Some(Ok(())) if !owned.exists() => Ok(()),
                _ => match std::fs::remove_dir_all(&owned) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                    _ => Ok(()),
                },
            }
        })
        .await;
        let error = match removed {
            Ok(Ok(())) => return,
            Ok(Err(error)) => crate::error::describe(&error),
            Err(error) => crate::error::describe(&error),
        };
        tracing::warn!(dir = %dir.display(), %error, "removing a volume's files");
    }

    /// Checks the mounts a create asks for and names each volume by its id.
    /// Makes a subpath's directory if it is missing.
    pub(crate) async fn resolve_mounts(
        &self,
        snapshot: &SnapshotRecord,
        mounts: &[VolumeMount],
    ) -> Result<Vec<VolumeMount>, EngineError> {
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        match snapshot.class {
            SandboxClass::Container => {}
            // A VM reaches its volumes over virtio-fs, which QEMU cannot
            // save: such a VM always boots cold.
            SandboxClass::LinuxVm if snapshot.has_memory => {
                return Err(invalid(
                    "volumes",
                    format!(
                        "snapshot {} holds a running machine's memory, and a VM with volumes \
                         boots cold; create from a snapshot without memory, or without volumes",
                        snapshot.name
                    ),
                ))
            }
            SandboxClass::LinuxVm => {}
        }
        if let Some(what) = self.shared.runtime(snapshot.class)?.volumes_unavailable() {
            return Err(EngineError::NotImplemented { what });
        }
        let mut resolved: Vec<VolumeMount> = Vec::with_capacity(mounts.len());
        for mount in mounts {
            check_mount_path(&mount.mount_path)?;
            if let Some(subpath) = &mount.subpath {
                check_subpath(subpath)?;
            }
            if resolved.iter().any(|m| m.mount_path == mount.mount_path) {
                return Err(invalid(
                    "volumes.mountPath",
                    format!("{} is used twice", mount.mount_path),
                ));
            }
            let volume = self.get(&mount.volume_id).await?;
            if let Some(subpath) = &mount.subpath {
                self.make_subpath(&volume, subpath).await?;
            }
            self.shared.store.touch_volume(&volume.id, now_ms()).await?;
            resolved.push(VolumeMount {
                volume_id: volume.id,
                mount_path: mount.mount_path.clone(),
                subpath: mount.subpath.clone(),
            });
        }
        Ok(resolved)
    }

    /// Makes a subpath's directory in a volume if it is missing. Sandboxes
    /// write the volume, so the path is walked from the volume's own
    /// directory without following a single symlink: a subpath that passes
    /// through one is refused, naming the volume and where.
    async fn make_subpath(&self, volume: &VolumeRecord, subpath: &str) -> Result<(), EngineError> {
        let root = self.volume_dir(&volume.id)?;
        let relative = PathBuf::from(subpath);
        let made = tokio::task::spawn_blocking(move || {
            cove_runtime::beneath::open_dir(
                &root,
                &relative,
                Some(cove_runtime::beneath::SHARED_DIR_MODE),
            )
            .map(drop)
        })
        .await
        .map_err(|source| EngineError::Task {
            what: "volume",
            id: volume.id.clone(),
            operation: "make a subpath",
            source,
        })?;
        made.map_err(|error| match error {
            cove_runtime::beneath::BeneathError::Io { path, source } => EngineError::Io {
                action: "create, in a volume,",
                path,
                source,
            },
            refused => invalid(
                "volumes.subpath",
                format!("subpath {subpath:?} of volume {}: {refused}", volume.name),
            ),
        })
    }

    /// The volumes a sandbox's runtime mounts: each volume's directory and
    /// the subpath in it, which the runtime opens without following links.
    pub(crate) fn binds(&self, record: &SandboxRecord) -> Vec<cove_runtime::VolumeBind> {
        let Some(dir) = self.shared.config.volumes_dir.as_deref() else {
            return Vec::new();
        };
        record
            .volumes
            .iter()
            .map(|m| cove_runtime::VolumeBind {
                root: dir.join(&m.volume_id),
                subpath: m.subpath.as_ref().map(PathBuf::from),
                target: PathBuf::from(&m.mount_path),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths() {
        for good in ["/data", "/home/user/work", "/mnt/a-b_c.d"] {
            assert!(check_mount_path(good).is_ok(), "{good}");
        }
        for bad in [
            "/",
            "data",
            "",
            "/a/../b",
            "/a/./b",
            "/a//b",
            "/a/",
            "/proc",
            "/proc/x",
            "/sys/fs",
            "/dev",
            "/run/cove",
        ] {
            assert!(check_mount_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn subpaths() {
        assert!(check_subpath("a/b").is_ok());
        assert!(check_subpath("../x").is_err());
        assert!(check_subpath("/abs").is_err());
        assert!(check_subpath("a/../../x").is_err());
    }
}
