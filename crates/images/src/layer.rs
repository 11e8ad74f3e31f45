//! Unpacking one layer tar into a directory of its own, exactly as the tar says.
//!
//! The layer directory keeps the tar's content verbatim, whiteout markers
//! (`.wh.NAME`, `.wh..wh..opq`) included as empty files: interpreting them is
//! the job of `flatten.rs`, which stacks layers in order. That is what lets one
//! unpacked layer serve every image that shares it.
//!
//! Safety: paths with a `..` component are refused, and every entry is created
//! through `fsat::walk`, which refuses to pass through a symlink, so a symlink
//! in the tar (to `/` or anywhere) is stored but never followed. Character and
//! block devices are skipped (counted in [`LayerMeta::skipped_devices`]): the
//! sandbox gets its own `/dev`, and a device node elsewhere in an image would
//! only be a way around the device allow-list. FIFOs are created.
//!
//! `fuzz/fuzz_targets/tar_unpack.rs` compiles `layer.rs`, `fsat.rs` and
//! `error.rs` on their own (`#[path]`): they use nothing else of this crate.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags, Timespec, Uid};
use serde::{Deserialize, Serialize};
use tar::EntryType;

use crate::error::{io_err, ImageError, Result};
use crate::fsat::{self, WalkError};

/// The whiteout prefix: `.wh.NAME` deletes NAME from the layers below.
pub(crate) const WHITEOUT_PREFIX: &[u8] = b".wh.";
/// In a directory, hides everything the layers below put there.
pub(crate) const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// What a layer directory cannot say by itself, kept beside it in `meta.json`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct LayerMeta {
    /// Directories the tar did not name but which its entries needed; their
    /// metadata is a default, so flattening must not let it replace the
    /// metadata a lower layer gave the same directory. Paths are `/`-joined bytes.
    pub implicit_dirs: Vec<Vec<u8>>,
    /// Hard links whose target is not in this layer (it is in a lower one);
    /// flattening makes them in the root filesystem.
    pub external_links: Vec<ExternalLink>,
    /// Character and block devices left out.
    pub skipped_devices: u64,
    /// Bytes of regular file content.
    pub file_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ExternalLink {
    pub path: Vec<u8>,
    pub target: Vec<u8>,
}

/// Metadata of one tar entry, read before its content.
struct EntryMeta {
    mode: u32,
    uid: Uid,
    gid: Gid,
    mtime: Timespec,
    xattrs: Vec<(OsString, Vec<u8>)>,
}

struct Unpacker<'a> {
    layer: &'a str,
    root_path: &'a Path,
    root: OwnedFd,
    meta: LayerMeta,
    implicit: HashSet<Vec<OsString>>,
    dir_mtimes: HashMap<Vec<OsString>, Timespec>,
    buffer: Vec<u8>,
}

/// Unpacks the tar read from `reader` into `root` (an existing empty
/// directory). Returns what the directory cannot record, and the reader, so the
/// caller can read it to the end to finish its digest.
pub(crate) fn unpack<R: Read>(reader: R, root: &Path, layer: &str) -> Result<(LayerMeta, R)> {
    let root_fd = fsat::open_dir(root).map_err(io_err(root, "open layer directory"))?;
    let mut unpacker = Unpacker {
        layer,
        root_path: root,
        root: root_fd,
        meta: LayerMeta::default(),
        // The root counts as implied until the tar names `./`.
        implicit: HashSet::from([Vec::new()]),
        dir_mtimes: HashMap::new(),
        buffer: vec![0; 256 * 1024],
    };
    let mut archive = tar::Archive::new(reader);
    let corrupt =
        |e: io::Error| ImageError::invalid(layer, format!("layer tar is unreadable: {e}"));
    for entry in archive.entries().map_err(corrupt)? {
        let mut entry = entry.map_err(corrupt)?;
        unpacker.entry(&mut entry)?;
    }
    unpacker.finish()?;
    Ok((unpacker.meta, archive.into_inner()))
}

impl Unpacker<'_> {
    fn unsafe_entry(&self, entry: &[u8], reason: &'static str) -> ImageError {
        ImageError::UnsafeLayer {
            layer: self.layer.to_owned(),
            entry: String::from_utf8_lossy(entry).into_owned(),
            reason,
        }
    }

    fn invalid(&self, reason: String) -> ImageError {
        ImageError::invalid(self.layer, reason)
    }

    fn host_path(&self, components: &[OsString]) -> PathBuf {
        components
            .iter()
            .fold(self.root_path.to_path_buf(), |p, c| p.join(c))
    }

    /// Splits an entry path into components; `..` is refused, `.` and empty
    /// components (leading `/`, `./`, doubled slashes) are dropped, so absolute
    /// names are taken relative to the layer root.
    fn components(&self, raw: &[u8]) -> Result<Vec<OsString>> {
        let mut out = Vec::new();
        for part in raw.split(|b| *b == b'/') {
            match part {
                b"" | b"." => {}
                b".." => return Err(self.unsafe_entry(raw, "a path component is `..`")),
                _ => out.push(OsStr::from_bytes(part).to_owned()),
            }
        }
        Ok(out)
    }

    /// Opens the parent directory of an entry, making missing directories.
    fn parent(&mut self, raw: &[u8], components: &[OsString]) -> Result<OwnedFd> {
        let parent = &components[..components.len() - 1];
        let mut created = Vec::new();
        let fd = fsat::walk(self.root.as_fd(), parent, true, |depth| created.push(depth));
        for depth in created {
            self.implicit.insert(parent[..depth].to_vec());
        }
        fd.map_err(|e| match e {
            WalkError::ThroughSymlink => {
                self.unsafe_entry(raw, "its path goes through a symbolic link")
            }
            WalkError::NotADirectory => {
                self.unsafe_entry(raw, "a parent in its path is not a directory")
            }
            WalkError::Missing => self.invalid("a parent directory vanished".into()),
            WalkError::Io(e) => io_err(self.host_path(parent), "create directory")(e),
        })
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<()> {
        let kind = entry.header().entry_type();
        if matches!(kind, EntryType::XGlobalHeader) {
            return Ok(());
        }
        let raw_path = entry.path_bytes().into_owned();
        let components = self.components(&raw_path)?;
        let meta = self.entry_meta(entry, &raw_path)?;

        let Some(name) = components.last().cloned() else {
            // `./` itself: the metadata of the layer's root directory.
            if kind == EntryType::Directory {
                let root = fsat::open_dir(self.root_path)
                    .map_err(io_err(self.root_path, "open layer directory"))?;
                self.set_dir_meta(&root, &meta, &components)?;
            }
            return Ok(());
        };
        let parent = self.parent(&raw_path, &components)?;
        let path = self.host_path(&components);
        if !self.meta.external_links.is_empty() {
            // A later entry at a pending cross-layer hard link's path wins over
            // it; a later non-directory also replaces everything below its path.
            let replaced = join_bytes(&components);
            let whole_tree = kind != EntryType::Directory;
            self.meta.external_links.retain(|link| {
                let below = link.path.starts_with(&replaced)
                    && link.path.get(replaced.len()) == Some(&b'/');
                link.path != replaced && !(whole_tree && below)
            });
        }

        if name.as_bytes().starts_with(WHITEOUT_PREFIX) {
            // A whiteout marker: only its name matters.
            fsat::remove_at(parent.as_fd(), &name).map_err(io_err(&path, "replace"))?;
            let file = create_file(&parent, &name).map_err(io_err(&path, "create whiteout"))?;
            drop(file);
            return Ok(());
        }

        match kind {
            EntryType::Directory => {
                let existing =
                    fsat::lstat_at(parent.as_fd(), &name).map_err(io_err(&path, "inspect"))?;
                if existing.is_some_and(|s| fsat::file_type(&s) != FileType::Directory) {
                    fsat::remove_at(parent.as_fd(), &name).map_err(io_err(&path, "replace"))?;
                }
                if existing.is_none_or(|s| fsat::file_type(&s) != FileType::Directory) {
                    rustix::fs::mkdirat(&parent, &name, Mode::from_raw_mode(0o700))
                        .map_err(|e| io_err(&path, "create directory")(e.into()))?;
                }
                let dir = fsat::open_subdir(parent.as_fd(), &name)
                    .map_err(io_err(&path, "open directory"))?;
                self.set_dir_meta(&dir, &meta, &components)?;
            }
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                fsat::remove_at(parent.as_fd(), &name).map_err(io_err(&path, "replace"))?;
                let mut file = create_file(&parent, &name).map_err(io_err(&path, "create file"))?;
                self.meta.file_bytes += self.copy_content(entry, &mut file, &path)?;
                set_owner_and_mode(file.as_fd(), &meta)
                    .map_err(io_err(&path, "set owner and mode of"))?;
                self.set_xattrs(&meta, &path, |attr, value| {
                    fsat::set_xattr(file.as_fd(), attr, value)
                })?;
                rustix::fs::futimens(&file, &fsat::timestamps(meta.mtime))
                    .map_err(|e| io_err(&path, "set times of")(e.into()))?;
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| {
                        self.invalid(format!("symlink {} has no target", path.display()))
                    })?
                    .into_owned();
                fsat::remove_at(parent.as_fd(), &name).map_err(io_err(&path, "replace"))?;
                // The target is stored as data and never resolved here.
                rustix::fs::symlinkat(OsStr::from_bytes(&target), &parent, &name)
                    .map_err(|e| io_err(&path, "create symlink")(e.into()))?;
                rustix::fs::chownat(
                    &parent,
                    &name,
                    Some(meta.uid),
                    Some(meta.gid),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(|e| io_err(&path, "set owner of")(e.into()))?;
                self.set_xattrs(&meta, &path, |attr, value| {
                    fsat::set_link_xattr(parent.as_fd(), &name, attr, value)
                })?;
                rustix::fs::utimensat(
                    &parent,
                    &name,
                    &fsat::timestamps(meta.mtime),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(|e| io_err(&path, "set times of")(e.into()))?;
            }
            EntryType::Link => self.hard_link(entry, &raw_path, &components, &parent)?,
            EntryType::Fifo => {
                fsat::remove_at(parent.as_fd(), &name).map_err(io_err(&path, "replace"))?;
                rustix::fs::mknodat(
                    &parent,
                    &name,
                    FileType::Fifo,
                    Mode::from_raw_mode(0o600),
                    0,
                )
                .map_err(|e| io_err(&path, "create fifo")(e.into()))?;
                rustix::fs::chownat(
                    &parent,
                    &name,
                    Some(meta.uid),
                    Some(meta.gid),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(|e| io_err(&path, "set owner of")(e.into()))?;
                rustix::fs::chmodat(
                    &parent,
                    &name,
                    Mode::from_raw_mode(meta.mode),
                    AtFlags::empty(),
                )
                .map_err(|e| io_err(&path, "set mode of")(e.into()))?;
                rustix::fs::utimensat(
                    &parent,
                    &name,
                    &fsat::timestamps(meta.mtime),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(|e| io_err(&path, "set times of")(e.into()))?;
            }
            EntryType::Char | EntryType::Block => self.meta.skipped_devices += 1,
            other => {
                return Err(self.invalid(format!(
                    "entry {} has an unsupported tar type {:?}",
                    path.display(),
                    other
                )))
            }
        }
        Ok(())
    }

    fn entry_meta<R: Read>(
        &self,
        entry: &mut tar::Entry<'_, R>,
        raw_path: &[u8],
    ) -> Result<EntryMeta> {
        let header = entry.header();
        let bad = |what: &str, e: io::Error| {
            self.invalid(format!(
                "entry {} has a bad {what}: {e}",
                String::from_utf8_lossy(raw_path)
            ))
        };
        let mode = header.mode().map_err(|e| bad("mode", e))? & 0o7777;
        // The tar crate has already applied PAX `uid`/`gid` overrides to the header.
        let id =
            |value: u64| -> Option<u32> { u32::try_from(value).ok().filter(|v| *v != u32::MAX) };
        let uid = id(header.uid().map_err(|e| bad("uid", e))?)
            .ok_or_else(|| bad("uid", io::Error::other("out of range")))?;
        let gid = id(header.gid().map_err(|e| bad("gid", e))?)
            .ok_or_else(|| bad("gid", io::Error::other("out of range")))?;
        let mut mtime = Timespec {
            tv_sec: i64::try_from(header.mtime().map_err(|e| bad("mtime", e))?).unwrap_or(i64::MAX),
            tv_nsec: 0,
        };
        let mut xattrs = Vec::new();
        if let Some(extensions) = entry.pax_extensions().map_err(|e| bad("PAX header", e))? {
            for extension in extensions {
                let extension = extension.map_err(|e| bad("PAX header", e))?;
                let Ok(key) = extension.key() else { continue };
                if let Some(attr) = key.strip_prefix("SCHILY.xattr.") {
                    xattrs.push((OsString::from(attr), extension.value_bytes().to_vec()));
                } else if key == "mtime" {
                    if let Some(precise) = parse_pax_time(extension.value_bytes()) {
                        mtime = precise;
                    }
                }
            }
        }
        Ok(EntryMeta {
            mode,
            uid: Uid::from_raw(uid),
            gid: Gid::from_raw(gid),
            mtime,
            xattrs,
        })
    }

    fn copy_content<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        file: &mut File,
        path: &Path,
    ) -> Result<u64> {
        let mut total = 0u64;
        loop {
            let n = match entry.read(&mut self.buffer) {
                Ok(0) => return Ok(total),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.invalid(format!("layer tar is unreadable: {e}"))),
            };
            file.write_all(&self.buffer[..n])
                .map_err(io_err(path, "write"))?;
            total += n as u64;
        }
    }

    fn hard_link<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        raw_path: &[u8],
        components: &[OsString],
        parent: &OwnedFd,
    ) -> Result<()> {
        let path = self.host_path(components);
        let name = components.last().expect("checked by the caller");
        let raw_target = entry
            .link_name_bytes()
            .ok_or_else(|| self.invalid(format!("hard link {} has no target", path.display())))?
            .into_owned();
        // Link targets are archive paths, relative to the root like entry names.
        let target = self.components(&raw_target)?;
        if target.is_empty() {
            return Err(self.invalid(format!("hard link {} points at the root", path.display())));
        }
        if target == components {
            return Ok(());
        }
        let target_parent = match fsat::walk(
            self.root.as_fd(),
            &target[..target.len() - 1],
            false,
            |_| {},
        ) {
            Ok(fd) => Some(fd),
            Err(WalkError::Missing) => None,
            Err(WalkError::ThroughSymlink) => {
                return Err(
                    self.unsafe_entry(raw_path, "its link target goes through a symbolic link")
                )
            }
            Err(WalkError::NotADirectory) => {
                return Err(
                    self.unsafe_entry(raw_path, "its link target's parent is not a directory")
                )
            }
            Err(WalkError::Io(e)) => return Err(io_err(&path, "resolve link target of")(e)),
        };
        let target_name = target.last().expect("not empty");
        let target_stat = match &target_parent {
            Some(fd) => fsat::lstat_at(fd.as_fd(), target_name)
                .map_err(io_err(&path, "inspect link target of"))?,
            None => None,
        };
        fsat::remove_at(parent.as_fd(), name).map_err(io_err(&path, "replace"))?;
        match (target_parent, target_stat) {
            (Some(target_parent), Some(stat)) => {
                if fsat::file_type(&stat) == FileType::Directory {
                    return Err(self.invalid(format!(
                        "hard link {} points at a directory",
                        path.display()
                    )));
                }
                // Flags 0: a link to a symlink links the symlink itself.
                rustix::fs::linkat(&target_parent, target_name, parent, name, AtFlags::empty())
                    .map_err(|e| io_err(&path, "create hard link")(e.into()))?;
            }
            _ => self.meta.external_links.push(ExternalLink {
                path: join_bytes(components),
                target: join_bytes(&target),
            }),
        }
        Ok(())
    }

    fn set_dir_meta(
        &mut self,
        dir: &OwnedFd,
        meta: &EntryMeta,
        components: &[OsString],
    ) -> Result<()> {
        let path = self.host_path(components);
        self.implicit.remove(components);
        set_owner_and_mode(dir.as_fd(), meta).map_err(io_err(&path, "set owner and mode of"))?;
        self.set_xattrs(meta, &path, |attr, value| {
            fsat::set_xattr(dir.as_fd(), attr, value)
        })?;
        // Applied last (in `finish`): creating entries inside changes it.
        self.dir_mtimes.insert(components.to_vec(), meta.mtime);
        Ok(())
    }

    fn set_xattrs(
        &self,
        meta: &EntryMeta,
        path: &Path,
        mut set: impl FnMut(&OsStr, &[u8]) -> io::Result<()>,
    ) -> Result<()> {
        for (attr, value) in &meta.xattrs {
            if !xattr_allowed(attr.as_bytes()) {
                tracing::debug!(layer = self.layer, path = %path.display(), attr = ?attr, "xattr left out");
                continue;
            }
            match set(attr, value) {
                Ok(()) => {}
                // A namespace this filesystem does not store: not fatal for the image.
                Err(e) if e.raw_os_error() == Some(libc_enotsup()) => {
                    tracing::warn!(layer = self.layer, path = %path.display(), attr = ?attr, "xattr not supported here, left out");
                }
                Err(e) => return Err(io_err(path, "set xattr on")(e)),
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        let mut dirs: Vec<_> = self.dir_mtimes.drain().collect();
        // Deepest first, so setting a child's time does not disturb its parent's.
        dirs.sort_by_key(|d| std::cmp::Reverse(d.0.len()));
        for (components, mtime) in dirs {
            match fsat::walk(self.root.as_fd(), &components, false, |_| {}) {
                Ok(dir) => rustix::fs::futimens(&dir, &fsat::timestamps(mtime))
                    .map_err(|e| io_err(self.host_path(&components), "set times of")(e.into()))?,
                // Replaced by a later entry: nothing to date.
                Err(WalkError::Missing | WalkError::NotADirectory | WalkError::ThroughSymlink) => {}
                Err(WalkError::Io(e)) => {
                    return Err(io_err(self.host_path(&components), "open")(e))
                }
            }
        }
        let mut implicit: Vec<_> = self.implicit.drain().map(|c| join_bytes(&c)).collect();
        implicit.sort();
        self.meta.implicit_dirs = implicit;
        Ok(())
    }
}

fn create_file(parent: &OwnedFd, name: &OsStr) -> io::Result<File> {
    let fd = rustix::fs::openat(
        parent,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    Ok(File::from(fd))
}

/// Owner first: `chown` clears setuid/setgid bits and file capabilities, so
/// the mode and the xattrs come after it.
fn set_owner_and_mode(fd: std::os::fd::BorrowedFd<'_>, meta: &EntryMeta) -> io::Result<()> {
    rustix::fs::fchown(fd, Some(meta.uid), Some(meta.gid))?;
    rustix::fs::fchmod(fd, Mode::from_raw_mode(meta.mode))?;
    Ok(())
}

/// Which xattrs from a tar are applied. `trusted.overlay.*` and
/// `user.overlay.*` are overlayfs's own control attributes: on a lower layer
/// they would redirect or hide paths in every sandbox made from the image.
pub(crate) fn xattr_allowed(name: &[u8]) -> bool {
    let overlay = name.starts_with(b"trusted.overlay.") || name.starts_with(b"user.overlay.");
    let known_namespace = [&b"user."[..], b"security.", b"trusted.", b"system."]
        .iter()
        .any(|ns| name.starts_with(ns));
    known_namespace && !overlay
}

fn libc_enotsup() -> i32 {
    rustix::io::Errno::NOTSUP.raw_os_error()
}

/// PAX times are decimal seconds with an optional fraction: `1700000000.25`.
fn parse_pax_time(value: &[u8]) -> Option<Timespec> {
    let text = std::str::from_utf8(value).ok()?;
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    let tv_sec: i64 = secs.parse().ok()?;
    let digits: String = frac.chars().take(9).collect();
    let tv_nsec = if digits.is_empty() {
        0
    } else {
        let parsed: i64 = digits.parse().ok()?;
        parsed * 10i64.pow(9 - digits.len() as u32)
    };
    // Negative times with a fraction count the fraction backwards.
    if tv_sec < 0 && tv_nsec > 0 {
        return Some(Timespec {
            tv_sec: tv_sec - 1,
            tv_nsec: 1_000_000_000 - tv_nsec,
        });
    }
    Some(Timespec { tv_sec, tv_nsec })
}

pub(crate) fn join_bytes(components: &[OsString]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, c) in components.iter().enumerate() {
        if i > 0 {
            out.push(b'/');
        }
        out.extend_from_slice(c.as_bytes());
    }
    out
}

pub(crate) fn split_bytes(path: &[u8]) -> Vec<OsString> {
    path.split(|b| *b == b'/')
        .filter(|p| !p.is_empty())
        .map(|p| OsStr::from_bytes(p).to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_times() {
        assert_eq!(
            parse_pax_time(b"1700000000"),
            Some(Timespec {
                tv_sec: 1_700_000_000,
                tv_nsec: 0
            })
        );
        assert_eq!(
            parse_pax_time(b"12.5"),
            Some(Timespec {
                tv_sec: 12,
                tv_nsec: 500_000_000
            })
        );
        assert_eq!(
            parse_pax_time(b"-1.25"),
            Some(Timespec {
                tv_sec: -2,
                tv_nsec: 750_000_000
            })
        );
        assert_eq!(parse_pax_time(b"x"), None);
    }

    #[test]
    fn overlay_xattrs_are_left_out() {
        assert!(xattr_allowed(b"security.capability"));
        assert!(xattr_allowed(b"user.comment"));
        assert!(!xattr_allowed(b"trusted.overlay.opaque"));
        assert!(!xattr_allowed(b"user.overlay.redirect"));
        assert!(!xattr_allowed(b"weird.namespace"));
    }
}
