//! The tree walk shared by search, find and watch: depth first, sorted, never
//! following a symlink below the root, never entering kernel pseudo-filesystems
//! (`/proc`, `/sys`, cgroup, debug and security fs) unless the walk starts there,
//! and stopping as soon as its [`Cancel`] flag is raised.
//!
//! Reading `/proc/<pid>/…` files can block or be enormous, and a search of `/`
//! is a normal request, so pseudo-filesystems are only entered on purpose.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nix::sys::statfs::{self, FsType};

use crate::error::ApiError;

/// A flag that a request handler raises when it is dropped (the client went
/// away), so a walk on a blocking thread stops instead of running to the end.
#[derive(Debug, Clone, Default)]
pub(super) struct Cancel(Arc<AtomicBool>);

impl Cancel {
    pub(super) fn is_raised(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// A guard that raises the flag when dropped.
    pub(super) fn guard(&self) -> CancelOnDrop {
        CancelOnDrop(self.clone())
    }
}

#[derive(Debug)]
pub(super) struct CancelOnDrop(Cancel);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0 .0.store(true, Ordering::Relaxed);
    }
}

/// One entry the walk reached.
pub(super) struct Entry<'a> {
    pub path: &'a Path,
    pub metadata: &'a Metadata,
    /// 0 for the root, 1 for its children, and so on.
    pub depth: usize,
}

/// Walks `root` (following it if it is a symlink), calling `visit` for the root
/// and every entry below it. `visit` returns whether to descend into a
/// directory. A missing or unreadable root is an error naming it; unreadable
/// entries below it are skipped.
pub(super) fn walk(
    root: &Path,
    cancel: &Cancel,
    mut visit: impl FnMut(&Entry<'_>) -> bool,
) -> Result<(), ApiError> {
    let metadata = std::fs::metadata(root).map_err(|e| ApiError::io(root, e))?;
    let descend = visit(&Entry {
        path: root,
        metadata: &metadata,
        depth: 0,
    });
    if !(descend && metadata.is_dir()) {
        return Ok(());
    }
    // Children are read when their directory is reached, so memory holds one
    // pending list per level, not the whole tree.
    let mut stack = vec![Level {
        entries: children(root).map_err(|e| ApiError::io(root, e))?,
        depth: 1,
        dev: metadata.dev(),
    }];
    while let Some(level) = stack.last_mut() {
        if cancel.is_raised() {
            return Ok(());
        }
        let Some((path, metadata)) = level.entries.pop() else {
            stack.pop();
            continue;
        };
        let (depth, parent_dev) = (level.depth, level.dev);
        let descend = visit(&Entry {
            path: &path,
            metadata: &metadata,
            depth,
        });
        if descend && metadata.is_dir() && !is_pseudo_mount(&path, &metadata, parent_dev) {
            if let Ok(entries) = children(&path) {
                stack.push(Level {
                    entries,
                    depth: depth + 1,
                    dev: metadata.dev(),
                });
            }
        }
    }
    Ok(())
}

/// The entries of one directory still to visit, and where they sit.
struct Level {
    entries: Vec<(PathBuf, Metadata)>,
    depth: usize,
    /// Device of the directory holding them.
    dev: u64,
}

/// Entries of `dir`, sorted so that `pop` yields them in name order.
fn children(dir: &Path) -> std::io::Result<Vec<(PathBuf, Metadata)>> {
    let mut list: Vec<(PathBuf, Metadata)> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let path = entry.path();
            let metadata = std::fs::symlink_metadata(&path).ok()?;
            Some((path, metadata))
        })
        .collect();
    list.sort_by(|a, b| b.0.cmp(&a.0));
    Ok(list)
}

/// Whether `dir` is the root of a kernel pseudo-filesystem mounted below the
/// walk's root. Only a change of device is checked with statfs, so ordinary
/// directories cost no extra system call.
fn is_pseudo_mount(dir: &Path, metadata: &Metadata, parent_dev: u64) -> bool {
    if metadata.dev() == parent_dev {
        return false;
    }
    const PSEUDO: [FsType; 7] = [
        statfs::PROC_SUPER_MAGIC,
        statfs::SYSFS_MAGIC,
        statfs::CGROUP_SUPER_MAGIC,
        statfs::CGROUP2_SUPER_MAGIC,
        statfs::DEBUGFS_MAGIC,
        statfs::TRACEFS_MAGIC,
        statfs::SECURITYFS_MAGIC,
    ];
    statfs::statfs(dir).is_ok_and(|fs| PSEUDO.contains(&fs.filesystem_type()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_in_name_order_without_following_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("b/c")).unwrap();
        std::fs::write(dir.path().join("a.txt"), "x").unwrap();
        std::fs::write(dir.path().join("b/c/d.txt"), "x").unwrap();
        std::os::unix::fs::symlink(dir.path(), dir.path().join("loop")).unwrap();
        let mut seen = Vec::new();
        walk(dir.path(), &Cancel::default(), |entry| {
            let relative = entry.path.strip_prefix(dir.path()).unwrap();
            seen.push((relative.to_string_lossy().into_owned(), entry.depth));
            true
        })
        .unwrap();
        let expected = [
            ("", 0),
            ("a.txt", 1),
            ("b", 1),
            ("b/c", 2),
            ("b/c/d.txt", 3),
            ("loop", 1),
        ];
        let expected: Vec<_> = expected.iter().map(|(p, d)| (p.to_string(), *d)).collect();
        assert_eq!(seen, expected);
    }

    #[test]
    fn a_raised_flag_stops_the_walk() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..10 {
            std::fs::write(dir.path().join(format!("{i}")), "x").unwrap();
        }
        let cancel = Cancel::default();
        let guard = cancel.guard();
        let mut seen = 0;
        walk(dir.path(), &cancel, |_| {
            seen += 1;
            true
        })
        .unwrap();
        assert_eq!(seen, 11);
        drop(guard);
        let mut after = 0;
        walk(dir.path(), &cancel, |_| {
            after += 1;
            true
        })
        .unwrap();
        assert_eq!(after, 1, "only the root is visited once cancelled");
    }

    #[test]
    fn a_missing_root_is_not_found() {
        let error = walk(Path::new("/nonexistent/cove"), &Cancel::default(), |_| true).unwrap_err();
        assert_eq!(error.status(), axum::http::StatusCode::NOT_FOUND);
    }
}
