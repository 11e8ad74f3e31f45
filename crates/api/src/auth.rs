//! Bearer API keys on every request: the key names its [`Caller`], which the
//! handlers and [`crate::permissions`] read from the request's extensions,
//! and the organization the request acts in: a key's own, always (Daytona
//! reads `X-Daytona-Organization-ID` only with a user's login, never with a
//! key); the operator's key acts in the one that header names, else in the
//! default one. Handlers reach the engine through [`Tenant`], which sees
//! only that organization's resources.

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use cove_engine::{Caller, KeyCheck, Scoped};

use crate::{ApiError, AppState};

/// The header that picks the organization a request acts in.
pub(crate) const ORGANIZATION_HEADER: &str = "x-daytona-organization-id";

/// The name the `COVE_API_KEY` key goes by in listings and the audit.
pub(crate) const ENV_KEY_NAME: &str = "COVE_API_KEY";
/// How `COVE_API_KEY` is shown: not even masked, since it is not cove's.
pub(crate) const ENV_KEY_MASKED: &str = "(COVE_API_KEY)";

pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// The subprotocol a browser's WebSocket offers beside its key, and the one
/// cove answers with (see [`websocket_key`]).
pub(crate) const WEBSOCKET_PROTOCOL: &str = "cove";
/// The prefix of the subprotocol that carries a key: `cove.key.` and the key
/// in unpadded base64url, so any key is a valid protocol token.
const WEBSOCKET_KEY_PREFIX: &str = "cove.key.";

/// Whether a subprotocol offered is one that carries a key (in any case, so
/// no spelling of it slips past [`without_keys`]).
fn carries_key(protocol: &str) -> bool {
    protocol
        .get(..WEBSOCKET_KEY_PREFIX.len())
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(WEBSOCKET_KEY_PREFIX))
}

/// Whether `headers` ask for a WebSocket: `Upgrade: websocket`.
fn is_websocket(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim().eq_ignore_ascii_case("websocket"))
}

/// The subprotocols a WebSocket handshake offers, over every
/// `Sec-WebSocket-Protocol` line.
pub(crate) fn websocket_protocols(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
}

/// The key a browser's WebSocket handshake carries. A browser cannot set
/// `Authorization` on a WebSocket, and a key in the URL would be logged and
/// kept in history, so the dashboard offers it as a subprotocol
/// (`cove.key.<base64url>`) beside [`WEBSOCKET_PROTOCOL`], which the answer
/// names. Only WebSocket handshakes are read this way, and the toolbox proxy
/// takes every key-carrying protocol off before the sandbox sees the request
/// ([`without_keys`]).
pub(crate) fn websocket_key(headers: &HeaderMap) -> Option<String> {
    use base64::Engine as _;
    if !is_websocket(headers) {
        return None;
    }
    let encoded = websocket_protocols(headers)
        .find(|protocol| carries_key(protocol))
        .map(|protocol| &protocol[WEBSOCKET_KEY_PREFIX.len()..])?;
    let key = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(encoded)
        .ok()?;
    String::from_utf8(key).ok()
}

/// The subprotocols of a handshake with every key-carrying one removed, and
/// whether there was one: what may go on to a sandbox (`None` when nothing
/// is left), and whether the answer must name [`WEBSOCKET_PROTOCOL`]. Beside
/// a key, [`WEBSOCKET_PROTOCOL`] is cove's own and goes too.
pub(crate) fn without_keys(headers: &HeaderMap) -> (Option<String>, bool) {
    let had_key = websocket_protocols(headers).any(carries_key);
    let kept: Vec<&str> = websocket_protocols(headers)
        .filter(|protocol| !protocol.is_empty() && !carries_key(protocol))
        .filter(|protocol| !(had_key && *protocol == WEBSOCKET_PROTOCOL))
        .collect();
    let kept = (!kept.is_empty()).then(|| kept.join(", "));
    (kept, had_key)
}

pub(crate) async fn require_api_key(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let websocket = websocket_key(request.headers());
    let Some(token) = bearer(request.headers()).or(websocket.as_deref()) else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing API key: send Authorization: Bearer <key>",
        )
        .into_response();
    };
    let caller = match authenticate(&state, token).await {
        Ok(caller) => caller,
        Err(error) => return error.into_response(),
    };
    match acting_in(&state, caller, request.headers()).await {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(error) => error.into_response(),
    }
}

/// `caller` acting in the organization the request names, if it names one
/// and may. A key of an organization acts in it whatever the header says,
/// as Daytona's keys do. The operator's key acts in the organization the
/// header names when it is an organization's id in form (the default one's,
/// or a UUID; one that does not exist is a 404); any other value is no
/// organization's id and is not read as one (the pinned SDK sends its
/// `revoke_ssh_access` token in this header).
async fn acting_in(
    state: &AppState,
    caller: Caller,
    headers: &HeaderMap,
) -> Result<Caller, ApiError> {
    if !caller.operator {
        return Ok(caller);
    }
    let Some(asked) = headers
        .get(ORGANIZATION_HEADER)
        .and_then(|value| value.to_str().ok())
        .map(str::trim)
        .filter(|asked| names_an_organization(asked))
    else {
        return Ok(caller);
    };
    state.engine.organizations().get(asked).await?;
    Ok(caller.in_organization(asked))
}

/// Whether a header value is an organization's id in form: the default
/// organization's, or a UUID (every other organization's).
fn names_an_organization(value: &str) -> bool {
    value == cove_engine::DEFAULT_ORGANIZATION || uuid::Uuid::try_parse(value).is_ok()
}

/// The engine as the request's organization sees it: another organization's
/// sandbox, snapshot, volume or registry is not found through it.
pub(crate) struct Tenant(pub(crate) Scoped);

impl std::ops::Deref for Tenant {
    type Target = Scoped;

    fn deref(&self) -> &Scoped {
        &self.0
    }
}

impl FromRequestParts<AppState> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Tenant, ApiError> {
        let caller = parts.extensions.get::<Caller>().ok_or_else(|| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing API key: send Authorization: Bearer <key>",
            )
        })?;
        Ok(Tenant(state.engine.scoped(&caller.organization_id)))
    }
}

/// Who `token` is: the server's configured key (the operator) or a stored
/// key that has not expired; else a 401 saying which.
pub(crate) async fn authenticate(state: &AppState, token: &str) -> Result<Caller, ApiError> {
    let from_env = state
        .config
        .env_api_key
        .as_deref()
        .is_some_and(|key| cove_engine::constant_time_eq(key.as_bytes(), token.as_bytes()));
    if from_env {
        return Ok(Caller::operator(ENV_KEY_NAME, ENV_KEY_MASKED));
    }
    match state.engine.access().check_api_key(token).await? {
        KeyCheck::Accepted(caller) => Ok(caller),
        KeyCheck::Expired { name } => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            format!("API key {name} has expired"),
        )),
        KeyCheck::Unknown => Err(ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key")),
    }
}

/// Who the request's `Authorization: Bearer` key is, if it is a key of
/// this server; `None` without one, or for a token it does not know (an
/// application's own).
pub(crate) async fn bearer_caller(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Option<Caller>, ApiError> {
    let Some(token) = bearer(headers) else {
        return Ok(None);
    };
    match authenticate(state, token).await {
        Ok(caller) => Ok(Some(caller)),
        Err(error) if error.status == StatusCode::UNAUTHORIZED => Ok(None),
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_websocket_offers_its_key_as_a_subprotocol_of_upgrades_only() {
        let mut headers = HeaderMap::new();
        // "key/with+odd=chars" in unpadded base64url.
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            "cove, cove.key.a2V5L3dpdGgrb2RkPWNoYXJz".parse().unwrap(),
        );
        assert_eq!(websocket_key(&headers), None, "not an upgrade");
        headers.insert(header::UPGRADE, "websocket".parse().unwrap());
        assert_eq!(
            websocket_key(&headers).as_deref(),
            Some("key/with+odd=chars")
        );
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            "cove.key.!!!".parse().unwrap(),
        );
        assert_eq!(websocket_key(&headers), None, "not base64url");
        headers.insert(header::SEC_WEBSOCKET_PROTOCOL, "cove".parse().unwrap());
        assert_eq!(websocket_key(&headers), None, "no key offered");
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            "cove, cove.key.a2V5".parse().unwrap(),
        );
        headers.insert(header::UPGRADE, "h2c".parse().unwrap());
        assert_eq!(websocket_key(&headers), None, "not a WebSocket");
    }

    #[test]
    fn every_spelling_of_a_key_protocol_is_taken_off_and_the_rest_kept() {
        let mut headers = HeaderMap::new();
        headers.append(
            header::SEC_WEBSOCKET_PROTOCOL,
            "cove.key.!!, chat, COVE.KEY.a2V5".parse().unwrap(),
        );
        headers.append(
            header::SEC_WEBSOCKET_PROTOCOL,
            "Cove.Key.x, cove".parse().unwrap(),
        );
        assert_eq!(without_keys(&headers), (Some("chat".to_owned()), true));
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            "cove.key.a2V5".parse().unwrap(),
        );
        assert_eq!(without_keys(&headers), (None, true));
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            "chat, cove".parse().unwrap(),
        );
        assert_eq!(
            without_keys(&headers),
            (Some("chat, cove".to_owned()), false)
        );
    }

    #[test]
    fn only_an_organizations_id_in_form_names_one() {
        assert!(names_an_organization("cove"));
        assert!(names_an_organization(
            "8d6958cd-b263-468b-b85c-ea4651ce84d3"
        ));
        // What the pinned SDK sends here in place of an organization: an
        // SSH access token.
        assert!(!names_an_organization(
            "4b1e03f98d8daaabeca9d09d0464c1bb8f011f51863331f2"
        ));
        assert!(!names_an_organization(""));
        assert!(!names_an_organization("Cove"));
    }
}
