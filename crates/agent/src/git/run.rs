//! Running the sandbox's `git` binary for one request: never interactive
//! (no terminal prompt, no stdin), killed when the request is dropped, with
//! per-run configuration and credentials passed through the environment
//! (`GIT_CONFIG_COUNT`), never on the command line where `ps` would show them
//! and never into the repository's config.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Output, Stdio};

use tokio::io::AsyncWriteExt as _;

use super::failure::{classify, GitError};
use crate::error::ApiError;

/// A credential helper that answers `get` from two environment variables of
/// the git process itself, so the secret reaches git without touching disk.
const ENV_CREDENTIAL_HELPER: &str = "!f() { test \"$1\" = get || exit 0; \
     test -n \"$COVE_GIT_USERNAME\" && printf 'username=%s\\n' \"$COVE_GIT_USERNAME\"; \
     test -n \"$COVE_GIT_PASSWORD\" && printf 'password=%s\\n' \"$COVE_GIT_PASSWORD\"; \
     exit 0; }; f";

/// Username and password (or token) for one remote operation.
#[derive(Debug, Default)]
pub(super) struct Credentials {
    pub username: Option<String>,
    pub password: Option<String>,
}

impl Credentials {
    pub(super) fn new(
        username: Option<String>,
        password: Option<String>,
    ) -> Result<Self, ApiError> {
        let username = username.filter(|v| !v.is_empty());
        let password = password.filter(|v| !v.is_empty());
        // The credential protocol is line based: a newline would inject keys.
        if [&username, &password]
            .into_iter()
            .flatten()
            .any(|v| v.contains(['\n', '\0']))
        {
            return Err(ApiError::BadRequest(
                "username and password must not contain newlines".into(),
            ));
        }
        Ok(Self { username, password })
    }

    fn is_empty(&self) -> bool {
        self.username.is_none() && self.password.is_none()
    }
}

/// One `git` invocation being put together.
pub(super) struct Git {
    args: Vec<std::ffi::OsString>,
    config: Vec<(String, String)>,
    envs: Vec<(&'static str, String)>,
    secret: Option<String>,
    stdin: Option<Vec<u8>>,
    /// Shown in error messages: `git <subcommand> in <repo>`.
    description: String,
}

impl Git {
    /// `git -C <repo> <subcommand>`.
    pub(super) fn in_repo(repo: &Path, subcommand: &str) -> Self {
        let mut git = Self::new(
            subcommand,
            format!("git {subcommand} in {}", repo.display()),
        );
        git.args.splice(
            0..0,
            [
                OsStr::new("-C").to_os_string(),
                repo.as_os_str().to_os_string(),
            ],
        );
        git
    }

    /// `git <subcommand>` outside any repository; `description` names it in errors.
    pub(super) fn new(subcommand: &str, description: String) -> Self {
        Self {
            args: vec![subcommand.into()],
            // Repositories in a sandbox may belong to another uid (a clone
            // uploaded as files, a bind mount); the toolbox is the owner's
            // own tool, so git's ownership check only gets in the way.
            config: vec![("safe.directory".into(), "*".into())],
            envs: Vec::new(),
            secret: None,
            stdin: None,
            description,
        }
    }

    pub(super) fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_os_string());
        self
    }

    pub(super) fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(mut self, args: I) -> Self {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        self
    }

    pub(super) fn arg_if(self, condition: bool, arg: &str) -> Self {
        if condition {
            self.arg(arg)
        } else {
            self
        }
    }

    /// A configuration value for this run only (`git -c`, but out of sight).
    pub(super) fn config(mut self, key: &str, value: &str) -> Self {
        self.config.push((key.into(), value.into()));
        self
    }

    pub(super) fn env(mut self, key: &'static str, value: &str) -> Self {
        self.envs.push((key, value.into()));
        self
    }

    pub(super) fn stdin(mut self, input: Vec<u8>) -> Self {
        self.stdin = Some(input);
        self
    }

    /// Answers git's credential requests with these and nothing else: the
    /// configured helpers are reset for this run so they neither answer nor
    /// store what we pass.
    pub(super) fn credentials(mut self, credentials: &Credentials) -> Self {
        if credentials.is_empty() {
            return self;
        }
        self.config
            .push(("credential.helper".into(), String::new()));
        self.config
            .push(("credential.helper".into(), ENV_CREDENTIAL_HELPER.into()));
        if let Some(username) = &credentials.username {
            self.envs.push(("COVE_GIT_USERNAME", username.clone()));
        }
        if let Some(password) = &credentials.password {
            self.envs.push(("COVE_GIT_PASSWORD", password.clone()));
            self.secret = Some(password.clone());
        }
        self
    }

    /// Runs git and returns its stdout; a non-zero exit is a classified
    /// [`GitError`] carrying git's message.
    pub(super) async fn run(self) -> Result<String, ApiError> {
        let description = self.description.clone();
        let secret = self.secret.clone();
        let output = self.output().await?;
        if output.status.success() {
            return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
        }
        Err(failure(&output, description, secret.as_deref()).into())
    }

    /// Runs git and hands back whatever happened, for commands whose
    /// non-zero exit carries meaning (`git config --get` of an unset key).
    pub(super) async fn output(self) -> Result<Output, ApiError> {
        let mut command = tokio::process::Command::new("git");
        command
            .args(&self.args)
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_CONFIG_COUNT", self.config.len().to_string())
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(if self.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A dropped request (client gone) must not leave git running.
            .kill_on_drop(true);
        for (index, (key, value)) in self.config.iter().enumerate() {
            command
                .env(format!("GIT_CONFIG_KEY_{index}"), key)
                .env(format!("GIT_CONFIG_VALUE_{index}"), value);
        }
        let mut child = command
            .spawn()
            .map_err(|e| ApiError::internal("starting git (is git installed?)", e))?;
        if let Some(input) = self.stdin {
            let mut stdin = child.stdin.take().expect("stdin is piped");
            // git may exit before reading everything; its exit status tells.
            let _ = stdin.write_all(&input).await;
        }
        child
            .wait_with_output()
            .await
            .map_err(|e| ApiError::internal("waiting for git", e))
    }
}

/// The error for a failed run: git's message, with the password scrubbed in
/// case git echoed a URL that carried it.
pub(super) fn failure(output: &Output, command: String, secret: Option<&str>) -> GitError {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut detail = if stderr.trim().is_empty() {
        stdout.trim().to_string()
    } else {
        stderr.trim().to_string()
    };
    if detail.is_empty() {
        detail = format!("exit status {}", output.status);
    }
    if let Some(secret) = secret {
        detail = detail.replace(secret, "***");
    }
    let failure = classify(&format!("{stderr}\n{stdout}"));
    GitError {
        failure,
        command,
        detail,
    }
}

/// A URL fit for a message: any `user:password@` part is dropped.
pub(super) fn redact_url(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let authority_end = rest.find('/').unwrap_or(rest.len());
            match rest[..authority_end].rfind('@') {
                Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
                None => url.to_string(),
            }
        }
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_credentials_in_messages() {
        assert_eq!(
            redact_url("https://user:tok@github.com/a/b.git"),
            "https://github.com/a/b.git"
        );
        assert_eq!(
            redact_url("https://github.com/a@b"),
            "https://github.com/a@b"
        );
        assert_eq!(redact_url("/tmp/remote.git"), "/tmp/remote.git");
    }

    #[test]
    fn credentials_with_newlines_are_refused() {
        assert!(Credentials::new(Some("u".into()), Some("p\nhost=evil".into())).is_err());
        let empty = Credentials::new(Some(String::new()), None).unwrap();
        assert!(empty.is_empty());
    }
}
