"""Two sandboxes see neither each other nor the host."""

from __future__ import annotations

import os
import uuid

import pytest
from daytona import SessionExecuteRequest


@pytest.fixture
def pair(sandboxes):
    return sandboxes(), sandboxes()


def test_files_are_not_shared(pair):
    a, b = pair
    marker = uuid.uuid4().hex
    a.fs.upload_file(marker.encode(), f"/tmp/only-in-a-{marker}")
    a.process.exec(f"echo {marker} > /root/a-{marker}")
    assert a.process.exec(f"cat /tmp/only-in-a-{marker}").result == marker

    found = b.process.exec(f"ls /tmp /root; grep -rl {marker} /tmp /root /home 2>/dev/null; true")
    assert marker not in found.result
    assert b.process.exec(f"test -e /tmp/only-in-a-{marker}").exit_code == 1


def test_processes_are_not_shared(pair):
    a, b = pair
    session = "iso-" + uuid.uuid4().hex[:8]
    a.process.create_session(session)
    a.process.execute_session_command(session, SessionExecuteRequest(command="sleep 1234", run_async=True))
    assert "sleep 1234" in a.process.exec("ps aux").result

    ps_b = b.process.exec("ps aux").result
    assert "sleep 1234" not in ps_b
    # B sees only its own few processes, not the host's.
    assert len(ps_b.strip().splitlines()) < 20, ps_b


def test_host_files_are_not_visible(sandbox):
    marker = f"/tmp/cove-host-marker-{uuid.uuid4().hex}"
    with open(marker, "w") as f:
        f.write("host secret")
    try:
        assert sandbox.process.exec(f"test -e {marker}").exit_code == 1
        assert "host secret" not in sandbox.process.exec(f"cat {marker} 2>&1; true").result
    finally:
        os.unlink(marker)


def test_hostnames_differ(pair):
    a, b = pair
    host_a = a.process.exec("hostname").result.strip()
    host_b = b.process.exec("hostname").result.strip()
    assert host_a and host_b
    assert host_a != host_b
    assert os.uname().nodename not in (host_a, host_b)


def test_pid_1_is_the_sandbox_init(sandbox):
    inside = sandbox.process.exec("cat /proc/1/cmdline | tr '\\0' ' '").result.strip()
    with open("/proc/1/cmdline", "rb") as f:
        host = f.read().replace(b"\0", b" ").decode().strip()
    assert inside, "empty /proc/1/cmdline inside the sandbox"
    assert inside != host
    assert "cove" in inside or "init" in inside, inside


@pytest.mark.parametrize("ns", ["pid", "mnt", "uts", "ipc", "net"])
def test_own_namespaces(sandbox, ns):
    inside = sandbox.process.exec(f"readlink /proc/self/ns/{ns}").result.strip()
    assert inside.startswith(f"{ns}:["), inside
    assert inside != os.readlink(f"/proc/self/ns/{ns}")
