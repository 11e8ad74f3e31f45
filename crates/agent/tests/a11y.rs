//! The accessibility routes (`/computeruse/a11y/*`) against a real desktop:
//! Xvfb on a display of its choosing, a private session bus (which starts
//! the accessibility bus on demand) and zenity dialogs, driven through
//! `app()` without a socket. Needs `xvfb`, `dbus`, `at-spi2-core`,
//! `libatk-adaptor` and `zenity` (`scripts/setup`); skipped without them,
//! failed under `COVE_TEST_STRICT=1`.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use cove_agent::computeruse::Session;
use cove_agent::{app, AppState, Settings};
use http_body_util::BodyExt as _;
use serde_json::{json, Value};
use tower::ServiceExt as _;

/// The agent's state, with no desktop yet.
fn agent(dir: &Path) -> AppState {
    let settings = Settings::from_env(&cove_protocol::AgentEnv {
        workdir: Some(dir.display().to_string()),
        state_dir: Some(dir.join("state").display().to_string()),
        ..Default::default()
    });
    AppState::new(settings).unwrap()
}

async fn request(
    state: &AppState,
    method: Method,
    uri: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(body.map_or_else(Body::empty, |body| Body::from(body.to_string())))
        .unwrap();
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{uri}: {e}: {}", String::from_utf8_lossy(&bytes)));
    (status, body)
}

async fn post(state: &AppState, uri: &str, body: Value) -> (StatusCode, Value) {
    request(state, Method::POST, uri, Some(body)).await
}

async fn get(state: &AppState, uri: &str) -> (StatusCode, Value) {
    request(state, Method::GET, uri, None).await
}

#[tokio::test]
async fn without_a_desktop_the_routes_answer_409_and_check_ids_first() {
    let dir = tempfile::tempdir().unwrap();
    let state = agent(dir.path());
    let node = json!({"id": ":1.5:/org/a11y/atspi/accessible/1"});
    for (method, uri, body) in [
        (Method::GET, "/computeruse/a11y/tree", None),
        (
            Method::POST,
            "/computeruse/a11y/find",
            Some(json!({"role": "label"})),
        ),
        (
            Method::POST,
            "/computeruse/a11y/node/focus",
            Some(node.clone()),
        ),
        (
            Method::POST,
            "/computeruse/a11y/node/invoke",
            Some(node.clone()),
        ),
        (
            Method::POST,
            "/computeruse/a11y/node/value",
            Some(json!({"id": node["id"], "value": "x"})),
        ),
    ] {
        let (status, body) = request(&state, method, uri, body).await;
        assert_eq!(status, StatusCode::CONFLICT, "{uri}: {body}");
        let message = body["message"].as_str().unwrap();
        assert!(message.contains("computer_use.start()"), "{uri}: {message}");
    }
    let (status, body) = post(
        &state,
        "/computeruse/a11y/node/focus",
        json!({"id": "nonsense"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = get(&state, "/computeruse/a11y/tree?scope=window").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
}

/// Everything a test started, killed by pid (and waited for) when dropped,
/// whatever happened, before the directory they used is removed.
struct Desktop {
    processes: Vec<Child>,
    session: Session,
    env: Vec<(&'static str, String)>,
    dir: tempfile::TempDir,
}

impl Drop for Desktop {
    fn drop(&mut self) {
        // Dialogs first, the bus (whose end ends the accessibility bus it
        // started), the X server last; asked to stop (so Xvfb removes its
        // socket and lock), then killed if they linger.
        for child in self.processes.iter_mut().rev() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(3);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Desktop {
    /// `None` (the test skipped) when a program is missing.
    fn start() -> Option<Self> {
        let programs = [
            ("Xvfb", "xvfb"),
            ("dbus-daemon", "dbus"),
            ("zenity", "zenity"),
        ];
        if !programs
            .iter()
            .all(|(program, package)| cove_testenv::program(program, package))
        {
            return None;
        }
        if !Path::new("/usr/libexec/at-spi-bus-launcher").exists() {
            cove_testenv::missing("at-spi-bus-launcher is not installed (at-spi2-core)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let runtime_dir = dir.path().join("run");
        std::fs::create_dir(&runtime_dir).unwrap();
        let mut desktop = Self {
            processes: Vec::new(),
            session: Session {
                display: String::new(),
                bus_address: String::new(),
            },
            // The accessibility bus's socket goes to $XDG_RUNTIME_DIR/at-spi,
            // else to ~/.cache, where another desktop's may already be.
            env: vec![("XDG_RUNTIME_DIR", runtime_dir.display().to_string())],
            dir,
        };

        // A display of its own, away from the low numbers a developer's or
        // another test's desktop takes (`-displayfd` alone picks the first
        // free one, :0). Xvfb writes the number once it accepts clients.
        for number in 90..190 {
            if Path::new(&format!("/tmp/.X{number}-lock")).exists() {
                continue;
            }
            let mut xvfb = Command::new("Xvfb")
                .arg(format!(":{number}"))
                .args([
                    "-displayfd",
                    "1",
                    "-screen",
                    "0",
                    "1024x768x24",
                    "-nolisten",
                    "tcp",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(desktop.dir.path().join("xvfb.err")).unwrap())
                .spawn()
                .unwrap();
            let ready = first_line(xvfb.stdout.take().unwrap());
            desktop.processes.push(xvfb);
            if ready.is_some() {
                desktop.session.display = format!(":{number}");
                break;
            }
            // Taken after all (its lock appeared meanwhile): the next one.
            let mut xvfb = desktop.processes.pop().unwrap();
            let _ = xvfb.wait();
        }
        assert!(
            !desktop.session.display.is_empty(),
            "no free X display in :90-:189: {}",
            desktop.output("xvfb.err")
        );
        desktop
            .env
            .push(("DISPLAY", desktop.session.display.clone()));

        let socket = desktop.dir.path().join("bus");
        let mut bus = Command::new("dbus-daemon")
            .args(["--session", "--nofork", "--print-address"])
            .arg(format!("--address=unix:path={}", socket.display()))
            .envs(desktop.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let address = first_line(bus.stdout.take().unwrap());
        let address = address.expect("dbus-daemon printed its address");
        desktop.processes.push(bus);
        desktop.session.bus_address = address.trim().to_owned();
        desktop.env.push((
            "DBUS_SESSION_BUS_ADDRESS",
            desktop.session.bus_address.clone(),
        ));
        Some(desktop)
    }

    /// A zenity dialog on this desktop, its output going to `name` in the
    /// test's directory.
    fn zenity(&mut self, args: &[&str], name: &str) -> (usize, u32) {
        let output = std::fs::File::create(self.dir.path().join(name)).unwrap();
        let errors = std::fs::File::create(self.dir.path().join(format!("{name}.err"))).unwrap();
        let child = Command::new("zenity")
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env_remove("NO_AT_BRIDGE")
            .stdin(Stdio::null())
            .stdout(output)
            .stderr(errors)
            .spawn()
            .unwrap();
        let pid = child.id();
        self.processes.push(child);
        (self.processes.len() - 1, pid)
    }

    fn output(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap()
    }

    /// How the process at `index` exited, waiting up to 10 s.
    async fn exit_status(&mut self, index: usize) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.processes[index].try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "process {index} did not exit");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The first line `stream` gives, `None` if it ends first.
fn first_line(stream: impl std::io::Read) -> Option<String> {
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).unwrap();
    Some(line).filter(|line| !line.trim().is_empty())
}

/// Every node of a tree, parents first.
fn nodes(root: &Value) -> Vec<&Value> {
    let mut all = vec![root];
    let mut index = 0;
    while index < all.len() {
        if let Some(children) = all[index]["children"].as_array() {
            all.extend(children);
        }
        index += 1;
    }
    all
}

/// The one match of a find, asserted to be one.
async fn find_one(state: &AppState, query: Value) -> Value {
    let (status, body) = post(state, "/computeruse/a11y/find", query.clone()).await;
    assert_eq!(status, StatusCode::OK, "{query}: {body}");
    let matches = body["matches"].as_array().unwrap();
    assert_eq!(matches.len(), 1, "{query}: {body:#}");
    matches[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zenity_dialogs_are_read_found_and_driven() {
    let Some(mut desktop) = Desktop::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let state = agent(dir.path());
    state.desktop.set_session(Some(desktop.session.clone()));
    let (info, info_pid) = desktop.zenity(&["--info", "--text", "hello cove"], "info.out");
    let (entry, entry_pid) = desktop.zenity(&["--entry", "--text", "your name"], "entry.out");

    // The dialogs register with the accessibility registry as GTK starts.
    let deadline = Instant::now() + Duration::from_secs(30);
    let tree = loop {
        let (status, body) = get(&state, "/computeruse/a11y/tree?scope=all").await;
        let labels: Vec<&str> = match status {
            StatusCode::OK => nodes(&body["root"])
                .iter()
                .filter(|node| node["role"] == "label")
                .filter_map(|node| node["name"].as_str())
                .collect(),
            _ => Vec::new(),
        };
        if labels.contains(&"hello cove") && labels.contains(&"your name") {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "the dialogs never showed on {}: {status} {body:#}\nXvfb said: {}\nzenity said: {}{}",
            desktop.session.display,
            desktop.output("xvfb.err"),
            desktop.output("info.out.err"),
            desktop.output("entry.out.err"),
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(tree["truncated"], false);
    let root = &tree["root"];
    assert_eq!(root["role"], "desktop frame", "{root:#}");
    assert_eq!(
        root["id"],
        "org.a11y.atspi.Registry:/org/a11y/atspi/accessible/root"
    );
    let all = nodes(root);
    let dialog = all
        .iter()
        .find(|node| node["role"] == "dialog" || node["role"] == "alert" || node["role"] == "frame")
        .unwrap_or_else(|| panic!("no dialog window: {root:#}"));
    assert!(
        dialog["states"]
            .as_array()
            .unwrap()
            .contains(&json!("showing")),
        "{dialog}"
    );
    assert!(dialog["bounds"]["width"].as_i64().unwrap() > 0, "{dialog}");
    for node in &all {
        eprintln!(
            "a11y: {} {:?} states={} actions={}",
            node["role"], node["name"], node["states"], node["actions"]
        );
    }

    // maxDepth 0: the root alone, its children not looked at.
    let (status, body) = get(&state, "/computeruse/a11y/tree?scope=all&maxDepth=0").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["root"].get("children").is_none(), "{body}");

    // A pid's tree is its application's alone.
    let (status, body) = get(
        &state,
        &format!("/computeruse/a11y/tree?scope=pid&pid={info_pid}"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["root"]["role"], "application", "{body}");
    let names: Vec<&str> = nodes(&body["root"])
        .iter()
        .filter_map(|n| n["name"].as_str())
        .collect();
    assert!(
        names.contains(&"hello cove") && !names.contains(&"your name"),
        "{names:?}"
    );
    let (status, body) = get(&state, "/computeruse/a11y/tree?scope=pid&pid=999999999").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let (status, body) = get(&state, "/computeruse/a11y/tree").await;
    assert_eq!(status, StatusCode::OK, "the focused scope answers: {body}");

    // Find the info dialog's OK button by role and exact name, and press it.
    let ok = find_one(
        &state,
        json!({"role": "push button", "name": "OK", "nameMatch": "exact", "scope": "pid", "pid": info_pid}),
    )
    .await;
    assert!(ok.get("children").is_none(), "{ok}");
    assert!(!ok["actions"].as_array().unwrap().is_empty(), "{ok}");
    let (status, body) = post(
        &state,
        "/computeruse/a11y/node/invoke",
        json!({"id": ok["id"]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, json!({}));
    assert!(desktop.exit_status(info).await.success());

    // The button's application is gone: its id is stale.
    let (status, body) = post(
        &state,
        "/computeruse/a11y/node/focus",
        json!({"id": ok["id"]}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let (status, body) = post(
        &state,
        "/computeruse/a11y/node/invoke",
        json!({"id": ":1.9999:/org/a11y/atspi/accessible/1"}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let (status, body) = post(
        &state,
        "/computeruse/a11y/node/value",
        json!({"id": "x:y", "value": "v"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

    // The entry: focus it, type through EditableText, confirm; zenity
    // prints what the entry holds.
    let text = find_one(
        &state,
        json!({"role": "text", "scope": "pid", "pid": entry_pid}),
    )
    .await;
    let text_id = text["id"].as_str().unwrap().to_owned();
    let (status, body) = post(
        &state,
        "/computeruse/a11y/node/focus",
        json!({"id": text_id}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let focused = find_one(
        &state,
        json!({"role": "text", "states": ["focused"], "scope": "pid", "pid": entry_pid}),
    )
    .await;
    assert_eq!(focused["id"], text_id.as_str());
    let (status, body) = post(
        &state,
        "/computeruse/a11y/node/value",
        json!({"id": text_id, "value": "typed by cove"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // A live application, a path it never had: not found either.
    let bus_name = text_id.rsplit_once(":/").unwrap().0;
    let (status, body) = post(
        &state,
        "/computeruse/a11y/node/focus",
        json!({"id": format!("{bus_name}:/org/a11y/atspi/accessible/no_such_node")}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    // An action the button does not have is the client's mistake.
    let ok = find_one(
        &state,
        json!({"role": "push button", "name": "^OK$", "nameMatch": "regex", "scope": "pid", "pid": entry_pid}),
    )
    .await;
    let (status, body) = post(
        &state,
        "/computeruse/a11y/node/invoke",
        json!({"id": ok["id"], "action": "fly"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let action = ok["actions"][0].as_str().unwrap();
    let (status, body) = post(
        &state,
        "/computeruse/a11y/node/invoke",
        json!({"id": ok["id"], "action": action}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(desktop.exit_status(entry).await.success());
    assert_eq!(desktop.output("entry.out"), "typed by cove\n");
}

/// One accessible of the hostile application below.
struct Hostile {
    children: Vec<(String, zbus::zvariant::OwnedObjectPath)>,
    name: String,
    hangs: bool,
}

#[zbus::interface(name = "org.a11y.atspi.Accessible")]
impl Hostile {
    async fn get_children(&self) -> Vec<(String, zbus::zvariant::OwnedObjectPath)> {
        self.children.clone()
    }
    async fn get_role_name(&self) -> String {
        if self.hangs {
            std::future::pending::<()>().await;
        }
        "panel".to_owned()
    }
    async fn get_state(&self) -> Vec<u32> {
        if self.hangs {
            std::future::pending::<()>().await;
        }
        vec![0, 0]
    }
    async fn get_interfaces(&self) -> Vec<String> {
        vec!["org.a11y.atspi.Accessible".to_owned()]
    }
    #[zbus(property)]
    async fn name(&self) -> String {
        self.name.clone()
    }
    #[zbus(property)]
    async fn description(&self) -> String {
        String::new()
    }
}

/// `org.a11y.Bus` pointing back at the session bus itself.
struct Launcher(String);

#[zbus::interface(name = "org.a11y.Bus")]
impl Launcher {
    fn get_address(&self) -> String {
        self.0.clone()
    }
}

/// A registry and applications that answer what no toolkit would: a
/// cycle, a node with 3000 children that are not there, a 100 kB name, and
/// a second application that never answers. The walk must end, soon, with
/// each node once and `truncated`; a node call on the silent one is a 500
/// naming the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_application_cannot_hang_or_flood_a_walk() {
    if !cove_testenv::program("dbus-daemon", "dbus") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut bus = Command::new("dbus-daemon")
        .args(["--session", "--nofork", "--print-address"])
        .arg(format!(
            "--address=unix:path={}",
            dir.path().join("bus").display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let address = first_line(bus.stdout.take().unwrap()).expect("dbus-daemon printed its address");
    let address = address.trim().to_owned();
    // Stopped by pid however the test ends.
    struct Stop(Child);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _bus = Stop(bus);

    let connect = || async {
        zbus::connection::Builder::address(address.as_str())
            .unwrap()
            .build()
            .await
            .unwrap()
    };
    let (app, silent) = (connect().await, connect().await);
    let app_name = app.unique_name().unwrap().to_string();
    let silent_name = silent.unique_name().unwrap().to_string();
    let node = |name: &str, path: &str| (name.to_owned(), path.try_into().unwrap());
    let serve = |children, name: &str, hangs| Hostile {
        children,
        name: name.to_owned(),
        hangs,
    };
    let server = app.object_server();
    server
        .at("/org/a11y/bus", Launcher(address.clone()))
        .await
        .unwrap();
    let root = vec![node(&app_name, "/app")];
    server
        .at(
            "/org/a11y/atspi/accessible/root",
            serve(root, "main", false),
        )
        .await
        .unwrap();
    let app_children = vec![
        node(&app_name, "/loop"),
        node(&app_name, "/wide"),
        node(&silent_name, "/hang"),
        node(&app_name, "/org/a11y/atspi/accessible/root"),
    ];
    let long_name = "x".repeat(100_000);
    server
        .at("/app", serve(app_children, &long_name, false))
        .await
        .unwrap();
    let back = vec![node(&app_name, "/app")];
    server
        .at("/loop", serve(back, "loop", false))
        .await
        .unwrap();
    let wide = (0..3000)
        .map(|n| node(&app_name, &format!("/wide/{n}")))
        .collect();
    server
        .at("/wide", serve(wide, "wide", false))
        .await
        .unwrap();
    silent
        .object_server()
        .at("/hang", serve(Vec::new(), "never", true))
        .await
        .unwrap();
    app.request_name("org.a11y.Bus").await.unwrap();
    app.request_name("org.a11y.atspi.Registry").await.unwrap();

    let state = agent(dir.path());
    state.desktop.set_session(Some(Session {
        display: ":none".to_owned(),
        bus_address: address.clone(),
    }));
    let started = Instant::now();
    let (status, body) = get(&state, "/computeruse/a11y/tree?scope=all").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(body["truncated"], true);
    let ids: Vec<&str> = nodes(&body["root"])
        .iter()
        .map(|n| n["id"].as_str().unwrap())
        .collect();
    // The root once more under the registry's unique name (an id is a
    // name and a path, not an identity), but none of its children again.
    let mut expected = vec!["org.a11y.atspi.Registry:/org/a11y/atspi/accessible/root".to_owned()];
    expected.extend(
        ["/app", "/loop", "/wide", "/org/a11y/atspi/accessible/root"]
            .iter()
            .map(|path| format!("{app_name}:{path}")),
    );
    assert_eq!(ids, expected, "each node once, none of the silent one's");
    let app = &body["root"]["children"][0];
    assert_eq!(app["name"].as_str().unwrap().len(), 1024);
    assert_eq!(
        app["children"][1]["children"],
        json!([]),
        "the absent children are left out"
    );

    let started = Instant::now();
    let hang = json!({"id": format!("{silent_name}:/hang")});
    let (status, body) = post(&state, "/computeruse/a11y/node/focus", hang).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("did not answer"),
        "{body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}
