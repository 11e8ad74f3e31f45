//! The languages `lsp/start` serves and the server each one runs.

use std::path::PathBuf;

use super::LspError;

/// A `languageId` of the SDK (`LspLanguageId`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Language {
    Python,
    TypeScript,
    JavaScript,
}

/// What the error for an unknown `languageId` lists.
pub const KNOWN: &str = "python, typescript, javascript";

impl Language {
    pub fn parse(language_id: &str) -> Result<Self, LspError> {
        match language_id {
            "python" => Ok(Self::Python),
            "typescript" => Ok(Self::TypeScript),
            "javascript" => Ok(Self::JavaScript),
            other => Err(LspError::UnknownLanguage(other.to_owned())),
        }
    }

    pub fn id(self) -> &'static str {
        match self {
            Self::Python => "python",
            Self::TypeScript => "typescript",
            Self::JavaScript => "javascript",
        }
    }

    /// The server's program, looked up on the agent's `PATH` (the sandbox's).
    fn command(self) -> &'static str {
        match self {
            Self::Python => "pylsp",
            Self::TypeScript | Self::JavaScript => "typescript-language-server",
        }
    }

    pub fn args(self) -> &'static [&'static str] {
        match self {
            Self::Python => &[],
            Self::TypeScript | Self::JavaScript => &["--stdio"],
        }
    }

    /// Where an image gets the server, for the error that says it lacks it.
    fn install_hint(self) -> &'static str {
        match self {
            Self::Python => "Debian's python3-pylsp, or pip install python-lsp-server",
            Self::TypeScript | Self::JavaScript => {
                "npm install -g typescript-language-server typescript"
            }
        }
    }

    /// The server's program, or the error naming it and how to get it.
    pub fn program(self) -> Result<PathBuf, LspError> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        crate::execute::find_on_path(self.command(), &path).ok_or(LspError::ServerMissing {
            language: self,
            program: self.command(),
            install: self.install_hint(),
        })
    }
}

impl std::fmt::Display for Language {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.id())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sdks_language_ids_and_nothing_else() {
        for id in ["python", "typescript", "javascript"] {
            assert_eq!(Language::parse(id).unwrap().id(), id);
        }
        for id in ["Python", "rust", ""] {
            assert!(matches!(
                Language::parse(id),
                Err(LspError::UnknownLanguage(_))
            ));
        }
    }
}
