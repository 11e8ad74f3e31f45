//! The engine driven against the fake runtime: every rule above the runtime,
//! without root.

use std::collections::HashMap;
use std::sync::Arc;

use cove_engine::{
    CreateSandbox, Engine, EngineConfig, EngineError, SandboxEvent, SandboxState, SettingChange,
    SnapshotRecord,
};
use cove_lifecycle::{SandboxClass, MINUTE_MS};
use cove_runtime::fake::FakeRuntime;
use cove_runtime::Runtime;
use cove_store::Store;

struct Harness {
    engine: Engine,
    fake: Arc<FakeRuntime>,
    store: Store,
    _dir: tempfile::TempDir,
}

async fn engine_on(store: Store, fake: Arc<FakeRuntime>) -> Engine {
    let runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> =
        HashMap::from([(SandboxClass::Container, fake as Arc<dyn Runtime>)]);
    Engine::new(EngineConfig::default(), store, runtimes)
}

async fn harness() -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let fake = Arc::new(FakeRuntime::new());
    let engine = engine_on(store.clone(), fake.clone()).await;
    engine
        .snapshots()
        .register(&SnapshotRecord::for_image(
            "cove-default",
            "/rootfs",
            SandboxClass::Container,
            0,
        ))
        .await
        .unwrap();
    Harness {
        engine,
        fake,
        store,
        _dir: dir,
    }
}

fn named(name: &str) -> CreateSandbox {
    CreateSandbox {
        name: Some(name.into()),
        ..CreateSandbox::default()
    }
}

#[tokio::test]
async fn a_runtime_error_keeps_its_kind_and_source_through_the_engine() {
    use cove_engine::ErrorKind;
    use cove_runtime::RuntimeError;
    let h = harness().await;
    let s = h.engine.sandboxes().create(named("kinds")).await.unwrap();
    h.engine.sandboxes().stop(&s.id).await.unwrap();
    let cases: [(cove_runtime::fake::StartFailure, ErrorKind); 3] = [
        (
            |id| RuntimeError::AlreadyRunning { id: id.to_owned() },
            ErrorKind::Conflict,
        ),
        (
            |id| RuntimeError::Busy {
                id: id.to_owned(),
                reason: "every id range is in use".into(),
            },
            ErrorKind::ServiceUnavailable,
        ),
        (
            |id| RuntimeError::File {
                id: id.to_owned(),
                action: "open",
                path: "/nowhere/console.log".into(),
                source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
            },
            ErrorKind::Internal,
        ),
    ];
    for (make, kind) in cases {
        h.fake.fail_start_with(Some(make));
        let error = h.engine.sandboxes().start(&s.id).await.unwrap_err();
        assert_eq!(error.kind(), kind, "{error}");
        // The runtime's error is the engine error's source, as it was made,
        // and what it wraps comes after it in the chain.
        let source = std::error::Error::source(&error).expect("a source");
        let runtime = source
            .downcast_ref::<RuntimeError>()
            .expect("the runtime's error");
        assert_eq!(runtime.sandbox_id(), s.id);
        let chain: Vec<String> = std::iter::successors(Some(source), |e| e.source())
            .map(ToString::to_string)
            .collect();
        assert_eq!(chain[0], make(&s.id).to_string());
        if kind == ErrorKind::Internal {
            assert_eq!(chain.len(), 2, "{chain:?}");
            assert!(source.source().unwrap().is::<std::io::Error>());
        }
        // The record says why, with the whole chain.
        let record = h.engine.sandboxes().get(&s.id).await.unwrap();
        assert_eq!(
            record.error_reason.as_deref(),
            Some(format!("start failed: {}", cove_engine::describe(source)).as_str())
        );
        h.fake.fail_start_with(None);
        h.engine.sandboxes().recover(&s.id).await.unwrap();
        h.engine.sandboxes().stop(&s.id).await.unwrap();
    }
}

#[tokio::test]
async fn create_stop_start_delete() {
    let h = harness().await;
    let s = h.engine.sandboxes().create(named("one")).await.unwrap();
    assert_eq!(s.state, SandboxState::Started);
    assert_eq!((s.cpu, s.memory_mib, s.disk_gib), (1, 1024, 3));
    assert!(h.fake.is_running(&sid(&s.id)).await);
    assert_eq!(h.engine.sandboxes().get("one").await.unwrap().id, s.id);

    let stopped = h.engine.sandboxes().stop(&s.id).await.unwrap();
    assert_eq!(stopped.state, SandboxState::Stopped);
    assert!(!h.fake.is_running(&sid(&s.id)).await);
    // Stop again is a no-op, not an error.
    assert_eq!(
        h.engine.sandboxes().stop(&s.id).await.unwrap().state,
        SandboxState::Stopped
    );

    assert_eq!(
        h.engine.sandboxes().start("one").await.unwrap().state,
        SandboxState::Started
    );
    assert!(h.fake.is_running(&sid(&s.id)).await);

    let deleted = h.engine.sandboxes().delete("one").await.unwrap();
    assert_eq!(deleted.state, SandboxState::Destroyed);
    assert!(h.fake.machines().is_empty());
    assert!(matches!(
        h.engine.sandboxes().get(&s.id).await,
        Err(EngineError::SandboxNotFound { .. })
    ));
}

/// The feed as (event, state, desired state) lines, read until it is empty.
fn drain(feed: &mut tokio::sync::broadcast::Receiver<SandboxEvent>) -> Vec<String> {
    let mut lines = Vec::new();
    while let Ok(event) = feed.try_recv() {
        let s = event.sandbox();
        let what = match &event {
            SandboxEvent::Created { .. } => "created".to_owned(),
            SandboxEvent::StateUpdated { old_state, .. } => format!("state from {old_state}"),
            SandboxEvent::DesiredStateUpdated {
                old_desired_state, ..
            } => format!("desired from {old_desired_state}"),
        };
        lines.push(format!("{what}: {} {}", s.state, s.desired_state));
    }
    lines
}

#[tokio::test]
async fn every_recorded_change_reaches_the_event_feed_in_order() {
    let h = harness().await;
    let mut feed = h.engine.events();
    let s = h.engine.sandboxes().create(named("feed")).await.unwrap();
    h.engine.sandboxes().stop(&s.id).await.unwrap();
    h.engine.sandboxes().start(&s.id).await.unwrap();
    h.engine.sandboxes().delete(&s.id).await.unwrap();
    assert_eq!(
        drain(&mut feed),
        [
            // Announced once its create ended, as the create answered it.
            "created: started started",
            "state from started: stopping stopped",
            "desired from started: stopping stopped",
            "state from stopping: stopped stopped",
            "state from stopped: starting started",
            "desired from stopped: starting started",
            "state from starting: started started",
            "state from started: destroying destroyed",
            "desired from started: destroying destroyed",
            "state from destroying: destroyed destroyed",
        ]
    );

    // A create the runtime fails ends destroyed: the row is gone, and it
    // was never announced.
    h.fake.fail_start(Some("no luck"));
    h.engine
        .sandboxes()
        .create(named("broken"))
        .await
        .unwrap_err();
    assert!(drain(&mut feed).is_empty());
}

#[tokio::test]
async fn a_failed_create_leaves_nothing() {
    let h = harness().await;
    h.fake.fail_start(Some("no luck"));
    let err = h
        .engine
        .sandboxes()
        .create(named("broken"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no luck"), "{err}");
    assert!(h.engine.sandboxes().list().await.unwrap().is_empty());
    assert!(h.fake.machines().is_empty());
    // The name is free again.
    h.fake.fail_start(None);
    h.engine.sandboxes().create(named("broken")).await.unwrap();
}

#[tokio::test]
async fn bad_requests_are_refused_by_name() {
    let h = harness().await;
    let unknown = CreateSandbox {
        snapshot: Some("nope".into()),
        ..Default::default()
    };
    let err = h.engine.sandboxes().create(unknown).await.unwrap_err();
    assert_eq!(err.to_string(), "snapshot nope not found");
    assert_eq!(err.kind(), cove_engine::ErrorKind::NotFound);

    let big = CreateSandbox {
        memory_gib: Some(64),
        ..Default::default()
    };
    let err = h.engine.sandboxes().create(big).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "memory 64 is above this server's ceiling of 8"
    );
    assert_eq!(err.kind(), cove_engine::ErrorKind::BadRequest);

    let windows = CreateSandbox {
        snapshot: Some("windows-small".into()),
        ..Default::default()
    };
    assert!(h
        .engine
        .sandboxes()
        .create(windows)
        .await
        .unwrap_err()
        .to_string()
        .contains("no Windows image"));

    h.engine.sandboxes().create(named("taken")).await.unwrap();
    let err = h
        .engine
        .sandboxes()
        .create(named("taken"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), cove_engine::ErrorKind::Conflict);

    let bad_name = h.engine.sandboxes().create(named("a b")).await.unwrap_err();
    assert_eq!(bad_name.kind(), cove_engine::ErrorKind::BadRequest);
    let both = CreateSandbox {
        auto_pause: Some(5),
        ..Default::default()
    };
    assert_eq!(
        h.engine.sandboxes().create(both).await.unwrap_err().kind(),
        cove_engine::ErrorKind::BadRequest
    );
    // Nothing half-made by any of these.
    assert_eq!(h.engine.sandboxes().list().await.unwrap().len(), 1);
    assert_eq!(h.fake.machines().len(), 1);
}

#[tokio::test]
async fn a_crash_is_an_error_and_recover_starts_it() {
    let h = harness().await;
    let s = h.engine.sandboxes().create(named("crashy")).await.unwrap();
    h.fake.crash(&s.id);
    let mut state = SandboxState::Started;
    for _ in 0..100 {
        state = h.engine.sandboxes().get(&s.id).await.unwrap().state;
        if state == SandboxState::Error {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(state, SandboxState::Error);
    let record = h.engine.sandboxes().get(&s.id).await.unwrap();
    assert!(record.error_reason.unwrap().contains("exited unexpectedly"));
    // Start from error is not allowed; recover is.
    let err = h.engine.sandboxes().start(&s.id).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "sandbox {}: cannot start a sandbox that is error (recover it first)",
            s.id
        )
    );
    assert_eq!(
        h.engine.sandboxes().recover(&s.id).await.unwrap().state,
        SandboxState::Started
    );
}

#[tokio::test]
async fn stop_does_not_count_as_a_crash() {
    let h = harness().await;
    let s = h.engine.sandboxes().create(named("calm")).await.unwrap();
    h.engine.sandboxes().stop(&s.id).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(
        h.engine.sandboxes().get(&s.id).await.unwrap().state,
        SandboxState::Stopped
    );
}

#[tokio::test]
async fn ephemeral_is_deleted_on_stop() {
    let h = harness().await;
    let request = CreateSandbox {
        auto_delete: Some(0),
        ..named("brief")
    };
    let s = h.engine.sandboxes().create(request).await.unwrap();
    let after = h.engine.sandboxes().stop(&s.id).await.unwrap();
    assert_eq!(after.state, SandboxState::Destroyed);
    assert!(h.engine.sandboxes().list().await.unwrap().is_empty());
    assert!(h.fake.machines().is_empty());
}

#[tokio::test]
async fn timers_stop_idle_sandboxes_and_honour_ttl() {
    let h = harness().await;
    let idle = h
        .engine
        .sandboxes()
        .create(CreateSandbox {
            auto_stop: Some(1),
            ..named("idle")
        })
        .await
        .unwrap();
    let ttl = h
        .engine
        .sandboxes()
        .create(CreateSandbox {
            auto_stop: Some(0),
            ttl_minutes: Some(2),
            ..named("ttl")
        })
        .await
        .unwrap();
    let now = cove_engine::now_ms();

    assert!(h
        .engine
        .sandboxes()
        .check_timers(now + 30_000)
        .await
        .unwrap()
        .is_empty());
    let fired = h
        .engine
        .sandboxes()
        .check_timers(now + MINUTE_MS + 1000)
        .await
        .unwrap();
    assert!(fired.contains(&(idle.id.clone(), "auto-stop")), "{fired:?}");
    assert_eq!(
        h.engine.sandboxes().get(&idle.id).await.unwrap().state,
        SandboxState::Stopped
    );

    let fired = h
        .engine
        .sandboxes()
        .check_timers(now + 3 * MINUTE_MS)
        .await
        .unwrap();
    assert!(fired.contains(&(ttl.id.clone(), "ttl")), "{fired:?}");
    assert!(h.engine.sandboxes().get(&ttl.id).await.is_err());
}

#[tokio::test]
async fn setters_keep_the_rules_and_reset_ttl() {
    let h = harness().await;
    let s = h.engine.sandboxes().create(named("set")).await.unwrap();
    let r = h
        .engine
        .sandboxes()
        .change(&s.id, SettingChange::AutoStop(30))
        .await
        .unwrap();
    assert_eq!(r.timers.auto_stop, 30);
    let err = h
        .engine
        .sandboxes()
        .change(&s.id, SettingChange::AutoPause(5))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), cove_engine::ErrorKind::BadRequest);
    let before = cove_engine::now_ms();
    let r = h
        .engine
        .sandboxes()
        .change(&s.id, SettingChange::Ttl(10))
        .await
        .unwrap();
    assert!(r.ttl_deadline_ms.unwrap() >= before + 10 * MINUTE_MS);
    let r = h
        .engine
        .sandboxes()
        .change(&s.id, SettingChange::Ttl(0))
        .await
        .unwrap();
    assert_eq!(r.ttl_deadline_ms, None);
    let labels = [("a".to_string(), "b".to_string())].into_iter().collect();
    let r = h
        .engine
        .sandboxes()
        .change(&s.id, SettingChange::Labels(labels))
        .await
        .unwrap();
    assert_eq!(r.labels.get("a").map(String::as_str), Some("b"));
}

#[tokio::test]
async fn a_restart_brings_sandboxes_back_once() {
    let h = harness().await;
    let running = h.engine.sandboxes().create(named("running")).await.unwrap();
    let stopped = h.engine.sandboxes().create(named("stopped")).await.unwrap();
    h.engine.sandboxes().stop(&stopped.id).await.unwrap();

    // A new engine on the same store, as after a server restart; its runtime has
    // lost every process.
    let fake = Arc::new(FakeRuntime::new());
    for id in [&running.id, &stopped.id] {
        let spec = cove_runtime::SandboxSpec {
            id: sid(id),
            hostname: "x".into(),
            rootfs: "/rootfs".into(),
            layers: vec![],
            resources: cove_runtime::Resources {
                cpu: 1,
                memory_mib: 1024,
                disk_gib: 3,
            },
            env: vec![],
            network: None,
            volumes: Vec::new(),
            workdir: None,
            user: None,
            command: Vec::new(),
        };
        fake.prepare(&spec).await.unwrap();
    }
    let engine = engine_on(h.store.clone(), fake.clone()).await;
    engine.recover_after_restart().await.unwrap();
    assert_eq!(
        engine.sandboxes().get(&running.id).await.unwrap().state,
        SandboxState::Started
    );
    assert!(fake.is_running(&sid(&running.id)).await);
    assert_eq!(
        engine.sandboxes().get(&stopped.id).await.unwrap().state,
        SandboxState::Stopped
    );
    assert!(!fake.is_running(&sid(&stopped.id)).await);
    assert_eq!(engine.sandboxes().list().await.unwrap().len(), 2);
}

#[tokio::test]
async fn snapshots_capture_stack_revert_and_refuse_what_would_break() {
    use cove_engine::ErrorKind;
    let h = harness().await;
    let source = h.engine.sandboxes().create(named("source")).await.unwrap();
    let after = h
        .engine
        .sandboxes()
        .snapshot(&source.id, "snap-a", false)
        .await
        .unwrap();
    assert_eq!(
        after.state,
        SandboxState::Started,
        "a live snapshot keeps it running"
    );
    let snap = h.engine.snapshots().get("snap-a").await.unwrap();
    assert_eq!(snap.source_sandbox.as_deref(), Some(source.id.as_str()));
    assert_eq!(snap.layers, [format!("/captures/{}", snap.id)]);
    assert_eq!(snap.rootfs, "/rootfs");

    let err = h
        .engine
        .sandboxes()
        .snapshot(&source.id, "snap-a", false)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    let err = h
        .engine
        .sandboxes()
        .snapshot(&source.id, "mem", true)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadRequest);
    assert!(err.to_string().contains("memory"), "{err}");

    let child = h
        .engine
        .sandboxes()
        .create(CreateSandbox {
            snapshot: Some("snap-a".into()),
            ..named("child")
        })
        .await
        .unwrap();
    h.engine
        .sandboxes()
        .snapshot(&child.id, "snap-b", false)
        .await
        .unwrap();
    let stacked = h.engine.snapshots().get("snap-b").await.unwrap();
    assert_eq!(stacked.layers.len(), 2);
    assert_eq!(
        stacked.layers[1], snap.layers[0],
        "the parent's layer stays below"
    );

    // The child cannot revert to its parent's snapshot; the source can.
    let err = h
        .engine
        .sandboxes()
        .revert(&child.id, "snap-a")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadRequest);
    let reverted = h
        .engine
        .sandboxes()
        .revert(&source.id, "snap-a")
        .await
        .unwrap();
    assert_eq!(reverted.state, SandboxState::Started);
    assert!(h
        .fake
        .calls()
        .contains(&format!("revert {} {}", source.id, snap.id)));

    // In use by a sandbox and by a stacked snapshot: refused, naming both.
    let err = h.engine.snapshots().delete("snap-a").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert!(
        err.to_string().contains("snapshot snap-b") && err.to_string().contains("sandbox child"),
        "{err}"
    );
    assert_eq!(
        h.engine
            .snapshots()
            .delete("cove-default")
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::BadRequest
    );

    h.engine.sandboxes().delete(&child.id).await.unwrap();
    h.engine.snapshots().delete("snap-b").await.unwrap();
    h.engine.snapshots().delete("snap-a").await.unwrap();
    assert!(h.fake.calls().contains(&format!("discard {}", snap.id)));
    assert_eq!(
        h.engine.snapshots().get("snap-a").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
}

#[tokio::test]
async fn revoking_ssh_access_tells_its_holders() {
    let h = harness().await;
    let s = h
        .engine
        .sandboxes()
        .create(named("ssh-watch"))
        .await
        .unwrap();
    let issued = h
        .engine
        .access()
        .create_ssh_access(&s.id, None)
        .await
        .unwrap();
    let mut revocations = h.engine.access().ssh_access_revocations();
    // Revoking nothing is no news.
    h.engine
        .access()
        .revoke_ssh_access(&s.id, Some("not-a-token"))
        .await
        .unwrap();
    assert!(!revocations.has_changed().unwrap());
    h.engine
        .access()
        .revoke_ssh_access(&s.id, Some(&issued.token))
        .await
        .unwrap();
    assert!(revocations.has_changed().unwrap());
    revocations.borrow_and_update();
    // Deleting a sandbox takes its tokens with it.
    h.engine
        .access()
        .create_ssh_access(&s.id, None)
        .await
        .unwrap();
    h.engine.sandboxes().delete(&s.id).await.unwrap();
    assert!(revocations.has_changed().unwrap());
}

#[tokio::test]
async fn ssh_access_is_issued_validated_expires_and_is_revoked() {
    let h = harness().await;
    let s = h.engine.sandboxes().create(named("ssh")).await.unwrap();
    let issued = h
        .engine
        .access()
        .create_ssh_access("ssh", Some(5))
        .await
        .unwrap();
    assert_eq!(issued.record.sandbox_id, s.id);
    assert!(issued.token.len() >= 32, "{}", issued.token);
    assert_eq!(
        issued.record.expires_at_ms - issued.record.created_at_ms,
        5 * MINUTE_MS
    );
    // Only the hash is stored.
    assert_ne!(issued.record.token_hash, issued.token);
    assert_eq!(
        h.engine
            .access()
            .validate_ssh_access(&issued.token)
            .await
            .unwrap(),
        Some(s.id.clone())
    );
    assert_eq!(
        h.engine
            .access()
            .validate_ssh_access("unknown")
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        h.engine.access().validate_ssh_access("").await.unwrap(),
        None
    );
    // A token outlives a stop and start of its sandbox.
    h.engine.sandboxes().stop(&s.id).await.unwrap();
    h.engine.sandboxes().start(&s.id).await.unwrap();
    assert_eq!(
        h.engine
            .access()
            .validate_ssh_access(&issued.token)
            .await
            .unwrap(),
        Some(s.id.clone())
    );

    // Expired: valid until its last millisecond, not after.
    let expires = issued.record.expires_at_ms;
    assert!(h
        .engine
        .access()
        .validate_ssh_access_at(&issued.token, expires - 1)
        .await
        .unwrap()
        .is_some());
    assert_eq!(
        h.engine
            .access()
            .validate_ssh_access_at(&issued.token, expires)
            .await
            .unwrap(),
        None
    );

    // Two tokens: revoking one leaves the other; revoking all ends both.
    let second = h
        .engine
        .access()
        .create_ssh_access(&s.id, None)
        .await
        .unwrap();
    assert_ne!(second.token, issued.token);
    assert_eq!(
        second.record.expires_at_ms - second.record.created_at_ms,
        60 * MINUTE_MS
    );
    h.engine
        .access()
        .revoke_ssh_access("ssh", Some(&issued.token))
        .await
        .unwrap();
    assert_eq!(
        h.engine
            .access()
            .validate_ssh_access(&issued.token)
            .await
            .unwrap(),
        None
    );
    assert!(h
        .engine
        .access()
        .validate_ssh_access(&second.token)
        .await
        .unwrap()
        .is_some());
    let third = h
        .engine
        .access()
        .create_ssh_access(&s.id, Some(1))
        .await
        .unwrap();
    h.engine
        .access()
        .revoke_ssh_access(&s.id, None)
        .await
        .unwrap();
    for token in [&second.token, &third.token] {
        assert_eq!(
            h.engine.access().validate_ssh_access(token).await.unwrap(),
            None
        );
    }

    // A deleted sandbox's tokens go with it.
    let fourth = h
        .engine
        .access()
        .create_ssh_access(&s.id, Some(1))
        .await
        .unwrap();
    h.engine.sandboxes().delete(&s.id).await.unwrap();
    assert_eq!(
        h.engine
            .access()
            .validate_ssh_access(&fourth.token)
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn ssh_access_refuses_bad_lifetimes_and_unknown_sandboxes() {
    let h = harness().await;
    h.engine.sandboxes().create(named("ssh")).await.unwrap();
    for minutes in [0, -1, cove_engine::MAX_SSH_ACCESS_MINUTES + 1] {
        let error = h
            .engine
            .access()
            .create_ssh_access("ssh", Some(minutes))
            .await
            .unwrap_err();
        assert!(
            matches!(
                error,
                EngineError::Invalid {
                    field: "expiresInMinutes",
                    ..
                }
            ),
            "{error}"
        );
    }
    for error in [
        h.engine
            .access()
            .create_ssh_access("nope", Some(5))
            .await
            .unwrap_err(),
        h.engine
            .access()
            .revoke_ssh_access("nope", None)
            .await
            .unwrap_err(),
    ] {
        assert!(
            matches!(error, EngineError::SandboxNotFound { .. }),
            "{error}"
        );
    }
}

#[tokio::test]
async fn a_finished_build_log_outlives_the_server() {
    let h = harness().await;
    let snapshot = h
        .engine
        .snapshots()
        .create_image_snapshot(cove_engine::ImageSnapshotRequest {
            name: "logged".into(),
            dockerfile: Some("FROM cove-default\nENV A=1\n".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let live = h.engine.snapshots().build_log(&snapshot.id).await.unwrap();
    loop {
        let (_, done) = live.read_all();
        if done {
            break;
        }
        live.wait(0).await;
    }
    let (written, _) = live.read_all();
    assert!(written.iter().any(|l| l == "build complete"), "{written:?}");
    // A new server on the same store reads the same lines.
    let restarted = engine_on(h.store.clone(), h.fake.clone()).await;
    let kept = restarted.snapshots().build_log("logged").await.unwrap();
    assert_eq!(kept.read_all(), (written, true));
    // Deleting the snapshot deletes its log.
    restarted.snapshots().delete("logged").await.unwrap();
    assert_eq!(h.store.find_build_log(&snapshot.id).await.unwrap(), None);
}

#[tokio::test]
async fn a_restart_clears_build_scratch_but_keeps_uploaded_contexts() {
    let dir = tempfile::tempdir().unwrap();
    let contexts = dir.path().join("contexts");
    for leftover in [
        ".uploads/u1/00001",
        ".builds/b1/context/x",
        "abc123/context.tar",
    ] {
        let path = contexts.join(leftover);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "x").unwrap();
    }
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> = HashMap::from([(
        SandboxClass::Container,
        Arc::new(FakeRuntime::new()) as Arc<dyn Runtime>,
    )]);
    let config = EngineConfig {
        build_contexts_dir: Some(contexts.clone()),
        ..EngineConfig::default()
    };
    let engine = Engine::new(config, store, runtimes);
    engine.recover_after_restart().await.unwrap();
    assert!(!contexts.join(".uploads").exists());
    assert!(!contexts.join(".builds").exists());
    assert!(contexts.join("abc123/context.tar").is_file());
}

/// Attack: a hostile Dockerfile's `RUN` (a fork bomb, a miner) outlives the
/// server when it crashes mid-build: its build sandbox is no sandbox
/// record, so before, nothing ever ended its processes or removed its
/// cgroup and directory. Restart recovery now destroys every build sandbox
/// it finds through the runtime, and nothing else.
#[tokio::test]
async fn a_restart_destroys_the_build_sandboxes_a_crash_left() {
    let h = harness().await;
    let kept = h.engine.sandboxes().create(named("kept")).await.unwrap();
    let fake = Arc::new(FakeRuntime::new());
    let spec = |id: &str| {
        cove_runtime::SandboxSpec::bare(
            sid(id),
            "x",
            "/rootfs".into(),
            cove_runtime::Resources {
                cpu: 1,
                memory_mib: 1024,
                disk_gib: 3,
            },
        )
    };
    let leftover = "build-0123456789abcdef0123456789abcdef";
    for id in [kept.id.as_str(), leftover] {
        fake.prepare(&spec(id)).await.unwrap();
    }
    fake.start(&spec(leftover)).await.unwrap();
    assert!(fake.is_running(&sid(leftover)).await);

    let engine = engine_on(h.store.clone(), fake.clone()).await;
    engine.recover_after_restart().await.unwrap();
    assert_eq!(fake.machines(), [kept.id.as_str()]);
    assert!(fake.calls().contains(&format!("destroy {leftover}")));
    assert_eq!(
        engine.sandboxes().get(&kept.id).await.unwrap().state,
        SandboxState::Started
    );
}

/// An engine whose build contexts may be at most `max_bytes`, two uploads
/// in parts per grant.
fn context_engine(dir: &std::path::Path, store: Store) -> Engine {
    let runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> = HashMap::from([(
        SandboxClass::Container,
        Arc::new(FakeRuntime::new()) as Arc<dyn Runtime>,
    )]);
    let config = EngineConfig {
        build_contexts_dir: Some(dir.join("contexts")),
        context_limits: cove_engine::ContextLimits {
            max_bytes: 1000,
            max_uploads_per_grant: 2,
        },
        ..EngineConfig::default()
    };
    Engine::new(config, store, runtimes)
}

fn body(
    chunks: &[usize],
) -> impl futures_util::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Unpin {
    let chunks: Vec<_> = chunks
        .iter()
        .map(|&n| Ok(bytes::Bytes::from(vec![b'x'; n])))
        .collect();
    futures_util::stream::iter(chunks)
}

/// Every file under `dir`, relative.
fn files_under(dir: &std::path::Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).into_iter().flatten().flatten() {
            if entry.file_type().unwrap().is_dir() {
                pending.push(entry.path());
            } else {
                found.push(
                    entry
                        .path()
                        .strip_prefix(dir)
                        .unwrap()
                        .display()
                        .to_string(),
                );
            }
        }
    }
    found.sort();
    found
}

/// Attack: a client with push credentials streams an endless build context
/// (one PUT, or parts that each fit but together do not) to fill the
/// server's disk, or opens uploads in parts without end. Each is refused
/// at the limit with `ContextTooLarge` (S3's EntityTooLarge) and nothing
/// of it stays on disk; a context within the limit is stored.
#[tokio::test]
async fn build_contexts_are_their_organizations_own() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let engine = context_engine(dir.path(), store);
    let team = engine.organizations().create("team", None).await.unwrap();
    let ours = engine.snapshots().issue_push_grant("cove").unwrap();
    let theirs = engine.snapshots().issue_push_grant(&team.id).unwrap();
    let hash = "0123abcd";
    // The team uploads a context under a hash; the default organization,
    // naming the same hash, finds nothing and writes its own beside it.
    let their_key = format!("{}/{hash}/context.tar", team.id);
    engine
        .snapshots()
        .put_context(&theirs, &their_key, body(&[10]), None)
        .await
        .unwrap();
    let our_key = format!("cove/{hash}/context.tar");
    let seen = engine
        .snapshots()
        .head_context(&ours, &our_key)
        .await
        .unwrap();
    assert!(seen.is_none(), "{seen:?}");
    engine
        .snapshots()
        .put_context(&ours, &our_key, body(&[20]), None)
        .await
        .unwrap();
    let sizes = |grant: &cove_engine::PushGrant, key: &str| {
        let (engine, grant, key) = (engine.clone(), grant.clone(), key.to_owned());
        async move {
            engine
                .snapshots()
                .head_context(&grant, &key)
                .await
                .unwrap()
                .map(|o| o.size)
        }
    };
    assert_eq!(sizes(&ours, &our_key).await, Some(20));
    assert_eq!(sizes(&theirs, &their_key).await, Some(10));
    // A grant writes under its own organization only.
    let error = engine
        .snapshots()
        .put_context(&theirs, &our_key, body(&[5]), None)
        .await
        .unwrap_err();
    assert_eq!(error.kind(), cove_engine::ErrorKind::BadRequest, "{error}");
    assert_eq!(sizes(&ours, &our_key).await, Some(20));
}

#[tokio::test]
async fn build_context_uploads_are_bounded_and_leave_nothing_when_refused() {
    use cove_engine::ErrorKind;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let engine = context_engine(dir.path(), store);
    let contexts = dir.path().join("contexts");
    let grant = engine.snapshots().issue_push_grant("cove").unwrap();
    let key = "cove/0123abcd/context.tar";

    let error = engine
        .snapshots()
        .put_context(&grant, key, body(&[600, 600, 600]), None)
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            EngineError::ContextTooLarge {
                limit_bytes: 1000,
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(error.kind(), ErrorKind::BadRequest);
    assert_eq!(files_under(&contexts), Vec::<String>::new());

    // Parts that fit one by one but not together: the whole upload goes.
    let upload = engine
        .snapshots()
        .start_context_upload(&grant, key)
        .await
        .unwrap();
    engine
        .snapshots()
        .put_context_part(&grant, key, &upload, 1, body(&[600]), None)
        .await
        .unwrap();
    // The same part sent again counts once.
    engine
        .snapshots()
        .put_context_part(&grant, key, &upload, 1, body(&[600]), None)
        .await
        .unwrap();
    let error = engine
        .snapshots()
        .put_context_part(&grant, key, &upload, 2, body(&[300, 300]), None)
        .await
        .unwrap_err();
    assert!(
        matches!(error, EngineError::ContextTooLarge { .. }),
        "{error}"
    );
    assert_eq!(files_under(&contexts), Vec::<String>::new());
    let gone = engine
        .snapshots()
        .put_context_part(&grant, key, &upload, 3, body(&[1]), None)
        .await
        .unwrap_err();
    assert_eq!(gone.kind(), ErrorKind::BadRequest, "{gone}");

    // At most two uploads in parts per grant.
    let first = engine
        .snapshots()
        .start_context_upload(&grant, key)
        .await
        .unwrap();
    engine
        .snapshots()
        .start_context_upload(&grant, key)
        .await
        .unwrap();
    let error = engine
        .snapshots()
        .start_context_upload(&grant, key)
        .await
        .unwrap_err();
    assert!(
        matches!(error, EngineError::TooManyUploads { limit: 2 }),
        "{error}"
    );
    engine
        .snapshots()
        .abort_context_upload(&grant, key, &first)
        .await
        .unwrap();
    let upload = engine
        .snapshots()
        .start_context_upload(&grant, key)
        .await
        .unwrap();

    // Within the limit: stored.
    engine
        .snapshots()
        .put_context_part(&grant, key, &upload, 1, body(&[500]), None)
        .await
        .unwrap();
    engine
        .snapshots()
        .put_context_part(&grant, key, &upload, 2, body(&[500]), None)
        .await
        .unwrap();
    engine
        .snapshots()
        .complete_context_upload(&grant, key, &upload, &[1, 2])
        .await
        .unwrap();
    let stored = engine
        .snapshots()
        .head_context(&grant, key)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.size, 1000);
}

/// Attack: anyone with the API key named any host path for
/// `POST /api/snapshots/import`, making the server read `/etc`, another
/// data dir, or follow a symlink planted in the import directory. The
/// engine now reads only inside its import directory and answers 400
/// naming it for anything else; a path inside is read.
#[tokio::test]
async fn imports_read_nothing_outside_the_import_directory() {
    use cove_engine::ErrorKind;
    let dir = tempfile::tempdir().unwrap();
    let import = dir.path().join("import");
    std::fs::create_dir_all(&import).unwrap();
    let import = import.canonicalize().unwrap();
    std::fs::write(import.join("junk.tar"), "not an image").unwrap();
    std::fs::write(dir.path().join("secret.tar"), "not yours").unwrap();
    std::os::unix::fs::symlink(dir.path(), import.join("escape")).unwrap();
    let store = Store::open(&dir.path().join("cove.db")).await.unwrap();
    let runtimes: HashMap<SandboxClass, Arc<dyn Runtime>> = HashMap::from([(
        SandboxClass::Container,
        Arc::new(FakeRuntime::new()) as Arc<dyn Runtime>,
    )]);
    let config = EngineConfig {
        images: Some(cove_images::ImageStore::new(dir.path().join("images"))),
        import_dir: Some(import.clone()),
        ..EngineConfig::default()
    };
    let engine = Engine::new(config, store, runtimes);
    for path in [
        dir.path().join("secret.tar"),
        "../secret.tar".into(),
        "escape/secret.tar".into(),
        import.join("escape/secret.tar"),
        "/etc/passwd".into(),
    ] {
        let error = engine
            .snapshots()
            .import_image_snapshot("stolen", &path)
            .await
            .unwrap_err();
        assert!(
            matches!(error, EngineError::OutsideImportDir { .. }),
            "{}: {error}",
            path.display()
        );
        assert_eq!(error.kind(), ErrorKind::BadRequest);
        assert!(
            error.to_string().contains(&import.display().to_string()),
            "{error}"
        );
    }
    // Inside: read, and refused only for not being an image.
    let error = engine
        .snapshots()
        .import_image_snapshot("junk", std::path::Path::new("junk.tar"))
        .await
        .unwrap_err();
    assert!(matches!(error, EngineError::Image { .. }), "{error}");
    assert!(error.to_string().contains("junk.tar"), "{error}");
}

/// A sandbox id the test names.
fn sid(id: &str) -> cove_runtime::SandboxId {
    cove_runtime::SandboxId::parse(id).expect("the test's ids are valid")
}
