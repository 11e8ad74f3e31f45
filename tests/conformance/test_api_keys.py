"""API keys with Daytona's permissions, driven through the pinned SDK.

The operator's key makes keys over raw HTTP (the SDK has no call for it);
each key then drives cove through `Daytona(DaytonaConfig(api_key=...))` as a
user's program would.
"""

import pytest
import requests
from daytona import Daytona, DaytonaConfig, DaytonaError

from conftest import CoveServer, unique


def make_key(cove: CoveServer, permissions: list[str]) -> tuple[str, str]:
    name = unique("key")
    r = cove.request("POST", "/api-keys", json={"name": name, "permissions": permissions})
    assert r.status_code == 201, r.text
    return name, r.json()["value"]


def client(cove: CoveServer, key: str) -> Daytona:
    return Daytona(DaytonaConfig(api_key=key, api_url=cove.api_url))


def test_a_key_does_what_its_permissions_allow_and_no_more(cove: CoveServer):
    name, value = make_key(cove, ["write:sandboxes"])
    try:
        writer = client(cove, value)
        sandbox = writer.create(timeout=120)
        try:
            # The toolbox is write:sandboxes' too.
            assert sandbox.process.exec("echo hi").result.strip() == "hi"
            with pytest.raises(DaytonaError) as refused:
                writer.delete(sandbox)
            assert refused.value.status_code == 403
            assert "delete:sandboxes" in str(refused.value)
        finally:
            # The SDK's sandbox keeps the key it was made with: the operator
            # deletes it over HTTP.
            assert cove.request("DELETE", f"/sandbox/{sandbox.id}").status_code == 200
        # The audit log names the key, what it did and how that ended.
        log = cove.request(
            "GET", "/audit/organizations/cove", params={"targetId": sandbox.id}
        ).json()["items"]
        by_key = [
            (e["action"], e["statusCode"]) for e in log if e["metadata"]["apiKeyName"] == name
        ]
        assert ("create", 200) in by_key and ("delete", 403) in by_key, log
        # The value was shown once: no listing has it.
        listed = cove.request("GET", "/api-keys")
        assert listed.status_code == 200
        assert name in listed.text and value not in listed.text
    finally:
        assert cove.request("DELETE", f"/api-keys/{name}").status_code == 204
    after = requests.get(
        f"{cove.api_url}/sandbox", headers={"Authorization": f"Bearer {value}"}, timeout=30
    )
    assert after.status_code == 401


def test_a_key_without_permissions_reads_but_cannot_act(cove: CoveServer, sandbox):
    name, value = make_key(cove, [])
    try:
        reader = client(cove, value)
        same = reader.get(sandbox.id)
        assert same.id == sandbox.id
        with pytest.raises(DaytonaError) as refused:
            same.process.exec("true")
        assert refused.value.status_code == 403
        assert "write:sandboxes" in str(refused.value)
        with pytest.raises(DaytonaError) as refused:
            same.stop()
        assert refused.value.status_code == 403
        assert reader.get(sandbox.id).state.value == "started"
    finally:
        assert cove.request("DELETE", f"/api-keys/{name}").status_code == 204
