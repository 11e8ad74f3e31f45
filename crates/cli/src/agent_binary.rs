//! Finding the static agent binary that goes into every sandbox.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

const MUSL_DIR: &str = "x86_64-unknown-linux-musl";

/// Whether an ELF file asks for a dynamic loader (has a PT_INTERP header).
fn is_dynamic(path: &Path) -> anyhow::Result<bool> {
    let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let header = |at: usize, len: usize| bytes.get(at..at + len).context("truncated ELF header");
    if header(0, 4)? != b"\x7fELF" || header(4, 1)? != [2] {
        bail!("{} is not a 64-bit ELF binary", path.display());
    }
    let phoff = u64::from_le_bytes(header(0x20, 8)?.try_into()?) as usize;
    let phentsize = u16::from_le_bytes(header(0x36, 2)?.try_into()?) as usize;
    let phnum = u16::from_le_bytes(header(0x38, 2)?.try_into()?) as usize;
    for i in 0..phnum {
        let p_type = u32::from_le_bytes(header(phoff + i * phentsize, 4)?.try_into()?);
        if p_type == 3 {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The agent given explicitly, or the one built beside this binary by `cargo agent`.
pub(crate) fn locate(explicit: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let candidates: Vec<PathBuf> = match explicit {
        Some(path) => vec![path],
        None => {
            let exe = std::env::current_exe().context("locate the cove binary")?;
            let dir = exe
                .parent()
                .context("the cove binary has no directory")?
                .to_owned();
            let target = dir
                .parent()
                .map(Path::to_owned)
                .unwrap_or_else(|| dir.clone());
            vec![
                dir.join("cove-agent"),
                target.join(MUSL_DIR).join("release").join("cove-agent"),
                target.join(MUSL_DIR).join("debug").join("cove-agent"),
            ]
        }
    };
    for candidate in &candidates {
        if candidate.is_file() {
            if is_dynamic(candidate)? {
                if candidates.len() == 1 {
                    bail!(
                        "{} is dynamically linked; the agent must be static (cargo agent)",
                        candidate.display()
                    );
                }
                continue;
            }
            return Ok(candidate.clone());
        }
    }
    bail!(
        "no static cove-agent found (looked at {}); build it with `cargo agent` or pass --agent-bin",
        candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_test_binary_is_dynamic() {
        let exe = std::env::current_exe().unwrap();
        assert!(is_dynamic(&exe).unwrap());
    }

    #[test]
    fn garbage_is_not_elf() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), b"#!/bin/sh\n").unwrap();
        assert!(is_dynamic(file.path()).is_err());
    }
}
