//! Reading a Dockerfile into the steps cove builds: one `FROM`, then `RUN`,
//! `COPY`, `ADD`, `ENV`, `ARG`, `WORKDIR`, `USER`, `ENTRYPOINT`, `CMD` and
//! metadata that does not change the image (`LABEL`, `EXPOSE`, ...).
//! Anything else is named in the error.

use std::collections::BTreeMap;

/// A Dockerfile cove does not build, and why. A front end answers either
/// as a client error; `Unsupported` names what cove could learn to build.
#[derive(Debug, thiserror::Error)]
pub enum DockerfileError {
    /// The Dockerfile is malformed.
    #[error("invalid buildInfo.dockerfileContent: {reason}")]
    Invalid { reason: String },
    /// The Dockerfile uses something cove does not build; `what` names it.
    #[error("building images with {what} is not implemented by cove yet")]
    Unsupported { what: String },
}

/// A Dockerfile cove can build.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DockerfilePlan {
    /// The image (or snapshot) of the one `FROM`.
    pub base: String,
    /// What follows `FROM`, in order.
    pub steps: Vec<Step>,
}

impl DockerfilePlan {
    /// Whether a step reads the build context (`COPY`, `ADD`).
    pub fn copies(&self) -> bool {
        self.steps
            .iter()
            .any(|step| matches!(step.kind, StepKind::Copy(_)))
    }
}

/// One instruction after `FROM`, with its text as written (joined lines) for
/// logs and cache keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub text: String,
    pub kind: StepKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepKind {
    /// Runs a command in a build sandbox; its changes become a layer.
    Run(Command),
    /// `ENV` as written after the keyword: read again when built, because
    /// `$VAR` expands against the image's environment so far.
    Env(String),
    /// A build variable with its default (there are no `--build-arg`s).
    Arg {
        name: String,
        default: Option<String>,
    },
    /// Copies files from the build context into the image.
    Copy(Copy),
    Workdir(String),
    User(String),
    Entrypoint(Command),
    Cmd(Command),
    /// Changes nothing a sandbox sees (`LABEL`, `EXPOSE`, ...).
    Metadata,
}

/// `COPY` or `ADD` from the build context: sources and destination as
/// written (`$VAR`s expand when built).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Copy {
    pub sources: Vec<String>,
    pub dest: String,
    /// `--chown=user[:group]`, resolved inside the image.
    pub chown: Option<String>,
    /// `--chmod=0755`: the mode of everything copied.
    pub chmod: Option<u32>,
    /// `ADD`: a local tar archive (plain or gzip) is unpacked at the
    /// destination instead of copied.
    pub unpack_archives: bool,
}

/// The shell form (`RUN echo hi`) or the exec form (`RUN ["echo", "hi"]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Shell(String),
    Exec(Vec<String>),
}

impl Command {
    /// The command line as argv: the shell form runs under `/bin/sh -c`.
    pub fn argv(&self) -> Vec<String> {
        match self {
            Command::Shell(line) => vec!["/bin/sh".into(), "-c".into(), line.clone()],
            Command::Exec(words) => words.clone(),
        }
    }
}

fn invalid(reason: String) -> DockerfileError {
    DockerfileError::Invalid { reason }
}

fn unsupported(what: &str) -> DockerfileError {
    DockerfileError::Unsupported {
        what: what.to_owned(),
    }
}

/// Parses a Dockerfile into the steps cove can build: a malformed one is
/// [`DockerfileError::Invalid`], one with an instruction cove does not build is
/// [`DockerfileError::Unsupported`] naming it.
pub fn parse_dockerfile(text: &str) -> Result<DockerfilePlan, DockerfileError> {
    let mut plan = DockerfilePlan::default();
    for instruction in logical_lines(text) {
        let (keyword, rest) = instruction
            .split_once(char::is_whitespace)
            .map(|(k, r)| (k, r.trim()))
            .unwrap_or((instruction.as_str(), ""));
        let keyword = keyword.to_ascii_uppercase();
        if keyword == "FROM" {
            if !plan.base.is_empty() {
                return Err(unsupported("a second FROM (multi-stage builds)"));
            }
            let mut words = rest.split_whitespace();
            let image = words.next().unwrap_or_default();
            if image.is_empty() || image.starts_with("--") || words.next().is_some() {
                return Err(unsupported(&format!("FROM {rest}")));
            }
            plan.base = image.to_owned();
            continue;
        }
        if plan.base.is_empty() {
            return Err(invalid("the Dockerfile must start with FROM".into()));
        }
        let needs_argument = |kind: StepKind| {
            if rest.is_empty() {
                Err(invalid(format!("{keyword} needs an argument")))
            } else {
                Ok(kind)
            }
        };
        let kind = match keyword.as_str() {
            "RUN" => {
                if rest.starts_with("--") {
                    return Err(unsupported(&format!("RUN options ({instruction})")));
                }
                needs_argument(StepKind::Run(command(rest)?))?
            }
            "ENV" => {
                parse_env(rest, &BTreeMap::new())?;
                StepKind::Env(rest.to_owned())
            }
            "ARG" => {
                let (name, default) = match rest.split_once('=') {
                    Some((name, value)) => (name, Some(unquote(value))),
                    None => (rest, None),
                };
                if name.is_empty() || name.contains(char::is_whitespace) {
                    return Err(invalid(format!("cannot read ARG {rest}")));
                }
                StepKind::Arg {
                    name: name.to_owned(),
                    default,
                }
            }
            "WORKDIR" => needs_argument(StepKind::Workdir(unquote(rest)))?,
            "USER" => needs_argument(StepKind::User(unquote(rest)))?,
            "ENTRYPOINT" => needs_argument(StepKind::Entrypoint(command(rest)?))?,
            "CMD" => needs_argument(StepKind::Cmd(command(rest)?))?,
            "LABEL" | "EXPOSE" | "STOPSIGNAL" | "MAINTAINER" => StepKind::Metadata,
            "COPY" | "ADD" => needs_argument(StepKind::Copy(copy(&keyword, rest)?))?,
            "VOLUME" | "SHELL" | "ONBUILD" | "HEALTHCHECK" => {
                return Err(unsupported(&format!("the {keyword} instruction")));
            }
            other => {
                return Err(invalid(format!(
                    "{other:?} is not a Dockerfile instruction"
                )))
            }
        };
        plan.steps.push(Step {
            text: instruction.clone(),
            kind,
        });
    }
    if plan.base.is_empty() {
        return Err(invalid("the Dockerfile has no FROM".into()));
    }
    Ok(plan)
}

/// Instructions with continuation lines (`\` at the end) joined, comments
/// and blank lines dropped.
fn logical_lines(text: &str) -> Vec<String> {
    let mut joined: Vec<String> = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (current.is_empty() && trimmed.is_empty()) {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        current.push_str(trimmed);
        joined.push(std::mem::take(&mut current));
    }
    if !current.trim().is_empty() {
        joined.push(current.trim().to_owned());
    }
    joined
}

/// `COPY`/`ADD` `[--chown=..] [--chmod=..] [--link] src... dest`, or the
/// JSON form `["src", ..., "dest"]` after the options.
fn copy(keyword: &str, rest: &str) -> Result<Copy, DockerfileError> {
    let mut rest = rest.trim();
    let mut copy = Copy {
        sources: Vec::new(),
        dest: String::new(),
        chown: None,
        chmod: None,
        unpack_archives: keyword == "ADD",
    };
    while let Some(option) = rest.strip_prefix("--") {
        let (word, after) = option
            .split_once(char::is_whitespace)
            .unwrap_or((option, ""));
        let (name, value) = word.split_once('=').unwrap_or((word, ""));
        match name {
            "chown" if !value.is_empty() => copy.chown = Some(value.to_owned()),
            "chmod" if !value.is_empty() => {
                let mode = u32::from_str_radix(value, 8)
                    .ok()
                    .filter(|m| *m <= 0o7777)
                    .ok_or_else(|| {
                        unsupported(&format!(
                            "{keyword} --chmod={value} (only octal modes such as 0755)"
                        ))
                    })?;
                copy.chmod = Some(mode);
            }
            // Only how Docker stores the layer; the files are the same.
            "link" if value.is_empty() || value == "true" => {}
            "from" => {
                return Err(unsupported(&format!(
                    "{keyword} --from (multi-stage builds)"
                )))
            }
            _ => return Err(unsupported(&format!("{keyword} --{word}"))),
        }
        rest = after.trim_start();
    }
    if rest.starts_with("<<") {
        return Err(unsupported(&format!("{keyword} with a here-document")));
    }
    let words: Vec<String> = if rest.starts_with('[') {
        serde_json::from_str(rest).map_err(|_| {
            invalid(format!(
                "cannot read {keyword} {rest}: not a JSON array of strings"
            ))
        })?
    } else {
        rest.split_whitespace().map(str::to_owned).collect()
    };
    let Some((dest, sources)) = words.split_last() else {
        return Err(invalid(format!(
            "{keyword} needs a source and a destination"
        )));
    };
    if sources.is_empty() {
        return Err(invalid(format!(
            "{keyword} needs a source and a destination"
        )));
    }
    for source in sources {
        if source.contains("://") || source.starts_with("git@") {
            return Err(unsupported(&format!(
                "{keyword} from a URL ({source}); download it in a RUN step"
            )));
        }
    }
    if sources.len() > 1 && !dest.ends_with('/') {
        return Err(invalid(format!(
            "{keyword} with several sources needs a destination directory ending in /, not {dest}"
        )));
    }
    copy.sources = sources.to_vec();
    copy.dest = dest.clone();
    Ok(copy)
}

/// The exec form is a JSON array of strings; anything else is the shell form.
fn command(rest: &str) -> Result<Command, DockerfileError> {
    if rest.starts_with('[') {
        if let Ok(words) = serde_json::from_str::<Vec<String>>(rest) {
            if words.is_empty() {
                return Err(invalid(format!("{rest} is an empty command")));
            }
            return Ok(Command::Exec(words));
        }
    }
    Ok(Command::Shell(rest.to_owned()))
}

/// `ENV KEY=value KEY2="two words" PATH=/x:$PATH` or the old `ENV KEY value`
/// form; `$VAR` and `${VAR}` expand from `vars` outside single quotes.
pub(super) fn parse_env(
    rest: &str,
    vars: &BTreeMap<String, String>,
) -> Result<Vec<(String, String)>, DockerfileError> {
    let bad = || invalid(format!("cannot read ENV {rest}"));
    let Some(first) = rest.split_whitespace().next() else {
        return Err(bad());
    };
    if !first.contains('=') {
        let (key, value) = rest.split_once(char::is_whitespace).ok_or_else(bad)?;
        return Ok(vec![(key.to_owned(), expand(&unquote(value.trim()), vars))]);
    }
    let mut pairs = Vec::new();
    let mut chars = rest.chars().peekable();
    while chars.peek().is_some() {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() {
            break;
        }
        let mut value = String::new();
        let mut quote: Option<char> = None;
        while let Some(c) = chars.next() {
            match (quote, c) {
                (None, c) if c.is_whitespace() => break,
                (None, '"' | '\'') => quote = Some(c),
                (Some(q), c) if c == q => quote = None,
                (Some('\''), c) => value.push(c),
                (_, '\\') => value.extend(chars.next()),
                (_, '$') => value.push_str(&variable(&mut chars, vars)),
                _ => value.push(c),
            }
        }
        if quote.is_some() || key.contains(char::is_whitespace) {
            return Err(bad());
        }
        pairs.push((key, value));
    }
    Ok(pairs)
}

/// Expands `$VAR` and `${VAR}` (unset ones are empty), as Docker does in
/// `WORKDIR`, `USER` and `ENV`.
pub(super) fn expand(text: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'$') => out.extend(chars.next()),
            '$' => out.push_str(&variable(&mut chars, vars)),
            c => out.push(c),
        }
    }
    out
}

/// Reads a variable name after `$` and answers its value.
fn variable(
    chars: &mut std::iter::Peekable<std::str::Chars<'_>>,
    vars: &BTreeMap<String, String>,
) -> String {
    let braced = chars.peek() == Some(&'{');
    if braced {
        chars.next();
    }
    let mut name = String::new();
    while let Some(&c) = chars.peek() {
        if c.is_ascii_alphanumeric() || c == '_' {
            name.push(c);
            chars.next();
        } else {
            break;
        }
    }
    if braced && chars.peek() == Some(&'}') {
        chars.next();
    }
    if name.is_empty() {
        return "$".into();
    }
    vars.get(&name).cloned().unwrap_or_default()
}

fn unquote(value: &str) -> String {
    let value = value.trim();
    let quoted = value.len() >= 2
        && ((value.starts_with('"') && value.ends_with('"'))
            || (value.starts_with('\'') && value.ends_with('\'')));
    if quoted {
        value[1..value.len() - 1].to_owned()
    } else {
        value.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(text: &str) -> Vec<StepKind> {
        parse_dockerfile(text)
            .unwrap()
            .steps
            .into_iter()
            .map(|s| s.kind)
            .collect()
    }

    #[test]
    fn dockerfiles_cove_can_build() {
        let plan = parse_dockerfile(
            "# comment\nFROM python:3.12-slim\nENV A=1 B=\"two words\"\nRUN echo hi \\\n  > /x\nLABEL x=y\n",
        )
        .unwrap();
        assert_eq!(plan.base, "python:3.12-slim");
        assert_eq!(
            plan.steps[1],
            Step {
                text: "RUN echo hi  > /x".into(),
                kind: StepKind::Run(Command::Shell("echo hi  > /x".into())),
            }
        );
        assert_eq!(
            kinds("FROM a\nWORKDIR '/my dir'\nUSER nobody\nARG V=1\nENTRYPOINT [\"/bin/sh\", \"-c\"]\nCMD sleep 1\n"),
            [
                StepKind::Workdir("/my dir".into()),
                StepKind::User("nobody".into()),
                StepKind::Arg {
                    name: "V".into(),
                    default: Some("1".into())
                },
                StepKind::Entrypoint(Command::Exec(vec!["/bin/sh".into(), "-c".into()])),
                StepKind::Cmd(Command::Shell("sleep 1".into())),
            ]
        );
        // The SDK's run_commands(["bash", "-c", "x"]) form is a shell line.
        assert_eq!(
            kinds("FROM a\nRUN \"bash\" \"-c\" \"x\"\n"),
            [StepKind::Run(Command::Shell(
                "\"bash\" \"-c\" \"x\"".into()
            ))]
        );
        assert_eq!(
            kinds("FROM a\nRUN [\"echo\", \"a \\\"b\\\"\"]\n"),
            [StepKind::Run(Command::Exec(vec![
                "echo".into(),
                "a \"b\"".into()
            ]))]
        );
    }

    #[test]
    fn copy_and_add_read_options_and_both_forms() {
        assert_eq!(
            kinds("FROM a\nCOPY --chown=app:app --chmod=0750 --link a b /dst/\nADD [\"my file\", \"/x\"]\n"),
            [
                StepKind::Copy(Copy {
                    sources: vec!["a".into(), "b".into()],
                    dest: "/dst/".into(),
                    chown: Some("app:app".into()),
                    chmod: Some(0o750),
                    unpack_archives: false,
                }),
                StepKind::Copy(Copy {
                    sources: vec!["my file".into()],
                    dest: "/x".into(),
                    chown: None,
                    chmod: None,
                    unpack_archives: true,
                }),
            ]
        );
    }

    #[test]
    fn env_reads_both_forms_and_expands_variables() {
        let vars = BTreeMap::from([("PATH".to_owned(), "/bin".to_owned())]);
        assert_eq!(
            parse_env(
                "A=1 B=\"two words\" P=/x:$PATH Q='$PATH' R=${PATH}/y",
                &vars
            )
            .unwrap(),
            [
                ("A".to_owned(), "1".to_owned()),
                ("B".to_owned(), "two words".to_owned()),
                ("P".to_owned(), "/x:/bin".to_owned()),
                ("Q".to_owned(), "$PATH".to_owned()),
                ("R".to_owned(), "/bin/y".to_owned()),
            ]
        );
        assert_eq!(
            parse_env("C three words", &vars).unwrap(),
            [("C".to_owned(), "three words".to_owned())]
        );
        assert!(parse_env("A=\"open", &vars).is_err());
        assert_eq!(
            expand(
                "$HOME/x \\$y",
                &BTreeMap::from([("HOME".into(), "/h".into())])
            ),
            "/h/x $y"
        );
    }

    #[test]
    fn dockerfiles_cove_cannot_build_are_refused_by_name() {
        for (text, named) in [
            ("FROM a\nCOPY --from=b x /x\n", "COPY --from"),
            ("FROM a\nADD https://example.com/x /x\n", "URL"),
            ("FROM a\nCOPY --chmod=u+x x /x\n", "octal"),
            ("FROM a\nCOPY <<EOF /x\n", "here-document"),
            ("FROM a\nVOLUME /data\n", "VOLUME"),
            ("FROM a\nRUN --mount=type=cache echo\n", "RUN options"),
            ("FROM a AS b\n", "FROM a AS b"),
            ("FROM a\nFROM b\n", "multi-stage"),
        ] {
            let err = parse_dockerfile(text).unwrap_err();
            assert!(matches!(err, DockerfileError::Unsupported { .. }), "{err}");
            assert!(err.to_string().contains(named), "{err}");
        }
        for (text, said) in [
            ("ENV A=1\n", "must start with FROM"),
            ("FROM a\nFROBNICATE\n", "not a Dockerfile instruction"),
            ("FROM a\nRUN\n", "RUN needs an argument"),
            ("FROM a\nCOPY x\n", "a source and a destination"),
            ("FROM a\nCOPY x y /z\n", "ending in /"),
            ("", "no FROM"),
        ] {
            let err = parse_dockerfile(text).unwrap_err();
            assert!(matches!(err, DockerfileError::Invalid { .. }), "{err}");
            assert!(err.to_string().contains(said), "{err}");
        }
    }
}
