"""Issue 23, item 4: linked sandboxes, as Daytona's documentation uses them.
An ephemeral sandbox made with `linked_sandbox=owner.id` shares a private
network with its owner: each answers the other by sandbox name, nobody else
reaches either that way, and the link ends when either is deleted."""

from __future__ import annotations

import pytest
from daytona import CreateSandboxFromSnapshotParams, DaytonaError, SessionExecuteRequest

from conftest import VM_SNAPSHOT, VM_TIMEOUT, unique, wait_until

PORT = 8080


def serve(sandbox, text: str) -> None:
    """An HTTP server on PORT answering `text`, as a background session command."""
    sandbox.process.exec(f"mkdir -p /tmp/site && echo {text} > /tmp/site/index.html")
    sandbox.process.create_session("web")
    sandbox.process.execute_session_command(
        "web",
        SessionExecuteRequest(command=f"cd /tmp/site && python3 -m http.server {PORT}", run_async=True),
    )
    assert wait_until(
        lambda: sandbox.process.exec(f"curl -s -m 2 http://127.0.0.1:{PORT}/").result.strip() == text, 20
    ), "the server never answered"


def fetch(sandbox, host: str) -> str:
    return sandbox.process.exec(f"curl -s -m 3 http://{host}:{PORT}/ || echo unreachable").result.strip()


def reaches(sandbox, host: str, text: str) -> bool:
    """Whether `sandbox` gets `text` from `host` within a few tries: the
    first packets of a new pair wait for their neighbours to be found."""
    return wait_until(lambda: fetch(sandbox, host) == text, 15)


def resolve(sandbox, name: str) -> str:
    return sandbox.process.exec(f"getent hosts {name} | cut -d' ' -f1").result.strip()


def linked_to(sandboxes, owner, **kw):
    params = CreateSandboxFromSnapshotParams(linked_sandbox=owner.id, ephemeral=True, **kw)
    return sandboxes(params, timeout=60)


def test_linked_sandboxes_serve_each_other_by_name_and_no_one_else(cove, sandboxes):
    owner = sandboxes(CreateSandboxFromSnapshotParams(name=unique("owner")))
    serve(owner, "from-owner")
    helper = linked_to(sandboxes, owner)
    assert cove.request("GET", f"/sandbox/{helper.id}").json()["linkedSandboxId"] == owner.id
    assert cove.request("GET", f"/sandbox/{owner.id}").json()["linkedSandboxId"] is None

    # The helper reaches its owner by name, and the owner the helper.
    owner_address = resolve(helper, owner.name)
    assert owner_address.count(".") == 3, owner_address
    assert reaches(helper, owner.name, "from-owner")
    serve(helper, "from-helper")
    assert reaches(owner, helper.name, "from-helper")
    # (Names are matched without regard to case, as DNS does.)
    assert reaches(helper, owner.name.upper(), "from-owner")

    # Anyone else: no name, no way through, even by address.
    stranger = sandboxes()
    assert resolve(stranger, owner.name) == ""
    assert fetch(stranger, owner_address) == "unreachable"
    helper_address = resolve(owner, helper.name)
    assert fetch(stranger, helper_address) == "unreachable"
    # And the helper reaches no one else either.
    serve(stranger, "from-stranger")
    stranger_address = stranger.process.exec("hostname -I").result.split()[0]
    assert fetch(helper, stranger_address) == "unreachable"

    # Deleting the helper ends the link.
    helper.delete()
    assert resolve(owner, helper.name) == ""


def test_a_link_is_made_only_as_daytona_allows(cove, sandboxes):
    owner = sandboxes()
    before = cove.sandbox_ids()
    # Not ephemeral.
    with pytest.raises(DaytonaError) as refused:
        sandboxes(CreateSandboxFromSnapshotParams(linked_sandbox=owner.id))
    assert "ephemeral" in str(refused.value)
    # To a sandbox that does not exist.
    with pytest.raises(DaytonaError) as refused:
        sandboxes(CreateSandboxFromSnapshotParams(linked_sandbox=unique("nobody"), ephemeral=True))
    assert "not found" in str(refused.value).lower()
    assert cove.sandbox_ids() == before
    # To a sandbox that is itself linked, by name.
    helper = linked_to(sandboxes, owner)
    before = cove.sandbox_ids()
    with pytest.raises(DaytonaError) as refused:
        sandboxes(CreateSandboxFromSnapshotParams(linked_sandbox=helper.name, ephemeral=True))
    assert "itself linked" in str(refused.value)
    assert cove.sandbox_ids() == before


def test_a_vm_links_to_a_container(cove, sandboxes):
    owner = sandboxes(CreateSandboxFromSnapshotParams(name=unique("vm-owner")))
    serve(owner, "for-the-vm")
    machine = sandboxes(
        CreateSandboxFromSnapshotParams(snapshot=VM_SNAPSHOT, linked_sandbox=owner.name, ephemeral=True),
        timeout=VM_TIMEOUT,
    )
    assert cove.request("GET", f"/sandbox/{machine.id}").json()["linkedSandboxId"] == owner.id
    assert wait_until(lambda: fetch(machine, owner.name) == "for-the-vm", 30)
    assert resolve(owner, machine.name).count(".") == 3
