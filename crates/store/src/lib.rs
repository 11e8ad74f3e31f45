//! Persistence of cove.
//!
//! Owns the database schema (migrations in `migrations/`) and the rows of
//! organizations, sandboxes, snapshots, API keys, SSH access tokens, the audit log and the meter. It stores plain records and checks
//! nothing about transitions: the engine decides, this crate remembers.
//! SQL is kept portable so PostgreSQL can replace SQLite.

mod api_keys;
mod audit;
mod meter;
mod organizations;
mod previews;
mod quotas;
mod records;
mod registries;
mod sandboxes;
mod snapshots;
mod ssh_access;
mod volumes;

use std::path::Path;
use std::str::FromStr;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::SqlitePool;

pub use api_keys::ApiKeyRecord;
pub use audit::{AuditQuery, AuditRecord};
pub use meter::{MeterKind, MeterRecord};
pub use organizations::{OrganizationHoldings, OrganizationRecord};
pub use previews::SignedPreview;
pub use quotas::{OrganizationQuotaRecord, RateLimit, RegionQuotaRecord};
pub use records::{
    BuildStepRecord, DockerRegistryRecord, ImageSettings, NetworkSettings, SandboxRecord,
    SnapshotRecord, SnapshotState, VolumeMount, VolumeRecord,
};
pub use sandboxes::{SandboxOrder, SandboxSortField, SortDirection};
pub use ssh_access::SshAccessRecord;

/// The organization every server has, made at its first start; rows from
/// before organizations existed belong to it (migration 0017).
pub const DEFAULT_ORGANIZATION: &str = "cove";
/// The one region of a server (Daytona's default target's name, so a
/// program that sets `DAYTONA_TARGET=us` runs here unchanged).
pub const DEFAULT_REGION: &str = "us";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database {path}")]
    Open {
        path: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("database migration")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    #[error("database query")]
    Query(#[from] sqlx::Error),
    #[error("{name} already exists")]
    Duplicate { name: String },
    #[error("stored row {id} is corrupt: {reason}")]
    Corrupt { id: String, reason: String },
    /// A JSON column of a row does not decode.
    #[error("stored row {id} is corrupt: its {column} does not decode")]
    Undecodable {
        id: String,
        column: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

/// How a transaction that reads before it writes begins: with the write
/// lock taken (waiting out `busy_timeout`), so that no other writer can
/// commit between its read and its write, which SQLite in WAL mode would
/// answer with an immediate `SQLITE_BUSY` rather than a wait.
const WRITE: &str = "BEGIN IMMEDIATE";

/// The statement that writes every column of a row keyed by `id`: a plain
/// insert for a new row, an upsert for a saved one. Upserting (rather than
/// `INSERT OR REPLACE`, which deletes and re-inserts) keeps the row's rowid,
/// so listings in creation order stay stable among rows made in one
/// millisecond.
fn write_row_sql(table: &str, columns: &str, upsert: bool) -> String {
    let names: Vec<&str> = columns.split(',').map(str::trim).collect();
    let placeholders = vec!["?"; names.len()].join(", ");
    let mut sql = format!("INSERT INTO {table} ({columns}) VALUES ({placeholders})");
    if upsert {
        let updates: Vec<String> = names
            .iter()
            .filter(|name| **name != "id")
            .map(|name| format!("{name} = excluded.{name}"))
            .collect();
        sql.push_str(&format!(
            " ON CONFLICT(id) DO UPDATE SET {}",
            updates.join(", ")
        ));
    }
    sql
}

/// The statement that finds the row whose id or, failing that, whose name is
/// its first parameter, in the organization that is its second (NULL: in
/// any; names are unique only in one, so the oldest row of that name wins).
fn find_by_id_or_name_sql(table: &str, columns: &str) -> String {
    format!(
        "SELECT {columns} FROM {table} WHERE (id = ?1 OR name = ?1) \
         AND (?2 IS NULL OR organization_id = ?2) \
         ORDER BY CASE WHEN id = ?1 THEN 0 ELSE 1 END, created_at_ms, rowid LIMIT 1"
    )
}

/// The statement that lists every row, oldest first (rowid orders rows made
/// in the same millisecond).
fn list_sql(table: &str, columns: &str) -> String {
    format!("SELECT {columns} FROM {table} ORDER BY created_at_ms, rowid")
}

/// The database of one cove server.
#[derive(Clone, Debug)]
pub struct Store {
    pool: SqlitePool,
}

impl Store {
    /// Opens (creating if needed) the SQLite database at `path` and migrates it.
    pub async fn open(path: &Path) -> Result<Store, StoreError> {
        let open_err = |source| StoreError::Open {
            path: path.display().to_string(),
            source,
        };
        let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
            .map_err(open_err)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // WAL with NORMAL survives a process crash; only a power loss can drop
            // the last transactions, and the reconciler repairs that on start.
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(std::time::Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .map_err(open_err)?;
        sqlx::migrate!("./migrations")
            .run(&pool)
            .await
            .map_err(StoreError::Migrate)?;
        let store = Store { pool };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        store
            .ensure_organization(&OrganizationRecord {
                id: DEFAULT_ORGANIZATION.into(),
                name: DEFAULT_ORGANIZATION.into(),
                default_region_id: DEFAULT_REGION.into(),
                created_at_ms: now,
                updated_at_ms: now,
            })
            .await?;
        restrict_to_owner(path).map_err(|source| StoreError::Open {
            path: path.display().to_string(),
            source: sqlx::Error::Io(source),
        })?;
        Ok(store)
    }
}

/// The database holds environments, registry passwords and preview tokens:
/// it and the WAL and shared-memory files beside it are made readable by
/// their owner only once SQLite has them (SQLite sets an empty database file
/// to 0644 when it opens it, and makes the others with the database's mode,
/// so later ones are 0600 too).
fn restrict_to_owner(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let beside = |suffix: &str| {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        std::path::PathBuf::from(name)
    };
    for file in [path.to_owned(), beside("-wal"), beside("-shm")] {
        match std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => return Err(error),
            _ => {}
        }
    }
    Ok(())
}
