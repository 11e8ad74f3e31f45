//! Displays and windows (`/computeruse/display/*`), in the SDK's shapes.

use axum::extract::State;
use axum::routing::get;
use axum::Router;
use serde::Serialize;

use crate::error::{ApiError, Json};
use crate::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/computeruse/display/info", get(info))
        .route("/computeruse/display/windows", get(windows))
}

/// `DisplayInfo` of the SDK.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DisplayInfo {
    id: usize,
    x: i32,
    y: i32,
    width: u32,
    height: u32,
    is_active: bool,
}

/// `WindowInfo` of the SDK.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WindowInfo {
    id: u32,
    title: String,
    x: i32,
    y: i32,
    width: u32,
    height: u32,
    is_active: bool,
}

#[derive(Serialize)]
struct Displays {
    displays: Vec<DisplayInfo>,
}

#[derive(Serialize)]
struct Windows {
    windows: Vec<WindowInfo>,
}

async fn info(State(state): State<AppState>) -> Result<Json<Displays>, ApiError> {
    let displays = state.desktop.with_screen(|s| s.displays()).await?;
    let any_primary = displays.iter().any(|d| d.primary);
    Ok(Json(Displays {
        displays: displays
            .into_iter()
            .enumerate()
            .map(|(id, d)| DisplayInfo {
                id,
                x: d.x,
                y: d.y,
                width: d.width,
                height: d.height,
                // Without a primary monitor, the first one is the active one.
                is_active: d.primary || (!any_primary && id == 0),
            })
            .collect(),
    }))
}

async fn windows(State(state): State<AppState>) -> Result<Json<Windows>, ApiError> {
    let windows = state.desktop.with_screen(|s| s.windows()).await?;
    Ok(Json(Windows {
        windows: windows
            .into_iter()
            .map(|w| WindowInfo {
                id: w.id,
                title: w.title,
                x: w.x,
                y: w.y,
                width: w.width,
                height: w.height,
                is_active: w.active,
            })
            .collect(),
    }))
}
