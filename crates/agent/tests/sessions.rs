//! `/process/session...` through a real agent: state across commands,
//! asynchronous commands, logs (JSON and followed over a WebSocket), limits.

mod common;

use std::time::Duration;

use common::Agent;
use futures_util::StreamExt as _;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;

async fn create(agent: &Agent, id: &str) {
    let reply = agent
        .post_json("/process/session", json!({"sessionId": id}))
        .await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
}

async fn exec(agent: &Agent, id: &str, command: &str) -> Value {
    let reply = agent
        .post_json(
            &format!("/process/session/{id}/exec"),
            json!({"command": command}),
        )
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    reply.json()
}

async fn exec_async(agent: &Agent, id: &str, command: &str) -> String {
    let reply = agent
        .post_json(
            &format!("/process/session/{id}/exec"),
            json!({"command": command, "runAsync": true}),
        )
        .await;
    assert_eq!(reply.status, 202, "{:?}", reply.body);
    reply.json()["cmdId"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn session_keeps_directory_and_exports_across_commands() {
    let agent = Agent::start();
    create(&agent, "s1").await;
    let first = exec(&agent, "s1", "cd /tmp && export FOO=bar").await;
    assert_eq!(first["exitCode"], 0);
    let second = exec(&agent, "s1", "pwd; echo $FOO; echo oops >&2; false").await;
    assert_eq!(second["stdout"], "/tmp\nbar\n");
    assert_eq!(second["stderr"], "oops\n");
    // stdout and stderr come through two pipes, so their interleaving in the
    // combined output is not defined; every line is there once.
    let mut lines: Vec<&str> = second["output"].as_str().unwrap().lines().collect();
    lines.sort_unstable();
    assert_eq!(lines, ["/tmp", "bar", "oops"]);
    assert_eq!(second["exitCode"], 1);
    // A syntax error is the command's failure, not the session's end.
    let broken = exec(&agent, "s1", "echo \"unclosed").await;
    assert_ne!(broken["exitCode"], 0);
    assert_eq!(exec(&agent, "s1", "echo $FOO").await["stdout"], "bar\n");

    let session = agent.get("/process/session/s1").await.json();
    assert_eq!(session["sessionId"], "s1");
    assert_eq!(session["commands"].as_array().unwrap().len(), 4);
    assert_eq!(
        session["commands"][0]["command"],
        "cd /tmp && export FOO=bar"
    );
    let list = agent.get("/process/session").await.json();
    assert_eq!(list.as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn create_twice_is_409_and_unknown_session_404() {
    let agent = Agent::start();
    create(&agent, "dup").await;
    let again = agent
        .post_json("/process/session", json!({"sessionId": "dup"}))
        .await;
    assert_eq!(again.status, 409);
    assert_eq!(agent.get("/process/session/nope").await.status, 404);
    let exec = agent
        .post_json("/process/session/nope/exec", json!({"command": "true"}))
        .await;
    assert_eq!(exec.status, 404);
}

#[tokio::test]
async fn async_command_has_no_exit_code_until_it_ends() {
    let agent = Agent::start();
    create(&agent, "s").await;
    let id = exec_async(&agent, "s", "echo begin; sleep 1; echo end >&2; exit 7").await;
    let uri = format!("/process/session/s/command/{id}");
    let running = agent.get(&uri).await.json();
    assert_eq!(running["id"], id.as_str());
    assert_eq!(running["exitCode"], Value::Null);
    let mut finished = Value::Null;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        finished = agent.get(&uri).await.json();
        if !finished["exitCode"].is_null() {
            break;
        }
    }
    assert_eq!(finished["exitCode"], 7);
    let logs = agent.get(&format!("{uri}/logs")).await;
    assert_eq!(logs.headers["content-type"], "application/json");
    assert_eq!(
        logs.json(),
        json!({"output": "begin\nend\n", "stdout": "begin\n", "stderr": "end\n"})
    );
}

#[tokio::test]
async fn input_reaches_an_async_command() {
    let agent = Agent::start();
    create(&agent, "s").await;
    let id = exec_async(&agent, "s", "read line; echo got $line").await;
    let uri = format!("/process/session/s/command/{id}");
    let sent = agent
        .post_json(&format!("{uri}/input"), json!({"data": "hello\n"}))
        .await;
    assert_eq!(sent.status, 204, "{:?}", sent.body);
    for _ in 0..50 {
        if !agent.get(&uri).await.json()["exitCode"].is_null() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The input is echoed into stdout, as Daytona's daemon does.
    assert_eq!(
        agent.get(&format!("{uri}/logs")).await.json()["stdout"],
        "hello\ngot hello\n"
    );
    let late = agent
        .post_json(&format!("{uri}/input"), json!({"data": "x"}))
        .await;
    assert_eq!(late.status, 410);
}

/// The stdout a log stream carries, markers removed; panics on stderr.
fn stdout_of(stream: &[u8]) -> String {
    let text = String::from_utf8(stream.to_vec()).unwrap();
    assert!(!text.contains("\x02\x02\x02"), "stderr in {text:?}");
    text.replace("\x01\x01\x01", "")
}

async fn follow_until(
    socket: &mut tokio_tungstenite::WebSocketStream<tokio::net::UnixStream>,
    stream: &mut Vec<u8>,
    wanted: Option<&str>,
) {
    while wanted.is_none_or(|wanted| !stdout_of(stream).contains(wanted)) {
        match socket.next().await {
            Some(Ok(Message::Binary(data))) => stream.extend_from_slice(&data),
            Some(Ok(Message::Close(_))) | None => return,
            Some(Ok(_)) => {}
            Some(Err(e)) => panic!("{e}"),
        }
    }
}

#[tokio::test]
async fn input_is_echoed_between_prompt_and_reply_with_its_newline_added() {
    let agent = Agent::start();
    create(&agent, "s").await;
    let id = exec_async(
        &agent,
        "s",
        r#"echo "Name?"; read name; echo "Hello $name""#,
    )
    .await;
    let uri = format!("/process/session/s/command/{id}");
    let mut socket = agent.websocket(&format!("{uri}/logs?follow=true")).await;
    let mut stream = Vec::new();
    follow_until(&mut socket, &mut stream, Some("Name?\n")).await;
    // No newline: the agent adds it, or `read` would wait for ever.
    let sent = agent
        .post_json(&format!("{uri}/input"), json!({"data": "Alice"}))
        .await;
    assert_eq!(sent.status, 204, "{:?}", sent.body);
    follow_until(&mut socket, &mut stream, None).await;
    assert_eq!(stdout_of(&stream), "Name?\nAlice\nHello Alice\n");
    let logs = agent.get(&format!("{uri}/logs")).await.json();
    assert_eq!(logs["stdout"], "Name?\nAlice\nHello Alice\n");
    assert_eq!(logs["output"], "Name?\nAlice\nHello Alice\n");
}

#[tokio::test]
async fn suppressed_input_is_not_echoed() {
    let agent = Agent::start();
    create(&agent, "s").await;
    let reply = agent
        .post_json(
            "/process/session/s/exec",
            json!({"command": "read secret; echo got ${#secret}", "runAsync": true, "suppressInputEcho": true}),
        )
        .await;
    let id = reply.json()["cmdId"].as_str().unwrap().to_owned();
    let uri = format!("/process/session/s/command/{id}");
    agent
        .post_json(&format!("{uri}/input"), json!({"data": "hunter2\n"}))
        .await;
    for _ in 0..100 {
        if !agent.get(&uri).await.json()["exitCode"].is_null() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        agent.get(&format!("{uri}/logs")).await.json()["stdout"],
        "got 7\n"
    );
}

#[tokio::test]
async fn follow_streams_marked_chunks_and_closes_with_1000() {
    let agent = Agent::start();
    create(&agent, "s").await;
    let id = exec_async(
        &agent,
        "s",
        "echo one; sleep 0.3; echo two >&2; sleep 0.3; echo three",
    )
    .await;
    let mut socket = agent
        .websocket(&format!("/process/session/s/command/{id}/logs?follow=true"))
        .await;
    let mut stream = Vec::new();
    let close = loop {
        match socket
            .next()
            .await
            .expect("socket ended without a close frame")
            .unwrap()
        {
            Message::Binary(data) => stream.extend_from_slice(&data),
            Message::Text(text) => stream.extend_from_slice(text.as_bytes()),
            Message::Close(frame) => break frame,
            _ => {}
        }
    };
    assert_eq!(close.map(|f| f.code), Some(CloseCode::Normal));
    assert_eq!(
        String::from_utf8(stream).unwrap(),
        "\x01\x01\x01one\n\x02\x02\x02two\n\x01\x01\x01three\n"
    );
}

#[tokio::test]
async fn delete_kills_the_shell_and_its_children() {
    let agent = Agent::start();
    create(&agent, "s").await;
    let marker = agent.path("survived");
    exec_async(&agent, "s", &format!("sleep 1; touch {}", marker.display())).await;
    assert_eq!(agent.delete("/process/session/s").await.status, 204);
    assert_eq!(agent.get("/process/session/s").await.status, 404);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !marker.exists(),
        "a child of the deleted session kept running"
    );
}

#[tokio::test]
async fn session_limit_is_429_naming_it() {
    let agent = Agent::start_with(&[("COVE_AGENT_MAX_SESSIONS", "2")]);
    create(&agent, "a").await;
    create(&agent, "b").await;
    let third = agent
        .post_json("/process/session", json!({"sessionId": "c"}))
        .await;
    assert_eq!(third.status, 429);
    assert!(third.json()["message"]
        .as_str()
        .unwrap()
        .contains("2 sessions"));
    agent.delete("/process/session/a").await;
    create(&agent, "c").await;
}

#[tokio::test]
async fn default_session_limit_is_8() {
    let agent = Agent::start();
    for i in 0..8 {
        create(&agent, &format!("s{i}")).await;
    }
    let ninth = agent
        .post_json("/process/session", json!({"sessionId": "s8"}))
        .await;
    assert_eq!(ninth.status, 429);
}

#[tokio::test]
async fn async_command_limit_is_429_until_one_ends() {
    let agent = Agent::start_with(&[("COVE_AGENT_MAX_ASYNC_COMMANDS", "2")]);
    for id in ["a", "b", "c"] {
        create(&agent, id).await;
    }
    let first = exec_async(&agent, "a", "sleep 0.5").await;
    exec_async(&agent, "b", "sleep 30").await;
    let refused = agent
        .post_json(
            "/process/session/c/exec",
            json!({"command": "true", "runAsync": true}),
        )
        .await;
    assert_eq!(refused.status, 429);
    assert!(refused.json()["message"]
        .as_str()
        .unwrap()
        .contains("asynchronous commands"));
    for _ in 0..50 {
        let command = agent
            .get(&format!("/process/session/a/command/{first}"))
            .await
            .json();
        if !command["exitCode"].is_null() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    exec_async(&agent, "c", "true").await;
}
