//! The store keeps what it is given, across reopening.

use std::collections::BTreeMap;

use cove_lifecycle::{DesiredState, SandboxClass, SandboxState, TimerSettings};
use cove_store::{
    SandboxOrder, SandboxRecord, SandboxSortField, SnapshotRecord, SnapshotState, SortDirection,
    Store,
};

fn sandbox(id: &str, name: &str) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        organization_id: "cove".into(),
        name: name.into(),
        snapshot: "cove-default".into(),
        class: SandboxClass::Container,
        state: SandboxState::Started,
        desired_state: DesiredState::Started,
        error_reason: None,
        os_user: "root".into(),
        cpu: 1,
        gpu: 0,
        memory_mib: 1024,
        disk_gib: 3,
        env: BTreeMap::from([("A".into(), "1".into())]),
        labels: BTreeMap::from([("env".into(), "dev".into())]),
        public: false,
        timers: TimerSettings {
            auto_stop: 15,
            auto_pause: 0,
            auto_archive: 10080,
            auto_delete: -1,
        },
        ttl_minutes: 0,
        ttl_deadline_ms: None,
        created_at_ms: 1,
        updated_at_ms: 1,
        state_since_ms: 1,
        last_activity_ms: 1,
        persistent: true,
        spot: false,
        parent_id: Some("id-parent".into()),
        linked_sandbox_id: Some("id-owner".into()),
        network: cove_store::NetworkSettings {
            block_all: false,
            allow_list: vec!["10.0.0.0/8".into()],
            deny_list: vec![],
            domains: vec!["*.example.com".into()],
        },
        volumes: vec![cove_store::VolumeMount {
            volume_id: "v1".into(),
            mount_path: "/data".into(),
            subpath: Some("a".into()),
        }],
        runner_id: Some("runner-1".into()),
    }
}

fn snapshot(id: &str, name: &str) -> SnapshotRecord {
    SnapshotRecord {
        id: id.into(),
        organization_id: "cove".into(),
        name: name.into(),
        class: SandboxClass::Container,
        state: SnapshotState::Active,
        error_reason: None,
        rootfs: "/x".into(),
        layers: vec![],
        capture_id: None,
        source_sandbox: None,
        cpu: 1,
        gpu: 0,
        memory_mib: 1024,
        disk_gib: 3,
        size_bytes: Some(5),
        has_memory: true,
        env: BTreeMap::from([("PATH".into(), "/usr/bin".into())]),
        image: cove_store::ImageSettings {
            workdir: Some("/app".into()),
            user: Some("nobody".into()),
            entrypoint: vec!["/bin/sh".into(), "-c".into()],
            cmd: vec!["sleep infinity".into()],
        },
        general: true,
        created_at_ms: 1,
        updated_at_ms: 1,
    }
}

async fn sandboxes_round_trip_and_survive_reopen(db: &Db) {
    let store = db.open().await;
    let a = sandbox("id-a", "alpha");
    store.insert_sandbox(&a).await.unwrap();
    store
        .insert_sandbox(&sandbox("id-b", "beta"))
        .await
        .unwrap();
    let clash = store
        .insert_sandbox(&sandbox("id-c", "beta"))
        .await
        .unwrap_err();
    assert!(
        matches!(clash, cove_store::StoreError::Duplicate { .. }),
        "{clash:?}"
    );
    assert_eq!(
        store.find_sandbox(None, "id-a").await.unwrap(),
        Some(a.clone())
    );
    assert_eq!(
        store.find_sandbox(None, "alpha").await.unwrap(),
        Some(a.clone())
    );
    assert!(store.name_taken("cove", "beta").await.unwrap());
    assert!(!store.name_taken("cove", "gamma").await.unwrap());
    store.record_activity("id-a", 50).await.unwrap();
    store.record_activity("id-a", 20).await.unwrap();
    drop(store);

    let store = db.open().await;
    let found = store.find_sandbox(None, "alpha").await.unwrap().unwrap();
    assert_eq!(found.last_activity_ms, 50);
    assert_eq!(store.list_sandboxes().await.unwrap().len(), 2);
    // Both rows name id-owner as the sandbox they are linked to.
    let linked = store.sandboxes_linked_to("id-owner").await.unwrap();
    assert_eq!(linked.len(), 2);
    assert!(store.sandboxes_linked_to("id-a").await.unwrap().is_empty());
    store.delete_sandbox("id-a", 1).await.unwrap();
    assert_eq!(store.find_sandbox(None, "id-a").await.unwrap(), None);
}

async fn snapshots_and_keys(db: &Db) {
    let store = db.open().await;
    let snap = snapshot("s1", "cove-default");
    store.save_snapshot(&snap).await.unwrap();
    assert_eq!(
        store.find_snapshot(None, "cove-default").await.unwrap(),
        Some(snap)
    );
    assert_eq!(store.find_snapshot(None, "nope").await.unwrap(), None);
    let step = cove_store::BuildStepRecord {
        cache_key: "k".into(),
        capture_id: "c1".into(),
        layer: "/layers/c1".into(),
        created_at_ms: 2,
    };
    assert!(store.insert_build_step(&step).await.unwrap());
    let again = cove_store::BuildStepRecord {
        capture_id: "c2".into(),
        ..step.clone()
    };
    assert!(!store.insert_build_step(&again).await.unwrap());
    assert_eq!(store.find_build_step("k").await.unwrap(), Some(step));
    assert_eq!(store.find_build_step("other").await.unwrap(), None);
}

fn access(
    id: &str,
    sandbox_id: &str,
    hash: &str,
    expires_at_ms: i64,
) -> cove_store::SshAccessRecord {
    cove_store::SshAccessRecord {
        id: id.into(),
        sandbox_id: sandbox_id.into(),
        token_hash: hash.into(),
        expires_at_ms,
        created_at_ms: 1,
        updated_at_ms: 1,
    }
}

async fn ssh_access_is_found_by_hash_revoked_pruned_and_goes_with_its_sandbox(db: &Db) {
    let store = db.open().await;
    store
        .insert_sandbox(&sandbox("id-a", "alpha"))
        .await
        .unwrap();
    store
        .insert_sandbox(&sandbox("id-b", "beta"))
        .await
        .unwrap();
    for record in [
        access("1", "id-a", "h1", 100),
        access("2", "id-a", "h2", 200),
        access("3", "id-a", "h3", 300),
        access("4", "id-b", "h4", 400),
    ] {
        store.add_ssh_access(&record).await.unwrap();
    }
    assert_eq!(
        store.find_ssh_access("h2").await.unwrap(),
        Some(access("2", "id-a", "h2", 200))
    );
    assert_eq!(store.find_ssh_access("nope").await.unwrap(), None);

    // A token is revoked only through its own sandbox.
    assert_eq!(
        store.revoke_ssh_access("id-b", Some("h1")).await.unwrap(),
        0
    );
    assert_eq!(
        store.revoke_ssh_access("id-a", Some("h1")).await.unwrap(),
        1
    );
    assert_eq!(store.find_ssh_access("h1").await.unwrap(), None);

    assert_eq!(store.prune_ssh_access(200).await.unwrap(), 1);
    assert_eq!(store.find_ssh_access("h2").await.unwrap(), None);
    assert!(store.find_ssh_access("h3").await.unwrap().is_some());

    // Saving a sandbox keeps its tokens; deleting it deletes them, not the others'.
    store.save_sandbox(&sandbox("id-a", "alpha")).await.unwrap();
    assert!(store.find_ssh_access("h3").await.unwrap().is_some());
    store.delete_sandbox("id-a", 1).await.unwrap();
    assert_eq!(store.find_ssh_access("h3").await.unwrap(), None);
    assert!(store.find_ssh_access("h4").await.unwrap().is_some());
    assert_eq!(store.revoke_ssh_access("id-b", None).await.unwrap(), 1);
}

async fn docker_registries(db: &Db) {
    let store = db.open().await;
    let mut registry = cove_store::DockerRegistryRecord {
        id: "r1".into(),
        organization_id: "cove".into(),
        name: "local".into(),
        url: "127.0.0.1:5000".into(),
        username: "u".into(),
        password: "secret".into(),
        project: String::new(),
        registry_type: "organization".into(),
        created_at_ms: 1,
        updated_at_ms: 1,
    };
    store.save_registry(&registry).await.unwrap();
    assert!(!format!("{registry:?}").contains("secret"));
    registry.password = "new".into();
    store.save_registry(&registry).await.unwrap();
    assert_eq!(
        store.list_registries().await.unwrap(),
        vec![registry.clone()]
    );
    assert_eq!(store.find_registry("r1").await.unwrap(), Some(registry));
    store.delete_registry("r1").await.unwrap();
    assert_eq!(store.find_registry("r1").await.unwrap(), None);
}

/// A database at `path` as a server whose last migration was `version` left it.
async fn migrated_up_to(path: &std::path::Path, version: i64) -> sqlx::SqlitePool {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true);
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    let mut migrator = sqlx::migrate!("./migrations/sqlite");
    let earlier: Vec<_> = migrator
        .migrations
        .iter()
        .filter(|m| m.version <= version)
        .cloned()
        .collect();
    migrator.migrations = earlier.into();
    migrator.run(&pool).await.unwrap();
    pool
}

#[tokio::test]
async fn memory_kept_in_gib_before_is_read_in_mib_after_migrating() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cove.db");
    // The database as a server before migration 0010 left it.
    let pool = migrated_up_to(&path, 9).await;
    sqlx::query(
        "INSERT INTO snapshots (id, name, class, state, rootfs, cpu, gpu, memory_gib, \
         disk_gib, general, created_at_ms, updated_at_ms) \
         VALUES ('s1', 'big', 'linux-vm', 'active', '/r', 2, 0, 4, 3, 0, 1, 1)",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;

    let store = Store::open(&path).await.unwrap();
    let snapshot = store.find_snapshot(None, "big").await.unwrap().unwrap();
    assert_eq!((snapshot.cpu, snapshot.memory_mib), (2, 4096));
}

async fn sandboxes_list_in_any_order_with_stable_ties(db: &Db) {
    let store = db.open().await;
    // Inserted in an order that is neither by name nor by creation time; two
    // made in the same millisecond, told apart by insertion.
    for (id, name, created, cpu, activity) in [
        ("id-1", "bravo", 20, 2, 500),
        ("id-2", "alpha", 30, 1, 100),
        ("id-3", "delta", 10, 2, 300),
        ("id-4", "charlie", 30, 4, 200),
    ] {
        let mut record = sandbox(id, name);
        record.created_at_ms = created;
        record.cpu = cpu;
        record.last_activity_ms = activity;
        record.parent_id = None;
        store.insert_sandbox(&record).await.unwrap();
    }
    let names = |order| {
        let store = store.clone();
        async move {
            store
                .list_sandboxes_ordered(None, order)
                .await
                .unwrap()
                .into_iter()
                .map(|s| s.name)
                .collect::<Vec<_>>()
        }
    };
    use SandboxSortField::*;
    use SortDirection::*;
    for (field, direction, expected) in [
        (Name, Ascending, ["alpha", "bravo", "charlie", "delta"]),
        (Name, Descending, ["delta", "charlie", "bravo", "alpha"]),
        (CreatedAt, Ascending, ["delta", "bravo", "alpha", "charlie"]),
        (
            CreatedAt,
            Descending,
            ["charlie", "alpha", "bravo", "delta"],
        ),
        // Equal CPUs fall back to creation time, in the same direction.
        (Cpu, Ascending, ["alpha", "delta", "bravo", "charlie"]),
        (Cpu, Descending, ["charlie", "bravo", "delta", "alpha"]),
        (
            LastActivityAt,
            Descending,
            ["bravo", "delta", "charlie", "alpha"],
        ),
        (Id, Descending, ["charlie", "delta", "alpha", "bravo"]),
    ] {
        let order = SandboxOrder { field, direction };
        assert_eq!(names(order).await, expected, "{order:?}");
    }
    // The old entry point keeps its order: oldest first.
    let oldest_first: Vec<_> = store
        .list_sandboxes()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(oldest_first, ["delta", "bravo", "alpha", "charlie"]);
}

fn key(name: &str, hash: &str) -> cove_store::ApiKeyRecord {
    cove_store::ApiKeyRecord {
        hash: hash.into(),
        organization_id: "cove".into(),
        name: name.into(),
        permissions: vec!["write:sandboxes".into(), "read:volumes".into()],
        masked: "cove_1****9".into(),
        created_at_ms: 5,
        expires_at_ms: Some(99),
        last_used_at_ms: None,
        operator: false,
    }
}

async fn api_keys_are_unique_by_name_and_remember_their_use(db: &Db) {
    let store = db.open().await;
    let ci = key("ci", "h1");
    assert!(store.insert_api_key(&ci).await.unwrap());
    assert!(!store.insert_api_key(&key("ci", "h2")).await.unwrap());
    store.touch_api_key("h1", 42).await.unwrap();
    let stored = store.api_keys().await.unwrap();
    let used = cove_store::ApiKeyRecord {
        last_used_at_ms: Some(42),
        ..ci
    };
    assert_eq!(stored, vec![used]);
    assert!(store.delete_api_key("cove", "ci").await.unwrap());
    assert!(!store.delete_api_key("cove", "ci").await.unwrap());
    assert!(store.api_keys().await.unwrap().is_empty());
}

#[tokio::test]
async fn keys_from_before_names_become_the_operators() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cove.db");
    // A database as cove left it before keys had names: migrations up to 11.
    {
        let pool = migrated_up_to(&path, 11).await;
        for (hash, at) in [("first", 1), ("second", 2)] {
            sqlx::query("INSERT INTO api_keys (hash, created_at_ms) VALUES (?, ?)")
                .bind(hash)
                .bind(at)
                .execute(&pool)
                .await
                .unwrap();
        }
        pool.close().await;
    }
    let store = Store::open(&path).await.unwrap();
    let keys = store.api_keys().await.unwrap();
    let names: Vec<_> = keys
        .iter()
        .map(|k| (k.hash.as_str(), k.name.as_str()))
        .collect();
    assert_eq!(names, [("first", "operator"), ("second", "operator-2")]);
    assert!(keys.iter().all(|k| k.operator && k.expires_at_ms.is_none()));
}

fn audited(id: &str, at: i64, action: &str, target: &str, status: u16) -> cove_store::AuditRecord {
    cove_store::AuditRecord {
        id: id.into(),
        organization_id: "cove".into(),
        created_at_ms: at,
        key_name: "ci".into(),
        key_masked: "cove_1****9".into(),
        action: action.into(),
        target_type: "sandbox".into(),
        target_id: Some(target.into()),
        status_code: status,
        error_message: (status >= 400).then(|| "refused".into()),
        user_agent: None,
    }
}

async fn the_audit_log_reads_newest_first_filtered_and_paged(db: &Db) {
    let store = db.open().await;
    let rows = [
        audited("a1", 10, "create", "s1", 200),
        audited("a2", 20, "stop", "s1", 200),
        audited("a3", 30, "delete", "s2", 403),
        audited("a4", 40, "stop", "s2", 200),
    ];
    for row in &rows {
        store.insert_audit(row).await.unwrap();
    }
    let ids = |items: Vec<cove_store::AuditRecord>| -> Vec<String> {
        items.into_iter().map(|r| r.id).collect()
    };
    let all = cove_store::AuditQuery::default();
    let (page, total) = store.audit_page(&all, 0, 3).await.unwrap();
    assert_eq!(
        (ids(page), total),
        (vec!["a4".into(), "a3".into(), "a2".into()], 4)
    );
    let (page, _) = store.audit_page(&all, 3, 3).await.unwrap();
    assert_eq!(page, vec![rows[0].clone()]);

    let stops = cove_store::AuditQuery {
        action: Some("stop".into()),
        from_ms: Some(15),
        to_ms: Some(35),
        ..Default::default()
    };
    let (page, total) = store.audit_page(&stops, 0, 10).await.unwrap();
    assert_eq!((ids(page), total), (vec!["a2".into()], 1));
    let refused = cove_store::AuditQuery {
        status_code: Some(403),
        target_id: Some("s2".into()),
        ..Default::default()
    };
    let (page, _) = store.audit_page(&refused, 0, 10).await.unwrap();
    assert_eq!(page, vec![rows[2].clone()]);
}

async fn the_meter_splits_at_every_change_in_the_same_write_and_survives_reopen(db: &Db) {
    let store = db.open().await;
    let mut record = sandbox("id-a", "alpha");
    record.state = SandboxState::Creating;
    record.created_at_ms = 1_000;
    store.insert_sandbox(&record).await.unwrap();
    record.state = SandboxState::Started;
    record.updated_at_ms = 2_000;
    store.save_sandbox(&record).await.unwrap();
    // A save that changes nothing metered (labels) keeps the interval open.
    record.labels.insert("more".into(), "x".into());
    record.updated_at_ms = 2_500;
    store.save_sandbox(&record).await.unwrap();
    // A resize is a change.
    record.cpu = 2;
    record.updated_at_ms = 3_000;
    store.save_sandbox(&record).await.unwrap();
    drop(store);

    let store = db.open().await;
    // The server comes back at 5 000: the open interval ends there and the
    // same measure starts again from it.
    assert_eq!(store.reopen_meters(5_000).await.unwrap(), 1);
    store.delete_sandbox("id-a", 6_000).await.unwrap();
    let intervals = store.meter_intervals(0, i64::MAX).await.unwrap();
    let seen: Vec<(&str, i64, i64, Option<i64>)> = intervals
        .iter()
        .map(|i| (i.state.as_str(), i.cpu, i.started_ms, i.ended_ms))
        .collect();
    assert_eq!(
        seen,
        [
            ("creating", 1, 1_000, Some(2_000)),
            ("started", 1, 2_000, Some(3_000)),
            ("started", 2, 3_000, Some(5_000)),
            ("started", 2, 5_000, Some(6_000)),
        ]
    );
    assert!(intervals.iter().all(|i| i.name == "alpha"));
    // Only intervals with time in the period are read.
    let window = store.meter_intervals(2_100, 2_900).await.unwrap();
    assert_eq!(window.len(), 1);
    assert_eq!(window[0].started_ms, 2_000);
}

async fn a_users_snapshot_is_metered_while_active_and_the_servers_own_are_not(db: &Db) {
    let store = db.open().await;
    let mut own = snapshot("snap-1", "mine");
    own.general = false;
    own.state = SnapshotState::Building;
    own.created_at_ms = 10;
    store.insert_snapshot(&own).await.unwrap();
    own.state = SnapshotState::Active;
    own.size_bytes = Some(5 << 30);
    own.updated_at_ms = 20;
    store.save_snapshot(&own).await.unwrap();
    let mut general = snapshot("snap-2", "default");
    general.general = true;
    general.state = SnapshotState::Active;
    store.insert_snapshot(&general).await.unwrap();
    store.delete_snapshot("snap-1", 50).await.unwrap();
    let intervals = store.meter_intervals(0, 100).await.unwrap();
    assert_eq!(intervals.len(), 1, "{intervals:?}");
    assert_eq!(intervals[0].kind, cove_store::MeterKind::Snapshot);
    assert_eq!(intervals[0].size_bytes, 5 << 30);
    assert_eq!(
        (intervals[0].started_ms, intervals[0].ended_ms),
        (20, Some(50))
    );
}

async fn a_region_quota_is_kept_and_replaced_whole(db: &Db) {
    let store = db.open().await;
    assert_eq!(store.region_quota("cove", "us").await.unwrap(), None);
    let mut quota = cove_store::RegionQuotaRecord {
        organization_id: "cove".into(),
        region_id: "us".into(),
        max_running_sandboxes: Some(1),
        total_cpu: Some(8),
        updated_at_ms: 5,
        ..Default::default()
    };
    store.save_region_quota(&quota).await.unwrap();
    assert_eq!(
        store.region_quota("cove", "us").await.unwrap().as_ref(),
        Some(&quota)
    );
    quota.total_cpu = None;
    quota.max_disk_per_sandbox = Some(10);
    store.save_region_quota(&quota).await.unwrap();
    assert_eq!(store.region_quota("cove", "us").await.unwrap(), Some(quota));
    assert_eq!(store.region_quota("cove", "eu").await.unwrap(), None);
}

async fn an_organizations_rate_limits_are_kept_and_replaced(db: &Db) {
    let store = db.open().await;
    assert_eq!(store.organization_quota("cove").await.unwrap(), None);
    let quota = cove_store::OrganizationQuotaRecord {
        sandbox_create: Some(cove_store::RateLimit {
            requests: 2,
            window_seconds: 60,
        }),
        volumes: Some(3),
        ..Default::default()
    };
    store
        .save_organization_quota("cove", &quota, 1)
        .await
        .unwrap();
    assert_eq!(
        store.organization_quota("cove").await.unwrap().as_ref(),
        Some(&quota)
    );
    store
        .save_organization_quota("cove", &Default::default(), 2)
        .await
        .unwrap();
    assert_eq!(
        store.organization_quota("cove").await.unwrap(),
        Some(Default::default())
    );
    // Both kinds in one write.
    let region = cove_store::RegionQuotaRecord {
        organization_id: "cove".into(),
        region_id: "us".into(),
        max_cpu_per_sandbox: Some(2),
        updated_at_ms: 3,
        ..Default::default()
    };
    store.save_quotas("cove", &quota, &region, 3).await.unwrap();
    assert_eq!(
        store.organization_quota("cove").await.unwrap().as_ref(),
        Some(&quota)
    );
    assert_eq!(
        store.region_quota("cove", "us").await.unwrap().as_ref(),
        Some(&region)
    );
}

async fn concurrent_writes_of_many_sandboxes_all_land_with_their_meter(db: &Db) {
    let store = db.open().await;
    let writes = (0..40).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            let mut record = sandbox(&format!("id-{i}"), &format!("name-{i}"));
            record.state = SandboxState::Creating;
            store.insert_sandbox(&record).await?;
            record.state = SandboxState::Started;
            record.updated_at_ms = 2;
            store.save_sandbox(&record).await
        })
    });
    for write in futures_join(writes).await {
        write.unwrap().unwrap();
    }
    let intervals = store.meter_intervals(0, i64::MAX).await.unwrap();
    assert_eq!(intervals.len(), 80);
    assert_eq!(
        intervals.iter().filter(|i| i.ended_ms.is_none()).count(),
        40
    );
}

async fn futures_join<T>(
    handles: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<Result<T, tokio::task::JoinError>> {
    let mut results = Vec::new();
    for handle in handles.collect::<Vec<_>>() {
        results.push(handle.await);
    }
    results
}

async fn organizations_own_their_rows_and_names_are_unique_in_one_only(db: &Db) {
    let store = db.open().await;
    // Every store has the default organization.
    let listed = store.list_organizations().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, cove_store::DEFAULT_ORGANIZATION);
    let acme = cove_store::OrganizationRecord {
        id: "org-acme".into(),
        name: "Acme".into(),
        default_region_id: "local".into(),
        created_at_ms: 1,
        updated_at_ms: 1,
    };
    store.insert_organization(&acme).await.unwrap();
    let taken = store
        .insert_organization(&cove_store::OrganizationRecord {
            id: "org-other".into(),
            ..acme.clone()
        })
        .await
        .unwrap_err();
    assert!(matches!(taken, cove_store::StoreError::Duplicate { .. }));

    // One name in two organizations; twice in one is refused.
    let ours = sandbox("id-ours", "web");
    let theirs = SandboxRecord {
        id: "id-theirs".into(),
        organization_id: "org-acme".into(),
        created_at_ms: 2,
        ..sandbox("", "web")
    };
    store.insert_sandbox(&ours).await.unwrap();
    store.insert_sandbox(&theirs).await.unwrap();
    let twice = SandboxRecord {
        id: "id-twice".into(),
        ..theirs.clone()
    };
    assert!(matches!(
        store.insert_sandbox(&twice).await.unwrap_err(),
        cove_store::StoreError::Duplicate { .. }
    ));
    // A lookup in an organization finds its own, by name or id, and never
    // another's, even by id.
    let found = |org: Option<&'static str>, key: &'static str| {
        let store = store.clone();
        async move { store.find_sandbox(org, key).await.unwrap().map(|s| s.id) }
    };
    assert_eq!(
        found(Some("org-acme"), "web").await.as_deref(),
        Some("id-theirs")
    );
    assert_eq!(found(Some("cove"), "web").await.as_deref(), Some("id-ours"));
    assert_eq!(found(Some("org-acme"), "id-ours").await, None);
    assert_eq!(found(None, "id-ours").await.as_deref(), Some("id-ours"));
    assert!(store.name_taken("org-acme", "web").await.unwrap());
    assert!(!store.name_taken("org-acme", "api").await.unwrap());
    let acme_only = store
        .list_sandboxes_ordered(
            Some("org-acme"),
            SandboxOrder {
                field: SandboxSortField::Name,
                direction: SortDirection::Ascending,
            },
        )
        .await
        .unwrap();
    assert_eq!(acme_only.len(), 1);
    assert_eq!(acme_only[0].id, "id-theirs");

    // A general snapshot is seen from every organization; an own one only
    // from its own, and it wins over a general one of the same name.
    let general = SnapshotRecord {
        general: true,
        ..snapshot("g1", "base")
    };
    store.save_snapshot(&general).await.unwrap();
    let own = SnapshotRecord {
        organization_id: "org-acme".into(),
        general: false,
        ..snapshot("s-acme", "mine")
    };
    store.save_snapshot(&own).await.unwrap();
    let snap = |org: &'static str, key: &'static str| {
        let store = store.clone();
        async move {
            store
                .find_snapshot(Some(org), key)
                .await
                .unwrap()
                .map(|s| s.id)
        }
    };
    assert_eq!(snap("org-acme", "base").await.as_deref(), Some("g1"));
    assert_eq!(snap("org-acme", "mine").await.as_deref(), Some("s-acme"));
    assert_eq!(snap("cove", "mine").await, None);
    assert_eq!(snap("cove", "s-acme").await, None);

    // An organization with rows is not deleted, and says what it holds.
    let holdings = store
        .delete_organization("org-acme")
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        (holdings.sandboxes, holdings.snapshots, holdings.volumes),
        (1, 1, 0)
    );
    store.delete_sandbox("id-theirs", 3).await.unwrap();
    store.delete_snapshot("s-acme", 3).await.unwrap();
    let key = cove_store::ApiKeyRecord {
        organization_id: "org-acme".into(),
        ..key("ci", "hash-acme")
    };
    assert!(store.insert_api_key(&key).await.unwrap());
    // The same key name in another organization is another key.
    assert!(store
        .insert_api_key(&key_named("ci", "hash-cove"))
        .await
        .unwrap());
    store
        .delete_organization("org-acme")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(store.find_organization("org-acme").await.unwrap(), None);
    let keys = store.api_keys().await.unwrap();
    assert_eq!(keys.len(), 1, "its keys go with it");
    assert_eq!(keys[0].organization_id, "cove");
}

fn runner(id: &str, at_ms: i64) -> cove_store::RunnerRecord {
    cove_store::RunnerRecord {
        id: id.into(),
        name: format!("host-{id}"),
        region: "us".into(),
        classes: vec!["container".into(), "linux-vm".into()],
        accelerator: Some("tcg".into()),
        cpu: 2,
        memory_gib: 24,
        disk_gib: 100,
        app_version: "0.1.0".into(),
        unschedulable: false,
        draining: false,
        usage: cove_store::RunnerUsage::default(),
        created_at_ms: at_ms,
        updated_at_ms: at_ms,
        last_checked_ms: Some(at_ms),
        tags: Vec::new(),
        api_url: None,
        proxy_url: None,
    }
}

async fn runners_register_report_and_keep_the_operators_switches(db: &Db) {
    use cove_store::{RunnerSwitches, RunnerUsage};
    let store = db.open().await;
    let first = store.register_runner(&runner("r1", 10)).await.unwrap();
    assert_eq!(first, runner("r1", 10));
    store.register_runner(&runner("r2", 20)).await.unwrap();
    let ids = |runners: Vec<cove_store::RunnerRecord>| -> Vec<String> {
        runners.into_iter().map(|r| r.id).collect()
    };
    assert_eq!(ids(store.list_runners().await.unwrap()), ["r1", "r2"]);

    let drained = store
        .switch_runner(
            "r1",
            RunnerSwitches {
                draining: Some(true),
                ..RunnerSwitches::default()
            },
            30,
        )
        .await
        .unwrap()
        .unwrap();
    assert!(drained.draining && !drained.unschedulable);
    let both = store
        .switch_runner(
            "r1",
            RunnerSwitches {
                unschedulable: Some(true),
                ..RunnerSwitches::default()
            },
            31,
        )
        .await
        .unwrap()
        .unwrap();
    assert!(both.draining && both.unschedulable, "{both:?}");
    assert_eq!(both.updated_at_ms, 31);
    assert_eq!(
        store
            .switch_runner("nobody", RunnerSwitches::default(), 32)
            .await
            .unwrap(),
        None
    );

    let usage = RunnerUsage {
        cpu: 12.5,
        memory: 40.0,
        disk: 3.25,
    };
    assert!(store.runner_checked_in("r1", usage, 40).await.unwrap());
    assert!(!store.runner_checked_in("nobody", usage, 40).await.unwrap());
    drop(store);

    // It starts again, offering more: the switches and its creation stay.
    let store = db.open().await;
    let again = store
        .register_runner(&cove_store::RunnerRecord {
            cpu: 4,
            ..runner("r1", 50)
        })
        .await
        .unwrap();
    assert_eq!(again.cpu, 4);
    assert_eq!(again.created_at_ms, 10);
    assert_eq!(again.last_checked_ms, Some(50));
    assert!(again.draining && again.unschedulable, "{again:?}");
    let found = store.find_runner("r2").await.unwrap().unwrap();
    assert_eq!(found, runner("r2", 20));

    // Rows from before runners go to the runner that claims them.
    let mut old = sandbox("id-old", "old");
    old.runner_id = None;
    store.insert_sandbox(&old).await.unwrap();
    store
        .insert_sandbox(&sandbox("id-new", "new"))
        .await
        .unwrap();
    // An archived one is on no runner until a start places it.
    let mut archived = sandbox("id-archived", "archived");
    archived.runner_id = None;
    archived.state = SandboxState::Archived;
    store.insert_sandbox(&archived).await.unwrap();
    assert_eq!(store.claim_unplaced_sandboxes("r2").await.unwrap(), 1);
    let found = store.find_sandbox(None, "id-archived").await.unwrap();
    assert_eq!(found.unwrap().runner_id, None);
    let runner_of = |found: Option<SandboxRecord>| found.unwrap().runner_id;
    assert_eq!(
        runner_of(store.find_sandbox(None, "id-old").await.unwrap()),
        Some("r2".into())
    );
    assert_eq!(
        runner_of(store.find_sandbox(None, "id-new").await.unwrap()),
        Some("runner-1".into())
    );
}

async fn a_runner_elsewhere_is_found_by_its_token_reports_and_goes_only_when_empty_or_lost(
    db: &Db,
) {
    use cove_store::{RunnerReport, RunnerUsage};
    let store = db.open().await;
    let registered = cove_store::RunnerRecord {
        classes: Vec::new(),
        accelerator: None,
        cpu: 0,
        memory_gib: 0,
        disk_gib: 0,
        app_version: String::new(),
        last_checked_ms: None,
        tags: vec!["gpu".into(), "rack-2".into()],
        ..runner("far", 10)
    };
    assert!(store.create_runner(&registered, "hash-far").await.unwrap());
    assert!(
        !store
            .create_runner(&registered, "hash-other")
            .await
            .unwrap(),
        "the id is taken"
    );
    assert_eq!(
        store.runner_by_token("hash-far").await.unwrap(),
        Some(registered.clone())
    );
    assert_eq!(store.runner_by_token("hash-other").await.unwrap(), None);
    // The server's own runner re-registering does not touch the token.
    store.register_runner(&runner("near", 5)).await.unwrap();
    assert_eq!(
        store.runner_by_token("hash-far").await.unwrap().unwrap().id,
        "far"
    );

    let report = RunnerReport {
        classes: vec!["container".into()],
        accelerator: None,
        cpu: 16,
        memory_gib: 64,
        disk_gib: 500,
        app_version: "0.2.0".into(),
        usage: RunnerUsage {
            cpu: 5.0,
            memory: 10.0,
            disk: 1.5,
        },
        api_url: Some("http://10.0.0.2:3001".into()),
        proxy_url: None,
    };
    let reported = store
        .runner_reported("far", &report, 40)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (reported.cpu, reported.memory_gib, reported.disk_gib),
        (16, 64, 500)
    );
    assert_eq!(reported.classes, ["container"]);
    assert_eq!(reported.usage, report.usage);
    assert_eq!(reported.api_url.as_deref(), Some("http://10.0.0.2:3001"));
    assert_eq!(reported.last_checked_ms, Some(40));
    assert_eq!(reported.tags, ["gpu", "rack-2"]);
    assert_eq!(reported.created_at_ms, 10);
    assert_eq!(
        store.runner_reported("nobody", &report, 40).await.unwrap(),
        None
    );

    // A runner holding a sandbox stays; an empty one goes, token and all.
    let mut held = sandbox("id-held", "held");
    held.runner_id = Some("far".into());
    store.insert_sandbox(&held).await.unwrap();
    assert!(!store.delete_empty_runner("far").await.unwrap());
    // What it holds is found by its id, and only that.
    store
        .insert_sandbox(&sandbox("id-here", "here"))
        .await
        .unwrap();
    let on_far = store.sandboxes_on_runner("far").await.unwrap();
    assert_eq!(
        on_far.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        ["id-held"]
    );
    assert!(store
        .sandboxes_on_runner("nobody")
        .await
        .unwrap()
        .is_empty());
    store.delete_sandbox("id-held", 50).await.unwrap();
    assert!(store.delete_empty_runner("far").await.unwrap());
    assert_eq!(store.runner_by_token("hash-far").await.unwrap(), None);
    assert!(!store.delete_empty_runner("far").await.unwrap());

    // One deleted as lost goes whatever it holds; its sandboxes still
    // name it, for the engine to say what happened to them.
    assert!(store.create_runner(&registered, "hash-far").await.unwrap());
    let mut lost = sandbox("id-lost", "lost");
    lost.runner_id = Some("far".into());
    store.insert_sandbox(&lost).await.unwrap();
    assert!(store.delete_runner("far").await.unwrap());
    assert_eq!(store.runner_by_token("hash-far").await.unwrap(), None);
    let kept = store.find_sandbox(None, "id-lost").await.unwrap().unwrap();
    assert_eq!(kept.runner_id.as_deref(), Some("far"));
    assert!(!store.delete_runner("far").await.unwrap());
}

fn key_named(name: &str, hash: &str) -> cove_store::ApiKeyRecord {
    key(name, hash)
}

/// Where a case's database is: a SQLite file, or a database of its own in a
/// throw-away PostgreSQL cluster. Opening it again is a server's restart.
enum Db {
    Sqlite(tempfile::TempDir),
    Postgres(String),
}

impl Db {
    async fn open(&self) -> Store {
        match self {
            Db::Sqlite(dir) => Store::open(&dir.path().join("cove.db")).await.unwrap(),
            Db::Postgres(url) => Store::connect(url).await.unwrap(),
        }
    }
}

/// Each case runs as a test of its own on SQLite, and all of them, each on
/// a database of its own, on one PostgreSQL cluster the test starts.
macro_rules! on_both_dialects {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case(&super::Db::Sqlite(tempfile::tempdir().unwrap())).await;
                }
            )*
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn every_case_on_postgresql() {
            let Some(cluster) = cove_testenv::postgres::Postgres::start() else {
                return;
            };
            $(
                eprintln!("postgresql: {}", stringify!($case));
                $case(&Db::Postgres(cluster.database(stringify!($case)))).await;
            )*
        }
    };
}

on_both_dialects!(
    sandboxes_round_trip_and_survive_reopen,
    snapshots_and_keys,
    ssh_access_is_found_by_hash_revoked_pruned_and_goes_with_its_sandbox,
    docker_registries,
    sandboxes_list_in_any_order_with_stable_ties,
    api_keys_are_unique_by_name_and_remember_their_use,
    the_audit_log_reads_newest_first_filtered_and_paged,
    the_meter_splits_at_every_change_in_the_same_write_and_survives_reopen,
    a_users_snapshot_is_metered_while_active_and_the_servers_own_are_not,
    a_region_quota_is_kept_and_replaced_whole,
    an_organizations_rate_limits_are_kept_and_replaced,
    concurrent_writes_of_many_sandboxes_all_land_with_their_meter,
    organizations_own_their_rows_and_names_are_unique_in_one_only,
    runners_register_report_and_keep_the_operators_switches,
    a_runner_elsewhere_is_found_by_its_token_reports_and_goes_only_when_empty_or_lost,
);
