//! `POST /cove/vm/identity` and `POST /cove/vm/sync`, which only a VM's
//! agent serves and only the VM runtime calls (the agent's `vm::setup`
//! says what each field does when applied).
//!
//! Identity is told after every boot and every restore from saved memory:
//! the memory of a template, a snapshot or a fork parent holds another
//! sandbox's hostname, environment and a stale clock, and the same random
//! state as its siblings. Sync writes out every filesystem before the VM
//! stops. Both answer `{}`.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub const IDENTITY_PATH: &str = "/cove/vm/identity";
pub const SYNC_PATH: &str = "/cove/vm/sync";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IdentityRequest {
    pub hostname: String,
    /// The sandbox's variables; they replace those of the previous call.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The host's clock.
    pub unix_time_ns: Option<u64>,
    /// Hex digits the guest mixes into its random generator.
    #[serde(default)]
    pub entropy: String,
    /// Whether the root filesystem may be smaller than its disk: after a
    /// boot, or when the host has just grown the disk.
    #[serde(default)]
    pub grow_root: bool,
    /// The size the root disk has now.
    pub disk_bytes: Option<u64>,
    /// `None`: no network (the NIC is taken down).
    #[serde(default)]
    pub network: Option<GuestNetwork>,
    #[serde(default)]
    pub volumes: Vec<GuestVolume>,
    /// The image's ENTRYPOINT and CMD; started unless already running.
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// Who toolbox requests run as (`name`, `uid`, `name:group`, as an
    /// image's `USER`); `None`: root.
    #[serde(default)]
    pub user: Option<String>,
}

/// The guest's NIC settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestNetwork {
    /// `aa:bb:cc:dd:ee:ff`: the NIC to configure.
    pub mac: String,
    pub address: Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: Ipv4Addr,
    pub resolv_conf: String,
}

/// One virtio-fs share and where it is mounted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestVolume {
    /// The virtio-fs tag of the device.
    pub tag: String,
    /// Where the volume appears in the guest (absolute).
    pub path: PathBuf,
}

/// The answer to identity and sync: nothing to say.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityReply {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_round_trips() {
        let identity = IdentityRequest {
            hostname: "sbx".into(),
            env: BTreeMap::from([("A".into(), "1".into())]),
            unix_time_ns: Some(1_700_000_000_000_000_000),
            entropy: "00ff".into(),
            grow_root: true,
            disk_bytes: Some(1 << 30),
            network: Some(GuestNetwork {
                mac: "02:00:00:00:00:01".into(),
                address: Ipv4Addr::new(10, 0, 0, 2),
                prefix_len: 24,
                gateway: Ipv4Addr::new(10, 0, 0, 1),
                resolv_conf: "nameserver 10.0.0.1\n".into(),
            }),
            volumes: vec![GuestVolume {
                tag: "cove0".into(),
                path: "/data".into(),
            }],
            entrypoint: vec!["sleep".into(), "1".into()],
            user: Some("daytona".into()),
        };
        let json = serde_json::to_value(&identity).unwrap();
        assert_eq!(json["unixTimeNs"], 1_700_000_000_000_000_000u64);
        assert_eq!(json["network"]["prefixLen"], 24);
        assert_eq!(json["network"]["address"], "10.0.0.2");
        assert_eq!(json["volumes"][0]["path"], "/data");
        assert_eq!(json["user"], "daytona");
        assert_eq!(
            serde_json::from_value::<IdentityRequest>(json).unwrap(),
            identity
        );
    }

    #[test]
    fn a_bare_identity_needs_only_a_hostname() {
        let bare: IdentityRequest =
            serde_json::from_str(r#"{"hostname":"h","network":null}"#).unwrap();
        assert_eq!(
            bare,
            IdentityRequest {
                hostname: "h".into(),
                ..IdentityRequest::default()
            }
        );
        assert!(serde_json::from_str::<IdentityRequest>("{}").is_err());
        assert_eq!(serde_json::to_string(&IdentityReply {}).unwrap(), "{}");
    }
}
