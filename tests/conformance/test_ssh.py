"""SSH access through the SDK and the system ssh client: tokens issued,
validated and revoked; `ssh TOKEN@host` runs commands with their exit status
and interactive shells on a terminal; refused tokens and stopped sandboxes get
a message, not a shell."""

from __future__ import annotations

import os
import socket
import subprocess
import urllib.request
from datetime import datetime, timezone

import pytest
from daytona import SessionExecuteRequest

from conftest import free_port, unique, wait_until

SSH = "/usr/bin/ssh"


def ssh(cove, token: str, *args: str, stdin: bytes | None = None, timeout: float = 60.0):
    """Runs the system ssh client against the server's gateway."""
    command = [
        SSH,
        "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null",
        "-o", "BatchMode=yes",
        "-o", "LogLevel=ERROR",
        "-o", "ConnectTimeout=20",
        "-p", str(cove.ssh_port),
        f"{token}@127.0.0.1",
        *args,
    ]
    return subprocess.run(
        command,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout,
    )


@pytest.fixture(autouse=True, scope="module")
def _needs_ssh():
    if not os.path.exists(SSH):
        pytest.skip("the system ssh client (openssh-client) is not installed")


def test_access_is_issued_validated_and_revoked(sandbox, cove):
    access = sandbox.create_ssh_access(expires_in_minutes=5)
    assert access.sandbox_id == sandbox.id
    assert len(access.token) >= 32
    assert access.ssh_command == f"ssh {access.token}@127.0.0.1 -p {cove.ssh_port}"
    lifetime = access.expires_at - access.created_at
    assert lifetime.total_seconds() == pytest.approx(300, abs=2)
    assert access.expires_at > datetime.now(timezone.utc)

    valid = sandbox.validate_ssh_access(access.token)
    assert (valid.valid, valid.sandbox_id) == (True, sandbox.id)

    sandbox.revoke_ssh_access(access.token)
    assert sandbox.validate_ssh_access(access.token).valid is False
    assert sandbox.validate_ssh_access("not-a-token").valid is False


def test_bad_lifetimes_and_unknown_sandboxes_are_refused(sandbox, cove):
    for minutes in (0, -1, 10**9):
        r = cove.request("POST", f"/sandbox/{sandbox.id}/ssh-access", params={"expiresInMinutes": minutes})
        assert r.status_code == 400, r.text
        assert "expiresInMinutes" in r.json()["message"]
    r = cove.request("POST", "/sandbox/no-such-sandbox/ssh-access")
    assert r.status_code == 404, r.text


def test_exec_prints_output_and_returns_the_exit_status(sandbox, cove):
    token = sandbox.create_ssh_access(expires_in_minutes=5).token
    done = ssh(cove, token, "echo", "ok")
    assert (done.returncode, done.stdout) == (0, b"ok\n"), done.stderr
    done = ssh(cove, token, "exit 3")
    assert done.returncode == 3, done.stderr
    # The command runs in the sandbox, with its shell.
    done = ssh(cove, token, "echo $((6*7)) > /tmp/ssh-made && cat /tmp/ssh-made && hostname")
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().splitlines()[0] == "42"
    assert sandbox.fs.download_file("/tmp/ssh-made") == b"42\n"


def test_an_interactive_terminal_runs_commands(sandbox, cove):
    token = sandbox.create_ssh_access(expires_in_minutes=5).token
    # -tt forces a terminal although stdin is a pipe; the arithmetic keeps the
    # echoed command line from matching.
    script = b"echo pty-$((40+2)); tty; exit 7\n"
    done = ssh(cove, token, "-tt", stdin=script)
    output = done.stdout.decode(errors="replace")
    assert "pty-42" in output, (output, done.stderr)
    assert "/dev/pts/" in output, output
    assert done.returncode == 7, (output, done.stderr)


def refused(done) -> str:
    assert done.returncode == 255, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == b""
    return done.stderr.decode(errors="replace")


def test_unknown_revoked_and_expired_tokens_are_refused(sandbox, cove):
    message = refused(ssh(cove, "not-a-token", "echo", "never"))
    assert "unknown, expired or revoked" in message

    access = sandbox.create_ssh_access(expires_in_minutes=5)
    assert ssh(cove, access.token, "true").returncode == 0
    sandbox.revoke_ssh_access(access.token)
    assert "unknown, expired or revoked" in refused(ssh(cove, access.token, "echo", "never"))

    # Revoking without a token revokes them all.
    tokens = [sandbox.create_ssh_access(expires_in_minutes=5).token for _ in range(2)]
    assert cove.request("DELETE", f"/sandbox/{sandbox.id}/ssh-access").status_code == 200
    for token in tokens:
        assert "unknown, expired or revoked" in refused(ssh(cove, token, "true"))


def test_a_stopped_sandbox_is_refused_with_a_message(sandbox, cove):
    token = sandbox.create_ssh_access(expires_in_minutes=5).token
    sandbox.stop()
    message = refused(ssh(cove, token, "echo", "never"))
    assert "start it" in message, message
    sandbox.start()
    done = ssh(cove, token, "echo", "back")
    assert (done.returncode, done.stdout) == (0, b"back\n"), done.stderr


def test_deleting_the_sandbox_ends_its_tokens(sandboxes, cove):
    sandbox = sandboxes()
    token = sandbox.create_ssh_access(expires_in_minutes=5).token
    sandbox.delete()
    r = cove.request("GET", "/sandbox/ssh-access/validate", params={"token": token})
    assert r.json() == {"valid": False, "sandboxId": ""}
    assert "unknown, expired or revoked" in refused(ssh(cove, token, "true"))


def test_local_forwarding_reaches_a_port_on_the_sandbox_loopback(sandbox, cove):
    """`ssh -L` through the agent's tunnel (`GET /cove/tunnel/{port}`)."""
    session = unique("web")
    sandbox.process.create_session(session)
    sandbox.process.execute_session_command(
        session,
        SessionExecuteRequest(
            command="mkdir -p /tmp/web && echo forwarded > /tmp/web/index.html && "
            "python3 -m http.server 8765 --bind 127.0.0.1 --directory /tmp/web",
            run_async=True,
        ),
    )
    assert wait_until(
        lambda: sandbox.process.exec("curl -sf http://127.0.0.1:8765/").exit_code == 0, 30
    ), "the web server in the sandbox did not start"

    token = sandbox.create_ssh_access(expires_in_minutes=5).token
    local = free_port()
    forward = subprocess.Popen(
        [
            SSH, "-N",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes",
            "-L", f"127.0.0.1:{local}:localhost:8765",
            "-p", str(cove.ssh_port), f"{token}@127.0.0.1",
        ],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", local)) == 0

        assert wait_until(listening, 20), "ssh -L never listened"
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=20).read()
        except OSError as error:
            forward.terminate()
            stderr = forward.communicate(timeout=10)[1].decode(errors="replace")
            if "404" in stderr and "/cove/tunnel" in stderr:
                pytest.skip(f"this agent has no tunnel endpoint yet: {stderr.strip()}")
            raise AssertionError(f"{error}; ssh said: {stderr}")
        assert body == b"forwarded\n"
    finally:
        if forward.poll() is None:
            forward.terminate()
            try:
                forward.wait(timeout=10)
            except subprocess.TimeoutExpired:
                # Seen once in CI under load: the client, told to end after
                # the page came through, had not ended 10 s later. What this
                # test checks (the forward) is done; no stray ssh is left.
                forward.kill()
                forward.wait(timeout=10)
        sandbox.process.delete_session(session)


def test_revoking_a_token_ends_its_live_session(sandbox, cove):
    token = sandbox.create_ssh_access(expires_in_minutes=5).token
    # A shell on a terminal, kept open by its stdin: a live connection.
    live = subprocess.Popen(
        [SSH, "-tt", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-p", str(cove.ssh_port),
         f"{token}@127.0.0.1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        live.stdin.write(b"echo live-$((40+2))\n")
        live.stdin.flush()
        seen = b""
        while b"live-42" not in seen:
            chunk = live.stdout.read1(4096)
            assert chunk, (seen, live.stderr.read())
            seen += chunk
        other = sandbox.create_ssh_access(expires_in_minutes=5).token
        # By raw HTTP: the pinned SDK's revoke_ssh_access(token) passes the
        # token where the organization header goes, which revokes them all.
        reply = cove.request("DELETE", f"/sandbox/{sandbox.id}/ssh-access", params={"token": token})
        assert reply.status_code == 200, reply.text
        # The gateway closes the connection that came in with the token...
        live.wait(timeout=30)
        assert live.returncode == 255, live.returncode
        assert b"revoked" in live.stderr.read()
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()
    # ...which opens nothing more; another token of the sandbox still works.
    assert "unknown, expired or revoked" in refused(ssh(cove, token, "true"))
    done = ssh(cove, other, "echo", "still")
    assert (done.returncode, done.stdout) == (0, b"still\n"), done.stderr
