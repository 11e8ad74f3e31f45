//! Bearer API keys on every request: the key names its [`Caller`], which the
//! handlers and [`crate::permissions`] read from the request's extensions.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use cove_engine::{Caller, KeyCheck};

use crate::{ApiError, AppState};

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

pub(crate) async fn require_api_key(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(token) = bearer(request.headers()) else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing API key: send Authorization: Bearer <key>",
        )
        .into_response();
    };
    match authenticate(&state, token).await {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(error) => error.into_response(),
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

/// Whether `token` is a key this server accepts.
pub(crate) async fn key_accepted(state: &AppState, token: &str) -> Result<bool, ApiError> {
    match authenticate(state, token).await {
        Ok(_) => Ok(true),
        Err(error) if error.status == StatusCode::UNAUTHORIZED => Ok(false),
        Err(error) => Err(error),
    }
}
