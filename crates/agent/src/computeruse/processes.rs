//! The desktop's processes: each started in its own process group by a task
//! that watches it, restarts it when it dies on its own (a few times, then it
//! stays down and says so), and keeps the last of its output in memory.
//!
//! Output is kept in bounded buffers rather than files: the agent writes
//! nothing into the user's tree, and a chatty X client cannot fill a disk.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt as _};
use tokio::sync::{mpsc, oneshot};

/// Bytes of output kept per process and stream.
const KEPT_OUTPUT: usize = 64 << 10;
/// Restarts after unexpected exits before a process is left down.
const MAX_RESTARTS: u32 = 5;
/// Pause before a restart, so a program that dies at once does not spin.
const RESTART_PAUSE: Duration = Duration::from_millis(500);
/// How long a process has to end after SIGTERM before it gets SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(2);

/// What to run for one desktop process.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Daytona's name for it (`xvfb`, `xfce4`, `x11vnc`, `novnc`).
    pub name: &'static str,
    /// Start order, lowest first, as Daytona numbers it.
    pub priority: u32,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// `ProcessStatus` of the SDK.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    pub running: bool,
    pub priority: u32,
    pub auto_restart: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

/// The newest `KEPT_OUTPUT` bytes of a stream.
#[derive(Debug, Default)]
struct Tail(VecDeque<u8>);

impl Tail {
    fn push(&mut self, data: &[u8]) {
        let data = &data[data.len().saturating_sub(KEPT_OUTPUT)..];
        let overflow = (self.0.len() + data.len()).saturating_sub(KEPT_OUTPUT);
        self.0.drain(..overflow);
        self.0.extend(data);
    }

    fn text(&self) -> String {
        let (a, b) = self.0.as_slices();
        let mut bytes = Vec::with_capacity(a.len() + b.len());
        bytes.extend_from_slice(a);
        bytes.extend_from_slice(b);
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[derive(Debug, Default)]
struct Observed {
    pid: Option<u32>,
    restarts: u32,
    stdout: Tail,
    stderr: Tail,
}

enum Order {
    Restart(oneshot::Sender<()>),
    Stop(oneshot::Sender<()>),
}

/// One supervised process.
pub struct Process {
    pub spec: Spec,
    observed: Arc<Mutex<Observed>>,
    orders: mpsc::Sender<Order>,
}

impl Process {
    /// Starts `spec` and the task that watches it. Fails only if the first
    /// start fails (a missing program, say).
    pub fn start(spec: Spec) -> std::io::Result<Self> {
        let observed = Arc::new(Mutex::new(Observed::default()));
        let child = spawn(&spec, &observed)?;
        let (orders, received) = mpsc::channel(4);
        tokio::spawn(watch(spec.clone(), observed.clone(), child, received));
        Ok(Self {
            spec,
            observed,
            orders,
        })
    }

    pub fn status(&self) -> Status {
        let observed = self.observed.lock().unwrap();
        Status {
            running: observed.pid.is_some(),
            priority: self.spec.priority,
            auto_restart: observed.restarts < MAX_RESTARTS,
            pid: observed.pid,
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.observed.lock().unwrap().pid
    }

    pub fn logs(&self) -> String {
        self.observed.lock().unwrap().stdout.text()
    }

    pub fn errors(&self) -> String {
        self.observed.lock().unwrap().stderr.text()
    }

    /// Ends the running instance and starts a new one; answers once the new
    /// one is started (or could not be).
    pub async fn restart(&self) {
        let (done, wait) = oneshot::channel();
        if self.orders.send(Order::Restart(done)).await.is_ok() {
            let _ = wait.await;
        }
    }

    /// Ends the process (its whole group) and its watcher.
    pub async fn stop(&self) {
        let (done, wait) = oneshot::channel();
        if self.orders.send(Order::Stop(done)).await.is_ok() {
            let _ = wait.await;
        }
    }
}

fn spawn(spec: &Spec, observed: &Arc<Mutex<Observed>>) -> std::io::Result<tokio::process::Child> {
    let mut command = tokio::process::Command::new(&spec.program);
    command
        .args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = command.spawn()?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    tokio::spawn(keep(stdout, observed.clone(), false));
    tokio::spawn(keep(stderr, observed.clone(), true));
    observed.lock().unwrap().pid = child.id();
    Ok(child)
}

async fn keep(mut stream: impl AsyncRead + Unpin, observed: Arc<Mutex<Observed>>, errors: bool) {
    let mut buffer = vec![0u8; 8192];
    while let Ok(n) = stream.read(&mut buffer).await {
        if n == 0 {
            break;
        }
        let mut observed = observed.lock().unwrap();
        let tail = if errors {
            &mut observed.stderr
        } else {
            &mut observed.stdout
        };
        tail.push(&buffer[..n]);
    }
}

/// Ends `child`'s process group: SIGTERM, then SIGKILL after a grace period.
pub async fn end_group(child: &mut tokio::process::Child) {
    let Some(pid) = child.id() else {
        return;
    };
    let group = Pid::from_raw(pid as i32);
    let _ = killpg(group, Signal::SIGTERM);
    if tokio::time::timeout(TERM_GRACE, child.wait())
        .await
        .is_err()
    {
        let _ = killpg(group, Signal::SIGKILL);
        let _ = child.wait().await;
    }
    // Whatever the leader left behind in its group goes too.
    let _ = killpg(group, Signal::SIGKILL);
}

async fn watch(
    spec: Spec,
    observed: Arc<Mutex<Observed>>,
    mut child: tokio::process::Child,
    mut orders: mpsc::Receiver<Order>,
) {
    loop {
        tokio::select! {
            status = child.wait() => {
                observed.lock().unwrap().pid = None;
                let restarts = {
                    let mut observed = observed.lock().unwrap();
                    observed.restarts += 1;
                    observed.restarts
                };
                tracing::warn!(process = spec.name, ?status, restarts, "a desktop process ended");
                if restarts > MAX_RESTARTS {
                    // Left down; still answer orders so stop and restart work.
                    match orders.recv().await {
                        Some(Order::Restart(done)) => {
                            observed.lock().unwrap().restarts = 0;
                            match spawn(&spec, &observed) {
                                Ok(new) => child = new,
                                Err(error) => {
                                    tracing::warn!(process = spec.name, %error, "restart failed");
                                    let _ = done.send(());
                                    continue;
                                }
                            }
                            let _ = done.send(());
                        }
                        Some(Order::Stop(done)) => {
                            let _ = done.send(());
                            return;
                        }
                        None => return,
                    }
                    continue;
                }
                tokio::time::sleep(RESTART_PAUSE).await;
                match spawn(&spec, &observed) {
                    Ok(new) => child = new,
                    Err(error) => {
                        tracing::warn!(process = spec.name, %error, "restart failed");
                        observed.lock().unwrap().restarts = MAX_RESTARTS + 1;
                    }
                }
            }
            order = orders.recv() => match order {
                Some(Order::Restart(done)) => {
                    end_group(&mut child).await;
                    observed.lock().unwrap().pid = None;
                    if let Ok(new) = spawn(&spec, &observed) {
                        child = new;
                    }
                    let _ = done.send(());
                }
                Some(Order::Stop(done)) => {
                    end_group(&mut child).await;
                    observed.lock().unwrap().pid = None;
                    let _ = done.send(());
                    return;
                }
                None => {
                    end_group(&mut child).await;
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_keeps_the_newest_bytes() {
        let mut tail = Tail::default();
        tail.push(b"hello ");
        tail.push(b"world");
        assert_eq!(tail.text(), "hello world");
        tail.push(&vec![b'x'; KEPT_OUTPUT]);
        assert_eq!(tail.text().len(), KEPT_OUTPUT);
        assert!(!tail.text().contains('h'));
        tail.push(b"end");
        assert!(tail.text().ends_with("xend"));
        assert_eq!(tail.0.len(), KEPT_OUTPUT);
    }

    #[tokio::test]
    async fn a_process_that_dies_is_restarted_and_stop_ends_it() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("ran");
        // Dies on its first run; stays up on the second.
        let script = format!(
            "echo up; if [ -e {0} ]; then exec sleep 30; fi; touch {0}; echo oops >&2; exit 1",
            marker.display()
        );
        let process = Process::start(Spec {
            name: "test",
            priority: 1,
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script],
            env: vec![],
        })
        .unwrap();
        let first = process.pid().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let second = loop {
            match process.pid() {
                Some(pid) if pid != first && process.logs() == "up\nup\n" => break pid,
                _ if std::time::Instant::now() > deadline => panic!("not restarted"),
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        assert!(process.errors().contains("oops"));
        assert!(process.status().running);
        process.stop().await;
        assert!(!process.status().running);
        assert!(nix::sys::signal::kill(Pid::from_raw(second as i32), None).is_err());
    }

    #[tokio::test]
    async fn restart_replaces_a_running_process() {
        let process = Process::start(Spec {
            name: "test",
            priority: 1,
            program: "/bin/sleep".into(),
            args: vec!["30".into()],
            env: vec![],
        })
        .unwrap();
        let first = process.pid().unwrap();
        process.restart().await;
        let second = process.pid().unwrap();
        assert_ne!(first, second);
        assert!(process.status().running);
        process.stop().await;
        assert!(process.pid().is_none());
    }
}
