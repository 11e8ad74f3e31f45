"""VM sandboxes (seeds 000-002): QEMU microVMs whose running processes survive
pause and resume, memory snapshots and forks. Under TCG on hosts without KVM,
so every step takes a second or so; the tests wait in states, never in time.

The "in-memory counter" is a shell loop in a session: its variable lives only
in the shell's memory, and each turn writes it to a file. After a pause, a
memory snapshot or a fork it must go on from where it was, not start again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from daytona import CreateSandboxFromSnapshotParams, DaytonaError, SandboxState, SessionExecuteRequest, VolumeMount

from conftest import CoveServer, new_data_dir, remove_data_dir, unique, vm_assets, wait_until

pytestmark = pytest.mark.skipif(vm_assets() is None, reason="COVE_TEST_VM_ASSETS is not set (scripts/vm-assets)")

VM = "daytona-vm-small"
# Written aside and renamed, so a reader never sees the file empty.
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/counter; sleep 0.2; done"
TIMEOUT = 180
IDLE_WINDOW = 6.0


def vm(sandboxes, **kw):
    return sandboxes(CreateSandboxFromSnapshotParams(snapshot=VM, **kw))


def start_counter(sandbox) -> str:
    sandbox.process.create_session("keepalive")
    command = sandbox.process.execute_session_command(
        "keepalive", SessionExecuteRequest(command=COUNTER, run_async=True)
    )
    assert wait_until(lambda: counter(sandbox) >= 2, TIMEOUT), "the counter never started"
    return command.cmd_id


def counter(sandbox) -> int:
    text = sandbox.process.exec("cat /tmp/counter 2>/dev/null || echo 0").result.strip()
    return int(text or 0)


def counting_on(sandbox, at_least: int) -> bool:
    """The loop runs, and its count went on from `at_least` rather than from 0."""
    first = counter(sandbox)
    if first < at_least:
        return False
    return wait_until(lambda: counter(sandbox) > first, 60)


def test_vm_class_and_accelerator(cove, sandboxes):
    sandbox = vm(sandboxes)
    assert sandbox.state == SandboxState.STARTED
    dto = cove.request("GET", f"/sandbox/{sandbox.id}").json()
    assert dto["sandboxClass"] == "linux-vm"
    assert dto["accelerator"] in ("kvm", "tcg")
    # The server says what its VMs run on and why, and it is the sandbox's.
    chosen = cove.request("GET", "/config").json()["coveVmAccelerator"]
    assert chosen["name"] == dto["accelerator"], chosen
    assert chosen["reason"], chosen
    # Its own kernel, not the host's.
    assert sandbox.process.exec("uname -r").result.strip() != os.uname().release
    assert sandbox.process.exec("echo hello from a vm").result.strip() == "hello from a vm"


def test_a_tiny_vm_has_256_mib_and_keeps_it_across_pause(cove, sandboxes, daytona):
    snapshot = daytona.snapshot.get("daytona-vm-tiny")
    assert (snapshot.cpu, snapshot.mem) == (1, 0.25)
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(snapshot="daytona-vm-tiny"))
    # Whole GiB in the sandbox, as the SDK reads it.
    assert sandbox.memory == 1
    total_kib = int(sandbox.process.exec("awk '/MemTotal/ {print $2}' /proc/meminfo").result)
    # The kernel keeps some for itself: what is left is most of 256 MiB, and no more.
    assert 160 * 1024 < total_kib <= 256 * 1024, total_kib
    start_counter(sandbox)
    before = counter(sandbox)
    sandbox.pause()
    sandbox.start(timeout=TIMEOUT)
    assert counting_on(sandbox, before)


def test_seed_000_pause_and_resume_keep_running_processes(sandboxes):
    sandbox = vm(sandboxes)
    command = start_counter(sandbox)
    sandbox.fs.upload_file(b"on disk", "/home/daytona/kept.txt")
    before = counter(sandbox)

    sandbox.pause()
    assert sandbox.state == SandboxState.PAUSED
    sandbox.start(timeout=TIMEOUT)
    assert sandbox.state == SandboxState.STARTED

    # The session command started before the pause is still running...
    assert sandbox.process.get_session_command("keepalive", command).exit_code is None
    # ...and its in-memory count went on from where it was.
    assert counting_on(sandbox, before)
    assert sandbox.fs.download_file("/home/daytona/kept.txt") == b"on disk"


def test_vms_surface_pause_resume_and_cold_start(cove, sandboxes):
    sandbox = vm(sandboxes)
    start_counter(sandbox)
    sandbox.fs.upload_file(b"disk survives a cold start", "/home/daytona/disk.txt")

    assert cove.request("POST", f"/vms/{sandbox.id}/pause").status_code == 200
    assert cove.request("GET", f"/sandbox/{sandbox.id}").json()["state"] == "paused"
    assert cove.request("POST", f"/vms/{sandbox.id}/resume").status_code == 200
    sandbox.refresh_data()
    assert sandbox.state == SandboxState.STARTED
    before = counter(sandbox)
    assert counting_on(sandbox, before)

    # Seed 001: `start` on a paused VM discards its memory and boots from the disk.
    assert cove.request("POST", f"/vms/{sandbox.id}/pause").status_code == 200
    assert cove.request("POST", f"/vms/{sandbox.id}/start").status_code == 200
    sandbox.refresh_data()
    assert sandbox.state == SandboxState.STARTED
    assert sandbox.fs.download_file("/home/daytona/disk.txt") == b"disk survives a cold start"
    # The loop died with the memory ("[w]" keeps grep from finding itself).
    assert sandbox.process.exec("ps -eo args | grep -c '[w]hile true' || true").result.strip() == "0"

    assert cove.request("POST", f"/vms/{sandbox.id}/stop").status_code == 200
    assert cove.request("GET", f"/sandbox/{sandbox.id}").json()["state"] == "stopped"


def cpu_seconds(pid: int) -> float:
    """User and system time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_vm_leaves_its_host_core_idle(cove, sandboxes):
    """A VM with nothing to do costs the host next to no CPU: made from the
    template, and again after a pause (restored from memory both times, when
    the agent's port sees its host go away and come back)."""

    def cpu_used_idling(sandbox) -> float:
        assert sandbox.process.exec("echo awake").result.strip() == "awake"
        [pid] = [p for p in qemu_processes(cove.data_dir) if sandbox.id in Path(f"/proc/{p}/cmdline").read_text()]
        before = cpu_seconds(pid)
        time.sleep(IDLE_WINDOW)
        return cpu_seconds(pid) - before

    sandbox = vm(sandboxes)
    # A guest that spins keeps its vCPU thread busy the whole window.
    used = cpu_used_idling(sandbox)
    assert used < IDLE_WINDOW / 3, f"qemu used {used:.1f} s of CPU in {IDLE_WINDOW} s of idling"
    sandbox.pause()
    sandbox.start(timeout=TIMEOUT)
    used = cpu_used_idling(sandbox)
    assert used < IDLE_WINDOW / 3, f"after a resume, qemu used {used:.1f} s of CPU in {IDLE_WINDOW} s of idling"


def test_pause_rules(cove, sandboxes):
    ephemeral = vm(sandboxes, ephemeral=True)
    reply = cove.request("POST", f"/sandbox/{ephemeral.id}/pause")
    assert reply.status_code == 409, reply.text
    assert "persistent" in reply.json()["message"]

    container = sandboxes()
    reply = cove.request("POST", f"/vms/{container.id}/pause")
    assert reply.status_code in (400, 409), reply.text

    reply = cove.request(
        "POST", "/sandbox", json={"snapshot": VM, "autoPauseInterval": 5, "autoStopInterval": 5}
    )
    assert reply.status_code == 400, reply.text



def test_memory_snapshot_starts_with_processes_running(cove, sandboxes, daytona):
    sandbox = vm(sandboxes)
    command = start_counter(sandbox)
    name = unique("mem")
    reply = cove.request("POST", f"/sandbox/{sandbox.id}/snapshot", json={"name": name, "includeMemory": True})
    assert reply.status_code in (200, 201), reply.text
    try:
        assert wait_until(
            lambda: cove.request("GET", f"/sandbox/{sandbox.id}").json()["state"] == "started", TIMEOUT
        )
        snapshot = cove.request("GET", f"/snapshots/{name}").json()
        assert snapshot["includesMemory"] is True, snapshot
        at_capture = counter(sandbox)

        copy = vm_from(sandboxes, name)
        assert copy.process.get_session_command("keepalive", command).exit_code is None
        assert counting_on(copy, 1)
        # The copy continues the captured count; it did not start a new loop at 0.
        assert counter(copy) >= at_capture - 50
        # The original went on running through the capture.
        assert counting_on(sandbox, at_capture)
    finally:
        for sid in list(sandboxes.ids)[1:]:
            cove.request("DELETE", f"/sandbox/{sid}")
        wait_until(lambda: cove.request("DELETE", f"/snapshots/{name}").status_code in (200, 204, 404), 60, 1)


def vm_from(sandboxes, snapshot: str):
    return sandboxes(CreateSandboxFromSnapshotParams(snapshot=snapshot))


def test_forks_diverge_and_keep_the_parent(cove, sandboxes, daytona):
    parent = vm(sandboxes)
    start_counter(parent)
    parent.code_interpreter.run_code("x = 41")
    at_fork = counter(parent)

    first = parent.fork(name=unique("fork-a"))
    sandboxes.track(first.id)
    second = parent.fork(name=unique("fork-b"))
    sandboxes.track(second.id)
    assert first.state == SandboxState.STARTED and second.state == SandboxState.STARTED

    # Each child holds the parent's memory: the interpreter's variable, the loop's count.
    first.code_interpreter.run_code("x += 1")
    second.code_interpreter.run_code("x += 100")
    assert first.code_interpreter.run_code("print(x)").stdout.strip() == "42"
    assert second.code_interpreter.run_code("print(x)").stdout.strip() == "141"
    assert parent.code_interpreter.run_code("print(x)").stdout.strip() == "41"
    assert counting_on(first, at_fork)
    assert counting_on(second, at_fork)
    assert counting_on(parent, at_fork)

    # Disks are independent too.
    first.fs.upload_file(b"first", "/home/daytona/who")
    second.fs.upload_file(b"second", "/home/daytona/who")
    assert first.fs.download_file("/home/daytona/who") == b"first"
    assert second.fs.download_file("/home/daytona/who") == b"second"
    assert parent.process.exec("cat /home/daytona/who 2>/dev/null || echo none").result.strip() == "none"

    # The fork tree.
    forks = cove.request("GET", f"/sandbox/{parent.id}/forks").json()
    assert sorted(f["id"] for f in forks) == sorted([first.id, second.id])
    assert cove.request("GET", f"/sandbox/{first.id}/parent").json()["id"] == parent.id
    ancestors = cove.request("GET", f"/sandbox/{first.id}/ancestors").json()
    assert [a["id"] for a in ancestors] == [parent.id]

    # A parent with forks stays; the message names them.
    reply = cove.request("DELETE", f"/sandbox/{parent.id}")
    assert reply.status_code == 409, reply.text
    assert first.id in reply.json()["message"] or first.name in reply.json()["message"]


def test_a_fork_into_many_children_each_go_on_alone_and_the_parent_runs(cove, sandboxes, daytona):
    """`POST /sandbox/{id}/forks` (a cove extension, raw HTTP: the SDK has no
    call for it): N children from one instant of the parent, each with the
    parent's counting loop going on in it, its own name and address."""
    parent = vm(sandboxes)
    start_counter(parent)
    at_fork = counter(parent)
    names = [unique(f"fan-{i}") for i in range(3)]

    reply = cove.request("POST", f"/sandbox/{parent.id}/forks", json={"names": names})
    assert reply.status_code == 200, reply.text
    made = reply.json()
    for child in made:
        sandboxes.track(child["id"])
    assert [c["name"] for c in made] == names
    assert all(c["state"] == "started" and c["parentSandboxId"] == parent.id for c in made), made

    children = [daytona.get(c["id"]) for c in made]
    # Each child's loop went on from the parent's count, not from 0, and
    # counts alone: a mark one child makes is seen by none of the others.
    for child in children:
        assert counting_on(child, at_fork)
    for child in children:
        child.process.exec(f"echo {child.id} > /tmp/mark")
    for child in children:
        assert child.process.exec("cat /tmp/mark").result.strip() == child.id
    assert parent.process.exec("cat /tmp/mark 2>/dev/null || echo none").result.strip() == "none"
    assert counting_on(parent, at_fork)

    # Each is itself: its own host name (its sandbox name) and its own address.
    hostnames = [child.process.exec("hostname").result.strip() for child in children]
    assert hostnames == [name[:63] for name in names]
    addresses = {address_of(sandbox) for sandbox in [parent, *children]}
    assert len(addresses) == 4, addresses
    forks = cove.request("GET", f"/sandbox/{parent.id}/forks").json()
    assert sorted(f["id"] for f in forks) == sorted(c["id"] for c in made)


def test_a_fork_into_many_refuses_bad_counts_and_makes_nothing(cove, sandboxes):
    parent = vm(sandboxes)
    for body in ({}, {"count": 0}, {"count": 1000}, {"count": "two"}, {"count": 2, "names": ["a"]}):
        reply = cove.request("POST", f"/sandbox/{parent.id}/forks", json=body)
        assert reply.status_code == 400, (body, reply.text)
        assert reply.json()["message"], reply.text
    assert cove.request("GET", f"/sandbox/{parent.id}/forks").json() == []
    # The one-child fork answers one sandbox, as before.
    reply = cove.request("POST", f"/sandbox/{parent.id}/fork", json={"name": unique("one")})
    assert reply.status_code == 200, reply.text
    sandboxes.track(reply.json()["id"])
    assert reply.json()["parentSandboxId"] == parent.id


CURL = "curl -s -m 5 -o /dev/null -w '%{http_code}' "


def fetch(sandbox, url: str) -> str:
    """The HTTP status the sandbox gets for url, or '000' when it cannot connect."""
    return sandbox.process.exec(CURL + url, timeout=30).result.strip()


def address_of(sandbox) -> str:
    return sandbox.process.exec("hostname -I").result.split()[0]


def tap_devices() -> set[str]:
    return {p.parent.name for p in Path("/sys/class/net").glob("*/tun_flags")}


def test_vm_network_policy_forks_and_pause(cove, sandboxes, fake_internet):
    taps_before = tap_devices()
    parent = vm(sandboxes, domain_allow_list="allowed.test")
    # The guest's own NIC, on a TAP device of cove's bridge, with cove's resolver.
    assert len(tap_devices() - taps_before) == 1
    assert "nameserver 10.77.0.1" in parent.process.exec("cat /etc/resolv.conf").result
    assert fetch(parent, "http://allowed.test/") == "200"
    assert fetch(parent, "http://denied.test/") == "000"
    assert fetch(parent, f"http://{fake_internet.DENIED}/") == "000"

    # A live change, no restart.
    parent.update_network_settings(network_block_all=True)
    assert wait_until(lambda: fetch(parent, "http://allowed.test/") == "000", 30)
    parent.update_network_settings(network_block_all=False)
    assert wait_until(lambda: fetch(parent, f"http://{fake_internet.DENIED}/") == "200", 30)

    # A fork starts from the parent's memory (its address, its MAC) and is
    # given its own: both reach the internet, neither reaches the other.
    child = parent.fork(name=unique("net-fork"))
    sandboxes.track(child.id)
    assert address_of(child) != address_of(parent)
    assert fetch(child, "http://allowed.test/") == "200"
    assert fetch(parent, "http://allowed.test/") == "200"
    child.process.exec("nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
    assert wait_until(lambda: fetch(child, "http://127.0.0.1:8000/") == "200", 60)
    assert fetch(parent, f"http://{address_of(child)}:8000/") == "000"

    # Pause gives the TAP device up; resume gets one again, same address.
    address = address_of(parent)
    parent.pause()
    parent.start(timeout=TIMEOUT)
    assert address_of(parent) == address
    assert fetch(parent, "http://allowed.test/") == "200"

    for sandbox in (child, parent):
        sandbox.delete(timeout=TIMEOUT)
    assert wait_until(lambda: tap_devices() <= taps_before, 30), tap_devices() - taps_before
    tables = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
    assert address not in tables


def virtiofsd_processes(data_dir: Path) -> list[int]:
    """virtiofsd processes of a server with `data_dir`: they have nothing of
    it in their arguments (a listening socket, a volume mounted in a mount
    namespace of their own), but they log to a file of a sandbox there."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            log = os.readlink(entry / "fd" / "2")
        except OSError:
            continue
        if args and args[0].endswith(b"virtiofsd") and log.startswith(str(data_dir)):
            found.append(int(entry.name))
    return found


def status_of(pid: int) -> dict[str, str]:
    """/proc/PID/status as a dict."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def vm_cgroup(pid: int) -> str:
    """The name of the VM cgroup a process is in (cgroup v1 or v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        path = line.split(":", 2)[2]
        if path.startswith("/cove-vm/vm-"):
            return path.removeprefix("/cove-vm/")
    raise AssertionError(f"process {pid} is in no VM cgroup: {Path(f'/proc/{pid}/cgroup').read_text()}")


def memory_limit(cgroup: str) -> int:
    v1 = Path("/sys/fs/cgroup/memory/cove-vm") / cgroup / "memory.limit_in_bytes"
    v2 = Path("/sys/fs/cgroup/cove-vm") / cgroup / "memory.max"
    return int((v1 if v1.exists() else v2).read_text())


def can_open_as(uid: int, path: Path) -> bool:
    """Whether a process with `uid` (and gid) opens `path` for reading."""
    child = os.fork()
    if child == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            open(path, "rb").close()
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) == 0


def test_a_vms_host_processes_are_unprivileged_and_confined(cove, sandboxes, daytona):
    """Issue 16: QEMU and virtiofsd ran as host root, with no seccomp and no
    cgroup, and under TCG QEMU is no security boundary. Now both run as the
    first id of a range of their own (nothing of it is root), QEMU without
    capabilities, under its seccomp sandbox, and both in one cgroup with a
    memory limit over the guest's RAM; that user cannot read the server's
    database; the cgroup is gone with the VM."""
    volume = cove.request("POST", "/volumes", json={"name": unique("jail")}).json()
    try:
        machine = vm(sandboxes, volumes=[VolumeMount(volume_id=volume["id"], mount_path="/mnt/vol")])
        machine.process.exec("echo guest > /mnt/vol/g.txt && chown 1000:1000 /mnt/vol/g.txt")
        sandbox_dir = cove.data_dir / "storage" / "vms" / machine.id
        qemu = int((sandbox_dir / "qemu.pid").read_text())
        status = status_of(qemu)
        uid = int(status["Uid"].split()[0])
        assert uid > 0 and set(status["Uid"].split()) == {str(uid)}, status["Uid"]
        assert set(status["Gid"].split()) == {str(uid)}, status["Gid"]
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, status
        assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2", status
        cgroup = vm_cgroup(qemu)
        assert 1024 << 20 < memory_limit(cgroup) < 64 << 30, memory_limit(cgroup)

        [daemon, *forks] = virtiofsd_processes(cove.data_dir)
        for pid in [daemon, *forks]:
            assert set(status_of(pid)["Uid"].split()) == {str(uid)}, status_of(pid)
            assert vm_cgroup(pid) == cgroup
        # Root of a namespace that maps only the VM's range.
        assert Path(f"/proc/{daemon}/uid_map").read_text().split() == ["0", str(uid), "65536"]
        # The guest's ids reach the disk as the guest sees them (idmapped).
        on_disk = cove.data_dir / "storage" / "volumes" / volume["id"] / "g.txt"
        assert on_disk.stat().st_uid == 1000, on_disk.stat()

        # What QEMU's user can reach of the host: not the server's files.
        assert can_open_as(uid, Path("/etc/hostname"))
        for secret in (cove.data_dir / "cove.db", sandbox_dir / "ram", sandbox_dir / "disk.qcow2"):
            assert not can_open_as(uid, secret), secret

        daytona.delete(machine)
        assert wait_until(lambda: not (Path("/sys/fs/cgroup/pids/cove-vm") / cgroup).exists()
                          and not (Path("/sys/fs/cgroup/cove-vm") / cgroup).exists(), 30), cgroup
        assert wait_until(lambda: not virtiofsd_processes(cove.data_dir), 30)
    finally:
        sandboxes.cleanup()
        assert wait_until(lambda: cove.request("DELETE", f"/volumes/{volume['id']}").status_code in (200, 404), 60)


def test_a_vm_shares_a_volume_with_a_container(cove, sandboxes, daytona):
    volume = cove.request("POST", "/volumes", json={"name": unique("vmvol")}).json()
    try:
        container = sandboxes(
            CreateSandboxFromSnapshotParams(volumes=[VolumeMount(volume_id=volume["id"], mount_path="/data")])
        )
        container.process.exec("echo from-container > /data/a.txt && mkdir /data/sub")
        machine = vm(
            sandboxes,
            volumes=[
                VolumeMount(volume_id=volume["id"], mount_path="/mnt/vol"),
                VolumeMount(volume_id=volume["id"], mount_path="/mnt/sub", subpath="sub"),
            ],
        )
        # (virtiofsd forks into its sandbox: a parent and a child per volume.)
        assert virtiofsd_processes(cove.data_dir)
        assert machine.process.exec("cat /mnt/vol/a.txt").result.strip() == "from-container"
        assert machine.process.exec("grep ' /mnt/vol ' /proc/mounts").result.split()[2] == "virtiofs"
        # Live both ways, with the modes the VM set.
        machine.process.exec("echo from-vm > /mnt/vol/b.txt && chmod 640 /mnt/vol/b.txt")
        # (root's file, mode 640: the container's default user reads it through sudo)
        assert container.process.exec("sudo cat /data/b.txt").result.strip() == "from-vm"
        assert container.process.exec("stat -c %a /data/b.txt").result.strip() == "640"
        # The guest sees the volume and nothing beside it on the host.
        assert machine.process.exec("ls /mnt/vol/..").exit_code == 0
        assert sorted(machine.process.exec("ls /mnt/vol").result.split()) == ["a.txt", "b.txt", "sub"]

        # A VM with volumes never saves its memory: pause, fork and memory
        # snapshots say why instead.
        for action, body in [
            ("pause", None),
            ("fork", {}),
            ("snapshot", {"name": unique("mem"), "includeMemory": True}),
        ]:
            reply = cove.request("POST", f"/sandbox/{machine.id}/{action}", json=body)
            assert reply.status_code == 409, (action, reply.text)
            assert "volumes" in reply.json()["message"], action

        # A stop and a start boot it again, volume mounted; but not while the
        # subpath is a symlink out of the volume (issue 16: virtiofsd was
        # given the path, and served the host's root).
        machine.stop(timeout=TIMEOUT)
        assert wait_until(lambda: not virtiofsd_processes(cove.data_dir), 30)
        container.process.exec("rmdir /data/sub && ln -s / /data/sub")
        with pytest.raises(DaytonaError) as refused:
            machine.start(timeout=TIMEOUT)
        assert "symlink" in str(refused.value), str(refused.value)
        assert wait_until(lambda: not virtiofsd_processes(cove.data_dir), 30)
        container.process.exec("rm /data/sub && mkdir /data/sub && echo inside > /data/sub/c.txt")
        assert cove.request("POST", f"/sandbox/{machine.id}/recover").status_code == 200
        assert wait_until(lambda: daytona.get(machine.id).state == SandboxState.STARTED, TIMEOUT)
        assert machine.process.exec("cat /mnt/vol/b.txt").result.strip() == "from-vm"
        assert machine.process.exec("ls /mnt/sub").result.split() == ["c.txt"]
        daytona.delete(machine)
        assert wait_until(lambda: not virtiofsd_processes(cove.data_dir), 30)
    finally:
        sandboxes.cleanup()
        assert wait_until(lambda: cove.request("DELETE", f"/volumes/{volume['id']}").status_code in (200, 404), 60)


@contextmanager
def own_vm_server(*extra_args: str) -> Iterator[tuple[CoveServer, Path]]:
    """A server of the test's own that serves VMs; everything it made is
    gone afterwards, QEMU processes included."""
    data_dir = new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=extra_args, vms=True)
    server.start()
    try:
        yield server, data_dir
    except BaseException:
        # What the server said is gone with its data dir: show its end.
        print(f"\nthe test's own server's log ends:\n{server.log_tail()}")
        raise
    finally:
        try:
            if server.proc is not None:
                server.delete_all()
        finally:
            server.stop()
            for pid in qemu_processes(data_dir):
                kill_qemu(pid)
            remove_data_dir(data_dir)


def kill_qemu(pid: int) -> None:
    """SIGKILL, thawed first: a warm-paused QEMU is frozen, and a frozen
    process dies only once thawed."""
    try:
        os.kill(pid, signal.SIGKILL)
        if freezer_state(pid) == "FROZEN":
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                if "freezer" in controllers.split(","):
                    Path(f"/sys/fs/cgroup/freezer{path}/freezer.state").write_text("THAWED")
    except (OSError, AssertionError):
        pass


def crash_and_restart(server: CoveServer) -> None:
    """No goodbye: the server dies (its QEMU processes do not) and starts again."""
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    server.proc = None
    server.start()


def test_a_networked_vm_keeps_running_and_its_network_across_a_server_crash(cove, fake_internet):
    # A second networked server beside the session's: its own bridge, range
    # and routing table.
    args = (*fake_internet.server_args(), "--bridge", "covert", "--network-range", "10.78.0.0/16",
            "--route-table", "7701")
    with own_vm_server(*args) as (server, data_dir):
        client = server.client()
        sandbox = client.create(
            CreateSandboxFromSnapshotParams(snapshot=VM, network_allow_list=f"{fake_internet.ALLOWED}/32"),
            timeout=TIMEOUT,
        )
        start_counter(sandbox)
        address = address_of(sandbox)
        assert address.startswith("10.78."), address
        assert fetch(sandbox, f"http://{fake_internet.ALLOWED}/") == "200"
        before = counter(sandbox)

        crash_and_restart(server)
        client = server.client()

        # Taken over, paused and resumed onto the new server's network: the
        # same processes, the same address, the internet again.
        again = client.get(sandbox.id)
        assert again.state == SandboxState.STARTED, again.state
        assert counting_on(again, before)
        assert address_of(again) == address
        assert fetch(again, f"http://{fake_internet.ALLOWED}/") == "200"
        assert fetch(again, f"http://{fake_internet.DENIED}/") == "000"
        client.delete(again, timeout=TIMEOUT, wait=True)
        assert wait_until(lambda: not sandbox_qemus(data_dir), 30), sandbox_qemus(data_dir)
    # Its bridge and tables went with it; the session server's are untouched.
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "covert" not in links
    assert "cove0" in links


def test_windows_snapshot_is_a_clear_error(cove):
    reply = cove.request("POST", "/sandbox", json={"snapshot": "windows-11"})
    assert reply.status_code == 400, reply.text
    assert "windows" in reply.json()["message"].lower()


def waiting_vms(data_dir: Path) -> list[int]:
    """QEMU processes of the server's warm pool: still in a `warm-*`
    directory of their own (a sandbox that took one leaves the old name
    behind as a symbolic link to its own directory)."""
    found = []
    for pid in qemu_processes(data_dir):
        launched_in = launch_dir(pid)
        if launched_in.name.startswith("warm-") and not launched_in.is_symlink():
            found.append(pid)
    return found


def launch_dir(pid: int) -> Path:
    """The directory a QEMU process was launched in, from its `-name`
    (`cove:{dir}/qmp.sock`): QEMU gets everything of it as descriptors."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    name = args[args.index(b"-name") + 1].decode().replace(",,", ",")
    return Path(name.removeprefix("cove:")).parent


def sandbox_qemus(data_dir: Path) -> list[int]:
    """QEMU processes of sandboxes: all but the warm pool's."""
    waiting = waiting_vms(data_dir)
    return [pid for pid in qemu_processes(data_dir) if pid not in waiting]


def test_a_create_takes_a_waiting_vm_of_the_warm_pool(fake_internet):
    """A server asked to keep one VM of the small size running and waiting
    does; a create takes it (the same QEMU process becomes the sandbox, with its
    identity and its network), a new one is made in its place; a size first
    created later is kept waiting from then on; and the server ends the
    waiting ones when it stops."""
    with own_vm_server(*fake_internet.server_args(), "--bridge", "covepool", "--network-range",
                       "10.76.0.0/16", "--route-table", "7703", "--vm-warm-pool", "1") as (server, data_dir):
        def made() -> int:
            """Warm VMs made ready so far (its QEMU runs before it is)."""
            return server.log_path.read_text(errors="replace").count("a warm VM waits")

        assert wait_until(lambda: made() == 1, TIMEOUT), server.log_tail()
        [waiting] = waiting_vms(data_dir)
        client = server.client()
        sandbox = client.create(
            CreateSandboxFromSnapshotParams(snapshot=VM, env_vars={"POOLED": "yes"},
                                            network_allow_list=f"{fake_internet.ALLOWED}/32"),
            timeout=TIMEOUT,
        )
        assert sandbox_qemus(data_dir) == [waiting]
        assert sandbox.process.exec("hostname").result.strip() == sandbox.id
        assert sandbox.process.exec("echo $POOLED").result.strip() == "yes"
        assert address_of(sandbox).startswith("10.76."), address_of(sandbox)
        assert fetch(sandbox, f"http://{fake_internet.ALLOWED}/") == "200"
        assert fetch(sandbox, f"http://{fake_internet.DENIED}/") == "000"
        # Another waits in its place.
        assert wait_until(lambda: made() == 2, TIMEOUT), server.log_tail()
        assert len(waiting_vms(data_dir)) == 1 and waiting not in waiting_vms(data_dir)

        # The taken VM pauses (warm: the same process), forks and resumes
        # like any other; the old name it was launched under goes with its
        # process.
        start_counter(sandbox)
        child = sandbox.fork(name=unique("pooled-child"))
        assert counting_on(child, 1)
        before = counter(sandbox)
        sandbox.pause()
        sandbox.start(timeout=TIMEOUT)
        assert waiting in sandbox_qemus(data_dir)
        assert counting_on(sandbox, before)
        assert fetch(sandbox, f"http://{fake_internet.ALLOWED}/") == "200"
        vms = data_dir / "storage" / "vms"
        for machine in (child, sandbox):
            client.delete(machine, timeout=TIMEOUT, wait=True)
        assert wait_until(lambda: not sandbox_qemus(data_dir), 30), sandbox_qemus(data_dir)
        assert not [p for p in vms.iterdir() if p.is_symlink()], list(vms.iterdir())

        # Another size finds none waiting; from its first create on, one of it waits too.
        tiny = CreateSandboxFromSnapshotParams(snapshot="daytona-vm-tiny")
        first = client.create(tiny)
        assert wait_until(lambda: made() == 3, TIMEOUT), server.log_tail()
        both = waiting_vms(data_dir)
        assert len(both) == 2, both
        second = client.create(tiny)
        assert len(set(sandbox_qemus(data_dir)) & set(both)) == 1, (sandbox_qemus(data_dir), both)
        assert int(second.process.exec("awk '/MemTotal/ {print $2}' /proc/meminfo").result) <= 256 * 1024
        assert wait_until(lambda: made() == 4, TIMEOUT), server.log_tail()
        for machine in (first, second):
            client.delete(machine, timeout=TIMEOUT, wait=True)

        server.stop()
        assert wait_until(lambda: not qemu_processes(data_dir), 30), qemu_processes(data_dir)
        assert not list(vms.glob("warm-*")), list(vms.iterdir())


def qemu_processes(data_dir: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "qemu-system" in cmdline and str(data_dir) in cmdline:
            found.append(int(entry.name))
    return found


def qemu_of(data_dir: Path, sandbox) -> int | None:
    """The QEMU process running a sandbox, found by its pid file."""
    try:
        pid = int((data_dir / "storage" / "vms" / sandbox.id / "qemu.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if pid in qemu_processes(data_dir) else None


def freezer_state(pid: int) -> str:
    """FROZEN or THAWED: the cgroup v1 freezer of a process's cgroup."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            return Path(f"/sys/fs/cgroup/freezer{path}/freezer.state").read_text().strip()
    raise AssertionError(f"process {pid} is in no freezer cgroup")


def clock_skew(sandbox) -> float:
    return abs(float(sandbox.process.exec("date +%s.%N").result.strip()) - time.time())


def test_a_pause_keeps_its_qemu_frozen_until_it_deepens_and_a_crash_loses_neither(fake_internet):
    """A pause keeps the VM's QEMU process, frozen, and a resume continues
    that same process: its processes, its clock and its network intact.
    After --warm-pause-minutes the pause deepens (memory saved, QEMU gone)
    and a resume restores it; a warm pause survives a server crash (the new
    server saves its memory) and a server's stop (which saves it); a stop
    from a warm pause keeps what the guest wrote."""
    args = (*fake_internet.server_args(), "--bridge", "covewarm", "--network-range", "10.74.0.0/16",
            "--route-table", "7705", "--warm-pause-minutes", "0.1", "--vm-warm-pool", "0")
    with own_vm_server(*args) as (server, data_dir):
        client = server.client()
        sandbox = client.create(
            CreateSandboxFromSnapshotParams(snapshot=VM, network_allow_list=f"{fake_internet.ALLOWED}/32"),
            timeout=TIMEOUT,
        )
        start_counter(sandbox)
        pid = qemu_of(data_dir, sandbox)
        assert pid is not None

        sandbox.pause()
        assert qemu_of(data_dir, sandbox) == pid, "the pause kept its QEMU"
        assert freezer_state(pid) == "FROZEN"
        frozen_at = cpu_seconds(pid)
        time.sleep(1)
        assert cpu_seconds(pid) == frozen_at, "a frozen QEMU uses no CPU"
        time.sleep(2)  # the guest's clock would fall behind by this much
        sandbox.start(timeout=TIMEOUT)
        assert qemu_of(data_dir, sandbox) == pid, "a warm resume continues the same QEMU"
        assert freezer_state(pid) == "THAWED"
        assert counting_on(sandbox, 2)
        assert clock_skew(sandbox) < 1.5, "the guest's clock is set on resume"
        assert fetch(sandbox, f"http://{fake_internet.ALLOWED}/") == "200"
        assert fetch(sandbox, f"http://{fake_internet.DENIED}/") == "000"

        # Deepened after 6 s: memory saved, the process gone; a resume restores it.
        before = counter(sandbox)
        sandbox.pause()
        assert wait_until(lambda: qemu_of(data_dir, sandbox) is None, 60), server.log_tail()
        assert (data_dir / "storage" / "vms" / sandbox.id / "state").exists()
        assert not (data_dir / "storage" / "vms" / sandbox.id / "warm-paused").exists()
        sandbox.start(timeout=TIMEOUT)
        assert counting_on(sandbox, before)
        assert clock_skew(sandbox) < 1.5
        assert fetch(sandbox, f"http://{fake_internet.ALLOWED}/") == "200"

        # A server crash during a warm pause: the new server saves its memory.
        before = counter(sandbox)
        sandbox.pause()
        frozen = qemu_of(data_dir, sandbox)
        assert frozen is not None and freezer_state(frozen) == "FROZEN"
        crash_and_restart(server)
        client = server.client()
        again = client.get(sandbox.id)
        assert again.state == SandboxState.PAUSED, again.state
        assert qemu_of(data_dir, again) is None, "its memory was saved and the frozen QEMU ended"
        again.start(timeout=TIMEOUT)
        assert counting_on(again, before)
        assert fetch(again, f"http://{fake_internet.ALLOWED}/") == "200"

        # A server told to stop saves a warm pause's memory on its way out.
        before = counter(again)
        again.pause()
        assert qemu_of(data_dir, again) is not None
        assert server.stop() == 0, server.log_tail()
        assert qemu_of(data_dir, again) is None, "the shutdown saved its memory and ended its QEMU"
        assert (data_dir / "storage" / "vms" / again.id / "state").exists()
        server.start()
        client = server.client()
        again = client.get(sandbox.id)
        assert again.state == SandboxState.PAUSED, again.state
        again.start(timeout=TIMEOUT)
        assert counting_on(again, before)

        # A stop from a warm pause: what the guest wrote (still in its page
        # cache at the pause) is on the disk afterwards.
        again.process.exec("echo kept > /home/daytona/written")
        again.pause()
        reply = server.request("POST", f"/sandbox/{again.id}/stop")
        assert reply.status_code == 200, reply.text
        assert qemu_of(data_dir, again) is None
        again.start(timeout=TIMEOUT)
        assert again.process.exec("cat /home/daytona/written").result.strip() == "kept"
        client.delete(again, timeout=TIMEOUT, wait=True)
        assert wait_until(lambda: not sandbox_qemus(data_dir), 30), sandbox_qemus(data_dir)


def test_killed_server_loses_no_vm_and_delete_leaves_no_qemu():
    with own_vm_server("--no-network") as (server, data_dir):
        client = server.client()
        running = client.create(CreateSandboxFromSnapshotParams(snapshot=VM, name="vm-running"))
        paused = client.create(CreateSandboxFromSnapshotParams(snapshot=VM, name="vm-paused"))
        running.fs.upload_file(b"running disk", "/home/daytona/f")
        paused.fs.upload_file(b"paused disk", "/home/daytona/f")
        start_counter(running)
        start_counter(paused)
        before = counter(paused)
        paused.pause()
        assert sandbox_qemus(data_dir), "a running VM has a QEMU process"

        crash_and_restart(server)
        client = server.client()

        again = client.get(running.id)
        assert again.state in (SandboxState.STARTED, SandboxState.STOPPED), again.state
        if again.state == SandboxState.STARTED:
            # Found again, still counting.
            assert counting_on(again, 1)
        else:
            again.start(timeout=TIMEOUT)
        assert again.fs.download_file("/home/daytona/f") == b"running disk"

        still = client.get(paused.id)
        assert still.state == SandboxState.PAUSED, still.state
        still.start(timeout=TIMEOUT)
        assert counting_on(still, before)
        assert still.fs.download_file("/home/daytona/f") == b"paused disk"

        for sandbox in (again, still):
            client.delete(sandbox, timeout=TIMEOUT, wait=True)
        assert wait_until(lambda: not sandbox_qemus(data_dir), 30), sandbox_qemus(data_dir)
