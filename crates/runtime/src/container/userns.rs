//! User namespaces of containers: root in a sandbox is not root on the host.
//!
//! Each running container gets a range of 65536 host ids of its own from a
//! configured pool ([`IdPool`]): its uid and gid 0 are host id `base`, its
//! 1000 is `base + 1000`, and nothing of it maps to a host id outside its
//! range (in particular not to 0). Files on disk keep the ids the sandbox
//! sees (0 for its root): image layers, the sandbox's own layer and volumes
//! are mounted through idmapped mounts (`rootfs`), so layers stay shared and
//! unchowned, snapshots and archives move between sandboxes, and a volume is
//! shared live whatever range each sandbox has. Ranges are kept in memory:
//! a container never outlives the server that started it (the shim has a
//! parent-death signal), so a new server starts with none in use.
//!
//! This module owns the allocation (server side) and the making of the
//! namespace (shim side); the mounts are `rootfs`'s.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use nix::errno::Errno;
use nix::sched::{unshare, CloneFlags};
use nix::sys::wait::waitpid;
use nix::unistd::{fork, pipe2, ForkResult};

/// Ids one sandbox maps: every 16-bit uid and gid an image can hold.
pub(super) const RANGE_SIZE: u32 = 65536;

/// Why `--userns-pool` was refused.
#[derive(Debug, thiserror::Error)]
pub enum IdPoolError {
    #[error("{text:?}: expected START:COUNT, e.g. 1879048192:4096")]
    Form { text: String },
    #[error("{text:?}: START must be a host id (a 32-bit number)")]
    Start { text: String },
    #[error("{text:?}: COUNT must be a number of ranges")]
    Count { text: String },
    #[error(
        "{text:?}: the pool must start above 0, hold at least one range, and end below {}",
        u32::MAX
    )]
    Bounds { text: String },
}

/// Why a sandbox could not have a user namespace.
#[derive(Debug, thiserror::Error)]
pub enum UsernsError {
    #[error("all {count} user-namespace id ranges are in use by running sandboxes; stop some, or give the server a larger --userns-pool")]
    Exhausted { count: u32 },
    #[error("{step}")]
    Sys {
        step: &'static str,
        #[source]
        source: Errno,
    },
    #[error("the child could not make a user namespace")]
    Child,
    #[error("cannot {action} {path}")]
    Io {
        action: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("descriptor {fd} is not the user namespace the server passed")]
    NotUserns {
        fd: i32,
        #[source]
        source: std::io::Error,
    },
}

fn sys(step: &'static str) -> impl FnOnce(Errno) -> UsernsError {
    move |source| UsernsError::Sys { step, source }
}

/// The host ids containers are given, in ranges of [`RANGE_SIZE`]:
/// `start`, `start + 65536`, ... (`count` of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdPool {
    pub start: u32,
    pub count: u32,
}

impl Default for IdPool {
    /// Above the ranges `/etc/subuid` and systemd hand out (systemd-nspawn's
    /// end at 1879048191), up to 2^31 - 1: `net.ipv4.ping_group_range` takes
    /// no group above that, and ping in a sandbox needs its groups in it.
    fn default() -> Self {
        IdPool {
            start: 1_879_048_192,
            count: 4_096,
        }
    }
}

impl IdPool {
    /// Parses `START:COUNT`; the pool must fit below 2^32 - 1 (the invalid id).
    pub fn parse(text: &str) -> Result<IdPool, IdPoolError> {
        let text_owned = || text.to_owned();
        let (start, count) = text
            .split_once(':')
            .ok_or_else(|| IdPoolError::Form { text: text_owned() })?;
        let start: u32 = start
            .parse()
            .map_err(|_| IdPoolError::Start { text: text_owned() })?;
        let count: u32 = count
            .parse()
            .map_err(|_| IdPoolError::Count { text: text_owned() })?;
        let end = u64::from(start) + u64::from(count) * u64::from(RANGE_SIZE);
        if start == 0 || count == 0 || end > u64::from(u32::MAX) {
            return Err(IdPoolError::Bounds { text: text_owned() });
        }
        Ok(IdPool { start, count })
    }
}

/// The ranges in use, by holder: running containers (by sandbox id) and
/// the host processes of running VMs (see `vm::confine`), from one pool so
/// that no two of them share a host id.
///
/// Each range's user namespace is made once and kept ([`IdRanges::namespace`]):
/// it holds nothing but the map, so the next holder of the range joins the
/// same one, and a create does not pay the fork that makes one.
#[derive(Debug)]
pub struct IdRanges {
    pool: IdPool,
    taken: Mutex<HashMap<String, u32>>,
    namespaces: Mutex<HashMap<u32, Arc<OwnedFd>>>,
}

impl IdRanges {
    pub fn new(pool: IdPool) -> Self {
        Self {
            pool,
            taken: Mutex::default(),
            namespaces: Mutex::default(),
        }
    }

    /// The first host id of `id`'s range: the one it has, or the lowest free one.
    pub(crate) fn take(&self, id: &str) -> Result<u32, UsernsError> {
        let mut taken = self.taken.lock().expect("id range lock");
        if let Some(slot) = taken.get(id) {
            return Ok(self.base(*slot));
        }
        let used: std::collections::HashSet<u32> = taken.values().copied().collect();
        let slot = (0..self.pool.count)
            .find(|slot| !used.contains(slot))
            .ok_or(UsernsError::Exhausted {
                count: self.pool.count,
            })?;
        taken.insert(id.to_owned(), slot);
        Ok(self.base(slot))
    }

    pub(crate) fn release(&self, id: &str) {
        self.taken.lock().expect("id range lock").remove(id);
    }

    /// Records that `id` holds the range starting at `base`, as a process
    /// an earlier server started still does. False when `base` is not the
    /// start of a range of the pool, or another holder has it.
    pub(crate) fn claim(&self, id: &str, base: u32) -> bool {
        let Some(offset) = base.checked_sub(self.pool.start) else {
            return false;
        };
        let slot = offset / RANGE_SIZE;
        if offset % RANGE_SIZE != 0 || slot >= self.pool.count {
            return false;
        }
        let mut taken = self.taken.lock().expect("id range lock");
        match taken.iter().find(|(_, s)| **s == slot) {
            Some((holder, _)) => holder == id,
            None => {
                taken.insert(id.to_owned(), slot);
                true
            }
        }
    }

    /// The user namespace of the range starting at `base` (see the type's
    /// text). Blocks for a fork the first time.
    pub(crate) fn namespace(&self, base: u32) -> Result<Arc<OwnedFd>, UsernsError> {
        if let Some(made) = self.namespaces.lock().expect("namespace lock").get(&base) {
            return Ok(made.clone());
        }
        let made = Arc::new(make(base)?);
        let mut namespaces = self.namespaces.lock().expect("namespace lock");
        Ok(namespaces.entry(base).or_insert(made).clone())
    }

    fn base(&self, slot: u32) -> u32 {
        self.pool.start + slot * RANGE_SIZE
    }
}

/// Takes the user namespace the server passed as descriptor `fd` (in the
/// shim), checking that it is one.
pub(super) fn inherited(fd: i32) -> Result<OwnedFd, UsernsError> {
    // NS_GET_NSTYPE: _IO(0xb7, 0x3).
    const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
    // SAFETY: an ioctl with no argument on a descriptor number; a number that
    // is no descriptor fails with EBADF.
    let kind = unsafe { libc::ioctl(fd, NS_GET_NSTYPE) };
    if kind != libc::CLONE_NEWUSER {
        return Err(UsernsError::NotUserns {
            fd,
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: the descriptor is open (the ioctl answered), was inherited for
    // this process alone, and nothing else in the shim owns it.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// The map line of a range: its ids 0..65536 are host ids `base`...
pub(super) fn id_map(base: u32) -> String {
    format!("0 {base} {RANGE_SIZE}\n")
}

/// Makes a user namespace whose ids 0..65536 are host ids `base`...: a child
/// unshares one and waits while this process (root in the host's namespace)
/// writes its maps, and the namespace is kept by a descriptor once the child
/// exits. The child makes only system calls and allocates nothing, so a
/// multithreaded process (the server, for a VM's virtiofsd) may call this
/// too; it blocks until the child is gone.
///
/// The child is released by a byte, never by end of file: a child forked
/// by another thread's call at the same moment holds copies of this call's
/// pipe ends (they close on exec, and these children never exec), so an end
/// of file would wait for that other child, which may be waiting for ours.
pub(crate) fn make(base: u32) -> Result<OwnedFd, UsernsError> {
    let (ready_read, ready_write) = pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(sys("pipe"))?;
    let (done_read, done_write) = pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(sys("pipe"))?;
    // SAFETY: the child of a multithreaded process may only make
    // async-signal-safe calls: it unshares, writes a byte, reads one and
    // exits, all plain system calls on descriptors opened before the fork.
    match unsafe { fork() }.map_err(sys("fork"))? {
        ForkResult::Child => {
            drop(ready_read);
            drop(done_write);
            let code = match unshare(CloneFlags::CLONE_NEWUSER) {
                Ok(()) => {
                    let _ = fs::File::from(ready_write).write_all(b"u");
                    let _ = fs::File::from(done_read).read(&mut [0u8; 1]);
                    0
                }
                Err(_) => 1,
            };
            // SAFETY: _exit ends the forked copy without running the parent's
            // exit handlers or flushing its buffers.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => {
            drop(ready_write);
            drop(done_read);
            let made = fs::File::from(ready_read)
                .read(&mut [0u8; 1])
                .ok()
                .filter(|n| *n == 1)
                .ok_or(UsernsError::Child)
                .and_then(|_| {
                    let map = id_map(base);
                    for file in ["uid_map", "gid_map"] {
                        let path = format!("/proc/{child}/{file}");
                        if let Err(source) = fs::write(&path, &map) {
                            let action = "write";
                            return Err(UsernsError::Io {
                                action,
                                path,
                                source,
                            });
                        }
                    }
                    let path = format!("/proc/{child}/ns/user");
                    match fs::File::open(&path) {
                        Ok(file) => Ok(OwnedFd::from(file)),
                        Err(source) => Err(UsernsError::Io {
                            action: "open",
                            path,
                            source,
                        }),
                    }
                });
            // A child that already exited does not read it (EPIPE, ignored).
            let _ = fs::File::from(done_write).write_all(b"d");
            let _ = waitpid(child, None);
            made
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_parse_and_must_fit_below_the_invalid_id() {
        assert_eq!(
            IdPool::parse("100000:10").unwrap(),
            IdPool {
                start: 100000,
                count: 10
            }
        );
        let default = IdPool::default();
        assert!(
            u64::from(default.start) + u64::from(default.count) * u64::from(RANGE_SIZE) <= 1 << 31
        );
        for bad in ["", "1", "0:5", "5:0", "x:1", "4294000000:100", "100000:-1"] {
            assert!(IdPool::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ranges_are_distinct_stable_per_sandbox_and_reused_once_released() {
        let ranges = IdRanges::new(IdPool {
            start: 1 << 20,
            count: 2,
        });
        let a = ranges.take("a").unwrap();
        assert_eq!(a, 1 << 20);
        assert_eq!(ranges.take("a").unwrap(), a);
        let b = ranges.take("b").unwrap();
        assert_eq!(b, a + RANGE_SIZE);
        let full = ranges.take("c").unwrap_err();
        assert!(full.to_string().contains("--userns-pool"), "{full}");
        ranges.release("a");
        assert_eq!(ranges.take("c").unwrap(), a);
    }

    #[test]
    fn a_claim_takes_a_free_range_of_the_pool_only() {
        let ranges = IdRanges::new(IdPool {
            start: 1 << 20,
            count: 2,
        });
        let a = ranges.take("a").unwrap();
        assert!(!ranges.claim("b", a), "taken by a");
        assert!(ranges.claim("a", a), "a's own");
        assert!(!ranges.claim("b", a + 1), "not a range start");
        assert!(!ranges.claim("b", a + 2 * RANGE_SIZE), "beyond the pool");
        assert!(!ranges.claim("b", 5), "below the pool");
        assert!(ranges.claim("b", a + RANGE_SIZE));
        assert!(ranges.take("c").is_err(), "the claim holds its range");
    }

    /// Two creates at once made two of these at once, each child holding the
    /// other's pipe ends: both waited for an end of file forever.
    #[test]
    fn namespaces_made_at_once_on_many_threads_all_finish() {
        if !cove_testenv::root("making user namespaces") {
            return;
        }
        let (done, finished) = std::sync::mpsc::channel();
        for thread in 0..4u32 {
            let done = done.clone();
            std::thread::spawn(move || {
                for _ in 0..25 {
                    let made = make(100_000 + thread * RANGE_SIZE);
                    done.send(made.map(drop).map_err(|e| e.to_string()))
                        .unwrap();
                }
            });
        }
        drop(done);
        for _ in 0..100 {
            let made = finished
                .recv_timeout(std::time::Duration::from_secs(20))
                .expect("every namespace is made, none waits forever");
            made.unwrap();
        }
    }

    #[test]
    fn a_map_never_reaches_host_root() {
        assert_eq!(id_map(2_000_000_000), "0 2000000000 65536\n");
    }
}
