//! What the sandbox is doing, read from the kernel: listening TCP ports
//! (`GET /port`, `GET /port/{port}/in-use`) and resource use
//! (`GET /system/metrics`). Everything here only reads; the sandbox's own
//! network namespace and cgroup bound what it can see.

mod metrics;
mod ports;

use axum::routing::get;
use axum::Router;

use crate::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/port", get(ports::list))
        .route("/port/{port}/in-use", get(ports::in_use))
        .route("/system/metrics", get(metrics::metrics))
}
