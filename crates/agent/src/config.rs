//! Settings of one agent process: where relative paths resolve, which shells run
//! commands, and the limits that keep one sandbox from exhausting the agent.
//!
//! Everything is read once at start-up; request handlers only read the result.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cove_protocol::{env, AgentEnv};

#[derive(Debug, Clone)]
pub struct Settings {
    /// Directory that relative paths and a missing `cwd` resolve against.
    pub work_dir: PathBuf,
    /// Home directory of the sandbox user, answered by `/user-home-dir`.
    pub home_dir: PathBuf,
    /// Shell for `/process/execute`: the SDK documents "the first available of
    /// zsh, bash or sh".
    pub exec_shell: PathBuf,
    /// Shell for sessions: bash if present, else sh.
    pub session_shell: PathBuf,
    /// Deadline of `/process/execute` when the request names none.
    pub default_exec_timeout: Duration,
    /// Most sessions alive at once.
    pub max_sessions: usize,
    /// Most asynchronous session commands running at once, over all sessions.
    pub max_async_commands: usize,
    /// Most bytes of output kept per command and stream; later output is dropped.
    pub max_log_bytes: usize,
    /// Where sessions keep their per-command FIFOs and scripts.
    pub state_dir: PathBuf,
    /// The sysfs directory of the btrfs quota group that caps the sandbox's
    /// disk (`COVE_DISK_QGROUP`, set by the container runtime); without it the
    /// disk is the root filesystem's (a VM's own disk).
    pub disk_qgroup: Option<PathBuf>,
    /// The image's ENTRYPOINT and CMD (`COVE_ENTRYPOINT`, a JSON array),
    /// started at start-up (see `entrypoint`); empty: nothing.
    pub entrypoint: Vec<String>,
}

/// Where a sandbox's agents keep their state: the sandbox's own `/run`, a
/// tmpfs in both classes that no snapshot captures, never `/tmp`, where a
/// user's `ls` or an agent framework's `grep -r` would find cove's files.
pub const SANDBOX_STATE_PARENT: &str = "/run/cove";

/// A state directory of its own for an agent of a sandbox: new for every
/// agent, as the default in `$TMPDIR` is.
pub fn sandbox_state_dir() -> PathBuf {
    Path::new(SANDBOX_STATE_PARENT).join(format!("agent-{}", uuid::Uuid::new_v4().simple()))
}

/// Makes `dir` (0700) while this process may still write its parent, and
/// gives it to `owner`, the user the agent is about to become: a sandbox
/// user cannot create anything in `/run`. The parent is made 0755, so that
/// user can reach its own directory and no other.
pub fn prepare_state_dir(
    dir: &Path,
    owner: Option<(nix::unistd::Uid, nix::unistd::Gid)>,
) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    if let Some(parent) = dir.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    if let Some((uid, gid)) = owner {
        // Not through a link: a directory named in the environment that is
        // a link already gives its target to nobody.
        std::os::unix::fs::lchown(dir, Some(uid.as_raw()), Some(gid.as_raw()))?;
    }
    Ok(())
}

impl Settings {
    /// The settings the agent's environment (`COVE_*` variables, read with
    /// [`AgentEnv::from_process`] before they are removed) asks for; empty
    /// values are as good as none.
    pub fn from_env(agent_env: &AgentEnv) -> Self {
        let path = |value: &Option<String>| {
            value
                .as_deref()
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let home_dir = std::env::var_os("HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| "/root".into());
        let work_dir = path(&agent_env.workdir).unwrap_or_else(|| home_dir.clone());
        let exec_shell =
            path(&agent_env.exec_shell).unwrap_or_else(|| first_shell(&["zsh", "bash", "sh"]));
        let session_shell =
            path(&agent_env.session_shell).unwrap_or_else(|| first_shell(&["bash", "sh"]));
        let state_dir = path(&agent_env.state_dir)
            // New for every agent start: a name that repeats (the pid of
            // PID 1 always does) would find the directory a snapshot or an
            // image build captured, owned by whoever ran then.
            .unwrap_or_else(|| {
                std::env::temp_dir().join(format!(".cove-agent-{}", uuid::Uuid::new_v4().simple()))
            });
        Self {
            work_dir,
            home_dir,
            exec_shell,
            session_shell,
            default_exec_timeout: Duration::from_secs(agent_env.exec_timeout_secs.unwrap_or(600)),
            max_sessions: agent_env.max_sessions.unwrap_or(8) as usize,
            max_async_commands: agent_env.max_async_commands.unwrap_or(16) as usize,
            max_log_bytes: agent_env.max_log_bytes.unwrap_or(32 << 20) as usize,
            state_dir,
            disk_qgroup: path(&agent_env.disk_qgroup),
            entrypoint: agent_env.entrypoint.clone(),
        }
    }

    /// Resolves a request path: absolute paths stay, relative ones join the
    /// work dir; either way cleaned as Go's `filepath.Join` cleans what
    /// Daytona's daemon answers, so `.` lists `/home/u/.bashrc`, never
    /// `/home/u/./.bashrc`.
    pub fn resolve(&self, path: &str) -> PathBuf {
        // Joining an absolute path gives that path.
        clean(&self.work_dir.join(path))
    }
}

/// `path` without `.` components, repeated or trailing separators, or
/// `..` after a name (it removes the name; at the root it stays the root):
/// Go's `filepath.Clean`, lexical as Daytona's is, so a `..` after a
/// symbolic link removes the link's name rather than leaving its target.
pub(crate) fn clean(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut parts: Vec<Component> = Vec::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => match parts.last() {
                Some(Component::Normal(_)) => {
                    parts.pop();
                }
                Some(Component::RootDir | Component::Prefix(_)) => {}
                _ => parts.push(component),
            },
            other => parts.push(other),
        }
    }
    if parts.is_empty() {
        return PathBuf::from(".");
    }
    parts.iter().collect()
}

/// Removes the agent's private variables from its own environment so every
/// child inherits exactly the sandbox's environment.
///
/// Must run before any thread exists: changing the environment of a
/// multi-threaded process races with `getenv` in other threads.
pub fn remove_private_env() {
    let private: Vec<_> = std::env::vars_os()
        .map(|(key, _)| key)
        .filter(|key| env::is_private(&key.to_string_lossy()))
        .collect();
    for key in private {
        std::env::remove_var(key);
    }
}

fn first_shell(names: &[&str]) -> PathBuf {
    for name in names {
        for dir in ["/bin", "/usr/bin", "/usr/local/bin"] {
            let candidate = Path::new(dir).join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    PathBuf::from("/bin/sh")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(work_dir: &str) -> Settings {
        Settings::from_env(&AgentEnv {
            workdir: Some(work_dir.to_owned()),
            ..AgentEnv::default()
        })
    }

    #[test]
    fn request_paths_resolve_clean() {
        let settings = settings("/home/u");
        for (given, resolved) in [
            (".", "/home/u"),
            ("./", "/home/u"),
            ("./a/./b", "/home/u/a/b"),
            ("a//b/", "/home/u/a/b"),
            ("..", "/home"),
            ("a/../b", "/home/u/b"),
            ("../../../..", "/"),
            ("/", "/"),
            ("/tmp/./x", "/tmp/x"),
            ("/tmp/x/..", "/tmp"),
            ("/../etc", "/etc"),
            ("//tmp///x", "/tmp/x"),
            ("/tmp/.hidden", "/tmp/.hidden"),
            ("/tmp/..x", "/tmp/..x"),
        ] {
            assert_eq!(
                settings.resolve(given),
                PathBuf::from(resolved),
                "{given:?}"
            );
        }
    }

    #[test]
    fn a_work_dir_given_unclean_is_cleaned_too() {
        assert_eq!(
            settings("/work/./dir/").resolve("."),
            PathBuf::from("/work/dir")
        );
        assert_eq!(clean(Path::new("a/..")), PathBuf::from("."));
        assert_eq!(clean(Path::new("../a")), PathBuf::from("../a"));
    }
}
