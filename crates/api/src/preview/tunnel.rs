//! A pooled HTTP client whose connections are tunnels to a port inside a
//! sandbox: each is a connection to the sandbox's agent socket upgraded with
//! `GET /cove/tunnel/{port}` (`Upgrade: cove-tcp`, see the agent's `tunnel`
//! module). The agent socket exists for every sandbox class, VMs included, so
//! this one path reaches any of them.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::{header, Request, StatusCode, Uri};
use http_body_util::BodyExt as _;
use hyper::upgrade::Upgraded;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::UnixStream;

/// The most of a response head (status line and headers) read from an
/// agent, and from an app behind a tunnel (the pooled client's buffer).
pub const HEAD_LIMIT: usize = 64 << 10;
/// The most of an agent's refusal of a tunnel that is read: a JSON message.
pub const REFUSAL_LIMIT: usize = 64 << 10;

/// Why a tunnel could not be opened, with the status the preview answers.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct TunnelError {
    pub status: StatusCode,
    pub message: String,
}

impl TunnelError {
    fn bad_gateway(message: String) -> TunnelError {
        TunnelError {
            status: StatusCode::BAD_GATEWAY,
            message,
        }
    }
}

/// The client and the agent sockets it dials, by sandbox id.
#[derive(Clone)]
pub struct TunnelClient {
    sockets: Arc<Mutex<HashMap<String, PathBuf>>>,
    pub client: Client<TunnelConnector, Body>,
}

impl TunnelClient {
    pub fn new() -> TunnelClient {
        let sockets: Arc<Mutex<HashMap<String, PathBuf>>> = Arc::default();
        // Bodies stream both ways untouched; only heads are parsed, and
        // they are bounded.
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(std::time::Duration::from_secs(30))
            .http1_max_buf_size(HEAD_LIMIT.max(8192))
            .build(TunnelConnector {
                sockets: sockets.clone(),
            });
        TunnelClient { sockets, client }
    }

    /// Remembers where the agent of sandbox `id` listens (it changes when the
    /// sandbox restarts).
    pub fn set_socket(&self, id: &str, socket: PathBuf) {
        self.sockets.lock().unwrap().insert(id.to_owned(), socket);
    }

    /// The URI of `path_and_query` on `port` of sandbox `id`: the pool keeps
    /// connections per authority, so each (sandbox, port) has its own.
    pub fn uri(id: &str, port: u16, path_and_query: &str) -> Option<Uri> {
        format!("http://{port}.{id}{path_and_query}").parse().ok()
    }
}

/// Opens a tunnel for a `http://{port}.{sandboxId}` URI.
#[derive(Clone)]
pub struct TunnelConnector {
    sockets: Arc<Mutex<HashMap<String, PathBuf>>>,
}

impl tower::Service<Uri> for TunnelConnector {
    type Response = TunnelStream;
    type Error = TunnelError;
    type Future = Pin<Box<dyn Future<Output = Result<TunnelStream, TunnelError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let host = uri.host().unwrap_or_default();
        let target = host
            .split_once('.')
            .and_then(|(port, id)| Some((port.parse::<u16>().ok()?, id.to_owned())));
        let sockets = self.sockets.clone();
        Box::pin(async move {
            let (port, id) = target
                .ok_or_else(|| TunnelError::bad_gateway(format!("no sandbox port in {uri}")))?;
            let socket = sockets.lock().unwrap().get(&id).cloned();
            let socket = socket.ok_or_else(|| {
                TunnelError::bad_gateway(format!("no agent known for sandbox {id}"))
            })?;
            open(&id, port, socket).await
        })
    }
}

async fn open(id: &str, port: u16, socket: PathBuf) -> Result<TunnelStream, TunnelError> {
    let agent_gone = |e: &dyn std::fmt::Display| {
        TunnelError::bad_gateway(format!("the agent of sandbox {id} did not answer: {e}"))
    };
    let stream = UnixStream::connect(&socket)
        .await
        .map_err(|e| agent_gone(&e))?;
    let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(HEAD_LIMIT.max(8192))
        .handshake(TokioIo::new(stream))
        .await
        .map_err(|e| agent_gone(&e))?;
    tokio::spawn(async move {
        if let Err(error) = connection.with_upgrades().await {
            tracing::debug!(%error, "tunnel connection to an agent ended");
        }
    });
    let request = Request::get(format!("/cove/tunnel/{port}"))
        .header(header::HOST, "cove-agent")
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, "cove-tcp")
        .body(Body::empty())
        .map_err(|e| agent_gone(&e))?;
    let mut response = sender
        .send_request(request)
        .await
        .map_err(|e| agent_gone(&e))?;
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let upgraded = hyper::upgrade::on(&mut response)
            .await
            .map_err(|e| agent_gone(&e))?;
        return Ok(TunnelStream(upgraded));
    }
    // The agent says why (nothing listening, most often) in a JSON message.
    let status = response.status();
    let body = match http_body_util::Limited::new(response.into_body(), REFUSAL_LIMIT)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes(),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            return Err(TunnelError::bad_gateway(format!(
                "the agent of sandbox {id} refused a tunnel to port {port} ({status}) \
                 with more than {REFUSAL_LIMIT} bytes; cove reads no more"
            )))
        }
        Err(_) => Default::default(),
    };
    let reason = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
    let message = if status == StatusCode::BAD_GATEWAY {
        format!("sandbox {id}: {reason}")
    } else {
        format!("the agent of sandbox {id} refused a tunnel to port {port} ({status}): {reason}")
    };
    Err(TunnelError::bad_gateway(message))
}

/// An open tunnel, as the pooled client sees a connection.
pub struct TunnelStream(Upgraded);

impl Connection for TunnelStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl hyper::rt::Read for TunnelStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for TunnelStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// An agent that answers with `head` and then bytes that never stop.
    fn hostile_agent(head: &'static [u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut request = [0u8; 4096];
                    let _ = stream.read(&mut request).await;
                    let chunk = vec![b'x'; 64 << 10];
                    let mut written = stream.write_all(head).await;
                    while written.is_ok() {
                        written = stream.write_all(&chunk).await;
                    }
                });
            }
        });
        (dir, socket)
    }

    #[tokio::test]
    async fn an_endless_refusal_is_cut_at_the_limit() {
        let (_dir, socket) = hostile_agent(b"HTTP/1.1 502 Bad Gateway\r\n\r\n");
        let error = open("sbx-1", 3000, socket).await.err().unwrap();
        assert_eq!(error.status, StatusCode::BAD_GATEWAY);
        assert!(error.message.contains("sandbox sbx-1"), "{}", error.message);
        assert!(error.message.contains("more than"), "{}", error.message);
    }

    #[tokio::test]
    async fn an_endless_header_is_refused() {
        let (_dir, socket) = hostile_agent(b"HTTP/1.1 101 Switching Protocols\r\nX-Endless: ");
        let error = open("sbx-2", 3000, socket).await.err().unwrap();
        assert!(error.message.contains("sandbox sbx-2"), "{}", error.message);
    }
}
