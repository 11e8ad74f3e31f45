//! The audit log: who (which key) asked the control API to change what, when,
//! and how it ended; read back at `GET /api/audit/organizations/{id}` and, by
//! the operator, `GET /api/admin/audit`.
//!
//! [`record`] sits inside the key layer on matched routes, so it knows the
//! [`Caller`] and the route template. Reads (GET, HEAD) are not recorded, nor
//! is the toolbox: a command run or a file written is the sandbox's own
//! business, and recording each would cost the hot path a write. What was
//! done is named from the route (`POST /api/sandbox/{id}/stop` is `stop` on
//! `sandbox` `{id}`); a create names what it made from its answer's `id`.

use axum::body::Body;
use axum::extract::{MatchedPath, Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::middleware::Next;
use axum::response::Response;
use axum::{Extension, Json};
use cove_engine::{AuditQuery, AuditRecord, Caller};
use http_body_util::BodyExt;
use serde::Serialize;
use serde_json::Value;

use crate::api_keys::USER_ID;
use crate::dto::rfc3339;
use crate::{ApiError, AppState};

/// The most of an answer read to name what a create made or why a request
/// failed; both are small JSON bodies.
const ANSWER_LIMIT: usize = 64 * 1024;
/// The most of a `User-Agent` kept.
const USER_AGENT_LIMIT: usize = 256;

/// What a change was, from its method and route.
#[derive(Debug, PartialEq, Eq)]
struct Action {
    action: String,
    target_type: &'static str,
    target_id: Option<String>,
}

/// The kind of resource the first segment of a route under `/api` names.
fn target_type(segment: &str) -> &'static str {
    match segment {
        "sandbox" | "vms" => "sandbox",
        "snapshots" => "snapshot",
        "volumes" => "volume",
        "docker-registry" => "docker_registry",
        "api-keys" => "api_key",
        "object-storage" => "object_storage",
        "admin" => "server",
        _ => "other",
    }
}

/// What `method` on `route` (a template under `/api`) at `path` does, or
/// `None` for what is not audited.
fn action(method: &Method, route: &str, path: &str) -> Option<Action> {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    let route = route.strip_prefix("/api/")?;
    let path = path.strip_prefix("/api/")?;
    let template: Vec<&str> = route.split('/').collect();
    let actual: Vec<&str> = path.split('/').collect();
    let is_param = |s: &str| s.starts_with('{');
    let target_id = template
        .iter()
        .zip(&actual)
        .skip(1)
        .filter(|(t, _)| is_param(t) && !matches!(**t, "{user}" | "{minutes}" | "{port}"))
        .map(|(_, a)| (*a).to_owned())
        .next();
    let named = template.iter().skip(1).rev().find(|s| !is_param(s));
    let action = match (named, method) {
        (Some(name), _) => name.replace('-', "_"),
        (None, &Method::POST) => "create".into(),
        (None, &Method::DELETE) => "delete".into(),
        (None, _) => "update".into(),
    };
    Some(Action {
        action,
        target_type: target_type(template[0]),
        target_id,
    })
}

/// Records each change asked of the control API once it is answered. A
/// record that cannot be written is logged; the answer stands.
pub(crate) async fn record(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned());
    let done = route
        .as_deref()
        .and_then(|route| action(request.method(), route, request.uri().path()));
    let (Some(done), Some(caller)) = (done, request.extensions().get::<Caller>().cloned()) else {
        return next.run(request).await;
    };
    let user_agent = user_agent(request.headers());
    let response = next.run(request).await;
    let status = response.status();
    let reads_answer =
        !status.is_success() || (done.target_id.is_none() && done.action == "create");
    let (response, answer) = if reads_answer {
        read_answer(response).await
    } else {
        (response, None)
    };
    let target_id = done.target_id.or_else(|| {
        let answer = answer.as_ref().filter(|_| status.is_success())?;
        ["id", "name"]
            .iter()
            .find_map(|field| answer[field].as_str().map(str::to_owned))
    });
    let error_message = answer
        .as_ref()
        .filter(|_| !status.is_success())
        .and_then(|a| a["message"].as_str().map(str::to_owned));
    let entry = AuditRecord {
        id: uuid::Uuid::new_v4().to_string(),
        organization_id: caller.organization_id,
        created_at_ms: cove_engine::now_ms(),
        key_name: caller.key_name,
        key_masked: caller.key_masked,
        action: done.action,
        target_type: done.target_type.into(),
        target_id,
        status_code: status.as_u16(),
        error_message,
        user_agent,
    };
    if let Err(error) = state.engine.access().record_audit(&entry).await {
        tracing::error!(error = %cove_engine::describe(&error), action = %entry.action, "the audit log could not be written");
    }
    response
}

fn user_agent(headers: &HeaderMap) -> Option<String> {
    let agent = headers.get(header::USER_AGENT)?.to_str().ok()?;
    Some(agent.chars().take(USER_AGENT_LIMIT).collect())
}

/// The answer's JSON, if it is JSON and small; the response, whole again.
async fn read_answer(response: Response) -> (Response, Option<Value>) {
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    // A JSON answer is whole already: its size is known before it is read.
    let small = axum::body::HttpBody::size_hint(response.body())
        .upper()
        .is_some_and(|n| n <= ANSWER_LIMIT as u64);
    if !is_json || !small {
        return (response, None);
    }
    let (parts, body) = response.into_parts();
    match body.collect().await {
        Ok(collected) => {
            let bytes = collected.to_bytes();
            let value = serde_json::from_slice(&bytes).ok();
            (Response::from_parts(parts, Body::from(bytes)), value)
        }
        Err(error) => {
            tracing::warn!(%error, "an answer could not be read for the audit log");
            (Response::from_parts(parts, Body::empty()), None)
        }
    }
}

/// `AuditLog`, as Daytona's API answers it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct AuditLog {
    id: String,
    actor_id: &'static str,
    actor_email: &'static str,
    actor_api_key_prefix: String,
    actor_api_key_suffix: String,
    organization_id: String,
    action: String,
    target_type: String,
    target_id: Option<String>,
    status_code: u16,
    error_message: Option<String>,
    user_agent: Option<String>,
    source: &'static str,
    metadata: Value,
    created_at: String,
}

impl From<AuditRecord> for AuditLog {
    fn from(r: AuditRecord) -> AuditLog {
        let prefix = r
            .key_masked
            .split('*')
            .next()
            .unwrap_or_default()
            .to_owned();
        let suffix = r
            .key_masked
            .rsplit('*')
            .next()
            .unwrap_or_default()
            .to_owned();
        AuditLog {
            id: r.id,
            actor_id: USER_ID,
            actor_email: "",
            actor_api_key_prefix: prefix,
            actor_api_key_suffix: suffix,
            organization_id: r.organization_id,
            action: r.action,
            target_type: r.target_type,
            target_id: r.target_id,
            status_code: r.status_code,
            error_message: r.error_message,
            user_agent: r.user_agent,
            source: "api",
            metadata: serde_json::json!({ "apiKeyName": r.key_name }),
            created_at: rfc3339(r.created_at_ms),
        }
    }
}

/// `PaginatedAuditLogs`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct AuditPage {
    items: Vec<AuditLog>,
    total: u64,
    page: u64,
    total_pages: u64,
}

const DEFAULT_LIMIT: u64 = 100;
const MAX_LIMIT: u64 = 1000;

/// The page, limit and filters of a query string.
fn parse_query(query: Option<&str>) -> Result<(AuditQuery, u64, u64), ApiError> {
    let mut filter = AuditQuery::default();
    let (mut page, mut limit) = (1u64, DEFAULT_LIMIT);
    let whole = |key: &str, value: &str| -> Result<u64, ApiError> {
        value.parse().map_err(|_| {
            ApiError::bad_request(format!("{key} must be a whole number, not {value:?}"))
        })
    };
    let time = |key: &str, value: &str| -> Result<i64, ApiError> {
        Ok(crate::list_filter::instant(key, value)? as i64)
    };
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        let value = value.into_owned();
        match &*key {
            "page" => page = whole("page", &value)?,
            "limit" => limit = whole("limit", &value)?,
            "from" => filter.from_ms = Some(time("from", &value)?),
            "to" => filter.to_ms = Some(time("to", &value)?),
            "action" => filter.action = Some(value),
            "targetType" => filter.target_type = Some(value),
            "targetId" => filter.target_id = Some(value),
            "statusCode" => {
                let code = whole("statusCode", &value)?;
                filter.status_code = Some(u16::try_from(code).unwrap_or(u16::MAX));
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "the audit log cannot be filtered by {other:?}; cove filters by page, limit, \
                     from, to, action, targetType, targetId and statusCode"
                )))
            }
        }
    }
    if page == 0 {
        return Err(ApiError::bad_request("page counts from 1"));
    }
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit must be between 1 and {MAX_LIMIT}, not {limit}"
        )));
    }
    Ok((filter, page, limit))
}

/// A page of the log, of one organization's rows when `organization` is set.
async fn page_of(
    state: &AppState,
    organization: Option<String>,
    query: Option<&str>,
) -> Result<Json<AuditPage>, ApiError> {
    let (mut filter, page, limit) = parse_query(query)?;
    filter.organization_id = organization;
    let offset = (page - 1).saturating_mul(limit);
    let (items, total) = state
        .engine
        .access()
        .audit_log(&filter, offset, limit)
        .await?;
    Ok(Json(AuditPage {
        items: items.into_iter().map(AuditLog::from).collect(),
        total,
        page,
        total_pages: total.div_ceil(limit),
    }))
}

/// `GET /api/audit/organizations/{organizationId}` (`read:audit_logs`).
pub(crate) async fn organization(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(organization): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<AuditPage>, ApiError> {
    crate::billing::check_organization(&state, &caller, &organization).await?;
    page_of(&state, Some(organization), query.as_deref()).await
}

/// `GET /api/admin/audit`: the whole log, for the operator.
pub(crate) async fn all(
    State(state): State<AppState>,
    RawQuery(query): RawQuery,
) -> Result<Json<AuditPage>, ApiError> {
    page_of(&state, None, query.as_deref()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(
        method: Method,
        route: &str,
        path: &str,
    ) -> Option<(String, &'static str, Option<String>)> {
        action(&method, route, path).map(|a| (a.action, a.target_type, a.target_id))
    }

    #[test]
    fn changes_are_named_from_their_route() {
        let some =
            |action: &str, kind, id: Option<&str>| Some((action.into(), kind, id.map(Into::into)));
        assert_eq!(
            named(Method::POST, "/api/sandbox", "/api/sandbox"),
            some("create", "sandbox", None)
        );
        assert_eq!(
            named(
                Method::POST,
                "/api/sandbox/{id}/stop",
                "/api/sandbox/s1/stop"
            ),
            some("stop", "sandbox", Some("s1"))
        );
        assert_eq!(
            named(Method::DELETE, "/api/sandbox/{id}", "/api/sandbox/s1"),
            some("delete", "sandbox", Some("s1"))
        );
        assert_eq!(
            named(
                Method::POST,
                "/api/sandbox/{id}/autostop/{minutes}",
                "/api/sandbox/s1/autostop/5"
            ),
            some("autostop", "sandbox", Some("s1"))
        );
        assert_eq!(
            named(Method::POST, "/api/vms/{id}/pause", "/api/vms/v1/pause"),
            some("pause", "sandbox", Some("v1"))
        );
        assert_eq!(
            named(
                Method::DELETE,
                "/api/api-keys/{user}/{name}",
                "/api/api-keys/operator/ci"
            ),
            some("delete", "api_key", Some("ci"))
        );
        assert_eq!(
            named(
                Method::PATCH,
                "/api/docker-registry/{id}",
                "/api/docker-registry/r1"
            ),
            some("update", "docker_registry", Some("r1"))
        );
        assert_eq!(
            named(
                Method::POST,
                "/api/snapshots/import",
                "/api/snapshots/import"
            ),
            some("import", "snapshot", None)
        );
        assert_eq!(named(Method::GET, "/api/sandbox", "/api/sandbox"), None);
        assert_eq!(
            named(Method::POST, "/toolbox/{id}/{*path}", "/toolbox/s1/files"),
            None
        );
    }

    #[test]
    fn queries_are_checked() {
        let (filter, page, limit) =
            parse_query(Some("page=2&limit=5&action=stop&statusCode=403")).unwrap();
        assert_eq!((page, limit), (2, 5));
        assert_eq!(filter.action.as_deref(), Some("stop"));
        assert_eq!(filter.status_code, Some(403));
        for bad in [
            "page=0",
            "limit=0",
            "limit=5000",
            "page=x",
            "actorEmail=a",
            "from=yesterday",
        ] {
            assert!(parse_query(Some(bad)).is_err(), "{bad}");
        }
    }
}
