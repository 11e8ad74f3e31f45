//! Measures the VM backend on this host: create from a template -> first
//! command, pause, resume -> first command, fork -> the child's first
//! command (and how long the parent was frozen), for each RAM size given.
//!
//! ```text
//! COVE_TEST_VM_ASSETS=/var/tmp/cove/vm COVE_TEST_ROOTFS=... COVE_TEST_AGENT=... \
//!   cargo run -p cove-runtime --example vm_timings -- 256 1024
//! ```
//!
//! Needs root. Makes its own btrfs storage in a temporary directory and
//! removes everything it made when it ends; `COVE_LOG=cove_runtime=debug`
//! shows the steps, `--keep-consoles DIR` copies the guests' consoles there.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cove_runtime::storage::Storage;
use cove_runtime::vm::{VmConfig, VmRuntime};
use cove_runtime::{Resources, Runtime, SandboxSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

fn env_path(name: &str) -> PathBuf {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("set {name} (see the example's doc)"))
}

async fn exec(socket: &Path, command: &str) -> String {
    let body = serde_json::json!({ "command": command }).to_string();
    let mut stream = UnixStream::connect(socket)
        .await
        .expect("connect to the agent");
    let request = format!(
        "POST /process/execute HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).await.expect("receive");
    let text = String::from_utf8_lossy(&reply).into_owned();
    assert!(text.starts_with("HTTP/1.1 200"), "{command}: {text}");
    text
}

/// `GET /files/download`: the file streams through the channel as it is.
async fn download(socket: &Path, path: &str) -> usize {
    let mut stream = UnixStream::connect(socket)
        .await
        .expect("connect to the agent");
    let request =
        format!("GET /files/download?path={path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).await.expect("receive");
    assert!(
        reply.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&reply[..200.min(reply.len())])
    );
    reply.len()
}

fn ms(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1e4).round() / 10.0
}

struct Row {
    memory_mib: u64,
    template_ms: f64,
    create_ms: f64,
    first_command_ms: f64,
    pause_ms: f64,
    resume_ms: f64,
    fork_ms: f64,
    fork_child_ms: f64,
}

async fn measure(
    runtime: &VmRuntime,
    storage: &Storage,
    spec: &dyn Fn(&str, u64) -> SandboxSpec,
    memory_mib: u64,
) -> Row {
    let socket = |id: &str| storage.root().join("vms").join(id).join("agent.sock");
    let warm = spec(&format!("warm-{memory_mib}"), memory_mib);
    let began = Instant::now();
    runtime
        .warm_template(&warm)
        .await
        .expect("make the template");
    let template_ms = ms(began.elapsed());

    let id = format!("t-{memory_mib}");
    let sandbox = spec(&id, memory_mib);
    let began = Instant::now();
    runtime.prepare(&sandbox).await.expect("prepare");
    runtime.start(&sandbox).await.expect("start");
    let create_ms = ms(began.elapsed());
    exec(&socket(&id), "echo hi").await;
    let first_command_ms = ms(began.elapsed());
    // Some memory in use, as a sandbox that did something has.
    exec(&socket(&id), "head -c 64M /dev/urandom > /dev/shm/fill").await;
    // How fast bytes come out through the agent's channel (yamux over virtio-serial).
    exec(
        &socket(&id),
        "head -c 16000000 /dev/zero | tr '\\0' a > /dev/shm/out",
    )
    .await;
    let began = Instant::now();
    exec(
        &socket(&id),
        "head -c 16000000 /dev/zero | tr '\\0' a > /dev/null",
    )
    .await;
    eprintln!(
        "{memory_mib} MiB: making the output alone: {} ms",
        ms(began.elapsed())
    );
    let began = Instant::now();
    let reply = exec(&socket(&id), "cat /dev/shm/out").await;
    eprintln!(
        "{memory_mib} MiB: {} bytes of command output in {} ms",
        reply.len(),
        ms(began.elapsed())
    );
    let began = Instant::now();
    let bytes = download(&socket(&id), "/dev/shm/out").await;
    eprintln!(
        "{memory_mib} MiB: downloaded {bytes} bytes in {} ms",
        ms(began.elapsed())
    );

    let began = Instant::now();
    runtime.pause(&sid(&id)).await.expect("pause");
    let pause_ms = ms(began.elapsed());
    let began = Instant::now();
    runtime.start(&sandbox).await.expect("resume");
    let resumed_ms = ms(began.elapsed());
    exec(&socket(&id), "echo hi").await;
    let resume_ms = ms(began.elapsed());
    let began = Instant::now();
    exec(&socket(&id), "echo hi").await;
    eprintln!(
        "resume: start() {resumed_ms} ms, first command at {resume_ms} ms, a second command {} ms",
        ms(began.elapsed())
    );

    let child = spec(&format!("f-{memory_mib}"), memory_mib);
    let began = Instant::now();
    runtime.fork(&sid(&id), &child).await.expect("fork");
    let fork_ms = ms(began.elapsed());
    runtime.start(&child).await.expect("start the child");
    exec(&socket(&child.id), "echo hi").await;
    let fork_child_ms = ms(began.elapsed());
    Row {
        memory_mib,
        template_ms,
        create_ms,
        first_command_ms,
        pause_ms,
        resume_ms,
        fork_ms,
        fork_child_ms,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("COVE_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .try_init();
    let mut sizes = Vec::new();
    let mut keep_consoles = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--keep-consoles" {
            keep_consoles = Some(PathBuf::from(args.next().expect("--keep-consoles DIR")));
        } else {
            sizes.push(arg.parse::<u64>().expect("RAM sizes in MiB"));
        }
    }
    if sizes.is_empty() {
        sizes = vec![256, 1024];
    }
    let assets = env_path("COVE_TEST_VM_ASSETS");
    let rootfs = env_path("COVE_TEST_ROOTFS");
    let agent = env_path("COVE_TEST_AGENT");
    let dir = tempfile::Builder::new()
        .prefix("cove-vmb-")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let storage = Arc::new(
        Storage::open(
            &dir.path().join("storage.img"),
            &dir.path().join("s"),
            64 << 30,
        )
        .expect("storage"),
    );
    let runtime = VmRuntime::new(VmConfig::new(storage.clone(), assets, agent)).expect("runtime");
    let spec = |id: &str, memory_mib: u64| {
        let resources = Resources {
            cpu: 1,
            memory_mib,
            disk_gib: 3,
        };
        SandboxSpec::bare(sid(id), id, rootfs.clone(), resources)
    };
    let mut rows = Vec::new();
    for &memory_mib in &sizes {
        rows.push(measure(&runtime, &storage, &spec, memory_mib).await);
    }
    println!("accelerator: {}", runtime.accelerator().name());
    println!(
        "{:>8} {:>10} {:>10} {:>14} {:>8} {:>14} {:>8} {:>14}",
        "RAM MiB",
        "template",
        "create",
        "create->cmd",
        "pause",
        "resume->cmd",
        "fork",
        "fork->child"
    );
    for r in &rows {
        println!(
            "{:>8} {:>10} {:>10} {:>14} {:>8} {:>14} {:>8} {:>14}",
            r.memory_mib,
            r.template_ms,
            r.create_ms,
            r.first_command_ms,
            r.pause_ms,
            r.resume_ms,
            r.fork_ms,
            r.fork_child_ms
        );
    }
    let vms = storage.root().join("vms");
    let ids: Vec<String> = std::fs::read_dir(&vms)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if let Some(keep) = keep_consoles {
        std::fs::create_dir_all(&keep).expect("console dir");
        for id in &ids {
            let _ = std::fs::copy(
                vms.join(id).join("console.log"),
                keep.join(format!("{id}.log")),
            );
        }
    }
    for id in &ids {
        if let Err(error) = runtime.destroy(&sid(id)).await {
            eprintln!("destroy {id}: {error}");
        }
    }
    if let Err(error) = storage.unmount() {
        eprintln!("unmount the storage: {error}");
    }
}

/// A sandbox id the example names.
fn sid(id: &str) -> cove_runtime::SandboxId {
    cove_runtime::SandboxId::parse(id).expect("the example's ids are valid")
}
