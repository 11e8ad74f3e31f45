"""Archive (seed 000, issue 5): a stopped sandbox's filesystem moves to object
storage and `start` brings it back; the local copy is gone meanwhile.

The session server archives to a local directory (its default); a second server
archives to an S3-compatible service (moto in server mode on loopback, the
`s3` fixture of conftest), so the S3 path is exercised for real without
leaving the machine.
"""

from __future__ import annotations

import uuid

import requests

from conftest import CoveServer, new_data_dir, remove_data_dir, s3_env


def archive_round_trip(cove: CoveServer, daytona, tag: str) -> None:
    sandbox = daytona.create()
    try:
        sandbox.fs.upload_file(f"kept {tag}".encode(), "kept.txt")
        # A deletion in the writable layer (an overlayfs whiteout) must survive too.
        # (The default user changes the image through sudo, as on Daytona.)
        sandbox.process.exec("sudo rm /etc/motd && sudo mkdir -p /srv/deep/tree && echo x | sudo tee /srv/deep/tree/f")
        sandbox.stop()
        sandbox.archive()
        assert cove.request("GET", f"/sandbox/{sandbox.id}").json()["state"] == "archived"
        # Nothing of its filesystem stays on the host, and no runner holds it.
        assert not (cove.data_dir / "storage" / "sandboxes" / sandbox.id).exists()
        held = cove.request("GET", f"/runners/by-sandbox/{sandbox.id}")
        assert held.status_code == 404 and "archived" in held.json()["message"], held.text

        sandbox.start(timeout=120)
        assert sandbox.fs.download_file("kept.txt") == f"kept {tag}".encode()
        r = sandbox.process.exec("test ! -e /etc/motd && cat /srv/deep/tree/f")
        assert (r.exit_code, r.result.strip()) == (0, "x"), r.result
    finally:
        daytona.delete(sandbox)


def test_archive_to_a_local_directory_and_back(cove, daytona):
    archive_round_trip(cove, daytona, "local")
    # The archive is removed once the sandbox is back (nothing left in it).
    left = [p for p in (cove.data_dir / "archive").rglob("*") if p.is_file()]
    assert left == []


def test_archive_needs_a_stopped_sandbox(cove, sandbox):
    r = cove.request("POST", f"/sandbox/{sandbox.id}/archive")
    assert r.status_code == 409, r.text
    assert "stop it first" in r.json()["message"]
    assert cove.request("GET", f"/sandbox/{sandbox.id}").json()["state"] == "started"


def test_archive_to_s3_compatible_storage(s3):
    endpoint, bucket = s3
    data_dir = new_data_dir()
    server = CoveServer(
        data_dir,
        api_key="cv-" + uuid.uuid4().hex,
        extra_args=("--archive", f"s3://{bucket}/cove", "--no-network"),
        extra_env=s3_env(endpoint),
    )
    server.start()
    try:
        daytona = server.client()
        sandbox = daytona.create()
        try:
            sandbox.fs.upload_file(b"in s3", "s3.txt")
            sandbox.stop()
            sandbox.archive()
            # The object is in the bucket, under the configured prefix.
            listing = requests.get(f"{endpoint}/{bucket}?list-type=2&prefix=cove/", timeout=10).text
            assert f"cove/sandboxes/{sandbox.id}/storage" in listing, listing
            sandbox.start(timeout=120)
            assert sandbox.fs.download_file("s3.txt") == b"in s3"
            listing = requests.get(f"{endpoint}/{bucket}?list-type=2&prefix=cove/", timeout=10).text
            assert sandbox.id not in listing
        finally:
            daytona.delete(sandbox)
    finally:
        server.delete_all()
        server.stop()
        remove_data_dir(data_dir)
