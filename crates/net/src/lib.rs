//! Sandbox networking: every sandbox gets a network namespace with one veth
//! into a host bridge, an address from a private range, NAT out of a configured
//! uplink, an egress policy enforced in nftables sets, and cove's own DNS
//! resolver, which admits the addresses of allowed names.
//!
//! [`Network`] is made once at server start ([`Network::new`] also removes what
//! a previous run left); [`Network::attach`] makes a sandbox's namespace (a file
//! the container joins with `setns`), [`Network::set_policy`] changes its
//! policy live, [`Network::detach`] removes every trace of it. The create path
//! (`attach`) uses only netlink; the `nft` binary runs only at start and
//! shutdown to load and delete the ruleset.
//!
//! Module map: `config` (what the server sets), `policy` (what a sandbox may
//! reach), `closed` (what no sandbox reaches: the host's world),
//! `addresses` (persistent allocation), `netns` (namespace files and
//! a pool of ready namespaces with their veths),
//! `links` (rtnetlink: bridge, veth, routes, rules), `nft` (ruleset and set
//! elements), `resolver` (DNS).
//!
//! This crate knows nothing of containers, HTTP or the database; the container
//! runtime only sees the namespace path and the resolv.conf text.

mod addresses;
mod closed;
mod config;
mod error;
mod links;
mod netns;
mod nft;
mod policy;
mod resolver;
mod tap;

use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use config::{nameservers, ConfigError, NetworkConfig, Uplink};
pub use error::NetError;
pub use ipnet::Ipv4Net;
pub use nft::elements::BatchError;
pub use policy::{Policy, PolicyError};

use addresses::AddressBook;
use closed::ClosedRanges;
use nft::elements::{Change, Element};
use nft::Firewall;
use policy::{CompiledPolicy, Resolution};
use resolver::Resolver;

/// An address a resolver answer admits stays reachable for the record's TTL,
/// but at least this long (a TTL of 0 would admit nothing usable) ...
const MIN_ADMIT: Duration = Duration::from_secs(10);
/// ... and at most this long.
const MAX_ADMIT: Duration = Duration::from_secs(24 * 3600);
/// An admitted address this close to expiry is re-added rather than replaced:
/// the kernel may drop it between our delete and add.
const EXPIRY_MARGIN: Duration = Duration::from_secs(2);
/// At most this many admitted addresses per sandbox: a wildcard lets a
/// sandbox resolve names without end, and each admission is kernel memory.
const MAX_LEARNED: usize = 4096;

/// How a sandbox meets the bridge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// A network namespace of its own with a veth (containers).
    Namespace,
    /// A TAP device the sandbox's VM opens; the guest configures the address.
    Tap,
}

/// What the runtime joins or opens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Link {
    /// The namespace file to `setns` into (`CLONE_NEWNET`); `eth0` inside
    /// has the address and the default route already.
    Namespace(PathBuf),
    /// The TAP device's name; the guest gives its NIC the address, the
    /// gateway route and the MAC [`Attachment::guest_mac`].
    Tap(String),
}

/// What a sandbox's runtime needs to put it on the network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub link: Link,
    pub address: Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: Ipv4Addr,
    /// The host end of the sandbox's veth, a port of the bridge.
    pub host_link: String,
    /// The sandbox's NIC's MAC (`eth0` of a container, a VM's virtio NIC),
    /// pinned to its port on the bridge.
    pub mac: [u8; 6],
    /// The sandbox's `/etc/resolv.conf`: cove's resolver, never the host's.
    pub resolv_conf: String,
}

impl Attachment {
    /// The namespace file of a [`Link::Namespace`] attachment.
    pub fn netns_path(&self) -> Option<&Path> {
        match &self.link {
            Link::Namespace(path) => Some(path),
            Link::Tap(_) => None,
        }
    }

    /// The MAC a VM's NIC must use: random (locally administered, unicast)
    /// and kept with the address, so it is unique on the bridge and the same
    /// across pause, resume and restart. A VM restored from another's memory
    /// (a template, a snapshot, a fork) starts with that one's MAC, which the
    /// bridge drops until the guest takes this one.
    pub fn guest_mac(&self) -> [u8; 6] {
        self.mac
    }
}

/// The sandbox network of one server.
pub struct Network {
    /// Held while this network exists: one server per bridge on a host.
    _bridge_lock: nix::fcntl::Flock<std::fs::File>,
    shared: Arc<Shared>,
    host: rtnetlink::Handle,
    /// The bridge's interface index, for the host's neighbour entries.
    bridge_index: u32,
    pool: netns::Pool,
    resolver: Mutex<Option<Resolver>>,
    /// Ports of detached sandboxes being deleted in the background (see
    /// [`Deletion::Background`]); a shutdown waits for them.
    retiring: Mutex<tokio::task::JoinSet<()>>,
}

/// Where bridge locks live: per boot, like the links they guard.
const LOCK_DIR: &str = "/run/cove";

/// Takes the host-wide lock of `bridge`, or says which server holds it. The
/// kernel drops it when the holder exits, so a crashed server's successor
/// gets it.
fn lock_bridge(bridge: &str) -> Result<nix::fcntl::Flock<std::fs::File>, NetError> {
    std::fs::create_dir_all(LOCK_DIR).map_err(NetError::io(format!("create {LOCK_DIR}")))?;
    let path = Path::new(LOCK_DIR).join(format!("bridge-{bridge}.lock"));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(NetError::io(format!("open {}", path.display())))?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(lock),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(NetError::Config(format!(
            "bridge {bridge} is in use by another cove server on this host; give this one \
             its own --bridge, --network-range and --route-table (or --no-network)"
        ))),
        Err((_, error)) => Err(NetError::Config(format!(
            "locking {}: {error}",
            path.display()
        ))),
    }
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

/// When a detach deletes the sandbox's port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deletion {
    /// Before the detach returns.
    Now,
    /// In the background, after it returns: the sandbox is off the network
    /// when the detach returns (its firewall elements, neighbour entry and
    /// namespace file are gone, and the port leads nowhere), and a new attach
    /// takes a port of another name, so nothing waits on the deletion (a
    /// link's, which waits out an RCU grace period, ~10 ms) but
    /// [`Network::shutdown`]. For a pause, whose machine keeps the port
    /// unplugged and frozen.
    Background,
}

/// What the resolver shares with the network.
struct Shared {
    config: NetworkConfig,
    /// What no sandbox reaches; the resolver admits none of it either.
    closed: ClosedRanges,
    firewall: Firewall,
    state: Mutex<State>,
}

struct State {
    book: AddressBook,
    attached: HashMap<String, Sandbox>,
    by_address: HashMap<Ipv4Addr, String>,
    /// Ids with an attach or detach under way.
    busy: HashSet<String>,
    /// Pairs of sandboxes that reach each other, and answer by name.
    links: Vec<Pairing>,
}

/// Two linked sandboxes: each reaches the other, and cove's resolver answers
/// the other's name with its address.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Pairing {
    ends: [LinkEnd; 2],
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct LinkEnd {
    id: String,
    name: String,
    address: Ipv4Addr,
}

impl Pairing {
    /// The end that is not `id`, if `id` is one of them.
    fn peer_of(&self, id: &str) -> Option<&LinkEnd> {
        match &self.ends {
            [a, b] if a.id == id => Some(b),
            [a, b] if b.id == id => Some(a),
            _ => None,
        }
    }
}

struct Sandbox {
    address: Ipv4Addr,
    mac: [u8; 6],
    kind: LinkKind,
    port: String,
    policy: CompiledPolicy,
    /// Addresses the resolver admitted, and when the kernel forgets them.
    learned: HashMap<Ipv4Addr, Instant>,
}

/// An id names a file under the state dir: one plain path component.
fn check_id(id: &str) -> Result<(), NetError> {
    match cove_protocol::SandboxId::parse(id) {
        Ok(_) => Ok(()),
        Err(invalid) => Err(NetError::InvalidId { id: invalid.id }),
    }
}

impl Network {
    /// Sets up the bridge, routing, firewall and resolver, after removing
    /// whatever a previous run with this config left (namespaces, links, rules,
    /// set elements). Address allocations are kept.
    pub async fn new(config: NetworkConfig) -> Result<Self, NetError> {
        config.validate()?;
        // Before anything is touched: what follows removes the ports and
        // namespaces a previous run on this bridge left, which would be a
        // running server's if one still used it.
        let bridge_lock = lock_bridge(&config.bridge)?;
        let netns_dir = config.netns_dir();
        std::fs::create_dir_all(&netns_dir)
            .map_err(NetError::io(format!("create {}", netns_dir.display())))?;
        let (connection, host, _) =
            rtnetlink::new_connection().map_err(NetError::io("open a netlink socket"))?;
        tokio::spawn(connection);

        let stale = netns::remove_all(&netns_dir)?;
        let ports = links::delete_ports(&host, &config).await?;
        if !stale.is_empty() || !ports.is_empty() {
            tracing::info!(
                namespaces = stale.len(),
                links = ports.len(),
                "removed the sandbox network of a previous run"
            );
        }
        let uplink_index = links::index_of(&host, &config.uplink.interface)
            .await?
            .ok_or_else(|| {
                NetError::Config(format!(
                    "uplink interface {} does not exist",
                    config.uplink.interface
                ))
            })?;
        // The uplink's LAN as it is now: an address it gets later (DHCP on
        // another subnet) is not closed until the next start.
        let uplink_subnets = links::ipv4_subnets(&host, uplink_index).await?;
        let closed = ClosedRanges::new(&uplink_subnets, &config.allow_private_egress);
        tracing::info!(
            uplink_subnets = ?uplink_subnets,
            opened = ?config.allow_private_egress,
            "sandboxes reach no private, link-local or uplink address except those opened"
        );
        let bridge_index = links::create_bridge(&host, &config).await?;
        // From here a failure takes down what this start made on the host
        // (a resolver address taken, say), so nothing is left behind.
        let undo = config.clone();
        match Self::finish(config, closed, &host, uplink_index, bridge_index).await {
            Ok((shared, resolver)) => Ok(Self {
                _bridge_lock: bridge_lock,
                pool: netns::Pool::new(
                    shared.config.netns_pool,
                    host.clone(),
                    shared.config.clone(),
                    bridge_index,
                ),
                shared,
                host,
                bridge_index,
                resolver: Mutex::new(Some(resolver)),
                retiring: Mutex::new(tokio::task::JoinSet::new()),
            }),
            Err(error) => {
                let _ = nft::run_nft(&nft::teardown(&undo)).await;
                let _ = links::remove_routing(&host, &undo, Some(uplink_index)).await;
                let _ = links::delete_link(&host, &undo.bridge).await;
                Err(error)
            }
        }
    }

    /// The rest of `new` once the bridge is made: forwarding, routes, the
    /// firewall, the address book and the resolver.
    async fn finish(
        config: NetworkConfig,
        closed: ClosedRanges,
        host: &rtnetlink::Handle,
        uplink_index: u32,
        bridge_index: u32,
    ) -> Result<(Arc<Shared>, Resolver), NetError> {
        links::enable_forwarding(&config)?;
        links::install_routing(host, &config, uplink_index, bridge_index).await?;
        nft::run_nft(&nft::ruleset(&config, &closed)).await?;

        let shared = Arc::new(Shared {
            closed,
            firewall: Firewall::open(&config)?,
            state: Mutex::new(State {
                book: AddressBook::load(&config)?,
                attached: HashMap::new(),
                by_address: HashMap::new(),
                links: Vec::new(),
                busy: HashSet::new(),
            }),
            config,
        });
        let upstreams = shared
            .config
            .dns_upstreams
            .iter()
            .map(|a| SocketAddrV4::new(*a, 53))
            .collect();
        let resolver = Resolver::start(
            SocketAddrV4::new(shared.config.gateway(), 53),
            upstreams,
            shared.config.route_table,
            Arc::clone(&shared) as Arc<dyn resolver::Policies>,
        )
        .await?;
        Ok((shared, resolver))
    }

    pub fn config(&self) -> &NetworkConfig {
        &self.shared.config
    }

    /// The `/etc/resolv.conf` of every sandbox: cove's resolver on the gateway.
    pub fn resolv_conf(&self) -> String {
        format!("nameserver {}\n", self.shared.config.gateway())
    }

    /// Puts a container sandbox on the network with `policy`: its namespace,
    /// veth, address and firewall elements. Attaching an attached sandbox
    /// applies the policy and returns the same attachment.
    pub async fn attach(&self, id: &str, policy: &Policy) -> Result<Attachment, NetError> {
        self.attach_as(id, policy, LinkKind::Namespace).await
    }

    /// Puts a sandbox on the network through `kind` of link: a namespace
    /// (containers) or a TAP device (VMs). Otherwise as [`Network::attach`].
    pub async fn attach_as(
        &self,
        id: &str,
        policy: &Policy,
        kind: LinkKind,
    ) -> Result<Attachment, NetError> {
        check_id(id)?;
        let compiled = policy.compile()?;
        let (offset, mac) = match self.shared.reserve(id)? {
            Reserved::Attached => {
                self.set_policy(id, policy).await?;
                let (address, mac, kind, port) = self.shared.address_of(id)?;
                return Ok(self.attachment(id, address, mac, kind, port));
            }
            Reserved::Offset(offset, mac) => (offset, mac),
        };
        let config = &self.shared.config;
        let address = config.sandbox_address(offset);
        let built = self.build(id, address, mac, kind, &compiled).await;
        if kind == LinkKind::Namespace {
            self.pool.refill();
        }
        let mut state = self.shared.lock();
        state.busy.remove(id);
        let port = built?;
        state.by_address.insert(address, id.to_owned());
        state.attached.insert(
            id.to_owned(),
            Sandbox {
                address,
                mac,
                kind,
                port: port.clone(),
                policy: compiled,
                learned: HashMap::new(),
            },
        );
        drop(state);
        Ok(self.attachment(id, address, mac, kind, port))
    }

    fn attachment(
        &self,
        id: &str,
        address: Ipv4Addr,
        mac: [u8; 6],
        kind: LinkKind,
        host_link: String,
    ) -> Attachment {
        let config = &self.shared.config;
        Attachment {
            link: match kind {
                LinkKind::Namespace => Link::Namespace(config.netns_dir().join(id)),
                LinkKind::Tap => Link::Tap(host_link.clone()),
            },
            address,
            prefix_len: config.range.prefix_len(),
            gateway: config.gateway(),
            host_link,
            mac,
            resolv_conf: self.resolv_conf(),
        }
    }

    /// Makes the kernel objects of a sandbox; on failure removes what it made.
    /// Returns the name of the sandbox's port (the veth's host end, or the TAP
    /// device).
    async fn build(
        &self,
        id: &str,
        address: Ipv4Addr,
        mac: [u8; 6],
        kind: LinkKind,
        policy: &CompiledPolicy,
    ) -> Result<String, NetError> {
        let config = &self.shared.config;
        let path = config.netns_dir().join(id);
        let mut made_link = None;
        let mut port = String::new();
        let made = async {
            match kind {
                LinkKind::Namespace => {
                    let namespace = self.pool.take().await?;
                    made_link = Some(namespace.host_link);
                    port = namespace.port.clone();
                    namespace.pin(&path)?;
                    let inside = links::configure_inside(
                        &namespace.handle,
                        address,
                        mac,
                        config.range.prefix_len(),
                        config.gateway(),
                    );
                    let pinned = links::pin_mac(&self.host, namespace.host_link, mac);
                    let (inside, pinned) = tokio::join!(inside, pinned);
                    inside.and(pinned)?;
                }
                LinkKind::Tap => {
                    let (name, bridge_index) = self.pool.next_port();
                    port = name;
                    tap::create(&port)?;
                    match links::enslave_tap(&self.host, &port, bridge_index).await {
                        Ok(index) => made_link = Some(index),
                        Err(err) => {
                            let _ = links::delete_link(&self.host, &port).await;
                            return Err(err);
                        }
                    }
                    if let Some(index) = made_link {
                        links::pin_mac(&self.host, index, mac).await?;
                    }
                }
            }
            links::pin_neighbour(&self.host, self.bridge_index, address, mac).await?;
            self.shared
                .firewall
                .apply(&nft::sandbox_changes(
                    Change::Add,
                    &port,
                    mac,
                    address,
                    policy,
                ))
                .map_err(NetError::firewall(format!(
                    "add the firewall elements of sandbox {id}"
                )))
        }
        .await;
        match made {
            Ok(()) => Ok(port),
            Err(err) => {
                // Deleting what may not exist fails on the first missing
                // element, so each set is tried alone.
                for change in nft::sandbox_changes(Change::Delete, &port, mac, address, policy) {
                    let _ = self.shared.firewall.apply(&[change]);
                }
                let _ = links::unpin_neighbour(&self.host, self.bridge_index, address).await;
                if let Some(index) = made_link {
                    let _ = links::delete_index(&self.host, index).await;
                }
                let _ = netns::remove(&path);
                Err(err)
            }
        }
    }

    /// Replaces a sandbox's policy; takes effect for the next packet.
    pub async fn set_policy(&self, id: &str, policy: &Policy) -> Result<(), NetError> {
        check_id(id)?;
        let new = policy.compile()?;
        let mut state = self.shared.lock();
        let sandbox = state
            .attached
            .get_mut(id)
            .ok_or_else(|| NetError::NotAttached { id: id.to_owned() })?;
        let changes = nft::policy_diff(sandbox.address, &sandbox.policy, &new);
        self.shared
            .firewall
            .apply(&changes)
            .map_err(NetError::firewall(format!(
                "change the policy of sandbox {id}"
            )))?;
        let domains_changed = sandbox.policy.domains != new.domains;
        sandbox.policy = new;
        if domains_changed {
            // What the old names resolved to is not what the new ones allow.
            let learned = std::mem::take(&mut sandbox.learned);
            self.shared.forget_learned(sandbox.address, learned);
        }
        Ok(())
    }

    /// Links two attached sandboxes (`(id, name)` each): each may reach the
    /// other, which cove's resolver names for it, whatever their egress
    /// policies say; every other sandbox stays out of reach. The link lasts
    /// until [`Network::unlink`] or the release of either; linking a pair
    /// again changes nothing.
    pub fn link(&self, a: (&str, &str), b: (&str, &str)) -> Result<(), NetError> {
        check_id(a.0)?;
        check_id(b.0)?;
        let mut state = self.shared.lock();
        let end = |(id, name): (&str, &str)| {
            state
                .attached
                .get(id)
                .map(|sandbox| LinkEnd {
                    id: id.to_owned(),
                    name: name.to_owned(),
                    address: sandbox.address,
                })
                .ok_or_else(|| NetError::NotAttached { id: id.to_owned() })
        };
        let link = Pairing {
            ends: [end(a)?, end(b)?],
        };
        if state.links.contains(&link) {
            return Ok(());
        }
        let [first, second] = &link.ends;
        self.shared
            .firewall
            .apply(&[nft::link_changes(
                Change::Add,
                first.address,
                second.address,
            )])
            .map_err(NetError::firewall(format!(
                "link sandboxes {} and {}",
                a.0, b.0
            )))?;
        state.links.push(link);
        Ok(())
    }

    /// Ends every link of `id`; a sandbox with none is not an error.
    pub fn unlink(&self, id: &str) -> Result<(), NetError> {
        let mut state = self.shared.lock();
        let (gone, kept): (Vec<Pairing>, Vec<Pairing>) = std::mem::take(&mut state.links)
            .into_iter()
            .partition(|link| link.peer_of(id).is_some());
        state.links = kept;
        let changes: Vec<_> = gone
            .iter()
            .map(|link| {
                nft::link_changes(Change::Delete, link.ends[0].address, link.ends[1].address)
            })
            .collect();
        self.shared
            .firewall
            .apply(&changes)
            .map_err(NetError::firewall(format!("unlink sandbox {id}")))
    }

    /// How many network namespaces (with their veths) wait ready for
    /// containers, the network's warm pool.
    pub fn ready_namespaces(&self) -> usize {
        self.pool.ready()
    }

    /// The attached sandboxes' ids and addresses.
    pub fn attached(&self) -> Vec<(String, Ipv4Addr)> {
        let state = self.shared.lock();
        let mut list: Vec<_> = state
            .attached
            .iter()
            .map(|(id, s)| (id.clone(), s.address))
            .collect();
        list.sort();
        list
    }

    /// Removes a sandbox from the network: its firewall elements, veth or TAP
    /// device (now or in the background, per `deletion`), and namespace file.
    /// It keeps its address for the next attach. Detaching a sandbox that is
    /// not attached is not an error.
    pub async fn detach(&self, id: &str, deletion: Deletion) -> Result<(), NetError> {
        check_id(id)?;
        let sandbox = {
            let mut state = self.shared.lock();
            if !state.busy.insert(id.to_owned()) {
                return Err(NetError::Busy { id: id.to_owned() });
            }
            let sandbox = state.attached.remove(id);
            if let Some(sandbox) = &sandbox {
                state.by_address.remove(&sandbox.address);
            }
            sandbox
        };
        let removed = self.teardown(id, sandbox, deletion).await;
        self.shared.lock().busy.remove(id);
        removed
    }

    /// Waits for the ports detached with [`Deletion::Background`] to be deleted.
    pub async fn retired(&self) {
        let mut retiring = std::mem::take(&mut *self.retiring.lock().expect("retiring lock"));
        while retiring.join_next().await.is_some() {}
    }

    /// A sandbox that is not attached may still have a namespace file (a
    /// detach that failed halfway); a leftover port of one is deleted at the
    /// next start.
    async fn teardown(
        &self,
        id: &str,
        sandbox: Option<Sandbox>,
        deletion: Deletion,
    ) -> Result<(), NetError> {
        let config = &self.shared.config;
        if let Some(sandbox) = sandbox {
            self.shared
                .firewall
                .apply(&nft::sandbox_changes(
                    Change::Delete,
                    &sandbox.port,
                    sandbox.mac,
                    sandbox.address,
                    &sandbox.policy,
                ))
                .map_err(NetError::firewall(format!(
                    "delete the firewall elements of sandbox {id}"
                )))?;
            self.shared.forget_learned(sandbox.address, sandbox.learned);
            links::unpin_neighbour(&self.host, self.bridge_index, sandbox.address).await?;
            match deletion {
                Deletion::Now => links::delete_link(&self.host, &sandbox.port).await?,
                Deletion::Background => {
                    let (host, port) = (self.host.clone(), sandbox.port);
                    let mut retiring = self.retiring.lock().expect("retiring lock");
                    while retiring.try_join_next().is_some() {}
                    retiring.spawn(async move {
                        if let Err(error) = links::delete_link(&host, &port).await {
                            // The next server start deletes it (a port of this bridge).
                            tracing::warn!(%port, %error, "deleting a detached sandbox's port");
                        }
                    });
                }
            }
        }
        netns::remove(&config.netns_dir().join(id))
    }

    /// Detaches the sandbox, ends its links and gives up its address (for a
    /// deleted sandbox).
    pub async fn release(&self, id: &str) -> Result<(), NetError> {
        self.detach(id, Deletion::Now).await?;
        self.unlink(id)?;
        let mut state = self.shared.lock();
        if state.book.release(id) {
            state.book.save(&self.shared.config)?;
        }
        Ok(())
    }

    /// Stops the resolver and removes everything the network made on the host:
    /// every sandbox's objects, the firewall tables, the rules and route, and
    /// the bridge. Address allocations stay on disk.
    pub async fn shutdown(&self) -> Result<(), NetError> {
        drop(self.resolver.lock().expect("resolver lock").take());
        self.pool.close().await;
        self.retired().await;
        let ids: Vec<String> = self.attached().into_iter().map(|(id, _)| id).collect();
        for id in ids {
            self.detach(&id, Deletion::Now).await?;
        }
        let config = &self.shared.config;
        nft::run_nft(&nft::teardown(config)).await?;
        let uplink_index = links::index_of(&self.host, &config.uplink.interface).await?;
        links::remove_routing(&self.host, config, uplink_index).await?;
        links::delete_link(&self.host, &config.bridge).await?;
        netns::remove_all(&config.netns_dir())?;
        Ok(())
    }
}

/// What `attach` found for an id.
enum Reserved {
    Attached,
    /// Not attached: marked busy, with this address offset and MAC (saved).
    Offset(u32, [u8; 6]),
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("network state lock")
    }

    fn reserve(&self, id: &str) -> Result<Reserved, NetError> {
        let mut state = self.lock();
        if state.attached.contains_key(id) {
            return Ok(Reserved::Attached);
        }
        if !state.busy.insert(id.to_owned()) {
            return Err(NetError::Busy { id: id.to_owned() });
        }
        let reserved = match state.book.reserve(id) {
            Ok(reserved) => reserved,
            Err(err) => {
                state.busy.remove(id);
                return Err(err);
            }
        };
        let Some((offset, mac, changed)) = reserved else {
            state.busy.remove(id);
            return Err(NetError::RangeFull {
                range: self.config.range,
            });
        };
        if changed {
            if let Err(err) = state.book.save(&self.config) {
                state.book.release(id);
                state.busy.remove(id);
                return Err(err);
            }
        }
        Ok(Reserved::Offset(offset, mac))
    }

    fn address_of(&self, id: &str) -> Result<(Ipv4Addr, [u8; 6], LinkKind, String), NetError> {
        self.lock()
            .attached
            .get(id)
            .map(|s| (s.address, s.mac, s.kind, s.port.clone()))
            .ok_or_else(|| NetError::NotAttached { id: id.to_owned() })
    }

    /// Deletes admitted addresses that have not expired yet. Each may expire
    /// on its own meanwhile, and a batch fails whole on one missing element,
    /// so a failed batch is retried one element at a time.
    fn forget_learned(&self, sandbox: Ipv4Addr, learned: HashMap<Ipv4Addr, Instant>) {
        let now = Instant::now();
        let elements: Vec<Element> = learned
            .into_iter()
            .filter(|(_, expiry)| *expiry > now)
            .map(|(destination, _)| nft::learned(sandbox, destination, None))
            .collect();
        if elements.is_empty() {
            return;
        }
        let all = nft::learned_changes(Change::Delete, elements.clone());
        if self.firewall.apply(&[all]).is_err() {
            for element in elements {
                let _ = self
                    .firewall
                    .apply(&[nft::learned_changes(Change::Delete, vec![element])]);
            }
        }
    }
}

impl resolver::Policies for Shared {
    fn resolution(&self, source: Ipv4Addr, name: &str) -> Resolution {
        let state = self.lock();
        let Some((id, sandbox)) = state
            .by_address
            .get(&source)
            .and_then(|id| Some((id, state.attached.get(id)?)))
        else {
            return Resolution::Refuse;
        };
        // A linked sandbox answers by its name, whatever the policy says.
        let wanted = name.trim_end_matches('.');
        let peer = state
            .links
            .iter()
            .filter_map(|link| link.peer_of(id))
            .find(|peer| peer.name.eq_ignore_ascii_case(wanted));
        match peer {
            Some(peer) => Resolution::Peer(peer.address),
            None => sandbox.policy.resolve(name),
        }
    }

    fn admit(
        &self,
        source: Ipv4Addr,
        name: &str,
        answers: &[(Ipv4Addr, u32)],
    ) -> Result<(), NetError> {
        let mut state = self.lock();
        let State {
            by_address,
            attached,
            ..
        } = &mut *state;
        let Some(sandbox) = by_address.get(&source).and_then(|id| attached.get_mut(id)) else {
            return Ok(()); // detached meanwhile: nothing to admit to
        };
        if sandbox.policy.resolve(name) != (Resolution::Forward { admit: true }) {
            return Ok(()); // the policy changed while upstream answered
        }
        let now = Instant::now();
        sandbox.learned.retain(|_, expiry| *expiry > now);
        let mut replaced = Vec::new();
        let mut added = Vec::new();
        let mut expiries = Vec::new();
        for (destination, ttl) in answers {
            // The answer still goes to the sandbox as upstream gave it: the
            // firewall's fixed deny is what keeps the address closed, for an
            // open sandbox (which may ask any resolver) as for this one, so
            // rewriting it would hide nothing, and an unchanged record shows
            // why a connection to the name fails. It is only not admitted.
            if self.closed.contains(*destination) {
                tracing::debug!(sandbox = %source, name, %destination, "resolver: not admitting a closed address");
                continue;
            }
            if sandbox.learned.len() + added.len() >= MAX_LEARNED
                && !sandbox.learned.contains_key(destination)
            {
                tracing::warn!(sandbox = %source, name, "resolver: too many admitted addresses; not admitting more");
                break;
            }
            let timeout = Duration::from_secs(u64::from(*ttl)).clamp(MIN_ADMIT, MAX_ADMIT);
            let expiry = now + timeout;
            match sandbox.learned.get(destination) {
                Some(current) if *current >= expiry => continue,
                // Re-adding an element that exists keeps its old timeout, so
                // extending one means deleting it first, in the same batch.
                Some(current) if *current > now + EXPIRY_MARGIN => {
                    replaced.push(nft::learned(source, *destination, None));
                }
                _ => {}
            }
            added.push(nft::learned(
                source,
                *destination,
                Some(timeout.as_millis() as u64),
            ));
            expiries.push((*destination, expiry));
        }
        if added.is_empty() {
            return Ok(());
        }
        let batch = [
            nft::learned_changes(Change::Delete, replaced),
            nft::learned_changes(Change::Add, added.clone()),
        ];
        let applied = self.firewall.apply(&batch).or_else(|err| {
            // An element expired between our check and the delete.
            if err.errno() == Some(libc::ENOENT) {
                self.firewall
                    .apply(&[nft::learned_changes(Change::Add, added)])
            } else {
                Err(err)
            }
        });
        applied.map_err(NetError::firewall(format!(
            "admit the addresses of {name} for sandbox {source}"
        )))?;
        sandbox.learned.extend(expiries);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_single_path_components() {
        for good in ["sb1", "a-b_c.d"] {
            assert!(check_id(good).is_ok(), "{good}");
        }
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(129)] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_pairing_names_each_end_the_other_and_no_one_else() {
        let end = |id: &str, last| LinkEnd {
            id: id.into(),
            name: format!("name-{id}"),
            address: Ipv4Addr::new(10, 77, 0, last),
        };
        let pairing = Pairing {
            ends: [end("a", 2), end("b", 3)],
        };
        assert_eq!(pairing.peer_of("a").map(|p| p.id.as_str()), Some("b"));
        assert_eq!(
            pairing.peer_of("b").map(|p| p.name.as_str()),
            Some("name-a")
        );
        assert_eq!(pairing.peer_of("c"), None);
    }
}
