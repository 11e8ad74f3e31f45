//! The agent's environment: every `COVE_*` variable the runtime starts the
//! agent with, and the agent's own tuning knobs, named once. The runtime
//! writes them ([`AgentEnv::to_env`]); the agent reads them at start-up
//! ([`AgentEnv::from_vars`]) and then removes every variable with the
//! [`PRIVATE_PREFIX`], so no sandbox process inherits them.
//!
//! Values are kept as they were set: the agent decides what an empty one
//! means (as it always has: an empty `COVE_WORKDIR` is no work directory).

use std::fmt;

/// Prefix of the variables meant for the agent itself.
pub const PRIVATE_PREFIX: &str = "COVE_";

/// The image's `WORKDIR`: where commands start and relative paths resolve.
pub const WORKDIR: &str = "COVE_WORKDIR";
/// The image's `USER`: who the agent serves as.
pub const USER: &str = "COVE_USER";
/// The image's ENTRYPOINT and CMD, a JSON array, started once.
pub const ENTRYPOINT: &str = "COVE_ENTRYPOINT";
/// The number of an inherited, bound and listening Unix socket; set by the
/// container init only, never from a spec.
pub const LISTEN_FD: &str = "COVE_AGENT_LISTEN_FD";
/// The sysfs directory of the btrfs quota group that caps a container's disk.
pub const DISK_QGROUP: &str = "COVE_DISK_QGROUP";
/// Tuning, for tests and operators: the shells, the state directory, the
/// default command deadline, the limits, the log filter.
pub const EXEC_SHELL: &str = "COVE_AGENT_EXEC_SHELL";
pub const SESSION_SHELL: &str = "COVE_AGENT_SESSION_SHELL";
pub const STATE_DIR: &str = "COVE_AGENT_STATE_DIR";
pub const EXEC_TIMEOUT_SECS: &str = "COVE_AGENT_EXEC_TIMEOUT_SECS";
pub const MAX_SESSIONS: &str = "COVE_AGENT_MAX_SESSIONS";
pub const MAX_ASYNC_COMMANDS: &str = "COVE_AGENT_MAX_ASYNC_COMMANDS";
pub const MAX_LOG_BYTES: &str = "COVE_AGENT_MAX_LOG_BYTES";
pub const LOG: &str = "COVE_AGENT_LOG";

/// The variables that carry an image's settings: a sandbox spec's own
/// variables cannot override them.
pub const IMAGE_SETTINGS: [&str; 3] = [WORKDIR, USER, ENTRYPOINT];

/// Whether `name` is one of the agent's own variables.
pub fn is_private(name: &str) -> bool {
    name.starts_with(PRIVATE_PREFIX)
}

/// What the agent is started with, besides the sandbox's own environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentEnv {
    pub workdir: Option<String>,
    pub user: Option<String>,
    /// Empty: nothing to start (and no variable).
    pub entrypoint: Vec<String>,
    pub listen_fd: Option<i32>,
    pub disk_qgroup: Option<String>,
    pub exec_shell: Option<String>,
    pub session_shell: Option<String>,
    pub state_dir: Option<String>,
    /// The numbers: one that does not parse is as good as absent (the
    /// agent's default applies), as it always was.
    pub exec_timeout_secs: Option<u64>,
    pub max_sessions: Option<u64>,
    pub max_async_commands: Option<u64>,
    pub max_log_bytes: Option<u64>,
    pub log: Option<String>,
}

/// A variable the agent cannot start with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvError {
    pub name: &'static str,
    pub value: String,
}

impl fmt::Display for EnvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={:?} is not a fd", self.name, self.value)
    }
}

impl std::error::Error for EnvError {}

impl AgentEnv {
    /// Reads the variables through `get` (`std::env::var(..).ok()` in the
    /// agent, a map in tests). Only a listen fd that is no number fails.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<AgentEnv, EnvError> {
        let number = |name: &str| get(name).and_then(|v| v.parse().ok());
        let listen_fd = match get(LISTEN_FD) {
            None => None,
            Some(value) => Some(value.parse().map_err(|_| EnvError {
                name: LISTEN_FD,
                value,
            })?),
        };
        Ok(AgentEnv {
            workdir: get(WORKDIR),
            user: get(USER),
            entrypoint: get(ENTRYPOINT)
                .and_then(|json| serde_json::from_str(&json).ok())
                .unwrap_or_default(),
            listen_fd,
            disk_qgroup: get(DISK_QGROUP),
            exec_shell: get(EXEC_SHELL),
            session_shell: get(SESSION_SHELL),
            state_dir: get(STATE_DIR),
            exec_timeout_secs: number(EXEC_TIMEOUT_SECS),
            max_sessions: number(MAX_SESSIONS),
            max_async_commands: number(MAX_ASYNC_COMMANDS),
            max_log_bytes: number(MAX_LOG_BYTES),
            log: get(LOG),
        })
    }

    /// The process's own environment.
    pub fn from_process() -> Result<AgentEnv, EnvError> {
        AgentEnv::from_vars(|name| std::env::var(name).ok())
    }

    /// The variables that are set, as `(name, value)` pairs in a fixed
    /// order (the image's settings first).
    pub fn to_env(&self) -> Vec<(String, String)> {
        let entrypoint = (!self.entrypoint.is_empty())
            .then(|| serde_json::to_string(&self.entrypoint).expect("strings serialize"));
        let text = |value: &Option<String>| value.clone();
        let number = |value: &Option<u64>| value.map(|v| v.to_string());
        [
            (WORKDIR, text(&self.workdir)),
            (USER, text(&self.user)),
            (ENTRYPOINT, entrypoint),
            (LISTEN_FD, self.listen_fd.map(|fd| fd.to_string())),
            (DISK_QGROUP, text(&self.disk_qgroup)),
            (EXEC_SHELL, text(&self.exec_shell)),
            (SESSION_SHELL, text(&self.session_shell)),
            (STATE_DIR, text(&self.state_dir)),
            (EXEC_TIMEOUT_SECS, number(&self.exec_timeout_secs)),
            (MAX_SESSIONS, number(&self.max_sessions)),
            (MAX_ASYNC_COMMANDS, number(&self.max_async_commands)),
            (MAX_LOG_BYTES, number(&self.max_log_bytes)),
            (LOG, text(&self.log)),
        ]
        .into_iter()
        .filter_map(|(name, value)| value.map(|value| (name.to_owned(), value)))
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn read(vars: &[(String, String)]) -> Result<AgentEnv, EnvError> {
        let map: HashMap<_, _> = vars.iter().cloned().collect();
        AgentEnv::from_vars(|name| map.get(name).cloned())
    }

    #[test]
    fn every_setting_round_trips() {
        let env = AgentEnv {
            workdir: Some("/app".into()),
            user: Some("nobody".into()),
            entrypoint: vec!["sh".into(), "-c".into(), "echo \"hi\"".into()],
            listen_fd: Some(3),
            disk_qgroup: Some("/sys/fs/btrfs/x/qgroups/0_257".into()),
            exec_shell: Some("/bin/sh".into()),
            session_shell: Some("/bin/bash".into()),
            state_dir: Some("/tmp/state".into()),
            exec_timeout_secs: Some(5),
            max_sessions: Some(2),
            max_async_commands: Some(3),
            max_log_bytes: Some(1024),
            log: Some("debug".into()),
        };
        let vars = env.to_env();
        assert_eq!(vars.len(), 13);
        assert!(vars.iter().all(|(name, _)| is_private(name)));
        assert_eq!(vars[2].1, r#"["sh","-c","echo \"hi\""]"#);
        assert_eq!(read(&vars).unwrap(), env);
    }

    #[test]
    fn nothing_set_is_no_variable() {
        assert!(AgentEnv::default().to_env().is_empty());
        assert_eq!(read(&[]).unwrap(), AgentEnv::default());
    }

    #[test]
    fn bad_values_fall_back_except_the_listen_fd() {
        let vars = [
            (ENTRYPOINT.to_owned(), "not json".to_owned()),
            (MAX_SESSIONS.to_owned(), "many".to_owned()),
            (WORKDIR.to_owned(), String::new()),
        ];
        let env = read(&vars).unwrap();
        assert!(env.entrypoint.is_empty());
        assert_eq!(env.max_sessions, None);
        // Empty is kept: the agent decides what it means.
        assert_eq!(env.workdir.as_deref(), Some(""));
        let error = read(&[(LISTEN_FD.to_owned(), "x".to_owned())]).unwrap_err();
        assert_eq!(error.to_string(), "COVE_AGENT_LISTEN_FD=\"x\" is not a fd");
    }
}
