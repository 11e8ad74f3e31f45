//! Which program runs a language's code, found on the `PATH` the code will
//! run with. A language whose program the image lacks is the caller's answer
//! (`ApiError::RuntimeMissing`), never a failed run.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use crate::error::ApiError;
use crate::execute::find_on_path;

/// Starts the Python prelude (`prelude.py`, written as `cove_code_run.py` into
/// the run's directory) from the directory named in `COVE_CODE_RUN_DIR`,
/// which it removes from the environment before the user's code runs. With
/// `-c`, `sys.path[0]` is the working directory, as for any snippet.
const PYTHON_BOOTSTRAP: &str = "import os, sys\n\
    run_dir = os.environ.pop('COVE_CODE_RUN_DIR')\n\
    sys.path.insert(0, run_dir)\n\
    import cove_code_run\n\
    del sys.path[0]\n\
    cove_code_run.main(run_dir)\n";

/// Node.js versions from which `--experimental-strip-types` runs TypeScript.
const STRIP_TYPES_SINCE: (u32, u32) = (22, 6);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    Python,
    JavaScript,
    TypeScript,
}

impl Language {
    /// The SDK's names (`code-toolbox-language`).
    pub fn parse(name: &str) -> Result<Self, ApiError> {
        match name.to_ascii_lowercase().as_str() {
            "python" => Ok(Self::Python),
            "javascript" => Ok(Self::JavaScript),
            "typescript" => Ok(Self::TypeScript),
            _ => Err(ApiError::BadRequest(format!(
                "unsupported language {name:?}: use python, javascript or typescript"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Python => "python",
            Self::JavaScript => "javascript",
            Self::TypeScript => "typescript",
        }
    }

    /// The file the user's code is written to in the run's directory.
    pub fn code_file(self) -> &'static str {
        match self {
            Self::Python => "code.py",
            Self::JavaScript => "code.js",
            Self::TypeScript => "code.ts",
        }
    }
}

/// A program and the arguments before the user's `argv`.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Invocation {
    pub(super) program: PathBuf,
    pub(super) args: Vec<OsString>,
}

/// How to run `language` code from `code_file`, looking programs up in `path`.
pub(super) fn invocation(
    language: Language,
    code_file: &Path,
    path: &OsStr,
) -> Result<Invocation, ApiError> {
    let missing = |wanted: &str| ApiError::RuntimeMissing {
        language: language.name(),
        wanted: wanted.to_owned(),
    };
    match language {
        Language::Python => {
            let program = find_on_path("python3", path)
                .or_else(|| find_on_path("python", path))
                .ok_or_else(|| missing("python3"))?;
            Ok(Invocation {
                program,
                args: vec!["-c".into(), PYTHON_BOOTSTRAP.into()],
            })
        }
        Language::JavaScript => Ok(Invocation {
            program: find_on_path("node", path).ok_or_else(|| missing("node"))?,
            args: vec![code_file.into()],
        }),
        Language::TypeScript => {
            for runner in ["tsx", "ts-node"] {
                if let Some(program) = find_on_path(runner, path) {
                    return Ok(Invocation {
                        program,
                        args: vec![code_file.into()],
                    });
                }
            }
            let wanted = "tsx, ts-node or node 22.6 or later";
            let Some(node) = find_on_path("node", path) else {
                return Err(missing(wanted));
            };
            let version = node_version(&node);
            if version.is_none_or(|v| v < STRIP_TYPES_SINCE) {
                let found = version.map_or("an unknown version".to_owned(), |(major, minor)| {
                    format!("{major}.{minor}")
                });
                return Err(missing(&format!("{wanted} (node is {found})")));
            }
            Ok(Invocation {
                program: node,
                args: vec![
                    "--experimental-strip-types".into(),
                    "--disable-warning=ExperimentalWarning".into(),
                    code_file.into(),
                ],
            })
        }
    }
}

/// `node --version` as (major, minor).
fn node_version(node: &Path) -> Option<(u32, u32)> {
    let output = std::process::Command::new(node)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    parse_node_version(&String::from_utf8_lossy(&output.stdout))
}

fn parse_node_version(text: &str) -> Option<(u32, u32)> {
    let mut parts = text.trim().trim_start_matches('v').split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn executable(dir: &Path, name: &str, script: &str) {
        use std::os::unix::fs::PermissionsExt as _;
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn languages_are_the_sdks_names() {
        assert_eq!(Language::parse("python").unwrap(), Language::Python);
        assert_eq!(Language::parse("TypeScript").unwrap(), Language::TypeScript);
        let error = Language::parse("ruby").unwrap_err();
        assert_eq!(error.status(), 400);
        assert!(error.to_string().contains("ruby"), "{error}");
    }

    #[test]
    fn a_missing_runtime_is_named() {
        let empty = tempfile::tempdir().unwrap();
        let path = empty.path().as_os_str();
        let file = Path::new("/run/code.js");
        for (language, wanted) in [
            (Language::Python, "python3"),
            (Language::JavaScript, "node"),
            (Language::TypeScript, "tsx, ts-node or node 22.6 or later"),
        ] {
            let error = invocation(language, file, path).unwrap_err();
            assert_eq!(error.status(), 422, "{error}");
            assert!(error.to_string().contains(wanted), "{error}");
            assert!(error.to_string().contains(language.name()), "{error}");
        }
    }

    #[test]
    fn typescript_prefers_tsx_then_ts_node_then_a_recent_node() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().as_os_str();
        let file = Path::new("/run/code.ts");
        executable(dir.path(), "node", "echo v20.11.1");
        let old = invocation(Language::TypeScript, file, path).unwrap_err();
        assert!(old.to_string().contains("node is 20.11"), "{old}");
        executable(dir.path(), "node", "echo v22.6.0");
        let strip = invocation(Language::TypeScript, file, path).unwrap();
        assert!(strip.program.ends_with("node"));
        assert_eq!(strip.args[0], "--experimental-strip-types");
        assert_eq!(strip.args.last().unwrap(), file.as_os_str());
        executable(dir.path(), "ts-node", "");
        assert!(invocation(Language::TypeScript, file, path)
            .unwrap()
            .program
            .ends_with("ts-node"));
        executable(dir.path(), "tsx", "");
        let tsx = invocation(Language::TypeScript, file, path).unwrap();
        assert!(tsx.program.ends_with("tsx"));
        assert_eq!(tsx.args, vec![file.as_os_str().to_owned()]);
    }

    #[test]
    fn node_versions_parse() {
        assert_eq!(parse_node_version("v22.6.0\n"), Some((22, 6)));
        assert_eq!(parse_node_version("v23.10.1"), Some((23, 10)));
        assert_eq!(parse_node_version("garbage"), None);
    }
}
