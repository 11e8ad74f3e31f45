"""PTY sessions through the SDK: create-connect with envs, a real terminal,
several clients, resize, exit codes and kill."""

from __future__ import annotations

import time

import pytest
from daytona import DaytonaError, DaytonaNotFoundError, PtySize

from conftest import SANDBOX_CLASSES, unique, sandbox_of_class

@pytest.fixture(params=SANDBOX_CLASSES)
def sandbox(request, sandboxes):
    """A fresh container, or this module's VM: every test runs on both."""
    return sandbox_of_class(request, sandboxes)


def read_until(handle, needle: str, timeout: float = 15.0) -> str:
    """Terminal output until it contains ``needle``; the PTY stays connected."""
    output = bytearray()
    deadline = time.monotonic() + timeout
    while needle.encode() not in output:
        assert time.monotonic() < deadline, f"{needle!r} never came; got {output!r}"
        handle.wait(on_data=output.extend, timeout=0.3)
        assert handle.exit_code is None or needle.encode() in output, f"pty ended: {output!r}"
    return output.decode(errors="replace")


def test_pty_runs_a_shell_on_a_real_terminal(sandbox):
    pty_id = unique("pty")
    handle = sandbox.process.create_pty_session(
        pty_id, cwd="/tmp", envs={"GREETING": "hello pty"}, pty_size=PtySize(rows=30, cols=100)
    )
    try:
        assert handle.is_connected()
        # The arithmetic keeps the echoed command line from matching.
        handle.send_input('echo "[$GREETING|$(pwd)|$((6*7))]"\n')
        read_until(handle, "[hello pty|/tmp|42]")
        handle.send_input("tty; echo size=$(stty size)=\n")
        output = read_until(handle, "size=30 100=")
        assert "/dev/pts/" in output

        info = sandbox.process.get_pty_session_info(pty_id)
        assert (info.id, info.active, info.cwd, info.cols, info.rows) == (pty_id, True, "/tmp", 100, 30)
        assert info.envs.get("GREETING") == "hello pty"
        assert pty_id in [s.id for s in sandbox.process.list_pty_sessions()]

        resized = handle.resize(PtySize(rows=40, cols=120))
        assert (resized.cols, resized.rows) == (120, 40)
        handle.send_input("echo size=$(stty size)=\n")
        read_until(handle, "size=40 120=")

        handle.send_input("exit 0\n")
        result = handle.wait(timeout=15)
        assert result.exit_code == 0
    finally:
        handle.disconnect()
    with pytest.raises(DaytonaNotFoundError):
        sandbox.process.get_pty_session_info(pty_id)


def test_pty_second_client_and_kill(sandbox):
    pty_id = unique("pty")
    first = sandbox.process.create_pty_session(pty_id)
    second = sandbox.process.connect_pty_session(pty_id)
    try:
        second.send_input("echo from-$((20+2))\n")
        read_until(first, "from-22")
        read_until(second, "from-22")
        first.send_input("sleep 1000 &\n")
        first.kill()
        for handle in (first, second):
            result = handle.wait(timeout=15)
            assert result.exit_code == 137
            assert result.error == "SIGKILL"
    finally:
        first.disconnect()
        second.disconnect()
    assert pty_id not in [s.id for s in sandbox.process.list_pty_sessions()]
    leftover = sandbox.process.exec("pgrep -x sleep || true")
    assert leftover.result.strip() == ""


def test_pty_exit_code_and_duplicate_id(sandbox):
    pty_id = unique("pty")
    handle = sandbox.process.create_pty_session(pty_id)
    try:
        with pytest.raises(DaytonaError) as refused:
            sandbox.process.create_pty_session(pty_id)
        assert refused.value.status_code == 409
        handle.send_input("exit 5\n")
        result = handle.wait(timeout=15)
        assert result.exit_code == 5
    finally:
        handle.disconnect()
    with pytest.raises(DaytonaError):
        sandbox.process.connect_pty_session(unique("missing"))
