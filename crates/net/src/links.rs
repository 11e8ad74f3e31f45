//! Links, addresses, routes and rules over rtnetlink, plus the few sysctls
//! that go with them. Nothing here spawns a process.
//!
//! Host side: the bridge (with the gateway address and a fixed MAC, so the
//! sandboxes' ARP caches stay right across restarts), one veth per sandbox
//! created with its peer already inside the sandbox's namespace as `eth0`, and
//! policy routing: sandbox traffic (by input interface and source) and the
//! resolver's upstream queries (by firewall mark) use a table of their own whose
//! default route is the uplink, so the host's main table is never touched.
//!
//! Every sandbox port is isolated, learns nothing and gets no flooded
//! unicast; the sandbox's MAC is a static, sticky entry of the bridge's
//! forwarding table on its port. So a sandbox that sends frames from another
//! sandbox's MAC moves nothing, and the gateway's frames for a sandbox go to
//! its port only.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::RawFd;

use futures_util::TryStreamExt;
use rtnetlink::packet_route::link::{InfoBridgePort, InfoData, InfoKind, InfoVeth, LinkAttribute};
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute};
use rtnetlink::{
    Handle, IpVersion, LinkBridge, LinkBridgePort, LinkMessageBuilder, LinkUnspec, LinkVeth,
    RouteMessageBuilder,
};

use crate::config::NetworkConfig;
use crate::NetError;

/// The sandbox end of its veth: the only link in its namespace besides `lo`,
/// so the index is free and fixing it saves a lookup.
const SANDBOX_LINK: &str = "eth0";
const SANDBOX_LINK_INDEX: u32 = 2;

/// The errno of a netlink refusal, positive.
pub(crate) fn errno(err: &rtnetlink::Error) -> Option<i32> {
    match err {
        rtnetlink::Error::NetlinkError(message) => Some(message.raw_code().abs()),
        _ => None,
    }
}

pub(crate) async fn index_of(handle: &Handle, name: &str) -> Result<Option<u32>, NetError> {
    let mut links = handle.link().get().match_name(name.to_owned()).execute();
    match links.try_next().await {
        Ok(link) => Ok(link.map(|l| l.header.index)),
        Err(err) if errno(&err) == Some(libc::ENODEV) => Ok(None),
        Err(err) => Err(NetError::netlink(format!("look up link {name}"))(err)),
    }
}

/// Deletes a link by name; one that does not exist is not an error. Deleting
/// either end of a veth deletes both.
pub(crate) async fn delete_link(handle: &Handle, name: &str) -> Result<(), NetError> {
    let message = LinkUnspec::new_with_name(name).build();
    match handle.link().del_with_message(message).execute().await {
        Err(err) if errno(&err) != Some(libc::ENODEV) => {
            Err(NetError::netlink(format!("delete link {name}"))(err))
        }
        _ => Ok(()),
    }
}

/// The main table's IPv4 default route: gateway and output interface index.
pub(crate) async fn default_route(handle: &Handle) -> Result<Option<(Ipv4Addr, u32)>, NetError> {
    use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute};
    let routes: Vec<_> = handle
        .route()
        .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
        .execute()
        .try_collect()
        .await
        .map_err(NetError::netlink("list routes"))?;
    let main = u32::from(libc::RT_TABLE_MAIN);
    Ok(routes.iter().find_map(|route| {
        let table = route
            .attributes
            .iter()
            .find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            })
            .unwrap_or(u32::from(route.header.table));
        let gateway = route.attributes.iter().find_map(|a| match a {
            RouteAttribute::Gateway(RouteAddress::Inet(g)) => Some(*g),
            _ => None,
        });
        let oif = route.attributes.iter().find_map(|a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        });
        match (route.header.destination_prefix_length, table, gateway, oif) {
            (0, t, Some(gateway), Some(oif)) if t == main => Some((gateway, oif)),
            _ => None,
        }
    }))
}

/// The IPv4 subnets of the link at `index` (its addresses' networks).
pub(crate) async fn ipv4_subnets(
    handle: &Handle,
    index: u32,
) -> Result<Vec<ipnet::Ipv4Net>, NetError> {
    use rtnetlink::packet_route::address::AddressAttribute;
    let addresses: Vec<_> = handle
        .address()
        .get()
        .set_link_index_filter(index)
        .execute()
        .try_collect()
        .await
        .map_err(NetError::netlink(format!(
            "list the addresses of link {index}"
        )))?;
    Ok(addresses
        .iter()
        .filter_map(|message| {
            let prefix = message.header.prefix_len;
            message.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(IpAddr::V4(address)) => {
                    ipnet::Ipv4Net::new(*address, prefix)
                        .ok()
                        .map(|n| n.trunc())
                }
                _ => None,
            })
        })
        .collect())
}

/// The name of the link at `index`.
pub(crate) async fn name_of(handle: &Handle, index: u32) -> Result<Option<String>, NetError> {
    let mut links = handle.link().get().match_index(index).execute();
    match links.try_next().await {
        Ok(link) => Ok(link.and_then(|l| {
            l.attributes.into_iter().find_map(|a| match a {
                LinkAttribute::IfName(name) => Some(name),
                _ => None,
            })
        })),
        Err(err) if errno(&err) == Some(libc::ENODEV) => Ok(None),
        Err(err) => Err(NetError::netlink(format!("look up link {index}"))(err)),
    }
}

/// Deletes a link by index; one that does not exist is not an error.
pub(crate) async fn delete_index(handle: &Handle, index: u32) -> Result<(), NetError> {
    match handle.link().del(index).execute().await {
        Err(err) if errno(&err) != Some(libc::ENODEV) => {
            Err(NetError::netlink(format!("delete link {index}"))(err))
        }
        _ => Ok(()),
    }
}

/// Deletes every link named like a port of this network (`{bridge}v<hex>`).
pub(crate) async fn delete_ports(
    handle: &Handle,
    config: &NetworkConfig,
) -> Result<Vec<String>, NetError> {
    let links: Vec<_> = handle
        .link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(NetError::netlink("list links"))?;
    let mut deleted = Vec::new();
    for link in links {
        let name = link.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(name) => Some(name.clone()),
            _ => None,
        });
        let Some(name) = name else { continue };
        let is_port = name
            .strip_prefix(config.bridge.as_str())
            .and_then(|rest| rest.strip_prefix('v'))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_hexdigit()));
        if is_port {
            delete_link(handle, &name).await?;
            deleted.push(name);
        }
    }
    Ok(deleted)
}

/// A locally administered MAC derived from the bridge name (FNV-1a), the same
/// on every start.
fn bridge_mac(name: &str) -> Vec<u8> {
    let hash = name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    let [a, b, c, d] = hash.to_be_bytes();
    vec![0x02, 0x63, a, b, c, d]
}

/// Makes the bridge afresh (a leftover of the same name is deleted first) with
/// the gateway address; returns its index.
pub(crate) async fn create_bridge(
    handle: &Handle,
    config: &NetworkConfig,
) -> Result<u32, NetError> {
    let name = &config.bridge;
    delete_link(handle, name).await?;
    handle
        .link()
        .add(LinkBridge::new(name).address(bridge_mac(name)).build())
        .execute()
        .await
        .map_err(NetError::netlink(format!("create bridge {name}")))?;
    let index = index_of(handle, name).await?.ok_or_else(|| NetError::Io {
        action: format!("find bridge {name} after creating it"),
        source: std::io::Error::from_raw_os_error(libc::ENODEV),
    })?;
    // Set before the address exists, so the bridge never has an IPv6 address.
    write_sysctl(&format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1")?;
    handle
        .address()
        .add(
            index,
            IpAddr::V4(config.gateway()),
            config.range.prefix_len(),
        )
        .execute()
        .await
        .map_err(NetError::netlink(format!(
            "add {} to {name}",
            config.gateway()
        )))?;
    Ok(index)
}

/// Routing between the bridge and the uplink happens only where forwarding is
/// on for the interface the packet came in on: both directions need it.
pub(crate) fn enable_forwarding(config: &NetworkConfig) -> Result<(), NetError> {
    for interface in [&config.bridge, &config.uplink.interface] {
        write_sysctl(
            &format!("/proc/sys/net/ipv4/conf/{interface}/forwarding"),
            "1",
        )?;
    }
    // Sandbox ports are isolated, so one sandbox's ARP for another reaches
    // only the host. Answering it with the bridge's own MAC (private-VLAN
    // proxy ARP) sends their packets through the host's firewall, which lets
    // through only linked pairs (the ICMP redirects that would tell the
    // sender to go direct are dropped by the firewall's `output` chain).
    let bridge = &config.bridge;
    write_sysctl(
        &format!("/proc/sys/net/ipv4/conf/{bridge}/proxy_arp_pvlan"),
        "1",
    )?;
    // Answered at once: the kernel otherwise holds each proxied answer for
    // a random time up to 0.8 s, in a queue that drops beyond 64 requests,
    // which a linked pair pays for on every new neighbour.
    write_sysctl(
        &format!("/proc/sys/net/ipv4/neigh/{bridge}/proxy_delay"),
        "0",
    )
}

pub(crate) fn write_sysctl(path: &str, value: &str) -> Result<(), NetError> {
    std::fs::write(path, value).map_err(NetError::io(format!("write {value} to {path}")))
}

fn sandbox_table_route(
    config: &NetworkConfig,
    uplink_index: u32,
) -> rtnetlink::packet_route::route::RouteMessage {
    RouteMessageBuilder::<Ipv4Addr>::new()
        .gateway(config.uplink.gateway)
        .output_interface(uplink_index)
        .table_id(config.route_table)
        .build()
}

/// The sandboxes' own range, back out of the bridge: the only way one
/// sandbox reaches another (through the host, whose firewall lets linked
/// pairs pass and drops the rest).
fn sandbox_range_route(
    config: &NetworkConfig,
    bridge_index: u32,
) -> rtnetlink::packet_route::route::RouteMessage {
    RouteMessageBuilder::<Ipv4Addr>::new()
        .destination_prefix(config.range.network(), config.range.prefix_len())
        .output_interface(bridge_index)
        .scope(rtnetlink::packet_route::route::RouteScope::Link)
        .table_id(config.route_table)
        .build()
}

/// Installs the two rules and the routes of the sandboxes' routing table,
/// replacing those of a previous run.
pub(crate) async fn install_routing(
    handle: &Handle,
    config: &NetworkConfig,
    uplink_index: u32,
    bridge_index: u32,
) -> Result<(), NetError> {
    remove_rules(handle, config).await?;
    let rule = || {
        handle
            .rule()
            .add()
            .v4()
            .action(RuleAction::ToTable)
            .priority(config.rule_priority)
            .table_id(config.route_table)
    };
    // `iif` keeps the host's own packets from sandbox-range addresses (the
    // resolver's answers) on the main table.
    rule()
        .input_interface(config.bridge.clone())
        .source_prefix(config.range.network(), config.range.prefix_len())
        .execute()
        .await
        .map_err(NetError::netlink(format!(
            "add rule from {} iif {} lookup {}",
            config.range, config.bridge, config.route_table
        )))?;
    rule()
        .fw_mark(config.route_table)
        .execute()
        .await
        .map_err(NetError::netlink(format!(
            "add rule fwmark {0} lookup {0}",
            config.route_table
        )))?;
    handle
        .route()
        .add(sandbox_table_route(config, uplink_index))
        .replace()
        .execute()
        .await
        .map_err(NetError::netlink(format!(
            "add default route via {} dev {} to table {}",
            config.uplink.gateway, config.uplink.interface, config.route_table
        )))?;
    // (Gone with the bridge: nothing to remove at shutdown.)
    handle
        .route()
        .add(sandbox_range_route(config, bridge_index))
        .replace()
        .execute()
        .await
        .map_err(NetError::netlink(format!(
            "add route {} dev {} to table {}",
            config.range, config.bridge, config.route_table
        )))
}

/// Deletes this network's rules (its priority and table) and its route.
pub(crate) async fn remove_routing(
    handle: &Handle,
    config: &NetworkConfig,
    uplink_index: Option<u32>,
) -> Result<(), NetError> {
    remove_rules(handle, config).await?;
    let Some(uplink_index) = uplink_index else {
        return Ok(()); // the uplink is gone, and its routes with it
    };
    match handle
        .route()
        .del(sandbox_table_route(config, uplink_index))
        .execute()
        .await
    {
        Err(err) if errno(&err) != Some(libc::ESRCH) => Err(NetError::netlink(format!(
            "delete the default route of table {}",
            config.route_table
        ))(err)),
        _ => Ok(()),
    }
}

async fn remove_rules(handle: &Handle, config: &NetworkConfig) -> Result<(), NetError> {
    let rules: Vec<_> = handle
        .rule()
        .get(IpVersion::V4)
        .execute()
        .try_collect()
        .await
        .map_err(NetError::netlink("list routing rules"))?;
    for rule in rules {
        let ours = rule
            .attributes
            .contains(&RuleAttribute::Priority(config.rule_priority))
            && (rule
                .attributes
                .contains(&RuleAttribute::Table(config.route_table))
                || u32::from(rule.header.table) == config.route_table);
        if ours {
            match handle.rule().del(rule).execute().await {
                Err(err) if errno(&err) != Some(libc::ENOENT) => {
                    return Err(NetError::netlink("delete a routing rule")(err))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Creates a veth whose host end `name` is an isolated port of the bridge,
/// up, and whose other end is `eth0` (index 2) up inside the namespace
/// `netns` (`inside` is a handle in that namespace). Returns the host end's
/// index. The port passes no frame until the sandbox's address is bound to it
/// in the firewall, so it may be made long before it is used.
pub(crate) async fn create_veth(
    host: &Handle,
    inside: &Handle,
    name: &str,
    bridge_index: u32,
    netns: RawFd,
) -> Result<u32, NetError> {
    let peer = LinkUnspec::new_with_index(SANDBOX_LINK_INDEX)
        .name(SANDBOX_LINK)
        .setns_by_fd(netns)
        .build();
    let message = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
        .name(name)
        .controller(bridge_index)
        .up()
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build();
    host.link()
        .add(message)
        .execute()
        .await
        .map_err(NetError::netlink(format!("create veth {name}")))?;
    // The peer is not brought up in the same message: a veth end refuses to
    // open (ENOTCONN) until both ends exist.
    let eth0_up = async {
        inside
            .link()
            .set(LinkUnspec::new_with_index(SANDBOX_LINK_INDEX).up().build())
            .execute()
            .await
            .map_err(NetError::netlink(
                "bring eth0 up in a new network namespace",
            ))
    };
    let (up, isolated) = tokio::join!(eth0_up, isolate_port(host, name));
    up.and(isolated)?;
    index_of(host, name).await?.ok_or_else(|| NetError::Io {
        action: format!("find veth {name} after creating it"),
        source: std::io::Error::from_raw_os_error(libc::ENODEV),
    })
}

/// Makes the TAP device `name` an isolated, up port of the bridge (the
/// firewall passes no frame from it until a sandbox's address is bound to
/// it). Returns its index.
pub(crate) async fn enslave_tap(
    handle: &Handle,
    name: &str,
    bridge_index: u32,
) -> Result<u32, NetError> {
    let index = index_of(handle, name).await?.ok_or_else(|| NetError::Io {
        action: format!("find TAP device {name} after creating it"),
        source: std::io::Error::from_raw_os_error(libc::ENODEV),
    })?;
    handle
        .link()
        .set(
            LinkUnspec::new_with_index(index)
                .controller(bridge_index)
                .up()
                .build(),
        )
        .execute()
        .await
        .map_err(NetError::netlink(format!(
            "make TAP device {name} a port of the bridge"
        )))?;
    isolate_port(handle, name).await?;
    Ok(index)
}

/// Bridge-port isolation: frames from an isolated port reach only
/// non-isolated ports (the bridge itself), never another sandbox. The port
/// does not learn (a frame from it cannot move any MAC to it) and gets no
/// unicast flood (a frame for a MAC the bridge does not know, another
/// sandbox's included, never reaches it); its sandbox's MAC is pinned to it
/// (`pin_mac`).
pub(crate) async fn isolate_port(handle: &Handle, port: &str) -> Result<(), NetError> {
    let message = LinkBridgePort::new(0)
        .name(port)
        .append_info_data(InfoBridgePort::Isolated(true))
        .append_info_data(InfoBridgePort::Learning(false))
        .append_info_data(InfoBridgePort::UnicastFlood(false))
        .build();
    handle
        .link()
        .set_port(message)
        .execute()
        .await
        .map_err(NetError::netlink(format!("isolate bridge port {port}")))
}

/// A static, sticky entry of the bridge's forwarding table: frames for `mac`
/// go to the port at `port_index`, and no frame seen elsewhere moves it.
/// It goes with the port.
pub(crate) async fn pin_mac(
    handle: &Handle,
    port_index: u32,
    mac: [u8; 6],
) -> Result<(), NetError> {
    use rtnetlink::packet_route::neighbour::{NeighbourFlags, NeighbourState};
    let mut request = handle.neighbours().add_bridge(port_index, &mac).replace();
    let header = &mut request.message_mut().header;
    // NOARP without PERMANENT is `bridge fdb add .. master static`:
    // PERMANENT would make it the bridge's own address, delivered locally.
    header.state = NeighbourState::Noarp;
    header.flags = NeighbourFlags::Controller | NeighbourFlags::Sticky;
    request.execute().await.map_err(NetError::netlink(format!(
        "pin MAC {} to bridge port {port_index}",
        crate::addresses::mac_text(&mac)
    )))
}

/// Tells the host, on the bridge, which MAC a sandbox's address has (a
/// permanent neighbour entry), so it never asks: an address that served
/// another sandbox before keeps no stale MAC in the host's cache, which
/// would hold the host's packets to the new one (DNS answers, a linked
/// sandbox's traffic) until the kernel gave up on the old MAC.
pub(crate) async fn pin_neighbour(
    handle: &Handle,
    bridge_index: u32,
    address: Ipv4Addr,
    mac: [u8; 6],
) -> Result<(), NetError> {
    use rtnetlink::packet_route::neighbour::NeighbourState;
    handle
        .neighbours()
        .add(bridge_index, IpAddr::V4(address))
        .link_layer_address(&mac)
        .state(NeighbourState::Permanent)
        .replace()
        .execute()
        .await
        .map_err(NetError::netlink(format!(
            "pin {address} to {} on the bridge",
            crate::addresses::mac_text(&mac)
        )))
}

/// Removes what [`pin_neighbour`] made; a missing entry is not an error.
pub(crate) async fn unpin_neighbour(
    handle: &Handle,
    bridge_index: u32,
    address: Ipv4Addr,
) -> Result<(), NetError> {
    let mut request = handle.neighbours().add(bridge_index, IpAddr::V4(address));
    let message = request.message_mut().clone();
    match handle.neighbours().del(message).execute().await {
        Err(err) if errno(&err) == Some(libc::ENOENT) => Ok(()),
        other => other.map_err(NetError::netlink(format!("unpin {address} on the bridge"))),
    }
}

/// Inside a sandbox's namespace (`lo` and `eth0` are up already): the MAC
/// and address of `eth0`, the default route via the gateway.
pub(crate) async fn configure_inside(
    handle: &Handle,
    address: Ipv4Addr,
    mac: [u8; 6],
    prefix_len: u8,
    gateway: Ipv4Addr,
) -> Result<(), NetError> {
    // A veth's MAC may change while it is up.
    let set_mac = async {
        handle
            .link()
            .set(
                LinkUnspec::new_with_index(SANDBOX_LINK_INDEX)
                    .address(mac.to_vec())
                    .build(),
            )
            .execute()
            .await
            .map_err(NetError::netlink("set the MAC of the sandbox's eth0"))
    };
    let add_address = async {
        handle
            .address()
            .add(SANDBOX_LINK_INDEX, IpAddr::V4(address), prefix_len)
            .execute()
            .await
            .map_err(NetError::netlink(format!(
                "add {address} to the sandbox's eth0"
            )))
    };
    let (set_mac, add_address) = tokio::join!(set_mac, add_address);
    set_mac.and(add_address)?;
    // The gateway is reachable once eth0 has its address (and so the subnet
    // route); a missing carrier (the host end not up yet) does not matter.
    let route = RouteMessageBuilder::<Ipv4Addr>::new()
        .gateway(gateway)
        .output_interface(SANDBOX_LINK_INDEX)
        .build();
    handle
        .route()
        .add(route)
        .execute()
        .await
        .map_err(NetError::netlink(format!(
            "add the sandbox's default route via {gateway}"
        )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bridge_macs_are_local_unicast_and_stable() {
        let mac = bridge_mac("cove0");
        assert_eq!(mac.len(), 6);
        assert_eq!(mac[0] & 0x03, 0x02, "locally administered, unicast");
        assert_eq!(mac, bridge_mac("cove0"));
        assert_ne!(mac, bridge_mac("cove1"));
    }
}
