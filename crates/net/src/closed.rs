//! The host's world: destinations no sandbox reaches, whatever its policy.
//! A cloud host's metadata service (169.254.169.254, its credentials), its
//! private networks and the uplink's own LAN would otherwise be one
//! masqueraded connection away, as the host. The firewall drops them before
//! any allow set is looked at, and the resolver admits none of them.
//!
//! The operator may open ranges (`serve --allow-private-egress`); an opened
//! range is then subject to each sandbox's own policy like any address.
//! Pure data: the uplink's subnets are read by the caller.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

/// Closed by default: link-local (metadata services), CGNAT, RFC 1918,
/// loopback, "this network", multicast, and the reserved block with the
/// limited broadcast address.
pub(crate) const DEFAULT_CLOSED: [(Ipv4Addr, u8); 9] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(10, 0, 0, 0), 8),
    (Ipv4Addr::new(100, 64, 0, 0), 10),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(172, 16, 0, 0), 12),
    (Ipv4Addr::new(192, 168, 0, 0), 16),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// The ranges closed to every sandbox on this host: merged, not
/// overlapping, as an nftables interval set wants them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClosedRanges {
    nets: Vec<Ipv4Net>,
}

impl ClosedRanges {
    /// The default ranges and the uplink's `subnets`, minus what the operator
    /// `opened`.
    pub(crate) fn new(subnets: &[Ipv4Net], opened: &[Ipv4Net]) -> Self {
        let mut closed: Vec<Ipv4Net> = DEFAULT_CLOSED
            .iter()
            .map(|(address, prefix)| Ipv4Net::new(*address, *prefix).expect("a valid prefix"))
            .chain(subnets.iter().map(Ipv4Net::trunc))
            .collect();
        for open in opened {
            closed = closed
                .into_iter()
                .flat_map(|net| subtract(net, open.trunc()))
                .collect();
        }
        Self {
            nets: Ipv4Net::aggregate(&closed),
        }
    }

    pub(crate) fn nets(&self) -> &[Ipv4Net] {
        &self.nets
    }

    pub(crate) fn contains(&self, address: Ipv4Addr) -> bool {
        self.nets.iter().any(|net| net.contains(&address))
    }
}

/// `net` without `hole`: nothing, `net` itself, or the halves of `net` that
/// do not hold the hole, down to the hole's size.
fn subtract(net: Ipv4Net, hole: Ipv4Net) -> Vec<Ipv4Net> {
    if hole.contains(&net) {
        return Vec::new();
    }
    if !net.contains(&hole) {
        return vec![net];
    }
    net.subnets(net.prefix_len() + 1)
        .expect("net is wider than the hole it contains")
        .flat_map(|half| subtract(half, hole))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(text: &str) -> Ipv4Net {
        text.parse().unwrap()
    }

    fn address(text: &str) -> Ipv4Addr {
        text.parse().unwrap()
    }

    #[test]
    fn the_hosts_world_is_closed_and_the_internet_is_not() {
        let closed = ClosedRanges::new(&[net("198.18.7.0/30")], &[]);
        for inside in [
            "169.254.169.254",
            "10.99.0.5",
            "172.31.255.1",
            "192.168.77.5",
            "100.100.100.200",
            "127.0.0.1",
            "0.1.2.3",
            "224.0.0.251",
            "255.255.255.255",
            "198.18.7.2",
        ] {
            assert!(closed.contains(address(inside)), "{inside}");
        }
        for outside in ["198.51.100.10", "1.1.1.1", "172.32.0.1", "198.18.7.4"] {
            assert!(!closed.contains(address(outside)), "{outside}");
        }
    }

    #[test]
    fn an_opened_range_is_cut_out_exactly() {
        let closed = ClosedRanges::new(&[], &[net("192.168.77.0/24"), net("10.0.0.0/8")]);
        assert!(!closed.contains(address("192.168.77.5")));
        assert!(!closed.contains(address("10.1.2.3")));
        assert!(closed.contains(address("192.168.76.255")));
        assert!(closed.contains(address("192.168.78.0")));
        assert!(closed.contains(address("169.254.169.254")));
        // The halves left of 192.168/16 cover all of it but the hole.
        let size = |n: &Ipv4Net| 1u64 << (32 - n.prefix_len());
        let left: u64 = closed
            .nets()
            .iter()
            .filter(|n| net("192.168.0.0/16").contains(*n))
            .map(size)
            .sum();
        assert_eq!(left, (1 << 16) - 256);
    }

    #[test]
    fn ranges_never_overlap_and_opening_everything_leaves_nothing() {
        let closed = ClosedRanges::new(&[net("10.1.0.0/16"), net("192.0.2.0/24")], &[]);
        let nets = closed.nets();
        for (i, a) in nets.iter().enumerate() {
            for b in &nets[i + 1..] {
                assert!(!a.contains(b) && !b.contains(a), "{a} and {b} overlap");
            }
        }
        assert!(nets.contains(&net("10.0.0.0/8")));
        assert!(ClosedRanges::new(&[], &[net("0.0.0.0/0")])
            .nets()
            .is_empty());
    }
}
