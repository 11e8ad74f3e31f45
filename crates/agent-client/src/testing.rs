//! Fake agents for tests, of this crate and of its users. Compiled in
//! always (a feature would rebuild every user for its tests); nothing in a
//! server calls it.

use std::path::PathBuf;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixListener;

/// An agent on a Unix socket that answers every connection with `head` and
/// then bytes that never stop: an endless body after a whole head, an
/// endless header after a partial one. The socket lives as long as the
/// directory returned; it needs a Tokio runtime.
pub fn hostile_agent(head: &'static [u8]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("agent.sock");
    let listener = UnixListener::bind(&socket).expect("a socket in a fresh directory");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                let _ = stream.read(&mut request).await;
                let chunk = vec![b'x'; 64 << 10];
                let mut written = stream.write_all(head).await;
                while written.is_ok() {
                    written = stream.write_all(&chunk).await;
                }
            });
        }
    });
    (dir, socket)
}
