//! The one gate of the tests that need the real machine: root, a Debian root
//! filesystem, the static agent, QEMU and the guest assets, nft, a local
//! registry, PostgreSQL ([`postgres`] starts a throw-away cluster). A test
//! asks for what it needs; when something is missing it is skipped with the
//! reason on stderr, except under `COVE_TEST_STRICT=1` (`scripts/test`, so
//! CI), where a missing piece fails the test instead: a suite that silently
//! ran nothing cannot pass there.
//!
//! ```no_run
//! let Some(rootfs) = cove_testenv::path("COVE_TEST_ROOTFS", "a Debian root filesystem") else {
//!     return;
//! };
//! ```

use std::path::{Path, PathBuf};

pub mod postgres;

/// The variable that turns a skip into a failure.
pub const STRICT: &str = "COVE_TEST_STRICT";

/// Whether a missing environment fails tests rather than skipping them.
pub fn strict() -> bool {
    std::env::var(STRICT).is_ok_and(|v| v == "1")
}

/// Skips the calling test (says why on stderr), or fails it under
/// `COVE_TEST_STRICT=1`. Callers return right after.
#[track_caller]
pub fn missing(why: &str) {
    if strict() {
        panic!("{why} ({STRICT}=1: every test must run here)");
    }
    // Written to the process's stderr, not through libtest's capture, so the
    // reason shows even when the test passes.
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "skipped: {why}");
}

/// Whether the tests run as root; else [`missing`].
#[track_caller]
pub fn root(what: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    missing(&format!("{what} need root"));
    false
}

/// The path in the environment variable `name` (an existing file or
/// directory: `what` says which); else [`missing`].
#[track_caller]
pub fn path(name: &str, what: &str) -> Option<PathBuf> {
    match std::env::var_os(name).filter(|v| !v.is_empty()) {
        Some(value) if Path::new(&value).exists() => Some(PathBuf::from(value)),
        Some(value) => {
            missing(&format!(
                "{name}={} ({what}) does not exist",
                Path::new(&value).display()
            ));
            None
        }
        None => {
            missing(&format!("{name} is not set (it names {what})"));
            None
        }
    }
}

/// Whether `program` is on the PATH or in /usr/sbin or /sbin; else [`missing`].
#[track_caller]
pub fn program(program: &str, install: &str) -> bool {
    let dirs = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&dirs)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .any(|dir| dir.join(program).is_file());
    if !found {
        missing(&format!("{program} is not installed ({install})"));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_existing_path_is_given() {
        std::env::set_var("COVE_TESTENV_SELF", "/");
        assert_eq!(
            path("COVE_TESTENV_SELF", "the root"),
            Some(PathBuf::from("/"))
        );
    }

    #[test]
    fn a_missing_path_skips_or_fails_by_strictness() {
        let outcome = std::panic::catch_unwind(|| path("COVE_TESTENV_UNSET", "nothing"));
        if strict() {
            assert!(
                outcome.is_err(),
                "strict mode fails a test whose environment is missing"
            );
        } else {
            assert_eq!(outcome.ok(), Some(None));
        }
    }

    #[test]
    fn programs_are_found_on_the_path() {
        assert!(program("sh", "a shell"));
    }
}
