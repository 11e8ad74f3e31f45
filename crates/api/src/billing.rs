//! `GET /api/organizations/{organizationId}/bill`: what the organization's
//! sandboxes and snapshots cost over a period, from the meter (permission
//! `read:billing`). The period is `from`/`to` (RFC 3339) or cove's `month`
//! (`YYYY-MM`); without either, the current calendar month (UTC).

use axum::extract::{Path, RawQuery, State};
use axum::{Extension, Json};
use cove_engine::{month_containing, month_period, now_ms, Bill, Caller, EngineError};

use crate::{ApiError, AppState};

/// The organization a route's path names, if the caller may see it: its
/// own, or any that exists for the operator. Another is a 404, as if it did
/// not exist.
pub(crate) async fn check_organization(
    state: &AppState,
    caller: &Caller,
    organization: &str,
) -> Result<(), ApiError> {
    let not_found = || EngineError::OrganizationNotFound {
        id: organization.to_owned(),
    };
    if caller.operator {
        state.engine.organizations().get(organization).await?;
        Ok(())
    } else if caller.organization_id == organization {
        Ok(())
    } else {
        Err(not_found().into())
    }
}

/// The period `[from, to)` of a bill's query string, in milliseconds.
fn period(query: Option<&str>, now: i64) -> Result<(i64, i64), ApiError> {
    let (mut from, mut to, mut month) = (None, None, None);
    let time = |key: &str, value: &str| -> Result<Option<i64>, ApiError> {
        Ok(Some(crate::list_filter::instant(key, value)? as i64))
    };
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match &*key {
            "from" => from = time("from", &value)?,
            "to" => to = time("to", &value)?,
            "month" => month = Some(value.into_owned()),
            other => {
                return Err(ApiError::bad_request(format!(
                    "a bill has no parameter {other:?}; give from and to (RFC 3339) or month \
                     (YYYY-MM)"
                )))
            }
        }
    }
    let month = match month {
        Some(_) if from.is_some() || to.is_some() => {
            return Err(ApiError::bad_request(
                "give either month or from and to, not both",
            ))
        }
        Some(month) => month_period(&month).map_err(|e| ApiError::bad_request(e.0))?,
        None => month_containing(now),
    };
    let (from, to) = (from.unwrap_or(month.0), to.unwrap_or(month.1));
    if to <= from {
        return Err(ApiError::bad_request(format!(
            "the period must end after it starts (from {from} ms, to {to} ms)"
        )));
    }
    Ok((from, to))
}

/// `GET /api/organizations/{organizationId}/bill?from=&to=` or `?month=`.
pub(crate) async fn bill(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(organization): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<Bill>, ApiError> {
    check_organization(&state, &caller, &organization).await?;
    let (from, to) = period(query.as_deref(), now_ms())?;
    Ok(Json(
        state.engine.billing().bill(&organization, from, to).await?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_period_is_a_month_or_from_and_to_and_defaults_to_this_month() {
        let (december, january) = month_period("2026-12").unwrap();
        let now = december + 5 * 86_400_000;
        assert_eq!(period(None, now).unwrap(), (december, january));
        assert_eq!(
            period(Some("month=2026-12"), 0).unwrap(),
            (december, january)
        );
        assert_eq!(
            period(Some("from=2026-12-01T00:00:00Z&to=2026-12-02T00:00:00Z"), 0).unwrap(),
            (december, december + 86_400_000)
        );
        // Only a start: up to the end of the current month.
        assert_eq!(
            period(Some("from=2026-12-02T00:00:00Z"), now).unwrap(),
            (december + 86_400_000, january)
        );
        for bad in [
            "month=2026-13",
            "month=2026-12&from=2026-12-01T00:00:00Z",
            "from=2026-12-02T00:00:00Z&to=2026-12-01T00:00:00Z",
            "from=yesterday",
            "org=cove",
        ] {
            let error = period(Some(bad), now).unwrap_err();
            assert_eq!(error.status, axum::http::StatusCode::BAD_REQUEST, "{bad}");
        }
    }
}
