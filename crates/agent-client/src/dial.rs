//! How a byte stream to an agent is made.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use cove_protocol::SandboxId;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Opens a new connection to an agent. `authority` is the host of the
/// request's URI: what tells agents apart when one pool serves many.
pub trait Dial: Clone + Send + Sync + 'static {
    type Io: AsyncRead + AsyncWrite + Send + Unpin + 'static;
    type Error: std::error::Error + Send + Sync + 'static;

    fn dial(&self, authority: &str) -> BoxFuture<Result<Self::Io, Self::Error>>;
}

/// The agent listening on one Unix socket (whatever the authority).
#[derive(Clone, Debug)]
pub struct UnixSocket(pub PathBuf);

impl Dial for UnixSocket {
    type Io = UnixStream;
    type Error = io::Error;

    fn dial(&self, _: &str) -> BoxFuture<io::Result<UnixStream>> {
        let socket = self.0.clone();
        Box::pin(async move { UnixStream::connect(socket).await })
    }
}

/// The agents of many sandboxes, by id: the authority is the sandbox id.
/// Where each listens is set before each request (a restarted sandbox's
/// agent has a new socket), and dialed at once if at all. So an entry not
/// set for [`KEEP`] serves no request: a later `set` drops it, and the map
/// holds the sandboxes in use, not every one this server ever started.
#[derive(Clone, Debug, Default)]
pub struct Sockets(Arc<Mutex<Known>>);

/// How long an entry is kept after it was last set.
const KEEP: Duration = Duration::from_secs(120);
/// The fewest entries a `set` sweeps the old ones from.
const FIRST_SWEEP: usize = 256;

#[derive(Debug, Default)]
struct Known {
    by_id: HashMap<String, (Endpoint, Instant)>,
    /// The size at which the next `set` sweeps: twice what the last sweep
    /// kept, so sweeping costs a constant share of the sets.
    sweep_at: usize,
}

impl Sockets {
    pub fn set(&self, id: &SandboxId, endpoint: Endpoint) {
        self.set_at(id.as_str(), endpoint, Instant::now());
    }

    fn set_at(&self, id: &str, endpoint: Endpoint, now: Instant) {
        let mut known = self.0.lock().unwrap();
        if known.by_id.len() >= known.sweep_at.max(FIRST_SWEEP) {
            known
                .by_id
                .retain(|_, (_, set)| now.saturating_duration_since(*set) < KEEP);
            known.sweep_at = known.by_id.len() * 2;
        }
        known.by_id.insert(id.to_owned(), (endpoint, now));
    }

    pub fn get(&self, id: &str) -> Option<Endpoint> {
        let known = self.0.lock().unwrap();
        known.by_id.get(id).map(|(endpoint, _)| endpoint.clone())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().unwrap().by_id.len()
    }
}

impl Dial for Sockets {
    type Io = AgentStream;
    type Error = io::Error;

    fn dial(&self, id: &str) -> BoxFuture<io::Result<AgentStream>> {
        let endpoint = self.get(id);
        let id = id.to_owned();
        Box::pin(async move {
            let endpoint = endpoint.ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, format!("no agent known for {id}"))
            })?;
            endpoint.connect().await
        })
    }
}

/// Where the agent of one sandbox is reached from this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix socket on this host; the agent serves HTTP on it.
    Unix(PathBuf),
    /// A sandbox on a runner on another machine: each connection is a TCP
    /// connection to the runner's service, switched by an authenticated
    /// upgrade into a byte stream to the agent (see [`RunnerTunnel`]).
    Runner(RunnerTunnel),
}

/// The way to a sandbox's agent through the runner that runs it:
/// `GET /sandboxes/{sandbox}/agent` with `Upgrade: cove-agent` and the
/// runner's service key, answered `101` by a runner that runs the sandbox.
#[derive(Clone, PartialEq, Eq)]
pub struct RunnerTunnel {
    /// `host:port` of the runner's service.
    pub address: String,
    pub sandbox: String,
    /// The key the runner's service takes (it reported it to the control
    /// plane, which keeps it only in memory).
    pub key: String,
    /// Over TLS, when the runner serves `https://`.
    pub tls: Option<RunnerTls>,
}

/// How a runner serving `https://` is reached: the client configuration
/// (the roots its certificate must chain to) and the name it must carry.
#[derive(Clone)]
pub struct RunnerTls {
    pub config: Arc<rustls::ClientConfig>,
    pub server_name: rustls::pki_types::ServerName<'static>,
}

impl PartialEq for RunnerTls {
    fn eq(&self, other: &RunnerTls) -> bool {
        Arc::ptr_eq(&self.config, &other.config) && self.server_name == other.server_name
    }
}

impl Eq for RunnerTls {}

impl std::fmt::Debug for RunnerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunnerTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for RunnerTunnel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunnerTunnel")
            .field("address", &self.address)
            .field("sandbox", &self.sandbox)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

/// The protocol a runner's service upgrades a connection to: raw bytes
/// to and from the agent of one sandbox.
pub const RUNNER_TUNNEL_PROTOCOL: &str = "cove-agent";

/// The most of a runner's answer to a tunnel request that is read.
const TUNNEL_HEAD_LIMIT: usize = 8 << 10;
/// How long connecting to a runner and reading its answer may take.
const TUNNEL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A byte stream to an agent: a Unix socket's, or a TCP connection through
/// a runner, over TLS when the runner serves it.
#[derive(Debug)]
pub enum AgentStream {
    Unix(UnixStream),
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Endpoint {
    /// A new connection to the agent.
    pub async fn connect(&self) -> io::Result<AgentStream> {
        match self {
            Endpoint::Unix(socket) => UnixStream::connect(socket).await.map(AgentStream::Unix),
            Endpoint::Runner(tunnel) => tunnel.open().await,
        }
    }
}

impl Dial for Endpoint {
    type Io = AgentStream;
    type Error = io::Error;

    fn dial(&self, _: &str) -> BoxFuture<io::Result<AgentStream>> {
        let endpoint = self.clone();
        Box::pin(async move { endpoint.connect().await })
    }
}

impl RunnerTunnel {
    /// Connects to the runner and asks it for the agent; the stream is the
    /// agent's once the runner switched protocols. The answer's head is
    /// read a byte at a time, so nothing of the agent's is read with it.
    pub async fn open(&self) -> io::Result<AgentStream> {
        let timed_out = || {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the runner at {} did not open the agent of {} within {} s",
                    self.address,
                    self.sandbox,
                    TUNNEL_TIMEOUT.as_secs()
                ),
            )
        };
        tokio::time::timeout(TUNNEL_TIMEOUT, self.handshake())
            .await
            .map_err(|_| timed_out())?
    }

    async fn handshake(&self) -> io::Result<AgentStream> {
        let stream = TcpStream::connect(&self.address).await?;
        stream.set_nodelay(true)?;
        match &self.tls {
            None => self.upgrade(stream).await.map(AgentStream::Tcp),
            Some(tls) => {
                let connector = tokio_rustls::TlsConnector::from(tls.config.clone());
                let stream = connector
                    .connect(tls.server_name.clone(), stream)
                    .await
                    .map_err(|error| {
                        io::Error::new(
                            error.kind(),
                            format!("TLS with the runner at {}: {error}", self.address),
                        )
                    })?;
                let stream = self.upgrade(stream).await?;
                Ok(AgentStream::Tls(Box::new(stream)))
            }
        }
    }

    /// Asks the runner, on `stream`, to switch it to the agent.
    async fn upgrade<S: AsyncRead + AsyncWrite + Unpin>(&self, mut stream: S) -> io::Result<S> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let request = format!(
            "GET /sandboxes/{}/agent HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\n\
             Connection: Upgrade\r\nUpgrade: {RUNNER_TUNNEL_PROTOCOL}\r\n\r\n",
            self.sandbox, self.address, self.key
        );
        stream.write_all(request.as_bytes()).await?;
        let mut head = Vec::with_capacity(256);
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if head.len() >= TUNNEL_HEAD_LIMIT || stream.read(&mut byte).await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "the runner at {} ended its answer for the agent of {} early",
                        self.address, self.sandbox
                    ),
                ));
            }
            head.push(byte[0]);
        }
        let status_line = String::from_utf8_lossy(&head);
        let status_line = status_line.lines().next().unwrap_or_default();
        if status_line.split(' ').nth(1) != Some("101") {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!(
                    "the runner at {} did not open the agent of {}: {}",
                    self.address,
                    self.sandbox,
                    status_line.trim()
                ),
            ));
        }
        Ok(stream)
    }
}

impl AsyncRead for AgentStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            AgentStream::Unix(stream) => Pin::new(stream).poll_read(cx, buf),
            AgentStream::Tcp(stream) => Pin::new(stream).poll_read(cx, buf),
            AgentStream::Tls(stream) => Pin::new(stream).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for AgentStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            AgentStream::Unix(stream) => Pin::new(stream).poll_write(cx, buf),
            AgentStream::Tcp(stream) => Pin::new(stream).poll_write(cx, buf),
            AgentStream::Tls(stream) => Pin::new(stream).poll_write(cx, buf),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            AgentStream::Unix(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            AgentStream::Tcp(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            AgentStream::Tls(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            AgentStream::Unix(stream) => stream.is_write_vectored(),
            AgentStream::Tcp(stream) => stream.is_write_vectored(),
            AgentStream::Tls(stream) => stream.is_write_vectored(),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            AgentStream::Unix(stream) => Pin::new(stream).poll_flush(cx),
            AgentStream::Tcp(stream) => Pin::new(stream).poll_flush(cx),
            AgentStream::Tls(stream) => Pin::new(stream).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            AgentStream::Unix(stream) => Pin::new(stream).poll_shutdown(cx),
            AgentStream::Tcp(stream) => Pin::new(stream).poll_shutdown(cx),
            AgentStream::Tls(stream) => Pin::new(stream).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(n: usize) -> Endpoint {
        Endpoint::Unix(PathBuf::from(format!("/run/agent-{n}.sock")))
    }

    #[test]
    fn sockets_not_set_for_a_while_go_and_those_in_use_stay() {
        let sockets = Sockets::default();
        let start = Instant::now();
        for n in 0..FIRST_SWEEP - 1 {
            sockets.set_at(&format!("old-{n}"), endpoint(n), start);
        }
        // Still in use: set again since.
        sockets.set_at("old-7", endpoint(7), start + Duration::from_secs(10));
        sockets.set_at("last", endpoint(999), start);
        assert_eq!(
            sockets.len(),
            FIRST_SWEEP,
            "nothing swept below the first size"
        );

        let later = start + KEEP + Duration::from_secs(1);
        sockets.set_at("new", endpoint(1000), later);
        assert_eq!(
            sockets.len(),
            2,
            "only the one set within KEEP, and the new one"
        );
        assert_eq!(sockets.get("old-7"), Some(endpoint(7)));
        assert_eq!(sockets.get("new"), Some(endpoint(1000)));
        assert_eq!(sockets.get("old-8"), None);

        // The next sweep waits for twice what this one kept.
        for n in 0..2 {
            sockets.set_at(&format!("more-{n}"), endpoint(n), later + KEEP * 2);
        }
        assert_eq!(sockets.len(), 4, "no sweep before {FIRST_SWEEP} entries");
    }
}
