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
use tokio::sync::{watch, Semaphore};

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
    /// Time a client has from connecting to being authenticated; then it is
    /// dropped.
    pub auth_timeout: Duration,
    /// Connections served at once; over it the gateway stops accepting
    /// until one ends (clients wait in the listen backlog).
    pub max_connections: usize,
    /// Connections not yet authenticated at once; over it a new connection
    /// is closed at once, as OpenSSH's `MaxStartups` does.
    pub max_unauthenticated: usize,
}

impl GatewayConfig {
    /// A gateway on `listen` with the default limits.
    pub fn new(listen: SocketAddr, host_key: PathBuf) -> GatewayConfig {
        GatewayConfig {
            listen,
            host_key,
            auth_timeout: DEFAULT_AUTH_TIMEOUT,
            max_connections: 1024,
            max_unauthenticated: 64,
        }
    }
}

/// Time a client has to authenticate unless configured otherwise.
pub const DEFAULT_AUTH_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a disconnect message is given to reach the client before the
/// connection is dropped anyway.
const DISCONNECT_GRACE: Duration = Duration::from_secs(5);

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
            // secret is compared, so nothing to hide behind a delay. Only the
            // methods cove refuses outright (passwords, keys) are rejected;
            // a short delay slows a client that tries many, and stays well
            // inside the authentication timeout.
            auth_rejection_time: Duration::from_millis(500),
            auth_rejection_time_initial: Some(Duration::ZERO),
            max_auth_attempts: 4,
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
        let accept = tokio::spawn(accept_loop(
            engine,
            listener,
            server_config,
            config.clone(),
            stop,
        ));
        tracing::info!(
            addr = %local_addr,
            auth_timeout = ?config.auth_timeout,
            max_connections = config.max_connections,
            max_unauthenticated = config.max_unauthenticated,
            "ssh gateway listening"
        );
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
    limits: GatewayConfig,
    mut stop: watch::Receiver<bool>,
) {
    let connections = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let unauthenticated = Arc::new(Semaphore::new(limits.max_unauthenticated.max(1)));
    loop {
        // A slot first: over the cap, clients wait in the backlog.
        let slot = tokio::select! {
            _ = stop.changed() => return,
            slot = connections.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return,
            },
        };
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
        let Ok(unauthenticated) = unauthenticated.clone().try_acquire_owned() else {
            // Not a warning: a flood would fill the log.
            tracing::debug!(
                %peer,
                max = limits.max_unauthenticated,
                "too many ssh connections not yet authenticated; closed a new one"
            );
            continue;
        };
        let (on_admitted, admitted) = watch::channel(None);
        let handler =
            connection::Connection::new(engine.clone(), Some(peer), on_admitted, unauthenticated);
        let client = Client {
            engine: engine.clone(),
            peer,
            admitted,
            auth_deadline: tokio::time::Instant::now() + limits.auth_timeout,
            stop: stop.clone(),
        };
        let config = config.clone();
        tokio::spawn(async move {
            let _slot = slot;
            client.serve(config, socket, handler).await;
        });
    }
}

/// What the gateway keeps of one client connection besides its handler.
struct Client {
    engine: Engine,
    peer: SocketAddr,
    /// Set by the handler once the client is authenticated.
    admitted: watch::Receiver<Option<connection::Admitted>>,
    /// When a client that is not in by then is dropped.
    auth_deadline: tokio::time::Instant,
    stop: watch::Receiver<bool>,
}

/// How the wait for authentication ended.
enum Authentication {
    In(connection::Admitted),
    Ended(Result<(), russh::Error>),
    TimedOut,
    Stopped,
    HandlerGone,
}

impl Client {
    /// Runs the connection: drops it if it is not authenticated by the
    /// deadline, then closes it when its token is revoked or the gateway stops.
    async fn serve(
        mut self,
        config: Arc<Config>,
        socket: tokio::net::TcpStream,
        handler: connection::Connection,
    ) {
        let peer = self.peer;
        // russh runs the session in a task of its own, which dropping its
        // future does not end: a second descriptor of the socket lets the
        // gateway shut the connection down itself.
        let Some((socket, closer)) = with_closer(socket) else {
            return;
        };
        let close = || {
            let _ = closer.shutdown(std::net::Shutdown::Both);
        };
        // Subscribed before the token is first checked: no revocation is missed.
        let mut revocations = self.engine.access().ssh_access_revocations();
        let started = tokio::time::timeout_at(
            self.auth_deadline,
            russh::server::run_stream(config, socket, handler),
        );
        let session = match started.await {
            Ok(Ok(session)) => session,
            Ok(Err(error)) => {
                tracing::debug!(%peer, %error, "ssh handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "ssh client did not authenticate in time; dropped");
                return;
            }
        };
        let handle = session.handle();
        tokio::pin!(session);
        let authentication = tokio::select! {
            result = &mut session => Authentication::Ended(result),
            _ = self.stop.changed() => Authentication::Stopped,
            _ = tokio::time::sleep_until(self.auth_deadline) => Authentication::TimedOut,
            admitted = self.admitted.wait_for(Option::is_some) => {
                // No admission means the handler is gone: the session is ending.
                admitted.ok().and_then(|a| a.clone()).map_or(Authentication::HandlerGone, Authentication::In)
            }
        };
        let admitted = match authentication {
            Authentication::In(admitted) => admitted,
            Authentication::Ended(result) => {
                if let Err(error) = result {
                    tracing::debug!(%peer, %error, "ssh connection ended");
                }
                return;
            }
            Authentication::TimedOut => {
                tracing::debug!(%peer, "ssh client did not authenticate in time; dropped");
                close();
                return;
            }
            Authentication::Stopped => {
                close();
                return;
            }
            Authentication::HandlerGone => {
                let _ = (&mut session).await;
                return;
            }
        };
        let reason = loop {
            tokio::select! {
                result = &mut session => {
                    if let Err(error) = result {
                        tracing::debug!(%peer, %error, "ssh connection ended");
                    }
                    return;
                }
                _ = self.stop.changed() => break "cove is shutting down",
                changed = revocations.changed() => {
                    if changed.is_err() {
                        // The engine is gone; nothing more will be revoked.
                        let _ = (&mut session).await;
                        return;
                    }
                    match self.engine.access().validate_ssh_access(&admitted.token).await {
                        Ok(Some(id)) if id == admitted.sandbox_id => continue,
                        Ok(_) => {
                            tracing::info!(%peer, sandbox = %admitted.sandbox_id, "ssh access revoked; closing its connection");
                            break connection::TOKEN_GONE;
                        }
                        Err(error) => {
                            tracing::warn!(%peer, error = %session::error_chain(&error), "re-checking an ssh access token");
                            continue;
                        }
                    }
                }
            }
        };
        let _ = handle
            .disconnect(russh::Disconnect::ByApplication, reason.into(), "en".into())
            .await;
        if tokio::time::timeout(DISCONNECT_GRACE, &mut session)
            .await
            .is_err()
        {
            close();
        }
    }
}

/// The socket, and a second descriptor of it to shut it down with.
fn with_closer(
    socket: tokio::net::TcpStream,
) -> Option<(tokio::net::TcpStream, std::net::TcpStream)> {
    let socket = socket.into_std().ok()?;
    let closer = socket.try_clone().ok()?;
    let socket = tokio::net::TcpStream::from_std(socket).ok()?;
    Some((socket, closer))
}
