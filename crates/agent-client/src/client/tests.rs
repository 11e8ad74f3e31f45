//! The client against fake agents on a Unix socket: hostile ones that never
//! stop answering (every owner's limit holds), and a plain one (calls, the
//! pool, tunnels).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{UnixListener, UnixStream};

use super::*;
use crate::UnixSocket;

use crate::testing::hostile_agent;

/// The limits cove's callers set: tunnel refusals and heads (64 KiB), the
/// VM runtime's calls (1 MiB), SSH `exec` and the builder's `RUN` (8 MiB).
const LIMITS: [usize; 3] = [64 << 10, 1 << 20, 8 << 20];

#[tokio::test]
async fn an_endless_answer_is_cut_at_each_limit() {
    let (_dir, socket) = hostile_agent(b"HTTP/1.1 200 OK\r\n\r\n");
    for limit in LIMITS {
        let agent = AgentClient::new("sbx-1", UnixSocket(socket.clone()), limit);
        let error = agent
            .execute(&ExecuteRequest::new("yes"))
            .await
            .unwrap_err();
        assert!(
            matches!(&error, AgentError::TooLarge { sandbox, limit: l, .. } if sandbox == "sbx-1" && *l == limit),
            "{error:?}"
        );
        assert!(error.to_string().contains("sandbox sbx-1"), "{error}");
        let error = agent.sync().await.unwrap_err();
        assert!(matches!(error, AgentError::TooLarge { .. }), "{error:?}");
    }
}

#[tokio::test]
async fn an_endless_chunked_answer_is_cut_at_the_limit() {
    let (_dir, socket) =
        hostile_agent(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n200000\r\n");
    let agent = AgentClient::new("sbx-c", UnixSocket(socket), 1 << 20);
    let error = agent.sync().await.unwrap_err();
    assert!(matches!(error, AgentError::TooLarge { .. }), "{error:?}");
}

#[tokio::test]
async fn an_endless_header_is_refused() {
    let (_dir, socket) = hostile_agent(b"HTTP/1.1 200 OK\r\nX-Endless: ");
    let agent = AgentClient::new("sbx-2", UnixSocket(socket), 8 << 20);
    let error = agent
        .execute(&ExecuteRequest::new("true"))
        .await
        .unwrap_err();
    assert!(matches!(error, AgentError::Unanswered { .. }), "{error:?}");
    assert!(error.to_string().contains("sandbox sbx-2"), "{error}");
}

#[tokio::test]
async fn an_endless_tunnel_refusal_is_cut_at_the_limit() {
    let (_dir, socket) = hostile_agent(b"HTTP/1.1 502 Bad Gateway\r\n\r\n");
    let agent = AgentClient::new("sbx-3", UnixSocket(socket), 64 << 10);
    let error = agent.tunnel(3000).await.unwrap_err();
    assert!(matches!(error, AgentError::TooLarge { .. }), "{error:?}");
    assert!(error.to_string().contains("more than"), "{error}");
}

#[tokio::test]
async fn bodies_are_read_up_to_the_limit_and_no_further() {
    let small = Full::new(Bytes::from(vec![b'x'; 1000]));
    assert_eq!(read_bounded(small, 1000).await.unwrap().len(), 1000);
    let large = Full::new(Bytes::from(vec![b'x'; 3 << 20]));
    let error = read_bounded(large, 2 << 20).await.unwrap_err();
    assert!(error.is::<http_body_util::LengthLimitError>(), "{error}");
}

/// An agent that answers every request on a connection (kept open) with
/// `answer` for `path`, 404 otherwise, and counts connections. `/cove/tunnel/`
/// is upgraded and then echoes.
fn plain_agent(
    path: &'static str,
    answer: &'static str,
) -> (tempfile::TempDir, PathBuf, Arc<AtomicUsize>) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(stream, path, answer));
        }
    });
    (dir, socket, connections)
}

async fn serve(mut stream: UnixStream, path: &'static str, answer: &'static str) {
    let mut pending = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") else {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => pending.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&pending[..end]).to_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map_or(0, |n| n.trim().parse().unwrap());
        while pending.len() < end + 4 + length {
            let n = stream.read(&mut chunk).await.unwrap();
            pending.extend_from_slice(&chunk[..n]);
        }
        let request_line = head.lines().next().unwrap().to_owned();
        pending.drain(..end + 4 + length);
        if request_line.starts_with("get /cove/tunnel/") {
            assert!(head.contains("upgrade: cove-tcp"), "{head}");
            stream
                .write_all(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: cove-tcp\r\n\r\n")
                .await
                .unwrap();
            let (mut reader, mut writer) = stream.split();
            let _ = tokio::io::copy(&mut reader, &mut writer).await;
            return;
        }
        let reply = if request_line.split(' ').nth(1) == Some(path) {
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                answer.len()
            )
        } else {
            "HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\n\r\nnope".to_owned()
        };
        stream.write_all(reply.as_bytes()).await.unwrap();
    }
}

#[tokio::test]
async fn calls_share_one_pooled_connection() {
    let (_dir, socket, connections) =
        plain_agent("/process/execute", r#"{"exitCode":3,"result":"out"}"#);
    let agent = AgentClient::new("sbx-4", UnixSocket(socket), 1 << 20);
    for _ in 0..3 {
        let executed = agent.execute(&ExecuteRequest::new("x")).await.unwrap();
        assert_eq!(
            executed,
            ExecuteResponse {
                exit_code: 3,
                result: "out".into(),
                timed_out: false
            }
        );
    }
    assert_eq!(connections.load(Ordering::SeqCst), 1);
    let error = agent.sync().await.unwrap_err();
    assert!(
        matches!(&error, AgentError::Refused { status, body, .. } if *status == StatusCode::NOT_FOUND && body == "nope"),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_bad_answer_is_named() {
    let (_dir, socket, _) = plain_agent("/cove/vm/identity", "not json");
    let agent = AgentClient::new("sbx-5", UnixSocket(socket), 1 << 20);
    let error = agent
        .identity(&IdentityRequest::default())
        .await
        .unwrap_err();
    assert!(matches!(error, AgentError::BadAnswer { .. }), "{error:?}");
}

#[tokio::test]
async fn a_tunnel_carries_bytes_both_ways() {
    let (_dir, socket, _) = plain_agent("/", "{}");
    let agent = AgentClient::new("sbx-6", UnixSocket(socket), 64 << 10);
    let mut tunnel = hyper_util::rt::TokioIo::new(agent.tunnel(8080).await.unwrap());
    tunnel.write_all(b"ping").await.unwrap();
    let mut echoed = [0u8; 4];
    tunnel.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, b"ping");
}

#[test]
fn reports_name_every_cause_once() {
    let inner = std::io::Error::other("disk on fire");
    let outer = AgentError::BadRequest {
        sandbox: "s".into(),
        what: "POST /x".into(),
        reason: "bad".into(),
    };
    assert_eq!(
        crate::report(&outer),
        "cannot ask the agent of sandbox s POST /x: bad"
    );
    assert_eq!(crate::report(&inner), "disk on fire");
}
