//! `GET /cove/tunnel/{port}`: the raw TCP tunnel the server reaches sandbox
//! ports through, spoken byte for byte as a client of the contract would.

mod common;

use common::Agent;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixStream};

/// Sends the tunnel request and returns the stream and the response head.
async fn ask(agent: &Agent, port: u16) -> (UnixStream, String) {
    let mut stream = UnixStream::connect(agent.socket()).await.unwrap();
    stream
        .write_all(
            format!(
                "GET /cove/tunnel/{port} HTTP/1.1\r\nHost: agent\r\n\
                 Connection: Upgrade\r\nUpgrade: cove-tcp\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        assert_eq!(stream.read(&mut byte).await.unwrap(), 1, "head cut short");
        head.push(byte[0]);
    }
    (stream, String::from_utf8(head).unwrap())
}

#[tokio::test]
async fn the_tunnel_carries_bytes_both_ways_and_passes_on_a_close() {
    let agent = Agent::start();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    // An echo server that upper-cases, then closes when its client does.
    let echo = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut data = Vec::new();
        socket.read_to_end(&mut data).await.unwrap();
        socket.write_all(&data.to_ascii_uppercase()).await.unwrap();
    });

    let (mut stream, head) = ask(&agent, port).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("upgrade: cove-tcp"),
        "{head}"
    );
    stream.write_all(b"hello through the tunnel").await.unwrap();
    stream.shutdown().await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    assert_eq!(answer, b"HELLO THROUGH THE TUNNEL");
    echo.await.unwrap();
}

#[tokio::test]
async fn a_closed_port_is_502_naming_it_and_bad_requests_400() {
    let agent = Agent::start();
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let (mut stream, head) = ask(&agent, port).await;
    assert!(head.starts_with("HTTP/1.1 502"), "{head}");
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .expect("a content length");
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains(&format!("port {port}")),
        "{body}"
    );
    // Without the upgrade headers, or with port 0, nothing is connected.
    assert_eq!(agent.get(&format!("/cove/tunnel/{port}")).await.status, 400);
    assert_eq!(agent.get("/cove/tunnel/0").await.status, 400);
}
