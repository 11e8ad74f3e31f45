"""Sandboxes from container images (issue 5): `create(image=...)` pulls from a
registry, `snapshot.create` registers an image, `cove image import` takes an
OCI layout for hosts without a registry, and the SDK's `Image` builder's
Dockerfile is built: RUN in a build sandbox, ENV/WORKDIR/USER/ENTRYPOINT/CMD
in the image's settings, each step cached.

Nothing comes from the internet: the test builds a tiny image itself (a static
busybox, Debian's busybox-static), serves it from Debian's `docker-registry` on
a loopback port and pushes it there with skopeo.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from daytona import (
    CreateSandboxFromImageParams,
    CreateSandboxFromSnapshotParams,
    CreateSnapshotParams,
    DaytonaError,
    DaytonaNotFoundError,
    Image,
)

from conftest import cove_binary, free_port, unique, vm_assets, wait_until

BUSYBOX = Path("/bin/busybox")
APPLETS = ["sh", "echo", "cat", "ls", "env", "sleep", "test", "mkdir", "rm", "id", "pwd"]


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer_tar() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = mode
            tar.addfile(info)

        def add_file(name: str, data: bytes, mode: int = 0o644) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            tar.addfile(info, io.BytesIO(data))

        for d in ["bin", "etc", "root", "proc", "sys", "dev", "run"]:
            add_dir(d)
        add_dir("tmp", 0o1777)
        add_file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type = tarfile.SYMTYPE
            link.linkname = "busybox"
            tar.addfile(link)
        add_file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
        add_file("etc/group", b"root:x:0:\n")
        add_file("etc/image-marker", b"made by test_images\n")
    return out.getvalue()


def write_oci_layout(dest: Path, tag: str) -> None:
    """A one-layer linux/amd64 image as an OCI image layout directory."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> str:
        digest = sha256(data)
        (blobs / digest.split(":")[1]).write_bytes(data)
        return digest

    raw = layer_tar()
    compressed = gzip.compress(raw)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": ["PATH=/bin", "GREETING=from-image"],
                # What every sandbox of the image starts (in its "entrypoint" session).
                "Entrypoint": ["sh", "-c"],
                "Cmd": ["echo started-$((6*7)) > /tmp/entry.txt; exec sleep 1000"],
            },
            "rootfs": {"type": "layers", "diff_ids": [sha256(raw)]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": blob(config),
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": blob(compressed),
                    "size": len(compressed),
                }
            ],
        }
    ).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": blob(manifest),
                "size": len(manifest),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (dest / "index.json").write_text(json.dumps(index))
    (dest / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))


@contextmanager
def local_registry(user: str | None = None, password: str | None = None):
    """A docker-registry on loopback holding cove/busy:v1 (behind htpasswd
    basic auth when given a user); yields (host:port, layout dir)."""
    missing = [t for t in ("docker-registry", "skopeo") if shutil.which(t) is None]
    if user and shutil.which("htpasswd") is None:
        missing.append("htpasswd")
    if missing or not BUSYBOX.is_file():
        pytest.skip(f"needs docker-registry, skopeo, htpasswd and busybox-static (missing: {missing or 'busybox'})")
    work = Path(tempfile.mkdtemp(prefix="cvreg", dir="/tmp"))
    port = free_port()
    auth = ""
    if user:
        subprocess.run(["htpasswd", "-Bbc", str(work / "htpasswd"), user, password], check=True, capture_output=True)
        auth = f"auth:\n  htpasswd:\n    realm: cove-test\n    path: {work / 'htpasswd'}\n"
    (work / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {work / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n" + auth
    )
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(work / "config.yml")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code in (200, 401):
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("docker-registry did not start")
            time.sleep(0.2)
        layout = work / "layout"
        write_oci_layout(layout, "v1")
        host = f"127.0.0.1:{port}"
        creds = ["--dest-creds", f"{user}:{password}"] if user else []
        # busy:v1 for most tests; the same image as pulled:v1, which no test
        # pulls first, so one pull is seen whole.
        for repository in ("busy", "pulled"):
            subprocess.run(
                [
                    "skopeo",
                    "copy",
                    "--quiet",
                    "--dest-tls-verify=false",
                    *creds,
                    f"oci:{layout}:v1",
                    f"docker://{host}/cove/{repository}:v1",
                ],
                check=True,
            )
        yield host, layout
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def registry():
    with local_registry() as found:
        yield found


@pytest.fixture(scope="module")
def private_registry():
    with local_registry("cove", "pull-secret") as found:
        yield found


def test_create_from_a_registry_image_runs_commands_with_its_env(registry, daytona, sandboxes):
    host, _ = registry
    sandbox = sandboxes(CreateSandboxFromImageParams(image=f"{host}/cove/busy:v1"))
    r = sandbox.process.exec("cat /etc/image-marker && echo $GREETING")
    assert r.exit_code == 0, r.result
    assert r.result.split() == ["made", "by", "test_images", "from-image"]
    # The image's ENTRYPOINT and CMD run, in the "entrypoint" session.
    assert wait_until(lambda: sandbox.process.exec("cat /tmp/entry.txt").result.strip() == "started-42", 30)
    assert "sleep 1000" in sandbox.process.get_session("entrypoint").commands[0].command
    # Files move in and out as in any sandbox.
    sandbox.fs.upload_file(b"hello", "/tmp/x.txt")
    assert sandbox.fs.download_file("/tmp/x.txt") == b"hello"


def test_snapshot_create_from_an_image_then_create_by_name(registry, daytona, sandboxes, cove):
    host, _ = registry
    snap = daytona.snapshot.create(CreateSnapshotParams(name="busy-snap", image=f"{host}/cove/busy:v1"))
    try:
        assert snap.state == "active"
        sandbox = sandboxes(CreateSandboxFromSnapshotParams(snapshot="busy-snap"))
        assert sandbox.process.exec("cat /etc/image-marker").result.strip() == "made by test_images"
        daytona.delete(sandbox)
    finally:
        cove.request("DELETE", "/snapshots/busy-snap")


@pytest.mark.skipif(vm_assets() is None, reason="COVE_TEST_VM_ASSETS is not set (scripts/vm-assets)")
def test_a_registry_image_makes_vm_sandboxes_too(registry, daytona, sandboxes, cove):
    host, _ = registry
    name = unique("busy-vm")
    reply = cove.request(
        "POST", "/snapshots", json={"name": name, "imageName": f"{host}/cove/busy:v1", "sandboxClass": "linux-vm"}
    )
    assert reply.status_code in (200, 201), reply.text
    try:
        assert wait_until(lambda: cove.request("GET", f"/snapshots/{name}").json()["state"] == "active", 60)
        sandbox = sandboxes(CreateSandboxFromSnapshotParams(snapshot=name), timeout=180)
        # Its own kernel, the image's files and environment, and its entrypoint.
        assert sandbox.process.exec("cat /proc/version").result.strip() != Path("/proc/version").read_text().strip()
        r = sandbox.process.exec("cat /etc/image-marker && echo $GREETING")
        assert r.result.split() == ["made", "by", "test_images", "from-image"], r.result
        assert wait_until(lambda: sandbox.process.exec("cat /tmp/entry.txt").result.strip() == "started-42", 60)
        daytona.delete(sandbox)
    finally:
        cove.request("DELETE", f"/snapshots/{name}")


@pytest.mark.skipif(vm_assets() is None, reason="COVE_TEST_VM_ASSETS is not set (scripts/vm-assets)")
def test_a_dockerfile_image_makes_vm_sandboxes_too(daytona, sandboxes, cove):
    # Built in containers, then flattened into one tree for the VM's disk:
    # what RUN wrote is there, what it removed is gone (a whiteout applied).
    name = unique("built-vm")
    dockerfile = (
        "FROM cove-default\n"
        "RUN echo vm-built > /built.txt && rm /etc/issue\n"
        "ENV BUILT=yes\n"
    )
    reply = cove.request(
        "POST",
        "/snapshots",
        json={"name": name, "buildInfo": {"dockerfileContent": dockerfile}, "sandboxClass": "linux-vm"},
    )
    assert reply.status_code in (200, 201), reply.text
    try:
        assert wait_until(lambda: cove.request("GET", f"/snapshots/{name}").json()["state"] != "building", 120)
        snapshot = cove.request("GET", f"/snapshots/{name}").json()
        assert snapshot["state"] == "active", snapshot
        logs = cove.request("GET", f"/snapshots/{name}/build-logs").text
        assert "flattening the layers for a VM's disk" in logs, logs
        sandbox = sandboxes(CreateSandboxFromSnapshotParams(snapshot=name), timeout=180)
        assert sandbox.process.exec("cat /proc/version").result.strip() != Path("/proc/version").read_text().strip()
        r = sandbox.process.exec("cat /built.txt; test -e /etc/issue && echo issue-still-there; echo $BUILT")
        assert r.result.split() == ["vm-built", "yes"], r.result
        daytona.delete(sandbox)
    finally:
        cove.request("DELETE", f"/snapshots/{name}")


def test_image_builder_env_is_applied_and_unsupported_instructions_are_refused_by_name(
    registry, sandboxes, cove
):
    host, _ = registry
    image = Image.base(f"{host}/cove/busy:v1").env({"BUILT": "yes"})
    sandbox = sandboxes(CreateSandboxFromImageParams(image=image))
    assert sandbox.process.exec("echo $BUILT $GREETING").result.strip() == "yes from-image"

    before = cove.sandbox_ids()
    with pytest.raises(DaytonaError) as info:
        sandboxes(
            CreateSandboxFromImageParams(image=Image.base(f"{host}/cove/busy:v1").dockerfile_commands(["VOLUME /data"]))
        )
    assert info.value.status_code == 501
    assert "VOLUME" in str(info.value)
    assert cove.sandbox_ids() == before


def test_run_steps_build_layers_and_the_image_settings_reach_sandboxes(daytona, sandboxes, cove):
    """FROM the server's own Debian image (nothing from the network)."""
    name = unique("built")
    image = (
        Image.base("cove-default")
        .run_commands("echo hi > /built.txt")
        .dockerfile_commands(['RUN ["/bin/sh", "-c", "echo exec-form > /argv.txt"]'])
        .env({"BUILT": "yes"})
        .dockerfile_commands(["ENV WHERE=${BUILT}-two", "USER nobody"])
        .workdir("/srv/work")
        .run_commands("id -un > who.txt")
        .entrypoint(["/bin/sh", "-c"])
        .cmd(["echo entry-$((40+2)) > /tmp/entry.txt; exec sleep infinity"])
    )
    logs: list[str] = []
    snap = daytona.snapshot.create(CreateSnapshotParams(name=name, image=image), on_logs=logs.append)
    try:
        assert snap.state == "active"
        text = "\n".join(logs)
        assert "RUN echo hi > /built.txt" in text and "build complete" in text, text
        assert daytona.snapshot.get(name).entrypoint == [
            "/bin/sh",
            "-c",
            "echo entry-$((40+2)) > /tmp/entry.txt; exec sleep infinity",
        ]

        sandbox = sandboxes(CreateSandboxFromSnapshotParams(snapshot=name))
        r = sandbox.process.exec("cat /built.txt /argv.txt; pwd; echo $BUILT $WHERE; id -un; cat who.txt")
        assert r.exit_code == 0, r.result
        assert r.result.split() == ["hi", "exec-form", "/srv/work", "yes", "yes-two", "nobody", "nobody"]
        assert sandbox.get_work_dir() == "/srv/work"
        # The sandbox runs as the image's user: root's files stay root's.
        assert sandbox.process.exec("touch /etc/nope").exit_code != 0
        # ENTRYPOINT and CMD run at start, as that user, in the "entrypoint" session.
        assert wait_until(lambda: sandbox.process.exec("cat /tmp/entry.txt").result.strip() == "entry-42", 30)
        assert sandbox.process.exec("stat -c %U /tmp/entry.txt").result.strip() == "nobody"
        entry = sandbox.process.get_session("entrypoint")
        assert len(entry.commands) == 1 and "sleep infinity" in entry.commands[0].command
        assert entry.commands[0].exit_code is None
        # Again after a stop and a start.
        sandbox.process.exec("rm /tmp/entry.txt")
        sandbox.stop()
        sandbox.start()
        assert wait_until(lambda: sandbox.process.exec("cat /tmp/entry.txt").result.strip() == "entry-42", 30)

        # The same Dockerfile with one more step reuses the layers built above.
        again: list[str] = []
        name2 = unique("built")
        snap2 = daytona.snapshot.create(
            CreateSnapshotParams(name=name2, image=image.run_commands("echo more > more.txt")),
            on_logs=again.append,
        )
        try:
            assert snap2.state == "active"
            assert "\n".join(again).count("using cache") == 4, again
            sandbox2 = sandboxes(CreateSandboxFromSnapshotParams(snapshot=name2))
            assert sandbox2.process.exec("cat /built.txt more.txt").result.split() == ["hi", "more"]
            daytona.delete(sandbox2)
        finally:
            cove.request("DELETE", f"/snapshots/{name2}")
        daytona.delete(sandbox)
    finally:
        cove.request("DELETE", f"/snapshots/{name}")


def test_a_sandbox_from_an_image_with_run_steps_is_built_first(sandboxes):
    image = Image.base("cove-default").run_commands("echo direct > /direct.txt").workdir("/opt/app")
    sandbox = sandboxes(CreateSandboxFromImageParams(image=image))
    r = sandbox.process.exec("cat /direct.txt; pwd")
    assert r.result.split() == ["direct", "/opt/app"], r.result


def test_a_failing_run_fails_the_snapshot_with_its_exit_code_and_output(daytona, cove, sandboxes):
    name = unique("doomed")
    image = Image.base("cove-default").run_commands("echo about to fail; exit 3")
    try:
        with pytest.raises(DaytonaError) as info:
            daytona.snapshot.create(CreateSnapshotParams(name=name, image=image))
        message = str(info.value)
        assert "exit 3" in message and "code 3" in message and "about to fail" in message, message
        got = cove.request("GET", f"/snapshots/{name}").json()
        assert got["state"] == "error"
        logs = cove.request("GET", f"/snapshots/{got['id']}/build-logs").text
        assert "about to fail" in logs and "code 3" in logs, logs
        before = cove.sandbox_ids()
        with pytest.raises(DaytonaError) as info:
            sandboxes(CreateSandboxFromSnapshotParams(snapshot=name))
        assert info.value.status_code == 400 and "error" in str(info.value)
        assert cove.sandbox_ids() == before
    finally:
        cove.request("DELETE", f"/snapshots/{name}")

    # Creating a sandbox straight from it answers the same reason, and leaves nothing.
    before = cove.sandbox_ids()
    with pytest.raises(DaytonaError) as info:
        sandboxes(CreateSandboxFromImageParams(image=Image.base("cove-default").run_commands("exit 7")))
    assert info.value.status_code == 400 and "code 7" in str(info.value)
    assert cove.sandbox_ids() == before


def test_unsupported_instructions_fail_the_snapshot_with_logs_naming_them(daytona, cove):
    name = unique("nocopy")
    try:
        with pytest.raises(DaytonaError) as info:
            daytona.snapshot.create(
                CreateSnapshotParams(name=name, image=Image.base("cove-default").dockerfile_commands(["SHELL [\"/bin/bash\"]"]))
            )
        assert "SHELL" in str(info.value)
        got = cove.request("GET", f"/snapshots/{name}").json()
        assert got["state"] == "error" and "SHELL" in got["errorReason"]
        assert "SHELL" in cove.request("GET", f"/snapshots/{name}/build-logs").text
    finally:
        cove.request("DELETE", f"/snapshots/{name}")
    # A malformed Dockerfile is refused at once, and nothing is registered.
    r = cove.request(
        "POST", "/snapshots", json={"name": name, "buildInfo": {"dockerfileContent": "RUN true\n"}}
    )
    assert r.status_code == 400 and "FROM" in r.json()["message"]
    assert cove.request("GET", f"/snapshots/{name}").status_code == 404


def test_snapshots_deactivate_and_activate(daytona, cove, sandboxes, registry):
    host, _ = registry
    name = unique("toggle")
    daytona.snapshot.create(CreateSnapshotParams(name=name, image=f"{host}/cove/busy:v1"))
    try:
        assert cove.request("POST", f"/snapshots/{name}/deactivate").status_code == 204
        assert daytona.snapshot.get(name).state == "inactive"
        with pytest.raises(DaytonaError) as info:
            sandboxes(CreateSandboxFromSnapshotParams(snapshot=name))
        assert info.value.status_code == 400 and "activate" in str(info.value)
        assert daytona.snapshot.activate(name).state == "active"
        sandbox = sandboxes(CreateSandboxFromSnapshotParams(snapshot=name))
        assert sandbox.process.exec("echo $GREETING").result.strip() == "from-image"
        daytona.delete(sandbox)
    finally:
        cove.request("DELETE", f"/snapshots/{name}")


def test_unknown_image_is_a_clear_404_and_leaves_nothing(registry, sandboxes, cove):
    host, _ = registry
    before = cove.sandbox_ids()
    with pytest.raises(DaytonaNotFoundError) as info:
        sandboxes(CreateSandboxFromImageParams(image=f"{host}/cove/busy:nope"))
    assert "busy:nope" in str(info.value)
    assert cove.sandbox_ids() == before


def cove_cli(cove, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(cove_binary()), *args, "--url", cove.api_url, "--api-key", cove.api_key],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cove_image_pull_follows_the_pull_in_its_build_log(registry, sandboxes, cove):
    host, _ = registry
    name = unique("pulled")
    result = cove_cli(cove, "image", "pull", f"{host}/cove/pulled:v1", "--name", name)
    try:
        assert result.returncode == 0, result.stderr
        assert f"snapshot {name}" in result.stdout and "active" in result.stdout, result.stdout
        # Not a terminal here: the log's lines without the byte counts.
        assert f"resolving {host}/cove/pulled:v1" in result.stderr, result.stderr
        assert "1 layers" in result.stderr and "ready" in result.stderr, result.stderr
        # The same log through the API, byte counts included.
        logs = cove.request("GET", f"/snapshots/{name}/build-logs").text
        assert "resolving" in logs and "ready" in logs, logs
        sandbox = sandboxes(CreateSandboxFromSnapshotParams(snapshot=name))
        assert sandbox.process.exec("cat /etc/image-marker").result.strip() == "made by test_images"
        cove.request("DELETE", f"/sandbox/{sandbox.id}")
    finally:
        cove.request("DELETE", f"/snapshots/{name}")

    # An unknown image: a 404 naming it, at once, and nothing registered.
    missing = unique("missing")
    reply = cove.request("POST", "/snapshots", json={"name": missing, "imageName": f"{host}/cove/pulled:nope"})
    assert reply.status_code == 404, reply.text
    assert "pulled:nope" in reply.json()["message"]
    assert cove.request("GET", f"/snapshots/{missing}").status_code == 404
    result = cove_cli(cove, "image", "pull", f"{host}/cove/pulled:nope", "--name", missing)
    assert result.returncode != 0 and "pulled:nope" in result.stderr, result.stderr


def test_cove_image_import_registers_an_oci_layout(registry, sandboxes, cove):
    _, layout = registry
    result = subprocess.run(
        [
            str(cove_binary()),
            "image",
            "import",
            str(layout),
            "--name",
            "busy-imported",
            "--url",
            cove.api_url,
            "--api-key",
            cove.api_key,
            # The server reads imports only from its import directory, where
            # the CLI puts the file.
            "--import-dir",
            str(cove.data_dir / "import"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "busy-imported" in result.stdout and "active" in result.stdout, result.stdout
    try:
        sandbox = sandboxes(CreateSandboxFromSnapshotParams(snapshot="busy-imported"))
        assert sandbox.process.exec("echo $GREETING").result.strip() == "from-image"
        cove.request("DELETE", f"/sandbox/{sandbox.id}")
    finally:
        cove.request("DELETE", "/snapshots/busy-imported")


def test_docker_registry_credentials_are_used_for_pulls_from_their_host(private_registry, daytona, sandboxes, cove):
    host, _ = private_registry
    image = f"{host}/cove/busy:v1"
    before = cove.sandbox_ids()
    # Without credentials the registry refuses, and the answer says so.
    with pytest.raises(DaytonaError) as info:
        sandboxes(CreateSandboxFromImageParams(image=image))
    assert "busy" in str(info.value) and info.value.status_code in (400, 401, 403), str(info.value)
    assert cove.sandbox_ids() == before

    r = cove.request(
        "POST",
        "/docker-registry",
        json={"name": "private", "url": f"http://{host}", "username": "cove", "password": "wrong"},
    )
    assert r.status_code == 201, r.text
    registry_id = r.json()["id"]
    try:
        assert "wrong" not in cove.request("GET", "/docker-registry").text
        with pytest.raises(DaytonaError):
            sandboxes(CreateSandboxFromImageParams(image=image))
        # The right password, by update; the listing still never shows it.
        r = cove.request(
            "PATCH",
            f"/docker-registry/{registry_id}",
            json={"name": "private", "url": host, "username": "cove", "password": "pull-secret"},
        )
        assert r.status_code == 200, r.text
        assert "pull-secret" not in cove.request("GET", f"/docker-registry/{registry_id}").text
        sandbox = sandboxes(CreateSandboxFromImageParams(image=image))
        assert sandbox.process.exec("cat /etc/image-marker").result.strip() == "made by test_images"
        daytona.delete(sandbox)
    finally:
        assert cove.request("DELETE", f"/docker-registry/{registry_id}").status_code == 204
    assert cove.request("GET", f"/docker-registry/{registry_id}").status_code == 404
