//! Stacking unpacked OCI layers, lowest first, into one root filesystem:
//! how the store assembles a pulled or imported image. (`flatten.rs` is the
//! other direction's tool: overlayfs layers a build captured, copied into
//! one tree for a VM's disk.)
//!
//! The result is what overlayfs would show for the same layers: a whiteout
//! `.wh.NAME` removes NAME from the layers below, `.wh..wh..opq` empties its
//! directory of what the layers below put there, and an entry replaces
//! whatever was at its path (a directory over a symlink replaces the symlink;
//! it is never written through it).
//!
//! Files are not copied: each non-directory in the root filesystem is a hard
//! link to the inode in the layer directory, so assembling costs one `link`
//! per file and the data is stored once however many images share a layer.
//! This needs the layer cache and the root filesystems on one filesystem, and
//! nobody may write to either afterwards: sandboxes see the root filesystem
//! only as a read-only overlay lower layer. Directories are created anew, with
//! the metadata of the highest layer that names them.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Gid, Mode, Timespec, Uid};

use crate::error::{io_err, ImageError, Result};
use crate::fsat::{self, WalkError};
use crate::layer::{join_bytes, split_bytes, LayerMeta, OPAQUE_MARKER, WHITEOUT_PREFIX};

/// One unpacked layer, as `stack` needs it.
pub(crate) struct LayerDir<'a> {
    /// The directory holding the layer's tree.
    pub root: PathBuf,
    pub meta: &'a LayerMeta,
    /// For messages: the layer's digest.
    pub name: String,
}

struct Stacker<'a> {
    rootfs: &'a Path,
    layer: &'a LayerDir<'a>,
    implicit: HashSet<Vec<u8>>,
    dir_mtimes: &'a mut HashMap<Vec<OsString>, Timespec>,
}

/// Builds `rootfs` (an existing empty directory) from `layers`, lowest first.
pub(crate) fn stack(layers: &[LayerDir<'_>], rootfs: &Path) -> Result<()> {
    let root = fsat::open_dir(rootfs).map_err(io_err(rootfs, "open root filesystem"))?;
    let mut dir_mtimes = HashMap::new();
    for layer in layers {
        let layer_root =
            fsat::open_dir(&layer.root).map_err(io_err(&layer.root, "open layer directory"))?;
        let mut stacker = Stacker {
            rootfs,
            layer,
            implicit: layer.meta.implicit_dirs.iter().cloned().collect(),
            dir_mtimes: &mut dir_mtimes,
        };
        let mut rel = Vec::new();
        if !stacker.implicit.contains(&Vec::new()) {
            stacker.copy_dir_meta(layer_root.as_fd(), root.as_fd(), &rel)?;
        }
        stacker.merge(layer_root.as_fd(), root.as_fd(), &mut rel)?;
        stacker.external_links(root.as_fd())?;
    }
    let mut dirs: Vec<_> = dir_mtimes.into_iter().collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0.len()));
    for (components, mtime) in dirs {
        let path = host_path(rootfs, &components);
        match fsat::walk(root.as_fd(), &components, false, |_| {}) {
            Ok(dir) => rustix::fs::futimens(&dir, &fsat::timestamps(mtime))
                .map_err(|e| io_err(&path, "set times of")(e.into()))?,
            Err(WalkError::Missing | WalkError::NotADirectory | WalkError::ThroughSymlink) => {}
            Err(WalkError::Io(e)) => return Err(io_err(&path, "open")(e)),
        }
    }
    Ok(())
}

fn host_path(base: &Path, components: &[OsString]) -> PathBuf {
    components.iter().fold(base.to_path_buf(), |p, c| p.join(c))
}

impl Stacker<'_> {
    fn merge(
        &mut self,
        layer_dir: BorrowedFd<'_>,
        root_dir: BorrowedFd<'_>,
        rel: &mut Vec<OsString>,
    ) -> Result<()> {
        let here = host_path(self.rootfs, rel);
        let names = fsat::read_names(layer_dir)
            .map_err(io_err(host_path(&self.layer.root, rel), "list"))?;
        // Whiteouts first: they apply to the layers below, never to this one's
        // own entries in the same directory.
        if names.iter().any(|n| n.as_bytes() == OPAQUE_MARKER) {
            fsat::remove_children(root_dir).map_err(io_err(&here, "empty opaque directory"))?;
        }
        for name in &names {
            let bytes = name.as_bytes();
            if let Some(hidden) = bytes.strip_prefix(WHITEOUT_PREFIX) {
                // `.wh..wh.*` names are markers (opaque, aufs's `.wh..wh.plnk`), not deletions.
                if hidden == b"." || hidden == b".." {
                    return Err(ImageError::UnsafeLayer {
                        layer: self.layer.name.clone(),
                        entry: here.join(name).display().to_string(),
                        reason: "a whiteout of `.` or `..`",
                    });
                }
                if !hidden.starts_with(WHITEOUT_PREFIX) && !hidden.is_empty() {
                    let hidden = std::ffi::OsStr::from_bytes(hidden);
                    fsat::remove_at(root_dir, hidden)
                        .map_err(io_err(here.join(hidden), "remove whited-out"))?;
                }
            }
        }
        for name in names
            .iter()
            .filter(|n| !n.as_bytes().starts_with(WHITEOUT_PREFIX))
        {
            let target = here.join(name);
            let stat = fsat::lstat_at(layer_dir, name)
                .map_err(io_err(
                    host_path(&self.layer.root, rel).join(name),
                    "inspect",
                ))?
                .ok_or_else(|| {
                    ImageError::invalid(&self.layer.name, "layer directory changed while stacking")
                })?;
            if fsat::file_type(&stat) != FileType::Directory {
                fsat::remove_at(root_dir, name).map_err(io_err(&target, "replace"))?;
                rustix::fs::linkat(layer_dir, name, root_dir, name, AtFlags::empty())
                    .map_err(|e| io_err(&target, "link")(e.into()))?;
                continue;
            }
            let existing = fsat::lstat_at(root_dir, name).map_err(io_err(&target, "inspect"))?;
            let is_dir = existing.is_some_and(|s| fsat::file_type(&s) == FileType::Directory);
            if existing.is_some() && !is_dir {
                fsat::remove_at(root_dir, name).map_err(io_err(&target, "replace"))?;
            }
            if !is_dir {
                rustix::fs::mkdirat(root_dir, name, Mode::from_raw_mode(0o700))
                    .map_err(|e| io_err(&target, "create directory")(e.into()))?;
            }
            let child_layer = fsat::open_subdir(layer_dir, name)
                .map_err(io_err(host_path(&self.layer.root, rel).join(name), "open"))?;
            let child_root = fsat::open_subdir(root_dir, name).map_err(io_err(&target, "open"))?;
            rel.push(name.clone());
            if !is_dir || !self.implicit.contains(&join_bytes(rel)) {
                self.copy_dir_meta(child_layer.as_fd(), child_root.as_fd(), rel)?;
            }
            self.merge(child_layer.as_fd(), child_root.as_fd(), rel)?;
            rel.pop();
        }
        Ok(())
    }

    /// Gives a root filesystem directory the owner, mode, xattrs and (later)
    /// time of the layer's directory, dropping what a lower layer had set.
    fn copy_dir_meta(
        &mut self,
        from: BorrowedFd<'_>,
        to: BorrowedFd<'_>,
        rel: &[OsString],
    ) -> Result<()> {
        let path = host_path(self.rootfs, rel);
        let stat = rustix::fs::fstat(from)
            .map_err(|e| io_err(&path, "inspect layer copy of")(e.into()))?;
        rustix::fs::fchown(
            to,
            Some(Uid::from_raw(stat.st_uid)),
            Some(Gid::from_raw(stat.st_gid)),
        )
        .map_err(|e| io_err(&path, "set owner of")(e.into()))?;
        rustix::fs::fchmod(to, Mode::from_raw_mode(stat.st_mode & 0o7777))
            .map_err(|e| io_err(&path, "set mode of")(e.into()))?;
        for (attr, _) in fsat::list_xattrs(to).map_err(io_err(&path, "list xattrs of"))? {
            fsat::remove_xattr(to, &attr).map_err(io_err(&path, "remove xattr from"))?;
        }
        for (attr, value) in
            fsat::list_xattrs(from).map_err(io_err(&path, "list layer xattrs of"))?
        {
            fsat::set_xattr(to, &attr, &value).map_err(io_err(&path, "set xattr on"))?;
        }
        let mtime = Timespec {
            tv_sec: stat.st_mtime,
            tv_nsec: stat.st_mtime_nsec as _,
        };
        self.dir_mtimes.insert(rel.to_vec(), mtime);
        Ok(())
    }

    /// Hard links whose target came from a lower layer, made once the layer's
    /// tree is in place.
    fn external_links(&self, root: BorrowedFd<'_>) -> Result<()> {
        for link in &self.layer.meta.external_links {
            let path = split_bytes(&link.path);
            let target = split_bytes(&link.target);
            let (Some(name), Some(target_name)) = (path.last(), target.last()) else {
                return Err(ImageError::invalid(
                    &self.layer.name,
                    "empty hard link path",
                ));
            };
            let shown = host_path(self.rootfs, &path);
            let open = |components: &[OsString]| -> Result<OwnedFd> {
                fsat::walk(root, components, false, |_| {}).map_err(|e| match e {
                    WalkError::Io(e) => io_err(&shown, "resolve hard link")(e),
                    WalkError::ThroughSymlink => ImageError::UnsafeLayer {
                        layer: self.layer.name.clone(),
                        entry: String::from_utf8_lossy(&link.path).into_owned(),
                        reason: "its link target goes through a symbolic link",
                    },
                    WalkError::Missing | WalkError::NotADirectory => ImageError::invalid(
                        &self.layer.name,
                        format!(
                            "hard link {} points at {}, which no layer holds",
                            String::from_utf8_lossy(&link.path),
                            String::from_utf8_lossy(&link.target)
                        ),
                    ),
                })
            };
            let target_parent = open(&target[..target.len() - 1])?;
            let parent = open(&path[..path.len() - 1])?;
            match fsat::lstat_at(target_parent.as_fd(), target_name)
                .map_err(io_err(&shown, "inspect link target of"))?
            {
                Some(stat) if fsat::file_type(&stat) != FileType::Directory => {}
                _ => {
                    return Err(ImageError::invalid(
                        &self.layer.name,
                        format!(
                            "hard link {} points at {}, which is missing or a directory",
                            String::from_utf8_lossy(&link.path),
                            String::from_utf8_lossy(&link.target)
                        ),
                    ))
                }
            }
            fsat::remove_at(parent.as_fd(), name).map_err(io_err(&shown, "replace"))?;
            rustix::fs::linkat(&target_parent, target_name, &parent, name, AtFlags::empty())
                .map_err(|e| io_err(&shown, "create hard link")(e.into()))?;
        }
        Ok(())
    }
}

/// Bytes of regular file content in a tree, each inode counted once.
pub(crate) fn content_size(root: &Path) -> Result<u64> {
    fn walk(dir: BorrowedFd<'_>, path: &Path, seen: &mut HashSet<u64>) -> Result<u64> {
        let mut total = 0;
        for name in fsat::read_names(dir).map_err(io_err(path, "list"))? {
            let stat = fsat::lstat_at(dir, &name)
                .map_err(io_err(path.join(&name), "inspect"))?
                .ok_or_else(|| {
                    io_err(path.join(&name), "inspect")(std::io::ErrorKind::NotFound.into())
                })?;
            match fsat::file_type(&stat) {
                FileType::RegularFile if seen.insert(stat.st_ino) => total += stat.st_size as u64,
                FileType::Directory => {
                    let child =
                        fsat::open_subdir(dir, &name).map_err(io_err(path.join(&name), "open"))?;
                    total += walk(child.as_fd(), &path.join(&name), seen)?;
                }
                _ => {}
            }
        }
        Ok(total)
    }
    let fd = fsat::open_dir(root).map_err(io_err(root, "open"))?;
    walk(fd.as_fd(), root, &mut HashSet::new())
}
