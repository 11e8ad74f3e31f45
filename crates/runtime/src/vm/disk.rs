//! The disks of VMs: the read-only base image every root disk starts from,
//! and the qcow2 files over it.
//!
//! A base is a raw ext4 image made from an image's root filesystem with
//! `mkfs.ext4 -d` (no mount needed) and the static agent written into it at
//! [`AGENT_IN_GUEST`] with `debugfs`. It is cached in `{assets}/bases/` under
//! a key of the root filesystem and the agent binary, built once under a file
//! lock, and never changed: qcow2 files of sandboxes, captures and templates
//! name it as their backing file. Its filesystem is the root filesystem's size
//! plus headroom; a larger disk is a larger qcow2 whose filesystem the agent
//! grows online at boot.
//!
//! The cache is shared by every server of the host, and each new agent or
//! image makes new bases (a gigabyte or two each), so a base that no data dir
//! uses is deleted. A data dir holds a hard link to each base its disks name,
//! in `{data dir}/vm-bases/` ([`REFERENCES`], beside the storage's image:
//! the btrfs storage is another filesystem): a base whose link count is one
//! is nobody's. Links are made when a server first uses a base and matched to
//! the data dir's disks when it starts (a deleted sandbox's base is let go);
//! a removed data dir takes its links with it. Linking, and deleting
//! unlinked bases (after a new one is built, and as a server starts), both
//! happen under the cache's lock, so a base is never deleted between being
//! chosen and being linked. Only a base some data dir linked once is ever
//! deleted ([`LINKED`]): a data dir from before links were kept may name
//! one it never linked. A base gone from the cache (a clean-up of old
//! files in /var/tmp) is put back from a data dir's link rather than built
//! again, since a new build is not the same bytes. Where the data dir is on
//! another filesystem than the cache (no hard link across them) the base is
//! pinned instead, and kept for good.

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
/// The directory of a data dir (beside its storage image) that holds its
/// links to bases.
pub(super) const REFERENCES: &str = "vm-bases";
/// Beside a base whose user could not link it: keep it for good.
const PINNED: &str = "pinned";
/// Beside a base some data dir has linked: only such a base is deleted
/// when no link is left. One from before links were kept (which data dirs
/// of that time may name without linking) stays until a data dir links it.
const LINKED: &str = "linked";
/// The directories of a data dir's storage whose `*/disk.qcow2` name bases.
const DISK_DIRS: [&str; 3] = ["vms", "captures", "vm-templates"];
/// The longest backing file name qcow2 allows.
const MAX_BACKING_NAME: u32 = 1023;

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

/// The cache's lock, held while a base is built, linked or deleted.
fn lock_bases(bases: &Path) -> Result<Flock<File>, DiskError> {
    fs::create_dir_all(bases).map_err(io_error(bases, "create"))?;
    let lock_path = bases.join(".lock");
    let lock_file = File::create(&lock_path).map_err(io_error(&lock_path, "open the lock"))?;
    Flock::lock(lock_file, FlockArg::LockExclusive)
        .map_err(|(_, errno)| io_error(&lock_path, "lock")(io::Error::from(errno)))
}

/// Returns the base made from `rootfs` with `agent`, building it first if
/// needed, and linked from `references` (the data dir's [`REFERENCES`]).
/// Blocking (seconds the first time). Concurrent callers, in this process or
/// another, wait for one build.
pub(super) fn ensure_base(
    cache: &Path,
    rootfs: &Path,
    agent: &Path,
    references: &Path,
) -> Result<PathBuf, DiskError> {
    let bases = cache.join("bases");
    let key = base_key(rootfs, agent)?;
    let base = bases.join(format!("{key}.raw"));
    if linked_from(&base, references) {
        // A base with a link besides the cache's is never pruned: nothing
        // to wait for behind another server's build.
        return Ok(base);
    }
    let _lock = lock_bases(&bases)?;
    let missing = !base.exists();
    if missing && restore(&base, references) {
        tracing::info!(base = %base.display(), "put a VM base disk back in the cache from a data dir's link");
    } else if missing {
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
        // A new base is when the cache grows: the ones nobody links go.
        prune(&bases, Some(&base));
    }
    reference(&base, references)?;
    Ok(base)
}

/// Where `references` links `base`: under the base's own file name.
fn link_of(base: &Path, references: &Path) -> PathBuf {
    references.join(base.file_name().expect("a base has a file name"))
}

/// Whether `references` holds a link to `base` (the same file) and the
/// base is marked linked: all [`reference`] would do is done.
fn linked_from(base: &Path, references: &Path) -> bool {
    let link = link_of(base, references);
    match (fs::metadata(base), fs::symlink_metadata(&link)) {
        (Ok(base_meta), Ok(link_meta)) => {
            link_meta.is_file()
                && (base_meta.dev(), base_meta.ino()) == (link_meta.dev(), link_meta.ino())
                && base.with_extension(LINKED).exists()
        }
        _ => false,
    }
}

/// Puts `base`, gone from the cache (deleted by hand, or by a clean-up of
/// old files in /var/tmp), back from the data dir's link to it: the disks
/// over it need those bytes, and a base built again would not be them.
/// Called under the cache's lock; whether it did.
fn restore(base: &Path, references: &Path) -> bool {
    let link = link_of(base, references);
    fs::symlink_metadata(&link).is_ok_and(|meta| meta.is_file())
        && fs::hard_link(&link, base).is_ok()
}

/// Links `base` from `references`, or pins it where a link cannot be made.
/// Called under the cache's lock.
fn reference(base: &Path, references: &Path) -> Result<(), DiskError> {
    let link = link_of(base, references);
    fs::create_dir_all(references).map_err(io_error(references, "create"))?;
    let base_ino = fs::metadata(base).map_err(io_error(base, "read"))?.ino();
    let marker = base.with_extension(LINKED);
    if !marker.exists() {
        File::create(&marker).map_err(io_error(&marker, "create"))?;
    }
    match fs::symlink_metadata(&link) {
        Ok(meta) if meta.ino() == base_ino => return Ok(()),
        // A link to a base of that name that is gone (deleted by hand).
        Ok(_) => fs::remove_file(&link).map_err(io_error(&link, "remove a stale link"))?,
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(io_error(&link, "read")(error)),
    }
    match fs::hard_link(base, &link) {
        Ok(()) => Ok(()),
        Err(error) if error.raw_os_error() == Some(libc::EXDEV) => {
            let pin = base.with_extension(PINNED);
            tracing::info!(
                base = %base.display(),
                data = %references.display(),
                "the data dir is on another filesystem than the VM cache: the base is kept for good"
            );
            File::create(&pin)
                .map(drop)
                .map_err(io_error(&pin, "create"))
        }
        Err(error) => Err(io_error(&link, "link the base")(error)),
    }
}

/// Deletes every base no data dir links any more (but `keep`, and those
/// none ever linked: see [`LINKED`]) and what failed builds left. Called
/// under the cache's lock; a failure only leaves a file.
fn prune(bases: &Path, keep: Option<&Path>) {
    let Ok(entries) = fs::read_dir(bases) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let unused = if name.ends_with(".raw.partial") || name.ends_with(".debugfs") {
            // Builds hold the lock: these are what an interrupted one left.
            true
        } else if name.ends_with(".raw") && Some(path.as_path()) != keep {
            let pinned = path.with_extension(PINNED).exists();
            let managed = path.with_extension(LINKED).exists();
            !pinned
                && managed
                && entry
                    .metadata()
                    .is_ok_and(|meta| meta.is_file() && meta.nlink() == 1)
        } else {
            false
        };
        if unused {
            match fs::remove_file(&path) {
                Ok(()) => {
                    let _ = fs::remove_file(path.with_extension(LINKED));
                    tracing::info!(base = %path.display(), "deleted a VM base disk no data dir uses")
                }
                Err(error) => {
                    tracing::warn!(base = %path.display(), %error, "could not delete an unused VM base disk")
                }
            }
        }
    }
}

/// Matches a data dir's links to the bases its disks name: links what a
/// disk names (a data dir from before links were kept) and lets go of what
/// none does, then deletes the bases nobody links. A base is known by its
/// file name, whatever path to the cache a header spells; while any disk's
/// header cannot be read, no link is let go. Run as a server starts,
/// before it makes or starts any VM.
pub(super) fn sync_references(
    storage: &Path,
    references: &Path,
    cache: &Path,
) -> Result<(), DiskError> {
    let bases = cache.join("bases");
    if !bases.exists() {
        return Ok(());
    }
    let mut named = std::collections::HashSet::new();
    let mut unread = false;
    for dir in DISK_DIRS {
        let Ok(entries) = fs::read_dir(storage.join(dir)) else {
            continue;
        };
        for entry in entries.flatten() {
            let disk = entry.path().join("disk.qcow2");
            match backing_file(&disk) {
                Ok(Some(backing)) => {
                    if let Some(name) = base_name(&backing) {
                        named.insert(std::ffi::OsString::from(name));
                    }
                }
                Ok(None) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => {
                    tracing::warn!(disk = %disk.display(), %error, "cannot read which base a VM disk is over: this data dir keeps every base it links");
                    unread = true;
                }
            }
        }
    }
    let _lock = lock_bases(&bases)?;
    for name in &named {
        let base = bases.join(name);
        if base.exists() || restore(&base, references) {
            reference(&base, references)?;
        }
    }
    if let (false, Ok(links)) = (unread, fs::read_dir(references)) {
        for link in links.flatten() {
            if !named.contains(&link.file_name()) {
                let path = link.path();
                fs::remove_file(&path).map_err(io_error(&path, "remove"))?;
            }
        }
    }
    prune(&bases, None);
    Ok(())
}

/// The name of the base `path` names, if its file name is one
/// (`{16 hex digits}.raw`): only that name is ever looked up, in the cache.
fn base_name(path: &Path) -> Option<&str> {
    let name = path.file_name()?.to_str()?;
    (name.len() == 20
        && name.ends_with(".raw")
        && name[..16].bytes().all(|b| b.is_ascii_hexdigit()))
    .then_some(name)
}

/// The backing file a qcow2 names, from its header (`None`: it has none).
/// QEMU writes the header (a guest that took QEMU over could write
/// anything), so the read is bounded, follows no symlink, and only the
/// answer's file name is used, as a base's name in the cache.
fn backing_file(disk: &Path) -> io::Result<Option<PathBuf>> {
    use std::io::{Seek, SeekFrom};
    use std::os::unix::ffi::OsStringExt;
    let invalid = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_owned());
    let mut file = crate::beneath::open_regular(disk)?;
    let mut header = [0u8; 20];
    file.read_exact(&mut header)?;
    if &header[..4] != b"QFI\xfb" {
        return Err(invalid("not a qcow2 image"));
    }
    let offset = u64::from_be_bytes(header[8..16].try_into().expect("8 bytes"));
    let size = u32::from_be_bytes(header[16..20].try_into().expect("4 bytes"));
    if offset == 0 || size == 0 {
        return Ok(None);
    }
    if size > MAX_BACKING_NAME {
        return Err(invalid("a backing file name longer than qcow2 allows"));
    }
    file.seek(SeekFrom::Start(offset))?;
    let mut name = vec![0u8; size as usize];
    file.read_exact(&mut name)?;
    Ok(Some(PathBuf::from(std::ffi::OsString::from_vec(name))))
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

    /// A qcow2 header naming `backing` (all `backing_file` reads).
    fn qcow2_over(path: &Path, backing: &Path) {
        let name = backing.as_os_str().as_encoded_bytes();
        let mut header = b"QFI\xfb".to_vec();
        header.extend_from_slice(&3u32.to_be_bytes());
        header.extend_from_slice(&104u64.to_be_bytes());
        header.extend_from_slice(&(name.len() as u32).to_be_bytes());
        header.resize(104, 0);
        header.extend_from_slice(name);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, header).unwrap();
    }

    fn nlink(path: &Path) -> u64 {
        fs::metadata(path).unwrap().nlink()
    }

    #[test]
    fn a_base_no_data_dir_links_goes_when_a_new_one_is_built() {
        if !cove_testenv::program("mkfs.ext4", "e2fsprogs")
            || !cove_testenv::program("debugfs", "e2fsprogs")
        {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (cache, rootfs, agent) = (
            dir.path().join("cache"),
            dir.path().join("rootfs"),
            dir.path().join("agent"),
        );
        fs::create_dir_all(rootfs.join("etc")).unwrap();
        fs::write(rootfs.join("etc/hostname"), "cove\n").unwrap();
        let (one, two) = (dir.path().join("one"), dir.path().join("two"));
        let mut made = Vec::new();
        for (content, references) in [("a", &one), ("b", &two), ("c", &two)] {
            fs::write(&agent, content).unwrap();
            let base = ensure_base(&cache, &rootfs, &agent, references).unwrap();
            assert_eq!(nlink(&base), 2, "linked from its data dir");
            made.push(base);
            if content == "b" {
                // The first data dir is removed; its base stays until the
                // next one is built.
                fs::remove_dir_all(&one).unwrap();
                assert!(made[0].exists());
            }
        }
        assert!(!made[0].exists(), "a base no data dir links was kept");
        assert!(made[1].exists() && made[2].exists());
        // Asking again for a base that is there links it and builds nothing.
        fs::write(&agent, "b").unwrap();
        assert_eq!(ensure_base(&cache, &rootfs, &agent, &one).unwrap(), made[1]);
        assert_eq!(nlink(&made[1]), 3);
        // A base deleted from the cache by someone else comes back from a
        // data dir's link, the same bytes, not built again.
        let inode = |path: &Path| fs::metadata(path).unwrap().ino();
        let before = inode(&made[2]);
        fs::remove_file(&made[2]).unwrap();
        fs::write(&agent, "c").unwrap();
        assert_eq!(ensure_base(&cache, &rootfs, &agent, &two).unwrap(), made[2]);
        assert_eq!(inode(&made[2]), before);
        // A base this data dir links already is answered while another
        // holds the cache's lock (a build of another server's).
        let held = lock_bases(&cache.join("bases")).unwrap();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let asked = (cache.clone(), rootfs.clone(), agent.clone(), two.clone());
        std::thread::spawn(move || {
            let _ = done_tx.send(ensure_base(&asked.0, &asked.1, &asked.2, &asked.3));
        });
        let answer = done_rx.recv_timeout(std::time::Duration::from_secs(30));
        assert_eq!(answer.expect("waited for the lock").unwrap(), made[2]);
        drop(held);
    }

    #[test]
    fn a_starting_server_links_what_its_disks_name_and_lets_go_of_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let (storage, cache) = (dir.path().join("storage"), dir.path().join("assets"));
        let bases = cache.join("bases");
        fs::create_dir_all(&bases).unwrap();
        let base = |key: &str| {
            let path = bases.join(format!("{key}.raw"));
            fs::write(&path, key).unwrap();
            path
        };
        let (used, template, stale, pinned, other, old_format) = (
            base("00000000000000aa"),
            base("00000000000000bb"),
            base("00000000000000cc"),
            base("00000000000000dd"),
            base("00000000000000ee"),
            base("0000000000000011"),
        );
        fs::write(pinned.with_extension(PINNED), "").unwrap();
        // Every base but `old_format` was linked by some data dir once.
        for linked in [&used, &template, &stale, &pinned, &other] {
            fs::write(linked.with_extension(LINKED), "").unwrap();
        }
        qcow2_over(&storage.join("vms/sb1/disk.qcow2"), &used);
        // The same cache, spelt another way (a symbolic link to it).
        qcow2_over(
            &storage.join("vm-templates/t1/disk.qcow2"),
            &dir.path().join("cache-link/bases/00000000000000bb.raw"),
        );
        // A base gone from the cache (a clean-up of /var/tmp) that this
        // data dir links: put back from the link, not lost.
        let removed = bases.join("0000000000000022.raw");
        qcow2_over(&storage.join("vms/sb2/disk.qcow2"), &removed);
        // A header naming a file outside the cache is not followed.
        let outside = dir.path().join("outside.raw");
        fs::write(&outside, "x").unwrap();
        qcow2_over(&storage.join("captures/c1/disk.qcow2"), &outside);
        // Another data dir still links `other`; this one linked `stale`
        // for a sandbox since deleted.
        let elsewhere = dir.path().join("elsewhere");
        fs::create_dir_all(&elsewhere).unwrap();
        fs::hard_link(&other, elsewhere.join("00000000000000ee.raw")).unwrap();
        let references = dir.path().join(REFERENCES);
        fs::create_dir_all(&references).unwrap();
        fs::hard_link(&stale, references.join("00000000000000cc.raw")).unwrap();
        fs::write(references.join("0000000000000022.raw"), "22").unwrap();
        fs::write(bases.join("00000000000000ff.raw.partial"), "").unwrap();

        sync_references(&storage, &references, &cache).unwrap();
        assert_eq!((nlink(&used), nlink(&template)), (2, 2));
        assert_eq!(fs::read_to_string(&removed).unwrap(), "22");
        assert_eq!(nlink(&removed), 2);
        assert!(
            !stale.exists(),
            "a base only a deleted sandbox named was kept"
        );
        assert!(!stale.with_extension(LINKED).exists());
        assert!(pinned.exists() && other.exists());
        assert!(
            old_format.exists(),
            "a base no data dir ever linked was deleted"
        );
        assert!(!bases.join("00000000000000ff.raw.partial").exists());
        assert_eq!(nlink(&outside), 1);
        let mut links: Vec<_> = fs::read_dir(&references)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        links.sort();
        assert_eq!(
            links,
            [
                "0000000000000022.raw",
                "00000000000000aa.raw",
                "00000000000000bb.raw"
            ]
        );

        // A header that cannot be read: no link is let go.
        fs::write(storage.join("vms/sb1/disk.qcow2"), "not a qcow2").unwrap();
        sync_references(&storage, &references, &cache).unwrap();
        assert_eq!(nlink(&used), 2);
    }

    #[test]
    fn backing_names_are_read_bounded_and_only_from_qcow2() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("disk.qcow2");
        qcow2_over(
            &disk,
            Path::new("/var/tmp/cove/vm/bases/0123456789abcdef.raw"),
        );
        assert_eq!(
            backing_file(&disk).unwrap().unwrap(),
            Path::new("/var/tmp/cove/vm/bases/0123456789abcdef.raw")
        );
        qcow2_over(&disk, &PathBuf::from("x".repeat(2000)));
        assert!(backing_file(&disk).is_err());
        fs::write(&disk, [0u8; 200]).unwrap();
        assert!(backing_file(&disk).is_err());
        let link = dir.path().join("link.qcow2");
        std::os::unix::fs::symlink(&disk, &link).unwrap();
        assert!(backing_file(&link).is_err(), "followed a symlink");
        let fifo = dir.path().join("fifo.qcow2");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(backing_file(&fifo).is_err(), "read a FIFO");
        // A disk over no base.
        let mut header = b"QFI\xfb".to_vec();
        header.extend_from_slice(&[0; 196]);
        fs::write(&disk, &header).unwrap();
        assert_eq!(backing_file(&disk).unwrap(), None);
        // Only a base's file name counts, looked up in the cache alone.
        let name = Some("0123456789abcdef.raw");
        assert_eq!(base_name(Path::new("/c/bases/0123456789abcdef.raw")), name);
        assert_eq!(
            base_name(Path::new("/elsewhere/0123456789abcdef.raw")),
            name
        );
        assert_eq!(base_name(Path::new("/c/bases/0123456789abcdeg.raw")), None);
        assert_eq!(
            base_name(Path::new("/c/bases/0123456789abcdef.raw/..")),
            None
        );
        assert_eq!(base_name(Path::new("/c/bases/outside.raw")), None);
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
