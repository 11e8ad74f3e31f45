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

/// Writes the merged view of `layers` (topmost first) over `rootfs` into
/// `dest`, unless `dest` already exists (the same image flattened before).
/// The tree is made beside `dest` and renamed into place, so `dest` is
/// whole or absent.
pub fn flatten(rootfs: &Path, layers: &[PathBuf], dest: &Path) -> Result<(), String> {
    if dest.is_dir() {
        return Ok(());
    }
    let parent = dest
        .parent()
        .ok_or_else(|| format!("{} has no parent directory", dest.display()))?;
    std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
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
        std::fs::create_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let result = copy_merged(rootfs, layers, &mountpoint, &partial);
    let _ = std::fs::remove_dir(&mountpoint);
    if let Err(error) = result {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(error);
    }
    std::fs::rename(&partial, dest).map_err(|e| format!("{}: {e}", dest.display()))
}

fn copy_merged(
    rootfs: &Path,
    layers: &[PathBuf],
    mountpoint: &Path,
    into: &Path,
) -> Result<(), String> {
    let mut lowers: Vec<String> = Vec::new();
    for dir in layers.iter().map(PathBuf::as_path).chain([rootfs]) {
        let text = dir.display().to_string();
        if text.contains([':', ',', '\\']) {
            return Err(format!(
                "layer path {text} has a character overlayfs options cannot hold"
            ));
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
        .map_err(|e| format!("running unshare: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "flattening the image's layers: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_root() -> bool {
        nix::unistd::geteuid().is_root()
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
        nix::sys::stat::mknod(
            &layer.join("etc/gone"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::empty(),
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
