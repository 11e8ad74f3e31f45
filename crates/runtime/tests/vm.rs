//! Real VMs on this host: needs root, QEMU 10 (`scripts/vm-setup`), the guest
//! kernel and initramfs (`scripts/vm-assets`, their directory in
//! `COVE_TEST_VM_ASSETS`), a Debian root filesystem (`COVE_TEST_ROOTFS`) and
//! the static agent (`COVE_TEST_AGENT`). Without them each test is skipped
//! with its reason, or fails under `COVE_TEST_STRICT=1` (`cove-testenv`).
//!
//! Each test makes its own btrfs storage in a temporary directory; its Drop
//! kills every QEMU that runs on that directory (the processes the test
//! started), unmounts the storage and removes the directory, even after a
//! failure. The tests run one at a time: VMs under emulation need the CPUs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cove_runtime::storage::Storage;
use cove_runtime::vm::{VmConfig, VmRuntime};
use cove_runtime::{AgentEndpoint, Resources, Runtime, SandboxSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// One VM test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn assets() -> Option<(PathBuf, PathBuf, PathBuf)> {
    if !cove_testenv::root("the VM tests") {
        return None;
    }
    Some((
        cove_testenv::path(
            "COVE_TEST_VM_ASSETS",
            "the guest kernel and initramfs (scripts/vm-assets)",
        )?,
        cove_testenv::path("COVE_TEST_ROOTFS", "a Debian root filesystem with python3")?,
        cove_testenv::path("COVE_TEST_AGENT", "the static cove-agent binary")?,
    ))
}

struct Harness {
    runtime: VmRuntime,
    storage: Arc<Storage>,
    rootfs: PathBuf,
    dir: tempfile::TempDir,
}

impl Harness {
    fn new() -> Option<Harness> {
        Harness::with_config(|_| {})
    }

    fn with_config(adjust: impl FnOnce(&mut VmConfig)) -> Option<Harness> {
        let (assets, rootfs, agent) = assets()?;
        // COVE_LOG=cove_runtime=debug shows each step's timing.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("COVE_LOG")
                    .unwrap_or_else(|_| "warn".into()),
            )
            .with_test_writer()
            .try_init();
        // Short, so socket paths fit in sun_path.
        let dir = tempfile::Builder::new()
            .prefix("cove-vmt-")
            .tempdir_in("/tmp")
            .unwrap();
        let storage = Storage::open(
            &dir.path().join("storage.img"),
            &dir.path().join("s"),
            64 << 30,
        )
        .unwrap();
        let storage = Arc::new(storage);
        let mut config = VmConfig::new(storage.clone(), assets, agent);
        adjust(&mut config);
        let runtime = VmRuntime::new(config).unwrap();
        Some(Harness {
            runtime,
            storage,
            rootfs,
            dir,
        })
    }

    fn spec(&self, id: &str, memory_mib: u64) -> SandboxSpec {
        SandboxSpec {
            id: sid(id),
            hostname: format!("host-{id}"),
            rootfs: self.rootfs.clone(),
            layers: Vec::new(),
            resources: Resources {
                cpu: 1,
                memory_mib,
                // The default, as the default image (about 2 GiB as a VM disk) needs.
                disk_gib: 3,
            },
            env: vec![("SANDBOX_TEST".into(), format!("env-{id}"))],
            network: None,
            volumes: Vec::new(),
            workdir: None,
            user: None,
            command: Vec::new(),
        }
    }

    fn socket(&self, id: &str) -> PathBuf {
        self.storage.root().join("vms").join(id).join("agent.sock")
    }

    /// Pids of the QEMU processes of one sandbox.
    fn qemus_of(&self, id: &str) -> Vec<i32> {
        qemus_under(&self.storage.root().join("vms").join(id))
    }

    /// Pids of the QEMU processes running on this test's directory.
    fn qemus(&self) -> Vec<i32> {
        qemus_under(self.dir.path())
    }
}

fn qemus_under(dir: &Path) -> Vec<i32> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let text = String::from_utf8_lossy(&cmdline);
            text.contains("qemu-system") && text.contains(&needle)
        })
        .collect()
}

impl Drop for Harness {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = self.qemus();
            if left.is_empty() || Instant::now() > deadline {
                break;
            }
            for pid in left {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::SIGKILL,
                );
                thaw(pid);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Err(error) = self.storage.unmount() {
            eprintln!("unmount the test storage: {error}");
        }
    }
}

/// Thaws the freezer cgroup of a process (a warm-paused QEMU is frozen,
/// and a frozen process dies only once thawed).
fn thaw(pid: i32) {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next(), fields.next(), fields.next());
        if let (Some(controllers), Some(path)) = (controllers, path) {
            if controllers.split(',').any(|c| c == "freezer") {
                let state = format!("/sys/fs/cgroup/freezer{path}/freezer.state");
                let _ = std::fs::write(state, "THAWED");
            }
        }
    }
}

/// One HTTP/1.1 exchange over the agent socket; returns status and body.
async fn request(socket: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = UnixStream::connect(socket)
        .await
        .unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
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
    (status, body.to_owned())
}

/// Runs a command through the agent: exit code and output.
async fn exec(socket: &Path, command: &str) -> (i64, String) {
    let body = serde_json::json!({ "command": command, "timeout": 120 }).to_string();
    let (status, reply) = request(socket, "POST", "/process/execute", &body).await;
    assert_eq!(status, 200, "execute {command:?}: {reply}");
    let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
    (
        reply["exitCode"].as_i64().unwrap(),
        reply["result"].as_str().unwrap_or("").to_owned(),
    )
}

async fn exec_ok(socket: &Path, command: &str) -> String {
    let (code, output) = exec(socket, command).await;
    assert_eq!(code, 0, "{command:?} failed: {output}");
    output.trim().to_owned()
}

/// Starts a shell that counts in its own memory and publishes the count in
/// /dev/shm (memory too); returns its pid.
async fn start_counter(socket: &Path) -> String {
    exec_ok(
        socket,
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /dev/shm/n.tmp; \
         mv /dev/shm/n.tmp /dev/shm/n; sleep 0.1; done' </dev/null >/dev/null 2>&1 & echo $!",
    )
    .await
}

/// The counter's value; 0 before its first tick.
async fn count(socket: &Path) -> u64 {
    let text = exec_ok(socket, "cat /dev/shm/n 2>/dev/null || echo 0").await;
    text.parse()
        .unwrap_or_else(|_| panic!("the counter says {text:?}"))
}

/// The counter with `pid` is alive and counting beyond `at_least`.
async fn assert_counting(socket: &Path, pid: &str, at_least: u64) {
    let alive = exec_ok(socket, &format!("kill -0 {pid} && echo alive")).await;
    assert_eq!(alive, "alive");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = count(socket).await;
        if now > at_least {
            return;
        }
        assert!(Instant::now() < deadline, "the counter stays at {now}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The guest's wall clock agrees with the host's within a few seconds.
async fn assert_clock_is_right(socket: &Path) {
    let guest: i64 = exec_ok(socket, "date +%s").await.parse().unwrap();
    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (guest - host).abs() <= 3,
        "guest clock {guest}, host clock {host}"
    );
}

fn ms(duration: Duration) -> String {
    format!("{:.0} ms", duration.as_secs_f64() * 1e3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_keeps_its_memory_across_pause_snapshots_and_forks() {
    let _serial = SERIAL.lock().await;
    let Some(h) = Harness::new() else { return };
    let rt = &h.runtime;

    // Create: the first sandbox makes the template, then continues from it.
    let a = h.spec("vm-a", 256);
    let began = Instant::now();
    rt.prepare(&a).await.unwrap();
    let started = rt.start(&a).await.unwrap();
    eprintln!("first create (template made here): {}", ms(began.elapsed()));
    let AgentEndpoint::Unix(socket) = started.agent.clone() else {
        panic!("a VM's agent is on a Unix socket")
    };
    assert_eq!(socket, h.socket("vm-a"));
    assert!(matches!(started.accelerator, Some("kvm" | "tcg")));
    let (code, out) = exec(&socket, "echo hi").await;
    assert_eq!((code, out.trim()), (0, "hi"));
    // The template's memory held another name and environment.
    let who = exec_ok(&socket, "echo $(hostname) $SANDBOX_TEST").await;
    assert_eq!(who, "host-vm-a env-vm-a");
    // The root filesystem grows (in the background) to fill the 2 GiB disk,
    // larger than the template's.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let size = exec_ok(&socket, "df --output=size -B1M / | tail -n 1").await;
        if size.trim().parse::<u64>().unwrap() > 1800 {
            break;
        }
        assert!(Instant::now() < deadline, "root stays at {size} MiB");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Pause and resume: the counter process goes on where it was.
    let counter = start_counter(&socket).await;
    assert_counting(&socket, &counter, 0).await;
    let before = count(&socket).await;
    assert_clock_is_right(&socket).await;
    let qemu = h.qemus();
    let began = Instant::now();
    rt.pause(&sid("vm-a")).await.unwrap();
    eprintln!("pause (warm): {}", ms(began.elapsed()));
    assert!(!rt.is_running(&sid("vm-a")).await);
    assert_eq!(h.qemus(), qemu, "a warm pause keeps its QEMU process");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let began = Instant::now();
    rt.start(&a).await.unwrap();
    assert_eq!(exec_ok(&socket, "echo back").await, "back");
    eprintln!("resume (warm) -> first command: {}", ms(began.elapsed()));
    assert_eq!(h.qemus(), qemu, "a warm resume continues the same process");
    assert_counting(&socket, &counter, before).await;
    // The guest's clock stopped while it was paused; the host set it again.
    assert_clock_is_right(&socket).await;
    // Deepened: the memory saved, the process gone; the resume restores it.
    let before = count(&socket).await;
    rt.pause(&sid("vm-a")).await.unwrap();
    rt.deepen_all().await;
    assert!(h.qemus().is_empty(), "a deepened pause has no process");
    tokio::time::sleep(Duration::from_secs(5)).await;
    let began = Instant::now();
    rt.start(&a).await.unwrap();
    assert_eq!(exec_ok(&socket, "echo back").await, "back");
    eprintln!("resume (saved) -> first command: {}", ms(began.elapsed()));
    assert_counting(&socket, &counter, before).await;
    assert_clock_is_right(&socket).await;
    exec_ok(&socket, "echo from-a > /root/who && sync").await;

    // A memory snapshot: a new sandbox made from it runs the same counter.
    let capture = rt.capture_with_memory(&sid("vm-a"), "cap-1").await.unwrap();
    let at_capture = count(&socket).await;
    let mut b = h.spec("vm-b", 256);
    b.layers = vec![capture.clone()];
    rt.prepare(&b).await.unwrap();
    let began = Instant::now();
    let started_b = rt.start(&b).await.unwrap();
    let b_socket = h.socket("vm-b");
    assert_eq!(exec_ok(&b_socket, "cat /root/who").await, "from-a");
    eprintln!(
        "start from a memory snapshot -> first command: {}",
        ms(began.elapsed())
    );
    assert_eq!(
        exec_ok(&b_socket, "echo $(hostname) $SANDBOX_TEST").await,
        "host-vm-b env-vm-b"
    );
    assert_counting(&b_socket, &counter, at_capture.saturating_sub(1)).await;

    // A fork: the child continues the parent's processes, then both diverge.
    let c = h.spec("vm-c", 256);
    let began = Instant::now();
    rt.fork(&sid("vm-a"), &c).await.unwrap();
    let forked = began.elapsed();
    rt.start(&c).await.unwrap();
    let c_socket = h.socket("vm-c");
    assert_eq!(exec_ok(&c_socket, "echo child").await, "child");
    eprintln!(
        "fork: {} (child answers {} after the fork began)",
        ms(forked),
        ms(began.elapsed())
    );
    assert_counting(&c_socket, &counter, 0).await;
    assert_counting(&socket, &counter, 0).await;
    exec_ok(
        &socket,
        "echo parent > /root/who; echo parent > /dev/shm/mem",
    )
    .await;
    exec_ok(
        &c_socket,
        "echo child > /root/who; echo child > /dev/shm/mem",
    )
    .await;
    exec_ok(&socket, &format!("kill {counter}")).await;
    assert_eq!(
        exec_ok(&socket, "cat /root/who /dev/shm/mem").await,
        "parent\nparent"
    );
    assert_eq!(
        exec_ok(&c_socket, "cat /root/who /dev/shm/mem").await,
        "child\nchild"
    );
    let (gone, _) = exec(&socket, &format!("kill -0 {counter}")).await;
    assert_ne!(gone, 0, "the parent's counter was killed");
    assert_counting(&c_socket, &counter, count(&c_socket).await).await;

    // Stop and start: a cold boot from the intact disk, memory gone.
    exec_ok(&c_socket, "echo unsynced-but-stopped > /root/late").await;
    rt.stop(&sid("vm-c")).await.unwrap();
    assert!(!rt.is_running(&sid("vm-c")).await);
    let began = Instant::now();
    rt.start(&c).await.unwrap();
    eprintln!("cold boot after stop -> agent: {}", ms(began.elapsed()));
    assert_eq!(
        exec_ok(&c_socket, "cat /root/who /root/late").await,
        "child\nunsynced-but-stopped"
    );
    let (missing, _) = exec(&c_socket, "cat /dev/shm/mem").await;
    assert_ne!(missing, 0, "memory does not survive a stop");
    let (dead, _) = exec(&c_socket, &format!("kill -0 {counter}")).await;
    assert_ne!(dead, 0, "processes do not survive a stop");

    // A disk capture of a running VM; a sandbox made from it boots with
    // what was written (the agent flushes first), then a revert to the
    // memory snapshot brings its processes back.
    let disk_capture = rt.capture(&sid("vm-c"), "cap-2").await.unwrap();
    let mut d = h.spec("vm-d", 256);
    d.layers = vec![disk_capture.clone()];
    rt.prepare(&d).await.unwrap();
    rt.start(&d).await.unwrap();
    let d_socket = h.socket("vm-d");
    assert_eq!(
        exec_ok(&d_socket, "cat /root/who /root/late").await,
        "child\nunsynced-but-stopped"
    );
    rt.stop(&sid("vm-d")).await.unwrap();
    rt.revert(&d, "cap-1").await.unwrap();
    rt.start(&d).await.unwrap();
    assert_eq!(exec_ok(&d_socket, "cat /root/who").await, "from-a");
    assert_counting(&d_socket, &counter, 0).await;

    // A VM that dies is reported.
    let b_qemu = qemus_under(&h.storage.root().join("vms").join("vm-b"));
    assert_eq!(b_qemu.len(), 1, "{b_qemu:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(b_qemu[0]),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    let why = tokio::time::timeout(Duration::from_secs(30), started_b.exited)
        .await
        .expect("the exit is reported")
        .unwrap();
    assert!(why.contains("signal 9"), "{why}");
    assert!(!rt.is_running(&sid("vm-b")).await);

    // The template the VMs continued from says what it was made of. An
    // older make of the same machine (as an upgrade's new agent leaves
    // behind) goes when the server starts again; the newest stays.
    let templates = h.storage.root().join("vm-templates");
    let made: Vec<_> = std::fs::read_dir(&templates)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_none())
        .collect();
    assert_eq!(made.len(), 1, "{made:?}");
    let made_of = std::fs::read_to_string(made[0].join("made-of")).unwrap();
    assert!(
        made_of.contains(&format!("rootfs={} ", h.rootfs.display())),
        "{made_of}"
    );
    let older = templates.join("0123456789abcdef");
    std::fs::create_dir(&older).unwrap();
    std::fs::write(older.join("made-of"), &made_of).unwrap();
    let marker = std::fs::File::create(older.join("complete")).unwrap();
    marker
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))
        .unwrap();

    // After a server restart, a new runtime finds the VM still running and
    // can stop it.
    let again = VmRuntime::new(VmConfig::new(
        h.storage.clone(),
        assets().unwrap().0,
        assets().unwrap().2,
    ))
    .unwrap();
    assert!(!older.exists());
    assert!(made[0].join("complete").exists());
    assert!(again.is_running(&sid("vm-a")).await);
    again.stop(&sid("vm-a")).await.unwrap();
    assert!(!again.is_running(&sid("vm-a")).await);
    assert!(qemus_under(&h.storage.root().join("vms").join("vm-a")).is_empty());
    assert!(again.is_running(&sid("vm-d")).await);
    again.destroy(&sid("vm-d")).await.unwrap();
    assert!(qemus_under(&h.storage.root().join("vms").join("vm-d")).is_empty());
    assert!(!h.storage.root().join("vms").join("vm-d").exists());
    drop(again);
    // The data dir links the one base its disks name, in the shared cache
    // (kept as the restart matched links to disks).
    let links: Vec<_> = std::fs::read_dir(h.dir.path().join("vm-bases"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    assert_eq!(links.len(), 1, "{links:?}");
    let base = assets()
        .unwrap()
        .0
        .join("bases")
        .join(links[0].file_name().unwrap());
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&base).unwrap()),
        std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&links[0]).unwrap()),
    );

    // Destroy: no process, no files.
    for id in ["vm-a", "vm-b", "vm-c", "vm-d"] {
        rt.destroy(&sid(id)).await.unwrap();
        assert!(!h.storage.root().join("vms").join(id).exists(), "{id}");
        rt.destroy(&sid(id)).await.unwrap();
    }
    rt.discard_capture("cap-1").await.unwrap();
    rt.discard_capture("cap-2").await.unwrap();
    assert!(!capture.exists());
    assert!(!disk_capture.exists());
    assert!(h.qemus().is_empty(), "left running: {:?}", h.qemus());
}

/// Waits until `path` in the guest has a line, then answers its lines.
async fn lines_once_written(socket: &Path, path: &str) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, out) = exec(socket, &format!("cat {path}")).await;
        if code == 0 && !out.trim().is_empty() {
            return out.lines().map(str::to_owned).collect();
        }
        assert!(Instant::now() < deadline, "{path} was never written");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vms_repeat_unanswered_identity_calls_and_flush_paused_disks_late() {
    let _serial = SERIAL.lock().await;
    // No identity call is answered in no time: every boot and restore here
    // gives up on its first session, connects to the agent again and
    // repeats the call there.
    let Some(h) = Harness::with_config(|config| config.identity_timeout = Duration::ZERO) else {
        return;
    };
    let rt = &h.runtime;
    let entrypoint = |spec: &mut SandboxSpec| {
        spec.command = ["sh", "-c", "echo run >> /root/entry.log; exec sleep 100000"]
            .map(String::from)
            .to_vec();
    };
    // The template's boot and the sandbox's restore from it.
    let mut a = h.spec("vm-r", 256);
    entrypoint(&mut a);
    rt.prepare(&a).await.unwrap();
    rt.start(&a).await.unwrap();
    let socket = h.socket("vm-r");
    assert_eq!(
        exec_ok(&socket, "echo $(hostname) $SANDBOX_TEST").await,
        "host-vm-r env-vm-r"
    );
    assert_eq!(
        lines_once_written(&socket, "/root/entry.log").await,
        ["run"]
    );

    // A fork child: the repeated call gives it its own name, and the
    // entrypoint it inherited running is not started a second time.
    let mut b = h.spec("vm-s", 256);
    entrypoint(&mut b);
    rt.fork(&sid("vm-r"), &b).await.unwrap();
    rt.start(&b).await.unwrap();
    let child = h.socket("vm-s");
    assert_eq!(
        exec_ok(&child, "echo $(hostname) $SANDBOX_TEST").await,
        "host-vm-s env-vm-s"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(lines_once_written(&child, "/root/entry.log").await, ["run"]);
    assert_eq!(exec_ok(&child, "pgrep -c -x sleep").await, "1");
    assert_eq!(exec_ok(&socket, "echo parent").await, "parent");

    // A pause does not flush the guest's page cache. A capture of the disk
    // alone, and a stop that drops the memory, have the paused VM flush it
    // first: a write the guest never synced is on the disk afterwards.
    exec_ok(&child, "echo kept > /root/unflushed").await;
    rt.pause(&sid("vm-s")).await.unwrap();
    let disk_only = rt.capture(&sid("vm-s"), "cap-flushed").await.unwrap();
    assert!(h.qemus_of("vm-s").is_empty(), "the flush left QEMU running");
    let mut c = h.spec("vm-t", 256);
    c.layers = vec![disk_only];
    rt.prepare(&c).await.unwrap();
    rt.start(&c).await.unwrap();
    assert_eq!(
        exec_ok(&h.socket("vm-t"), "cat /root/unflushed").await,
        "kept"
    );
    // Still paused, with its memory: it continues where it was.
    rt.start(&b).await.unwrap();
    assert_eq!(exec_ok(&child, "pgrep -c -x sleep").await, "1");
    exec_ok(&child, "echo again > /root/unflushed").await;
    rt.pause(&sid("vm-s")).await.unwrap();
    rt.stop(&sid("vm-s")).await.unwrap();
    assert!(h.qemus_of("vm-s").is_empty(), "the flush left QEMU running");
    rt.start(&b).await.unwrap();
    // A cold boot: the entrypoint starts afresh, and the file is there.
    assert_eq!(exec_ok(&child, "cat /root/unflushed").await, "again");

    rt.destroy(&sid("vm-t")).await.unwrap();
    rt.discard_capture("cap-flushed").await.unwrap();
    for id in ["vm-r", "vm-s"] {
        rt.destroy(&sid(id)).await.unwrap();
        assert!(!h.storage.root().join("vms").join(id).exists(), "{id}");
    }
    assert!(h.qemus().is_empty(), "left running: {:?}", h.qemus());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_into_many_gives_each_child_the_parents_instant() {
    let _serial = SERIAL.lock().await;
    let Some(h) = Harness::new() else { return };
    let rt = &h.runtime;
    let parent = h.spec("vm-p", 256);
    rt.prepare(&parent).await.unwrap();
    rt.start(&parent).await.unwrap();
    let socket = h.socket("vm-p");
    let counter = start_counter(&socket).await;
    assert_counting(&socket, &counter, 0).await;

    let children: Vec<SandboxSpec> = ["vm-k1", "vm-k2", "vm-k3"]
        .into_iter()
        .map(|id| h.spec(id, 256))
        .collect();
    let began = Instant::now();
    rt.fork_many(&sid("vm-p"), &children).await.unwrap();
    let forked = began.elapsed();
    assert!(rt.is_running(&sid("vm-p")).await);
    let at_fork = count(&socket).await;
    // Started at once, as the engine starts them.
    let (k1, k2, k3) = tokio::join!(
        rt.start(&children[0]),
        rt.start(&children[1]),
        rt.start(&children[2])
    );
    for started in [k1, k2, k3] {
        started.unwrap();
    }
    eprintln!(
        "fork into 3: {} (all started {} after the fork began)",
        ms(forked),
        ms(began.elapsed())
    );
    for child in &children {
        let id = child.id.as_str();
        let child_socket = h.socket(id);
        // The parent's counter (its pid, its count) goes on in each child,
        // which is itself.
        assert_counting(&child_socket, &counter, 0).await;
        assert_eq!(
            exec_ok(&child_socket, "echo $(hostname)").await,
            format!("host-{id}")
        );
        exec_ok(&child_socket, &format!("echo {id} > /dev/shm/mark")).await;
    }
    for child in &children {
        let id = child.id.as_str();
        assert_eq!(exec_ok(&h.socket(id), "cat /dev/shm/mark").await, id);
    }
    let (unmarked, _) = exec(&socket, "cat /dev/shm/mark").await;
    assert_ne!(unmarked, 0, "a child's memory is not the parent's");
    assert_counting(&socket, &counter, at_fork).await;

    for id in ["vm-k1", "vm-k2", "vm-k3", "vm-p"] {
        rt.destroy(&sid(id)).await.unwrap();
    }
    assert!(h.qemus().is_empty(), "left running: {:?}", h.qemus());
}

/// A sandbox id the test names.
fn sid(id: &str) -> cove_runtime::SandboxId {
    cove_runtime::SandboxId::parse(id).expect("the test's ids are valid")
}
