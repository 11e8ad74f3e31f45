"""Bad input and unsupported requests get a status and a message naming the problem,
and leave nothing behind."""

from __future__ import annotations

import time
import uuid

import pytest
from daytona import (
    CreateSandboxFromSnapshotParams,
    Daytona,
    DaytonaAuthenticationError,
    DaytonaConflictError,
    DaytonaError,
    DaytonaNotFoundError,
    SandboxState,
)

from conftest import CoveServer, kill_sandbox_processes, mounts_under, new_data_dir, pool_cgroups_of, remove_data_dir, unique, wait_until


def test_unknown_snapshot_is_404_naming_it(cove, daytona):
    before = cove.sandbox_ids()
    snapshot = unique("no-such-snapshot")
    with pytest.raises(DaytonaNotFoundError) as info:
        daytona.create(CreateSandboxFromSnapshotParams(snapshot=snapshot), timeout=30)
    assert snapshot in str(info.value)
    assert info.value.status_code == 404
    assert cove.sandbox_ids() == before

    r = cove.request("POST", "/sandbox", json={"snapshot": snapshot})
    assert r.status_code == 404
    assert snapshot in r.json()["message"]
    assert cove.sandbox_ids() == before


@pytest.mark.parametrize(
    "body, field",
    [
        ({"memory": 64}, "memory"),
        ({"cpu": 64}, "cpu"),
        ({"disk": 10000}, "disk"),
        ({"memory": 0}, "memory"),
    ],
)
def test_resources_outside_limits_are_400(cove, body, field):
    before = cove.sandbox_ids()
    r = cove.request("POST", "/sandbox", json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["message"]
    assert cove.sandbox_ids() == before


def test_memory_above_ceiling_through_the_sdk_client(cove, daytona):
    from daytona_api_client import CreateSandbox
    from daytona_api_client.exceptions import ApiException

    before = cove.sandbox_ids()
    with pytest.raises(ApiException) as info:
        daytona._sandbox_api.create_sandbox(CreateSandbox(memory=64))
    assert info.value.status == 400
    assert "memory" in info.value.body
    assert cove.sandbox_ids() == before


def test_duplicate_name_is_409(cove, daytona, sandboxes):
    name = unique("dup")
    first = sandboxes(CreateSandboxFromSnapshotParams(name=name))
    before = cove.sandbox_ids()
    with pytest.raises(DaytonaConflictError) as info:
        daytona.create(CreateSandboxFromSnapshotParams(name=name), timeout=30)
    assert name in str(info.value)
    assert cove.sandbox_ids() == before
    assert daytona.get(name).id == first.id


def test_invalid_name_is_400(cove):
    before = cove.sandbox_ids()
    r = cove.request("POST", "/sandbox", json={"name": "has spaces/and slash"})
    assert r.status_code == 400, r.text
    assert "name" in r.json()["message"]
    assert cove.sandbox_ids() == before


def test_get_unknown_sandbox_is_404_naming_it(cove, daytona):
    missing = str(uuid.uuid4())
    with pytest.raises(DaytonaNotFoundError) as info:
        daytona.get(missing)
    assert missing in str(info.value)
    r = cove.request("POST", f"/sandbox/{missing}/start")
    assert r.status_code == 404
    assert missing in r.json()["message"]


def test_toolbox_of_unknown_sandbox_is_404(cove):
    missing = str(uuid.uuid4())
    r = requests_toolbox(cove, missing, "/process/execute", json={"command": "true"})
    assert r.status_code == 404, r.text
    assert missing in r.json()["message"]


def requests_toolbox(cove, sandbox_id, path, **kw):
    import requests

    return requests.post(
        f"{cove.base_url}/toolbox/{sandbox_id}{path}",
        headers={"Authorization": f"Bearer {cove.api_key}"},
        timeout=30,
        **kw,
    )


def test_unauthenticated_is_401(cove, sandbox):
    r = cove.request("GET", "/sandbox", auth=False)
    assert r.status_code == 401
    r = cove.request("GET", "/sandbox", headers={"Authorization": "Bearer wrong-key"})
    assert r.status_code == 401
    # The toolbox is guarded too.
    r = cove.request("GET", f"/sandbox/{sandbox.id}", auth=False)
    assert r.status_code == 401
    import requests

    r = requests.post(
        f"{cove.base_url}/toolbox/{sandbox.id}/process/execute",
        json={"command": "echo pwned"},
        timeout=30,
    )
    assert r.status_code == 401
    assert "pwned" not in r.text

    bad = Daytona(__import__("daytona").DaytonaConfig(api_key="wrong-key", api_url=cove.api_url))
    with pytest.raises(DaytonaAuthenticationError):
        list(bad.list())


def test_unimplemented_daytona_endpoints_are_501_naming_them(cove, sandbox):
    r = cove.request("POST", f"/sandbox/{sandbox.id}/pause")
    assert r.status_code in (400, 501), r.text
    assert "pause" in r.json()["message"]

    r = cove.request("GET", "/docker-registry/registry-push-access")
    assert r.status_code == 501, r.text
    assert "registry-push-access" in r.json()["message"]

    r = cove.request("POST", f"/sandbox/{sandbox.id}/archive")
    assert r.status_code in (409, 501), r.text
    assert "archive" in r.json()["message"]

    # Through the SDK: a clear error, and the sandbox is untouched.
    with pytest.raises(DaytonaError) as info:
        sandbox.pause(timeout=10)
    assert "pause" in str(info.value).lower()
    assert info.value.status_code in (400, 501)
    assert cove.request("GET", f"/sandbox/{sandbox.id}").json()["state"] == "started"


def test_a_second_server_on_the_same_data_dir_is_refused(cove, sandbox, tmp_path):
    # Same data dir (and, by default, the same bridge): it must stop before it
    # touches anything the running server owns.
    second = CoveServer(cove.data_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=tuple(cove.extra_args))
    second.log_path = tmp_path / "second.log"
    with pytest.raises(RuntimeError, match="in use by another cove server"):
        second.start()
    assert sandbox.process.exec("echo still-served").result.strip() == "still-served"


def test_a_second_server_on_the_same_bridge_is_refused_and_leaves_nothing(cove, fake_internet, sandbox):
    # Its own data dir, but the running server's bridge: refused by the
    # network before it removes anything, and its storage is unmounted again.
    data_dir = new_data_dir()
    second = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=fake_internet.server_args())
    try:
        with pytest.raises(RuntimeError, match="bridge cove0 is in use by another cove server"):
            second.start()
        assert mounts_under(data_dir) == []
        # Its shim pool never started: no waiting shim's cgroup outlives it.
        assert pool_cgroups_of(data_dir) == set()
        # The running server's sandbox still has its network.
        status = sandbox.process.exec("curl -s -o /dev/null -w '%{http_code}' --max-time 5 http://allowed.test/", timeout=15)
        assert status.result.strip() == "200", status.result
    finally:
        remove_data_dir(data_dir)


def test_bogus_path_is_404(cove):
    r = cove.request("GET", "/definitely/not/an/endpoint")
    assert r.status_code == 404
    assert "/definitely/not/an/endpoint" in r.json()["message"]


def test_bad_list_query_is_400(cove):
    r = cove.request("GET", "/sandbox", params={"labels": "not json"})
    assert r.status_code == 400
    assert "labels" in r.json()["message"]


def test_start_from_error_is_409_naming_both_then_recover(cove, daytona, sandbox):
    """Kill the sandbox from outside: it lands in `error`; start is refused (409,
    naming the operation and the state); recover brings it back."""
    assert kill_sandbox_processes(sandbox.id), "no processes found in the sandbox's cgroup"
    assert wait_until(lambda: daytona.get(sandbox.id).state == SandboxState.ERROR, timeout=15), (
        f"state after its processes were killed: {daytona.get(sandbox.id).state}"
    )
    fetched = daytona.get(sandbox.id)
    assert fetched.error_reason
    assert fetched.recoverable is True

    r = cove.request("POST", f"/sandbox/{sandbox.id}/start")
    assert r.status_code == 409, r.text
    message = r.json()["message"]
    assert "start" in message and "error" in message

    with pytest.raises(DaytonaConflictError):
        sandbox.start(timeout=10)

    sandbox.recover(timeout=60)
    assert sandbox.state == SandboxState.STARTED
    assert sandbox.process.exec("echo back").result.strip() == "back"
