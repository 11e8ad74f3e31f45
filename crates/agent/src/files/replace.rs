//! `POST /files/replace` (`{files, pattern, newValue}` → `[{file, success,
//! error?}]`): replaces every occurrence of a literal text, file by file.
//!
//! Each file streams through a temporary sibling that is renamed over it only
//! when complete and only if something changed, so memory stays bounded for
//! any file size, an untouched file keeps its inode and time stamps, and a
//! failure leaves the original intact. The new file keeps the old one's mode
//! and owner; a symlink is followed and its target replaced.

use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use axum::extract::State;
use memchr::memmem::Finder;
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, Json};
use crate::AppState;

const CHUNK: usize = 64 << 10;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplaceRequest {
    files: Vec<String>,
    pattern: String,
    new_value: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct ReplaceResult {
    file: String,
    success: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

pub(crate) async fn replace_in_files(
    State(state): State<AppState>,
    Json(request): Json<ReplaceRequest>,
) -> Result<Json<Vec<ReplaceResult>>, ApiError> {
    if request.pattern.is_empty() {
        return Err(ApiError::BadRequest("pattern must not be empty".into()));
    }
    let settings = state.settings.clone();
    let results = tokio::task::spawn_blocking(move || {
        let finder = Finder::new(request.pattern.as_bytes());
        request
            .files
            .into_iter()
            .map(|file| {
                let path = settings.resolve(&file);
                let outcome = replace_file(&path, &finder, request.new_value.as_bytes());
                ReplaceResult {
                    file,
                    success: outcome.is_ok(),
                    error: outcome.err().map(|e| e.to_string()),
                }
            })
            .collect::<Vec<_>>()
    })
    .await
    .map_err(|e| ApiError::internal("replacing in files", io::Error::other(e)))?;
    Ok(Json(results))
}

/// Replaces in one file; returns how many occurrences were replaced.
fn replace_file(requested: &Path, finder: &Finder<'_>, new_value: &[u8]) -> Result<u64, ApiError> {
    let path = std::fs::canonicalize(requested).map_err(|e| ApiError::io(requested, e))?;
    let metadata = std::fs::metadata(&path).map_err(|e| ApiError::io(requested, e))?;
    if !metadata.is_file() {
        return Err(ApiError::BadRequest(format!(
            "not a regular file: {}",
            requested.display()
        )));
    }
    let mut input = std::fs::File::open(&path).map_err(|e| ApiError::io(requested, e))?;
    let temporary = temporary_sibling(&path);
    let mut output = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temporary)
        .map_err(|e| ApiError::io(requested, e))?;
    let result = (|| {
        let count = replace_stream(&mut input, &mut output, finder, new_value)?;
        if count > 0 {
            output.set_permissions(std::fs::Permissions::from_mode(metadata.mode() & 0o7777))?;
            // Keeping the owner needs root; as anyone else the file becomes theirs.
            let _ = std::os::unix::fs::fchown(&output, Some(metadata.uid()), Some(metadata.gid()));
            output.sync_data()?;
            std::fs::rename(&temporary, &path)?;
        }
        Ok::<_, io::Error>(count)
    })();
    if !matches!(result, Ok(count) if count > 0) {
        let _ = std::fs::remove_file(&temporary);
    }
    result.map_err(|e| ApiError::io(requested, e))
}

fn temporary_sibling(path: &Path) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(
        ".{name}.cove-replace-{}",
        uuid::Uuid::new_v4().simple()
    ))
}

/// Copies `input` to `output`, replacing each non-overlapping occurrence found
/// by `finder` with `new_value`. Only a chunk plus one pattern length is held.
fn replace_stream(
    input: &mut impl Read,
    output: &mut impl Write,
    finder: &Finder<'_>,
    new_value: &[u8],
) -> io::Result<u64> {
    let pattern_len = finder.needle().len();
    let mut pending: Vec<u8> = Vec::with_capacity(CHUNK + pattern_len);
    let mut chunk = vec![0u8; CHUNK];
    let mut count = 0;
    loop {
        let read = match input.read(&mut chunk) {
            Ok(read) => read,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        pending.extend_from_slice(&chunk[..read]);
        let mut start = 0;
        while let Some(at) = finder.find(&pending[start..]) {
            output.write_all(&pending[start..start + at])?;
            output.write_all(new_value)?;
            start += at + pattern_len;
            count += 1;
        }
        // An occurrence cut by the chunk boundary starts in the last
        // pattern_len - 1 bytes; keep them for the next round.
        let keep = if read == 0 {
            0
        } else {
            (pattern_len - 1).min(pending.len() - start)
        };
        let flush_to = pending.len() - keep;
        output.write_all(&pending[start..flush_to])?;
        pending.drain(..flush_to);
        if read == 0 {
            output.flush()?;
            return Ok(count);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out one byte at a time, to cut every occurrence.
    struct Trickle<'a>(&'a [u8]);

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let Some((first, rest)) = self.0.split_first() else {
                return Ok(0);
            };
            buf[0] = *first;
            self.0 = rest;
            Ok(1)
        }
    }

    fn replace(text: &str, pattern: &str, new_value: &str) -> (String, u64) {
        let mut out = Vec::new();
        let count = replace_stream(
            &mut Trickle(text.as_bytes()),
            &mut out,
            &Finder::new(pattern),
            new_value.as_bytes(),
        )
        .unwrap();
        (String::from_utf8(out).unwrap(), count)
    }

    #[test]
    fn replaces_across_read_boundaries() {
        assert_eq!(replace("abcabcab", "abc", "X"), ("XXab".into(), 2));
        assert_eq!(replace("aaaa", "aa", "b"), ("bb".into(), 2));
        assert_eq!(replace("no match", "zz", "y"), ("no match".into(), 0));
        assert_eq!(replace("", "a", "b"), ("".into(), 0));
        assert_eq!(replace("x.y", ".", "->"), ("x->y".into(), 1));
    }
}
