//! `/api/api-keys` and `/api/users/me`: the keys of the request's
//! organization, as Daytona's API has them. A key's value is answered once, at its
//! creation; listings show it masked.

use axum::extract::{rejection::JsonRejection, Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use cove_engine::{ApiKeyInfo, Caller, Permission};
use serde::{Deserialize, Serialize};

use crate::auth::ENV_KEY_NAME;
use crate::dto::{rfc3339, DEFAULT_ORGANIZATION};
use crate::{ApiError, AppState};

/// The one user every key belongs to, until organizations have members.
pub(crate) const USER_ID: &str = "operator";

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CreateApiKey {
    name: String,
    permissions: Vec<String>,
    expires_at: Option<String>,
}

/// `ApiKeyResponse`: the new key with its value.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CreatedKey {
    name: String,
    value: String,
    created_at: String,
    permissions: Vec<&'static str>,
    expires_at: Option<String>,
}

/// `ApiKeyList`: a key as listed, its value masked.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ListedKey {
    name: String,
    value: String,
    created_at: String,
    permissions: Vec<&'static str>,
    last_used_at: Option<String>,
    expires_at: Option<String>,
    user_id: &'static str,
}

fn names(permissions: &[Permission]) -> Vec<&'static str> {
    permissions.iter().map(|p| p.name()).collect()
}

impl From<ApiKeyInfo> for ListedKey {
    fn from(key: ApiKeyInfo) -> ListedKey {
        ListedKey {
            name: key.name,
            value: key.masked,
            created_at: rfc3339(key.created_at_ms),
            permissions: names(&key.permissions),
            last_used_at: key.last_used_at_ms.map(rfc3339),
            expires_at: key.expires_at_ms.map(rfc3339),
            user_id: USER_ID,
        }
    }
}

/// `POST /api/api-keys`: 201 with the value, shown this once.
pub(crate) async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Result<Json<CreateApiKey>, JsonRejection>,
) -> Result<(StatusCode, Json<CreatedKey>), ApiError> {
    let Json(request) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let permissions = request
        .permissions
        .iter()
        .map(|name| Permission::parse(name).map_err(ApiError::from))
        .collect::<Result<Vec<_>, _>>()?;
    let expires_at_ms = match request.expires_at.as_deref() {
        None => None,
        Some(at) => Some(crate::list_filter::instant("expiresAt", at)? as i64),
    };
    let key = state
        .engine
        .access()
        .create_api_key(&caller, &request.name, &permissions, expires_at_ms)
        .await?;
    let created = CreatedKey {
        name: key.info.name,
        value: key.value,
        created_at: rfc3339(key.info.created_at_ms),
        permissions: names(&key.info.permissions),
        expires_at: key.info.expires_at_ms.map(rfc3339),
    };
    Ok((StatusCode::CREATED, Json(created)))
}

/// `GET /api/api-keys`: the keys of the request's organization.
pub(crate) async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Vec<ListedKey>>, ApiError> {
    let keys = state
        .engine
        .access()
        .api_keys(&caller.organization_id)
        .await?;
    Ok(Json(keys.into_iter().map(ListedKey::from).collect()))
}

/// `GET /api/api-keys/current`: the key of this request.
pub(crate) async fn current(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<ListedKey>, ApiError> {
    if caller.key_name == ENV_KEY_NAME && caller.operator {
        // `COVE_API_KEY` is not stored: it is the operator's for as long as
        // the server runs with it.
        return Ok(Json(ListedKey {
            name: caller.key_name.clone(),
            value: caller.key_masked.clone(),
            created_at: rfc3339(state.started_at_ms),
            permissions: names(&caller.permissions()),
            last_used_at: None,
            expires_at: None,
            user_id: USER_ID,
        }));
    }
    // The operator's keys are the default organization's, wherever the
    // request acts.
    let home = match caller.operator {
        true => DEFAULT_ORGANIZATION,
        false => caller.organization_id.as_str(),
    };
    let key = state
        .engine
        .access()
        .api_key(home, &caller.key_name)
        .await?;
    Ok(Json(key.into()))
}

/// `GET /api/api-keys/{name}`: a key of the request's organization.
pub(crate) async fn get(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<Json<ListedKey>, ApiError> {
    let key = state
        .engine
        .access()
        .api_key(&caller.organization_id, &name)
        .await?;
    Ok(Json(key.into()))
}

/// `DELETE /api/api-keys/{name}`: 204; the key is refused from then on.
pub(crate) async fn delete(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.engine.access().delete_api_key(&caller, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /api/api-keys/{userId}/{name}`: as above, for the one user.
pub(crate) async fn delete_for_user(
    state: State<AppState>,
    caller: Extension<Caller>,
    Path((user, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    if user != USER_ID {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("user {user} not found; this server's one user is {USER_ID}"),
        ));
    }
    delete(state, caller, Path(name)).await
}

/// `User`, as `GET /api/users/me` answers it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct User {
    id: &'static str,
    name: &'static str,
    email: &'static str,
    email_verified: bool,
    public_keys: Vec<serde_json::Value>,
    created_at: String,
}

pub(crate) async fn me(State(state): State<AppState>) -> Json<User> {
    Json(User {
        id: USER_ID,
        name: USER_ID,
        email: "",
        email_verified: false,
        public_keys: Vec::new(),
        created_at: rfc3339(state.started_at_ms),
    })
}
