//! `GET /metrics` over the fake runtime: behind the key, and what it reports
//! after real requests, labelled only by closed sets.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use cove_api::{app, ApiConfig, AppState};
use cove_engine::{Engine, EngineConfig, SnapshotRecord};
use cove_lifecycle::SandboxClass;
use cove_runtime::fake::FakeRuntime;
use cove_runtime::Runtime;
use cove_store::Store;
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

const KEY: &str = "metrics-key";

async fn router(dir: &tempfile::TempDir) -> axum::Router {
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> = HashMap::from([(
        SandboxClass::Container,
        Arc::new(FakeRuntime::new()) as Arc<dyn Runtime>,
    )]);
    let config = EngineConfig {
        data_dir: Some(dir.path().to_owned()),
        ..EngineConfig::default()
    };
    let engine = Engine::new(config, store, runtimes);
    engine
        .snapshots()
        .register(&SnapshotRecord::for_image(
            "cove-default",
            "/rootfs",
            SandboxClass::Container,
            0,
        ))
        .await
        .unwrap();
    let config = ApiConfig {
        env_api_key: Some(KEY.into()),
        preview_domain: Some("preview.localhost".into()),
        ..ApiConfig::default()
    };
    app(AppState::new(engine, config))
}

async fn call(
    router: &axum::Router,
    method: &str,
    path: &str,
    key: Option<&str>,
) -> (StatusCode, String, String) {
    call_host(router, "cove.test", method, path, key).await
}

async fn call_host(
    router: &axum::Router,
    host: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
) -> (StatusCode, String, String) {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", host);
    if let Some(key) = key {
        request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
    }
    // Creates and stops take JSON; `{}` asks for the defaults.
    let body = match method {
        "POST" => {
            request = request.header(header::CONTENT_TYPE, "application/json");
            Body::from("{}")
        }
        _ => Body::empty(),
    };
    let response = router
        .clone()
        .oneshot(request.body(body).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        content_type,
        String::from_utf8(body.to_vec()).unwrap(),
    )
}

fn has_line(text: &str, line: &str) {
    assert!(
        text.lines().any(|l| l == line),
        "no line {line}\nin:\n{text}"
    );
}

#[tokio::test]
async fn metrics_need_the_key_and_count_by_closed_labels() {
    let dir = tempfile::tempdir().unwrap();
    let router = router(&dir).await;

    let (status, _, _) = call(&router, "GET", "/metrics", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = call(&router, "GET", "/metrics", Some("wrong")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    let (status, _, created) = call(&router, "POST", "/api/sandbox", Some(KEY)).await;
    assert_eq!(status, StatusCode::OK, "{created}");
    let created: Value = serde_json::from_str(&created).unwrap();
    let id = created["id"].as_str().unwrap().to_owned();
    let name = created["name"].as_str().unwrap().to_owned();
    let (status, _, _) = call(&router, "GET", &format!("/api/sandbox/{id}"), Some(KEY)).await;
    assert_eq!(status, StatusCode::OK);
    // The fake's agent socket does not exist: whatever the proxy answers is
    // counted under the route's template, not the sandbox's path.
    let (toolbox_status, _, _) = call(
        &router,
        "GET",
        &format!("/toolbox/{id}/files?path=/tmp"),
        Some(KEY),
    )
    .await;
    let (status, _, _) = call(&router, "GET", &format!("/no/such/{id}"), Some(KEY)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    call(&router, "BREW", "/api/sandbox", Some(KEY)).await;
    // Answered before any routing: a preview named by its Host, and
    // Socket.IO (which serves only WebSockets, so this poll is refused).
    let (preview_status, _, _) = call_host(
        &router,
        &format!("3000-{id}.preview.localhost"),
        "GET",
        "/",
        Some(KEY),
    )
    .await;
    let (socket_io_status, _, _) = call(
        &router,
        "GET",
        "/api/socket.io/?EIO=4&transport=polling",
        None,
    )
    .await;
    // A path under /api that no route serves is answered by the API's own
    // fallback, and counted as unmatched too.
    let (status, _, _) = call(&router, "GET", &format!("/api/no-such/{id}"), Some(KEY)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (status, content_type, text) = call(&router, "GET", "/metrics", Some(KEY)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );

    has_line(&text, "# TYPE cove_sandboxes gauge");
    has_line(
        &text,
        r#"cove_sandboxes{state="started",class="container"} 1"#,
    );
    has_line(
        &text,
        r#"cove_sandboxes{state="stopped",class="container"} 0"#,
    );
    has_line(
        &text,
        r#"cove_sandbox_operations_total{operation="create",class="container",outcome="ok"} 1"#,
    );
    has_line(
        &text,
        "# TYPE cove_sandbox_operation_duration_seconds histogram",
    );
    has_line(
        &text,
        r#"cove_sandbox_operation_duration_seconds_count{operation="create",class="container"} 1"#,
    );
    has_line(
        &text,
        r#"cove_runtime_processes{class="container",process="agent"} 1"#,
    );
    has_line(
        &text,
        r#"cove_runtime_processes{class="container",process="qemu"} 0"#,
    );
    has_line(
        &text,
        r#"cove_warm_pool{pool="machines",class="container"} 0"#,
    );
    has_line(
        &text,
        r#"cove_sandbox_disk_allocated_bytes{class="container"} 3221225472"#,
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with(r#"cove_filesystem_available_bytes{filesystem="data"} "#)),
        "{text}"
    );
    has_line(&text, "cove_snapshots 1");

    has_line(&text, "# TYPE cove_http_requests_total counter");
    has_line(
        &text,
        r#"cove_http_requests_total{route="/metrics",method="GET",status="401"} 2"#,
    );
    has_line(
        &text,
        r#"cove_http_requests_total{route="/api/sandbox",method="POST",status="200"} 1"#,
    );
    has_line(
        &text,
        r#"cove_http_requests_total{route="/api/sandbox/{id}",method="GET",status="200"} 1"#,
    );
    has_line(
        &text,
        &format!(
            r#"cove_http_requests_total{{route="/toolbox/{{id}}/{{*path}}",method="GET",status="{}"}} 1"#,
            toolbox_status.as_u16()
        ),
    );
    has_line(
        &text,
        r#"cove_http_requests_total{route="unmatched",method="GET",status="404"} 2"#,
    );
    assert!(!text.contains("__private__"), "{text}");
    has_line(
        &text,
        &format!(
            r#"cove_http_requests_total{{route="preview-host",method="GET",status="{}"}} 1"#,
            preview_status.as_u16()
        ),
    );
    has_line(
        &text,
        &format!(
            r#"cove_http_requests_total{{route="/api/socket.io",method="GET",status="{}"}} 1"#,
            socket_io_status.as_u16()
        ),
    );
    assert!(
        text.lines()
            .any(|l| l
                .starts_with(r#"cove_http_requests_total{route="/api/sandbox",method="other","#)),
        "{text}"
    );
    has_line(
        &text,
        r#"cove_http_request_duration_seconds_count{route="/api/sandbox"} 2"#,
    );
    assert!(
        !text.contains(&id),
        "the sandbox id is in the metrics:\n{text}"
    );
    assert!(
        !text.contains(&name),
        "the sandbox name is in the metrics:\n{text}"
    );

    // A stop is counted and the census follows the store.
    let (status, _, _) = call(
        &router,
        "POST",
        &format!("/api/sandbox/{id}/stop"),
        Some(KEY),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (_, _, text) = call(&router, "GET", "/metrics", Some(KEY)).await;
    has_line(
        &text,
        r#"cove_sandbox_operations_total{operation="stop",class="container",outcome="ok"} 1"#,
    );
    has_line(
        &text,
        r#"cove_sandboxes{state="started",class="container"} 0"#,
    );
    has_line(
        &text,
        r#"cove_sandboxes{state="stopped",class="container"} 1"#,
    );
    has_line(
        &text,
        r#"cove_runtime_processes{class="container",process="agent"} 0"#,
    );
    has_line(
        &text,
        r#"cove_http_requests_total{route="/metrics",method="GET",status="200"} 1"#,
    );
}
