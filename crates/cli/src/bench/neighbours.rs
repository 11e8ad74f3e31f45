//! What a benchmark's own server must not share with another cove server on
//! the host: the sandbox bridge, the address range, the routing table and the
//! user-namespace id pool. A server on its defaults (`scripts/run`) may be
//! running beside the benchmark, and the `net` scenario runs two of its own,
//! so each own server takes a slot no other server holds.

use std::net::Ipv4Addr;
use std::path::Path;

use anyhow::bail;

/// How many own servers can run on one host at once.
const SLOTS: u8 = 16;
/// Where servers keep their bridge locks (`cove-net`): one lock per bridge,
/// held while the server runs.
const LOCK_DIR: &str = "/run/cove";
/// The default pool's first id (`cove serve --userns-pool`); slots take
/// pools below it, so they never meet a server on its defaults.
const DEFAULT_POOL_START: u32 = 1_879_048_192;
/// Ranges of 65536 ids per slot.
const RANGES_PER_SLOT: u32 = 256;
const RANGE_SIZE: u32 = 65_536;

/// The host resources of one own server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Slot {
    pub bridge: String,
    pub network_range: String,
    pub route_table: u32,
    pub userns_pool: String,
}

impl Slot {
    fn numbered(n: u8) -> Slot {
        let pool_start = DEFAULT_POOL_START - (u32::from(n) + 1) * RANGES_PER_SLOT * RANGE_SIZE;
        Slot {
            bridge: format!("covb{n}"),
            network_range: format!("10.{}.0.0/16", 200 + u32::from(n)),
            route_table: 7710 + u32::from(n),
            userns_pool: format!("{pool_start}:{RANGES_PER_SLOT}"),
        }
    }

    /// The `cove serve` arguments that give a server this slot.
    pub(super) fn args(&self) -> Vec<String> {
        vec![
            "--bridge".into(),
            self.bridge.clone(),
            "--network-range".into(),
            self.network_range.clone(),
            "--route-table".into(),
            self.route_table.to_string(),
            "--userns-pool".into(),
            self.userns_pool.clone(),
        ]
    }

    /// The first slot whose bridge no server holds and whose range no host
    /// route covers. The bridge lock is what the server takes; a slot picked
    /// here is taken by the server within its start (the caller waits for it).
    pub(super) fn free() -> anyhow::Result<Slot> {
        let routes = std::fs::read_to_string("/proc/net/route").unwrap_or_default();
        let taken = host_routes(&routes);
        for n in 0..SLOTS {
            let slot = Slot::numbered(n);
            if bridge_held(&slot.bridge) {
                continue;
            }
            let (base, prefix) = (Ipv4Addr::new(10, 200 + n, 0, 0), 16);
            if taken
                .iter()
                .any(|&(net, len)| overlaps((base, prefix), (net, len)))
            {
                continue;
            }
            return Ok(slot);
        }
        bail!(
            "no free slot for a benchmark server: {SLOTS} are in use (bridges covb0-covb{})",
            SLOTS - 1
        )
    }
}

/// Whether a running server holds `bridge`'s lock.
fn bridge_held(bridge: &str) -> bool {
    let path = Path::new(LOCK_DIR).join(format!("bridge-{bridge}.lock"));
    let Ok(file) = std::fs::File::open(&path) else {
        return false;
    };
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        // Released when dropped, here.
        Ok(_lock) => false,
        Err(_) => true,
    }
}

/// The (network, prefix length) of each route of the host's main table, from
/// `/proc/net/route` (addresses in hex, in the kernel's byte order). The
/// default route (length 0) is left out: it covers everything.
fn host_routes(text: &str) -> Vec<(Ipv4Addr, u8)> {
    // The kernel prints each address's bytes, in network order, as a
    // little-endian number.
    let parse = |hex: &str| {
        u32::from_str_radix(hex, 16)
            .ok()
            .map(|v| Ipv4Addr::from(v.to_le_bytes()))
    };
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let net = parse(fields.get(1)?)?;
            let len = u32::from(parse(fields.get(7)?)?).count_ones() as u8;
            (len > 0).then_some((net, len))
        })
        .collect()
}

/// Whether two networks share an address.
fn overlaps(a: (Ipv4Addr, u8), b: (Ipv4Addr, u8)) -> bool {
    let len = a.1.min(b.1);
    let mask = if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    };
    u32::from(a.0) & mask == u32::from(b.0) & mask
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_never_share_a_resource_nor_meet_the_defaults() {
        let slots: Vec<Slot> = (0..SLOTS).map(Slot::numbered).collect();
        for (i, a) in slots.iter().enumerate() {
            for b in &slots[i + 1..] {
                assert_ne!(a.bridge, b.bridge);
                assert_ne!(a.network_range, b.network_range);
                assert_ne!(a.route_table, b.route_table);
                assert_ne!(a.userns_pool, b.userns_pool);
            }
            assert!(a.bridge.len() <= 8, "{}", a.bridge);
            assert_ne!(a.route_table, 7700);
            let (start, count) = a.userns_pool.split_once(':').unwrap();
            let end = u64::from(start.parse::<u32>().unwrap())
                + u64::from(count.parse::<u32>().unwrap()) * u64::from(RANGE_SIZE);
            assert!(
                end <= u64::from(DEFAULT_POOL_START),
                "{a:?} reaches the default pool"
            );
        }
        let last = slots.last().unwrap().userns_pool.split_once(':').unwrap().0;
        assert!(
            last.parse::<u32>().unwrap() > 65_536 * 16,
            "pools stay above host ids"
        );
    }

    #[test]
    fn reads_the_hosts_routes() {
        let text =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                    eth0\t00000000\t0102A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
                    eth0\t0002A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                    cove0\t00004D0A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n";
        assert_eq!(
            host_routes(text),
            vec![
                (Ipv4Addr::new(192, 168, 2, 0), 24),
                (Ipv4Addr::new(10, 77, 0, 0), 16)
            ]
        );
    }

    #[test]
    fn overlap_is_decided_by_the_shorter_prefix() {
        let net = |a, b, c, d, len| (Ipv4Addr::new(a, b, c, d), len);
        assert!(overlaps(net(10, 200, 0, 0, 16), net(10, 0, 0, 0, 8)));
        assert!(overlaps(net(10, 200, 3, 0, 24), net(10, 200, 0, 0, 16)));
        assert!(!overlaps(net(10, 200, 0, 0, 16), net(10, 201, 0, 0, 16)));
        assert!(!overlaps(net(10, 200, 0, 0, 16), net(192, 168, 0, 0, 16)));
    }
}
