//! The one agent call the image builder makes: `POST /process/execute` (the
//! agent's toolbox API, its whole contract with the server) on a build
//! sandbox's agent socket.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};

/// A `RUN` may install a toolchain; it still ends some day.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(60 * 60);

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
    let request = hyper::Request::post("/process/execute")
        .header(hyper::header::HOST, "sandbox")
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("running the step in the build sandbox: {e}"))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("reading the step's output: {e}"))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!(
            "the build sandbox's agent refused the step: {status} {}",
            String::from_utf8_lossy(&body)
        ));
    }
    serde_json::from_slice(&body).map_err(|e| format!("the build sandbox's agent answered {e}"))
}

/// One word for a POSIX shell.
pub fn shell_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_quoted_for_a_posix_shell() {
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("a b $x"), "'a b $x'");
    }
}
