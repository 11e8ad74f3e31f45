//! hyper's pooled HTTP/1 client over a [`Dial`]: connections are kept open
//! between requests (a new one per command would be a visible share of a
//! 1-2 ms round trip), upgrades (WebSockets, tunnels) are supported, and
//! response heads are bounded at [`HEAD_LIMIT`]. Bodies stream both ways
//! untouched.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Uri};
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::dial::{BoxFuture, Dial};
use crate::HEAD_LIMIT;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long an idle connection is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Requests on connections from `D`, with bodies of type `B`.
pub struct Pool<D, B> {
    client: Client<Connector<D>, B>,
}

impl<D: Clone, B> Clone for Pool<D, B> {
    fn clone(&self) -> Self {
        Pool {
            client: self.client.clone(),
        }
    }
}

impl<D, B> Pool<D, B>
where
    D: Dial,
    B: hyper::body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    /// A pool whose response heads are bounded at [`HEAD_LIMIT`].
    pub fn new(dial: D) -> Pool<D, B> {
        Pool::with_read_buffer(dial, Some(HEAD_LIMIT))
    }

    /// A pool whose read buffer (which bounds response heads) is at most
    /// `max` bytes (at least 8 KiB, hyper's minimum); `None`: hyper's
    /// default (about 400 KiB), for a proxy that streams large bodies.
    pub fn with_read_buffer(dial: D, max: Option<usize>) -> Pool<D, B> {
        let mut builder = Client::builder(TokioExecutor::new());
        builder.pool_idle_timeout(IDLE_TIMEOUT);
        if let Some(max) = max {
            builder.http1_max_buf_size(max.max(8192));
        }
        Pool {
            client: builder.build(Connector { dial }),
        }
    }

    /// Sends `request`, whose URI's host is the authority handed to the
    /// dialer.
    pub fn request(&self, request: Request<B>) -> ResponseFuture {
        self.client.request(request)
    }
}

/// The pool's connector: a [`Dial`] as hyper wants it.
#[derive(Clone)]
pub struct Connector<D> {
    dial: D,
}

impl<D: Dial> tower_service::Service<Uri> for Connector<D> {
    type Response = PooledStream<D::Io>;
    type Error = D::Error;
    type Future = BoxFuture<Result<PooledStream<D::Io>, D::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let dialing = self.dial.dial(uri.host().unwrap_or_default());
        Box::pin(async move { Ok(PooledStream(TokioIo::new(dialing.await?))) })
    }
}

/// One connection of the pool.
pub struct PooledStream<T>(TokioIo<T>);

impl<T> Connection for PooledStream<T> {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> hyper::rt::Read for PooledStream<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> hyper::rt::Write for PooledStream<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    // Vectored writes let hyper send a body chunk as it came, with its
    // headers, instead of copying every byte of an upload into its buffer.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
