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

/// Most networks in `networkAllowList`: Daytona's limit, kept so a list
/// that works here works there.
pub(crate) const MAX_ALLOW_LIST_NETWORKS: usize = 5;

/// `settings` as they are kept and read back: each CIDR as the network it
/// stands for (host bits masked, as Daytona's runner applies them, and a bare
/// address as `/32`), so what a client reads is what the firewall enforces.
pub(crate) fn normalised(settings: NetworkSettings) -> Result<NetworkSettings, EngineError> {
    let policy = policy(&settings)?;
    Ok(NetworkSettings {
        allow_list: policy.allow_cidrs.iter().map(ToString::to_string).collect(),
        deny_list: policy.deny_cidrs.iter().map(ToString::to_string).collect(),
        ..settings
    })
}

/// The policy `settings` describe, checked: a bad CIDR or domain, or too
/// many networks, is a 400 naming it.
pub fn policy(settings: &NetworkSettings) -> Result<Policy, EngineError> {
    if settings.allow_list.len() > MAX_ALLOW_LIST_NETWORKS {
        return Err(EngineError::Invalid {
            field: "networkAllowList",
            reason: format!(
                "{} networks given, at most {MAX_ALLOW_LIST_NETWORKS} are allowed; \
                 cover them with fewer, wider CIDRs",
                settings.allow_list.len()
            ),
        });
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(allow: &[&str], deny: &[&str]) -> NetworkSettings {
        NetworkSettings {
            allow_list: allow.iter().map(|s| s.to_string()).collect(),
            deny_list: deny.iter().map(|s| s.to_string()).collect(),
            ..NetworkSettings::default()
        }
    }

    #[test]
    fn lists_are_kept_as_the_networks_they_stand_for() {
        let given = settings(
            &["192.168.1.0/16", " 10.0.0.0/8", "203.0.113.9"],
            &["198.51.100.7/24"],
        );
        let kept = normalised(given).unwrap();
        assert_eq!(
            kept.allow_list,
            ["192.168.0.0/16", "10.0.0.0/8", "203.0.113.9/32"]
        );
        assert_eq!(kept.deny_list, ["198.51.100.0/24"]);
        // What is kept checks again to itself.
        assert_eq!(normalised(kept.clone()).unwrap(), kept);
    }

    #[test]
    fn garbage_and_long_lists_are_refused_by_field() {
        for (given, field, named) in [
            (
                settings(&["10.0.0.0/8", "not-a-cidr"], &[]),
                "networkAllowList",
                "not-a-cidr",
            ),
            (
                settings(&["10.0.0.0/33"], &[]),
                "networkAllowList",
                "10.0.0.0/33",
            ),
            (
                settings(&[], &["300.0.0.0/8"]),
                "networkDenyList",
                "300.0.0.0/8",
            ),
            (
                settings(
                    &[
                        "1.0.0.0/8",
                        "2.0.0.0/8",
                        "3.0.0.0/8",
                        "4.0.0.0/8",
                        "5.0.0.0/8",
                        "6.0.0.0/8",
                    ],
                    &[],
                ),
                "networkAllowList",
                "at most 5",
            ),
        ] {
            match normalised(given) {
                Err(EngineError::Invalid { field: f, reason }) => {
                    assert_eq!(f, field);
                    assert!(reason.contains(named), "{reason} should name {named}");
                }
                other => panic!("{other:?}"),
            }
        }
        let five = [
            "1.0.0.0/8",
            "2.0.0.0/8",
            "3.0.0.0/8",
            "4.0.0.0/8",
            "5.0.0.0/8",
        ];
        normalised(settings(&five, &[])).unwrap();
    }
}
