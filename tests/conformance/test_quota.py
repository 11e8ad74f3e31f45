"""The running-machine limit and usage, on a server of the test's own (a
quota there holds no other module's sandboxes back), driven through the
pinned SDK; the quota is set and usage read over raw HTTP, which the SDK
has no calls for. The server restarts in the middle: the quota and the bill
outlive it.
"""

from __future__ import annotations

import pytest
from daytona import CreateSandboxFromSnapshotParams, DaytonaError, SandboxState

from conftest import CoveServer, unique

QUOTA = "/admin/organizations/cove/quota/us"


def usage(server: CoveServer) -> dict:
    r = server.request("GET", "/organizations/cove/usage")
    assert r.status_code == 200, r.text
    return r.json()["regionUsage"][0]


def test_a_second_running_sandbox_is_refused_until_the_first_stops(own_server: CoveServer):
    r = own_server.request("PATCH", QUOTA, json={"maxRunningSandboxes": 1})
    assert r.status_code == 204, r.text
    daytona = own_server.client()
    first = daytona.create(CreateSandboxFromSnapshotParams(name=unique("first")), timeout=120)
    assert usage(own_server)["currentCpuUsage"] == first.cpu
    assert usage(own_server)["currentRunningSandboxes"] == 1

    second = unique("second")
    with pytest.raises(DaytonaError) as refused:
        daytona.create(CreateSandboxFromSnapshotParams(name=second), timeout=120)
    assert refused.value.status_code == 403
    assert "maxRunningSandboxes is 1" in str(refused.value)
    assert own_server.request("GET", f"/sandbox/{second}").status_code == 404

    # The quota and what was metered outlive a restart.
    assert own_server.stop() == 0, own_server.log_tail()
    own_server.start()
    daytona = own_server.client()
    assert usage(own_server)["maxRunningSandboxes"] == 1
    first = daytona.get(first.id)
    # A restart brings a sandbox back running, or stopped when it cannot.
    assert first.state in (SandboxState.STARTED, SandboxState.STOPPED), first.state
    if first.state == SandboxState.STARTED:
        first.stop(timeout=120)
    assert usage(own_server)["currentCpuUsage"] == 0

    made = daytona.create(CreateSandboxFromSnapshotParams(name=second), timeout=120)
    assert made.process.exec("echo in").result.strip() == "in"
    # The first cannot start while the second runs, and stays stopped.
    with pytest.raises(DaytonaError) as refused:
        first.start(timeout=120)
    assert refused.value.status_code == 403
    first.refresh_data()
    assert first.state == SandboxState.STOPPED

    bill = own_server.request("GET", "/organizations/cove/bill").json()
    ran = {line["sandboxId"]: line["vcpuHours"] for line in bill["lines"]}
    assert ran.get(first.id, 0) > 0 and ran.get(made.id, 0) > 0, bill


def test_volumes_past_the_volume_quota_are_refused(own_server: CoveServer):
    r = own_server.request("PATCH", "/organizations/cove/quota", json={"volumeQuota": 1})
    assert r.status_code == 204, r.text
    daytona = own_server.client()
    daytona.volume.create(unique("vol"))
    with pytest.raises(DaytonaError) as refused:
        daytona.volume.create(unique("vol"))
    assert refused.value.status_code == 403
    assert "volumeQuota is 1" in str(refused.value)
    assert usage(own_server)["maxRunningSandboxes"] is None
    overview = own_server.request("GET", "/organizations/cove/usage").json()
    assert overview["totalVolumeQuota"] == 1 and overview["currentVolumeUsage"] == 1


def test_a_sandbox_from_the_archive_counts_its_disk_again(own_server: CoveServer):
    daytona = own_server.client()
    first = daytona.create(CreateSandboxFromSnapshotParams(name=unique("kept")), timeout=120)
    first.process.exec("echo still-here > kept.txt")
    r = own_server.request("PATCH", QUOTA, json={"totalDiskQuota": first.disk})
    assert r.status_code == 204, r.text
    first.stop(timeout=120)
    first.archive()
    first.refresh_data()
    assert first.state == SandboxState.ARCHIVED
    assert usage(own_server)["currentDiskUsage"] == 0

    # Archived, its disk is not kept, so another one fits the quota...
    second = daytona.create(CreateSandboxFromSnapshotParams(name=unique("room")), timeout=120)
    assert usage(own_server)["currentDiskUsage"] == second.disk
    # ...and the first cannot come back beside it: nothing moves, nothing is lost.
    with pytest.raises(DaytonaError) as refused:
        first.start(timeout=120)
    assert refused.value.status_code == 403
    assert "totalDiskQuota" in str(refused.value)
    first.refresh_data()
    assert first.state == SandboxState.ARCHIVED

    daytona.delete(second, timeout=120)
    first.start(timeout=300)
    assert first.process.exec("cat kept.txt").result.strip() == "still-here"
    assert usage(own_server)["currentDiskUsage"] == first.disk
