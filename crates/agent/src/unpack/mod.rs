//! `POST /cove/unpack` (a cove extension): unpacks a tar stream at the
//! sandbox's root, for the image builder's `COPY` and `ADD`.
//!
//! The server builds an image by starting a build sandbox whose agent runs as
//! root and posting each instruction's files here as one plain (uncompressed)
//! tar. The agent's `/` is the sandbox's root, so paths resolve as they do for
//! the image's own processes: symbolic links already in the image (`/lib ->
//! usr/lib`) are followed, as Docker's `COPY` does, and none of them leads out
//! of the sandbox. The core ([`unpack`], in `archive.rs`) takes any root so
//! that tests can use a temporary directory; there the same symbolic links
//! could lead out of it, which is why the handler only ever passes `/`.
//!
//! Contract: `POST /cove/unpack[?owner=SPEC]`, the body a tar stream, unpacked
//! as it arrives (never held whole).
//! - Entry names are relative to the root (`app/main.py`, `./app/sub/`). An
//!   absolute name, or one with a `..` component, is refused with `400` naming
//!   the entry before anything is written for it; so is a hard link whose
//!   target is. The root entry itself (`./`) is skipped.
//! - Regular files, directories, symbolic links and hard links (whose targets
//!   are relative to the root, like names) are unpacked; other types (devices,
//!   fifos) are refused with `400` naming them.
//! - Missing parent directories are created (`0755`, owned by the agent's
//!   user); existing ones are kept as they are, symbolic links followed.
//! - An existing file or symbolic link at an entry's path is replaced. An
//!   existing directory (or symbolic link to one) is kept for a directory entry
//!   and takes the entry's mode, owner and mtime; for any other entry it is
//!   refused with `400`.
//! - Mode bits (setuid, setgid and sticky included) and mtime come from the
//!   header; a directory's are set after the whole stream, so that entries
//!   can be written into a directory whose mode forbids it. A hard link shares
//!   its target's mode and mtime.
//! - Owner: the header's numeric uid and gid; with `owner`, that owner for
//!   every entry (created parents excepted). `SPEC` is Docker's `--chown`:
//!   `user`, `user:group`, `uid` or `uid:gid`, names from the sandbox's
//!   `/etc/passwd` and `/etc/group`; without a group the gid is the uid's
//!   number, as in Docker. An unknown name is `400` naming it.
//! - Answer: `200 {"entries": N}`, N the entries unpacked. A body that is not
//!   a tar stream or ends inside an entry is `400`; a failure to write is `500`
//!   naming the path and the entry. Entries before a failing one stay unpacked.

mod archive;

use std::io::{self, BufReader};
use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use cove_protocol::{UnpackQuery, UnpackReply};
use futures_util::TryStreamExt as _;
use nix::unistd::{Gid, Uid};
use tokio_util::io::{StreamReader, SyncIoBridge};

pub use archive::unpack;

use crate::error::{ApiError, Json, Query};
use crate::AppState;

/// Bytes taken from the request body per hand-over to the blocking unpacker:
/// every refill costs a wake-up of the async side, and tar reads 512-byte
/// headers, so a small buffer would hand over per header.
const READ_BUFFER: usize = 256 << 10;

pub fn routes() -> Router<AppState> {
    Router::new().route(cove_protocol::unpack::PATH, post(unpack_request))
}

async fn unpack_request(
    Query(query): Query<UnpackQuery>,
    body: Body,
) -> Result<Json<UnpackReply>, ApiError> {
    let stream = body.into_data_stream().map_err(io::Error::other);
    let reader = SyncIoBridge::new(StreamReader::new(stream));
    let entries = tokio::task::spawn_blocking(move || {
        let mut body = BufReader::with_capacity(READ_BUFFER, reader);
        let unpacked = query
            .owner
            .as_deref()
            .map(Owner::parse)
            .transpose()
            .and_then(|owner| unpack(&mut body, Path::new("/"), owner));
        // Read what follows the archive's end (a writer's zero padding, or
        // the rest after a refusal) before answering: a client still sending
        // it would otherwise see its write fail instead of this answer.
        let _ = io::copy(&mut body, &mut io::sink());
        unpacked
    })
    .await
    .map_err(|e| ApiError::internal("unpacking a tar stream", io::Error::other(e)))??;
    Ok(Json(UnpackReply { entries }))
}

/// Why a tar stream was not (wholly) unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("owner {spec:?}: {reason}")]
    UnknownOwner { spec: String, reason: String },
    /// Nothing was written for `entry`.
    #[error("refusing tar entry {entry:?}: {reason}")]
    Refused { entry: String, reason: String },
    /// The body is not tar, or ends early; `place` says where in the stream.
    #[error("the request body is not a readable tar stream ({place}): {source}")]
    Archive {
        place: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot {action} {} (tar entry {entry:?}): {source}", .path.display())]
    Io {
        entry: String,
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl UnpackError {
    /// Only a failure to write is ours; everything else is the request's.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::BAD_REQUEST,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::Io { .. } => "INTERNAL_SERVER_ERROR",
            _ => "BAD_REQUEST",
        }
    }
}

/// The owner every unpacked entry gets when the request names one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub uid: Uid,
    pub gid: Gid,
}

impl Owner {
    /// Resolves Docker's `--chown` spec (`user`, `user:group`, `uid`,
    /// `uid:gid`) from `/etc/passwd` and `/etc/group`.
    pub fn parse(spec: &str) -> Result<Self, UnpackError> {
        let user = crate::user::lookup(spec).map_err(|reason| UnpackError::UnknownOwner {
            spec: spec.to_string(),
            reason: reason.to_string(),
        })?;
        // Unlike `USER`, `--chown` takes no primary group from /etc/passwd: "a
        // username without groupname or a UID without GID uses the same
        // numeric UID as the GID".
        let gid = if spec.contains(':') {
            user.gid
        } else {
            Gid::from_raw(user.uid.as_raw())
        };
        Ok(Self { uid: user.uid, gid })
    }
}
