//! Network namespaces as files: `{state_dir}/netns/<id>` is a bind mount of a
//! namespace, which keeps it alive with no process in it and lets the
//! container shim `setns` into it. A namespace is made by a short-lived thread
//! that unshares its own network namespace (allowed in a threaded process, unlike
//! a mount namespace), pins it, and opens a netlink socket inside it, through
//! which the namespace is configured from anywhere afterwards.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};

use crate::NetError;

/// A fresh namespace pinned at a path, with a way to configure it.
pub(crate) struct Namespace {
    /// The pinned namespace, opened; as `IFLA_NET_NS_FD` it places a new link inside.
    pub file: File,
    /// An rtnetlink handle whose socket lives in the namespace; its connection
    /// task runs on the tokio runtime until the handle is dropped.
    pub handle: rtnetlink::Handle,
}

/// Makes a network namespace pinned at `path` (replacing whatever a previous
/// run left there). IPv6 is off for every interface but `lo`: cove routes and
/// polices only IPv4, so an IPv6 path out or to the host must not exist.
pub(crate) async fn create(path: PathBuf) -> Result<Namespace, NetError> {
    let runtime = tokio::runtime::Handle::current();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let thread_path = path.clone();
    std::thread::Builder::new()
        .name("cove-netns".into())
        .spawn(move || {
            let made = make_in_this_thread(&thread_path, &runtime);
            let _ = tx.send(made);
        })
        .map_err(NetError::io("spawn a thread to make a network namespace"))?;
    let (file, connection, handle) = rx.await.map_err(|_| NetError::Io {
        action: format!("make network namespace {}", path.display()),
        source: io::Error::other("the namespace thread ended without an answer"),
    })??;
    tokio::spawn(connection);
    Ok(Namespace { file, handle })
}

type Connection = rtnetlink::proto::Connection<rtnetlink::packet_route::RouteNetlinkMessage>;

/// Runs on a thread of its own: the unshare changes only this thread, which
/// ends right after, so no other work ever runs in the new namespace by mistake.
fn make_in_this_thread(
    path: &Path,
    runtime: &tokio::runtime::Handle,
) -> Result<(File, Connection, rtnetlink::Handle), NetError> {
    let at = |what: &str| format!("{what} for network namespace {}", path.display());
    unshare(CloneFlags::CLONE_NEWNET)
        .map_err(|errno| NetError::io(at("unshare"))(io::Error::from(errno)))?;
    // /proc/sys/net shows the namespace of the thread that opens it.
    fs::write("/proc/sys/net/ipv6/conf/default/disable_ipv6", "1")
        .map_err(NetError::io(at("turn IPv6 off by default")))?;
    remove(path)?;
    File::create(path).map_err(NetError::io(at("create the mount point")))?;
    mount(
        Some("/proc/thread-self/ns/net"),
        path,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|errno| NetError::io(at("bind-mount"))(io::Error::from(errno)))?;
    let pinned = (|| {
        let file = File::open(path).map_err(NetError::io(at("open")))?;
        // The netlink socket belongs to the namespace it is opened in: this one.
        let _entered = runtime.enter();
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(NetError::io(at("open a netlink socket")))?;
        Ok((file, connection, handle))
    })();
    if pinned.is_err() {
        let _ = remove(path);
    }
    pinned
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
