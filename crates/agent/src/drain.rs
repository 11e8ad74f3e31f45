//! Reads what a handler left of its request body before the answer goes
//! out. A multipart upload ends at its closing boundary, but a chunked body
//! goes on for an epilogue and the last chunk, which may arrive after the
//! handler is done; hyper, finding the body unread when it answers, closes
//! the connection, and the host's proxy, still writing those last bytes,
//! reports a broken pipe instead of the answer. So every body is wrapped:
//! when the handler drops it, what is left comes back here, and up to
//! [`DRAIN_LIMIT`] bytes of it are read (for at most [`DRAIN_TIME`]). A
//! handler that refused a large body early still closes the connection.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::BodyExt as _;
use hyper::body::{Body as _, Frame, SizeHint};

/// The most of an unread body read before answering.
pub const DRAIN_LIMIT: usize = 1 << 20;
/// The longest the answer waits for it.
pub const DRAIN_TIME: Duration = Duration::from_secs(1);

type Slot = Arc<Mutex<Option<Body>>>;

/// A request body that, dropped unfinished, leaves its rest in a slot.
struct Returned {
    inner: Option<Body>,
    slot: Slot,
}

impl hyper::body::Body for Returned {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        match self.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(|inner| inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map(|inner| inner.size_hint())
            .unwrap_or_default()
    }
}

impl Drop for Returned {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take().filter(|inner| !inner.is_end_stream()) {
            *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(inner);
        }
    }
}

/// The middleware: runs the handler, then reads what it left of the body.
pub async fn unread_body(request: Request, next: Next) -> Response {
    let slot: Slot = Arc::default();
    let request = request.map(|inner| {
        Body::new(Returned {
            inner: Some(inner),
            slot: slot.clone(),
        })
    });
    let response = next.run(request).await;
    let rest = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(rest) = rest {
        let _ = tokio::time::timeout(DRAIN_TIME, drain(rest)).await;
    }
    response
}

/// Reads and drops up to [`DRAIN_LIMIT`] bytes of `body`.
async fn drain(mut body: Body) {
    let mut read = 0;
    while read <= DRAIN_LIMIT {
        match body.frame().await {
            Some(Ok(frame)) => read += frame.data_ref().map_or(0, Bytes::len),
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::post;
    use tower::ServiceExt as _;

    /// A handler that reads only the first frame of its body.
    async fn first_frame(body: Body) -> &'static str {
        let mut body = body;
        let _ = body.frame().await;
        "ok"
    }

    #[tokio::test]
    async fn what_a_handler_leaves_of_a_body_is_read_before_the_answer() {
        // Room for one chunk: the sender waits until the one before is read,
        // and fails once the body is dropped unread.
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        let body = Body::from_stream(tokio_stream_of(receiver));
        let app = axum::Router::new()
            .route("/", post(first_frame))
            .layer(axum::middleware::from_fn(unread_body));
        let sent = tokio::spawn(async move {
            for chunk in ["first", "second", "third", "fourth"] {
                sender
                    .send(Ok(Bytes::from(chunk)))
                    .await
                    .expect("the body was read");
            }
        });
        let request = Request::post("/").body(body).unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), 200);
        sent.await.unwrap();
    }

    fn tokio_stream_of(
        mut receiver: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
    ) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
        futures_util::stream::poll_fn(move |cx| receiver.poll_recv(cx))
    }
}
