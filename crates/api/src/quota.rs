//! Quotas and usage: `PATCH /api/organizations/{id}/quota` (the operator's;
//! `UpdateOrganizationQuota`'s rate limits, per-sandbox ceilings,
//! `volumeQuota` and `snapshotQuota`; the snapshot size, processing and
//! secret fields, which cove does not enforce, are refused by name unless
//! `null`),
//! `PATCH /api/admin/organizations/{id}/quota/{regionId}`
//! (the operator's; `UpdateOrganizationRegionQuota`'s totals and
//! per-sandbox ceilings, plus cove's `maxRunningSandboxes`; a field left out
//! stays as it is, `null` lifts its limit) and `GET
//! /api/organizations/{id}/usage` (`OrganizationUsageOverview`, live).

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use cove_engine::{
    Caller, OrganizationQuotaRecord, QuotaChange, RateLimit, RegionQuotaRecord, REGION_ID,
};
use serde::{Deserialize, Deserializer, Serialize};

use crate::billing::check_organization;
use crate::{ApiError, AppState};

/// A field that is there, even as `null`, is `Some`; one left out is `None`.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<f64>>, D::Error> {
    Option::<f64>::deserialize(d).map(Some)
}

/// The body of the PATCH: what cove enforces of
/// `UpdateOrganizationRegionQuota`. GPU fields and sandbox classes are
/// refused by name (deny_unknown_fields): a server without GPUs cannot keep
/// such a promise.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct UpdateRegionQuota {
    #[serde(default, deserialize_with = "present")]
    total_cpu_quota: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    total_memory_quota: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    total_disk_quota: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    max_running_sandboxes: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    max_cpu_per_sandbox: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    max_memory_per_sandbox: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    max_disk_per_sandbox: Option<Option<f64>>,
}

impl UpdateRegionQuota {
    fn change(&self) -> Result<QuotaChange, ApiError> {
        Ok(QuotaChange {
            total_cpu: whole("totalCpuQuota", self.total_cpu_quota)?,
            total_memory_gib: whole("totalMemoryQuota", self.total_memory_quota)?,
            total_disk_gib: whole("totalDiskQuota", self.total_disk_quota)?,
            max_running_sandboxes: whole("maxRunningSandboxes", self.max_running_sandboxes)?,
            max_cpu_per_sandbox: whole("maxCpuPerSandbox", self.max_cpu_per_sandbox)?,
            max_memory_per_sandbox: whole("maxMemoryPerSandbox", self.max_memory_per_sandbox)?,
            max_disk_per_sandbox: whole("maxDiskPerSandbox", self.max_disk_per_sandbox)?,
        })
    }
}

/// `PATCH /api/admin/organizations/{organizationId}/quota/{regionId}`: 204.
pub(crate) async fn update(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((organization, region)): Path<(String, String)>,
    body: Result<Json<UpdateRegionQuota>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    check_organization(&state, &caller, &organization).await?;
    if region != REGION_ID {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("region {region} not found: this server's one region is {REGION_ID}"),
        ));
    }
    let Json(body) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    state
        .engine
        .billing()
        .update_region_quota(&organization, &body.change()?)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The body of `PATCH /api/organizations/{id}/quota`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct UpdateOrganizationQuota {
    #[serde(default, deserialize_with = "present")]
    authenticated_rate_limit: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    authenticated_rate_limit_ttl_seconds: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    sandbox_create_rate_limit: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    sandbox_create_rate_limit_ttl_seconds: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    sandbox_lifecycle_rate_limit: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    sandbox_lifecycle_rate_limit_ttl_seconds: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    max_cpu_per_sandbox: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    max_memory_per_sandbox: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    max_disk_per_sandbox: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    volume_quota: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    snapshot_quota: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    max_snapshot_size: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    max_concurrent_snapshot_processing: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    secret_quota: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    max_secrets_per_sandbox: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    snapshot_deactivation_timeout_minutes: Option<Option<f64>>,
}

/// A whole, non-negative number, or `null`; `None` when left out.
fn whole(name: &str, field: Option<Option<f64>>) -> Result<Option<Option<i64>>, ApiError> {
    match field {
        Some(Some(v)) if v.fract() != 0.0 || !v.is_finite() || !(0.0..=1e15).contains(&v) => {
            Err(ApiError::bad_request(format!(
                "{name} must be a whole number of zero or more, or null for no limit, not {v}"
            )))
        }
        Some(v) => Ok(Some(v.map(|v| v as i64))),
        None => Ok(None),
    }
}

/// `limit` changed by a body's count and window fields: a count of `null`
/// lifts it; a window alone changes the current limit's; a new count
/// without a window counts per minute.
fn rate_limit(
    limit: &mut Option<RateLimit>,
    (name, requests): (&str, Option<Option<f64>>),
    (window_name, window): (&str, Option<Option<f64>>),
) -> Result<(), ApiError> {
    let requests = whole(name, requests)?;
    let window = whole(window_name, window)?.flatten();
    if window == Some(0) {
        return Err(ApiError::bad_request(format!(
            "{window_name} must be at least 1"
        )));
    }
    let window_seconds = window
        .or(limit.map(|l| l.window_seconds as i64))
        .unwrap_or(60) as u64;
    match requests {
        Some(None) => *limit = None,
        Some(Some(requests)) => {
            *limit = Some(RateLimit {
                requests: requests as u64,
                window_seconds,
            })
        }
        None => {
            if let Some(limit) = limit {
                limit.window_seconds = window_seconds;
            }
        }
    }
    Ok(())
}

impl UpdateOrganizationQuota {
    /// The organization's quota with this change made, and the change of
    /// its per-sandbox ceilings; what cove does not enforce is refused.
    fn apply(&self, quota: &mut OrganizationQuotaRecord) -> Result<QuotaChange, ApiError> {
        for (name, value) in [
            ("maxSnapshotSize", self.max_snapshot_size),
            (
                "maxConcurrentSnapshotProcessing",
                self.max_concurrent_snapshot_processing,
            ),
            ("secretQuota", self.secret_quota),
            ("maxSecretsPerSandbox", self.max_secrets_per_sandbox),
            (
                "snapshotDeactivationTimeoutMinutes",
                self.snapshot_deactivation_timeout_minutes,
            ),
        ] {
            if let Some(Some(_)) = value {
                return Err(ApiError::bad_request(format!(
                    "cove does not enforce {name}; leave it out or send null"
                )));
            }
        }
        rate_limit(
            &mut quota.authenticated,
            ("authenticatedRateLimit", self.authenticated_rate_limit),
            (
                "authenticatedRateLimitTtlSeconds",
                self.authenticated_rate_limit_ttl_seconds,
            ),
        )?;
        rate_limit(
            &mut quota.sandbox_create,
            ("sandboxCreateRateLimit", self.sandbox_create_rate_limit),
            (
                "sandboxCreateRateLimitTtlSeconds",
                self.sandbox_create_rate_limit_ttl_seconds,
            ),
        )?;
        rate_limit(
            &mut quota.sandbox_lifecycle,
            (
                "sandboxLifecycleRateLimit",
                self.sandbox_lifecycle_rate_limit,
            ),
            (
                "sandboxLifecycleRateLimitTtlSeconds",
                self.sandbox_lifecycle_rate_limit_ttl_seconds,
            ),
        )?;
        if let Some(volumes) = whole("volumeQuota", self.volume_quota)? {
            quota.volumes = volumes;
        }
        if let Some(snapshots) = whole("snapshotQuota", self.snapshot_quota)? {
            quota.snapshots = snapshots;
        }
        Ok(QuotaChange {
            max_cpu_per_sandbox: whole("maxCpuPerSandbox", self.max_cpu_per_sandbox)?,
            max_memory_per_sandbox: whole("maxMemoryPerSandbox", self.max_memory_per_sandbox)?,
            max_disk_per_sandbox: whole("maxDiskPerSandbox", self.max_disk_per_sandbox)?,
            ..QuotaChange::default()
        })
    }
}

/// `PATCH /api/organizations/{organizationId}/quota`: 204.
pub(crate) async fn update_organization(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(organization): Path<String>,
    body: Result<Json<UpdateOrganizationQuota>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    check_organization(&state, &caller, &organization).await?;
    let Json(body) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let billing = state.engine.billing();
    let mut quota = billing.organization_quota(&organization).await?;
    let ceilings = body.apply(&mut quota)?;
    billing
        .update_organization_quota(&organization, &quota, &ceilings)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `RegionUsageOverview`, with cove's running-sandbox limit beside it. A
/// limit that is not set is `null`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RegionUsage {
    region_id: &'static str,
    sandbox_class: &'static str,
    total_cpu_quota: Option<i64>,
    current_cpu_usage: i64,
    total_memory_quota: Option<i64>,
    current_memory_usage: i64,
    total_disk_quota: Option<i64>,
    current_disk_usage: i64,
    total_gpu_quota: i64,
    current_gpu_usage: i64,
    allowed_gpu_types: Vec<String>,
    max_cpu_per_sandbox: Option<i64>,
    max_memory_per_sandbox: Option<i64>,
    max_disk_per_sandbox: Option<i64>,
    max_disk_per_non_ephemeral_sandbox: Option<i64>,
    max_cpu_per_gpu: Option<i64>,
    max_memory_per_gpu: Option<i64>,
    max_disk_per_gpu: Option<i64>,
    max_running_sandboxes: Option<i64>,
    current_running_sandboxes: i64,
}

/// `OrganizationUsageOverview`. Snapshots (the server's own images aside)
/// and volumes are counted; a quota not set is `null`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct UsageOverview {
    region_usage: Vec<RegionUsage>,
    total_snapshot_quota: Option<i64>,
    current_snapshot_usage: usize,
    total_volume_quota: Option<i64>,
    current_volume_usage: usize,
}

/// `GET /api/organizations/{organizationId}/usage`.
pub(crate) async fn usage(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(organization): Path<String>,
) -> Result<Json<UsageOverview>, ApiError> {
    check_organization(&state, &caller, &organization).await?;
    let billing = state.engine.billing();
    let RegionQuotaRecord {
        total_cpu,
        total_memory_gib,
        total_disk_gib,
        max_running_sandboxes,
        max_cpu_per_sandbox,
        max_memory_per_sandbox,
        max_disk_per_sandbox,
        ..
    } = billing.region_quota(&organization).await?;
    let (now, snapshots, volumes) = billing.usage(&organization).await?;
    let organization = billing.organization_quota(&organization).await?;
    Ok(Json(UsageOverview {
        region_usage: vec![RegionUsage {
            region_id: REGION_ID,
            sandbox_class: "",
            total_cpu_quota: total_cpu,
            current_cpu_usage: now.cpu,
            total_memory_quota: total_memory_gib,
            current_memory_usage: now.memory_gib,
            total_disk_quota: total_disk_gib,
            current_disk_usage: now.disk_gib,
            total_gpu_quota: 0,
            current_gpu_usage: 0,
            allowed_gpu_types: Vec::new(),
            max_cpu_per_sandbox,
            max_memory_per_sandbox,
            max_disk_per_sandbox,
            max_disk_per_non_ephemeral_sandbox: max_disk_per_sandbox,
            max_cpu_per_gpu: None,
            max_memory_per_gpu: None,
            max_disk_per_gpu: None,
            max_running_sandboxes,
            current_running_sandboxes: now.running,
        }],
        total_snapshot_quota: organization.snapshots,
        current_snapshot_usage: snapshots,
        total_volume_quota: organization.volumes,
        current_volume_usage: volumes,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_body_changes_what_it_names_and_null_lifts_a_limit() {
        let body: UpdateRegionQuota =
            serde_json::from_str(r#"{"maxRunningSandboxes": 1, "totalCpuQuota": null}"#).unwrap();
        let change = body.change().unwrap();
        assert_eq!(change.max_running_sandboxes, Some(Some(1)));
        assert_eq!(change.total_cpu, Some(None));
        assert_eq!(change.total_disk_gib, None);
        let half: UpdateRegionQuota = serde_json::from_str(r#"{"totalCpuQuota": 1.5}"#).unwrap();
        assert!(half.change().unwrap_err().message.contains("whole number"));
        let gpu = serde_json::from_str::<UpdateRegionQuota>(r#"{"totalGpuQuota": 1}"#);
        assert!(gpu.unwrap_err().to_string().contains("totalGpuQuota"));
    }

    fn organization(
        body: &str,
        quota: &mut OrganizationQuotaRecord,
    ) -> Result<QuotaChange, ApiError> {
        serde_json::from_str::<UpdateOrganizationQuota>(body)
            .unwrap()
            .apply(quota)
    }

    #[test]
    fn rate_limits_take_a_count_and_a_window_and_null_lifts_them() {
        let mut quota = OrganizationQuotaRecord::default();
        let ceilings = organization(
            r#"{"sandboxCreateRateLimit": 3, "authenticatedRateLimit": 100,
                "authenticatedRateLimitTtlSeconds": 10, "maxCpuPerSandbox": 2, "volumeQuota": 4}"#,
            &mut quota,
        )
        .unwrap();
        let per = |requests, window_seconds| {
            Some(RateLimit {
                requests,
                window_seconds,
            })
        };
        assert_eq!(
            quota.sandbox_create,
            per(3, 60),
            "a count alone is per minute"
        );
        assert_eq!(quota.authenticated, per(100, 10));
        assert_eq!(quota.volumes, Some(4));
        assert_eq!(ceilings.max_cpu_per_sandbox, Some(Some(2)));
        organization(
            r#"{"sandboxCreateRateLimitTtlSeconds": 5, "authenticatedRateLimit": null}"#,
            &mut quota,
        )
        .unwrap();
        assert_eq!(quota.sandbox_create, per(3, 5));
        assert_eq!(quota.authenticated, None);
        assert_eq!(quota.volumes, Some(4), "what a body leaves out stays");
        for (body, says) in [
            (r#"{"secretQuota": 5}"#, "secretQuota"),
            (r#"{"sandboxCreateRateLimitTtlSeconds": 0}"#, "at least 1"),
            (r#"{"volumeQuota": -2}"#, "zero or more"),
        ] {
            let error = organization(body, &mut quota).unwrap_err();
            assert!(error.message.contains(says), "{body}: {}", error.message);
        }
        organization(
            r#"{"snapshotQuota": null, "secretQuota": null}"#,
            &mut quota,
        )
        .unwrap();
    }
}
