//! A VM's sandbox user (`vm::user`): the root agent starts a user agent,
//! hands it every toolbox request (a WebSocket upgrade included), keeps it
//! for the same user with new variables, and ends it for root. Run on the
//! host as root, with `nobody` as the sandbox user.

mod common;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::sync::Arc;
use std::time::Duration;

use common::Client;
use cove_agent::vm::user::{dispatch, UserAgent};
use cove_protocol::AgentEnv;
use futures_util::{SinkExt as _, StreamExt as _};
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;

const NOBODY: u32 = 65534;

/// Serves `dispatch` on a socket: what a VM's agent does for every path
/// but `/cove/vm/*`. Its own toolbox is empty, so only the user agent
/// answers toolbox requests.
fn front(user: Arc<UserAgent>, socket: &std::path::Path) -> tokio::task::JoinHandle<()> {
    let app = axum::Router::new()
        .fallback(move |request| dispatch(axum::Router::new(), user.clone(), request));
    let listener = tokio::net::UnixListener::bind(socket).unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    })
}

#[tokio::test]
async fn toolbox_requests_run_as_the_sandbox_user() {
    if !cove_testenv::root("becoming another user") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    let state = dir.path().join("state");
    for shared in [&work, &state] {
        std::fs::create_dir(shared).unwrap();
        std::fs::set_permissions(shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let settings = AgentEnv {
        workdir: Some(work.display().to_string()),
        state_dir: Some(state.display().to_string()),
        log: Some("warn".into()),
        ..AgentEnv::default()
    };
    let user = Arc::new(UserAgent::with(
        env!("CARGO_BIN_EXE_cove-agent").into(),
        &dir.path().join("private"),
        settings,
    ));
    let socket = dir.path().join("front.sock");
    let server = front(user.clone(), &socket);
    let client = Client::at(&socket);

    user.become_user(Some("nobody"), &[], &[]).await.unwrap();
    // Its socket is root's alone.
    let private = std::fs::metadata(dir.path().join("private")).unwrap();
    assert_eq!((private.uid(), private.mode() & 0o777), (0, 0o700));

    let reply = client
        .post_json("/process/execute", json!({"command": "id -u"}))
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(
        reply.json()["result"].as_str().unwrap().trim(),
        NOBODY.to_string()
    );

    // Files it writes are the user's.
    let reply = client
        .post_json("/files/folder?path=made&mode=755", json!({}))
        .await;
    assert!(reply.status.is_success(), "{:?}", reply.body);
    assert_eq!(std::fs::metadata(work.join("made")).unwrap().uid(), NOBODY);

    // A WebSocket (a PTY) is joined through to the user agent.
    let reply = client
        .post_json(
            "/process/pty",
            json!({"id": "term", "cols": 80, "rows": 24}),
        )
        .await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    let mut terminal = client.websocket("/process/pty/term/connect").await;
    let first = terminal.next().await.unwrap().unwrap();
    assert!(first.to_text().unwrap().contains("connected"), "{first:?}");
    terminal
        .send(Message::Binary(b"echo uid=$(id -u)\n".to_vec().into()))
        .await
        .unwrap();
    let mut output = String::new();
    while !output.contains(&format!("uid={NOBODY}")) {
        let message = tokio::time::timeout(Duration::from_secs(15), terminal.next())
            .await
            .unwrap_or_else(|_| panic!("no uid in {output:?}"))
            .unwrap()
            .unwrap();
        if let Message::Binary(data) = message {
            output.push_str(&String::from_utf8_lossy(&data));
        }
    }
    drop(terminal);

    // The same user again keeps the agent (its PTY is still there) and
    // hands it the variables that changed.
    std::env::set_var("COVE_VM_USER_TEST_VAR", "handed over");
    user.become_user(Some("nobody"), &["COVE_VM_USER_TEST_VAR".into()], &[])
        .await
        .unwrap();
    let reply = client
        .post_json(
            "/process/execute",
            json!({"command": "echo $COVE_VM_USER_TEST_VAR"}),
        )
        .await;
    assert_eq!(
        reply.json()["result"].as_str().unwrap().trim(),
        "handed over"
    );
    std::env::remove_var("COVE_VM_USER_TEST_VAR");
    let reply = client.get("/process/pty").await;
    assert!(
        reply.body.windows(4).any(|w| w == b"term"),
        "{:?}",
        reply.body
    );

    // Asked to start an entrypoint, the same user's agent that started
    // none (a warm machine's) is replaced by one that starts it...
    let marker = work.join("entrypoint-ran");
    let entrypoint = vec![
        "sh".to_owned(),
        "-c".to_owned(),
        format!("echo ran >> {}", marker.display()),
    ];
    user.become_user(Some("nobody"), &[], &entrypoint)
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !marker.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the entrypoint never ran"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reply = client.get("/process/pty").await;
    assert!(
        !reply.body.windows(4).any(|w| w == b"term"),
        "the old user agent's PTY is gone with it: {:?}",
        reply.body
    );
    // ...and kept when asked again (a fork's or a restore's identity call):
    // the entrypoint is not started twice.
    let reply = client
        .post_json(
            "/process/pty",
            json!({"id": "kept", "cols": 80, "rows": 24}),
        )
        .await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    user.become_user(Some("nobody"), &[], &entrypoint)
        .await
        .unwrap();
    let reply = client.get("/process/pty").await;
    assert!(
        reply.body.windows(4).any(|w| w == b"kept"),
        "{:?}",
        reply.body
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "ran\n");

    // Root needs no user agent: the root agent's own routes answer.
    user.become_user(None, &[], &[]).await.unwrap();
    assert!(user.socket().is_none());
    let reply = client
        .post_json("/process/execute", json!({"command": "id -u"}))
        .await;
    assert_eq!(reply.status, 404, "{:?}", reply.body);

    // A user the system lacks: the call fails and nothing is left serving.
    let refused = user.become_user(Some("no-such-user-here"), &[], &[]).await;
    assert!(refused.is_err());
    assert!(user.socket().is_none());
    server.abort();
}
