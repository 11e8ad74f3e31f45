//! Which images under a runner's images directory runners fetched, and which
//! runners still use each, so a runner can delete the images its control
//! plane no longer places anything of on it.
//!
//! An images directory may be shared: by the control plane on the same host
//! (whose own images a runner never fetches, since it finds them there), and
//! by other runners (the default directory is the same for all). So a runner
//! deletes only an image some runner fetched, and only once no runner marks
//! it as used. All of it lives under `.runners/` in the images directory:
//!
//! - `fetched/{key}`: a runner fetched the image (the file holds its path);
//! - `users/{key}/{runner}`: that runner has sandboxes placed on it of the
//!   image (or had, until its next sweep);
//! - `locks/{key}`: a use is marked under a shared lock, and an image is
//!   judged unused and moved aside under an exclusive one, so a runner that
//!   marks its use just then either keeps the image or finds it gone (and
//!   fetches it again), never loses it from under a sandbox.
//!
//! `{key}` is the SHA-256 of the image's path (a path may be long, and
//! holds slashes); `{runner}` that of the runner's token.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

const RUNNERS: &str = ".runners";

/// The record under one images directory, as one runner sees it.
pub(crate) struct ImageUsers {
    images: PathBuf,
    /// This runner, as `users/{key}/` names it.
    me: String,
}

impl ImageUsers {
    /// The record under `images` for the runner whose token is `token`.
    pub(crate) fn new(images: &Path, token: &str) -> ImageUsers {
        ImageUsers {
            images: images.to_owned(),
            me: cove_engine::hash_api_key(token),
        }
    }

    fn dir(&self, part: &str) -> PathBuf {
        self.images.join(RUNNERS).join(part)
    }

    /// Marks `image` (a plain path under the images directory) as used by
    /// this runner; call before using it.
    pub(crate) fn mark_used(&self, image: &str) -> io::Result<()> {
        let key = key_of(image);
        let _shared = self.lock(&key, nix::fcntl::FlockArg::LockShared)?;
        let users = self.dir("users").join(&key);
        fs::create_dir_all(&users)?;
        fs::write(users.join(&self.me), b"")
    }

    /// Records that this runner fetched `image`, so that a sweep may delete
    /// it once no runner uses it.
    pub(crate) fn mark_fetched(&self, image: &str) -> io::Result<()> {
        let fetched = self.dir("fetched");
        fs::create_dir_all(&fetched)?;
        fs::write(fetched.join(key_of(image)), image)
    }

    /// Deletes every fetched image that neither `keep` (what this runner's
    /// control plane still places on it) nor any other runner uses: its
    /// own mark goes from each image not in `keep`, and each in `keep` is
    /// marked. Moved aside under `aside` (on the same filesystem) before it
    /// is deleted. Answers the images deleted. Call while this runner
    /// uses no image (before it serves).
    pub(crate) fn sweep(&self, keep: &HashSet<String>, aside: &Path) -> io::Result<Vec<String>> {
        let mut deleted = Vec::new();
        for image in keep {
            self.mark_used(image)?;
        }
        let entries = match fs::read_dir(self.dir("fetched")) {
            Ok(entries) => entries,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(deleted),
            Err(error) => return Err(error),
        };
        for entry in entries {
            let record = entry?.path();
            let Some(image) = fs::read_to_string(&record).ok().filter(|image| {
                cove_engine::remote::plain_image(image).is_some()
                    && !crate::runner_service::through_a_link(&self.images, image)
                    && record.file_name().and_then(|n| n.to_str()) == Some(&key_of(image))
            }) else {
                continue;
            };
            if keep.contains(&image) {
                continue;
            }
            let key = key_of(&image);
            let users = self.dir("users").join(&key);
            match fs::remove_file(users.join(&self.me)) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => return Err(error),
                _ => {}
            }
            let _alone = self.lock(&key, nix::fcntl::FlockArg::LockExclusive)?;
            let used = fs::read_dir(&users).is_ok_and(|mut users| users.next().is_some());
            if used {
                continue;
            }
            let rootfs = self.images.join(&image);
            fs::create_dir_all(aside)?;
            let moved = aside.join(format!(
                "{}-unused-{}",
                std::process::id(),
                uuid::Uuid::new_v4().simple()
            ));
            match fs::rename(&rootfs, &moved) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => return Err(error),
            }
            let _ = fs::remove_dir(&users);
            fs::remove_file(&record)?;
            drop(_alone);
            if moved.exists() {
                fs::remove_dir_all(&moved)?;
            }
            deleted.push(image);
        }
        Ok(deleted)
    }

    /// Holds `locks/{key}` as `how` while the answer lives.
    fn lock(
        &self,
        key: &str,
        how: nix::fcntl::FlockArg,
    ) -> io::Result<nix::fcntl::Flock<fs::File>> {
        let locks = self.dir("locks");
        fs::create_dir_all(&locks)?;
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(locks.join(key))?;
        nix::fcntl::Flock::lock(file, how).map_err(|(_, errno)| io::Error::from(errno))
    }
}

/// The name an image's records go by.
fn key_of(image: &str) -> String {
    cove_engine::hash_api_key(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(images: &Path, path: &str) {
        fs::create_dir_all(images.join(path).join("etc")).unwrap();
        fs::write(
            images.join(path).join("etc/passwd"),
            "root:x:0:0::/:/bin/sh\n",
        )
        .unwrap();
    }

    fn keep(images: &[&str]) -> HashSet<String> {
        images.iter().map(|image| image.to_string()).collect()
    }

    #[test]
    fn a_fetched_image_goes_once_no_runner_uses_it_and_an_image_never_fetched_stays() {
        let dir = tempfile::tempdir().unwrap();
        let (images, aside) = (
            dir.path().join("images"),
            dir.path().join("images/.incoming"),
        );
        // The control plane's own image, which both runners also use.
        image(&images, "debian-bookworm/rootfs");
        image(&images, "pulled/one/rootfs");
        let (a, b) = (
            ImageUsers::new(&images, "token-a"),
            ImageUsers::new(&images, "token-b"),
        );
        for runner in [&a, &b] {
            runner.mark_used("debian-bookworm/rootfs").unwrap();
            runner.mark_used("pulled/one/rootfs").unwrap();
        }
        a.mark_fetched("pulled/one/rootfs").unwrap();

        // Runner a needs neither any more; runner b still uses the fetched one.
        assert_eq!(a.sweep(&keep(&[]), &aside).unwrap(), Vec::<String>::new());
        assert!(images.join("pulled/one/rootfs/etc/passwd").is_file());
        // Once b needs it no more either, it goes; the never-fetched one stays.
        assert_eq!(
            b.sweep(&keep(&[]), &aside).unwrap(),
            vec!["pulled/one/rootfs".to_owned()]
        );
        assert!(!images.join("pulled/one/rootfs").exists());
        assert!(images.join("debian-bookworm/rootfs/etc/passwd").is_file());
        assert_eq!(fs::read_dir(&aside).unwrap().count(), 0);
        // Its records went with it: fetched again, it is swept again.
        assert_eq!(fs::read_dir(a.dir("fetched")).unwrap().count(), 0);
    }

    #[test]
    fn an_image_its_control_plane_still_places_here_stays_and_is_marked() {
        let dir = tempfile::tempdir().unwrap();
        let (images, aside) = (
            dir.path().join("images"),
            dir.path().join("images/.incoming"),
        );
        image(&images, "pulled/two/rootfs");
        let (a, b) = (
            ImageUsers::new(&images, "token-a"),
            ImageUsers::new(&images, "token-b"),
        );
        a.mark_fetched("pulled/two/rootfs").unwrap();
        // Runner a keeps it (and so marks it, though it had not yet): b's
        // sweep, needing it no more, leaves it.
        assert!(a
            .sweep(&keep(&["pulled/two/rootfs"]), &aside)
            .unwrap()
            .is_empty());
        assert!(b.sweep(&keep(&[]), &aside).unwrap().is_empty());
        assert!(images.join("pulled/two/rootfs/etc/passwd").is_file());
    }

    #[test]
    fn a_record_that_names_another_image_than_its_key_is_passed_over() {
        let dir = tempfile::tempdir().unwrap();
        let (images, aside) = (
            dir.path().join("images"),
            dir.path().join("images/.incoming"),
        );
        image(&images, "debian-bookworm/rootfs");
        let a = ImageUsers::new(&images, "token-a");
        a.mark_fetched("pulled/three/rootfs").unwrap();
        // A record rewritten to name the control plane's image, or a path
        // that leaves the directory, deletes nothing.
        let record = a.dir("fetched").join(key_of("pulled/three/rootfs"));
        for forged in ["debian-bookworm/rootfs", "../../etc"] {
            fs::write(&record, forged).unwrap();
            assert!(a.sweep(&keep(&[]), &aside).unwrap().is_empty());
        }
        assert!(images.join("debian-bookworm/rootfs/etc/passwd").is_file());
    }
}
