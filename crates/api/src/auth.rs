//! Bearer API keys on every request: the key names its [`Caller`], which the
//! handlers and [`crate::permissions`] read from the request's extensions,
//! and the organization the request acts in (the key's own; the operator's
//! key acts in the one `X-Daytona-Organization-ID` names, else the default
//! one). Handlers reach the engine through [`Tenant`], which sees only that
//! organization's resources.

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

/// `caller` acting in the organization the request names, if it may: the
/// operator in any that exists (404 otherwise), a key in its own only (403
/// for another, whether or not it exists).
async fn acting_in(
    state: &AppState,
    caller: Caller,
    headers: &HeaderMap,
) -> Result<Caller, ApiError> {
    let Some(value) = headers.get(ORGANIZATION_HEADER) else {
        return Ok(caller);
    };
    let asked = value
        .to_str()
        .map_err(|_| ApiError::bad_request("X-Daytona-Organization-ID is not text"))?
        .trim();
    if asked.is_empty() || asked == caller.organization_id {
        return Ok(caller);
    }
    if caller.operator {
        state.engine.organizations().get(asked).await?;
        return Ok(caller.in_organization(asked));
    }
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        format!(
            "API key {} acts in its own organization only, not in {asked:?} \
             (X-Daytona-Organization-ID)",
            caller.key_name
        ),
    ))
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

/// Whether `token` is a key of this server, of any organization.
pub(crate) async fn is_key(state: &AppState, token: &str) -> Result<bool, ApiError> {
    match authenticate(state, token).await {
        Ok(_) => Ok(true),
        Err(error) if error.status == StatusCode::UNAUTHORIZED => Ok(false),
        Err(error) => Err(error),
    }
}

/// Whether `token` is a key this server accepts for a resource of
/// `organization_id`: the operator's, or one of that organization.
pub(crate) async fn key_accepted_for(
    state: &AppState,
    token: &str,
    organization_id: &str,
) -> Result<bool, ApiError> {
    match authenticate(state, token).await {
        Ok(caller) => Ok(caller.operator || caller.organization_id == organization_id),
        Err(error) if error.status == StatusCode::UNAUTHORIZED => Ok(false),
        Err(error) => Err(error),
    }
}
