"""Deleting a sandbox leaves no process, cgroup, mount or directory behind."""

from __future__ import annotations

import glob
from pathlib import Path

from daytona import SessionExecuteRequest

from conftest import assert_gone, wait_until


def cgroup_dirs(sandbox_id: str) -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/*/cove/{sandbox_id}") + glob.glob(f"/sys/fs/cgroup/cove/{sandbox_id}")


def mounts_mentioning(sandbox_id: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.strip() for line in f if sandbox_id in line]


def processes_mentioning(marker: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in text:
            found.append(f"{cmdline.parent.name}: {text}")
    return found


def test_delete_leaves_nothing_behind(cove, daytona, sandboxes):
    sandbox = sandboxes()
    sid = sandbox.id
    marker = "sleep 4" + "".join(c for c in sid if c.isdigit())[:5].ljust(5, "7")
    sandbox.process.create_session("bg")
    sandbox.process.execute_session_command("bg", SessionExecuteRequest(command=marker, run_async=True))
    sandbox.process.exec(f"nohup {marker} > /dev/null 2>&1 &")
    sandbox_dir = cove.data_dir / "storage" / "sandboxes" / sid

    # While it runs, the things we check for do exist (so the checks below can fail).
    assert cgroup_dirs(sid), "no cgroup of the running sandbox found"
    assert sandbox_dir.is_dir()
    assert wait_until(lambda: len(processes_mentioning(marker)) >= 2, timeout=5), processes_mentioning(marker)

    sandbox.delete()
    assert_gone(daytona, sid)
    assert wait_until(lambda: not processes_mentioning(marker), timeout=10), processes_mentioning(marker)
    assert wait_until(lambda: not cgroup_dirs(sid), timeout=10), cgroup_dirs(sid)
    assert not mounts_mentioning(sid), mounts_mentioning(sid)
    assert not sandbox_dir.exists(), list(sandbox_dir.rglob("*"))[:20]


def test_stop_ends_every_process(cove, daytona, sandboxes):
    sandbox = sandboxes()
    sid = sandbox.id
    marker = "sleep 5" + "".join(c for c in sid if c.isdigit())[:5].ljust(5, "3")
    sandbox.process.exec(f"nohup {marker} > /dev/null 2>&1 &")
    assert wait_until(lambda: processes_mentioning(marker), timeout=5)
    sandbox.stop()
    assert wait_until(lambda: not processes_mentioning(marker), timeout=10), processes_mentioning(marker)
    pids = [p for d in cgroup_dirs(sid) for p in Path(d, "cgroup.procs").read_text().split()] if cgroup_dirs(sid) else []
    assert not pids, pids
    # Its disk is kept for the next start.
    assert (cove.data_dir / "storage" / "sandboxes" / sid).is_dir()


def test_stop_ends_processes_that_ignore_sigterm(sandboxes):
    sandbox = sandboxes()
    marker = "sleep 6" + "".join(c for c in sandbox.id if c.isdigit())[:5].ljust(5, "1")
    sandbox.process.exec(f"nohup sh -c \"trap '' TERM; {marker}\" > /dev/null 2>&1 &")
    assert wait_until(lambda: processes_mentioning(marker), timeout=5)
    sandbox.stop(timeout=30)
    assert wait_until(lambda: not processes_mentioning(marker), timeout=10), processes_mentioning(marker)
    sandbox.start()
    assert marker not in sandbox.process.exec("ps -eo args").result
