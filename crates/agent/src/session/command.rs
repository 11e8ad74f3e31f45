//! Starting one session command and collecting its output: per-command FIFOs
//! for stdout and stderr (and stdin of asynchronous commands) in the session's
//! private dir, read by one task that fills the [`CommandRecord`].
//!
//! Input sent to a command is echoed into its stdout log, as Daytona's daemon
//! does (unless the command was started with `suppressInputEcho`): the
//! collecting task appends the echo after everything the command had written
//! before the input was sent, and the input is written only then, so a log
//! reader sees prompt, echo and reply in that order.

use std::os::fd::{AsFd, AsRawFd as _};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use nix::sys::stat::Mode;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

use super::log::{CommandRecord, Stream};
use super::shell::Session;
use crate::error::ApiError;

/// One of the limited slots of running asynchronous commands; freed on drop.
pub(super) struct AsyncSlot(Arc<AtomicUsize>);

impl AsyncSlot {
    pub(super) fn acquire(running: &Arc<AtomicUsize>, limit: usize) -> Result<Self, ApiError> {
        running
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map_err(|_| ApiError::LimitReached {
                what: "asynchronous commands running",
                limit,
            })?;
        Ok(Self(running.clone()))
    }
}

impl Drop for AsyncSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How input reaches a running asynchronous command.
pub(super) struct Input {
    /// The write end of its stdin FIFO.
    pipe: pipe::Sender,
    /// To the collecting task, which appends the echo and answers; `None`
    /// when the command was started with `suppressInputEcho`.
    echo: Option<mpsc::UnboundedSender<Echo>>,
}

/// Input to echo into the log, and who waits for it to be there.
type Echo = (Vec<u8>, oneshot::Sender<()>);

/// Starts `command` in `session`; returns once the shell has been handed it.
pub(super) async fn start(
    session: &Arc<Session>,
    command: String,
    slot: Option<AsyncSlot>,
    echo_input: bool,
    max_log_bytes: usize,
) -> Result<Arc<CommandRecord>, ApiError> {
    let id = uuid::Uuid::new_v4().to_string();
    let file = |suffix: &str| session.dir.join(format!("{id}.{suffix}"));
    let (script, out_path, err_path) = (file("sh"), file("out"), file("err"));
    let setup = |e: std::io::Error| ApiError::internal("preparing session command", e);
    std::fs::write(&script, &command).map_err(setup)?;
    let mut files = vec![script.clone()];
    for fifo in [&out_path, &err_path] {
        nix::unistd::mkfifo(fifo, Mode::S_IRUSR | Mode::S_IWUSR).map_err(|e| setup(e.into()))?;
        files.push(fifo.clone());
    }
    let out = pipe::OpenOptions::new()
        .open_receiver(&out_path)
        .map_err(setup)?;
    let err = pipe::OpenOptions::new()
        .open_receiver(&err_path)
        .map_err(setup)?;
    // Our own writers keep the FIFOs from reporting end-of-file before the
    // shell opens them; they are dropped when the command ends.
    let writers = (
        pipe::OpenOptions::new()
            .open_sender(&out_path)
            .map_err(setup)?,
        pipe::OpenOptions::new()
            .open_sender(&err_path)
            .map_err(setup)?,
    );

    let is_async = slot.is_some();
    let stdin_path = if is_async {
        let path = file("in");
        nix::unistd::mkfifo(&path, Mode::S_IRUSR | Mode::S_IWUSR).map_err(|e| setup(e.into()))?;
        files.push(path.clone());
        path
    } else {
        // A synchronous command must never wait for input nobody can send.
        PathBuf::from("/dev/null")
    };
    let record = Arc::new(CommandRecord::new(
        id.clone(),
        command,
        is_async,
        max_log_bytes,
    ));
    let (echo, echoes) = mpsc::unbounded_channel();
    if is_async {
        // Read-write so opening never blocks, whether or not the command reads.
        let pipe = pipe::OpenOptions::new()
            .read_write(true)
            .open_sender(&stdin_path)
            .map_err(setup)?;
        let echo = echo_input.then_some(echo);
        *record.input.lock().await = Some(Input { pipe, echo });
    }

    let status = session.expect_status(&id)?;
    session.add_command(record.clone());
    tokio::spawn(collect(
        record.clone(),
        (out, err),
        writers,
        status,
        echoes,
        slot,
        files,
    ));
    session
        .run(&id, &script, &stdin_path, &out_path, &err_path)
        .await?;
    Ok(record)
}

/// Sends `data` to the stdin of a running asynchronous command, with a
/// newline added when it lacks one (the SDK sends a line without its end), and
/// echoes it into the stdout log first.
pub(super) async fn send_input(record: &CommandRecord, data: &[u8]) -> Result<(), ApiError> {
    let mut input = record.input.lock().await;
    let Some(input) = input.as_mut() else {
        if record.exit_code().is_some() {
            return Err(ApiError::CommandCompleted(record.id.clone()));
        }
        return Err(ApiError::BadRequest(format!(
            "command {} was not started with runAsync; its stdin is /dev/null",
            record.id
        )));
    };
    let mut line = data.to_vec();
    if !line.ends_with(b"\n") {
        line.push(b'\n');
    }
    if let Some(echo) = &input.echo {
        let (appended, done) = oneshot::channel();
        // The collecting task answers every echo it receives, also while the
        // command ends; a send fails only once it no longer takes any.
        if echo.send((line.clone(), appended)).is_ok() {
            let _ = done.await;
        }
    }
    input
        .pipe
        .write_all(&line)
        .await
        .map_err(|e| ApiError::internal("writing command input", e))
}

/// Fills `record` until the command has ended and every process that
/// inherited its output has closed it.
async fn collect(
    record: Arc<CommandRecord>,
    (mut out, mut err): (pipe::Receiver, pipe::Receiver),
    writers: (pipe::Sender, pipe::Sender),
    mut status: oneshot::Receiver<i32>,
    mut echoes: mpsc::UnboundedReceiver<Echo>,
    slot: Option<AsyncSlot>,
    files: Vec<PathBuf>,
) {
    let (mut out_buf, mut err_buf) = (vec![0; 16 * 1024], vec![0; 16 * 1024]);
    let (mut out_open, mut err_open) = (true, true);
    let mut held = Some((writers, slot));
    loop {
        tokio::select! {
            read = out.read(&mut out_buf), if out_open => match read {
                Ok(n) if n > 0 => record.append(Stream::Stdout, &out_buf[..n]),
                _ => out_open = false,
            },
            read = err.read(&mut err_buf), if err_open => match read {
                Ok(n) if n > 0 => record.append(Stream::Stderr, &err_buf[..n]),
                _ => err_open = false,
            },
            Some((input, appended)) = echoes.recv(), if held.is_some() => {
                // What the command wrote before the input was sent comes first.
                drain(&out, &record, Stream::Stdout);
                drain(&err, &record, Stream::Stderr);
                record.append(Stream::Stdout, &input);
                let _ = appended.send(());
            },
            code = &mut status, if held.is_some() => {
                // Everything the command wrote before exiting is in the FIFOs now.
                drain(&out, &record, Stream::Stdout);
                drain(&err, &record, Stream::Stderr);
                // A sender of input may hold `record.input` while it waits for
                // its echo: answer it before taking the lock.
                echoes.close();
                while let Ok((input, appended)) = echoes.try_recv() {
                    record.append(Stream::Stdout, &input);
                    let _ = appended.send(());
                }
                record.input.lock().await.take();
                held = None;
                for file in &files {
                    let _ = std::fs::remove_file(file);
                }
                record.finish(code.unwrap_or(-1));
            },
            else => break,
        }
    }
}

/// Reads whatever is buffered in a FIFO without waiting for readiness events.
fn drain(fifo: &impl AsFd, record: &CommandRecord, stream: Stream) {
    let mut buf = [0; 16 * 1024];
    loop {
        match nix::unistd::read(fifo.as_fd().as_raw_fd(), &mut buf) {
            Ok(0) => return,
            Ok(n) => record.append(stream, &buf[..n]),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return,
        }
    }
}
