"""What a server leaves on the host for other host users and for sandboxes to
find (issue 16, host hygiene): a private data dir and database, storage where a
set-user-id file or a device node means nothing, sandbox settings kept out of
every process's command line, containers that never outlive their server, a
shim pool that waits at the lowest priority and goes with its server, and no
mount or loop device left once the last sandbox is gone."""

from __future__ import annotations

import signal
import stat
import subprocess
import uuid
from pathlib import Path

from daytona import CreateSandboxFromSnapshotParams, SandboxState, VolumeMount

from conftest import CoveServer, mounts_under, new_data_dir, pool_cgroups_of, remove_data_dir, wait_until


def mount_options(mount_point: Path) -> set[str]:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(mount_point):
                return set(fields[5].split(","))
    raise AssertionError(f"{mount_point} is not mounted")


def cgroup_procs(sandbox_id: str) -> list[int]:
    pids: list[int] = []
    for procs in Path("/sys/fs/cgroup").glob(f"*/cove/{sandbox_id}/cgroup.procs"):
        try:
            pids += [int(p) for p in procs.read_text().split()]
        except OSError:
            pass
    return pids


def command_lines() -> list[str]:
    lines = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            lines.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return lines


def test_the_data_dir_and_database_are_private(cove):
    assert stat.S_IMODE(cove.data_dir.stat().st_mode) == 0o700
    for name in ["cove.db", "cove.db-wal", "cove.db-shm"]:
        path = cove.data_dir / name
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
    assert stat.S_IMODE((cove.data_dir / "ssh_host_ed25519_key").stat().st_mode) == 0o600


def test_storage_honours_no_setuid_file_or_device_node(cove):
    options = mount_options(cove.data_dir / "storage")
    assert {"nosuid", "nodev"} <= options, options


def test_a_sandboxs_environment_is_in_no_command_line(sandboxes):
    secret = "cv-secret-" + uuid.uuid4().hex
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(env_vars={"TOKEN": secret}))
    assert sandbox.process.exec("echo $TOKEN").result.strip() == secret
    leaks = [line for line in command_lines() if secret in line]
    assert not leaks, leaks


def test_containers_die_with_a_crashed_server_and_come_back(own_server):
    client = own_server.client()
    sandbox = client.create(CreateSandboxFromSnapshotParams(name="orphan-" + uuid.uuid4().hex[:6]))
    sandbox.fs.upload_file(b"kept", "kept.txt")
    assert cgroup_procs(sandbox.id), "the running sandbox has no process in its cgroup"

    own_server.proc.send_signal(signal.SIGKILL)
    own_server.proc.wait(timeout=10)
    own_server.proc = None
    # No container runs unsupervised once its server is gone.
    assert wait_until(lambda: not cgroup_procs(sandbox.id), timeout=10), cgroup_procs(sandbox.id)

    own_server.start()
    again = own_server.client().get(sandbox.id)
    if again.state != SandboxState.STARTED:
        again.start(timeout=60)
    assert again.fs.download_file("kept.txt") == b"kept"


def container_init_processes(server_pid: int) -> dict[int, tuple[int, int]]:
    """Every process running `cove __container-init SUPERVISOR SERVER_PID` for
    this server (the waiting shims and the inits they forked), by pid, with
    its parent and niceness; found by command line, so one that outlived its
    server would still be found."""
    found = {}
    for cmdline_path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline_path.read_bytes().split(b"\0")
            stat_text = (cmdline_path.parent / "stat").read_text()
        except OSError:
            continue
        if len(argv) > 3 and argv[1] == b"__container-init" and argv[3] == str(server_pid).encode():
            # After the command name in parentheses: state, ppid, ..., nice (the 17th).
            fields = stat_text.rsplit(")", 1)[1].split()
            found[int(cmdline_path.parent.name)] = (int(fields[1]), int(fields[16]))
    return found


def container_shims(server_pid: int) -> dict[int, int]:
    """The server's waiting shims (its own children), with their niceness."""
    return {
        pid: nice
        for pid, (parent, nice) in container_init_processes(server_pid).items()
        if parent == server_pid
    }


def pool_cgroups() -> set[Path]:
    return set(Path("/sys/fs/cgroup").glob("*/cove/pool@*"))


def test_the_shim_pool_waits_at_low_priority_and_goes_with_its_server():
    data_dir = new_data_dir()
    server = CoveServer(
        data_dir,
        api_key="cv-" + uuid.uuid4().hex,
        extra_args=("--no-network", "--container-pool", "3"),
    )
    others = pool_cgroups()
    server.start()
    try:
        pid = server.proc.pid
        def pool_inits() -> dict[int, int]:
            waiting = container_shims(pid)
            return {p: n for p, (parent, n) in container_init_processes(pid).items() if parent in waiting}

        # A shim shows before the container init it forks: both are waited for.
        assert wait_until(lambda: len(container_shims(pid)) == 3 and len(pool_inits()) == 3,
                          timeout=30), container_init_processes(pid)
        waiting = container_shims(pid)
        # Made ahead, at the lowest priority: they take no CPU a start wants.
        assert set(waiting.values()) == {19}, waiting
        inits = pool_inits()
        assert len(inits) == 3, container_init_processes(pid)
        ours = pool_cgroups() - others
        assert ours, "the pool's shims wait in no cgroup of their own"
        # The name other tests find a server's pool by.
        assert ours == pool_cgroups_of(data_dir), (ours, pool_cgroups_of(data_dir))

        sandbox = server.client().create()
        # The sandbox that took a shim runs at the normal priority.
        assert sandbox.process.exec("nice").result.strip() == "0"
        assert wait_until(lambda: len(container_shims(pid)) == 3, timeout=30), container_shims(pid)
        assert len(set(container_shims(pid)) & set(waiting)) == 2, "the pool was not refilled"
        # Deleted, so the stop below has no running sandbox to leave for a next start.
        server.client().delete(sandbox, wait=True)
        assert not cgroup_procs(sandbox.id)

        assert server.stop() == 0, server.log_tail()
        assert wait_until(lambda: not container_init_processes(pid), timeout=10), container_init_processes(pid)
        assert not (pool_cgroups() & ours), pool_cgroups() & ours
        assert not list(Path("/sys/fs/cgroup").glob(f"*/cove/{sandbox.id}")), "the sandbox's cgroups are left"
    finally:
        server.stop()
        remove_data_dir(data_dir)


def test_a_server_with_no_sandbox_left_unmounts_its_storage():
    data_dir = new_data_dir()
    server = CoveServer(data_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=("--no-network",))
    server.start()
    try:
        client = server.client()
        sandbox = client.create()
        assert sandbox.process.exec("echo hi").result.strip() == "hi"
        client.delete(sandbox, wait=True)
        assert server.stop() == 0, server.log_tail()
        assert not mounts_under(data_dir), mounts_under(data_dir)
        image = data_dir / "storage.img"
        attached = subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True).stdout
        assert wait_until(
            lambda: not subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True).stdout,
            timeout=10,
        ), attached
    finally:
        server.stop()
        remove_data_dir(data_dir)


def test_a_volume_cannot_fill_the_shared_storage():
    data_dir = new_data_dir()
    server = CoveServer(
        data_dir, api_key="cv-" + uuid.uuid4().hex, extra_args=("--no-network", "--volume-size-gib", "1")
    )
    server.start()
    try:
        client = server.client()
        volume = client.volume.get("cap-" + uuid.uuid4().hex[:6], create=True)
        sandbox = client.create(
            CreateSandboxFromSnapshotParams(volumes=[VolumeMount(volume_id=volume.id, mount_path="/data")])
        )
        wrote = sandbox.process.exec("dd if=/dev/zero of=/data/fill bs=1M count=1300 conv=fsync 2>&1", timeout=300)
        assert wrote.exit_code != 0, wrote.result
        assert "quota" in wrote.result.lower() or "space" in wrote.result.lower(), wrote.result
        size = int(sandbox.process.exec("stat -c %s /data/fill").result.strip())
        assert size <= 1 << 30, size
        # The sandbox's own disk is untouched by it, and the volume still works.
        assert sandbox.process.exec("rm /data/fill && echo ok > /data/after").exit_code == 0
        client.delete(sandbox, wait=True)
        assert server.request("DELETE", f"/volumes/{volume.id}").status_code == 200
    finally:
        server.delete_all()
        server.stop()
        remove_data_dir(data_dir)
