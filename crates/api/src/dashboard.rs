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
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::{ApiError, AppState};

const INDEX: &str = include_str!("../dashboard/index.html");
const APP_JS: &str = include_str!("../dashboard/app.js");
const APP_CSS: &str = include_str!("../dashboard/app.css");
const XTERM_JS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/xterm.js"));
const XTERM_CSS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/xterm.css"));

/// The page's policy when the request names no plain host: scripts, styles
/// and connections of this origin only, nothing inline but styles (xterm.js
/// sets its own), no `eval`; never framed, so no other page can overlay it.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
     img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// The page's policy for a browser that reached this server as `host`: as
/// [`POLICY`], with every source named down to its path. `'self'` would also
/// allow `/preview/...`, which a sandbox serves on this same origin, so a
/// script injected as `<script src=/preview/...>` would run there and a
/// `fetch` could carry data out to a sandbox; named paths allow neither.
fn page_policy(host: Option<&str>) -> String {
    let Some(host) = host.filter(|host| is_plain_host(host)) else {
        return POLICY.to_owned();
    };
    let assets = |files: &[&str]| {
        files
            .iter()
            .map(|file| format!("{host}/dashboard/{file}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    format!(
        "default-src 'none'; script-src {scripts}; style-src {styles} 'unsafe-inline'; \
         img-src data:; connect-src {host}/api/ {host}/toolbox/ ws://{host}/api/socket.io/ \
         wss://{host}/api/socket.io/ ws://{host}/toolbox/ wss://{host}/toolbox/; \
         base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        scripts = assets(&["app.js", "xterm.js"]),
        styles = assets(&["app.css", "xterm.css"]),
    )
}

/// A `Host` that can stand in a policy as it is: a name or address and a
/// port, nothing that could end a directive or start a path.
fn is_plain_host(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 255
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
}

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(index))
        .route("/dashboard/{file}", get(asset))
}

async fn index(headers: HeaderMap) -> Response {
    let host = headers
        .get(header::HOST)
        .and_then(|value| value.to_str().ok());
    let policy = HeaderValue::from_str(&page_policy(host))
        .unwrap_or_else(|_| HeaderValue::from_static(POLICY));
    serve("text/html; charset=utf-8", INDEX.as_bytes(), policy)
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
    serve(content_type, body, HeaderValue::from_static(POLICY))
}

fn serve(content_type: &'static str, body: &'static [u8], policy: HeaderValue) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_SECURITY_POLICY, policy);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_names_its_sources_down_to_the_path_and_never_the_previews() {
        let policy = page_policy(Some("cove.test:3000"));
        assert!(
            policy.contains(
                "script-src cove.test:3000/dashboard/app.js cove.test:3000/dashboard/xterm.js;"
            ),
            "{policy}"
        );
        assert!(policy.contains("ws://cove.test:3000/toolbox/"), "{policy}");
        assert!(
            !policy.contains("'self'") && !policy.contains("preview"),
            "{policy}"
        );
        // A host that could end a directive is not written into one.
        for odd in ["evil; script-src *", "a/b", "", "h\"x"] {
            assert_eq!(page_policy(Some(odd)), POLICY, "{odd}");
        }
        assert_eq!(page_policy(None), POLICY);
    }
}
