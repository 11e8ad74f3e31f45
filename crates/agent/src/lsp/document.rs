//! Files as the SDK names them and as language servers want them.
//!
//! The SDK sends `uri` as `"file://" + path` without encoding anything, and
//! documents that a relative `path` is relative to the project: so
//! `file://src/a.py` is `<project>/src/a.py`, not a file on a host named
//! `src`. Language servers get a real `file:` URI (percent-encoded) and the
//! file's text, read here: the SDK never sends text.

use std::path::{Path, PathBuf};

use super::LspError;

/// Largest file given to a language server; source files are far smaller.
pub const MAX_DOCUMENT_BYTES: u64 = 16 << 20;

/// The file `uri` names; relative paths resolve against `project`.
pub fn path_of(uri: &str, project: &Path) -> Result<PathBuf, LspError> {
    let bad = || LspError::BadUri(uri.to_owned());
    let rest = uri
        .strip_prefix("file://")
        .or_else(|| uri.strip_prefix("FILE://"))
        .ok_or_else(bad)?;
    let decoded = percent_decode(rest);
    if decoded.is_empty() || decoded.contains('\0') {
        return Err(bad());
    }
    let path = Path::new(&decoded);
    Ok(crate::config::clean(&project.join(path)))
}

/// The `file:` URI of an absolute `path`, percent-encoded as editors (and
/// the servers' own URI parsers) expect.
pub fn uri_of(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt as _;
    let mut uri = String::from("file://");
    for &byte in path.as_os_str().as_bytes() {
        if byte.is_ascii_alphanumeric() || b"/-._~!$&'()*+,;=:@".contains(&byte) {
            uri.push(byte as char);
        } else {
            uri.push_str(&format!("%{byte:02X}"));
        }
    }
    uri
}

/// `%XX` sequences decoded (as a language server given the SDK's URI would
/// decode them); anything else, a stray `%` included, kept as it is.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(high), Some(low)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((high * 16 + low) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The `languageId` of a document: by its extension where one server
/// serves several languages (a `.js` file in a TypeScript project), else the
/// server's.
pub fn language_of(path: &Path, server_language: &str) -> String {
    let by_extension = match path.extension().and_then(|e| e.to_str()) {
        Some("py" | "pyi") => "python",
        Some("ts" | "mts" | "cts") => "typescript",
        Some("tsx") => "typescriptreact",
        Some("js" | "mjs" | "cjs") => "javascript",
        Some("jsx") => "javascriptreact",
        _ => server_language,
    };
    by_extension.to_owned()
}

/// The text of the file at `path`, bounded.
pub async fn read_text(path: &Path) -> Result<String, LspError> {
    use tokio::io::AsyncReadExt as _;
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|e| LspError::Document {
            path: path.to_owned(),
            source: e,
        })?;
    let mut bytes = Vec::new();
    file.take(MAX_DOCUMENT_BYTES + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| LspError::Document {
            path: path.to_owned(),
            source: e,
        })?;
    if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
        return Err(LspError::DocumentTooLarge(path.to_owned()));
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sdk_uris_name_absolute_and_project_relative_files() {
        let project = Path::new("/home/u/proj");
        for (uri, path) in [
            ("file:///tmp/a.py", "/tmp/a.py"),
            ("file://src/a.py", "/home/u/proj/src/a.py"),
            ("file://./a.py", "/home/u/proj/a.py"),
            ("file://../other/a.py", "/home/u/other/a.py"),
            ("file:///tmp/a%20b.py", "/tmp/a b.py"),
            ("file:///tmp/100%.py", "/tmp/100%.py"),
            ("file:///tmp/x%4", "/tmp/x%4"),
        ] {
            assert_eq!(path_of(uri, project).unwrap(), PathBuf::from(path), "{uri}");
        }
        for bad in ["/tmp/a.py", "http://x/a.py", "file://", "src/a.py", ""] {
            assert!(
                matches!(path_of(bad, project), Err(LspError::BadUri(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn server_uris_are_encoded_and_round_trip() {
        let path = Path::new("/tmp/dir with space/é#?.py");
        let uri = uri_of(path);
        assert_eq!(uri, "file:///tmp/dir%20with%20space/%C3%A9%23%3F.py");
        assert_eq!(path_of(&uri, Path::new("/")).unwrap(), path);
    }

    #[test]
    fn documents_are_typed_by_extension() {
        assert_eq!(
            language_of(Path::new("/a/b.js"), "typescript"),
            "javascript"
        );
        assert_eq!(
            language_of(Path::new("/a/b.tsx"), "typescript"),
            "typescriptreact"
        );
        assert_eq!(language_of(Path::new("/a/Makefile"), "python"), "python");
    }
}
