//! Persistence of cove.
//!
//! Owns the database schema (migrations in `migrations/`) and the rows of
//! organizations, sandboxes, snapshots, API keys, SSH access tokens, the audit log and the meter. It stores plain records and checks
//! nothing about transitions: the engine decides, this crate remembers.
//!
//! One database of two dialects, through sqlx's `Any` driver: SQLite, a file in
//! the data directory (the one-machine default), or PostgreSQL (`connect`
//! with a `postgres://` URL), which several control-plane processes can share.
//! Every statement is one text for both: placeholders are `$N`, flags are
//! BIGINT 0/1, two-argument `MIN`/`MAX` are `CASE`s, and PostgreSQL's tables
//! have a `rowid` column where the store orders by SQLite's. Each dialect has
//! its migrations (`migrations/sqlite`, `migrations/postgres`); a migration
//! added later goes into both with the same version.

mod api_keys;
mod audit;
mod meter;
mod organizations;
mod previews;
mod quotas;
mod records;
mod registries;
mod runners;
mod sandboxes;
mod snapshots;
mod ssh_access;
mod volumes;

use std::path::Path;

use sqlx::any::{AnyArguments, AnyPoolOptions};
use sqlx::{Any, AnyPool, Executor as _, Transaction};

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
pub use runners::{RunnerRecord, RunnerReport, RunnerSwitches, RunnerUsage};
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
    #[error("the database is in use by another cove server; give this one a database of its own")]
    InUse,
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

/// A statement of the store, whichever the dialect.
pub(crate) type Query<'q> = sqlx::query::Query<'q, Any, AnyArguments<'q>>;

/// The key of the PostgreSQL advisory lock that [`Store::write`] takes: one
/// for the whole store, as SQLite has one write lock.
const WRITE_LOCK: i64 = 0x636f_7665; // "cove"

/// The key of the PostgreSQL advisory lock a server holds its database by
/// ([`Store::hold_alone`]).
const SERVER_LOCK: i64 = 0x636f_7665_0001;

/// A database held by one server; dropping it lets another take it.
pub struct Holder {
    /// The connection whose session holds the lock (`None` once it was lost).
    conn: Option<sqlx::AnyConnection>,
    pool: AnyPool,
}

impl Holder {
    /// Checks that the lock is held, taking it on a new connection when
    /// there is none yet ([`Store::hold_alone`]) or PostgreSQL lost the old
    /// one (a restart, a terminated backend, a network cut), which released it. [`StoreError::InUse`]:
    /// another server took it meanwhile, and this one must stop acting on the
    /// database at once. Any other error: the database cannot be reached
    /// now; call again later.
    pub async fn keep(&mut self) -> Result<(), StoreError> {
        const PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);
        if let Some(conn) = self.conn.as_mut() {
            let ping = sqlx::query("SELECT 1").execute(&mut *conn);
            if matches!(tokio::time::timeout(PATIENCE, ping).await, Ok(Ok(_))) {
                return Ok(());
            }
            self.conn = None;
        }
        let connect = async {
            let mut conn = self.pool.acquire().await?.detach();
            let (taken,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_lock($1)")
                .bind(SERVER_LOCK)
                .fetch_one(&mut conn)
                .await?;
            Ok::<_, sqlx::Error>((conn, taken))
        };
        match tokio::time::timeout(PATIENCE, connect).await {
            Ok(Ok((conn, true))) => {
                self.conn = Some(conn);
                Ok(())
            }
            Ok(Ok((_, false))) => Err(StoreError::InUse),
            Ok(Err(error)) => Err(StoreError::Query(error)),
            Err(_) => Err(StoreError::Query(sqlx::Error::PoolTimedOut)),
        }
    }
}

impl std::fmt::Debug for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Holder")
    }
}

/// Which database a store is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dialect {
    Sqlite,
    Postgres,
}

/// The statement that writes every column of a row keyed by `id`: a plain
/// insert for a new row, an upsert for a saved one. Upserting (rather than
/// `INSERT OR REPLACE`, which deletes and re-inserts) keeps the row's rowid,
/// so listings in creation order stay stable among rows made in one
/// millisecond.
fn write_row_sql(table: &str, columns: &str, upsert: bool) -> String {
    let names: Vec<&str> = columns.split(',').map(str::trim).collect();
    let placeholders: Vec<String> = (1..=names.len()).map(|n| format!("${n}")).collect();
    let placeholders = placeholders.join(", ");
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
        "SELECT {columns} FROM {table} WHERE (id = $1 OR name = $1) \
         AND ($2 IS NULL OR organization_id = $2) \
         ORDER BY CASE WHEN id = $1 THEN 0 ELSE 1 END, created_at_ms, rowid LIMIT 1"
    )
}

/// The statement that lists every row, oldest first (rowid orders rows made
/// in the same millisecond).
fn list_sql(table: &str, columns: &str) -> String {
    format!("SELECT {columns} FROM {table} ORDER BY created_at_ms, rowid")
}

/// The database of one cove server (or of the control planes sharing it).
#[derive(Clone, Debug)]
pub struct Store {
    pool: AnyPool,
    dialect: Dialect,
}

impl Store {
    /// Opens (creating if needed) the SQLite database at `path` and migrates it.
    pub async fn open(path: &Path) -> Result<Store, StoreError> {
        // Percent-encoded where a URL would misread the path; sqlx decodes it.
        let mut encoded = String::new();
        for c in path.display().to_string().chars() {
            match c {
                '%' | '?' | '#' | ' ' => encoded.push_str(&format!("%{:02X}", c as u32)),
                c => encoded.push(c),
            }
        }
        let store = Store::connect(&format!("sqlite://{encoded}?mode=rwc")).await?;
        restrict_to_owner(path).map_err(|source| StoreError::Open {
            path: path.display().to_string(),
            source: sqlx::Error::Io(source),
        })?;
        Ok(store)
    }

    /// Connects to the database at `url` (`sqlite://PATH?mode=rwc` or
    /// `postgres://...`), migrates it and makes sure the default
    /// organization exists. Several servers may connect to one PostgreSQL
    /// database at once: migrations take PostgreSQL's migration lock.
    pub async fn connect(url: &str) -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        let shown = without_password(url);
        let open_err = |source| StoreError::Open {
            path: shown.clone(),
            source,
        };
        let dialect = if url.starts_with("sqlite:") {
            Dialect::Sqlite
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            Dialect::Postgres
        } else {
            return Err(open_err(sqlx::Error::Configuration(
                "the database URL must start with sqlite:// or postgres://".into(),
            )));
        };
        let options = match dialect {
            // WAL with NORMAL survives a process crash; only a power loss can drop
            // the last transactions, and the reconciler repairs that on start.
            Dialect::Sqlite => AnyPoolOptions::new()
                .max_connections(4)
                .after_connect(|conn, _| {
                    Box::pin(async move {
                        for pragma in [
                            "PRAGMA journal_mode = WAL",
                            "PRAGMA synchronous = NORMAL",
                            "PRAGMA busy_timeout = 5000",
                            "PRAGMA foreign_keys = ON",
                        ] {
                            conn.execute(pragma).await?;
                        }
                        Ok(())
                    })
                }),
            Dialect::Postgres => AnyPoolOptions::new().max_connections(16),
        };
        let pool = options.connect(url).await.map_err(open_err)?;
        match dialect {
            Dialect::Sqlite => sqlx::migrate!("./migrations/sqlite").run(&pool).await,
            Dialect::Postgres => sqlx::migrate!("./migrations/postgres").run(&pool).await,
        }
        .map_err(StoreError::Migrate)?;
        let store = Store { pool, dialect };
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
        Ok(store)
    }

    /// Takes the database for this server alone, for as long as the returned
    /// guard lives, or says that another server has it. Until control planes
    /// share a database (with runners holding the sandboxes), a second server
    /// on the same database would take the first's sandboxes for its own. A
    /// SQLite database is in its server's data directory, whose lock covers
    /// it; a PostgreSQL one is held by a session-level advisory lock on a
    /// connection of its own, which PostgreSQL releases when that connection
    /// ends (also when the server is killed).
    pub async fn hold_alone(&self) -> Result<Option<Holder>, StoreError> {
        if self.dialect == Dialect::Sqlite {
            return Ok(None);
        }
        let mut holder = Holder {
            conn: None,
            pool: self.pool.clone(),
        };
        holder.keep().await?;
        Ok(Some(holder))
    }

    /// A transaction that reads before it writes, begun with the store's
    /// write lock held, so that no other writer commits between its read and
    /// its write. SQLite: `BEGIN IMMEDIATE` (waiting out `busy_timeout`; in
    /// WAL mode a plain `BEGIN` would meet an immediate `SQLITE_BUSY` instead
    /// of a wait). PostgreSQL: a transaction-scoped advisory lock, which every
    /// writer of every control plane on the database takes.
    pub(crate) async fn write(&self) -> Result<Transaction<'static, Any>, sqlx::Error> {
        match self.dialect {
            Dialect::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await,
            Dialect::Postgres => {
                let mut tx = self.pool.begin().await?;
                // In FROM, so the row has a type the Any driver reads (not void).
                sqlx::query("SELECT COUNT(*) FROM pg_advisory_xact_lock($1)")
                    .bind(WRITE_LOCK)
                    .execute(&mut *tx)
                    .await?;
                Ok(tx)
            }
        }
    }
}

/// `url` with the password of its user information, if any, starred: the
/// form of a database URL that messages and logs show.
fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The user information ends at the last `@` before the path.
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    match rest[..at].split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***{}", &rest[at..]),
        None => url.to_owned(),
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

#[cfg(test)]
mod tests {
    #[test]
    fn a_urls_password_is_starred_and_nothing_else_changes() {
        let starred = super::without_password;
        assert_eq!(
            starred("postgres://cove:p@ss:w@rd@db:5432/cove"),
            "postgres://cove:***@db:5432/cove"
        );
        assert_eq!(
            starred("postgres://cove@db/cove"),
            "postgres://cove@db/cove"
        );
        assert_eq!(starred("postgres://db/cove"), "postgres://db/cove");
        assert_eq!(
            starred("sqlite:///var/lib/cove/cove.db?mode=rwc"),
            "sqlite:///var/lib/cove/cove.db?mode=rwc"
        );
    }
}
