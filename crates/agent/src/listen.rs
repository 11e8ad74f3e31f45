//! The listening socket and the HTTP/1.1 server on it (WebSocket upgrades
//! included): either a socket inherited from the container setup code
//! (`COVE_AGENT_LISTEN_FD`) or one bound here (`--socket PATH`, for tests).
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{FromRawFd as _, OwnedFd, RawFd};
use std::path::Path;

use axum::Router;
use nix::fcntl::{fcntl, FcntlArg, FdFlag};

/// Variable naming an inherited, bound and listening Unix stream socket.
pub use cove_protocol::env::LISTEN_FD as LISTEN_FD_ENV;

/// Where the server listens.
#[derive(Debug, Clone)]
pub enum Endpoint {
    InheritedFd(RawFd),
    Path(std::path::PathBuf),
}

pub fn open(endpoint: &Endpoint) -> io::Result<std::os::unix::net::UnixListener> {
    let listener = match endpoint {
        Endpoint::InheritedFd(fd) => {
            // SAFETY: the parent handed this descriptor to us alone through
            // COVE_AGENT_LISTEN_FD (read once, then removed from the
            // environment), so nothing else owns or closes it.
            let owned = unsafe { OwnedFd::from_raw_fd(*fd) };
            // Commands we spawn must not inherit the agent's socket.
            fcntl(*fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
            std::os::unix::net::UnixListener::from(owned)
        }
        Endpoint::Path(path) => bind(path)?,
    };
    listener.set_nonblocking(true)?;
    Ok(listener)
}

fn bind(path: &Path) -> io::Result<std::os::unix::net::UnixListener> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::os::unix::net::UnixListener::bind(path)
}

/// Serves `app` until SIGTERM or SIGINT.
pub async fn serve(listener: std::os::unix::net::UnixListener, app: Router) -> io::Result<()> {
    let listener = tokio::net::UnixListener::from_std(listener)?;
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down");
}
