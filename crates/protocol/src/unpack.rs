//! `POST /cove/unpack[?owner=USER[:GROUP]]` (a cove extension): the body is
//! a tar stream the agent unpacks at the sandbox's root, every entry owned
//! by `owner` when given. The image builder's `COPY` and `ADD` use it.

use serde::{Deserialize, Serialize};

pub const PATH: &str = "/cove/unpack";

/// The query string.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnpackQuery {
    /// Docker's `--chown` form: a user, optionally `:group`, by name or id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

impl UnpackQuery {
    /// The path and query of the request.
    pub fn path_and_query(&self) -> String {
        match &self.owner {
            None => PATH.to_owned(),
            Some(owner) => format!("{PATH}?owner={}", percent_encode(owner)),
        }
    }
}

/// The answer: how many entries were unpacked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnpackReply {
    pub entries: u64,
}

/// `application/x-www-form-urlencoded` value encoding (every byte but the
/// unreserved ones escaped), enough for an owner.
fn percent_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'*') {
            out.push(byte as char);
        } else if byte == b' ' {
            out.push('+');
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_goes_in_the_query() {
        assert_eq!(UnpackQuery::default().path_and_query(), "/cove/unpack");
        let query = UnpackQuery {
            owner: Some("app:1000".into()),
        };
        assert_eq!(query.path_and_query(), "/cove/unpack?owner=app%3A1000");
        let odd = UnpackQuery {
            owner: Some("a b&c=é".into()),
        };
        assert_eq!(odd.path_and_query(), "/cove/unpack?owner=a+b%26c%3D%C3%A9");
    }

    #[test]
    fn replies_round_trip() {
        let reply = UnpackReply { entries: 3 };
        let json = serde_json::to_string(&reply).unwrap();
        assert_eq!(json, r#"{"entries":3}"#);
        assert_eq!(serde_json::from_str::<UnpackReply>(&json).unwrap(), reply);
    }
}
