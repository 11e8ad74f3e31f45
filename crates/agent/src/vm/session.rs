//! The agent's HTTP server over its virtio-serial port, in a VM.
//!
//! A VM has one byte stream to the host, so connections are multiplexed on it
//! with yamux: the host opens one yamux stream per HTTP connection and the
//! agent serves each like an accepted socket ([`Incoming`] is an axum
//! listener). The host connects afresh to every QEMU process, and a VM
//! restored from saved memory still holds the yamux state of the old one, so
//! every session starts with a handshake:
//!
//! 1. the host sends filler bytes (0xff), then `COVE-HOST-HELLO <nonce>
//!    t=<unix ns>\n`, and repeats the hello line (with a fresh time) until it
//!    is answered; the agent sets its clock from it;
//! 2. the agent reads past anything before a hello, answers
//!    `COVE-GUEST-HELLO <nonce>\n` once, and drops the repeats that follow;
//! 3. yamux runs, the host as client, the agent as server.
//!
//! The lines, their parsers and the constants are the contract's
//! (`cove_protocol::handshake`), shared with the host's `vm::bridge`.
//!
//! A restored guest is told right after it continues that its host is gone
//! (the new QEMU's chardev has nobody connected yet), and then that it is
//! back, since the host connects at once. When both notices are handled
//! before the agent reads, the agent never sees end-of-file; in our runs
//! that is what happened on every restore. Its old yamux session reads the
//! filler instead, which is no valid frame header (yamux version 0) and
//! longer than any partial frame the host may have left (it sends at most
//! 16 KiB a frame), so that session fails and the agent starts over, finding
//! one of the repeated hellos. A host that goes away while the VM runs is
//! seen as end-of-file, and the agent starts over the same way. QEMU's
//! `VSERPORT_CHANGE` events cannot tell the host when the guest reopened the
//! port: they are rate-limited to one a second per port.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::mpsc;
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt, TokioAsyncReadCompatExt};

use super::port::{self, Port};

// The lines, their parsers and the limits are the contract's; the
// reading and the skipping are this side's.
use cove_protocol::handshake::{classify, guest_answer, repeat_line, Repeat, HELLO_WINDOW};
pub use cove_protocol::handshake::{find_hello, Hello};

/// Reads until the host's hello; returns its nonce, its time and what
/// followed it.
pub async fn await_host_hello<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> io::Result<(String, Option<u64>, Vec<u8>)> {
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 4096];
    loop {
        let n = reader.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some((hello, end)) = find_hello(&buf) {
            return Ok((hello.nonce.to_owned(), hello.unix_ns, buf[end..].to_vec()));
        }
        // Keep only what could still be the start of a hello.
        if buf.len() > HELLO_WINDOW {
            buf.drain(..buf.len() - HELLO_WINDOW);
        }
    }
}

/// The port after the handshake: first the bytes already read past the
/// hello, without the repeats of that hello line the host sent before it
/// saw the answer (they all come before its first yamux byte), then the port.
struct SkipRepeats<T> {
    line: Vec<u8>,
    buffer: Vec<u8>,
    offset: usize,
    skipping: bool,
    inner: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for SkipRepeats<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        while this.skipping {
            match classify(&this.buffer[this.offset..], &this.line) {
                Repeat::Whole(length) => this.offset += length,
                Repeat::No => this.skipping = false,
                Repeat::Partial => {
                    this.buffer.drain(..this.offset);
                    this.offset = 0;
                    let mut chunk = [0u8; 1024];
                    let mut more = ReadBuf::new(&mut chunk);
                    std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, &mut more))?;
                    if more.filled().is_empty() {
                        // End of file: hand over what there is.
                        this.skipping = false;
                    }
                    this.buffer.extend_from_slice(more.filled());
                }
            }
        }
        if this.offset < this.buffer.len() {
            let n = buf.remaining().min(this.buffer.len() - this.offset);
            buf.put_slice(&this.buffer[this.offset..this.offset + n]);
            this.offset += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SkipRepeats<T> {
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

/// One HTTP connection from the host: a yamux stream.
pub type Connection = Compat<yamux::Stream>;

/// The connections the host opens, for `axum::serve`.
pub struct Incoming {
    streams: mpsc::UnboundedReceiver<Connection>,
}

/// The peer of every connection: the host.
#[derive(Debug, Clone, Copy)]
pub struct Host;

impl axum::serve::Listener for Incoming {
    type Io = Connection;
    type Addr = Host;

    async fn accept(&mut self) -> (Connection, Host) {
        match self.streams.recv().await {
            Some(stream) => (stream, Host),
            // The session task ended, which it only does when the port is gone
            // for good; there is nothing left to accept.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Host> {
        Ok(Host)
    }
}

/// Finds the agent's port and serves sessions on it for as long as the agent runs.
pub fn listen() -> io::Result<Incoming> {
    let path = port::find(
        Path::new("/sys/class/virtio-ports"),
        Path::new("/dev"),
        port::PORT_NAME,
    )?;
    let (sender, streams) = mpsc::unbounded_channel();
    tokio::spawn(serve_sessions(path, sender));
    Ok(Incoming { streams })
}

async fn serve_sessions(path: PathBuf, streams: mpsc::UnboundedSender<Connection>) {
    loop {
        match session(&path, &streams).await {
            Ok(()) => tracing::info!("host session ended"),
            Err(error) => tracing::warn!(%error, "host session failed"),
        }
        if streams.is_closed() {
            return;
        }
    }
}

/// Opens the port, waits for the host, shakes hands and serves one yamux
/// session until the host goes away or sends what is no yamux frame.
async fn session(path: &Path, streams: &mpsc::UnboundedSender<Connection>) -> io::Result<()> {
    let mut port = Port::open(path)?;
    wait_for_host(&port).await?;
    // Opened while no host was there, the registration saw a hang-up; one
    // made now starts clean (see `port`).
    port.register_again()?;
    let (nonce, unix_ns, rest) = await_host_hello(&mut port).await?;
    if let Some(unix_ns) = unix_ns {
        // Before anything answers: a restored guest's clock is as old as
        // its saved memory, and a plain resume gets no other correction.
        if let Err(error) = super::setup::set_clock(unix_ns) {
            tracing::warn!(%error, "could not set the clock from the host's hello");
        }
    }
    port.write_all(guest_answer(&nonce).as_bytes()).await?;
    tracing::info!("host session started");
    let io = SkipRepeats {
        line: repeat_line(&nonce),
        buffer: rest,
        offset: 0,
        skipping: true,
        inner: port,
    };
    let mut connection =
        yamux::Connection::new(io.compat(), yamux::Config::default(), yamux::Mode::Server);
    loop {
        match std::future::poll_fn(|cx| connection.poll_next_inbound(cx)).await {
            Some(Ok(stream)) => {
                if streams.send(stream.compat()).is_err() {
                    return Ok(());
                }
            }
            Some(Err(yamux::ConnectionError::Closed)) | None => return Ok(()),
            Some(Err(error)) => return Err(io::Error::other(error)),
        }
    }
}

/// Waits until a host process is connected to the port. The port offers no
/// event for that, only `POLLHUP` while nobody is, so this polls: quickly at
/// first (a restored VM waits here for its new host), then slowly.
async fn wait_for_host(port: &Port) -> io::Result<()> {
    let began = Instant::now();
    while !port.host_connected()? {
        let pause = if began.elapsed() < Duration::from_secs(2) {
            Duration::from_millis(2)
        } else {
            Duration::from_millis(50)
        };
        tokio::time::sleep(pause).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn repeated_hellos_are_dropped_before_the_session() {
        let (mut host, guest) = tokio::io::duplex(1024);
        let line = b"COVE-HOST-HELLO n".to_vec();
        let mut io = SkipRepeats {
            line: line.clone(),
            buffer: b"COVE-HOST-HE".to_vec(),
            offset: 0,
            skipping: true,
            inner: guest,
        };
        host.write_all(b"LLO n\nCOVE-HOST-HELLO n\nCO")
            .await
            .unwrap();
        host.write_all(b"VE-HOST-HELLO n\n\x00yamux").await.unwrap();
        drop(host);
        let mut rest = Vec::new();
        io.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"\x00yamux");
    }

    #[tokio::test]
    async fn the_handshake_skips_stale_bytes_and_keeps_what_follows() {
        let (mut host, mut guest) = tokio::io::duplex(1024);
        host.write_all(b"stale COVE-HOST-HEL").await.unwrap();
        host.write_all(b"LO n0nce t=7\nnext").await.unwrap();
        let (nonce, time, rest) = await_host_hello(&mut guest).await.unwrap();
        assert_eq!((nonce.as_str(), time), ("n0nce", Some(7)));
        assert_eq!(rest, b"next");
    }
}
