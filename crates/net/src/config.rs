//! What the server tells the network at start, checked once, and the names and
//! addresses derived from it. Pure data: nothing here touches the host.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use ipnet::Ipv4Net;

/// Where sandbox traffic leaves the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uplink {
    /// The host interface that carries sandbox traffic out, e.g. `eth0`.
    pub interface: String,
    /// The next hop on that interface; the default route of the sandboxes'
    /// routing table points at it.
    pub gateway: Ipv4Addr,
}

impl Uplink {
    /// The host's own way out: the interface and gateway of the main routing
    /// table's default route.
    pub async fn detect() -> Result<Self, crate::NetError> {
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(crate::NetError::io("open a netlink socket"))?;
        let task = tokio::spawn(connection);
        let detected = async {
            let none = || {
                crate::NetError::Config(
                    "the host has no IPv4 default route to use as the uplink".into(),
                )
            };
            let (gateway, index) = crate::links::default_route(&handle)
                .await?
                .ok_or_else(none)?;
            let interface = crate::links::name_of(&handle, index)
                .await?
                .ok_or_else(none)?;
            Ok(Self { interface, gateway })
        }
        .await;
        task.abort();
        detected
    }
}

/// The IPv4 `nameserver`s of a resolv.conf, e.g. the host's, in order.
pub fn nameservers(resolv_conf: &str) -> Vec<Ipv4Addr> {
    resolv_conf
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            match (words.next(), words.next()) {
                (Some("nameserver"), Some(address)) => address.parse().ok(),
                _ => None,
            }
        })
        .collect()
}

#[derive(Clone, Debug)]
pub struct NetworkConfig {
    /// The host bridge every sandbox's veth joins. Also names the nftables
    /// tables (`inet` and `bridge` families), and prefixes the sandboxes' host
    /// links (`{bridge}v{n}`), so it is at most 8 characters.
    pub bridge: String,
    /// The private range sandboxes get addresses from; its first host address is
    /// the gateway (on the bridge, where cove's resolver listens).
    pub range: Ipv4Net,
    pub uplink: Uplink,
    /// Resolvers cove's own resolver forwards allowed queries to, tried in order.
    pub dns_upstreams: Vec<Ipv4Addr>,
    /// Holds `netns/<id>` (namespace files) and `addresses` (the allocations).
    pub state_dir: PathBuf,
    /// The routing table that sends sandbox traffic to the uplink, and the
    /// firewall mark of the resolver's upstream queries, which use it too.
    pub route_table: u32,
    /// Priority of the two policy-routing rules that select `route_table`.
    pub rule_priority: u32,
    /// Network namespaces kept ready for the next attaches (making one is
    /// most of the cost of an attach); 0 makes each on demand.
    pub netns_pool: usize,
    /// Ranges of the host's world (private, link-local, the uplink's LAN, ...)
    /// the operator opens to sandboxes; each sandbox's policy still applies
    /// to them. Empty: all of it is closed (see `closed`).
    pub allow_private_egress: Vec<Ipv4Net>,
    /// The pool refills a namespace only once requests leave the host quiet
    /// (or the pool is empty).
    pub quiet: cove_quiet::Quiet,
}

impl NetworkConfig {
    /// A config with the defaults: bridge `cove0`, range 10.77.0.0/16, routing
    /// table and rule priority 7700, 4 namespaces ready.
    pub fn new(uplink: Uplink, dns_upstreams: Vec<Ipv4Addr>, state_dir: PathBuf) -> Self {
        Self {
            bridge: "cove0".into(),
            range: Ipv4Net::new(Ipv4Addr::new(10, 77, 0, 0), 16).expect("16 is a valid prefix"),
            uplink,
            dns_upstreams,
            state_dir,
            route_table: 7700,
            rule_priority: 7700,
            netns_pool: 4,
            allow_private_egress: Vec::new(),
            quiet: cove_quiet::Quiet::default(),
        }
    }

    /// Checks what the kernel would refuse later, with the reason.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_ifname("bridge", &self.bridge, MAX_BRIDGE_NAME)?;
        check_ifname("uplink interface", &self.uplink.interface, 15)?;
        let range = self.range;
        if range.prefix_len() < MIN_PREFIX || range.prefix_len() > MAX_PREFIX {
            return Err(ConfigError::Prefix { range });
        }
        if range.trunc() != range {
            return Err(ConfigError::HostBits { range });
        }
        if range.contains(&self.uplink.gateway) {
            return Err(ConfigError::GatewayInside {
                gateway: self.uplink.gateway,
                range,
            });
        }
        if self.dns_upstreams.is_empty() {
            return Err(ConfigError::NoUpstream);
        }
        if let Some(inside) = self.dns_upstreams.iter().find(|a| range.contains(*a)) {
            return Err(ConfigError::UpstreamInside {
                upstream: *inside,
                range,
            });
        }
        if let Some(net) = self.allow_private_egress.iter().find(|n| n.trunc() != **n) {
            return Err(ConfigError::EgressHostBits { net: *net });
        }
        // Tables 253-255 are the kernel's default, main and local tables.
        if self.route_table == 0 || (253..=255).contains(&self.route_table) {
            return Err(ConfigError::ReservedTable {
                table: self.route_table,
            });
        }
        if self.rule_priority == 0 || self.rule_priority >= 32766 {
            return Err(ConfigError::RulePriority {
                priority: self.rule_priority,
            });
        }
        Ok(())
    }

    /// The bridge's address, which sandboxes route through and resolve with.
    pub fn gateway(&self) -> Ipv4Addr {
        offset_address(self.range, 1)
    }

    /// The address at `offset` into the range, for offsets of sandboxes.
    pub(crate) fn sandbox_address(&self, offset: u32) -> Ipv4Addr {
        offset_address(self.range, offset)
    }

    /// Offsets that sandboxes may use: after the network address and the
    /// gateway, before the broadcast address.
    pub(crate) fn sandbox_offsets(&self) -> std::ops::RangeInclusive<u32> {
        let size = 1u32 << (32 - u32::from(self.range.prefix_len()));
        2..=size - 2
    }

    /// The offset of an address in the range, if it is in it.
    pub(crate) fn offset_of(&self, address: Ipv4Addr) -> Option<u32> {
        self.range
            .contains(&address)
            .then(|| u32::from(address) - u32::from(self.range.network()))
    }

    /// The host end of the `n`th veth made: bridge name, `v`, `n` in hex; `n`
    /// wraps at 2^24 so the name fits in 15 characters.
    pub(crate) fn port_name(&self, n: u32) -> String {
        format!("{}v{:x}", self.bridge, n & 0xff_ffff)
    }

    /// Matches every port name of this bridge in nftables (`*` is a prefix match).
    pub(crate) fn port_pattern(&self) -> String {
        format!("{}v*", self.bridge)
    }

    /// The nftables table name (one in the `inet` family, one in `bridge`).
    pub(crate) fn table(&self) -> &str {
        &self.bridge
    }

    pub(crate) fn netns_dir(&self) -> PathBuf {
        self.state_dir.join("netns")
    }

    pub(crate) fn addresses_file(&self) -> PathBuf {
        self.state_dir.join("addresses")
    }
}

/// What the kernel would refuse in a [`NetworkConfig`], named.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{what} name {name:?} must be 1 to {max} of [A-Za-z0-9_-]")]
    IfName {
        what: &'static str,
        name: String,
        max: usize,
    },
    #[error("range {range} must have a prefix length from /{MIN_PREFIX} to /{MAX_PREFIX}")]
    Prefix { range: Ipv4Net },
    #[error("range {range} has host bits set; did you mean {}?", range.trunc())]
    HostBits { range: Ipv4Net },
    #[error("uplink gateway {gateway} is inside the sandbox range {range}")]
    GatewayInside { gateway: Ipv4Addr, range: Ipv4Net },
    #[error("at least one DNS upstream is needed")]
    NoUpstream,
    #[error("DNS upstream {upstream} is inside the sandbox range {range}")]
    UpstreamInside { upstream: Ipv4Addr, range: Ipv4Net },
    #[error("private egress range {net} has host bits set; did you mean {}?", net.trunc())]
    EgressHostBits { net: Ipv4Net },
    #[error("route_table {table} is reserved by the kernel")]
    ReservedTable { table: u32 },
    #[error("rule_priority {priority} must be between 1 and 32765, before the main table's rule")]
    RulePriority { priority: u32 },
}

const MAX_BRIDGE_NAME: usize = 8;
const MIN_PREFIX: u8 = 8;
const MAX_PREFIX: u8 = 29;

fn offset_address(range: Ipv4Net, offset: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(range.network()) + offset)
}

/// Interface names are at most 15 bytes, and these must also be plain words
/// so they can go into an nftables script and a sysctl path as they are.
fn check_ifname(what: &'static str, name: &str, max: usize) -> Result<(), ConfigError> {
    let plain = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if name.is_empty() || name.len() > max || !plain {
        return Err(ConfigError::IfName {
            what,
            name: name.to_owned(),
            max,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> NetworkConfig {
        NetworkConfig::new(
            Uplink {
                interface: "eth0".into(),
                gateway: Ipv4Addr::new(192, 0, 2, 1),
            },
            vec![Ipv4Addr::new(192, 0, 2, 53)],
            "/var/lib/cove/net".into(),
        )
    }

    #[test]
    fn defaults_are_valid_and_derive_names() {
        let config = config();
        config.validate().unwrap();
        assert_eq!(config.gateway(), Ipv4Addr::new(10, 77, 0, 1));
        assert_eq!(config.sandbox_offsets(), 2..=65534);
        assert_eq!(config.sandbox_address(2), Ipv4Addr::new(10, 77, 0, 2));
        assert_eq!(config.offset_of(Ipv4Addr::new(10, 77, 1, 0)), Some(256));
        assert_eq!(config.offset_of(Ipv4Addr::new(10, 78, 0, 0)), None);
        assert_eq!(config.port_name(256), "cove0v100");
        assert_eq!(config.port_name(1 << 24), "cove0v0");
    }

    #[test]
    fn port_names_fit_in_ifnamsiz_for_the_widest_range() {
        let mut config = config();
        config.bridge = "abcdefgh".into();
        config.range = "10.0.0.0/8".parse().unwrap();
        config.validate().unwrap();
        assert_eq!(config.port_name(u32::MAX).len(), 15);
    }

    #[test]
    fn nameservers_are_read_from_resolv_conf() {
        let text =
            "# comment\nsearch x\nnameserver 192.0.2.53\nnameserver ::1\nnameserver 127.0.0.53\n";
        assert_eq!(
            nameservers(text),
            vec![Ipv4Addr::new(192, 0, 2, 53), Ipv4Addr::new(127, 0, 0, 53)]
        );
    }

    #[test]
    fn bad_configs_say_what_is_wrong() {
        let check = |edit: fn(&mut NetworkConfig), needle: &str| {
            let mut config = config();
            edit(&mut config);
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{err} should mention {needle}");
        };
        check(|c| c.bridge = "toolongname".into(), "bridge name");
        check(|c| c.bridge = "a;b".into(), "bridge name");
        check(
            |c| c.range = "10.77.0.0/30".parse().unwrap(),
            "prefix length",
        );
        check(|c| c.range = "10.77.0.1/16".parse().unwrap(), "host bits");
        check(|c| c.uplink.gateway = Ipv4Addr::new(10, 77, 3, 3), "inside");
        check(|c| c.dns_upstreams.clear(), "DNS upstream");
        check(|c| c.route_table = 254, "reserved");
        check(|c| c.rule_priority = 32766, "rule_priority");
        check(
            |c| c.allow_private_egress = vec!["10.1.2.3/8".parse().unwrap()],
            "private egress",
        );
    }
}
