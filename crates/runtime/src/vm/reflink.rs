//! Copies that share blocks: `FICLONE` on the btrfs storage, so a VM's RAM
//! file and disk are copied in milliseconds whatever their size.
#![allow(unsafe_code)]

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// `_IOW(0x94, 9, int)`.
const FICLONE: libc::Ioctl = 0x4004_9409;
/// `_IOR('f', 1, long)` and `_IOW('f', 2, long)`.
const FS_IOC_GETFLAGS: libc::Ioctl = 0x8008_6601;
const FS_IOC_SETFLAGS: libc::Ioctl = 0x4008_6602;
const FS_NOCOW_FL: libc::c_long = 0x0080_0000;

/// Makes files created in `dir` from now on "no copy-on-write": written in
/// place, without data checksums. A guest's RAM file is rewritten page by
/// page all the time, and writing it back (which every clone of it waits
/// for) costs much less this way. Clones still share blocks (a shared
/// block is copied once when written), but only between files that are
/// both NOCOW, so every directory that holds VM files gets this.
pub(super) fn set_nocow(dir: &Path) -> io::Result<()> {
    let handle = File::open(dir)?;
    let mut flags: libc::c_long = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one long.
    if unsafe { libc::ioctl(handle.as_raw_fd(), FS_IOC_GETFLAGS, &mut flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & FS_NOCOW_FL != 0 {
        return Ok(());
    }
    flags |= FS_NOCOW_FL;
    // SAFETY: FS_IOC_SETFLAGS reads one long.
    if unsafe { libc::ioctl(handle.as_raw_fd(), FS_IOC_SETFLAGS, &flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `dest` (which must not exist) a copy of `source` sharing its blocks.
/// Both must be on one filesystem that supports reflinks. Pending writes to
/// `source` (a running VM's RAM file has them) are flushed by the kernel first.
pub(super) fn clone_file(source: &Path, dest: &Path) -> io::Result<()> {
    let from = File::open(source)?;
    let to = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dest)?;
    // SAFETY: FICLONE takes the source fd as its argument, on the dest fd.
    if unsafe { libc::ioctl(to.as_raw_fd(), FICLONE, from.as_raw_fd()) } != 0 {
        let error = io::Error::last_os_error();
        drop(to);
        let _ = fs::remove_file(dest);
        return Err(error);
    }
    Ok(())
}

/// Reads the data of `path` (a sparse file: holes are skipped) so that it is
/// in the page cache. A plain read: `readahead(2)` only starts the I/O, and a
/// guest faulting pages in while it runs measured slower than this.
pub(super) fn read_ahead(path: &Path) -> io::Result<()> {
    use nix::unistd::{lseek, Whence};
    use std::os::unix::fs::FileExt;
    let file = File::open(path)?;
    let fd = file.as_raw_fd();
    let len = file.metadata()?.len() as i64;
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0i64;
    while offset < len {
        let data = match lseek(fd, offset, Whence::SeekData) {
            Ok(data) => data,
            // No data after `offset`.
            Err(nix::errno::Errno::ENXIO) => break,
            Err(errno) => return Err(errno.into()),
        };
        let hole = lseek(fd, data, Whence::SeekHole).unwrap_or(len);
        let mut at = data;
        while at < hole {
            let want = ((hole - at) as usize).min(buf.len());
            let n = file.read_at(&mut buf[..want], at as u64)?;
            if n == 0 {
                break;
            }
            at += n as i64;
        }
        offset = hole;
    }
    Ok(())
}

/// Like [`clone_file`], replacing `dest` if it exists.
pub(super) fn clone_replacing(source: &Path, dest: &Path) -> io::Result<()> {
    match fs::remove_file(dest) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => return Err(error),
        _ => {}
    }
    clone_file(source, dest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_ahead_walks_a_sparse_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ram");
        let file = File::create(&path).unwrap();
        file.set_len(8 << 20).unwrap();
        std::os::unix::fs::FileExt::write_at(&file, b"data", 4 << 20).unwrap();
        read_ahead(&path).unwrap();
        File::create(dir.path().join("empty")).unwrap();
        read_ahead(&dir.path().join("empty")).unwrap();
    }

    #[test]
    fn a_failed_clone_leaves_no_file() {
        // tmpfs or ext4 under the test dir may not reflink; either way the
        // destination must not be left half-made.
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("a");
        fs::write(&source, b"data").unwrap();
        let dest = dir.path().join("b");
        match clone_file(&source, &dest) {
            Ok(()) => assert_eq!(fs::read(&dest).unwrap(), b"data"),
            Err(_) => assert!(!dest.exists()),
        }
        assert!(clone_file(&dir.path().join("missing"), &dest).is_err());
    }
}
