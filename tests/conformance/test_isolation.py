"""Two sandboxes see neither each other nor the host, and a sandbox's syscalls and
capabilities are confined (seccomp allow-list, no CAP_NET_RAW)."""

from __future__ import annotations

import base64
import os
import uuid
from pathlib import Path

import pytest
from daytona import CreateSandboxFromSnapshotParams, SessionExecuteRequest


# This module is about what root inside a sandbox cannot do, so its sandboxes
# run as root; the default user's walls are test_default_user.py's.
AS_ROOT = CreateSandboxFromSnapshotParams(os_user="root")


@pytest.fixture
def sandbox(sandboxes):
    return sandboxes(AS_ROOT)


@pytest.fixture
def pair(sandboxes):
    return sandboxes(AS_ROOT), sandboxes(AS_ROOT)


def test_files_are_not_shared(pair):
    a, b = pair
    marker = uuid.uuid4().hex
    a.fs.upload_file(marker.encode(), f"/tmp/only-in-a-{marker}")
    a.process.exec(f"echo {marker} > /root/a-{marker}")
    assert a.process.exec(f"cat /tmp/only-in-a-{marker}").result == marker

    found = b.process.exec(f"ls /tmp /root; grep -rl {marker} /tmp /root /home 2>/dev/null; true")
    assert marker not in found.result
    assert b.process.exec(f"test -e /tmp/only-in-a-{marker}").exit_code == 1


def test_processes_are_not_shared(pair):
    a, b = pair
    session = "iso-" + uuid.uuid4().hex[:8]
    a.process.create_session(session)
    a.process.execute_session_command(session, SessionExecuteRequest(command="sleep 1234", run_async=True))
    assert "sleep 1234" in a.process.exec("ps aux").result

    ps_b = b.process.exec("ps aux").result
    assert "sleep 1234" not in ps_b
    # B sees only its own few processes, not the host's.
    assert len(ps_b.strip().splitlines()) < 20, ps_b


def test_host_files_are_not_visible(sandbox):
    marker = f"/tmp/cove-host-marker-{uuid.uuid4().hex}"
    with open(marker, "w") as f:
        f.write("host secret")
    try:
        assert sandbox.process.exec(f"test -e {marker}").exit_code == 1
        assert "host secret" not in sandbox.process.exec(f"cat {marker} 2>&1; true").result
    finally:
        os.unlink(marker)


def test_hostnames_differ(pair):
    a, b = pair
    host_a = a.process.exec("hostname").result.strip()
    host_b = b.process.exec("hostname").result.strip()
    assert host_a and host_b
    assert host_a != host_b
    assert os.uname().nodename not in (host_a, host_b)


def test_pid_1_is_the_sandbox_init(sandbox):
    inside = sandbox.process.exec("cat /proc/1/cmdline | tr '\\0' ' '").result.strip()
    with open("/proc/1/cmdline", "rb") as f:
        host = f.read().replace(b"\0", b" ").decode().strip()
    assert inside, "empty /proc/1/cmdline inside the sandbox"
    assert inside != host
    assert "cove" in inside or "init" in inside, inside


@pytest.mark.parametrize("ns", ["pid", "mnt", "uts", "ipc", "net", "user", "cgroup"])
def test_own_namespaces(sandbox, ns):
    inside = sandbox.process.exec(f"readlink /proc/self/ns/{ns}").result.strip()
    assert inside.startswith(f"{ns}:["), inside
    assert inside != os.readlink(f"/proc/self/ns/{ns}")


def host_pids(sandbox_id: str) -> list[int]:
    pids: list[int] = []
    for procs in Path("/sys/fs/cgroup").glob(f"*/cove/{sandbox_id}/cgroup.procs"):
        pids += [int(p) for p in procs.read_text().split()]
    return sorted(set(pids))


def host_ids(pid: int) -> tuple[list[int], list[int]]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    field = lambda name: [int(v) for v in next(l for l in status if l.startswith(name)).split()[1:]]
    return field("Uid:"), field("Gid:")


def test_sandbox_root_is_not_host_root(cove, pair):
    """Issue 16: /proc/self/uid_map was `0 0 4294967295`; root inside was uid 0 outside."""
    a, b = pair
    maps = []
    for sandbox in (a, b):
        assert sandbox.process.exec("id -u; id -g").result.split() == ["0", "0"]
        inside, outside, count = sandbox.process.exec("cat /proc/self/uid_map").result.split()
        assert (inside, count) == ("0", "65536"), (inside, outside, count)
        assert int(outside) >= 65536, outside
        assert sandbox.process.exec("cat /proc/self/gid_map").result.split() == [inside, outside, count]
        maps.append(int(outside))
        # Seen from the host, every process of the sandbox runs as its range, never as root.
        pids = host_pids(sandbox.id)
        assert pids, "no process of the sandbox found"
        for pid in pids:
            uids, gids = host_ids(pid)
            assert all(int(outside) <= i < int(outside) + 65536 for i in uids + gids), (pid, uids, gids)
    # Each sandbox has a range of its own.
    assert abs(maps[0] - maps[1]) >= 65536, maps


def test_files_keep_the_ids_the_sandbox_sees(cove, sandbox):
    sandbox.process.exec(
        "mkdir -p /srv/own && echo x > /srv/own/root-file && echo y > /srv/own/user-file "
        "&& chown 1000:1000 /srv/own/user-file"
    )
    listed = sandbox.process.exec("stat -c '%u:%g %n' /srv/own/root-file /srv/own/user-file /etc/passwd").result
    assert listed.strip().split("\n") == ["0:0 /srv/own/root-file", "1000:1000 /srv/own/user-file", "0:0 /etc/passwd"], listed
    # On disk the sandbox's layer holds the same ids: layers stay portable.
    upper = cove.data_dir / "storage" / "sandboxes" / sandbox.id / "upper" / "srv" / "own"
    assert (upper / "root-file").stat().st_uid == 0
    assert (upper / "user-file").stat().st_uid == 1000
    # Root inside still does what root does inside: packages, users, ownership.
    assert sandbox.process.exec("useradd -m someone && su someone -c 'id -un'").result.strip() == "someone"
    assert sandbox.process.exec("python3 -m http.server 80 >/dev/null 2>&1 & sleep 1; "
                                "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:80/").result.strip() == "200"


def test_root_inside_cannot_use_host_privileges(sandbox):
    # Host-only operations fail even for root inside.
    denied = sandbox.process.exec(
        "python3 -c 'import os; os.setgroups([]); os.setuid(0); "
        "import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)' 2>&1; echo rc=$?"
    ).result
    assert "rc=1" in denied, denied

def run_python(sandbox, script: str) -> str:
    """Runs a Python script in the sandbox; fails the test unless it exits 0."""
    encoded = base64.b64encode(script.encode()).decode()
    response = sandbox.process.exec(f"python3 -c \"import base64; exec(base64.b64decode('{encoded}'))\"", timeout=60)
    assert response.exit_code == 0, response.result
    return response.result.strip()


SYSCALL_PROBES = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(*[ctypes.c_long(a) for a in (nr,) + args])
    return "ok" if rc != -1 else errno.errorcode[ctypes.get_errno()]
for name, *args in %r:
    print(name, call(*args))
"""

# name, x86_64 syscall number and arguments, the answer expected under cove's filter.
PROBES = [
    ("keyctl", (250, 0, -3, 0), "EPERM"),
    ("add_key", (248, 0, 0, 0, 0, 0), "EPERM"),
    ("bpf", (321, 0, 0, 0), "EPERM"),
    ("syslog", (103, 10, 0, 0), "EPERM"),
    ("userfaultfd", (323, 0), "EPERM"),
    ("open_by_handle_at", (304, -100, 0, 0), "EPERM"),
    ("fsopen", (430, 0, 0), "EPERM"),
    ("io_uring_setup", (425, 1, 0), "EPERM"),
    ("unshare_user", (272, 0x10000000), "EPERM"),
    ("clone3", (435, 0, 0), "ENOSYS"),
    ("x32_getpid", (0x40000000 | 39,), "EPERM"),
    ("syscall_500", (500,), "EPERM"),
    ("vsock_socket", (41, 40, 1, 0), "EPERM"),
    ("raw_socket", (41, 2, 3, 1), "EPERM"),
    ("getpid", (39,), "ok"),
]


def test_syscalls_outside_the_allow_list_answer_eperm(sandbox):
    """keyctl, bpf, the new mount API, x32 and not-yet-existing syscall numbers: EPERM
    (clone3 ENOSYS so that libc falls back to clone)."""
    script = SYSCALL_PROBES % [(name, *args) for name, args, _ in PROBES]
    results = dict(line.split(" ", 1) for line in run_python(sandbox, script).splitlines())
    assert results == {name: expected for name, _, expected in PROBES}


ICMP_ECHO = """
import os, socket, struct
if os.environ.get("AS_NOBODY"):
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
s.settimeout(5)
s.sendto(struct.pack("!BBHHH", 8, 0, 0, 0, 1) + b"cove", ("127.0.0.1", 0))
print("reply type", s.recvfrom(64)[0][0])
"""


def test_no_cap_net_raw_but_unprivileged_ping(sandbox):
    status = sandbox.process.exec("grep -E '^Cap(Eff|Bnd):' /proc/self/status").result
    for line in status.strip().splitlines():
        assert int(line.split()[1], 16) & (1 << 13) == 0, f"CAP_NET_RAW kept: {status}"
    raw = sandbox.process.exec(
        "python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)'"
    )
    assert raw.exit_code != 0 and "PermissionError" in raw.result, raw.result
    assert run_python(sandbox, ICMP_ECHO) == "reply type 0"
    assert run_python(sandbox, "import os; os.environ['AS_NOBODY'] = '1'\n" + ICMP_ECHO) == "reply type 0"
