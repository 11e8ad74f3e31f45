//! `GET /cove/tunnel/{port}` (a cove extension): a raw TCP tunnel to a port
//! inside the sandbox, over the agent's own connection.
//!
//! The server reaches sandbox ports this way for preview URLs (and other
//! helpers for port forwarding): the agent runs in the sandbox's network
//! namespace, and its socket is the one path that exists for every sandbox
//! class, including VMs that have no network device.
//!
//! Contract: the request carries `Connection: Upgrade` and `Upgrade: cove-tcp`.
//! The agent connects to `127.0.0.1:{port}` first; if that fails it answers
//! `502` with a JSON message naming the port instead of upgrading. Otherwise it
//! answers `101 Switching Protocols` (`Upgrade: cove-tcp`) and from then on
//! copies bytes both ways until each side has closed; a side's end of stream is
//! passed on as a half-close.

use axum::extract::{Path, Request};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::error::ApiError;
use crate::AppState;

/// The upgrade protocol name of the tunnel (the contract is cove-protocol's).
pub use cove_protocol::tunnel::PROTOCOL;

/// Bytes copied per read each way. Tokio's default (8 KiB) costs a system
/// call pair per 8 KiB, which caps a bulk download far below what loopback
/// carries; 256 KiB keeps the copy near memory speed.
const COPY_BUFFER: usize = 256 << 10;

pub fn routes() -> Router<AppState> {
    Router::new().route(cove_protocol::tunnel::ROUTE, get(open))
}

fn asks_for_tunnel(headers: &HeaderMap) -> bool {
    let upgrade = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case(PROTOCOL));
    let connection = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    upgrade && connection
}

async fn open(Path(port): Path<String>, mut request: Request) -> Result<Response, ApiError> {
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| ApiError::BadRequest(format!("port must be 1-65535, got {port:?}")))?;
    if !asks_for_tunnel(request.headers()) {
        return Err(ApiError::BadRequest(format!(
            "/cove/tunnel needs Connection: Upgrade and Upgrade: {PROTOCOL}"
        )));
    }
    // Connect before upgrading, so a closed port is an answer the caller can
    // show rather than a tunnel that closes at once.
    let target = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|source| ApiError::PortUnreachable { port, source })?;
    // Previews carry WebSocket frames and keystrokes, not only bulk data.
    let _ = target.set_nodelay(true);
    let upgrade = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        let client = match upgrade.await {
            Ok(upgraded) => upgraded,
            Err(error) => {
                tracing::debug!(%error, port, "tunnel upgrade failed");
                return;
            }
        };
        let mut client = TokioIo::new(client);
        let mut target = target;
        if let Err(error) = tokio::io::copy_bidirectional_with_sizes(
            &mut client,
            &mut target,
            COPY_BUFFER,
            COPY_BUFFER,
        )
        .await
        {
            tracing::debug!(%error, port, "tunnel ended");
        }
    });
    Ok((
        StatusCode::SWITCHING_PROTOCOLS,
        [
            (header::CONNECTION, HeaderValue::from_static("upgrade")),
            (header::UPGRADE, HeaderValue::from_static(PROTOCOL)),
        ],
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tunnel_needs_both_upgrade_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(header::UPGRADE, HeaderValue::from_static("Cove-TCP"));
        assert!(!asks_for_tunnel(&headers));
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert!(asks_for_tunnel(&headers));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(!asks_for_tunnel(&headers));
    }
}
