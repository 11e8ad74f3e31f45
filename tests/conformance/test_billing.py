"""The bill: a sandbox made and stopped through the pinned SDK is billed for
the time it ran and no more, over raw HTTP (`GET
/api/organizations/cove/bill`, which the SDK has no call for) and through
`cove admin bill`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from daytona import CreateSandboxFromSnapshotParams

from conftest import CoveServer, cove_binary, unique


def line_of(bill: dict, sandbox_id: str) -> dict:
    lines = [line for line in bill["lines"] if line["sandboxId"] == sandbox_id]
    assert len(lines) == 1, bill
    return lines[0]


def test_a_sandbox_is_billed_for_the_time_it_ran(cove: CoveServer, daytona, sandboxes):
    before_create = time.monotonic()
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(name=unique("billed")))
    assert sandbox.process.exec("echo running").result.strip() == "running"
    time.sleep(2)
    sandbox.stop(timeout=120)
    ran_at_most = time.monotonic() - before_create
    time.sleep(2)

    r = cove.request("GET", "/organizations/cove/bill")
    assert r.status_code == 200, r.text
    bill = r.json()
    line = line_of(bill, sandbox.id)
    assert line["name"] == sandbox.name
    # Its vCPUs for the 2 s or more it ran, and nothing for the time stopped.
    vcpu_seconds = line["vcpuHours"] * 3600 / sandbox.cpu
    assert 2.0 <= vcpu_seconds <= ran_at_most, (vcpu_seconds, ran_at_most, line)
    assert abs(line["memoryGbHours"] * 3600 / sandbox.memory - vcpu_seconds) < 1e-6, line
    # Its disk, stopped or not.
    assert line["diskGbHours"] * 3600 / sandbox.disk >= vcpu_seconds + 2.0, line

    # A stopped sandbox's compute does not grow.
    time.sleep(1)
    again = line_of(cove.request("GET", "/organizations/cove/bill").json(), sandbox.id)
    assert again["vcpuHours"] == line["vcpuHours"]
    assert again["diskGbHours"] > line["diskGbHours"]

    # The total is the lines at the bill's prices, less the credits.
    prices = bill["prices"]
    total = 0.0
    for each in bill["lines"]:
        amount = (
            each["vcpuHours"] * prices["vcpuHour"]
            + each["memoryGbHours"] * prices["memoryGbHour"]
            + each["diskGbHours"] * prices["diskGbHour"]
            + each["snapshotGbMonths"] * prices["snapshotGbMonth"]
        )
        assert abs(amount - each["amount"]) < 1e-9, each
        total += amount
    assert abs(bill["total"] - max(0.0, total - bill["credits"])) < 1e-9, bill

    # `cove admin bill` prints the same bill, as JSON or as a table.
    env = {**os.environ, "DAYTONA_API_URL": cove.api_url, "COVE_API_KEY": cove.api_key}
    month = bill["from"][:7]
    printed = subprocess.run(
        [str(cove_binary()), "admin", "bill", "--org", "cove", "--month", month, "--json"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    assert line_of(json.loads(printed.stdout), sandbox.id)["vcpuHours"] == line["vcpuHours"]
    table = subprocess.run(
        [str(cove_binary()), "admin", "bill", "--month", month],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    assert any(row.startswith(sandbox.id) and sandbox.name in row for row in table.splitlines()), table
    assert "total" in table


def test_a_bill_is_refused_for_another_organization_or_a_bad_month(cove: CoveServer):
    r = cove.request("GET", "/organizations/someone-else/bill")
    assert r.status_code == 404 and "someone-else" in r.json()["message"]
    r = cove.request("GET", "/organizations/cove/bill", params={"month": "2026-1x"})
    assert r.status_code == 400 and "YYYY-MM" in r.json()["message"]
