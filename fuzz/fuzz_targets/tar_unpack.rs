//! Fuzz target `tar_unpack`: the agent's tar unpacking (`POST /cove/unpack`,
//! `cove_agent::unpack::unpack`) on arbitrary streams, each into a fresh
//! directory.
//!
//! The unpacker follows symbolic links wherever they lead, since in a
//! sandbox its root is the sandbox's `/`. Here it runs as root (lchown) on
//! the fuzzing machine, so every input is unpacked by one worker thread
//! jailed in a scratch directory (`unshare(CLONE_FS)` gives the thread its
//! own root, then `chroot`): whatever a stream does lands in the jail. The
//! stream is unpacked at `/r` of the jail; unless it holds a symbolic link
//! that points up or out (absolute, or with a `..`), which the unpacker
//! follows by design, nothing but `/r` may be left in the jail afterwards.
//! That is the promise a hostile `../` name, hard link or long-name trick
//! would break.
//!
//! The same stream then goes through cove-images's layer unpacking
//! (`crates/images/src/layer.rs` with its `fsat.rs` and `error.rs`, compiled from
//! their files), a separate code path that never follows a symbolic link: for
//! it nothing but `/r` may be left in the jail, whatever the stream holds.

#![no_main]

#[allow(dead_code)]
#[path = "../../crates/images/src/error.rs"]
mod error;
#[allow(dead_code)]
#[path = "../../crates/images/src/fsat.rs"]
mod fsat;
#[allow(dead_code)]
#[path = "../../crates/images/src/layer.rs"]
mod layer;

use std::path::{Component, Path};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;

/// Where the stream is unpacked, inside the jail.
const ROOT: &str = "/r";

struct Jail {
    inputs: Mutex<mpsc::Sender<Vec<u8>>>,
    done: Mutex<mpsc::Receiver<()>>,
}

fn jail() -> &'static Jail {
    static JAIL: OnceLock<Jail> = OnceLock::new();
    JAIL.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("cove-fuzz-tar-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("the jail directory");
        let (inputs, received) = mpsc::channel::<Vec<u8>>();
        let (finished, done) = mpsc::channel();
        let (ready, jailed) = mpsc::channel();
        std::thread::spawn(move || {
            let entered = nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS)
                .and_then(|()| nix::unistd::chroot(&dir))
                .and_then(|()| nix::unistd::chdir("/"));
            let entered_ok = entered.is_ok();
            ready.send(entered).expect("the fuzzer waits");
            if !entered_ok {
                return;
            }
            for data in received {
                unpack_jailed(&data);
                finished.send(()).expect("the fuzzer waits");
            }
        });
        if let Err(error) = jailed.recv().expect("the jail thread answers") {
            eprintln!(
                "tar_unpack unpacks as root inside a chroot and could not make one ({error}); \
                 run it as root"
            );
            std::process::exit(1);
        }
        Jail {
            inputs: Mutex::new(inputs),
            done: Mutex::new(done),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let jail = jail();
    jail.inputs
        .lock()
        .unwrap()
        .send(data.to_vec())
        .expect("the jail thread runs");
    // A panic in the jail thread aborts the process (libFuzzer's hook), so
    // an answer always comes or the run ends as a crash.
    jail.done
        .lock()
        .unwrap()
        .recv()
        .expect("the jail thread answers");
});

/// Runs in the jail: unpacks `data` at [`ROOT`] with each unpacker in turn,
/// checks that nothing else was written, and empties the jail after each.
fn unpack_jailed(data: &[u8]) {
    std::fs::create_dir(ROOT).expect("a fresh root");
    let _ = cove_agent::unpack::unpack(data, Path::new(ROOT), None);
    if !links_out(data) {
        assert_contained("cove-agent");
    }
    empty_jail();

    std::fs::create_dir(ROOT).expect("a fresh root");
    let _ = layer::unpack(data, Path::new(ROOT), "fuzz");
    assert_contained("cove-images");
    empty_jail();
}

fn assert_contained(unpacker: &str) {
    let stray: Vec<_> = std::fs::read_dir("/")
        .expect("the jail")
        .map(|entry| entry.expect("a jail entry").file_name())
        .filter(|name| name != "r")
        .collect();
    assert!(
        stray.is_empty(),
        "{unpacker} wrote outside the root: {stray:?}"
    );
}

fn empty_jail() {
    for entry in std::fs::read_dir("/").expect("the jail") {
        let path = entry.expect("a jail entry").path();
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        }
        .expect("emptying the jail");
    }
}

/// Whether the stream holds a symbolic link that the unpacker may follow up
/// or out of the root (read with the same tar reader it uses).
fn links_out(data: &[u8]) -> bool {
    let mut archive = tar::Archive::new(data);
    let Ok(entries) = archive.entries() else {
        return false;
    };
    for entry in entries {
        let Ok(entry) = entry else {
            return false;
        };
        if entry.header().entry_type() != tar::EntryType::Symlink {
            continue;
        }
        // An unreadable target is refused by the unpacker the same way.
        let escapes = matches!(
            entry.link_name(),
            Ok(Some(target)) if target
                .components()
                .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
        );
        if escapes {
            return true;
        }
    }
    false
}
