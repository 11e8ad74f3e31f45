//! The organization's rate limits (`PATCH /api/organizations/{id}/quota`):
//! every control-API request (`authenticatedRateLimit`), sandbox creates and
//! forks (`sandboxCreateRateLimit`) and lifecycle changes
//! (`sandboxLifecycleRateLimit`), each N requests per window of T seconds.
//! A fork into many (`POST /api/sandbox/{id}/forks`) counts each child as a
//! create, all or none, in its handler, which alone knows how many.
//! A request past one is a 429 with `Retry-After`, the seconds until its
//! window ends. The operator's key is never limited, so the operator can
//! always lift a limit set too low.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use cove_engine::{Caller, OrganizationQuotaRecord, RateLimit};

use crate::{ApiError, AppState};

/// What a request counts against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Authenticated,
    SandboxCreate,
    SandboxLifecycle,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Authenticated => "authenticatedRateLimit",
            Kind::SandboxCreate => "sandboxCreateRateLimit",
            Kind::SandboxLifecycle => "sandboxLifecycleRateLimit",
        }
    }

    fn limit(self, quota: &OrganizationQuotaRecord) -> Option<RateLimit> {
        match self {
            Kind::Authenticated => quota.authenticated,
            Kind::SandboxCreate => quota.sandbox_create,
            Kind::SandboxLifecycle => quota.sandbox_lifecycle,
        }
    }
}

/// The kinds `method` on `route` (a matched template) counts against.
fn kinds(method: &Method, route: &str) -> Vec<Kind> {
    let Some(rest) = route.strip_prefix("/api") else {
        return Vec::new();
    };
    let mut kinds = vec![Kind::Authenticated];
    let last = rest.rsplit('/').next().unwrap_or_default();
    let on_machine = rest.starts_with("/sandbox/{id}/") || rest.starts_with("/vms/{id}/");
    if *method == Method::POST && (rest == "/sandbox" || rest == "/sandbox/{id}/fork") {
        kinds.push(Kind::SandboxCreate);
    } else if (*method == Method::POST
        && on_machine
        && matches!(
            last,
            "start" | "stop" | "pause" | "resume" | "archive" | "recover" | "revert"
        ))
        || (*method == Method::DELETE && rest == "/sandbox/{id}")
    {
        kinds.push(Kind::SandboxLifecycle);
    }
    kinds
}

/// Fixed windows, one per kind: a window starts with its first request and
/// counts until it ends.
#[derive(Debug, Default)]
pub(crate) struct RateLimiter {
    /// By organization and kind.
    windows: Mutex<HashMap<(String, Kind), (Instant, u64)>>,
}

impl RateLimiter {
    /// Counts one request of `kind` by `organization` at `now` under
    /// `limit`, or says how long until its window ends.
    fn take(
        &self,
        organization: &str,
        kind: Kind,
        limit: RateLimit,
        now: Instant,
    ) -> Result<(), Duration> {
        self.take_many(organization, kind, limit, now, 1)
    }

    /// Counts `n` requests at once, or none if they do not all fit.
    fn take_many(
        &self,
        organization: &str,
        kind: Kind,
        limit: RateLimit,
        now: Instant,
        n: u64,
    ) -> Result<(), Duration> {
        let window = Duration::from_secs(limit.window_seconds.max(1));
        let mut windows = self.windows.lock().unwrap();
        let (started, count) = windows
            .entry((organization.to_owned(), kind))
            .or_insert((now, 0));
        if now.duration_since(*started) >= window {
            (*started, *count) = (now, 0);
        }
        if count.saturating_add(n) > limit.requests {
            return Err(window.saturating_sub(now.duration_since(*started)));
        }
        *count += n;
        Ok(())
    }
}

/// Counts `n` sandbox creates by `caller` against its organization's
/// `sandboxCreateRateLimit`, all or none: for a fork into many, whose
/// number of creates is in its body.
pub(crate) async fn take_creates(
    state: &AppState,
    caller: &Caller,
    n: u64,
) -> Result<(), Response> {
    if caller.operator {
        return Ok(());
    }
    let organization = &caller.organization_id;
    let quota = state
        .engine
        .billing()
        .organization_quota(organization)
        .await
        .map_err(|error| ApiError::from(error).into_response())?;
    let kind = Kind::SandboxCreate;
    let Some(limit) = kind.limit(&quota) else {
        return Ok(());
    };
    state
        .rate_limiter
        .take_many(organization, kind, limit, Instant::now(), n)
        .map_err(|wait| refusal(kind, limit, wait))
}

/// The 429 of a request past `limit`, with the seconds to `wait`.
fn refusal(kind: Kind, limit: RateLimit, wait: Duration) -> Response {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let mut response = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        format!(
            "rate limit {} of {} requests per {} s reached; retry in {seconds} s",
            kind.name(),
            limit.requests,
            limit.window_seconds
        ),
    )
    .into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
    response
}

/// Refuses a request past one of the organization's rate limits. Runs inside
/// the key layer, on matched routes.
pub(crate) async fn check(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let caller = request
        .extensions()
        .get::<Caller>()
        .filter(|caller| !caller.operator)
        .cloned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("", MatchedPath::as_str);
    let kinds = kinds(request.method(), route);
    let Some(caller) = caller.filter(|_| !kinds.is_empty()) else {
        return next.run(request).await;
    };
    let organization = &caller.organization_id;
    let quota = match state
        .engine
        .billing()
        .organization_quota(organization)
        .await
    {
        Ok(quota) => quota,
        Err(error) => return ApiError::from(error).into_response(),
    };
    let now = Instant::now();
    for kind in kinds {
        let Some(limit) = kind.limit(&quota) else {
            continue;
        };
        if let Err(wait) = state.rate_limiter.take(organization, kind, limit, now) {
            return refusal(kind, limit, wait);
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_count_against_the_kinds_their_route_is() {
        use Kind::*;
        assert_eq!(kinds(&Method::GET, "/api/sandbox"), [Authenticated]);
        assert_eq!(
            kinds(&Method::POST, "/api/sandbox"),
            [Authenticated, SandboxCreate]
        );
        assert_eq!(
            kinds(&Method::POST, "/api/sandbox/{id}/fork"),
            [Authenticated, SandboxCreate]
        );
        for route in [
            "/api/sandbox/{id}/stop",
            "/api/vms/{id}/resume",
            "/api/sandbox/{id}/archive",
        ] {
            assert_eq!(
                kinds(&Method::POST, route),
                [Authenticated, SandboxLifecycle],
                "{route}"
            );
        }
        assert_eq!(
            kinds(&Method::DELETE, "/api/sandbox/{id}"),
            [Authenticated, SandboxLifecycle]
        );
        assert_eq!(
            kinds(&Method::PUT, "/api/sandbox/{id}/labels"),
            [Authenticated]
        );
        // Its handler counts one create per child.
        assert_eq!(
            kinds(&Method::POST, "/api/sandbox/{id}/forks"),
            [Authenticated]
        );
        assert!(kinds(&Method::POST, "/toolbox/{id}/{*path}").is_empty());
        assert!(kinds(&Method::GET, "/metrics").is_empty());
    }

    #[test]
    fn a_window_allows_its_requests_then_says_how_long_to_wait() {
        let limiter = RateLimiter::default();
        let limit = RateLimit {
            requests: 2,
            window_seconds: 10,
        };
        let t0 = Instant::now();
        limiter.take("a", Kind::SandboxCreate, limit, t0).unwrap();
        limiter
            .take("a", Kind::SandboxCreate, limit, t0 + Duration::from_secs(1))
            .unwrap();
        let wait = limiter
            .take("a", Kind::SandboxCreate, limit, t0 + Duration::from_secs(4))
            .unwrap_err();
        assert_eq!(wait, Duration::from_secs(6));
        // Other kinds have windows of their own.
        limiter
            .take("a", Kind::SandboxLifecycle, limit, t0)
            .unwrap();
        // Other organizations have windows of their own.
        limiter
            .take("b", Kind::SandboxCreate, limit, t0 + Duration::from_secs(4))
            .unwrap();
        // A new window starts when the old one ends.
        limiter
            .take(
                "a",
                Kind::SandboxCreate,
                limit,
                t0 + Duration::from_secs(10),
            )
            .unwrap();
    }

    #[test]
    fn many_at_once_count_each_and_all_or_none() {
        let limiter = RateLimiter::default();
        let limit = RateLimit {
            requests: 5,
            window_seconds: 10,
        };
        let t0 = Instant::now();
        limiter
            .take_many("a", Kind::SandboxCreate, limit, t0, 3)
            .unwrap();
        // Three more do not fit in the two left, and none is counted.
        limiter
            .take_many("a", Kind::SandboxCreate, limit, t0, 3)
            .unwrap_err();
        limiter
            .take_many("a", Kind::SandboxCreate, limit, t0, 2)
            .unwrap();
        limiter
            .take("a", Kind::SandboxCreate, limit, t0)
            .unwrap_err();
    }
}
