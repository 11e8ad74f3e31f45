//! Flattening an image made of layers into one plain directory tree, for a
//! sandbox class that cannot stack layers itself: a VM's base disk is made
//! from one directory (`mkfs.ext4 -d`), while a built image is a root
//! filesystem under overlayfs layers (with whiteouts and opaque directories).
//!
//! The layers are mounted read-only as overlayfs, which applies whiteouts
//! exactly as a container sees them, and the merged view is copied with
//! `cp -a` (owners, modes, links, xattrs). The mount is made in a mount
//! namespace of its own (`unshare`), so it ends with the copying process
//! and nothing can be left mounted on the host.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{io_err, ImageError, Result};
use crate::store::ImageStore;

impl ImageStore {
    /// A built image (`rootfs` under `layers`, topmost first) as one
    /// directory in the cache, `oci/built/{key}`, flattened once per build
    /// key. Blocking.
    pub fn flatten_built(&self, key: &str, rootfs: &Path, layers: &[PathBuf]) -> Result<PathBuf> {
        let dest = self.cache_dir().join("built").join(key);
        flatten(rootfs, layers, &dest)?;
        Ok(dest)
    }
}

/// Writes the merged view of `layers` (topmost first) over `rootfs` into
/// `dest`, unless `dest` already exists (the same image flattened before).
/// The tree is made beside `dest` and renamed into place, so `dest` is
/// whole or absent.
pub fn flatten(rootfs: &Path, layers: &[PathBuf], dest: &Path) -> Result<()> {
    if dest.is_dir() {
        return Ok(());
    }
    let parent = dest.parent().ok_or_else(|| ImageError::Flatten {
        dest: dest.to_owned(),
        reason: "it has no parent directory".into(),
    })?;
    std::fs::create_dir_all(parent).map_err(io_err(parent, "create"))?;
    let partial = parent.join(format!(
        ".{}.partial-{}",
        dest.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let mountpoint = parent.join(format!(
        ".{}.mnt-{}",
        dest.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    for dir in [&partial, &mountpoint] {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir(dir).map_err(io_err(dir, "create"))?;
    }
    let result = copy_merged(rootfs, layers, &mountpoint, &partial, dest);
    let _ = std::fs::remove_dir(&mountpoint);
    if let Err(error) = result {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(error);
    }
    std::fs::rename(&partial, dest).map_err(io_err(dest, "move the flattened image in place at"))
}

fn copy_merged(
    rootfs: &Path,
    layers: &[PathBuf],
    mountpoint: &Path,
    into: &Path,
    dest: &Path,
) -> Result<()> {
    let failed = |reason: String| ImageError::Flatten {
        dest: dest.to_owned(),
        reason,
    };
    let mut lowers: Vec<String> = Vec::new();
    for dir in layers.iter().map(PathBuf::as_path).chain([rootfs]) {
        let text = dir.display().to_string();
        if text.contains([':', ',', '\\']) {
            return Err(failed(format!(
                "layer path {text} has a character overlayfs options cannot hold"
            )));
        }
        lowers.push(text);
    }
    // With no layers there is nothing to merge: copy the root filesystem.
    let script = if layers.is_empty() {
        r#"exec cp -a --reflink=auto "$0/." "$2/""#
    } else {
        r#"mount -t overlay overlay -o "ro,lowerdir=$0" "$1" && exec cp -a "$1/." "$2/""#
    };
    let source = if layers.is_empty() {
        rootfs.display().to_string()
    } else {
        lowers.join(":")
    };
    let output = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
        ])
        .arg(source)
        .arg(mountpoint)
        .arg(into)
        .output()
        .map_err(io_err("unshare", "run"))?;
    if !output.status.success() {
        return Err(failed(
            String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_root() -> bool {
        rustix::process::geteuid().is_root()
    }

    #[test]
    fn built_images_flatten_into_the_cache_once_per_key() {
        if !is_root() {
            eprintln!("skipped: overlayfs mounts need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let rootfs = dir.path().join("rootfs");
        std::fs::create_dir_all(&rootfs).unwrap();
        std::fs::write(rootfs.join("file"), "base").unwrap();
        let store = ImageStore::new(dir.path().join("images"));
        let flat = store.flatten_built("k1", &rootfs, &[]).unwrap();
        assert_eq!(flat, dir.path().join("images/oci/built/k1"));
        assert_eq!(std::fs::read_to_string(flat.join("file")).unwrap(), "base");
    }

    #[test]
    fn a_layer_path_overlayfs_cannot_hold_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let error = flatten(
            dir.path(),
            &[dir.path().join("a:b")],
            &dir.path().join("flat"),
        )
        .unwrap_err();
        assert!(matches!(error, ImageError::Flatten { .. }), "{error}");
        assert!(!dir.path().join("flat").exists());
    }

    #[test]
    fn layers_merge_with_whiteouts_applied() {
        if !is_root() {
            eprintln!("skipped: overlayfs mounts need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let rootfs = dir.path().join("rootfs");
        let layer = dir.path().join("layer");
        std::fs::create_dir_all(rootfs.join("etc")).unwrap();
        std::fs::write(rootfs.join("etc/base"), "base").unwrap();
        std::fs::write(rootfs.join("etc/gone"), "gone").unwrap();
        std::fs::write(rootfs.join("etc/changed"), "old").unwrap();
        std::fs::create_dir_all(layer.join("etc")).unwrap();
        std::fs::write(layer.join("etc/changed"), "new").unwrap();
        std::fs::write(layer.join("etc/added"), "added").unwrap();
        // An overlayfs whiteout: a 0/0 character device.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            layer.join("etc/gone"),
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::empty(),
            0,
        )
        .unwrap();
        let dest = dir.path().join("flat");
        flatten(&rootfs, std::slice::from_ref(&layer), &dest).unwrap();
        let read = |p: &str| std::fs::read_to_string(dest.join(p)).unwrap();
        assert_eq!(read("etc/base"), "base");
        assert_eq!(read("etc/changed"), "new");
        assert_eq!(read("etc/added"), "added");
        assert!(!dest.join("etc/gone").exists());
        // Done once: a second call keeps what is there.
        std::fs::write(layer.join("etc/added"), "later").unwrap();
        flatten(&rootfs, std::slice::from_ref(&layer), &dest).unwrap();
        assert_eq!(read("etc/added"), "added");
        // Nothing is left beside it, and nothing stays mounted.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mounts.contains(&dir.path().display().to_string()));
    }
}
