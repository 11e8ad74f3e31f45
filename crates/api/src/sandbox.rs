//! Handlers of `/api/sandbox...`: each turns one request into one engine call.

use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;
use cove_engine::{SandboxRecord, SettingChange};

use crate::auth::Tenant;
use crate::dto::{CreateSandboxRequest, Labels, Sandbox, SandboxList, Url};
use crate::list_filter::SandboxFilter;
use crate::{ApiError, AppState};

/// The page size of a list when the client asks for none.
const DEFAULT_PAGE: usize = 100;

/// Where clients reach the toolbox: the configured public URL, or the host they
/// used for this request.
pub(crate) fn toolbox_base(state: &AppState, headers: &HeaderMap) -> String {
    format!("{}/toolbox", public_base(state, headers))
}

/// The URL clients reach this server at, without a trailing slash.
pub(crate) fn public_base(state: &AppState, headers: &HeaderMap) -> String {
    match &state.config.public_url {
        Some(url) => url.trim_end_matches('/').to_owned(),
        None => {
            let host = headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or("127.0.0.1");
            format!("http://{host}")
        }
    }
}

pub(crate) fn dto(state: &AppState, headers: &HeaderMap, record: SandboxRecord) -> Json<Sandbox> {
    Json(to_dto(state, headers, record))
}

pub(crate) fn to_dto(state: &AppState, headers: &HeaderMap, record: SandboxRecord) -> Sandbox {
    let accelerator = state.engine.sandboxes().accelerator(&record.id);
    Sandbox::from_record(record, toolbox_base(state, headers), accelerator)
}

pub(crate) type Reply = Result<Json<Sandbox>, ApiError>;

pub(crate) async fn create(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    body: Result<Json<CreateSandboxRequest>, axum::extract::rejection::JsonRejection>,
) -> Reply {
    let Json(request) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    crate::regions::check("target", request.target.as_deref())?;
    if let Some(what) = request.unsupported() {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("{what} is not implemented by cove yet"),
        ));
    }
    let record = tenant.sandboxes().create(request.into_engine()).await?;
    Ok(dto(&state, &headers, record))
}

pub(crate) async fn get(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    let record = tenant.sandboxes().get(&id).await?;
    Ok(dto(&state, &headers, record))
}

/// `GET /sandbox?labels={json}&states=a&states=b&id=p&name=p&...&sort=F&order=D&cursor=N&limit=N`
/// (the filters are `list_filter`'s): sorted by the store, then filtered,
/// then paged, so consecutive pages of one order neither repeat nor skip a
/// sandbox.
pub(crate) async fn list(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Json<SandboxList>, ApiError> {
    let mut filter = SandboxFilter::default();
    let mut cursor = 0usize;
    let mut limit = DEFAULT_PAGE;
    let mut sort = None;
    let mut order = None;
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        if filter.take(&key, &value)? {
            continue;
        }
        match key.as_ref() {
            "cursor" => {
                cursor = value
                    .parse()
                    .map_err(|_| ApiError::bad_request(format!("invalid cursor {value:?}")))?
            }
            "limit" => {
                limit = value
                    .parse()
                    .ok()
                    .filter(|l| *l > 0)
                    .ok_or_else(|| ApiError::bad_request(format!("invalid limit {value:?}")))?
            }
            "sort" => sort = Some(value.into_owned()),
            "order" => order = Some(value.into_owned()),
            _ => {}
        }
    }
    let order = crate::sort::sandbox_order(sort.as_deref(), order.as_deref())?;
    let matching: Vec<SandboxRecord> = tenant
        .sandboxes()
        .list_ordered(order)
        .await?
        .into_iter()
        .filter(|sandbox| filter.matches(sandbox))
        .collect();
    let total = matching.len();
    let items: Vec<Sandbox> = matching
        .into_iter()
        .skip(cursor)
        .take(limit)
        .map(|record| to_dto(&state, &headers, record))
        .collect();
    let next = cursor + items.len();
    let next_cursor = (next < total).then(|| next.to_string());
    Ok(Json(SandboxList { items, next_cursor }))
}

pub(crate) async fn start(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    let record = tenant.sandboxes().start(&id).await?;
    Ok(dto(&state, &headers, record))
}

pub(crate) async fn stop(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    let record = tenant.sandboxes().stop(&id).await?;
    Ok(dto(&state, &headers, record))
}

pub(crate) async fn recover(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    let record = tenant.sandboxes().recover(&id).await?;
    Ok(dto(&state, &headers, record))
}

pub(crate) async fn delete(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    let record = tenant.sandboxes().delete(&id).await?;
    Ok(dto(&state, &headers, record))
}

pub(crate) async fn replace_labels(
    tenant: Tenant,
    Path(id): Path<String>,
    body: Result<Json<Labels>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Labels>, ApiError> {
    let Json(Labels { labels }) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let record = tenant
        .sandboxes()
        .change(&id, SettingChange::Labels(labels))
        .await?;
    Ok(Json(Labels {
        labels: record.labels,
    }))
}

fn minutes(value: &str) -> Result<i64, ApiError> {
    value.parse().map_err(|_| {
        ApiError::bad_request(format!(
            "interval {value:?} is not a whole number of minutes"
        ))
    })
}

async fn change(
    state: AppState,
    tenant: Tenant,
    headers: HeaderMap,
    id: String,
    change: SettingChange,
) -> Reply {
    let record = tenant.sandboxes().change(&id, change).await?;
    Ok(dto(&state, &headers, record))
}

pub(crate) async fn set_auto_stop(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path((id, m)): Path<(String, String)>,
) -> Reply {
    change(
        state,
        tenant,
        headers,
        id,
        SettingChange::AutoStop(minutes(&m)?),
    )
    .await
}

pub(crate) async fn set_auto_pause(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path((id, m)): Path<(String, String)>,
) -> Reply {
    change(
        state,
        tenant,
        headers,
        id,
        SettingChange::AutoPause(minutes(&m)?),
    )
    .await
}

pub(crate) async fn set_auto_archive(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path((id, m)): Path<(String, String)>,
) -> Reply {
    change(
        state,
        tenant,
        headers,
        id,
        SettingChange::AutoArchive(minutes(&m)?),
    )
    .await
}

pub(crate) async fn set_auto_delete(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path((id, m)): Path<(String, String)>,
) -> Reply {
    change(
        state,
        tenant,
        headers,
        id,
        SettingChange::AutoDelete(minutes(&m)?),
    )
    .await
}

pub(crate) async fn set_ttl(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path((id, m)): Path<(String, String)>,
) -> Reply {
    change(state, tenant, headers, id, SettingChange::Ttl(minutes(&m)?)).await
}

pub(crate) async fn set_public(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path((id, public)): Path<(String, String)>,
) -> Reply {
    let public = public.parse().map_err(|_| {
        ApiError::bad_request(format!("public must be true or false, got {public:?}"))
    })?;
    change(state, tenant, headers, id, SettingChange::Public(public)).await
}

pub(crate) async fn toolbox_proxy_url(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Url>, ApiError> {
    tenant.sandboxes().get(&id).await?;
    Ok(Json(Url {
        url: toolbox_base(&state, &headers),
    }))
}
