//! The state directory a sandbox's agent makes for its user before it drops
//! to that user (`config::prepare_state_dir`).

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};

use cove_agent::config::prepare_state_dir;
use nix::unistd::{Gid, Uid};

#[test]
fn the_state_dir_is_its_users_alone_and_a_link_gives_nothing_away() {
    if !cove_testenv::root("giving a directory to another user") {
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let owner = Some((Uid::from_raw(4321), Gid::from_raw(4322)));

    let dir = scratch.path().join("run/cove/agent-1");
    prepare_state_dir(&dir, owner).unwrap();
    let made = std::fs::metadata(&dir).unwrap();
    assert_eq!((made.uid(), made.gid()), (4321, 4322));
    assert_eq!(made.permissions().mode() & 0o7777, 0o700);
    let parent = std::fs::metadata(dir.parent().unwrap()).unwrap();
    assert_eq!(
        (parent.uid(), parent.permissions().mode() & 0o7777),
        (0, 0o755)
    );
    // Made again (a directory named in the environment may exist): fine.
    prepare_state_dir(&dir, owner).unwrap();

    // A directory named in the environment that is a link: the link's owner
    // changes, never its target's.
    let target = scratch.path().join("target");
    std::fs::create_dir(&target).unwrap();
    let link = scratch.path().join("run/cove/agent-2");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    prepare_state_dir(&link, owner).unwrap();
    assert_eq!(std::fs::metadata(&target).unwrap().uid(), 0);
}
