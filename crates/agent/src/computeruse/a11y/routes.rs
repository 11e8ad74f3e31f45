//! `/computeruse/a11y/*`: the tree, find, and focus, invoke and set value
//! on one node, in the SDK's shapes (`daytona_toolbox_api_client` models).
//!
//! Every request checks what it was sent before it asks the desktop, then
//! opens its own connection to the accessibility bus.

use axum::extract::State;
use axum::routing::{get, post};
use axum::Router;
use serde::{Deserialize, Serialize};

use super::bus::{A11yBus, CallError};
use super::node::{state_names, Node, NodeId};
use super::walk::{self, Filter, Scope, DEFAULT_FIND_LIMIT, MAX_FIND_LIMIT};
use super::A11yError;
use crate::error::{ApiError, Json, Query};
use crate::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/computeruse/a11y/tree", get(tree))
        .route("/computeruse/a11y/find", post(find))
        .route("/computeruse/a11y/node/focus", post(focus))
        .route("/computeruse/a11y/node/invoke", post(invoke))
        .route("/computeruse/a11y/node/value", post(set_value))
}

/// `GET /computeruse/a11y/tree` query.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TreeQuery {
    pub scope: Option<String>,
    pub pid: Option<i64>,
    /// Levels below the root: 0 the root only, negative or absent as deep
    /// as a walk may go.
    pub max_depth: Option<i64>,
}

/// `FindAccessibilityNodesRequest`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FindNodesRequest {
    pub role: Option<String>,
    pub name: Option<String>,
    pub name_match: Option<String>,
    pub states: Option<Vec<String>>,
    pub pid: Option<i64>,
    pub scope: Option<String>,
    /// 0, negative or absent: the default (500); at most 5000.
    pub limit: Option<i64>,
}

/// `AccessibilityNodeRequest`.
#[derive(Debug, Deserialize)]
pub struct NodeRequest {
    pub id: String,
}

/// `AccessibilityInvokeRequest`; no action: the node's first.
#[derive(Debug, Deserialize)]
pub struct InvokeNodeRequest {
    pub id: String,
    pub action: Option<String>,
}

/// `AccessibilitySetValueRequest`.
#[derive(Debug, Deserialize)]
pub struct SetNodeValueRequest {
    pub id: String,
    pub value: Option<String>,
}

/// `AccessibilityTreeResponse`.
#[derive(Debug, Serialize)]
struct TreeResponse {
    root: Node,
    truncated: bool,
}

/// `AccessibilityNodesResponse`.
#[derive(Debug, Serialize)]
struct NodesResponse {
    matches: Vec<Node>,
    truncated: bool,
}

/// The SDK's `Empty`.
#[derive(Debug, Serialize)]
struct Empty {}

async fn connect(state: &AppState) -> Result<A11yBus, ApiError> {
    let session = state.desktop.session()?;
    Ok(A11yBus::connect(&session.bus_address).await?)
}

async fn tree(
    State(state): State<AppState>,
    Query(query): Query<TreeQuery>,
) -> Result<Json<TreeResponse>, ApiError> {
    let scope = Scope::parse(query.scope.as_deref(), query.pid)?;
    let max_depth = query
        .max_depth
        .and_then(|depth| usize::try_from(depth).ok());
    let bus = connect(&state).await?;
    let root = walk::scope_root(&bus, scope).await?;
    let (root, truncated) = walk::tree(&bus, root, max_depth).await?;
    Ok(Json(TreeResponse { root, truncated }))
}

async fn find(
    State(state): State<AppState>,
    Json(request): Json<FindNodesRequest>,
) -> Result<Json<NodesResponse>, ApiError> {
    let scope = Scope::parse(request.scope.as_deref(), request.pid)?;
    let filter = Filter::new(
        request.role.as_deref(),
        request.name.as_deref(),
        request.name_match.as_deref(),
        request.states.as_deref().unwrap_or_default(),
    )?;
    let limit = match request.limit.and_then(|limit| usize::try_from(limit).ok()) {
        None | Some(0) => DEFAULT_FIND_LIMIT,
        Some(limit) => limit.min(MAX_FIND_LIMIT),
    };
    let bus = connect(&state).await?;
    let root = walk::scope_root(&bus, scope).await?;
    let (matches, truncated) = walk::find(&bus, root, &filter, limit).await?;
    Ok(Json(NodesResponse { matches, truncated }))
}

async fn focus(
    State(state): State<AppState>,
    Json(request): Json<NodeRequest>,
) -> Result<Json<Empty>, ApiError> {
    let id = NodeId::parse(&request.id)?;
    let bus = connect(&state).await?;
    existing(&bus, &id).await?;
    let focused = bus
        .grab_focus(&id)
        .await
        .map_err(|e| A11yError::from_call(&id, "focus", e))?;
    if !focused {
        return Err(refused(&id, "focus"));
    }
    Ok(Json(Empty {}))
}

async fn invoke(
    State(state): State<AppState>,
    Json(request): Json<InvokeNodeRequest>,
) -> Result<Json<Empty>, ApiError> {
    let id = NodeId::parse(&request.id)?;
    let bus = connect(&state).await?;
    existing(&bus, &id).await?;
    let actions = bus
        .action_names(&id)
        .await
        .map_err(|e| A11yError::from_call(&id, "actions", e))?;
    let wanted = request.action.as_deref().filter(|a| !a.is_empty());
    let index = match wanted {
        None if !actions.is_empty() => Some(0),
        None => None,
        Some(wanted) => actions
            .iter()
            .position(|action| action.eq_ignore_ascii_case(wanted)),
    };
    let Some(index) = index.and_then(|index| i32::try_from(index).ok()) else {
        let what = match wanted {
            Some(wanted) => format!(
                "the action {:?} (it has: {})",
                super::node::clip(wanted, 64),
                actions.join(", ")
            ),
            None => "actions".to_owned(),
        };
        return Err(A11yError::NotSupported {
            id: id.to_string(),
            what,
        }
        .into());
    };
    let done = bus
        .do_action(&id, index)
        .await
        .map_err(|e| A11yError::from_call(&id, "an action", e))?;
    if !done {
        return Err(refused(&id, "the action"));
    }
    Ok(Json(Empty {}))
}

/// The text of an editable node (`EditableText.SetTextContents`), else the
/// number of a value node (`Value.CurrentValue`): what Daytona's daemon does.
async fn set_value(
    State(state): State<AppState>,
    Json(request): Json<SetNodeValueRequest>,
) -> Result<Json<Empty>, ApiError> {
    let id = NodeId::parse(&request.id)?;
    let value = request.value.unwrap_or_default();
    let bus = connect(&state).await?;
    existing(&bus, &id).await?;
    // GTK answers false even when it changed the text: the call's success
    // is the answer.
    match bus.set_text(&id, &value).await {
        Ok(_) => return Ok(Json(Empty {})),
        Err(CallError::Unsupported(_)) => {}
        Err(error) => return Err(A11yError::from_call(&id, "text", error).into()),
    }
    let Ok(number) = value.trim().parse::<f64>() else {
        return Err(A11yError::NotSupported {
            id: id.to_string(),
            what: "text, and the value is not a number".to_owned(),
        }
        .into());
    };
    bus.set_current_value(&id, number)
        .await
        .map_err(|e| A11yError::from_call(&id, "a text or numeric value", e))?;
    Ok(Json(Empty {}))
}

/// 404 unless `id` is an accessible that is still there: every accessible
/// answers `GetState`, and one its application dropped says `defunct`.
async fn existing(bus: &A11yBus, id: &NodeId) -> Result<(), A11yError> {
    let not_found = || A11yError::NodeNotFound { id: id.to_string() };
    match bus.state(id).await {
        Ok(words) if state_names(&words).contains(&"defunct") => Err(not_found()),
        Ok(_) => Ok(()),
        Err(CallError::Gone(_) | CallError::Unsupported(_)) => Err(not_found()),
        Err(error) => Err(A11yError::from_call(id, "its state", error)),
    }
}

fn refused(id: &NodeId, what: &'static str) -> ApiError {
    A11yError::Refused {
        id: id.to_string(),
        what,
    }
    .into()
}
