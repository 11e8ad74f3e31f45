//! `POST /process/execute`: one command run to its end, its output in one
//! answer. Daytona's toolbox API, which the SDK calls through the proxy;
//! the server calls it itself for SSH `exec`, for an image build's `RUN`,
//! and to warm up a VM template.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const PATH: &str = "/process/execute";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecuteRequest {
    pub command: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envs: Option<BTreeMap<String, String>>,
    /// Seconds; absent or 0 means the agent's default deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
}

impl ExecuteRequest {
    /// `command` with the agent's defaults for everything else.
    pub fn new(command: impl Into<String>) -> ExecuteRequest {
        ExecuteRequest {
            command: command.into(),
            ..ExecuteRequest::default()
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecuteResponse {
    pub exit_code: i32,
    /// Standard output and error, in the order they were written.
    pub result: String,
    /// The deadline killed the command (its exit code is then 124).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_leave_out_what_is_unset() {
        let plain = ExecuteRequest::new("true");
        let json = serde_json::to_string(&plain).unwrap();
        assert_eq!(json, r#"{"command":"true"}"#);
        assert_eq!(
            serde_json::from_str::<ExecuteRequest>(&json).unwrap(),
            plain
        );
        let full = ExecuteRequest {
            command: "ls".into(),
            cwd: Some("/tmp".into()),
            envs: Some(BTreeMap::from([("A".into(), "1".into())])),
            timeout: Some(60),
        };
        let json = serde_json::to_string(&full).unwrap();
        assert_eq!(
            json,
            r#"{"command":"ls","cwd":"/tmp","envs":{"A":"1"},"timeout":60}"#
        );
        assert_eq!(serde_json::from_str::<ExecuteRequest>(&json).unwrap(), full);
        // What the SDK sends: nulls for what it leaves out.
        let sdk: ExecuteRequest =
            serde_json::from_str(r#"{"command":"x","cwd":null,"envs":null,"timeout":null}"#)
                .unwrap();
        assert_eq!(sdk, ExecuteRequest::new("x"));
    }

    #[test]
    fn responses_round_trip_and_say_timed_out_only_when_it_did() {
        let done = ExecuteResponse {
            exit_code: 0,
            result: "ok\n".into(),
            timed_out: false,
        };
        let json = serde_json::to_string(&done).unwrap();
        assert_eq!(json, r#"{"exitCode":0,"result":"ok\n"}"#);
        assert_eq!(
            serde_json::from_str::<ExecuteResponse>(&json).unwrap(),
            done
        );
        let killed = ExecuteResponse {
            exit_code: 124,
            result: String::new(),
            timed_out: true,
        };
        let json = serde_json::to_string(&killed).unwrap();
        assert_eq!(
            serde_json::from_str::<ExecuteResponse>(&json).unwrap(),
            killed
        );
    }
}
