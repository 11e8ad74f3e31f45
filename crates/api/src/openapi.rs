//! `GET /api/openapi.json`: cove's control API as an OpenAPI 3.0 document,
//! built from [`OPERATIONS`], the description of every route the router
//! serves under `/api`, and from the permission table (`x-cove-permission`:
//! what a key needs for each). A test reads the router's source and fails
//! when a route is served without a description here, or described without
//! being served.

use axum::http::Method;
use axum::Json;
use serde_json::{json, Map, Value};

use crate::permissions::{need, Need};

/// One operation: method, path under `/api`, tag, summary.
pub(crate) struct Operation {
    method: &'static str,
    path: &'static str,
    tag: &'static str,
    summary: &'static str,
}

const fn op(
    method: &'static str,
    path: &'static str,
    tag: &'static str,
    summary: &'static str,
) -> Operation {
    Operation {
        method,
        path,
        tag,
        summary,
    }
}

/// Every route of the control API. Daytona's operations keep Daytona's
/// meaning; cove's own are marked "cove extension".
pub(crate) const OPERATIONS: &[Operation] = &[
    op(
        "GET",
        "/config",
        "config",
        "The server's configuration, as the SDKs read it",
    ),
    op(
        "GET",
        "/openapi.json",
        "config",
        "This document (cove extension)",
    ),
    op("GET", "/regions", "regions", "The server's one region"),
    op(
        "GET",
        "/shared-regions",
        "regions",
        "The server's one region, shared by every sandbox",
    ),
    op(
        "GET",
        "/runners",
        "runners",
        "List the runners sandboxes run on, with what each holds (operator)",
    ),
    op(
        "POST",
        "/runners",
        "runners",
        "Register a runner on another machine; answers its token once (operator)",
    ),
    op("GET", "/runners/{id}", "runners", "A runner (operator)"),
    op(
        "DELETE",
        "/runners/{id}",
        "runners",
        "Delete a runner that holds no sandbox, and its token (operator)",
    ),
    op(
        "GET",
        "/runners/me",
        "runners",
        "The calling runner, by its runner token",
    ),
    op(
        "GET",
        "/runners/me/images/{image}",
        "runners",
        "The root filesystem of an image a sandbox placed on the calling runner uses, as a tar, by its runner token",
    ),
    op(
        "GET",
        "/runners/me/images",
        "runners",
        "The images (paths under the images directory) the sandboxes placed on the calling runner use, by its runner token",
    ),
    op(
        "GET",
        "/runners/me/layers",
        "runners",
        "The capture ids of the captured layers the sandboxes placed on the calling runner use, by its runner token",
    ),
    op(
        "GET",
        "/runners/me/layers/{capture}",
        "runners",
        "A captured layer of the snapshot a sandbox placed on the calling runner uses, as a btrfs send stream, by its runner token",
    ),
    op(
        "POST",
        "/runners/healthcheck",
        "runners",
        "A runner reports its host and the URLs it serves on, by its runner token",
    ),
    op(
        "GET",
        "/runners/by-sandbox/{sandbox}",
        "runners",
        "The runner holding a sandbox (operator)",
    ),
    op(
        "PATCH",
        "/runners/{id}/scheduling",
        "runners",
        "Take a runner out of scheduling, or put it back (operator)",
    ),
    op(
        "PATCH",
        "/runners/{id}/draining",
        "runners",
        "Drain a runner: no new sandbox goes to it (operator)",
    ),
    op(
        "GET",
        "/api-keys",
        "api-keys",
        "API keys, their values masked",
    ),
    op(
        "POST",
        "/api-keys",
        "api-keys",
        "Make an API key; its value is answered this once",
    ),
    op(
        "GET",
        "/api-keys/current",
        "api-keys",
        "The key this request is made with",
    ),
    op(
        "GET",
        "/api-keys/{name}",
        "api-keys",
        "One API key, its value masked",
    ),
    op(
        "DELETE",
        "/api-keys/{name}",
        "api-keys",
        "Delete an API key",
    ),
    op(
        "DELETE",
        "/api-keys/{user}/{name}",
        "api-keys",
        "Delete a user's API key",
    ),
    op("GET", "/users/me", "users", "The user every key belongs to"),
    op(
        "GET",
        "/audit/organizations/{organization}",
        "audit",
        "The organization's audit log, newest first",
    ),
    op(
        "GET",
        "/admin/audit",
        "admin",
        "The whole audit log (operator)",
    ),
    op(
        "GET",
        "/organizations",
        "organizations",
        "Every organization (operator), or the key's own",
    ),
    op(
        "POST",
        "/organizations",
        "organizations",
        "Make an organization (operator)",
    ),
    op(
        "GET",
        "/organizations/{organization}",
        "organizations",
        "The organization, with its limits",
    ),
    op(
        "DELETE",
        "/organizations/{organization}",
        "organizations",
        "Delete an empty organization with its keys (operator)",
    ),
    op(
        "GET",
        "/organizations/{organization}/bill",
        "organizations",
        "The bill of a period from the meter (cove extension)",
    ),
    op(
        "GET",
        "/organizations/{organization}/usage",
        "organizations",
        "What the organization's sandboxes use now",
    ),
    op(
        "PATCH",
        "/organizations/{organization}/quota",
        "organizations",
        "Rate limits, per-sandbox ceilings and the volume quota (operator)",
    ),
    op(
        "PATCH",
        "/admin/organizations/{organization}/quota/{region}",
        "admin",
        "Region totals and the running-sandbox limit (operator)",
    ),
    op(
        "POST",
        "/sandbox",
        "sandbox",
        "Create a sandbox from a snapshot or an image",
    ),
    op(
        "GET",
        "/sandbox",
        "sandbox",
        "List sandboxes, filtered, sorted and paged",
    ),
    op(
        "GET",
        "/sandbox/{id}",
        "sandbox",
        "One sandbox by id or name",
    ),
    op("DELETE", "/sandbox/{id}", "sandbox", "Delete a sandbox"),
    op(
        "POST",
        "/sandbox/{id}/start",
        "sandbox",
        "Start a stopped, paused or archived sandbox",
    ),
    op(
        "POST",
        "/sandbox/{id}/stop",
        "sandbox",
        "Stop a sandbox, keeping its disk",
    ),
    op(
        "POST",
        "/sandbox/{id}/recover",
        "sandbox",
        "Recover a sandbox in error",
    ),
    op(
        "POST",
        "/sandbox/{id}/pause",
        "sandbox",
        "Pause a VM, keeping its memory (cove extension)",
    ),
    op(
        "POST",
        "/sandbox/{id}/archive",
        "sandbox",
        "Archive a stopped sandbox",
    ),
    op(
        "POST",
        "/sandbox/{id}/network-settings",
        "sandbox",
        "Change a sandbox's egress policy",
    ),
    op(
        "POST",
        "/sandbox/{id}/fork",
        "sandbox",
        "Fork a running sandbox (cove extension)",
    ),
    op(
        "GET",
        "/sandbox/{id}/forks",
        "sandbox",
        "A sandbox's forks (cove extension)",
    ),
    op(
        "POST",
        "/sandbox/{id}/forks",
        "sandbox",
        "Fork a running sandbox into N children at once, all or none (cove extension)",
    ),
    op(
        "GET",
        "/sandbox/{id}/parent",
        "sandbox",
        "The sandbox a fork came from (cove extension)",
    ),
    op(
        "GET",
        "/sandbox/{id}/ancestors",
        "sandbox",
        "Every ancestor of a fork (cove extension)",
    ),
    op(
        "POST",
        "/sandbox/{id}/snapshot",
        "sandbox",
        "Snapshot a sandbox's disk, or disk and memory (cove extension)",
    ),
    op(
        "POST",
        "/sandbox/{id}/revert",
        "sandbox",
        "Rewind a sandbox to one of its snapshots (cove extension)",
    ),
    op(
        "POST",
        "/sandbox/{id}/ssh-access",
        "sandbox",
        "Make an SSH access token",
    ),
    op(
        "DELETE",
        "/sandbox/{id}/ssh-access",
        "sandbox",
        "Revoke SSH access tokens",
    ),
    op(
        "GET",
        "/sandbox/ssh-access/validate",
        "sandbox",
        "Check an SSH access token",
    ),
    op(
        "PUT",
        "/sandbox/{id}/labels",
        "sandbox",
        "Replace a sandbox's labels",
    ),
    op(
        "POST",
        "/sandbox/{id}/autostop/{minutes}",
        "sandbox",
        "Set the auto-stop interval",
    ),
    op(
        "POST",
        "/sandbox/{id}/autopause/{minutes}",
        "sandbox",
        "Set the auto-pause interval (cove extension)",
    ),
    op(
        "POST",
        "/sandbox/{id}/autoarchive/{minutes}",
        "sandbox",
        "Set the auto-archive interval",
    ),
    op(
        "POST",
        "/sandbox/{id}/autodelete/{minutes}",
        "sandbox",
        "Set the auto-delete interval (0 deletes on stop, -1 never)",
    ),
    op(
        "POST",
        "/sandbox/{id}/ttl/{minutes}",
        "sandbox",
        "Set the wall-clock time to live (cove extension)",
    ),
    op(
        "POST",
        "/sandbox/{id}/public/{public}",
        "sandbox",
        "Make previews public or private",
    ),
    op(
        "GET",
        "/sandbox/{id}/ports/{port}/preview-url",
        "preview",
        "A port's preview URL and token",
    ),
    op(
        "GET",
        "/sandbox/{id}/ports/{port}/signed-preview-url",
        "preview",
        "A signed preview URL that expires",
    ),
    op(
        "POST",
        "/sandbox/{id}/ports/{port}/signed-preview-url/{token}/expire",
        "preview",
        "End a signed preview URL now",
    ),
    op(
        "GET",
        "/sandbox/{id}/toolbox-proxy-url",
        "sandbox",
        "Where the sandbox's toolbox is reached",
    ),
    op(
        "POST",
        "/vms/{id}/pause",
        "vms",
        "Pause a VM (cove extension)",
    ),
    op(
        "POST",
        "/vms/{id}/resume",
        "vms",
        "Resume a paused VM (cove extension)",
    ),
    op(
        "POST",
        "/vms/{id}/start",
        "vms",
        "Boot a VM afresh, discarding saved memory (cove extension)",
    ),
    op(
        "POST",
        "/vms/{id}/stop",
        "vms",
        "Stop a VM (cove extension)",
    ),
    op(
        "POST",
        "/admin/reclaim",
        "admin",
        "Reclaim spot sandboxes (operator, cove extension)",
    ),
    op("GET", "/snapshots", "snapshots", "List snapshots"),
    op(
        "POST",
        "/snapshots",
        "snapshots",
        "Make a snapshot from an image or a Dockerfile",
    ),
    op(
        "POST",
        "/snapshots/import",
        "snapshots",
        "Import an image archive from the import directory (operator, cove extension)",
    ),
    op(
        "GET",
        "/snapshots/{id}",
        "snapshots",
        "One snapshot by id or name",
    ),
    op(
        "DELETE",
        "/snapshots/{id}",
        "snapshots",
        "Delete a snapshot no sandbox stands on",
    ),
    op(
        "POST",
        "/snapshots/{id}/activate",
        "snapshots",
        "Let new sandboxes be made from a snapshot",
    ),
    op(
        "POST",
        "/snapshots/{id}/deactivate",
        "snapshots",
        "Stop new sandboxes being made from a snapshot",
    ),
    op(
        "GET",
        "/snapshots/{id}/build-logs",
        "snapshots",
        "A snapshot's build log, or its stream",
    ),
    op(
        "GET",
        "/snapshots/{id}/build-logs-url",
        "snapshots",
        "Where a snapshot's build log streams",
    ),
    op(
        "GET",
        "/docker-registry",
        "docker-registry",
        "Registry credentials, passwords withheld",
    ),
    op(
        "POST",
        "/docker-registry",
        "docker-registry",
        "Add registry credentials",
    ),
    op(
        "GET",
        "/docker-registry/{id}",
        "docker-registry",
        "One registry's credentials",
    ),
    op(
        "PATCH",
        "/docker-registry/{id}",
        "docker-registry",
        "Change a registry's credentials",
    ),
    op(
        "DELETE",
        "/docker-registry/{id}",
        "docker-registry",
        "Delete a registry's credentials",
    ),
    op(
        "GET",
        "/object-storage/push-access",
        "object-storage",
        "Credentials to upload build contexts",
    ),
    op("GET", "/volumes", "volumes", "List volumes"),
    op("POST", "/volumes", "volumes", "Make a volume"),
    op(
        "GET",
        "/volumes/by-name/{name}",
        "volumes",
        "One volume by name",
    ),
    op("GET", "/volumes/{id}", "volumes", "One volume by id"),
    op(
        "DELETE",
        "/volumes/{id}",
        "volumes",
        "Delete a volume no sandbox mounts",
    ),
];

/// The path parameters of a template.
fn parameters(path: &str) -> Vec<Value> {
    path.split('/')
        .filter_map(|part| part.strip_prefix('{')?.strip_suffix('}'))
        .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
        .collect()
}

/// `getSandboxIdForks` from `GET /sandbox/{id}/forks`: unique per operation.
fn operation_id(method: &str, path: &str) -> String {
    let mut id = method.to_ascii_lowercase();
    for part in path
        .split(['/', '-', '.', '{', '}'])
        .filter(|p| !p.is_empty())
    {
        let mut chars = part.chars();
        if let Some(first) = chars.next() {
            id.push(first.to_ascii_uppercase());
            id.extend(chars);
        }
    }
    id
}

/// What a key needs for an operation, as the document names it.
fn permission(method: &str, path: &str) -> Value {
    let method = Method::from_bytes(method.as_bytes()).expect("the table's methods are valid");
    match need(&method, &format!("/api{path}")) {
        Need::Nothing => Value::Null,
        Need::Permission(p) => Value::from(p.name()),
        Need::Operator => Value::from("operator"),
    }
}

/// The whole document.
pub(crate) fn document() -> Value {
    let mut paths = Map::new();
    for o in OPERATIONS {
        let entry = paths
            .entry(o.path)
            .or_insert_with(|| Value::Object(Map::new()));
        entry[o.method.to_ascii_lowercase()] = json!({
            "operationId": operation_id(o.method, o.path),
            "summary": o.summary,
            "tags": [o.tag],
            "parameters": parameters(o.path),
            "x-cove-permission": permission(o.method, o.path),
            "responses": {
                "default": {
                    "description": "The answer; an error is {\"statusCode\", \"message\", \"error\"}",
                },
            },
        });
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "cove",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "cove's control API: Daytona's, as the pinned SDKs use it, and cove's \
                extensions. Every request carries `Authorization: Bearer <key>`; \
                `x-cove-permission` says what the key needs. Toolbox requests go to \
                each sandbox's toolboxProxyUrl.",
        },
        "servers": [{"url": "/api"}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    })
}

/// `GET /api/openapi.json`.
pub(crate) async fn get() -> Json<Value> {
    Json(document())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    const METHODS: [&str; 5] = ["get", "post", "put", "patch", "delete"];

    /// Every (METHOD, path) the `/api` router in `lib.rs` serves, read from
    /// its source: each `.route(` call, its path, and the method functions
    /// it registers, except the 501s of `not_implemented`; and the
    /// `/api/...` routes served outside the key layer (a runner's).
    fn served() -> BTreeSet<(String, String)> {
        let source = include_str!("lib.rs");
        let start = source
            .find("let api = Router::new()")
            .expect("the api router");
        let end = start
            + source[start..]
                .find("let with_key")
                .expect("then the key layer");
        let mut found = routes_in(&source[start..end]);
        let outside = routes_in(&source[end..])
            .into_iter()
            .filter_map(|(method, path)| Some((method, path.strip_prefix("/api")?.to_owned())));
        found.extend(outside);
        found
    }

    /// The (METHOD, path) of each `.route(` call in `source`.
    fn routes_in(source: &str) -> BTreeSet<(String, String)> {
        let mut found = BTreeSet::new();
        for call in source.split(".route(").skip(1) {
            let mut depth = 1;
            let close = call
                .char_indices()
                .find(|&(_, c)| {
                    depth += match c {
                        '(' => 1,
                        ')' => -1,
                        _ => 0,
                    };
                    depth == 0
                })
                .map(|(i, _)| i)
                .expect("a route call closes");
            let call = &call[..close];
            // A wildcard (`{*image}`, the rest of the path) is described as
            // the parameter it is (`{image}`).
            let path = call
                .split('"')
                .nth(1)
                .expect("a route has a path")
                .replace("{*", "{");
            let path = path.as_str();
            for (at, _) in call.match_indices('(') {
                let before = &call[..at];
                let word = before
                    .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .next()
                    .unwrap_or_default();
                let handler = call[at + 1..].split(')').next().unwrap_or_default();
                if METHODS.contains(&word) && !handler.trim().starts_with("not_implemented::") {
                    found.insert((word.to_ascii_uppercase(), path.to_owned()));
                }
            }
        }
        found
    }

    #[test]
    fn every_served_route_is_described_and_every_description_served() {
        let served = served();
        assert!(
            served.len() > 60,
            "the reading of lib.rs found {}",
            served.len()
        );
        let described: BTreeSet<(String, String)> = OPERATIONS
            .iter()
            .map(|o| (o.method.to_owned(), o.path.to_owned()))
            .collect();
        assert_eq!(
            described.len(),
            OPERATIONS.len(),
            "an operation is described twice"
        );
        let undescribed: Vec<_> = served.difference(&described).collect();
        assert!(
            undescribed.is_empty(),
            "served without a description in OPERATIONS: {undescribed:?}"
        );
        let unserved: Vec<_> = described.difference(&served).collect();
        assert!(
            unserved.is_empty(),
            "described but not served: {unserved:?}"
        );
    }

    #[test]
    fn the_document_names_each_operation_once_with_its_parameters_and_permission() {
        let doc = document();
        let mut ids = BTreeSet::new();
        for (path, methods) in doc["paths"].as_object().unwrap() {
            for (method, operation) in methods.as_object().unwrap() {
                assert!(ids.insert(operation["operationId"].as_str().unwrap().to_owned()));
                let names: Vec<&str> = operation["parameters"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p["name"].as_str().unwrap())
                    .collect();
                assert_eq!(names.len(), path.matches('{').count(), "{method} {path}");
            }
        }
        let delete = &doc["paths"]["/sandbox/{id}"]["delete"];
        assert_eq!(delete["x-cove-permission"], "delete:sandboxes");
        assert_eq!(
            doc["paths"]["/admin/reclaim"]["post"]["x-cove-permission"],
            "operator"
        );
        assert_eq!(
            doc["paths"]["/sandbox"]["get"]["x-cove-permission"],
            Value::Null
        );
    }
}
