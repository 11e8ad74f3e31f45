"""Create, inspect, change, stop/start and delete sandboxes through the SDK."""

from __future__ import annotations

import datetime as dt
import os
import threading
import time

import pytest
from daytona import (
    CreateSandboxFromSnapshotParams,
    Daytona,
    DaytonaError,
    DaytonaNotFoundError,
    ListSandboxesQuery,
    SandboxState,
)
from daytona_api_client import CreateSandbox

from conftest import assert_gone, unique


def test_default_create_and_exec(cove, sandboxes):
    # Configured from DAYTONA_API_URL / DAYTONA_API_KEY alone, as a user would.
    client = Daytona()
    sandbox = client.create()
    sandboxes.track(sandbox.id)

    response = sandbox.process.exec("echo hi")
    assert response.exit_code == 0
    assert response.result.strip() == "hi"

    assert sandbox.state == SandboxState.STARTED
    assert sandbox.sandbox_class == "container"
    assert (sandbox.cpu, sandbox.memory, sandbox.disk) == (1, 1, 3)
    # The raw DTO says the same, with its wire names.
    raw = cove.request("GET", f"/sandbox/{sandbox.id}").json()
    assert raw["state"] == "started"
    assert raw["sandboxClass"] == "container"
    assert (raw["cpu"], raw["memory"], raw["disk"]) == (1, 1, 3)


def test_filesystem_survives_stop_and_start(sandbox):
    # Seed 002, "Filesystem persistence".
    sandbox.fs.upload_file(b"done", "setup.log")
    sandbox.stop()
    assert sandbox.state == SandboxState.STOPPED
    sandbox.wait_for_sandbox_stop(timeout=60)
    sandbox.start()
    assert sandbox.state == SandboxState.STARTED
    sandbox.wait_for_sandbox_start(timeout=60)
    assert sandbox.fs.download_file("setup.log") == b"done"
    assert sandbox.process.exec("echo alive").result.strip() == "alive"


def test_create_with_name_labels_env(daytona, sandboxes):
    name = unique("cfm")
    labels = {"suite": "conformance", "case": name}
    tricky = "spaces, 'quotes', \"dq\", $dollar and ünïcode"
    sandbox = sandboxes(
        CreateSandboxFromSnapshotParams(
            name=name, labels=labels, env_vars={"X": "from-create", "TRICKY": tricky}
        )
    )
    assert sandbox.name == name
    for k, v in labels.items():
        assert sandbox.labels[k] == v
    assert sandbox.env["X"] == "from-create"
    assert sandbox.process.exec("echo $X").result.strip() == "from-create"
    assert sandbox.process.exec('printf %s "$TRICKY"').result == tricky
    # Sessions see the sandbox's environment too.
    sandbox.process.create_session("envs")
    from daytona import SessionExecuteRequest

    out = sandbox.process.execute_session_command("envs", SessionExecuteRequest(command="echo $X"))
    assert out.output.strip() == "from-create"

    by_id = daytona.get(sandbox.id)
    by_name = daytona.get(name)
    assert by_id.id == by_name.id == sandbox.id
    assert by_name.name == name
    assert by_id.labels["case"] == name


def test_create_with_resources(cove, daytona, sandboxes):
    # The SDK only sends resources with an image (buildInfo, not supported by cove);
    # the control API takes them on any create, so send them through the SDK's own
    # generated client with a snapshot create.
    dto = daytona._sandbox_api.create_sandbox(CreateSandbox(cpu=2, memory=2, disk=5))
    sandboxes.track(dto.id)
    assert (dto.cpu, dto.memory, dto.disk) == (2, 2, 5)
    assert dto.state == SandboxState.STARTED
    fetched = daytona.get(dto.id)
    assert (fetched.cpu, fetched.memory, fetched.disk) == (2, 2, 5)
    # The limits are real, not only recorded: the memory cgroup holds 2 GiB.
    if os.path.isdir("/sys/fs/cgroup/memory/cove") or os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        assert cove_memory_limit(dto.id) == 2 * 1024**3


def cove_memory_limit(sandbox_id: str) -> int | None:
    for path in (
        f"/sys/fs/cgroup/memory/cove/{sandbox_id}/memory.limit_in_bytes",
        f"/sys/fs/cgroup/cove/{sandbox_id}/memory.max",
    ):
        try:
            return int(open(path).read().strip())
        except (OSError, ValueError):
            continue
    return None


def test_list_filters_by_labels_across_pages(cove, daytona, sandboxes):
    tag = unique("lst")
    mine = {sandboxes(CreateSandboxFromSnapshotParams(labels={"lst": tag})).id for _ in range(3)}
    other = sandboxes(CreateSandboxFromSnapshotParams(labels={"lst": "someone-else"}))

    found = [s.id for s in daytona.list(ListSandboxesQuery(labels={"lst": tag}))]
    assert sorted(found) == sorted(mine)
    # limit=1 forces the SDK to follow nextCursor page by page.
    paged = [s.id for s in daytona.list(ListSandboxesQuery(labels={"lst": tag}, limit=1))]
    assert sorted(paged) == sorted(mine)
    assert other.id not in paged

    raw = cove.request("GET", "/sandbox", params={"labels": f'{{"lst": "{tag}"}}', "limit": 2}).json()
    assert len(raw["items"]) == 2
    assert raw["nextCursor"]


def test_set_labels(daytona, sandbox):
    result = sandbox.set_labels({"team": "cove", "tier": "gold"})
    assert result["team"] == "cove"
    assert sandbox.labels["tier"] == "gold"
    fetched = daytona.get(sandbox.id)
    assert fetched.labels["team"] == "cove"
    assert fetched.labels["tier"] == "gold"


def test_timer_settings_are_reflected(daytona, sandbox):
    sandbox.set_autostop_interval(42)
    sandbox.set_auto_delete_interval(120)
    fetched = daytona.get(sandbox.id)
    assert fetched.auto_stop_interval == 42
    assert fetched.auto_delete_interval == 120

    sandbox.set_autostop_interval(0)
    sandbox.set_auto_delete_interval(-1)
    fetched = daytona.get(sandbox.id)
    assert fetched.auto_stop_interval == 0
    assert fetched.auto_delete_interval == -1


def test_set_ttl_is_reflected(daytona, sandbox):
    before = dt.datetime.now(dt.timezone.utc)
    sandbox.set_ttl(60)
    fetched = daytona.get(sandbox.id)
    # The SDK exposes the TTL as autoDestroyAt: now + 60 minutes.
    assert fetched.auto_destroy_at, "autoDestroyAt missing from the DTO after set_ttl(60)"
    at = dt.datetime.fromisoformat(fetched.auto_destroy_at.replace("Z", "+00:00"))
    assert before + dt.timedelta(minutes=59) <= at <= before + dt.timedelta(minutes=61)

    sandbox.set_ttl(0)
    assert daytona.get(sandbox.id).auto_destroy_at is None


def test_delete_then_get_is_not_found(daytona, sandboxes):
    sandbox = sandboxes()
    sandbox.delete()
    assert_gone(daytona, sandbox.id)
    assert sandbox.id not in {s.id for s in daytona.list()}


def test_delete_wait(daytona, sandboxes):
    sandbox = sandboxes()
    started = time.monotonic()
    sandbox.delete(wait=True)
    assert time.monotonic() - started < 30
    assert_gone(daytona, sandbox.id)


def test_ephemeral_sandbox_is_gone_after_stop(cove, daytona, sandboxes):
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(ephemeral=True))
    assert sandbox.auto_delete_interval == 0
    sandbox.stop()
    assert_gone(daytona, sandbox.id)
    assert sandbox.id not in cove.sandbox_ids()


def test_recover_on_started_is_a_noop(cove, sandbox):
    r = cove.request("POST", f"/sandbox/{sandbox.id}/recover")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "started"
    assert sandbox.process.exec("echo still").result.strip() == "still"


def test_default_sandbox_has_the_language_label_and_default_timers(daytona, sandbox):
    fetched = daytona.get(sandbox.id)
    assert fetched.labels.get("code-toolbox-language") == "python"
    assert fetched.user
    assert fetched.organization_id
    assert fetched.auto_stop_interval == 15
    assert fetched.auto_delete_interval is not None and fetched.auto_delete_interval < 0
    assert fetched.snapshot


def test_stop_and_start_are_idempotent(cove, sandbox):
    r = cove.request("POST", f"/sandbox/{sandbox.id}/start")
    assert r.status_code == 200 and r.json()["state"] == "started", r.text
    sandbox.stop()
    r = cove.request("POST", f"/sandbox/{sandbox.id}/stop")
    assert r.status_code == 200 and r.json()["state"] == "stopped", r.text
    sandbox.start()
    assert sandbox.process.exec("true").exit_code == 0


def test_toolbox_of_a_stopped_sandbox_is_refused(sandbox):
    sandbox.stop()
    with pytest.raises(DaytonaError) as info:
        sandbox.process.exec("echo nope")
    assert "stopped" in str(info.value)
    sandbox.start()
    assert sandbox.process.exec("echo yes").result.strip() == "yes"


def test_delete_twice_is_not_found(cove, daytona, sandboxes):
    sandbox = sandboxes()
    sandbox.delete()
    r = cove.request("DELETE", f"/sandbox/{sandbox.id}")
    assert r.status_code == 404
    assert sandbox.id in r.json()["message"]


def test_list_filters_by_state(cove, daytona, sandboxes):
    tag = unique("st")
    up = sandboxes(CreateSandboxFromSnapshotParams(labels={"st": tag}))
    down = sandboxes(CreateSandboxFromSnapshotParams(labels={"st": tag}))
    down.stop()
    q = ListSandboxesQuery(labels={"st": tag}, states=[SandboxState.STOPPED])
    assert [s.id for s in daytona.list(q)] == [down.id]
    q = ListSandboxesQuery(labels={"st": tag}, states=[SandboxState.STARTED])
    assert [s.id for s in daytona.list(q)] == [up.id]


def test_concurrent_creates(cove, daytona, sandboxes):
    tag = unique("par")
    made, errors = [], []

    def one():
        try:
            made.append(daytona.create(CreateSandboxFromSnapshotParams(labels={"par": tag})))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for s in made:
        sandboxes.track(s.id)
    assert not errors, errors
    assert len({s.id for s in made}) == 4
    outputs = {s.process.exec("hostname").result.strip() for s in made}
    assert len(outputs) == 4


def test_create_from_an_unreachable_registry_fails_cleanly(cove, daytona):
    from daytona import CreateSandboxFromImageParams, Resources

    # A loopback port nothing listens on: the pull fails without leaving the machine.
    before = cove.sandbox_ids()
    with pytest.raises(DaytonaError) as info:
        daytona.create(
            CreateSandboxFromImageParams(image="127.0.0.1:9/none/python:3.12-slim", resources=Resources(cpu=2, memory=2, disk=5)),
            timeout=30,
        )
    assert info.value.status_code == 502
    assert "127.0.0.1:9/none/python:3.12-slim" in str(info.value)
    assert cove.sandbox_ids() == before


def test_memory_limit_is_enforced(sandbox):
    # 1 GiB sandbox: a 1.5 GiB allocation is killed, the sandbox survives.
    response = sandbox.process.exec("python3 -c 'b = bytearray(1536 * 1024 * 1024); print(len(b))'", timeout=60)
    assert response.exit_code == 137, response.result
    assert sandbox.process.exec("echo survived").result.strip() == "survived"
    small = sandbox.process.exec("python3 -c 'b = bytearray(256 * 1024 * 1024); print(len(b))'", timeout=60)
    assert small.exit_code == 0
    assert small.result.strip() == str(256 * 1024 * 1024)


def test_disk_limit_is_enforced(sandbox):
    # disk=3 (GiB): the root filesystem must not take a 4 GiB file.
    response = sandbox.process.exec("fallocate -l 4G /root/too-big && echo written; rm -f /root/too-big", timeout=60)
    assert "written" not in response.result, (
        "a 4 GiB file fit in a 3 GiB sandbox; df says: " + sandbox.process.exec("df -h /").result
    )
