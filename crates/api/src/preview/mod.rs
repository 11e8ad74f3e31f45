//! Preview URLs: HTTP (and WebSocket, server-sent events) to a port inside a
//! sandbox, served by cove's own listener.
//!
//! Two shapes of URL reach the same proxy:
//! - host-based, `http://{port}-{sandboxId}.{previewDomain}[:listen port]/...`,
//!   when the server has a preview domain (a wildcard DNS name pointing at it);
//!   such requests are taken before any other routing, whatever their path;
//! - path-based, `{publicUrl}/preview/{sandboxId}/{port}/...`, for setups without
//!   wildcard DNS. `/preview` sits at the root, beside `/api` and `/toolbox`, so
//!   it never meets Daytona's own `/api/preview/...` operations.
//!
//! A signed preview URL puts its token where the sandbox id goes. Private
//! sandboxes need their preview token (`X-Daytona-Preview-Token`) or an API key
//! (`Authorization: Bearer`); public ones need nothing. Neither credential
//! reaches the sandbox. Preview traffic does not reset the idle clock.

mod tunnel;
mod urls;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode, Version};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use cove_engine::Caller;
use hyper_util::rt::TokioIo;

use crate::{auth, ApiError, AppState};

pub(crate) use tunnel::TunnelClient;
pub(crate) use urls::{expire_signed_preview_url, preview_url, signed_preview_url};

/// The header Daytona's SDK documents for a sandbox's preview token.
pub(crate) const TOKEN_HEADER: &str = "x-daytona-preview-token";

/// Response headers that speak for a whole origin, which a path-based
/// preview does not own: it is served from the origin of the API and the web
/// console. Without them a sandbox's page cannot claim the origin's root for
/// its service worker (where it would see the console's requests and key),
/// keep a handle on a console it opens (its own `Cross-Origin-Opener-Policy`
/// matching the console's would), have the browser report the origin's
/// traffic to it, wipe the origin's data, or move its traffic elsewhere.
/// Host-based previews keep them: their origin is the sandbox's own.
const ORIGIN_WIDE: &[&str] = &[
    "service-worker-allowed",
    "cross-origin-opener-policy",
    "report-to",
    "reporting-endpoints",
    "nel",
    "clear-site-data",
    "alt-svc",
];

/// The tunnel client and the preview tokens already read, by sandbox id
/// (a token never changes once made, so the cache cannot go stale).
#[derive(Clone)]
pub(crate) struct Previews {
    tunnels: TunnelClient,
    tokens: Arc<Mutex<HashMap<String, String>>>,
}

impl Previews {
    pub(crate) fn new() -> Previews {
        Previews {
            tunnels: TunnelClient::new(),
            tokens: Arc::default(),
        }
    }
}

/// The sandbox's preview token, from the cache or the engine.
async fn token_of(state: &AppState, id: &str) -> Result<String, ApiError> {
    if let Some(token) = state.previews.tokens.lock().unwrap().get(id) {
        return Ok(token.clone());
    }
    let (record, token) = state.engine.access().preview_token(id).await?;
    state
        .previews
        .tokens
        .lock()
        .unwrap()
        .insert(record.id, token.clone());
    Ok(token)
}

/// Which port of what a preview request asks for: `target` is a sandbox id (or
/// name), or the token of a signed preview URL.
struct Target {
    target: String,
    port: u16,
    /// What the client sees before the forwarded path (`/preview/{t}/{p}`), if any.
    prefix: Option<String>,
    /// The path and query the application gets.
    rest: String,
}

pub(crate) fn parse_port(port: &str) -> Result<u16, ApiError> {
    // The OpenAPI document types the port as a number, so `3000.0` is a port too.
    let number = port
        .parse::<u64>()
        .ok()
        .or_else(|| {
            port.parse::<f64>()
                .ok()
                .filter(|p| p.fract() == 0.0 && *p >= 0.0 && *p <= 65535.0)
                .map(|p| p as u64)
        })
        .filter(|p| (1..=65535).contains(p));
    number
        .map(|p| p as u16)
        .ok_or_else(|| ApiError::bad_request(format!("port must be 1-65535, got {port:?}")))
}

/// Takes preview requests by their Host before any other routing.
pub(crate) async fn by_host(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let Some(domain) = state.config.preview_domain.as_deref() else {
        return next.run(request).await;
    };
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| request.uri().host())
        .unwrap_or_default()
        .to_ascii_lowercase();
    let Some(label) = urls::preview_label(&host, domain) else {
        return next.run(request).await;
    };
    // Counted in the metrics under one fixed route: the Host names a sandbox.
    let mut response = async {
        let Some((port, target)) = label.split_once('-') else {
            return ApiError::bad_request(format!(
                "preview host {host} is not {{port}}-{{sandboxId}}.{domain}"
            ))
            .into_response();
        };
        let port = match parse_port(port) {
            Ok(port) => port,
            Err(error) => return error.into_response(),
        };
        let rest = request
            .uri()
            .path_and_query()
            .map(|pq| pq.as_str().to_owned())
            .unwrap_or_else(|| "/".to_owned());
        let target = Target {
            target: target.to_owned(),
            port,
            prefix: None,
            rest,
        };
        serve(state.clone(), target, request)
            .await
            .unwrap_or_else(IntoResponse::into_response)
    }
    .await;
    response
        .extensions_mut()
        .insert(crate::metrics::RouteTemplate::HOST_PREVIEW);
    response
}

/// `/preview/{sandboxIdOrSignedToken}/{port}/...`
pub(crate) async fn by_path(State(state): State<AppState>, request: Request) -> Response {
    let raw = request
        .uri()
        .path_and_query()
        .map(|pq| pq.as_str())
        .unwrap_or("/");
    let Some(after) = raw.strip_prefix("/preview/") else {
        return ApiError::new(StatusCode::NOT_FOUND, "no such preview").into_response();
    };
    let (path, query) = match after.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (after, None),
    };
    let mut parts = path.splitn(3, '/');
    let (Some(target), Some(port)) = (parts.next(), parts.next()) else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "a preview path is /preview/{sandboxId}/{port}/...",
        )
        .into_response();
    };
    let port = match parse_port(port) {
        Ok(port) => port,
        Err(error) => return error.into_response(),
    };
    let prefix = format!("/preview/{target}/{port}");
    let Some(rest) = parts.next() else {
        // Without the slash a browser resolves relative links one level too
        // high (`/preview/{id}/style.css`); 308 keeps the method and body.
        let location = match query {
            Some(query) => format!("{prefix}/?{query}"),
            None => format!("{prefix}/"),
        };
        return (
            StatusCode::PERMANENT_REDIRECT,
            [(header::LOCATION, location)],
        )
            .into_response();
    };
    let rest = match query {
        Some(query) => format!("/{rest}?{query}"),
        None => format!("/{rest}"),
    };
    let target = Target {
        target: target.to_owned(),
        port,
        prefix: Some(prefix),
        rest,
    };
    serve(state, target, request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// The sandbox a preview names. Without an API key, by its id only: names
/// are unique per organization, not on the server, so a name would open
/// whichever organization's sandbox of that name is oldest. With a key of
/// an organization, by id or name among that organization's (another's is
/// not found).
async fn preview_target(
    state: &AppState,
    target: &str,
    caller: Option<&Caller>,
) -> Result<cove_engine::SandboxRecord, ApiError> {
    let not_found = || -> ApiError {
        cove_engine::EngineError::SandboxNotFound {
            id: target.to_owned(),
        }
        .into()
    };
    if let Some(caller) = caller.filter(|caller| !caller.operator) {
        let scoped = state.engine.scoped(&caller.organization_id);
        return Ok(scoped.sandboxes().get(target).await?);
    }
    let record = state.engine.sandboxes().get(target).await?;
    if record.id == target {
        Ok(record)
    } else {
        Err(not_found())
    }
}

/// The sandbox id a request may reach, or why not. `caller` is who the
/// request's API key is, if it came with one of this server's.
async fn authorize(
    state: &AppState,
    target: &Target,
    headers: &HeaderMap,
    caller: Option<&Caller>,
) -> Result<String, ApiError> {
    if urls::looks_like_token(&target.target) {
        if let Some(signed) = state.engine.access().signed_preview(&target.target).await? {
            if signed.port != target.port {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    format!(
                        "this signed preview URL opens port {}, not {}",
                        signed.port, target.port
                    ),
                ));
            }
            if signed.expires_at_ms <= cove_engine::now_ms() {
                return Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    format!(
                        "this signed preview URL of sandbox {} expired at {}; ask for a new one",
                        signed.sandbox_id,
                        crate::dto::rfc3339(signed.expires_at_ms)
                    ),
                ));
            }
            return Ok(signed.sandbox_id);
        }
    }
    let record = preview_target(state, &target.target, caller).await?;
    if record.public {
        return Ok(record.id);
    }
    if let Some(given) = headers.get(TOKEN_HEADER) {
        let token = token_of(state, &record.id).await?;
        if cove_engine::constant_time_eq(given.as_bytes(), token.as_bytes()) {
            return Ok(record.id);
        }
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            format!("wrong preview token for sandbox {}", record.id),
        ));
    }
    // The record was looked up in the key's organization: any key that
    // found it may open it.
    if caller.is_some() {
        return Ok(record.id);
    }
    if auth::bearer(headers).is_some() {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            format!("invalid API key for the preview of sandbox {}", record.id),
        ));
    }
    Err(ApiError::new(
        StatusCode::UNAUTHORIZED,
        format!(
            "sandbox {id} is private: send its preview token in X-Daytona-Preview-Token \
             (GET /api/sandbox/{id}/ports/{port}/preview-url) or an API key as \
             Authorization: Bearer, or use a signed preview URL",
            id = record.id,
            port = target.port
        ),
    ))
}

async fn serve(
    state: AppState,
    target: Target,
    mut request: Request,
) -> Result<Response, ApiError> {
    let caller = auth::bearer_caller(&state, request.headers()).await?;
    let id = authorize(&state, &target, request.headers(), caller.as_ref()).await?;
    // The API key never reaches the sandbox, even when something else let the
    // request in; an application's own Authorization header does.
    let strip_authorization = caller.is_some();
    // Not `engine.toolbox`: a preview must not reset the idle clock.
    let (record, endpoint) = state.engine.sandboxes().agent(&id).await?;
    state.previews.tunnels.set_endpoint(&record.id, endpoint);
    let port = target.port;
    let uri = TunnelClient::uri(&record.id, port, &target.rest)
        .ok_or_else(|| ApiError::bad_request(format!("invalid preview path {:?}", target.rest)))?;

    let client_upgrade = request
        .headers()
        .contains_key(header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut request));
    // HTTP/2 requests name their host in the URI, not in a header.
    let host = request.headers().get(header::HOST).cloned().or_else(|| {
        request
            .uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });
    *request.uri_mut() = uri;
    // The application speaks HTTP/1.1 over the tunnel whatever the client spoke.
    *request.version_mut() = Version::HTTP_11;
    let headers = request.headers_mut();
    headers.remove(TOKEN_HEADER);
    if strip_authorization {
        headers.remove(header::AUTHORIZATION);
    }
    let host = host.unwrap_or_else(|| HeaderValue::from_static("localhost"));
    headers.insert(HeaderName::from_static("x-forwarded-host"), host.clone());
    headers.insert(header::HOST, host);
    headers.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
    if let Some(prefix) = target.prefix.as_deref() {
        if let Ok(prefix) = HeaderValue::from_str(prefix) {
            headers.insert(HeaderName::from_static("x-forwarded-prefix"), prefix);
        }
    }

    let mut response = state
        .previews
        .tunnels
        .client
        .request(request)
        .await
        .map_err(|error| proxy_error(&record.id, port, &error))?;
    if target.prefix.is_some() {
        let headers = response.headers_mut();
        for name in ORIGIN_WIDE {
            headers.remove(*name);
        }
    }

    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            return Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!(
                    "port {port} of sandbox {} upgraded a plain request",
                    record.id
                ),
            ));
        };
        let app_upgrade = hyper::upgrade::on(&mut response);
        tokio::spawn(async move {
            match tokio::try_join!(client_upgrade, app_upgrade) {
                Ok((client, app)) => {
                    let mut client = TokioIo::new(client);
                    let mut app = TokioIo::new(app);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut app).await;
                }
                Err(error) => tracing::debug!(%error, "preview upgrade failed"),
            }
        });
    }
    Ok(response.map(Body::new))
}

/// The tunnel's own reason when it could not be opened, else the client's.
fn proxy_error(id: &str, port: u16, error: &(dyn std::error::Error + 'static)) -> ApiError {
    let mut source = Some(error);
    while let Some(cause) = source {
        if let Some(tunnel) = cause.downcast_ref::<tunnel::TunnelError>() {
            return ApiError::new(tunnel.status, tunnel.message.clone());
        }
        source = cause.source();
    }
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!(
            "port {port} of sandbox {id} did not answer: {}",
            cove_engine::describe(error)
        ),
    )
}
