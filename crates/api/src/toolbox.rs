//! The toolbox proxy: `/toolbox/{sandboxId}/{path}` is forwarded as it is to the
//! agent inside the sandbox, bodies streamed both ways, WebSocket upgrades
//! spliced. The proxy never parses a toolbox request: the agent owns that API.
//! One path is known by name: a PTY's `connect` socket, whose 101 waits for
//! the agent's first message (see [`agent_speaks_first`]).

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use cove_agent_client::{Pool, Sockets};
use cove_protocol::SandboxId;

use futures_util::{future, FutureExt};
use http_body_util::{BodyExt, Limited};
use hyper_util::rt::TokioIo;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use crate::{ApiError, AppState};

/// The agents of all sandboxes, by id, through one pool (`cove-agent-client`):
/// a request's host is the sandbox id, reached over the Unix socket of its
/// agent.
#[derive(Clone)]
pub(crate) struct AgentClient {
    sockets: Sockets,
    pool: Pool<Sockets, Body>,
}

impl AgentClient {
    pub(crate) fn new() -> AgentClient {
        let sockets = Sockets::default();
        AgentClient {
            // hyper's own read buffer, as before: the proxy streams
            // downloads, and the toolbox API's heads are the agent's own.
            pool: Pool::with_read_buffer(sockets.clone(), None),
            sockets,
        }
    }

    /// Opens a connection to the agent of a sandbox that is starting, with a
    /// request it answers from memory (`GET /version`), and leaves it in the
    /// pool. A sandbox's first toolbox request then finds the connection
    /// made and the agent's request path run once: both cost a new container
    /// ~1 ms more than a second request, on the user's path. Runs beside
    /// the rest of the start (the engine calls this before it records the
    /// start) and never counts as use of the sandbox. The answer is read
    /// bounded, under a deadline, and dropped: the agent runs in the sandbox.
    pub(crate) fn warm(&self, id: &str, agent: &cove_agent_client::Endpoint) {
        let Ok(id) = SandboxId::parse(id) else { return };
        self.sockets.set(&id, agent.clone());
        let pool = self.pool.clone();
        tokio::spawn(async move {
            let request = axum::http::Request::get(format!("http://{id}/version"))
                .header(header::HOST, id.as_str())
                .body(Body::empty())
                .expect("a plain GET builds");
            let answered = tokio::time::timeout(WARM_WAIT, async {
                let response = pool
                    .request(request)
                    .await
                    .map_err(|e| cove_engine::describe(&e))?;
                Limited::new(response.into_body(), WARM_ANSWER_LIMIT)
                    .collect()
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            })
            .await;
            let failure = match answered {
                Ok(Ok(())) => None,
                Ok(Err(failure)) => Some(failure),
                Err(_) => Some(format!("no answer in {WARM_WAIT:?}")),
            };
            if let Some(failure) = failure {
                tracing::debug!(sandbox = %id, %failure, "warming the connection to a new agent");
            }
        });
    }
}

/// How long warming a new agent's connection may take; past it the request
/// is dropped (the first user request then makes its own).
const WARM_WAIT: Duration = Duration::from_secs(10);
/// The most of a warming answer read (the agent's version is a few bytes).
const WARM_ANSWER_LIMIT: usize = 4096;

pub(crate) async fn proxy_root(
    state: State<AppState>,
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    forward(state, tenant, id, request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub(crate) async fn proxy(
    state: State<AppState>,
    tenant: crate::auth::Tenant,
    Path((id, _)): Path<(String, String)>,
    request: Request,
) -> Response {
    forward(state, tenant, id, request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn forward(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    id: String,
    request: Request,
) -> Result<Response, ApiError> {
    let (id, endpoint) = tenant.sandboxes().toolbox(&id).await?;
    let id = SandboxId::parse(&id).map_err(|e| ApiError::bad_request(e.to_string()))?;
    state.toolbox.sockets.set(&id, endpoint);
    relay(&state.toolbox.pool, &id, request).await
}

/// Sends `request` to the agent of `id` and its answer back; an upgrade is
/// spliced once both sides have switched.
async fn relay(
    pool: &Pool<Sockets, Body>,
    id: &SandboxId,
    mut request: Request,
) -> Result<Response, ApiError> {
    // The raw path keeps its percent-encoding; only the `/toolbox/{id}` prefix goes.
    let raw = request
        .uri()
        .path_and_query()
        .map(|pq| pq.as_str())
        .unwrap_or("/");
    let rest = raw
        .strip_prefix("/toolbox/")
        .and_then(|r| r.find(['/', '?']).map(|i| &r[i..]))
        .unwrap_or("/");
    let rest = if rest.starts_with('?') {
        format!("/{rest}")
    } else {
        rest.to_owned()
    };
    let uri: Uri = format!("http://{id}{rest}")
        .parse()
        .map_err(|_| ApiError::bad_request(format!("invalid toolbox path {rest:?}")))?;
    let greets = agent_speaks_first(uri.path());

    let client_upgrade = request
        .headers()
        .contains_key(header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut request));
    *request.uri_mut() = uri;
    // A browser's key comes as a subprotocol: every such protocol stays
    // here, whatever it decodes to, and the answer names cove's.
    let (protocols, browser_key) = crate::auth::without_keys(request.headers());
    let headers = request.headers_mut();
    // The API key stays outside: nothing in the sandbox may read it. Nor do
    // the origin's cookies, which the toolbox API never needs and which a
    // browser would send on a WebSocket.
    headers.remove(header::AUTHORIZATION);
    headers.remove(header::COOKIE);
    if browser_key {
        headers.remove(header::SEC_WEBSOCKET_PROTOCOL);
        if let Some(value) = protocols.and_then(|p| HeaderValue::from_str(&p).ok()) {
            headers.insert(header::SEC_WEBSOCKET_PROTOCOL, value);
        }
    }
    if let Ok(host) = HeaderValue::from_str(id.as_str()) {
        headers.insert(header::HOST, host);
    }

    let mut response = pool.request(request).await.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "the agent of sandbox {id} did not answer: {}",
                cove_engine::describe(&e)
            ),
        )
    })?;

    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        if browser_key {
            response.headers_mut().insert(
                header::SEC_WEBSOCKET_PROTOCOL,
                HeaderValue::from_static(crate::auth::WEBSOCKET_PROTOCOL),
            );
        }
        let Some(client_upgrade) = client_upgrade else {
            return Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "the agent upgraded a plain request",
            ));
        };
        let agent_upgrade = hyper::upgrade::on(&mut response);
        let (agent, greeting) = if greets {
            let agent = agent_upgrade.await.map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!("the agent of sandbox {id} did not switch protocols: {e}"),
                )
            })?;
            let mut agent = TokioIo::new(agent);
            let greeting = greeting(&mut agent).await;
            (future::Either::Left(future::ready(Ok(agent))), greeting)
        } else {
            let agent = agent_upgrade.map(|upgraded| upgraded.map(TokioIo::new));
            (future::Either::Right(agent), Vec::new())
        };
        tokio::spawn(async move {
            match tokio::try_join!(client_upgrade, agent) {
                Ok((client, mut agent)) => {
                    let mut client = TokioIo::new(client);
                    if client.write_all(&greeting).await.is_err() {
                        return;
                    }
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut agent).await;
                }
                Err(error) => tracing::debug!(%error, "toolbox upgrade failed"),
            }
        });
    }
    Ok(response.map(Body::new))
}

/// A PTY's `connect` socket opens with the agent's `connected` message, and
/// the sync Python SDK waits only 100 ms for it after it reads the 101 (it
/// misses httpx_ws' `queue.Empty`, so a later message fails the connect). In
/// a VM under emulation the message can take longer than that to come out of
/// the guest, so for this path the proxy holds the 101 until the agent's
/// first bytes are here and sends them right behind it.
fn agent_speaks_first(path: &str) -> bool {
    path.strip_prefix("/process/pty/")
        .and_then(|rest| rest.strip_suffix("/connect"))
        .is_some_and(|session| !session.is_empty() && !session.contains('/'))
}

/// How long the proxy holds a 101 for the agent's first bytes: the SDK's own
/// connect timeout. Past it the socket is spliced with nothing held.
const GREETING_WAIT: Duration = Duration::from_secs(10);

/// The first bytes the agent sends on an upgraded socket, or nothing if it
/// sends none in [`GREETING_WAIT`] or closes.
async fn greeting(agent: &mut (impl AsyncRead + Unpin)) -> Vec<u8> {
    let mut buffer = vec![0; 16 * 1024];
    match tokio::time::timeout(GREETING_WAIT, agent.read(&mut buffer)).await {
        Ok(Ok(n)) => {
            buffer.truncate(n);
            buffer
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::routing::any;
    use axum::Router;
    use tokio::net::{TcpStream, UnixListener};
    use tokio::sync::Semaphore;

    use super::*;

    /// A frame as the agent's `connected` message goes out: text, unmasked.
    const FRAME: &[u8] = b"\x81\x05hello";

    /// An agent whose upgraded sockets say [`FRAME`] once `speak` has a permit.
    async fn agent(socket: std::path::PathBuf, speak: Arc<Semaphore>) {
        let app = Router::new().fallback(any(move |mut request: Request| {
            let speak = speak.clone();
            async move {
                // What the sandbox would see of a browser's key.
                let saw = match request.headers().get(header::SEC_WEBSOCKET_PROTOCOL) {
                    Some(protocols) => protocols.to_str().unwrap_or("?").to_owned(),
                    None => "nothing".to_owned(),
                };
                let cookie = match request.headers().contains_key(header::COOKIE) {
                    true => "yes",
                    false => "no",
                };
                let upgrade = hyper::upgrade::on(&mut request);
                tokio::spawn(async move {
                    let Ok(upgraded) = upgrade.await else { return };
                    let _ = speak.acquire().await;
                    let mut io = TokioIo::new(upgraded);
                    let _ = io.write_all(FRAME).await;
                    let _ = io.flush().await;
                    // Held open, as a session is, until the test ends.
                    let _ = io.read(&mut [0; 1]).await;
                });
                Response::builder()
                    .status(StatusCode::SWITCHING_PROTOCOLS)
                    .header(header::CONNECTION, "upgrade")
                    .header(header::UPGRADE, "websocket")
                    .header("x-agent-saw-protocols", saw)
                    .header("x-agent-saw-cookie", cookie)
                    .body(Body::empty())
                    .unwrap()
            }
        }));
        let listener = UnixListener::bind(socket).unwrap();
        axum::serve(listener, app).await.unwrap();
    }

    /// The proxy in front of that agent, on a loopback port.
    async fn proxy(socket: std::path::PathBuf) -> std::net::SocketAddr {
        let id = SandboxId::parse("sbx-1").unwrap();
        let sockets = Sockets::default();
        sockets.set(&id, cove_runtime::AgentEndpoint::Unix(socket));
        let pool = Pool::with_read_buffer(sockets, None);
        let app = Router::new().route(
            "/toolbox/{id}/{*path}",
            any(move |request: Request| {
                let (pool, id) = (pool.clone(), id.clone());
                async move {
                    relay(&pool, &id, request)
                        .await
                        .unwrap_or_else(IntoResponse::into_response)
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    async fn open(addr: std::net::SocketAddr, path: &str) -> TcpStream {
        open_with(addr, path, "").await
    }

    /// An upgrade of `path` with `extra` header lines (each ending in CRLF).
    async fn open_with(addr: std::net::SocketAddr, path: &str, extra: &str) -> TcpStream {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "GET /toolbox/sbx-1{path} HTTP/1.1\r\nHost: t\r\nConnection: upgrade\r\n\
             Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n{extra}\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream
    }

    /// Reads until `wanted` has arrived (or the stream ends), returning all of it.
    async fn read_until(stream: &mut TcpStream, wanted: &[u8]) -> Vec<u8> {
        let mut seen = Vec::new();
        let mut buffer = [0; 1024];
        while !seen.windows(wanted.len()).any(|w| w == wanted) {
            let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buffer))
                .await
                .expect("the proxy answers")
                .unwrap();
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buffer[..n]);
        }
        seen
    }

    #[tokio::test]
    async fn a_pty_connect_is_answered_with_the_agents_first_message() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let speak = Arc::new(Semaphore::new(0));
        tokio::spawn(agent(socket.clone(), speak.clone()));
        while !socket.exists() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let addr = proxy(socket).await;

        // Any other upgrade is answered as soon as the agent switches.
        let mut other = open(addr, "/process/session/s/command/c/logs?follow=true").await;
        let head = read_until(&mut other, b"\r\n\r\n").await;
        assert!(head.starts_with(b"HTTP/1.1 101"), "{head:?}");

        // A PTY's is held until the agent has spoken...
        let mut pty = open(addr, "/process/pty/p1/connect").await;
        let early = tokio::time::timeout(Duration::from_millis(300), pty.read(&mut [0; 64])).await;
        assert!(early.is_err(), "the 101 went out before the agent spoke");
        // ...then the 101 and that message come together.
        speak.add_permits(Semaphore::MAX_PERMITS / 2);
        let answer = read_until(&mut pty, FRAME).await;
        assert!(answer.starts_with(b"HTTP/1.1 101"), "{answer:?}");
        assert!(answer.ends_with(FRAME), "{answer:?}");
    }

    #[tokio::test]
    async fn a_browsers_key_stops_at_the_proxy_and_the_answer_names_coves_protocol() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        tokio::spawn(agent(socket.clone(), Arc::new(Semaphore::new(0))));
        while !socket.exists() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let addr = proxy(socket).await;
        let path = "/process/session/s/command/c/logs?follow=true";

        // "key" offered as the dashboard offers it.
        let mut browser = open_with(
            addr,
            path,
            "Sec-WebSocket-Protocol: cove, cove.key.a2V5, COVE.KEY.!!\r\nCookie: a=b\r\n",
        )
        .await;
        let head = String::from_utf8(read_until(&mut browser, b"\r\n\r\n").await).unwrap();
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        assert!(head.contains("x-agent-saw-protocols: nothing"), "{head}");
        assert!(head.contains("x-agent-saw-cookie: no"), "{head}");
        assert!(head.contains("sec-websocket-protocol: cove\r\n"), "{head}");

        // A client's own protocols, with no key among them, pass as they are.
        let mut other = open_with(addr, path, "Sec-WebSocket-Protocol: chat\r\n").await;
        let head = String::from_utf8(read_until(&mut other, b"\r\n\r\n").await).unwrap();
        assert!(head.contains("x-agent-saw-protocols: chat"), "{head}");
        assert!(!head.contains("sec-websocket-protocol"), "{head}");
    }

    #[test]
    fn only_a_pty_connect_is_held() {
        assert!(agent_speaks_first("/process/pty/abc/connect"));
        assert!(!agent_speaks_first("/process/pty//connect"));
        assert!(!agent_speaks_first("/process/pty/a/b/connect"));
        assert!(!agent_speaks_first("/process/pty/abc"));
        assert!(!agent_speaks_first("/process/interpreter/execute"));
    }
}
