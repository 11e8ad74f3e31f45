//! Serving the app on a TCP listener, plain or TLS, with the limits that keep
//! a hostile client from holding the server's connections and descriptors.
//!
//! Each connection is HTTP/1.1 only, served by hyper's own connection builder
//! with a Tokio timer, so `header_read_timeout` runs from the first byte the
//! server waits for: a client that never finishes its request line and
//! headers is closed when it runs out, and so is a kept-alive connection that
//! sits idle that long between requests (hyper starts the same timer when it
//! waits for the next request). hyper-util's `auto` builder is not used: it
//! first reads enough bytes to tell HTTP/2 from HTTP/1 with no timer, so a
//! client that sends nothing would never meet the timeout; cove's clients
//! (the SDKs, `cove`, browsers through previews) speak HTTP/1.1, and the TLS
//! listener offers only `http/1.1` by ALPN. A TLS client must finish its
//! handshake within `tls_handshake_timeout`.
//!
//! At most `max_connections` connections are served at once per listener.
//! Over the cap the listener stops accepting until one ends: new clients wait
//! in the kernel's listen backlog rather than being refused, so a burst of
//! honest clients is served late instead of failing, and a flood of silent
//! ones frees its slots within the header timeout. Once a request's headers
//! are in, the connection is the handler's: upgraded connections (WebSocket
//! PTYs, log follows, preview upgrades, tunnels) and streamed bodies live as
//! long as they need, each holding its slot.
//!
//! Knows nothing of the routes it serves.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

pub use tokio_rustls::TlsAcceptor;

/// Time a client has to send a request's headers (and the longest a
/// kept-alive connection may idle between requests).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(20);
/// Time a TLS client has to finish its handshake.
pub const DEFAULT_TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(20);
/// Connections served at once by one listener, unless the server derives a
/// cap from its descriptor limit.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// The limits of one listener.
#[derive(Clone, Copy, Debug)]
pub struct ListenerLimits {
    pub header_read_timeout: Duration,
    pub tls_handshake_timeout: Duration,
    pub max_connections: usize,
}

impl Default for ListenerLimits {
    fn default() -> ListenerLimits {
        ListenerLimits {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            tls_handshake_timeout: DEFAULT_TLS_HANDSHAKE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// Serves `app` on `listener` until the task is dropped; over TLS when `tls`
/// is given.
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: Router,
    limits: ListenerLimits,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let scheme = if tls.is_some() { "https" } else { "http" };
    loop {
        // The slot first: over the cap, clients wait in the backlog.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors, for one: wait rather than spin.
                tracing::warn!(%error, scheme, "accepting a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Small writes go at once: an upgraded stream (a terminal, an agent
        // tunnel) and a TLS handshake's flights would otherwise wait on the
        // peer's delayed ACK, some 40 ms each.
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%peer, %error, "TCP_NODELAY not set");
        }
        let app = app.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let Some(tls) = tls else {
                return serve_connection(stream, app, limits).await;
            };
            match tokio::time::timeout(limits.tls_handshake_timeout, tls.accept(stream)).await {
                Ok(Ok(stream)) => serve_connection(stream, app, limits).await,
                Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                Err(_) => tracing::debug!(
                    %peer,
                    timeout = ?limits.tls_handshake_timeout,
                    "TLS handshake not finished in time; closed"
                ),
            }
        });
    }
}

/// Serves HTTP/1.1 requests (and their upgrades) on one connection.
async fn serve_connection<S>(stream: S, app: Router, limits: ListenerLimits)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app))
        .with_upgrades()
        .await;
    if let Err(error) = served {
        tracing::debug!(%error, "connection ended");
    }
}
