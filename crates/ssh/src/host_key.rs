//! The gateway's host key: an Ed25519 key made once and kept in the data dir,
//! so clients that trust it keep trusting the server across restarts.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use rand::RngCore as _;
use russh::keys::ssh_key::private::Ed25519Keypair;
use russh::keys::ssh_key::LineEnding;
use russh::keys::PrivateKey;

use crate::SshError;

/// Reads the host key at `path`, or makes one there (mode 0600, written to a
/// temporary file and renamed, so a crash never leaves half a key).
pub(crate) fn load_or_create(path: &Path) -> Result<PrivateKey, SshError> {
    let error = |reason: String| SshError::HostKey {
        path: path.display().to_string(),
        reason,
    };
    match std::fs::read_to_string(path) {
        Ok(text) => return PrivateKey::from_openssh(text).map_err(|e| error(e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(error(e.to_string())),
    }
    let mut seed = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut seed);
    let key = PrivateKey::from(Ed25519Keypair::from_seed(&seed));
    let text = key
        .to_openssh(LineEnding::LF)
        .map_err(|e| error(e.to_string()))?;
    let partial = path.with_extension("partial");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)
        .map_err(|e| error(format!("writing {}: {e}", partial.display())))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|e| error(format!("writing {}: {e}", partial.display())))?;
    std::fs::rename(&partial, path).map_err(|e| error(e.to_string()))?;
    tracing::info!(path = %path.display(), "made the SSH gateway's host key");
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_made_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ssh_host_ed25519_key");
        let first = load_or_create(&path).unwrap();
        let second = load_or_create(&path).unwrap();
        assert_eq!(first.public_key(), second.public_key());
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(&path, "garbage").unwrap();
        assert!(load_or_create(&path).is_err());
    }
}
