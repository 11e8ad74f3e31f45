//! [`SandboxId`]: a sandbox's id, checked once where it enters and plain
//! text from then on. Ids name directories, cgroups, network namespaces and
//! sockets on the host, so what may be one is narrow: 1 to 128 of
//! `[A-Za-z0-9._-]`, and neither `.` nor `..`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The longest id accepted.
pub const MAX_LEN: usize = 128;

/// A sandbox id that is safe as one path component on the host.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SandboxId(String);

/// Why a string is not a sandbox id (the message names the rule).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidSandboxId {
    pub id: String,
}

impl fmt::Display for InvalidSandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sandbox id {:?}: id must be 1 to {MAX_LEN} of [A-Za-z0-9._-] and not . or ..",
            self.id
        )
    }
}

impl std::error::Error for InvalidSandboxId {}

impl SandboxId {
    /// Checks `id`; the only way to make a [`SandboxId`].
    pub fn parse(id: &str) -> Result<SandboxId, InvalidSandboxId> {
        if is_valid(id) {
            Ok(SandboxId(id.to_owned()))
        } else {
            Err(InvalidSandboxId { id: id.to_owned() })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

fn is_valid(id: &str) -> bool {
    !id.is_empty()
        && id != "."
        && id != ".."
        && id.len() <= MAX_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A checked id reads as the string it is.
impl std::ops::Deref for SandboxId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for SandboxId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for SandboxId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl FromStr for SandboxId {
    type Err = InvalidSandboxId;

    fn from_str(id: &str) -> Result<SandboxId, InvalidSandboxId> {
        SandboxId::parse(id)
    }
}

impl TryFrom<String> for SandboxId {
    type Error = InvalidSandboxId;

    fn try_from(id: String) -> Result<SandboxId, InvalidSandboxId> {
        if is_valid(&id) {
            Ok(SandboxId(id))
        } else {
            Err(InvalidSandboxId { id })
        }
    }
}

impl From<SandboxId> for String {
    fn from(id: SandboxId) -> String {
        id.0
    }
}

impl Serialize for SandboxId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

/// Deserializing checks too: an id read from the wire or from disk is no
/// more trusted than one from a request path.
impl<'de> Deserialize<'de> for SandboxId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<SandboxId, D::Error> {
        let id = String::deserialize(deserializer)?;
        SandboxId::try_from(id).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_ids_are_taken() {
        for id in ["a", "sbx-1", "A.b_c-9", "..a", "a..", &"x".repeat(MAX_LEN)] {
            let parsed = SandboxId::parse(id).unwrap();
            assert_eq!(parsed.as_str(), id);
            assert_eq!(parsed.to_string(), id);
            assert_eq!(id.parse::<SandboxId>().unwrap(), parsed);
        }
    }

    #[test]
    fn ids_that_could_escape_a_directory_are_refused() {
        let long = "x".repeat(MAX_LEN + 1);
        for id in [
            "", ".", "..", "a/b", "/a", "a b", "a\0b", "é", "a\n", "a:b", &long,
        ] {
            let error = SandboxId::parse(id).unwrap_err();
            assert_eq!(error.id, id);
            assert!(error.to_string().contains("1 to 128"), "{error}");
            assert!(SandboxId::try_from(id.to_owned()).is_err());
        }
    }

    #[test]
    fn ids_round_trip_through_json_and_are_checked_on_the_way_in() {
        let id = SandboxId::parse("sbx-7").unwrap();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"sbx-7\"");
        assert_eq!(serde_json::from_str::<SandboxId>(&json).unwrap(), id);
        let error = serde_json::from_str::<SandboxId>("\"../etc\"").unwrap_err();
        assert!(error.to_string().contains("1 to 128"), "{error}");
    }
}
