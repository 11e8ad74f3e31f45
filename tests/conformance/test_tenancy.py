"""Organizations: one server, several tenants that cannot see each other.

Two organizations (A and B) are made for the module by the operator's key,
each with a key of its own; the operator acts in one by sending
`X-Daytona-Organization-ID`. Checked:

- only the operator makes and deletes organizations; a name is taken once; a
  key lists and reads its own organization only; an organization with
  sandboxes or volumes left cannot be deleted, an empty one can, and its keys
  stop working; the default organization `cove` stays;
- a key acts in its own organization whatever `X-Daytona-Organization-ID`
  says; the operator naming an unknown organization gets a 404; a key lists
  its own organization's keys only;
- A's sandbox is a 404 from B (B's key, the operator in B, the operator in
  `cove`) on every route, by id and by name, through the toolbox and the SDK,
  and is untouched afterwards;
- a preview of A's private sandbox opens with A's credentials, not B's key;
- sandbox and volume names are unique per organization, not per server;
- A's volumes and snapshots are invisible to B and cannot be mounted or used
  by it; the server's default snapshot is everyone's;
- quotas, usage, bills and audit logs are per organization.

Everything here runs in containers from the default snapshot, over raw HTTP
where the SDK has no call (organizations, keys, quotas) or hides the status.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

import pytest
import requests
from daytona import (
    CreateSandboxFromSnapshotParams,
    Daytona,
    DaytonaConfig,
    DaytonaError,
    DaytonaNotFoundError,
    Sandbox,
    SandboxState,
    SessionExecuteRequest,
)

from conftest import CoveServer, unique, wait_until

ORG_HEADER = "X-Daytona-Organization-ID"
TOKEN_HEADER = "X-Daytona-Preview-Token"
DEFAULT_SNAPSHOT = "cove-default"
DEFAULT_ORGANIZATION = "cove"
# Everything a tenant's own program may need here.
FULL = [
    "write:sandboxes",
    "delete:sandboxes",
    "write:volumes",
    "read:volumes",
    "delete:volumes",
    "write:snapshots",
    "delete:snapshots",
    "write:registries",
    "delete:registries",
    "read:billing",
    "read:audit_logs",
    "manage:api_keys",
]


def send(cove: CoveServer, key: str, method: str, path: str, org: str | None = None, **kw) -> requests.Response:
    """`method` on `/api{path}` with `key`, in organization `org` when given."""
    headers = {"Authorization": f"Bearer {key}", **kw.pop("headers", {})}
    if org is not None:
        headers[ORG_HEADER] = org
    return requests.request(method, f"{cove.api_url}{path}", headers=headers, timeout=60, **kw)


def make_key(cove: CoveServer, org: str, permissions: list[str]) -> tuple[str, str]:
    """A key of organization `org`, made by the operator acting in it."""
    name = unique("key")
    r = send(cove, cove.api_key, "POST", "/api-keys", org=org, json={"name": name, "permissions": permissions})
    assert r.status_code == 201, r.text
    return name, r.json()["value"]


def make_organization(cove: CoveServer, name: str) -> dict:
    r = cove.request("POST", "/organizations", json={"name": name, "defaultRegionId": "us"})
    assert r.status_code == 201, r.text
    return r.json()


def items(r: requests.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    body = r.json()
    return body["items"] if isinstance(body, dict) else body


def remove_organization(cove: CoveServer, org: str, key_names: list[str]) -> bool:
    """Deletes what is left in `org` (the operator acting in it), then `org`;
    True once it is gone."""

    def as_org(method: str, path: str, **kw) -> requests.Response:
        return send(cove, cove.api_key, method, path, org=org, **kw)

    def left(path: str, delete_path, **kw) -> list[dict]:
        """What `path` lists that `delete_path` names, each sent a DELETE."""
        r = as_org("GET", path, **kw)
        if r.status_code != 200:
            return []
        found = [each for each in items(r) if delete_path(each)]
        for each in found:
            as_org("DELETE", delete_path(each))
        return found

    # Forks before their parents: whatever is refused now goes next round.
    wait_until(lambda: not left("/sandbox", lambda s: f"/sandbox/{s['id']}", params={"limit": 1000}), 90, 0.5)
    # Not the server's general snapshots, which every organization lists.
    mine = lambda s: None if s.get("general") else f"/snapshots/{s['id']}"  # noqa: E731
    wait_until(lambda: not left("/snapshots", mine, params={"limit": 100}), 60, 0.5)
    wait_until(lambda: not left("/volumes", lambda v: f"/volumes/{v['id']}"), 60, 0.5)
    left("/docker-registry", lambda d: f"/docker-registry/{d['id']}")
    for name in key_names:
        as_org("DELETE", f"/api-keys/{name}")
    return wait_until(
        lambda: cove.request("DELETE", f"/organizations/{org}").status_code in (204, 404), 30, 0.5
    )


@dataclass
class Tenant:
    """An organization of the module and a key of its own with FULL."""

    cove: CoveServer
    id: str
    name: str
    key_name: str = ""
    key: str = ""

    def request(self, method: str, path: str, **kw) -> requests.Response:
        """With this organization's own key, no header."""
        return send(self.cove, self.key, method, path, **kw)

    def operator(self, method: str, path: str, **kw) -> requests.Response:
        """With the operator's key, acting in this organization."""
        return send(self.cove, self.cove.api_key, method, path, org=self.id, **kw)

    @cached_property
    def client(self) -> Daytona:
        return Daytona(DaytonaConfig(api_key=self.key, api_url=self.cove.api_url))

    def sandbox_ids(self) -> set[str]:
        return {s["id"] for s in items(self.request("GET", "/sandbox", params={"limit": 1000}))}

    def create(self, **params) -> Sandbox:
        """A started container through the SDK with this organization's key."""
        return self.client.create(CreateSandboxFromSnapshotParams(**params), timeout=120)

    def delete(self, *sandboxes: Sandbox | None) -> None:
        for sandbox in sandboxes:
            if sandbox is not None:
                self.operator("DELETE", f"/sandbox/{sandbox.id}")


@pytest.fixture(scope="module")
def tenants(cove: CoveServer) -> Iterator[tuple[Tenant, Tenant]]:
    made: list[Tenant] = []
    try:
        for label in ("a", "b"):
            org = make_organization(cove, unique(f"org-{label}"))
            tenant = Tenant(cove, org["id"], org["name"])
            made.append(tenant)
            tenant.key_name, tenant.key = make_key(cove, tenant.id, FULL)
        yield made[0], made[1]
    finally:
        stuck = [t.id for t in made if not remove_organization(cove, t.id, [t.key_name] if t.key_name else [])]
        assert not stuck, f"organizations left behind: {stuck}"


def test_only_the_operator_makes_and_deletes_organizations(cove: CoveServer, tenants):
    a, b = tenants
    name = unique("org-c")
    operator_names = lambda: [o["name"] for o in items(cove.request("GET", "/organizations"))]  # noqa: E731
    r = a.request("POST", "/organizations", json={"name": name, "defaultRegionId": "us"})
    assert r.status_code == 403, r.text
    assert name not in operator_names()

    org = make_organization(cove, name)
    c = org["id"]
    assert org["name"] == name
    assert str(uuid.UUID(c)) == c.lower() and c not in (a.id, b.id, DEFAULT_ORGANIZATION)
    gone = False
    keys: list[str] = []
    try:
        r = cove.request("POST", "/organizations", json={"name": name, "defaultRegionId": "us"})
        assert r.status_code == 409, r.text
        assert operator_names().count(name) == 1

        # The operator sees every organization, a key its own alone.
        every = {o["id"] for o in items(cove.request("GET", "/organizations"))}
        assert {DEFAULT_ORGANIZATION, a.id, b.id, c} <= every
        assert [o["id"] for o in items(a.request("GET", "/organizations"))] == [a.id]
        r = a.request("GET", f"/organizations/{a.id}")
        assert r.status_code == 200 and r.json()["name"] == a.name, r.text
        for other in (b.id, c):
            assert a.request("GET", f"/organizations/{other}").status_code == 404
        assert cove.request("GET", f"/organizations/{c}").json()["name"] == name

        key_name, key = make_key(cove, c, FULL)
        keys.append(key_name)
        assert [o["id"] for o in items(send(cove, key, "GET", "/organizations"))] == [c]

        # Not while it holds a sandbox or a volume, and not by a tenant's key.
        sandbox = Daytona(DaytonaConfig(api_key=key, api_url=cove.api_url)).create(timeout=120)
        volume = unique("vol")
        r = send(cove, key, "POST", "/volumes", json={"name": volume})
        assert r.status_code in (200, 201), r.text
        volume_id = r.json()["id"]
        assert a.request("DELETE", f"/organizations/{c}").status_code == 403
        r = cove.request("DELETE", f"/organizations/{c}")
        assert r.status_code == 409, r.text
        message = r.json()["message"].lower()
        assert "sandbox" in message and "volume" in message, message
        # Nothing of it went: the key still works and still sees its sandbox.
        assert sandbox.id in {s["id"] for s in items(send(cove, key, "GET", "/sandbox"))}

        assert send(cove, key, "DELETE", f"/sandbox/{sandbox.id}").status_code == 200
        assert wait_until(lambda: send(cove, key, "GET", f"/sandbox/{sandbox.id}").status_code == 404, 60, 0.2)
        r = cove.request("DELETE", f"/organizations/{c}")
        assert r.status_code == 409, r.text
        assert "volume" in r.json()["message"].lower()
        assert send(cove, key, "DELETE", f"/volumes/{volume_id}").status_code in (200, 204)
        assert wait_until(lambda: send(cove, key, "GET", f"/volumes/{volume_id}").status_code == 404, 30, 0.2)

        r = cove.request("DELETE", f"/organizations/{c}")
        assert r.status_code == 204, r.text
        gone = True
        assert send(cove, key, "GET", "/sandbox").status_code == 401
        assert cove.request("GET", f"/organizations/{c}").status_code == 404
        assert send(cove, cove.api_key, "GET", "/sandbox", org=c).status_code == 404
        assert name not in operator_names()
    finally:
        if not gone:
            remove_organization(cove, c, keys)

    # The default organization is the server's own.
    r = cove.request("DELETE", f"/organizations/{DEFAULT_ORGANIZATION}")
    assert r.status_code == 409, r.text
    assert cove.request("GET", f"/organizations/{DEFAULT_ORGANIZATION}").status_code == 200
    assert cove.request("GET", "/sandbox").status_code == 200


def test_a_key_acts_in_its_own_organization_and_lists_only_its_keys(cove: CoveServer, tenants):
    a, b = tenants
    r = a.request("GET", "/api-keys/current")
    assert r.status_code == 200 and r.json()["name"] == a.key_name, r.text
    # Its own id in the header changes nothing.
    assert a.request("GET", "/sandbox", headers={ORG_HEADER: a.id}).status_code == 200

    # Another organization's id changes nothing either: a key acts in its own
    # organization, as Daytona's keys do (the header is for logins).
    into_b = {ORG_HEADER: b.id}
    keys = [k["name"] for k in items(a.request("GET", "/api-keys", headers=into_b))]
    assert a.key_name in keys and b.key_name not in keys, keys
    volume = unique("vol")
    r = a.request("POST", "/volumes", json={"name": volume}, headers=into_b)
    assert r.status_code in (200, 201), r.text
    try:
        assert r.json()["organizationId"] == a.id, r.text
        assert volume in [v["name"] for v in items(a.request("GET", "/volumes"))]
        assert volume not in [v["name"] for v in items(b.request("GET", "/volumes"))]
    finally:
        assert a.request("DELETE", f"/volumes/{r.json()['id']}").status_code in (200, 204)

    # An organization that does not exist is a 404, even for the operator.
    unknown = str(uuid.uuid4())
    assert send(cove, cove.api_key, "GET", "/sandbox", org=unknown).status_code == 404
    key_name = unique("key")
    r = send(cove, cove.api_key, "POST", "/api-keys", org=unknown, json={"name": key_name, "permissions": []})
    if r.status_code == 201:
        cove.request("DELETE", f"/api-keys/{key_name}")
    assert r.status_code == 404, r.text

    # Each organization's keys, whoever lists them.
    for tenant, other in ((a, b), (b, a)):
        for listing in (tenant.request("GET", "/api-keys"), tenant.operator("GET", "/api-keys")):
            names = [k["name"] for k in items(listing)]
            assert tenant.key_name in names and other.key_name not in names, names
        assert tenant.request("GET", f"/api-keys/{other.key_name}").status_code == 404
    # B cannot delete A's key: it still works.
    assert b.request("DELETE", f"/api-keys/{a.key_name}").status_code == 404
    assert a.request("GET", "/api-keys/current").status_code == 200


def test_another_organizations_sandbox_is_a_404_everywhere(cove: CoveServer, tenants):
    a, b = tenants
    mine = a.create(name=unique("mine"), labels={"owner": "a"})
    try:
        assert mine.organization_id == a.id
        r = a.request("GET", f"/sandbox/{mine.id}")
        assert r.status_code == 200, r.text
        before = r.json()
        toolbox = f"{cove.base_url}/toolbox/{mine.id}"
        # The routes answer A: the 404s below are about who asks.
        own = {"Authorization": f"Bearer {a.key}"}
        r = requests.get(f"{toolbox}/files", params={"path": "/"}, headers=own, timeout=30)
        assert r.status_code == 200, r.text

        stolen, fork = unique("stolen"), unique("fork")
        routes = [
            ("GET", f"/sandbox/{mine.id}", None),
            ("GET", f"/sandbox/{mine.name}", None),
            ("POST", f"/sandbox/{mine.id}/stop", None),
            ("POST", f"/sandbox/{mine.name}/stop", None),
            ("POST", f"/sandbox/{mine.id}/start", None),
            ("POST", f"/sandbox/{mine.id}/archive", None),
            ("POST", f"/sandbox/{mine.id}/fork", {"name": fork}),
            ("POST", f"/sandbox/{mine.id}/snapshot", {"name": stolen}),
            ("PUT", f"/sandbox/{mine.id}/labels", {"labels": {"owner": "b"}}),
            ("POST", f"/sandbox/{mine.id}/public/true", None),
            ("POST", f"/sandbox/{mine.id}/autostop/1", None),
            ("GET", f"/sandbox/{mine.id}/ports/3000/preview-url", None),
            ("GET", f"/sandbox/{mine.id}/ports/3000/signed-preview-url", None),
            ("POST", f"/sandbox/{mine.id}/ssh-access", None),
            ("GET", f"/sandbox/{mine.id}/toolbox-proxy-url", None),
            ("DELETE", f"/sandbox/{mine.name}", None),
            ("DELETE", f"/sandbox/{mine.id}", None),
        ]
        outsiders = {
            "B's key": {"Authorization": f"Bearer {b.key}"},
            "the operator in B": {"Authorization": f"Bearer {cove.api_key}", ORG_HEADER: b.id},
            "the operator in cove": {"Authorization": f"Bearer {cove.api_key}"},
        }
        for who, headers in outsiders.items():
            for method, path, body in routes:
                r = requests.request(method, f"{cove.api_url}{path}", headers=headers, json=body, timeout=60)
                assert r.status_code == 404, (who, method, path, r.text)
            r = requests.get(f"{toolbox}/files", params={"path": "/"}, headers=headers, timeout=30)
            assert r.status_code == 404, (who, r.text)
            r = requests.post(
                f"{toolbox}/process/execute", headers=headers, json={"command": "touch /tmp/pwned"}, timeout=30
            )
            assert r.status_code == 404, (who, r.text)
            r = requests.get(f"{cove.api_url}/sandbox", headers=headers, params={"limit": 1000}, timeout=30)
            assert mine.id not in {s["id"] for s in items(r)}, who
        with pytest.raises(DaytonaNotFoundError):
            b.client.get(mine.id)
        with pytest.raises(DaytonaNotFoundError):
            b.client.get(mine.name)

        # A's sandbox is as it was, and none of it happened.
        assert mine.id in a.sandbox_ids()
        after = a.request("GET", f"/sandbox/{mine.id}").json()
        assert after["state"] == "started"
        # (The SDK adds its own label for the code toolbox's language.)
        assert after["labels"] == before["labels"] and before["labels"]["owner"] == "a"
        assert after["public"] is False
        assert after["autoStopInterval"] == before["autoStopInterval"]
        mine.refresh_data()
        assert mine.process.exec("test -e /tmp/pwned").exit_code == 1
        for tenant in (a, b):
            assert tenant.request("GET", f"/sandbox/{fork}").status_code == 404
            assert tenant.request("GET", f"/snapshots/{stolen}").status_code == 404
    finally:
        a.delete(mine)


APP_PORT = 8000
PAGE = b"a page of organization A\n"
PROBE = """
import socket, sys
socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()
"""


def serve_a_page(sandbox: Sandbox) -> None:
    """`python3 -m http.server` on APP_PORT in the sandbox, serving PAGE."""
    assert sandbox.process.exec("mkdir -p /tmp/site").exit_code == 0
    sandbox.fs.upload_file(PAGE, "/tmp/site/page.txt")
    sandbox.fs.upload_file(PROBE.encode(), "/tmp/probe.py")
    sandbox.process.create_session("web")
    sandbox.process.execute_session_command(
        "web",
        SessionExecuteRequest(
            command=f"cd /tmp/site && python3 -m http.server --bind 127.0.0.1 {APP_PORT}", run_async=True
        ),
    )
    assert wait_until(lambda: sandbox.process.exec(f"python3 /tmp/probe.py {APP_PORT}").exit_code == 0, 30)


def test_a_preview_opens_with_its_own_organizations_credentials_only(cove: CoveServer, tenants):
    a, b = tenants
    mine = a.create()
    try:
        serve_a_page(mine)
        r = a.request("GET", f"/sandbox/{mine.id}/ports/{APP_PORT}/preview-url")
        assert r.status_code == 200, r.text
        token = r.json()["token"]
        page = f"{cove.base_url}/preview/{mine.id}/{APP_PORT}/page.txt"

        r = requests.get(page, headers={TOKEN_HEADER: token}, timeout=10)
        assert r.status_code == 200 and r.content == PAGE, r.text
        r = requests.get(page, headers={"Authorization": f"Bearer {a.key}"}, timeout=10)
        assert r.status_code == 200 and r.content == PAGE, r.text
        r = requests.get(page, headers={"Authorization": f"Bearer {b.key}"}, timeout=10)
        assert r.status_code == 404, r.text
        assert PAGE not in r.content

        # B can neither get a token nor sign a URL for it; A's signed URL works alone.
        for path in ("preview-url", "signed-preview-url"):
            assert b.request("GET", f"/sandbox/{mine.id}/ports/{APP_PORT}/{path}").status_code == 404
        r = a.request(
            "GET", f"/sandbox/{mine.id}/ports/{APP_PORT}/signed-preview-url", params={"expiresInSeconds": 60}
        )
        assert r.status_code == 200, r.text
        signed = r.json()
        r = requests.get(f"{signed['url']}/page.txt", timeout=10)
        assert r.status_code == 200 and r.content == PAGE, r.text
        r = b.request("POST", f"/sandbox/{mine.id}/ports/{APP_PORT}/signed-preview-url/{signed['token']}/expire")
        assert r.status_code == 404, r.text
        assert requests.get(f"{signed['url']}/page.txt", timeout=10).status_code == 200
    finally:
        a.delete(mine)


def test_names_are_unique_within_an_organization_not_across(cove: CoveServer, tenants):
    a, b = tenants
    name = unique("same")
    volume = unique("vol")
    ours = theirs = None
    volumes: list[tuple[Tenant, str]] = []
    try:
        ours = a.create(name=name)
        theirs = b.create(name=name)
        assert ours.id != theirs.id and ours.name == theirs.name == name
        with pytest.raises(DaytonaError) as refused:
            a.create(name=name)
        assert refused.value.status_code == 409, refused.value
        named = [s["id"] for s in items(a.request("GET", "/sandbox", params={"limit": 1000})) if s["name"] == name]
        assert named == [ours.id]
        # A name finds each organization's own.
        for tenant, sandbox in ((a, ours), (b, theirs)):
            assert tenant.request("GET", f"/sandbox/{name}").json()["id"] == sandbox.id
            assert tenant.client.get(name).id == sandbox.id

        for tenant in (a, b):
            r = tenant.request("POST", "/volumes", json={"name": volume})
            assert r.status_code in (200, 201), r.text
            volumes.append((tenant, r.json()["id"]))
        assert volumes[0][1] != volumes[1][1]
        r = a.request("POST", "/volumes", json={"name": volume})
        assert r.status_code == 409, r.text
        for tenant, volume_id in volumes:
            assert tenant.request("GET", f"/volumes/by-name/{volume}").json()["id"] == volume_id
            assert [v["id"] for v in items(tenant.request("GET", "/volumes")) if v["name"] == volume] == [volume_id]
    finally:
        a.delete(ours)
        b.delete(theirs)
        for tenant, volume_id in volumes:
            tenant.operator("DELETE", f"/volumes/{volume_id}")


def test_another_organizations_volume_cannot_be_seen_or_mounted(cove: CoveServer, tenants):
    a, b = tenants
    r = a.request("POST", "/volumes", json={"name": unique("vol")})
    assert r.status_code in (200, 201), r.text
    volume = r.json()
    try:
        assert volume["id"] in [v["id"] for v in items(a.request("GET", "/volumes"))]
        for request in (b.request, b.operator):
            assert request("GET", f"/volumes/{volume['id']}").status_code == 404
            assert request("GET", f"/volumes/by-name/{volume['name']}").status_code == 404
            assert volume["id"] not in [v["id"] for v in items(request("GET", "/volumes"))]

        ours, theirs = a.sandbox_ids(), b.sandbox_ids()
        for ref in (volume["id"], volume["name"]):
            r = b.request("POST", "/sandbox", json={"volumes": [{"volumeId": ref, "mountPath": "/data"}]})
            assert r.status_code in (400, 404), (ref, r.text)
            assert ref in r.json()["message"], r.text
        assert b.sandbox_ids() == theirs and a.sandbox_ids() == ours

        assert b.request("DELETE", f"/volumes/{volume['id']}").status_code == 404
        r = a.request("GET", f"/volumes/{volume['id']}")
        assert r.status_code == 200 and r.json()["state"] == "ready", r.text
    finally:
        a.operator("DELETE", f"/volumes/{volume['id']}")


def test_another_organizations_snapshot_cannot_be_seen_or_used(cove: CoveServer, tenants):
    a, b = tenants
    source = a.create()
    name = unique("snap")
    made = None
    try:
        r = a.request("POST", f"/sandbox/{source.id}/snapshot", json={"name": name})
        assert r.status_code in (200, 201), r.text
        assert wait_until(lambda: a.request("GET", f"/snapshots/{name}").json().get("state") == "active", 120, 0.5)

        def listed(request) -> list[str]:
            return [s["name"] for s in items(request("GET", "/snapshots", params={"limit": 100}))]

        assert name in listed(a.request) and DEFAULT_SNAPSHOT in listed(a.request)
        for request in (b.request, b.operator):
            names = listed(request)
            assert name not in names and DEFAULT_SNAPSHOT in names, names
            assert request("GET", f"/snapshots/{name}").status_code == 404
        assert b.request("GET", f"/snapshots/{DEFAULT_SNAPSHOT}").status_code == 200

        assert b.request("DELETE", f"/snapshots/{name}").status_code == 404
        assert a.request("GET", f"/snapshots/{name}").status_code == 200

        ours, theirs = a.sandbox_ids(), b.sandbox_ids()
        r = b.request("POST", "/sandbox", json={"snapshot": name})
        assert r.status_code in (400, 404), r.text
        assert name in r.json()["message"], r.text
        assert b.sandbox_ids() == theirs and a.sandbox_ids() == ours

        # The server's default snapshot is every organization's.
        made = b.create(snapshot=DEFAULT_SNAPSHOT)
        assert made.organization_id == b.id and made.state == SandboxState.STARTED
        assert made.process.exec("echo from b").result.strip() == "from b"
    finally:
        b.delete(made)
        a.delete(source)
        a.operator("DELETE", f"/snapshots/{name}")


def test_quotas_usage_bills_and_audit_logs_are_per_organization(cove: CoveServer, tenants):
    a, b = tenants
    quota = f"/admin/organizations/{a.id}/quota/us"
    a1 = a2 = b1 = b2 = None
    try:
        a1 = a.create()
        a2 = a.create()
        a2.stop(timeout=120)
        r = cove.request("PATCH", quota, json={"maxRunningSandboxes": 1})
        assert r.status_code == 204, r.text

        before = a.sandbox_ids()
        with pytest.raises(DaytonaError) as refused:
            a.create()
        assert refused.value.status_code == 403
        assert "maxRunningSandboxes" in str(refused.value)
        assert a.sandbox_ids() == before
        with pytest.raises(DaytonaError) as refused:
            a2.start(timeout=120)
        assert refused.value.status_code == 403
        assert "maxRunningSandboxes" in str(refused.value)
        a2.refresh_data()
        assert a2.state == SandboxState.STOPPED

        # B has no such limit: two run at once.
        b1 = b.create()
        b2 = b.create()
        assert b1.state == b2.state == SandboxState.STARTED

        def usage(tenant: Tenant, org: str) -> dict:
            r = tenant.request("GET", f"/organizations/{org}/usage")
            assert r.status_code == 200, r.text
            return r.json()["regionUsage"][0]

        ours, theirs = usage(a, a.id), usage(b, b.id)
        assert ours["currentRunningSandboxes"] == 1 and ours["maxRunningSandboxes"] == 1, ours
        assert ours["currentCpuUsage"] == a1.cpu, ours
        assert theirs["currentRunningSandboxes"] == 2 and theirs["maxRunningSandboxes"] is None, theirs
        r = cove.request("GET", f"/organizations/{DEFAULT_ORGANIZATION}/usage")
        assert r.status_code == 200 and r.json()["regionUsage"][0]["maxRunningSandboxes"] is None, r.text

        # Another organization's figures are not found.
        for path in (f"/organizations/{a.id}/usage", f"/organizations/{a.id}/bill", f"/audit/organizations/{a.id}"):
            r = b.request("GET", path)
            assert r.status_code == 404, (path, r.text)

        def billed(tenant: Tenant) -> set[str]:
            r = tenant.request("GET", f"/organizations/{tenant.id}/bill")
            assert r.status_code == 200, r.text
            return {line["sandboxId"] for line in r.json()["lines"] if line.get("sandboxId")}

        a_bill, b_bill = billed(a), billed(b)
        assert {a1.id, a2.id} <= a_bill and not {b1.id, b2.id} & a_bill, a_bill
        assert {b1.id, b2.id} <= b_bill and not {a1.id, a2.id} & b_bill, b_bill

        def audited(tenant: Tenant, target: str) -> list[tuple[str, int]]:
            r = tenant.request("GET", f"/audit/organizations/{tenant.id}", params={"targetId": target})
            return [(e["action"], e["statusCode"]) for e in items(r)]

        assert ("create", 200) in audited(a, a1.id)
        assert ("create", 200) in audited(b, b1.id)
        assert audited(a, b1.id) == [] and audited(b, a1.id) == []
    finally:
        r = cove.request("PATCH", quota, json={"maxRunningSandboxes": None})
        a.delete(a1, a2)
        b.delete(b1, b2)
        assert r.status_code == 204, r.text
