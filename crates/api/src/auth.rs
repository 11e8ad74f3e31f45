//! Bearer API keys on every request.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::{ApiError, AppState};

pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

pub(crate) async fn require_api_key(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let Some(token) = bearer(request.headers()) else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing API key: send Authorization: Bearer <key>",
        )
        .into_response();
    };
    match key_accepted(&state, token).await {
        Ok(true) => next.run(request).await,
        Ok(false) => ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key").into_response(),
        Err(error) => error.into_response(),
    }
}

/// Whether `token` is the server's configured key or a stored one.
pub(crate) async fn key_accepted(state: &AppState, token: &str) -> Result<bool, ApiError> {
    let from_env = state
        .config
        .env_api_key
        .as_deref()
        .is_some_and(|key| key == token);
    Ok(from_env || state.engine.access().verify_api_key(token).await?)
}
