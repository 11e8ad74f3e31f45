//! The node's network as the engine holds it, and the check that turns a
//! sandbox's network settings into an egress policy. Attaching sandboxes is
//! the sandboxes part's (`sandboxes/network.rs`).

use std::sync::Arc;

use cove_net::{Policy, PolicyError};
use cove_store::NetworkSettings;

use crate::EngineError;

/// The node's network, shared by the engine and the server that made it.
#[derive(Clone)]
pub struct NetworkHandle(pub Arc<cove_net::Network>);

impl std::fmt::Debug for NetworkHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NetworkHandle")
    }
}

fn invalid(field: &'static str, error: PolicyError) -> EngineError {
    EngineError::Invalid {
        field,
        reason: error.to_string(),
    }
}

/// The policy `settings` describe, checked: a bad CIDR or domain is a 400 naming it.
pub fn policy(settings: &NetworkSettings) -> Result<Policy, EngineError> {
    let cidrs = |field: &'static str, list: &[String]| -> Result<_, EngineError> {
        list.iter()
            .map(|c| Policy::parse_cidr(c).map_err(|e| invalid(field, e)))
            .collect::<Result<Vec<_>, _>>()
    };
    let policy = Policy {
        block_all: settings.block_all,
        allow_cidrs: cidrs("networkAllowList", &settings.allow_list)?,
        deny_cidrs: cidrs("networkDenyList", &settings.deny_list)?,
        allow_domains: settings.domains.clone(),
    };
    policy.validate().map_err(|e| {
        let field = match &e {
            PolicyError::InvalidDomain { .. } => "domainAllowList",
            _ if e.to_string().contains("deny") => "networkDenyList",
            _ => "networkAllowList",
        };
        invalid(field, e)
    })?;
    Ok(policy)
}
