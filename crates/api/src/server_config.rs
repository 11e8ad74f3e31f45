//! `GET /api/config`: what the SDK reads about the server.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;

use crate::sandbox::toolbox_base;
use crate::AppState;

pub(crate) async fn get_config(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Json<serde_json::Value> {
    let toolbox = toolbox_base(&state, &headers);
    let engine = state.engine.config();
    Json(serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "oidc": { "issuer": "", "clientId": "", "audience": "", "provider": "none" },
        "linkedAccountsEnabled": false,
        "announcements": {},
        "proxyTemplateUrl": "",
        "proxyToolboxUrl": toolbox,
        "defaultSnapshot": engine.default_snapshot,
        "dashboardUrl": "",
        "maxAutoArchiveInterval": 30 * 24 * 60,
        "maintananceMode": false,
        "environment": "cove",
        "analyticsApiUrl": null,
        // cove's own: what VM sandboxes run on, and why.
        "coveVmAccelerator": state.engine.vm_accelerator().map(|(name, reason)| {
            serde_json::json!({ "name": name, "reason": reason })
        }),
    }))
}
