//! The image's ENTRYPOINT and CMD (`COVE_ENTRYPOINT`, a JSON array, set by the
//! runtime): started when the agent starts, as an asynchronous command of a
//! session named [`SESSION`], so it runs as the sandbox's user in its working
//! directory with its environment, and its output and exit code are read
//! like any session command's (`process.get_session`,
//! `get_session_command_logs`). It holds one of the session and background
//! command slots while it runs; deleting the session ends it.

use crate::session::Registry;

/// The session the image's command runs in.
pub const SESSION: &str = "entrypoint";

/// Starts `argv` in the entrypoint session; nothing when it is empty. A
/// failure is logged: the sandbox serves without it.
pub async fn start(sessions: &Registry, argv: &[String]) {
    if argv.is_empty() {
        return;
    }
    // No input, as in `docker run` without `-i`: a CMD of `python3` or
    // `bash` ends at once instead of holding its slots waiting to be typed at.
    let words: Vec<String> = argv.iter().map(|arg| quote(arg)).collect();
    let command = format!("{} </dev/null", words.join(" "));
    if let Err(error) = sessions.create(SESSION.to_owned()) {
        tracing::warn!(%error, "could not make the entrypoint session");
        return;
    }
    match sessions.exec(SESSION, command.clone(), true, true).await {
        Ok(_) => tracing::info!(%command, "started the image's entrypoint"),
        Err(error) => tracing::warn!(%error, %command, "could not start the image's entrypoint"),
    }
}

/// One shell word holding exactly `arg`.
fn quote(arg: &str) -> String {
    format!("'{}'", arg.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::quote;

    #[test]
    fn quoting_keeps_every_character() {
        assert_eq!(quote("nginx"), "'nginx'");
        assert_eq!(quote("it's $HOME"), r"'it'\''s $HOME'");
    }
}
