//! The disks of VMs: the read-only base image every root disk starts from,
//! and the qcow2 files over it.
//!
//! A base is a raw ext4 image made from an image's root filesystem with
//! `mkfs.ext4 -d` (no mount needed) and the static agent written into it at
//! [`AGENT_IN_GUEST`] with `debugfs`. It is cached in `{assets}/bases/` under
//! a key of the root filesystem and the agent binary, built once under a file
//! lock, and never changed or deleted: qcow2 files of sandboxes and captures
//! name it as their backing file. Its filesystem is the root filesystem's size
//! plus headroom; a larger disk is a larger qcow2 whose filesystem the agent
//! grows online at boot.

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::UNIX_EPOCH;

use nix::fcntl::{Flock, FlockArg};
use sha2::{Digest, Sha256};

/// Where the agent lives in every VM's root filesystem; the initramfs
/// execs it (`cove.init=` default of the first stage).
pub const AGENT_IN_GUEST: &str = "/usr/local/bin/cove-agent";
/// Bumped when the way a base is made changes.
const BASE_FORMAT: u32 = 1;
/// The file a finished default root filesystem holds (the name cove-images
/// writes, its `COMPLETE_MARKER`); its times stamp the image in the base key.
const COMPLETE_MARKER: &str = ".complete";
/// Free space a base filesystem gets beyond its files.
const BASE_HEADROOM: u64 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{path}: {action}")]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("`{command}` failed: {output}")]
    Command { command: String, output: String },
    #[error("{path} is not a qcow2 file")]
    NotQcow2 { path: PathBuf },
}

fn io_error(path: &Path, action: &'static str) -> impl FnOnce(io::Error) -> DiskError {
    let path = path.to_owned();
    move |source| DiskError::Io {
        path,
        action,
        source,
    }
}

fn run(command: &mut Command) -> Result<(), DiskError> {
    let output = command.output().map_err(|source| DiskError::Io {
        path: PathBuf::from(command.get_program()),
        action: "run",
        source,
    })?;
    if output.status.success() {
        return Ok(());
    }
    let mut text = String::from_utf8_lossy(&output.stderr).trim().to_owned();
    if text.is_empty() {
        text = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    }
    Err(DiskError::Command {
        command: format!("{command:?}"),
        output: text,
    })
}

/// The cache key of the base made from `rootfs` with `agent`: the image's
/// path and the time it was finished (images are never changed after), and
/// the agent's contents.
pub(super) fn base_key(rootfs: &Path, agent: &Path) -> Result<String, DiskError> {
    let mut hash = Sha256::new();
    hash.update(BASE_FORMAT.to_le_bytes());
    let rootfs = rootfs
        .canonicalize()
        .map_err(io_error(rootfs, "resolve the image"))?;
    hash.update(rootfs.as_os_str().as_encoded_bytes());
    let marker = rootfs.join(COMPLETE_MARKER);
    let stamp = fs::metadata(&marker)
        .or_else(|_| fs::metadata(&rootfs))
        .map_err(io_error(&rootfs, "read the image"))?;
    hash.update(stamp.mtime().to_le_bytes());
    hash.update(stamp.mtime_nsec().to_le_bytes());
    hash.update(stamp.ino().to_le_bytes());
    let mut file = File::open(agent).map_err(io_error(agent, "open the agent"))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(io_error(agent, "read the agent"))?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
    }
    Ok(hash
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The size of everything under `dir` (files as allocated, at least a block each).
fn tree_bytes(dir: &Path) -> io::Result<(u64, u64)> {
    let mut bytes = 0;
    let mut inodes = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let metadata = entry.metadata()?;
            inodes += 1;
            bytes += metadata.len().max(4096);
            if metadata.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    Ok((bytes, inodes))
}

/// Returns the base made from `rootfs` with `agent`, building it first if
/// needed. Blocking (seconds the first time). Concurrent callers, in this
/// process or another, wait for one build.
pub(super) fn ensure_base(cache: &Path, rootfs: &Path, agent: &Path) -> Result<PathBuf, DiskError> {
    let bases = cache.join("bases");
    fs::create_dir_all(&bases).map_err(io_error(&bases, "create"))?;
    let key = base_key(rootfs, agent)?;
    let base = bases.join(format!("{key}.raw"));
    if base.exists() {
        return Ok(base);
    }
    let lock_path = bases.join(".lock");
    let lock_file = File::create(&lock_path).map_err(io_error(&lock_path, "open the lock"))?;
    let _lock = Flock::lock(lock_file, FlockArg::LockExclusive)
        .map_err(|(_, errno)| io_error(&lock_path, "lock")(io::Error::from(errno)))?;
    if base.exists() {
        return Ok(base);
    }
    let partial = bases.join(format!("{key}.raw.partial"));
    let _ = fs::remove_file(&partial);
    let built = build_base(rootfs, agent, &partial);
    if let Err(error) = built {
        let _ = fs::remove_file(&partial);
        return Err(error);
    }
    // QEMU, which reads it as the backing file of every disk, runs unprivileged.
    fs::set_permissions(&partial, fs::Permissions::from_mode(0o644))
        .map_err(io_error(&partial, "make readable"))?;
    fs::rename(&partial, &base).map_err(io_error(&base, "move the finished base in place"))?;
    tracing::info!(base = %base.display(), rootfs = %rootfs.display(), "built a VM base disk");
    Ok(base)
}

fn build_base(rootfs: &Path, agent: &Path, dest: &Path) -> Result<(), DiskError> {
    let (files, inodes) = tree_bytes(rootfs).map_err(io_error(rootfs, "measure the image"))?;
    let agent_bytes = fs::metadata(agent)
        .map_err(io_error(agent, "read the agent"))?
        .len();
    // ext4's own metadata is a few percent; round to a whole 64 MiB.
    let wanted = (files + agent_bytes) * 11 / 10 + BASE_HEADROOM;
    let size = wanted.div_ceil(64 << 20) * (64 << 20);
    let file = File::create(dest).map_err(io_error(dest, "create"))?;
    file.set_len(size).map_err(io_error(dest, "size"))?;
    drop(file);
    let inode_count = (inodes * 2).max(65536);
    run(
        Command::new(tool(&["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"])?)
            .args(["-q", "-F", "-L", "cove-root", "-m", "0"])
            .arg("-N")
            .arg(inode_count.to_string())
            .arg("-d")
            .arg(rootfs)
            .arg(dest),
    )?;
    let agent = agent
        .canonicalize()
        .map_err(io_error(agent, "resolve the agent"))?;
    // An image need not have the agent's directory (a busybox image has no
    // /usr): each parent is made, which debugfs declines for one that exists.
    let parents: String = Path::new(AGENT_IN_GUEST)
        .ancestors()
        .skip(1)
        .filter(|dir| *dir != Path::new("/"))
        .collect::<Vec<_>>()
        .iter()
        .rev()
        .map(|dir| format!("mkdir {}\n", dir.display()))
        .collect();
    let script = format!(
        "{parents}rm {AGENT_IN_GUEST}\nwrite {} {AGENT_IN_GUEST}\nsif {AGENT_IN_GUEST} mode 0100755\n\
         sif {AGENT_IN_GUEST} uid 0\nsif {AGENT_IN_GUEST} gid 0\n",
        agent.display()
    );
    let script_path = dest.with_extension("debugfs");
    fs::write(&script_path, script).map_err(io_error(&script_path, "write"))?;
    let written = run(Command::new(tool(&["/usr/sbin/debugfs", "/sbin/debugfs"])?)
        .arg("-w")
        .arg("-f")
        .arg(&script_path)
        .arg(dest));
    let _ = fs::remove_file(&script_path);
    written?;
    verify_agent(dest, &agent)
}

/// debugfs reports some failures only on its output: check the file is there.
fn verify_agent(image: &Path, agent: &Path) -> Result<(), DiskError> {
    let output = Command::new(tool(&["/usr/sbin/debugfs", "/sbin/debugfs"])?)
        .arg("-R")
        .arg(format!("stat {AGENT_IN_GUEST}"))
        .arg(image)
        .output()
        .map_err(io_error(image, "inspect"))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let size = fs::metadata(agent)
        .map_err(io_error(agent, "read the agent"))?
        .len();
    if text.contains(&format!("Size: {size}")) && text.contains("Mode:  0755") {
        return Ok(());
    }
    Err(DiskError::Command {
        command: format!("debugfs write of {AGENT_IN_GUEST}"),
        output: format!(
            "the agent is not in the image as expected: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ),
    })
}

fn tool(candidates: &[&'static str]) -> Result<&'static str, DiskError> {
    candidates
        .iter()
        .copied()
        .find(|p| Path::new(p).exists())
        .ok_or_else(|| DiskError::Io {
            path: PathBuf::from(candidates[0]),
            action: "find (install e2fsprogs)",
            source: io::ErrorKind::NotFound.into(),
        })
}

/// Makes `dest` a qcow2 of `bytes` over the raw `base`.
pub(super) fn create_overlay(
    qemu_img: &Path,
    base: &Path,
    dest: &Path,
    bytes: u64,
) -> Result<(), DiskError> {
    run(Command::new(qemu_img)
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(base)
        .arg(dest)
        .arg(bytes.to_string()))
}

/// Grows a qcow2 that no process has open.
pub(super) fn resize(qemu_img: &Path, disk: &Path, bytes: u64) -> Result<(), DiskError> {
    run(Command::new(qemu_img)
        .args(["resize", "-q", "-f", "qcow2"])
        .arg(disk)
        .arg(bytes.to_string()))
}

/// The virtual size of a qcow2 file, from its header.
pub(super) fn qcow2_size(path: &Path) -> Result<u64, DiskError> {
    let mut header = [0u8; 32];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .map_err(io_error(path, "read the header"))?;
    if &header[..4] != b"QFI\xfb" {
        return Err(DiskError::NotQcow2 {
            path: path.to_owned(),
        });
    }
    Ok(u64::from_be_bytes(
        header[24..32].try_into().expect("8 bytes"),
    ))
}

/// A size stamp of a file (length and modification time), for cache keys.
pub(super) fn file_stamp(path: &Path) -> io::Result<String> {
    let metadata = fs::metadata(path)?;
    let modified = metadata
        .modified()?
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    Ok(format!("{}:{}", metadata.len(), modified.as_nanos()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_follows_the_agent_and_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let rootfs = dir.path().join("rootfs");
        fs::create_dir(&rootfs).unwrap();
        let agent = dir.path().join("agent");
        fs::write(&agent, b"one").unwrap();
        let first = base_key(&rootfs, &agent).unwrap();
        assert_eq!(first, base_key(&rootfs, &agent).unwrap());
        fs::write(&agent, b"two").unwrap();
        let second = base_key(&rootfs, &agent).unwrap();
        assert_ne!(first, second);
        File::create(rootfs.join(COMPLETE_MARKER)).unwrap();
        assert_ne!(second, base_key(&rootfs, &agent).unwrap());
        assert_eq!(first.len(), 16);
    }

    #[test]
    fn qcow2_sizes_come_from_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.qcow2");
        let mut header = b"QFI\xfb".to_vec();
        header.extend_from_slice(&[0; 20]);
        header.extend_from_slice(&(3u64 << 30).to_be_bytes());
        fs::write(&path, &header).unwrap();
        assert_eq!(qcow2_size(&path).unwrap(), 3 << 30);
        fs::write(&path, [0u8; 32]).unwrap();
        assert!(matches!(qcow2_size(&path), Err(DiskError::NotQcow2 { .. })));
    }
}
