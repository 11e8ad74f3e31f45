//! The SSH gateway against hostile and revoked clients, on loopback over the
//! fake runtime: clients that never authenticate are dropped, the cap on
//! unauthenticated connections holds, and a token that is revoked or expires
//! opens no more channels (a revoked one also loses its live connection).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cove_engine::{CreateSandbox, Engine, EngineConfig, SnapshotRecord, SshAccessRecord};
use cove_lifecycle::SandboxClass;
use cove_runtime::fake::FakeRuntime;
use cove_runtime::Runtime;
use cove_ssh::{Gateway, GatewayConfig};
use cove_store::Store;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const AUTH_TIMEOUT: Duration = Duration::from_secs(2);
/// Generous: the tests show that connections are closed, not how fast.
const SLACK: Duration = Duration::from_secs(15);

struct Harness {
    engine: Engine,
    store: Store,
    gateway: Gateway,
    sandbox: String,
    _dir: tempfile::TempDir,
}

async fn harness(max_unauthenticated: usize) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let fake = Arc::new(FakeRuntime::new());
    let runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> =
        HashMap::from([(SandboxClass::Container, fake as Arc<dyn Runtime>)]);
    let engine = Engine::new(EngineConfig::default(), store.clone(), runtimes);
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
    let sandbox = engine
        .sandboxes()
        .create(CreateSandbox::default())
        .await
        .unwrap()
        .id;
    let config = GatewayConfig {
        auth_timeout: AUTH_TIMEOUT,
        max_unauthenticated,
        ..GatewayConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.path().join("ssh_host_ed25519_key"),
        )
    };
    let gateway = Gateway::start(engine.clone(), config).await.unwrap();
    Harness {
        engine,
        store,
        gateway,
        sandbox,
        _dir: dir,
    }
}

/// Reads until the gateway closes the connection; panics if it stays open
/// past `within`. Answers what was read.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> Vec<u8> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the gateway kept the connection open");
    seen
}

#[tokio::test]
async fn clients_that_never_authenticate_are_dropped() {
    let h = harness(64).await;
    let addr = h.gateway.local_addr();
    let mut attackers = Vec::new();
    for i in 0..20 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        if i % 2 == 0 {
            // Half say hello and stop there; half say nothing at all.
            tokio::io::AsyncWriteExt::write_all(&mut stream, b"SSH-2.0-slow\r\n")
                .await
                .unwrap();
        }
        attackers.push(stream);
    }
    for stream in &mut attackers {
        closed_within(stream, AUTH_TIMEOUT + SLACK).await;
    }
    // An honest client still gets in.
    let token = h
        .engine
        .access()
        .create_ssh_access(&h.sandbox, None)
        .await
        .unwrap()
        .token;
    let client = connect(addr, &token).await;
    assert!(!client.is_closed());
}

#[tokio::test]
async fn over_the_unauthenticated_cap_a_new_connection_is_closed() {
    let h = harness(2).await;
    let addr = h.gateway.local_addr();
    let mut waiting = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        // The gateway greets a client it serves.
        let mut greeting = [0u8; 8];
        stream.read_exact(&mut greeting).await.unwrap();
        assert_eq!(&greeting, b"SSH-2.0-");
        waiting.push(stream);
    }
    let mut third = TcpStream::connect(addr).await.unwrap();
    // Closed long before the authentication timeout, without a greeting.
    let seen = closed_within(&mut third, AUTH_TIMEOUT / 2).await;
    assert!(seen.is_empty(), "{}", String::from_utf8_lossy(&seen));
}

struct TrustAnyHostKey;

impl russh::client::Handler for TrustAnyHostKey {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        _key: &russh::keys::PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        Ok(true)
    }
}

/// A client authenticated with `token` (the `none` method, as `ssh TOKEN@host`).
async fn connect(addr: SocketAddr, token: &str) -> russh::client::Handle<TrustAnyHostKey> {
    let config = Arc::new(russh::client::Config::default());
    let mut handle = russh::client::connect(config, addr, TrustAnyHostKey)
        .await
        .unwrap();
    let auth = handle.authenticate_none(token).await.unwrap();
    assert!(auth.success(), "{auth:?}");
    handle
}

async fn disconnected_within(client: &russh::client::Handle<TrustAnyHostKey>, within: Duration) {
    let closed = tokio::time::timeout(within, async {
        while !client.is_closed() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(closed.is_ok(), "the gateway kept the connection open");
}

#[tokio::test]
async fn revoking_a_token_closes_its_live_connection() {
    let h = harness(64).await;
    let token = h
        .engine
        .access()
        .create_ssh_access(&h.sandbox, None)
        .await
        .unwrap()
        .token;
    let other = h
        .engine
        .access()
        .create_ssh_access(&h.sandbox, None)
        .await
        .unwrap()
        .token;
    let client = connect(h.gateway.local_addr(), &token).await;
    let bystander = connect(h.gateway.local_addr(), &other).await;
    client.channel_open_session().await.unwrap();

    h.engine
        .access()
        .revoke_ssh_access(&h.sandbox, Some(&token))
        .await
        .unwrap();
    disconnected_within(&client, SLACK).await;
    assert!(client.channel_open_session().await.is_err());
    // A connection on another token of the same sandbox stays.
    bystander.channel_open_session().await.unwrap();
    assert!(!bystander.is_closed());
}

#[tokio::test]
async fn an_expired_token_opens_no_new_channel() {
    let h = harness(64).await;
    // A token that lives three seconds.
    let token = "expiring-token";
    let now = cove_engine::now_ms();
    h.store
        .add_ssh_access(&SshAccessRecord {
            id: "expiring".into(),
            sandbox_id: h.sandbox.clone(),
            token_hash: cove_engine::hash_api_key(token),
            expires_at_ms: now + 3_000,
            created_at_ms: now,
            updated_at_ms: now,
        })
        .await
        .unwrap();
    let client = connect(h.gateway.local_addr(), token).await;
    client.channel_open_session().await.unwrap();
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert!(client.channel_open_session().await.is_err());
    disconnected_within(&client, SLACK).await;
}
