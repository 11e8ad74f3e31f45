//! Where a container sandbox keeps its files on the host: `{state_dir}/{id}/` holds the
//! writable layer (`upper`, `work`), the mount point of the merged root (`rootfs`, mounted
//! only inside the container's own mount namespace), `run/agent.sock` and `console.log`.
//! Pure path arithmetic; nothing here touches the disk.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `sun_path` is 108 bytes including the terminating NUL.
pub(super) const MAX_SOCKET_PATH: usize = 107;

#[derive(Clone, Debug)]
pub(super) struct SandboxLayout {
    pub dir: PathBuf,
}

impl SandboxLayout {
    pub(super) fn new(state_dir: &Path, id: &str) -> Self {
        Self {
            dir: state_dir.join(id),
        }
    }

    pub(super) fn upper(&self) -> PathBuf {
        self.dir.join("upper")
    }

    pub(super) fn work(&self) -> PathBuf {
        self.dir.join("work")
    }

    /// Mount point of the overlay; stays an empty directory on the host.
    pub(super) fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }

    pub(super) fn run(&self) -> PathBuf {
        self.dir.join("run")
    }

    pub(super) fn agent_socket(&self) -> PathBuf {
        self.run().join("agent.sock")
    }

    pub(super) fn console(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    /// The directories `prepare` makes.
    pub(super) fn dirs(&self) -> [PathBuf; 4] {
        [self.upper(), self.work(), self.rootfs(), self.run()]
    }
}

/// A host path a container cannot use.
#[derive(Debug, thiserror::Error)]
pub enum PathRefused {
    #[error("socket path {} is {len} bytes, more than the {MAX_SOCKET_PATH} a unix socket allows; use a shorter state or data directory", path.display())]
    SocketTooLong { path: PathBuf, len: usize },
    #[error("path {} contains ',', ':' or '\\', which overlayfs options cannot carry", path.display())]
    OverlaySeparator { path: PathBuf },
}

/// Rejects a socket path the kernel could not bind, with the reason.
pub(super) fn check_socket_path(path: &Path) -> Result<(), PathRefused> {
    let len = path.as_os_str().as_bytes().len();
    if len > MAX_SOCKET_PATH {
        return Err(PathRefused::SocketTooLong {
            path: path.to_owned(),
            len,
        });
    }
    Ok(())
}

/// Rejects a path that would break overlayfs's comma- and colon-separated options.
pub(super) fn check_overlay_path(path: &Path) -> Result<(), PathRefused> {
    let bytes = path.as_os_str().as_bytes();
    if bytes.iter().any(|b| matches!(b, b',' | b':' | b'\\')) {
        return Err(PathRefused::OverlaySeparator {
            path: path.to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_live_under_the_sandbox_dir() {
        let layout = SandboxLayout::new(Path::new("/var/lib/cove"), "sb1");
        assert_eq!(
            layout.agent_socket(),
            Path::new("/var/lib/cove/sb1/run/agent.sock")
        );
        assert_eq!(layout.upper(), Path::new("/var/lib/cove/sb1/upper"));
        assert_eq!(layout.console(), Path::new("/var/lib/cove/sb1/console.log"));
    }

    #[test]
    fn socket_path_limit_is_checked() {
        assert!(check_socket_path(Path::new("/short/agent.sock")).is_ok());
        let long = PathBuf::from(format!("/{}", "x".repeat(107)));
        let err = check_socket_path(&long).unwrap_err().to_string();
        assert!(err.contains("108") || err.contains("107"), "{err}");
    }

    #[test]
    fn overlay_paths_reject_separators() {
        assert!(check_overlay_path(Path::new("/var/lib/a")).is_ok());
        assert!(check_overlay_path(Path::new("/var/lib/a,b")).is_err());
        assert!(check_overlay_path(Path::new("/var/lib/a:b")).is_err());
    }
}
