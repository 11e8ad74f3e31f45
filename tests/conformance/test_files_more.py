"""sandbox.fs beyond transfers, through the SDK: move, permissions, search, find,
replace, list depth, large streamed transfers, the cove watch WebSocket, and the
info calls (ports, latest metrics, update_env)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time

import aiohttp
import pytest
from daytona import (
    DaytonaBadRequestError,
    DaytonaConflictError,
    CreateSandboxFromSnapshotParams,
    DaytonaError,
    DaytonaFileAccessDeniedError,
    DaytonaFileNotFoundError,
    DaytonaNotFoundError,
)
from daytona_api_client import CreateSandbox
from daytona_toolbox_api_client import PortApi

from conftest import SANDBOX_CLASSES, sandbox_of_class

@pytest.fixture(params=SANDBOX_CLASSES)
def sandbox(request, sandboxes):
    """A fresh container, or this module's VM: every test runs on both."""
    return sandbox_of_class(request, sandboxes)


@pytest.fixture(params=SANDBOX_CLASSES)
def root_sandbox(request, sandboxes):
    """A fresh container or a module's VM, running as root: for what only
    root may do to files of the image or of others."""
    if request.param == "vm":
        return request.getfixturevalue("module_root_vm")
    return sandboxes(CreateSandboxFromSnapshotParams(os_user="root"))


def write(sandbox, files: dict[str, str]) -> None:
    for path, text in files.items():
        sandbox.fs.upload_file(text.encode(), path)


def test_move_files_renames_and_refuses_conflicts(root_sandbox):
    sandbox = root_sandbox
    write(sandbox, {"/tmp/mv/src/a.txt": "a", "/tmp/mv/b.txt": "b"})
    sandbox.fs.move_files("/tmp/mv/src", "/tmp/mv/dst")
    assert sandbox.fs.download_file("/tmp/mv/dst/a.txt") == b"a"
    with pytest.raises(DaytonaConflictError):
        sandbox.fs.move_files("/tmp/mv/b.txt", "/tmp/mv/dst")
    with pytest.raises(DaytonaNotFoundError) as missing:
        sandbox.fs.move_files("/tmp/mv/nope.txt", "/tmp/mv/x.txt")
    assert "/tmp/mv/nope.txt" in str(missing.value)
    # A directory of the image (overlayfs lower layer) moves too.
    sandbox.fs.move_files("/etc/apt", "/tmp/mv/apt")
    assert any(f.name == "sources.list.d" for f in sandbox.fs.list_files("/tmp/mv/apt"))


def test_set_file_permissions_changes_mode_and_owner(root_sandbox):
    sandbox = root_sandbox
    write(sandbox, {"/tmp/perm/run.sh": "#!/bin/sh\necho ran\n"})
    sandbox.fs.set_file_permissions("/tmp/perm/run.sh", mode="750")
    info = sandbox.fs.get_file_info("/tmp/perm/run.sh")
    assert info.permissions == "0750"
    assert sandbox.process.exec("/tmp/perm/run.sh").result.strip() == "ran"
    sandbox.fs.set_file_permissions("/tmp/perm/run.sh", owner="nobody", group="nogroup")
    info = sandbox.fs.get_file_info("/tmp/perm/run.sh")
    assert (info.owner, info.group) == ("nobody", "nogroup")
    with pytest.raises(DaytonaBadRequestError):
        sandbox.fs.set_file_permissions("/tmp/perm/run.sh", mode="9x")
    with pytest.raises(DaytonaFileNotFoundError):
        sandbox.fs.set_file_permissions("/tmp/perm/gone", mode="644")


def test_the_default_user_may_not_give_its_files_away(sandboxes):
    sandbox = sandboxes()
    write(sandbox, {"mine.txt": "x"})
    sandbox.fs.set_file_permissions("mine.txt", mode="600")
    assert sandbox.fs.get_file_info("mine.txt").permissions == "0600"
    with pytest.raises(DaytonaFileAccessDeniedError):
        sandbox.fs.set_file_permissions("mine.txt", owner="nobody")
    assert sandbox.fs.get_file_info("mine.txt").owner == "daytona"
    # Nor move what belongs to root.
    with pytest.raises(DaytonaFileAccessDeniedError):
        sandbox.fs.move_files("/etc/apt", "/tmp/apt")


TREE = {
    "/tmp/proj/main.py": "import os\nprint('TODO: hello')\n",
    "/tmp/proj/src/lib.rs": "// TODO: write\nfn main() {}\n",
    "/tmp/proj/src/deep/util.py": "x = 1\n# TODO: more\n",
    "/tmp/proj/README.md": "nothing to do\n",
}


def test_search_files_by_glob(sandbox):
    write(sandbox, TREE)
    found = sandbox.fs.search_files("/tmp/proj", "*.py")
    assert found.files == ["/tmp/proj/main.py", "/tmp/proj/src/deep/util.py"]
    found = sandbox.fs.search_files("/tmp/proj", "src/**/*.{rs,py}")
    assert found.files == ["/tmp/proj/src/deep/util.py", "/tmp/proj/src/lib.rs"]
    assert sandbox.fs.search_files("/tmp/proj", "*.none").files == []
    with pytest.raises(DaytonaNotFoundError):
        sandbox.fs.search_files("/tmp/no-such-dir", "*")


def test_find_files_by_content(sandbox):
    write(sandbox, TREE)
    sandbox.process.exec("printf 'TODO: \\000bin' > /tmp/proj/blob.bin")
    matches = sandbox.fs.find_files("/tmp/proj", "TODO:")
    got = [(m.file, m.line, m.content) for m in matches]
    assert got == [
        ("/tmp/proj/main.py", 2, "print('TODO: hello')"),
        ("/tmp/proj/src/deep/util.py", 2, "# TODO: more"),
        ("/tmp/proj/src/lib.rs", 1, "// TODO: write"),
    ]
    # Searching the whole root neither hangs in /proc nor fails.
    started = time.monotonic()
    matches = sandbox.fs.find_files("/tmp", "print('TODO")
    assert [m.file for m in matches] == ["/tmp/proj/main.py"]
    assert time.monotonic() - started < 30


def test_replace_in_files_reports_each_file(sandbox):
    write(sandbox, {"/tmp/rep/a.conf": "host=old\nbackup=old\n", "/tmp/rep/b.conf": "clean\n"})
    sandbox.fs.set_file_permissions("/tmp/rep/a.conf", mode="640")
    results = sandbox.fs.replace_in_files(
        ["/tmp/rep/a.conf", "/tmp/rep/b.conf", "/tmp/rep/missing.conf"], "old", "new"
    )
    assert [(r.file, r.success) for r in results] == [
        ("/tmp/rep/a.conf", True),
        ("/tmp/rep/b.conf", True),
        ("/tmp/rep/missing.conf", False),
    ]
    assert "/tmp/rep/missing.conf" in results[2].error
    assert sandbox.fs.download_file("/tmp/rep/a.conf") == b"host=new\nbackup=new\n"
    assert sandbox.fs.get_file_info("/tmp/rep/a.conf").permissions == "0640"


def test_list_files_with_depth(sandbox):
    write(sandbox, TREE)
    shallow = {f.path for f in sandbox.fs.list_files("/tmp/proj")}
    assert "/tmp/proj/src" in shallow and "/tmp/proj/src/lib.rs" not in shallow
    deep = {f.path for f in sandbox.fs.list_files("/tmp/proj", depth=3)}
    assert {"/tmp/proj/src/lib.rs", "/tmp/proj/src/deep/util.py"} <= deep
    with pytest.raises(DaytonaError):
        sandbox.fs.list_files("/tmp/proj", depth=0)


def test_large_file_streams_both_ways(sandbox, tmp_path):
    size = 96 * 1024 * 1024
    local = tmp_path / "big.bin"
    digest = hashlib.sha256()
    with open(local, "wb") as f:
        block = os.urandom(1024 * 1024)
        for i in range(size // len(block)):
            chunk = block[i % 7 :] + block[: i % 7]
            digest.update(chunk)
            f.write(chunk)
    sandbox.fs.upload_file(str(local), "/tmp/big.bin")
    remote = sandbox.process.exec("sha256sum /tmp/big.bin").result.split()[0]
    assert remote == digest.hexdigest()
    back = hashlib.sha256()
    received = 0
    for chunk in sandbox.fs.download_file_stream("/tmp/big.bin"):
        back.update(chunk)
        received += len(chunk)
    assert received == size
    assert back.hexdigest() == digest.hexdigest()


def toolbox_ws_url(cove, sandbox, path: str) -> str:
    return f"{cove.base_url.replace('http://', 'ws://')}/toolbox/{sandbox.id}{path}"


def test_watch_streams_inotify_events_over_the_proxy(cove, sandbox):
    sandbox.fs.create_folder("/tmp/w", "755")

    async def watch() -> list[dict]:
        headers = {"Authorization": f"Bearer {cove.api_key}"}
        url = toolbox_ws_url(cove, sandbox, "/files/watch?path=/tmp/w&recursive=true")
        events: list[dict] = []
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(url, headers=headers) as ws:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(
                    None,
                    lambda: sandbox.process.exec(
                        "mkdir /tmp/w/d && echo hi > /tmp/w/d/f.txt && mv /tmp/w/d/f.txt /tmp/w/g.txt && rm /tmp/w/g.txt"
                    ),
                )
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    message = await ws.receive(timeout=max(0.1, deadline - time.monotonic()))
                    if message.type != aiohttp.WSMsgType.TEXT:
                        break
                    events.append(json.loads(message.data))
                    if events[-1]["type"] == "delete" and events[-1]["path"] == "/tmp/w/g.txt":
                        break
                await ws.close()
        return events

    events = asyncio.run(watch())
    kinds = [(e["type"], e["path"]) for e in events if e["type"] != "modify"]
    assert kinds[0] == ("create", "/tmp/w/d")
    assert ("create", "/tmp/w/d/f.txt") in kinds
    rename = next(e for e in events if e["type"] == "rename")
    assert rename == {"type": "rename", "path": "/tmp/w/g.txt", "oldPath": "/tmp/w/d/f.txt", "isDir": False}
    assert kinds[-1] == ("delete", "/tmp/w/g.txt")


def test_ports_show_what_listens_in_the_sandbox(sandbox):
    sandbox.process.exec(
        "nohup python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 & "
        "for i in $(seq 50); do grep -q ':223D ' /proc/net/tcp && break; sleep 0.1; done"
    )
    ports = PortApi(sandbox._toolbox_api)
    assert 8765 in ports.get_ports().ports
    assert ports.is_port_in_use(8765).is_in_use is True
    assert ports.is_port_in_use(8766).is_in_use is False


def test_latest_metrics_describe_the_sandbox(sandbox):
    metrics = sandbox.get_metrics_latest()
    # The sandbox's own resources (a VM's kernel keeps some memory and its
    # filesystem some blocks for itself), not the host's.
    assert metrics.cpu_count == sandbox.cpu
    assert 0.8 * sandbox.memory * 1024**3 <= metrics.mem_total <= sandbox.memory * 1024**3
    assert 0.85 * sandbox.disk * 1024**3 <= metrics.disk_total <= sandbox.disk * 1024**3
    assert 0.0 <= metrics.cpu_used_pct <= 100.0
    assert 0 < metrics.mem_used <= metrics.mem_total
    # A container's disk is its quota group, counted at each btrfs commit: a
    # sandbox that wrote nothing yet may read 0.
    assert 0 <= metrics.disk_used <= metrics.disk_total


def test_metrics_are_the_sandbox_limits_not_the_hosts(daytona, sandboxes):
    # Resources go through the generated client (the SDK sends them only with
    # an image build), as in test_lifecycle.
    dto = daytona._sandbox_api.create_sandbox(CreateSandbox(cpu=1, memory=1, disk=3))
    sandboxes.track(dto.id)
    sandbox = daytona.get(dto.id)
    before = sandbox.get_metrics_latest()
    assert before.cpu_count == 1
    assert before.mem_total == 1024**3
    assert before.disk_total == 3 * 1024**3
    assert 0 < before.mem_used < before.mem_total
    sandbox.process.exec("head -c 64000000 /dev/urandom > fill.bin && sync")
    after = sandbox.get_metrics_latest()
    # The quota group counts what the sandbox wrote.
    assert after.disk_used - before.disk_used >= 60_000_000
    # Its own cgroup, bound read-only; nothing of the host's other cgroups.
    limit = "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max"
    assert sandbox.process.exec(limit).result.strip() == str(1024**3)
    assert sandbox.process.exec("test ! -e /sys/fs/cgroup/memory/cove && test ! -e /sys/fs/cgroup/cove").exit_code == 0
    assert sandbox.process.exec("touch /sys/fs/cgroup/memory/x || touch /sys/fs/cgroup/x").exit_code != 0


def test_update_env_reaches_new_processes(sandbox):
    sandbox.update_env({"CONF_GREETING": "hello"})
    assert sandbox.process.exec("echo $CONF_GREETING").result.strip() == "hello"
    sandbox.update_env({}, unset=["CONF_GREETING"])
    assert sandbox.process.exec("echo ${CONF_GREETING-unset}").result.strip() == "unset"
