"""Filesystem snapshots through the SDK: seed 000's cold snapshot, live snapshots
of running sandboxes, revert (a cove extension), and the registry."""

from __future__ import annotations

import pytest
from daytona import (
    CreateSandboxFromSnapshotParams,
    DaytonaConflictError,
    DaytonaNotFoundError,
    SessionExecuteRequest,
)

from conftest import unique


@pytest.fixture
def snapshot_names(sandboxes, daytona):
    """Names of snapshots the test made; deleted after the test's sandboxes."""
    names: list[str] = []
    yield names
    sandboxes.cleanup()
    for name in reversed(names):
        try:
            daytona.snapshot.delete(daytona.snapshot.get(name))
        except DaytonaNotFoundError:
            pass


def test_seed_000_cold_snapshot(sandboxes, daytona, snapshot_names):
    sandbox = sandboxes()
    sandbox.fs.upload_file(b"done", "setup.log")
    sandbox.stop()
    name = unique("snap")
    sandbox.create_snapshot(name)
    snapshot_names.append(name)
    assert sandbox.state.value == "stopped"

    new_sandbox = sandboxes(CreateSandboxFromSnapshotParams(snapshot=name))
    assert new_sandbox.fs.download_file("setup.log").decode() == "done"
    # Independent copies: a change in the new one does not reach the source.
    new_sandbox.fs.upload_file(b"changed", "setup.log")
    sandbox.start()
    assert sandbox.fs.download_file("setup.log") == b"done"

    listed = daytona.snapshot.get(name)
    assert listed.name == name
    assert listed.state.value == "active"
    assert name in [s.name for s in daytona.snapshot.list().items]


def test_live_snapshot_keeps_the_sandbox_running_and_revert_rewinds(cove, sandboxes, snapshot_names):
    sandbox = sandboxes()
    session = unique("s")
    sandbox.process.create_session(session)
    sandbox.process.execute_session_command(session, SessionExecuteRequest(command="sleep 300", run_async=True))
    sandbox.fs.upload_file(b"v1", "state.txt")
    name = unique("live")
    sandbox.create_snapshot(name)
    snapshot_names.append(name)
    assert sandbox.state.value == "started"
    # The machine kept running through the snapshot.
    assert "sleep 300" in sandbox.process.exec("ps -eo args").result

    sandbox.fs.upload_file(b"v2", "state.txt")
    sandbox.process.exec("touch added-later")
    reply = cove.request("POST", f"/sandbox/{sandbox.id}/revert", json={"snapshot": name})
    assert reply.status_code == 200, reply.text
    assert reply.json()["state"] == "started"
    assert sandbox.fs.download_file("state.txt") == b"v1"
    assert sandbox.process.exec("test -e added-later").exit_code == 1


def test_snapshots_stack(sandboxes, snapshot_names):
    first = sandboxes()
    first.fs.upload_file(b"one", "one")
    a = unique("a")
    first.create_snapshot(a)
    snapshot_names.append(a)
    second = sandboxes(CreateSandboxFromSnapshotParams(snapshot=a))
    second.fs.upload_file(b"two", "two")
    second.process.exec("rm one")
    b = unique("b")
    second.create_snapshot(b)
    snapshot_names.append(b)
    third = sandboxes(CreateSandboxFromSnapshotParams(snapshot=b))
    assert third.fs.download_file("two") == b"two"
    # A deletion in a middle layer stays deleted.
    assert third.process.exec("test -e one").exit_code == 1


def test_snapshot_rules(cove, sandboxes, daytona, snapshot_names):
    sandbox = sandboxes()
    name = unique("rules")
    sandbox.create_snapshot(name)
    snapshot_names.append(name)
    # Names are unique.
    with pytest.raises(DaytonaConflictError, match=name):
        sandbox.create_snapshot(name)
    # Containers have no memory to capture.
    reply = cove.request("POST", f"/sandbox/{sandbox.id}/snapshot", json={"name": unique("m"), "includeMemory": True})
    assert reply.status_code == 400
    assert "memory" in reply.json()["message"]
    # A snapshot in use by a sandbox cannot be deleted, and the refusal names the user.
    user = sandboxes(CreateSandboxFromSnapshotParams(snapshot=name))
    with pytest.raises(DaytonaConflictError, match=user.id):
        daytona.snapshot.delete(daytona.snapshot.get(name))
    # Revert only to the sandbox's own snapshots.
    reply = cove.request("POST", f"/sandbox/{user.id}/revert", json={"snapshot": name})
    assert reply.status_code == 400
    assert "not taken from" in reply.json()["message"]
    reply = cove.request("POST", f"/sandbox/{user.id}/revert", json={"snapshot": "no-such-snapshot"})
    assert reply.status_code == 404
    assert "no-such-snapshot" in reply.json()["message"]
    # The server's own image is not deletable.
    default = cove.request("GET", "/snapshots/cove-default")
    assert default.status_code == 200 and default.json()["general"] is True
    assert cove.request("DELETE", "/snapshots/cove-default").status_code == 400
    assert cove.request("GET", "/snapshots/no-such-snapshot").status_code == 404


def test_deleting_a_snapshot_frees_its_capture(cove, sandboxes, daytona):
    sandbox = sandboxes()
    name = unique("gone")
    sandbox.create_snapshot(name)
    snapshot = daytona.snapshot.get(name)
    captures = cove.data_dir / "storage" / "captures"
    assert (captures / snapshot.id).is_dir()
    daytona.snapshot.delete(snapshot)
    assert not (captures / snapshot.id).exists()
    with pytest.raises(DaytonaNotFoundError):
        daytona.snapshot.get(name)
