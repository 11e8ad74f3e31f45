"""Runners: the machines sandboxes run on, in Daytona's `Runner` shape.

A one-machine server is a control plane and one runner: it is listed with
its host and what its sandboxes hold, every sandbox names it, and the
operator can drain it or take it out of scheduling, which keeps new
sandboxes off it (refused with 503 while no other runner can take them)
and leaves the ones it holds running.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import shutil
import signal
import subprocess
import tarfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
import requests
from daytona import (
    CreateSandboxFromSnapshotParams, DaytonaError, ListSandboxesQuery, SessionExecuteRequest,
)

from conftest import (
    CoveServer, cove_binary, free_port, images_dir, kill_sandbox_processes, new_data_dir,
    remove_data_dir, s3_env, unique, wait_until,
)

# What Daytona's `Runner` requires.
REQUIRED = {
    "apiVersion", "cpu", "createdAt", "disk", "id", "memory", "name", "region",
    "runnerClass", "state", "tags", "unschedulable", "updatedAt", "version",
}


def runners(cove: CoveServer) -> list[dict]:
    r = cove.request("GET", "/runners")
    assert r.status_code == 200, r.text
    return r.json()


def the_runner(cove: CoveServer) -> dict:
    found = runners(cove)
    assert len(found) == 1, found
    return found[0]


def unschedulable(cove: CoveServer, runner_id: str, value: bool) -> dict:
    r = cove.request("PATCH", f"/runners/{runner_id}/scheduling", json={"unschedulable": value})
    assert r.status_code == 200, r.text
    assert r.json()["unschedulable"] is value
    return r.json()


def admin(cove: CoveServer, *args: str) -> str:
    done = subprocess.run(
        [str(cove_binary()), "admin", *args, "--url", cove.api_url, "--api-key", cove.api_key],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def memory_gib() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) >> 20
    raise AssertionError("no MemTotal")


def test_the_servers_runner_is_listed_with_its_host_and_what_it_holds(cove, sandboxes):
    runner = the_runner(cove)
    assert REQUIRED <= runner.keys(), REQUIRED - runner.keys()
    # Its id is kept in the data directory, so a restart is the same runner.
    assert runner["id"] == (cove.data_dir / "runner-id").read_text().strip()
    uuid.UUID(runner["id"])
    assert runner["state"] == "ready"
    assert runner["region"] == "us"
    assert (runner["draining"], runner["unschedulable"]) == (False, False)
    assert runner["cpu"] == os.cpu_count()
    assert runner["memory"] == memory_gib()
    assert runner["disk"] > 0
    assert runner["sandboxClasses"] == ["container", "linux-vm"]
    # How its VMs execute: TCG on this machine, KVM where the host has it.
    assert runner["accelerator"] in ("kvm", "tcg"), runner
    assert runner["sandboxClass"] == "container"
    assert 0 <= runner["currentMemoryUsagePercentage"] <= 100

    sandbox = sandboxes(CreateSandboxFromSnapshotParams(name=unique("placed")))
    assert sandbox.runner_id == runner["id"]
    held = cove.request("GET", f"/runners/by-sandbox/{sandbox.id}")
    assert held.status_code == 200, held.text
    assert held.json()["id"] == runner["id"]
    after = the_runner(cove)
    # Counted from the sandboxes' rows when asked: one more, with its size.
    grew = {
        field: after[field] - runner[field]
        for field in ("currentAllocatedCpu", "currentAllocatedMemoryGiB",
                      "currentAllocatedDiskGiB", "currentStartedSandboxes", "sandboxes")
    }
    assert grew == {
        "currentAllocatedCpu": sandbox.cpu,
        "currentAllocatedMemoryGiB": sandbox.memory,
        "currentAllocatedDiskGiB": sandbox.disk,
        "currentStartedSandboxes": 1,
        "sandboxes": 1,
    }, grew
    # It reports its host every few seconds.
    assert wait_until(lambda: the_runner(cove)["lastChecked"] != after["lastChecked"], 20), after

    table = admin(cove, "runners")
    rows = [line.split() for line in table.splitlines()]
    assert rows[0][0] == "ID"
    assert rows[1][:4] == [runner["id"], runner["name"], "ready", "on"], table


def test_runners_are_the_operators(cove):
    r = cove.request("POST", "/api-keys", json={
        "name": unique("member"),
        "permissions": ["write:sandboxes", "delete:sandboxes", "write:snapshots"],
    })
    assert r.status_code == 201, r.text
    member = {"Authorization": f"Bearer {r.json()['value']}"}
    runner_id = the_runner(cove)["id"]
    for method, path, body in [
        ("GET", "/runners", None),
        ("GET", f"/runners/{runner_id}", None),
        ("GET", "/runners/by-sandbox/anything", None),
        ("PATCH", f"/runners/{runner_id}/draining", {"draining": True}),
    ]:
        refused = cove.request(method, path, headers=dict(member), json=body)
        assert refused.status_code == 403, (path, refused.text)
        assert "operator" in refused.json()["message"]
        assert cove.request(method, path, auth=False, json=body).status_code == 401
    assert the_runner(cove)["draining"] is False


def test_unknown_runners_bad_switches_and_what_is_not_served(cove):
    missing = unique("no-such-runner")
    for method, path in [("GET", f"/runners/{missing}"), ("PATCH", f"/runners/{missing}/draining")]:
        r = cove.request(method, path, json={"draining": True})
        assert r.status_code == 404, r.text
        assert missing in r.json()["message"]
    gone = unique("no-such-sandbox")
    r = cove.request("GET", f"/runners/by-sandbox/{gone}")
    assert r.status_code == 404 and gone in r.json()["message"], r.text

    runner_id = the_runner(cove)["id"]
    for which, body in [
        ("draining", {"draining": "yes"}),
        ("draining", {}),
        ("scheduling", {"unschedulable": 1}),
        ("scheduling", {"unschedulable": False, "extra": True}),
    ]:
        r = cove.request("PATCH", f"/runners/{runner_id}/{which}", json=body)
        assert r.status_code == 400, (body, r.text)
    runner = the_runner(cove)
    assert (runner["draining"], runner["unschedulable"]) == (False, False)

    # The server's own runner cannot be deleted; what a runner asks of its
    # control plane takes a runner's token, not the operator's key.
    r = cove.request("DELETE", f"/runners/{runner_id}")
    assert r.status_code == 409 and "this server's own" in r.json()["message"], r.text
    for method, path in [("GET", "/runners/me"), ("POST", "/runners/healthcheck")]:
        r = cove.request(method, path, json={"appVersion": "1"})
        assert r.status_code == 401 and "runner token" in r.json()["message"], r.text
    # Not served yet: named, 501.
    for method, path in [
        ("GET", f"/runners/{runner_id}/full"),
        ("GET", "/runners/by-snapshot-ref?ref=x"),
    ]:
        r = cove.request(method, path)
        assert r.status_code == 501, (method, path, r.text)
        assert "/runners" in r.json()["message"]


def add_runner(cove: CoveServer, name: str, *tags: str) -> tuple[str, str]:
    """Registers a runner with `cove admin add-runner`: its id and token."""
    said = admin(cove, "add-runner", name, *(arg for tag in tags for arg in ("--tag", tag)))
    runner_id = said.split("registered: ")[1].split()[0]
    token = said.split("shown this once: ")[1].split()[0]
    assert token.startswith("cove_runner_"), said
    return runner_id, token


def start_runner(cove: CoveServer, token: str, data_dir) -> subprocess.Popen:
    """`cove runner` with `token` in its environment (not its arguments),
    without the operator's key."""
    env = {k: v for k, v in os.environ.items() if k not in ("COVE_API_KEY", "DAYTONA_API_KEY")}
    env["COVE_RUNNER_TOKEN"] = token
    return subprocess.Popen(
        [str(cove_binary()), "runner", "--control", cove.api_url,
         "--data-dir", str(data_dir), "--no-vm"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def serving_runner(cove: CoveServer, token: str, data_dir, cgroup_parent: str,
                   network: tuple[str, ...], userns_pool: str = "2147483648:64",
                   extra_env: dict[str, str] | None = None,
                   control: str | None = None,
                   images: Path | None = None) -> subprocess.Popen:
    """`cove runner --listen`: it serves containers on a loopback port, its
    sandboxes' user namespaces (`userns_pool`), cgroups and `network` (its
    flags, and any other) apart from the server's. It reports to `control`
    (default: the server's plain API URL) and keeps images in `images`
    (default: the shared images directory, which holds the server's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COVE_API_KEY", "DAYTONA_API_KEY")}
    env.update(extra_env or {})
    env["COVE_RUNNER_TOKEN"] = token
    env.setdefault("RUST_LOG", "info")
    return subprocess.Popen(
        [str(cove_binary()), "runner", "--control", control or cove.api_url, "--data-dir", str(data_dir),
         "--no-vm", "--listen", "127.0.0.1:0", "--images-dir", str(images or images_dir()),
         "--storage-size-gib", "8", "--userns-pool", userns_pool,
         "--cgroup-parent", cgroup_parent, *network],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def end(process: subprocess.Popen | None, server: CoveServer, *data_dirs) -> None:
    """Ends a runner still running (asked first, so it takes down what it
    made: its sandboxes, network and storage), stops the test's own server,
    and removes the data directories (unmounting their storage)."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    try:
        server.stop()
    finally:
        for data_dir in data_dirs:
            remove_data_dir(data_dir)


def end_all(processes: list[subprocess.Popen], server: CoveServer, data_dirs, parents) -> None:
    """`end` for several runners, then their cgroup parents."""
    for process in processes:
        end(process, server)
    for data_dir in data_dirs:
        remove_data_dir(data_dir)
    for parent in parents:
        remove_cgroup_parent(parent)


def remove_cgroup_parent(parent: str) -> None:
    """Removes a runner's cgroup parent in every hierarchy, with whatever a
    test that failed midway left in it: its sandboxes' processes are
    killed and their cgroups removed first."""
    for sandbox in {Path(c).name for c in glob.glob(f"/sys/fs/cgroup/*/{parent}/*/")}:
        kill_sandbox_processes(sandbox, parent)
    for cgroup in glob.glob(f"/sys/fs/cgroup/*/{parent}/*/") + glob.glob(f"/sys/fs/cgroup/*/{parent}"):
        for _ in range(50):
            if subprocess.run(["rmdir", cgroup], capture_output=True).returncode == 0 \
                    or not os.path.exists(cgroup):
                break
            time.sleep(0.1)


def state(cove: CoveServer, runner_id: str) -> str:
    r = cove.request("GET", f"/runners/{runner_id}")
    assert r.status_code == 200, r.text
    return r.json()["state"]


def test_a_runner_on_another_machine_checks_in_reports_and_ends_when_deleted(cove, sandboxes, tmp_path):
    """`cove runner` with the token `cove admin add-runner` printed: it
    checks in, reports its host every few seconds, is listed with it, and
    ends when the operator deletes it. No sandbox is placed on it yet."""
    name = unique("node")
    runner_id, token = add_runner(cove, name, "rack-2")
    process = None
    try:
        registered = cove.request("GET", f"/runners/{runner_id}").json()
        assert (registered["name"], registered["state"]) == (name, "initializing"), registered
        assert registered["tags"] == ["rack-2"]

        data_dir = tmp_path / "runner"
        process = start_runner(cove, token, data_dir)
        assert wait_until(lambda: state(cove, runner_id) == "ready", 30), registered
        runner = cove.request("GET", f"/runners/{runner_id}").json()
        assert runner["cpu"] == os.cpu_count()
        assert runner["memory"] == memory_gib()
        assert runner["disk"] > 0
        assert runner["sandboxClasses"] == ["container"] and runner["accelerator"] is None, runner
        assert runner["sandboxes"] == 0 and runner["currentSnapshotCount"] == 0, runner
        assert data_dir.stat().st_mode & 0o777 == 0o700
        # The token is the runner's, for its own routes only.
        as_runner = {"Authorization": f"Bearer {token}"}
        me = cove.request("GET", "/runners/me", headers=dict(as_runner))
        assert me.status_code == 200 and me.json()["id"] == runner_id, me.text
        assert cove.request("GET", "/sandbox", headers=dict(as_runner)).status_code == 401
        assert cove.request("GET", "/runners", headers=dict(as_runner)).status_code == 401
        # It reports again.
        assert wait_until(
            lambda: cove.request("GET", f"/runners/{runner_id}").json()["lastChecked"]
            != runner["lastChecked"], 20)
        rows = [line.split() for line in admin(cove, "runners").splitlines()]
        assert [runner_id, name, "ready", "on"] in [row[:4] for row in rows], rows

        # New sandboxes stay on the server's own runner: this runner does
        # not serve (no --listen).
        placed = sandboxes(CreateSandboxFromSnapshotParams(name=unique("here")))
        assert placed.runner_id != runner_id

        # A name is one runner's.
        taken = cove.request("POST", "/runners", json={"name": name})
        assert taken.status_code == 409 and name in taken.json()["message"], taken.text

        said = admin(cove, "remove-runner", runner_id)
        assert runner_id in said, said
        assert process.wait(timeout=30) != 0
        assert "no longer knows this runner" in process.stderr.read()
        gone = cove.request("GET", f"/runners/{runner_id}")
        assert gone.status_code == 404, gone.text
        assert cove.request("GET", "/runners/me", headers=dict(as_runner)).status_code == 401
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        cove.request("DELETE", f"/runners/{runner_id}")


def test_a_runner_killed_is_shown_unresponsive_and_comes_back_as_itself(tmp_path):
    """kill -9 of a runner: its record stays, it is shown unresponsive once
    silent past --runner-silence, and started again with its token it is the
    same runner, ready, with no second record."""
    data_dir = new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex,
                        extra_args=("--no-network", "--runner-silence", "10"))
    process = None
    try:
        server.start()
        runner_id, token = add_runner(server, unique("node"), "rack-3")
        process = start_runner(server, token, tmp_path / "runner")
        assert wait_until(lambda: state(server, runner_id) == "ready", 30)
        before = server.request("GET", f"/runners/{runner_id}").json()

        process.kill()
        process.wait()
        assert wait_until(lambda: state(server, runner_id) == "unresponsive", 30)
        silent = server.request("GET", f"/runners/{runner_id}").json()
        for field in ("name", "tags", "cpu", "memory", "disk", "sandboxClasses", "createdAt"):
            assert silent[field] == before[field], (field, silent, before)
        rows = [line.split() for line in admin(server, "runners").splitlines()]
        assert [runner_id, before["name"], "unresponsive"] in [row[:3] for row in rows], rows

        process = start_runner(server, token, tmp_path / "runner")
        assert wait_until(lambda: state(server, runner_id) == "ready", 30)
        assert [r["id"] for r in runners(server)].count(runner_id) == 1
        assert len(runners(server)) == 2, runners(server)
    finally:
        end(process, server, data_dir)


def labelled(daytona, labels: dict[str, str]) -> list[str]:
    return [sandbox.id for sandbox in daytona.list(ListSandboxesQuery(labels=labels))]


def refused_create(daytona, labels: dict[str, str]) -> str:
    with pytest.raises(DaytonaError) as info:
        daytona.create(CreateSandboxFromSnapshotParams(labels=labels), timeout=60)
    assert info.value.status_code == 503, info.value
    return str(info.value)


def test_a_drained_runner_takes_no_new_sandbox_keeps_its_own_and_stays_drained(own_server):
    daytona = own_server.client()
    kept = daytona.create(CreateSandboxFromSnapshotParams(name=unique("kept")), timeout=120)
    runner_id = the_runner(own_server)["id"]

    said = admin(own_server, "drain", runner_id)
    assert "draining" in said and runner_id in said and "1 sandboxes" in said, said
    refused = {"refused": unique("r")}
    message = refused_create(daytona, refused)
    assert "draining" in message and runner_id in message, message
    assert f"cove admin drain {runner_id} --undo" in message, message
    assert labelled(daytona, refused) == []
    # What it holds goes on: commands, and a stop and a start on it.
    assert kept.process.exec("echo still").result.strip() == "still"
    kept.stop(timeout=60)
    kept.start(timeout=60)
    assert kept.process.exec("echo again").result.strip() == "again"

    # A restart is the same runner, still drained: the switch is the
    # operator's, kept in the records.
    own_server.stop()
    own_server.start()
    daytona = own_server.client()  # on the port the server has now
    runner = the_runner(own_server)
    assert runner["id"] == runner_id and runner["draining"] is True, runner
    assert admin(own_server, "runners").splitlines()[1].split()[3] == "draining"
    refused_create(daytona, refused)

    said = admin(own_server, "drain", runner_id, "--undo")
    assert "not draining" in said, said
    assert unschedulable(own_server, runner_id, True)["draining"] is False
    message = refused_create(daytona, refused)
    assert "unschedulable" in message and runner_id in message, message
    assert labelled(daytona, refused) == []

    unschedulable(own_server, runner_id, False)
    placed = daytona.create(CreateSandboxFromSnapshotParams(labels=refused), timeout=120)
    assert placed.runner_id == runner_id
    assert labelled(daytona, refused) == [placed.id]


def cgroups_of(parent: str, sandbox_id: str) -> list[str]:
    """The host cgroups of a container on a runner, in any hierarchy."""
    return glob.glob(f"/sys/fs/cgroup/**/{parent}/{sandbox_id}", recursive=True)


def read_until(handle, needle: str) -> str:
    output = bytearray()
    deadline = time.monotonic() + 20
    while needle.encode() not in output and time.monotonic() < deadline:
        handle.wait(on_data=output.extend, timeout=0.3)
    assert needle.encode() in output, output
    return output.decode(errors="replace")


def probe_command(port: int) -> str:
    """A command that succeeds once a web server answers on `port` inside the sandbox."""
    return f"python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/page.txt')\""


def reaches_the_internet(sandbox) -> bool:
    web = sandbox.process.exec("curl -s --max-time 3 http://allowed.test/")
    return web.result.strip() == "allowed server"


def reaches_it_through_the_runner(server: CoveServer, sandbox) -> None:
    """A PTY, a preview and SSH: each reaches the agent through the runner."""
    handle = sandbox.process.create_pty_session(unique("pty"))
    try:
        handle.send_input('echo "[$((6*7))]"\n')
        read_until(handle, "[42]")
    finally:
        handle.disconnect()

    assert sandbox.process.exec("mkdir -p /tmp/site").exit_code == 0
    sandbox.fs.upload_file(b"served from a runner\n", "/tmp/site/page.txt")
    sandbox.process.create_session("web")
    sandbox.process.execute_session_command("web", SessionExecuteRequest(
        command="cd /tmp/site && python3 -m http.server --bind 127.0.0.1 8123", run_async=True))
    assert wait_until(lambda: sandbox.process.exec(probe_command(8123)).exit_code == 0, 30)
    preview = sandbox.get_preview_link(8123)
    r = requests.get(f"{preview.url}/page.txt", headers={"X-Daytona-Preview-Token": preview.token}, timeout=10)
    assert (r.status_code, r.text) == (200, "served from a runner\n"), r.text

    assert shutil.which("ssh"), "the system ssh client (scripts/setup installs openssh-client)"
    token = sandbox.create_ssh_access(expires_in_minutes=5).token
    done = subprocess.run(
        ["ssh", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-p", str(server.ssh_port),
         f"{token}@127.0.0.1", "echo via-$((40+2))"],
        stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, b"via-42"), done.stderr


def test_a_runner_elsewhere_runs_the_containers_placed_on_it(fake_internet):
    """With the server's own runner drained, a create goes to a runner that
    serves (`cove runner --listen`): the runner runs the container;
    commands, files, a PTY, a preview and SSH reach it through the runner,
    and it reaches the (fake) internet through the runner's own network;
    a restart of the control plane takes it back as it runs; it stops and
    starts with its files there. Killed with SIGKILL, the
    runner loses nothing: its sandbox is shown in error naming it, and once
    the runner is back it starts there with its files. Deleted, it leaves
    nothing on the runner."""
    data_dir = new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=("--no-network",))
    process = None
    runner_dir = new_data_dir()
    parent = "cove-test-" + uuid.uuid4().hex[:8]
    # The runner's own bridge, range and routes, out through the test's
    # fake internet.
    network = ("--bridge", "cvr" + uuid.uuid4().hex[:4], "--network-range", "10.76.0.0/16",
               "--route-table", "7760", *fake_internet.server_args())
    try:
        server.start()
        runner_id, token = add_runner(server, unique("node"))
        process = serving_runner(server, token, runner_dir, parent, network)
        assert wait_until(lambda: state(server, runner_id) == "ready", 60)
        me = server.request("GET", "/runners/me", headers={"Authorization": f"Bearer {token}"}).json()
        service = me["apiUrl"]
        assert service.startswith("http://127.0.0.1:"), me
        # The runner's service takes its own key only: not the runner's
        # token, not the operator's key.
        for key in (None, token, server.api_key):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert requests.get(f"{service}/sandboxes/x", headers=headers, timeout=10).status_code == 401

        local = next(r["id"] for r in runners(server) if r["id"] != runner_id)
        admin(server, "drain", local)
        daytona = server.client()
        sandbox = daytona.create(CreateSandboxFromSnapshotParams(name=unique("there")), timeout=120)
        assert sandbox.runner_id == runner_id
        assert cgroups_of(parent, sandbox.id), "the runner's cgroup of the sandbox"
        assert sandbox.process.exec("echo from elsewhere").result.strip() == "from elsewhere"
        sandbox.fs.upload_file(b"kept on the runner", "kept.txt")
        assert sandbox.fs.download_file("kept.txt") == b"kept on the runner"
        assert server.request("GET", f"/runners/by-sandbox/{sandbox.id}").json()["id"] == runner_id
        reaches_it_through_the_runner(server, sandbox)
        # Its network is the runner's: an address of the runner's range, the
        # (fake) internet by name, and the host's world closed as on a server.
        assert "10.76." in sandbox.process.exec("hostname -I").result
        web = sandbox.process.exec("curl -s --max-time 10 http://allowed.test/")
        assert web.result.strip() == "allowed server", web.result
        metadata = sandbox.process.exec(f"curl -s --max-time 3 http://{fake_internet.METADATA}/")
        assert metadata.exit_code != 0, metadata.result
        # Its policy is the runner's to apply: at once, and at every start.
        sandbox.update_network_settings(network_block_all=True)
        assert wait_until(lambda: not reaches_the_internet(sandbox), 20)

        # The control plane restarts; the runner does not. Once the runner
        # reports again, its sandbox is taken over as it runs: the web
        # server started before is still serving.
        server.stop()
        server.start(keep_ports=True)
        daytona = server.client()
        sandbox = daytona.get(sandbox.id)

        def taken_back() -> bool:
            try:
                return sandbox.process.exec("echo back").result.strip() == "back"
            except DaytonaError:
                return False

        assert wait_until(taken_back, 60)
        assert sandbox.state == "started"
        assert sandbox.process.exec(probe_command(8123)).exit_code == 0

        sandbox.stop(timeout=60)
        assert sandbox.state == "stopped"
        assert not cgroups_of(parent, sandbox.id)
        sandbox.start(timeout=60)
        assert sandbox.fs.download_file("kept.txt") == b"kept on the runner"
        assert sandbox.process.exec("echo again").result.strip() == "again"
        assert not reaches_the_internet(sandbox), "blocked still, after a start"
        sandbox.update_network_settings(network_block_all=False)
        assert wait_until(lambda: reaches_the_internet(sandbox), 20)

        def in_error() -> bool:
            sandbox.refresh_data()
            return sandbox.state == "error"

        # Ended by itself (each of its processes killed from the host), it
        # shows error, and its port on the runner's network goes back at
        # once; recovered, it has one again.
        pinned = runner_dir / "net" / "netns" / sandbox.id
        assert pinned.exists()
        assert kill_sandbox_processes(sandbox.id, parent), "the container's processes"
        assert wait_until(in_error, 30), sandbox.state
        assert wait_until(lambda: not pinned.exists(), 20)
        sandbox.recover(timeout=60)
        assert pinned.exists()
        assert wait_until(lambda: reaches_the_internet(sandbox), 20)

        # kill -9 of the runner: the sandbox's record stays; once the
        # runner is back (with a new port and key), it says the sandbox no
        # longer runs, and a recover brings it back there with its files.
        process.kill()
        process.wait()
        process = serving_runner(server, token, runner_dir, parent, network)
        assert wait_until(in_error, 60), sandbox.state
        assert "no longer runs it" in sandbox.error_reason, sandbox.error_reason
        sandbox.recover(timeout=60)
        assert sandbox.runner_id == runner_id
        assert sandbox.fs.download_file("kept.txt") == b"kept on the runner"

        sandbox.delete()
        assert not cgroups_of(parent, sandbox.id)
        assert os.listdir(runner_dir / "storage" / "sandboxes") == []

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stderr.read()
        with open("/proc/self/mounts") as mounts:
            assert str(runner_dir / "storage") not in mounts.read()
    finally:
        end(process, server, data_dir, runner_dir)
        remove_cgroup_parent(parent)


def runner_of(server: CoveServer, sandbox_id: str) -> str:
    r = server.request("GET", f"/sandbox/{sandbox_id}")
    assert r.status_code == 200, r.text
    return r.json().get("runnerId")


def in_bucket(endpoint: str, bucket: str, sandbox_id: str) -> bool:
    listing = requests.get(f"{endpoint}/{bucket}?list-type=2&prefix=cove/", timeout=10).text
    return f"cove/sandboxes/{sandbox_id}/storage" in listing


class SharingAnArchive:
    """A server of the test's own and two runners elsewhere (`a`, `b`),
    all naming one S3 archive; the server's own runner (`local`) and `b`
    drained."""

    def __init__(self, server: CoveServer, dirs: list[Path], parents: list[str],
                 processes: list[subprocess.Popen], endpoint: str, bucket: str):
        self.server, self.dirs, self.parents = server, dirs, parents
        self.endpoint, self.bucket = endpoint, bucket
        archive = ("--archive", f"s3://{bucket}/cove")
        # Apart from each other's user namespaces too.
        pools = ["2147483648:64", "2151677952:64"]
        ids = []
        for n, (runner_dir, parent, pool) in enumerate(zip(dirs, parents, pools)):
            runner_id, token = add_runner(server, unique(f"node{n}"))
            ids.append(runner_id)
            processes.append(serving_runner(server, token, runner_dir, parent,
                                            ("--no-network", *archive), pool, s3_env(endpoint)))
        self.processes = processes
        self.a, self.b = ids
        assert wait_until(lambda: all(state(server, r) == "ready" for r in ids), 60)
        self.local = next(r["id"] for r in runners(server) if r["id"] not in ids)
        admin(server, "drain", self.local)
        admin(server, "drain", self.b)

    def in_bucket(self, sandbox_id: str) -> bool:
        return in_bucket(self.endpoint, self.bucket, sandbox_id)

    def end(self) -> None:
        """Asks each runner to end, as a stop of the machine would."""
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0, process.stderr.read()


@contextlib.contextmanager
def sharing_an_archive(s3: tuple[str, str]) -> Iterator[SharingAnArchive]:
    """`SharingAnArchive`, taken down afterwards with everything it made."""
    endpoint, bucket = s3
    data_dir = new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex,
                        extra_args=("--no-network", "--archive", f"s3://{bucket}/cove"),
                        extra_env=s3_env(endpoint))
    dirs = [new_data_dir(), new_data_dir()]
    parents = ["cove-test-" + uuid.uuid4().hex[:8] for _ in dirs]
    processes: list[subprocess.Popen] = []
    try:
        server.start()
        yield SharingAnArchive(server, dirs, parents, processes, endpoint, bucket)
    finally:
        end_all(processes, server, [data_dir, *dirs], parents)


def test_a_stopped_sandbox_moves_between_runners_through_the_archive(s3):
    """Two runners elsewhere and the server share one S3 archive. A sandbox
    stopped on runner A, once A is drained, starts on runner B with its
    files: A sends its storage to the archive and B fetches it, so its
    bytes never pass through the control plane. Archived on B, it starts
    on the server's own runner, and there again with every runner drained.
    Deleted, nothing is left anywhere."""
    with sharing_an_archive(s3) as two:
        server, a, b, local, dirs, parents = two.server, two.a, two.b, two.local, two.dirs, two.parents
        daytona = server.client()
        sandbox = daytona.create(CreateSandboxFromSnapshotParams(name=unique("mover")), timeout=120)
        assert sandbox.runner_id == a
        sandbox.fs.upload_file(b"made on A", "kept.txt")
        # A deletion in the writable layer moves too.
        assert sandbox.process.exec("sudo rm /etc/motd").exit_code == 0
        sandbox.stop(timeout=60)

        # A drained: the start moves it to B, through the archive.
        admin(server, "drain", a)
        admin(server, "drain", b, "--undo")
        sandbox.start(timeout=120)
        # (The SDK reads runnerId once, at creation.)
        assert (sandbox.state, runner_of(server, sandbox.id)) == ("started", b)
        assert sandbox.fs.download_file("kept.txt") == b"made on A"
        assert sandbox.process.exec("test ! -e /etc/motd").exit_code == 0
        assert cgroups_of(parents[1], sandbox.id) and not cgroups_of(parents[0], sandbox.id)
        assert os.listdir(dirs[0] / "storage" / "sandboxes") == []
        assert not two.in_bucket(sandbox.id), "removed once it is back"

        # Archived on B, it is in the bucket and on no runner's disk; it
        # starts on the runner that can take it: the server's own.
        sandbox.fs.upload_file(b"changed on B", "kept.txt")
        sandbox.stop(timeout=60)
        sandbox.archive()
        assert server.request("GET", f"/sandbox/{sandbox.id}").json()["state"] == "archived"
        assert two.in_bucket(sandbox.id)
        assert os.listdir(dirs[1] / "storage" / "sandboxes") == []
        admin(server, "drain", b)
        admin(server, "drain", local, "--undo")
        sandbox.start(timeout=120)
        assert (sandbox.state, runner_of(server, sandbox.id)) == ("started", local)
        assert sandbox.fs.download_file("kept.txt") == b"changed on B"
        assert not two.in_bucket(sandbox.id)

        # With every runner drained, a start from the archive brings it back
        # on the server's own runner, as a stopped sandbox starts where it is.
        sandbox.stop(timeout=60)
        sandbox.archive()
        assert runner_of(server, sandbox.id) is None, "in the archive, on no runner"
        admin(server, "drain", local)
        sandbox.start(timeout=120)
        assert (sandbox.state, runner_of(server, sandbox.id)) == ("started", local)
        assert sandbox.fs.download_file("kept.txt") == b"changed on B"
        sandbox.stop(timeout=60)
        sandbox.archive()
        assert two.in_bucket(sandbox.id)

        # Deleted from the archive: nothing is left in the bucket or on a runner.
        sandbox.delete()
        assert not two.in_bucket(sandbox.id)
        for runner_dir in dirs:
            assert os.listdir(runner_dir / "storage" / "sandboxes") == []
        two.end()


def test_a_sandbox_of_a_snapshot_moves_between_runners_through_the_archive(s3):
    """A snapshot taken of a sandbox on runner A, and a sandbox of it there
    that writes more: stopped, with A drained, it starts on runner B through
    the archive, which holds only what it wrote itself; B fetches the
    snapshot's captured layer from the control plane (which received it
    from A when the snapshot was taken), so the sandbox has both. Archived
    again, it comes back on the server's own runner, whose own copy of the
    layer it uses."""
    with sharing_an_archive(s3) as two:
        server, a, b, local, dirs = two.server, two.a, two.b, two.local, two.dirs
        daytona = server.client()
        base = daytona.create(CreateSandboxFromSnapshotParams(name=unique("base")), timeout=120)
        assert base.runner_id == a
        assert base.process.exec("echo layer > ~/layer && sudo rm /etc/motd").exit_code == 0
        name = unique("layered")
        base.create_snapshot(name)
        capture = daytona.snapshot.get(name).id
        mover = daytona.create(CreateSandboxFromSnapshotParams(snapshot=name, name=unique("mover")),
                               timeout=120)
        assert mover.runner_id == a
        assert mover.process.exec("echo own > ~/own").exit_code == 0
        mover.stop(timeout=60)

        admin(server, "drain", a)
        admin(server, "drain", b, "--undo")
        mover.start(timeout=120)
        assert (mover.state, runner_of(server, mover.id)) == ("started", b)
        assert mover.process.exec("cat ~/layer ~/own").result == "layer\nown\n"
        assert mover.process.exec("test ! -e /etc/motd").exit_code == 0
        assert (dirs[1] / "storage" / "captures" / capture / "upper").is_dir()
        assert not two.in_bucket(mover.id)

        mover.stop(timeout=60)
        mover.archive()
        admin(server, "drain", b)
        admin(server, "drain", local, "--undo")
        mover.start(timeout=120)
        assert (mover.state, runner_of(server, mover.id)) == ("started", local)
        assert mover.process.exec("cat ~/layer ~/own").result == "layer\nown\n"

        for sandbox in (mover, base):
            sandbox.delete()
        daytona.snapshot.delete(daytona.snapshot.get(name))
        two.end()


class BesideOne:
    """A server of the test's own (no network) and one runner serving
    beside it, the server's own runner drained: the runner's process is
    `process`, replaced by `restart`."""

    def __init__(self, server: CoveServer, runner_dir, parent: str, runner_args: tuple[str, ...],
                 control: str | None = None, images: Path | None = None):
        self.server = server
        self.runner_dir = runner_dir
        self.parent = parent
        self.control = control
        self.images = images
        self.runner_id, self.token = add_runner(server, unique("node"))
        self.process: subprocess.Popen | None = None
        self.restart(runner_args)
        assert wait_until(lambda: state(server, self.runner_id) == "ready", 60)
        self.local = next(r["id"] for r in runners(server) if r["id"] != self.runner_id)
        admin(server, "drain", self.local)

    def restart(self, runner_args: tuple[str, ...] = ("--no-network",)) -> subprocess.Popen:
        """Starts the runner (again) with its token and `runner_args`."""
        self.process = serving_runner(self.server, self.token, self.runner_dir, self.parent,
                                      runner_args, control=self.control, images=self.images)
        return self.process

    def me(self) -> dict:
        """The runner as it sees itself (`GET /runners/me` with its token)."""
        r = self.server.request("GET", "/runners/me", headers={"Authorization": f"Bearer {self.token}"})
        assert r.status_code == 200, r.text
        return r.json()


@contextlib.contextmanager
def beside_one_runner(server_args: tuple[str, ...] = (),
                      runner_args: tuple[str, ...] = ("--no-network",),
                      control: Callable[[CoveServer], str] | None = None,
                      server_images: Path | None = None,
                      runner_images: Path | None = None) -> Iterator[BesideOne]:
    """`BesideOne`, taken down afterwards: the runner asked to end, the
    server stopped, their directories and the runner's cgroups removed. The
    runner reports to `control(server)`, or the server's plain API URL; the
    server and the runner keep images where given, or both in the shared
    images directory."""
    data_dir, runner_dir = new_data_dir(), new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex,
                        extra_args=("--no-network", *server_args), images=server_images)
    parent = "cove-test-" + uuid.uuid4().hex[:8]
    setup = None
    try:
        server.start()
        setup = BesideOne(server, runner_dir, parent, runner_args, control and control(server),
                          runner_images)
        yield setup
    finally:
        end(setup.process if setup else None, server, data_dir, runner_dir)
        remove_cgroup_parent(parent)


def test_a_runner_that_falls_silent_leaves_its_sandboxes_in_error_until_it_is_back():
    """A runner killed with SIGKILL and not started again: once it is
    silent past the server's limit, its sandbox shows `error`, saying so,
    instead of `started`; its record stays whole. Started again, the runner
    is the same one, and a recover brings the sandbox back there with its
    files."""
    with beside_one_runner(("--runner-silence", "10")) as one:
        server, runner_id = one.server, one.runner_id
        daytona = server.client()
        sandbox = daytona.create(CreateSandboxFromSnapshotParams(name=unique("held")), timeout=120)
        assert sandbox.runner_id == runner_id
        sandbox.fs.upload_file(b"kept through the silence", "kept.txt")

        one.process.kill()
        one.process.wait()

        def in_error() -> bool:
            sandbox.refresh_data()
            return sandbox.state == "error"

        assert wait_until(in_error, 60), sandbox.state
        assert "stopped reporting" in sandbox.error_reason, sandbox.error_reason
        assert state(server, runner_id) == "unresponsive"
        assert runner_of(server, sandbox.id) == runner_id

        process = one.restart()
        assert wait_until(lambda: state(server, runner_id) == "ready", 60)
        sandbox.recover(timeout=60)
        assert runner_of(server, sandbox.id) == runner_id
        assert sandbox.fs.download_file("kept.txt") == b"kept through the silence"
        sandbox.delete()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stderr.read()


def certificates(directory: Path, name: str, ip: str) -> tuple[Path, Path, Path]:
    """A throw-away CA, and a certificate it signs for `ip`: the CA's PEM,
    the certificate's and its key's."""
    ca_key, ca, key, request, cert = (directory / f"{name}.{part}" for part in
                                      ("ca.key", "ca.pem", "key", "csr", "pem"))
    extensions = directory / f"{name}.ext"
    extensions.write_text(f"subjectAltName=IP:{ip}\nbasicConstraints=CA:FALSE\n"
                          "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")
    for command in (
        ["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", f"/CN={name} test CA"],
        ["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", key, "-out", request, "-subj", f"/CN={name}"],
        ["x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "1", "-extfile", extensions],
    ):
        done = subprocess.run(["openssl", *map(str, command)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    return ca, cert, key


def test_a_runner_over_tls_is_reached_only_through_it(tmp_path):
    """A control plane given `--runner-ca` and a runner serving with a
    certificate of that CA (`--tls-cert`, `--tls-key`): the runner
    advertises `https://`, and every way into its sandbox (the REST calls,
    commands and files, a PTY, a preview, SSH) goes over TLS, since its
    port speaks nothing else. Its reports (which carry the key it is reached
    with) go to the control plane's HTTPS listener, trusting only that
    listener's CA (`--control-ca`). The same runner with a certificate of
    another CA is not trusted: a create placed on it fails (503, naming the
    certificate) and leaves nothing; told to trust another CA for the
    control plane, it does not check in."""
    ca, cert, key = certificates(tmp_path, "runner", "127.0.0.1")
    control_ca, control_cert, control_key = certificates(tmp_path, "control", "127.0.0.1")
    port = free_port()
    https = ("--tls-listen", f"127.0.0.1:{port}", "--tls-cert", str(control_cert),
             "--tls-key", str(control_key))
    tls = ("--no-network", "--tls-cert", str(cert), "--tls-key", str(key),
           "--control-ca", str(control_ca))
    with beside_one_runner(("--runner-ca", str(ca), *https), tls,
                           control=lambda _: f"https://127.0.0.1:{port}/api") as one:
        server, runner_id = one.server, one.runner_id
        service = one.me()["apiUrl"]
        assert service.startswith("https://127.0.0.1:"), service
        # Its port speaks TLS only, with the certificate the CA vouches for.
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(service.replace("https://", "http://") + "/sandboxes/x", timeout=10)
        answer = requests.get(f"{service}/sandboxes/x", verify=str(ca), timeout=10)
        assert answer.status_code == 401, answer.text

        daytona = server.client()
        sandbox = daytona.create(CreateSandboxFromSnapshotParams(name=unique("sealed")), timeout=120)
        assert runner_of(server, sandbox.id) == runner_id
        assert sandbox.process.exec("echo over-$((6*7))").result.strip() == "over-42"
        sandbox.fs.upload_file(b"sent over TLS", "kept.txt")
        assert sandbox.fs.download_file("kept.txt") == b"sent over TLS"
        reaches_it_through_the_runner(server, sandbox)
        sandbox.stop(timeout=120)
        sandbox.start(timeout=120)
        assert sandbox.fs.download_file("kept.txt") == b"sent over TLS"
        sandbox.delete()
        one.process.send_signal(signal.SIGTERM)
        assert one.process.wait(timeout=60) == 0, one.process.stderr.read()

        # The same runner, with a certificate of a CA the server was not given.
        stranger_ca, stranger, stranger_key = certificates(tmp_path, "stranger", "127.0.0.1")
        process = one.restart(("--no-network", "--tls-cert", str(stranger), "--tls-key", str(stranger_key),
                               "--control-ca", str(control_ca)))
        assert wait_until(lambda: one.me()["apiUrl"] not in (None, service), 60)
        name = unique("refused")
        with pytest.raises(DaytonaError) as refused:
            daytona.create(CreateSandboxFromSnapshotParams(name=name), timeout=120)
        assert refused.value.status_code == 503, refused.value
        assert "invalid peer certificate" in str(refused.value), refused.value
        # Nothing half-made is left of it.
        assert server.request("GET", f"/sandbox/{name}").status_code == 404
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stderr.read()

        # Told to trust another CA for the control plane, it never checks in
        # (so its key is never sent); nor over plain HTTP with that flag.
        process = one.restart(("--no-network", "--tls-cert", str(cert), "--tls-key", str(key),
                               "--control-ca", str(stranger_ca)))
        assert process.wait(timeout=60) != 0
        said = process.stderr.read()
        assert "checking in with the control plane" in said and "certificate" in said, said
        one.control = server.api_url
        process = one.restart(("--no-network", "--control-ca", str(control_ca)))
        assert process.wait(timeout=60) != 0
        said = process.stderr.read()
        assert "--control-ca is for an https:// control plane" in said, said


BUSYBOX = Path("/bin/busybox")


def tiny_default_image(images: Path) -> Path:
    """A default image of a few files under `images`, marked built with the
    shared default image's own marker so a server takes it as it is:
    Debian's static busybox as its shell and tools, the default user, and
    one of each kind of entry an image holds (a symbolic link, a hard link,
    an owner, a mode, an extended attribute). Answers its root."""
    rootfs = images / "debian-bookworm" / "rootfs"
    for directory in ("bin", "etc", "tmp", "root", "home/daytona", "proc", "sys", "dev", "run"):
        (rootfs / directory).mkdir(parents=True, exist_ok=True)
    os.chmod(rootfs / "tmp", 0o1777)
    shutil.copy(BUSYBOX, rootfs / "bin" / "busybox")
    for tool in ("sh", "cat", "ls", "true", "echo", "id", "sleep", "env"):
        os.symlink("busybox", rootfs / "bin" / tool)
    (rootfs / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\ndaytona:x:1000:1000::/home/daytona:/bin/sh\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\ndaytona:x:1000:\n")
    os.chown(rootfs / "home" / "daytona", 1000, 1000)
    tiny = rootfs / "etc" / "cove-tiny"
    tiny.write_text("tiny\n")
    os.chown(tiny, 0, 1000)
    os.chmod(tiny, 0o640)
    os.link(tiny, rootfs / "etc" / "cove-tiny.again")
    os.setxattr(tiny, "user.cove", b"kept")
    marker = images_dir() / "debian-bookworm" / "rootfs" / ".complete"
    (rootfs / ".complete").write_bytes(marker.read_bytes())
    return rootfs


def test_a_runner_without_the_image_fetches_it_from_the_control_plane(tmp_path):
    """A runner whose images directory is empty gets a sandbox placed on it:
    it fetches the sandbox's image from the control plane
    (`GET /runners/me/images/...` with its own token) and runs it. The copy
    is the image as the control plane holds it (owners, modes, links,
    extended attributes), and the next sandbox of it takes that copy. The
    route serves a runner only the images of sandboxes placed on it: before
    the first, and for any other path, its token gets a 404; an API key
    gets a 401, and a path that leaves the images directory a 400. When the
    control plane's image is built again at the same path, the runner's
    next sandbox of it gets the new build. Started again, the runner keeps
    its copy while a sandbox placed on it uses the image, and deletes it
    once none does (`GET /runners/me/images`, its token)."""
    server_images, runner_images = tmp_path / "control", tmp_path / "runner"
    tiny_default_image(server_images)
    with beside_one_runner(server_images=server_images, runner_images=runner_images) as one:
        server = one.server
        as_runner = {"Authorization": f"Bearer {one.token}"}
        image = "/runners/me/images/debian-bookworm/rootfs"

        r = server.request("GET", image, auth=False, headers=as_runner)
        assert r.status_code == 404, r.text
        assert "no sandbox placed on this runner uses" in r.json()["message"], r.text
        r = server.request("GET", image)
        assert r.status_code == 401, r.text
        r = server.request("GET", "/runners/me/images/debian-bookworm/..%2F..%2F..%2Fetc",
                           auth=False, headers=as_runner)
        assert r.status_code == 400, r.text
        assert not runner_images.exists()

        daytona = server.client()
        sandbox = daytona.create(CreateSandboxFromSnapshotParams(name=unique("fetched")), timeout=120)
        assert sandbox.runner_id == one.runner_id
        assert sandbox.process.exec("cat /etc/cove-tiny").result == "tiny\n"
        fetched = runner_images / "debian-bookworm" / "rootfs"
        tiny = os.stat(fetched / "etc" / "cove-tiny")
        assert (tiny.st_uid, tiny.st_gid, tiny.st_mode & 0o7777) == (0, 1000, 0o640)
        assert os.stat(fetched / "etc" / "cove-tiny.again").st_ino == tiny.st_ino
        assert os.getxattr(fetched / "etc" / "cove-tiny", "user.cove") == b"kept"
        assert os.readlink(fetched / "bin" / "sh") == "busybox"
        assert (fetched / "bin" / "busybox").read_bytes() == BUSYBOX.read_bytes()
        assert os.stat(fetched / "home" / "daytona").st_uid == 1000
        assert list((runner_images / ".incoming").iterdir()) == []

        # Now its token gets that image, as a tar, and still no other.
        r = server.request("GET", image, auth=False, headers=as_runner)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/x-tar"
        names = tarfile.open(fileobj=io.BytesIO(r.content)).getnames()
        assert "etc/cove-tiny" in names and "bin/busybox" in names, names
        r = server.request("GET", "/runners/me/images/debian-bookworm", auth=False, headers=as_runner)
        assert r.status_code == 404, r.text

        # The next sandbox of the image takes the runner's copy.
        copy = os.stat(fetched).st_ino
        second = daytona.create(CreateSandboxFromSnapshotParams(name=unique("second")), timeout=120)
        assert second.runner_id == one.runner_id
        assert second.process.exec("cat /etc/cove-tiny").result == "tiny\n"
        assert os.stat(fetched).st_ino == copy

        # The control plane's image is built again at the same path (its
        # marker says another build): the next sandbox there gets the new
        # build, fetched anew, and those running keep the copy they have.
        rebuilt = server_images / "debian-bookworm" / "rootfs"
        (rebuilt / "etc" / "cove-build").write_text("second build\n")
        (rebuilt / ".complete").write_bytes((rebuilt / ".complete").read_bytes() + b"rebuilt\n")
        third = daytona.create(CreateSandboxFromSnapshotParams(name=unique("third")), timeout=120)
        assert third.runner_id == one.runner_id
        assert third.process.exec("cat /etc/cove-build").result == "second build\n"
        assert os.stat(fetched).st_ino != copy
        assert (fetched / ".complete").read_bytes() == (rebuilt / ".complete").read_bytes()
        stale = list((runner_images / ".incoming").glob("*-stale-*"))
        assert len(stale) == 1, stale
        assert second.process.exec("cat /etc/cove-tiny").result == "tiny\n"
        assert second.process.exec("test -e /etc/cove-build || echo old").result == "old\n"

        # Its token lists the images its sandboxes use, and a runner
        # started again keeps the image a stopped sandbox there still uses.
        r = server.request("GET", "/runners/me/images", auth=False, headers=as_runner)
        assert r.status_code == 200, r.text
        assert r.json() == {"images": ["debian-bookworm/rootfs"]}
        for made in (third, second):
            daytona.delete(made)
        sandbox.stop(timeout=120)
        service = one.me()["apiUrl"]
        one.process.send_signal(signal.SIGTERM)
        assert one.process.wait(timeout=60) == 0, one.process.stderr.read()
        one.restart()
        assert wait_until(lambda: one.me()["apiUrl"] not in (None, service), 60)
        assert (fetched / "etc" / "cove-tiny").is_file()
        # Once no sandbox placed there uses it, the runner deletes its copy
        # as it next starts (the control plane's own stays).
        daytona.delete(sandbox)
        r = server.request("GET", "/runners/me/images", auth=False, headers=as_runner)
        assert r.json() == {"images": []}, r.text
        service = one.me()["apiUrl"]
        one.process.send_signal(signal.SIGTERM)
        assert one.process.wait(timeout=60) == 0, one.process.stderr.read()
        one.restart()
        assert wait_until(lambda: one.me()["apiUrl"] not in (None, service), 60)
        assert not fetched.exists()
        assert list((runner_images / ".incoming").glob("*-unused-*")) == []
        assert (rebuilt / "etc" / "cove-tiny").is_file()


def test_a_runner_gone_for_good_is_deleted_as_lost_and_its_sandboxes_say_so():
    """A runner killed with SIGKILL that is not coming back: the operator
    deletes it with `--lost` (refused while it still reports, and without
    the flag while it holds sandboxes). Each sandbox it held, running or
    stopped, shows `error` saying its files went with it; a recover is
    refused (never a new one from nothing) and a delete forgets it. The
    runner started again anyway is turned away: its token is gone, and
    nothing it held comes back."""
    with beside_one_runner(("--runner-silence", "10")) as one:
        server, runner_id, local = one.server, one.runner_id, one.local
        daytona = server.client()
        running = daytona.create(CreateSandboxFromSnapshotParams(name=unique("run")), timeout=120)
        stopped = daytona.create(CreateSandboxFromSnapshotParams(name=unique("rest")), timeout=120)
        stopped.stop(timeout=120)
        assert {runner_of(server, running.id), runner_of(server, stopped.id)} == {runner_id}

        r = server.request("DELETE", f"/runners/{runner_id}?lost=maybe")
        assert r.status_code == 400 and "lost must be true or false" in r.json()["message"], r.text
        r = server.request("DELETE", f"/runners/{runner_id}?lost=true")
        assert r.status_code == 409 and "still reports" in r.json()["message"], r.text

        one.process.kill()
        one.process.wait()
        assert wait_until(lambda: state(server, runner_id) == "unresponsive", 60)
        r = server.request("DELETE", f"/runners/{runner_id}")
        assert r.status_code == 409 and "holds 2 sandboxes" in r.json()["message"], r.text
        said = admin(server, "remove-runner", runner_id, "--lost")
        assert "deleted as lost" in said, said
        assert server.request("GET", f"/runners/{runner_id}").status_code == 404

        for sandbox in (running, stopped):
            sandbox.refresh_data()
            assert sandbox.state == "error", sandbox.state
            assert "deleted as lost" in sandbox.error_reason, sandbox.error_reason
            r = server.request("POST", f"/sandbox/{sandbox.id}/recover")
            assert r.status_code == 409 and "deleted as lost" in r.json()["message"], r.text
            sandbox.refresh_data()
            assert sandbox.state == "error" and "deleted as lost" in sandbox.error_reason
        running.delete()
        assert server.request("GET", f"/sandbox/{running.id}").status_code == 404

        # Back after all, it is turned away, and stops what it held.
        process = one.restart()
        assert process.wait(timeout=120) != 0
        assert "checking in with the control plane" in process.stderr.read()
        assert [r["id"] for r in runners(server)] == [local]
        stopped.refresh_data()
        assert stopped.state == "error"
        stopped.delete()
        assert server.request("GET", f"/sandbox/{stopped.id}").status_code == 404


def test_sixty_creates_spread_over_three_runners_and_one_killed_comes_back_as_it_was(fake_internet):
    """Three runners elsewhere, each with its own bridge, range, routing
    table, cgroup parent and user namespaces, and the server's own runner
    drained: 60 creates through the SDK (four at a time) spread over them.
    Each sandbox answers a command and a file on its runner, a preview and
    SSH reach one on each runner, and each reaches the (fake) internet
    through its runner's network. One runner killed with SIGKILL: its
    sandboxes show error once it is silent past the limit while the others
    go on; started again, it is the same runner, and its sandboxes recover
    there with their files, none duplicated or lost."""
    from concurrent.futures import ThreadPoolExecutor

    data_dir = new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex,
                        extra_args=("--no-network", "--runner-silence", "10"))
    dirs = [new_data_dir() for _ in range(3)]
    parents = ["cove-test-" + uuid.uuid4().hex[:8] for _ in dirs]
    # Apart from every other server's on the host (10.77/16 is serve's default).
    networks = [("--bridge", "cvr" + uuid.uuid4().hex[:4], "--network-range", f"10.{81 + n}.0.0/16",
                 "--route-table", str(7810 + 10 * n), *fake_internet.server_args())
                for n in range(3)]
    pools = [f"{2147483648 + n * 64 * 65536}:64" for n in range(3)]
    processes: list[subprocess.Popen] = []
    tokens: list[str] = []
    made = []
    try:
        server.start()
        daytona = server.client()
        ids = []
        for n in range(3):
            runner_id, token = add_runner(server, unique(f"node{n}"))
            ids.append(runner_id)
            tokens.append(token)
            processes.append(serving_runner(server, token, dirs[n], parents[n], networks[n], pools[n]))
        # Three at once make their storage and networks: slower than one.
        ready = wait_until(lambda: all(state(server, r) == "ready" for r in ids), 120)
        assert ready, [p.stderr.read()[-3000:] for p in processes if p.poll() is not None]
        local = next(r["id"] for r in runners(server) if r["id"] not in ids)
        admin(server, "drain", local)

        def create(n: int):
            return daytona.create(CreateSandboxFromSnapshotParams(name=unique(f"s{n}")), timeout=120)

        with ThreadPoolExecutor(4) as pool:
            made = list(pool.map(create, range(60)))
        on = {runner_id: [s for s in made if s.runner_id == runner_id] for runner_id in ids}
        assert sum(len(held) for held in on.values()) == 60, {r: len(h) for r, h in on.items()}
        assert min(len(held) for held in on.values()) >= 15, {r: len(h) for r, h in on.items()}
        for n, runner_id in enumerate(ids):
            for sandbox in on[runner_id]:
                assert cgroups_of(parents[n], sandbox.id), sandbox.id
                assert sandbox.process.exec(f"echo {sandbox.name}").result.strip() == sandbox.name
                sandbox.fs.upload_file(sandbox.id.encode(), "mine.txt")
                assert sandbox.fs.download_file("mine.txt") == sandbox.id.encode()
            first = on[runner_id][0]
            assert f"10.{81 + n}." in first.process.exec("hostname -I").result
            assert wait_until(lambda: reaches_the_internet(first), 30)
            reaches_it_through_the_runner(server, first)

        # One runner killed: its sandboxes show error once it is silent past
        # the limit; the others' answer all along.
        killed, killed_dir = ids[2], dirs[2]
        processes[2].kill()
        processes[2].wait()

        def shown_in_error() -> bool:
            return all(daytona.get(s.id).state == "error" for s in on[killed])

        assert wait_until(shown_in_error, 60)
        for runner_id in ids[:2]:
            for sandbox in on[runner_id][:3]:
                assert sandbox.process.exec("echo on").result.strip() == "on"

        # Started again, it is the same runner; its sandboxes recover there
        # with their files, and no sandbox is duplicated or lost.
        processes[2] = serving_runner(server, tokens[2], killed_dir, parents[2], networks[2], pools[2])
        assert wait_until(lambda: state(server, killed) == "ready", 60)
        for sandbox in on[killed]:
            sandbox.recover(timeout=60)
            assert runner_of(server, sandbox.id) == killed
            assert sandbox.fs.download_file("mine.txt") == sandbox.id.encode()
        listed = [s.id for s in daytona.list()]
        assert sorted(listed) == sorted(s.id for s in made)
        assert len(runners(server)) == 4

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(daytona.delete, made))
        made = []
        for n, runner_dir in enumerate(dirs):
            assert os.listdir(runner_dir / "storage" / "sandboxes") == []
        for process in processes:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        for sandbox in made:
            try:
                daytona.delete(sandbox)
            except Exception:
                pass
        end_all(processes, server, [data_dir, *dirs], parents)


def test_a_snapshot_taken_from_a_sandbox_runs_on_a_runner_that_fetches_its_layers(tmp_path):
    """A snapshot taken of a sandbox on the control plane's own runner,
    then taken again of a sandbox made from it, is two captured layers over
    the image. A sandbox of the second, placed on a runner elsewhere that
    holds neither, runs there: the runner fetches each layer from the
    control plane (`GET /runners/me/layers/{capture}`, its own token) onto
    its storage, so the sandbox has every file written in either sandbox,
    and a file deleted in the first stays deleted. The route serves a runner
    only the layers of sandboxes placed on it: before one, its token gets a
    404, an API key a 401, and a name that is no capture id a 400."""
    server_images, runner_images = tmp_path / "control", tmp_path / "runner"
    home = tiny_default_image(server_images) / "home" / "daytona"
    (home / "note").write_text("from the image\n")
    (home / "kept").write_text("kept\n")
    for name in ("note", "kept"):
        os.chown(home / name, 1000, 1000)
    with beside_one_runner(server_images=server_images, runner_images=runner_images) as one:
        server = one.server
        daytona = server.client()
        as_runner = {"Authorization": f"Bearer {one.token}"}
        admin(server, "drain", one.local, "--undo")
        admin(server, "drain", one.runner_id)

        first = daytona.create(CreateSandboxFromSnapshotParams(name=unique("first")), timeout=120)
        assert first.runner_id == one.local
        made = first.process.exec("echo one > ~/one && rm ~/note && mkdir -p ~/made")
        assert made.exit_code == 0, made.result
        lower = unique("lower")
        first.create_snapshot(lower)
        second = daytona.create(CreateSandboxFromSnapshotParams(snapshot=lower, name=unique("second")),
                                timeout=120)
        assert second.runner_id == one.local
        assert second.process.exec("cat ~/one").result == "one\n"
        made = second.process.exec("echo two > ~/made/two")
        assert made.exit_code == 0, made.result
        upper = unique("upper")
        second.create_snapshot(upper)
        captures = [daytona.snapshot.get(name).id for name in (upper, lower)]

        for capture in captures:
            r = server.request("GET", f"/runners/me/layers/{capture}", auth=False, headers=as_runner)
            assert r.status_code == 404, r.text
            assert "no sandbox placed on this runner uses the captured layer" in r.json()["message"]
            r = server.request("GET", f"/runners/me/layers/{capture}")
            assert r.status_code == 401, r.text
        r = server.request("GET", "/runners/me/layers/..%2F..%2Fetc", auth=False, headers=as_runner)
        assert r.status_code == 400, r.text

        admin(server, "drain", one.local)
        admin(server, "drain", one.runner_id, "--undo")
        moved = daytona.create(CreateSandboxFromSnapshotParams(snapshot=upper, name=unique("moved")),
                               timeout=120)
        assert moved.runner_id == one.runner_id
        assert moved.process.exec("cat ~/one ~/made/two").result == "one\ntwo\n"
        gone = moved.process.exec("test -e ~/note || echo gone")
        assert gone.result.strip() == "gone", gone.result
        assert moved.process.exec("cat ~/kept").result == "kept\n"
        # Each layer is on the runner's storage, whole, and nothing is left mid-way.
        storage = Path(one.runner_dir) / "storage"
        for capture in captures:
            assert (storage / "captures" / capture / "upper").is_dir(), capture
        assert list((storage / "captures" / ".incoming").glob("*")) == []
        # Its token now gets them, and still no other.
        r = server.request("GET", f"/runners/me/layers/{captures[0]}", auth=False, headers=as_runner)
        assert r.status_code == 200, r.text
        assert len(r.content) > 0
        r = server.request("GET", f"/runners/me/layers/{uuid.uuid4()}", auth=False, headers=as_runner)
        assert r.status_code == 404, r.text

        # Its token also gets the list of the layers its sandboxes use.
        r = server.request("GET", "/runners/me/layers", auth=False, headers=as_runner)
        assert r.status_code == 200, r.text
        assert sorted(r.json()["captures"]) == sorted(captures)

        for sandbox in (moved, second, first):
            daytona.delete(sandbox)
        r = server.request("GET", "/runners/me/layers", auth=False, headers=as_runner)
        assert r.json()["captures"] == [], r.text
        # The runner's copy goes with its snapshot (the control plane's
        # `DELETE /layers/{capture}` on the runner's service, sent in the
        # background), which takes the service's key only.
        daytona.snapshot.delete(daytona.snapshot.get(upper))
        assert wait_until(lambda: not (storage / "captures" / captures[0]).exists(), timeout=30)
        assert (storage / "captures" / captures[1] / "upper").is_dir()
        r = requests.delete(f"{one.me()['apiUrl']}/layers/{captures[1]}", headers=as_runner, timeout=10)
        assert r.status_code == 401, r.text
        # A snapshot deleted while the runner is away: the runner deletes its
        # copy as it starts again, asking which layers to keep.
        service = one.me()["apiUrl"]
        one.process.send_signal(signal.SIGTERM)
        assert one.process.wait(timeout=60) == 0, one.process.stderr.read()
        # (Its storage is unmounted while it is away; the control plane's
        # call to delete its copy finds no one.)
        daytona.snapshot.delete(daytona.snapshot.get(lower))
        one.restart()
        # Its first report names its new service: its storage is mounted again.
        assert wait_until(lambda: one.me()["apiUrl"] not in (None, service), 60)
        assert (storage / "captures").is_dir()
        assert [path.name for path in (storage / "captures").iterdir()] == [".incoming"]


def test_a_snapshot_of_a_sandbox_on_a_runner_elsewhere_comes_to_the_control_plane(tmp_path):
    """A snapshot of a sandbox on a runner elsewhere: the runner captures
    its layer (`POST /sandboxes/{id}/capture/{capture}` on its service) and
    the control plane receives it (`GET /layers/{capture}`, a `btrfs send`
    stream it checks before receiving) into its own storage, where every
    snapshot's layers are. A sandbox of that snapshot then runs on the
    control plane's own runner with the files written on the runner, and
    the runner's sandbox reverts to it: from its own copy, and, once that
    is gone, from the control plane's, fetched with its token. The
    snapshot's deletion takes both copies."""
    server_images, runner_images = tmp_path / "control", tmp_path / "runner"
    home = tiny_default_image(server_images) / "home" / "daytona"
    (home / "note").write_text("from the image\n")
    os.chown(home / "note", 1000, 1000)
    with beside_one_runner(server_images=server_images, runner_images=runner_images) as one:
        server = one.server
        daytona = server.client()
        far = daytona.create(CreateSandboxFromSnapshotParams(name=unique("far")), timeout=120)
        assert far.runner_id == one.runner_id
        made = far.process.exec("echo one > ~/one && rm ~/note && mkdir -p ~/made && echo two > ~/made/two")
        assert made.exit_code == 0, made.result
        name = unique("far-snap")
        far.create_snapshot(name)
        capture = daytona.snapshot.get(name).id
        # Both copies are whole, and neither side left a transfer mid-way.
        here = Path(server.data_dir) / "storage" / "captures"
        there = Path(one.runner_dir) / "storage" / "captures"
        for captures in (here, there):
            assert (captures / capture / "upper").is_dir(), captures
            assert list((captures / ".incoming").glob("*")) == []
        # The sandbox ran on while it was captured.
        assert far.process.exec("cat ~/one").result == "one\n"

        admin(server, "drain", one.local, "--undo")
        admin(server, "drain", one.runner_id)
        near = daytona.create(CreateSandboxFromSnapshotParams(snapshot=name, name=unique("near")),
                              timeout=120)
        assert near.runner_id == one.local
        assert near.process.exec("cat ~/one ~/made/two").result == "one\ntwo\n"
        gone = near.process.exec("test -e ~/note || echo gone")
        assert gone.result.strip() == "gone", gone.result

        # A revert on the runner, from its own copy.
        assert far.process.exec("echo changed > ~/one").exit_code == 0
        r = server.request("POST", f"/sandbox/{far.id}/revert", json={"snapshot": name})
        assert r.status_code == 200, r.text
        assert far.process.exec("cat ~/one").result == "one\n"
        # Its copy gone, the runner fetches the control plane's: its token
        # may have the layers of snapshots taken of its sandboxes.
        assert far.process.exec("echo changed > ~/one").exit_code == 0
        deleted = subprocess.run(["btrfs", "subvolume", "delete", str(there / capture)],
                                 capture_output=True, text=True)
        assert deleted.returncode == 0, deleted.stderr
        r = server.request("POST", f"/sandbox/{far.id}/revert", json={"snapshot": name})
        assert r.status_code == 200, r.text
        assert far.process.exec("cat ~/one").result == "one\n"
        assert (there / capture / "upper").is_dir()
        r = server.request("GET", "/runners/me/layers", auth=False,
                           headers={"Authorization": f"Bearer {one.token}"})
        assert capture in r.json()["captures"], r.text

        daytona.delete(near)
        daytona.delete(far)
        daytona.snapshot.delete(daytona.snapshot.get(name))
        assert not (here / capture).exists()
        assert wait_until(lambda: not (there / capture).exists(), timeout=30)
