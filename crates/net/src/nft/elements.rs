//! Adds and deletes nftables set elements over nfnetlink, in one atomic batch per
//! call. This is the only nftables work on the create path and in the resolver,
//! so it spawns nothing: a batch is one `sendmsg`, which the kernel processes
//! before it returns, then one `recv` per acknowledgement.
//!
//! Messages follow `linux/netfilter/nf_tables.h` and `nfnetlink.h`; only the
//! parts needed for set elements are encoded.

use std::io;
use std::os::fd::AsFd;

use rtnetlink::sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 0x2;
const NLA_F_NESTED: u16 = 0x8000;

const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_SET_ELEM_KEY_END: u16 = 10;
const NFTA_DATA_VALUE: u16 = 1;

/// nftables address families (`NFPROTO_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Family {
    Inet = 1,
    Bridge = 7,
}

/// One set element: a key, the end of its range for interval sets, and a
/// timeout for sets with timeouts.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Element {
    pub key: Vec<u8>,
    pub key_end: Option<Vec<u8>>,
    pub timeout_ms: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    Add,
    Delete,
}

/// One message of a batch: add or delete elements of one set.
#[derive(Clone, Debug)]
pub(crate) struct SetChange<'a> {
    pub change: Change,
    pub family: Family,
    pub table: &'a str,
    pub set: &'a str,
    pub elements: Vec<Element>,
}

/// A netlink socket for nftables in the namespace it was opened in.
pub(crate) struct ElementSocket {
    socket: Socket,
    seq: u32,
    buffer: Vec<u8>,
}

impl std::fmt::Debug for ElementSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElementSocket")
            .field("seq", &self.seq)
            .finish()
    }
}

/// Why a batch failed: the kernel's error for the first message it refused.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("{change:?} elements of set {set}")]
    Refused {
        change: Change,
        set: String,
        #[source]
        source: io::Error,
    },
    #[error("talk to nftables over netlink")]
    Io(#[source] io::Error),
}

impl BatchError {
    /// The errno the kernel answered, if it answered one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Refused { source, .. } => source.raw_os_error(),
            Self::Io(_) => None,
        }
    }
}

impl ElementSocket {
    pub(crate) fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind(&SocketAddr::new(0, 0))?;
        // Acknowledgements of a large batch must fit; they are read right after.
        socket.set_rx_buf_sz(1 << 20)?;
        Ok(Self {
            socket,
            seq: 1,
            buffer: Vec::with_capacity(1 << 16),
        })
    }

    /// Applies every change or none (the kernel aborts the whole batch on the
    /// first error). Changes with no elements are skipped.
    pub(crate) fn apply(&mut self, changes: &[SetChange<'_>]) -> Result<(), BatchError> {
        let changes: Vec<&SetChange<'_>> =
            changes.iter().filter(|c| !c.elements.is_empty()).collect();
        if changes.is_empty() {
            return Ok(());
        }
        let first_seq = self.seq;
        let mut message = Vec::with_capacity(512);
        batch_marker(&mut message, NFNL_MSG_BATCH_BEGIN, self.next_seq());
        let mut pending = Vec::with_capacity(changes.len());
        for change in &changes {
            let seq = self.next_seq();
            encode_change(&mut message, change, seq);
            pending.push(seq);
        }
        batch_marker(&mut message, NFNL_MSG_BATCH_END, self.next_seq());
        let sent = self.socket.send(&message, 0).map_err(BatchError::Io)?;
        if sent != message.len() {
            return Err(BatchError::Io(io::Error::other(format!(
                "sent {sent} of {} bytes",
                message.len()
            ))));
        }
        self.read_acks(first_seq, &changes, &mut pending)
    }

    fn next_seq(&mut self) -> u32 {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1).max(1);
        seq
    }

    /// Reads one acknowledgement per change; the first error wins.
    fn read_acks(
        &mut self,
        first_seq: u32,
        changes: &[&SetChange<'_>],
        pending: &mut Vec<u32>,
    ) -> Result<(), BatchError> {
        let begin_seq = first_seq;
        let mut failure: Option<BatchError> = None;
        while !pending.is_empty() {
            self.wait_readable()?;
            self.buffer.clear();
            self.socket
                .recv(&mut self.buffer, libc::MSG_DONTWAIT)
                .map_err(BatchError::Io)?;
            for (seq, errno) in parse_acks(&self.buffer) {
                // Answers to an earlier batch that gave up early are skipped.
                if seq == begin_seq && errno != 0 {
                    return Err(BatchError::Io(io::Error::from_raw_os_error(errno)));
                }
                let Some(at) = pending.iter().position(|s| *s == seq) else {
                    continue;
                };
                pending.remove(at);
                if errno != 0 && failure.is_none() {
                    let change = changes[seq.wrapping_sub(first_seq).wrapping_sub(1) as usize];
                    failure = Some(BatchError::Refused {
                        change: change.change,
                        set: change.set.to_owned(),
                        source: io::Error::from_raw_os_error(errno),
                    });
                }
            }
            // After a refusal the kernel answers the messages it got to; it may
            // not answer the rest, so the first error ends the wait.
            if failure.is_some() {
                break;
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// The kernel queues the answers during `send`, so this returns at once;
    /// the timeout only guards against a kernel that says nothing.
    fn wait_readable(&self) -> Result<(), BatchError> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(self.socket.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(2000u16)) {
            Ok(0) => Err(BatchError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                "nftables did not acknowledge a batch within 2 s",
            ))),
            Ok(_) => Ok(()),
            Err(errno) => Err(BatchError::Io(io::Error::from(errno))),
        }
    }
}

/// (sequence number, errno) of each acknowledgement in a datagram.
fn parse_acks(mut data: &[u8]) -> Vec<(u32, i32)> {
    let mut acks = Vec::new();
    while data.len() >= 16 {
        let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
        let kind = u16::from_ne_bytes([data[4], data[5]]);
        let seq = u32::from_ne_bytes([data[8], data[9], data[10], data[11]]);
        if len < 16 || len > data.len() {
            break;
        }
        if kind == NLMSG_ERROR && len >= 20 {
            let error = i32::from_ne_bytes([data[16], data[17], data[18], data[19]]);
            acks.push((seq, -error));
        }
        data = &data[align(len).min(data.len())..];
    }
    acks
}

fn align(len: usize) -> usize {
    (len + 3) & !3
}

/// Writes a netlink header with a placeholder length; returns where it starts.
fn start_message(out: &mut Vec<u8>, kind: u16, flags: u16, seq: u32) -> usize {
    let start = out.len();
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
    start
}

fn finish_message(out: &mut [u8], start: usize) {
    let len = (out.len() - start) as u32;
    out[start..start + 4].copy_from_slice(&len.to_ne_bytes());
}

/// struct nfgenmsg: family, version, resource id (big endian).
fn nfgenmsg(out: &mut Vec<u8>, family: u8, res_id: u16) {
    out.push(family);
    out.push(0); // NFNETLINK_V0
    out.extend_from_slice(&res_id.to_be_bytes());
}

fn batch_marker(out: &mut Vec<u8>, kind: u16, seq: u32) {
    let start = start_message(out, kind, NLM_F_REQUEST, seq);
    nfgenmsg(out, 0, NFNL_SUBSYS_NFTABLES);
    finish_message(out, start);
}

fn attribute(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    out.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize(align(out.len()), 0);
}

fn string_attribute(out: &mut Vec<u8>, kind: u16, text: &str) {
    let mut payload = Vec::with_capacity(text.len() + 1);
    payload.extend_from_slice(text.as_bytes());
    payload.push(0);
    attribute(out, kind, &payload);
}

fn start_nest(out: &mut Vec<u8>, kind: u16) -> usize {
    let start = out.len();
    out.extend_from_slice(&0u16.to_ne_bytes());
    out.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    start
}

fn finish_nest(out: &mut [u8], start: usize) {
    let len = (out.len() - start) as u16;
    out[start..start + 2].copy_from_slice(&len.to_ne_bytes());
}

fn data_attribute(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let nest = start_nest(out, kind);
    attribute(out, NFTA_DATA_VALUE, value);
    finish_nest(out, nest);
}

fn encode_change(out: &mut Vec<u8>, change: &SetChange<'_>, seq: u32) {
    let (kind, flags) = match change.change {
        // Without NLM_F_EXCL, adding an element that exists is not an error.
        Change::Add => (NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE),
        Change::Delete => (NFT_MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK),
    };
    let start = start_message(out, (NFNL_SUBSYS_NFTABLES << 8) | kind, flags, seq);
    nfgenmsg(out, change.family as u8, 0);
    string_attribute(out, NFTA_SET_ELEM_LIST_TABLE, change.table);
    string_attribute(out, NFTA_SET_ELEM_LIST_SET, change.set);
    let list = start_nest(out, NFTA_SET_ELEM_LIST_ELEMENTS);
    for element in &change.elements {
        let item = start_nest(out, NFTA_LIST_ELEM);
        data_attribute(out, NFTA_SET_ELEM_KEY, &element.key);
        if let Some(end) = &element.key_end {
            data_attribute(out, NFTA_SET_ELEM_KEY_END, end);
        }
        if let (Change::Add, Some(ms)) = (change.change, element.timeout_ms) {
            attribute(out, NFTA_SET_ELEM_TIMEOUT, &ms.to_be_bytes());
        }
        finish_nest(out, item);
    }
    finish_nest(out, list);
    finish_message(out, start);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_element_message_is_laid_out_as_the_kernel_reads_it() {
        let mut out = Vec::new();
        let change = SetChange {
            change: Change::Add,
            family: Family::Inet,
            table: "t",
            set: "s",
            elements: vec![Element {
                key: vec![10, 0, 0, 2],
                key_end: None,
                timeout_ms: Some(1000),
            }],
        };
        encode_change(&mut out, &change, 7);
        let len = u32::from_ne_bytes(out[0..4].try_into().unwrap()) as usize;
        assert_eq!(len, out.len());
        assert_eq!(len % 4, 0);
        assert_eq!(u16::from_ne_bytes([out[4], out[5]]), 0x0a0c);
        assert_eq!(u32::from_ne_bytes(out[8..12].try_into().unwrap()), 7);
        assert_eq!(out[16], 1, "family inet");
        // Table attribute: length 6 ("t\0" + header), type 1, padded to 8.
        assert_eq!(&out[20..26], &[6, 0, 1, 0, b't', 0]);
        // The timeout is big endian milliseconds at the end of the element.
        assert_eq!(&out[len - 8..], &1000u64.to_be_bytes());
    }

    #[test]
    fn acks_are_read_with_their_sequence_numbers() {
        let mut data = Vec::new();
        for (seq, error) in [(3u32, 0i32), (4, -17)] {
            let start = start_message(&mut data, NLMSG_ERROR, 0, 0);
            data.extend_from_slice(&error.to_ne_bytes());
            // The echoed header of the request.
            let echoed = start_message(&mut data, 0, 0, seq);
            finish_message(&mut data, echoed);
            data[start + 8..start + 12].copy_from_slice(&seq.to_ne_bytes());
            finish_message(&mut data, start);
        }
        assert_eq!(parse_acks(&data), vec![(3, 0), (4, 17)]);
    }
}
