//! Fuzz target `agent_frames`: the agent channel's handshake, fed whatever
//! the other end might send.
//!
//! Host side (`crates/runtime/src/vm/bridge.rs`, compiled from its file):
//! the input is what the guest sends during the handshake. Guest side
//! (`cove_agent::vm::session`, its parsers `cove_protocol::handshake`): the
//! input is what the host sends before its hello, then what follows the
//! hello (its repeats). Besides "no panic", each checks its promise: the
//! bytes after the guest's answer reach yamux intact, and what the guest
//! keeps after the hello is bounded. (The host's answers to its own calls
//! are read by hyper in `cove-agent-client` now, with no reader of cove's
//! own left to fuzz; its limits have unit tests there.)
//!
//! The first byte of the input is a flag byte, kept so that the corpus
//! stays valid; it is not used.

#![no_main]

#[allow(dead_code)]
#[path = "../../crates/runtime/src/vm/bridge.rs"]
mod bridge;

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;

/// The host's nonce, fixed so that inputs can carry the right answer.
const NONCE: &str = "00112233445566778899aabbccddeeff";

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime")
    })
}

fuzz_target!(|input: &[u8]| {
    let Some((&flags, data)) = input.split_first() else {
        return;
    };
    let _ = flags;
    runtime().block_on(async {
        host_handshake(data).await;
        guest_handshake(data).await;
    });
    repeats(data);
});

/// The host shakes hands with a guest that sends `data` and then closes its
/// sending side (it keeps reading, so the host's hellos never meet a closed
/// socket: SIGPIPE is not ignored in a libFuzzer process).
async fn host_handshake(data: &[u8]) {
    let (host, guest) = UnixStream::pair().expect("a socket pair");
    let (mut guest_reads, mut guest_writes) = guest.into_split();
    let sent = data.to_vec();
    let guest = tokio::spawn(async move {
        let drain = async {
            let mut sink = Vec::new();
            let _ = guest_reads.read_to_end(&mut sink).await;
        };
        let send = async {
            let _ = guest_writes.write_all(&sent).await;
            let _ = guest_writes.shutdown().await;
        };
        tokio::join!(drain, send);
    });
    let outcome = bridge::handshake(host, NONCE).await;
    let answer = format!("COVE-GUEST-HELLO {NONCE}\n");
    let found = data
        .windows(answer.len())
        .position(|w| w == answer.as_bytes());
    match (outcome, found) {
        (Ok((rest, socket)), Some(at)) => {
            // What yamux reads: the rest already read, then the socket.
            let mut io = bridge::Prefixed {
                prefix: rest,
                offset: 0,
                inner: socket,
            };
            let mut after = Vec::new();
            io.read_to_end(&mut after)
                .await
                .expect("reading past the answer");
            assert_eq!(after, &data[at + answer.len()..], "bytes after the answer");
            drop(io);
        }
        (Ok(_), None) => panic!("the handshake succeeded without the answer"),
        (Err(error), Some(_)) => panic!("the answer was sent but the handshake failed: {error}"),
        (Err(_), None) => {}
    }
    guest.await.expect("the fake guest");
}

/// The agent waits for the host's hello in `data`.
async fn guest_handshake(data: &[u8]) {
    let mut reader = data;
    if let Ok((nonce, _, rest)) = cove_agent::vm::session::await_host_hello(&mut reader).await {
        assert!(!nonce.is_empty() && nonce.bytes().all(|b| b.is_ascii_alphanumeric()));
        // What was read past the hello: at most one read's chunk beyond
        // the window kept while searching.
        assert!(
            rest.len() <= 8192,
            "kept {} bytes after the hello",
            rest.len()
        );
    }
    let _ = cove_agent::vm::session::find_hello(data);
}

/// The guest tells repeats of the hello from the first yamux bytes: a whole
/// repeat is never longer than what it was given, and nothing but a repeat
/// is dropped.
fn repeats(data: &[u8]) {
    use cove_protocol::handshake::{classify, repeat_line, Repeat};
    let line = repeat_line("n0nce");
    match classify(data, &line) {
        Repeat::Whole(length) => {
            assert!(length <= data.len());
            assert!(data.starts_with(&line) && data[length - 1] == b'\n');
        }
        Repeat::Partial => assert!(line.starts_with(data) || data.starts_with(&line)),
        Repeat::No => {}
    }
}
