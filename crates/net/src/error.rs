//! The one error type of the crate. Messages name what failed and on what; the
//! cause is in `source`, not repeated.

use std::io;

use ipnet::Ipv4Net;

use crate::config::ConfigError;
use crate::nft::elements::BatchError;
use crate::policy::PolicyError;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("invalid network config: {0}")]
    Config(String),
    #[error("invalid network config")]
    Invalid(#[from] ConfigError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("invalid sandbox id {id:?}: it must be 1 to 128 of [A-Za-z0-9._-] and not . or ..")]
    InvalidId { id: String },
    #[error("sandbox {id} is not attached to the network")]
    NotAttached { id: String },
    #[error("sandbox {id} is being attached or detached by another call")]
    Busy { id: String },
    #[error("no free sandbox address left in {range}")]
    RangeFull { range: Ipv4Net },
    #[error("{action}")]
    Io {
        action: String,
        #[source]
        source: io::Error,
    },
    #[error("{action}")]
    Netlink {
        action: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("nftables: {action}: {reason}")]
    Nft { action: String, reason: String },
    #[error("{action}")]
    Firewall {
        action: String,
        #[source]
        source: BatchError,
    },
}

impl NetError {
    pub(crate) fn io(action: impl Into<String>) -> impl FnOnce(io::Error) -> Self {
        let action = action.into();
        move |source| Self::Io { action, source }
    }

    pub(crate) fn netlink(action: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> Self {
        let action = action.into();
        move |source| Self::Netlink { action, source }
    }

    pub(crate) fn firewall(action: impl Into<String>) -> impl FnOnce(BatchError) -> Self {
        let action = action.into();
        move |source| Self::Firewall { action, source }
    }
}
