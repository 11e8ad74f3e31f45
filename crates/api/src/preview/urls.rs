//! The control API of previews: a sandbox's preview URL and token, signed
//! preview URLs and their early expiry, and the shape of preview URLs.

use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;

use super::{parse_port, token_of};
use crate::dto::{PortPreviewUrl, SignedPortPreviewUrl};
use crate::{ApiError, AppState};

/// Daytona's default lifetime of a signed preview URL.
const DEFAULT_SIGNED_S: u32 = 60;
/// The longest a signed preview URL may live: a day.
const MAX_SIGNED_S: u32 = 24 * 60 * 60;

/// The label of a preview host (`{port}-{target}`), if `host` (lower case,
/// with or without a port) is directly under the preview domain.
pub(super) fn preview_label<'h>(host: &'h str, domain: &str) -> Option<&'h str> {
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let label = name
        .strip_suffix(domain.trim_matches('.'))?
        .strip_suffix('.')?;
    (!label.is_empty() && !label.contains('.')).then_some(label)
}

/// Whether a preview target can be a signed token (what the engine makes:
/// 32 lower-case letters and digits), so other targets skip that lookup.
pub(super) fn looks_like_token(target: &str) -> bool {
    target.len() == 32
        && target
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Scheme, host name and port (with its colon, or empty) clients reach this
/// server at: the configured public URL, or this request's Host.
fn origin(state: &AppState, headers: &HeaderMap) -> (String, String, String) {
    let (scheme, authority) = match &state.config.public_url {
        Some(url) => {
            let (scheme, rest) = url.split_once("://").unwrap_or(("http", url));
            let authority = rest.split('/').next().unwrap_or(rest);
            (scheme.to_owned(), authority.to_owned())
        }
        None => (
            "http".to_owned(),
            headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or("127.0.0.1")
                .to_owned(),
        ),
    };
    match authority.rsplit_once(':') {
        Some((name, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
            (scheme, name.to_owned(), format!(":{port}"))
        }
        _ => (scheme, authority, String::new()),
    }
}

/// The preview URL of `port` of `target` (a sandbox id or a signed token):
/// host-based with a preview domain, else path-based.
pub(super) fn url_of(state: &AppState, headers: &HeaderMap, target: &str, port: u16) -> String {
    match &state.config.preview_domain {
        Some(domain) => {
            let (scheme, _, listen_port) = origin(state, headers);
            let domain = domain.trim_matches('.');
            format!("{scheme}://{port}-{target}.{domain}{listen_port}")
        }
        None => {
            let base = match &state.config.public_url {
                Some(url) => url.trim_end_matches('/').to_owned(),
                None => {
                    let (scheme, host, listen_port) = origin(state, headers);
                    format!("{scheme}://{host}{listen_port}")
                }
            };
            format!("{base}/preview/{target}/{port}")
        }
    }
}

/// `GET /sandbox/{id}/ports/{port}/preview-url`
pub(crate) async fn preview_url(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path((id, port)): Path<(String, String)>,
) -> Result<Json<PortPreviewUrl>, ApiError> {
    let port = parse_port(&port)?;
    let record = tenant.sandboxes().get(&id).await?;
    let token = token_of(&state, &record.id).await?;
    Ok(Json(PortPreviewUrl {
        url: url_of(&state, &headers, &record.id, port),
        sandbox_id: record.id,
        token,
    }))
}

/// `GET /sandbox/{id}/ports/{port}/signed-preview-url?expiresInSeconds=N`
pub(crate) async fn signed_preview_url(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path((id, port)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> Result<Json<SignedPortPreviewUrl>, ApiError> {
    let port = parse_port(&port)?;
    let mut expires_in = DEFAULT_SIGNED_S;
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        if key == "expiresInSeconds" {
            expires_in = value
                .parse()
                .ok()
                .filter(|s| (1..=MAX_SIGNED_S).contains(s))
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "expiresInSeconds must be 1-{MAX_SIGNED_S}, got {value:?}"
                    ))
                })?;
        }
    }
    let id = tenant.sandboxes().get(&id).await?.id;
    let signed = state
        .engine
        .access()
        .sign_preview(&id, port, expires_in)
        .await?;
    Ok(Json(SignedPortPreviewUrl {
        url: url_of(&state, &headers, &signed.token, port),
        sandbox_id: signed.sandbox_id,
        port,
        token: signed.token,
    }))
}

/// `POST /sandbox/{id}/ports/{port}/signed-preview-url/{token}/expire`
pub(crate) async fn expire_signed_preview_url(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    Path((id, port, token)): Path<(String, String, String)>,
) -> Result<StatusCode, ApiError> {
    let port = parse_port(&port)?;
    let id = tenant.sandboxes().get(&id).await?.id;
    state
        .engine
        .access()
        .expire_signed_preview(&id, port, &token)
        .await?;
    Ok(StatusCode::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preview_hosts_are_one_label_under_the_domain() {
        let domain = "preview.localhost";
        assert_eq!(
            preview_label("3000-abc.preview.localhost:8080", domain),
            Some("3000-abc")
        );
        assert_eq!(
            preview_label("3000-abc.preview.localhost", domain),
            Some("3000-abc")
        );
        assert_eq!(preview_label("preview.localhost", domain), None);
        assert_eq!(preview_label("a.b.preview.localhost", domain), None);
        assert_eq!(preview_label("3000-abcpreview.localhost", domain), None);
        assert_eq!(preview_label("127.0.0.1:3000", domain), None);
    }

    #[test]
    fn signed_tokens_are_recognised_by_shape() {
        assert!(looks_like_token("abcdefghijklmnopqrstuvwxyz012345"));
        assert!(!looks_like_token("6d3c0f3e-8f0e-4a43-9a55-2f0a0c0e7f11"));
        assert!(!looks_like_token("ABCDEFGHIJKLMNOPQRSTUVWXYZ012345"));
    }
}
