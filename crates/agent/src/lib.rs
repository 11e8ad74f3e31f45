//! cove-agent: the guest agent that serves the Daytona toolbox API inside a
//! sandbox (processes, sessions, files) over a Unix socket.
//!
//! The cove server proxies the SDK's toolbox requests here byte for byte, so
//! the routes and JSON shapes are the SDK's (`daytona==0.226.1`). This crate
//! knows nothing about sandboxes, containers or the server.

pub mod config;
pub mod entrypoint;
pub mod error;
pub mod execute;
pub mod files;
pub mod git;
pub mod info;
pub mod init;
pub mod interpreter;
pub mod listen;
pub mod not_implemented;
pub mod pty;
pub mod session;
pub mod system;
pub mod tunnel;
pub mod unpack;
pub mod user;
pub mod vm;

use std::sync::Arc;

use axum::Router;

pub use config::Settings;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub settings: Arc<Settings>,
    pub sessions: Arc<session::Registry>,
}

impl AppState {
    pub fn new(settings: Settings) -> std::io::Result<Self> {
        let settings = Arc::new(settings);
        let sessions = Arc::new(session::Registry::new(settings.clone())?);
        Ok(Self { settings, sessions })
    }
}

/// The whole toolbox API; tests drive it without a socket.
pub fn app(state: AppState) -> Router {
    Router::new()
        .merge(system::routes())
        .merge(execute::routes())
        .merge(session::routes())
        .merge(files::routes())
        .merge(info::routes())
        .merge(git::routes())
        .merge(pty::routes())
        .merge(interpreter::routes())
        .merge(tunnel::routes())
        .merge(unpack::routes())
        .fallback(not_implemented::fallback)
        .with_state(state)
}
