//! The firewall: two nftables tables named after the bridge, loaded once at
//! start with `nft -f -`, and set elements keyed by sandbox address that carry
//! every per-sandbox rule, changed over netlink (`elements`) in microseconds.
//!
//! - `inet` table: NAT to the uplink; the sandboxes' forwarded traffic goes only
//!   to the uplink, never to the sandbox range nor to the host's world (the
//!   fixed `closed` set, see `closed.rs`, before any allow set), and passes
//!   the policy sets (`blocked`, `denied`, `allowed`, `learned`,
//!   `restricted`); traffic from the
//!   bridge to the host itself is dropped except DNS to the gateway; nothing may
//!   open a connection into a sandbox through the host.
//! - `bridge` table: a frame from a sandbox's port must carry that sandbox's
//!   MAC and IPv4 address (`ports`; in ARP, as sender too), since a sandbox
//!   that can send raw packets (a VM's root can; containers no longer keep
//!   CAP_NET_RAW) could otherwise borrow another sandbox's policy by spoofing
//!   its address, or its traffic by spoofing its MAC.

pub(crate) mod elements;

use std::net::Ipv4Addr;
use std::process::Stdio;
use std::sync::Mutex;

use ipnet::Ipv4Net;
use tokio::io::AsyncWriteExt;

use crate::closed::ClosedRanges;
use crate::config::NetworkConfig;
use crate::policy::CompiledPolicy;
use crate::NetError;
use elements::{BatchError, Change, Element, ElementSocket, Family, SetChange};

pub(crate) const BLOCKED: &str = "blocked";
pub(crate) const RESTRICTED: &str = "restricted";
pub(crate) const ALLOWED: &str = "allowed";
pub(crate) const DENIED: &str = "denied";
pub(crate) const LEARNED: &str = "learned";
pub(crate) const PORTS: &str = "ports";
pub(crate) const CLOSED: &str = "closed";
/// `a . b` for every pair of linked sandboxes, both ways round.
pub(crate) const LINKED: &str = "linked";

/// The whole ruleset of one network. Deleting the tables first (after making
/// sure they exist, so the delete cannot fail) makes loading it idempotent and
/// clears the elements of a previous run in the same transaction. `closed`
/// is fixed for the network's life, so it is written here, not over netlink.
pub(crate) fn ruleset(config: &NetworkConfig, closed: &ClosedRanges) -> String {
    let table = config.table();
    let bridge = &config.bridge;
    let uplink = &config.uplink.interface;
    let range = config.range;
    let gateway = config.gateway();
    let ports = config.port_pattern();
    let closed_elements = if closed.nets().is_empty() {
        String::new()
    } else {
        let nets: Vec<String> = closed.nets().iter().map(|n| n.to_string()).collect();
        format!(" elements = {{ {} }};", nets.join(", "))
    };
    format!(
        r#"table inet {table} {{}}
delete table inet {table}
table bridge {table} {{}}
delete table bridge {table}
table inet {table} {{
    set {BLOCKED} {{ type ipv4_addr; }}
    set {RESTRICTED} {{ type ipv4_addr; }}
    set {ALLOWED} {{ type ipv4_addr . ipv4_addr; flags interval; }}
    set {DENIED} {{ type ipv4_addr . ipv4_addr; flags interval; }}
    set {LEARNED} {{ type ipv4_addr . ipv4_addr; flags timeout; }}
    set {CLOSED} {{ type ipv4_addr; flags interval;{closed_elements} }}
    set {LINKED} {{ type ipv4_addr . ipv4_addr; }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "{bridge}" oifname "{bridge}" ip saddr . ip daddr @{LINKED} accept
        iifname "{bridge}" jump egress
        oifname "{bridge}" ct state established,related accept
        oifname "{bridge}" drop
    }}
    chain egress {{
        meta nfproto ipv6 drop
        oifname != "{uplink}" drop
        ip daddr {range} drop
        ip daddr @{CLOSED} drop
        ip saddr @{BLOCKED} drop
        ip saddr . ip daddr @{DENIED} drop
        ip saddr . ip daddr @{ALLOWED} accept
        ip saddr . ip daddr @{LEARNED} accept
        ip saddr @{RESTRICTED} drop
    }}
    chain output {{
        type filter hook output priority filter; policy accept;
        oifname "{bridge}" icmp type redirect drop
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "{bridge}" jump from_sandbox
    }}
    chain from_sandbox {{
        ct state established,related accept
        ip daddr {gateway} udp dport 53 accept
        ip daddr {gateway} tcp dport 53 accept
        drop
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {range} oifname "{uplink}" masquerade
    }}
}}
table bridge {table} {{
    set {PORTS} {{ type ifname . ether_addr . ipv4_addr; }}
    chain prerouting {{
        type filter hook prerouting priority filter; policy accept;
        iifname != "{ports}" accept
        iifname . ether saddr . ip saddr @{PORTS} accept
        iifname . ether saddr . arp saddr ip @{PORTS} iifname . arp saddr ether . arp saddr ip @{PORTS} accept
        drop
    }}
}}
"#
    )
}

/// Deletes both tables; a missing table is not an error.
pub(crate) fn teardown(config: &NetworkConfig) -> String {
    let table = config.table();
    format!(
        "table inet {table} {{}}\ndelete table inet {table}\n\
         table bridge {table} {{}}\ndelete table bridge {table}\n"
    )
}

/// Runs `nft -f -` with `script` on stdin. Only at start and shutdown.
pub(crate) async fn run_nft(script: &str) -> Result<(), NetError> {
    let failed = |reason: String| NetError::Nft {
        action: "load the ruleset with nft -f -".into(),
        reason,
    };
    let mut child = tokio::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(NetError::io(
            "run nft -f - (is the nftables package installed?)",
        ))?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let written = stdin.write_all(script.as_bytes()).await;
    drop(stdin);
    let output = child
        .wait_with_output()
        .await
        .map_err(NetError::io("wait for nft -f -"))?;
    written.map_err(NetError::io("write the ruleset to nft -f -"))?;
    if !output.status.success() {
        return Err(failed(format!(
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(())
}

/// The element socket, shared by attach, detach, policy changes and the resolver.
#[derive(Debug)]
pub(crate) struct Firewall {
    table: String,
    socket: Mutex<ElementSocket>,
}

impl Firewall {
    pub(crate) fn open(config: &NetworkConfig) -> Result<Self, NetError> {
        let socket = ElementSocket::open().map_err(|source| NetError::Io {
            action: "open an nftables netlink socket".into(),
            source,
        })?;
        Ok(Self {
            table: config.table().to_owned(),
            socket: Mutex::new(socket),
        })
    }

    pub(crate) fn apply(&self, changes: &[Changes]) -> Result<(), BatchError> {
        let messages: Vec<SetChange<'_>> = changes
            .iter()
            .map(|c| SetChange {
                change: c.change,
                family: c.family,
                table: &self.table,
                set: c.set,
                elements: c.elements.clone(),
            })
            .collect();
        self.socket
            .lock()
            .expect("nft socket lock")
            .apply(&messages)
    }
}

/// Elements to add to or delete from one set of this network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Changes {
    pub change: Change,
    pub family: Family,
    pub set: &'static str,
    pub elements: Vec<Element>,
}

impl Changes {
    fn inet(change: Change, set: &'static str, elements: Vec<Element>) -> Self {
        Self {
            change,
            family: Family::Inet,
            set,
            elements,
        }
    }
}

fn single(address: Ipv4Addr) -> Element {
    Element {
        key: address.octets().to_vec(),
        key_end: None,
        timeout_ms: None,
    }
}

/// `sandbox . net` as a range element of an interval set.
fn pair_range(sandbox: Ipv4Addr, net: Ipv4Net) -> Element {
    let key = |end: Ipv4Addr| [sandbox.octets(), end.octets()].concat();
    Element {
        key: key(net.network()),
        key_end: Some(key(net.broadcast())),
        timeout_ms: None,
    }
}

/// `sandbox . destination` in `learned`, gone after `timeout_ms`.
pub(crate) fn learned(
    sandbox: Ipv4Addr,
    destination: Ipv4Addr,
    timeout_ms: Option<u64>,
) -> Element {
    Element {
        key: [sandbox.octets(), destination.octets()].concat(),
        key_end: None,
        timeout_ms,
    }
}

/// `port . mac . address` in the bridge table. An ifname key is 16 bytes,
/// NUL-padded; each part of a concatenation takes whole 32-bit registers, so
/// the 6-byte MAC is padded to 8.
fn port(port: &str, mac: [u8; 6], address: Ipv4Addr) -> Element {
    let mut key = [0u8; 28];
    key[..port.len()].copy_from_slice(port.as_bytes());
    key[16..22].copy_from_slice(&mac);
    key[24..].copy_from_slice(&address.octets());
    Element {
        key: key.to_vec(),
        key_end: None,
        timeout_ms: None,
    }
}

/// Everything a sandbox's policy puts in the `inet` sets.
fn policy_elements(
    address: Ipv4Addr,
    policy: &CompiledPolicy,
) -> Vec<(&'static str, Vec<Element>)> {
    let flag = |on: bool| {
        if on {
            vec![single(address)]
        } else {
            Vec::new()
        }
    };
    let ranges = |nets: &[Ipv4Net]| nets.iter().map(|n| pair_range(address, *n)).collect();
    vec![
        (BLOCKED, flag(policy.block_all)),
        (RESTRICTED, flag(policy.restricted())),
        (ALLOWED, ranges(&policy.allow)),
        (DENIED, ranges(&policy.deny)),
    ]
}

/// Adds (or deletes) a sandbox: its port binding and its policy.
pub(crate) fn sandbox_changes(
    change: Change,
    port_name: &str,
    mac: [u8; 6],
    address: Ipv4Addr,
    policy: &CompiledPolicy,
) -> Vec<Changes> {
    let mut changes = vec![Changes {
        change,
        family: Family::Bridge,
        set: PORTS,
        elements: vec![port(port_name, mac, address)],
    }];
    for (set, elements) in policy_elements(address, policy) {
        changes.push(Changes::inet(change, set, elements));
    }
    changes
}

/// Turns a sandbox's elements for `old` into those for `new`, touching only
/// what differs (deletions first, so a range that shrinks is never doubled).
pub(crate) fn policy_diff(
    address: Ipv4Addr,
    old: &CompiledPolicy,
    new: &CompiledPolicy,
) -> Vec<Changes> {
    let old = policy_elements(address, old);
    let new = policy_elements(address, new);
    let mut deletes = Vec::new();
    let mut adds = Vec::new();
    for ((set, before), (_, after)) in old.into_iter().zip(new) {
        let gone: Vec<Element> = before
            .iter()
            .filter(|e| !after.contains(e))
            .cloned()
            .collect();
        let added: Vec<Element> = after
            .iter()
            .filter(|e| !before.contains(e))
            .cloned()
            .collect();
        deletes.push(Changes::inet(Change::Delete, set, gone));
        adds.push(Changes::inet(Change::Add, set, added));
    }
    deletes.extend(adds);
    deletes.retain(|c| !c.elements.is_empty());
    deletes
}

/// Opens (or closes) the way between two linked sandboxes, both directions.
pub(crate) fn link_changes(change: Change, a: Ipv4Addr, b: Ipv4Addr) -> Changes {
    Changes::inet(
        change,
        LINKED,
        vec![learned(a, b, None), learned(b, a, None)],
    )
}

pub(crate) fn learned_changes(change: Change, elements: Vec<Element>) -> Changes {
    Changes::inet(change, LEARNED, elements)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;

    fn compile(policy: Policy) -> CompiledPolicy {
        policy.compile().unwrap()
    }

    const SANDBOX: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
    const MAC: [u8; 6] = [0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0xee];

    #[test]
    fn an_open_sandbox_has_only_its_port_binding() {
        let changes = sandbox_changes(
            Change::Add,
            "cove0v2",
            MAC,
            SANDBOX,
            &compile(Policy::default()),
        );
        let non_empty: Vec<_> = changes.iter().filter(|c| !c.elements.is_empty()).collect();
        assert_eq!(non_empty.len(), 1);
        assert_eq!(non_empty[0].set, PORTS);
        let key = &non_empty[0].elements[0].key;
        assert_eq!(&key[..7], b"cove0v2");
        assert!(key[7..16].iter().all(|b| *b == 0));
        assert_eq!(&key[16..22], &MAC);
        assert_eq!(&key[22..24], &[0, 0]);
        assert_eq!(&key[24..], &[10, 77, 0, 2]);
    }

    #[test]
    fn an_allow_list_restricts_and_lists_ranges() {
        let policy = compile(Policy {
            allow_cidrs: vec!["198.51.100.0/24".parse().unwrap()],
            ..Policy::default()
        });
        let changes = sandbox_changes(Change::Add, "cove0v2", MAC, SANDBOX, &policy);
        let set = |name| changes.iter().find(|c| c.set == name).unwrap();
        assert_eq!(set(RESTRICTED).elements, vec![single(SANDBOX)]);
        assert!(set(BLOCKED).elements.is_empty());
        let range = &set(ALLOWED).elements[0];
        assert_eq!(range.key, vec![10, 77, 0, 2, 198, 51, 100, 0]);
        assert_eq!(range.key_end, Some(vec![10, 77, 0, 2, 198, 51, 100, 255]));
    }

    #[test]
    fn a_policy_change_touches_only_the_difference() {
        let a: Ipv4Net = "198.51.100.0/24".parse().unwrap();
        let b: Ipv4Net = "203.0.113.0/24".parse().unwrap();
        let old = compile(Policy {
            allow_cidrs: vec![a],
            ..Policy::default()
        });
        let new = compile(Policy {
            allow_cidrs: vec![a, b],
            block_all: true,
            ..Policy::default()
        });
        let diff = policy_diff(SANDBOX, &old, &new);
        assert_eq!(
            diff,
            vec![
                Changes::inet(Change::Add, BLOCKED, vec![single(SANDBOX)]),
                Changes::inet(Change::Add, ALLOWED, vec![pair_range(SANDBOX, b)]),
            ]
        );
        let back = policy_diff(SANDBOX, &new, &compile(Policy::default()));
        assert!(back.iter().all(|c| c.change == Change::Delete));
        assert_eq!(back.len(), 3, "{back:?}");
    }

    #[test]
    fn the_ruleset_names_this_networks_objects() {
        let config = NetworkConfig::new(
            crate::config::Uplink {
                interface: "up0".into(),
                gateway: Ipv4Addr::new(198, 18, 0, 2),
            },
            vec![Ipv4Addr::new(198, 51, 100, 53)],
            "/tmp/x".into(),
        );
        let closed = ClosedRanges::new(&["198.18.0.0/30".parse().unwrap()], &[]);
        let text = ruleset(&config, &closed);
        assert!(text.contains("ip saddr 10.77.0.0/16 oifname \"up0\" masquerade"));
        assert!(text.contains("iifname != \"cove0v*\" accept"));
        assert!(text.contains("ip daddr 10.77.0.1 udp dport 53 accept"));
        assert!(text.starts_with("table inet cove0 {}\ndelete table inet cove0\n"));
        assert!(text.contains("169.254.0.0/16, 172.16.0.0/12"), "{text}");
        assert!(text.contains("198.18.0.0/30"), "{text}");
        // The fixed deny comes before any allow set.
        let closed_at = text.find("ip daddr @closed drop").unwrap();
        assert!(closed_at < text.find("@allowed accept").unwrap());
        assert!(closed_at < text.find("@learned accept").unwrap());
        // Bridge to bridge, only linked pairs pass; the rest falls to egress,
        // whose first test for such a packet (not to the uplink) drops it.
        let linked = text
            .find("iifname \"cove0\" oifname \"cove0\" ip saddr . ip daddr @linked accept")
            .unwrap();
        assert!(linked < text.find("iifname \"cove0\" jump egress").unwrap());
        assert!(text.contains("oifname != \"up0\" drop"));
        assert!(text.contains("oifname \"cove0\" icmp type redirect drop"));
    }

    #[test]
    fn a_link_opens_both_ways_and_only_between_its_ends() {
        let (a, b) = (Ipv4Addr::new(10, 77, 0, 2), Ipv4Addr::new(10, 77, 0, 3));
        let changes = link_changes(Change::Add, a, b);
        assert_eq!(changes.set, LINKED);
        let keys: Vec<Vec<u8>> = changes.elements.iter().map(|e| e.key.clone()).collect();
        assert_eq!(
            keys,
            [
                [a.octets(), b.octets()].concat(),
                [b.octets(), a.octets()].concat()
            ]
        );
        assert!(changes
            .elements
            .iter()
            .all(|e| e.timeout_ms.is_none() && e.key_end.is_none()));
    }
}
