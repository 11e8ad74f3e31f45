"""Sandbox networking (issue 6) through the SDK: each sandbox has its own
network, egress goes only where its policy allows (CIDRs, domains, block all),
never to the host's world (its metadata service, private ranges, its LAN),
changes apply to a running sandbox, sandboxes cannot reach each other, and a
deleted sandbox leaves nothing on the host.

The internet here is the session's fake one (conftest.FakeInternet):
allowed.test and denied.test, each with a web server, behind cove's uplink,
beside a fake metadata service (169.254.169.254) and a private host.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from daytona import CreateSandboxFromSnapshotParams, DaytonaError

CURL = "curl -s -m 3 -o /dev/null -w '%{http_code}' "


def fetch(sandbox, url: str) -> str:
    """The HTTP status the sandbox gets for url, or '000' when it cannot connect."""
    return sandbox.process.exec(CURL + url, timeout=15).result.strip()


def eventually(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)


def test_open_sandbox_reaches_the_internet_through_cove(sandbox, fake_internet):
    assert fetch(sandbox, "http://allowed.test/") == "200"
    assert fetch(sandbox, f"http://{fake_internet.DENIED}/") == "200"
    # DNS is cove's resolver, never the host's.
    resolv = sandbox.process.exec("cat /etc/resolv.conf").result
    assert "nameserver 10.77.0.1" in resolv, resolv


def test_the_metadata_service_and_private_hosts_are_closed(sandbox, sandboxes, fake_internet):
    """The attack: a sandbox asks for the cloud host's credentials, or a host
    on its private network, through the host's NAT."""
    # The fake servers answer where they are, so a refusal below is cove's.
    for address, body in ((fake_internet.METADATA, "metadata"), (fake_internet.PRIVATE, "private")):
        there = subprocess.run(["ip", "netns", "exec", fake_internet.netns, "curl", "-s", "-m", "3",
                                f"http://{address}/"], capture_output=True, text=True)
        assert there.stdout == f"{body} server\n", there
    assert fetch(sandbox, f"http://{fake_internet.ALLOWED}/") == "200"
    result = sandbox.process.exec(f"curl -m 3 http://{fake_internet.METADATA}/", timeout=15)
    assert result.exit_code != 0, result.result
    assert fetch(sandbox, f"http://{fake_internet.PRIVATE}/") == "000"
    # Naming them in an allow list opens nothing.
    listed = sandboxes(CreateSandboxFromSnapshotParams(
        network_allow_list=f"{fake_internet.METADATA}/32,192.168.0.0/16,198.51.100.0/24"))
    assert fetch(listed, f"http://{fake_internet.METADATA}/") == "000"
    assert fetch(listed, f"http://{fake_internet.PRIVATE}/") == "000"
    assert fetch(listed, f"http://{fake_internet.ALLOWED}/") == "200"


def test_block_all(sandboxes):
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(network_block_all=True))
    assert fetch(sandbox, "http://allowed.test/") == "000"
    assert fetch(sandbox, "http://198.51.100.10/") == "000"


def test_cidr_allow_list(sandboxes, fake_internet):
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(network_allow_list="198.51.100.0/24"))
    assert fetch(sandbox, f"http://{fake_internet.ALLOWED}/") == "200"
    assert fetch(sandbox, f"http://{fake_internet.DENIED}/") == "000"


def test_domain_allow_list(sandboxes):
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(domain_allow_list="allowed.test"))
    assert fetch(sandbox, "http://allowed.test/") == "200"
    assert fetch(sandbox, "http://denied.test/") == "000"
    r = sandbox.process.exec("getent hosts denied.test")
    assert r.exit_code != 0, r.result


def test_settings_change_applies_live(sandbox):
    assert fetch(sandbox, "http://allowed.test/") == "200"
    sandbox.update_network_settings(network_block_all=True)
    assert eventually(lambda: fetch(sandbox, "http://allowed.test/") == "000")
    sandbox.update_network_settings(network_block_all=False)
    assert eventually(lambda: fetch(sandbox, "http://allowed.test/") == "200")
    sandbox.update_network_settings(network_allow_list="198.51.100.0/24")
    assert eventually(lambda: fetch(sandbox, "http://203.0.113.10/") == "000")
    assert fetch(sandbox, "http://198.51.100.10/") == "200"


def test_sandboxes_cannot_reach_each_other(sandboxes):
    a = sandboxes()
    b = sandboxes()
    a.process.exec("nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
    address = a.process.exec("hostname -I").result.split()[0]
    assert eventually(lambda: fetch(a, "http://127.0.0.1:8000/") == "200")
    assert fetch(b, f"http://{address}:8000/") == "000"


def test_bad_policies_are_400_naming_them(cove, sandbox):
    before = cove.sandbox_ids()
    r = cove.request("POST", "/sandbox", json={"networkAllowList": "10.0.0.0/33"})
    assert r.status_code == 400, r.text
    assert "10.0.0.0/33" in r.json()["message"]
    r = cove.request("POST", "/sandbox", json={"domainAllowList": "bad domain!"})
    assert r.status_code == 400, r.text
    assert "bad domain!" in r.json()["message"]
    assert cove.sandbox_ids() == before
    with pytest.raises(DaytonaError) as info:
        sandbox.update_network_settings(network_allow_list="not-a-cidr")
    assert info.value.status_code == 400
    assert "not-a-cidr" in str(info.value)


def veth_count() -> int:
    out = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
    return len(out.splitlines())


def test_delete_leaves_no_network_objects(cove, daytona):
    sandbox = daytona.create()
    netns = cove.data_dir / "net" / "netns" / sandbox.id
    assert netns.exists()
    during = veth_count()
    daytona.delete(sandbox)
    assert not netns.exists()
    # The pool keeps a few ready namespaces; the sandbox's own veth is gone.
    assert eventually(lambda: veth_count() <= during)
    tables = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
    assert sandbox.id not in tables
