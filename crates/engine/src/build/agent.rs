//! The agent calls the image builder makes on a build sandbox's agent
//! socket, all of them the agent's own contract with the server: `POST
//! /process/execute` for `RUN`; `GET /files/info` and cove's `POST
//! /cove/unpack` for `COPY`/`ADD`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use futures_util::TryStreamExt as _;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};

/// A `RUN` may install a toolchain; it still ends some day.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(60 * 60);
/// The largest answer read from a build sandbox's agent. A `RUN`'s whole
/// output comes back in one JSON answer, and what it prints is the
/// Dockerfile author's choice: past this the step fails rather than the
/// server holding it all in memory.
pub const MAX_ANSWER_BYTES: usize = 32 << 20;

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ExecuteRequest<'a> {
    command: &'a str,
    cwd: Option<&'a str>,
    envs: &'a BTreeMap<String, String>,
    timeout: u64,
}

/// What `/process/execute` answers.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Executed {
    pub exit_code: i32,
    pub result: String,
    #[serde(default)]
    pub timed_out: bool,
}

/// Runs `argv` (quoted for the agent's shell) in `cwd` with `envs` added.
pub async fn execute(
    socket: &Path,
    argv: &[String],
    cwd: Option<&str>,
    envs: &BTreeMap<String, String>,
) -> Result<Executed, String> {
    let command = argv
        .iter()
        .map(|w| shell_quote(w))
        .collect::<Vec<_>>()
        .join(" ");
    let body = serde_json::to_vec(&ExecuteRequest {
        command: &command,
        cwd,
        envs,
        timeout: RUN_TIMEOUT.as_secs(),
    })
    .map_err(|e| e.to_string())?;
    let request = hyper::Request::post("/process/execute")
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(
            Full::new(Bytes::from(body))
                .map_err(|e| match e {})
                .boxed_unsync(),
        )
        .map_err(|e| e.to_string())?;
    let (status, body) = send(socket, request).await?;
    if !status.is_success() {
        return Err(format!(
            "the build sandbox's agent refused the step: {status} {}",
            String::from_utf8_lossy(&body)
        ));
    }
    serde_json::from_slice(&body).map_err(|e| format!("the build sandbox's agent answered {e}"))
}

type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

/// Sends one request over a new connection to the agent at `socket`.
async fn send(
    socket: &Path,
    mut request: hyper::Request<Body>,
) -> Result<(hyper::StatusCode, Bytes), String> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| format!("connecting to the build sandbox's agent: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("talking to the build sandbox's agent: {e}"))?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "build agent connection ended");
        }
    });
    request.headers_mut().insert(
        hyper::header::HOST,
        hyper::header::HeaderValue::from_static("sandbox"),
    );
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("sending the step to the build sandbox: {e}"))?;
    let status = response.status();
    let body = read_bounded(response.into_body(), MAX_ANSWER_BYTES).await?;
    Ok((status, body))
}

/// Reads a whole body of at most `limit` bytes.
async fn read_bounded<B>(body: B, limit: usize) -> Result<Bytes, String>
where
    B: hyper::body::Body,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(format!(
            "the build sandbox's answer (a RUN step's output) is larger than {} MiB; \
             print less, or send the output to a file",
            limit >> 20
        )),
        Err(e) => Err(format!("reading the build sandbox's answer: {e}")),
    }
}

/// Whether `path` (absolute, in the build sandbox) is a directory; a path
/// that does not exist is not.
pub async fn is_dir(socket: &Path, path: &str) -> Result<bool, String> {
    let query: String = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("path", path)
        .finish();
    let request = hyper::Request::get(format!("/files/info?{query}"))
        .body(
            Full::new(Bytes::new())
                .map_err(|e| match e {})
                .boxed_unsync(),
        )
        .map_err(|e| e.to_string())?;
    let (status, body) = send(socket, request).await?;
    if status == hyper::StatusCode::NOT_FOUND {
        return Ok(false);
    }
    if !status.is_success() {
        return Err(format!(
            "looking up {path} in the build sandbox: {status} {}",
            String::from_utf8_lossy(&body)
        ));
    }
    let info: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| format!("the agent answered {e}"))?;
    Ok(info.get("isDir").and_then(|d| d.as_bool()).unwrap_or(false))
}

/// Unpacks the tar archive `archive` at the build sandbox's root, every
/// entry owned by `owner` (Docker's `--chown` form) when given.
pub async fn unpack(socket: &Path, archive: &Path, owner: Option<&str>) -> Result<(), String> {
    let file = tokio::fs::File::open(archive)
        .await
        .map_err(|e| format!("{}: {e}", archive.display()))?;
    let frames = tokio_util::io::ReaderStream::new(file).map_ok(hyper::body::Frame::data);
    let mut uri = "/cove/unpack".to_owned();
    if let Some(owner) = owner {
        uri.push('?');
        uri.push_str(
            &url::form_urlencoded::Serializer::new(String::new())
                .append_pair("owner", owner)
                .finish(),
        );
    }
    let request = hyper::Request::post(uri)
        .header(hyper::header::CONTENT_TYPE, "application/x-tar")
        .body(http_body_util::StreamBody::new(frames).boxed_unsync())
        .map_err(|e| e.to_string())?;
    let (status, body) = send(socket, request).await?;
    if !status.is_success() {
        return Err(format!("copying into the image: {}", agent_message(&body)));
    }
    Ok(())
}

/// The message of an agent's JSON error, else its body.
fn agent_message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

/// One word for a POSIX shell.
pub fn shell_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attack: a `RUN` that prints gigabytes made the server read the
    /// agent's whole answer into memory. Now reading stops at the limit
    /// and the step fails saying why.
    #[tokio::test]
    async fn an_answer_over_the_limit_is_refused() {
        let small = Full::new(Bytes::from(vec![b'x'; 1000]));
        assert_eq!(read_bounded(small, 1000).await.unwrap().len(), 1000);
        let large = Full::new(Bytes::from(vec![b'x'; 3 << 20]));
        let error = read_bounded(large, 2 << 20).await.unwrap_err();
        assert!(error.contains("larger than 2 MiB"), "{error}");
    }

    #[test]
    fn words_are_quoted_for_a_posix_shell() {
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("a b $x"), "'a b $x'");
    }
}
