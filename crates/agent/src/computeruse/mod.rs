//! Computer use (`/computeruse/*`): the sandbox's desktop, started on
//! request and driven from the agent.
//!
//! `start` runs the desktop's programs from the image (an X server, Xvfb, at
//! `:0` sized by `VNC_RESOLUTION`; a session bus; the xfwm4 window manager
//! and the Xfce panel; x11vnc; noVNC on port 6080 for a person to watch),
//! each supervised by `processes`. Screenshots, input, displays and windows
//! then go through one X connection the agent keeps (`x11`), never a new
//! process per call. Nothing runs until `start`, and `stop` ends it all.
//!
//! Everything the desktop keeps (the session bus socket, the runtime
//! directory) lives in the agent's state directory, outside the user's tree.

pub mod a11y;
pub mod display;
pub mod input;
pub mod keys;
pub mod processes;
pub mod recording;
pub mod screenshot;
pub mod x11;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::extract::{Path as UrlPath, State};
use axum::routing::{get, post};
use axum::Router;
use serde::Serialize;
use serde_json::{json, Value};

use crate::error::{ApiError, Json};
use crate::execute::find_on_path;
use crate::{AppState, Settings};
use processes::{Process, Spec, Status};
use x11::{Screen, XError};

pub use input::{
    KeyRequest, KeyboardHotkeyRequest, KeyboardPressRequest, KeyboardTypeRequest,
    MouseButtonRequest, MouseClickRequest, MouseDragRequest, MouseMoveRequest, MouseScrollRequest,
};
pub use recording::{StartRecordingRequest, StopRecordingRequest};
pub use screenshot::{CompressedQuery, RegionQuery, ScreenshotQuery};

/// The X display the desktop serves, as Daytona's images have it.
pub const DISPLAY: &str = ":0";
const DISPLAY_NUMBER: u32 = 0;
/// The desktop's size when `VNC_RESOLUTION` names none.
const DEFAULT_RESOLUTION: (u16, u16) = (1024, 768);
/// The port noVNC serves on, inside the sandbox, for preview links.
pub const NOVNC_PORT: u16 = 6080;
const VNC_PORT: u16 = 5900;
/// How long the X server may take to accept connections (a VM without
/// hardware acceleration is slow to start one).
const X_READY: Duration = Duration::from_secs(60);

/// What a desktop client needs to reach the running desktop.
#[derive(Debug, Clone)]
pub struct Session {
    /// `DISPLAY`.
    pub display: String,
    /// `DBUS_SESSION_BUS_ADDRESS` of the desktop's session bus.
    pub bus_address: String,
}

struct Running {
    /// In start order.
    processes: Vec<Process>,
    dir: PathBuf,
    /// The value of `MARKER` in this desktop's processes.
    marker: String,
}

/// The environment variable that marks every process a desktop started.
const MARKER: &str = "COVE_DESKTOP";

/// The desktop of this sandbox: stopped until `start`.
pub struct Desktop {
    settings: Arc<Settings>,
    running: tokio::sync::Mutex<Option<Running>>,
    session: RwLock<Option<Session>>,
    screen: Mutex<Option<Arc<Screen>>>,
    recordings: recording::Recordings,
}

impl std::fmt::Debug for Desktop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Desktop").finish_non_exhaustive()
    }
}

impl Desktop {
    pub fn new(settings: Arc<Settings>) -> Self {
        Self {
            recordings: recording::Recordings::new(settings.home_dir.join(".cove/recordings")),
            settings,
            running: tokio::sync::Mutex::new(None),
            session: RwLock::new(None),
            screen: Mutex::new(None),
        }
    }

    /// The running desktop's session; 409 if it is not running.
    pub fn session(&self) -> Result<Session, ApiError> {
        self.session
            .read()
            .unwrap()
            .clone()
            .ok_or(ApiError::DesktopStopped)
    }

    /// Points the desktop's clients at a desktop started elsewhere (`None`:
    /// none): for tests that run their own X server and session bus.
    pub fn set_session(&self, session: Option<Session>) {
        *self.session.write().unwrap() = session;
        *self.screen.lock().unwrap() = None;
    }

    /// Runs `work` with the agent's X connection on a blocking thread,
    /// connecting first if needed; a connection that failed is dropped so
    /// the next call makes a new one.
    pub async fn with_screen<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Screen) -> Result<T, XError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let session = self.session()?;
        let cached = self.screen.lock().unwrap().clone();
        let (screen, result) = tokio::task::spawn_blocking(move || {
            let screen = match cached {
                Some(screen) => screen,
                None => Arc::new(Screen::connect(&session.display)?),
            };
            let result = work(&screen);
            if result.is_err() && !screen.alive() {
                return Err(XError("the connection to the X server was lost".into()));
            }
            Ok((screen, result))
        })
        .await
        .map_err(|e| ApiError::Desktop(format!("a desktop call panicked: {e}")))?
        .map_err(|e| {
            *self.screen.lock().unwrap() = None;
            ApiError::Desktop(e.0)
        })?;
        *self.screen.lock().unwrap() = Some(screen);
        result.map_err(|e| ApiError::Desktop(e.0))
    }

    async fn start(&self) -> Result<BTreeMap<&'static str, Status>, ApiError> {
        let mut running = self.running.lock().await;
        if let Some(running) = running.as_ref() {
            return Ok(statuses(&running.processes));
        }
        let xvfb = find_program("Xvfb")?;
        let dir = self.settings.state_dir.join("desktop");
        crate::config::prepare_state_dir(&dir, None).map_err(|e| ApiError::io(&dir, e))?;
        let bus_address = format!("unix:path={}", dir.join("bus").display());
        let (width, height) = resolution(std::env::var("VNC_RESOLUTION").ok().as_deref());
        let marker = uuid::Uuid::new_v4().simple().to_string();
        let env = vec![
            // Inherited by everything the desktop starts, including the
            // services its session bus starts and that leave their parent
            // (at-spi's, xfconf's): `stop` finds them by it.
            (MARKER.to_owned(), marker.clone()),
            ("DISPLAY".to_owned(), DISPLAY.to_owned()),
            ("DBUS_SESSION_BUS_ADDRESS".to_owned(), bus_address.clone()),
            // at-spi and GTK keep their sockets here, not in the user's tree.
            ("XDG_RUNTIME_DIR".to_owned(), dir.display().to_string()),
            // The panel's first start uses its default layout without asking.
            ("XFCE_PANEL_MIGRATE_DEFAULT".to_owned(), "1".to_owned()),
        ];
        clear_stale_display();

        let mut started: Vec<Process> = Vec::new();
        let outcome = self
            .start_all(&mut started, xvfb, &bus_address, (width, height), env)
            .await;
        if let Err(error) = outcome {
            for process in started.iter().rev() {
                process.stop().await;
            }
            sweep(&marker).await;
            let _ = std::fs::remove_dir_all(&dir);
            return Err(error);
        }
        *self.session.write().unwrap() = Some(Session {
            display: DISPLAY.to_owned(),
            bus_address: bus_address.clone(),
        });
        // Programs the user starts from now on find the desktop and its
        // session bus, as in a desktop session (see `system::update_env` on
        // changing the agent's environment while it runs). A value the user
        // set is kept.
        for (name, value) in [
            ("DISPLAY", DISPLAY),
            ("DBUS_SESSION_BUS_ADDRESS", &bus_address),
        ] {
            if std::env::var_os(name).is_none() {
                std::env::set_var(name, value);
            }
        }
        let answer = statuses(&started);
        *running = Some(Running {
            processes: started,
            dir,
            marker,
        });
        Ok(answer)
    }

    async fn start_all(
        &self,
        started: &mut Vec<Process>,
        xvfb: PathBuf,
        bus_address: &str,
        (width, height): (u16, u16),
        env: Vec<(String, String)>,
    ) -> Result<(), ApiError> {
        let spec = |name, priority, program: PathBuf, args: &[&str]| Spec {
            name,
            priority,
            program,
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            env: env.clone(),
        };
        let spawn_failed = |name: &'static str| {
            move |e: std::io::Error| ApiError::Desktop(format!("could not start {name}: {e}"))
        };
        let screen = format!("{width}x{height}x24");
        started.push(
            Process::start(spec(
                "xvfb",
                100,
                xvfb,
                &[
                    DISPLAY,
                    "-screen",
                    "0",
                    &screen,
                    "-nolisten",
                    "tcp",
                    "-dpi",
                    "96",
                    "-noreset",
                ],
            ))
            .map_err(spawn_failed("xvfb"))?,
        );
        if let Ok(dbus) = find_program("dbus-daemon") {
            let address = format!("--address={bus_address}");
            started.push(
                Process::start(spec(
                    "dbus",
                    150,
                    dbus,
                    &["--session", "--nofork", "--nopidfile", &address],
                ))
                .map_err(spawn_failed("dbus"))?,
            );
        }
        wait_for_x(&started[0]).await?;
        let optional: [(&'static str, u32, &str, &[&str]); 4] = [
            (
                "xfce4",
                200,
                "xfwm4",
                &["--compositor=off", "--sm-client-disable"],
            ),
            ("xfce4-panel", 250, "xfce4-panel", &["--disable-wm-check"]),
            (
                "x11vnc",
                300,
                "x11vnc",
                &[
                    "-display",
                    DISPLAY,
                    "-rfbport",
                    &VNC_PORT.to_string(),
                    "-localhost",
                    "-nopw",
                    "-forever",
                    "-shared",
                    "-noxdamage",
                    "-quiet",
                ],
            ),
            (
                "novnc",
                400,
                "websockify",
                &[
                    "--web",
                    "/usr/share/novnc",
                    &format!("127.0.0.1:{NOVNC_PORT}"),
                    &format!("127.0.0.1:{VNC_PORT}"),
                ],
            ),
        ];
        for (name, priority, program, args) in optional {
            // An image without one of these still gets a desktop to drive.
            let Ok(path) = find_program(program) else {
                tracing::info!(program, "not in the image; the desktop runs without it");
                continue;
            };
            started.push(
                Process::start(spec(name, priority, path, args)).map_err(spawn_failed(name))?,
            );
        }
        Ok(())
    }

    async fn stop(&self) -> BTreeMap<&'static str, Status> {
        let mut running = self.running.lock().await;
        self.recordings.stop_all().await;
        *self.session.write().unwrap() = None;
        *self.screen.lock().unwrap() = None;
        let Some(stopping) = running.take() else {
            return BTreeMap::new();
        };
        for process in stopping.processes.iter().rev() {
            process.stop().await;
        }
        sweep(&stopping.marker).await;
        let _ = std::fs::remove_dir_all(&stopping.dir);
        statuses(&stopping.processes)
    }
}

/// Ends what is left of a desktop: every process (of this user: others'
/// environments cannot be read) whose environment carries its marker.
async fn sweep(marker: &str) {
    let needle = format!("{MARKER}={marker}\0").into_bytes();
    for _ in 0..3 {
        let wanted = needle.clone();
        let found = tokio::task::spawn_blocking(move || marked(&wanted))
            .await
            .unwrap_or_default();
        if found.is_empty() {
            return;
        }
        for pid in found {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn marked(needle: &[u8]) -> Vec<nix::unistd::Pid> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.windows(needle.len()).any(|w| w == needle))
        })
        .map(|pid| nix::unistd::Pid::from_raw(pid as i32))
        .collect()
}

fn statuses(processes: &[Process]) -> BTreeMap<&'static str, Status> {
    processes
        .iter()
        .map(|p| (p.spec.name, p.status()))
        .collect()
}

/// A program of the desktop (or its recorder): on the agent's PATH, then in
/// the image's usual directories.
fn find_program(name: &str) -> Result<PathBuf, ApiError> {
    let mut path = std::env::var_os("PATH").unwrap_or_default();
    path.push(":/usr/local/bin:/usr/bin:/bin");
    find_on_path(name, &path).ok_or_else(|| ApiError::DesktopMissing(name.to_owned()))
}

/// `WxH` or `WxHxD` from `VNC_RESOLUTION`; the default for anything else.
fn resolution(value: Option<&str>) -> (u16, u16) {
    let parse = |value: &str| {
        let mut parts = value.trim().split('x');
        let width: u16 = parts.next()?.parse().ok()?;
        let height: u16 = parts.next()?.parse().ok()?;
        ((64..=8192).contains(&width) && (64..=8192).contains(&height)).then_some((width, height))
    };
    value.and_then(parse).unwrap_or(DEFAULT_RESOLUTION)
}

/// Removes the lock of a display whose server is gone (a sandbox restored
/// from a snapshot taken with the desktop running), so Xvfb can start.
fn clear_stale_display() {
    let lock = PathBuf::from(format!("/tmp/.X{DISPLAY_NUMBER}-lock"));
    let Ok(text) = std::fs::read_to_string(&lock) else {
        return;
    };
    let alive = text
        .trim()
        .parse::<i32>()
        .is_ok_and(|pid| nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok());
    if !alive {
        let _ = std::fs::remove_file(&lock);
        let _ = std::fs::remove_file(format!("/tmp/.X11-unix/X{DISPLAY_NUMBER}"));
    }
}

async fn wait_for_x(xvfb: &Process) -> Result<(), ApiError> {
    let deadline = Instant::now() + X_READY;
    loop {
        let ready = tokio::task::spawn_blocking(|| Screen::connect(DISPLAY).is_ok())
            .await
            .unwrap_or(false);
        if ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(ApiError::Desktop(format!(
                "the X server did not start within {}s: {}",
                X_READY.as_secs(),
                xvfb.errors().trim()
            )));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/computeruse/start", post(start))
        .route("/computeruse/stop", post(stop))
        .route("/computeruse/status", get(status))
        .route("/computeruse/process-status", get(status))
        .route("/computeruse/process/{name}/status", get(process_status))
        .route("/computeruse/process/{name}/logs", get(process_logs))
        .route("/computeruse/process/{name}/errors", get(process_errors))
        .route("/computeruse/process/{name}/restart", post(process_restart))
        .merge(screenshot::routes())
        .merge(input::routes())
        .merge(display::routes())
        .merge(recording::routes())
        .merge(a11y::routes())
}

#[derive(Serialize)]
struct StartStop {
    message: String,
    status: BTreeMap<&'static str, Status>,
}

async fn start(State(state): State<AppState>) -> Result<Json<StartStop>, ApiError> {
    let status = state.desktop.start().await?;
    Ok(Json(StartStop {
        message: "Computer use processes started successfully".into(),
        status,
    }))
}

async fn stop(State(state): State<AppState>) -> Json<StartStop> {
    let status = state.desktop.stop().await;
    Json(StartStop {
        message: "Computer use processes stopped successfully".into(),
        status,
    })
}

/// `active` when every desktop process runs, `partial` when some do,
/// `inactive` when the desktop is stopped.
async fn status(State(state): State<AppState>) -> Json<Value> {
    let running = state.desktop.running.lock().await;
    let status = match running.as_ref() {
        None => "inactive",
        Some(running) if running.processes.iter().all(|p| p.status().running) => "active",
        Some(_) => "partial",
    };
    Json(json!({ "status": status }))
}

const PROCESS_NAMES: &[&str] = &["xvfb", "dbus", "xfce4", "xfce4-panel", "x11vnc", "novnc"];

/// Runs `with` on the named process of the running desktop; `None` when the
/// desktop is stopped. An unknown name is 404.
async fn with_process<T>(
    state: &AppState,
    name: &str,
    with: impl FnOnce(&Process) -> T,
) -> Result<Option<T>, ApiError> {
    if !PROCESS_NAMES.contains(&name) {
        return Err(ApiError::DesktopProcessNotFound(format!(
            "{name} (the desktop's processes are {})",
            PROCESS_NAMES.join(", ")
        )));
    }
    let running = state.desktop.running.lock().await;
    Ok(running
        .as_ref()
        .and_then(|r| r.processes.iter().find(|p| p.spec.name == name))
        .map(with))
}

async fn process_status(
    State(state): State<AppState>,
    UrlPath(name): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let running = with_process(&state, &name, |p| p.status().running)
        .await?
        .unwrap_or(false);
    Ok(Json(json!({ "processName": name, "running": running })))
}

async fn process_logs(
    State(state): State<AppState>,
    UrlPath(name): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let logs = with_process(&state, &name, Process::logs)
        .await?
        .unwrap_or_default();
    Ok(Json(json!({ "processName": name, "logs": logs })))
}

async fn process_errors(
    State(state): State<AppState>,
    UrlPath(name): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let errors = with_process(&state, &name, Process::errors)
        .await?
        .unwrap_or_default();
    Ok(Json(json!({ "processName": name, "errors": errors })))
}

async fn process_restart(
    State(state): State<AppState>,
    UrlPath(name): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    with_process(&state, &name, |_| ()).await?;
    let running = state.desktop.running.lock().await;
    let process = running
        .as_ref()
        .ok_or(ApiError::DesktopStopped)?
        .processes
        .iter()
        .find(|p| p.spec.name == name)
        .ok_or_else(|| ApiError::DesktopProcessNotFound(format!("{name} (not in this image)")))?;
    process.restart().await;
    if name == "xvfb" {
        // Its clients lost their display; the agent reconnects on next use.
        *state.desktop.screen.lock().unwrap() = None;
    }
    Ok(Json(json!({
        "processName": name,
        "message": format!("Process {name} restarted successfully"),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolution_reads_vnc_resolution() {
        assert_eq!(resolution(Some("1280x800")), (1280, 800));
        assert_eq!(resolution(Some("1920x1080x24")), (1920, 1080));
        assert_eq!(resolution(Some("huge")), DEFAULT_RESOLUTION);
        assert_eq!(resolution(Some("1x1")), DEFAULT_RESOLUTION);
        assert_eq!(resolution(None), DEFAULT_RESOLUTION);
    }
}
