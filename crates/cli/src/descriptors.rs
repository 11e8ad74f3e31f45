//! The server's file descriptor budget: `cove serve` raises its soft
//! `RLIMIT_NOFILE` to the hard limit, keeps a reserve for its own work
//! (sandboxes, the database, agent sockets, QEMU chardevs, image layers) and
//! divides the rest among its listeners as connection caps, so a flood of
//! clients runs into a cap before the server runs out of descriptors.

/// Descriptors never given to client connections: at least this many...
const RESERVE_MIN: u64 = 1024;
/// ...or this share of the limit, whichever is more.
const RESERVE_DIVISOR: u64 = 4;
/// A served connection holds its own descriptor and, proxied, one to the
/// agent it is forwarded to (an SSH channel likewise).
const DESCRIPTORS_PER_CONNECTION: u64 = 2;
/// A cap beyond which memory, not descriptors, is what runs out (hyper reads
/// up to ~400 KiB of headers per connection).
const MAX_CONNECTIONS_PER_LISTENER: u64 = 16 * 1024;
/// Even a tiny limit leaves every listener a few connections.
const MIN_CONNECTIONS_PER_LISTENER: u64 = 16;

/// How many connections each listener serves at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConnectionCaps {
    /// The plain HTTP listener (`--listen`).
    pub http: usize,
    /// The HTTPS listener (`--tls-listen`).
    pub https: usize,
    /// The SSH gateway, authenticated or not.
    pub ssh: usize,
    /// SSH connections that have not authenticated yet.
    pub ssh_unauthenticated: usize,
}

impl ConnectionCaps {
    /// The caps for a descriptor limit of `limit`: half of what is left after
    /// the reserve to HTTP, a quarter each to HTTPS and SSH.
    pub(crate) fn for_limit(limit: u64) -> ConnectionCaps {
        let connections = limit.saturating_sub(Self::reserve(limit)) / DESCRIPTORS_PER_CONNECTION;
        let share = |part: u64| {
            (connections / part).clamp(MIN_CONNECTIONS_PER_LISTENER, MAX_CONNECTIONS_PER_LISTENER)
                as usize
        };
        let ssh = share(4);
        ConnectionCaps {
            http: share(2),
            https: share(4),
            ssh,
            // Like OpenSSH's MaxStartups: few may be in the handshake at once.
            ssh_unauthenticated: (ssh / 8).clamp(8, 256),
        }
    }

    /// The reserve kept back from a limit of `limit`.
    pub(crate) fn reserve(limit: u64) -> u64 {
        RESERVE_MIN.max(limit / RESERVE_DIVISOR)
    }
}

/// Raises the soft descriptor limit to the hard one; answers the limit now
/// in force (the old one if it could not be raised).
pub(crate) fn raise_limit() -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(limits) => limits,
        Err(error) => {
            tracing::warn!(%error, "reading RLIMIT_NOFILE");
            return RESERVE_MIN;
        }
    };
    if soft >= hard {
        return soft;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => hard,
        Err(error) => {
            tracing::warn!(%error, soft, hard, "raising RLIMIT_NOFILE");
            soft
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_keep_the_reserve_free() {
        for limit in [1024, 4096, 65_536, 1 << 20] {
            let caps = ConnectionCaps::for_limit(limit);
            let used = (caps.http + caps.https + caps.ssh) as u64 * DESCRIPTORS_PER_CONNECTION;
            if limit >= 4096 {
                assert!(
                    used + ConnectionCaps::reserve(limit) <= limit,
                    "{limit}: {caps:?}"
                );
            }
            assert!(caps.ssh_unauthenticated <= caps.ssh.max(8));
            assert!(caps.http >= caps.https);
        }
    }

    #[test]
    fn a_usual_limit_gives_usual_caps() {
        assert_eq!(
            ConnectionCaps::for_limit(65_536),
            ConnectionCaps {
                http: 12_288,
                https: 6_144,
                ssh: 6_144,
                ssh_unauthenticated: 256,
            }
        );
        // A tiny limit still serves someone.
        assert_eq!(ConnectionCaps::for_limit(1024).http, 16);
    }
}
