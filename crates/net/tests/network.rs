//! The sandbox network against a fake internet on this machine (see `common`):
//! real namespaces, links, routes and nftables. Needs root and `nft`; skipped
//! with the reason otherwise, or failed under `COVE_TEST_STRICT=1`. Each test has its own bridge, range, routing table
//! and fake internet, so they run in parallel.

mod common;

use std::net::{Ipv4Addr, TcpListener};
use std::time::{Duration, Instant};

use common::{
    http_get, inside, resolve, resolve_tcp, World, ALLOWED_IP, DENIED_IP, METADATA_IP, PRIVATE_IP,
};
use cove_net::{Deletion, Link, LinkKind, NetError, Policy, PolicyError};
use hickory_proto::op::ResponseCode;

fn cidr(text: &str) -> cove_net::Ipv4Net {
    Policy::parse_cidr(text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_sandbox_resolves_and_reaches_the_internet() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let attachment = network.attach("open", &Policy::default()).await.unwrap();
    assert!(world.config.range.contains(&attachment.address));
    assert_eq!(attachment.gateway, world.config.gateway());
    assert_eq!(
        attachment.resolv_conf,
        format!("nameserver {}\n", world.config.gateway())
    );

    let gateway = attachment.gateway;
    let (allowed, denied, unknown, addresses) =
        inside(attachment.netns_path().unwrap(), move || {
            let addresses = std::fs::read_to_string("/proc/net/fib_trie").unwrap_or_default();
            (
                resolve(gateway, "allowed.test"),
                http_get(DENIED_IP, 80),
                resolve(gateway, "nothing.test"),
                addresses,
            )
        })
        .await;
    assert_eq!(allowed.unwrap(), (ResponseCode::NoError, vec![ALLOWED_IP]));
    assert_eq!(unknown.unwrap().0, ResponseCode::NXDomain);
    assert_eq!(
        denied.unwrap(),
        "denied",
        "an open sandbox reaches any address"
    );
    assert!(addresses.contains(&attachment.address.to_string()));
    let body = inside(attachment.netns_path().unwrap(), || {
        http_get(ALLOWED_IP, 80)
    })
    .await;
    assert_eq!(body.unwrap(), "allowed");

    network.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_all_lets_nothing_out() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let policy = Policy {
        block_all: true,
        ..Policy::default()
    };
    let attachment = network.attach("blocked", &policy).await.unwrap();
    let gateway = attachment.gateway;
    let (allowed, denied, dns) = inside(attachment.netns_path().unwrap(), move || {
        (
            http_get(ALLOWED_IP, 80),
            http_get(DENIED_IP, 80),
            resolve(gateway, "allowed.test"),
        )
    })
    .await;
    assert!(allowed.is_err(), "{allowed:?}");
    assert!(denied.is_err(), "{denied:?}");
    assert_eq!(dns.unwrap(), (ResponseCode::Refused, vec![]));
    assert!(
        world.dns_log.lock().unwrap().is_empty(),
        "a blocked sandbox's query reached upstream"
    );
    network.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allow_list_of_cidrs_lets_only_those_through() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let policy = Policy {
        allow_cidrs: vec![cidr("198.51.100.0/24")],
        ..Policy::default()
    };
    let attachment = network.attach("cidrs", &policy).await.unwrap();
    let (allowed, denied) = inside(attachment.netns_path().unwrap(), || {
        (http_get(ALLOWED_IP, 80), http_get(DENIED_IP, 80))
    })
    .await;
    assert_eq!(allowed.unwrap(), "allowed");
    assert!(denied.is_err(), "{denied:?}");

    // A deny list wins over the allow list.
    let policy = Policy {
        deny_cidrs: vec![cidr("198.51.100.10")],
        ..policy
    };
    network.set_policy("cidrs", &policy).await.unwrap();
    let allowed = inside(attachment.netns_path().unwrap(), || {
        http_get(ALLOWED_IP, 80)
    })
    .await;
    assert!(allowed.is_err(), "{allowed:?}");
    network.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_domain_allow_list_admits_only_what_allowed_names_resolve_to() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let policy = Policy {
        allow_domains: vec!["allowed.test".into()],
        ..Policy::default()
    };
    let attachment = network.attach("domains", &policy).await.unwrap();
    let gateway = attachment.gateway;
    let outcome = inside(attachment.netns_path().unwrap(), move || {
        let before = http_get(ALLOWED_IP, 80);
        let allowed = resolve(gateway, "allowed.test");
        let after = http_get(ALLOWED_IP, 80);
        let denied = resolve(gateway, "denied.test");
        let direct = http_get(DENIED_IP, 80);
        (before, allowed, after, denied, direct)
    })
    .await;
    let (before, allowed, after, denied, direct) = outcome;
    assert!(
        before.is_err(),
        "reachable before its name resolved: {before:?}"
    );
    assert_eq!(allowed.unwrap(), (ResponseCode::NoError, vec![ALLOWED_IP]));
    assert_eq!(after.unwrap(), "allowed");
    assert_eq!(denied.unwrap(), (ResponseCode::NXDomain, vec![]));
    assert!(direct.is_err(), "{direct:?}");
    assert_eq!(
        *world.dns_log.lock().unwrap(),
        vec!["allowed.test".to_string()],
        "only the allowed name may be forwarded"
    );
    let tables = world.nft_tables();
    assert!(
        tables.contains(&format!("{} . {ALLOWED_IP} timeout", attachment.address)),
        "{tables}"
    );

    // The C library, reading the resolv.conf cove gives sandboxes.
    let resolv_conf = world.state.join("resolv.conf");
    std::fs::write(&resolv_conf, &attachment.resolv_conf).unwrap();
    let getent = |name: &str| {
        let script = format!(
            "mount --bind {} /etc/resolv.conf && getent ahostsv4 {name}",
            resolv_conf.display()
        );
        let output = std::process::Command::new("nsenter")
            .arg(format!(
                "--net={}",
                attachment.netns_path().unwrap().display()
            ))
            .args(["unshare", "--mount", "sh", "-c", &script])
            .output()
            .unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    };
    let (code, hosts) = getent("allowed.test");
    assert_eq!(code, Some(0), "{hosts}");
    assert!(hosts.contains(&ALLOWED_IP.to_string()), "{hosts}");
    let (code, hosts) = getent("denied.test");
    assert_eq!(code, Some(2), "getent: not found; {hosts}");
    world
        .dns_log
        .lock()
        .unwrap()
        .retain(|name| name != "allowed.test");

    // Over TCP too, which is forwarded over TCP.
    let (allowed, denied) = inside(attachment.netns_path().unwrap(), move || {
        (
            resolve_tcp(gateway, "allowed.test"),
            resolve_tcp(gateway, "denied.test"),
        )
    })
    .await;
    assert_eq!(allowed.unwrap(), (ResponseCode::NoError, vec![ALLOWED_IP]));
    assert_eq!(denied.unwrap(), (ResponseCode::NXDomain, vec![]));
    assert_eq!(
        *world.dns_log.lock().unwrap(),
        vec!["allowed.test".to_string()]
    );

    // Wildcards cover names below the suffix.
    let policy = Policy {
        allow_domains: vec!["*.test".into()],
        ..Policy::default()
    };
    network.set_policy("domains", &policy).await.unwrap();
    let (denied, direct) = inside(attachment.netns_path().unwrap(), move || {
        (resolve(gateway, "denied.test"), http_get(DENIED_IP, 80))
    })
    .await;
    assert_eq!(denied.unwrap(), (ResponseCode::NoError, vec![DENIED_IP]));
    assert_eq!(direct.unwrap(), "denied");
    network.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_reach_neither_each_other_nor_the_host() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let a = network.attach("a", &Policy::default()).await.unwrap();
    let b = network.attach("b", &Policy::default()).await.unwrap();
    assert_ne!(a.address, b.address);

    // A server in b, which the host can reach (as a preview proxy will).
    let b_address = b.address;
    let listener = inside(b.netns_path().unwrap(), move || {
        TcpListener::bind((b_address, 8080)).unwrap()
    })
    .await;
    let serve = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut stream, _) = listener.accept().unwrap();
        let mut request = [0u8; 1024];
        let _ = stream.read(&mut request);
        let _ = stream.write_all(b"HTTP/1.0 200 OK\r\n\r\nfrom b");
    });
    assert_eq!(http_get(b_address, 8080).unwrap(), "from b");
    serve.join().unwrap();
    let listener = inside(b.netns_path().unwrap(), move || {
        TcpListener::bind((b_address, 8081)).unwrap()
    })
    .await;

    // Host services on the gateway and on the uplink address.
    let gateway = world.config.gateway();
    let host_uplink = Ipv4Addr::from(u32::from(world.config.uplink.gateway) - 1);
    let on_gateway = TcpListener::bind((gateway, 8082)).unwrap();
    let on_uplink = TcpListener::bind((host_uplink, 8083)).unwrap();

    let (to_b, to_gateway, to_uplink, internet) = inside(a.netns_path().unwrap(), move || {
        (
            http_get(b_address, 8081),
            http_get(gateway, 8082),
            http_get(host_uplink, 8083),
            http_get(ALLOWED_IP, 80),
        )
    })
    .await;
    assert!(to_b.is_err(), "a reached b: {to_b:?}");
    assert!(
        to_gateway.is_err(),
        "a reached the host on the gateway: {to_gateway:?}"
    );
    assert!(
        to_uplink.is_err(),
        "a reached the host's uplink address: {to_uplink:?}"
    );
    assert_eq!(internet.unwrap(), "allowed");
    drop((listener, on_gateway, on_uplink));
    network.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_changes_apply_to_a_running_sandbox() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let attachment = network.attach("live", &Policy::default()).await.unwrap();
    let path = attachment.netns_path().unwrap().to_path_buf();
    let reach = || {
        let path = path.clone();
        async move {
            inside(&path, || {
                (
                    http_get(ALLOWED_IP, 80).is_ok(),
                    http_get(DENIED_IP, 80).is_ok(),
                )
            })
            .await
        }
    };
    assert_eq!(reach().await, (true, true));

    let changed = Instant::now();
    network
        .set_policy(
            "live",
            &Policy {
                block_all: true,
                ..Policy::default()
            },
        )
        .await
        .unwrap();
    eprintln!("set_policy took {:?}", changed.elapsed());
    assert_eq!(reach().await, (false, false));

    network
        .set_policy(
            "live",
            &Policy {
                allow_cidrs: vec![cidr("203.0.113.0/24")],
                ..Policy::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(reach().await, (false, true));

    network
        .set_policy("live", &Policy::default())
        .await
        .unwrap();
    assert_eq!(reach().await, (true, true));

    let missing = network.set_policy("nobody", &Policy::default()).await;
    assert!(
        matches!(missing, Err(NetError::NotAttached { .. })),
        "{missing:?}"
    );
    network.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_policies_are_refused_naming_the_entry_and_make_nothing() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let bad_domain = Policy {
        allow_domains: vec!["ok.test".into(), "bad..test".into()],
        ..Policy::default()
    };
    match network.attach("bad", &bad_domain).await {
        Err(NetError::Policy(PolicyError::InvalidDomain { value, .. })) => {
            assert_eq!(value, "bad..test")
        }
        other => panic!("{other:?}"),
    }
    let err = Policy::parse_cidr_list("10.0.0.0/8,10.0.0.300/32").unwrap_err();
    assert!(err.to_string().contains("10.0.0.300/32"), "{err}");
    let host_bits = Policy {
        allow_cidrs: vec!["10.1.2.3/8".parse().unwrap()],
        ..Policy::default()
    };
    let err = network.attach("bad", &host_bits).await.unwrap_err();
    assert!(err.to_string().contains("10.1.2.3/8"), "{err}");
    assert!(world.netns_files().is_empty());
    assert!(network.attached().is_empty());

    // A good sandbox whose live change is bad keeps its policy.
    let attachment = network
        .attach(
            "good",
            &Policy {
                allow_cidrs: vec![cidr("198.51.100.0/24")],
                ..Policy::default()
            },
        )
        .await
        .unwrap();
    assert!(network.set_policy("good", &bad_domain).await.is_err());
    let allowed = inside(attachment.netns_path().unwrap(), || {
        http_get(ALLOWED_IP, 80)
    })
    .await;
    assert_eq!(allowed.unwrap(), "allowed");
    network.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_and_shutdown_leave_nothing_behind() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let policy = Policy {
        allow_cidrs: vec![cidr("198.51.100.0/24")],
        deny_cidrs: vec![cidr("198.51.100.99")],
        allow_domains: vec!["allowed.test".into()],
        block_all: false,
    };
    let attachment = network.attach("gone", &policy).await.unwrap();
    let keep = network.attach("kept", &Policy::default()).await.unwrap();
    let gateway = attachment.gateway;
    let resolved = inside(attachment.netns_path().unwrap(), move || {
        resolve(gateway, "allowed.test")
    })
    .await;
    assert_eq!(resolved.unwrap().1, vec![ALLOWED_IP]);
    let address = attachment.address.to_string();
    assert!(world.nft_tables().contains(&address));
    assert!(world.link_exists(&attachment.host_link));

    network.detach("gone", Deletion::Now).await.unwrap();
    let tables = world.nft_tables();
    assert!(!tables.contains(&address), "elements left: {tables}");
    assert!(!tables.contains(&attachment.host_link), "{tables}");
    assert!(tables.contains(&keep.address.to_string()), "{tables}");
    assert!(!world.link_exists(&attachment.host_link));
    assert!(world.link_exists(&keep.host_link));
    assert_eq!(world.netns_files(), vec!["kept".to_string()]);
    assert!(!attachment.netns_path().unwrap().exists());
    assert_eq!(world.mounts_under_state().len(), 1);
    network.detach("gone", Deletion::Now).await.unwrap(); // again: nothing to do

    // The address is kept for the next attach, and given up by release.
    let again = network.attach("gone", &Policy::default()).await.unwrap();
    assert_eq!(again.address, attachment.address);
    network.release("gone").await.unwrap();
    let other = network.attach("other", &Policy::default()).await.unwrap();
    assert_eq!(other.address, attachment.address, "the lowest free address");
    // A port still being deleted when the shutdown comes is waited for.
    network.attach("soon", &Policy::default()).await.unwrap();
    network.detach("soon", Deletion::Background).await.unwrap();

    network.shutdown().await.unwrap();
    assert!(world.links().is_empty(), "{:?}", world.links());
    assert_eq!(world.nft_tables(), "");
    assert_eq!(world.rules(), "");
    assert_eq!(world.routes(), "");
    assert!(world.netns_files().is_empty());
    assert!(world.mounts_under_state().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_removes_leftovers_and_keeps_addresses() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let first = network.attach("first", &Policy::default()).await.unwrap();
    let second = network.attach("second", &Policy::default()).await.unwrap();
    let old_ports: Vec<String> = [&first, &second]
        .iter()
        .map(|a| world.ifindex(&a.host_link).expect("the port exists"))
        .collect();
    // The server dies without cleaning up.
    drop(network);
    assert_eq!(world.netns_files().len(), 2);

    let network = world.network().await;
    assert!(world.netns_files().is_empty());
    let indexes: Vec<String> = world
        .links()
        .iter()
        .filter_map(|l| world.ifindex(l))
        .collect();
    for old in &old_ports {
        assert!(!indexes.contains(old), "port {old} survived the restart");
    }
    let tables = world.nft_tables();
    assert!(!tables.contains(&second.address.to_string()), "{tables}");

    let again = network.attach("second", &Policy::default()).await.unwrap();
    assert_eq!(again.address, second.address);
    let body = inside(again.netns_path().unwrap(), || http_get(ALLOWED_IP, 80)).await;
    assert_eq!(body.unwrap(), "allowed");
    network.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_network_on_the_same_bridge_is_refused_and_changes_nothing() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let kept = network.attach("kept", &Policy::default()).await.unwrap();
    // A second server started with the same settings: refused before it
    // clears anything as "left by a previous run".
    let error = world.try_network().await.unwrap_err().to_string();
    assert!(error.contains("in use by another cove server"), "{error}");
    assert!(world.link_exists(&kept.host_link));
    assert_eq!(world.netns_files(), vec!["kept".to_string()]);
    let body = inside(kept.netns_path().unwrap(), || http_get(ALLOWED_IP, 80)).await;
    assert_eq!(body.unwrap(), "allowed");
    network.shutdown().await.unwrap();
    // Once it is gone, the bridge is free again.
    drop(network);
    let again = world.network().await;
    again.shutdown().await.unwrap();
}

/// Not a check: prints how long attach and detach take (median of 20).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_latency() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let policy = Policy {
        allow_cidrs: vec![cidr("198.51.100.0/24")],
        allow_domains: vec!["allowed.test".into()],
        ..Policy::default()
    };
    let mut attach = Vec::new();
    let mut detach = Vec::new();
    for i in 0..21 {
        let id = format!("bench{i}");
        let began = Instant::now();
        network.attach(&id, &policy).await.unwrap();
        attach.push(began.elapsed());
        let began = Instant::now();
        network.release(&id).await.unwrap();
        detach.push(began.elapsed());
        // Sandboxes made one at a time, as a steady load makes them: the pool
        // refills in between (back to back, attaches would wait for it).
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The first includes warming up (page faults, first netns of the run).
    let median = |times: &mut Vec<Duration>| {
        times.remove(0);
        times.sort();
        times[times.len() / 2]
    };
    eprintln!(
        "one at a time: attach median {:?}, detach median {:?} (20 runs)",
        median(&mut attach),
        median(&mut detach)
    );

    // A burst: the pool runs dry and most namespaces are made on demand.
    let mut burst = Vec::new();
    for i in 0..21 {
        let began = Instant::now();
        network.attach(&format!("burst{i}"), &policy).await.unwrap();
        burst.push(began.elapsed());
    }
    eprintln!(
        "back to back: attach median {:?} (20 runs, pool of {})",
        median(&mut burst),
        world.config.netns_pool
    );
    network.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_uplink_is_found_from_the_hosts_default_route() {
    if !common::can_run() {
        return;
    }
    let shown = std::process::Command::new("ip")
        .args(["-4", "route", "show", "default", "table", "main"])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    let words: Vec<&str> = shown.split_whitespace().collect();
    let expected = words
        .iter()
        .position(|w| *w == "via")
        .zip(words.iter().position(|w| *w == "dev"))
        .map(|(via, dev)| (words[via + 1].to_owned(), words[dev + 1].to_owned()));
    match (cove_net::Uplink::detect().await, expected) {
        (Ok(uplink), Some((gateway, interface))) => {
            assert_eq!(uplink.gateway.to_string(), gateway);
            assert_eq!(uplink.interface, interface);
        }
        (Err(err), None) => assert!(err.to_string().contains("default route"), "{err}"),
        (found, expected) => panic!("found {found:?}, ip shows {expected:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_gets_an_isolated_tap_port_that_detach_removes() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let policy = Policy {
        block_all: true,
        ..Policy::default()
    };
    let attachment = network
        .attach_as("vm", &policy, LinkKind::Tap)
        .await
        .unwrap();
    let Link::Tap(device) = &attachment.link else {
        panic!("a VM's link is a TAP device: {attachment:?}");
    };
    assert_eq!(device, &attachment.host_link);
    assert!(attachment.netns_path().is_none());
    assert!(world.config.range.contains(&attachment.address));
    let mac = attachment.guest_mac();
    assert_eq!(mac, attachment.mac);
    assert_eq!(mac[0] & 0x03, 0x02, "locally administered, unicast");
    let sys = std::path::Path::new("/sys/class/net").join(device);
    // A TAP device (tun_flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR, persistent),
    // an isolated port of this world's bridge, up.
    let flags = std::fs::read_to_string(sys.join("tun_flags")).unwrap();
    let flags = u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16).unwrap();
    assert_eq!(flags & 0x5002, 0x5002, "{flags:#x}");
    let master = std::fs::read_link(sys.join("master")).unwrap();
    assert_eq!(
        master.file_name().unwrap().to_str().unwrap(),
        world.config.bridge
    );
    assert_eq!(
        std::fs::read_to_string(sys.join("brport/isolated"))
            .unwrap()
            .trim(),
        "1"
    );
    assert_port_pinned(&world, device, mac);
    let tables = world.nft_tables();
    assert!(tables.contains(device.as_str()), "{tables}");
    assert!(tables.contains(&attachment.address.to_string()), "{tables}");
    // Attaching again answers the same TAP device.
    let again = network
        .attach_as("vm", &policy, LinkKind::Tap)
        .await
        .unwrap();
    assert_eq!(again, attachment);

    // A paused VM is detached at once, its port deleted in the background:
    // off the firewall and the neighbour table when the detach returns.
    network.detach("vm", Deletion::Background).await.unwrap();
    let tables = world.nft_tables();
    assert!(!tables.contains(device.as_str()), "{tables}");
    assert!(
        !tables.contains(&attachment.address.to_string()),
        "{tables}"
    );
    assert!(network.attached().is_empty());
    // Its saved memory holds the NIC's MAC, so it gets the same one when it
    // resumes, on a port of another name (whatever the deletion's progress).
    let resumed = network
        .attach_as("vm", &policy, LinkKind::Tap)
        .await
        .unwrap();
    assert_eq!(resumed.guest_mac(), mac);
    assert_eq!(resumed.address, attachment.address);
    assert_ne!(resumed.host_link, *device);
    network.retired().await;
    assert!(!world.link_exists(device));
    assert!(world.link_exists(&resumed.host_link));
    network.detach("vm", Deletion::Now).await.unwrap();
    assert!(!world.link_exists(&resumed.host_link));
    let tables = world.nft_tables();
    assert!(!tables.contains(device.as_str()), "{tables}");
    assert!(
        !tables.contains(&attachment.address.to_string()),
        "{tables}"
    );
    assert!(world.netns_files().is_empty());
}

/// The port learns nothing, floods no unicast to it, and has `mac` as a
/// static, sticky forwarding entry.
fn assert_port_pinned(world: &World, port: &str, mac: [u8; 6]) {
    let brport = std::path::Path::new("/sys/class/net")
        .join(port)
        .join("brport");
    for (flag, expected) in [("isolated", "1"), ("learning", "0"), ("unicast_flood", "0")] {
        let value = std::fs::read_to_string(brport.join(flag)).unwrap();
        assert_eq!(value.trim(), expected, "{port}: {flag}");
    }
    let text = mac_text(mac);
    let entries = world.fdb_entries(&text);
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = &entries[0];
    assert!(entry.contains(&format!("dev {port} ")), "{entry}");
    assert!(entry.contains("static"), "{entry}");
    assert!(entry.contains("sticky"), "{entry}");
}

fn mac_text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The attack: a sandbox asks for the cloud host's credentials at
/// 169.254.169.254, or for a host on its private network or its LAN, and the
/// host's NAT would carry it there as the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sandbox_reaches_the_metadata_service_or_the_hosts_private_world() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let open = network.attach("open", &Policy::default()).await.unwrap();
    let lan = world.uplink_neighbour();
    let (metadata, private, neighbour, public) = inside(open.netns_path().unwrap(), move || {
        (
            http_get(METADATA_IP, 80),
            http_get(PRIVATE_IP, 80),
            http_get(lan, 80),
            http_get(ALLOWED_IP, 80),
        )
    })
    .await;
    assert!(
        metadata.is_err(),
        "reached the metadata service: {metadata:?}"
    );
    assert!(private.is_err(), "reached a private host: {private:?}");
    assert!(
        neighbour.is_err(),
        "reached the uplink's LAN: {neighbour:?}"
    );
    assert_eq!(public.unwrap(), "allowed", "the internet stays reachable");

    // A policy naming them opens nothing: the fixed deny comes first.
    let policy = Policy {
        allow_cidrs: vec![
            cidr("169.254.169.254/32"),
            cidr("192.168.0.0/16"),
            cidr("198.51.100.0/24"),
        ],
        ..Policy::default()
    };
    let listed = network.attach("listed", &policy).await.unwrap();
    let (metadata, private, public) = inside(listed.netns_path().unwrap(), || {
        (
            http_get(METADATA_IP, 80),
            http_get(PRIVATE_IP, 80),
            http_get(ALLOWED_IP, 80),
        )
    })
    .await;
    assert!(
        metadata.is_err(),
        "an allow list opened the metadata service: {metadata:?}"
    );
    assert!(
        private.is_err(),
        "an allow list opened a private host: {private:?}"
    );
    assert_eq!(public.unwrap(), "allowed");
    // The server itself still answers from there: the fake is up.
    assert_eq!(
        inside(
            std::path::Path::new(&format!("/run/netns/fakenet-{}", world.tag)),
            || { http_get(METADATA_IP, 80) }
        )
        .await
        .unwrap(),
        "metadata"
    );
    network.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opened_private_range_is_reachable_by_each_sandboxs_policy() {
    if !common::can_run() {
        return;
    }
    let mut world = World::new();
    world.config.allow_private_egress = vec![cidr("192.168.77.0/24")];
    let network = world.network().await;
    let open = network.attach("open", &Policy::default()).await.unwrap();
    let (private, metadata) = inside(open.netns_path().unwrap(), || {
        (http_get(PRIVATE_IP, 80), http_get(METADATA_IP, 80))
    })
    .await;
    assert_eq!(private.unwrap(), "private", "the operator opened it");
    assert!(metadata.is_err(), "only what was opened: {metadata:?}");

    // The sandbox's own policy still applies to an opened range.
    let policy = Policy {
        allow_cidrs: vec![cidr("198.51.100.0/24")],
        ..Policy::default()
    };
    let restricted = network.attach("restricted", &policy).await.unwrap();
    let private = inside(restricted.netns_path().unwrap(), || {
        http_get(PRIVATE_IP, 80)
    })
    .await;
    assert!(private.is_err(), "not on its allow list: {private:?}");
    let policy = Policy {
        allow_cidrs: vec![cidr("192.168.77.5")],
        ..Policy::default()
    };
    network.set_policy("restricted", &policy).await.unwrap();
    let private = inside(restricted.netns_path().unwrap(), || {
        http_get(PRIVATE_IP, 80)
    })
    .await;
    assert_eq!(private.unwrap(), "private");
    network.shutdown().await.unwrap();
}

/// The attack: an allowed name whose records point at the host's world
/// (DNS rebinding, or a name the sandbox's owner controls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_name_resolving_to_a_closed_address_opens_nothing() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let policy = Policy {
        allow_domains: vec![
            "metadata.test".into(),
            "private.test".into(),
            "allowed.test".into(),
        ],
        ..Policy::default()
    };
    let attachment = network.attach("rebind", &policy).await.unwrap();
    let gateway = attachment.gateway;
    let (metadata_name, private_name, metadata, private, allowed_name, allowed) =
        inside(attachment.netns_path().unwrap(), move || {
            (
                resolve(gateway, "metadata.test"),
                resolve(gateway, "private.test"),
                http_get(METADATA_IP, 80),
                http_get(PRIVATE_IP, 80),
                resolve(gateway, "allowed.test"),
                http_get(ALLOWED_IP, 80),
            )
        })
        .await;
    // The records are answered as upstream gave them ...
    assert_eq!(
        metadata_name.unwrap(),
        (ResponseCode::NoError, vec![METADATA_IP])
    );
    assert_eq!(
        private_name.unwrap(),
        (ResponseCode::NoError, vec![PRIVATE_IP])
    );
    // ... but nothing is admitted, and nothing is reachable.
    assert!(metadata.is_err(), "{metadata:?}");
    assert!(private.is_err(), "{private:?}");
    let tables = world.nft_tables();
    assert!(!tables.contains(&METADATA_IP.to_string()), "{tables}");
    assert!(!tables.contains(&format!(". {PRIVATE_IP}")), "{tables}");
    assert_eq!(allowed_name.unwrap().1, vec![ALLOWED_IP]);
    assert_eq!(allowed.unwrap(), "allowed");
    network.shutdown().await.unwrap();
}

/// The attack: a sandbox (it keeps CAP_NET_RAW) sends frames from another
/// sandbox's MAC, so that a learning bridge sends that sandbox's traffic to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spoofed_mac_moves_no_traffic_on_the_bridge() {
    if !common::can_run() {
        return;
    }
    let world = World::new();
    let network = world.network().await;
    let a = network.attach("a", &Policy::default()).await.unwrap();
    let b = network.attach("b", &Policy::default()).await.unwrap();
    let a_mac = common::parse_mac(&common::eth0_mac(a.netns_path().unwrap()));
    assert_eq!(a_mac, a.mac, "eth0 has the MAC the network chose");
    assert_port_pinned(&world, &a.host_link, a.mac);
    assert_port_pinned(&world, &b.host_link, b.mac);

    // A server in a that the host talks to before and after: the host's
    // neighbour entry for a stays fresh, so after the spoofing its frames go
    // wherever the bridge says a's MAC is, with no new ARP to correct it.
    let a_address = a.address;
    let listener = inside(a.netns_path().unwrap(), move || {
        TcpListener::bind((a_address, 8080)).unwrap()
    })
    .await;
    let serve = std::thread::spawn(move || {
        use std::io::{Read, Write};
        for _ in 0..2 {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request);
            let _ = stream.write_all(b"HTTP/1.0 200 OK\r\n\r\nfrom a");
        }
    });
    assert_eq!(http_get(a_address, 8080).unwrap(), "from a");

    // b sends from a's MAC, with its own address (which an address check
    // alone lets through) and with a's.
    let bridge_mac = common::parse_mac(
        &std::fs::read_to_string(format!("/sys/class/net/{}/address", world.tag)).unwrap(),
    );
    let (gateway, b_address) = (a.gateway, b.address);
    inside(b.netns_path().unwrap(), move || {
        for source in [b_address, a_address] {
            for _ in 0..5 {
                common::send_frame(&common::udp_frame(a_mac, bridge_mac, source, gateway))
                    .expect("send a raw frame");
            }
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let entries = world.fdb_entries(&mac_text(a.mac));
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert!(
        entries[0].contains(&format!("dev {} ", a.host_link)),
        "a's MAC moved: {entries:?}"
    );
    // The host's traffic for a still reaches a.
    assert_eq!(http_get(a_address, 8080).unwrap(), "from a");
    serve.join().unwrap();
    network.shutdown().await.unwrap();
}
