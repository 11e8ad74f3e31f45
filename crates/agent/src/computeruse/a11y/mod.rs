//! The accessibility tree of the sandbox's desktop (`/computeruse/a11y/*`),
//! read and driven through AT-SPI over D-Bus.
//!
//! - `bus.rs`: finding the accessibility bus through the desktop's session
//!   bus, and the AT-SPI calls, each with a deadline.
//! - `node.rs`: node ids (`<bus name>:<object path>`, as Daytona's daemon
//!   writes them) and the node the SDK sees.
//! - `walk.rs`: scopes, the bounded walk, a find's filter.
//! - `routes.rs`: the five routes.
//!
//! The applications on the accessibility bus are the sandbox's code: their
//! answers are clipped and counted, never trusted to end (see `walk.rs`).
//! This module knows the desktop only as [`super::Desktop::session`]; it
//! starts nothing.

mod bus;
mod node;
mod routes;
mod walk;

use std::time::Duration;

use axum::http::StatusCode;

pub use routes::{
    routes, FindNodesRequest, InvokeNodeRequest, NodeRequest, SetNodeValueRequest, TreeQuery,
};

/// Why an accessibility request failed; each kind has its status.
#[derive(Debug, thiserror::Error)]
pub enum A11yError {
    /// The desktop runs but its accessibility stack does not answer (503).
    #[error("the accessibility bus is not reachable: {0}")]
    Unavailable(String),
    #[error("invalid accessibility node id {id:?}: {why}")]
    InvalidId { id: String, why: String },
    #[error("{0}")]
    InvalidRequest(String),
    /// The node's application or the node itself is gone (or never was).
    #[error("accessibility node not found: {id}")]
    NodeNotFound { id: String },
    #[error("no application on the accessibility bus {0}")]
    NoApplication(String),
    #[error("accessibility node {id} does not support {what}")]
    NotSupported { id: String, what: String },
    #[error("accessibility node {id} refused {what}")]
    Refused { id: String, what: &'static str },
    #[error("the application of accessibility node {id} did not answer within {}s (asked for {what})", .limit.as_secs())]
    Unresponsive {
        id: String,
        what: &'static str,
        limit: Duration,
    },
    #[error("asking accessibility node {id} for {what} failed")]
    Bus {
        id: String,
        what: &'static str,
        #[source]
        source: Box<zbus::Error>,
    },
}

impl A11yError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::InvalidId { .. }
            | Self::InvalidRequest(_)
            | Self::NotSupported { .. }
            | Self::Refused { .. } => StatusCode::BAD_REQUEST,
            Self::NodeNotFound { .. } | Self::NoApplication(_) => StatusCode::NOT_FOUND,
            Self::Unresponsive { .. } | Self::Bus { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The daemon error code (`DaemonErrorCode`); the SDK maps
    /// `A11Y_UNAVAILABLE` to its `DaytonaA11yUnavailableError`.
    pub fn code(&self) -> &'static str {
        match self.status() {
            StatusCode::SERVICE_UNAVAILABLE => "A11Y_UNAVAILABLE",
            StatusCode::BAD_REQUEST => "BAD_REQUEST",
            StatusCode::NOT_FOUND => "NOT_FOUND",
            _ => "INTERNAL_SERVER_ERROR",
        }
    }

    /// What a failed call on `id` asking for `what` (e.g. "focus") means.
    fn from_call(id: &node::NodeId, what: &'static str, error: bus::CallError) -> Self {
        let id = id.to_string();
        match error {
            bus::CallError::Gone(_) => Self::NodeNotFound { id },
            bus::CallError::Unsupported(_) => Self::NotSupported {
                id,
                what: what.to_owned(),
            },
            bus::CallError::Timeout(limit) => Self::Unresponsive { id, what, limit },
            bus::CallError::Other(source) => Self::Bus { id, what, source },
        }
    }
}
