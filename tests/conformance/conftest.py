"""Conformance suite: a real cove server driven through the official Daytona SDK.

One server per test session (``cove`` fixture), started from the built binary on a
free port with a throw-away data directory; images are shared across runs (see
``images_dir``). Every test gets a ``sandboxes`` factory that deletes what it made.

Environment:
    COVE_BIN         the server binary (default: <repo>/target/release/cove)
    COVE_IMAGES_DIR  where root filesystems are cached (default: /var/tmp/cove/images)
    COVE_AGENT_BIN   passed through to the server when set
    COVE_TEST_VM_ASSETS  the VM guest assets (scripts/vm-assets); without it the
                     VM tests skip and servers run with --no-vm
    COVE_TEST_STRICT=1   (scripts/test, so CI) a test that would be skipped fails
                     instead, naming what is missing: nothing passes by not running
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
import requests

from daytona import (
    CreateSandboxFromSnapshotParams,
    Daytona,
    DaytonaConfig,
    DaytonaNotFoundError,
    Sandbox,
)

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 180.0


STRICT = os.environ.get("COVE_TEST_STRICT") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under COVE_TEST_STRICT=1 a skip is a failure (the same gate as the
    Rust tests' ``cove-testenv``)."""
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under COVE_TEST_STRICT=1, where every test must run: {reason}"


def cove_binary() -> Path:
    return Path(os.environ.get("COVE_BIN") or REPO / "target" / "release" / "cove")


def images_dir() -> Path:
    return Path(os.environ.get("COVE_IMAGES_DIR") or "/var/tmp/cove/images")


def vm_assets() -> Path | None:
    """The guest kernel and initramfs (scripts/vm-assets); None: VM tests skip."""
    path = os.environ.get("COVE_TEST_VM_ASSETS")
    return Path(path) if path else None


def vm_args(vms: bool) -> list[str]:
    assets = vm_assets()
    if vms and assets is not None:
        return ["--vm-assets", str(assets)]
    return ["--no-vm"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mounts_under(path: Path) -> list[str]:
    """Mount points (host mount namespace) at or under ``path``."""
    prefix = str(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mount_point = line.split()[4]
            if mount_point == prefix or mount_point.startswith(prefix + "/"):
                found.append(mount_point)
    return found


def pool_cgroups_of(data_dir: Path) -> set[Path]:
    """The shim-pool cgroups of the server on ``data_dir``: they are named
    ``pool@{tag}.{n}``, the tag being the 64-bit FNV-1a hash of the server's
    container state directory (``<data dir>/storage/sandboxes``)."""
    tag = 0xCBF29CE484222325
    for byte in str(Path(data_dir).resolve() / "storage" / "sandboxes").encode():
        tag = ((tag ^ byte) * 0x100000001B3) % (1 << 64)
    return set(Path("/sys/fs/cgroup").glob(f"*/cove/pool@{tag:016x}.*"))


class CoveServer:
    """A `cove serve` child process on its own port, over a given data directory."""

    def __init__(
        self,
        data_dir: Path,
        api_key: str,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
        vms: bool = False,
        images: Path | None = None,
    ):
        self.data_dir = data_dir
        # Where its images are (`--images-dir`): the shared one unless given.
        self.images = images or images_dir()
        # A server boots a VM template at start when it serves VMs; the ones
        # that test something else leave that CPU to the others.
        self.vms = vms
        self.api_key = api_key
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.port = 0
        # The SSH gateway's port (`--ssh-listen`); every server gets its own
        # on loopback, so servers never clash over the default 127.0.0.1:2222.
        self.ssh_port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self._log = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, keep_ports: bool = False) -> None:
        """Starts the server, on new free ports unless `keep_ports` (a
        restart that clients and runners must find where it was)."""
        binary = cove_binary()
        if not binary.is_file():
            pytest.exit(f"cove binary not found at {binary}; run `cargo build --release && cargo agent`", 2)
        self.images.mkdir(parents=True, exist_ok=True)
        if not (keep_ports and getattr(self, "port", None)):
            self.port = free_port()
            self.ssh_port = free_port()
        env = dict(os.environ)
        env["COVE_API_KEY"] = self.api_key
        env.update(self.extra_env)
        env.setdefault("RUST_LOG", "info")
        # A waiting VM of the warm pool would take CPU from the tests, and is
        # taken by whichever test creates a VM first; the pool's own test asks
        # for one.
        env.setdefault("COVE_VM_WARM_POOL", "0")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                str(binary),
                "serve",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--data-dir",
                str(self.data_dir),
                "--images-dir",
                str(self.images),
                *vm_args(self.vms),
                "--ssh-listen",
                f"127.0.0.1:{self.ssh_port}",
                *self.extra_args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            env=env,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"cove exited with {self.proc.returncode} before answering:\n{self.log_tail()}"
                )
            try:
                r = requests.get(
                    f"{self.api_url}/sandbox",
                    headers={"Authorization": f"Bearer {self.api_key}"},
                    timeout=2,
                )
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except requests.RequestException as e:
                last = repr(e)
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"cove not ready after {READY_TIMEOUT_S}s (last: {last}):\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        code = self.proc.returncode
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None
        return code

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # Raw HTTP, for what the SDK cannot express or hides.
    def request(self, method: str, path: str, auth: bool = True, **kw) -> requests.Response:
        headers = kw.pop("headers", {})
        if auth:
            headers.setdefault("Authorization", f"Bearer {self.api_key}")
        return requests.request(method, f"{self.api_url}{path}", headers=headers, timeout=60, **kw)

    def sandbox_ids(self) -> set[str]:
        r = self.request("GET", "/sandbox", params={"limit": 1000})
        r.raise_for_status()
        body = r.json()
        ids = {item["id"] for item in body["items"]}
        cursor = body.get("nextCursor")
        while cursor:
            r = self.request("GET", "/sandbox", params={"limit": 1000, "cursor": cursor})
            r.raise_for_status()
            body = r.json()
            ids |= {item["id"] for item in body["items"]}
            cursor = body.get("nextCursor")
        return ids

    def delete_all(self) -> None:
        for sid in self.sandbox_ids():
            self.request("DELETE", f"/sandbox/{sid}")

    def client(self) -> Daytona:
        return Daytona(DaytonaConfig(api_key=self.api_key, api_url=self.api_url))


def run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True)


class FakeInternet:
    """The sandboxes' "internet" for a test session, all on this machine: a
    network namespace joined to the host by a veth (cove's uplink), with a DNS
    server (allowed.test, denied.test) and an HTTP server on each name's address,
    and what a cloud host has beside it: a metadata service (its credentials)
    at 169.254.169.254 and a host on its private network. Their addresses are
    on the namespace's lo only; sandbox traffic gets there through the uplink
    gateway, as it would get to the real ones.
    """

    HOST_ADDR = "198.18.77.1"
    GATEWAY = "198.18.77.2"
    ALLOWED = "198.51.100.10"
    DENIED = "203.0.113.10"
    METADATA = "169.254.169.254"
    PRIVATE = "192.168.77.5"

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.netns = f"fakenet-{tag}"
        self.interface = f"fk{tag}"
        self.peer = f"fkp{tag}"
        self.procs: list[subprocess.Popen] = []
        self.web = Path(tempfile.mkdtemp(prefix="cvweb", dir="/tmp"))

    def start(self) -> None:
        run("ip", "netns", "add", self.netns)
        ns = ["ip", "netns", "exec", self.netns]
        run("ip", "link", "add", self.interface, "type", "veth", "peer", "name", self.peer)
        run("ip", "link", "set", self.peer, "netns", self.netns)
        run("ip", "addr", "add", f"{self.HOST_ADDR}/30", "dev", self.interface)
        run("ip", "link", "set", self.interface, "up")
        run(*ns, "ip", "addr", "add", f"{self.GATEWAY}/30", "dev", self.peer)
        run(*ns, "ip", "link", "set", self.peer, "up")
        run(*ns, "ip", "link", "set", "lo", "up")
        for address in (self.ALLOWED, self.DENIED, self.METADATA, self.PRIVATE):
            run(*ns, "ip", "addr", "add", f"{address}/32", "dev", "lo")
        dns = Path(__file__).with_name("fakenet_dns.py")
        self.procs.append(
            subprocess.Popen(
                [*ns, sys.executable, str(dns), self.GATEWAY,
                 f"allowed.test={self.ALLOWED}", f"denied.test={self.DENIED}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        )
        servers = (("allowed", self.ALLOWED), ("denied", self.DENIED),
                   ("metadata", self.METADATA), ("private", self.PRIVATE))
        for name, address in servers:
            root = self.web / name
            root.mkdir()
            (root / "index.html").write_text(f"{name} server\n")
            self.procs.append(
                subprocess.Popen(
                    [*ns, sys.executable, "-m", "http.server", "80", "--bind", address,
                     "--directory", str(root)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )
        time.sleep(0.5)

    def server_args(self) -> tuple[str, ...]:
        return (
            "--uplink-interface", self.interface,
            "--uplink-gateway", self.GATEWAY,
            "--dns", self.GATEWAY,
        )

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        # Deleting the namespace deletes the veth pair with it.
        subprocess.run(["ip", "netns", "del", self.netns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.interface], check=False, capture_output=True)
        shutil.rmtree(self.web, ignore_errors=True)


class TlsFiles:
    """A test certificate authority and a certificate it signed for 127.0.0.1,
    for cove's HTTPS listener (`serve --tls-listen`), made with openssl. The
    SDK's S3 client trusts only the system's bundle, so code that uploads build
    contexts runs where ``bundle`` (the system's plus this CA) is bind-mounted
    over it, in a mount namespace of its own (``sdk_with_test_ca``)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="cove-tls-"))
        self.cert = self.dir / "server.pem"
        self.key = self.dir / "server.key"
        self.bundle = self.dir / "bundle.pem"
        ca_key, ca_cert = self.dir / "ca.key", self.dir / "ca.pem"
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=cove test CA", "-keyout", str(ca_key), "-out", str(ca_cert))
        csr = self.dir / "server.csr"
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", str(self.key), "-out", str(csr))
        ext = self.dir / "ext.cnf"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        run("openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(self.cert))
        system = Path("/etc/ssl/certs/ca-certificates.crt")
        self.bundle.write_text((system.read_text() if system.exists() else "") + ca_cert.read_text())
        self.port = 0

    def server_args(self) -> tuple[str, ...]:
        self.port = free_port()
        return ("--tls-listen", f"127.0.0.1:{self.port}",
                "--tls-cert", str(self.cert), "--tls-key", str(self.key))

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def sdk_with_test_ca(tls: TlsFiles, script: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs a Python script (SDK code) where the system CA bundle includes the
    test CA: in its own mount namespace, so nothing changes for the host."""
    path = tls.dir / f"script-{uuid.uuid4().hex}.py"
    path.write_text(script)
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         'mount --bind "$0" /etc/ssl/certs/ca-certificates.crt && exec "$1" "$2"',
         str(tls.bundle), sys.executable, str(path)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **env},
    )


def kill_sandbox_processes(sandbox_id: str, parent: str = "cove") -> int:
    """SIGKILL, from the host, to every process of a container whose cgroup
    is `{parent}/{sandbox_id}` (cgroup v1's pids hierarchy, or v2); how
    many there were."""
    pids: list[int] = []
    for path in (
        f"/sys/fs/cgroup/pids/{parent}/{sandbox_id}/cgroup.procs",
        f"/sys/fs/cgroup/{parent}/{sandbox_id}/cgroup.procs",
    ):
        try:
            pids = [int(p) for p in Path(path).read_text().split()]
            break
        except OSError:
            continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def new_data_dir() -> Path:
    # Short: the agent's Unix socket lives under it and sun_path holds 107 bytes.
    return Path(tempfile.mkdtemp(prefix="cv", dir="/tmp"))


def remove_data_dir(path: Path) -> None:
    # The server leaves its sandbox storage (a loop-mounted image) mounted on
    # purpose; a throw-away server's goes with its data dir. Unmounting frees the
    # loop device.
    storage = path / "storage"
    # A VM the server just stopped may still hold a file on it for a moment
    # (EBUSY): try again briefly rather than leave the mount behind.
    for _ in range(50):
        if not any(m == str(storage) for m in mounts_under(path)):
            break
        if subprocess.run(["umount", str(storage)], check=False, capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    if mounts_under(path):
        # Never rmtree through a live mount; leave it for a human to look at.
        return
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.joinpath(f"{path.name}.log").unlink()
    except OSError:
        pass


@pytest.fixture(scope="session")
def fake_internet() -> Iterator[FakeInternet]:
    internet = FakeInternet()
    try:
        internet.start()
        yield internet
    finally:
        internet.stop()


def s3_env(endpoint: str) -> dict[str, str]:
    """The AWS_* variables a server or runner reaches the test's S3 service with."""
    return {
        "AWS_ENDPOINT": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
    }


@pytest.fixture()
def s3() -> Iterator[tuple[str, str]]:
    """An S3-compatible service on loopback (moto in server mode) with one
    bucket: its endpoint and the bucket's name."""
    found = shutil.which("moto_server", path=os.path.dirname(sys.executable))
    if found is None:
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    port = free_port()
    proc = subprocess.Popen(
        [found, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(endpoint, timeout=1)
                break
            except requests.RequestException:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.2)
        bucket = "cove-archive"
        # moto accepts unsigned requests: make the bucket with a plain PUT.
        assert requests.put(f"{endpoint}/{bucket}", timeout=10).status_code == 200
        yield endpoint, bucket
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tls_files() -> Iterator[TlsFiles]:
    files = TlsFiles()
    try:
        yield files
    finally:
        files.remove()


def start_or_remove(server: CoveServer, data_dir: Path) -> None:
    """Starts `server`; one that does not come up (its log is in the error)
    leaves neither its data dir nor its log behind."""
    try:
        server.start()
    except BaseException:
        server.stop()
        remove_data_dir(data_dir)
        raise


@pytest.fixture(scope="session")
def cove(fake_internet: FakeInternet, tls_files: TlsFiles) -> Iterator[CoveServer]:
    data_dir = new_data_dir()
    # Sandbox traffic leaves only into the fake internet, never off this machine.
    server = CoveServer(
        data_dir,
        api_key="cv-" + uuid.uuid4().hex,
        extra_args=(*fake_internet.server_args(), *tls_files.server_args()),
        vms=True,
    )
    start_or_remove(server, data_dir)
    os.environ["DAYTONA_API_URL"] = server.api_url
    os.environ["DAYTONA_API_KEY"] = server.api_key
    try:
        yield server
    finally:
        try:
            if server.proc is not None and server.proc.poll() is None:
                server.delete_all()
        finally:
            code = server.stop()
            failed = code not in (0, None, -signal.SIGTERM)
            if not failed:
                remove_data_dir(data_dir)
            else:
                print(f"\ncove exited with {code}; data dir and log kept at {data_dir}")


@pytest.fixture
def own_server() -> Iterator[CoveServer]:
    """A server of the test's own, without a network (its own would clash with
    the session server's bridge and routes), over a throw-away data dir; a
    test may stop and start it, and whatever it left is deleted."""
    data_dir = new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=("--no-network",))
    start_or_remove(server, data_dir)
    try:
        yield server
    finally:
        if server.proc is None:
            try:
                server.start()
            except Exception:
                pass
        try:
            if server.proc is not None:
                server.delete_all()
        finally:
            server.stop()
            remove_data_dir(data_dir)


@pytest.fixture(scope="session")
def daytona(cove: CoveServer) -> Daytona:
    return cove.client()


class SandboxFactory:
    """Creates sandboxes through the SDK and deletes whatever is left at teardown."""

    def __init__(self, cove: CoveServer, daytona: Daytona):
        self.cove = cove
        self.daytona = daytona
        self.ids: list[str] = []

    def __call__(self, params: CreateSandboxFromSnapshotParams | None = None, **kw) -> Sandbox:
        before = self.cove.sandbox_ids()
        try:
            sandbox = self.daytona.create(params, **kw) if params is not None else self.daytona.create(**kw)
        except Exception:
            # A failed create must not leak, but if it did, clean it up here too.
            self.ids.extend(self.cove.sandbox_ids() - before)
            raise
        self.ids.append(sandbox.id)
        return sandbox

    def track(self, sandbox_id: str) -> None:
        self.ids.append(sandbox_id)

    def cleanup(self) -> None:
        # Newest first: forks go before the parents they keep from deletion.
        for sid in reversed(self.ids):
            try:
                self.cove.request("DELETE", f"/sandbox/{sid}")
            except requests.RequestException:
                pass


@pytest.fixture
def sandboxes(cove: CoveServer, daytona: Daytona) -> Iterator[SandboxFactory]:
    factory = SandboxFactory(cove, daytona)
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture
def sandbox(sandboxes: SandboxFactory) -> Sandbox:
    """One default sandbox for the test."""
    return sandboxes()


VM_SNAPSHOT = "daytona-vm-small"
VM_TIMEOUT = 180
# The classes every toolbox test runs on: the toolbox must behave the same in a
# container and in a VM (where the agent is reached over virtio-serial).
SANDBOX_CLASSES = ["container", "vm"]


def _module_vm(cove: CoveServer, daytona: Daytona, **params) -> Iterator[Sandbox]:
    if vm_assets() is None:
        pytest.skip("COVE_TEST_VM_ASSETS is not set (scripts/vm-assets)")
    factory = SandboxFactory(cove, daytona)
    try:
        yield factory(CreateSandboxFromSnapshotParams(snapshot=VM_SNAPSHOT, **params), timeout=VM_TIMEOUT)
    finally:
        factory.cleanup()


@pytest.fixture(scope="module")
def module_vm(cove: CoveServer, daytona: Daytona) -> Iterator[Sandbox]:
    """One VM sandbox shared by a module's tests: a VM under TCG costs seconds
    to make, so the toolbox tests that leave no conflicting state share one.
    It runs as the default user (`daytona`), as a container does."""
    yield from _module_vm(cove, daytona)


@pytest.fixture(scope="module")
def module_root_vm(cove: CoveServer, daytona: Daytona) -> Iterator[Sandbox]:
    """A module's VM running as root: for what only root may do."""
    yield from _module_vm(cove, daytona, os_user="root")


def sandbox_of_class(request: pytest.FixtureRequest, sandboxes: SandboxFactory) -> Sandbox:
    """For a fixture parametrized over SANDBOX_CLASSES: a fresh container, or
    the module's VM."""
    if request.param == "vm":
        return request.getfixturevalue("module_vm")
    return sandboxes()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def assert_gone(daytona: Daytona, sandbox_id: str) -> None:
    with pytest.raises(DaytonaNotFoundError):
        daytona.get(sandbox_id)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
