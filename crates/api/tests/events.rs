//! Live events over Socket.IO, through cove's own listener on loopback, with
//! a client that speaks the wire by hand (Engine.IO 4 over a WebSocket), as
//! the SDKs' clients send it: CONNECT with `{"token": KEY}`, then events.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use cove_api::listener::{self, ListenerLimits};
use cove_api::{app, ApiConfig, AppState};
use cove_engine::{Engine, EngineConfig, SnapshotRecord};
use cove_lifecycle::SandboxClass;
use cove_runtime::fake::FakeRuntime;
use cove_runtime::Runtime;
use cove_store::Store;
use futures_util::{SinkExt, StreamExt};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::Message;
use tower::ServiceExt;

const KEY: &str = "test-key";
/// Generous: a missing message fails the test instead of hanging it.
const PATIENCE: Duration = Duration::from_secs(20);

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

struct Server {
    router: axum::Router,
    addr: std::net::SocketAddr,
    _dir: tempfile::TempDir,
}

async fn server() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let fake = Arc::new(FakeRuntime::new());
    let runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> =
        HashMap::from([(SandboxClass::Container, fake as Arc<dyn Runtime>)]);
    let engine = Engine::new(EngineConfig::default(), store, runtimes);
    engine
        .snapshots()
        .register(&SnapshotRecord::for_image(
            "cove-default",
            "/rootfs",
            SandboxClass::Container,
            0,
        ))
        .await
        .unwrap();
    let config = ApiConfig {
        env_api_key: Some(KEY.into()),
        ..ApiConfig::default()
    };
    let router = app(AppState::new(engine, config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(listener::serve(
        listener,
        None,
        router.clone(),
        ListenerLimits::default(),
    ));
    Server {
        router,
        addr,
        _dir: dir,
    }
}

impl Server {
    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        self.call_as(KEY, None, method, path, body).await
    }

    /// A call with `key`, acting in `organization` when given.
    async fn call_as(
        &self,
        key: &str,
        organization: Option<&str>,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.addr.to_string())
            .header("authorization", format!("Bearer {key}"));
        if let Some(organization) = organization {
            request = request.header("x-daytona-organization-id", organization);
        }
        let request = match body {
            Some(body) => request
                .header("content-type", "application/json")
                .body(Body::from(body.to_string())),
            None => request.body(Body::empty()),
        };
        let response = self.router.clone().oneshot(request.unwrap()).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// An Engine.IO connection that has read the server's open packet.
    async fn engine_io(&self, query: &str) -> Socket {
        let url = format!(
            "ws://{}/api/socket.io/?EIO=4&transport=websocket{query}",
            self.addr
        );
        let (mut socket, _) = tokio_tungstenite::connect_async(url).await.unwrap();
        let open = next_text(&mut socket).await;
        assert!(open.starts_with("0{"), "not an open packet: {open}");
        socket
    }

    /// Connects to the namespace `/` with `auth`; the server's answer.
    async fn connect(&self, query: &str, auth: Option<Value>) -> (Socket, String) {
        let mut socket = self.engine_io(query).await;
        let packet = match auth {
            Some(auth) => format!("40{auth}"),
            None => "40".to_owned(),
        };
        socket.send(Message::text(packet)).await.unwrap();
        let answer = next_text(&mut socket).await;
        (socket, answer)
    }
}

/// The next text message, answering the server's pings on the way.
async fn next_text(socket: &mut Socket) -> String {
    loop {
        let message = tokio::time::timeout(PATIENCE, socket.next())
            .await
            .expect("no message from the server")
            .expect("the socket ended")
            .unwrap();
        match message {
            Message::Text(text) if text.as_str() == "2" => {
                socket.send(Message::text("3")).await.unwrap();
            }
            Message::Text(text) => return text.as_str().to_owned(),
            _ => {}
        }
    }
}

/// The next Socket.IO event: its name and data.
async fn next_event(socket: &mut Socket) -> (String, Value) {
    let text = next_text(socket).await;
    let body = text
        .strip_prefix("42")
        .unwrap_or_else(|| panic!("not an event: {text}"));
    let Value::Array(parts) = serde_json::from_str(body).unwrap() else {
        panic!("not an event: {text}")
    };
    (parts[0].as_str().unwrap().to_owned(), parts[1].clone())
}

#[tokio::test]
async fn a_socket_hears_each_change_of_a_sandbox_as_the_sdk_reads_it() {
    let server = server().await;
    let (mut socket, answer) = server
        .connect("&source=sdk-python", Some(json!({"token": KEY})))
        .await;
    assert!(answer.starts_with("40{\"sid\""), "{answer}");

    let (status, created) = server
        .call("POST", "/api/sandbox", Some(json!({"name": "evented"})))
        .await;
    assert_eq!(status, StatusCode::OK, "{created}");
    let id = created["id"].as_str().unwrap();

    // Announced as the create answered it: a `creating` heard after the
    // answer would take the SDK's sandbox back to `creating`.
    let (name, data) = next_event(&mut socket).await;
    assert_eq!(name, "sandbox.created");
    assert_eq!(
        (data["id"].as_str(), data["state"].as_str()),
        (Some(id), Some("started"))
    );
    // The whole DTO, as GET answers it over this connection's Host.
    let (_, got) = server
        .call("GET", &format!("/api/sandbox/{id}"), None)
        .await;
    for field in [
        "organizationId",
        "name",
        "user",
        "target",
        "toolboxProxyUrl",
        "cpu",
        "memory",
    ] {
        assert_eq!(data[field], got[field], "{field}");
    }

    server
        .call("POST", &format!("/api/sandbox/{id}/stop"), None)
        .await;
    let mut heard = Vec::new();
    for _ in 0..3 {
        let (name, data) = next_event(&mut socket).await;
        assert_eq!(data["sandbox"]["id"], id);
        heard.push(match name.as_str() {
            "sandbox.state.updated" => format!("state {}", data["newState"].as_str().unwrap()),
            "sandbox.desired-state.updated" => {
                format!("desired {}", data["newDesiredState"].as_str().unwrap())
            }
            other => panic!("unexpected event {other}"),
        });
    }
    assert_eq!(
        heard,
        ["state stopping", "desired stopped", "state stopped"]
    );

    server
        .call("DELETE", &format!("/api/sandbox/{id}"), None)
        .await;
    let mut last = Value::Null;
    for _ in 0..3 {
        let (name, data) = next_event(&mut socket).await;
        if name == "sandbox.state.updated" {
            last = data;
        }
    }
    assert_eq!(last["newState"], "destroyed");
    assert_eq!(last["sandbox"]["state"], "destroyed");
}

#[tokio::test]
async fn connections_without_a_valid_key_are_refused() {
    let server = server().await;
    for auth in [
        None,
        Some(json!({"token": "wrong"})),
        Some(json!({"other": KEY})),
    ] {
        let (_, answer) = server.connect("", auth.clone()).await;
        assert!(answer.starts_with("44{"), "{auth:?}: {answer}");
        assert!(answer.contains("API key"), "{auth:?}: {answer}");
    }
}

#[tokio::test]
async fn a_refused_socket_hears_nothing_and_is_closed_and_a_bearer_header_is_a_key_too() {
    let server = server().await;
    let (mut refused, answer) = server.connect("", Some(json!({"token": "wrong"}))).await;
    assert!(answer.starts_with("44{"), "{answer}");

    // The key as a Bearer header on the upgrade, for clients that can set one.
    let mut request =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(format!(
            "ws://{}/api/socket.io/?EIO=4&transport=websocket",
            server.addr
        ))
        .unwrap();
    request
        .headers_mut()
        .insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    let (mut bearer, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    assert!(next_text(&mut bearer).await.starts_with("0{"));
    bearer.send(Message::text("40")).await.unwrap();
    let answer = next_text(&mut bearer).await;
    assert!(answer.starts_with("40{\"sid\""), "{answer}");

    server
        .call("POST", "/api/sandbox", Some(json!({"name": "quiet"})))
        .await;
    let (name, _) = next_event(&mut bearer).await;
    assert_eq!(name, "sandbox.created");
    // The refused socket is sent nothing but pings, and is closed.
    loop {
        let next = tokio::time::timeout(PATIENCE, refused.next())
            .await
            .expect("a refused connection was kept open");
        match next {
            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break,
            Some(Ok(Message::Text(text))) => {
                assert!(!text.as_str().starts_with("42"), "{text}");
                refused.send(Message::text("3")).await.ok();
            }
            Some(Ok(_)) => {}
        }
    }
}

#[tokio::test]
async fn a_socket_hears_no_more_once_its_key_is_deleted() {
    let server = server().await;
    let body = json!({"name": "listener", "permissions": ["write:sandboxes"]});
    let (status, made) = server.call("POST", "/api/api-keys", Some(body)).await;
    assert_eq!(status, StatusCode::CREATED, "{made}");
    let key = made["value"].as_str().unwrap().to_owned();
    let (mut socket, answer) = server.connect("", Some(json!({"token": key}))).await;
    assert!(answer.starts_with("40{\"sid\""), "{answer}");
    let (status, _) = server
        .call("POST", "/api/sandbox", Some(json!({"name": "first"})))
        .await;
    assert_eq!(status, StatusCode::OK);
    let (name, _) = next_event(&mut socket).await;
    assert_eq!(name, "sandbox.created");

    let (status, _) = server.call("DELETE", "/api/api-keys/listener", None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = server
        .call("POST", "/api/sandbox", Some(json!({"name": "second"})))
        .await;
    assert_eq!(status, StatusCode::OK);
    // What comes now is the socket's end, never the second sandbox.
    loop {
        let message = tokio::time::timeout(PATIENCE, socket.next())
            .await
            .expect("the socket was neither closed nor sent anything");
        match message {
            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break,
            Some(Ok(Message::Text(text))) => {
                let text = text.as_str();
                assert!(!text.contains("second"), "heard after its key went: {text}");
                if text == "2" {
                    socket.send(Message::text("3")).await.unwrap();
                }
                if text.starts_with("41") {
                    break;
                }
            }
            Some(Ok(_)) => {}
        }
    }
}

#[tokio::test]
async fn a_socket_hears_its_own_organizations_sandboxes_only() {
    let server = server().await;
    let (status, team) = server
        .call("POST", "/api/organizations", Some(json!({"name": "team"})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{team}");
    let team = team["id"].as_str().unwrap().to_owned();
    let body = json!({"name": "team-key", "permissions": ["write:sandboxes"]});
    let (status, made) = server
        .call_as(KEY, Some(&team), "POST", "/api/api-keys", Some(body))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{made}");
    let key = made["value"].as_str().unwrap().to_owned();
    let (mut socket, answer) = server.connect("", Some(json!({"token": key}))).await;
    assert!(answer.starts_with("40{\"sid\""), "{answer}");
    // The default organization's sandbox first, then the team's: the team's
    // socket hears of its own only.
    let (status, _) = server
        .call("POST", "/api/sandbox", Some(json!({"name": "ours"})))
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = server
        .call_as(
            &key,
            None,
            "POST",
            "/api/sandbox",
            Some(json!({"name": "theirs"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (name, data) = next_event(&mut socket).await;
    assert_eq!(name, "sandbox.created");
    assert_eq!(data["name"], "theirs", "{data}");
    assert_eq!(data["organizationId"], team.as_str());
}

#[tokio::test]
async fn a_socket_naming_another_organization_is_refused() {
    let server = server().await;
    let (_, answer) = server
        .connect("&organizationId=someone-else", Some(json!({"token": KEY})))
        .await;
    assert!(answer.starts_with("44{"), "{answer}");
    assert!(answer.contains("someone-else"), "{answer}");
    let (_, answer) = server
        .connect("&organizationId=cove", Some(json!({"token": KEY})))
        .await;
    assert!(answer.starts_with("40{\"sid\""), "{answer}");
}

#[tokio::test]
async fn only_the_websocket_transport_is_served() {
    let server = server().await;
    let request = Request::builder()
        .uri("/api/socket.io/?EIO=4&transport=polling")
        .header("host", server.addr.to_string())
        .body(Body::empty())
        .unwrap();
    let response = server.router.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
}
