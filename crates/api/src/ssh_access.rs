//! `/api/sandbox/{id}/ssh-access` (issue, revoke) and
//! `/api/sandbox/ssh-access/validate`: tokens for cove's SSH gateway, used as
//! the SSH user name (`ssh TOKEN@HOST -p PORT`).

use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;
use cove_engine::IssuedSshAccess;
use serde::Serialize;

use crate::auth::Tenant;
use crate::dto::rfc3339;
use crate::sandbox::{dto, Reply};
use crate::{ApiError, AppState};

/// `SshAccessDto` of Daytona's API.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SshAccess {
    pub id: String,
    pub sandbox_id: String,
    pub token: String,
    pub expires_at: String,
    pub created_at: String,
    pub updated_at: String,
    pub ssh_command: String,
}

/// `SshAccessValidationDto`: the SDK requires `sandboxId` to be a string, so
/// an invalid token answers with an empty one.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SshAccessValidation {
    pub valid: bool,
    pub sandbox_id: String,
}

/// The value of query parameter `name`, if given.
fn query_param(query: &Option<String>, name: &str) -> Option<String> {
    form_urlencoded::parse(query.as_deref().unwrap_or_default().as_bytes())
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
}

/// The host clients reach the gateway at: the public URL's host, else the
/// host of this request (without its port).
fn ssh_host(state: &AppState, headers: &HeaderMap) -> String {
    let authority = match &state.config.public_url {
        Some(url) => {
            let rest = url.split_once("://").map_or(url.as_str(), |(_, rest)| rest);
            rest.split('/').next().unwrap_or_default().to_owned()
        }
        None => headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("127.0.0.1")
            .to_owned(),
    };
    host_of(&authority).to_owned()
}

/// `host[:port]` or `[v6]:port` without the port.
fn host_of(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// `POST /sandbox/{id}/ssh-access?expiresInMinutes=N`
pub(crate) async fn create(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<SshAccess>, ApiError> {
    let Some(port) = state.config.ssh_port else {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "SSH access is not available: this server runs no SSH gateway (serve --ssh-listen)",
        ));
    };
    let minutes = match query_param(&query, "expiresInMinutes") {
        None => None,
        Some(text) => Some(parse_minutes(&text).ok_or_else(|| {
            ApiError::bad_request(format!(
                "invalid expiresInMinutes: expected a whole number of minutes, got {text:?}"
            ))
        })?),
    };
    let id = tenant.sandboxes().get(&id).await?.id;
    let IssuedSshAccess { token, record } = state
        .engine
        .access()
        .create_ssh_access(&id, minutes)
        .await?;
    let host = ssh_host(&state, &headers);
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    Ok(Json(SshAccess {
        ssh_command: format!("ssh {token}@{host} -p {port}"),
        id: record.id,
        sandbox_id: record.sandbox_id,
        token,
        expires_at: rfc3339(record.expires_at_ms),
        created_at: rfc3339(record.created_at_ms),
        updated_at: rfc3339(record.updated_at_ms),
    }))
}

/// Whole minutes; the API declares a number, so `5.0` is accepted too.
fn parse_minutes(text: &str) -> Option<i64> {
    if let Ok(minutes) = text.parse::<i64>() {
        return Some(minutes);
    }
    let minutes = text.parse::<f64>().ok()?;
    (minutes.fract() == 0.0 && minutes.abs() < 1e15).then_some(minutes as i64)
}

/// `DELETE /sandbox/{id}/ssh-access[?token=T]`: one token, or all of the sandbox's.
pub(crate) async fn revoke(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Reply {
    let token = query_param(&query, "token").filter(|t| !t.is_empty());
    let id = tenant.sandboxes().get(&id).await?.id;
    let record = state
        .engine
        .access()
        .revoke_ssh_access(&id, token.as_deref())
        .await?;
    Ok(dto(&state, &headers, record))
}

/// `GET /sandbox/ssh-access/validate?token=T`: valid only for a sandbox of
/// the request's organization.
pub(crate) async fn validate(
    State(state): State<AppState>,
    tenant: Tenant,
    RawQuery(query): RawQuery,
) -> Result<Json<SshAccessValidation>, ApiError> {
    let token =
        query_param(&query, "token").ok_or_else(|| ApiError::bad_request("token is required"))?;
    let mut sandbox = state.engine.access().validate_ssh_access(&token).await?;
    if let Some(id) = &sandbox {
        if tenant.sandboxes().get(id).await.is_err() {
            sandbox = None;
        }
    }
    Ok(Json(SshAccessValidation {
        valid: sandbox.is_some(),
        sandbox_id: sandbox.unwrap_or_default(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_lose_their_ports() {
        assert_eq!(host_of("cove.test:3000"), "cove.test");
        assert_eq!(host_of("cove.test"), "cove.test");
        assert_eq!(host_of("[::1]:3000"), "::1");
        assert_eq!(host_of("10.0.0.5"), "10.0.0.5");
    }

    #[test]
    fn minutes_are_whole_numbers() {
        assert_eq!(parse_minutes("5"), Some(5));
        assert_eq!(parse_minutes("5.0"), Some(5));
        assert_eq!(parse_minutes("-3"), Some(-3));
        assert_eq!(parse_minutes("1.5"), None);
        assert_eq!(parse_minutes("soon"), None);
    }
}
