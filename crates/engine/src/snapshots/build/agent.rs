//! The agent calls the image builder makes on a build sandbox's agent
//! socket, all of them the agent's own contract with the server
//! (`cove-protocol`, carried by `cove-agent-client`): `POST
//! /process/execute` for `RUN`; `GET /files/info` and cove's `POST
//! /cove/unpack` for `COPY`/`ADD`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use cove_agent_client::{report, AgentClient, AgentError, Endpoint};
use cove_protocol::{ExecuteRequest, UnpackQuery};
use futures_util::TryStreamExt as _;
use http_body_util::BodyExt as _;

/// A `RUN` may install a toolchain; it still ends some day.
pub(crate) const RUN_TIMEOUT: Duration = Duration::from_secs(60 * 60);
/// The most of an answer of a build sandbox's agent that is read: a `RUN`'s
/// whole output comes back in `/process/execute`'s JSON. The sandbox runs
/// the Dockerfile's commands, so its answers are not trusted to end.
pub(crate) const ANSWER_LIMIT: usize = 8 << 20;

/// What `/process/execute` answers.
pub(crate) type Executed = cove_protocol::ExecuteResponse;

/// The agent of build sandbox `sandbox`, reached at `endpoint`.
fn agent(sandbox: &str, endpoint: &Endpoint) -> AgentClient<Endpoint> {
    AgentClient::new(sandbox, endpoint.clone(), ANSWER_LIMIT)
}

/// What went wrong in a call to a build sandbox's agent, in the builder's
/// words: an answer past the limit is the `RUN` step's to fix.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BuildAgentError {
    #[error(
        "the agent of build sandbox {sandbox} answered more than {} MiB; \
         a RUN step's output must stay under that (send it to a file)",
        limit >> 20
    )]
    TooLarge { sandbox: String, limit: usize },
    #[error("the build sandbox's agent refused the step: {status} {body}")]
    Refused {
        status: hyper::StatusCode,
        body: String,
    },
    #[error("talking to the agent of build sandbox {sandbox}: {}", report(source))]
    Agent {
        sandbox: String,
        #[source]
        source: AgentError,
    },
    #[error("looking up {path} in the build sandbox: {status} {body}")]
    Lookup {
        path: String,
        status: hyper::StatusCode,
        body: String,
    },
    #[error("the agent answered {0}")]
    Answer(#[source] serde_json::Error),
    #[error("a request to the agent: {0}")]
    Request(#[source] hyper::http::Error),
    #[error("{}: {source}", path.display())]
    Archive {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("copying into the image: {0}")]
    Unpack(String),
}

fn failure(sandbox: &str, error: AgentError) -> BuildAgentError {
    match error {
        AgentError::TooLarge { limit, .. } => BuildAgentError::TooLarge {
            sandbox: sandbox.to_owned(),
            limit,
        },
        AgentError::Refused { status, body, .. } => BuildAgentError::Refused { status, body },
        source => BuildAgentError::Agent {
            sandbox: sandbox.to_owned(),
            source,
        },
    }
}

/// Runs `argv` (quoted for the agent's shell) in `cwd` with `envs` added,
/// in build sandbox `sandbox` whose agent is at `endpoint`.
pub(crate) async fn execute(
    sandbox: &str,
    endpoint: &Endpoint,
    argv: &[String],
    cwd: Option<&str>,
    envs: &BTreeMap<String, String>,
) -> Result<Executed, BuildAgentError> {
    let command = argv
        .iter()
        .map(|w| shell_quote(w))
        .collect::<Vec<_>>()
        .join(" ");
    let request = ExecuteRequest {
        command,
        cwd: cwd.map(str::to_owned),
        envs: Some(envs.clone()),
        timeout: Some(RUN_TIMEOUT.as_secs()),
    };
    agent(sandbox, endpoint)
        .execute(&request)
        .await
        .map_err(|e| failure(sandbox, e))
}

/// Whether `path` (absolute, in the build sandbox) is a directory; a path
/// that does not exist is not.
pub(crate) async fn is_dir(
    sandbox: &str,
    endpoint: &Endpoint,
    path: &str,
) -> Result<bool, BuildAgentError> {
    let query: String = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("path", path)
        .finish();
    let request = hyper::Request::get(format!("/files/info?{query}"))
        .body(cove_agent_client::empty())
        .map_err(BuildAgentError::Request)?;
    let (status, body) = agent(sandbox, endpoint)
        .call(request)
        .await
        .map_err(|e| failure(sandbox, e))?;
    if status == hyper::StatusCode::NOT_FOUND {
        return Ok(false);
    }
    if !status.is_success() {
        return Err(BuildAgentError::Lookup {
            path: path.to_owned(),
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    let info: serde_json::Value = serde_json::from_slice(&body).map_err(BuildAgentError::Answer)?;
    Ok(info.get("isDir").and_then(|d| d.as_bool()).unwrap_or(false))
}

/// Unpacks the tar archive `archive` at the build sandbox's root, every
/// entry owned by `owner` (Docker's `--chown` form) when given.
pub(crate) async fn unpack(
    sandbox: &str,
    endpoint: &Endpoint,
    archive: &Path,
    owner: Option<&str>,
) -> Result<(), BuildAgentError> {
    let file = tokio::fs::File::open(archive)
        .await
        .map_err(|source| BuildAgentError::Archive {
            path: archive.to_owned(),
            source,
        })?;
    let frames = tokio_util::io::ReaderStream::new(file)
        .map_ok(hyper::body::Frame::data)
        .map_err(cove_agent_client::BoxError::from);
    let query = UnpackQuery {
        owner: owner.map(str::to_owned),
    };
    let body = http_body_util::StreamBody::new(frames).boxed_unsync();
    match agent(sandbox, endpoint).unpack(&query, body).await {
        Ok(_) => Ok(()),
        Err(AgentError::Refused { body, .. }) => {
            Err(BuildAgentError::Unpack(agent_message(body.as_bytes())))
        }
        Err(error) => Err(failure(sandbox, error)),
    }
}

/// The message of an agent's JSON error, else its body.
fn agent_message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

/// One word for a POSIX shell.
pub(crate) fn shell_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    use cove_agent_client::testing::hostile_agent;

    /// Attack: a `RUN` that prints gigabytes made the server read the
    /// agent's whole answer into memory. Now reading stops at the limit
    /// and the step fails saying why.
    #[tokio::test]
    async fn an_endless_answer_is_cut_at_the_limit() {
        let (_dir, socket) =
            hostile_agent(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n");
        let error = execute(
            "build-1",
            &Endpoint::Unix(socket),
            &["true".to_owned()],
            None,
            &BTreeMap::new(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(error.contains("build sandbox build-1"), "{error}");
        assert!(error.contains("8 MiB"), "{error}");
    }

    #[tokio::test]
    async fn an_endless_header_is_refused() {
        let (_dir, socket) = hostile_agent(b"HTTP/1.1 200 OK\r\nX-Endless: ");
        let error = is_dir("build-2", &Endpoint::Unix(socket), "/")
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("build sandbox build-2"), "{error}");
    }

    #[test]
    fn words_are_quoted_for_a_posix_shell() {
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("a b $x"), "'a b $x'");
    }
}
