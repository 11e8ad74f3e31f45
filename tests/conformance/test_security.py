"""The server against hostile clients, on a server of its own with short
timeouts (`--header-read-timeout 2 --ssh-auth-timeout 2`): connections that
never finish their HTTP headers, never start their TLS handshake or never
authenticate over SSH are closed, while honest clients are still served."""

from __future__ import annotations

import socket
import ssl
import time
import uuid
from typing import Iterator

import pytest

from conftest import CoveServer, TlsFiles, new_data_dir, remove_data_dir

TIMEOUT_S = 2
# Generous: the tests show that connections are closed, not how fast.
SLACK_S = 20
ATTACKERS = 20


@pytest.fixture(scope="module")
def own_tls() -> Iterator[TlsFiles]:
    # Its own: the session's TlsFiles names the session server's port.
    files = TlsFiles()
    try:
        yield files
    finally:
        files.remove()


@pytest.fixture(scope="module")
def guarded(own_tls: TlsFiles) -> Iterator[CoveServer]:
    data_dir = new_data_dir()
    server = CoveServer(
        data_dir,
        api_key="cv-" + uuid.uuid4().hex,
        extra_args=(
            "--no-network",
            "--header-read-timeout", str(TIMEOUT_S),
            "--ssh-auth-timeout", str(TIMEOUT_S),
            *own_tls.server_args(),
        ),
    )
    server.tls_port = own_tls.port
    server.start()
    try:
        yield server
    finally:
        server.stop()
        remove_data_dir(data_dir)


def open_connections(port: int, first_bytes: bytes) -> list[socket.socket]:
    connections = []
    for _ in range(ATTACKERS):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if first_bytes:
            s.sendall(first_bytes)
        connections.append(s)
    return connections


def assert_all_closed(connections: list[socket.socket]) -> None:
    deadline = time.monotonic() + TIMEOUT_S + SLACK_S
    for s in connections:
        try:
            while True:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    if not s.recv(4096):
                        break
                except ConnectionResetError:
                    break
                except socket.timeout:
                    pytest.fail("the server kept a connection open past its timeout")
        finally:
            s.close()


def test_clients_that_never_finish_their_headers_are_closed(guarded):
    attackers = open_connections(guarded.port, b"GET /api/sandb")
    # An honest request is served meanwhile.
    r = guarded.request("GET", "/sandbox")
    assert r.status_code == 200, r.text
    assert_all_closed(attackers)
    assert guarded.request("GET", "/sandbox").status_code == 200


def test_tls_clients_that_never_send_a_client_hello_are_closed(guarded, own_tls):
    attackers = open_connections(guarded.tls_port, b"")
    assert_all_closed(attackers)
    # A real TLS client still gets an answer.
    context = ssl.create_default_context(cafile=str(own_tls.dir / "ca.pem"))
    with socket.create_connection(("127.0.0.1", guarded.tls_port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert tls.recv(12).startswith(b"HTTP/1.1")


def test_ssh_clients_that_never_authenticate_are_dropped(guarded):
    attackers = open_connections(guarded.ssh_port, b"SSH-2.0-slow\r\n")
    attackers += open_connections(guarded.ssh_port, b"")
    assert_all_closed(attackers)
    # The gateway still greets a new client.
    with socket.create_connection(("127.0.0.1", guarded.ssh_port), timeout=10) as s:
        assert s.recv(8) == b"SSH-2.0-"
