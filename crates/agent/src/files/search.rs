//! `GET /files/search` (names matching a glob → `{files}`) and `GET /files/find`
//! (lines containing a text → `[{file, line, content}]`), both over
//! [`walk`](super::walk) on a blocking thread that stops when the client leaves.
//!
//! Glob rules (`*`, `?`, `[..]`, `{a,b}`, `**`): a pattern without `/` matches
//! an entry's name at any depth (`*.py` finds every Python file, as the SDK
//! documents); a pattern with `/` matches the path relative to the search root
//! (`src/**/*.rs`). Matches are files and directories, never the root itself,
//! as absolute paths in walk order.
//!
//! Find is a plain substring search, line by line, in regular files whose first
//! 512 bytes hold no NUL (binary files are skipped). Line numbers start at 1.
//! A line longer than [`MAX_LINE`] is matched and answered on its first
//! `MAX_LINE` bytes, so one huge line cannot exhaust memory.

use std::io::{BufRead, BufReader, Read as _};
use std::path::Path;

use axum::extract::State;
use globset::{GlobBuilder, GlobMatcher};
use serde::{Deserialize, Serialize};

use super::walk::{walk, Cancel};
use crate::error::{ApiError, Json, Query};
use crate::AppState;

/// Longest part of one line kept for matching and answering.
pub(crate) const MAX_LINE: usize = 1 << 20;

#[derive(Debug, Deserialize)]
pub struct PatternQuery {
    path: String,
    pattern: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct SearchFilesResponse {
    files: Vec<String>,
}

#[derive(Debug, Serialize, PartialEq)]
pub(crate) struct Match {
    file: String,
    line: u64,
    content: String,
}

pub(crate) async fn search_files(
    State(state): State<AppState>,
    Query(query): Query<PatternQuery>,
) -> Result<Json<SearchFilesResponse>, ApiError> {
    let (root, pattern) = validate(&state, &query)?;
    let matcher = NameMatcher::new(&pattern)?;
    let files = blocking(move |cancel| {
        let mut files = Vec::new();
        walk(&root, &cancel, |entry| {
            if entry.depth > 0 {
                let relative = entry.path.strip_prefix(&root).unwrap_or(entry.path);
                if matcher.is_match(relative) {
                    files.push(entry.path.to_string_lossy().into_owned());
                }
            }
            true
        })?;
        Ok(files)
    })
    .await?;
    Ok(Json(SearchFilesResponse { files }))
}

pub(crate) async fn find_in_files(
    State(state): State<AppState>,
    Query(query): Query<PatternQuery>,
) -> Result<Json<Vec<Match>>, ApiError> {
    let (root, pattern) = validate(&state, &query)?;
    let matches = blocking(move |cancel| {
        let needle = memchr::memmem::Finder::new(pattern.as_bytes()).into_owned();
        let mut matches = Vec::new();
        walk(&root, &cancel, |entry| {
            if entry.metadata.is_file() {
                // An unreadable file is skipped, like an unreadable directory.
                let _ = find_in_file(entry.path, &needle, &cancel, &mut matches);
            }
            true
        })?;
        Ok(matches)
    })
    .await?;
    Ok(Json(matches))
}

fn validate(
    state: &AppState,
    query: &PatternQuery,
) -> Result<(std::path::PathBuf, String), ApiError> {
    if query.path.is_empty() || query.pattern.is_empty() {
        return Err(ApiError::BadRequest("path and pattern are required".into()));
    }
    Ok((state.settings.resolve(&query.path), query.pattern.clone()))
}

/// Runs `work` on a blocking thread; dropping the returned future (the client
/// hung up) raises the cancel flag the work polls.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce(Cancel) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let cancel = Cancel::default();
    let _guard = cancel.guard();
    tokio::task::spawn_blocking(move || work(cancel))
        .await
        .map_err(|e| ApiError::internal("searching files", std::io::Error::other(e)))?
}

/// A compiled search pattern and whether it applies to names or relative paths.
struct NameMatcher {
    glob: GlobMatcher,
    whole_path: bool,
}

impl NameMatcher {
    fn new(pattern: &str) -> Result<Self, ApiError> {
        let glob = GlobBuilder::new(pattern)
            .literal_separator(true)
            .backslash_escape(true)
            .build()
            .map_err(|e| ApiError::BadRequest(format!("invalid glob pattern {pattern:?}: {e}")))?
            .compile_matcher();
        Ok(Self {
            glob,
            whole_path: pattern.contains('/'),
        })
    }

    fn is_match(&self, relative: &Path) -> bool {
        if self.whole_path {
            self.glob.is_match(relative)
        } else {
            relative
                .file_name()
                .is_some_and(|name| self.glob.is_match(Path::new(name)))
        }
    }
}

fn find_in_file(
    path: &Path,
    needle: &memchr::memmem::Finder<'static>,
    cancel: &Cancel,
    out: &mut Vec<Match>,
) -> std::io::Result<()> {
    let mut file = std::fs::File::open(path)?;
    let mut head = [0u8; 512];
    let mut filled = 0;
    while filled < head.len() {
        match file.read(&mut head[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if head[..filled].contains(&0) {
        return Ok(());
    }
    let reader = BufReader::with_capacity(64 << 10, head[..filled].chain(file));
    let file_name = path.to_string_lossy();
    for_each_line(reader, |number, line| {
        if needle.find(line).is_some() {
            out.push(Match {
                file: file_name.clone().into_owned(),
                line: number,
                content: String::from_utf8_lossy(line).into_owned(),
            });
        }
        !cancel.is_raised()
    })
}

/// Calls `on_line(number, line)` for each line (without `\n` or `\r\n`), each
/// cut to [`MAX_LINE`] bytes; `on_line` returns whether to go on.
fn for_each_line(
    mut reader: impl BufRead,
    mut on_line: impl FnMut(u64, &[u8]) -> bool,
) -> std::io::Result<()> {
    let mut line = Vec::new();
    let mut number = 1;
    let keep = |line: &mut Vec<u8>, part: &[u8]| {
        let room = MAX_LINE.saturating_sub(line.len());
        line.extend_from_slice(&part[..part.len().min(room)]);
    };
    loop {
        let buffer = match reader.fill_buf() {
            Ok(buffer) => buffer,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buffer.is_empty() {
            if !line.is_empty() {
                on_line(number, trim_cr(&line));
            }
            return Ok(());
        }
        match memchr::memchr(b'\n', buffer) {
            Some(end) => {
                keep(&mut line, &buffer[..end]);
                reader.consume(end + 1);
                if !on_line(number, trim_cr(&line)) {
                    return Ok(());
                }
                line.clear();
                number += 1;
            }
            None => {
                let len = buffer.len();
                keep(&mut line, buffer);
                reader.consume(len);
            }
        }
    }
}

fn trim_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &[u8]) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        for_each_line(BufReader::with_capacity(3, text), |n, line| {
            out.push((n, line.to_vec()));
            true
        })
        .unwrap();
        out
    }

    #[test]
    fn lines_are_numbered_from_one_without_terminators() {
        assert_eq!(
            lines(b"a\r\nbcdef\n\nlast"),
            vec![
                (1, b"a".to_vec()),
                (2, b"bcdef".to_vec()),
                (3, b"".to_vec()),
                (4, b"last".to_vec())
            ]
        );
        assert!(lines(b"").is_empty());
    }

    #[test]
    fn a_pattern_without_slash_matches_names_at_any_depth() {
        let matcher = NameMatcher::new("*.py").unwrap();
        assert!(matcher.is_match(Path::new("a.py")));
        assert!(matcher.is_match(Path::new("deep/down/b.py")));
        assert!(!matcher.is_match(Path::new("deep.py/c.txt")));
        let matcher = NameMatcher::new("src/**/*.{rs,toml}").unwrap();
        assert!(matcher.is_match(Path::new("src/a/b/c.rs")));
        assert!(matcher.is_match(Path::new("src/x.toml")));
        assert!(!matcher.is_match(Path::new("other/src/c.rs")));
        assert!(NameMatcher::new("[").is_err());
    }
}
