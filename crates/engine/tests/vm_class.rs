//! The rules of classes that keep memory (VMs), driven against the fake runtime:
//! pause and resume, cold start, memory snapshots, forks and their tree, spot
//! reclaim, and the persistent rule.

use std::collections::HashMap;
use std::sync::Arc;

use cove_engine::{CreateSandbox, Engine, EngineConfig, EngineError, SandboxState, SnapshotRecord};
use cove_lifecycle::SandboxClass;
use cove_runtime::fake::FakeRuntime;
use cove_runtime::Runtime;
use cove_store::Store;

struct Harness {
    engine: Engine,
    fake: Arc<FakeRuntime>,
    _dir: tempfile::TempDir,
}

async fn harness() -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let fake = Arc::new(FakeRuntime::new());
    let runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> = HashMap::from([
        (SandboxClass::Container, fake.clone() as Arc<dyn Runtime>),
        (SandboxClass::LinuxVm, fake.clone() as Arc<dyn Runtime>),
    ]);
    let engine = Engine::new(EngineConfig::default(), store, runtimes);
    for (name, class) in [
        ("cove-default", SandboxClass::Container),
        ("daytona-vm-small", SandboxClass::LinuxVm),
    ] {
        engine
            .snapshots()
            .register(&SnapshotRecord::for_image(name, "/rootfs", class, 0))
            .await
            .unwrap();
    }
    Harness {
        engine,
        fake,
        _dir: dir,
    }
}

fn vm(name: &str) -> CreateSandbox {
    CreateSandbox {
        name: Some(name.into()),
        snapshot: Some("daytona-vm-small".into()),
        ..CreateSandbox::default()
    }
}

fn calls_for(fake: &FakeRuntime, id: &str) -> Vec<String> {
    fake.calls()
        .into_iter()
        .filter(|c| c.ends_with(id))
        .map(|c| c.split(' ').next().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn vm_defaults_to_auto_pause_and_is_persistent() {
    let h = harness().await;
    let s = h.engine.sandboxes().create(vm("v")).await.unwrap();
    assert_eq!(s.class, SandboxClass::LinuxVm);
    assert!(s.persistent);
    assert_eq!((s.timers.auto_pause, s.timers.auto_stop), (60, 0));

    // Both timers set is refused, and so is auto-pause on an ephemeral sandbox.
    let both = CreateSandbox {
        auto_pause: Some(5),
        auto_stop: Some(5),
        ..vm("both")
    };
    assert!(matches!(
        h.engine.sandboxes().create(both).await,
        Err(EngineError::Timers(_))
    ));
    let ephemeral = CreateSandbox {
        auto_pause: Some(5),
        auto_delete: Some(0),
        ..vm("eph")
    };
    let err = h.engine.sandboxes().create(ephemeral).await.unwrap_err();
    assert!(err.to_string().contains("cannot pause"), "{err}");
    // An ephemeral VM is not persistent and falls back to auto-stop.
    let eph = CreateSandbox {
        auto_delete: Some(0),
        ..vm("eph2")
    };
    let eph = h.engine.sandboxes().create(eph).await.unwrap();
    assert!(!eph.persistent);
    assert_eq!((eph.timers.auto_pause, eph.timers.auto_stop), (0, 15));
}

#[tokio::test]
async fn pause_then_start_resumes_from_memory() {
    let h = harness().await;
    let s = h.engine.sandboxes().create(vm("p")).await.unwrap();
    let paused = h.engine.sandboxes().pause(&s.id).await.unwrap();
    assert_eq!(paused.state, SandboxState::Paused);
    assert!(!h.fake.is_running(&sid(&s.id)).await);
    // Pausing a paused sandbox is a no-op.
    assert_eq!(
        h.engine.sandboxes().pause(&s.id).await.unwrap().state,
        SandboxState::Paused
    );
    // A toolbox call on a paused sandbox is refused (409), not sent anywhere.
    assert!(matches!(
        h.engine.sandboxes().toolbox(&s.id).await,
        Err(EngineError::NotStarted { .. })
    ));
    // A snapshot of a paused sandbox: resume first.
    let err = h
        .engine
        .sandboxes()
        .snapshot(&s.id, "snap", false)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("resume it first"), "{err}");

    let started = h.engine.sandboxes().start(&s.id).await.unwrap();
    assert_eq!(started.state, SandboxState::Started);
    // The machine continued from its memory: no stop (which would drop it) in between.
    assert_eq!(
        calls_for(&h.fake, &s.id),
        ["prepare", "start", "pause", "resume"]
    );
}

#[tokio::test]
async fn cold_start_discards_memory() {
    let h = harness().await;
    let s = h.engine.sandboxes().create(vm("c")).await.unwrap();
    h.engine.sandboxes().pause(&s.id).await.unwrap();
    let started = h.engine.sandboxes().cold_start(&s.id).await.unwrap();
    assert_eq!(started.state, SandboxState::Started);
    let calls = calls_for(&h.fake, &s.id);
    assert_eq!(
        &calls[2..],
        ["pause", "stop", "discard-memory", "start"],
        "{calls:?}"
    );
}

#[tokio::test]
async fn pause_needs_persistent_and_a_pausable_class() {
    let h = harness().await;
    let eph = h
        .engine
        .sandboxes()
        .create(CreateSandbox {
            auto_delete: Some(0),
            ..vm("e")
        })
        .await
        .unwrap();
    let err = h.engine.sandboxes().pause(&eph.id).await.unwrap_err();
    assert!(matches!(err, EngineError::NotPersistent { .. }), "{err}");
    assert_eq!(err.kind(), cove_engine::ErrorKind::Conflict);

    let not_persistent = CreateSandbox {
        persistent: Some(false),
        ..vm("np")
    };
    let np = h.engine.sandboxes().create(not_persistent).await.unwrap();
    assert!(matches!(
        h.engine.sandboxes().pause(&np.id).await,
        Err(EngineError::NotPersistent { .. })
    ));

    let container = h
        .engine
        .sandboxes()
        .create(CreateSandbox {
            name: Some("ct".into()),
            ..CreateSandbox::default()
        })
        .await
        .unwrap();
    let err = h.engine.sandboxes().pause(&container.id).await.unwrap_err();
    assert!(err.to_string().contains("do not support pause"), "{err}");
}

#[tokio::test]
async fn memory_snapshot_records_memory_and_needs_a_started_vm() {
    let h = harness().await;
    let s = h.engine.sandboxes().create(vm("m")).await.unwrap();
    h.engine
        .sandboxes()
        .snapshot(&s.id, "warm", true)
        .await
        .unwrap();
    let snap = h.engine.snapshots().get("warm").await.unwrap();
    assert!(snap.has_memory);
    assert_eq!(snap.class, SandboxClass::LinuxVm);
    assert!(h
        .fake
        .calls()
        .iter()
        .any(|c| c.starts_with("capture-memory")));
    // A sandbox made from it is a VM too.
    let child = h
        .engine
        .sandboxes()
        .create(CreateSandbox {
            name: Some("from-warm".into()),
            snapshot: Some("warm".into()),
            ..CreateSandbox::default()
        })
        .await
        .unwrap();
    assert_eq!(child.class, SandboxClass::LinuxVm);

    h.engine.sandboxes().stop(&s.id).await.unwrap();
    let err = h
        .engine
        .sandboxes()
        .snapshot(&s.id, "cold", true)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("needs a started sandbox"), "{err}");
}

#[tokio::test]
async fn fork_makes_an_independent_child_and_a_tree() {
    let h = harness().await;
    let parent = h.engine.sandboxes().create(vm("parent")).await.unwrap();
    let child = h
        .engine
        .sandboxes()
        .fork(&parent.id, Some("child"))
        .await
        .unwrap();
    assert_eq!(child.state, SandboxState::Started);
    assert_eq!(child.parent_id.as_deref(), Some(parent.id.as_str()));
    assert_eq!(child.name, "child");
    assert_ne!(child.id, parent.id);
    // The child continued from the copied memory; the parent runs on.
    assert_eq!(calls_for(&h.fake, &child.id), ["fork-many", "resume"]);
    assert_eq!(
        h.engine.sandboxes().get(&parent.id).await.unwrap().state,
        SandboxState::Started
    );
    assert!(h.fake.is_running(&sid(&parent.id)).await);

    let grandchild = h
        .engine
        .sandboxes()
        .fork(&sid("child"), None)
        .await
        .unwrap();
    assert_eq!(grandchild.name, grandchild.id);
    let ancestors: Vec<String> = h
        .engine
        .sandboxes()
        .fork_ancestors(&grandchild.id)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(ancestors, ["child", "parent"]);
    assert_eq!(
        h.engine
            .sandboxes()
            .fork_parent(&grandchild.id)
            .await
            .unwrap()
            .id,
        child.id
    );
    let forks: Vec<String> = h
        .engine
        .sandboxes()
        .forks(&parent.id)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(forks, ["child"]);
    assert!(h.engine.sandboxes().fork_parent(&parent.id).await.is_err());

    // A parent with children cannot be deleted; once they are gone it can.
    let err = h.engine.sandboxes().delete(&parent.id).await.unwrap_err();
    assert!(matches!(err, EngineError::HasForks { .. }), "{err}");
    assert!(err.to_string().contains("child"), "{err}");
    h.engine.sandboxes().delete(&grandchild.id).await.unwrap();
    h.engine.sandboxes().delete(&child.id).await.unwrap();
    h.engine.sandboxes().delete(&parent.id).await.unwrap();
    assert!(h.fake.machines().is_empty());

    // Taken names and stopped parents are refused, leaving nothing behind.
    let a = h.engine.sandboxes().create(vm("a")).await.unwrap();
    assert!(matches!(
        h.engine.sandboxes().fork(&a.id, Some("a")).await,
        Err(EngineError::NameTaken { .. })
    ));
    h.engine.sandboxes().stop(&a.id).await.unwrap();
    assert!(matches!(
        h.engine.sandboxes().fork(&a.id, Some("b")).await,
        Err(EngineError::Transition { .. })
    ));
    assert_eq!(h.engine.sandboxes().list().await.unwrap().len(), 1);
}

#[tokio::test]
async fn containers_cannot_fork() {
    let h = harness().await;
    let c = h
        .engine
        .sandboxes()
        .create(CreateSandbox {
            name: Some("c".into()),
            ..CreateSandbox::default()
        })
        .await
        .unwrap();
    let err = h
        .engine
        .sandboxes()
        .fork(&c.id, Some("f"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("do not support fork"), "{err}");
    assert_eq!(h.engine.sandboxes().list().await.unwrap().len(), 1);
}

#[tokio::test]
async fn spot_sandboxes_are_paused_or_deleted_on_reclaim() {
    let h = harness().await;
    let keep = h
        .engine
        .sandboxes()
        .create(CreateSandbox {
            spot: true,
            ..vm("spot-vm")
        })
        .await
        .unwrap();
    let gone = h
        .engine
        .sandboxes()
        .create(CreateSandbox {
            spot: true,
            name: Some("spot-ct".into()),
            ..CreateSandbox::default()
        })
        .await
        .unwrap();
    let other = h.engine.sandboxes().create(vm("not-spot")).await.unwrap();
    let mut reclaimed = h.engine.sandboxes().reclaim_spot().await.unwrap();
    reclaimed.sort();
    let mut expected = vec![(keep.id.clone(), "paused"), (gone.id.clone(), "deleted")];
    expected.sort();
    assert_eq!(reclaimed, expected);
    assert_eq!(
        h.engine.sandboxes().get(&keep.id).await.unwrap().state,
        SandboxState::Paused
    );
    assert!(h.engine.sandboxes().get(&gone.id).await.is_err());
    assert_eq!(
        h.engine.sandboxes().get(&other.id).await.unwrap().state,
        SandboxState::Started
    );
}

#[tokio::test]
async fn auto_pause_timer_pauses_an_idle_vm() {
    let h = harness().await;
    let s = h
        .engine
        .sandboxes()
        .create(CreateSandbox {
            auto_pause: Some(1),
            ..vm("idle")
        })
        .await
        .unwrap();
    let later = cove_engine::now_ms() + 2 * cove_lifecycle::MINUTE_MS;
    let fired = h.engine.sandboxes().check_timers(later).await.unwrap();
    assert_eq!(fired, [(s.id.clone(), "auto-pause")]);
    assert_eq!(
        h.engine.sandboxes().get(&s.id).await.unwrap().state,
        SandboxState::Paused
    );
}

#[tokio::test]
async fn a_class_without_a_runtime_is_refused_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let fake = Arc::new(FakeRuntime::new());
    let runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> =
        HashMap::from([(SandboxClass::Container, fake.clone() as Arc<dyn Runtime>)]);
    let engine = Engine::new(EngineConfig::default(), store, runtimes);
    engine
        .snapshots()
        .register(&SnapshotRecord::for_image(
            "daytona-vm-small",
            "/rootfs",
            SandboxClass::LinuxVm,
            0,
        ))
        .await
        .unwrap();
    let err = engine.sandboxes().create(vm("v")).await.unwrap_err();
    assert_eq!(err.kind(), cove_engine::ErrorKind::NotImplemented, "{err}");
    assert!(err.to_string().contains("linux-vm"), "{err}");
    assert!(engine.sandboxes().list().await.unwrap().is_empty());
    assert!(fake.machines().is_empty());
}

#[tokio::test]
async fn a_failed_fork_leaves_no_child_and_the_parent_running() {
    let h = harness().await;
    let parent = h.engine.sandboxes().create(vm("parent")).await.unwrap();
    h.fake.fail_start(Some("no luck"));
    let err = h
        .engine
        .sandboxes()
        .fork(&parent.id, Some("child"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no luck"), "{err}");
    // The saga undid the child: no row, no machine; the parent runs on.
    let left: Vec<String> = h
        .engine
        .sandboxes()
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(left, ["parent"]);
    assert_eq!(h.fake.machines(), vec![parent.id.clone()]);
    assert_eq!(
        h.engine.sandboxes().get(&parent.id).await.unwrap().state,
        SandboxState::Started
    );
    // The name is free again.
    h.fake.fail_start(None);
    h.engine
        .sandboxes()
        .fork(&parent.id, Some("child"))
        .await
        .unwrap();
}

fn names(of: &[&str]) -> Vec<Option<String>> {
    of.iter().map(|name| Some((*name).to_owned())).collect()
}

fn listed_names(list: Vec<cove_store::SandboxRecord>) -> Vec<String> {
    let mut names: Vec<String> = list.into_iter().map(|s| s.name).collect();
    names.sort();
    names
}

#[tokio::test]
async fn fork_into_many_copies_once_and_starts_every_child() {
    let h = harness().await;
    let parent = h.engine.sandboxes().create(vm("parent")).await.unwrap();
    let children = h
        .engine
        .sandboxes()
        .fork_many(&parent.id, &[Some("a".into()), None, Some("c".into())])
        .await
        .unwrap();
    // In the order asked, the unnamed one named by its id.
    assert_eq!(children.len(), 3);
    assert_eq!(
        (children[0].name.as_str(), children[2].name.as_str()),
        ("a", "c")
    );
    assert_eq!(children[1].name, children[1].id);
    let ids: Vec<&str> = children.iter().map(|c| c.id.as_str()).collect();
    // One copy of the parent for them all, then each continued from it.
    let copies: Vec<String> = h
        .fake
        .calls()
        .into_iter()
        .filter(|c| c.starts_with("fork"))
        .collect();
    assert_eq!(
        copies,
        [format!("fork-many {} {}", parent.id, ids.join(","))]
    );
    for child in &children {
        assert_eq!(child.state, SandboxState::Started);
        assert_eq!(child.parent_id.as_deref(), Some(parent.id.as_str()));
        assert!(h.fake.is_running(&sid(&child.id)).await);
        let own: Vec<String> = calls_for(&h.fake, &child.id)
            .into_iter()
            .filter(|call| call != "fork-many")
            .collect();
        assert_eq!(own, ["resume"]);
    }
    assert_eq!(
        h.engine.sandboxes().get(&parent.id).await.unwrap().state,
        SandboxState::Started
    );
    assert_eq!(
        h.engine.sandboxes().forks(&parent.id).await.unwrap().len(),
        3
    );
}

#[tokio::test]
async fn fork_into_many_is_all_or_nothing() {
    let h = harness().await;
    let parent = h.engine.sandboxes().create(vm("parent")).await.unwrap();
    let before = h.fake.machines();

    // One child that cannot start takes the others with it.
    h.fake.fail_start_of(Some("b"));
    let err = h
        .engine
        .sandboxes()
        .fork_many(&parent.id, &names(&["a", "b", "c"]))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("fails the start of b"), "{err}");
    assert_eq!(
        listed_names(h.engine.sandboxes().list().await.unwrap()),
        ["parent"]
    );
    assert_eq!(h.fake.machines(), before);
    assert_eq!(
        h.engine.sandboxes().get(&parent.id).await.unwrap().state,
        SandboxState::Started
    );
    h.fake.fail_start_of(None);

    // A name taken by the last child: the ones stored before it go.
    h.engine.sandboxes().create(vm("taken")).await.unwrap();
    let err = h
        .engine
        .sandboxes()
        .fork_many(&parent.id, &names(&["x", "y", "taken"]))
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::NameTaken { .. }), "{err}");
    assert_eq!(
        listed_names(h.engine.sandboxes().list().await.unwrap()),
        ["parent", "taken"]
    );

    // Each child counts against the quota: two running, room for three
    // more, four asked.
    h.engine
        .billing()
        .update_region_quota(
            cove_engine::DEFAULT_ORGANIZATION,
            &cove_engine::QuotaChange {
                max_running_sandboxes: Some(Some(5)),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let err = h
        .engine
        .sandboxes()
        .fork_many(&parent.id, &names(&["q1", "q2", "q3", "q4"]))
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::QuotaExceeded { .. }), "{err}");
    assert_eq!(
        listed_names(h.engine.sandboxes().list().await.unwrap()),
        ["parent", "taken"]
    );
    h.engine
        .sandboxes()
        .fork_many(&parent.id, &names(&["q1", "q2", "q3"]))
        .await
        .unwrap();

    // No children, too many, or one name twice: refused before anything.
    for (asked, says) in [
        (Vec::new(), "1 to 32 children, not 0"),
        (vec![None; 33], "not 33"),
        (names(&["d", "d"]), "the name d is given twice"),
    ] {
        let err = h
            .engine
            .sandboxes()
            .fork_many(&parent.id, &asked)
            .await
            .unwrap_err();
        assert!(matches!(err, EngineError::Invalid { .. }), "{err}");
        assert!(err.to_string().contains(says), "{err}");
    }
    assert_eq!(h.engine.sandboxes().list().await.unwrap().len(), 5);
}

/// A sandbox id the test names.
fn sid(id: &str) -> cove_runtime::SandboxId {
    cove_runtime::SandboxId::parse(id).expect("the test's ids are valid")
}
