//! Mouse and keyboard (`/computeruse/mouse/*`, `/computeruse/keyboard/*`):
//! XTest events on the agent's X connection, each call answered once the X
//! server has applied them.

use std::time::Duration;

use axum::extract::State;
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};
use x11rb::protocol::xproto::Keysym;

use super::keys;
use super::x11::{Button, Screen, XError};
use crate::error::{ApiError, Json};
use crate::AppState;

/// Most characters one `type` call sends.
const MAX_TYPED: usize = 100_000;
/// Longest pause between typed characters, in milliseconds.
const MAX_DELAY_MS: u64 = 1000;
/// Most clicks or scroll steps one call makes.
const MAX_REPEAT: u32 = 100;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/computeruse/mouse/position", get(position))
        .route("/computeruse/mouse/move", post(move_mouse))
        .route("/computeruse/mouse/click", post(click))
        .route("/computeruse/mouse/drag", post(drag))
        .route("/computeruse/mouse/scroll", post(scroll))
        .route("/computeruse/mouse/down", post(mouse_down))
        .route("/computeruse/mouse/up", post(mouse_up))
        .route("/computeruse/keyboard/type", post(type_text))
        .route("/computeruse/keyboard/key", post(press_key))
        .route("/computeruse/keyboard/hotkey", post(hotkey))
        .route("/computeruse/keyboard/down", post(key_down))
        .route("/computeruse/keyboard/up", post(key_up))
}

#[derive(Debug, Deserialize)]
pub struct MouseMoveRequest {
    x: Option<i32>,
    y: Option<i32>,
}

#[derive(Debug, Deserialize)]
pub struct MouseClickRequest {
    x: Option<i32>,
    y: Option<i32>,
    button: Option<String>,
    #[serde(default)]
    double: bool,
    clicks: Option<i64>,
    #[serde(default)]
    modifiers: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MouseDragRequest {
    start_x: Option<i32>,
    start_y: Option<i32>,
    end_x: Option<i32>,
    end_y: Option<i32>,
    button: Option<String>,
    #[serde(default)]
    modifiers: Vec<String>,
}

#[derive(Debug, Deserialize)]
pub struct MouseScrollRequest {
    x: Option<i32>,
    y: Option<i32>,
    direction: Option<String>,
    amount: Option<i64>,
    #[serde(default)]
    modifiers: Vec<String>,
}

/// `mouse/down` and `mouse/up`.
#[derive(Debug, Deserialize)]
pub struct MouseButtonRequest {
    x: Option<i32>,
    y: Option<i32>,
    button: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct KeyboardTypeRequest {
    text: Option<String>,
    delay: Option<i64>,
}

#[derive(Debug, Deserialize)]
pub struct KeyboardPressRequest {
    key: Option<String>,
    #[serde(default)]
    modifiers: Vec<String>,
}

#[derive(Debug, Deserialize)]
pub struct KeyboardHotkeyRequest {
    keys: Option<String>,
}

/// `keyboard/down` and `keyboard/up`.
#[derive(Debug, Deserialize)]
pub struct KeyRequest {
    key: Option<String>,
}

fn button(name: Option<&str>) -> Result<Button, ApiError> {
    match name.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") | Some("left") => Ok(Button::Left),
        Some("right") => Ok(Button::Right),
        Some("middle") => Ok(Button::Middle),
        Some(other) => Err(ApiError::BadRequest(format!(
            "unknown mouse button {other:?}: use left, right or middle"
        ))),
    }
}

fn key(name: &str) -> Result<Keysym, ApiError> {
    keys::named(name).ok_or_else(|| {
        ApiError::BadRequest(format!(
            "unknown key {name:?}: use a character or a name such as enter, tab, escape, \
             backspace, up, pageup, f5, ctrl, alt, shift or cmd"
        ))
    })
}

fn modifiers(names: &[String]) -> Result<Vec<Keysym>, ApiError> {
    names
        .iter()
        .map(|name| {
            keys::modifier(name).ok_or_else(|| {
                ApiError::BadRequest(format!(
                    "unknown modifier {name:?}: use ctrl, alt, shift or cmd"
                ))
            })
        })
        .collect()
}

fn point(x: Option<i32>, y: Option<i32>) -> Result<Option<(i32, i32)>, ApiError> {
    match (x, y) {
        (Some(x), Some(y)) if x >= 0 && y >= 0 => Ok(Some((x, y))),
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Err(ApiError::BadRequest(
            "coordinates must not be negative".into(),
        )),
        _ => Err(ApiError::BadRequest("give both x and y, or neither".into())),
    }
}

/// Holds `mods` down around `work`, releasing them even when it fails.
fn holding(
    screen: &Screen,
    mods: &[Keysym],
    work: impl FnOnce() -> Result<(), XError>,
) -> Result<(), XError> {
    for &m in mods {
        screen.key(m, true)?;
    }
    let result = work();
    for &m in mods.iter().rev() {
        screen.key(m, false)?;
    }
    result.and_then(|()| screen.sync())
}

fn position_json((x, y): (i32, i32)) -> Json<Value> {
    Json(json!({ "x": x, "y": y }))
}

async fn position(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let at = state.desktop.with_screen(|s| s.pointer()).await?;
    Ok(position_json(at))
}

async fn move_mouse(
    State(state): State<AppState>,
    Json(request): Json<MouseMoveRequest>,
) -> Result<Json<Value>, ApiError> {
    let (x, y) = point(request.x, request.y)?
        .ok_or_else(|| ApiError::BadRequest("x and y are required".into()))?;
    let at = state
        .desktop
        .with_screen(move |s| {
            s.move_to(x, y)?;
            s.pointer()
        })
        .await?;
    Ok(position_json(at))
}

async fn click(
    State(state): State<AppState>,
    Json(request): Json<MouseClickRequest>,
) -> Result<Json<Value>, ApiError> {
    let at = point(request.x, request.y)?;
    let button = button(request.button.as_deref())?;
    let mods = modifiers(&request.modifiers)?;
    let clicks = match request.clicks {
        Some(n) if n < 1 || n > i64::from(MAX_REPEAT) => {
            return Err(ApiError::BadRequest(format!(
                "clicks must be 1-{MAX_REPEAT}, got {n}"
            )))
        }
        Some(n) => n as u32,
        None if request.double => 2,
        None => 1,
    };
    let at = state
        .desktop
        .with_screen(move |s| {
            if let Some((x, y)) = at {
                s.move_to(x, y)?;
            }
            holding(s, &mods, || {
                for _ in 0..clicks {
                    s.button(button, true)?;
                    s.button(button, false)?;
                }
                Ok(())
            })?;
            s.pointer()
        })
        .await?;
    Ok(position_json(at))
}

async fn drag(
    State(state): State<AppState>,
    Json(request): Json<MouseDragRequest>,
) -> Result<Json<Value>, ApiError> {
    let start = point(request.start_x, request.start_y)?
        .ok_or_else(|| ApiError::BadRequest("startX and startY are required".into()))?;
    let end = point(request.end_x, request.end_y)?
        .ok_or_else(|| ApiError::BadRequest("endX and endY are required".into()))?;
    let button = button(request.button.as_deref())?;
    let mods = modifiers(&request.modifiers)?;
    let at = state
        .desktop
        .with_screen(move |s| {
            s.move_to(start.0, start.1)?;
            holding(s, &mods, || {
                s.button(button, true)?;
                // Through a few points on the way, as a hand would, so
                // programs that follow motion see a drag.
                const STEPS: i32 = 8;
                for step in 1..=STEPS {
                    let x = start.0 + (end.0 - start.0) * step / STEPS;
                    let y = start.1 + (end.1 - start.1) * step / STEPS;
                    s.move_to(x, y)?;
                }
                s.button(button, false)
            })?;
            s.pointer()
        })
        .await?;
    Ok(position_json(at))
}

async fn scroll(
    State(state): State<AppState>,
    Json(request): Json<MouseScrollRequest>,
) -> Result<Json<Value>, ApiError> {
    let at = point(request.x, request.y)?;
    let wheel = match request
        .direction
        .as_deref()
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Some("up") => Button::WheelUp,
        Some("down") => Button::WheelDown,
        Some("left") => Button::WheelLeft,
        Some("right") => Button::WheelRight,
        other => {
            return Err(ApiError::BadRequest(format!(
                "direction must be up, down, left or right, got {other:?}"
            )))
        }
    };
    let amount = match request.amount {
        None => 1,
        Some(n) if (1..=i64::from(MAX_REPEAT)).contains(&n) => n as u32,
        Some(n) => {
            return Err(ApiError::BadRequest(format!(
                "amount must be 1-{MAX_REPEAT}, got {n}"
            )))
        }
    };
    let mods = modifiers(&request.modifiers)?;
    state
        .desktop
        .with_screen(move |s| {
            if let Some((x, y)) = at {
                s.move_to(x, y)?;
            }
            holding(s, &mods, || {
                for _ in 0..amount {
                    s.button(wheel, true)?;
                    s.button(wheel, false)?;
                }
                Ok(())
            })
        })
        .await?;
    Ok(Json(json!({ "success": true })))
}

async fn mouse_button(
    state: AppState,
    request: MouseButtonRequest,
    press: bool,
) -> Result<Json<Value>, ApiError> {
    let at = point(request.x, request.y)?;
    let button = button(request.button.as_deref())?;
    let at = state
        .desktop
        .with_screen(move |s| {
            if let Some((x, y)) = at {
                s.move_to(x, y)?;
            }
            s.button(button, press)?;
            s.sync()?;
            s.pointer()
        })
        .await?;
    Ok(position_json(at))
}

async fn mouse_down(
    State(state): State<AppState>,
    Json(request): Json<MouseButtonRequest>,
) -> Result<Json<Value>, ApiError> {
    mouse_button(state, request, true).await
}

async fn mouse_up(
    State(state): State<AppState>,
    Json(request): Json<MouseButtonRequest>,
) -> Result<Json<Value>, ApiError> {
    mouse_button(state, request, false).await
}

async fn type_text(
    State(state): State<AppState>,
    Json(request): Json<KeyboardTypeRequest>,
) -> Result<Json<Value>, ApiError> {
    let text = request
        .text
        .ok_or_else(|| ApiError::BadRequest("text is required".into()))?;
    if text.chars().count() > MAX_TYPED {
        return Err(ApiError::BadRequest(format!(
            "at most {MAX_TYPED} characters per call"
        )));
    }
    let delay = match request.delay {
        None => 0,
        Some(ms) if (0..=MAX_DELAY_MS as i64).contains(&ms) => ms as u64,
        Some(ms) => {
            return Err(ApiError::BadRequest(format!(
                "delay must be 0-{MAX_DELAY_MS} milliseconds, got {ms}"
            )))
        }
    };
    state
        .desktop
        .with_screen(move |s| {
            for (i, c) in text.chars().enumerate() {
                if i > 0 && delay > 0 {
                    s.sync()?;
                    std::thread::sleep(Duration::from_millis(delay));
                }
                s.stroke(keys::char_keysym(c))?;
            }
            s.sync()
        })
        .await?;
    Ok(Json(json!({})))
}

async fn press_key(
    State(state): State<AppState>,
    Json(request): Json<KeyboardPressRequest>,
) -> Result<Json<Value>, ApiError> {
    let name = request
        .key
        .ok_or_else(|| ApiError::BadRequest("key is required".into()))?;
    let sym = key(&name)?;
    let mods = modifiers(&request.modifiers)?;
    state
        .desktop
        .with_screen(move |s| holding(s, &mods, || s.stroke(sym)))
        .await?;
    Ok(Json(json!({})))
}

/// `keys` is a combination such as `ctrl+shift+t`: every key but the last is
/// held while the last is pressed.
async fn hotkey(
    State(state): State<AppState>,
    Json(request): Json<KeyboardHotkeyRequest>,
) -> Result<Json<Value>, ApiError> {
    let combination = request
        .keys
        .ok_or_else(|| ApiError::BadRequest("keys is required".into()))?;
    // `+` alone, or at the end (`ctrl++`), is the plus key.
    let mut names: Vec<&str> = combination.split('+').map(str::trim).collect();
    if combination.ends_with('+') && names.len() >= 2 {
        names.truncate(names.len() - 2);
        names.push("+");
    }
    if names.iter().any(|n| n.is_empty()) {
        return Err(ApiError::BadRequest(format!(
            "keys must be key names joined by '+', such as ctrl+c; got {combination:?}"
        )));
    }
    let syms = names
        .iter()
        .map(|n| key(n))
        .collect::<Result<Vec<_>, _>>()?;
    let (last, held) = syms.split_last().expect("split gives at least one name");
    let (last, held) = (*last, held.to_vec());
    state
        .desktop
        .with_screen(move |s| holding(s, &held, || s.stroke(last)))
        .await?;
    Ok(Json(json!({})))
}

async fn key_change(
    state: AppState,
    request: KeyRequest,
    press: bool,
) -> Result<Json<Value>, ApiError> {
    let name = request
        .key
        .ok_or_else(|| ApiError::BadRequest("key is required".into()))?;
    let sym = key(&name)?;
    state
        .desktop
        .with_screen(move |s| {
            s.key(sym, press)?;
            s.sync()
        })
        .await?;
    Ok(Json(json!({})))
}

async fn key_down(
    State(state): State<AppState>,
    Json(request): Json<KeyRequest>,
) -> Result<Json<Value>, ApiError> {
    key_change(state, request, true).await
}

async fn key_up(
    State(state): State<AppState>,
    Json(request): Json<KeyRequest>,
) -> Result<Json<Value>, ApiError> {
    key_change(state, request, false).await
}
