//! cove's DNS resolver, on the gateway address, port 53, UDP and TCP. Every
//! sandbox's resolv.conf points here, so it sees every name a sandbox looks up:
//! it answers by the asking sandbox's policy (found by source address, which the
//! bridge table keeps honest), forwards what is allowed to the upstreams, and
//! admits the A records of answers to domain-restricted sandboxes into their
//! allow set before the answer leaves, so the connection that follows passes.
//!
//! Names that are not allowed are never forwarded, so a restricted sandbox
//! cannot tunnel data out through DNS queries either. Each sandbox gets a
//! share of the resolver (`limit`): a few TCP connections and queries in
//! flight; over it, a UDP query is dropped and a TCP connection closed.

mod limit;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::RData;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::policy::Resolution;
use crate::NetError;
use limit::PerSource;

/// How long one upstream may take to answer before the next is tried.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// A TCP client that sends nothing for this long is dropped.
const TCP_IDLE: Duration = Duration::from_secs(10);
/// Queries in flight at once, over all sandboxes; more are dropped (UDP) or
/// wait (TCP), so a flood costs bounded memory.
const MAX_IN_FLIGHT: usize = 512;
/// Queries in flight at once from one sandbox (UDP and TCP): a sixteenth of
/// the whole, so one sandbox whose queries upstream never answers (each held
/// up to `UPSTREAM_TIMEOUT` per upstream) leaves the rest to the others.
/// Resolvers in C libraries send at most a few queries per lookup.
const MAX_IN_FLIGHT_PER_SANDBOX: usize = 32;
/// Open TCP connections from one sandbox. Each is a task held up to
/// `TCP_IDLE`; clients fall back to TCP only for truncated answers.
const MAX_CONNECTIONS_PER_SANDBOX: usize = 8;

/// What the resolver needs from the network: the policy of whoever asks, and a
/// way to admit answered addresses.
pub(crate) trait Policies: Send + Sync + 'static {
    fn resolution(&self, source: Ipv4Addr, name: &str) -> Resolution;
    /// Admits `(address, ttl)` answers for `name` to `source`'s allow set; must
    /// recheck the policy, which may have changed while upstream answered.
    fn admit(
        &self,
        source: Ipv4Addr,
        name: &str,
        answers: &[(Ipv4Addr, u32)],
    ) -> Result<(), NetError>;
}

/// The running resolver; its tasks end when it is dropped.
#[derive(Debug)]
pub(crate) struct Resolver {
    _tasks: JoinSet<()>,
}

struct Context {
    policies: Arc<dyn Policies>,
    upstreams: Vec<SocketAddrV4>,
    mark: u32,
    in_flight: Arc<Semaphore>,
    queries: Arc<PerSource>,
    connections: Arc<PerSource>,
}

impl Resolver {
    /// Binds both sockets on `listen` (the gateway, which must be on a local
    /// interface already) and starts serving.
    pub(crate) async fn start(
        listen: SocketAddrV4,
        upstreams: Vec<SocketAddrV4>,
        mark: u32,
        policies: Arc<dyn Policies>,
    ) -> Result<Self, NetError> {
        let udp = UdpSocket::bind(listen)
            .await
            .map_err(NetError::io(format!("bind the resolver to udp {listen}")))?;
        let tcp = TcpListener::bind(listen)
            .await
            .map_err(NetError::io(format!("bind the resolver to tcp {listen}")))?;
        let context = Arc::new(Context {
            policies,
            upstreams,
            mark,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            queries: PerSource::new("queries in flight", MAX_IN_FLIGHT_PER_SANDBOX),
            connections: PerSource::new("TCP connections", MAX_CONNECTIONS_PER_SANDBOX),
        });
        let mut tasks = JoinSet::new();
        tasks.spawn(serve_udp(Arc::new(udp), Arc::clone(&context)));
        tasks.spawn(serve_tcp(tcp, context));
        Ok(Self { _tasks: tasks })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Transport {
    Udp,
    Tcp,
}

async fn serve_udp(socket: Arc<UdpSocket>, context: Arc<Context>) {
    let mut buffer = vec![0u8; 4096];
    loop {
        let (len, peer) = match socket.recv_from(&mut buffer).await {
            Ok(received) => received,
            Err(err) => {
                tracing::warn!(error = %err, "resolver: receive failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let SocketAddr::V4(source) = peer else {
            continue; // bound to an IPv4 address: never
        };
        // The client retries; dropping is what an overloaded server does.
        let Ok(slot) = context.queries.try_take(*source.ip()) else {
            continue;
        };
        let Ok(permit) = Arc::clone(&context.in_flight).try_acquire_owned() else {
            continue;
        };
        let query = buffer[..len].to_vec();
        let socket = Arc::clone(&socket);
        let context = Arc::clone(&context);
        tokio::spawn(async move {
            if let Some(reply) = answer(&context, peer, &query, Transport::Udp).await {
                let _ = socket.send_to(&reply, peer).await;
            }
            drop((permit, slot));
        });
    }
}

async fn serve_tcp(listener: TcpListener, context: Arc<Context>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(error = %err, "resolver: accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let SocketAddr::V4(source) = peer else {
            continue;
        };
        // Closing at once refuses the connection; the client tries UDP or
        // again later.
        let Ok(connection) = context.connections.try_take(*source.ip()) else {
            continue;
        };
        let context = Arc::clone(&context);
        tokio::spawn(async move {
            let _ = serve_tcp_client(stream, source, &context).await;
            drop(connection);
        });
    }
}

async fn serve_tcp_client(
    mut stream: TcpStream,
    peer: SocketAddrV4,
    context: &Context,
) -> std::io::Result<()> {
    loop {
        let Ok(query) = tokio::time::timeout(TCP_IDLE, read_framed(&mut stream)).await else {
            return Ok(());
        };
        let query = query?;
        let Ok(slot) = context.queries.try_take(*peer.ip()) else {
            return Ok(());
        };
        let Ok(permit) = context.in_flight.acquire().await else {
            return Ok(());
        };
        let reply = answer(context, peer.into(), &query, Transport::Tcp).await;
        drop((permit, slot));
        match reply {
            Some(reply) => write_framed(&mut stream, &reply).await?,
            None => return Ok(()),
        }
    }
}

/// DNS over TCP: each message is preceded by its length, two bytes, big endian.
async fn read_framed(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let len = stream.read_u16().await?;
    let mut message = vec![0u8; usize::from(len)];
    stream.read_exact(&mut message).await?;
    Ok(message)
}

async fn write_framed(stream: &mut TcpStream, message: &[u8]) -> std::io::Result<()> {
    let len = u16::try_from(message.len())
        .map_err(|_| std::io::Error::other("a DNS message longer than 65535 bytes"))?;
    let mut framed = Vec::with_capacity(message.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(message);
    stream.write_all(&framed).await
}

/// The reply to one query, or `None` when the query is not worth one.
async fn answer(
    context: &Context,
    peer: SocketAddr,
    query: &[u8],
    transport: Transport,
) -> Option<Vec<u8>> {
    let request = Message::from_vec(query).ok()?;
    if request.message_type() != MessageType::Query {
        return None;
    }
    let refuse = |code| reply(&request, code);
    let (SocketAddr::V4(peer), OpCode::Query, [question]) =
        (peer, request.op_code(), request.queries())
    else {
        return refuse(ResponseCode::Refused);
    };
    let name = question.name().to_ascii();
    let source = *peer.ip();
    match context.policies.resolution(source, &name) {
        Resolution::Peer(address) => peer_reply(&request, question, address),
        Resolution::Refuse => refuse(ResponseCode::Refused),
        Resolution::NotFound => refuse(ResponseCode::NXDomain),
        Resolution::Forward { admit } => {
            let Some(response) = forward(context, query, request.id(), transport).await else {
                return refuse(ResponseCode::ServFail);
            };
            if admit {
                let answers = a_records(&response);
                if let Err(err) = context.policies.admit(source, &name, &answers) {
                    tracing::error!(sandbox = %source, name, error = %err, "resolver: cannot admit answered addresses");
                    return refuse(ResponseCode::ServFail);
                }
            }
            Some(response)
        }
    }
}

/// How long a linked sandbox's address may be cached: it stays the
/// sandbox's for its life, but the link may end.
const PEER_TTL: u32 = 5;

/// The answer for a linked sandbox's name: its address for an A question,
/// no records (but no error) for any other type.
fn peer_reply(
    request: &Message,
    question: &hickory_proto::op::Query,
    address: Ipv4Addr,
) -> Option<Vec<u8>> {
    use hickory_proto::rr::{rdata::A, Record, RecordType};
    let mut message = Message::new();
    message
        .set_id(request.id())
        .set_message_type(MessageType::Response)
        .set_op_code(request.op_code())
        .set_authoritative(true)
        .set_recursion_desired(request.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(ResponseCode::NoError);
    message.add_query(question.clone());
    if question.query_type() == RecordType::A {
        message.add_answer(Record::from_rdata(
            question.name().clone(),
            PEER_TTL,
            RData::A(A(address)),
        ));
    }
    message.to_vec().ok()
}

/// An answer with only the question and a response code.
fn reply(request: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut message = Message::new();
    message
        .set_id(request.id())
        .set_message_type(MessageType::Response)
        .set_op_code(request.op_code())
        .set_recursion_desired(request.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(code);
    message.add_queries(request.queries().iter().cloned());
    message.to_vec().ok()
}

/// The A records of a response, with their TTLs (any name: CNAME targets of
/// an allowed name are what it resolves to).
fn a_records(response: &[u8]) -> Vec<(Ipv4Addr, u32)> {
    let Ok(message) = Message::from_vec(response) else {
        return Vec::new();
    };
    message
        .answers()
        .iter()
        .filter_map(|record| match record.data() {
            RData::A(a) => Some((a.0, record.ttl())),
            _ => None,
        })
        .collect()
}

/// Asks each upstream in turn; the first answer with the query's id wins. A
/// truncated UDP answer is passed on as it is: the client retries over TCP.
async fn forward(
    context: &Context,
    query: &[u8],
    id: u16,
    transport: Transport,
) -> Option<Vec<u8>> {
    for upstream in &context.upstreams {
        let attempt = match transport {
            Transport::Udp => ask_udp(*upstream, query, context.mark).await,
            Transport::Tcp => ask_tcp(*upstream, query, context.mark).await,
        };
        match attempt {
            Ok(response)
                if response.len() >= 2 && u16::from_be_bytes([response[0], response[1]]) == id =>
            {
                return Some(response)
            }
            Ok(_) => tracing::debug!(%upstream, "resolver: upstream answered another query id"),
            Err(err) => tracing::debug!(%upstream, error = %err, "resolver: upstream failed"),
        }
    }
    None
}

/// The mark routes the query by the sandboxes' table, out of the uplink.
fn mark(socket: &impl AsFd, mark: u32) -> std::io::Result<()> {
    nix::sys::socket::setsockopt(socket, nix::sys::socket::sockopt::Mark, &mark)
        .map_err(std::io::Error::from)
}

async fn ask_udp(upstream: SocketAddrV4, query: &[u8], fwmark: u32) -> std::io::Result<Vec<u8>> {
    let socket = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)).await?;
    mark(&socket, fwmark)?;
    socket.connect(upstream).await?;
    socket.send(query).await?;
    let mut buffer = vec![0u8; 65535];
    let len = tokio::time::timeout(UPSTREAM_TIMEOUT, socket.recv(&mut buffer))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))??;
    buffer.truncate(len);
    Ok(buffer)
}

async fn ask_tcp(upstream: SocketAddrV4, query: &[u8], fwmark: u32) -> std::io::Result<Vec<u8>> {
    let exchange = async {
        let socket = TcpSocket::new_v4()?;
        mark(&socket, fwmark)?;
        let mut stream = socket.connect(upstream.into()).await?;
        write_framed(&mut stream, query).await?;
        read_framed(&mut stream).await
    };
    tokio::time::timeout(UPSTREAM_TIMEOUT, exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::{rdata::A, Name, Record, RecordType};
    use std::str::FromStr;

    fn query(name: &str) -> Message {
        let mut message = Message::new();
        message
            .set_id(4242)
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Query)
            .set_recursion_desired(true);
        message.add_query(Query::query(Name::from_str(name).unwrap(), RecordType::A));
        message
    }

    #[test]
    fn refusals_keep_the_id_and_the_question() {
        let request = query("denied.test.");
        let bytes = reply(&request, ResponseCode::NXDomain).unwrap();
        let answer = Message::from_vec(&bytes).unwrap();
        assert_eq!(answer.id(), 4242);
        assert_eq!(answer.message_type(), MessageType::Response);
        assert_eq!(answer.response_code(), ResponseCode::NXDomain);
        assert_eq!(answer.queries(), request.queries());
        assert!(answer.answers().is_empty());
    }

    #[test]
    fn a_records_come_with_their_ttls() {
        let mut response = query("allowed.test.");
        response.set_message_type(MessageType::Response);
        let name = Name::from_str("allowed.test.").unwrap();
        response.add_answer(Record::from_rdata(
            name.clone(),
            300,
            RData::A(A(Ipv4Addr::new(198, 51, 100, 10))),
        ));
        response.add_answer(Record::from_rdata(
            name,
            60,
            RData::CNAME(hickory_proto::rr::rdata::CNAME(
                Name::from_str("x.test.").unwrap(),
            )),
        ));
        let bytes = response.to_vec().unwrap();
        assert_eq!(
            a_records(&bytes),
            vec![(Ipv4Addr::new(198, 51, 100, 10), 300)]
        );
        assert!(a_records(b"garbage").is_empty());
    }
}
