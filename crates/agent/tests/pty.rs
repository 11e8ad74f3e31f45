//! `/process/pty...` through a real agent: a real terminal (controlling tty,
//! window size, job control), lazy start, several clients, resize, kill and
//! exit codes in the close frame.

mod common;

use std::time::{Duration, Instant};

use common::Agent;
use futures_util::{SinkExt as _, StreamExt as _};
use serde_json::{json, Value};
use tokio::net::UnixStream;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

type Socket = WebSocketStream<UnixStream>;

async fn create(agent: &Agent, body: Value) {
    let reply = agent.post_json("/process/pty", body).await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
}

/// Connects and checks the `connected` control message comes first.
async fn connect(agent: &Agent, id: &str) -> Socket {
    let mut socket = agent.websocket(&format!("/process/pty/{id}/connect")).await;
    let first = tokio::time::timeout(Duration::from_secs(10), socket.next())
        .await
        .expect("no control message")
        .unwrap()
        .unwrap();
    let Message::Text(text) = first else {
        panic!("first message is not text: {first:?}");
    };
    let control: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(control, json!({"type": "control", "status": "connected"}));
    socket
}

async fn send(socket: &mut Socket, input: &str) {
    socket
        .send(Message::Binary(input.as_bytes().to_vec().into()))
        .await
        .unwrap();
}

/// Terminal output read until it contains `needle`.
async fn read_until(socket: &mut Socket, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut output = String::new();
    while !output.contains(needle) {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let message = tokio::time::timeout(remaining, socket.next())
            .await
            .unwrap_or_else(|_| panic!("{needle:?} never came; got {output:?}"))
            .expect("socket ended")
            .unwrap();
        match message {
            Message::Binary(data) => output.push_str(&String::from_utf8_lossy(&data)),
            Message::Close(frame) => panic!("closed {frame:?} before {needle:?}; got {output:?}"),
            _ => {}
        }
    }
    output
}

/// Reads to the close frame; returns it and the text messages seen.
async fn read_to_close(socket: &mut Socket) -> (CloseFrame, Vec<Value>) {
    let mut controls = Vec::new();
    loop {
        let message = tokio::time::timeout(Duration::from_secs(15), socket.next())
            .await
            .expect("no close frame")
            .expect("socket ended without a close frame")
            .unwrap();
        match message {
            Message::Text(text) => controls.push(serde_json::from_str(&text).unwrap()),
            Message::Close(frame) => return (frame.expect("close frame has a code"), controls),
            _ => {}
        }
    }
}

#[tokio::test]
async fn shell_runs_on_a_real_terminal_with_cwd_envs_and_size() {
    let agent = Agent::start();
    let cwd = agent.path("sub");
    std::fs::create_dir(&cwd).unwrap();
    create(
        &agent,
        json!({"id": "t1", "cwd": "sub", "envs": {"GREETING": "hi there"}, "cols": 120, "rows": 40}),
    )
    .await;
    let info = agent.get("/process/pty/t1").await.json();
    assert_eq!(info["id"], "t1");
    assert_eq!(info["active"], true);
    assert_eq!(info["cwd"], cwd.to_str().unwrap());
    assert_eq!(info["envs"]["GREETING"], "hi there");
    assert_eq!(
        (info["cols"].as_u64(), info["rows"].as_u64()),
        (Some(120), Some(40))
    );
    assert_eq!(info["lazyStart"], false);
    assert!(info["createdAt"].as_str().unwrap().contains('T'));

    let mut socket = connect(&agent, "t1").await;
    // The arithmetic keeps the echoed command line from matching the needle.
    send(&mut socket, "echo \"[$GREETING|$TERM|$(pwd)|$((6*7))]\"\n").await;
    let expected = format!("[hi there|xterm-256color|{}|42]", cwd.display());
    read_until(&mut socket, &expected).await;
    send(&mut socket, "echo size=$(stty size)=\n").await;
    read_until(&mut socket, "size=40 120=").await;
    // Session leader with the terminal as controlling tty: /dev/tty opens.
    send(
        &mut socket,
        "[ \"$(cut -d' ' -f6 /proc/$$/stat)\" = $$ ] && echo > /dev/tty leader-$((1+1))\n",
    )
    .await;
    read_until(&mut socket, "leader-2").await;

    let resized = agent
        .post_json("/process/pty/t1/resize", json!({"cols": 100, "rows": 30}))
        .await;
    assert_eq!(resized.status, 200, "{:?}", resized.body);
    assert_eq!(resized.json()["cols"], 100);
    send(&mut socket, "echo size=$(stty size)=\n").await;
    read_until(&mut socket, "size=30 100=").await;

    let too_big = agent
        .post_json("/process/pty/t1/resize", json!({"cols": 1001, "rows": 30}))
        .await;
    assert_eq!(too_big.status, 400);
}

#[tokio::test]
async fn exit_closes_clients_with_the_exit_code_and_forgets_the_session() {
    let agent = Agent::start();
    create(&agent, json!({"id": "t2"})).await;
    let mut socket = connect(&agent, "t2").await;
    send(&mut socket, "echo bye-$((1+2)); exit 3\n").await;
    read_until(&mut socket, "bye-3").await;
    let (close, _) = read_to_close(&mut socket).await;
    assert_eq!(close.code, CloseCode::Error);
    let reason: Value = serde_json::from_str(close.reason.as_str()).unwrap();
    assert_eq!(
        reason,
        json!({"exitCode": 3, "exitReason": "non-zero exit"})
    );
    assert_eq!(agent.get("/process/pty/t2").await.status, 404);

    create(&agent, json!({"id": "t3"})).await;
    let mut socket = connect(&agent, "t3").await;
    send(&mut socket, "exit\n").await;
    let (close, _) = read_to_close(&mut socket).await;
    assert_eq!(close.code, CloseCode::Normal);
    assert_eq!(close.reason.as_str(), r#"{"exitCode":0}"#);
}

#[tokio::test]
async fn lazy_session_starts_on_first_connect() {
    let agent = Agent::start();
    create(&agent, json!({"id": "lazy", "lazyStart": true})).await;
    let info = agent.get("/process/pty/lazy").await.json();
    assert_eq!(info["active"], false);
    assert_eq!(info["lazyStart"], true);
    // Resizing before the start sets the size the terminal starts with.
    let resized = agent
        .post_json("/process/pty/lazy/resize", json!({"cols": 90, "rows": 20}))
        .await;
    assert_eq!(resized.status, 200);
    let mut socket = connect(&agent, "lazy").await;
    assert_eq!(agent.get("/process/pty/lazy").await.json()["active"], true);
    send(&mut socket, "echo size=$(stty size)=\n").await;
    read_until(&mut socket, "size=20 90=").await;
}

#[tokio::test]
async fn several_clients_share_one_terminal() {
    let agent = Agent::start();
    create(&agent, json!({"id": "shared"})).await;
    let mut first = connect(&agent, "shared").await;
    let mut second = connect(&agent, "shared").await;
    send(&mut first, "echo from-$((10+1))\n").await;
    read_until(&mut first, "from-11").await;
    read_until(&mut second, "from-11").await;
    // Input from either client reaches the one shell.
    send(&mut second, "echo from-$((20+2))\n").await;
    read_until(&mut first, "from-22").await;
    drop(second);
    send(&mut first, "echo still-$((3*3))\n").await;
    read_until(&mut first, "still-9").await;
    let listed = agent.get("/process/pty").await.json();
    assert_eq!(listed["sessions"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn kill_ends_the_shell_and_its_background_jobs() {
    let agent = Agent::start();
    create(&agent, json!({"id": "doomed"})).await;
    let mut socket = connect(&agent, "doomed").await;
    send(&mut socket, "sleep 1000 & echo job=$!=\n").await;
    // The echoed command line has `job=$!=`; the answer has digits there.
    let mut output = String::new();
    let pid = loop {
        output.push_str(&read_until(&mut socket, "=").await);
        let found = output.split("job=").skip(1).find_map(|rest| {
            let digits = rest.split('=').next()?;
            digits.parse::<i32>().ok()
        });
        if let Some(pid) = found {
            break pid;
        }
    };
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());

    let killed = agent.delete("/process/pty/doomed").await;
    assert_eq!(killed.status, 200, "{:?}", killed.body);
    let (close, _) = read_to_close(&mut socket).await;
    let reason: Value = serde_json::from_str(close.reason.as_str()).unwrap();
    assert_eq!(reason["exitCode"], 137);
    assert_eq!(reason["exitReason"], "SIGKILL");
    assert_eq!(agent.get("/process/pty/doomed").await.status, 404);
    let deadline = Instant::now() + Duration::from_secs(5);
    while is_alive(pid) {
        assert!(Instant::now() < deadline, "background job {pid} survived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(agent.delete("/process/pty/doomed").await.status, 404);
}

#[tokio::test]
async fn bad_requests_are_refused() {
    let agent = Agent::start();
    create(&agent, json!({"id": "dup"})).await;
    let again = agent.post_json("/process/pty", json!({"id": "dup"})).await;
    assert_eq!(again.status, 409);
    let no_id = agent.post_json("/process/pty", json!({})).await;
    assert_eq!(no_id.status, 400);
    let bad_cwd = agent
        .post_json(
            "/process/pty",
            json!({"id": "x", "cwd": "/nonexistent/dir"}),
        )
        .await;
    assert_eq!(bad_cwd.status, 400);
    assert!(bad_cwd.json()["message"]
        .as_str()
        .unwrap()
        .contains("/nonexistent/dir"));
    assert_eq!(agent.get("/process/pty/missing").await.status, 404);
    let plain = agent.get("/process/pty/dup/connect").await;
    assert_eq!(plain.status, 400);
}

/// Alive and not a zombie waiting for its reaper.
fn is_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z')
        })
        .unwrap_or(false)
}
