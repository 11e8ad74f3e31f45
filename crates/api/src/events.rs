//! Live sandbox events over Socket.IO at `/api/socket.io/`, as Daytona's
//! notification gateway serves them and the SDKs subscribe to them: their
//! waits for a state end on the event instead of the next 1 s poll.
//!
//! The wire, as the pinned SDKs use it: Engine.IO 4 over WebSocket only (no
//! long-polling), the default namespace `/`, the API key in the CONNECT
//! packet's auth payload (`{"token": KEY}`; a `Authorization: Bearer` header
//! on the upgrade is taken too), and `organizationId` in the query when the
//! client names one. Events, each to the sockets of the sandbox's
//! organization:
//! - `sandbox.created`: the sandbox DTO, once its create has ended (as the
//!   create answered it: never `creating`);
//! - `sandbox.state.updated`: `{"sandbox": DTO, "oldState", "newState"}`;
//! - `sandbox.desired-state.updated`:
//!   `{"sandbox": DTO, "oldDesiredState", "newDesiredState"}`.
//!
//! The DTO is the one `GET /api/sandbox/{id}` answers, its toolbox URL made
//! from the connection's own `Host` as there. Each socket gets its own task
//! reading the engine's feed ([`Engine::events`](cove_engine::Engine::events));
//! a client too slow for it loses events, never the server's memory, and
//! still has its poll.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use cove_engine::SandboxEvent;
use serde::{Deserialize, Serialize};
use socketioxide::extract::{SocketRef, TryData};
use socketioxide::handler::ConnectHandler;
use socketioxide::layer::SocketIoLayer;
use socketioxide::{SocketIo, TransportType};
use tokio::sync::{broadcast, Notify};

use crate::dto::Sandbox;
use crate::AppState;

/// Where the SDKs look for it: `{API URL path}/socket.io/`.
pub(crate) const PATH: &str = "/api/socket.io";
/// How long a connection may go without joining the namespace (an
/// unauthenticated one never does) before it is closed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Clients send only their CONNECT packet and pongs.
const MAX_CLIENT_MESSAGE: usize = 16 * 1024;

/// The Socket.IO service, in front of every route (it takes only its path).
pub(crate) fn layer(state: AppState) -> SocketIoLayer {
    let (layer, io) = SocketIo::builder()
        .req_path(PATH)
        .transports([TransportType::Websocket])
        .connect_timeout(CONNECT_TIMEOUT)
        .max_payload(MAX_CLIENT_MESSAGE as u64)
        .ws_max_message_size(MAX_CLIENT_MESSAGE)
        .ws_max_frame_size(MAX_CLIENT_MESSAGE)
        .build_layer();
    let check_key = {
        let state = state.clone();
        move |socket: SocketRef, auth: TryData<Auth>| authenticate(state, socket, auth)
    };
    let connected = move |socket: SocketRef| {
        let state = state.clone();
        async move { forward(state, socket) }
    };
    io.ns("/", connected.with(check_key));
    layer
}

/// The CONNECT packet's payload.
#[derive(Deserialize)]
pub(crate) struct Auth {
    token: String,
}

/// Why a connection is refused; the client gets it as its `connect_error`.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("missing API key: connect with auth {{\"token\": \"<key>\"}}")]
    MissingKey,
    #[error("invalid API key")]
    InvalidKey,
    #[error("the API key does not belong to organization {0:?}")]
    OtherOrganization(String),
    #[error("the API key could not be checked")]
    Unchecked,
}

async fn authenticate(
    state: AppState,
    socket: SocketRef,
    TryData(auth): TryData<Auth>,
) -> Result<(), Refusal> {
    let parts = socket.req_parts();
    let token = match &auth {
        Ok(auth) => Some(auth.token.as_str()),
        Err(_) => crate::auth::bearer(&parts.headers),
    };
    let token = token.ok_or(Refusal::MissingKey)?;
    let caller = match crate::auth::authenticate(&state, token).await {
        Ok(caller) => caller,
        Err(error) if error.status == StatusCode::UNAUTHORIZED => return Err(Refusal::InvalidKey),
        Err(error) => {
            tracing::warn!(error = %error.message, "an event socket's API key could not be checked");
            return Err(Refusal::Unchecked);
        }
    };
    // A key hears of its own organization's sandboxes; the operator of the
    // one it names (`organizationId`, as the SDKs send it), else of the
    // default one. A key naming another is told why it would hear nothing.
    let asked = organization_asked(parts.uri.query()).filter(|asked| !asked.is_empty());
    let organization = match asked {
        Some(asked) if caller.operator => match state.engine.organizations().get(&asked).await {
            Ok(_) => asked,
            Err(_) => return Err(Refusal::OtherOrganization(asked)),
        },
        Some(asked) if asked != caller.organization_id => {
            return Err(Refusal::OtherOrganization(asked))
        }
        _ => caller.organization_id,
    };
    socket.extensions.insert(Listener {
        organization,
        token: token.to_owned(),
    });
    Ok(())
}

/// Who a socket is: the organization it hears of, and the key it came
/// with, checked again before each event so a deleted key hears no more.
#[derive(Clone)]
struct Listener {
    organization: String,
    token: String,
}

fn organization_asked(query: Option<&str>) -> Option<String> {
    form_urlencoded::parse(query?.as_bytes())
        .find(|(name, _)| name == "organizationId")
        .map(|(_, value)| value.into_owned())
}

/// Sends an authenticated socket its organization's events until it goes.
fn forward(state: AppState, socket: SocketRef) {
    let mut feed = state.engine.events();
    let gone = Arc::new(Notify::new());
    socket.on_disconnect({
        let gone = gone.clone();
        move || async move { gone.notify_one() }
    });
    let headers = socket.req_parts().headers.clone();
    let Some(Listener {
        organization,
        token,
    }) = socket.extensions.get::<Listener>()
    else {
        tracing::warn!(socket = %socket.id, "an event socket without its organization");
        return;
    };
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                () = gone.notified() => return,
                event = feed.recv() => event,
            };
            let event = match event {
                Ok(event) => event,
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::debug!(socket = %socket.id, missed, "an event socket fell behind");
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if event.sandbox().organization_id != organization {
                continue;
            }
            // A key deleted since (alone or with its organization), or
            // expired, ends the socket rather than hear another event.
            if crate::auth::authenticate(&state, &token).await.is_err() {
                tracing::info!(socket = %socket.id, "an event socket's key is no longer accepted");
                let _ = socket.disconnect();
                return;
            }
            let (name, message) = message(&state, &headers, event);
            // Fails once the socket is closed (the notice above ends the
            // task) or while its buffer is full: that event is dropped.
            if let Err(error) = socket.emit(name, &message) {
                tracing::debug!(socket = %socket.id, %error, "an event was not sent");
                if !socket.connected() {
                    return;
                }
            }
        }
    });
}

/// One event as Daytona's gateway sends it.
#[derive(Serialize)]
#[serde(untagged, rename_all_fields = "camelCase")]
enum Message {
    Created(Sandbox),
    StateUpdated {
        sandbox: Sandbox,
        old_state: &'static str,
        new_state: &'static str,
    },
    DesiredStateUpdated {
        sandbox: Sandbox,
        old_desired_state: &'static str,
        new_desired_state: &'static str,
    },
}

fn message(state: &AppState, headers: &HeaderMap, event: SandboxEvent) -> (&'static str, Message) {
    match event {
        SandboxEvent::Created { sandbox } => (
            "sandbox.created",
            Message::Created(crate::sandbox::to_dto(state, headers, sandbox)),
        ),
        SandboxEvent::StateUpdated { sandbox, old_state } => {
            let new_state = sandbox.state.wire();
            (
                "sandbox.state.updated",
                Message::StateUpdated {
                    sandbox: crate::sandbox::to_dto(state, headers, sandbox),
                    old_state: old_state.wire(),
                    new_state,
                },
            )
        }
        SandboxEvent::DesiredStateUpdated {
            sandbox,
            old_desired_state,
        } => {
            let new_desired_state = sandbox.desired_state.as_str();
            (
                "sandbox.desired-state.updated",
                Message::DesiredStateUpdated {
                    sandbox: crate::sandbox::to_dto(state, headers, sandbox),
                    old_desired_state: old_desired_state.as_str(),
                    new_desired_state,
                },
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_organization_is_read_from_the_query() {
        assert_eq!(organization_asked(None), None);
        assert_eq!(organization_asked(Some("source=sdk-python&EIO=4")), None);
        assert_eq!(
            organization_asked(Some("EIO=4&organizationId=a%20b&transport=websocket")).as_deref(),
            Some("a b")
        );
    }
}
