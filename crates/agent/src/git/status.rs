//! `GET /git/status`: `git status --porcelain=v2 --branch -z` turned into the
//! SDK's `GitStatus` (current branch, upstream, ahead/behind, one entry per
//! changed file with its index and worktree state).

use axum::extract::State;
use serde::Serialize;

use super::run::Git;
use super::{existing_dir, PathQuery};
use crate::error::{ApiError, Json, Query};
use crate::AppState;

/// Reported as `currentBranch` when HEAD is detached, as `git rev-parse
/// --abbrev-ref HEAD` does.
const DETACHED_HEAD: &str = "HEAD";

#[derive(Debug, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(super) struct GitStatus {
    pub current_branch: String,
    pub detached: bool,
    /// `origin/main`, empty when the branch tracks nothing.
    pub upstream: String,
    /// The upstream is set and exists on the remote as far as we know.
    pub branch_published: bool,
    pub ahead: u32,
    pub behind: u32,
    pub file_status: Vec<FileStatus>,
}

#[derive(Debug, Serialize, PartialEq)]
pub(super) struct FileStatus {
    pub name: String,
    pub staging: &'static str,
    pub worktree: &'static str,
    /// The original name of a renamed or copied file, else empty.
    pub extra: String,
}

pub(super) async fn status(
    State(state): State<AppState>,
    Query(query): Query<PathQuery>,
) -> Result<Json<GitStatus>, ApiError> {
    let repo = existing_dir(&state, &query.path).await?;
    let output = Git::in_repo(&repo, "status")
        .args(["--porcelain=v2", "--branch", "-z", "--untracked-files=all"])
        .run()
        .await?;
    Ok(Json(parse(&output)))
}

/// Parses NUL-separated porcelain v2 records.
pub(super) fn parse(output: &str) -> GitStatus {
    let mut status = GitStatus::default();
    let mut records = output.split('\0').filter(|r| !r.is_empty());
    while let Some(record) = records.next() {
        if let Some(header) = record.strip_prefix("# ") {
            let (key, value) = header.split_once(' ').unwrap_or((header, ""));
            match key {
                "branch.head" if value == "(detached)" => {
                    status.detached = true;
                    status.current_branch = DETACHED_HEAD.into();
                }
                "branch.head" => status.current_branch = value.into(),
                "branch.upstream" => status.upstream = value.into(),
                "branch.ab" => {
                    // Present only when the upstream ref exists.
                    status.branch_published = true;
                    for count in value.split(' ') {
                        if let Some(ahead) = count.strip_prefix('+') {
                            status.ahead = ahead.parse().unwrap_or(0);
                        } else if let Some(behind) = count.strip_prefix('-') {
                            status.behind = behind.parse().unwrap_or(0);
                        }
                    }
                }
                _ => {}
            }
            continue;
        }
        let kind = record.chars().next().unwrap_or(' ');
        let entry = match kind {
            // 1 XY sub mH mI mW hH hI path
            '1' => fields(record, 9).map(|f| changed(f[1], f[8], String::new())),
            // 2 XY sub mH mI mW hH hI Xscore path, then the original path.
            '2' => fields(record, 10).map(|f| {
                let original = records.next().unwrap_or_default().to_string();
                changed(f[1], f[9], original)
            }),
            // u XY sub m1 m2 m3 mW h1 h2 h3 path
            'u' => fields(record, 11).map(|f| FileStatus {
                name: f[10].into(),
                staging: "Updated but unmerged",
                worktree: "Updated but unmerged",
                extra: String::new(),
            }),
            '?' => Some(FileStatus {
                name: record[2..].into(),
                staging: "Untracked",
                worktree: "Untracked",
                extra: String::new(),
            }),
            _ => None,
        };
        status.file_status.extend(entry);
    }
    status
}

/// The first `count` space-separated fields; the last keeps any spaces (it is
/// the path).
fn fields(record: &str, count: usize) -> Option<Vec<&str>> {
    let fields: Vec<&str> = record.splitn(count, ' ').collect();
    (fields.len() == count).then_some(fields)
}

fn changed(xy: &str, name: &str, extra: String) -> FileStatus {
    let mut codes = xy.chars();
    FileStatus {
        name: name.into(),
        staging: state_name(codes.next().unwrap_or('.')),
        worktree: state_name(codes.next().unwrap_or('.')),
        extra,
    }
}

/// The SDK's `Status` enum for one porcelain state letter.
fn state_name(code: char) -> &'static str {
    match code {
        'M' | 'T' => "Modified",
        'A' => "Added",
        'D' => "Deleted",
        'R' => "Renamed",
        'C' => "Copied",
        'U' => "Updated but unmerged",
        '?' => "Untracked",
        _ => "Unmodified",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn porcelain_v2_becomes_the_sdk_shape() {
        let output = [
            "# branch.oid 1111111111111111111111111111111111111111",
            "# branch.head main",
            "# branch.upstream origin/main",
            "# branch.ab +2 -1",
            "1 M. N... 100644 100644 100644 aaaa bbbb staged.txt",
            "1 .M N... 100644 100644 100644 aaaa aaaa with space.txt",
            "1 A. N... 000000 100644 100644 0000 cccc added.txt",
            "2 R. N... 100644 100644 100644 aaaa aaaa R100 new name.txt",
            "old name.txt",
            "u UU N... 100644 100644 100644 100644 a b c clash.txt",
            "? fresh/untracked.txt",
            "",
        ]
        .join("\0");
        let status = parse(&output);
        assert_eq!(status.current_branch, "main");
        assert_eq!(status.upstream, "origin/main");
        assert!(status.branch_published && !status.detached);
        assert_eq!((status.ahead, status.behind), (2, 1));
        let summary: Vec<_> = status
            .file_status
            .iter()
            .map(|f| (f.name.as_str(), f.staging, f.worktree, f.extra.as_str()))
            .collect();
        assert_eq!(
            summary,
            [
                ("staged.txt", "Modified", "Unmodified", ""),
                ("with space.txt", "Unmodified", "Modified", ""),
                ("added.txt", "Added", "Unmodified", ""),
                ("new name.txt", "Renamed", "Unmodified", "old name.txt"),
                (
                    "clash.txt",
                    "Updated but unmerged",
                    "Updated but unmerged",
                    ""
                ),
                ("fresh/untracked.txt", "Untracked", "Untracked", ""),
            ]
        );
    }

    #[test]
    fn detached_head_and_unpublished_branches() {
        let detached = parse("# branch.oid abc\0# branch.head (detached)\0");
        assert!(detached.detached);
        assert_eq!(detached.current_branch, "HEAD");
        let local = parse("# branch.oid (initial)\0# branch.head feature\0");
        assert_eq!(local.current_branch, "feature");
        assert!(!local.branch_published);
        assert_eq!(local.upstream, "");
        assert!(local.file_status.is_empty());
    }
}
