//! The host processes of a VM are confined like a sandbox: QEMU, and the
//! virtiofsd of each of its volumes, run as an unprivileged host user in a
//! cgroup of their own.
//!
//! A [`Jail`] is made before the first of them starts and ends with QEMU:
//!
//! - **a host id range**, taken from the pool containers' user namespaces
//!   use (`IdRanges`), so no VM process shares a host id with a container or
//!   another VM. QEMU runs as the range's first id, with no capabilities and
//!   no supplementary group but `/dev/kvm`'s under KVM; the virtiofsds run as
//!   root of a user namespace mapping the whole range (see `shares`).
//! - **a cgroup** `cove-vm/vm-{hex}` in every controller, with the guest's
//!   CPUs plus one for QEMU's own threads, memory with headroom over the
//!   guest's RAM (QEMU itself, the virtiofsds, under TCG its translation
//!   cache), and a pids limit. The children join it between fork and exec,
//!   before they run any code of their own.
//!
//! QEMU processes outlive the server; after a restart one is found again by
//! its pid file and [`Jails::adopt`] reads its jail back from `/proc`.
//! Releasing a jail kills whatever is left in the cgroup (a virtiofsd whose
//! QEMU is gone), removes it, and frees the id range.

#![allow(unsafe_code)]

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::qemu::Accelerator;
use crate::container::cgroup::{self, CgroupBackend, CgroupError, CgroupLimits};
use crate::container::{IdRanges, UsernsError};

/// Where the cgroup controllers are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The cgroup every VM's own group is made in.
pub(super) const CGROUP_PARENT: &str = "cove-vm";
/// Threads of QEMU (vCPUs, I/O workers, RCU) and of its virtiofsds, with room.
const PIDS_MAX: u64 = 512;
/// Memory over the guest's RAM under KVM: QEMU's own and its virtiofsds'.
const KVM_HEADROOM_MIB: u64 = 256;
/// Under TCG also the translation cache, which QEMU lets grow to 1 GiB.
const TCG_HEADROOM_MIB: u64 = 1280;
/// The scheduler period; the quota is a number of CPUs times this.
const CPU_PERIOD_US: u64 = 100_000;
/// How old an empty VM cgroup must be before a starting server removes it.
const SWEEP_AFTER: std::time::Duration = std::time::Duration::from_secs(60);
/// `/dev/kvm`, which the device cgroup otherwise closes.
const KVM_DEVICE: &str = "/dev/kvm";
const KVM_DEVICE_RULE: &str = "c 10:232 rwm";

/// Makes and finds the jails of a runtime's VMs.
/// Why a VM's processes could not be confined.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("read random bytes for the VM's name")]
    Random(#[source] io::Error),
    #[error(transparent)]
    Userns(#[from] UsernsError),
    #[error("make the VM's cgroup")]
    Cgroup(#[source] CgroupError),
    #[error("cannot read {}", path.display())]
    Stat {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("QEMU runs as an unprivileged user and cannot read {} (mode {mode:o}); make it readable by others", path.display())]
    NotReadable { path: PathBuf, mode: u32 },
    #[error("QEMU runs as an unprivileged user and cannot reach {}: {} is mode {mode:o}; keep VM assets where others may search (the default is /var/tmp/cove/vm)", path.display(), dir.display())]
    NotSearchable {
        path: PathBuf,
        dir: PathBuf,
        mode: u32,
    },
    #[error("QEMU runs as an unprivileged user and opens {} through its group, but it is mode {mode:o}, group {gid}: give it a group of its own with read and write (udev's default is root:kvm 0660)", device.display())]
    KvmGroup {
        device: PathBuf,
        mode: u32,
        gid: u32,
    },
    #[error("{} contains a NUL byte", path.display())]
    Nul { path: PathBuf },
    #[error("the task making the user namespace failed")]
    Task(#[source] tokio::task::JoinError),
}

impl ConfineError {
    /// Whether every id range was in use: a retry after stops may succeed.
    pub fn is_exhausted(&self) -> bool {
        matches!(self, Self::Userns(UsernsError::Exhausted { .. }))
    }
}

fn stat(path: &Path) -> Result<fs::Metadata, ConfineError> {
    fs::metadata(path).map_err(|source| ConfineError::Stat {
        path: path.to_owned(),
        source,
    })
}

pub(super) struct Jails {
    cgroups: Arc<dyn CgroupBackend>,
    ids: Arc<IdRanges>,
    accelerator: Accelerator,
    /// Under KVM, the group through which QEMU opens `/dev/kvm`.
    kvm_group: Option<u32>,
}

impl std::fmt::Debug for Jails {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jails")
            .field("accelerator", &self.accelerator)
            .field("kvm_group", &self.kvm_group)
            .finish_non_exhaustive()
    }
}

impl Jails {
    /// Under KVM, QEMU needs `/dev/kvm` through a group that is not root's.
    pub(super) fn new(ids: Arc<IdRanges>, accelerator: Accelerator) -> Result<Jails, ConfineError> {
        let kvm_group = match accelerator {
            Accelerator::Tcg => None,
            Accelerator::Kvm => Some(kvm_group(Path::new(KVM_DEVICE))?),
        };
        Ok(Jails {
            cgroups: Arc::from(cgroup::detect(Path::new(CGROUP_ROOT), CGROUP_PARENT)),
            ids,
            accelerator,
            kvm_group,
        })
    }

    /// A jail for a machine of `cpus` and `memory_mib`: its id range taken
    /// and its cgroup made, with nothing in it yet.
    pub(super) fn make(&self, cpus: u32, memory_mib: u64) -> Result<Jail, ConfineError> {
        let name = format!(
            "vm-{}",
            super::bridge::random_hex(6).map_err(ConfineError::Random)?
        );
        let uid = self.ids.take(&name)?;
        let headroom = match self.accelerator {
            Accelerator::Kvm => KVM_HEADROOM_MIB,
            Accelerator::Tcg => TCG_HEADROOM_MIB,
        };
        let limits = CgroupLimits {
            cpu_quota_us: Some(u64::from(cpus.max(1) + 1) * CPU_PERIOD_US),
            cpu_period_us: CPU_PERIOD_US,
            memory_bytes: Some((memory_mib + headroom) << 20),
            pids_max: PIDS_MAX,
        };
        let jail = Jail {
            name,
            uid,
            groups: self.kvm_group.into_iter().collect(),
            cgroups: self.cgroups.clone(),
            ids: self.ids.clone(),
        };
        let made = self
            .cgroups
            .create(&jail.name, &limits)
            .and_then(|()| match self.accelerator {
                Accelerator::Kvm => self.cgroups.allow_device(&jail.name, KVM_DEVICE_RULE),
                Accelerator::Tcg => Ok(()),
            });
        if let Err(error) = made {
            jail.release();
            return Err(ConfineError::Cgroup(error));
        }
        Ok(jail)
    }

    /// The jail of a running QEMU process an earlier server started, read
    /// from `/proc`: its cgroup and its user. `None` for a process that is
    /// in no VM cgroup (started before VMs were confined) or is gone.
    pub(super) fn adopt(&self, pid: i32) -> Option<Jail> {
        let cgroups = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let name = vm_cgroup_name(&cgroups)?;
        let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let uid = real_uid(&status)?;
        if !self.ids.claim(&name, uid) {
            tracing::warn!(%pid, uid, "a VM of an earlier server runs with ids another sandbox holds");
        }
        Some(Jail {
            name,
            uid,
            groups: self.kvm_group.into_iter().collect(),
            cgroups: self.cgroups.clone(),
            ids: self.ids.clone(),
        })
    }

    /// Removes the cgroups no process is in any more (of VMs that ended
    /// while no server watched them). One made in the last minute is left
    /// alone: another server on this host may be about to start its QEMU.
    pub(super) fn sweep(&self) {
        let Some(parent) = self.cgroups.describe("-").parent().map(Path::to_path_buf) else {
            return;
        };
        let Ok(entries) = fs::read_dir(&parent) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let fresh = entry
                .metadata()
                .and_then(|meta| meta.modified())
                .map(|made| made.elapsed().unwrap_or_default() < SWEEP_AFTER)
                .unwrap_or(true);
            if !name.starts_with("vm-") || !entry.path().is_dir() || fresh {
                continue;
            }
            if self.cgroups.pids(&name).is_ok_and(|pids| pids.is_empty()) {
                if let Err(error) = self.cgroups.remove(&name) {
                    tracing::debug!(cgroup = name, %error, "removing a VM cgroup left behind");
                }
            }
        }
    }
}

/// Whether QEMU, as an unprivileged user, can read `path`: every
/// directory on the way searchable by others, the file readable by them.
pub(super) fn check_public(path: &Path) -> Result<(), ConfineError> {
    let meta = stat(path)?;
    if meta.mode() & 0o004 == 0 {
        return Err(ConfineError::NotReadable {
            path: path.to_owned(),
            mode: meta.mode() & 0o777,
        });
    }
    for dir in path
        .ancestors()
        .skip(1)
        .filter(|d| !d.as_os_str().is_empty())
    {
        let mode = stat(dir)?.mode();
        if mode & 0o001 == 0 {
            return Err(ConfineError::NotSearchable {
                path: path.to_owned(),
                dir: dir.to_owned(),
                mode: mode & 0o777,
            });
        }
    }
    Ok(())
}

/// The group of `/dev/kvm`, which must give its members read and write and
/// not be root's (a process in root's group reads more than `/dev/kvm`).
fn kvm_group(device: &Path) -> Result<u32, ConfineError> {
    let meta = stat(device)?;
    let mode = meta.mode() & 0o777;
    if meta.gid() == 0 || mode & 0o060 != 0o060 {
        return Err(ConfineError::KvmGroup {
            device: device.to_owned(),
            mode,
            gid: meta.gid(),
        });
    }
    Ok(meta.gid())
}

/// The name of the VM cgroup in a `/proc/PID/cgroup` text, if the process is in one.
fn vm_cgroup_name(text: &str) -> Option<String> {
    let prefix = format!("/{CGROUP_PARENT}/");
    text.lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .find_map(|path| path.strip_prefix(prefix.as_str()))
        .filter(|name| name.starts_with("vm-") && !name.contains('/'))
        .map(str::to_owned)
}

/// The real uid in a `/proc/PID/status` text.
fn real_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().next())
        .and_then(|uid| uid.parse().ok())
}

/// One VM's host id range and cgroup; see the module's text.
pub(super) struct Jail {
    name: String,
    uid: u32,
    groups: Vec<u32>,
    cgroups: Arc<dyn CgroupBackend>,
    ids: Arc<IdRanges>,
}

impl std::fmt::Debug for Jail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jail")
            .field("name", &self.name)
            .field("uid", &self.uid)
            .finish_non_exhaustive()
    }
}

impl Jail {
    /// The first host id of the range: QEMU's uid and gid, and root of the
    /// virtiofsds' user namespace.
    pub(super) fn uid(&self) -> u32 {
        self.uid
    }

    /// The user namespace of the jail's range (virtiofsd's).
    pub(super) async fn namespace(&self) -> Result<Arc<std::os::fd::OwnedFd>, ConfineError> {
        let (ids, base) = (self.ids.clone(), self.uid);
        let made = tokio::task::spawn_blocking(move || ids.namespace(base))
            .await
            .map_err(ConfineError::Task)?;
        Ok(made?)
    }

    /// What a child needs between fork and exec to enter the jail.
    pub(super) fn entry(&self) -> Result<Entry, ConfineError> {
        let procs = self
            .cgroups
            .procs_files(&self.name)
            .iter()
            .map(|path| {
                CString::new(path.as_os_str().as_bytes())
                    .map_err(|_| ConfineError::Nul { path: path.clone() })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Entry {
            procs,
            uid: self.uid,
            groups: self.groups.clone(),
        })
    }

    /// The freezer of the jail's cgroup.
    pub(super) fn freezer(&self) -> Freezer {
        Freezer {
            name: self.name.clone(),
            cgroups: self.cgroups.clone(),
        }
    }

    /// Kills what is left in the cgroup, removes it and frees the ids.
    /// Blocks (up to seconds while processes die).
    pub(super) fn release(self) {
        if let Err(error) = cgroup::kill_and_remove(self.cgroups.as_ref(), &self.name) {
            tracing::warn!(cgroup = self.name, %error, "removing a VM's cgroup");
        }
        self.ids.release(&self.name);
    }
}

/// The freezer of a jail's cgroup: what a warm pause stops QEMU with.
#[derive(Clone)]
pub(super) struct Freezer {
    name: String,
    cgroups: Arc<dyn CgroupBackend>,
}

impl std::fmt::Debug for Freezer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Freezer").field("name", &self.name).finish()
    }
}

impl Freezer {
    /// Freezes or thaws every process in the cgroup; blocks until the
    /// kernel reports it frozen.
    pub(super) fn set(&self, frozen: bool) -> Result<(), CgroupError> {
        self.cgroups.set_frozen(&self.name, frozen)
    }
}

/// A jail as a forked child enters it: prepared before the fork, so that
/// entering allocates nothing.
#[derive(Clone, Debug)]
pub(super) struct Entry {
    procs: Vec<CString>,
    uid: u32,
    groups: Vec<u32>,
}

impl Entry {
    /// Moves the calling process into the jail's cgroup. Async-signal-safe.
    pub(super) fn join_cgroup(&self) -> io::Result<()> {
        for procs in &self.procs {
            // SAFETY: a NUL-terminated path prepared before the fork.
            let fd = unsafe { libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` was just opened; "0" names the writing process.
            let written = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
            let error = io::Error::last_os_error();
            // SAFETY: closes the descriptor opened above.
            unsafe { libc::close(fd) };
            if written != 1 {
                return Err(error);
            }
        }
        Ok(())
    }

    /// Turns the calling process (root) into the jail's user: its uid and
    /// gid, only the jail's supplementary groups, no capabilities left, and
    /// no way to gain privileges by exec. Async-signal-safe.
    pub(super) fn become_user(&self) -> io::Result<()> {
        no_new_privileges()?;
        let groups: &[libc::gid_t] = &self.groups;
        // SAFETY: a slice of gids that lives across the call.
        if unsafe { libc::setgroups(groups.len(), groups.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: plain id changes; a uid change from root to non-root drops
        // every capability.
        unsafe {
            if libc::setresgid(self.uid, self.uid, self.uid) != 0
                || libc::setresuid(self.uid, self.uid, self.uid) != 0
            {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// Sets `PR_SET_NO_NEW_PRIVS`. Async-signal-safe.
pub(super) fn no_new_privileges() -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vm_cgroup_is_read_from_either_cgroup_version() {
        let v1 = "12:pids:/cove-vm/vm-0a1b2c\n4:memory:/cove-vm/vm-0a1b2c\n1:name=systemd:/\n";
        assert_eq!(vm_cgroup_name(v1).as_deref(), Some("vm-0a1b2c"));
        assert_eq!(
            vm_cgroup_name("0::/cove-vm/vm-ff\n").as_deref(),
            Some("vm-ff")
        );
        assert_eq!(vm_cgroup_name("0::/system.slice/cove.service\n"), None);
        assert_eq!(vm_cgroup_name("0::/cove-vm/vm-1/x\n"), None);
        assert_eq!(vm_cgroup_name("0::/cove/sandbox\n"), None);
    }

    #[test]
    fn the_real_uid_comes_from_status() {
        let status = "Name:\tqemu\nUid:\t1879048192\t1879048192\t1879048192\t1879048192\n";
        assert_eq!(real_uid(status), Some(1_879_048_192));
        assert_eq!(real_uid("Name:\tx\n"), None);
    }

    #[test]
    fn assets_must_be_reachable_by_others() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let open = dir.path().join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let file = open.join("vmlinux");
        fs::write(&file, "").unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
        check_public(&file).unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).unwrap();
        assert!(check_public(&file)
            .unwrap_err()
            .to_string()
            .contains("cannot read"));
        fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o700)).unwrap();
        let refused = check_public(&file).unwrap_err().to_string();
        assert!(refused.contains("cannot reach"), "{refused}");
    }

    #[test]
    fn kvm_must_be_reached_through_a_group_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let device = dir.path().join("kvm");
        fs::write(&device, "").unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&device, fs::Permissions::from_mode(0o600)).unwrap();
        // Made by root here: group 0, mode 0600; both are refused.
        let refused = kvm_group(&device).unwrap_err().to_string();
        assert!(refused.contains("0660"), "{refused}");
        std::os::unix::fs::chown(&device, None, Some(4242)).unwrap();
        assert!(kvm_group(&device).is_err(), "mode 0600");
        fs::set_permissions(&device, fs::Permissions::from_mode(0o660)).unwrap();
        assert_eq!(kvm_group(&device).unwrap(), 4242);
    }
}
