//! A fake internet for the network tests, all on this machine: a namespace
//! `fakenet-<tag>` joined to the host by a veth (the uplink cove is given), with
//! a DNS server (allowed.test -> 198.51.100.10, denied.test -> 203.0.113.10,
//! metadata.test -> 169.254.169.254, private.test -> 192.168.77.5) and an HTTP
//! server on each of those addresses and on the uplink's far end (a neighbour
//! on the host's LAN). The metadata and private servers are what a cloud host
//! has next to it: its credentials service and its private network. Their
//! addresses exist only in this namespace. Sandbox traffic reaches it only
//! through cove's routing table, whose default route is this veth, so nothing
//! a test does leaves the machine. Everything is removed on drop, also when
//! the test failed.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cove_net::{Network, NetworkConfig, Uplink};
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{rdata::A, Name, RData, Record, RecordType};

pub(crate) const ALLOWED_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
pub(crate) const DENIED_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
pub(crate) const DNS_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 53);
/// A cloud host's metadata service (its credentials), faked.
pub(crate) const METADATA_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// A host on the cloud host's private network, faked.
pub(crate) const PRIVATE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 5);
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_millis(1500);

/// Whether the tests can run here; says why not when they cannot.
/// Skipped, or failed under `COVE_TEST_STRICT=1` (`cove-testenv`), without.
pub(crate) fn can_run() -> bool {
    cove_testenv::root("the network tests (namespaces, links, nftables)")
        && cove_testenv::program("nft", "apt-get install nftables")
}

fn run(args: &[&str]) -> Result<(), String> {
    let output = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{args:?}: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{args:?}: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

fn output(args: &[&str]) -> String {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// One test's world: the fake internet, a state dir and a network config
/// whose names and numbers no other test uses.
pub(crate) struct World {
    pub tag: String,
    pub config: NetworkConfig,
    pub state: PathBuf,
    fakenet: String,
    uplink: String,
    /// Names the fake DNS server was asked for, in order.
    pub dns_log: Arc<Mutex<Vec<String>>>,
    servers: Option<(
        std::thread::JoinHandle<()>,
        tokio::sync::watch::Sender<bool>,
    )>,
}

impl World {
    pub(crate) fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // Bridge names are at most 8 characters: "ct", 4 hex of the pid, the test number.
        let tag = format!("ct{:04x}{n:x}", pid & 0xffff);
        let k = ((pid as u8) as u32 * 16 + n) % 250 + 1;
        let state = std::env::temp_dir().join(format!("cove-net-{tag}"));
        let fakenet = format!("fakenet-{tag}");
        let uplink = format!("{tag}u");
        let config = NetworkConfig {
            bridge: tag.clone(),
            range: format!("10.250.{k}.0/24").parse().unwrap(),
            uplink: Uplink {
                interface: uplink.clone(),
                gateway: Ipv4Addr::new(198, 18, k as u8, 2),
            },
            dns_upstreams: vec![DNS_IP],
            state_dir: state.clone(),
            route_table: 20000 + (pid % 1000) * 16 + n,
            rule_priority: 7000 + n,
            netns_pool: 2,
            allow_private_egress: Vec::new(),
            quiet: Default::default(),
        };
        let mut world = Self {
            tag,
            config,
            state,
            fakenet,
            uplink,
            dns_log: Arc::default(),
            servers: None,
        };
        // The guard exists before anything is made, so a failure below cleans up.
        world.make_fakenet(k).expect("build the fake internet");
        world
    }

    fn make_fakenet(&mut self, k: u32) -> Result<(), String> {
        let ns = self.fakenet.clone();
        let host = format!("198.18.{k}.1/30");
        let far = format!("198.18.{k}.2/30");
        run(&["ip", "netns", "add", &ns])?;
        run(&[
            "ip",
            "link",
            "add",
            &self.uplink,
            "type",
            "veth",
            "peer",
            "name",
            "up0",
            "netns",
            &ns,
        ])?;
        run(&["ip", "addr", "add", &host, "dev", &self.uplink])?;
        run(&["ip", "link", "set", &self.uplink, "up"])?;
        // Answers come back from addresses the host's main table would send
        // elsewhere; strict reverse-path filtering would drop them.
        std::fs::write(
            format!("/proc/sys/net/ipv4/conf/{}/rp_filter", self.uplink),
            "0",
        )
        .map_err(|e| e.to_string())?;
        for args in [
            vec!["addr", "add", far.as_str(), "dev", "up0"],
            vec!["link", "set", "up0", "up"],
            vec!["link", "set", "lo", "up"],
            vec!["addr", "add", "198.51.100.10/32", "dev", "lo"],
            vec!["addr", "add", "198.51.100.53/32", "dev", "lo"],
            vec!["addr", "add", "203.0.113.10/32", "dev", "lo"],
            vec!["addr", "add", "169.254.169.254/32", "dev", "lo"],
            vec!["addr", "add", "192.168.77.5/32", "dev", "lo"],
        ] {
            let mut full = vec!["ip", "-n", ns.as_str()];
            full.extend(args);
            run(&full)?;
        }
        self.servers = Some(start_servers(
            Path::new("/run/netns").join(&ns),
            self.uplink_neighbour(),
            Arc::clone(&self.dns_log),
        ));
        Ok(())
    }

    /// The uplink's far end, on the host's LAN (its subnet is the uplink's).
    pub(crate) fn uplink_neighbour(&self) -> Ipv4Addr {
        self.config.uplink.gateway
    }

    /// This world's bridge forwarding entries for `mac`, as `bridge fdb`
    /// shows them (`MAC dev PORT master BRIDGE static sticky`).
    pub(crate) fn fdb_entries(&self, mac: &str) -> Vec<String> {
        output(&["bridge", "fdb", "show", "br", &self.tag])
            .lines()
            .filter(|line| line.starts_with(mac))
            .map(str::to_owned)
            .collect()
    }

    pub(crate) async fn network(&self) -> Network {
        self.try_network().await.expect("set up the network")
    }

    pub(crate) async fn try_network(&self) -> Result<Network, cove_net::NetError> {
        Network::new(self.config.clone()).await
    }

    /// Elements of this world's nftables tables, as `nft` lists them.
    pub(crate) fn nft_tables(&self) -> String {
        output(&["nft", "list", "table", "inet", &self.tag])
            + &output(&["nft", "list", "table", "bridge", &self.tag])
    }

    pub(crate) fn link_exists(&self, name: &str) -> bool {
        Command::new("ip")
            .args(["link", "show", name])
            .output()
            .is_ok_and(|o| o.status.success())
    }

    /// A link's index, which a recreated link of the same name does not share.
    pub(crate) fn ifindex(&self, name: &str) -> Option<String> {
        std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
            .ok()
            .map(|s| s.trim().to_owned())
    }

    /// Links whose names start with this world's bridge name, except the uplink.
    pub(crate) fn links(&self) -> Vec<String> {
        output(&["ip", "-o", "link", "show"])
            .lines()
            .filter_map(|line| line.split(": ").nth(1))
            .map(|name| name.split('@').next().unwrap_or(name).to_owned())
            .filter(|name| name.starts_with(&self.tag) && *name != self.uplink)
            .collect()
    }

    pub(crate) fn rules(&self) -> String {
        output(&["ip", "rule", "show"])
            .lines()
            .filter(|l| l.contains(&format!("lookup {}", self.config.route_table)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub(crate) fn routes(&self) -> String {
        output(&[
            "ip",
            "route",
            "show",
            "table",
            &self.config.route_table.to_string(),
        ])
    }

    pub(crate) fn netns_files(&self) -> Vec<String> {
        std::fs::read_dir(self.state.join("netns"))
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    pub(crate) fn mounts_under_state(&self) -> Vec<String> {
        let state = self.state.to_string_lossy().into_owned();
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(&state))
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // What a failed test may have left; each step tolerates "not there".
        let tag = self.tag.clone();
        let _ = run(&["nft", "delete", "table", "inet", &tag]);
        let _ = run(&["nft", "delete", "table", "bridge", &tag]);
        for link in self.links() {
            let _ = run(&["ip", "link", "del", &link]);
        }
        let table = self.config.route_table.to_string();
        for _ in 0..4 {
            if run(&["ip", "rule", "del", "table", &table]).is_err() {
                break;
            }
        }
        let _ = run(&["ip", "route", "flush", "table", &table]);
        for file in self.netns_files() {
            let path = self.state.join("netns").join(file);
            let _ = nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.state);
        // The bridge's lock file: nobody holds it once the world's networks are gone.
        let _ = std::fs::remove_file(format!("/run/cove/bridge-{tag}.lock"));
        if let Some((thread, stop)) = self.servers.take() {
            let _ = stop.send(true);
            let _ = thread.join();
        }
        let _ = run(&["ip", "link", "del", &self.uplink]);
        let _ = run(&["ip", "netns", "del", &self.fakenet]);
    }
}

/// Enters the network namespace at `path` for the rest of this thread's life.
pub(crate) fn enter(path: &Path) {
    let file = std::fs::File::open(path).expect("open the namespace");
    nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
}

/// Runs blocking `work` on a fresh thread inside the namespace at `netns` (a
/// fresh thread, so no pooled thread is left in it).
pub(crate) async fn inside<T: Send + 'static>(
    netns: &Path,
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    let path = netns.to_owned();
    tokio::task::spawn_blocking(move || {
        std::thread::spawn(move || {
            enter(&path);
            work()
        })
        .join()
        .expect("work inside the sandbox panicked")
    })
    .await
    .expect("join the sandbox thread")
}

/// The MAC of `eth0` in the namespace at `netns`, as `ip` prints it (not
/// from /sys, which stays the host's after entering only a network namespace).
pub(crate) fn eth0_mac(netns: &Path) -> String {
    let shown = output(&[
        "nsenter",
        &format!("--net={}", netns.display()),
        "ip",
        "-o",
        "link",
        "show",
        "eth0",
    ]);
    shown
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .unwrap_or_default()
        .to_owned()
}

/// `aa:bb:cc:dd:ee:ff` as bytes.
pub(crate) fn parse_mac(text: &str) -> [u8; 6] {
    let mut mac = [0u8; 6];
    for (byte, part) in mac.iter_mut().zip(text.trim().split(':')) {
        *byte = u8::from_str_radix(part, 16).unwrap();
    }
    mac
}

/// Sends one raw Ethernet frame out of `eth0` (index 2) of this thread's
/// namespace, as a sandbox with CAP_NET_RAW can.
#[allow(unsafe_code)]
pub(crate) fn send_frame(frame: &[u8]) -> std::io::Result<()> {
    // SAFETY: a plain socket call; the descriptor is owned right after.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor nothing else owns.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: sockaddr_ll is plain old data; all-zero is a valid value.
    let mut address: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    address.sll_family = libc::AF_PACKET as u16;
    address.sll_ifindex = 2;
    address.sll_halen = 6;
    address.sll_addr[..6].copy_from_slice(&frame[..6]);
    // SAFETY: the frame and the address outlive the call; the length is
    // the address's size.
    let sent = unsafe {
        libc::sendto(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&address as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// An Ethernet frame carrying a UDP datagram (to port 9, "discard") from
/// `source` to `destination`, sent from `from_mac` to `to_mac`.
pub(crate) fn udp_frame(
    from_mac: [u8; 6],
    to_mac: [u8; 6],
    source: Ipv4Addr,
    destination: Ipv4Addr,
) -> Vec<u8> {
    let payload = b"spoofed";
    let udp_len = 8 + payload.len();
    let total = 20 + udp_len;
    let mut ip = vec![
        0x45,
        0,
        (total >> 8) as u8,
        total as u8,
        0,
        0,
        0x40,
        0,
        64,
        17,
        0,
        0,
    ];
    ip.extend_from_slice(&source.octets());
    ip.extend_from_slice(&destination.octets());
    let sum = ip
        .chunks(2)
        .map(|pair| u32::from(u16::from_be_bytes([pair[0], pair[1]])))
        .sum::<u32>();
    let sum = (sum & 0xffff) + (sum >> 16);
    let folded = !(((sum & 0xffff) + (sum >> 16)) as u16);
    ip[10..12].copy_from_slice(&folded.to_be_bytes());
    let mut frame = Vec::new();
    frame.extend_from_slice(&to_mac);
    frame.extend_from_slice(&from_mac);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&40000u16.to_be_bytes());
    frame.extend_from_slice(&9u16.to_be_bytes());
    frame.extend_from_slice(&(udp_len as u16).to_be_bytes());
    frame.extend_from_slice(&[0, 0]); // no checksum
    frame.extend_from_slice(payload);
    frame
}

/// GET / from `address:port`: the body, or why it failed.
pub(crate) fn http_get(address: Ipv4Addr, port: u16) -> Result<String, String> {
    let target = SocketAddr::from((address, port));
    let mut stream = TcpStream::connect_timeout(&target, CONNECT_TIMEOUT)
        .map_err(|e| format!("connect {target}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET / HTTP/1.0\r\n\r\n")
        .map_err(|e| format!("send to {target}: {e}"))?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|e| format!("read from {target}: {e}"))?;
    Ok(response.split("\r\n\r\n").nth(1).unwrap_or("").to_owned())
}

fn a_query(name: &str) -> Vec<u8> {
    let mut query = Message::new();
    query
        .set_id(777)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true);
    query.add_query(Query::query(Name::from_str(name).unwrap(), RecordType::A));
    query.to_vec().unwrap()
}

/// Asks the resolver at `server` for the A records of `name`, over UDP.
pub(crate) fn resolve(
    server: Ipv4Addr,
    name: &str,
) -> Result<(ResponseCode, Vec<Ipv4Addr>), String> {
    let socket = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
    socket
        .set_read_timeout(Some(Duration::from_secs(3)))
        .map_err(|e| e.to_string())?;
    socket
        .send_to(&a_query(name), (server, 53))
        .map_err(|e| format!("send a query to {server}: {e}"))?;
    let mut buffer = vec![0u8; 4096];
    let len = socket
        .recv(&mut buffer)
        .map_err(|e| format!("no answer from {server} for {name}: {e}"))?;
    parse_answer(&buffer[..len])
}

/// The same over TCP.
pub(crate) fn resolve_tcp(
    server: Ipv4Addr,
    name: &str,
) -> Result<(ResponseCode, Vec<Ipv4Addr>), String> {
    let target = SocketAddr::from((server, 53));
    let mut stream = TcpStream::connect_timeout(&target, CONNECT_TIMEOUT)
        .map_err(|e| format!("connect {target}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .map_err(|e| e.to_string())?;
    let query = a_query(name);
    let mut framed = (query.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&query);
    stream.write_all(&framed).map_err(|e| e.to_string())?;
    let mut len = [0u8; 2];
    stream
        .read_exact(&mut len)
        .map_err(|e| format!("no answer from {target} for {name}: {e}"))?;
    let mut answer = vec![0u8; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut answer).map_err(|e| e.to_string())?;
    parse_answer(&answer)
}

fn parse_answer(bytes: &[u8]) -> Result<(ResponseCode, Vec<Ipv4Addr>), String> {
    let answer = Message::from_vec(bytes).map_err(|e| e.to_string())?;
    assert_eq!(answer.id(), 777);
    let addresses = answer
        .answers()
        .iter()
        .filter_map(|r| match r.data() {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect();
    Ok((answer.response_code(), addresses))
}

/// The fake internet's servers, on a thread inside its namespace.
fn start_servers(
    netns: PathBuf,
    neighbour: Ipv4Addr,
    dns_log: Arc<Mutex<Vec<String>>>,
) -> (
    std::thread::JoinHandle<()>,
    tokio::sync::watch::Sender<bool>,
) {
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        enter(&netns);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let dns = tokio::net::UdpSocket::bind(SocketAddrV4::new(DNS_IP, 53))
                .await
                .unwrap();
            let dns_tcp = tokio::net::TcpListener::bind(SocketAddrV4::new(DNS_IP, 53))
                .await
                .unwrap();
            let allowed = tokio::net::TcpListener::bind((ALLOWED_IP, 80))
                .await
                .unwrap();
            let denied = tokio::net::TcpListener::bind((DENIED_IP, 80))
                .await
                .unwrap();
            let metadata = tokio::net::TcpListener::bind((METADATA_IP, 80))
                .await
                .unwrap();
            let private = tokio::net::TcpListener::bind((PRIVATE_IP, 80))
                .await
                .unwrap();
            let lan = tokio::net::TcpListener::bind((neighbour, 80))
                .await
                .unwrap();
            ready_tx.send(()).unwrap();
            tokio::select! {
                _ = serve_dns(dns, Arc::clone(&dns_log)) => {}
                _ = serve_dns_tcp(dns_tcp, dns_log) => {}
                _ = serve_http(allowed, "allowed") => {}
                _ = serve_http(denied, "denied") => {}
                _ = serve_http(metadata, "metadata") => {}
                _ = serve_http(private, "private") => {}
                _ = serve_http(lan, "lan") => {}
                _ = stop_rx.wait_for(|stop| *stop) => {}
            }
        });
    });
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("fake internet servers started");
    (thread, stop_tx)
}

async fn serve_http(listener: tokio::net::TcpListener, body: &'static str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request).await;
            let response = format!(
                "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        });
    }
}

async fn serve_dns(socket: tokio::net::UdpSocket, log: Arc<Mutex<Vec<String>>>) {
    let mut buffer = vec![0u8; 4096];
    loop {
        let Ok((len, peer)) = socket.recv_from(&mut buffer).await else {
            continue;
        };
        if let Some(response) = dns_answer(&buffer[..len], &log) {
            let _ = socket.send_to(&response, peer).await;
        }
    }
}

/// DNS over TCP: one length-prefixed query, one answer, per connection.
async fn serve_dns_tcp(listener: tokio::net::TcpListener, log: Arc<Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            continue;
        };
        let log = Arc::clone(&log);
        tokio::spawn(async move {
            let Ok(len) = stream.read_u16().await else {
                return;
            };
            let mut query = vec![0u8; usize::from(len)];
            if stream.read_exact(&mut query).await.is_err() {
                return;
            }
            if let Some(response) = dns_answer(&query, &log) {
                let mut framed = (response.len() as u16).to_be_bytes().to_vec();
                framed.extend_from_slice(&response);
                let _ = stream.write_all(&framed).await;
            }
        });
    }
}

/// allowed.test and denied.test have A records (TTL 300); nothing else exists.
fn dns_answer(query: &[u8], log: &Mutex<Vec<String>>) -> Option<Vec<u8>> {
    let query = Message::from_vec(query).ok()?;
    let question = query.queries().first().cloned()?;
    let name = question.name().to_ascii().trim_end_matches('.').to_owned();
    log.lock().unwrap().push(name.clone());
    let mut response = Message::new();
    response
        .set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(query.recursion_desired())
        .set_recursion_available(true);
    response.add_query(question.clone());
    let address = match name.as_str() {
        "allowed.test" => Some(ALLOWED_IP),
        "denied.test" => Some(DENIED_IP),
        "metadata.test" => Some(METADATA_IP),
        "private.test" => Some(PRIVATE_IP),
        _ => None,
    };
    match (address, question.query_type()) {
        (Some(address), RecordType::A) => {
            response.add_answer(Record::from_rdata(
                question.name().clone(),
                300,
                RData::A(A(address)),
            ));
        }
        (Some(_), _) => {}
        (None, _) => {
            response.set_response_code(ResponseCode::NXDomain);
        }
    }
    response.to_vec().ok()
}
