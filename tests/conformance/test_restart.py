"""A server restart over the same data directory brings sandboxes back, files intact."""

from __future__ import annotations

from pathlib import Path

from daytona import CreateSandboxFromSnapshotParams, SandboxState


def test_restart_keeps_sandboxes_and_files(own_server):
    client = own_server.client()
    running = client.create(CreateSandboxFromSnapshotParams(name="keep-running"))
    stopped = client.create(CreateSandboxFromSnapshotParams(name="keep-stopped"))
    running.fs.upload_file(b"survives restarts", "persist.txt")
    stopped.fs.upload_file(b"stopped too", "persist.txt")
    stopped.stop()

    assert own_server.stop() == 0, own_server.log_tail()
    # The running sandbox ended with the server, and its cgroups went too: a
    # data directory never started again would have left them for good.
    left = list(Path("/sys/fs/cgroup").glob(f"*/cove/{running.id}"))
    assert not left, f"the stopped server left the cgroups of its sandbox: {left}"
    own_server.start()
    client = own_server.client()

    listed = [s.id for s in client.list()]
    assert sorted(listed) == sorted([running.id, stopped.id]), listed

    again = client.get(running.id)
    assert again.state in (SandboxState.STARTED, SandboxState.STOPPED), again.state
    if again.state == SandboxState.STOPPED:
        again.start()
    assert again.state == SandboxState.STARTED
    assert again.fs.download_file("persist.txt") == b"survives restarts"
    assert again.process.exec("echo up").result.strip() == "up"

    # A sandbox the user stopped stays stopped, and starts with its disk.
    still = client.get(stopped.id)
    assert still.state == SandboxState.STOPPED
    still.start()
    assert still.fs.download_file("persist.txt") == b"stopped too"
