//! Real containers on this host: needs root, cgroups, overlayfs, a root filesystem
//! (`COVE_TEST_ROOTFS`, a Debian rootfs) and the static agent (`COVE_TEST_AGENT`);
//! without them each test is skipped with its reason, or fails under
//! `COVE_TEST_STRICT=1` (`cove-testenv`).
//!
//! The test binary is its own shim: a constructor runs before libtest's `main` (and so
//! before any thread) and becomes `cove __container-init` when invoked that way.
// The constructor is a linker-section static, which the unsafe_code lint counts.
#![allow(unsafe_code)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cove_runtime::container::{container_init_main, ContainerConfig, ContainerRuntime};
use cove_runtime::{
    AgentEndpoint, NetworkLink, Resources, Runtime, SandboxNetwork, SandboxSpec, Started,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

#[ctor::ctor(unsafe)]
fn become_the_shim_when_asked() {
    let Ok(raw) = std::fs::read("/proc/self/cmdline") else {
        return;
    };
    let args: Vec<String> = raw
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    if args.get(1).map(String::as_str) == Some("__container-init") {
        container_init_main();
    }
}

/// One runtime with its own state dir and cgroup parent; cleans both up.
struct Harness {
    runtime: ContainerRuntime,
    config: ContainerConfig,
    rootfs: PathBuf,
    state: tempfile::TempDir,
    cgroup_parent: String,
}

impl Harness {
    /// `None` (the test is skipped, or fails under `COVE_TEST_STRICT=1`)
    /// where this machine cannot run containers.
    fn new(name: &str) -> Option<Self> {
        Self::with_pool(name, 0)
    }

    /// A harness whose runtime keeps `shim_pool` shims waiting.
    fn with_pool(name: &str, shim_pool: usize) -> Option<Self> {
        if !cove_testenv::root("the container tests") {
            return None;
        }
        let rootfs =
            cove_testenv::path("COVE_TEST_ROOTFS", "a Debian root filesystem with python3")?;
        let agent = cove_testenv::path("COVE_TEST_AGENT", "the static cove-agent binary")?;
        // Short, so the agent socket path fits in sun_path.
        let state = tempfile::Builder::new()
            .prefix("cove-ct-")
            .tempdir_in("/tmp")
            .unwrap();
        let cgroup_parent = format!("cove-test-{}-{name}", std::process::id());
        let mut config = ContainerConfig::new(
            state.path().to_path_buf(),
            agent,
            std::env::current_exe().unwrap(),
        );
        config.cgroup_parent = cgroup_parent.clone();
        config.shim_pool = shim_pool;
        let runtime = ContainerRuntime::new(config.clone()).unwrap();
        runtime.fill_pool();
        Some(Self {
            runtime,
            config,
            rootfs,
            state,
            cgroup_parent,
        })
    }

    fn spec(&self, id: &str) -> SandboxSpec {
        SandboxSpec {
            id: sid(id),
            hostname: format!("host-{id}"),
            rootfs: self.rootfs.clone(),
            layers: Vec::new(),
            resources: Resources {
                cpu: 1,
                memory_mib: 256,
                disk_gib: 1,
            },
            env: vec![("SANDBOX_TEST".into(), "1".into())],
            network: None,
            volumes: Vec::new(),
            workdir: None,
            user: None,
            command: Vec::new(),
        }
    }

    async fn start(&self, id: &str) -> (Started, PathBuf) {
        self.start_spec(self.spec(id)).await
    }

    async fn start_spec(&self, spec: SandboxSpec) -> (Started, PathBuf) {
        let id = spec.id.clone();
        self.runtime.prepare(&spec).await.unwrap();
        let began = Instant::now();
        let started = self.runtime.start(&spec).await.unwrap();
        let took = began.elapsed();
        let AgentEndpoint::Unix(socket) = started.agent.clone() else {
            panic!("a container's agent is on a Unix socket")
        };
        let version = get(&socket, "/version").await;
        eprintln!(
            "start() of {id} took {took:?}; start + GET /version {:?}",
            began.elapsed()
        );
        assert_eq!(version.0, 200, "GET /version: {version:?}");
        (started, socket)
    }

    fn cgroup_dirs(&self, id: &str) -> Vec<PathBuf> {
        ["cpu", "cpuacct", "memory", "pids", "freezer", "devices", ""]
            .iter()
            .map(|c| {
                Path::new("/sys/fs/cgroup")
                    .join(c)
                    .join(&self.cgroup_parent)
                    .join(id)
            })
            .filter(|p| p.exists())
            .collect()
    }

    /// Nothing of sandbox `id` is left on the host: no mount under the state
    /// dir, no cgroup, none of `pids` alive, no sandbox directory.
    fn assert_nothing_left(&self, id: &str, pids: &BTreeSet<i32>) {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !mountinfo.contains(self.state.path().to_str().unwrap()),
            "{mountinfo}"
        );
        assert!(
            self.cgroup_dirs(id).is_empty(),
            "{:?}",
            self.cgroup_dirs(id)
        );
        // A killed process stays a zombie until its parent (the shim, or init once
        // the shim is gone) reaps it; give the reaping a few seconds.
        let deadline = Instant::now() + Duration::from_secs(5);
        let left = loop {
            let left: Vec<_> = pids
                .iter()
                .filter(|p| alive(**p))
                .map(|p| describe(*p))
                .collect();
            if left.is_empty() || Instant::now() > deadline {
                break left;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(left.is_empty(), "still alive: {left:?}");
        assert!(!self.state.path().join(id).exists());
    }
}

impl Drop for Harness {
    /// A failed test leaves its containers running: kill them through their cgroups
    /// (the processes this test started) and remove the cgroups.
    fn drop(&mut self) {
        let parents: Vec<PathBuf> = ["cpu", "cpuacct", "memory", "pids", "freezer", "devices", ""]
            .iter()
            .map(|c| {
                Path::new("/sys/fs/cgroup")
                    .join(c)
                    .join(&self.cgroup_parent)
            })
            .filter(|p| p.is_dir())
            .collect();
        let children = || {
            parents
                .iter()
                .flat_map(|p| std::fs::read_dir(p).into_iter().flatten().flatten())
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect::<Vec<_>>()
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !children().is_empty() && Instant::now() < deadline {
            for child in children() {
                for pid in pids_in(&[child.join("cgroup.procs")]) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::SIGKILL,
                    );
                }
                let _ = std::fs::remove_dir(&child);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for parent in parents {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

/// One HTTP/1.1 exchange over the agent socket; returns status and body.
async fn request(socket: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut stream = UnixStream::connect(socket).await.unwrap();
    let body = body.unwrap_or("");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
}

async fn get(socket: &Path, path: &str) -> (u16, String) {
    request(socket, "GET", path, None).await
}

/// Runs a shell command through the agent: exit code and combined output.
async fn exec(socket: &Path, command: &str) -> (i64, String) {
    let body = serde_json::json!({ "command": command, "timeout": 120 }).to_string();
    let (status, reply) = request(socket, "POST", "/process/execute", Some(&body)).await;
    assert_eq!(status, 200, "execute {command:?}: {reply}");
    let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
    (
        reply["exitCode"].as_i64().unwrap(),
        reply["result"].as_str().unwrap_or("").to_string(),
    )
}

async fn exec_ok(socket: &Path, command: &str) -> String {
    let (code, output) = exec(socket, command).await;
    assert_eq!(code, 0, "{command:?} failed: {output}");
    output.trim().to_string()
}

fn pids_in(files: &[PathBuf]) -> BTreeSet<i32> {
    files
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|l| l.parse().ok())
                .collect::<Vec<_>>()
        })
        .collect()
}

fn describe(pid: i32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let pick = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .unwrap_or("")
            .to_string()
    };
    format!(
        "{pid} {} {} {}",
        pick("Name:"),
        pick("State:"),
        pick("PPid:")
    )
}

fn alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[tokio::test]
async fn agent_answers_in_its_own_namespaces() {
    let Some(h) = Harness::new("ns") else { return };
    let (_started, socket) = h.start("ns1").await;
    let began = Instant::now();
    assert_eq!(exec_ok(&socket, "echo hi").await, "hi");
    eprintln!("first command answered in {:?}", began.elapsed());

    assert_eq!(
        exec_ok(&socket, "cat /proc/sys/kernel/hostname").await,
        "host-ns1"
    );
    assert_eq!(exec_ok(&socket, "ls /sys/class/net").await, "lo");
    assert!(exec_ok(
        &socket,
        "cat /sys/class/net/lo/operstate /sys/class/net/lo/flags"
    )
    .await
    .contains("0x9"));
    let pid1 = exec_ok(&socket, "tr '\\0' ' ' < /proc/1/cmdline").await;
    assert!(pid1.contains("cove-agent"), "pid 1 is {pid1:?}");
    let pids = exec_ok(&socket, "ls /proc | grep -E '^[0-9]+$' | wc -l").await;
    assert!(
        pids.parse::<u32>().unwrap() < 10,
        "the container sees {pids} processes"
    );
    let host_pid = std::process::id().to_string();
    let listed = exec_ok(&socket, "ls /proc").await;
    assert!(
        !listed.split_whitespace().any(|p| p == host_pid),
        "the container sees the test process"
    );
    assert_eq!(
        exec_ok(&socket, "echo $SANDBOX_TEST $HOME").await,
        "1 /root"
    );

    // Hardening: Docker's capability set, seccomp on, masked paths; no
    // no_new_privs, as with Docker, so a setuid `sudo` works.
    let status = exec_ok(
        &socket,
        "grep -E '^(CapEff|CapBnd|Seccomp|NoNewPrivs):' /proc/self/status",
    )
    .await;
    assert!(status.contains("CapBnd:\t00000000a80405fb"), "{status}");
    assert!(status.contains("CapEff:\t00000000a80405fb"), "{status}");
    assert!(status.contains("Seccomp:\t2"), "{status}");
    assert!(status.contains("NoNewPrivs:\t0"), "{status}");
    assert_eq!(
        exec_ok(&socket, "cat /proc/keys /proc/timer_list | wc -c").await,
        "0"
    );
    let (code, _) = exec(&socket, "echo 1 > /proc/sys/kernel/domainname").await;
    assert_ne!(code, 0, "/proc/sys must be read-only");
    let (code, out) = exec(&socket, "mkdir -p /mnt/x && mount -t tmpfs none /mnt/x").await;
    assert_ne!(code, 0, "mount must fail: {out}");
    let (code, _) = exec(
        &socket,
        "head -c1 /dev/urandom >/dev/null && echo x > /dev/null && test -c /dev/pts/ptmx",
    )
    .await;
    assert_eq!(code, 0);
    h.runtime.destroy(&sid("ns1")).await.unwrap();
}

/// Once its init runs, a sandbox's shim is the agent binary's small
/// supervisor (not a private copy of the server binary's relocated data per
/// sandbox), outside the sandbox's cgroups, and it still reports the init's
/// end: an init killed from the host ends the sandbox with its signal.
#[tokio::test]
async fn the_shim_of_a_running_sandbox_is_the_small_supervisor() {
    let Some(h) = Harness::new("superv") else {
        return;
    };
    let (started, socket) = h.start("s1").await;
    assert_eq!(exec_ok(&socket, "echo up").await, "up");
    let init = container_init_pid(&h, "s1");
    let parent = parent_of(init);
    // The shim reports the init ready, then execs the supervisor: on a busy
    // host that exec can still be under way (its command line empty).
    let wanted = format!("cove-agent\0supervise\0{init}\0");
    let mut cmdline = String::new();
    for _ in 0..500 {
        cmdline = std::fs::read_to_string(format!("/proc/{parent}/cmdline")).unwrap();
        if cmdline == wanted {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(cmdline, wanted);
    let exe = std::fs::read_link(format!("/proc/{parent}/exe")).unwrap();
    assert_eq!(exe.file_name().unwrap(), "cove-agent", "{exe:?}");
    let procs: Vec<PathBuf> = h
        .cgroup_dirs("s1")
        .iter()
        .map(|dir| dir.join("cgroup.procs"))
        .collect();
    assert!(
        !pids_in(&procs).contains(&parent),
        "the supervisor is in the sandbox's cgroups"
    );
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(init), nix::sys::signal::SIGKILL).unwrap();
    let exited = tokio::time::timeout(Duration::from_secs(5), started.exited)
        .await
        .expect("the end of the init is reported")
        .unwrap();
    assert!(exited.contains("killed by signal 9"), "{exited}");
    assert!(!alive(parent), "the supervisor ended with its init");
    h.runtime.destroy(&sid("s1")).await.unwrap();
}

#[tokio::test]
async fn files_survive_stop_and_start() {
    let Some(h) = Harness::new("persist") else {
        return;
    };
    let (started, socket) = h.start("p1").await;
    exec_ok(
        &socket,
        "echo kept > /root/note && echo gone > /run/scratch && echo tmp > /tmp/t",
    )
    .await;
    h.runtime.stop(&sid("p1")).await.unwrap();
    assert!(!h.runtime.is_running(&sid("p1")).await);
    let exited = tokio::time::timeout(Duration::from_secs(5), started.exited)
        .await
        .unwrap()
        .unwrap();
    eprintln!("exited: {exited}");

    let (_started, socket) = h.start("p1").await;
    assert_eq!(exec_ok(&socket, "cat /root/note /tmp/t").await, "kept\ntmp");
    let (code, _) = exec(&socket, "test -e /run/scratch").await;
    assert_ne!(code, 0, "/run is a fresh tmpfs on each start");
    h.runtime.stop(&sid("p1")).await.unwrap();
    h.runtime.stop(&sid("p1")).await.unwrap();
    h.runtime.destroy(&sid("p1")).await.unwrap();
}

#[tokio::test]
async fn memory_limit_kills_the_hog_not_the_container() {
    let Some(h) = Harness::new("oom") else { return };
    let (_started, socket) = h.start("m1").await;
    let (code, output) = exec(
        &socket,
        "python3 -c \"b = b'x' * (600 * 1024 * 1024); print(len(b))\"",
    )
    .await;
    assert_eq!(code, 137, "600 MB in 256 MiB must be OOM-killed: {output}");
    assert_eq!(get(&socket, "/version").await.0, 200);
    assert_eq!(exec_ok(&socket, "echo alive").await, "alive");
    assert!(h.runtime.is_running(&sid("m1")).await);
    h.runtime.destroy(&sid("m1")).await.unwrap();
}

#[tokio::test]
async fn destroy_leaves_nothing_behind() {
    let Some(h) = Harness::new("destroy") else {
        return;
    };
    let (started, socket) = h.start("d1").await;
    exec_ok(&socket, "sleep 1000 > /dev/null 2>&1 &").await;
    let pids = pids_in(&h.runtime.cgroup_procs_files("d1"));
    assert!(pids.len() >= 3, "init, server and sleep at least: {pids:?}");
    assert!(!h.cgroup_dirs("d1").is_empty());

    h.runtime.destroy(&sid("d1")).await.unwrap();
    h.assert_nothing_left("d1", &pids);
    assert!(!h.runtime.is_running(&sid("d1")).await);
    tokio::time::timeout(Duration::from_secs(5), started.exited)
        .await
        .unwrap()
        .unwrap();
    // Idempotent, also for a sandbox that never existed.
    h.runtime.destroy(&sid("d1")).await.unwrap();
    h.runtime.destroy(&sid("never")).await.unwrap();
}

#[tokio::test]
async fn sandboxes_do_not_see_each_other() {
    let Some(h) = Harness::new("iso") else { return };
    let (_a, socket_a) = h.start("a1").await;
    let (_b, socket_b) = h.start("b1").await;
    exec_ok(
        &socket_a,
        "echo secret > /root/only-a; sleep 1000 > /dev/null 2>&1 &",
    )
    .await;
    let (code, _) = exec(&socket_b, "test -e /root/only-a").await;
    assert_ne!(code, 0, "b sees a's file");
    let procs_b = exec_ok(&socket_b, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '").await;
    assert!(
        !procs_b.contains("sleep"),
        "b sees a's processes: {procs_b}"
    );
    assert!(
        !h.rootfs.join("root/only-a").exists(),
        "the image was written to"
    );
    h.runtime.destroy(&sid("a1")).await.unwrap();
    assert_eq!(exec_ok(&socket_b, "echo still").await, "still");
    h.runtime.destroy(&sid("b1")).await.unwrap();
}

#[tokio::test]
async fn stop_kills_running_commands() {
    let Some(h) = Harness::new("stop") else {
        return;
    };
    let (started, socket) = h.start("s1").await;
    exec_ok(&socket, "setsid sleep 999 > /dev/null 2>&1 &").await;
    let blocking = tokio::spawn({
        let socket = socket.clone();
        async move {
            let body = serde_json::json!({ "command": "sleep 998", "timeout": 600 }).to_string();
            request(&socket, "POST", "/process/execute", Some(&body)).await
        }
    });
    // Wait until both sleeps run.
    let files = h.runtime.cgroup_procs_files("s1");
    let deadline = Instant::now() + Duration::from_secs(10);
    let sleeps = loop {
        let sleeps: Vec<i32> = pids_in(&files)
            .into_iter()
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|name| name.trim() == "sleep")
            })
            .collect();
        if sleeps.len() == 2 || Instant::now() > deadline {
            break sleeps;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(sleeps.len(), 2, "both sleeps should run");
    let all = pids_in(&files);

    let began = Instant::now();
    h.runtime.stop(&sid("s1")).await.unwrap();
    eprintln!("stop() took {:?}", began.elapsed());
    assert!(!h.runtime.is_running(&sid("s1")).await);
    let left: Vec<_> = all
        .iter()
        .filter(|p| alive(**p))
        .map(|p| describe(*p))
        .collect();
    assert!(left.is_empty(), "still alive: {left:?}");
    let answer = tokio::time::timeout(Duration::from_secs(5), blocking)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(
        answer.0, 200,
        "the running command must not finish normally: {answer:?}"
    );
    tokio::time::timeout(Duration::from_secs(5), started.exited)
        .await
        .unwrap()
        .unwrap();
    assert!(
        h.state.path().join("s1/upper").is_dir(),
        "stop keeps the layer"
    );
    h.runtime.destroy(&sid("s1")).await.unwrap();
}

#[tokio::test]
async fn start_failure_is_reported_and_cleaned_up() {
    let Some(h) = Harness::new("fail") else {
        return;
    };
    let mut spec = h.spec("f1");
    spec.rootfs = PathBuf::from("/nonexistent/rootfs");
    h.runtime.prepare(&spec).await.unwrap();
    let err = h.runtime.start(&spec).await.unwrap_err().to_string();
    assert!(err.contains("f1") && err.contains("overlay"), "{err}");
    assert!(h.cgroup_dirs("f1").is_empty(), "{:?}", h.cgroup_dirs("f1"));
    assert!(!h.runtime.is_running(&sid("f1")).await);
    h.runtime.destroy(&sid("f1")).await.unwrap();
}

#[tokio::test]
async fn a_fresh_runtime_finds_and_destroys_a_running_sandbox() {
    // As after a server crash: the new runtime has no handle on the shim.
    let Some(h) = Harness::new("crash") else {
        return;
    };
    let (started, socket) = h.start("c1").await;
    exec_ok(&socket, "sleep 1000 > /dev/null 2>&1 &").await;
    let pids = pids_in(&h.runtime.cgroup_procs_files("c1"));
    let fresh = ContainerRuntime::new(h.config.clone()).unwrap();
    assert!(fresh.is_running(&sid("c1")).await);
    fresh.destroy(&sid("c1")).await.unwrap();
    assert!(!fresh.is_running(&sid("c1")).await);
    h.assert_nothing_left("c1", &pids);
    let exited = tokio::time::timeout(Duration::from_secs(5), started.exited)
        .await
        .unwrap()
        .unwrap();
    assert!(exited.contains("signal 9"), "{exited}");
}

/// A build sandbox a crashed server left (no sandbox record knows it): a
/// fresh runtime lists it among what it holds, so restart recovery can
/// destroy it, and after that nothing of it is left.
#[tokio::test]
async fn a_fresh_runtime_lists_what_a_crash_left_so_it_can_be_destroyed() {
    let Some(h) = Harness::new("leftover") else {
        return;
    };
    let id = "build-0123456789abcdef";
    let (_started, socket) = h.start(id).await;
    exec_ok(&socket, "sleep 1000 > /dev/null 2>&1 &").await;
    let pids = pids_in(&h.runtime.cgroup_procs_files(id));
    let fresh = ContainerRuntime::new(h.config.clone()).unwrap();
    assert_eq!(fresh.sandbox_ids().await.unwrap(), [id]);
    fresh.destroy(&sid(id)).await.unwrap();
    h.assert_nothing_left(id, &pids);
    assert_eq!(fresh.sandbox_ids().await.unwrap(), Vec::<String>::new());
}

/// Logs medians of prepare + start and of the whole path to a first command answered;
/// figures for the log, not thresholds (the machine is shared and noisy).
#[tokio::test]
async fn start_time_is_logged() {
    let Some(h) = Harness::new("timing") else {
        return;
    };
    let (mut starts, mut firsts) = (Vec::new(), Vec::new());
    for round in 0..10 {
        let id = format!("t{round}");
        let spec = h.spec(&id);
        let began = Instant::now();
        h.runtime.prepare(&spec).await.unwrap();
        let started = h.runtime.start(&spec).await.unwrap();
        starts.push(began.elapsed());
        let AgentEndpoint::Unix(socket) = started.agent else {
            panic!("a container's agent is on a Unix socket")
        };
        assert_eq!(exec_ok(&socket, "echo ok").await, "ok");
        firsts.push(began.elapsed());
        h.runtime.destroy(&sid(&id)).await.unwrap();
    }
    starts.sort();
    firsts.sort();
    eprintln!(
        "median of 10: prepare+start {:?}, to first command answered {:?} (max {:?})",
        starts[5], firsts[5], firsts[9]
    );
}

/// A network namespace made with `ip netns`, with a veth pair inside; deleted on drop.
struct TestNetns {
    name: String,
}

impl TestNetns {
    fn new(name: &str) -> Self {
        let netns = Self {
            name: format!("cove-ct-{}-{name}", std::process::id()),
        };
        let ip = |args: &[&str]| {
            let status = std::process::Command::new("ip")
                .args(args)
                .status()
                .unwrap();
            assert!(status.success(), "ip {args:?}");
        };
        ip(&["netns", "add", &netns.name]);
        let n = netns.name.as_str();
        ip(&[
            "-n", n, "link", "add", "a0", "type", "veth", "peer", "name", "b0",
        ]);
        ip(&["-n", n, "addr", "add", "10.123.0.2/24", "dev", "a0"]);
        ip(&["-n", n, "link", "set", "a0", "up"]);
        ip(&["-n", n, "link", "set", "lo", "up"]);
        netns
    }

    fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

#[tokio::test]
async fn a_sandbox_joins_the_network_prepared_for_it() {
    let Some(h) = Harness::new("net") else { return };
    let netns = TestNetns::new("net");
    let mut spec = h.spec("n1");
    spec.network = Some(SandboxNetwork {
        link: NetworkLink::Namespace(netns.path()),
        resolv_conf: "nameserver 10.123.0.1\n".into(),
    });
    let (_started, socket) = h.start_spec(spec).await;
    let interfaces = exec_ok(&socket, "cat /proc/net/dev").await;
    assert!(interfaces.contains("a0:"), "{interfaces}");
    assert_eq!(
        exec_ok(&socket, "cat /etc/resolv.conf").await,
        "nameserver 10.123.0.1"
    );
    let addresses = exec_ok(&socket, "cat /proc/net/fib_trie").await;
    assert!(addresses.contains("10.123.0.2"), "{addresses}");

    // Without a network: a namespace of its own with only lo, and the
    // image's resolv.conf untouched.
    let (_plain, plain) = h.start("n2").await;
    let interfaces = exec_ok(&plain, "cat /proc/net/dev").await;
    assert!(!interfaces.contains("a0:"), "{interfaces}");
    assert!(interfaces.contains("lo:"), "{interfaces}");
    let (_, resolv) = exec(&plain, "cat /etc/resolv.conf").await;
    assert!(!resolv.contains("10.123.0.1"), "{resolv}");

    // The network outlives the sandbox: it belongs to the network side.
    h.runtime.destroy(&sid("n1")).await.unwrap();
    h.runtime.destroy(&sid("n2")).await.unwrap();
    assert!(netns.path().exists());
    h.assert_nothing_left("n1", &BTreeSet::new());
}

/// The host pid of a sandbox's init (the agent): the process of its cgroup that is PID 1
/// of its own pid namespace.
fn container_init_pid(h: &Harness, id: &str) -> i32 {
    let procs: Vec<PathBuf> = h
        .cgroup_dirs(id)
        .iter()
        .map(|dir| dir.join("cgroup.procs"))
        .collect();
    pids_in(&procs)
        .into_iter()
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .unwrap_or_default()
                .lines()
                .any(|l| l.starts_with("NSpid:") && l.split_whitespace().last() == Some("1"))
        })
        .expect("the container init is in its cgroups")
}

/// The seccomp programs installed on `pid`, in the order installed, as the kernel holds them:
/// PTRACE_SECCOMP_GET_FILTER needs CAP_SYS_ADMIN and a tracee in a ptrace stop. All
/// ptrace calls come from this thread, the tracer.
fn installed_filters(pid: i32) -> Vec<Vec<libc::sock_filter>> {
    const PTRACE_SECCOMP_GET_FILTER: libc::c_uint = 0x420c;
    let no_data = std::ptr::null_mut::<libc::c_void>();
    // SAFETY: ptrace requests with integer arguments only.
    let rc = unsafe { libc::ptrace(libc::PTRACE_ATTACH, pid, no_data, no_data) };
    assert_eq!(
        rc,
        0,
        "attach to {pid}: {}",
        std::io::Error::last_os_error()
    );
    let mut status = 0;
    // SAFETY: writes one int, which lives across the call.
    let waited = unsafe { libc::waitpid(pid, &mut status, libc::__WALL) };
    assert_eq!(waited, pid, "wait for {pid} to stop");
    let mut filters = Vec::new();
    for index in 0..16usize {
        // SAFETY: with a null buffer the kernel only answers the program's length.
        let len = unsafe { libc::ptrace(PTRACE_SECCOMP_GET_FILTER, pid, index, no_data) };
        if len < 0 {
            let err = std::io::Error::last_os_error();
            assert_eq!(
                err.raw_os_error(),
                Some(libc::ENOENT),
                "filter {index}: {err}"
            );
            break;
        }
        let empty = libc::sock_filter {
            code: 0,
            jt: 0,
            jf: 0,
            k: 0,
        };
        let mut program = vec![empty; len as usize];
        // SAFETY: the buffer holds the `len` instructions the kernel said it would copy.
        let copied =
            unsafe { libc::ptrace(PTRACE_SECCOMP_GET_FILTER, pid, index, program.as_mut_ptr()) };
        assert_eq!(copied, len);
        filters.push(program);
    }
    // SAFETY: integer arguments only; the tracee continues with no signal.
    let rc = unsafe { libc::ptrace(libc::PTRACE_DETACH, pid, no_data, no_data) };
    assert_eq!(
        rc,
        0,
        "detach from {pid}: {}",
        std::io::Error::last_os_error()
    );
    filters
}

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;

/// Runs a classic BPF program (the subset `seccomp.rs` emits) over one `struct
/// seccomp_data` for an x86_64 syscall `nr` with all arguments 0.
fn run_bpf(program: &[libc::sock_filter], nr: u32) -> u32 {
    let data = [nr, AUDIT_ARCH_X86_64];
    let word = |offset: u32| data.get(offset as usize / 4).copied().unwrap_or(0);
    let (mut acc, mut pc) = (0u32, 0usize);
    loop {
        let insn = program[pc];
        pc += 1;
        let jump = |taken: bool| usize::from(if taken { insn.jt } else { insn.jf });
        match insn.code {
            0x20 => acc = word(insn.k),
            0x54 => acc &= insn.k,
            0x05 => pc += insn.k as usize,
            0x15 => pc += jump(acc == insn.k),
            0x25 => pc += jump(acc > insn.k),
            0x35 => pc += jump(acc >= insn.k),
            0x45 => pc += jump(acc & insn.k != 0),
            0x06 => return insn.k,
            code => panic!("unexpected BPF opcode {code:#x} at {}", pc - 1),
        }
    }
}

/// What the kernel answers `nr` with: of all filters' actions the most restrictive, of
/// equals the most recent filter's.
fn seccomp_verdict(filters: &[Vec<libc::sock_filter>], nr: u32) -> u32 {
    filters
        .iter()
        .rev()
        .map(|program| run_bpf(program, nr))
        .min_by_key(|&ret| (ret & 0xffff_0000) as i32)
        .expect("at least one filter")
}

#[tokio::test]
async fn the_agent_runs_under_an_allow_list_that_answers_eperm() {
    let Some(h) = Harness::new("filter") else {
        return;
    };
    let (_started, socket) = h.start("f1").await;
    let pid = container_init_pid(&h, "f1");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("Seccomp:\t2"), "{status}");
    let filters = installed_filters(pid);
    assert_eq!(filters.len(), 1, "{status}");

    // One program, a search whose last range (every number above the
    // table) is its default: EPERM.
    let eperm = SECCOMP_RET_ERRNO | libc::EPERM as u32;
    let allow_list = &filters[0];
    let default = allow_list.last().unwrap();
    assert_eq!(
        (default.code, default.k),
        (0x06, eperm),
        "RET EPERM; lengths {:?}",
        filters.iter().map(Vec::len).collect::<Vec<_>>()
    );
    let getpid = libc::SYS_getpid as u32;
    for (nr, expected, what) in [
        (getpid, SECCOMP_RET_ALLOW, "getpid"),
        (libc::SYS_read as u32, SECCOMP_RET_ALLOW, "read"),
        (libc::SYS_keyctl as u32, eperm, "keyctl"),
        (libc::SYS_syslog as u32, eperm, "syslog"),
        (libc::SYS_fsopen as u32, eperm, "fsopen"),
        (libc::SYS_io_uring_setup as u32, eperm, "io_uring_setup"),
        (0x4000_0000 | getpid, eperm, "x32 getpid"),
        (500, eperm, "syscall 500, none yet"),
        (u32::MAX, eperm, "syscall 2^32-1"),
        (
            libc::SYS_clone3 as u32,
            SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
            "clone3",
        ),
    ] {
        assert_eq!(seccomp_verdict(&filters, nr), expected, "{what}");
    }
    // The agent still answers after the stop and detach.
    assert_eq!(exec_ok(&socket, "echo alive").await, "alive");
    h.runtime.destroy(&sid("f1")).await.unwrap();
}

/// A shell command running a Python script given on stdin.
fn python(script: &str) -> String {
    format!("python3 - <<'PYTHON'\n{script}\nPYTHON")
}

/// Calls each syscall with ctypes and prints `name result` per line: `ok` or the errno.
const SYSCALL_PROBES: &str = r#"
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(*[ctypes.c_long(a) for a in (nr,) + args])
    return "ok" if rc != -1 else errno.errorcode[ctypes.get_errno()]
probes = [
    ("keyctl", 250, 0, -3, 0),
    ("add_key", 248, 0, 0, 0, 0, 0),
    ("request_key", 249, 0, 0, 0, 0),
    ("bpf", 321, 0, 0, 0),
    ("syslog", 103, 10, 0, 0),
    ("userfaultfd", 323, 0),
    ("open_by_handle_at", 304, -100, 0, 0),
    ("fsopen", 430, 0, 0),
    ("io_uring_setup", 425, 1, 0),
    ("perf_event_open", 298, 0, 0, -1, -1, 0),
    ("kexec_load", 246, 0, 0, 0, 0),
    ("mount", 165, 0, 0, 0, 0, 0),
    ("clone3", 435, 0, 0),
    ("x32_getpid", 0x40000000 | 39),
    ("syscall_500", 500),
    ("personality_no_aslr", 135, 0x0040000),
    ("vsock", 41, 40, 1, 0),
    ("vsock_high_bits", 41, 0x100000028, 1, 0),
    ("raw_socket", 41, 2, 3, 1),
    ("getpid", 39),
    ("personality_query", 135, 0xffffffff),
    ("udp_socket", 41, 2, 2, 0),
]
for name, *args in probes:
    print(name, call(*args))
"#;

#[tokio::test]
async fn refused_syscalls_answer_eperm_inside_the_sandbox() {
    let Some(h) = Harness::new("probe") else {
        return;
    };
    let (_started, socket) = h.start("p1").await;
    let output = exec_ok(&socket, &python(SYSCALL_PROBES)).await;
    let results: std::collections::BTreeMap<&str, &str> = output
        .lines()
        .filter_map(|line| line.split_once(' '))
        .collect();
    let expected = [
        ("keyctl", "EPERM"),
        ("add_key", "EPERM"),
        ("request_key", "EPERM"),
        ("bpf", "EPERM"),
        ("syslog", "EPERM"),
        ("userfaultfd", "EPERM"),
        ("open_by_handle_at", "EPERM"),
        ("fsopen", "EPERM"),
        ("io_uring_setup", "EPERM"),
        ("perf_event_open", "EPERM"),
        ("kexec_load", "EPERM"),
        ("mount", "EPERM"),
        ("clone3", "ENOSYS"),
        ("x32_getpid", "EPERM"),
        ("syscall_500", "EPERM"),
        ("personality_no_aslr", "EPERM"),
        ("vsock", "EPERM"),
        ("vsock_high_bits", "EPERM"),
        ("raw_socket", "EPERM"),
        ("getpid", "ok"),
        ("personality_query", "ok"),
        ("udp_socket", "ok"),
    ];
    for (name, result) in expected {
        assert_eq!(results.get(name), Some(&result), "{name}: {output}");
    }
    h.runtime.destroy(&sid("p1")).await.unwrap();
}

/// One echo request to 127.0.0.1 over an ICMP datagram socket (unprivileged ping);
/// prints the type of the answer, 0 for an echo reply.
const ICMP_ECHO: &str = r#"
import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
s.settimeout(5)
s.sendto(struct.pack("!BBHHH", 8, 0, 0, 0, 1) + b"cove", ("127.0.0.1", 0))
print("reply type", s.recvfrom(64)[0][0])
"#;

#[tokio::test]
async fn no_raw_sockets_but_ping_works() {
    let Some(h) = Harness::new("ping") else {
        return;
    };
    let netns = TestNetns::new("ping");
    let mut joined = h.spec("i1");
    joined.network = Some(SandboxNetwork {
        link: NetworkLink::Namespace(netns.path()),
        resolv_conf: "nameserver 10.123.0.1\n".into(),
    });
    let (_joined, joined) = h.start_spec(joined).await;
    let (_own, own) = h.start("i2").await;
    for socket in [&joined, &own] {
        let caps = exec_ok(socket, "grep -E '^Cap(Eff|Bnd):' /proc/self/status").await;
        for line in caps.lines() {
            let mask = u64::from_str_radix(line.split_whitespace().last().unwrap(), 16).unwrap();
            assert_eq!(mask & (1 << 13), 0, "CAP_NET_RAW kept: {caps}");
        }
        let (code, out) = exec(
            socket,
            "python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)'",
        )
        .await;
        assert_ne!(code, 0, "a raw socket was opened: {out}");
        assert!(out.contains("PermissionError"), "{out}");
        // (The range itself reads as 65534 inside: it is written in host
        // group ids, of which the sandbox's user namespace maps only its own.)
        assert_eq!(exec_ok(socket, &python(ICMP_ECHO)).await, "reply type 0");
        // Every group may ping, not only root's.
        let as_nobody =
            format!("import os\nos.setgroups([]); os.setgid(65534); os.setuid(65534)\n{ICMP_ECHO}");
        assert_eq!(exec_ok(socket, &python(&as_nobody)).await, "reply type 0");
    }
    h.runtime.destroy(&sid("i1")).await.unwrap();
    h.runtime.destroy(&sid("i2")).await.unwrap();
}

#[tokio::test]
async fn ordinary_work_runs_under_the_filter() {
    let Some(h) = Harness::new("work") else {
        return;
    };
    let (_started, socket) = h.start("w1").await;
    let script = r#"
import mmap, os, subprocess, threading
results = []
threads = [threading.Thread(target=lambda i=i: results.append(i * i)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
with mmap.mmap(-1, 1 << 20) as m:
    m[:5] = b"cove!"
    assert m[:5] == b"cove!"
child = subprocess.run(["sh", "-c", "echo from-child"], capture_output=True, text=True)
pid = os.fork()
if pid == 0:
    os._exit(7)
_, status = os.waitpid(pid, 0)
print(sorted(results)[-1], child.stdout.strip(), os.waitstatus_to_exitcode(status))
"#;
    assert_eq!(exec_ok(&socket, &python(script)).await, "49 from-child 7");
    exec_ok(
        &socket,
        "cd /tmp && git init -q repo && cd repo && echo hi > f && git add f \
         && git -c user.name=t -c user.email=t@e commit -qm first && git log --oneline | grep -q first",
    )
    .await;
    exec_ok(&socket, "apt-get --version | head -1").await;
    exec_ok(&socket, "python3 -m pip --version").await;
    // A PTY, a new session, a pipeline and a background job in a shell.
    assert_eq!(
        exec_ok(
            &socket,
            "script -qec 'tty | grep -c /dev/pts' /dev/null | tr -d '\\r'"
        )
        .await,
        "1"
    );
    assert_eq!(
        exec_ok(&socket, "setsid sh -c 'sleep 0.1 & wait; echo done' | cat").await,
        "done"
    );
    h.runtime.destroy(&sid("w1")).await.unwrap();
}

/// Waits until `runtime`'s pool holds `count` shims.
async fn pool_filled(runtime: &ContainerRuntime, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while runtime.pooled_shims() < count {
        assert!(Instant::now() < deadline, "the shim pool did not fill");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The pool's cgroups under the harness's parent, in every controller.
fn pool_cgroups(h: &Harness) -> Vec<PathBuf> {
    ["cpu", "cpuacct", "memory", "pids", "freezer", "devices", ""]
        .iter()
        .map(|c| Path::new("/sys/fs/cgroup").join(c).join(&h.cgroup_parent))
        .flat_map(|parent| std::fs::read_dir(parent).into_iter().flatten().flatten())
        .map(|entry| entry.path())
        .filter(|path| {
            path.is_dir()
                && path
                    .file_name()
                    .is_some_and(|name| name.to_string_lossy().starts_with("pool@"))
        })
        .collect()
}

/// Two sandboxes started from the pool: each took a shim made for no one, and
/// each has its own limits, hostname, environment and cgroups; the pool's
/// cgroups hold neither.
#[tokio::test]
async fn sandboxes_from_the_pool_are_each_their_own() {
    let Some(h) = Harness::with_pool("pool", 2) else {
        return;
    };
    let mut small = h.spec("p1");
    small.env = vec![("WHO".into(), "first".into())];
    let mut large = h.spec("p2");
    large.env = vec![("WHO".into(), "second".into())];
    large.resources = Resources {
        cpu: 2,
        memory_mib: 512,
        disk_gib: 1,
    };
    // A full pool makes nothing in the background: the start takes one of these.
    pool_filled(&h.runtime, 2).await;
    let waiting = h.runtime.pooled_init_pids();
    let (_a, first) = h.start_spec(small).await;
    let first_init = container_init_pid(&h, "p1");
    assert!(
        waiting.contains(&first_init),
        "{first_init} is one of {waiting:?}"
    );
    pool_filled(&h.runtime, 2).await;
    let waiting = h.runtime.pooled_init_pids();
    let (_b, second) = h.start_spec(large).await;
    let second_init = container_init_pid(&h, "p2");
    assert!(
        waiting.contains(&second_init),
        "{second_init} is one of {waiting:?}"
    );
    let inits = [first_init, second_init];
    assert_ne!(inits[0], inits[1]);
    for (socket, id, who, memory, quota) in [
        (&first, "p1", "first", 256u64 << 20, "100000"),
        (&second, "p2", "second", 512u64 << 20, "200000"),
    ] {
        assert_eq!(exec_ok(socket, "hostname").await, format!("host-{id}"));
        assert_eq!(exec_ok(socket, "echo $WHO").await, who);
        assert_eq!(
            exec_ok(socket, "cat /sys/fs/cgroup/memory/memory.limit_in_bytes").await,
            memory.to_string()
        );
        let host = Path::new("/sys/fs/cgroup/cpu")
            .join(&h.cgroup_parent)
            .join(id)
            .join("cpu.cfs_quota_us");
        assert_eq!(std::fs::read_to_string(host).unwrap().trim(), quota);
        let pid1 = exec_ok(socket, "tr '\\0' ' ' < /proc/1/cmdline").await;
        assert!(pid1.contains("cove-agent"), "pid 1 is {pid1:?}");
        let status = exec_ok(socket, "grep -E '^(CapEff|Seccomp):' /proc/self/status").await;
        assert!(status.contains("CapEff:\t00000000a80405fb"), "{status}");
        assert!(status.contains("Seccomp:\t2"), "{status}");
    }
    let in_pool = pids_in(
        &pool_cgroups(&h)
            .iter()
            .map(|dir| dir.join("cgroup.procs"))
            .collect::<Vec<_>>(),
    );
    assert!(
        inits.iter().all(|pid| !in_pool.contains(pid)),
        "a sandbox's init is still in a pool cgroup"
    );
    h.runtime.destroy(&sid("p1")).await.unwrap();
    h.runtime.destroy(&sid("p2")).await.unwrap();
    h.runtime.end_pool().await;
}

/// A waiting init killed in the pool (an operator, the OOM killer) costs its
/// start nothing: the start discards it with its cgroups and takes the next
/// shim, or makes one.
#[tokio::test]
async fn a_start_passes_over_a_pool_shim_that_died() {
    let Some(h) = Harness::with_pool("pooldead", 2) else {
        return;
    };
    pool_filled(&h.runtime, 2).await;
    let waiting = h.runtime.pooled_init_pids();
    let cgroups_before = pool_cgroups(&h).len();
    for pid in &waiting {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::SIGKILL)
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while waiting.iter().any(|pid| alive(*pid)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (_started, socket) = h.start("d1").await;
    assert_eq!(exec_ok(&socket, "hostname").await, "host-d1");
    let init = container_init_pid(&h, "d1");
    assert!(!waiting.contains(&init), "{init} was killed in the pool");
    // The dead shims' cgroups went with them; the refill makes new ones.
    pool_filled(&h.runtime, 2).await;
    let fresh = h.runtime.pooled_init_pids();
    assert!(fresh.iter().all(|pid| !waiting.contains(pid)), "{fresh:?}");
    assert_eq!(
        pool_cgroups(&h).len(),
        cgroups_before,
        "{:?}",
        pool_cgroups(&h)
    );
    h.runtime.destroy(&sid("d1")).await.unwrap();
    h.runtime.end_pool().await;
}

/// A pool's shims are made and wait at the lowest priority, so making them
/// takes no CPU a start wants; the sandbox that takes one runs at the normal
/// priority, its shim too.
#[tokio::test]
async fn pool_shims_wait_at_the_lowest_priority_and_sandboxes_run_at_normal() {
    let Some(h) = Harness::with_pool("poolnice", 2) else {
        return;
    };
    pool_filled(&h.runtime, 2).await;
    for init in h.runtime.pooled_init_pids() {
        let shim = parent_of(init);
        assert_eq!(niceness(shim), 19, "{}", describe(shim));
    }
    let (_started, socket) = h.start("n1").await;
    assert_eq!(exec_ok(&socket, "nice").await, "0");
    let init = container_init_pid(&h, "n1");
    assert_eq!(niceness(init), 0);
    assert_eq!(niceness(parent_of(init)), 0, "the supervisor");
    h.runtime.destroy(&sid("n1")).await.unwrap();
    h.runtime.end_pool().await;
}

/// The niceness of `pid` (the 19th field of its stat).
fn niceness(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The command name, in parentheses, may hold spaces: count after it.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    fields[16].parse().unwrap()
}

fn parent_of(pid: i32) -> i32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// At shutdown the waiting shims and their inits end and their cgroups go.
#[tokio::test]
async fn ending_the_pool_leaves_no_cgroup_or_process() {
    let Some(h) = Harness::with_pool("poolend", 2) else {
        return;
    };
    pool_filled(&h.runtime, 2).await;
    let inits = h.runtime.pooled_init_pids();
    assert_eq!(pool_cgroups(&h).len() % 2, 0, "{:?}", pool_cgroups(&h));
    assert!(!pool_cgroups(&h).is_empty());
    h.runtime.end_pool().await;
    assert_eq!(h.runtime.pooled_shims(), 0);
    assert!(pool_cgroups(&h).is_empty(), "{:?}", pool_cgroups(&h));
    let deadline = Instant::now() + Duration::from_secs(5);
    while inits.iter().any(|pid| alive(*pid)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left: Vec<_> = inits
        .iter()
        .filter(|p| alive(**p))
        .map(|p| describe(*p))
        .collect();
    assert!(left.is_empty(), "still alive: {left:?}");
}

/// A server killed with its pool full: its shims die with it (parent-death
/// signal), and the next runtime of the same state directory removes the
/// cgroups they left.
#[tokio::test]
async fn a_new_runtime_sweeps_the_pool_a_killed_one_left() {
    let Some(h) = Harness::new("poolcrash") else {
        return;
    };
    let mut config = h.config.clone();
    config.shim_pool = 2;
    // The "server": a thread with its own runtime, whose end kills the shims
    // it spawned, as a crashed server's end does; nothing is cleaned up.
    let inits = std::thread::spawn(move || {
        let tokio = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio.block_on(async {
            let runtime = ContainerRuntime::new(config).unwrap();
            runtime.fill_pool();
            pool_filled(&runtime, 2).await;
            let inits = runtime.pooled_init_pids();
            std::mem::forget(runtime);
            inits
        })
    })
    .join()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while inits.iter().any(|pid| alive(*pid)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        inits.iter().all(|pid| !alive(*pid)),
        "the pool outlived its server"
    );
    assert!(
        !pool_cgroups(&h).is_empty(),
        "the killed server left no cgroup to sweep"
    );
    let fresh = ContainerRuntime::new(h.config.clone()).unwrap();
    assert!(pool_cgroups(&h).is_empty(), "{:?}", pool_cgroups(&h));
    drop(fresh);
}

/// A sandbox id the test names.
fn sid(id: &str) -> cove_runtime::SandboxId {
    cove_runtime::SandboxId::parse(id).expect("the test's ids are valid")
}

/// A runtime over a btrfs storage of its own (a small image in a temp dir),
/// for the receives of captured layers; unmounted when dropped.
struct Stored {
    runtime: std::sync::Arc<ContainerRuntime>,
    storage: std::sync::Arc<cove_runtime::storage::Storage>,
    root: PathBuf,
    _dir: tempfile::TempDir,
}

impl Stored {
    fn new(name: &str) -> Option<Self> {
        if !cove_testenv::root("the container storage tests") {
            return None;
        }
        let agent = cove_testenv::path("COVE_TEST_AGENT", "the static cove-agent binary")?;
        let dir = tempfile::Builder::new()
            .prefix("cove-cts-")
            .tempdir_in("/tmp")
            .unwrap();
        let root = dir.path().join("s");
        let storage =
            cove_runtime::storage::Storage::open(&dir.path().join("storage.img"), &root, 256 << 20)
                .unwrap();
        let storage = std::sync::Arc::new(storage);
        let mut config = ContainerConfig::new(
            root.join("sandboxes"),
            agent,
            std::env::current_exe().unwrap(),
        );
        config.cgroup_parent = format!("cove-test-{}-{name}", std::process::id());
        config.storage = Some(storage.clone());
        let runtime = std::sync::Arc::new(ContainerRuntime::new(config).unwrap());
        Some(Stored {
            runtime,
            storage,
            root: root.canonicalize().unwrap(),
            _dir: dir,
        })
    }

    /// What receives left under `captures/.incoming` (nothing, once each ended).
    fn incoming(&self) -> Vec<PathBuf> {
        let dir = self.root.join("captures").join(".incoming");
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .map(|entry| entry.unwrap().path())
            .collect()
    }
}

impl Drop for Stored {
    fn drop(&mut self) {
        let _ = self.storage.unmount();
    }
}

#[tokio::test]
async fn a_layer_larger_than_the_storage_can_take_is_refused_and_leaves_nothing() {
    let Some(h) = Stored::new("spool") else {
        return;
    };
    // A 256 MiB storage may spool about a hundred; this stream has a GiB.
    let stream = std::io::Read::take(std::io::repeat(7), 1 << 30);
    let error = h
        .runtime
        .receive_capture("cap-big", stream)
        .await
        .expect_err("a layer larger than the storage can take");
    let message = error.to_string();
    assert!(
        message.contains("larger than this runner's storage can take"),
        "{message}"
    );
    assert!(!h.runtime.captured_layer("cap-big").exists());
    assert_eq!(h.incoming(), Vec::<PathBuf>::new());
}

/// A stream that reports its first read, then holds its reader until let go.
struct Held {
    first_read: Option<std::sync::mpsc::Sender<()>>,
    go: Option<std::sync::mpsc::Receiver<()>>,
}

impl std::io::Read for Held {
    fn read(&mut self, _buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(first) = self.first_read.take() {
            let _ = first.send(());
        }
        if let Some(go) = self.go.take() {
            let _ = go.recv();
        }
        Ok(0)
    }
}

#[tokio::test]
async fn captured_layers_are_received_one_at_a_time() {
    let Some(h) = Stored::new("receive") else {
        return;
    };
    let held = |go| {
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        let stream = Held {
            first_read: Some(first_tx),
            go,
        };
        (stream, first_rx)
    };
    let (go_a, wait_a) = std::sync::mpsc::channel();
    let (stream_a, read_a) = held(Some(wait_a));
    let (stream_b, read_b) = held(None);
    let runtime = h.runtime.clone();
    let a = tokio::spawn(async move { runtime.receive_capture("cap-a", stream_a).await });
    tokio::task::spawn_blocking(move || read_a.recv_timeout(Duration::from_secs(30)))
        .await
        .unwrap()
        .expect("the first receive reads its stream");
    let runtime = h.runtime.clone();
    let b = tokio::spawn(async move { runtime.receive_capture("cap-b", stream_b).await });
    // Its budget would be measured on the free space the first is filling.
    let (read_b, early) = tokio::task::spawn_blocking(move || {
        let early = read_b.recv_timeout(Duration::from_millis(500));
        (read_b, early)
    })
    .await
    .unwrap();
    assert!(
        early.is_err(),
        "a second receive began while the first was on"
    );
    go_a.send(()).unwrap();
    tokio::task::spawn_blocking(move || read_b.recv_timeout(Duration::from_secs(30)))
        .await
        .unwrap()
        .expect("the second receive goes on once the first ended");
    // Empty streams hold no capture: both fail, and leave nothing.
    assert!(a.await.unwrap().is_err());
    assert!(b.await.unwrap().is_err());
    assert_eq!(h.incoming(), Vec::<PathBuf>::new());
    assert!(!h.runtime.captured_layer("cap-a").exists());
}

/// The `btrfs send` stream of a new read-only subvolume `name` under `dir`
/// on `h`'s storage holding `upper/` with `files`, and a reflinked copy of
/// the first (which the sender writes as a clone from the subvolume itself).
fn sent_subvolume(h: &Stored, dir: &Path, name: &str, files: &[(&str, &str)]) -> Vec<u8> {
    let draft = dir.join(format!("{name}-draft"));
    h.storage.create_limited(&draft, 64 << 20).unwrap();
    std::fs::create_dir(draft.join("upper")).unwrap();
    for (file, text) in files {
        std::fs::write(draft.join("upper").join(file), text).unwrap();
    }
    let copied = std::process::Command::new("cp")
        .arg("--reflink=always")
        .arg(draft.join("upper").join(files[0].0))
        .arg(draft.join("upper").join("reflinked"))
        .status()
        .unwrap();
    assert!(copied.success());
    let sealed = dir.join(name);
    h.storage.snapshot(&draft, &sealed, true).unwrap();
    h.storage.delete_subvolume(&draft).unwrap();
    let output = cove_runtime::storage::Storage::send_command(&sealed)
        .unwrap()
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    h.storage.delete_subvolume(&sealed).unwrap();
    output.stdout
}

#[tokio::test]
async fn a_captured_layer_that_clones_from_another_subvolume_is_refused_and_leaves_nothing() {
    let Some(h) = Stored::new("clone") else {
        return;
    };
    let made = h.root.join("made");
    std::fs::create_dir_all(&made).unwrap();
    // A real capture's stream, a reflinked file in it, is taken whole.
    // Large enough for an extent of its own (small files are inline, and
    // sent as writes).
    let text = "hello from a runner\n".repeat(16 << 10);
    let bytes = sent_subvolume(&h, &made, "cap-real", &[("hello", &text)]);
    let layer = h
        .runtime
        .receive_capture("cap-real", std::io::Cursor::new(bytes.clone()))
        .await
        .unwrap();
    for file in ["hello", "reflinked"] {
        assert_eq!(std::fs::read_to_string(layer.join(file)).unwrap(), text);
    }
    // The same stream with its clone pointed at another subvolume's UUID
    // (one on the receiver's storage, found by UUID outside the chroot) is
    // refused before `btrfs receive` runs.
    let forged = forge_clone_source(&bytes, [0x5a; 16]);
    let error = h
        .runtime
        .receive_capture("cap-forged", std::io::Cursor::new(forged))
        .await
        .expect_err("a clone from another subvolume");
    assert!(
        error.to_string().contains("clones from another subvolume"),
        "{error}"
    );
    assert!(!h.runtime.captured_layer("cap-forged").exists());
    assert_eq!(h.incoming(), Vec::<PathBuf>::new());
}

/// `stream` with the clone source UUID of each of its CLONE commands
/// replaced by `uuid` (CRCs left as they were: the check comes first).
fn forge_clone_source(stream: &[u8], uuid: [u8; 16]) -> Vec<u8> {
    let mut out = stream.to_vec();
    let mut at = 17;
    let mut forged = 0;
    while at + 10 <= out.len() {
        let length = u32::from_le_bytes(out[at..at + 4].try_into().unwrap()) as usize;
        let command = u16::from_le_bytes(out[at + 4..at + 6].try_into().unwrap());
        let (mut attr, end) = (at + 10, at + 10 + length);
        while command == 16 && attr + 4 <= end {
            let kind = u16::from_le_bytes(out[attr..attr + 2].try_into().unwrap());
            let size = u16::from_le_bytes(out[attr + 2..attr + 4].try_into().unwrap()) as usize;
            if kind == 20 {
                out[attr + 4..attr + 4 + size].copy_from_slice(&uuid);
                forged += 1;
            }
            attr += 4 + size;
        }
        at = end;
    }
    assert!(forged > 0, "the sender wrote the reflinked file as a clone");
    out
}
