//! The host's end of a VM's agent channel.
//!
//! QEMU exposes the guest's virtio-serial port as a Unix socket (the
//! chardev); the runtime connects to it, shakes hands with the agent, and
//! runs yamux on it as the client. The server's toolbox proxy speaks HTTP to
//! a Unix socket per sandbox ([`Bridge`]'s listener): every connection
//! accepted there becomes one yamux stream to the agent, copied both ways.
//! Nothing here speaks HTTP: the runtime's own calls go through
//! `cove-agent-client` over [`Session::open`]'s streams.
//!
//! The handshake (its lines, parsers and constants are
//! `cove_protocol::handshake`; the agent's `vm::session` has the other half
//! and explains why it looks like this): the host sends [`FILLER_BYTES`]
//! bytes of 0xff and `COVE-HOST-HELLO <nonce> t=<unix ns>\n`, repeats the
//! hello line (with the time of each send: the agent sets its clock from it)
//! until the agent answers `COVE-GUEST-HELLO <nonce>\n`, and reads past
//! anything before that answer: a VM restored from saved memory may still
//! send bytes of its previous host's session. The filler makes a stale yamux
//! session in the guest fail at once: it is no valid frame header, and longer
//! than the partial frame the host may have left, since frames to the guest
//! are split at [`SPLIT_SEND_SIZE`].

// `fuzz/fuzz_targets/agent_frames.rs` compiles this file on its own (`#[path]`,
// sparing the fuzz build this crate's dependencies): it must use nothing else
// of the crate but cove-protocol, and what the target drives is `pub(crate)`.
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use cove_protocol::handshake::{
    after_answer, guest_answer, host_hello, FILLER, FILLER_BYTES, SPLIT_SEND_SIZE,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt, TokioAsyncReadCompatExt};

/// How often the hello is repeated until the agent answers: often while a
/// restored guest is expected to answer within milliseconds, then less.
const HELLO_REPEAT_FAST: Duration = Duration::from_millis(5);
const HELLO_REPEAT_SLOW: Duration = Duration::from_millis(250);
const FAST_REPEATS: u32 = 100;

/// The most of an answer to the runtime's own calls that is read (its
/// body; heads are bounded by the client): they answer small JSON, and the
/// guest is not trusted to stop.
pub(super) const ANSWER_LIMIT: usize = 1 << 20;

/// One yamux stream to the agent.
pub(super) type AgentStream = Compat<yamux::Stream>;

type OpenRequest = oneshot::Sender<Result<yamux::Stream, yamux::ConnectionError>>;

/// A live yamux session with the agent of one QEMU process.
#[derive(Debug, Clone)]
pub(super) struct Session {
    open: mpsc::Sender<OpenRequest>,
}

impl Session {
    /// Connects to QEMU's chardev socket and shakes hands with the agent,
    /// waiting for it at most `timeout` (a booting guest needs seconds). The
    /// returned task drives the session and ends with it.
    pub(super) async fn connect(
        chardev: &Path,
        timeout: Duration,
    ) -> io::Result<(Session, tokio::task::JoinHandle<()>)> {
        let socket = UnixStream::connect(chardev).await?;
        let nonce = nonce()?;
        let (rest, socket) = tokio::time::timeout(timeout, handshake(socket, &nonce))
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the agent did not answer within {timeout:?}"),
                )
            })??;
        let io = Prefixed {
            prefix: rest,
            offset: 0,
            inner: socket,
        };
        let mut config = yamux::Config::default();
        config.set_split_send_size(SPLIT_SEND_SIZE);
        let connection = yamux::Connection::new(io.compat(), config, yamux::Mode::Client);
        let (open, requests) = mpsc::channel(64);
        let driver = tokio::spawn(drive(connection, requests));
        Ok((Session { open }, driver))
    }

    /// Opens a new stream to the agent (one HTTP connection).
    pub(super) async fn open(&self) -> io::Result<AgentStream> {
        let closed = || io::Error::new(io::ErrorKind::NotConnected, "the agent session ended");
        let (reply, answer) = oneshot::channel();
        self.open.send(reply).await.map_err(|_| closed())?;
        match answer.await {
            Ok(Ok(stream)) => Ok(stream.compat()),
            Ok(Err(error)) => Err(io::Error::other(error)),
            Err(_) => Err(closed()),
        }
    }
}

fn nonce() -> io::Result<String> {
    random_hex(16)
}

/// `bytes` random bytes from the kernel, as hex digits.
pub(super) fn random_hex(bytes: usize) -> io::Result<String> {
    use std::io::Read as _;
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Sends the filler and the hello, repeating the hello until the answer;
/// returns what followed the answer.
pub(crate) async fn handshake(
    mut socket: UnixStream,
    nonce: &str,
) -> io::Result<(Vec<u8>, UnixStream)> {
    let mut first = vec![FILLER; FILLER_BYTES];
    first.extend_from_slice(hello(nonce).as_bytes());
    socket.write_all(&first).await?;
    let wanted = guest_answer(nonce).into_bytes();
    let mut seen = Vec::with_capacity(256);
    let mut chunk = [0u8; 4096];
    let mut repeats = 0u32;
    loop {
        let pause = if repeats < FAST_REPEATS {
            HELLO_REPEAT_FAST
        } else {
            HELLO_REPEAT_SLOW
        };
        tokio::select! {
            read = socket.read(&mut chunk) => {
                let n = read?;
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the agent channel closed during the handshake",
                    ));
                }
                seen.extend_from_slice(&chunk[..n]);
                if let Some(rest) = after_answer(&mut seen, &wanted) {
                    return Ok((rest, socket));
                }
            }
            _ = tokio::time::sleep(pause) => {
                socket.write_all(hello(nonce).as_bytes()).await?;
                repeats += 1;
            }
        }
    }
}

/// A hello line, with the host's clock for a restored guest, whose clock
/// stopped when its memory was saved.
fn hello(nonce: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    host_hello(nonce, now)
}

/// Drives the yamux connection: opens the streams asked for and keeps the
/// I/O going; the agent never opens streams itself.
async fn drive(
    mut connection: yamux::Connection<Compat<Prefixed<UnixStream>>>,
    mut requests: mpsc::Receiver<OpenRequest>,
) {
    let mut waiting: Option<OpenRequest> = None;
    let outcome = std::future::poll_fn(|cx| loop {
        if waiting.is_none() {
            if let Poll::Ready(Some(request)) = requests.poll_recv(cx) {
                waiting = Some(request);
            }
        }
        let mut progressed = false;
        if waiting.is_some() {
            if let Poll::Ready(result) = connection.poll_new_outbound(cx) {
                if let Some(request) = waiting.take() {
                    let _ = request.send(result);
                }
                progressed = true;
            }
        }
        match connection.poll_next_inbound(cx) {
            Poll::Ready(None) => return Poll::Ready(Ok(())),
            Poll::Ready(Some(Err(error))) => return Poll::Ready(Err(error)),
            Poll::Ready(Some(Ok(unexpected))) => drop(unexpected),
            Poll::Pending if !progressed => return Poll::Pending,
            Poll::Pending => {}
        }
    })
    .await;
    match outcome {
        Ok(()) | Err(yamux::ConnectionError::Closed) => tracing::debug!("agent session closed"),
        Err(error) => tracing::debug!(%error, "agent session failed"),
    }
}

/// Serves the sandbox's agent socket: every accepted connection becomes a
/// stream of the session. Dropping it stops accepting, ends every
/// connection it carries and removes the socket file.
#[derive(Debug)]
pub(super) struct Bridge {
    socket: PathBuf,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Bridge {
    fn drop(&mut self) {
        // Aborting the accept task drops its JoinSet, which aborts every copy.
        self.accept.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Bridge {
    /// Binds `socket` (replacing a stale file) and serves it over `session`.
    pub(super) fn serve(socket: &Path, session: Session) -> io::Result<Bridge> {
        match std::fs::remove_file(socket) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => return Err(error),
            _ => {}
        }
        let listener = UnixListener::bind(socket)?;
        let accept = tokio::spawn(accept_loop(listener, session));
        Ok(Bridge {
            socket: socket.to_owned(),
            accept,
        })
    }
}

async fn accept_loop(listener: UnixListener, session: Session) {
    let mut copies = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((mut client, _)) = accepted else { continue };
                let session = session.clone();
                copies.spawn(async move {
                    let Ok(mut agent) = session.open().await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut agent).await;
                });
            }
            Some(_) = copies.join_next(), if !copies.is_empty() => {}
        }
    }
}

/// A stream that first yields bytes already read from it.
pub(crate) struct Prefixed<T> {
    pub(crate) prefix: Vec<u8>,
    pub(crate) offset: usize,
    pub(crate) inner: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.offset < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.offset);
            let start = self.offset;
            buf.put_slice(&self.prefix[start..start + n]);
            self.offset += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use cove_agent_client::{AgentClient, AgentError, BoxFuture, Dial};
    use cove_protocol::handshake::HOST_HELLO;
    use cove_protocol::IdentityRequest;

    use super::*;

    /// A guest whose every stream answers `head` and then bytes that never
    /// stop, as the runtime's client sees it.
    #[derive(Clone)]
    struct Endless(&'static [u8]);

    impl Dial for Endless {
        type Io = tokio::io::DuplexStream;
        type Error = io::Error;

        fn dial(&self, _: &str) -> BoxFuture<io::Result<tokio::io::DuplexStream>> {
            let head = self.0;
            Box::pin(async move {
                let (host, mut guest) = tokio::io::duplex(64 << 10);
                tokio::spawn(async move {
                    // Answer once asked: hyper refuses an unasked answer.
                    let mut request = [0u8; 4096];
                    let _ = guest.read(&mut request).await;
                    let chunk = vec![b'x'; 64 << 10];
                    let mut written = guest.write_all(head).await;
                    while written.is_ok() {
                        written = guest.write_all(&chunk).await;
                    }
                });
                Ok(host)
            })
        }
    }

    #[tokio::test]
    async fn an_endless_answer_is_cut_at_the_limit() {
        let agent = AgentClient::new("vm-1", Endless(b"HTTP/1.1 200 OK\r\n\r\n"), ANSWER_LIMIT);
        let error = agent
            .identity(&IdentityRequest::default())
            .await
            .unwrap_err();
        assert!(
            matches!(error, AgentError::TooLarge { limit, .. } if limit == ANSWER_LIMIT),
            "{error:?}"
        );
        assert!(error.to_string().contains("more than"), "{error}");
    }

    #[tokio::test]
    async fn an_endless_header_is_cut_at_the_limit() {
        let agent = AgentClient::new(
            "vm-2",
            Endless(b"HTTP/1.1 200 OK\r\nX-Endless: "),
            ANSWER_LIMIT,
        );
        let error = agent.sync().await.unwrap_err();
        assert!(matches!(error, AgentError::Unanswered { .. }), "{error:?}");
    }

    /// A fake agent: answers the hello, then serves yamux streams that echo
    /// an HTTP response.
    async fn fake_agent(listener: UnixListener) {
        let (mut socket, _) = listener.accept().await.unwrap();
        // Answer late, as a booting guest does: the host repeats its hello.
        tokio::time::sleep(Duration::from_millis(70)).await;
        let mut seen = Vec::new();
        let mut buf = vec![0u8; 65536];
        let prefix = HOST_HELLO;
        let (nonce, end) = loop {
            let n = socket.read(&mut buf).await.unwrap();
            seen.extend_from_slice(&buf[..n]);
            let Some(at) = seen.windows(prefix.len()).position(|w| w == prefix) else {
                continue;
            };
            let line = &seen[at + prefix.len()..];
            if let Some(newline) = line.iter().position(|b| *b == b'\n') {
                let text = String::from_utf8(line[..newline].to_vec()).unwrap();
                let (nonce, time) = text.split_once(" t=").unwrap();
                assert!(time.parse::<u128>().unwrap() > 0);
                break (nonce.to_owned(), at + prefix.len() + newline + 1);
            }
        };
        assert!(seen[..FILLER_BYTES].iter().all(|b| *b == 0xff));
        socket
            .write_all(format!("noiseCOVE-GUEST-HELLO {nonce}\n").as_bytes())
            .await
            .unwrap();
        // The repeats sent so far precede the first yamux byte: drop them.
        let line = format!("{}{nonce} t=", String::from_utf8_lossy(HOST_HELLO));
        let mut rest = String::from_utf8_lossy(&seen[end..]).into_owned();
        loop {
            if rest.starts_with(&line) {
                match rest.find('\n') {
                    Some(newline) => drop(rest.drain(..=newline)),
                    None => {
                        let n = socket.read(&mut buf).await.unwrap();
                        rest.push_str(&String::from_utf8_lossy(&buf[..n]));
                    }
                }
            } else if !rest.is_empty() && line.starts_with(rest.as_str()) {
                let n = socket.read(&mut buf).await.unwrap();
                rest.push_str(&String::from_utf8_lossy(&buf[..n]));
            } else {
                break;
            }
        }
        let io = Prefixed {
            prefix: rest.into_bytes(),
            offset: 0,
            inner: socket,
        };
        let mut connection =
            yamux::Connection::new(io.compat(), yamux::Config::default(), yamux::Mode::Server);
        while let Some(Ok(stream)) =
            std::future::poll_fn(|cx| connection.poll_next_inbound(cx)).await
        {
            tokio::spawn(async move {
                let mut stream = stream.compat();
                let mut request = Vec::new();
                let mut chunk = [0u8; 1024];
                while !request.ends_with(b"{\"x\":1}") {
                    let n = stream.read(&mut chunk).await.unwrap();
                    request.extend_from_slice(&chunk[..n]);
                }
                let body = format!("{}", request.len());
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                stream.write_all(reply.as_bytes()).await.unwrap();
                stream.shutdown().await.unwrap();
            });
        }
    }

    #[tokio::test]
    async fn requests_reach_the_agent_through_the_bridge() {
        let dir = tempfile::tempdir().unwrap();
        let chardev = dir.path().join("serial.sock");
        tokio::spawn(fake_agent(UnixListener::bind(&chardev).unwrap()));
        let (session, _driver) = Session::connect(&chardev, Duration::from_secs(10))
            .await
            .unwrap();
        let agent = super::super::running::agent(&session);
        let length: usize = agent
            .post_json("/x", &serde_json::json!({ "x": 1 }))
            .await
            .unwrap();
        assert!(length > 50, "{length}");

        let socket = dir.path().join("agent.sock");
        let bridge = Bridge::serve(&socket, session).unwrap();
        for _ in 0..3 {
            let mut client = UnixStream::connect(&socket).await.unwrap();
            client
                .write_all(b"POST /y HTTP/1.1\r\nContent-Length: 7\r\n\r\n{\"x\":1}")
                .await
                .unwrap();
            let mut reply = Vec::new();
            client.read_to_end(&mut reply).await.unwrap();
            assert!(reply.starts_with(b"HTTP/1.1 200 OK"), "{reply:?}");
        }
        drop(bridge);
        assert!(!socket.exists());
    }
}
