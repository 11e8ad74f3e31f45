//! cove-agent: the guest agent that serves the Daytona toolbox API inside a
//! sandbox (processes, sessions, files) over a Unix socket.
//!
//! The cove server proxies the SDK's toolbox requests here byte for byte, so
//! the routes and JSON shapes are the SDK's (`daytona==0.226.1`). This crate
//! knows nothing about sandboxes, containers or the server.

pub mod code_run;
pub mod computeruse;
pub mod config;
pub mod drain;
pub mod entrypoint;
pub mod error;
pub mod execute;
pub mod files;
pub mod git;
pub mod info;
pub mod init;
pub mod interpreter;
pub mod listen;
pub mod lsp;
pub mod not_implemented;
pub mod pty;
pub mod session;
pub mod supervise;
pub mod system;
pub mod tunnel;
pub mod unpack;
pub mod user;
pub mod vm;

use std::sync::Arc;

use axum::Router;

pub use config::Settings;

/// Every JSON body and query string the agent parses, in one list so that the
/// fuzz target `api_json` (`fuzz/`) reaches them all; each is defined and used
/// next to its handler.
pub mod requests {
    /// Request bodies (JSON; the interpreter's first WebSocket message too).
    pub mod bodies {
        pub use crate::code_run::CodeRunRequest;
        pub use crate::computeruse::a11y::{
            FindNodesRequest, InvokeNodeRequest, NodeRequest, SetNodeValueRequest,
        };
        pub use crate::computeruse::{
            KeyRequest, KeyboardHotkeyRequest, KeyboardPressRequest, KeyboardTypeRequest,
            MouseButtonRequest, MouseClickRequest, MouseDragRequest, MouseMoveRequest,
            MouseScrollRequest, StartRecordingRequest, StopRecordingRequest,
        };
        pub use crate::files::download::DownloadRequest;
        pub use crate::files::replace::ReplaceRequest;
        pub use crate::git::branches::{BranchRequest, CheckoutRequest};
        pub use crate::git::config::{AuthenticateRequest, SetRequest, UserRequest};
        pub use crate::git::remote::{AddRemoteRequest, CloneRequest, PullRequest, PushRequest};
        pub use crate::git::repo::{
            AddRequest, CommitRequest, InitRequest, ResetRequest, RestoreRequest,
        };
        pub use crate::interpreter::execute::InterpreterExecuteRequest;
        pub use crate::interpreter::routes::CreateContextRequest;
        pub use crate::lsp::routes::{LspCompletionParams, LspDocumentRequest, LspServerRequest};
        pub use crate::pty::routes::{PtyCreateRequest, PtyResizeRequest};
        pub use crate::session::routes::{
            CreateSessionRequest, SendInputRequest, SessionExecuteRequest,
        };
        pub use crate::system::UpdateEnvRequest;
        pub use cove_protocol::ExecuteRequest;
        pub use cove_protocol::{GuestNetwork, GuestVolume, IdentityRequest};
    }

    /// Query strings.
    pub mod queries {
        pub use crate::computeruse::a11y::TreeQuery as A11yTreeQuery;
        pub use crate::computeruse::{CompressedQuery, RegionQuery, ScreenshotQuery};
        pub use crate::files::download::PathQuery as DownloadPathQuery;
        pub use crate::files::info::{ListQuery, PathQuery as InfoPathQuery};
        pub use crate::files::manage::{DeleteQuery, FolderQuery};
        pub use crate::files::permissions::PermissionsQuery;
        pub use crate::files::rename::MoveQuery;
        pub use crate::files::search::PatternQuery;
        pub use crate::files::upload::UploadQuery;
        pub use crate::files::watch::WatchQuery;
        pub use crate::git::config::GetQuery;
        pub use crate::git::PathQuery as GitPathQuery;
        pub use crate::lsp::routes::LspDocumentRequest as LspDocumentQuery;
        pub use crate::lsp::routes::WorkspaceSymbolsQuery as LspWorkspaceSymbolsQuery;
        pub use crate::pty::routes::CreateConnectQuery;
        pub use crate::session::routes::LogsQuery;
        pub use cove_protocol::UnpackQuery;
    }
}

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub settings: Arc<Settings>,
    pub sessions: Arc<session::Registry>,
    /// The desktop of computer use (`/computeruse/*`).
    pub desktop: Arc<computeruse::Desktop>,
    /// The running language servers (`/lsp/*`).
    pub lsp: Arc<lsp::Registry>,
}

impl AppState {
    pub fn new(settings: Settings) -> std::io::Result<Self> {
        let settings = Arc::new(settings);
        let sessions = Arc::new(session::Registry::new(settings.clone())?);
        let desktop = Arc::new(computeruse::Desktop::new(settings.clone()));
        Ok(Self {
            settings,
            sessions,
            desktop,
            lsp: Arc::default(),
        })
    }
}

/// The whole toolbox API; tests drive it without a socket.
pub fn app(state: AppState) -> Router {
    routes().with_state(state)
}

/// Every route of the toolbox API, waiting for the agent's state: the most
/// of an agent's start (~100 routes), so `main` builds it on a thread of its
/// own while the runtime and the state are made.
pub fn routes() -> Router<AppState> {
    Router::new()
        .merge(system::routes())
        .merge(execute::routes())
        .merge(code_run::routes())
        .merge(session::routes())
        .merge(files::routes())
        .merge(info::routes())
        .merge(git::routes())
        .merge(pty::routes())
        .merge(interpreter::routes())
        .merge(tunnel::routes())
        .merge(unpack::routes())
        .merge(computeruse::routes())
        .merge(lsp::routes())
        .fallback(not_implemented::fallback)
        .layer(axum::middleware::from_fn(drain::unread_body))
}
