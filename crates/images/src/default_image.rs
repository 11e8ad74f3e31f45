//! The default image: a Debian root filesystem built with debootstrap the
//! first time it is needed, kept in the image directory beside the cache of
//! pulled images (`store.rs`). Built once, atomically (a `.partial`
//! directory renamed into place), under a file lock so concurrent servers
//! build it once. A finished image is never written again: sandboxes mount
//! it read-only as the lower layer of an overlay.

use std::fs::{self, File};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::{io_err, ImageError, Result};
use crate::fsat;
use crate::store::ImageStore;

/// The Debian suite of the default image.
pub const DEFAULT_SUITE: &str = "bookworm";
/// What the default image holds beyond a minimal base.
pub const DEFAULT_PACKAGES: &[&str] = &[
    "python3",
    "python3-pip",
    "git",
    "curl",
    "procps",
    "ca-certificates",
    "bash",
    "less",
    "sudo",
    // The desktop computer use drives (started only by `computeruse/start`):
    // an X server, a window manager and panel, a terminal, VNC and noVNC for
    // a person to watch, the accessibility bus and GTK's bridge to it, a GTK
    // dialog program, and ffmpeg for recordings.
    "xvfb",
    "xfonts-base",
    "xfwm4",
    "xfce4-panel",
    "xterm",
    "x11vnc",
    "novnc",
    // What debootstrap, which does not resolve virtual packages, must be told:
    // the provider of python3-cryptography's cffi API (for websockify).
    "python3-cffi-backend",
    "dbus",
    "dbus-x11",
    "at-spi2-core",
    "libatk-adaptor",
    "zenity",
    "ffmpeg",
    // Language servers for `lsp/start`: Python's here, TypeScript's on Node.
    "python3-pylsp",
    "nodejs",
];
/// The user the default image's sandboxes run as, as in Daytona's default
/// snapshot: uid 1000, home `/home/daytona`, passwordless `sudo`.
pub const DEFAULT_USER: &str = "daytona";
const DEFAULT_UID: &str = "1000";
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
/// The file a finished default root filesystem holds. cove-runtime's VM
/// disk cache keys on its time (`vm/disk.rs` names the same file).
pub const COMPLETE_MARKER: &str = ".complete";
/// What a finished image's marker says. An image whose marker says anything
/// else was built by an older cove (without the default user, say) and is
/// built again.
const IMAGE_VERSION: &str = "cove-default 4\n";

/// One step of the default image's build, for a progress display.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DefaultImageProgress {
    /// Lines of debootstrap's progress seen so far.
    pub step: usize,
    /// What it is doing now, e.g. "Extracting python3".
    pub message: String,
}

impl ImageStore {
    /// Where the default root filesystem lives once built.
    pub fn default_rootfs(&self) -> PathBuf {
        self.dir
            .join(format!("debian-{DEFAULT_SUITE}"))
            .join("rootfs")
    }

    pub fn default_is_built(&self) -> bool {
        fs::read_to_string(self.default_rootfs().join(COMPLETE_MARKER))
            .is_ok_and(|marker| marker == IMAGE_VERSION)
    }

    /// Returns the default root filesystem, building it first if needed. Blocking:
    /// call it from a blocking thread. Concurrent callers (two servers sharing the
    /// directory) wait for one build.
    pub fn ensure_default(
        &self,
        mut progress: impl FnMut(&DefaultImageProgress),
    ) -> Result<PathBuf> {
        let rootfs = self.default_rootfs();
        if self.default_is_built() {
            return Ok(rootfs);
        }
        fs::create_dir_all(&self.dir).map_err(io_err(&self.dir, "create"))?;
        let lock_path = self.dir.join(".build.lock");
        let _lock = fsat::lock_file(&lock_path).map_err(io_err(&lock_path, "lock"))?;
        if self.default_is_built() {
            return Ok(rootfs);
        }

        let partial = self.dir.join(format!("debian-{DEFAULT_SUITE}.partial"));
        if partial.exists() {
            fs::remove_dir_all(&partial).map_err(io_err(&partial, "remove an unfinished build"))?;
        }
        let log_path = self.dir.join(format!("debian-{DEFAULT_SUITE}.build.log"));
        let mirror = std::env::var("COVE_DEBIAN_MIRROR").unwrap_or_else(|_| DEFAULT_MIRROR.into());
        run_debootstrap(&partial.join("rootfs"), &mirror, &log_path, &mut progress)?;
        finish_rootfs(&partial.join("rootfs"))
            .map_err(io_err(&partial, "finish the root filesystem"))?;
        add_default_user(&partial.join("rootfs"))?;
        crate::npm_tools::install_npm_tools(&partial.join("rootfs"))?;
        let complete = partial.join("rootfs").join(COMPLETE_MARKER);
        fs::write(&complete, IMAGE_VERSION).map_err(io_err(&complete, "mark complete"))?;
        let target = rootfs.parent().expect("rootfs has a parent");
        if target.exists() {
            fs::remove_dir_all(target).map_err(io_err(target, "remove an old image"))?;
        }
        fs::rename(&partial, target).map_err(io_err(target, "move the finished image in place"))?;
        Ok(rootfs)
    }
}

fn run_debootstrap(
    target: &Path,
    mirror: &str,
    log_path: &Path,
    progress: &mut impl FnMut(&DefaultImageProgress),
) -> Result<()> {
    let program = ["/usr/sbin/debootstrap", "/usr/bin/debootstrap"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .ok_or(ImageError::NoDebootstrap)?;
    let log = File::create(log_path).map_err(io_err(log_path, "create the build log"))?;
    let log_err = log
        .try_clone()
        .map_err(io_err(log_path, "open the build log"))?;
    let mut child = Command::new(program)
        .arg("--variant=minbase")
        .arg(format!("--include={}", DEFAULT_PACKAGES.join(",")))
        .arg(DEFAULT_SUITE)
        .arg(target)
        .arg(mirror)
        .stdout(Stdio::piped())
        .stderr(log_err)
        .spawn()
        .map_err(io_err(target, "run debootstrap into"))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut log = std::io::BufWriter::new(log);
    let mut step = 0;
    for line in BufReader::new(stdout)
        .lines()
        .map_while(std::io::Result::ok)
    {
        use std::io::Write;
        let _ = writeln!(log, "{line}");
        if let Some(message) = line.strip_prefix("I: ") {
            step += 1;
            progress(&DefaultImageProgress {
                step,
                message: message.trim_end_matches("...").to_owned(),
            });
        }
    }
    let status = child
        .wait()
        .map_err(io_err(target, "wait for debootstrap building"))?;
    if !status.success() {
        return Err(ImageError::Debootstrap {
            status: status.to_string(),
            log: log_path.to_owned(),
        });
    }
    Ok(())
}

/// Adds the default user with the host's `useradd`, which works inside the
/// root filesystem (`--root`), so the image's own `/etc/skel` and groups are
/// used; then lets it use `sudo` without a password.
fn add_default_user(rootfs: &Path) -> Result<()> {
    let status = Command::new("useradd")
        .arg("--root")
        .arg(rootfs)
        .args(["--create-home", "--uid", DEFAULT_UID, "--user-group"])
        .args(["--shell", "/bin/bash", "--groups", "sudo", DEFAULT_USER])
        .stdin(Stdio::null())
        .status()
        .map_err(io_err(rootfs, "run useradd in"))?;
    if !status.success() {
        return Err(ImageError::Io {
            path: rootfs.to_owned(),
            action: "add the default user to",
            source: std::io::Error::other(format!("useradd: {status}")),
        });
    }
    let sudoers = rootfs.join("etc/sudoers.d").join(DEFAULT_USER);
    fs::write(&sudoers, format!("{DEFAULT_USER} ALL=(ALL) NOPASSWD:ALL\n"))
        .and_then(|()| fs::set_permissions(&sudoers, fs::Permissions::from_mode(0o440)))
        .map_err(io_err(&sudoers, "write"))?;
    Ok(())
}

/// Trims caches and removes what debootstrap copied from the host.
fn finish_rootfs(rootfs: &Path) -> std::io::Result<()> {
    for dir in ["var/lib/apt/lists", "var/cache/apt/archives"] {
        let dir = rootfs.join(dir);
        for entry in fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_file() && path.file_name().is_some_and(|n| n != "lock") {
                fs::remove_file(path)?;
            }
        }
    }
    for cache in [
        "var/cache/apt/pkgcache.bin",
        "var/cache/apt/srcpkgcache.bin",
    ] {
        let _ = fs::remove_file(rootfs.join(cache));
    }
    // A sandbox must never inherit the host's resolver: its DNS is cove's business.
    fs::write(rootfs.join("etc/resolv.conf"), "# managed by cove\n")?;
    fs::write(rootfs.join("etc/hostname"), "sandbox\n")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_image_is_found_without_building() {
        let dir = tempfile::tempdir().unwrap();
        let store = ImageStore::new(dir.path());
        assert!(!store.default_is_built());
        fs::create_dir_all(store.default_rootfs()).unwrap();
        File::create(store.default_rootfs().join(COMPLETE_MARKER)).unwrap();
        assert!(
            !store.default_is_built(),
            "an image from an older cove is built again"
        );
        fs::write(store.default_rootfs().join(COMPLETE_MARKER), IMAGE_VERSION).unwrap();
        let mut calls = 0;
        let rootfs = store.ensure_default(|_| calls += 1).unwrap();
        assert_eq!(rootfs, store.default_rootfs());
        assert_eq!(calls, 0);
    }

    #[test]
    fn finishing_replaces_the_hosts_resolver() {
        let dir = tempfile::tempdir().unwrap();
        for sub in ["var/lib/apt/lists", "var/cache/apt/archives", "etc"] {
            fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        fs::write(dir.path().join("etc/resolv.conf"), "nameserver 8.8.8.8\n").unwrap();
        fs::write(dir.path().join("var/lib/apt/lists/big_Packages"), "x").unwrap();
        finish_rootfs(dir.path()).unwrap();
        let resolv = fs::read_to_string(dir.path().join("etc/resolv.conf")).unwrap();
        assert!(!resolv.contains("nameserver"));
        assert!(!dir.path().join("var/lib/apt/lists/big_Packages").exists());
    }
}
