//! cove's SSH gateway: `ssh TOKEN@host -p PORT` into a sandbox.
//!
//! The token (issued by `POST /api/sandbox/{id}/ssh-access`) is the SSH user
//! name; the engine says which sandbox it opens. Everything inside the sandbox
//! goes through its agent, the same HTTP API the toolbox proxy forwards to, so
//! containers and VMs are served alike: `exec` runs a command, `shell` a PTY
//! session, `direct-tcpip` (`ssh -L`) a tunnel to a port on the sandbox's
//! loopback. Owns the SSH protocol and the host key; knows nothing of the
//! store, runtimes or the HTTP API's JSON.

mod agent;
mod connection;
mod host_key;
mod session;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cove_engine::Engine;
use russh::server::Config;
use russh::{MethodKind, MethodSet};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use agent::AgentError;

#[derive(Debug, thiserror::Error)]
pub enum SshError {
    #[error("host key {path}: {reason}")]
    HostKey { path: String, reason: String },
    #[error("listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Settings of the gateway.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Where to accept SSH connections.
    pub listen: SocketAddr,
    /// The host key file; made on first start.
    pub host_key: PathBuf,
}

/// A running gateway; [`Gateway::shutdown`] stops it.
pub struct Gateway {
    local_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl Gateway {
    /// Loads (or makes) the host key, binds and starts accepting connections.
    pub async fn start(engine: Engine, config: GatewayConfig) -> Result<Gateway, SshError> {
        let key = tokio::task::spawn_blocking({
            let path = config.host_key.clone();
            move || host_key::load_or_create(&path)
        })
        .await
        .map_err(|e| SshError::HostKey {
            path: config.host_key.display().to_string(),
            reason: e.to_string(),
        })??;
        let server_config = Arc::new(Config {
            keys: vec![key],
            methods: MethodSet::from(&[MethodKind::None][..]),
            // Admission is decided by the token, looked up by hash: no
            // secret is compared, so nothing to hide behind a delay.
            auth_rejection_time: Duration::ZERO,
            auth_rejection_time_initial: Some(Duration::ZERO),
            // An interactive shell may sit quiet for long; keepalives find
            // dead clients instead of an inactivity timeout.
            inactivity_timeout: None,
            keepalive_interval: Some(Duration::from_secs(30)),
            keepalive_max: 4,
            nodelay: true,
            ..Config::default()
        });
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| SshError::Listen {
                    addr: config.listen,
                    source,
                })?;
        let local_addr = listener.local_addr().map_err(|source| SshError::Listen {
            addr: config.listen,
            source,
        })?;
        let (shutdown, stop) = watch::channel(false);
        let accept = tokio::spawn(accept_loop(engine, listener, server_config, stop));
        tracing::info!(addr = %local_addr, "ssh gateway listening");
        Ok(Gateway {
            local_addr,
            shutdown,
            accept,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting and closes every connection.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.accept.await;
    }
}

async fn accept_loop(
    engine: Engine,
    listener: TcpListener,
    config: Arc<Config>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let (socket, peer) = tokio::select! {
            _ = stop.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    tracing::warn!(%error, "ssh gateway accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let handler = connection::Connection::new(engine.clone(), Some(peer));
        let config = config.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let session = match russh::server::run_stream(config, socket, handler).await {
                Ok(session) => session,
                Err(error) => {
                    tracing::debug!(%peer, %error, "ssh handshake failed");
                    return;
                }
            };
            let handle = session.handle();
            tokio::pin!(session);
            tokio::select! {
                result = &mut session => {
                    if let Err(error) = result {
                        tracing::debug!(%peer, %error, "ssh connection ended");
                    }
                }
                _ = stop.changed() => {
                    let _ = handle
                        .disconnect(
                            russh::Disconnect::ByApplication,
                            "cove is shutting down".into(),
                            "en".into(),
                        )
                        .await;
                }
            }
        });
    }
}
