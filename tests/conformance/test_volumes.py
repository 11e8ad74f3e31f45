"""Volumes: directories that outlive sandboxes, mounted into them at create and
shared between them (issue 5)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from daytona import CreateSandboxFromSnapshotParams, DaytonaError, SandboxState, VolumeMount

from conftest import unique


@pytest.fixture
def volume(daytona, cove):
    made = daytona.volume.get(unique("vol"), create=True)
    yield made
    cove.request("DELETE", f"/volumes/{made.id}")


def with_volume(sandboxes, volume_id: str, mount_path: str = "/data", subpath: str | None = None):
    return sandboxes(
        CreateSandboxFromSnapshotParams(
            volumes=[VolumeMount(volume_id=volume_id, mount_path=mount_path, subpath=subpath)]
        )
    )


def test_a_volume_written_by_one_sandbox_is_read_by_another(daytona, sandboxes, volume):
    assert volume.state == "ready"
    writer = with_volume(sandboxes, volume.id)
    writer.fs.upload_file(b"shared", "/data/hello.txt")
    # By name as well as by id.
    reader = with_volume(sandboxes, volume.name, mount_path="/mnt/shared")
    assert reader.fs.download_file("/mnt/shared/hello.txt") == b"shared"
    # Live: a write in one shows in the other at once.
    reader.process.exec("echo back > /mnt/shared/reply.txt")
    assert writer.process.exec("cat /data/reply.txt").result.strip() == "back"
    assert writer.volumes[0].mount_path == "/data"


def test_a_volume_outlives_its_sandboxes(daytona, sandboxes, volume):
    first = with_volume(sandboxes, volume.id)
    first.process.exec("mkdir -p /data/keep && echo kept > /data/keep/file")
    daytona.delete(first, wait=True)
    second = with_volume(sandboxes, volume.id)
    assert second.process.exec("cat /data/keep/file").result.strip() == "kept"
    assert daytona.volume.get(volume.name).id == volume.id
    assert volume.id in [v.id for v in daytona.volume.list()]


def test_a_subpath_mounts_only_that_directory(sandboxes, volume):
    whole = with_volume(sandboxes, volume.id)
    whole.process.exec("echo top > /data/top.txt")
    part = with_volume(sandboxes, volume.id, mount_path="/work", subpath="projects/a")
    part.process.exec("echo inside > /work/in.txt")
    assert part.process.exec("ls /work").result.split() == ["in.txt"]
    assert whole.process.exec("cat /data/projects/a/in.txt").result.strip() == "inside"


def test_a_volume_in_use_cannot_be_deleted(cove, daytona, sandboxes, volume):
    user = with_volume(sandboxes, volume.id)
    reply = cove.request("DELETE", f"/volumes/{volume.id}")
    assert reply.status_code == 409, reply.text
    assert user.name in reply.json()["message"]
    daytona.delete(user, wait=True)
    assert cove.request("DELETE", f"/volumes/{volume.id}").status_code == 200
    assert cove.request("GET", f"/volumes/{volume.id}").status_code == 404


def test_volume_errors(cove, daytona, sandboxes, volume):
    before = cove.sandbox_ids()
    for mount_path, expected in [("relative", 400), ("/", 400), ("/proc/x", 400), ("/a/../etc", 400)]:
        reply = cove.request(
            "POST", "/sandbox", json={"volumes": [{"volumeId": volume.id, "mountPath": mount_path}]}
        )
        assert reply.status_code == expected, (mount_path, reply.text)
        assert "mountPath" in reply.json()["message"]
    reply = cove.request(
        "POST", "/sandbox", json={"volumes": [{"volumeId": volume.id, "mountPath": "/d", "subpath": "../x"}]}
    )
    assert reply.status_code == 400, reply.text
    reply = cove.request("POST", "/sandbox", json={"volumes": [{"volumeId": "no-such-volume", "mountPath": "/d"}]})
    assert reply.status_code == 404, reply.text
    assert "no-such-volume" in reply.json()["message"]
    # Nothing half-made was left.
    assert cove.sandbox_ids() == before

    assert cove.request("POST", "/volumes", json={"name": volume.name}).status_code == 409
    assert cove.request("POST", "/volumes", json={"name": "bad name!"}).status_code == 400
    with pytest.raises(DaytonaError):
        daytona.volume.get(unique("missing"))


def test_a_symlink_in_the_sandbox_cannot_redirect_a_mount(cove, sandboxes, volume):
    # A snapshot whose files hold a symlink to a host-looking path.
    source = sandboxes()
    source.process.exec("ln -s /etc /home/daytona/evil")
    name = unique("evil")
    source.stop()
    reply = cove.request("POST", f"/sandbox/{source.id}/snapshot", json={"name": name})
    assert reply.status_code in (200, 201), reply.text
    try:
        before = cove.sandbox_ids()
        reply = cove.request(
            "POST",
            "/sandbox",
            json={"snapshot": name, "volumes": [{"volumeId": volume.id, "mountPath": "/home/daytona/evil/x"}]},
        )
        assert reply.status_code >= 400, reply.text
        assert "symlink" in reply.json()["message"]
        assert cove.sandbox_ids() == before
    finally:
        cove.request("DELETE", f"/sandbox/{source.id}")
        cove.request("DELETE", f"/snapshots/{name}")


def test_a_subpath_that_is_a_symlink_never_reaches_the_host(cove, sandboxes, volume):
    """The attack of issue 16: a sandbox makes `x -> /` in a shared volume, and a
    second sandbox asks for subpath `x`; cove once bound the host's root."""
    attacker = with_volume(sandboxes, volume.id)
    attacker.process.exec("ln -s / /data/x && mkdir -p /data/real && ln -s /etc /data/real/etc")
    before = cove.sandbox_ids()
    # A directory no one has on the host: made through the link, it would appear there.
    probe = f"cove-probe-{uuid.uuid4().hex}"
    for subpath in ["x", "x/var/lib", "real/etc", f"x/tmp/{probe}"]:
        reply = cove.request(
            "POST", "/sandbox", json={"volumes": [{"volumeId": volume.id, "mountPath": "/mnt", "subpath": subpath}]}
        )
        assert reply.status_code == 400, (subpath, reply.text)
        message = reply.json()["message"]
        assert "symlink" in message and volume.name in message and subpath.split("/")[0] in message, message
    # Nothing half-made, and nothing was created through the link on the host.
    assert cove.sandbox_ids() == before
    assert not (Path("/tmp") / probe).exists()


def test_a_subpath_swapped_for_a_symlink_is_refused_at_the_next_start(cove, sandboxes, volume):
    """The same attack after the fact: the victim's subpath becomes a symlink to
    `/` while it is stopped; its next start must not mount the host's root."""
    attacker = with_volume(sandboxes, volume.id)
    victim = with_volume(sandboxes, volume.id, mount_path="/mnt", subpath="y")
    victim.process.exec("echo mine > /mnt/file")
    victim.stop()
    attacker.process.exec("rm -rf /data/y && ln -s / /data/y")
    with pytest.raises(DaytonaError) as refused:
        victim.start(timeout=60)
    assert "symlink" in str(refused.value), str(refused.value)
    # Put the directory back: the victim recovers, seeing the volume only.
    attacker.process.exec("rm /data/y && mkdir /data/y && echo back > /data/y/file")
    reply = cove.request("POST", f"/sandbox/{victim.id}/recover")
    assert reply.status_code == 200, reply.text
    victim.refresh_data()
    assert victim.state == SandboxState.STARTED, victim.state
    assert victim.process.exec("cat /mnt/file").result.strip() == "back"
    assert victim.process.exec("ls /mnt").result.split() == ["file"]
