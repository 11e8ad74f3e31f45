//! [`AgentClient`]: the agent's contract over a [`Pool`], for one sandbox,
//! with every answer read up to the limit its owner chose.

use bytes::Bytes;
use cove_protocol::execute::{self, ExecuteRequest, ExecuteResponse};
use cove_protocol::identity::{self, IdentityReply, IdentityRequest};
use cove_protocol::tunnel;
use cove_protocol::unpack::{UnpackQuery, UnpackReply};
use http::{header, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Empty, Full};
use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::dial::Dial;
use crate::error::AgentError;
use crate::pool::{BoxError, Pool};

/// A request body: empty, whole, or streamed (an archive to unpack).
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

pub fn empty() -> Body {
    Empty::new().map_err(|e| match e {}).boxed_unsync()
}

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|e| match e {})
        .boxed_unsync()
}

/// The agent of one sandbox.
pub struct AgentClient<D> {
    pool: Pool<D, Body>,
    dial: D,
    sandbox: String,
    answer_limit: usize,
}

impl<D: Clone> Clone for AgentClient<D> {
    fn clone(&self) -> Self {
        AgentClient {
            pool: self.pool.clone(),
            dial: self.dial.clone(),
            sandbox: self.sandbox.clone(),
            answer_limit: self.answer_limit,
        }
    }
}

impl<D> std::fmt::Debug for AgentClient<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("sandbox", &self.sandbox)
            .field("answer_limit", &self.answer_limit)
            .finish_non_exhaustive()
    }
}

/// The authority of every request: a client talks to one agent.
const AUTHORITY: &str = "agent";

impl<D: Dial> AgentClient<D> {
    /// The agent of `sandbox` (named in errors), reached through `dial`,
    /// whose answers are read up to `answer_limit` bytes.
    pub fn new(sandbox: impl Into<String>, dial: D, answer_limit: usize) -> AgentClient<D> {
        AgentClient {
            pool: Pool::new(dial.clone()),
            dial,
            sandbox: sandbox.into(),
            answer_limit,
        }
    }

    pub fn sandbox(&self) -> &str {
        &self.sandbox
    }

    pub fn answer_limit(&self) -> usize {
        self.answer_limit
    }

    /// A raw connection of its own, for a protocol that is not plain HTTP
    /// from the start (a WebSocket client's handshake).
    pub async fn connect(&self) -> Result<D::Io, D::Error> {
        self.dial.dial(AUTHORITY).await
    }

    fn what(request: &Request<Body>) -> String {
        let path = request.uri().path_and_query().map_or("/", |pq| pq.as_str());
        format!("{} {path}", request.method())
    }

    fn bad_request(&self, what: &str, reason: impl std::fmt::Display) -> AgentError {
        AgentError::BadRequest {
            sandbox: self.sandbox.clone(),
            what: what.to_owned(),
            reason: reason.to_string(),
        }
    }

    /// Sends `request` (its URI a path and query) and answers the response,
    /// its body not read yet.
    pub async fn send(&self, mut request: Request<Body>) -> Result<Response<Incoming>, AgentError> {
        let what = Self::what(&request);
        let path = request
            .uri()
            .path_and_query()
            .map_or("/", |pq| pq.as_str())
            .to_owned();
        *request.uri_mut() = format!("http://{AUTHORITY}{path}")
            .parse::<Uri>()
            .map_err(|e| self.bad_request(&what, e))?;
        request
            .headers_mut()
            .insert(header::HOST, HeaderValue::from_static("sandbox"));
        self.pool
            .request(request)
            .await
            .map_err(|source| AgentError::Unanswered {
                sandbox: self.sandbox.clone(),
                what,
                source,
            })
    }

    /// Sends `request` and reads the whole answer, up to the limit.
    pub async fn call(&self, request: Request<Body>) -> Result<(StatusCode, Bytes), AgentError> {
        let what = Self::what(&request);
        let response = self.send(request).await?;
        let status = response.status();
        let body = self.read(&what, response.into_body()).await?;
        Ok((status, body))
    }

    /// [`call`](Self::call), with anything but a success an error.
    pub async fn call_ok(&self, request: Request<Body>) -> Result<Bytes, AgentError> {
        let what = Self::what(&request);
        let (status, body) = self.call(request).await?;
        if !status.is_success() {
            return Err(AgentError::Refused {
                sandbox: self.sandbox.clone(),
                what,
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        Ok(body)
    }

    /// A whole body of the agent's, up to the limit.
    pub async fn read(&self, what: &str, body: Incoming) -> Result<Bytes, AgentError> {
        read_bounded(body, self.answer_limit)
            .await
            .map_err(|error| match error.downcast::<hyper::Error>() {
                Ok(source) => AgentError::Read {
                    sandbox: self.sandbox.clone(),
                    what: what.to_owned(),
                    source: *source,
                },
                Err(_) => AgentError::TooLarge {
                    sandbox: self.sandbox.clone(),
                    what: what.to_owned(),
                    limit: self.answer_limit,
                },
            })
    }

    /// POSTs `body` as JSON to `path` and decodes a successful answer.
    pub async fn post_json<T: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &T,
    ) -> Result<R, AgentError> {
        let what = format!("POST {path}");
        let json = serde_json::to_vec(body).map_err(|e| self.bad_request(&what, e))?;
        let request = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(full(json))
            .map_err(|e| self.bad_request(&what, e))?;
        let answer = self.call_ok(request).await?;
        self.decode(&what, &answer)
    }

    fn decode<R: DeserializeOwned>(&self, what: &str, answer: &[u8]) -> Result<R, AgentError> {
        serde_json::from_slice(answer).map_err(|e| AgentError::BadAnswer {
            sandbox: self.sandbox.clone(),
            what: what.to_owned(),
            reason: e.to_string(),
        })
    }

    /// Runs a command to its end (`POST /process/execute`).
    pub async fn execute(&self, request: &ExecuteRequest) -> Result<ExecuteResponse, AgentError> {
        self.post_json(execute::PATH, request).await
    }

    /// Tells a VM's agent who it is (`POST /cove/vm/identity`).
    pub async fn identity(&self, request: &IdentityRequest) -> Result<IdentityReply, AgentError> {
        self.post_json(identity::IDENTITY_PATH, request).await
    }

    /// Has a VM's agent write out its filesystems (`POST /cove/vm/sync`).
    pub async fn sync(&self) -> Result<IdentityReply, AgentError> {
        self.post_json(identity::SYNC_PATH, &serde_json::json!({}))
            .await
    }

    /// Unpacks the tar stream `archive` at the sandbox's root (`POST
    /// /cove/unpack`).
    pub async fn unpack(
        &self,
        query: &UnpackQuery,
        archive: Body,
    ) -> Result<UnpackReply, AgentError> {
        let path = query.path_and_query();
        let what = format!("POST {path}");
        let request = Request::builder()
            .method(Method::POST)
            .uri(&path)
            .header(header::CONTENT_TYPE, "application/x-tar")
            .body(archive)
            .map_err(|e| self.bad_request(&what, e))?;
        let answer = self.call_ok(request).await?;
        self.decode(&what, &answer)
    }

    /// A byte stream to 127.0.0.1:`port` inside the sandbox (`GET
    /// /cove/tunnel/{port}` upgraded). A refusal is read up to the limit for
    /// the agent's reason.
    pub async fn tunnel(&self, port: u16) -> Result<Upgraded, AgentError> {
        let path = tunnel::path(port);
        let what = format!("GET {path}");
        let request = Request::builder()
            .method(Method::GET)
            .uri(&path)
            .header(header::CONNECTION, "upgrade")
            .header(header::UPGRADE, tunnel::PROTOCOL)
            .body(empty())
            .map_err(|e| self.bad_request(&what, e))?;
        let mut response = self.send(request).await?;
        let status = response.status();
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return hyper::upgrade::on(&mut response)
                .await
                .map_err(|source| AgentError::Read {
                    sandbox: self.sandbox.clone(),
                    what,
                    source,
                });
        }
        // The agent says why (nothing listening, most often) in a JSON message.
        let body = self.read(&what, response.into_body()).await?;
        let reason = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
        Err(AgentError::TunnelRefused {
            sandbox: self.sandbox.clone(),
            port,
            status,
            reason,
        })
    }
}

/// Reads a whole body of at most `limit` bytes; past it, the error is
/// `http_body_util::LengthLimitError`, else the body's own.
pub async fn read_bounded<B>(body: B, limit: usize) -> Result<Bytes, BoxError>
where
    B: hyper::body::Body,
    B::Error: Into<BoxError>,
{
    let collected = http_body_util::Limited::new(body, limit).collect().await?;
    Ok(collected.to_bytes())
}

#[cfg(test)]
mod tests;
