//! The toolbox proxy: `/toolbox/{sandboxId}/{path}` is forwarded as it is to the
//! agent inside the sandbox, bodies streamed both ways, WebSocket upgrades
//! spliced. The proxy never parses a toolbox request: the agent owns that API.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use cove_runtime::AgentEndpoint;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::UnixStream;

use crate::{ApiError, AppState};

/// A pooled HTTP client whose "hosts" are sandbox ids, each reached over the
/// Unix socket of its agent. Keeping connections open matters: a new connection
/// per command would be a visible share of a 1-2 ms round trip.
#[derive(Clone)]
pub struct AgentClient {
    sockets: Arc<Mutex<HashMap<String, PathBuf>>>,
    client: Client<AgentConnector, Body>,
}

impl AgentClient {
    pub fn new() -> AgentClient {
        let sockets: Arc<Mutex<HashMap<String, PathBuf>>> = Arc::default();
        let connector = AgentConnector {
            sockets: sockets.clone(),
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(std::time::Duration::from_secs(30))
            .build(connector);
        AgentClient { sockets, client }
    }
}

/// Connects a sandbox id to its agent's socket.
#[derive(Clone)]
pub struct AgentConnector {
    sockets: Arc<Mutex<HashMap<String, PathBuf>>>,
}

pub struct AgentStream(TokioIo<UnixStream>);

impl Connection for AgentStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl hyper::rt::Read for AgentStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for AgentStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    // Vectored writes let hyper send a body chunk as it came, with its
    // headers, instead of copying every byte of an upload into its buffer.
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

impl tower::Service<Uri> for AgentConnector {
    type Response = AgentStream;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<AgentStream, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let id = uri.host().unwrap_or_default().to_owned();
        let socket = self.sockets.lock().unwrap().get(&id).cloned();
        Box::pin(async move {
            let socket = socket.ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("no agent known for {id}"),
                )
            })?;
            Ok(AgentStream(TokioIo::new(
                UnixStream::connect(socket).await?,
            )))
        })
    }
}

pub async fn proxy_root(
    state: State<AppState>,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    forward(state, id, request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub async fn proxy(
    state: State<AppState>,
    Path((id, _)): Path<(String, String)>,
    request: Request,
) -> Response {
    forward(state, id, request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn forward(
    State(state): State<AppState>,
    id: String,
    mut request: Request,
) -> Result<Response, ApiError> {
    let (id, endpoint) = state.engine.toolbox(&id).await?;
    let AgentEndpoint::Unix(socket) = endpoint;
    state
        .toolbox
        .sockets
        .lock()
        .unwrap()
        .insert(id.clone(), socket);

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

    let client_upgrade = request
        .headers()
        .contains_key(header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut request));
    *request.uri_mut() = uri;
    let headers = request.headers_mut();
    // The API key stays outside: nothing in the sandbox may read it.
    headers.remove(header::AUTHORIZATION);
    if let Ok(host) = HeaderValue::from_str(&id) {
        headers.insert(header::HOST, host);
    }

    let mut response = state.toolbox.client.request(request).await.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "the agent of sandbox {id} did not answer: {}",
                cove_engine::describe(&e)
            ),
        )
    })?;

    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            return Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "the agent upgraded a plain request",
            ));
        };
        let agent_upgrade = hyper::upgrade::on(&mut response);
        tokio::spawn(async move {
            match tokio::try_join!(client_upgrade, agent_upgrade) {
                Ok((client, agent)) => {
                    let mut client = TokioIo::new(client);
                    let mut agent = TokioIo::new(agent);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut agent).await;
                }
                Err(error) => tracing::debug!(%error, "toolbox upgrade failed"),
            }
        });
    }
    Ok(response.map(Body::new))
}
