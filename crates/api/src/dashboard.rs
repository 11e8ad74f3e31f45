//! The web console at `/`: one page and its script, style and the vendored
//! terminal (xterm.js), all built into the binary (`build.rs`, `dashboard/`).
//!
//! The page holds no secret and no data: it asks for an API key, keeps it in
//! the page's memory, and does everything through the public API with it
//! (`/api`, the toolbox proxy, Socket.IO), so it shows nothing the key could
//! not do. Everything a sandbox controls (names, labels, file names, logs) is
//! written into the page as text, never as markup, and the policy below lets
//! the page run its own script only, so such bytes can never run as script.

use axum::extract::Path;
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::{ApiError, AppState};

const INDEX: &str = include_str!("../dashboard/index.html");
const APP_JS: &str = include_str!("../dashboard/app.js");
const APP_CSS: &str = include_str!("../dashboard/app.css");
const XTERM_JS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/xterm.js"));
const XTERM_CSS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/xterm.css"));

/// Scripts from this server only, nothing inline and no `eval`; styles may be
/// inline because xterm.js sets its own; connections to this origin only
/// (`'self'` covers its `ws:`/`wss:` too); never framed, so no other page can
/// overlay it.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
     img-src 'self' data: blob:; connect-src 'self'; font-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(index))
        .route("/dashboard/{file}", get(asset))
}

async fn index() -> Response {
    serve("text/html; charset=utf-8", INDEX.as_bytes())
}

async fn asset(Path(file): Path<String>) -> Response {
    let (content_type, body): (&str, &'static [u8]) = match file.as_str() {
        "app.js" => ("text/javascript; charset=utf-8", APP_JS.as_bytes()),
        "app.css" => ("text/css; charset=utf-8", APP_CSS.as_bytes()),
        "xterm.js" => ("text/javascript; charset=utf-8", XTERM_JS),
        "xterm.css" => ("text/css; charset=utf-8", XTERM_CSS),
        _ => {
            return ApiError::new(
                StatusCode::NOT_FOUND,
                format!("the dashboard has no file {file:?}"),
            )
            .into_response()
        }
    };
    if body.is_empty() {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "{file} was not built into this cove (run scripts/setup, which installs \
                 crates/api/dashboard's packages, then cargo build)"
            ),
        )
        .into_response();
    }
    serve(content_type, body)
}

fn serve(content_type: &'static str, body: &'static [u8]) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // The binary is the version: a page and its script always come together.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        HeaderName::from_static("cross-origin-opener-policy"),
        HeaderValue::from_static("same-origin"),
    );
    response
}
