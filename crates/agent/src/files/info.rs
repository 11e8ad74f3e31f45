//! `GET /files` and `GET /files/info`: file metadata in the toolbox's
//! `FileInfo` shape (Go-style `mode`, octal `permissions`, owner names).

use std::fs::Metadata;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use axum::extract::State;
use nix::unistd::{Gid, Group, Uid, User};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::error::{ApiError, Json, Query};
use crate::AppState;

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FileInfo {
    pub name: String,
    pub path: String,
    pub size: u64,
    pub mode: String,
    pub permissions: String,
    pub is_dir: bool,
    /// Go's `time.Time.String()` layout, which the toolbox API still carries.
    pub mod_time: String,
    pub modified_at: String,
    pub owner: String,
    pub group: String,
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    path: Option<String>,
    depth: Option<u32>,
}

#[derive(Debug, Deserialize)]
pub struct PathQuery {
    path: String,
}

pub(crate) async fn list(
    State(state): State<AppState>,
    Query(query): Query<ListQuery>,
) -> Result<Json<Vec<FileInfo>>, ApiError> {
    let dir = match query.path.as_deref() {
        Some(path) if !path.is_empty() => state.settings.resolve(path),
        _ => state.settings.work_dir.clone(),
    };
    let depth = query.depth.unwrap_or(1);
    if depth == 0 {
        return Err(ApiError::BadRequest("depth must be at least 1".into()));
    }
    let entries = tokio::task::spawn_blocking(move || {
        let mut entries = Vec::new();
        list_into(&dir, depth, &mut entries)?;
        Ok::<_, ApiError>(entries)
    })
    .await
    .map_err(|e| ApiError::internal("listing files", std::io::Error::other(e)))??;
    Ok(Json(entries))
}

pub(crate) async fn info(
    State(state): State<AppState>,
    Query(query): Query<PathQuery>,
) -> Result<Json<FileInfo>, ApiError> {
    let path = state.settings.resolve(&query.path);
    let metadata = tokio::fs::metadata(&path)
        .await
        .map_err(|e| ApiError::io(&path, e))?;
    Ok(Json(FileInfo::new(&path, &metadata)))
}

fn list_into(dir: &Path, depth: u32, out: &mut Vec<FileInfo>) -> Result<(), ApiError> {
    let mut children: Vec<(PathBuf, Metadata)> = std::fs::read_dir(dir)
        .map_err(|e| ApiError::io(dir, e))?
        .filter_map(Result::ok)
        .filter_map(|entry| Some((entry.path(), entry.metadata().ok()?)))
        .collect();
    children.sort_by(|a, b| a.0.cmp(&b.0));
    for (path, metadata) in children {
        out.push(FileInfo::new(&path, &metadata));
        if depth > 1 && metadata.is_dir() {
            // A subdirectory we may not read is listed but not entered.
            let _ = list_into(&path, depth - 1, out);
        }
    }
    Ok(())
}

impl FileInfo {
    pub fn new(path: &Path, metadata: &Metadata) -> Self {
        let modified = metadata
            .modified()
            .map(OffsetDateTime::from)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH);
        Self {
            name: path
                .file_name()
                .unwrap_or(path.as_os_str())
                .to_string_lossy()
                .into_owned(),
            path: path.to_string_lossy().into_owned(),
            size: metadata.len(),
            mode: go_mode_string(metadata),
            permissions: format!("{:04o}", metadata.permissions().mode() & 0o7777),
            is_dir: metadata.is_dir(),
            mod_time: go_time_string(modified),
            modified_at: modified
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
            owner: User::from_uid(Uid::from_raw(metadata.uid()))
                .ok()
                .flatten()
                .map_or_else(|| metadata.uid().to_string(), |user| user.name),
            group: Group::from_gid(Gid::from_raw(metadata.gid()))
                .ok()
                .flatten()
                .map_or_else(|| metadata.gid().to_string(), |group| group.name),
        }
    }
}

/// Go's `FileMode.String()`, e.g. `drwxr-xr-x`, `-rw-r--r--`, `Lrwxrwxrwx`.
fn go_mode_string(metadata: &Metadata) -> String {
    let file_type = metadata.file_type();
    let mode = metadata.permissions().mode();
    let mut out = String::with_capacity(12);
    if file_type.is_dir() {
        out.push('d');
    } else if file_type.is_symlink() {
        out.push('L');
    } else if file_type.is_block_device() {
        out.push('D');
    } else if file_type.is_char_device() {
        out.push_str("Dc");
    } else if file_type.is_fifo() {
        out.push('p');
    } else if file_type.is_socket() {
        out.push('S');
    }
    if mode & 0o4000 != 0 {
        out.push('u');
    }
    if mode & 0o2000 != 0 {
        out.push('g');
    }
    if mode & 0o1000 != 0 {
        out.push('t');
    }
    if out.is_empty() {
        out.push('-');
    }
    const BITS: [(u32, char); 9] = [
        (0o400, 'r'),
        (0o200, 'w'),
        (0o100, 'x'),
        (0o040, 'r'),
        (0o020, 'w'),
        (0o010, 'x'),
        (0o004, 'r'),
        (0o002, 'w'),
        (0o001, 'x'),
    ];
    for (bit, letter) in BITS {
        out.push(if mode & bit != 0 { letter } else { '-' });
    }
    out
}

/// Go's `time.Time.String()` in UTC: `2006-01-02 15:04:05.999999999 +0000 UTC`.
fn go_time_string(t: OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    let mut out = format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    );
    if t.nanosecond() != 0 {
        let fraction = format!("{:09}", t.nanosecond());
        out.push('.');
        out.push_str(fraction.trim_end_matches('0'));
    }
    out.push_str(" +0000 UTC");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_time_trims_trailing_zeros() {
        let t = OffsetDateTime::from_unix_timestamp_nanos(1_500_000_000_120_000_000).unwrap();
        assert_eq!(go_time_string(t), "2017-07-14 02:40:00.12 +0000 UTC");
    }

    #[test]
    fn go_mode_of_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let metadata = std::fs::metadata(dir.path()).unwrap();
        assert_eq!(go_mode_string(&metadata), "drwxr-xr-x");
    }
}
