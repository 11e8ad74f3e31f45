//! The HTTP front driven without a socket, over the fake runtime.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use cove_api::{app, ApiConfig, AppState};
use cove_engine::{Engine, EngineConfig, SnapshotRecord};
use cove_lifecycle::SandboxClass;
use cove_runtime::fake::FakeRuntime;
use cove_runtime::Runtime;
use cove_store::Store;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

const KEY: &str = "test-key";

struct Api {
    router: axum::Router,
    fake: Arc<FakeRuntime>,
    _dir: tempfile::TempDir,
}

async fn api() -> Api {
    api_with_tls(None).await
}

/// An API whose HTTPS listener (for build-context uploads) is on `tls_port`.
async fn api_with_tls(tls_port: Option<u16>) -> Api {
    api_in(tempfile::tempdir().unwrap(), tls_port).await.0
}

/// An API over the store in `dir` (a server started again, when it holds
/// one already), and its engine.
async fn api_in(dir: tempfile::TempDir, tls_port: Option<u16>) -> (Api, Engine) {
    api_quiet_in(dir, tls_port, Default::default()).await
}

/// [`api_in`], whose requests mark `quiet` busy.
async fn api_quiet_in(
    dir: tempfile::TempDir,
    tls_port: Option<u16>,
    quiet: cove_quiet::Quiet,
) -> (Api, Engine) {
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let fake = Arc::new(FakeRuntime::new());
    let runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> = HashMap::from([
        (SandboxClass::Container, fake.clone() as Arc<dyn Runtime>),
        (SandboxClass::LinuxVm, fake.clone() as Arc<dyn Runtime>),
    ]);
    let engine_config = EngineConfig {
        build_contexts_dir: Some(dir.path().join("contexts")),
        volumes_dir: Some(dir.path().join("volumes")),
        ..EngineConfig::default()
    };
    let engine = Engine::new(engine_config, store, runtimes);
    for (name, class) in [
        ("cove-default", SandboxClass::Container),
        ("daytona-vm-small", SandboxClass::LinuxVm),
    ] {
        engine
            .snapshots()
            .register(&SnapshotRecord::for_image(name, "/rootfs", class, 0))
            .await
            .unwrap();
    }
    let config = ApiConfig {
        env_api_key: Some(KEY.into()),
        public_url: None,
        preview_domain: Some("preview.localhost".into()),
        ssh_port: Some(2222),
        tls_port,
        quiet,
    };
    let api = Api {
        router: app(AppState::new(engine.clone(), config)),
        fake,
        _dir: dir,
    };
    (api, engine)
}

impl Api {
    /// Makes a key of organization `organization` (with the operator's)
    /// named `name` with `permissions`; its value.
    async fn key_in(&self, organization: &str, name: &str, permissions: Value) -> String {
        let body = json!({"name": name, "permissions": permissions});
        let (status, made) = self
            .call_in(organization, "POST", "/api/api-keys", Some(body))
            .await;
        assert_eq!(status, StatusCode::CREATED, "{made}");
        made["value"].as_str().unwrap().to_owned()
    }

    /// A call by the operator acting in `organization`.
    async fn call_in(
        &self,
        organization: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        self.request(method, path, body, Some(KEY), Some(organization))
            .await
    }

    /// A bodiless call with `key` naming `organization` in its header.
    async fn call_in_with_key(
        &self,
        organization: &str,
        key: &str,
        method: &str,
        path: &str,
    ) -> (StatusCode, Value) {
        self.request(method, path, None, Some(key), Some(organization))
            .await
    }

    /// Makes a key (with the operator's) named `name` with `permissions`;
    /// its value.
    async fn key(&self, name: &str, permissions: Value) -> String {
        let body = json!({"name": name, "permissions": permissions});
        let (status, made) = self.call("POST", "/api/api-keys", Some(body)).await;
        assert_eq!(status, StatusCode::CREATED, "{made}");
        made["value"].as_str().unwrap().to_owned()
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        self.call_with_key(method, path, body, Some(KEY)).await
    }

    async fn call_with_key(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        key: Option<&str>,
    ) -> (StatusCode, Value) {
        self.request(method, path, body, key, None).await
    }

    async fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        key: Option<&str>,
        organization: Option<&str>,
    ) -> (StatusCode, Value) {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "cove.test:3000");
        if let Some(key) = key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        if let Some(organization) = organization {
            request = request.header("x-daytona-organization-id", organization);
        }
        let request = match body {
            Some(body) => request
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .unwrap(),
            None => request.body(Body::empty()).unwrap(),
        };
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, value)
    }
}

#[tokio::test]
async fn every_request_needs_a_key() {
    let api = api().await;
    let (status, body) = api.call_with_key("GET", "/api/sandbox", None, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(body["message"].as_str().unwrap().contains("API key"));
    let (status, _) = api
        .call_with_key("GET", "/api/sandbox", None, Some("wrong"))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = api
        .call_with_key("POST", "/toolbox/x/process/execute", None, None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn only_a_request_with_a_valid_key_holds_back_the_refills() {
    use std::time::Duration;
    // Refills wait for 2 s without a request in flight; the server has
    // been up for longer than that.
    let quiet = cove_quiet::Quiet::new(Duration::from_secs(2), Duration::from_secs(60));
    let dir = tempfile::tempdir().unwrap();
    let api = api_quiet_in(dir, None, quiet.clone()).await.0;
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let settled = || tokio::time::timeout(Duration::from_secs(1), quiet.settled());
    // Anyone can send these: refused, they leave the server quiet.
    for (path, key) in [
        ("/api/sandbox", None),
        ("/api/sandbox", Some("wrong")),
        ("/toolbox/x/files", None),
    ] {
        let (status, _) = api.call_with_key("GET", path, None, key).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}");
    }
    assert!(
        settled().await.is_ok(),
        "a refused request held the refills back"
    );
    // A request with the key counts: 2 s of quiet must follow it.
    let (status, _) = api.call("GET", "/api/sandbox", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        settled().await.is_err(),
        "a request with the key did not count"
    );
}

#[tokio::test]
async fn the_console_is_served_at_the_root_and_its_websockets_carry_the_key_as_a_protocol() {
    let api = api().await;
    // As a browser asks, naming the host it reached.
    let served = |path: &str| {
        let request = Request::get(path)
            .header("host", "cove.test:3000")
            .body(Body::empty())
            .unwrap();
        api.router.clone().oneshot(request)
    };
    let page = served("/").await.unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    let policy = page.headers()["content-security-policy"].to_str().unwrap();
    assert!(
        policy.contains(
            "script-src cove.test:3000/dashboard/app.js cove.test:3000/dashboard/xterm.js;"
        ),
        "{policy}"
    );
    assert!(policy.contains("frame-ancestors 'none'"), "{policy}");
    let script = served("/dashboard/app.js").await.unwrap();
    assert_eq!(script.status(), StatusCode::OK);
    assert!(script.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/javascript"));
    let other = served("/dashboard/cove.db").await.unwrap();
    assert_eq!(other.status(), StatusCode::NOT_FOUND);

    // A browser's WebSocket offers the key ("test-key") as a subprotocol.
    let upgrade = |upgrade: bool, protocols: &str| {
        let mut request = Request::get("/api/sandbox").header("sec-websocket-protocol", protocols);
        if upgrade {
            request = request
                .header("connection", "upgrade")
                .header("upgrade", "websocket");
        }
        request.body(Body::empty()).unwrap()
    };
    let status = |request: Request<Body>| async {
        api.router.clone().oneshot(request).await.unwrap().status()
    };
    assert_eq!(
        status(upgrade(true, "cove, cove.key.dGVzdC1rZXk")).await,
        StatusCode::OK
    );
    assert_eq!(
        status(upgrade(true, "cove, cove.key.d3Jvbmc")).await,
        StatusCode::UNAUTHORIZED,
        "another key"
    );
    assert_eq!(
        status(upgrade(false, "cove, cove.key.dGVzdC1rZXk")).await,
        StatusCode::UNAUTHORIZED,
        "only an upgrade is read so"
    );
}

#[tokio::test]
async fn the_sandbox_dto_has_what_the_sdk_requires() {
    let api = api().await;
    let (status, s) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"labels": {"code-toolbox-language": "python"}, "env": {"A": "1"}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{s}");
    for key in [
        "id",
        "organizationId",
        "name",
        "user",
        "target",
        "toolboxProxyUrl",
        "state",
        "snapshot",
        "createdAt",
    ] {
        assert!(s[key].is_string(), "{key} must be a string: {s}");
    }
    for key in ["env", "labels"] {
        assert!(s[key].is_object(), "{key}: {s}");
    }
    for key in ["public", "networkBlockAll", "kvm"] {
        assert!(s[key].is_boolean(), "{key}: {s}");
    }
    for key in [
        "cpu",
        "gpu",
        "memory",
        "disk",
        "autoStopInterval",
        "autoDeleteInterval",
    ] {
        assert!(s[key].is_i64(), "{key} must be an integer: {s}");
    }
    assert_eq!(s["state"], "started");
    assert_eq!(s["desiredState"], "started");
    assert_eq!(s["sandboxClass"], "container");
    assert_eq!(s["toolboxProxyUrl"], "http://cove.test:3000/toolbox");
    assert_eq!(
        (s["cpu"].as_i64(), s["memory"].as_i64(), s["disk"].as_i64()),
        (Some(1), Some(1), Some(3))
    );
    assert_eq!(s["autoStopInterval"], 15);
    assert_eq!(s["autoDeleteInterval"], -1);

    let id = s["id"].as_str().unwrap();
    let (status, url) = api
        .call("GET", &format!("/api/sandbox/{id}/toolbox-proxy-url"), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(url["url"], "http://cove.test:3000/toolbox");
}

#[tokio::test]
async fn bad_creates_are_refused_and_leave_nothing() {
    let api = api().await;
    let (status, body) = api
        .call("POST", "/api/sandbox", Some(json!({"snapshot": "ghost"})))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["message"], "snapshot ghost not found");
    let (status, body) = api
        .call("POST", "/api/sandbox", Some(json!({"cpu": 64})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        body["message"],
        "cpu 64 is above this server's ceiling of 4"
    );
    let (status, body) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"buildInfo": {"dockerfileContent": "FROM x"}})),
        )
        .await;
    // This server has no image cache: a 501 that says so.
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
    assert!(
        body["message"].as_str().unwrap().contains("image"),
        "{body}"
    );
    // Nor a sandbox network: policies are refused, never silently ignored.
    let (status, body) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"networkAllowList": "10.0.0.0/8"})),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED, "{body}");
    assert!(body["message"].as_str().unwrap().contains("network"));
    let (status, body) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"networkAllowList": "10.0.0.0/99"})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["message"].as_str().unwrap().contains("10.0.0.0/99"));
    let (status, _) = api
        .call("POST", "/api/sandbox", Some(json!({"cpu": "two"})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (_, list) = api.call("GET", "/api/sandbox", None).await;
    assert_eq!(list["items"].as_array().unwrap().len(), 0);
    assert!(api.fake.machines().is_empty());
}

#[tokio::test]
async fn lifecycle_over_http() {
    let api = api().await;
    let (_, s) = api
        .call("POST", "/api/sandbox", Some(json!({"name": "web"})))
        .await;
    let (status, stopped) = api
        .call("POST", "/api/sandbox/web/stop?force=false", None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(stopped["state"], "stopped");
    // The toolbox of a stopped sandbox is a conflict, named.
    let id = s["id"].as_str().unwrap();
    let (status, body) = api
        .call(
            "POST",
            &format!("/toolbox/{id}/process/execute"),
            Some(json!({"command": "true"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        body["message"].as_str().unwrap().contains("stopped"),
        "{body}"
    );
    let (status, started) = api.call("POST", "/api/sandbox/web/start", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(started["state"], "started");
    let (status, deleted) = api.call("DELETE", "/api/sandbox/web", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(deleted["state"], "destroyed");
    let (status, body) = api.call("GET", "/api/sandbox/web", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["message"], "sandbox web not found");
}

#[tokio::test]
async fn list_filters_by_labels_and_pages() {
    let api = api().await;
    for (name, env) in [("a", "dev"), ("b", "prod"), ("c", "dev")] {
        let (status, _) = api
            .call(
                "POST",
                "/api/sandbox",
                Some(json!({"name": name, "labels": {"env": env}})),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
    }
    let labels = "%7B%22env%22%3A%20%22dev%22%7D";
    let (_, page) = api
        .call("GET", &format!("/api/sandbox?labels={labels}"), None)
        .await;
    let names: Vec<&str> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    // Daytona's default order: newest first.
    assert_eq!(names, ["c", "a"]);
    assert!(page["nextCursor"].is_null());
    let (_, first) = api.call("GET", "/api/sandbox?limit=2", None).await;
    assert_eq!(first["items"].as_array().unwrap().len(), 2);
    assert_eq!(first["nextCursor"], "2");
    let (_, second) = api.call("GET", "/api/sandbox?limit=2&cursor=2", None).await;
    assert_eq!(second["items"][0]["name"], "a");
    let (status, _) = api.call("GET", "/api/sandbox?labels=notjson", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

/// The names of a `GET` of sandboxes, every page followed.
async fn listed_names(api: &Api, query: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(cursor) => format!("/api/sandbox?{query}&cursor={cursor}"),
            None => format!("/api/sandbox?{query}"),
        };
        let (status, page) = api.call("GET", &path, None).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        for item in page["items"].as_array().unwrap() {
            names.push(item["name"].as_str().unwrap().to_owned());
        }
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return names,
        }
    }
}

#[tokio::test]
async fn lists_sort_as_asked_on_every_page() {
    let api = api().await;
    for (name, cpu) in [("b", 2), ("d", 1), ("a", 2), ("c", 1)] {
        let (status, body) = api
            .call(
                "POST",
                "/api/sandbox",
                Some(json!({"name": name, "cpu": cpu})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    for (query, expected) in [
        ("sort=name&order=asc", ["a", "b", "c", "d"]),
        ("sort=name&order=desc", ["d", "c", "b", "a"]),
        ("sort=createdAt&order=asc", ["b", "d", "a", "c"]),
        ("sort=createdAt&order=desc", ["c", "a", "d", "b"]),
        ("sort=createdAt", ["c", "a", "d", "b"]),
        ("order=asc", ["b", "d", "a", "c"]),
        // Equal CPUs keep creation order, in the same direction.
        ("sort=cpu&order=asc", ["d", "c", "b", "a"]),
        ("sort=cpu&order=desc", ["a", "b", "c", "d"]),
    ] {
        for limit in [1, 3, 100] {
            let query = format!("{query}&limit={limit}");
            assert_eq!(listed_names(&api, &query).await, expected, "{query}");
        }
    }
    let (status, body) = api.call("GET", "/api/sandbox?sort=size", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("\"size\"") && message.contains("lastActivityAt"),
        "{message}"
    );
    let (status, body) = api
        .call("GET", "/api/sandbox?sort=name&order=up", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["message"].as_str().unwrap().contains("asc, desc"),
        "{body}"
    );
}

#[tokio::test]
async fn one_region_is_listed_and_only_it_is_a_target() {
    let api = api().await;
    for path in ["/api/regions", "/api/shared-regions"] {
        let (status, regions) = api.call("GET", path, None).await;
        assert_eq!(status, StatusCode::OK, "{regions}");
        let regions = regions.as_array().unwrap();
        assert_eq!(regions.len(), 1, "{regions:?}");
        assert_eq!(regions[0]["id"], "us");
        assert_eq!(regions[0]["name"], "us");
        assert_eq!(regions[0]["regionType"], "shared");
        assert!(regions[0]["createdAt"].is_string());
    }
    let (status, body) = api
        .call("POST", "/api/sandbox", Some(json!({"target": "eu"})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("\"eu\"") && message.contains("\"us\""),
        "{message}"
    );
    assert!(api.fake.machines().is_empty());
    let (status, made) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "here", "target": "us"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{made}");
    assert_eq!(made["target"], "us");
    assert_eq!(
        listed_names(&api, "regionIds=us").await,
        ["here"].map(String::from)
    );
    assert!(listed_names(&api, "regionIds=eu").await.is_empty());
    let (status, body) = api
        .call(
            "POST",
            "/api/snapshots",
            Some(json!({"name": "x", "imageName": "alpine:3", "regionId": "eu"})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("regionId"),
        "{body}"
    );
}

#[tokio::test]
async fn auto_archive_zero_reads_back_as_the_longest_interval() {
    let api = api().await;
    let (status, made) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "arch", "autoArchiveInterval": 0})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{made}");
    assert_eq!(made["autoArchiveInterval"], 43200);
    for (set, kept) in [(60, 60), (0, 43200), (100000, 43200)] {
        let (status, body) = api
            .call(
                "POST",
                &format!("/api/sandbox/arch/autoarchive/{set}"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let (_, read) = api.call("GET", "/api/sandbox/arch", None).await;
        assert_eq!(read["autoArchiveInterval"], kept, "set {set}");
    }
}

#[tokio::test]
async fn setters() {
    let api = api().await;
    api.call("POST", "/api/sandbox", Some(json!({"name": "s"})))
        .await;
    let (status, labels) = api
        .call(
            "PUT",
            "/api/sandbox/s/labels",
            Some(json!({"labels": {"x": "y"}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(labels, json!({"labels": {"x": "y"}}));
    let (status, _) = api.call("POST", "/api/sandbox/s/autostop/30", None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = api.call("POST", "/api/sandbox/s/autodelete/-1", None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = api.call("POST", "/api/sandbox/s/ttl/60", None).await;
    assert_eq!(status, StatusCode::OK);
    let (_, s) = api.call("GET", "/api/sandbox/s", None).await;
    assert_eq!(
        (s["autoStopInterval"].as_i64(), s["ttlMinutes"].as_i64()),
        (Some(30), Some(60))
    );
    let (status, body) = api.call("POST", "/api/sandbox/s/autopause/10", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, _) = api.call("POST", "/api/sandbox/s/autostop/soon", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = api.call("POST", "/api/sandbox/s/autodelete/-5", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn unimplemented_operations_answer_501_by_name() {
    let api = api().await;
    api.call("POST", "/api/sandbox", Some(json!({"name": "p"})))
        .await;
    let (status, body) = api
        .call("GET", "/api/docker-registry/registry-push-access", None)
        .await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
    assert_eq!(
        body["message"],
        "GET /docker-registry/registry-push-access is not implemented by cove yet"
    );
    // A container cannot pause: a clear 400, not a 501.
    let (status, body) = api.call("POST", "/api/sandbox/p/pause", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body["message"].as_str().unwrap().contains("pause"));
    let (status, _) = api.call("GET", "/api/definitely/not/here", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn config_validates_as_the_sdk_expects() {
    let api = api().await;
    let (status, config) = api.call("GET", "/api/config", None).await;
    assert_eq!(status, StatusCode::OK);
    for key in [
        "version",
        "proxyToolboxUrl",
        "defaultSnapshot",
        "dashboardUrl",
        "environment",
        "proxyTemplateUrl",
    ] {
        assert!(config[key].is_string(), "{key}");
    }
    assert_eq!(config["maintananceMode"], false);
    assert!(config["oidc"]["provider"].is_string());
    // The fake runtime names no accelerator.
    assert_eq!(config["coveVmAccelerator"], Value::Null);
}

#[tokio::test]
async fn vm_pause_resume_fork_over_http() {
    let api = api().await;
    let (status, vm) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "vm", "snapshot": "daytona-vm-small", "autoPauseInterval": 30})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{vm}");
    assert_eq!(vm["sandboxClass"], "linux-vm");
    assert_eq!(vm["persistent"], true);
    assert_eq!(
        (
            vm["autoPauseInterval"].as_i64(),
            vm["autoStopInterval"].as_i64()
        ),
        (Some(30), Some(0))
    );

    let (status, body) = api.call("POST", "/api/sandbox/vm/pause", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["state"], "paused");
    let (status, body) = api.call("POST", "/api/vms/vm/resume", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["state"], "started");
    let (_, body) = api.call("POST", "/api/vms/vm/pause", None).await;
    assert_eq!(body["state"], "paused");
    // Seed 001: start on a paused VM boots from disk and drops the memory.
    let (_, body) = api.call("POST", "/api/vms/vm/start", None).await;
    assert_eq!(body["state"], "started");
    assert!(api
        .fake
        .calls()
        .iter()
        .any(|c| c.starts_with("discard-memory")));

    let (status, child) = api
        .call("POST", "/api/sandbox/vm/fork", Some(json!({"name": "kid"})))
        .await;
    assert_eq!(status, StatusCode::OK, "{child}");
    assert_eq!(child["name"], "kid");
    assert_eq!(child["state"], "started");
    assert_eq!(child["parentSandboxId"], vm["id"]);
    let (_, forks) = api.call("GET", "/api/sandbox/vm/forks", None).await;
    assert_eq!(forks.as_array().unwrap().len(), 1);
    assert_eq!(forks[0]["name"], "kid");
    let (_, parent) = api.call("GET", "/api/sandbox/kid/parent", None).await;
    assert_eq!(parent["id"], vm["id"]);
    let (_, ancestors) = api.call("GET", "/api/sandbox/kid/ancestors", None).await;
    assert_eq!(ancestors[0]["id"], vm["id"]);

    let (status, body) = api.call("DELETE", "/api/sandbox/vm", None).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body["message"].as_str().unwrap().contains("kid"), "{body}");

    // Not persistent: pause is a 409 that says why.
    api.call(
        "POST",
        "/api/sandbox",
        Some(json!({"name": "eph", "snapshot": "daytona-vm-small", "ephemeral": true})),
    )
    .await;
    let (status, body) = api.call("POST", "/api/vms/eph/pause", None).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body["message"].as_str().unwrap().contains("persistent"));

    // kvm inside a sandbox is a 400 that says why; Windows is not registered.
    let (status, body) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "k", "kvm": true})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["message"].as_str().unwrap().contains("nested"));
    let (status, body) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"snapshot": "windows-small"})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["message"].as_str().unwrap().contains("Windows"));

    // Spot reclaim (extension): the spot VM is paused, not deleted.
    api.call(
        "POST",
        "/api/sandbox",
        Some(json!({"name": "sp", "snapshot": "daytona-vm-small", "spot": true})),
    )
    .await;
    let (status, body) = api.call("POST", "/api/admin/reclaim", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body[0]["action"], "paused");
    let (_, sp) = api.call("GET", "/api/sandbox/sp", None).await;
    assert_eq!(sp["state"], "paused");
}

impl Api {
    /// A request without the API key unless `headers` carry one.
    async fn send(
        &self,
        method: &str,
        host: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> (StatusCode, axum::http::HeaderMap, Value) {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", host);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = self
            .router
            .clone()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            headers,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }
}

fn message(body: &Value) -> &str {
    body["message"].as_str().unwrap_or_default()
}

/// The fake runtime's agent socket does not exist, so a preview that passes
/// every check ends in a 502 naming the agent: that is how these tests see
/// that a request got through.
fn got_through(status: StatusCode, body: &Value) -> bool {
    status == StatusCode::BAD_GATEWAY && message(body).contains("agent")
}

#[tokio::test]
async fn preview_urls_and_their_tokens() {
    let api = api().await;
    let (_, s) = api
        .call("POST", "/api/sandbox", Some(json!({"name": "web"})))
        .await;
    let id = s["id"].as_str().unwrap();
    for port in ["0", "65536", "http"] {
        let (status, body) = api
            .call(
                "GET",
                &format!("/api/sandbox/web/ports/{port}/preview-url"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(message(&body).contains(port), "{body}");
    }
    let (status, preview) = api
        .call("GET", "/api/sandbox/web/ports/3000/preview-url", None)
        .await;
    assert_eq!(status, StatusCode::OK, "{preview}");
    assert_eq!(preview["sandboxId"], id);
    // Host-based (the test server has a preview domain), on the listen port.
    assert_eq!(
        preview["url"],
        format!("http://3000-{id}.preview.localhost:3000")
    );
    let token = preview["token"].as_str().unwrap();
    let (_, again) = api
        .call(
            "GET",
            &format!("/api/sandbox/{id}/ports/8080/preview-url"),
            None,
        )
        .await;
    assert_eq!(again["token"], token, "one stable token per sandbox");
    let (status, _) = api
        .call("GET", "/api/sandbox/nothing/ports/3000/preview-url", None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn private_previews_need_the_token_or_a_key() {
    let api = api().await;
    let (_, s) = api
        .call("POST", "/api/sandbox", Some(json!({"name": "web"})))
        .await;
    let id = s["id"].as_str().unwrap().to_owned();
    let (_, preview) = api
        .call("GET", "/api/sandbox/web/ports/3000/preview-url", None)
        .await;
    let token = preview["token"].as_str().unwrap().to_owned();
    let host = format!("3000-{id}.preview.localhost:3000");
    let path = format!("/preview/{id}/3000/index.html");

    // Host-based requests are previews whatever their path, even /api/...
    for (host, path) in [
        (host.as_str(), "/api/sandbox"),
        ("cove.test:3000", path.as_str()),
    ] {
        let (status, _, body) = api.send("GET", host, path, &[]).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        assert!(message(&body).contains("X-Daytona-Preview-Token"), "{body}");
        let (status, _, body) = api
            .send("GET", host, path, &[("x-daytona-preview-token", "wrong")])
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        assert!(message(&body).contains("wrong preview token"), "{body}");
        let (status, _, body) = api
            .send("GET", host, path, &[("x-daytona-preview-token", &token)])
            .await;
        assert!(got_through(status, &body), "{status} {body}");
        let (status, _, body) = api
            .send(
                "GET",
                host,
                path,
                &[("authorization", &format!("Bearer {KEY}"))],
            )
            .await;
        assert!(got_through(status, &body), "{status} {body}");
        let (status, _, _) = api
            .send("GET", host, path, &[("authorization", "Bearer nope")])
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }

    // A public sandbox needs nothing.
    let (status, _) = api.call("POST", "/api/sandbox/web/public/true", None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, body) = api.send("GET", &host, "/", &[]).await;
    assert!(got_through(status, &body), "{status} {body}");

    // The bare path is redirected to the directory form, query kept.
    let (status, headers, _) = api
        .send(
            "GET",
            "cove.test:3000",
            &format!("/preview/{id}/3000?a=1"),
            &[],
        )
        .await;
    assert_eq!(status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(headers["location"], format!("/preview/{id}/3000/?a=1"));
    let (status, _, body) = api
        .send(
            "GET",
            "cove.test:3000",
            &format!("/preview/{id}/99999/"),
            &[],
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(message(&body).contains("99999"));

    // A stopped sandbox says so.
    api.call("POST", "/api/sandbox/web/stop", None).await;
    let (status, _, body) = api.send("GET", &host, "/", &[]).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(message(&body).contains("start it first"), "{body}");
}

#[tokio::test]
async fn previews_do_not_reset_the_idle_clock() {
    let api = api().await;
    let (_, s) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "web", "public": true})),
        )
        .await;
    let id = s["id"].as_str().unwrap().to_owned();
    let before = s["lastActivityAt"].clone();
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let (status, _, body) = api
        .send(
            "GET",
            "cove.test:3000",
            &format!("/preview/{id}/3000/"),
            &[],
        )
        .await;
    assert!(got_through(status, &body), "{status} {body}");
    let (_, after) = api.call("GET", "/api/sandbox/web", None).await;
    assert_eq!(after["lastActivityAt"], before);
    // The toolbox does reset it (the comparison that makes the above mean something).
    api.call("GET", &format!("/toolbox/{id}/version"), None)
        .await;
    let (_, touched) = api.call("GET", "/api/sandbox/web", None).await;
    assert_ne!(touched["lastActivityAt"], before);
}

#[tokio::test]
async fn signed_preview_urls_work_until_they_expire() {
    let api = api().await;
    let (_, s) = api
        .call("POST", "/api/sandbox", Some(json!({"name": "web"})))
        .await;
    let id = s["id"].as_str().unwrap().to_owned();
    for bad in ["0", "86401", "soon"] {
        let (status, body) = api
            .call(
                "GET",
                &format!("/api/sandbox/web/ports/3000/signed-preview-url?expiresInSeconds={bad}"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(message(&body).contains("expiresInSeconds"));
    }
    let (status, signed) = api
        .call(
            "GET",
            "/api/sandbox/web/ports/3000/signed-preview-url?expiresInSeconds=600",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{signed}");
    assert_eq!(signed["sandboxId"], id);
    assert_eq!(signed["port"], 3000);
    let token = signed["token"].as_str().unwrap().to_owned();
    assert_eq!(
        signed["url"],
        format!("http://3000-{token}.preview.localhost:3000")
    );
    let host = format!("3000-{token}.preview.localhost");
    let (status, _, body) = api.send("GET", &host, "/", &[]).await;
    assert!(got_through(status, &body), "{status} {body}");
    let (status, _, body) = api
        .send("GET", "cove.test", &format!("/preview/{token}/3000/x"), &[])
        .await;
    assert!(got_through(status, &body), "{status} {body}");
    // Only for its own port.
    let (status, _, body) = api
        .send("GET", &format!("3001-{token}.preview.localhost"), "/", &[])
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");

    let expire = format!("/api/sandbox/web/ports/3000/signed-preview-url/{token}/expire");
    let (status, _) = api.call("POST", &expire, None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, body) = api.send("GET", &host, "/", &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert!(message(&body).contains("expired"), "{body}");
    let (status, _) = api
        .call(
            "POST",
            "/api/sandbox/web/ports/3001/signed-preview-url/abc/expire",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // One that runs out by itself.
    let (_, short) = api
        .call(
            "GET",
            "/api/sandbox/web/ports/3000/signed-preview-url?expiresInSeconds=1",
            None,
        )
        .await;
    let host = format!(
        "3000-{}.preview.localhost",
        short["token"].as_str().unwrap()
    );
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let (status, _, body) = api.send("GET", &host, "/", &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert!(message(&body).contains("expired"), "{body}");
}

#[tokio::test]
async fn ssh_access_over_http() {
    let api = api().await;
    let (_, s) = api
        .call("POST", "/api/sandbox", Some(json!({"name": "ssh-box"})))
        .await;
    let id = s["id"].as_str().unwrap().to_owned();

    let (status, access) = api
        .call(
            "POST",
            "/api/sandbox/ssh-box/ssh-access?expiresInMinutes=30",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{access}");
    for key in [
        "id",
        "sandboxId",
        "token",
        "expiresAt",
        "createdAt",
        "updatedAt",
        "sshCommand",
    ] {
        assert!(access[key].is_string(), "{key} missing in {access}");
    }
    assert_eq!(access["sandboxId"], id.as_str());
    let token = access["token"].as_str().unwrap().to_owned();
    // The host the client used, the gateway's port.
    assert_eq!(
        access["sshCommand"],
        format!("ssh {token}@cove.test -p 2222").as_str()
    );

    let validate = |token: String| {
        let api = &api;
        async move {
            api.call(
                "GET",
                &format!("/api/sandbox/ssh-access/validate?token={token}"),
                None,
            )
            .await
        }
    };
    let (status, valid) = validate(token.clone()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(valid, json!({"valid": true, "sandboxId": id}));
    let (_, invalid) = validate("not-a-token".into()).await;
    assert_eq!(invalid, json!({"valid": false, "sandboxId": ""}));

    // Revoking one token answers with the sandbox; the token is then invalid.
    let (status, sandbox) = api
        .call(
            "DELETE",
            &format!("/api/sandbox/{id}/ssh-access?token={token}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{sandbox}");
    assert_eq!(sandbox["id"], id.as_str());
    assert_eq!(validate(token).await.1["valid"], false);

    // Without a token, every token of the sandbox goes.
    let (_, a) = api
        .call("POST", "/api/sandbox/ssh-box/ssh-access", None)
        .await;
    let (_, b) = api
        .call("POST", "/api/sandbox/ssh-box/ssh-access", None)
        .await;
    let (status, _) = api
        .call("DELETE", "/api/sandbox/ssh-box/ssh-access", None)
        .await;
    assert_eq!(status, StatusCode::OK);
    for access in [a, b] {
        let token = access["token"].as_str().unwrap().to_owned();
        assert_eq!(validate(token).await.1["valid"], false);
    }
}

#[tokio::test]
async fn ssh_access_refusals() {
    let api = api().await;
    api.call("POST", "/api/sandbox", Some(json!({"name": "ssh-box"})))
        .await;
    for query in ["0", "-5", "99999999", "1.5", "soon"] {
        let (status, body) = api
            .call(
                "POST",
                &format!("/api/sandbox/ssh-box/ssh-access?expiresInMinutes={query}"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {body}");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("expiresInMinutes"),
            "{body}"
        );
    }
    for (method, path) in [
        ("POST", "/api/sandbox/nope/ssh-access"),
        ("DELETE", "/api/sandbox/nope/ssh-access"),
    ] {
        let (status, _) = api.call(method, path, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{method} {path}");
    }
    let (status, _) = api
        .call("GET", "/api/sandbox/ssh-access/validate", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // Like every other route, these need the API key.
    let (status, _) = api
        .call_with_key(
            "GET",
            "/api/sandbox/ssh-access/validate?token=x",
            None,
            None,
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn inactive_snapshots_refuse_new_sandboxes_until_activated() {
    let api = api().await;
    api.call("POST", "/api/sandbox", Some(json!({"name": "src"})))
        .await;
    let (status, _) = api
        .call(
            "POST",
            "/api/sandbox/src/snapshot",
            Some(json!({"name": "snap"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = api.call("POST", "/api/snapshots/snap/activate", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message(&body).contains("only an inactive"), "{body}");

    let (status, _) = api
        .call("POST", "/api/snapshots/snap/deactivate", None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (_, got) = api.call("GET", "/api/snapshots/snap", None).await;
    assert_eq!(got["state"], "inactive");
    let before = api.call("GET", "/api/sandbox", None).await.1;
    let (status, body) = api
        .call("POST", "/api/sandbox", Some(json!({"snapshot": "snap"})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        message(&body).contains("snap is inactive") && message(&body).contains("activate"),
        "{body}"
    );
    assert_eq!(api.call("GET", "/api/sandbox", None).await.1, before);
    // The server's own image stays active.
    let (status, _) = api
        .call("POST", "/api/snapshots/cove-default/deactivate", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let (status, activated) = api.call("POST", "/api/snapshots/snap/activate", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(activated["state"], "active");
    let (status, _) = api
        .call("POST", "/api/sandbox", Some(json!({"snapshot": "snap"})))
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = api
        .call("POST", "/api/snapshots/ghost/activate", None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn docker_registries_keep_their_password_to_themselves() {
    let api = api().await;
    let (status, created) = api
        .call(
            "POST",
            "/api/docker-registry",
            Some(json!({"name": "local", "url": "http://127.0.0.1:5000", "username": "u", "password": "s3cret"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["registryType"], "organization");
    assert_eq!(created["project"], "");
    assert!(!created.to_string().contains("s3cret"), "{created}");
    let id = created["id"].as_str().unwrap();

    let (status, listed) = api.call("GET", "/api/docker-registry", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert!(!listed.to_string().contains("s3cret"));

    let (status, updated) = api
        .call(
            "PATCH",
            &format!("/api/docker-registry/{id}"),
            Some(json!({"name": "renamed", "url": "127.0.0.1:5000", "username": "v"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{updated}");
    assert_eq!(updated["name"], "renamed");
    assert_eq!(updated["username"], "v");
    let (_, got) = api
        .call("GET", &format!("/api/docker-registry/{id}"), None)
        .await;
    assert_eq!(got["name"], "renamed");

    for (body, field) in [
        (
            json!({"name": "x", "url": "not a host", "username": "u", "password": "p"}),
            "url",
        ),
        (
            json!({"name": "x", "url": "h:1", "username": "u"}),
            "password",
        ),
        (
            json!({"name": "", "url": "h:1", "username": "u", "password": "p"}),
            "name",
        ),
    ] {
        let (status, answer) = api.call("POST", "/api/docker-registry", Some(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
        assert!(message(&answer).contains(field), "{answer}");
    }
    let (_, listed) = api.call("GET", "/api/docker-registry", None).await;
    assert_eq!(listed.as_array().unwrap().len(), 1, "nothing half-made");

    let (status, _) = api
        .call("GET", "/api/docker-registry/registry-push-access", None)
        .await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
    let (status, _) = api
        .call("DELETE", &format!("/api/docker-registry/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, body) = api
        .call("GET", &format!("/api/docker-registry/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(message(&body).contains("not found"));
}

#[tokio::test]
async fn push_access_needs_https_and_uploads_need_its_signature() {
    // Without an HTTPS listener the SDK's S3 client could not upload: say so.
    let plain = api().await;
    let (status, body) = plain
        .call("GET", "/api/object-storage/push-access", None)
        .await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
    assert!(
        body["message"].as_str().unwrap().contains("--tls-listen"),
        "{body}"
    );

    let api = api_with_tls(Some(3443)).await;
    let (status, access) = api
        .call("GET", "/api/object-storage/push-access", None)
        .await;
    assert_eq!(status, StatusCode::OK, "{access}");
    assert_eq!(
        access["storageUrl"],
        "https://cove.test:3443/object-storage"
    );
    assert_eq!(access["bucket"], "cove-build-contexts");
    assert_eq!(access["organizationId"], "cove");
    for field in ["accessKey", "secret", "sessionToken", "region"] {
        assert!(!access[field].as_str().unwrap().is_empty(), "{field}");
    }
    let (status, again) = api
        .call("GET", "/api/object-storage/push-access", None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_ne!(again["secret"], access["secret"]);

    // An unsigned upload, or one signed with an unknown key, is refused
    // with S3's error codes, and nothing is stored.
    let key = "/object-storage/cove-build-contexts/cove/0123456789abcdef/context.tar";
    for (authorization, code) in [
        (None, "AccessDenied"),
        (
            Some(
                "AWS4-HMAC-SHA256 Credential=NOPE/20261201/us-east-1/s3/aws4_request, \
                 SignedHeaders=host;x-amz-date, Signature=00",
            ),
            "InvalidAccessKeyId",
        ),
    ] {
        let mut request = Request::builder()
            .method("PUT")
            .uri(key)
            .header("host", "cove.test:3443");
        if let Some(authorization) = authorization {
            request = request.header("authorization", authorization);
        }
        let response = api
            .router
            .clone()
            .oneshot(request.body(Body::from("data")).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body);
        assert!(body.contains(&format!("<Code>{code}</Code>")), "{body}");
    }
    assert!(!api._dir.path().join("contexts/0123456789abcdef").exists());
}

#[tokio::test]
async fn keys_carry_their_permissions_and_are_shown_once() {
    let api = api().await;
    let create = |name: &str, permissions: Value| json!({"name": name, "permissions": permissions});

    // The operator makes a key that may write sandboxes but not delete them.
    let (status, made) = api
        .call(
            "POST",
            "/api/api-keys",
            Some(create("ci", json!(["write:sandboxes"]))),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{made}");
    let ci = made["value"].as_str().unwrap().to_owned();
    assert!(ci.starts_with("cove_"), "{made}");
    assert_eq!(made["permissions"], json!(["write:sandboxes"]));
    assert_eq!(made["expiresAt"], Value::Null);

    // Its value never appears again: listings and gets are masked.
    let (status, listed) = api.call("GET", "/api/api-keys", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!listed.to_string().contains(&ci), "{listed}");
    let entry = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == "ci")
        .expect("the new key is listed");
    assert_eq!(entry["userId"], "operator");
    assert!(entry["value"].as_str().unwrap().contains("****"));
    let (_, got) = api
        .call_with_key("GET", "/api/api-keys/current", None, Some(&ci))
        .await;
    assert_eq!(got["name"], "ci");
    assert!(!got.to_string().contains(&ci));
    assert!(got["lastUsedAt"].is_string(), "a use is recorded: {got}");

    // What it may do, it does; what it may not is a 403 naming the permission.
    let (status, sandbox) = api
        .call_with_key("POST", "/api/sandbox", Some(json!({})), Some(&ci))
        .await;
    assert_eq!(status, StatusCode::OK, "{sandbox}");
    let id = sandbox["id"].as_str().unwrap();
    let (status, refused) = api
        .call_with_key("DELETE", &format!("/api/sandbox/{id}"), None, Some(&ci))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(
        refused["message"],
        "this API key lacks the permission delete:sandboxes"
    );
    for (method, path, permission) in [
        ("GET", "/api/volumes", "read:volumes"),
        ("POST", "/api/snapshots", "write:snapshots"),
        ("POST", "/api/api-keys", "manage:api_keys"),
    ] {
        let (status, refused) = api
            .call_with_key(method, path, Some(create("x", json!([]))), Some(&ci))
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{method} {path}");
        assert!(
            refused["message"].as_str().unwrap().ends_with(permission),
            "{refused}"
        );
    }
    let (status, _) = api
        .call_with_key("POST", "/api/admin/reclaim", None, Some(&ci))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    // A key that manages keys gives no more than it has.
    let (_, made) = api
        .call(
            "POST",
            "/api/api-keys",
            Some(create("keys", json!(["manage:api_keys"]))),
        )
        .await;
    let keys = made["value"].as_str().unwrap().to_owned();
    let (status, refused) = api
        .call_with_key(
            "POST",
            "/api/api-keys",
            Some(create("wider", json!(["delete:sandboxes"]))),
            Some(&keys),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(refused["message"]
        .as_str()
        .unwrap()
        .contains("delete:sandboxes"));

    // Bad requests say what is wrong and make nothing.
    for (body, needle) in [
        (create("ci", json!([])), "already exists"),
        (create("", json!([])), "name"),
        (create("y", json!(["write:everything"])), "write:everything"),
        (
            json!({"name": "old", "permissions": [], "expiresAt": "2020-01-01T00:00:00Z"}),
            "expiresAt",
        ),
        (
            json!({"name": "t", "permissions": [], "expiresAt": "tomorrow"}),
            "expiresAt",
        ),
    ] {
        let (status, refused) = api.call("POST", "/api/api-keys", Some(body.clone())).await;
        assert!(status.is_client_error(), "{body}: {status}");
        assert!(
            refused["message"].as_str().unwrap().contains(needle),
            "{refused}"
        );
    }
    let (_, listed) = api.call("GET", "/api/api-keys", None).await;
    let names: Vec<_> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["name"].clone())
        .collect();
    assert_eq!(names, [json!("ci"), json!("keys")]);

    // A deleted key is refused from then on.
    let (status, _) = api.call("DELETE", "/api/api-keys/ci", None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = api
        .call_with_key("GET", "/api/sandbox", None, Some(&ci))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = api.call("GET", "/api/api-keys/ci", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (status, me) = api.call("GET", "/api/users/me", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(me["id"], "operator");
}

#[tokio::test]
async fn expired_keys_are_refused_by_name() {
    let api = api().await;
    let soon = time::OffsetDateTime::now_utc() + time::Duration::seconds(3);
    let at = soon
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    let (status, made) = api
        .call(
            "POST",
            "/api/api-keys",
            Some(json!({"name": "brief", "permissions": [], "expiresAt": at})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{made}");
    let brief = made["value"].as_str().unwrap().to_owned();
    let (status, _) = api
        .call_with_key("GET", "/api/sandbox", None, Some(&brief))
        .await;
    assert_eq!(status, StatusCode::OK);
    let left = soon - time::OffsetDateTime::now_utc() + time::Duration::milliseconds(100);
    tokio::time::sleep(left.try_into().unwrap_or_default()).await;
    let (status, refused) = api
        .call_with_key("GET", "/api/sandbox", None, Some(&brief))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(refused["message"], "API key brief has expired");
}

#[tokio::test]
async fn the_audit_log_says_which_key_did_what_and_how_it_ended() {
    let api = api().await;
    let ci = api.key("ci", json!(["write:sandboxes"])).await;
    let (status, sandbox) = api
        .call_with_key("POST", "/api/sandbox", Some(json!({})), Some(&ci))
        .await;
    assert_eq!(status, StatusCode::OK);
    let id = sandbox["id"].as_str().unwrap().to_owned();
    let (status, _) = api
        .call_with_key("DELETE", &format!("/api/sandbox/{id}"), None, Some(&ci))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _) = api
        .call("POST", &format!("/api/sandbox/{id}/stop"), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    api.call("GET", &format!("/api/sandbox/{id}"), None).await;

    // Reading the log is `read:audit_logs`; the whole log the operator's.
    for path in ["/api/audit/organizations/cove", "/api/admin/audit"] {
        let (status, _) = api.call_with_key("GET", path, None, Some(&ci)).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{path}");
    }
    let (status, log) = api.call("GET", "/api/audit/organizations/cove", None).await;
    assert_eq!(status, StatusCode::OK, "{log}");
    let rows: Vec<(String, String, String, u64)> = log["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| {
            let key = item["metadata"]["apiKeyName"].as_str().unwrap().to_owned();
            let action = format!(
                "{} {}",
                item["action"].as_str().unwrap(),
                item["targetType"].as_str().unwrap()
            );
            let target = item["targetId"].as_str().unwrap_or_default().to_owned();
            (key, action, target, item["statusCode"].as_u64().unwrap())
        })
        .collect();
    let row = |key: &str, action: &str, target: &str, status: u64| {
        (key.to_owned(), action.to_owned(), target.to_owned(), status)
    };
    // Newest first; reads and the refused reads of the log are not changes.
    assert_eq!(
        rows,
        [
            row("COVE_API_KEY", "stop sandbox", &id, 200),
            row("ci", "delete sandbox", &id, 403),
            row("ci", "create sandbox", &id, 200),
            row("COVE_API_KEY", "create api_key", "ci", 201),
        ]
    );
    let refused = &log["items"][1];
    assert_eq!(
        refused["errorMessage"],
        "this API key lacks the permission delete:sandboxes"
    );
    assert!(ci.starts_with(refused["actorApiKeyPrefix"].as_str().unwrap()));
    assert!(ci.ends_with(refused["actorApiKeySuffix"].as_str().unwrap()));
    assert!(
        !log.to_string().contains(&ci),
        "the key's value is in the log"
    );
    assert_eq!(
        (log["total"].as_u64(), log["totalPages"].as_u64()),
        (Some(4), Some(1))
    );

    let (_, page) = api
        .call(
            "GET",
            "/api/audit/organizations/cove?action=delete&limit=1",
            None,
        )
        .await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert_eq!(page["items"][0]["statusCode"], 403);
    let (status, _) = api
        .call("GET", "/api/audit/organizations/other", None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, refused) = api.call("GET", "/api/admin/audit?actorEmail=x", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(refused["message"].as_str().unwrap().contains("actorEmail"));
}

#[tokio::test]
async fn the_bill_counts_running_time_only_and_survives_a_restart() {
    let (api, _) = api_in(tempfile::tempdir().unwrap(), None).await;
    let before_create = std::time::Instant::now();
    let (status, made) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "metered", "cpu": 2, "memory": 2, "disk": 4})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{made}");
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let (status, _) = api.call("POST", "/api/sandbox/metered/stop", None).await;
    assert_eq!(status, StatusCode::OK);
    let ran_at_most = before_create.elapsed().as_secs_f64();

    // The server stops and starts again on the same store; the sandbox
    // stays stopped for a while.
    let Api { _dir: dir, .. } = api;
    let (api, engine) = api_in(dir, None).await;
    engine.recover_after_restart().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;

    let (status, bill) = api.call("GET", "/api/organizations/cove/bill", None).await;
    assert_eq!(status, StatusCode::OK, "{bill}");
    let lines = bill["lines"].as_array().unwrap();
    let line = lines
        .iter()
        .find(|l| l["name"] == "metered")
        .unwrap_or_else(|| panic!("a line for the sandbox: {bill}"));
    assert_eq!(line["sandboxId"], made["id"]);
    // Two vCPUs for the 0.4 s or so it ran, and not while it was stopped.
    let vcpu_seconds = line["vcpuHours"].as_f64().unwrap() * 3600.0;
    assert!(
        vcpu_seconds >= 2.0 * 0.4 && vcpu_seconds <= 2.0 * ran_at_most,
        "{vcpu_seconds} vCPU-seconds for at most {ran_at_most} s of running: {bill}"
    );
    let memory_seconds = line["memoryGbHours"].as_f64().unwrap() * 3600.0;
    assert!((memory_seconds - vcpu_seconds).abs() < 1e-6, "{bill}");
    // The disk is kept while stopped too, across the restart.
    let disk_seconds = line["diskGbHours"].as_f64().unwrap() * 3600.0;
    assert!(disk_seconds >= 4.0 * (0.4 + 0.3), "{bill}");

    // A stopped sandbox's compute does not grow.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (_, again) = api.call("GET", "/api/organizations/cove/bill", None).await;
    let same = again["lines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "metered")
        .unwrap();
    assert_eq!(same["vcpuHours"], line["vcpuHours"]);

    // The total is the lines at the bill's prices, less the credits, never
    // below zero.
    let prices = &bill["prices"];
    let price = |key: &str| prices[key].as_f64().unwrap();
    let mut sum = 0.0;
    for line in lines {
        let figure = |key: &str| line[key].as_f64().unwrap();
        let amount = figure("vcpuHours") * price("vcpuHour")
            + figure("memoryGbHours") * price("memoryGbHour")
            + figure("diskGbHours") * price("diskGbHour")
            + figure("snapshotGbMonths") * price("snapshotGbMonth");
        assert!((amount - figure("amount")).abs() < 1e-12, "{line}");
        sum += amount;
    }
    let total = bill["total"].as_f64().unwrap();
    let credits = bill["credits"].as_f64().unwrap();
    assert!((total - (sum - credits).max(0.0)).abs() < 1e-12, "{bill}");
    assert_eq!(bill["currency"], "USD");
}

#[tokio::test]
async fn a_bill_needs_read_billing_and_a_known_organization_and_period() {
    let api = api().await;
    let ops = api.key("ops", json!(["write:sandboxes"])).await;
    let (status, body) = api
        .call_with_key("GET", "/api/organizations/cove/bill", None, Some(&ops))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(message(&body).contains("read:billing"), "{body}");
    let (status, body) = api
        .call("GET", "/api/organizations/elsewhere/bill", None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(message(&body), "organization elsewhere not found");
    let (status, body) = api
        .call("GET", "/api/organizations/cove/bill?month=2026-13", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message(&body).contains("YYYY-MM"), "{body}");
    for period in [
        "from=1970-01-01T00:00:00Z&to=9999-12-31T00:00:00Z",
        "month=9999-12",
    ] {
        let (status, body) = api
            .call(
                "GET",
                &format!("/api/organizations/cove/bill?{period}"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{period}: {body}");
        assert!(message(&body).contains("at most ten years"), "{body}");
    }
    let (status, body) = api
        .call("GET", "/api/organizations/cove/bill?month=2026-11", None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["from"], "2026-11-01T00:00:00Z");
    assert_eq!(body["to"], "2026-12-01T00:00:00Z");
}

#[tokio::test]
async fn the_running_limit_counts_running_sandboxes_and_frees_on_stop_or_pause() {
    let api = api().await;
    let quota = "/api/admin/organizations/cove/quota/us";
    let (status, body) = api
        .call("PATCH", quota, Some(json!({"maxRunningSandboxes": 1})))
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let create = |name: &str, snapshot: &str| json!({"name": name, "snapshot": snapshot, "cpu": 2});
    let (status, body) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(create("vm", "daytona-vm-small")),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // A second is refused, naming the quota, its limit and the use; it
    // leaves no sandbox behind.
    let (status, body) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(create("second", "cove-default")),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(
        message(&body).contains("maxRunningSandboxes is 1"),
        "{body}"
    );
    let (status, _) = api.call("GET", "/api/sandbox/second", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (_, usage) = api.call("GET", "/api/organizations/cove/usage", None).await;
    let region = &usage["regionUsage"][0];
    assert_eq!(region["regionId"], "us");
    assert_eq!(region["currentCpuUsage"], 2);
    assert_eq!(region["currentRunningSandboxes"], 1);
    assert_eq!(region["maxRunningSandboxes"], 1);
    assert_eq!(region["totalCpuQuota"], Value::Null);

    // Pausing the VM frees its slot; starting it again is then refused
    // while another runs, and it stays paused.
    let (status, _) = api.call("POST", "/api/sandbox/vm/pause", None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(create("second", "cove-default")),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = api.call("POST", "/api/sandbox/vm/start", None).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let (_, vm) = api.call("GET", "/api/sandbox/vm", None).await;
    assert_eq!(vm["state"], "paused");

    // Stopping the other frees it again; a limit lifted with null is gone.
    let (status, _) = api.call("POST", "/api/sandbox/second/stop", None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = api.call("POST", "/api/sandbox/vm/start", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _) = api
        .call("PATCH", quota, Some(json!({"maxRunningSandboxes": null})))
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, body) = api.call("POST", "/api/sandbox/second/start", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, usage) = api.call("GET", "/api/organizations/cove/usage", None).await;
    assert_eq!(usage["regionUsage"][0]["currentRunningSandboxes"], 2);
    assert_eq!(usage["regionUsage"][0]["maxRunningSandboxes"], Value::Null);
}

#[tokio::test]
async fn quotas_are_the_operators_and_refuse_what_cove_cannot_keep() {
    let api = api().await;
    let quota = "/api/admin/organizations/cove/quota/us";
    let user = api
        .key("all", json!(["write:sandboxes", "read:billing"]))
        .await;
    let (status, _) = api
        .call_with_key(
            "PATCH",
            quota,
            Some(json!({"maxRunningSandboxes": 5})),
            Some(&user),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    for (body, says) in [
        (json!({"totalGpuQuota": 1}), "totalGpuQuota"),
        (json!({"totalCpuQuota": 1.5}), "whole number"),
        (json!({"maxRunningSandboxes": -1}), "zero or more"),
    ] {
        let (status, answer) = api.call("PATCH", quota, Some(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
        assert!(message(&answer).contains(says), "{answer}");
    }
    let (status, _) = api
        .call(
            "PATCH",
            "/api/admin/organizations/cove/quota/us-east",
            Some(json!({})),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // A per-sandbox ceiling is a 400 at create, not a quietly smaller sandbox.
    let (status, _) = api
        .call("PATCH", quota, Some(json!({"maxCpuPerSandbox": 1})))
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, body) = api
        .call("POST", "/api/sandbox", Some(json!({"cpu": 2})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(message(&body).contains("maxCpuPerSandbox of 1"), "{body}");
}

#[tokio::test]
async fn a_fork_into_many_answers_every_child_or_a_clear_400() {
    let api = api().await;
    let (status, vm) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "vm", "snapshot": "daytona-vm-small"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{vm}");
    let (status, children) = api
        .call("POST", "/api/sandbox/vm/forks", Some(json!({"count": 3})))
        .await;
    assert_eq!(status, StatusCode::OK, "{children}");
    let children = children.as_array().unwrap();
    assert_eq!(children.len(), 3);
    for child in children {
        assert_eq!(child["state"], "started");
        assert_eq!(child["parentSandboxId"], vm["id"]);
    }
    let (status, named) = api
        .call(
            "POST",
            "/api/sandbox/vm/forks",
            Some(json!({"names": ["n1", "n2"]})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{named}");
    assert_eq!(
        (named[0]["name"].as_str(), named[1]["name"].as_str()),
        (Some("n1"), Some("n2"))
    );
    let (_, forks) = api.call("GET", "/api/sandbox/vm/forks", None).await;
    assert_eq!(forks.as_array().unwrap().len(), 5);

    for (body, says) in [
        (json!({}), "say how many children"),
        (json!({"count": 0}), "count must be 1 to 32, not 0"),
        (json!({"count": 33}), "not 33"),
        (json!({"count": -1}), "count"),
        (
            json!({"count": 2, "names": ["a"]}),
            "count 2 differs from the 1 names",
        ),
        (json!({"names": ["a", "a"]}), "the name a is given twice"),
        (json!({"cuont": 2}), "cuont"),
    ] {
        let (status, answer) = api
            .call("POST", "/api/sandbox/vm/forks", Some(body.clone()))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert!(message(&answer).contains(says), "{body}: {answer}");
    }
    // Refusals made nothing.
    let (_, forks) = api.call("GET", "/api/sandbox/vm/forks", None).await;
    assert_eq!(forks.as_array().unwrap().len(), 5);
}

#[tokio::test]
async fn each_child_of_a_fork_into_many_counts_against_the_create_rate_limit() {
    let api = api().await;
    let (status, body) = api
        .call(
            "PATCH",
            "/api/organizations/cove/quota",
            Some(json!({"sandboxCreateRateLimit": 4, "sandboxCreateRateLimitTtlSeconds": 60})),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let agent = api.key("agent", json!(["write:sandboxes"])).await;
    let (status, body) = api
        .call_with_key(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "vm", "snapshot": "daytona-vm-small"})),
            Some(&agent),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // Three left: four children do not fit and none is made or counted.
    let (status, body) = api
        .call_with_key(
            "POST",
            "/api/sandbox/vm/forks",
            Some(json!({"count": 4})),
            Some(&agent),
        )
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(
        message(&body).contains("sandboxCreateRateLimit of 4"),
        "{body}"
    );
    let (status, body) = api
        .call_with_key(
            "POST",
            "/api/sandbox/vm/forks",
            Some(json!({"count": 3})),
            Some(&agent),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = api
        .call_with_key(
            "POST",
            "/api/sandbox/vm/fork",
            Some(json!({})),
            Some(&agent),
        )
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
}

#[tokio::test]
async fn a_create_past_the_rate_limit_is_a_429_saying_when_to_retry() {
    let api = api().await;
    let (status, body) = api
        .call(
            "PATCH",
            "/api/organizations/cove/quota",
            Some(json!({"sandboxCreateRateLimit": 1, "sandboxCreateRateLimitTtlSeconds": 30})),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let agent = api.key("agent", json!(["write:sandboxes"])).await;
    let (status, body) = api
        .call_with_key("POST", "/api/sandbox", Some(json!({})), Some(&agent))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let request = Request::builder()
        .method("POST")
        .uri("/api/sandbox")
        .header("authorization", format!("Bearer {agent}"))
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .unwrap();
    let response = api.router.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=30).contains(&retry), "{retry}");
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(
        message(&body).contains("sandboxCreateRateLimit of 1 requests per 30 s"),
        "{body}"
    );
    // Reads are not creates; the operator is never limited.
    let (status, _) = api
        .call_with_key("GET", "/api/sandbox", None, Some(&agent))
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = api.call("POST", "/api/sandbox", Some(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // Only the operator sets quotas; what cove does not enforce is refused.
    let (status, _) = api
        .call_with_key(
            "PATCH",
            "/api/organizations/cove/quota",
            Some(json!({"sandboxCreateRateLimit": null})),
            Some(&agent),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, body) = api
        .call(
            "PATCH",
            "/api/organizations/cove/quota",
            Some(json!({"maxSnapshotSize": 3})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message(&body).contains("maxSnapshotSize"), "{body}");
}

#[tokio::test]
async fn snapshots_past_the_snapshot_quota_are_refused_before_anything_is_captured() {
    let api = api().await;
    let (status, _) = api
        .call(
            "PATCH",
            "/api/organizations/cove/quota",
            Some(json!({"snapshotQuota": 1})),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    api.call("POST", "/api/sandbox", Some(json!({"name": "src"})))
        .await;
    let take = |name: &str| json!({ "name": name });
    let (status, body) = api
        .call("POST", "/api/sandbox/src/snapshot", Some(take("one")))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = api
        .call("POST", "/api/sandbox/src/snapshot", Some(take("two")))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(
        message(&body).contains("snapshotQuota is 1 and 1 snapshots"),
        "{body}"
    );
    let (status, _) = api.call("GET", "/api/snapshots/two", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // Refused before anything was captured.
    let captures = api
        .fake
        .calls()
        .iter()
        .filter(|c| c.starts_with("capture"))
        .count();
    assert_eq!(captures, 1, "{:?}", api.fake.calls());
    // The sandbox goes on; the server's own images never counted.
    let (_, sandbox) = api.call("GET", "/api/sandbox/src", None).await;
    assert_eq!(sandbox["state"], "started");
    let (_, usage) = api.call("GET", "/api/organizations/cove/usage", None).await;
    assert_eq!(usage["totalSnapshotQuota"], 1);
    assert_eq!(usage["currentSnapshotUsage"], 1);
}

#[tokio::test]
async fn the_operator_makes_organizations_that_read_back_with_their_limits() {
    let api = api().await;
    api.call(
        "PATCH",
        "/api/organizations/cove/quota",
        Some(json!({"maxCpuPerSandbox": 2, "sandboxLifecycleRateLimit": 10})),
    )
    .await;
    let (status, org) = api.call("GET", "/api/organizations/cove", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(org["id"], "cove");
    assert_eq!(org["defaultRegionId"], "us");
    assert_eq!(org["maxCpuPerSandbox"], 2);
    // The server's own ceiling (8 GiB by default) where the quota sets none.
    assert_eq!(org["maxMemoryPerSandbox"], 8);
    assert_eq!(org["sandboxLifecycleRateLimit"], 10);
    assert_eq!(org["sandboxLifecycleRateLimitTtlSeconds"], 60);
    assert_eq!(org["authenticatedRateLimit"], Value::Null);
    let (status, _) = api.call("GET", "/api/organizations/other", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (status, team) = api
        .call("POST", "/api/organizations", Some(json!({"name": "team"})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{team}");
    assert_eq!(team["name"], "team");
    // Its own limits: none of the default organization's.
    assert_eq!(team["sandboxLifecycleRateLimit"], Value::Null);
    let team_id = team["id"].as_str().unwrap().to_owned();
    let (status, body) = api
        .call("POST", "/api/organizations", Some(json!({"name": "team"})))
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let (status, body) = api
        .call(
            "POST",
            "/api/organizations",
            Some(json!({"name": "x", "defaultRegionId": "eu"})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (_, listed) = api.call("GET", "/api/organizations", None).await;
    assert_eq!(listed.as_array().unwrap().len(), 2);

    // A key of the team sees its own organization only, and may not make one.
    let key = api
        .key_in(&team_id, "team-key", json!(["manage:api_keys"]))
        .await;
    let (_, listed) = api
        .call_with_key("GET", "/api/organizations", None, Some(&key))
        .await;
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["id"], team_id.as_str());
    let (status, _) = api
        .call_with_key("GET", "/api/organizations/cove", None, Some(&key))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = api
        .call_with_key(
            "POST",
            "/api/organizations",
            Some(json!({"name": "mine"})),
            Some(&key),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // Its keys are its own: the default organization lists none of them.
    let (_, keys) = api.call("GET", "/api/api-keys", None).await;
    assert!(!keys.to_string().contains("team-key"), "{keys}");

    // The default organization stays; an empty one goes with its keys.
    let (status, body) = api.call("DELETE", "/api/organizations/cove", None).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let (status, _) = api
        .call("DELETE", &format!("/api/organizations/{team_id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = api
        .call_with_key("GET", "/api/sandbox", None, Some(&key))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn another_organizations_sandbox_is_a_404_on_every_route() {
    let api = api().await;
    let (_, team) = api
        .call("POST", "/api/organizations", Some(json!({"name": "team"})))
        .await;
    let team_id = team["id"].as_str().unwrap().to_owned();
    let all = json!([
        "write:sandboxes",
        "delete:sandboxes",
        "write:snapshots",
        "delete:snapshots",
        "read:volumes",
        "write:volumes",
        "delete:volumes",
        "write:registries",
        "delete:registries"
    ]);
    let key = api.key_in(&team_id, "team-all", all).await;
    let (status, made) = api
        .call(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "ours", "labels": {"k": "v"}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{made}");
    let id = made["id"].as_str().unwrap().to_owned();
    let (status, snap) = api
        .call(
            "POST",
            &format!("/api/sandbox/{id}/snapshot"),
            Some(json!({"name": "snap"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{snap}");
    let (status, volume) = api
        .call("POST", "/api/volumes", Some(json!({"name": "vol"})))
        .await;
    assert_eq!(status, StatusCode::OK, "{volume}");
    let registry =
        json!({"name": "reg", "url": "registry.example", "username": "u", "password": "p"});
    let (status, registry) = api
        .call("POST", "/api/docker-registry", Some(registry))
        .await;
    assert!(status.is_success(), "{registry}");
    let (_, snapshots) = api.call("GET", "/api/snapshots", None).await;
    let snapshot_id = snapshots["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "snap")
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .expect("the snapshot is listed");

    // Every route with an id the OpenAPI document describes, by id and by
    // name, as the team's key: none finds the default organization's
    // sandbox, snapshot, volume or registry.
    let (_, doc) = api.call("GET", "/api/openapi.json", None).await;
    let mut tried = 0;
    for (path, operations) in doc["paths"].as_object().unwrap() {
        // A runner is the server's, no organization's: every key but the
        // operator's is refused there (403), whatever the id.
        if !path.contains("{id}") || path.starts_with("/runners/") {
            continue;
        }
        let targets = if path.starts_with("/snapshots/") {
            [snapshot_id.as_str(), "snap"]
        } else if path.starts_with("/volumes/") {
            [volume["id"].as_str().unwrap(), "vol"]
        } else if path.starts_with("/docker-registry/") {
            [registry["id"].as_str().unwrap(), "reg"]
        } else {
            [id.as_str(), "ours"]
        };
        for method in operations.as_object().unwrap().keys() {
            for target in targets {
                let url = format!("/api{path}")
                    .replace("{id}", target)
                    .replace("{minutes}", "5")
                    .replace("{port}", "3000")
                    .replace("{public}", "true")
                    .replace("{token}", "t0ken");
                let body = (method != "get" && method != "delete").then(|| {
                    json!({"name": "stolen", "snapshot": "stolen", "labels": {"x": "y"},
                               "url": "registry.example", "username": "u", "password": "p"})
                });
                let (status, answer) = api
                    .call_with_key(&method.to_uppercase(), &url, body, Some(&key))
                    .await;
                assert_eq!(status, StatusCode::NOT_FOUND, "{method} {url}: {answer}");
                tried += 1;
            }
        }
    }
    assert!(tried > 40, "only {tried} routes tried");
    for path in [
        format!("/toolbox/{id}/files?path=/"),
        format!("/toolbox/{id}/process/execute"),
    ] {
        let (status, _) = api.call_with_key("GET", &path, None, Some(&key)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
    }
    let (_, listed) = api
        .call_with_key("GET", "/api/sandbox", None, Some(&key))
        .await;
    assert_eq!(
        listed["items"].as_array().map(Vec::len),
        Some(0),
        "{listed}"
    );

    // The operator acting in the team sees none of it either; and the
    // sandbox is as it was.
    let (status, _) = api
        .call_in(&team_id, "GET", &format!("/api/sandbox/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, after) = api.call("GET", &format!("/api/sandbox/{id}"), None).await;
    assert_eq!(after["state"], "started");
    assert_eq!(after["labels"], json!({"k": "v"}));
    let (_, forks) = api.call("GET", "/api/sandbox", None).await;
    assert_eq!(forks["items"].as_array().unwrap().len(), 1, "{forks}");
    let (_, snapshots) = api.call("GET", "/api/snapshots", None).await;
    assert!(snapshots.to_string().contains("\"snap\""), "{snapshots}");
    assert!(!snapshots.to_string().contains("stolen"), "{snapshots}");
    let (_, volumes) = api.call("GET", "/api/volumes", None).await;
    assert_eq!(volumes.as_array().unwrap().len(), 1, "{volumes}");
    let (_, registries) = api.call("GET", "/api/docker-registry", None).await;
    assert_eq!(registries.as_array().unwrap().len(), 1, "{registries}");
    // Nor do the team's lists show them.
    for path in ["/api/snapshots", "/api/volumes", "/api/docker-registry"] {
        let (_, theirs) = api.call_with_key("GET", path, None, Some(&key)).await;
        let text = theirs.to_string();
        assert!(
            !text.contains("\"snap\"") && !text.contains("\"vol\"") && !text.contains("\"reg\""),
            "{path}: {text}"
        );
    }

    // A name is the team's to use too, and its sandbox is its own.
    let (status, theirs) = api
        .call_with_key(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "ours"})),
            Some(&key),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{theirs}");
    assert_eq!(theirs["organizationId"], team_id.as_str());
    let (_, again) = api
        .call_with_key(
            "POST",
            "/api/sandbox",
            Some(json!({"name": "ours"})),
            Some(&key),
        )
        .await;
    assert!(message(&again).contains("already exists"), "{again}");
    // A preview names its sandbox by id; by name only with a key, in the
    // key's organization. Another organization's key finds nothing.
    let (status, _) = api
        .call_with_key("GET", "/preview/ours/3000/", None, None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = api
        .call_with_key("GET", &format!("/preview/{id}/3000/"), None, Some(&key))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, body) = api
        .call_with_key("GET", &format!("/preview/{id}/3000/"), None, None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    // A key of the team acts in the team, whatever organization its header
    // names (as Daytona's keys do).
    let (status, listed) = api
        .call_in_with_key("cove", &key, "GET", "/api/sandbox")
        .await;
    assert_eq!(status, StatusCode::OK);
    let items = listed["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{listed}");
    assert_eq!(items[0]["organizationId"], team_id.as_str());
    // The operator naming an organization that does not exist is a 404;
    // what is no organization's id is not read as one.
    let (status, _) = api
        .call_in(
            "00000000-0000-4000-8000-000000000000",
            "GET",
            "/api/sandbox",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = api.call_in("not-an-id", "GET", "/api/sandbox", None).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn the_openapi_document_describes_the_control_api() {
    let api = api().await;
    let (status, doc) = api.call("GET", "/api/openapi.json", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(doc["openapi"], "3.0.3");
    let create = &doc["paths"]["/sandbox"]["post"];
    assert_eq!(create["x-cove-permission"], "write:sandboxes");
    assert!(create["summary"].as_str().unwrap().contains("Create"));
    assert!(doc["paths"]["/sandbox/{id}/revert"]["post"]["summary"]
        .as_str()
        .unwrap()
        .contains("cove extension"));
}

#[tokio::test]
async fn a_runner_elsewhere_is_registered_reports_with_its_own_token_and_is_deleted() {
    let (api, engine) = api_in(tempfile::tempdir().unwrap(), None).await;
    // As `serve` does: the server's own runner is registered first.
    engine.recover_after_restart().await.unwrap();
    let (status, made) = api
        .call(
            "POST",
            "/api/runners",
            Some(json!({"name": "node-2", "regionId": "us", "tags": ["rack-2"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{made}");
    let id = made["id"].as_str().unwrap().to_owned();
    let token = made["apiKey"].as_str().unwrap().to_owned();
    assert!(token.starts_with("cove_runner_"), "{token}");

    // Refused: a name taken, an unknown region, a bad name, a bad body.
    for (body, expected) in [
        (
            json!({"name": "node-2", "regionId": "us"}),
            StatusCode::CONFLICT,
        ),
        (
            json!({"name": "node-3", "regionId": "eu"}),
            StatusCode::BAD_REQUEST,
        ),
        (json!({"name": "no spaces"}), StatusCode::BAD_REQUEST),
        (json!({"regionId": "us"}), StatusCode::BAD_REQUEST),
    ] {
        let (status, answer) = api.call("POST", "/api/runners", Some(body.clone())).await;
        assert_eq!(status, expected, "{body}: {answer}");
        assert!(answer["message"].as_str().is_some_and(|m| !m.is_empty()));
    }

    // Registered, not reported yet.
    let (_, runner) = api.call("GET", &format!("/api/runners/{id}"), None).await;
    assert_eq!(runner["state"], "initializing", "{runner}");
    assert_eq!(runner["tags"], json!(["rack-2"]));

    // The token opens the runner's own routes and nothing else; no API key
    // opens those.
    let (status, _) = api
        .call_with_key("GET", "/api/sandbox", None, Some(&token))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = api
        .call_with_key("GET", &format!("/api/runners/{id}"), None, Some(&token))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, answer) = api.call("GET", "/api/runners/me", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{answer}");
    let (status, _) = api
        .call_with_key("GET", "/api/runners/me", None, None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, me) = api
        .call_with_key("GET", "/api/runners/me", None, Some(&token))
        .await;
    assert_eq!(status, StatusCode::OK, "{me}");
    assert_eq!(me["id"], id.as_str());
    assert_eq!(me["apiKey"], token.as_str());
    let (status, answer) = api
        .call_with_key("GET", "/api/runners/me/snapshots", None, Some(&token))
        .await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED, "{answer}");

    // It reports; a report that cannot be true is refused and changes nothing.
    let report = json!({
        "appVersion": "0.1.0",
        "apiUrl": "http://10.1.0.2:3001",
        "metrics": {
            "cpu": 16, "memoryGiB": 64, "diskGiB": 500,
            "currentCpuLoadAverage": 1.0, "currentCpuUsagePercentage": 6.25,
            "currentMemoryUsagePercentage": 20.5, "currentDiskUsagePercentage": 3.0,
            "currentAllocatedCpu": 0, "currentAllocatedMemoryGiB": 0,
            "currentAllocatedDiskGiB": 0, "currentSnapshotCount": 0,
            "currentStartedSandboxes": 0
        },
        "sandboxClasses": ["container", "linux-vm"],
        "accelerator": "kvm"
    });
    let (status, answer) = api
        .call_with_key(
            "POST",
            "/api/runners/healthcheck",
            Some(report.clone()),
            Some(&token),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let mut false_report = report.clone();
    false_report["sandboxClasses"] = json!(["container", "gpu"]);
    let (status, answer) = api
        .call_with_key(
            "POST",
            "/api/runners/healthcheck",
            Some(false_report),
            Some(&token),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert!(answer["message"]
        .as_str()
        .unwrap()
        .contains("sandboxClasses"));
    // A service is taken only with a plain key and an http:// URL with a
    // host: the key goes into a header of every call to the runner.
    // Its archive location is shown in messages: printable, and short.
    for (key, url, archive, field) in [
        (
            "line\r\nX-Evil: 1",
            "http://10.1.0.2:3001",
            "s3://a/b",
            "serviceKey",
        ),
        ("k", "https://10.1.0.2:3001", "s3://a/b", "apiUrl"),
        ("k", "http://10.1.0.2:3001", "s3://a/b\n", "archive"),
        ("k", "http://10.1.0.2:3001", "", "archive"),
    ] {
        let mut serving = report.clone();
        serving["serviceKey"] = json!(key);
        serving["apiUrl"] = json!(url);
        serving["archive"] = json!(archive);
        let (status, answer) = api
            .call_with_key(
                "POST",
                "/api/runners/healthcheck",
                Some(serving),
                Some(&token),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
        assert!(
            answer["message"].as_str().unwrap().contains(field),
            "{answer}"
        );
    }
    let (status, _) = api
        .call("POST", "/api/runners/healthcheck", Some(report.clone()))
        .await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "the operator is no runner"
    );

    let (_, runner) = api.call("GET", &format!("/api/runners/{id}"), None).await;
    assert_eq!(runner["state"], "ready", "{runner}");
    assert_eq!(
        (runner["cpu"].as_i64(), runner["memory"].as_i64()),
        (Some(16), Some(64))
    );
    assert_eq!(runner["sandboxClasses"], json!(["container", "linux-vm"]));
    assert_eq!(runner["accelerator"], "kvm");
    assert_eq!(runner["currentMemoryUsagePercentage"], 20.5);

    // New sandboxes stay on the server's own runner, the one it drives,
    // though the new one has more room.
    let (status, sandbox) = api.call("POST", "/api/sandbox", Some(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{sandbox}");
    assert_ne!(sandbox["runnerId"], id.as_str());
    let local = sandbox["runnerId"].as_str().unwrap().to_owned();
    // With the server's own drained, the create is refused naming both.
    let (status, _) = api
        .call(
            "PATCH",
            &format!("/api/runners/{local}/draining"),
            Some(json!({"draining": true})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, refused) = api.call("POST", "/api/sandbox", Some(json!({}))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{refused}");
    let message = refused["message"].as_str().unwrap();
    assert!(message.contains("is draining"), "{message}");
    assert!(
        message.contains("runner node-2") && message.contains("another machine"),
        "{message}"
    );
    api.call(
        "PATCH",
        &format!("/api/runners/{local}/draining"),
        Some(json!({"draining": false})),
    )
    .await;

    // The server's own runner cannot go; the other one can, and its token
    // stops working with it.
    let (status, answer) = api
        .call("DELETE", &format!("/api/runners/{local}"), None)
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    let (status, _) = api
        .call("DELETE", &format!("/api/runners/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = api
        .call("DELETE", &format!("/api/runners/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = api
        .call_with_key(
            "POST",
            "/api/runners/healthcheck",
            Some(report),
            Some(&token),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    // A key that is not the operator's registers no runner.
    let member = api
        .key_in("cove", "member", json!(["write:sandboxes"]))
        .await;
    let (status, _) = api
        .call_with_key(
            "POST",
            "/api/runners",
            Some(json!({"name": "sneaky"})),
            Some(&member),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}
