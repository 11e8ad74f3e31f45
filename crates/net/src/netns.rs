//! Network namespaces as files: `{state_dir}/netns/<id>` is a bind mount of a
//! namespace, which keeps it alive with no process in it and lets the
//! container shim `setns` into it.
//!
//! Making a namespace (about 1.5 ms: the kernel initialises every
//! per-namespace subsystem) and a veth into it (1-2 ms: two devices registered)
//! is most of a sandbox's network setup, so a small pool of ready ones is kept,
//! made in the background: `attach` takes one, pins the namespace at its path
//! and gives `eth0` its address. A ready veth's host end is already an
//! isolated, up port of the bridge; the bridge's firewall passes no frame from
//! it until a sandbox's address is bound to it. A namespace is made by a short-lived
//! thread that unshares its own network namespace (allowed in a threaded
//! process, unlike a mount namespace), opens it, and opens a netlink socket
//! inside it, through which it is configured from anywhere afterwards. Pooled
//! namespaces are held only by those descriptors, so they vanish with the
//! process, and their veths with them: nothing of the pool outlives a crash.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};

use crate::config::NetworkConfig;
use crate::{links, NetError};

/// A fresh namespace with `lo` and `eth0` up (IPv6 off on `eth0`), and the
/// host end of `eth0`'s veth, a port of the bridge.
pub(crate) struct Namespace {
    /// The namespace, open.
    pub file: File,
    /// An rtnetlink handle whose socket lives in the namespace; its connection
    /// task runs on the tokio runtime until the handle is dropped.
    pub handle: rtnetlink::Handle,
    /// The veth's host end: its index and name.
    pub host_link: u32,
    pub port: String,
}

impl Namespace {
    /// Makes a namespace and its veth, whose host end is `host_name`. cove
    /// polices only IPv4, so no link but `lo` may have IPv6: there would be a
    /// path out or to the host that no rule sees.
    async fn make(
        host: &rtnetlink::Handle,
        port: String,
        bridge_index: u32,
    ) -> Result<Self, NetError> {
        let runtime = tokio::runtime::Handle::current();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("cove-netns".into())
            .spawn(move || {
                let _ = tx.send(make_in_this_thread(&runtime));
            })
            .map_err(NetError::io("spawn a thread to make a network namespace"))?;
        let (file, connection, handle) = rx.await.map_err(|_| NetError::Io {
            action: "make a network namespace".into(),
            source: io::Error::other("the namespace thread ended without an answer"),
        })??;
        tokio::spawn(connection);
        let loopback = async {
            handle
                .link()
                .set(rtnetlink::LinkUnspec::new_with_index(1).up().build())
                .execute()
                .await
                .map_err(NetError::netlink("bring lo up in a new network namespace"))
        };
        let veth = links::create_veth(host, &handle, &port, bridge_index, file.as_raw_fd());
        let (loopback, veth) = tokio::join!(loopback, veth);
        let host_link = veth?;
        if let Err(err) = loopback {
            let _ = links::delete_index(host, host_link).await;
            return Err(err);
        }
        Ok(Self {
            file,
            handle,
            host_link,
            port,
        })
    }

    /// Binds the namespace to `path` (replacing whatever a previous run left
    /// there), so it outlives this process's descriptors and can be joined.
    pub(crate) fn pin(&self, path: &Path) -> Result<(), NetError> {
        let at = |what: &str| format!("{what} for network namespace {}", path.display());
        remove(path)?;
        File::create(path).map_err(NetError::io(at("create the mount point")))?;
        let source = format!("/proc/self/fd/{}", self.file.as_raw_fd());
        let mounted = mount(
            Some(source.as_str()),
            path,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        );
        if let Err(errno) = mounted {
            let _ = fs::remove_file(path);
            return Err(NetError::io(at("bind-mount"))(io::Error::from(errno)));
        }
        Ok(())
    }
}

type Connection = rtnetlink::proto::Connection<rtnetlink::packet_route::RouteNetlinkMessage>;

/// Runs on a thread of its own: the unshare changes only this thread, which
/// ends right after, so no other work ever runs in the new namespace by mistake.
fn make_in_this_thread(
    runtime: &tokio::runtime::Handle,
) -> Result<(File, Connection, rtnetlink::Handle), NetError> {
    unshare(CloneFlags::CLONE_NEWNET)
        .map_err(|errno| NetError::io("unshare a network namespace")(io::Error::from(errno)))?;
    // /proc/sys/net and /proc/thread-self/ns/net show this thread's namespace.
    fs::write("/proc/sys/net/ipv6/conf/default/disable_ipv6", "1").map_err(NetError::io(
        "turn IPv6 off by default in a new network namespace",
    ))?;
    let file = File::open("/proc/thread-self/ns/net")
        .map_err(NetError::io("open a new network namespace"))?;
    // The netlink socket belongs to the namespace it is opened in: this one.
    let _entered = runtime.enter();
    let (connection, handle, _) = rtnetlink::new_connection().map_err(NetError::io(
        "open a netlink socket in a new network namespace",
    ))?;
    Ok((file, connection, handle))
}

/// Ready namespaces, refilled in the background up to `target`.
pub(crate) struct Pool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    target: usize,
    host: rtnetlink::Handle,
    config: NetworkConfig,
    bridge_index: u32,
    next_name: AtomicU32,
    refill: cove_quiet::Refill,
    state: Mutex<PoolState>,
}

/// How long `Pool::close` waits for a refill in flight.
const REFILL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Default)]
struct PoolState {
    ready: Vec<Namespace>,
    refilling: bool,
    closed: bool,
}

impl Pool {
    pub(crate) fn new(
        target: usize,
        host: rtnetlink::Handle,
        config: NetworkConfig,
        bridge_index: u32,
    ) -> Self {
        let pool = Self {
            inner: Arc::new(PoolInner {
                target,
                host,
                config,
                bridge_index,
                next_name: AtomicU32::new(0),
                refill: cove_quiet::Refill::default(),
                state: Mutex::default(),
            }),
        };
        pool.refill();
        pool
    }

    /// A ready namespace, or a new one when the pool is empty (a burst). The
    /// caller refills the pool when it is done: making a namespace holds the
    /// kernel's rtnl lock, which every step of an attach also needs.
    pub(crate) async fn take(&self) -> Result<Namespace, NetError> {
        let ready = {
            let mut state = self.inner.lock();
            let ready = state.ready.pop();
            if ready.is_some() && state.ready.is_empty() {
                self.inner.refill.emptied();
            }
            ready
        };
        match ready {
            Some(namespace) => Ok(namespace),
            None => self.inner.make().await,
        }
    }

    /// How many namespaces wait ready.
    pub(crate) fn ready(&self) -> usize {
        self.inner.lock().ready.len()
    }

    /// A port name no other port of this run has (for a TAP device), and
    /// the bridge's index.
    pub(crate) fn next_port(&self) -> (String, u32) {
        let n = self.inner.next_name.fetch_add(1, Ordering::Relaxed);
        (self.inner.config.port_name(n), self.inner.bridge_index)
    }

    /// Stops refilling and deletes the ready namespaces' veths (the
    /// namespaces end with their descriptors). A refill in flight finishes
    /// first, deleting what it made: the kernel would end that namespace's
    /// veth only some time after its last descriptor closed.
    pub(crate) async fn close(&self) {
        let ready = self.inner.close();
        for namespace in ready {
            let _ = links::delete_index(&self.inner.host, namespace.host_link).await;
        }
        let began = std::time::Instant::now();
        while self.inner.lock().refilling && began.elapsed() < REFILL_WAIT {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Tops the pool up in the background.
    pub(crate) fn refill(&self) {
        {
            let mut state = self.inner.lock();
            if state.refilling || state.closed || state.ready.len() >= self.inner.target {
                return;
            }
            state.refilling = true;
        }
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move {
            loop {
                // One at a time, and once requests leave the host quiet: a
                // refill should not compete with attaches. An empty pool
                // refills at once, since its next attach makes one anyway.
                let is_empty = || inner.lock().ready.is_empty();
                inner.refill.turn(&inner.config.quiet, is_empty).await;
                {
                    // Closed while it waited: nothing to make.
                    let mut state = inner.lock();
                    if state.closed {
                        state.refilling = false;
                        return;
                    }
                }
                let made = inner.make().await;
                let unwanted = {
                    let mut state = inner.lock();
                    match made {
                        Ok(namespace) if !state.closed => {
                            state.ready.push(namespace);
                            None
                        }
                        Ok(namespace) => Some(namespace),
                        Err(err) => {
                            tracing::error!(error = %err, "cannot make a network namespace for the pool");
                            state.refilling = false;
                            return;
                        }
                    }
                };
                // Closed while it was made (see `close`).
                if let Some(namespace) = unwanted {
                    let _ = links::delete_index(&inner.host, namespace.host_link).await;
                }
                let mut state = inner.lock();
                if state.closed || state.ready.len() >= inner.target {
                    state.refilling = false;
                    return;
                }
            }
        });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Without a runtime to delete them, the veths go with their namespaces.
        drop(self.inner.close());
    }
}

impl PoolInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().expect("namespace pool lock")
    }

    fn close(&self) -> Vec<Namespace> {
        let mut state = self.lock();
        state.closed = true;
        // A refill waiting for quiet stops waiting, and ends.
        self.refill.emptied();
        std::mem::take(&mut state.ready)
    }

    async fn make(&self) -> Result<Namespace, NetError> {
        let n = self.next_name.fetch_add(1, Ordering::Relaxed);
        Namespace::make(&self.host, self.config.port_name(n), self.bridge_index).await
    }
}

/// Unpins and deletes a namespace file; a missing one is not an error. The
/// namespace itself ends when nothing else uses it (no process, no socket).
pub(crate) fn remove(path: &Path) -> Result<(), NetError> {
    match umount2(path, MntFlags::MNT_DETACH) {
        // EINVAL: not a mount point (a bare file left by a crash).
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
        Err(errno) => {
            return Err(NetError::io(format!("unmount {}", path.display()))(
                io::Error::from(errno),
            ))
        }
    }
    match fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => {
            Err(NetError::io(format!("remove {}", path.display()))(err))
        }
        _ => Ok(()),
    }
}

/// Removes every namespace file under `dir` (leftovers of a previous run).
pub(crate) fn remove_all(dir: &Path) -> Result<Vec<String>, NetError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(NetError::io(format!("list {}", dir.display()))(err)),
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(NetError::io(format!("list {}", dir.display())))?;
        remove(&entry.path())?;
        removed.push(entry.file_name().to_string_lossy().into_owned());
    }
    Ok(removed)
}
