//! Bearer API keys on every request.

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::{ApiError, AppState};

fn bearer(request: &Request) -> Option<&str> {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

pub async fn require_api_key(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let Some(token) = bearer(&request) else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing API key: send Authorization: Bearer <key>",
        )
        .into_response();
    };
    let from_env = state
        .config
        .env_api_key
        .as_deref()
        .is_some_and(|key| key == token);
    let accepted = from_env
        || match state.engine.verify_api_key(token).await {
            Ok(found) => found,
            Err(error) => return ApiError::from(error).into_response(),
        };
    if !accepted {
        return ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key").into_response();
    }
    next.run(request).await
}
