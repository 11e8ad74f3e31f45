//! The users an image knows: the names in its `/etc/passwd`, so a create can
//! refuse a user the image lacks with a 400 rather than a sandbox that fails
//! to start.
//!
//! The file is hostile input: a captured layer is what a sandbox wrote. It is
//! reached one component at a time without following links (`fsat`), opened
//! without blocking (a FIFO there must not hang the server), read only if it
//! is a regular file, and only up to [`PASSWD_LIMIT`] bytes.

use std::io::{self, Read as _};
use std::os::fd::AsFd as _;
use std::path::PathBuf;

use rustix::fs::{FileType, Mode, OFlags};

use crate::fsat;

/// The most of an `/etc/passwd` read; real ones are a few KiB.
pub const PASSWD_LIMIT: u64 = 1 << 20;

/// The user names of `etc/passwd` in the topmost of `roots` (topmost first,
/// as overlay layers stack) that has one. A whiteout or anything else that is
/// not a regular file hides the lower ones and yields no names.
pub fn image_users(roots: &[PathBuf]) -> io::Result<Vec<String>> {
    for root in roots {
        let root = match fsat::open_dir(root) {
            Ok(root) => root,
            // A VM's captured layer is a disk image: its passwd is the
            // one below it, as far as the host can read.
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOTDIR.raw_os_error()) => {
                continue
            }
            Err(e) => return Err(e),
        };
        let etc = match fsat::open_subdir(root.as_fd(), "etc".as_ref()) {
            Ok(etc) => etc,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(_) => return Ok(Vec::new()),
        };
        let Some(stat) = fsat::lstat_at(etc.as_fd(), "passwd".as_ref())? else {
            continue;
        };
        if fsat::file_type(&stat) != FileType::RegularFile {
            return Ok(Vec::new());
        }
        let file = rustix::fs::openat(
            etc.as_fd(),
            "passwd",
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        if FileType::from_raw_mode(rustix::fs::fstat(&file)?.st_mode) != FileType::RegularFile {
            return Ok(Vec::new());
        }
        let mut text = Vec::new();
        std::fs::File::from(file)
            .take(PASSWD_LIMIT)
            .read_to_end(&mut text)?;
        return Ok(names(&String::from_utf8_lossy(&text)));
    }
    Ok(Vec::new())
}

fn names(passwd: &str) -> Vec<String> {
    passwd
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split_once(':'))
        .map(|(name, _)| name.trim())
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn root_with_passwd(passwd: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("etc")).unwrap();
        fs::write(dir.path().join("etc/passwd"), passwd).unwrap();
        dir
    }

    #[test]
    fn the_topmost_passwd_decides() {
        let base = root_with_passwd(
            "root:x:0:0::/root:/bin/sh\n# note\ndaytona:x:1000:1000::/home/daytona:/bin/bash\n",
        );
        let upper =
            root_with_passwd("root:x:0:0::/root:/bin/sh\nalice:x:1001:1001::/home/alice:/bin/sh\n");
        let empty = tempfile::tempdir().unwrap();
        let roots = [empty.path().into(), base.path().into()];
        assert_eq!(image_users(&roots).unwrap(), ["root", "daytona"]);
        let roots = [upper.path().into(), base.path().into()];
        assert_eq!(image_users(&roots).unwrap(), ["root", "alice"]);
        // A VM's captured layer is a disk image, not a tree: the base decides.
        let disk = empty.path().join("disk.img");
        fs::write(&disk, b"not a tree").unwrap();
        let roots = [disk, base.path().into()];
        assert_eq!(image_users(&roots).unwrap(), ["root", "daytona"]);
    }

    #[test]
    fn a_passwd_that_is_no_regular_file_is_not_followed() {
        let outside = root_with_passwd("secret:x:0:0::/:/bin/sh\n");
        let linked = tempfile::tempdir().unwrap();
        fs::create_dir(linked.path().join("etc")).unwrap();
        std::os::unix::fs::symlink(
            outside.path().join("etc/passwd"),
            linked.path().join("etc/passwd"),
        )
        .unwrap();
        assert!(image_users(&[linked.path().into()]).unwrap().is_empty());

        let linked_etc = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path().join("etc"), linked_etc.path().join("etc"))
            .unwrap();
        assert!(image_users(&[linked_etc.path().into()]).unwrap().is_empty());

        let fifo = tempfile::tempdir().unwrap();
        fs::create_dir(fifo.path().join("etc")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            fifo.path().join("etc/passwd"),
            FileType::Fifo,
            Mode::RWXU,
            0,
        )
        .unwrap();
        assert!(image_users(&[fifo.path().into()]).unwrap().is_empty());
    }
}
