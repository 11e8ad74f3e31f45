//! `GET /regions` and `GET /shared-regions`: the one region of this server,
//! the `target` every sandbox reports, and the check of a region a request
//! names (a sandbox's `target`, a snapshot's `regionId`, a list's
//! `regionIds`).

use axum::extract::State;
use axum::Json;
use serde::Serialize;

use crate::dto::{rfc3339, DEFAULT_ORGANIZATION, TARGET};
use crate::{ApiError, AppState};

/// A region as the SDK's `Region` reads it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Region {
    id: &'static str,
    name: &'static str,
    organization_id: &'static str,
    /// Daytona's kinds are `shared`, `dedicated` and `custom`; a server's one
    /// region is shared by every sandbox on it.
    region_type: &'static str,
    created_at: String,
    updated_at: String,
}

pub(crate) async fn list(State(state): State<AppState>) -> Json<Vec<Region>> {
    let since = rfc3339(state.started_at_ms);
    Json(vec![Region {
        id: TARGET,
        name: TARGET,
        organization_id: DEFAULT_ORGANIZATION,
        region_type: "shared",
        created_at: since.clone(),
        updated_at: since,
    }])
}

/// Whether `region` (a `target` or a region id) names this server's region;
/// none, or an empty one, asks for the default, which is the same.
pub(crate) fn is_known(region: &str) -> bool {
    region.is_empty() || region == TARGET
}

/// Refuses a region this server does not have, naming the one it has.
pub(crate) fn check(field: &str, region: Option<&str>) -> Result<(), ApiError> {
    match region {
        Some(region) if !is_known(region) => Err(ApiError::bad_request(format!(
            "unknown {field} {region:?}: this server has one region, {TARGET:?} \
             (GET /api/regions lists it); use it or leave {field} out"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_servers_region_is_known() {
        for region in [None, Some(""), Some(TARGET)] {
            check("target", region).unwrap();
        }
        for region in ["local", "eu", "US", "us "] {
            let err = check("target", Some(region)).unwrap_err();
            assert_eq!(err.status, axum::http::StatusCode::BAD_REQUEST);
            assert!(
                err.message.contains(&format!("{region:?}")),
                "{}",
                err.message
            );
            assert!(err.message.contains("\"us\""), "{}", err.message);
            assert!(err.message.starts_with("unknown target"), "{}", err.message);
        }
    }
}
