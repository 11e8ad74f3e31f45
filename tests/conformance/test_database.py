"""`cove serve --database postgres://...`: every record in PostgreSQL instead of
the data directory's SQLite file, through the official SDK; one server per
database. The cluster is a throw-away one this module starts in a temporary
directory (Debian's PostgreSQL, `scripts/setup`), on loopback only."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from conftest import CoveServer, free_port, mounts_under, new_data_dir, pool_cgroups_of, remove_data_dir, wait_until


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class Cluster:
    """initdb and postgres as the `postgres` user (initdb refuses root), with
    its socket and data in one temporary directory, listening on 127.0.0.1."""

    def __init__(self, bin_dir: Path):
        self.bin = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="cove-pg-", dir="/tmp"))
        self.port = free_port()
        self.user = pwd.getpwnam("postgres")
        os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        self.proc: subprocess.Popen | None = None

    def _as_postgres(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(args), capture_output=True, text=True, check=True, user="postgres", group="postgres", cwd=self.dir
        )

    def start(self) -> None:
        data = self.dir / "data"
        self._as_postgres(str(self.bin / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self.log = open(self.dir / "postgres.log", "ab")
        self.proc = subprocess.Popen(
            [
                str(self.bin / "postgres"), "-D", str(data), "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.dir}",
                "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
            ],
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL,
            user="postgres", group="postgres", cwd=self.dir,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready = subprocess.run(
                [str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)], capture_output=True
            )
            if ready.returncode == 0:
                return
            assert self.proc.poll() is None, (self.dir / "postgres.log").read_text()
            time.sleep(0.1)
        raise RuntimeError(f"postgres not ready: {(self.dir / 'postgres.log').read_text()}")

    def database(self) -> str:
        name = "cove_" + uuid.uuid4().hex[:12]
        self._as_postgres(str(self.bin / "createdb"), "-h", str(self.dir), "-p", str(self.port), name)
        return f"postgres://postgres@127.0.0.1:{self.port}/{name}"

    def psql(self, url: str, sql: str) -> str:
        return self._as_postgres(str(self.bin / "psql"), url, "-At", "-c", sql).stdout.strip()

    def stop(self) -> None:
        if self.proc is not None:
            # The postmaster's fast shutdown.
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    bin_dir = postgres_bin()
    if bin_dir is None:
        if os.environ.get("COVE_TEST_STRICT") == "1":
            pytest.fail("PostgreSQL is not installed (scripts/setup --with-sdk installs it)")
        pytest.skip("PostgreSQL is not installed")
    c = Cluster(bin_dir)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_a_server_on_postgresql_keeps_its_sandboxes_there_across_a_restart(cluster):
    url = cluster.database()
    data_dir = new_data_dir()
    key = "cv-" + uuid.uuid4().hex
    server = CoveServer(data_dir, api_key=key, extra_args=("--no-network", "--database", url))
    server.start()
    try:
        client = server.client()
        sandbox = client.create()
        sandbox.fs.upload_file(b"kept\n", "/home/daytona/kept.txt")
        assert sandbox.process.exec("cat /home/daytona/kept.txt").result.strip() == "kept"
        # The records are in PostgreSQL, and there is no SQLite file beside them.
        assert cluster.psql(url, f"SELECT state FROM sandboxes WHERE id = '{sandbox.id}'") == "started"
        assert not (data_dir / "cove.db").exists()

        assert server.stop() == 0, server.log_tail()
        server.start()
        client = server.client()
        again = client.get(sandbox.id)
        assert again.process.exec("cat /home/daytona/kept.txt").result.strip() == "kept"
        client.delete(again, wait=True)
        assert cluster.psql(url, f"SELECT COUNT(*) FROM sandboxes WHERE id = '{sandbox.id}'") == "0"
    finally:
        server.stop()
        remove_data_dir(data_dir)


def test_a_second_server_on_the_same_database_is_refused_and_leaves_nothing(cluster):
    url = cluster.database()
    first_dir, second_dir = new_data_dir(), new_data_dir()
    first = CoveServer(first_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=("--no-network", "--database", url))
    second = CoveServer(second_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=("--no-network", "--database", url))
    first.start()
    try:
        client = first.client()
        sandbox = client.create()
        with pytest.raises(RuntimeError, match="database is in use by another cove server"):
            second.start()
        assert mounts_under(second_dir) == []
        assert pool_cgroups_of(second_dir) == set()
        # The first still serves its sandbox.
        assert sandbox.process.exec("echo still").result.strip() == "still"
        client.delete(sandbox, wait=True)
        # Once the first has gone, the database is free for another.
        assert first.stop() == 0, first.log_tail()
        second.start()
        assert second.sandbox_ids() == set()
    finally:
        second.stop()
        first.stop()
        remove_data_dir(first_dir)
        remove_data_dir(second_dir)


def test_a_database_url_of_another_kind_is_refused_by_name():
    data_dir = new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=("--no-network", "--database", "mysql://x@127.0.0.1/cove"))
    try:
        with pytest.raises(RuntimeError, match="must start with sqlite:// or postgres://"):
            server.start()
        assert mounts_under(data_dir) == []
    finally:
        server.stop()
        remove_data_dir(data_dir)


def test_a_database_that_cannot_be_opened_is_named_without_its_password(cluster):
    # A database the cluster does not have: refused at once, by name.
    url = f"postgres://postgres:s3cret-word@127.0.0.1:{cluster.port}/no_such_database"
    data_dir = new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=("--no-network",), extra_env={"COVE_DATABASE": url})
    try:
        with pytest.raises(RuntimeError) as refused:
            server.start()
        message = str(refused.value)
        assert f"postgres://postgres:***@127.0.0.1:{cluster.port}/no_such_database" in message, message
        assert "no_such_database\" does not exist" in message, message
        assert "s3cret-word" not in message
        assert mounts_under(data_dir) == []
    finally:
        server.stop()
        remove_data_dir(data_dir)


# The session lock a server holds its database by (cove-store's SERVER_LOCK),
# as pg_locks shows a 64-bit advisory key: its high and low 32 bits.
SERVER_LOCK = 0x636F_7665_0001
HOLDER_SQL = (
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
    f"AND classid = {SERVER_LOCK >> 32} AND objid = {SERVER_LOCK & 0xFFFFFFFF} "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def test_a_server_takes_its_database_again_after_losing_it_and_stops_if_another_took_it(cluster):
    url = cluster.database()
    data_dir = new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=("--no-network", "--database", url))
    server.start()
    holding = None
    try:
        client = server.client()
        sandbox = client.create()
        first = cluster.psql(url, HOLDER_SQL)
        assert first, "the server holds no lock on its database"

        # PostgreSQL loses the connection that held it: the server takes it again.
        cluster.psql(url, f"SELECT pg_terminate_backend({first})")
        assert wait_until(lambda: cluster.psql(url, HOLDER_SQL) not in ("", first), timeout=20), server.log_tail()
        assert sandbox.process.exec("echo serving").result.strip() == "serving"

        # Lost again, and another holder (a stand-in for a second server) takes
        # it first: the server stops at once rather than act beside it.
        holder = cluster.psql(url, HOLDER_SQL)
        holding = subprocess.Popen(
            [
                str(cluster.bin / "psql"), url, "-At",
                "-c", f"SELECT pg_terminate_backend({holder})",
                "-c", f"SELECT pg_advisory_lock({SERVER_LOCK})",
                "-c", "SELECT pg_sleep(60)",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, user="postgres", group="postgres", cwd=cluster.dir,
        )
        proc = server.proc
        assert wait_until(lambda: proc.poll() is not None, timeout=30), server.log_tail()
        assert proc.returncode == 75, (proc.returncode, server.log_tail())
        assert "another cove server took the database" in server.log_tail()
        # The stand-in lets go (its backend sleeps on, so it is ended).
        holding.kill()
        holding.wait(timeout=10)
        cluster.psql(url, HOLDER_SQL.replace("SELECT pid", "SELECT pg_terminate_backend(pid)"))
        assert wait_until(lambda: cluster.psql(url, HOLDER_SQL) == "", timeout=10)
        server.stop()

        # Once the other has let go, the server comes back with its sandbox.
        server.start()
        again = server.client().get(sandbox.id)
        assert again.process.exec("echo back").result.strip() == "back"
        server.client().delete(again, wait=True)
    finally:
        if holding is not None and holding.poll() is None:
            holding.kill()
            holding.wait(timeout=10)
        server.stop()
        remove_data_dir(data_dir)
