//! `POST /files/permissions?path=&mode=&owner=&group=`: chmod and chown in one
//! call. `mode` is octal (`755`, `0644`); `owner` and `group` are names or
//! numeric ids; each one left out stays as it is.

use std::path::Path;

use axum::extract::State;
use axum::http::StatusCode;
use nix::unistd::{Group, User};
use serde::Deserialize;

use crate::error::{ApiError, Query};
use crate::AppState;

#[derive(Debug, Deserialize)]
pub struct PermissionsQuery {
    path: String,
    mode: Option<String>,
    owner: Option<String>,
    group: Option<String>,
}

pub(crate) async fn set_permissions(
    State(state): State<AppState>,
    Query(query): Query<PermissionsQuery>,
) -> Result<StatusCode, ApiError> {
    if query.path.is_empty() {
        return Err(ApiError::BadRequest("path is required".into()));
    }
    let path = state.settings.resolve(&query.path);
    let nonempty = |value: &Option<String>| value.clone().filter(|v| !v.is_empty());
    let (mode, owner, group) = (
        nonempty(&query.mode),
        nonempty(&query.owner),
        nonempty(&query.group),
    );
    tokio::task::spawn_blocking(move || apply(&path, mode, owner, group))
        .await
        .map_err(|e| ApiError::internal("setting permissions", std::io::Error::other(e)))??;
    Ok(StatusCode::OK)
}

fn apply(
    path: &Path,
    mode: Option<String>,
    owner: Option<String>,
    group: Option<String>,
) -> Result<(), ApiError> {
    std::fs::metadata(path).map_err(|e| ApiError::io(path, e))?;
    let mode = mode.map(|mode| parse_mode(&mode)).transpose()?;
    let uid = owner.map(|owner| resolve_user(&owner)).transpose()?;
    let gid = group.map(|group| resolve_group(&group)).transpose()?;
    if let Some(mode) = mode {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| ApiError::io(path, e))?;
    }
    if uid.is_some() || gid.is_some() {
        std::os::unix::fs::chown(path, uid, gid).map_err(|e| ApiError::io(path, e))?;
    }
    Ok(())
}

fn parse_mode(mode: &str) -> Result<u32, ApiError> {
    u32::from_str_radix(mode, 8)
        .ok()
        .filter(|mode| *mode <= 0o7777)
        .ok_or_else(|| ApiError::BadRequest(format!("invalid octal mode: {mode}")))
}

fn resolve_user(owner: &str) -> Result<u32, ApiError> {
    if let Ok(uid) = owner.parse() {
        return Ok(uid);
    }
    User::from_name(owner)
        .ok()
        .flatten()
        .map(|user| user.uid.as_raw())
        .ok_or_else(|| ApiError::BadRequest(format!("user not found: {owner}")))
}

fn resolve_group(group: &str) -> Result<u32, ApiError> {
    if let Ok(gid) = group.parse() {
        return Ok(gid);
    }
    Group::from_name(group)
        .ok()
        .flatten()
        .map(|group| group.gid.as_raw())
        .ok_or_else(|| ApiError::BadRequest(format!("group not found: {group}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_octal_and_bounded() {
        assert_eq!(parse_mode("755").unwrap(), 0o755);
        assert_eq!(parse_mode("0644").unwrap(), 0o644);
        assert!(parse_mode("999").is_err());
        assert!(parse_mode("17777").is_err());
        assert_eq!(resolve_user("root").unwrap(), 0);
        assert_eq!(resolve_user("1234").unwrap(), 1234);
        assert!(resolve_user("no-such-user-cove").is_err());
    }
}
