//! A VM sandbox's user. The VM's agent stays root (it sets the clock and the
//! hostname, configures the NIC, mounts volumes), so where the sandbox runs
//! as another user it starts a second agent, `cove-agent serve`, that
//! becomes that user exactly as a container's agent does ([`crate::user`]),
//! and hands every toolbox request to it: commands, sessions, PTYs, files,
//! git and the interpreter then act as the user, and uploads belong to it.
//! Only `/cove/vm/*` stays with the root agent.
//!
//! The user is known only at `POST /cove/vm/identity`: a template boots
//! before any sandbox exists, and a snapshot's memory holds whatever user
//! its sandbox had. Identity therefore starts the user's agent, keeps the
//! one already running for the same user (a resume, a fork, a restored
//! snapshot: its sessions and processes go on), or stops it for another.
//!
//! The user's agent serves on a socket the root agent binds in a directory
//! only root may enter and hands over as `COVE_AGENT_LISTEN_FD`, so no
//! process of the sandbox can stand in for it or reach it by path.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{self, StatusCode};
use axum::response::{IntoResponse as _, Response};
use cove_protocol::AgentEnv;
use hyper_util::rt::TokioIo;
use tokio::process::{Child, Command};

use crate::error::ApiError;

/// The directory of the user agent's socket: root's alone.
const SOCKET_DIR: &str = "/run/cove-agent";
const SOCKET_NAME: &str = "user.sock";
/// How long a new user agent may take to answer (it is a fresh process of
/// a static binary, but a VM without KVM runs it slowly).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a user agent being replaced may take to end its sessions.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether `user` (from an identity call) means the root agent serves alone.
pub fn is_root(user: Option<&str>) -> bool {
    match user.map(|user| user.split_once(':').map_or(user, |(name, _)| name)) {
        None | Some("") | Some("root") | Some("0") => true,
        Some(_) => false,
    }
}

/// The user agent this VM runs, if any.
pub struct UserAgent {
    /// The agent binary: this one.
    program: PathBuf,
    /// The user agent's socket: in a directory only root may enter.
    socket_path: PathBuf,
    /// The settings the root agent started with (from its `COVE_*`
    /// variables): the user agent gets the same, and its user.
    settings: AgentEnv,
    running: tokio::sync::Mutex<Option<Running>>,
    /// The socket of the running user agent, read on every request.
    socket: std::sync::RwLock<Option<PathBuf>>,
}

struct Running {
    user: String,
    child: Child,
    /// Whether it was started with an entrypoint to run (a user agent
    /// started for a warm machine nobody asked for yet was not).
    entrypoint: bool,
}

impl UserAgent {
    pub fn new(settings: AgentEnv) -> Self {
        Self::with("/proc/self/exe".into(), SOCKET_DIR.as_ref(), settings)
    }

    /// A user agent of `program` serving on a socket in `socket_dir`
    /// (made, root's alone, if missing).
    pub fn with(program: PathBuf, socket_dir: &Path, settings: AgentEnv) -> Self {
        Self {
            program,
            socket_path: socket_dir.join(SOCKET_NAME),
            settings,
            running: tokio::sync::Mutex::new(None),
            socket: std::sync::RwLock::new(None),
        }
    }

    /// Where toolbox requests go: the user agent's socket, or `None` (the
    /// root agent serves them).
    pub fn socket(&self) -> Option<PathBuf> {
        self.socket
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_socket(&self, socket: Option<PathBuf>) {
        *self.socket.write().unwrap_or_else(|p| p.into_inner()) = socket;
    }

    /// Makes `user` the one toolbox requests run as: keeps a user agent
    /// already running as `user` and hands it the variables `env_changes`
    /// names (their values now in this process's environment; absent ones
    /// are removed), or replaces it. `entrypoint` starts in a new user
    /// agent; one kept must have started with an entrypoint already (a
    /// fork's or a restore's) unless there is none to start.
    pub async fn become_user(
        &self,
        user: Option<&str>,
        env_changes: &[String],
        entrypoint: &[String],
    ) -> Result<(), ApiError> {
        let mut running = self.running.lock().await;
        let wanted = user.filter(|_| !is_root(user));
        if let (Some(current), Some(wanted)) = (running.as_mut(), wanted) {
            let alive = matches!(current.child.try_wait(), Ok(None));
            if current.user == wanted && alive && (current.entrypoint || entrypoint.is_empty()) {
                return update_env(&self.socket_path, env_changes).await;
            }
        }
        if let Some(previous) = running.take() {
            self.set_socket(None);
            stop(previous).await;
        }
        let Some(user) = wanted else {
            return Ok(());
        };
        let child = self.start(user, entrypoint)?;
        let started = Running {
            user: user.to_owned(),
            child,
            entrypoint: !entrypoint.is_empty(),
        };
        let socket = self.socket_path.clone();
        if let Err(error) = wait_ready(&socket).await {
            stop(started).await;
            return Err(ApiError::internal(
                "start the sandbox user's agent (the VM's console says why)",
                error,
            ));
        }
        *running = Some(started);
        self.set_socket(Some(socket));
        tracing::info!(%user, "toolbox requests run as the sandbox user");
        Ok(())
    }

    /// Starts `cove-agent serve` on a new socket, as `user`.
    fn start(&self, user: &str, entrypoint: &[String]) -> Result<Child, ApiError> {
        let listener = bind(&self.socket_path)
            .map_err(|e| ApiError::internal("bind the user agent's socket", e))?;
        let fd = listener.as_raw_fd();
        // Its own state directory in the VM's /run, which it makes (and
        // gives to its user) before it drops to that user.
        let state_dir = self
            .settings
            .state_dir
            .clone()
            .or_else(|| Some(crate::config::sandbox_state_dir().display().to_string()));
        let settings = AgentEnv {
            user: Some(user.to_owned()),
            entrypoint: entrypoint.to_vec(),
            listen_fd: Some(fd),
            state_dir,
            ..self.settings.clone()
        };
        let mut command = Command::new(&self.program);
        command
            .arg("serve")
            .envs(settings.to_env())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        // SAFETY: between fork and exec only fcntl runs, which is
        // async-signal-safe.
        unsafe {
            command.pre_exec(move || {
                // The one descriptor the user agent inherits.
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .map_err(|e| ApiError::internal("start the user agent", e))?;
        // The child holds the listening socket now; with this copy gone, a
        // connection to a user agent that died is refused rather than left
        // waiting.
        drop(listener);
        Ok(child)
    }
}

/// Binds the socket afresh in root's own directory.
fn bind(path: &Path) -> io::Result<std::os::unix::net::UnixListener> {
    let dir = path.parent().expect("the socket has a directory");
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::os::unix::net::UnixListener::bind(path)
}

/// Ends a user agent: SIGTERM (it ends its sessions), then SIGKILL.
async fn stop(mut running: Running) {
    if let Some(pid) = running.child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    if tokio::time::timeout(STOP_TIMEOUT, running.child.wait())
        .await
        .is_err()
    {
        let _ = running.child.kill().await;
    }
    tracing::info!(user = %running.user, "the user agent ended");
}

/// Waits until the user agent answers `GET /version`.
async fn wait_ready(socket: &Path) -> io::Result<()> {
    let ask = async {
        let request = http::Request::get("/version")
            .header(http::header::HOST, "localhost")
            .body(Body::empty())
            .map_err(io::Error::other)?;
        let response = send(socket, request).await?;
        match response.status() {
            StatusCode::OK => Ok(()),
            status => Err(io::Error::other(format!("it answered {status}"))),
        }
    };
    tokio::time::timeout(START_TIMEOUT, ask)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer"))?
}

/// Hands the user agent the current values of `names` (`POST /env`).
async fn update_env(socket: &Path, names: &[String]) -> Result<(), ApiError> {
    if names.is_empty() {
        return Ok(());
    }
    let mut set = BTreeMap::new();
    let mut unset = Vec::new();
    for name in names {
        match std::env::var(name) {
            Ok(value) => {
                set.insert(name.clone(), value);
            }
            Err(_) => unset.push(name.clone()),
        }
    }
    let body = serde_json::json!({ "set": set, "unset": unset }).to_string();
    let request = http::Request::post("/env")
        .header(http::header::HOST, "localhost")
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .expect("a valid request");
    let response = send(socket, request)
        .await
        .map_err(|e| ApiError::internal("hand the user agent its variables", e))?;
    if !response.status().is_success() {
        return Err(ApiError::internal(
            "hand the user agent its variables",
            io::Error::other(format!("it answered {}", response.status())),
        ));
    }
    Ok(())
}

/// One request to the user agent on a connection of its own; an upgrade
/// (a PTY's WebSocket, a port tunnel) is joined to the caller's.
async fn send(socket: &Path, mut request: Request) -> io::Result<Response> {
    let upgrade = request
        .extensions_mut()
        .remove::<hyper::upgrade::OnUpgrade>();
    let stream = tokio::net::UnixStream::connect(socket).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(io::Error::other)?;
    tokio::spawn(async move {
        if let Err(error) = connection.with_upgrades().await {
            tracing::debug!(%error, "a connection to the user agent ended");
        }
    });
    let mut response = sender
        .send_request(request)
        .await
        .map_err(io::Error::other)?;
    if let (StatusCode::SWITCHING_PROTOCOLS, Some(upgrade)) = (response.status(), upgrade) {
        let theirs = hyper::upgrade::on(&mut response);
        tokio::spawn(async move {
            let (Ok(ours), Ok(theirs)) = tokio::join!(upgrade, theirs) else {
                return;
            };
            let _ =
                tokio::io::copy_bidirectional(&mut TokioIo::new(ours), &mut TokioIo::new(theirs))
                    .await;
        });
    }
    Ok(response.map(Body::new))
}

/// Serves one toolbox request: in the user agent where there is one, else
/// in `toolbox` (this agent's own routes, as root).
pub async fn dispatch(
    toolbox: axum::Router,
    user: std::sync::Arc<UserAgent>,
    request: Request,
) -> Response {
    let Some(socket) = user.socket() else {
        use tower::ServiceExt as _;
        return match toolbox.oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
    };
    match send(&socket, request).await {
        Ok(response) => response,
        Err(error) => ApiError::internal("reach the sandbox user's agent", error).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_in_any_spelling_needs_no_user_agent() {
        for user in [
            None,
            Some(""),
            Some("root"),
            Some("0"),
            Some("root:root"),
            Some("0:0"),
        ] {
            assert!(is_root(user), "{user:?}");
        }
        for user in [
            Some("daytona"),
            Some("1000"),
            Some("daytona:root"),
            Some("rooty"),
        ] {
            assert!(!is_root(user), "{user:?}");
        }
    }
}
