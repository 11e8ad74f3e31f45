//! The toolbox proxy: `/toolbox/{sandboxId}/{path}` is forwarded as it is to the
//! agent inside the sandbox, bodies streamed both ways, WebSocket upgrades
//! spliced. The proxy never parses a toolbox request: the agent owns that API.

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use cove_agent_client::{Pool, Sockets};
use cove_protocol::SandboxId;
use cove_runtime::AgentEndpoint;
use hyper_util::rt::TokioIo;

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
}

pub(crate) async fn proxy_root(
    state: State<AppState>,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    forward(state, id, request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub(crate) async fn proxy(
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
    let (id, endpoint) = state.engine.sandboxes().toolbox(&id).await?;
    let AgentEndpoint::Unix(socket) = endpoint;
    let id = SandboxId::parse(&id).map_err(|e| ApiError::bad_request(e.to_string()))?;
    state.toolbox.sockets.set(&id, socket);

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
    if let Ok(host) = HeaderValue::from_str(id.as_str()) {
        headers.insert(header::HOST, host);
    }

    let mut response = state.toolbox.pool.request(request).await.map_err(|e| {
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
