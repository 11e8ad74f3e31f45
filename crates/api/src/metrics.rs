//! `GET /metrics`: the server's metrics in the Prometheus text format
//! (version 0.0.4), behind the API key like `/api`, and the layer that counts
//! every HTTP request.
//!
//! Each scrape makes a registry, has the engine add its families (operation
//! counters, and a census taken now: see cove-engine's `metrics.rs`), adds
//! this crate's request counters, and writes it out. The request layer wraps
//! the whole router (toolbox proxy, previews, Socket.IO and object storage
//! included) and labels a request with its route template (axum's
//! `MatchedPath`, copied to the response by [`name_route`]), never its path:
//! `/toolbox/{id}/{*path}`, not a sandbox id. What no route matched is
//! [`UNMATCHED`]; Socket.IO and Host-named previews, which are answered
//! before routing, have fixed names. Methods outside the standard ones are
//! `other`, so a client cannot make a series per made-up method.
//!
//! A request's duration runs until its response head: a streamed body or an
//! upgraded connection (WebSocket, tunnel) goes on outside it.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::{prometheus_text, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::{ApiError, AppState};

/// The route of a request no route matched (404s, Daytona paths answered
/// 501 by the fallback).
pub(crate) const UNMATCHED: &str = "unmatched";

/// The route template a request was served under, carried on its response
/// to the counting layer.
#[derive(Clone, Debug)]
pub(crate) struct RouteTemplate(Cow<'static, str>);

impl RouteTemplate {
    /// A preview named by its Host (`{port}-{sandboxId}.{domain}`).
    pub(crate) const HOST_PREVIEW: RouteTemplate = RouteTemplate(Cow::Borrowed("preview-host"));
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: Cow<'static, str>,
    method: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: Cow<'static, str>,
}

fn request_buckets() -> Histogram {
    // 1 ms to about 33 s: most answers take milliseconds; a create of a
    // VM, or a command run through the toolbox, seconds.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// Requests served, by route, method and status, and how long they took.
/// Cheap to clone; clones share.
#[derive(Clone)]
pub(crate) struct HttpMetrics {
    requests: Family<RequestLabels, Counter>,
    durations: Family<RouteLabels, Histogram, fn() -> Histogram>,
}

impl Default for HttpMetrics {
    fn default() -> Self {
        HttpMetrics {
            requests: Family::default(),
            durations: Family::new_with_constructor(request_buckets),
        }
    }
}

impl HttpMetrics {
    fn observe(&self, route: Cow<'static, str>, method: &'static str, status: u16, took: Duration) {
        self.durations
            .get_or_create(&RouteLabels {
                route: route.clone(),
            })
            .observe(took.as_secs_f64());
        self.requests
            .get_or_create(&RequestLabels {
                route,
                method,
                status,
            })
            .inc();
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "http_requests",
            "HTTP requests served, by route template, method and status",
            self.requests.clone(),
        );
        registry.register_with_unit(
            "http_request_duration",
            "How long HTTP requests took until their response head, by route template",
            Unit::Seconds,
            self.durations.clone(),
        );
    }
}

/// A method's label: the standard ones by name, anything else `other`.
fn method_label(method: &Method) -> &'static str {
    const STANDARD: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::PATCH,
        Method::OPTIONS,
        Method::CONNECT,
        Method::TRACE,
    ];
    const NAMES: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
    ];
    STANDARD
        .iter()
        .position(|standard| standard == method)
        .map_or("other", |at| NAMES[at])
}

/// The outermost layer: counts and times every request.
pub(crate) async fn count_requests(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let method = method_label(request.method());
    let socket_io = request.uri().path().starts_with(crate::events::PATH);
    let began = Instant::now();
    let response = next.run(request).await;
    let route = match response.extensions().get::<RouteTemplate>() {
        Some(RouteTemplate(route)) => route.clone(),
        // Socket.IO's layer answers before any route is matched.
        None if socket_io => Cow::Borrowed(crate::events::PATH),
        None => Cow::Borrowed(UNMATCHED),
    };
    state
        .http_metrics
        .observe(route, method, response.status().as_u16(), began.elapsed());
    response
}

/// A route layer: tells [`count_requests`] which route template matched.
pub(crate) async fn name_route(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|matched| RouteTemplate(Cow::Owned(matched.as_str().to_owned())));
    let mut response = next.run(request).await;
    if let Some(route) = route {
        response.extensions_mut().insert(route);
    }
    response
}

/// `GET /metrics`
pub(crate) async fn scrape(State(state): State<AppState>) -> Result<Response, ApiError> {
    let mut registry = Registry::with_prefix("cove");
    state.engine.register_metrics(&mut registry).await?;
    state.http_metrics.register(&mut registry);
    let mut text = String::new();
    prometheus_text::encode(&mut text, &registry).map_err(|error| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("writing the metrics failed: {error}"),
        )
    })?;
    Ok((
        [(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)],
        text,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_outside_the_standard_set_share_one_label() {
        assert_eq!(method_label(&Method::GET), "GET");
        assert_eq!(method_label(&Method::PATCH), "PATCH");
        let made_up = Method::from_bytes(b"BREW-A-SANDBOX-ID").unwrap();
        assert_eq!(method_label(&made_up), "other");
    }
}
