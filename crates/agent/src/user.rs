//! The sandbox's user (an image's `USER`, `COVE_USER`): the serving process
//! drops to it before it serves, so every command, session, file operation and
//! interpreter runs as that user. PID 1 (the reaper) stays root.

use std::path::PathBuf;

use nix::errno::Errno;
use nix::unistd::{Gid, Group, Uid, User};

/// Why the sandbox's user could not be resolved or become. The kernel's
/// error is part of the message: callers print only this.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("user {name:?} is not in the image's /etc/passwd")]
    NoUser { name: String },
    #[error("group {name:?} is not in the image's /etc/group")]
    NoGroup { name: String },
    #[error("reading the image's user database: {errno}")]
    Lookup { errno: Errno },
    #[error("{step}: {errno}")]
    Become { step: String, errno: Errno },
}

fn lookup_failed(errno: Errno) -> UserError {
    UserError::Lookup { errno }
}

fn become_failed(step: impl Into<String>) -> impl FnOnce(Errno) -> UserError {
    let step = step.into();
    move |errno| UserError::Become { step, errno }
}

/// Who to become: resolved from the image's `/etc/passwd` and `/etc/group`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunAs {
    pub name: String,
    pub uid: Uid,
    pub gid: Gid,
    pub home: PathBuf,
}

/// Resolves `name`, `uid`, `name:group` or `uid:gid` as Docker's `USER` does:
/// a name must exist, a bare number need not (its home is then `/`).
pub fn lookup(spec: &str) -> Result<RunAs, UserError> {
    let (user, group) = match spec.split_once(':') {
        Some((user, group)) => (user, Some(group)),
        None => (spec, None),
    };
    let entry = match user.parse::<u32>() {
        Ok(uid) => User::from_uid(Uid::from_raw(uid)).map_err(lookup_failed)?,
        Err(_) => Some(
            User::from_name(user)
                .map_err(lookup_failed)?
                .ok_or_else(|| UserError::NoUser {
                    name: user.to_owned(),
                })?,
        ),
    };
    let (name, uid, mut gid, home) = match entry {
        Some(entry) => (entry.name, entry.uid, entry.gid, entry.dir),
        None => {
            let uid: u32 = user.parse().expect("parsed above");
            (
                uid.to_string(),
                Uid::from_raw(uid),
                Gid::from_raw(uid),
                "/".into(),
            )
        }
    };
    if let Some(group) = group {
        gid = match group.parse::<u32>() {
            Ok(gid) => Gid::from_raw(gid),
            Err(_) => {
                Group::from_name(group)
                    .map_err(lookup_failed)?
                    .ok_or_else(|| UserError::NoGroup {
                        name: group.to_owned(),
                    })?
                    .gid
            }
        };
    }
    Ok(RunAs {
        name,
        uid,
        gid,
        home,
    })
}

/// Becomes `user` for good: supplementary groups, group, then user (in that
/// order: after `setuid` the others are no longer allowed). Sets `HOME`,
/// `USER` and `LOGNAME` for every process started from now on.
pub fn become_user(user: &RunAs) -> Result<(), UserError> {
    let groups = supplementary_groups(user);
    nix::unistd::setgroups(&groups).map_err(become_failed("setgroups"))?;
    nix::unistd::setgid(user.gid).map_err(become_failed(format!("setgid {}", user.gid)))?;
    nix::unistd::setuid(user.uid).map_err(become_failed(format!("setuid {}", user.uid)))?;
    std::env::set_var("HOME", &user.home);
    std::env::set_var("USER", &user.name);
    std::env::set_var("LOGNAME", &user.name);
    Ok(())
}

/// The user's primary group and every group of `/etc/group` that lists it.
fn supplementary_groups(user: &RunAs) -> Vec<Gid> {
    let mut groups = vec![user.gid];
    if let Ok(text) = std::fs::read_to_string("/etc/group") {
        for line in text.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            if let [_, _, gid, members] = fields[..] {
                let listed = members.split(',').any(|m| m == user.name);
                if let (true, Ok(gid)) = (listed, gid.parse::<u32>()) {
                    groups.push(Gid::from_raw(gid));
                }
            }
        }
    }
    groups.sort_unstable_by_key(|g| g.as_raw());
    groups.dedup();
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_resolve_as_docker_does() {
        let root = lookup("root").unwrap();
        assert_eq!((root.uid.as_raw(), root.gid.as_raw()), (0, 0));
        let numeric = lookup("4242:77").unwrap();
        assert_eq!((numeric.uid.as_raw(), numeric.gid.as_raw()), (4242, 77));
        assert_eq!(numeric.home, PathBuf::from("/"));
        assert!(lookup("no-such-user-here")
            .unwrap_err()
            .to_string()
            .contains("/etc/passwd"));
        assert!(lookup("root:no-such-group")
            .unwrap_err()
            .to_string()
            .contains("/etc/group"));
    }
}
