//! A throw-away PostgreSQL cluster for the tests that run the store against
//! PostgreSQL as well as SQLite: Debian's binaries, a data directory of its
//! own under /tmp, a port nobody else uses, settings that trade durability
//! for speed. Nothing of the machine's own clusters is touched.
//!
//! ```no_run
//! let Some(postgres) = cove_testenv::postgres::Postgres::start() else {
//!     return;
//! };
//! let url = postgres.database("sandboxes_are_listed");
//! ```

use std::fs::{self, File};
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::{Gid, Pid, Uid, User};

/// Where Debian installs each major version's binaries (`<version>/bin`).
const INSTALLS: &str = "/usr/lib/postgresql";

/// What initdb and the postmaster say, in the cluster's directory.
const INITDB_LOG: &str = "initdb.log";
const SERVER_LOG: &str = "postgres.log";

/// How long the postmaster has to accept connections, and later to stop.
const PATIENCE: Duration = Duration::from_secs(30);

/// The libpq variables of the caller's environment that would point the
/// cluster's own tools somewhere else.
const LIBPQ_VARIABLES: [&str; 8] = [
    "PGHOST",
    "PGHOSTADDR",
    "PGPORT",
    "PGUSER",
    "PGDATABASE",
    "PGSERVICE",
    "PGOPTIONS",
    "PGDATA",
];

/// A PostgreSQL cluster of its own in a temporary directory, for one test process.
///
/// The postmaster is a child of the test process; dropping this stops it,
/// waits for it and removes the directory. A cluster kept in a `static` is
/// never dropped, and a test process can die without unwinding: for those a
/// watchdog (a shell reading a pipe from the test process, which closes when
/// that process ends, however it ends) stops the postmaster and removes the
/// directory instead.
pub struct Postgres {
    /// The temporary directory: `data/` (the cluster), the Unix socket,
    /// `initdb.log` and `postgres.log`.
    root: PathBuf,
    /// The binaries of the installed version.
    bin: PathBuf,
    /// The loopback TCP port it listens on (and the socket's number).
    port: u16,
    /// Who runs the cluster: the `postgres` system user when the tests run as
    /// root (initdb refuses root), else the tests' own user.
    owner: Option<(Uid, Gid)>,
    postmaster: Option<Child>,
    /// The watchdog, and the pipe whose end tells it to act.
    watchdog: Option<(Child, ChildStdin)>,
    /// How many databases [`Postgres::database`] has made: each name ends in
    /// its number, so no two are alike.
    databases: AtomicUsize,
}

impl Postgres {
    /// Starts one (initdb + postgres, as the `postgres` system user since
    /// initdb refuses root), or None after [`crate::missing`] when the
    /// binaries (/usr/lib/postgresql/*/bin) or the user are not there.
    ///
    /// Binaries that are there but fail to start a cluster are a failure, not
    /// a missing environment: that panics, with the end of the cluster's log.
    #[track_caller]
    pub fn start() -> Option<Postgres> {
        let Some(bin) = installed_bin() else {
            crate::missing(&format!(
                "PostgreSQL is not installed (no {INSTALLS}/*/bin/initdb; \
                 scripts/setup --with-sdk installs it)"
            ));
            return None;
        };
        let owner = if nix::unistd::geteuid().is_root() {
            match User::from_name("postgres") {
                Ok(Some(user)) => Some((user.uid, user.gid)),
                Ok(None) | Err(_) => {
                    crate::missing(
                        "the system user postgres, who runs the test cluster \
                         (initdb refuses root), is not there",
                    );
                    return None;
                }
            }
        } else {
            None
        };
        match Postgres::launch(bin, owner) {
            Ok(postgres) => Some(postgres),
            Err(why) => panic!("a test PostgreSQL cluster did not start: {why}"),
        }
    }

    /// A new, empty database in it, returned as a URL
    /// `postgres://postgres@127.0.0.1:PORT/NAME`. The name is `name_hint` cut
    /// down to `[a-z0-9_]` and numbered, so every call makes another.
    #[track_caller]
    pub fn database(&self, name_hint: &str) -> String {
        let number = self.databases.fetch_add(1, Ordering::Relaxed) + 1;
        let name = format!("{}_{number}", sanitize(name_hint));
        let port = self.port.to_string();
        let outcome = self
            .command(&self.bin.join("createdb"))
            .args(["-h".as_ref(), self.root.as_os_str()])
            .args(["-p", &port, "-U", "postgres", &name])
            .output();
        match outcome {
            Ok(output) if output.status.success() => self.url_of(&name),
            Ok(output) => panic!(
                "createdb {name} failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
            Err(error) => panic!("createdb {name} did not run: {error}"),
        }
    }

    /// The URL of the database `db` in it (trust authentication on loopback:
    /// no password).
    pub fn url_of(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Makes the directory, the cluster in it, and starts the postmaster.
    /// Whatever is made before an error is undone by `Drop`.
    fn launch(bin: PathBuf, owner: Option<(Uid, Gid)>) -> Result<Postgres, String> {
        let root = temporary_directory(owner)?;
        let mut postgres = Postgres {
            root,
            bin,
            port: 0,
            owner,
            postmaster: None,
            watchdog: None,
            databases: AtomicUsize::new(0),
        };
        postgres.initdb()?;
        // The port is free when asked for but may be taken before the
        // postmaster binds it: another port is tried then.
        let mut attempts = 0;
        loop {
            attempts += 1;
            postgres.port = free_port()?;
            match postgres.run_postmaster() {
                Ok(()) => return Ok(postgres),
                Err(why) if attempts < 3 && why.contains("could not bind") => {}
                Err(why) => return Err(why),
            }
        }
    }

    /// `initdb`: trust authentication (local and loopback: the cluster listens
    /// nowhere else), no fsync of the new files.
    fn initdb(&self) -> Result<(), String> {
        let log = self.log_file(INITDB_LOG)?;
        let status = self
            .command(&self.bin.join("initdb"))
            .arg("-D")
            .arg(self.root.join("data"))
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .stdout(log.0)
            .stderr(log.1)
            .status()
            .map_err(|error| format!("initdb did not run: {error}"))?;
        if !status.success() {
            return Err(format!(
                "initdb failed ({status}){}",
                self.log_tail(INITDB_LOG)
            ));
        }
        Ok(())
    }

    /// Starts the postmaster and its watchdog, and waits until it accepts
    /// connections. On an error the postmaster is stopped again.
    fn run_postmaster(&mut self) -> Result<(), String> {
        let log = self.log_file(SERVER_LOG)?;
        let mut socket_directories = std::ffi::OsString::from("unix_socket_directories=");
        socket_directories.push(&self.root);
        let postmaster = self
            .command(&self.bin.join("postgres"))
            .arg("-D")
            .arg(self.root.join("data"))
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1", "-c"])
            .arg(socket_directories)
            .args([
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=200",
                "-c",
                "shared_buffers=32MB",
            ])
            .stdin(Stdio::null())
            .stdout(log.0)
            .stderr(log.1)
            // Not in the tests' process group: a ^C there is the watchdog's
            // to answer, after the tests are gone.
            .process_group(0)
            .spawn()
            .map_err(|error| format!("postgres did not run: {error}"))?;
        let pid = postmaster.id();
        self.postmaster = Some(postmaster);
        self.watchdog = Some(self.watch(pid)?);
        let outcome = self.wait_until_ready();
        if outcome.is_err() {
            self.stop();
        }
        outcome
    }

    /// A shell that waits for its stdin (a pipe from this process) to close,
    /// then stops the postmaster `pid` and removes the directory. Dropping a
    /// `Postgres` kills it first; it acts only when this process ended
    /// without dropping it.
    fn watch(&self, pid: u32) -> Result<(Child, ChildStdin), String> {
        const SCRIPT: &str = r#"
            while read -r _; do :; done
            kill -INT "$1" 2>/dev/null
            i=0
            while kill -0 "$1" 2>/dev/null && [ "$i" -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
            kill -0 "$1" 2>/dev/null && kill -KILL "$1"
            rm -rf "$2"
        "#;
        let mut watchdog = Command::new("/bin/sh")
            .args(["-c", SCRIPT, "cove-postgres-watchdog", &pid.to_string()])
            .arg(&self.root)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|error| format!("the watchdog (/bin/sh) did not run: {error}"))?;
        match watchdog.stdin.take() {
            Some(stdin) => Ok((watchdog, stdin)),
            None => Err("the watchdog has no stdin".to_string()),
        }
    }

    /// Polls `pg_isready` until the postmaster accepts connections, it exits,
    /// or [`PATIENCE`] runs out.
    fn wait_until_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + PATIENCE;
        let port = self.port.to_string();
        loop {
            if let Some(postmaster) = self.postmaster.as_mut() {
                match postmaster.try_wait() {
                    Ok(None) => {}
                    Ok(Some(status)) => {
                        self.postmaster = None;
                        return Err(format!(
                            "postgres exited ({status}){}",
                            self.log_tail(SERVER_LOG)
                        ));
                    }
                    Err(error) => return Err(format!("waiting for postgres: {error}")),
                }
            }
            let ready = Command::new(self.bin.join("pg_isready"))
                .args(["-h".as_ref(), self.root.as_os_str()])
                .args([
                    "-p", &port, "-U", "postgres", "-d", "postgres", "-q", "-t", "1",
                ])
                .env("LC_ALL", "C")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map_err(|error| format!("pg_isready did not run: {error}"))?;
            if ready.success() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "postgres accepted no connections in {PATIENCE:?}{}",
                    self.log_tail(SERVER_LOG)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the watchdog, then the postmaster (a fast shutdown: SIGINT, then
    /// SIGQUIT and SIGKILL for one that does not go), and waits for both.
    fn stop(&mut self) {
        if let Some((mut watchdog, stdin)) = self.watchdog.take() {
            // Killed before its stdin closes, so it never acts.
            let _ = watchdog.kill();
            let _ = watchdog.wait();
            drop(stdin);
        }
        let Some(mut postmaster) = self.postmaster.take() else {
            return;
        };
        let Ok(raw) = i32::try_from(postmaster.id()) else {
            return;
        };
        let pid = Pid::from_raw(raw);
        for signal in [Signal::SIGINT, Signal::SIGQUIT, Signal::SIGKILL] {
            let _ = kill(pid, signal);
            let deadline = Instant::now() + PATIENCE;
            loop {
                match postmaster.try_wait() {
                    Ok(Some(status)) => {
                        if status.signal().is_some() {
                            say(&format!("the test PostgreSQL ended by {status}"));
                        }
                        return;
                    }
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Ok(None) => {
                        say(&format!(
                            "the test PostgreSQL (pid {pid}) did not stop in {PATIENCE:?} on {signal}"
                        ));
                        break;
                    }
                    Err(error) => {
                        say(&format!("waiting for the test PostgreSQL: {error}"));
                        return;
                    }
                }
            }
        }
    }

    /// A command run as the cluster's owner, in its directory, with none of
    /// the caller's libpq settings.
    fn command(&self, program: &Path) -> Command {
        let mut command = Command::new(program);
        command
            .current_dir(&self.root)
            .env("HOME", &self.root)
            .env("LC_ALL", "C");
        for variable in LIBPQ_VARIABLES {
            command.env_remove(variable);
        }
        if let Some((uid, gid)) = self.owner {
            // std drops root's supplementary groups along with the ids.
            command.uid(uid.as_raw()).gid(gid.as_raw());
        }
        command
    }

    /// The log `name`, opened to append, as a child's stdout and stderr.
    fn log_file(&self, name: &str) -> Result<(File, File), String> {
        let path = self.root.join(name);
        let file = File::options()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|error| format!("{}: {error}", path.display()))?;
        let again = file
            .try_clone()
            .map_err(|error| format!("{}: {error}", path.display()))?;
        Ok((file, again))
    }

    /// The last lines of the log `name`, to end an error message with.
    fn log_tail(&self, name: &str) -> String {
        let path = self.root.join(name);
        match fs::read(&path) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(30)..].join("\n");
                format!("; the end of {}:\n{tail}", path.display())
            }
            Err(error) => format!("; its log {} is unreadable: {error}", path.display()),
        }
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
        if let Err(error) = fs::remove_dir_all(&self.root) {
            if error.kind() != std::io::ErrorKind::NotFound {
                say(&format!("removing {}: {error}", self.root.display()));
            }
        }
    }
}

/// The `bin` directory of the newest installed version that has initdb and
/// postgres.
fn installed_bin() -> Option<PathBuf> {
    let mut versions: Vec<(Vec<u32>, PathBuf)> = fs::read_dir(INSTALLS)
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let version = entry
                .file_name()
                .to_str()?
                .split('.')
                .map(|part| part.parse().ok())
                .collect::<Option<Vec<u32>>>()?;
            let bin = entry.path().join("bin");
            let complete = ["initdb", "postgres", "pg_isready", "createdb"]
                .iter()
                .all(|program| bin.join(program).is_file());
            complete.then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

/// A new directory under /tmp (not `$TMPDIR`, which the cluster's owner may
/// not reach), private to the cluster's owner.
fn temporary_directory(owner: Option<(Uid, Gid)>) -> Result<PathBuf, String> {
    static MADE: AtomicUsize = AtomicUsize::new(0);
    let process = std::process::id();
    loop {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.subsec_nanos());
        let number = MADE.fetch_add(1, Ordering::Relaxed);
        let path = PathBuf::from(format!("/tmp/cove-postgres-{process}-{number}-{nanos:x}"));
        match fs::create_dir(&path) {
            Ok(()) => {
                let made =
                    fs::set_permissions(&path, fs::Permissions::from_mode(0o700)).and_then(|()| {
                        match owner {
                            Some((uid, gid)) => std::os::unix::fs::chown(
                                &path,
                                Some(uid.as_raw()),
                                Some(gid.as_raw()),
                            ),
                            None => Ok(()),
                        }
                    });
                return match made {
                    Ok(()) => Ok(path),
                    Err(error) => {
                        let _ = fs::remove_dir_all(&path);
                        Err(format!("{}: {error}", path.display()))
                    }
                };
            }
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(error) => return Err(format!("{}: {error}", path.display())),
        }
    }
}

/// A loopback port free at the moment of asking.
fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .map_err(|error| format!("no free port on 127.0.0.1: {error}"))
}

/// `hint` as the start of a database name: lowercase ASCII letters, digits
/// and underscores, short enough for PostgreSQL's 63 bytes with the number.
fn sanitize(hint: &str) -> String {
    let mut name: String = hint
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '_' => c,
            _ => '_',
        })
        .take(40)
        .collect();
    if !name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_') {
        name.insert_str(0, "db_");
    }
    name
}

/// A note on the process's stderr (as [`crate::missing`] writes: past
/// libtest's capture).
fn say(what: &str) {
    let _ = writeln!(std::io::stderr().lock(), "cove-testenv: {what}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `psql` answers to `query` in the database `db`, over TCP.
    fn ask(postgres: &Postgres, db: &str, query: &str) -> String {
        let output = Command::new(postgres.bin.join("psql"))
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d"])
            .arg(postgres.url_of(db))
            .args(["-c", query])
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "psql: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap().trim().to_string()
    }

    #[test]
    fn a_cluster_starts_takes_databases_and_goes() {
        let Some(postgres) = Postgres::start() else {
            return;
        };
        let first = postgres.database("First test: sandboxes");
        let second = postgres.database("First test: sandboxes");
        assert_ne!(first, second, "every call makes another database");
        for url in [&first, &second] {
            let name = url.rsplit('/').next().unwrap();
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{name}"
            );
            assert_eq!(ask(&postgres, name, "SELECT current_database()"), name);
            assert_eq!(
                ask(
                    &postgres,
                    name,
                    "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
                ),
                "0",
                "a new database is empty"
            );
        }
        let settings = ask(
            &postgres,
            "postgres",
            "SELECT string_agg(setting, ',' ORDER BY name) FROM pg_settings \
             WHERE name IN ('fsync', 'listen_addresses', 'max_connections')",
        );
        assert_eq!(settings, "off,127.0.0.1,200");

        let pid = Pid::from_raw(i32::try_from(postgres.postmaster.as_ref().unwrap().id()).unwrap());
        let watchdog =
            Pid::from_raw(i32::try_from(postgres.watchdog.as_ref().unwrap().0.id()).unwrap());
        let root = postgres.root.clone();
        assert!(root.join("data/PG_VERSION").is_file());
        drop(postgres);
        assert_eq!(
            kill(pid, None),
            Err(nix::errno::Errno::ESRCH),
            "the postmaster is gone"
        );
        assert_eq!(
            kill(watchdog, None),
            Err(nix::errno::Errno::ESRCH),
            "so is its watchdog"
        );
        assert!(!root.exists(), "{} is removed", root.display());
    }

    #[test]
    fn hints_become_names_postgres_takes() {
        assert_eq!(sanitize("Store::lists-Sandboxes"), "store__lists_sandboxes");
        assert_eq!(sanitize("1st"), "db_1st");
        assert_eq!(sanitize(""), "db_");
        assert!(sanitize(&"x".repeat(100)).len() <= 40);
    }

    #[test]
    fn a_cluster_can_be_shared_by_the_tests_of_a_process() {
        fn shared<T: Send + Sync>() {}
        shared::<Postgres>();
    }
}
