//! The host's end of a VM's agent channel.
//!
//! QEMU exposes the guest's virtio-serial port as a Unix socket (the
//! chardev); the runtime connects to it, shakes hands with the agent, and
//! runs yamux on it as the client. The server's toolbox proxy speaks HTTP to
//! a Unix socket per sandbox ([`Bridge`]'s listener): every connection
//! accepted there becomes one yamux stream to the agent, copied both ways.
//! Nothing here parses the HTTP, except the runtime's own calls
//! ([`Session::post`]).
//!
//! The handshake (the agent's `vm::session` has the other half and explains
//! why it looks like this): the host sends [`FILLER_BYTES`] bytes of 0xff and
//! `COVE-HOST-HELLO <nonce> t=<unix ns>\n`, repeats the hello line (with the
//! time of each send: the agent sets its clock from it) until the agent
//! answers `COVE-GUEST-HELLO <nonce>\n`, and reads past anything before that
//! answer: a VM restored from saved memory may still send bytes of its
//! previous host's session. The filler makes a stale yamux session in the
//! guest fail at once: it is no valid frame header, and longer than the
//! partial frame the host may have left, since frames to the guest are split
//! at [`SPLIT_SEND_SIZE`].

// `fuzz/fuzz_targets/agent_frames.rs` compiles this file on its own (`#[path]`,
// sparing the fuzz build this crate's dependencies): it must use nothing else
// of the crate, and what the target drives is `pub(crate)`.
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt, TokioAsyncReadCompatExt};

const HOST_HELLO: &str = "COVE-HOST-HELLO ";
const GUEST_HELLO: &[u8] = b"COVE-GUEST-HELLO ";
/// Largest data frame the host sends (yamux's default, set explicitly
/// because the filler's length depends on it).
const SPLIT_SEND_SIZE: usize = 16 << 10;
/// Longer than a frame header and the largest frame body together.
const FILLER_BYTES: usize = SPLIT_SEND_SIZE + 4096;
/// How often the hello is repeated until the agent answers: often while a
/// restored guest is expected to answer within milliseconds, then less.
const HELLO_REPEAT_FAST: Duration = Duration::from_millis(5);
const HELLO_REPEAT_SLOW: Duration = Duration::from_millis(250);
const FAST_REPEATS: u32 = 100;

/// The most of an answer to [`Session::post`] that is read (head and body):
/// the runtime's own calls answer small JSON, and the guest is not trusted
/// to stop.
pub const ANSWER_LIMIT: u64 = 1 << 20;

/// One yamux stream to the agent.
pub type AgentStream = Compat<yamux::Stream>;

type OpenRequest = oneshot::Sender<Result<yamux::Stream, yamux::ConnectionError>>;

/// A live yamux session with the agent of one QEMU process.
#[derive(Debug, Clone)]
pub struct Session {
    open: mpsc::Sender<OpenRequest>,
}

impl Session {
    /// Connects to QEMU's chardev socket and shakes hands with the agent,
    /// waiting for it at most `timeout` (a booting guest needs seconds). The
    /// returned task drives the session and ends with it.
    pub async fn connect(
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
    pub async fn open(&self) -> io::Result<AgentStream> {
        let closed = || io::Error::new(io::ErrorKind::NotConnected, "the agent session ended");
        let (reply, answer) = oneshot::channel();
        self.open.send(reply).await.map_err(|_| closed())?;
        match answer.await {
            Ok(Ok(stream)) => Ok(stream.compat()),
            Ok(Err(error)) => Err(io::Error::other(error)),
            Err(_) => Err(closed()),
        }
    }

    /// One HTTP/1.1 POST of a JSON body to the agent; answers the status and
    /// body, or an error once the answer passes [`ANSWER_LIMIT`].
    pub async fn post(&self, path: &str, body: &str) -> io::Result<(u16, String)> {
        post_on(self.open().await?, path, body).await
    }
}

/// [`Session::post`] on one stream.
pub(crate) async fn post_on<S>(mut stream: S, path: &str, body: &str) -> io::Result<(u16, String)>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await?;
    stream.flush().await?;
    let mut response = Vec::new();
    (&mut stream)
        .take(ANSWER_LIMIT + 1)
        .read_to_end(&mut response)
        .await?;
    if response.len() as u64 > ANSWER_LIMIT {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the agent's answer to POST {path} is longer than {ANSWER_LIMIT} bytes; cove reads no more"
            ),
        ));
    }
    parse_response(&response)
}

/// The status and body of a complete `Connection: close` response.
pub(crate) fn parse_response(response: &[u8]) -> io::Result<(u16, String)> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    let head_end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("the agent's response has no header end"))?;
    let head = String::from_utf8_lossy(&response[..head_end]);
    let body = &response[head_end + 4..];
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("the agent's response has no status"))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The data of a chunked body. Chunk sizes count bytes, so this reads bytes:
/// cut as text, a chunk ending inside a character would panic.
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = body.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&body[..line_end])
            .ok()
            .and_then(|size| usize::from_str_radix(size.trim(), 16).ok());
        let rest = &body[line_end + 2..];
        let Some(size) = size.filter(|&size| size > 0 && size <= rest.len()) else {
            break;
        };
        out.extend_from_slice(&rest[..size]);
        body = &rest[size..];
        while let Some(after) = body.strip_prefix(b"\r\n") {
            body = after;
        }
    }
    out
}

fn nonce() -> io::Result<String> {
    random_hex(16)
}

/// `bytes` random bytes from the kernel, as hex digits.
pub fn random_hex(bytes: usize) -> io::Result<String> {
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
    let mut first = vec![0xffu8; FILLER_BYTES];
    first.extend_from_slice(hello(nonce).as_bytes());
    socket.write_all(&first).await?;
    let mut wanted = GUEST_HELLO.to_vec();
    wanted.extend_from_slice(nonce.as_bytes());
    wanted.push(b'\n');
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
    format!("{HOST_HELLO}{nonce} t={now}\n")
}

/// What follows `wanted` in `seen`, once it is there; otherwise trims `seen`
/// to what could still be the start of it.
fn after_answer(seen: &mut Vec<u8>, wanted: &[u8]) -> Option<Vec<u8>> {
    if let Some(at) = seen.windows(wanted.len()).position(|w| w == wanted) {
        return Some(seen[at + wanted.len()..].to_vec());
    }
    if seen.len() > wanted.len() {
        seen.drain(..seen.len() - wanted.len());
    }
    None
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
pub struct Bridge {
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
    pub fn serve(socket: &Path, session: Session) -> io::Result<Bridge> {
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
    use super::*;

    #[tokio::test]
    async fn an_endless_answer_is_cut_at_the_limit() {
        let (host, mut guest) = tokio::io::duplex(64 << 10);
        tokio::spawn(async move {
            let chunk = vec![b'x'; 64 << 10];
            let mut written = guest.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await;
            while written.is_ok() {
                written = guest.write_all(&chunk).await;
            }
        });
        let error = post_on(host, "/cove/vm/identity", "{}").await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
        assert!(error.to_string().contains("longer than"), "{error}");
    }

    #[tokio::test]
    async fn an_endless_header_is_cut_at_the_limit() {
        let (host, mut guest) = tokio::io::duplex(64 << 10);
        tokio::spawn(async move {
            let chunk = vec![b'x'; 64 << 10];
            let mut written = guest.write_all(b"HTTP/1.1 200 OK\r\nX-Endless: ").await;
            while written.is_ok() {
                written = guest.write_all(&chunk).await;
            }
        });
        let error = post_on(host, "/cove/vm/sync", "{}").await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn responses_parse_plain_and_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(plain).unwrap(), (200, "{}".to_owned()));
        let chunked =
            b"HTTP/1.1 400 Bad Request\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked).unwrap(), (400, "abcde".to_owned()));
        assert!(parse_response(b"garbage").is_err());
    }

    /// Found by the `agent_frames` fuzz target: a chunk ending inside a
    /// character was cut as text, which panicked the host's task.
    #[test]
    fn a_chunk_may_end_inside_a_character() {
        let split = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\né\r\n0\r\n\r\n";
        assert_eq!(
            parse_response(split.as_bytes()).unwrap(),
            (200, "\u{fffd}".to_owned())
        );
        let whole =
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\né\r\n1\r\n!\r\n0\r\n\r\n";
        assert_eq!(
            parse_response(whole.as_bytes()).unwrap(),
            (200, "é!".to_owned())
        );
    }

    #[test]
    fn the_answer_is_found_after_stale_bytes() {
        let wanted = b"COVE-GUEST-HELLO abc\n";
        let mut seen = b"old yamux bytesCOVE-GUEST-HELLO wrong\nCOVE-GUEST-HE".to_vec();
        assert_eq!(after_answer(&mut seen, wanted), None);
        assert!(seen.len() <= wanted.len());
        seen.extend_from_slice(b"LLO abc\nrest");
        let mut seen = [b"xx".as_slice(), &seen].concat();
        assert_eq!(after_answer(&mut seen, wanted).unwrap(), b"rest");
    }

    /// A fake agent: answers the hello, then serves yamux streams that echo
    /// an HTTP response.
    async fn fake_agent(listener: UnixListener) {
        let (mut socket, _) = listener.accept().await.unwrap();
        // Answer late, as a booting guest does: the host repeats its hello.
        tokio::time::sleep(Duration::from_millis(70)).await;
        let mut seen = Vec::new();
        let mut buf = vec![0u8; 65536];
        let prefix = HOST_HELLO.as_bytes();
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
        let line = format!("{HOST_HELLO}{nonce} t=");
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
        let (status, body) = session.post("/x", "{\"x\":1}").await.unwrap();
        assert_eq!(status, 200);
        assert!(body.parse::<usize>().unwrap() > 100, "{body}");

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
