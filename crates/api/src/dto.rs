//! Wire types of Daytona's control API, exactly as the pinned SDK reads them.
//! Core types never derive `Serialize`; this module translates.

use std::collections::BTreeMap;

use cove_engine::NetworkSettings;
use cove_engine::{CreateSandbox, SandboxRecord, VolumeMount};
use serde::{Deserialize, Serialize};

/// The organization every server has: the operator acts in it unless a
/// request names another.
pub(crate) const DEFAULT_ORGANIZATION: &str = cove_engine::DEFAULT_ORGANIZATION;
/// The target (region) of every sandbox on this server, its one region
/// (`GET /regions`).
pub(crate) const TARGET: &str = cove_engine::REGION_ID;

pub(crate) fn rfc3339(ms: i64) -> String {
    let at = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    at.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Sandbox {
    pub id: String,
    pub organization_id: String,
    pub name: String,
    pub snapshot: String,
    pub user: String,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub public: bool,
    pub network_block_all: bool,
    pub network_allow_list: Option<String>,
    pub domain_allow_list: Option<String>,
    /// cove extension.
    pub network_deny_list: Option<String>,
    pub target: &'static str,
    pub cpu: i64,
    pub gpu: i64,
    /// Whole GiB, as the SDK reads it: a 256 MiB VM says 1 (its snapshot's
    /// `mem` says 0.25).
    pub memory: i64,
    pub disk: i64,
    pub state: &'static str,
    pub desired_state: &'static str,
    pub error_reason: Option<String>,
    pub recoverable: bool,
    pub backup_state: &'static str,
    pub auto_stop_interval: i64,
    pub auto_pause_interval: i64,
    pub auto_archive_interval: i64,
    pub auto_delete_interval: i64,
    pub ttl_minutes: i64,
    /// When the wall-clock TTL destroys the sandbox; the SDK reads the TTL here.
    pub auto_destroy_at: Option<String>,
    pub volumes: Vec<VolumeMount>,
    pub created_at: String,
    pub updated_at: String,
    pub last_activity_at: String,
    pub sandbox_class: &'static str,
    pub kvm: bool,
    pub spot: bool,
    /// cove extension: may pause (seed 001's `persistent`).
    pub persistent: bool,
    /// cove extension: the sandbox this one was forked from.
    pub parent_sandbox_id: Option<String>,
    /// The sandbox this one shares a private network with.
    pub linked_sandbox_id: Option<String>,
    /// The runner that holds it (`GET /api/runners/{id}`, the operator's).
    pub runner_id: Option<String>,
    /// cove extension: how a running VM executes, "kvm" or "tcg".
    pub accelerator: Option<&'static str>,
    pub toolbox_proxy_url: String,
}

impl Sandbox {
    pub(crate) fn from_record(
        record: SandboxRecord,
        toolbox_proxy_url: String,
        accelerator: Option<&'static str>,
    ) -> Sandbox {
        Sandbox {
            organization_id: record.organization_id,
            snapshot: record.snapshot,
            user: record.os_user,
            env: record.env,
            labels: record.labels,
            public: record.public,
            network_block_all: record.network.block_all,
            network_allow_list: join_list(&record.network.allow_list),
            domain_allow_list: join_list(&record.network.domains),
            network_deny_list: join_list(&record.network.deny_list),
            target: TARGET,
            cpu: record.cpu,
            gpu: record.gpu,
            memory: (record.memory_mib + 1023) / 1024,
            disk: record.disk_gib,
            state: record.state.wire(),
            desired_state: record.desired_state.as_str(),
            recoverable: record.state == cove_engine::SandboxState::Error,
            error_reason: record.error_reason,
            backup_state: "None",
            auto_stop_interval: record.timers.auto_stop,
            auto_pause_interval: record.timers.auto_pause,
            auto_archive_interval: record.timers.archive_after(),
            auto_delete_interval: record.timers.auto_delete,
            ttl_minutes: record.ttl_minutes,
            auto_destroy_at: record.ttl_deadline_ms.map(rfc3339),
            volumes: record.volumes.clone(),
            created_at: rfc3339(record.created_at_ms),
            updated_at: rfc3339(record.updated_at_ms),
            last_activity_at: rfc3339(record.last_activity_ms),
            sandbox_class: record.class.as_str(),
            kvm: false,
            spot: record.spot,
            persistent: record.persistent,
            parent_sandbox_id: record.parent_id,
            linked_sandbox_id: record.linked_sandbox_id,
            runner_id: record.runner_id,
            accelerator,
            toolbox_proxy_url,
            id: record.id,
            name: record.name,
        }
    }
}

/// `POST /sandbox`. Fields cove does not support yet are taken so that a request
/// using them is refused by name instead of silently ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CreateSandboxRequest {
    pub name: Option<String>,
    pub snapshot: Option<String>,
    pub user: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    pub public: Option<bool>,
    pub cpu: Option<i64>,
    pub gpu: Option<i64>,
    pub memory: Option<i64>,
    pub disk: Option<i64>,
    pub auto_stop_interval: Option<i64>,
    pub auto_pause_interval: Option<i64>,
    pub auto_archive_interval: Option<i64>,
    pub auto_delete_interval: Option<i64>,
    pub ttl_minutes: Option<i64>,
    pub ephemeral: Option<bool>,
    #[serde(default)]
    pub volumes: Vec<VolumeMount>,
    pub build_info: Option<serde_json::Value>,
    pub network_block_all: Option<bool>,
    pub network_allow_list: Option<String>,
    pub domain_allow_list: Option<String>,
    /// cove extension: CIDRs never reachable.
    pub network_deny_list: Option<String>,
    pub kvm: Option<bool>,
    pub spot: Option<bool>,
    /// cove extension (seed 001): may pause; defaults to "not ephemeral".
    pub persistent: Option<bool>,
    #[serde(default)]
    pub secrets: Vec<serde_json::Value>,
    pub outbound_proxy_url: Option<String>,
    /// The id or name of the sandbox to share a private network with; the
    /// new sandbox must be ephemeral.
    pub linked_sandbox: Option<String>,
    /// The region to create in: this server's one (`regions.rs`) or none.
    pub target: Option<String>,
}

impl CreateSandboxRequest {
    /// The first field that asks for something cove cannot do yet.
    pub(crate) fn unsupported(&self) -> Option<&'static str> {
        if self.build_info.as_ref().is_some_and(|b| {
            b.get("dockerfileContent")
                .and_then(|d| d.as_str())
                .is_none()
        }) {
            return Some("buildInfo without dockerfileContent");
        }
        if !self.secrets.is_empty() {
            return Some("secrets");
        }
        if self
            .outbound_proxy_url
            .as_deref()
            .is_some_and(|url| !url.is_empty())
        {
            return Some("outbound proxies (outboundProxyUrl)");
        }
        None
    }

    pub(crate) fn into_engine(self) -> CreateSandbox {
        let auto_delete = match self.ephemeral {
            Some(true) => Some(0),
            _ => self.auto_delete_interval,
        };
        CreateSandbox {
            name: self.name,
            snapshot: self.snapshot,
            user: self.user,
            env: self.env,
            labels: self.labels,
            public: self.public.unwrap_or(false),
            cpu: self.cpu,
            gpu: self.gpu,
            memory_gib: self.memory,
            disk_gib: self.disk,
            auto_stop: self.auto_stop_interval,
            auto_pause: self.auto_pause_interval,
            auto_archive: self.auto_archive_interval,
            auto_delete,
            ttl_minutes: self.ttl_minutes,
            persistent: self.persistent,
            spot: self.spot.unwrap_or(false),
            kvm: self.kvm.unwrap_or(false),
            network: NetworkSettings {
                block_all: self.network_block_all.unwrap_or(false),
                allow_list: split_list(self.network_allow_list.as_deref()),
                deny_list: split_list(self.network_deny_list.as_deref()),
                domains: split_list(self.domain_allow_list.as_deref()),
            },
            dockerfile: self
                .build_info
                .as_ref()
                .and_then(|b| b.get("dockerfileContent"))
                .and_then(|d| d.as_str())
                .map(str::to_owned),
            build_contexts: self
                .build_info
                .as_ref()
                .map(context_hashes)
                .unwrap_or_default(),
            volumes: self.volumes,
            linked_sandbox: self.linked_sandbox.filter(|linked| !linked.is_empty()),
        }
    }
}

/// `buildInfo.contextHashes`: the uploaded build contexts a Dockerfile's
/// `COPY`s read.
pub(crate) fn context_hashes(build_info: &serde_json::Value) -> Vec<String> {
    build_info
        .get("contextHashes")
        .and_then(|h| h.as_array())
        .map(|hashes| {
            hashes
                .iter()
                .filter_map(|h| h.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Daytona's comma-separated lists; empty items are dropped.
pub(crate) fn split_list(text: Option<&str>) -> Vec<String> {
    text.unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(str::to_owned)
        .collect()
}

fn join_list(items: &[String]) -> Option<String> {
    (!items.is_empty()).then(|| items.join(","))
}

/// `POST /sandbox/{id}/network-settings`: each field given changes the policy.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct NetworkSettingsRequest {
    pub network_block_all: Option<bool>,
    pub network_allow_list: Option<String>,
    pub domain_allow_list: Option<String>,
    /// cove extension.
    pub network_deny_list: Option<String>,
}

impl NetworkSettingsRequest {
    /// The policy after this change, as the SDK documents it: unblocking
    /// restores general access (clearing the allow lists), and giving an allow
    /// list implies not blocking everything.
    pub(crate) fn apply(self, mut settings: NetworkSettings) -> NetworkSettings {
        if let Some(block) = self.network_block_all {
            settings.block_all = block;
            if !block {
                settings.allow_list.clear();
                settings.domains.clear();
            }
        }
        if let Some(list) = self.network_allow_list {
            settings.allow_list = split_list(Some(&list));
            settings.block_all = false;
        }
        if let Some(list) = self.domain_allow_list {
            settings.domains = split_list(Some(&list));
            settings.block_all = false;
        }
        if let Some(list) = self.network_deny_list {
            settings.deny_list = split_list(Some(&list));
        }
        settings
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SandboxList {
    pub items: Vec<Sandbox>,
    pub next_cursor: Option<String>,
}

#[derive(Debug, Deserialize, Serialize)]
pub(crate) struct Labels {
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Url {
    pub url: String,
}

/// `GET /sandbox/{id}/ports/{port}/preview-url`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PortPreviewUrl {
    pub sandbox_id: String,
    pub url: String,
    pub token: String,
}

/// `GET /sandbox/{id}/ports/{port}/signed-preview-url`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SignedPortPreviewUrl {
    pub sandbox_id: String,
    pub port: u16,
    pub token: String,
    pub url: String,
}
