//! The guest's side of a VM sandbox's volumes: each is a virtio-fs device
//! (served on the host by a virtiofsd of the volume's directory), mounted at
//! the path the sandbox asked for. Mounted at every boot: a VM with volumes
//! never continues from saved memory (QEMU cannot save a virtio-fs device).

use std::io;
use std::path::Path;

/// What the host sends in the identity call's `volumes` (the contract is
/// cove-protocol's).
pub use cove_protocol::GuestVolume;
use nix::mount::{mount, MsFlags};

/// Mounts each volume that is not mounted yet.
pub fn mount_all(volumes: &[GuestVolume]) -> io::Result<()> {
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")?;
    for volume in volumes {
        if !volume.path.is_absolute() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("volume path {} is not absolute", volume.path.display()),
            ));
        }
        if is_mounted(&mounted, &volume.path) {
            continue;
        }
        std::fs::create_dir_all(&volume.path).map_err(|e| {
            io::Error::new(e.kind(), format!("create {}: {e}", volume.path.display()))
        })?;
        mount(
            Some(volume.tag.as_str()),
            &volume.path,
            Some("virtiofs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            None::<&str>,
        )
        .map_err(|e| {
            io::Error::other(format!(
                "mount volume {} at {}: {e}",
                volume.tag,
                volume.path.display()
            ))
        })?;
    }
    Ok(())
}

/// Whether a virtio-fs filesystem is mounted at `path`, from a mountinfo text.
fn is_mounted(mountinfo: &str, path: &Path) -> bool {
    let Some(path) = path.to_str() else {
        return false;
    };
    mountinfo.lines().any(|line| {
        let mut fields = line.split(' ');
        let point = fields.nth(4);
        // After the optional fields, "-" is followed by the filesystem type.
        let fstype = line.split(" - ").nth(1).and_then(|t| t.split(' ').next());
        point == Some(path) && fstype == Some("virtiofs")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_virtiofs_mount_by_its_point() {
        let info = "36 25 0:32 / /data rw,relatime shared:1 - virtiofs cove-vol0 rw\n\
                    37 25 0:33 / /other rw,relatime - ext4 /dev/vda rw\n";
        assert!(is_mounted(info, Path::new("/data")));
        assert!(!is_mounted(info, Path::new("/other")));
        assert!(!is_mounted(info, Path::new("/missing")));
    }
}
