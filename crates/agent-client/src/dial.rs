//! How a byte stream to an agent is made.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use cove_protocol::SandboxId;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::UnixStream;

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Opens a new connection to an agent. `authority` is the host of the
/// request's URI: what tells agents apart when one pool serves many.
pub trait Dial: Clone + Send + Sync + 'static {
    type Io: AsyncRead + AsyncWrite + Send + Unpin + 'static;
    type Error: std::error::Error + Send + Sync + 'static;

    fn dial(&self, authority: &str) -> BoxFuture<Result<Self::Io, Self::Error>>;
}

/// The agent listening on one Unix socket (whatever the authority).
#[derive(Clone, Debug)]
pub struct UnixSocket(pub PathBuf);

impl Dial for UnixSocket {
    type Io = UnixStream;
    type Error = io::Error;

    fn dial(&self, _: &str) -> BoxFuture<io::Result<UnixStream>> {
        let socket = self.0.clone();
        Box::pin(async move { UnixStream::connect(socket).await })
    }
}

/// The agents of many sandboxes, by id: the authority is the sandbox id.
/// Where each listens is set before each request (a restarted sandbox's
/// agent has a new socket).
#[derive(Clone, Debug, Default)]
pub struct Sockets(Arc<Mutex<HashMap<String, PathBuf>>>);

impl Sockets {
    pub fn set(&self, id: &SandboxId, socket: PathBuf) {
        self.0.lock().unwrap().insert(id.to_string(), socket);
    }

    pub fn get(&self, id: &str) -> Option<PathBuf> {
        self.0.lock().unwrap().get(id).cloned()
    }
}

impl Dial for Sockets {
    type Io = UnixStream;
    type Error = io::Error;

    fn dial(&self, id: &str) -> BoxFuture<io::Result<UnixStream>> {
        let socket = self.get(id);
        let id = id.to_owned();
        Box::pin(async move {
            let socket = socket.ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, format!("no agent known for {id}"))
            })?;
            UnixStream::connect(socket).await
        })
    }
}
