//! What a failed `git` run means to the SDK: each failure is classified from
//! git's own message into one of the daemon's `GIT_*` codes (or a generic one),
//! and the message keeps git's words so the user sees why.

use axum::http::StatusCode;

/// A `git` command that ran and failed; the message is git's own.
#[derive(Debug, thiserror::Error)]
#[error("{command} failed: {detail}")]
pub struct GitError {
    pub failure: GitFailure,
    /// What was run, e.g. `git clone /tmp/remote.git into /root/repo`.
    pub command: String,
    /// git's stderr (or stdout when stderr is empty), trimmed.
    pub detail: String,
}

/// The classes of git failure the SDK tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GitFailure {
    AuthFailed,
    RepoNotFound,
    BranchNotFound,
    /// A revision, commit or pathspec that does not exist.
    NotFound,
    BranchExists,
    /// A remote or clone destination that already exists.
    AlreadyExists,
    PushRejected,
    RemoteRejected,
    DirtyWorktree,
    MergeConflict,
    TransportFailed,
    NothingToCommit,
    /// Anything else git refused, usually because of the request.
    Other,
}

impl GitFailure {
    pub fn status(self) -> StatusCode {
        match self {
            Self::AuthFailed => StatusCode::UNAUTHORIZED,
            Self::RepoNotFound | Self::BranchNotFound | Self::NotFound => StatusCode::NOT_FOUND,
            Self::BranchExists
            | Self::AlreadyExists
            | Self::PushRejected
            | Self::DirtyWorktree
            | Self::MergeConflict => StatusCode::CONFLICT,
            Self::RemoteRejected => StatusCode::UNPROCESSABLE_ENTITY,
            Self::TransportFailed => StatusCode::BAD_GATEWAY,
            Self::NothingToCommit | Self::Other => StatusCode::BAD_REQUEST,
        }
    }

    /// The daemon error code the SDK maps to its `DaytonaGit*Error` classes.
    pub fn code(self) -> &'static str {
        match self {
            Self::AuthFailed => "GIT_AUTH_FAILED",
            Self::RepoNotFound => "GIT_REPO_NOT_FOUND",
            Self::BranchNotFound => "GIT_BRANCH_NOT_FOUND",
            Self::NotFound => "NOT_FOUND",
            Self::BranchExists => "GIT_BRANCH_EXISTS",
            Self::AlreadyExists => "CONFLICT",
            Self::PushRejected => "GIT_PUSH_REJECTED",
            Self::RemoteRejected => "GIT_REMOTE_REJECTED",
            Self::DirtyWorktree => "GIT_DIRTY_WORKTREE",
            Self::MergeConflict => "GIT_MERGE_CONFLICT",
            Self::TransportFailed => "GIT_TRANSPORT_FAILED",
            Self::NothingToCommit | Self::Other => "BAD_REQUEST",
        }
    }
}

/// Classifies git's output (stderr and stdout together). The order matters:
/// a rejected push also says "failed to push", an auth failure also says
/// "unable to access".
pub(super) fn classify(output: &str) -> GitFailure {
    let text = output.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|needle| text.contains(needle));
    if has(&[
        "conflict (",
        "automatic merge failed",
        "fix conflicts and then",
    ]) {
        GitFailure::MergeConflict
    } else if has(&[
        "would be overwritten by",
        "please commit your changes or stash them",
        "you have unstaged changes",
    ]) {
        GitFailure::DirtyWorktree
    } else if has(&["[remote rejected]", "pre-receive hook declined"]) {
        GitFailure::RemoteRejected
    } else if has(&[
        "[rejected]",
        "updates were rejected",
        "non-fast-forward",
        "(fetch first)",
    ]) {
        GitFailure::PushRejected
    } else if has(&[
        "authentication failed",
        "could not read username",
        "could not read password",
        "terminal prompts disabled",
        "permission denied (publickey",
        "http basic: access denied",
        "the requested url returned error: 401",
        "the requested url returned error: 403",
        "invalid username or password",
    ]) {
        GitFailure::AuthFailed
    } else if has(&[
        "does not appear to be a git repository",
        "not a git repository",
        "repository not found",
        "the requested url returned error: 404",
    ]) || (text.contains("repository '") && text.contains("' does not exist"))
    {
        GitFailure::RepoNotFound
    } else if has(&[
        "not found in upstream",
        "couldn't find remote ref",
        "invalid reference",
        "does not match any",
        "no such branch",
    ]) || (text.contains("branch '") && text.contains("' not found"))
    {
        GitFailure::BranchNotFound
    } else if text.contains("a branch named '") && text.contains("' already exists") {
        GitFailure::BranchExists
    } else if has(&["already exists"]) {
        GitFailure::AlreadyExists
    } else if has(&[
        "could not resolve host",
        "failed to connect",
        "couldn't connect to server",
        "connection refused",
        "connection timed out",
        "operation timed out",
        "unable to access",
        "ssl certificate problem",
        "the remote end hung up unexpectedly",
        "early eof",
        "could not read from remote repository",
    ]) {
        GitFailure::TransportFailed
    } else if has(&[
        "unknown revision",
        "bad revision",
        "not a valid object name",
        "not a tree object",
        "unable to read tree",
        "did not match any file",
        "did not match any files",
        "is not a commit",
    ]) {
        GitFailure::NotFound
    } else if has(&["nothing to commit", "no changes added to commit"]) {
        GitFailure::NothingToCommit
    } else {
        GitFailure::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Messages as git 2.39-2.47 prints them.
    #[test]
    fn git_messages_map_to_daemon_codes() {
        let cases = [
            ("fatal: repository '/tmp/missing.git' does not exist", "GIT_REPO_NOT_FOUND"),
            ("fatal: '/tmp/missing.git' does not appear to be a git repository\nfatal: Could not read from remote repository.", "GIT_REPO_NOT_FOUND"),
            ("fatal: not a git repository (or any of the parent directories): .git", "GIT_REPO_NOT_FOUND"),
            ("remote: Repository not found.\nfatal: repository 'https://github.com/a/b.git/' not found", "GIT_REPO_NOT_FOUND"),
            ("fatal: Remote branch nope not found in upstream origin", "GIT_BRANCH_NOT_FOUND"),
            ("fatal: invalid reference: nope", "GIT_BRANCH_NOT_FOUND"),
            ("error: branch 'nope' not found", "GIT_BRANCH_NOT_FOUND"),
            ("error: src refspec nope does not match any", "GIT_BRANCH_NOT_FOUND"),
            ("fatal: couldn't find remote ref nope", "GIT_BRANCH_NOT_FOUND"),
            ("fatal: a branch named 'main' already exists", "GIT_BRANCH_EXISTS"),
            ("error: remote origin already exists.", "CONFLICT"),
            ("fatal: destination path 'a' already exists and is not an empty directory.", "CONFLICT"),
            (" ! [rejected]        main -> main (fetch first)\nerror: failed to push some refs", "GIT_PUSH_REJECTED"),
            (" ! [remote rejected] main -> main (pre-receive hook declined)", "GIT_REMOTE_REJECTED"),
            ("error: Your local changes to the following files would be overwritten by checkout:", "GIT_DIRTY_WORKTREE"),
            ("CONFLICT (content): Merge conflict in a.txt\nAutomatic merge failed; fix conflicts and then commit the result.", "GIT_MERGE_CONFLICT"),
            ("fatal: Authentication failed for 'http://127.0.0.1/r.git/'", "GIT_AUTH_FAILED"),
            ("fatal: could not read Username for 'https://github.com': terminal prompts disabled", "GIT_AUTH_FAILED"),
            ("fatal: unable to access 'http://127.0.0.1:1/x.git/': Failed to connect to 127.0.0.1 port 1", "GIT_TRANSPORT_FAILED"),
            ("fatal: unable to access 'https://nowhere.invalid/': Could not resolve host: nowhere.invalid", "GIT_TRANSPORT_FAILED"),
            ("fatal: ambiguous argument 'HEAD~5': unknown revision or path not in the working tree.", "NOT_FOUND"),
            ("fatal: pathspec 'nofile' did not match any files", "NOT_FOUND"),
            ("nothing to commit, working tree clean", "BAD_REQUEST"),
            ("fatal: something new", "BAD_REQUEST"),
        ];
        for (message, code) in cases {
            assert_eq!(classify(message).code(), code, "{message}");
        }
    }

    #[test]
    fn codes_carry_the_status_the_sdk_expects() {
        assert_eq!(GitFailure::AuthFailed.status(), 401);
        assert_eq!(GitFailure::RepoNotFound.status(), 404);
        assert_eq!(GitFailure::PushRejected.status(), 409);
        assert_eq!(GitFailure::RemoteRejected.status(), 422);
        assert_eq!(GitFailure::TransportFailed.status(), 502);
    }
}
