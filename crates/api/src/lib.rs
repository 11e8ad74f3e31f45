//! The HTTP front of cove.
//!
//! Only this crate knows the HTTP and JSON shape of the public API: Daytona's
//! control API under `/api`, its live events over Socket.IO at `/api/socket.io/`,
//! the toolbox proxy under `/toolbox/{sandboxId}/...`
//! that forwards each request, untouched, to the agent inside the sandbox, and
//! the server's metrics at `/metrics` for Prometheus, and the web console at
//! `/` (`dashboard.rs`), a page that drives this same API. Handlers
//! turn a request into one engine call and the result into a response; they never
//! touch the database or a runtime.

mod api_keys;
mod audit;
mod auth;
mod billing;
mod dashboard;
mod docker_registry;
mod dto;
mod error;
mod events;
mod list_filter;
pub mod listener;
mod machines;
mod metrics;
mod not_implemented;
mod object_storage;
mod openapi;
mod organizations;
mod permissions;
mod preview;
mod quota;
mod rate_limit;
mod regions;
mod runners;
mod sandbox;
mod server_config;
mod snapshots;
mod sort;
mod ssh_access;
mod toolbox;
mod volumes;

use std::sync::Arc;

use axum::routing::{any, get, post, put};
use axum::Router;
use cove_engine::Engine;

pub use error::ApiError;

/// Settings of the HTTP front.
#[derive(Clone, Debug, Default)]
pub struct ApiConfig {
    /// A key accepted as `Authorization: Bearer` besides the stored ones (`COVE_API_KEY`).
    pub env_api_key: Option<String>,
    /// The URL clients reach this server at (e.g. `http://10.0.0.5:3000`); when
    /// unset, it is taken from each request's `Host` header.
    pub public_url: Option<String>,
    /// The wildcard DNS domain of host-based preview URLs
    /// (`{port}-{sandboxId}.{domain}`); without it preview URLs are path-based
    /// (`/preview/{sandboxId}/{port}/`).
    pub preview_domain: Option<String>,
    /// The port of the SSH gateway (`serve --ssh-listen`), for the `sshCommand`
    /// of issued SSH access; `None` when the server runs no gateway.
    pub ssh_port: Option<u16>,
    /// The port of cove's own HTTPS listener (`serve --tls-listen`), where the
    /// SDK uploads build contexts; `None` without one.
    pub tls_port: Option<u16>,
    /// Every request marks the host busy while it is answered, so the
    /// runtimes' pools refill between requests rather than during them.
    pub quiet: cove_quiet::Quiet,
}

#[derive(Clone)]
pub struct AppState {
    engine: Engine,
    config: Arc<ApiConfig>,
    toolbox: toolbox::AgentClient,
    previews: preview::Previews,
    /// Every HTTP request, counted and timed (`metrics.rs`).
    http_metrics: metrics::HttpMetrics,
    /// When this server started: the creation time its one region reports.
    started_at_ms: i64,
    /// The organization's rate-limit windows (`rate_limit.rs`).
    rate_limiter: Arc<rate_limit::RateLimiter>,
}

impl AppState {
    pub fn new(engine: Engine, config: ApiConfig) -> AppState {
        let toolbox = toolbox::AgentClient::new();
        let warming = toolbox.clone();
        // The first state made of an engine warms the agents it proxies to.
        engine.on_agent_started(move |id, agent| warming.warm(id, agent));
        AppState {
            engine,
            config: Arc::new(config),
            toolbox,
            previews: preview::Previews::new(),
            http_metrics: metrics::HttpMetrics::default(),
            started_at_ms: cove_engine::now_ms(),
            rate_limiter: Arc::default(),
        }
    }
}

/// The whole HTTP application; tests drive it without a socket.
pub fn app(state: AppState) -> Router {
    let api = Router::new()
        .route("/config", get(server_config::get_config))
        .route("/openapi.json", get(openapi::get))
        .route("/regions", get(regions::list))
        .route("/api-keys", get(api_keys::list).post(api_keys::create))
        .route("/api-keys/current", get(api_keys::current))
        .route(
            "/api-keys/{name}",
            get(api_keys::get).delete(api_keys::delete),
        )
        .route(
            "/api-keys/{user}/{name}",
            axum::routing::delete(api_keys::delete_for_user),
        )
        .route("/users/me", get(api_keys::me))
        .route(
            "/audit/organizations/{organization}",
            get(audit::organization),
        )
        .route("/admin/audit", get(audit::all))
        .route(
            "/organizations",
            get(organizations::list).post(organizations::create),
        )
        .route(
            "/organizations/{organization}",
            get(organizations::get).delete(organizations::delete),
        )
        .route("/organizations/{organization}/bill", get(billing::bill))
        .route("/organizations/{organization}/usage", get(quota::usage))
        .route(
            "/organizations/{organization}/quota",
            axum::routing::patch(quota::update_organization),
        )
        .route(
            "/admin/organizations/{organization}/quota/{region}",
            axum::routing::patch(quota::update),
        )
        .route("/shared-regions", get(regions::list))
        .route("/sandbox", post(sandbox::create).get(sandbox::list))
        .route("/sandbox/{id}", get(sandbox::get).delete(sandbox::delete))
        .route("/sandbox/{id}/start", post(sandbox::start))
        .route("/sandbox/{id}/stop", post(sandbox::stop))
        .route("/sandbox/{id}/recover", post(sandbox::recover))
        .route(
            "/sandbox/{id}/ssh-access",
            post(ssh_access::create).delete(ssh_access::revoke),
        )
        .route("/sandbox/ssh-access/validate", get(ssh_access::validate))
        .route("/sandbox/{id}/pause", post(machines::pause))
        .route("/sandbox/{id}/archive", post(machines::archive))
        .route(
            "/sandbox/{id}/network-settings",
            post(machines::network_settings),
        )
        .route("/sandbox/{id}/fork", post(machines::fork))
        .route(
            "/sandbox/{id}/forks",
            get(machines::forks).post(machines::fork_many),
        )
        .route("/sandbox/{id}/parent", get(machines::parent))
        .route("/sandbox/{id}/ancestors", get(machines::ancestors))
        .route("/vms/{id}/pause", post(machines::pause))
        .route("/vms/{id}/resume", post(machines::resume))
        .route("/vms/{id}/start", post(machines::cold_start))
        .route("/vms/{id}/stop", post(sandbox::stop))
        .route("/admin/reclaim", post(machines::reclaim))
        .route("/sandbox/{id}/snapshot", post(snapshots::take))
        .route("/sandbox/{id}/revert", post(snapshots::revert))
        .route("/snapshots", get(snapshots::list).post(snapshots::create))
        .route("/snapshots/import", post(snapshots::import))
        .route("/snapshots/{id}/activate", post(snapshots::activate))
        .route("/snapshots/{id}/build-logs", get(snapshots::build_logs))
        .route(
            "/snapshots/{id}/build-logs-url",
            get(snapshots::build_logs_url),
        )
        .route("/snapshots/{id}/deactivate", post(snapshots::deactivate))
        .route(
            "/snapshots/{id}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route(
            "/docker-registry",
            get(docker_registry::list).post(docker_registry::create),
        )
        // Daytona's transient push access is not served: keep its 501.
        .route(
            "/docker-registry/registry-push-access",
            get(not_implemented::fallback),
        )
        .route(
            "/object-storage/push-access",
            get(object_storage::push_access),
        )
        .route(
            "/docker-registry/{id}",
            get(docker_registry::get)
                .patch(docker_registry::update)
                .delete(docker_registry::delete),
        )
        // Runners: listed, registered, switched and deleted by the
        // operator; what a runner itself calls is outside the key layer.
        .route("/runners", get(runners::list).post(runners::create))
        .route("/runners/by-snapshot-ref", get(not_implemented::fallback))
        .route("/runners/by-sandbox/{sandbox}", get(runners::by_sandbox))
        .route("/runners/{id}", get(runners::get).delete(runners::delete))
        .route(
            "/runners/{id}/scheduling",
            axum::routing::patch(runners::scheduling),
        )
        .route(
            "/runners/{id}/draining",
            axum::routing::patch(runners::draining),
        )
        .route("/volumes", get(volumes::list).post(volumes::create))
        .route("/volumes/by-name/{name}", get(volumes::get_by_name))
        .route("/volumes/{id}", get(volumes::get).delete(volumes::delete))
        .route("/sandbox/{id}/labels", put(sandbox::replace_labels))
        .route(
            "/sandbox/{id}/autostop/{minutes}",
            post(sandbox::set_auto_stop),
        )
        .route(
            "/sandbox/{id}/autopause/{minutes}",
            post(sandbox::set_auto_pause),
        )
        .route(
            "/sandbox/{id}/autoarchive/{minutes}",
            post(sandbox::set_auto_archive),
        )
        .route(
            "/sandbox/{id}/autodelete/{minutes}",
            post(sandbox::set_auto_delete),
        )
        .route("/sandbox/{id}/ttl/{minutes}", post(sandbox::set_ttl))
        .route("/sandbox/{id}/public/{public}", post(sandbox::set_public))
        .route(
            "/sandbox/{id}/ports/{port}/preview-url",
            get(preview::preview_url),
        )
        .route(
            "/sandbox/{id}/ports/{port}/signed-preview-url",
            get(preview::signed_preview_url),
        )
        .route(
            "/sandbox/{id}/ports/{port}/signed-preview-url/{token}/expire",
            post(preview::expire_signed_preview_url),
        )
        .route(
            "/sandbox/{id}/toolbox-proxy-url",
            get(sandbox::toolbox_proxy_url),
        )
        .fallback(not_implemented::fallback);
    let with_key = Router::new()
        .nest("/api", api)
        .route("/toolbox/{id}/{*path}", any(toolbox::proxy))
        .route("/toolbox/{id}", any(toolbox::proxy_root))
        // Prometheus scrape configs send the key as a Bearer token too.
        .route("/metrics", get(metrics::scrape))
        // Innermost: a request the key may make counts against the
        // organization's rate limits.
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            rate_limit::check,
        ))
        // Inside the key layer, on matched routes only: what each route needs.
        .route_layer(axum::middleware::from_fn(permissions::check))
        // Outside the permission check, so refusals are recorded too.
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            audit::record,
        ))
        // Inside the key layer: a request without a valid key, which
        // anyone can send, never holds back the pools' refills.
        .layer(axum::middleware::from_fn_with_state(
            state.config.quiet.clone(),
            hold_quiet,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ));
    // Previews check their own credentials (a preview token, a signed URL, or
    // none for a public sandbox), so they sit outside the API key layer; the
    // host-based ones are taken before any routing by path.
    // Object storage checks each request's SigV4 signature instead.
    Router::new()
        .merge(dashboard::routes())
        .route("/preview/{*path}", any(preview::by_path))
        .route(
            "/object-storage/{bucket}/{*key}",
            any(object_storage::object),
        )
        .route("/object-storage/{bucket}", any(object_storage::bucket))
        // A runner on another machine sends its own token, not an API key.
        .route("/api/runners/me", get(runners::me))
        .route(
            "/api/runners/me/snapshots",
            get(not_implemented::outside_api),
        )
        .route("/api/runners/healthcheck", post(runners::healthcheck))
        .route("/api/runners/me/images", get(runners::images))
        .route("/api/runners/me/images/{*image}", get(runners::image))
        .route("/api/runners/me/layers", get(runners::layers))
        .route("/api/runners/me/layers/{capture}", get(runners::layer))
        .merge(with_key)
        // Tells the counting layer below which route template matched.
        .route_layer(axum::middleware::from_fn(metrics::name_route))
        // Socket.IO (`/api/socket.io/`) checks the key its clients send in
        // their CONNECT packet, not in a header: in front of the key layer.
        .layer(events::layer(state.clone()))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            preview::by_host,
        ))
        // Outermost, so every request is counted, whoever answers it.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            metrics::count_requests,
        ))
        .with_state(state)
}

/// Marks the host busy until the handler answers (a response's streamed
/// body, or an upgraded connection, does not hold it): background refills
/// wait for the gap after it (see `cove_quiet`). Placed inside the check of
/// the request's credentials, so only requests that passed it count.
pub async fn hold_quiet(
    axum::extract::State(quiet): axum::extract::State<cove_quiet::Quiet>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let _busy = quiet.busy();
    next.run(request).await
}
