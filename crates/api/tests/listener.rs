//! The listener against hostile clients, on loopback: clients that never
//! finish their headers or their TLS handshake are closed, the connection cap
//! holds, and honest requests and upgraded connections still work.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, Response, StatusCode};
use axum::routing::get;
use axum::Router;
use cove_api::listener::{self, ListenerLimits, TlsAcceptor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const HEADER_TIMEOUT: Duration = Duration::from_secs(2);
/// Generous: the tests show that connections are closed, not how fast.
const SLACK: Duration = Duration::from_secs(15);
const ATTACKERS: usize = 20;

fn limits(max_connections: usize) -> ListenerLimits {
    ListenerLimits {
        header_read_timeout: HEADER_TIMEOUT,
        tls_handshake_timeout: HEADER_TIMEOUT,
        max_connections,
    }
}

/// `/ping`, and `/echo`, which upgrades to a byte echo.
fn app() -> Router {
    Router::new()
        .route("/ping", get(|| async { "pong" }))
        .route("/echo", get(echo))
}

async fn echo(mut request: Request<Body>) -> Response<Body> {
    let upgrade = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        let Ok(upgraded) = upgrade.await else { return };
        let mut io = hyper_util::rt::TokioIo::new(upgraded);
        let mut buf = [0u8; 64];
        while let Ok(n) = io.read(&mut buf).await {
            if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, "echo")
        .body(Body::empty())
        .unwrap()
}

async fn start(tls: Option<TlsAcceptor>, limits: ListenerLimits) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(listener::serve(listener, tls, app(), limits));
    addr
}

/// Reads until the server closes the connection; panics if it stays open
/// past `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) {
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => continue,
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the server kept the connection open");
}

async fn get_ping(addr: std::net::SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /ping HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(SLACK, stream.read_to_string(&mut answer))
        .await
        .expect("an honest request is answered")
        .unwrap();
    answer
}

#[tokio::test]
async fn clients_that_never_finish_their_headers_are_closed() {
    let addr = start(None, limits(64)).await;
    let mut attackers = Vec::new();
    for _ in 0..ATTACKERS {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET /pi").await.unwrap();
        attackers.push(stream);
    }
    // An honest request is served meanwhile.
    assert!(get_ping(addr).await.ends_with("pong"));
    for stream in &mut attackers {
        closed_within(stream, HEADER_TIMEOUT + SLACK).await;
    }
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed() {
    let addr = start(None, limits(64)).await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = stream.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    closed_within(&mut stream, HEADER_TIMEOUT + SLACK).await;
}

#[tokio::test]
async fn an_upgraded_connection_outlives_the_header_timeout() {
    let addr = start(None, limits(64)).await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: upgrade\r\nUpgrade: echo\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = stream.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 101"));
    tokio::time::sleep(HEADER_TIMEOUT * 2).await;
    stream.write_all(b"still here").await.unwrap();
    let n = tokio::time::timeout(SLACK, stream.read(&mut buf))
        .await
        .expect("the upgraded connection answers")
        .unwrap();
    assert_eq!(&buf[..n], b"still here");
}

#[tokio::test]
async fn over_the_cap_a_client_waits_for_a_slot() {
    let addr = start(None, limits(2)).await;
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    // Both slots are held until the header timeout frees them; then the
    // honest client, waiting in the backlog, is served.
    assert!(get_ping(addr).await.ends_with("pong"));
    for stream in &mut silent {
        closed_within(stream, SLACK).await;
    }
}

/// A TLS configuration with no certificate: the clients here never get as
/// far as needing one.
fn tls_without_certificate() -> TlsAcceptor {
    #[derive(Debug)]
    struct NoCertificate;
    impl rustls::server::ResolvesServerCert for NoCertificate {
        fn resolve(
            &self,
            _: rustls::server::ClientHello<'_>,
        ) -> Option<Arc<rustls::sign::CertifiedKey>> {
            None
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(NoCertificate));
    TlsAcceptor::from(Arc::new(config))
}

#[tokio::test]
async fn tls_clients_that_never_send_a_client_hello_are_closed() {
    let addr = start(Some(tls_without_certificate()), limits(64)).await;
    let mut attackers = Vec::new();
    for _ in 0..ATTACKERS {
        attackers.push(TcpStream::connect(addr).await.unwrap());
    }
    for stream in &mut attackers {
        closed_within(stream, HEADER_TIMEOUT + SLACK).await;
    }
}
