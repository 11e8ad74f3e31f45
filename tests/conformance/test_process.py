"""process.exec and sessions through the SDK."""

from __future__ import annotations

import asyncio
import time

import pytest
from daytona import DaytonaError, SessionExecuteRequest
from daytona_toolbox_api_client import InfoApi

from conftest import SANDBOX_CLASSES, unique, wait_until, sandbox_of_class

@pytest.fixture(params=SANDBOX_CLASSES)
def sandbox(request, sandboxes):
    """A fresh container, or this module's VM: every test runs on both."""
    return sandbox_of_class(request, sandboxes)


def test_exec_with_cwd_and_env(sandbox):
    response = sandbox.process.exec("pwd; echo $GREETING", cwd="/tmp", env={"GREETING": "hello there"})
    assert response.exit_code == 0
    assert response.result.splitlines() == ["/tmp", "hello there"]


def test_exec_relative_cwd_is_under_the_work_dir(sandbox):
    sandbox.process.exec("mkdir -p sub/dir")
    work_dir = sandbox.get_work_dir()
    response = sandbox.process.exec("pwd", cwd="sub/dir")
    assert response.exit_code == 0
    assert response.result.strip() == f"{work_dir.rstrip('/')}/sub/dir"


def test_exec_nonzero_exit_code_and_stderr(sandbox):
    response = sandbox.process.exec("echo out; echo err >&2; exit 7")
    assert response.exit_code == 7
    # stdout and stderr are both in result, in the order written.
    assert response.result.splitlines() == ["out", "err"]


def test_exec_timeout_returns_quickly(sandbox):
    started = time.monotonic()
    response = sandbox.process.exec("echo begin; sleep 30; echo never", timeout=1)
    elapsed = time.monotonic() - started
    assert elapsed < 3.5, f"exec with timeout=1 took {elapsed:.1f}s"
    # cove answers like timeout(1): exit code 124 and timedOut=true (an extra field
    # the SDK keeps in additional_properties); output so far is kept.
    assert response.exit_code == 124
    assert response.additional_properties.get("timedOut") is True
    assert "begin" in response.result
    assert "never" not in response.result
    # The command was killed, not left running.
    ps = sandbox.process.exec("ps -eo args")
    assert "sleep 30" not in ps.result


def test_session_keeps_cwd_and_exports(sandbox):
    session = unique("sess")
    sandbox.process.create_session(session)
    try:
        first = sandbox.process.execute_session_command(
            session, SessionExecuteRequest(command="cd /tmp && export FOO=bar")
        )
        assert first.exit_code == 0
        second = sandbox.process.execute_session_command(session, SessionExecuteRequest(command="pwd; echo $FOO"))
        assert second.exit_code == 0
        assert second.output.splitlines() == ["/tmp", "bar"]
        assert second.stdout.splitlines() == ["/tmp", "bar"]
    finally:
        sandbox.process.delete_session(session)


def test_session_sync_output_and_exit_code(sandbox):
    session = unique("sess")
    sandbox.process.create_session(session)
    try:
        response = sandbox.process.execute_session_command(
            session, SessionExecuteRequest(command="echo to-out; echo to-err >&2; false")
        )
        assert response.cmd_id
        assert response.exit_code == 1
        assert "to-out" in response.stdout and "to-err" not in response.stdout
        assert "to-err" in response.stderr and "to-out" not in response.stderr
        assert "to-out" in response.output and "to-err" in response.output

        command = sandbox.process.get_session_command(session, response.cmd_id)
        assert command.id == response.cmd_id
        assert command.exit_code == 1

        # The session survives a failing command.
        after = sandbox.process.execute_session_command(session, SessionExecuteRequest(command="echo ok"))
        assert after.exit_code == 0
        assert after.output.strip() == "ok"
    finally:
        sandbox.process.delete_session(session)


def test_session_async_command(sandbox):
    session = unique("sess")
    sandbox.process.create_session(session)
    try:
        started = time.monotonic()
        response = sandbox.process.execute_session_command(
            session,
            SessionExecuteRequest(command="echo start; sleep 2; echo done >&2; exit 3", run_async=True),
        )
        assert time.monotonic() - started < 1.5, "run_async waited for the command"
        assert response.cmd_id

        running = sandbox.process.get_session_command(session, response.cmd_id)
        assert running.id == response.cmd_id
        assert "sleep 2" in running.command
        assert running.exit_code is None

        finished = wait_until(
            lambda: sandbox.process.get_session_command(session, response.cmd_id).exit_code is not None,
            timeout=15,
            interval=0.25,
        )
        assert finished, "the async command never got an exit code"
        assert sandbox.process.get_session_command(session, response.cmd_id).exit_code == 3

        logs = sandbox.process.get_session_command_logs(session, response.cmd_id)
        assert logs.stdout.strip() == "start"
        assert logs.stderr.strip() == "done"
        assert "start" in logs.output and "done" in logs.output
    finally:
        sandbox.process.delete_session(session)


def test_delete_session(sandbox):
    session = unique("sess")
    sandbox.process.create_session(session)
    assert sandbox.process.get_session(session).session_id == session
    assert session in [s.session_id for s in sandbox.process.list_sessions()]
    sandbox.process.delete_session(session)
    assert session not in [s.session_id for s in sandbox.process.list_sessions()]
    with pytest.raises(Exception) as info:
        sandbox.process.execute_session_command(session, SessionExecuteRequest(command="echo x"))
    assert session in str(info.value)


def test_exec_large_and_unicode_output(sandbox):
    response = sandbox.process.exec("head -c 1000000 /dev/zero | tr '\\0' 'a'; printf 'ünï ✓\\n'")
    assert response.exit_code == 0
    assert response.result.startswith("a" * 1000)
    assert response.result.count("a") >= 1_000_000
    assert response.result.endswith("ünï ✓\n")


def test_exec_stdin_is_closed(sandbox):
    started = time.monotonic()
    response = sandbox.process.exec("cat; echo after", timeout=10)
    assert time.monotonic() - started < 5
    assert response.result.strip() == "after"


def test_session_logs_follow(sandbox):
    session = unique("sess")
    sandbox.process.create_session(session)
    try:
        response = sandbox.process.execute_session_command(
            session,
            SessionExecuteRequest(
                command="echo one; sleep 0.5; echo oops >&2; sleep 0.5; echo two", run_async=True
            ),
        )
        out, err = [], []
        started = time.monotonic()
        asyncio.run(
            asyncio.wait_for(
                sandbox.process.get_session_command_logs_async(session, response.cmd_id, out.append, err.append),
                timeout=20,
            )
        )
        # Follow ends when the command ends, not before.
        assert time.monotonic() - started >= 0.8
        assert "".join(out) == "one\ntwo\n"
        assert "".join(err) == "oops\n"
        assert sandbox.process.get_session_command(session, response.cmd_id).exit_code == 0
    finally:
        sandbox.process.delete_session(session)


def test_ninth_shell_and_seventeenth_background_command_are_refused(sandbox):
    sessions = [unique(f"lim{i}") for i in range(8)]
    try:
        for session in sessions:
            sandbox.process.create_session(session)
        with pytest.raises(DaytonaError) as refused:
            sandbox.process.create_session(unique("ninth"))
        assert refused.value.status_code == 429
        assert "8" in str(refused.value)

        for i in range(16):
            sandbox.process.execute_session_command(
                sessions[i % 8], SessionExecuteRequest(command="sleep 60", run_async=True)
            )
        with pytest.raises(DaytonaError) as refused:
            sandbox.process.execute_session_command(
                sessions[0], SessionExecuteRequest(command="sleep 60", run_async=True)
            )
        assert refused.value.status_code == 429
        assert "16" in str(refused.value)
    finally:
        for session in sessions:
            try:
                sandbox.process.delete_session(session)
            except DaytonaError:
                pass
    # Deleting the shells ended their commands, so new ones are admitted.
    assert wait_until(lambda: "sleep 60" not in sandbox.process.exec("ps -eo args").result, 10)
    session = unique("after")
    sandbox.process.create_session(session)
    sandbox.process.delete_session(session)


def test_info_endpoints(sandbox):
    # Containers run as the default user, VMs as root.
    assert sandbox.get_user_home_dir() == {"daytona": "/home/daytona", "root": "/root"}[sandbox.user]
    assert sandbox.get_work_dir() == sandbox.process.exec("pwd").result.strip()
    assert InfoApi(sandbox._toolbox_api).get_version()["version"]
