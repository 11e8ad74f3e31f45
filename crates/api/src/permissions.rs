//! Which permission a request needs, by its route: Daytona's rules for keys.
//!
//! Any valid key may read (list and get sandboxes, snapshots, registries).
//! Changing a resource needs its `write:` permission, deleting it its
//! `delete:` one; volumes need `read:volumes` even to be listed, as in
//! Daytona. The toolbox, preview links and SSH access act inside a sandbox,
//! so they need `write:sandboxes`. A few routes act on the server itself
//! (reclaiming space, importing from the server's disk, anything under
//! `/api/admin/`, `/metrics`) and are the operator's alone; reading the audit log needs
//! `read:audit_logs`. The table is total: a route it does not name needs
//! nothing to be read and the operator to be changed.

use axum::extract::{MatchedPath, Request};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use cove_engine::{Caller, Permission};

use crate::ApiError;

/// What a route needs beyond a valid key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Need {
    Nothing,
    Permission(Permission),
    Operator,
}

/// The need of `method` on the route template `route` (as axum matched it,
/// `/api/sandbox/{id}`).
pub(crate) fn need(method: &Method, route: &str) -> Need {
    use Need::{Nothing, Operator};
    use Permission as P;
    let reads = method == Method::GET || method == Method::HEAD;
    let deletes = method == Method::DELETE;
    let by = |read: Need, write: Permission, delete: Permission| {
        if reads {
            read
        } else if deletes {
            Need::Permission(delete)
        } else {
            Need::Permission(write)
        }
    };
    if route.starts_with("/toolbox/") {
        return Need::Permission(P::WriteSandboxes);
    }
    if route == "/metrics" {
        // The whole server's figures: the operator's.
        return Operator;
    }
    let Some(rest) = route.strip_prefix("/api") else {
        return if reads { Nothing } else { Operator };
    };
    let sandbox = |route: &str| {
        if route.ends_with("preview-url") || route.ends_with("/expire") {
            // A preview token or signed URL opens the sandbox's ports.
            Need::Permission(P::WriteSandboxes)
        } else if route == "/sandbox/{id}" && deletes {
            Need::Permission(P::DeleteSandboxes)
        } else if reads {
            Nothing
        } else {
            Need::Permission(P::WriteSandboxes)
        }
    };
    match rest {
        "/snapshots/import" => Operator,
        _ if rest.starts_with("/admin/") => Operator,
        // The server's machines, not an organization's. (What a runner
        // itself calls, `/runners/me`, `/runners/me/images/...`, `.../layers/...` and
        // `/runners/healthcheck`, is routed
        // outside the key layer and takes its runner token instead.)
        _ if rest == "/runners" || rest.starts_with("/runners/") => Operator,
        "/audit/organizations/{organization}" => Need::Permission(P::ReadAuditLogs),
        "/organizations/{organization}/bill" => Need::Permission(P::ReadBilling),
        "/object-storage/push-access" => Need::Permission(P::WriteSnapshots),
        "/api-keys" | "/api-keys/current" | "/api-keys/{name}" | "/api-keys/{user}/{name}" => {
            by(Nothing, P::ManageApiKeys, P::ManageApiKeys)
        }
        _ if rest == "/sandbox" || rest.starts_with("/sandbox/") => sandbox(rest),
        _ if rest.starts_with("/vms/") => Need::Permission(P::WriteSandboxes),
        _ if rest == "/snapshots" || rest.starts_with("/snapshots/") => {
            by(Nothing, P::WriteSnapshots, P::DeleteSnapshots)
        }
        _ if rest == "/volumes" || rest.starts_with("/volumes/") => by(
            Need::Permission(P::ReadVolumes),
            P::WriteVolumes,
            P::DeleteVolumes,
        ),
        _ if rest == "/docker-registry" || rest.starts_with("/docker-registry/") => {
            by(Nothing, P::WriteRegistries, P::DeleteRegistries)
        }
        _ if reads => Nothing,
        _ => Operator,
    }
}

/// Refuses a request whose key lacks what its route needs (403 naming it).
/// Runs after [`crate::auth::require_api_key`], which leaves the [`Caller`].
pub(crate) async fn check(request: Request, next: Next) -> Response {
    let Some(caller) = request.extensions().get::<Caller>() else {
        return ApiError::new(StatusCode::UNAUTHORIZED, "missing API key").into_response();
    };
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("", MatchedPath::as_str);
    let allowed = match need(request.method(), route) {
        Need::Nothing => Ok(()),
        Need::Permission(permission) => caller.require(permission).map_err(ApiError::from),
        Need::Operator => operator(caller),
    };
    match allowed {
        Ok(()) => next.run(request).await,
        Err(error) => error.into_response(),
    }
}

fn operator(caller: &Caller) -> Result<(), ApiError> {
    if caller.operator {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "only the server operator's key may do this",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_need_what_daytona_asks() {
        use Need::{Nothing, Operator};
        use Permission as P;
        let p = Need::Permission;
        let table = [
            (Method::GET, "/api/sandbox", Nothing),
            (Method::POST, "/api/sandbox", p(P::WriteSandboxes)),
            (Method::GET, "/api/sandbox/{id}", Nothing),
            (Method::DELETE, "/api/sandbox/{id}", p(P::DeleteSandboxes)),
            (Method::POST, "/api/sandbox/{id}/stop", p(P::WriteSandboxes)),
            (
                Method::PUT,
                "/api/sandbox/{id}/labels",
                p(P::WriteSandboxes),
            ),
            (
                Method::DELETE,
                "/api/sandbox/{id}/ssh-access",
                p(P::WriteSandboxes),
            ),
            (
                Method::GET,
                "/api/sandbox/{id}/ports/{port}/preview-url",
                p(P::WriteSandboxes),
            ),
            (
                Method::GET,
                "/api/sandbox/{id}/ports/{port}/signed-preview-url",
                p(P::WriteSandboxes),
            ),
            (Method::POST, "/api/vms/{id}/pause", p(P::WriteSandboxes)),
            (Method::GET, "/toolbox/{id}/{*path}", p(P::WriteSandboxes)),
            (Method::GET, "/toolbox/{id}", p(P::WriteSandboxes)),
            (Method::GET, "/api/snapshots", Nothing),
            (Method::POST, "/api/snapshots", p(P::WriteSnapshots)),
            (Method::DELETE, "/api/snapshots/{id}", p(P::DeleteSnapshots)),
            (Method::POST, "/api/snapshots/import", Operator),
            (Method::GET, "/api/volumes", p(P::ReadVolumes)),
            (Method::POST, "/api/volumes", p(P::WriteVolumes)),
            (Method::DELETE, "/api/volumes/{id}", p(P::DeleteVolumes)),
            (Method::GET, "/api/docker-registry/{id}", Nothing),
            (
                Method::PATCH,
                "/api/docker-registry/{id}",
                p(P::WriteRegistries),
            ),
            (
                Method::DELETE,
                "/api/docker-registry/{id}",
                p(P::DeleteRegistries),
            ),
            (
                Method::GET,
                "/api/object-storage/push-access",
                p(P::WriteSnapshots),
            ),
            (Method::GET, "/api/api-keys", Nothing),
            (Method::POST, "/api/api-keys", p(P::ManageApiKeys)),
            (Method::DELETE, "/api/api-keys/{name}", p(P::ManageApiKeys)),
            (Method::POST, "/api/admin/reclaim", Operator),
            (Method::GET, "/api/runners", Operator),
            (Method::POST, "/api/runners", Operator),
            (Method::DELETE, "/api/runners/{id}", Operator),
            (Method::GET, "/api/runners/by-sandbox/{sandbox}", Operator),
            (Method::PATCH, "/api/runners/{id}/draining", Operator),
            (Method::GET, "/api/admin/audit", Operator),
            (
                Method::GET,
                "/api/audit/organizations/{organization}",
                p(P::ReadAuditLogs),
            ),
            (
                Method::GET,
                "/api/organizations/{organization}/bill",
                p(P::ReadBilling),
            ),
            (
                Method::GET,
                "/api/organizations/{organization}/usage",
                Nothing,
            ),
            (
                Method::PATCH,
                "/api/admin/organizations/{organization}/quota/{region}",
                Operator,
            ),
            (Method::GET, "/api/config", Nothing),
            // A route the table does not name: read freely, changed by the operator.
            (Method::POST, "/api/organizations", Operator),
            (Method::GET, "/metrics", Operator),
        ];
        for (method, route, expected) in table {
            assert_eq!(need(&method, route), expected, "{method} {route}");
        }
    }
}
