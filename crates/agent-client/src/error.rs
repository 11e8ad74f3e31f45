//! What can go wrong talking to an agent. Every variant names the sandbox
//! and the call (`what`: `POST /process/execute`).

use http::StatusCode;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// No connection, or the request or the answer's head failed (an
    /// oversized head included).
    #[error("the agent of sandbox {sandbox} did not answer {what}")]
    Unanswered {
        sandbox: String,
        what: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    /// The answer's body broke off.
    #[error("reading the answer of the agent of sandbox {sandbox} to {what} failed")]
    Read {
        sandbox: String,
        what: String,
        #[source]
        source: hyper::Error,
    },
    #[error("the agent of sandbox {sandbox} answered {what} with more than {limit} bytes; cove reads no more")]
    TooLarge {
        sandbox: String,
        what: String,
        limit: usize,
    },
    #[error("the agent of sandbox {sandbox} refused {what}: {status} {body}")]
    Refused {
        sandbox: String,
        what: String,
        status: StatusCode,
        body: String,
    },
    /// The agent did not open a tunnel; `reason` is its message (nothing
    /// listening on the port, most often, with 502).
    #[error("the agent of sandbox {sandbox} refused a tunnel to port {port} ({status}): {reason}")]
    TunnelRefused {
        sandbox: String,
        port: u16,
        status: StatusCode,
        reason: String,
    },
    #[error("the agent of sandbox {sandbox} answered {what} with {reason}")]
    BadAnswer {
        sandbox: String,
        what: String,
        reason: String,
    },
    /// The request could not be made (a header value, a body to encode).
    #[error("cannot ask the agent of sandbox {sandbox} {what}: {reason}")]
    BadRequest {
        sandbox: String,
        what: String,
        reason: String,
    },
}

/// An error and its causes on one line, for the callers whose errors are
/// text (`a: b: c`).
pub fn report(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // hyper repeats its kind in nested errors; say each thing once.
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
