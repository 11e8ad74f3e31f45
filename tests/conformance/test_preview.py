"""Preview URLs through the SDK: a web server inside a sandbox, reached through
cove's listener with the sandbox's preview token, as a public sandbox, and by
signed URLs; WebSocket and server-sent events pass through as they happen, and
preview traffic does not reset the sandbox's idle clock.

The servers in the sandbox use only the image's python3 standard library.
"""

from __future__ import annotations

import time
import uuid
from typing import Iterator

import httpx
import pytest
import requests
from httpx_ws import connect_ws

from daytona import Daytona, DaytonaConfig, Sandbox, SessionExecuteRequest

from conftest import CoveServer, new_data_dir, remove_data_dir, wait_until

TOKEN_HEADER = "X-Daytona-Preview-Token"
APP_PORT = 8765
FILES_PORT = 8000

# One HTTP server, stdlib only: /hello, /headers (what the app was sent),
# /sse (five events 0.2 s apart) and /ws (a WebSocket echo of text frames).
APP = r'''
import base64, hashlib, http.server, json, socketserver, struct, sys, time

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send_text(self, status, text, content_type="text/plain"):
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/hello":
            self.send_text(200, "hello from the sandbox")
        elif self.path.startswith("/headers"):
            self.send_text(200, json.dumps({k.lower(): v for k, v in self.headers.items()}
                                           | {"path": self.path}), "application/json")
        elif self.path == "/sw.js":
            # A service worker script that asks for the whole origin.
            self.send_response(200)
            self.send_header("Content-Type", "text/javascript")
            self.send_header("Service-Worker-Allowed", "/")
            # Headers that would speak for the whole origin.
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("NEL", '{"report_to": "x", "max_age": 60}')
            self.send_header("Report-To", '{"group": "x", "max_age": 60, "endpoints": []}')
            self.send_header("Clear-Site-Data", '"storage"')
            self.send_header("Alt-Svc", "clear")
            self.send_header("X-App", "kept")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"//")
        elif self.path == "/sse":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            for n in range(5):
                self.wfile.write(f"data: {n} {time.time()}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.2)
        elif self.path == "/ws":
            self.websocket()
        else:
            self.send_text(404, "no such page")

    def websocket(self):
        key = self.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            opcode, length = head[0] & 0x0F, head[1] & 0x7F
            if length == 126:
                length = struct.unpack(">H", self.rfile.read(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
            if opcode == 8:
                self.wfile.write(b"\x88\x00")
                return
            if opcode == 1:
                reply = b"echo: " + data
                header = bytes([0x81, len(reply)]) if len(reply) < 126 else \
                    bytes([0x81, 126]) + struct.pack(">H", len(reply))
                self.wfile.write(header + reply)
                self.wfile.flush()

class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''


PROBE = """
import socket, sys
for port in sys.argv[1:]:
    socket.create_connection(("127.0.0.1", int(port)), 1).close()
"""


def start_servers(sandbox: Sandbox) -> None:
    """The app on APP_PORT and `python3 -m http.server` on FILES_PORT, both
    listening on the sandbox's loopback only."""
    assert sandbox.process.exec("mkdir -p /tmp/site").exit_code == 0
    sandbox.fs.upload_file(APP.encode(), "/tmp/app.py")
    sandbox.fs.upload_file(b"a file served by http.server\n", "/tmp/site/page.txt")
    sandbox.fs.upload_file(PROBE.encode(), "/tmp/probe.py")
    commands = {
        "app": f"python3 /tmp/app.py {APP_PORT}",
        "files": f"cd /tmp/site && python3 -m http.server --bind 127.0.0.1 {FILES_PORT}",
    }
    for session, command in commands.items():
        sandbox.process.create_session(session)
        sandbox.process.execute_session_command(session, SessionExecuteRequest(command=command, run_async=True))
    last = None

    def listening() -> bool:
        nonlocal last
        last = sandbox.process.exec(f"python3 /tmp/probe.py {APP_PORT} {FILES_PORT}")
        return last.exit_code == 0

    assert wait_until(listening, timeout=30), f"servers did not start: {last.result}"


@pytest.fixture
def web(sandbox: Sandbox) -> Sandbox:
    start_servers(sandbox)
    return sandbox


def test_the_preview_url_serves_with_the_token_and_refuses_without(web: Sandbox, cove: CoveServer):
    preview = web.get_preview_link(APP_PORT)
    assert preview.url == f"{cove.base_url}/preview/{web.id}/{APP_PORT}"
    assert preview.token

    r = requests.get(f"{preview.url}/hello", headers={TOKEN_HEADER: preview.token}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.text == "hello from the sandbox"

    r = requests.get(f"{preview.url}/hello", timeout=10)
    assert r.status_code == 401
    assert "X-Daytona-Preview-Token" in r.json()["message"]
    r = requests.get(f"{preview.url}/hello", headers={TOKEN_HEADER: "not-the-token"}, timeout=10)
    assert r.status_code == 401

    # The API key works too, and neither credential reaches the sandbox.
    r = requests.get(
        f"{preview.url}/headers?x=1", headers={"Authorization": f"Bearer {cove.api_key}"}, timeout=10
    )
    assert r.status_code == 200, r.text
    seen = r.json()
    assert "authorization" not in seen and TOKEN_HEADER.lower() not in seen
    assert seen["path"] == "/headers?x=1"
    assert seen["x-forwarded-prefix"] == f"/preview/{web.id}/{APP_PORT}"
    # With the token, the API key is still removed; an application's own
    # Authorization header passes.
    for authorization, forwarded in ((f"Bearer {cove.api_key}", False), ("Bearer app-secret", True)):
        r = requests.get(
            f"{preview.url}/headers",
            headers={TOKEN_HEADER: preview.token, "Authorization": authorization},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        assert ("authorization" in r.json()) == forwarded

    # A path-based preview shares its origin with the API and the web console,
    # so nothing it answers may speak for the whole origin.
    r = requests.get(f"{preview.url}/sw.js", headers={TOKEN_HEADER: preview.token}, timeout=10)
    assert r.status_code == 200 and r.text == "//"
    for origin_wide in ("service-worker-allowed", "cross-origin-opener-policy", "nel", "report-to",
                        "clear-site-data", "alt-svc"):
        assert origin_wide not in r.headers, origin_wide
    assert r.headers["x-app"] == "kept"

    # `python3 -m http.server` as it is.
    files = web.get_preview_link(FILES_PORT)
    r = requests.get(f"{files.url}/page.txt", headers={TOKEN_HEADER: files.token}, timeout=10)
    assert r.status_code == 200 and r.text == "a file served by http.server\n"


def test_errors_name_the_port_and_the_state(web: Sandbox, cove: CoveServer):
    closed = web.get_preview_link(9)
    r = requests.get(closed.url + "/", headers={TOKEN_HEADER: closed.token}, timeout=10)
    assert r.status_code == 502
    assert "port 9" in r.json()["message"]

    r = cove.request("GET", f"/sandbox/{web.id}/ports/70000/preview-url")
    assert r.status_code == 400 and "70000" in r.json()["message"]

    preview = web.get_preview_link(APP_PORT)
    web.stop()
    r = requests.get(f"{preview.url}/hello", headers={TOKEN_HEADER: preview.token}, timeout=10)
    assert r.status_code == 409
    assert "stopped" in r.json()["message"]


def test_a_public_sandbox_needs_no_token(web: Sandbox):
    web.set_public(True)
    preview = web.get_preview_link(APP_PORT)
    r = requests.get(f"{preview.url}/hello", timeout=10)
    assert r.status_code == 200 and r.text == "hello from the sandbox"
    web.set_public(False)
    assert requests.get(f"{preview.url}/hello", timeout=10).status_code == 401


def test_websocket_echo_round_trips(web: Sandbox):
    preview = web.get_preview_link(APP_PORT)
    with httpx.Client(headers={TOKEN_HEADER: preview.token}, timeout=10) as client:
        with connect_ws(preview.url + "/ws", client) as ws:
            for text in ("first", "second " * 40):
                ws.send_text(text)
                assert ws.receive_text(timeout=10) == "echo: " + text


def test_server_sent_events_arrive_as_they_are_sent(web: Sandbox):
    preview = web.get_preview_link(APP_PORT)
    with requests.get(
        f"{preview.url}/sse", headers={TOKEN_HEADER: preview.token}, stream=True, timeout=10
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        arrivals = []
        for line in r.iter_lines(chunk_size=1):
            if line.startswith(b"data: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 5
    # The server sleeps 0.2 s between events: a buffering proxy would deliver
    # them all at once at the end.
    assert arrivals[-1] - arrivals[0] > 0.5


def test_a_signed_url_works_alone_until_expired(web: Sandbox, cove: CoveServer):
    signed = web.create_signed_preview_url(APP_PORT, expires_in_seconds=120)
    assert signed.sandbox_id == web.id and signed.port == APP_PORT
    assert signed.token in signed.url
    r = requests.get(f"{signed.url}/hello", timeout=10)
    assert r.status_code == 200 and r.text == "hello from the sandbox"

    web.expire_signed_preview_url(APP_PORT, signed.token)
    r = requests.get(f"{signed.url}/hello", timeout=10)
    assert r.status_code == 401 and "expired" in r.json()["message"]

    short = web.create_signed_preview_url(APP_PORT, expires_in_seconds=1)
    assert requests.get(f"{short.url}/hello", timeout=10).status_code == 200
    assert wait_until(lambda: requests.get(f"{short.url}/hello", timeout=10).status_code == 401, timeout=10)


def test_preview_traffic_does_not_reset_the_idle_clock(web: Sandbox, daytona: Daytona):
    preview = web.get_preview_link(APP_PORT)
    # Starting the servers went through the toolbox; let that settle first.
    before = daytona.get(web.id).last_activity_at
    time.sleep(1.1)
    for _ in range(5):
        r = requests.get(f"{preview.url}/hello", headers={TOKEN_HEADER: preview.token}, timeout=10)
        assert r.status_code == 200
    assert daytona.get(web.id).last_activity_at == before
    # The toolbox does reset it, so the comparison above means something.
    web.process.exec("true")
    assert daytona.get(web.id).last_activity_at != before


@pytest.fixture(scope="module")
def host_based() -> Iterator[CoveServer]:
    """A server of its own with a preview domain; without sandbox networking,
    so it shows the tunnel reaches sandboxes that have no network device."""
    data_dir = new_data_dir()
    server = CoveServer(
        data_dir,
        api_key="cv-" + uuid.uuid4().hex,
        extra_args=("--no-network", "--preview-domain", "preview.localhost"),
    )
    try:
        server.start()
        yield server
    finally:
        try:
            if server.proc is not None and server.proc.poll() is None:
                server.delete_all()
        finally:
            server.stop()
            remove_data_dir(data_dir)


def test_host_based_preview_urls(host_based: CoveServer):
    client = Daytona(DaytonaConfig(api_key=host_based.api_key, api_url=host_based.api_url))
    sandbox = client.create()
    try:
        start_servers(sandbox)
        preview = sandbox.get_preview_link(APP_PORT)
        assert preview.url == f"http://{APP_PORT}-{sandbox.id}.preview.localhost:{host_based.port}"
        # No wildcard DNS needed: the Host header is what routes.
        host = preview.url.removeprefix("http://")
        r = requests.get(
            f"{host_based.base_url}/hello", headers={"Host": host, TOKEN_HEADER: preview.token}, timeout=10
        )
        assert r.status_code == 200 and r.text == "hello from the sandbox"
        r = requests.get(f"{host_based.base_url}/hello", headers={"Host": host}, timeout=10)
        assert r.status_code == 401
        # A host-based preview is an origin of the sandbox's own: its headers pass.
        r = requests.get(
            f"{host_based.base_url}/sw.js", headers={"Host": host, TOKEN_HEADER: preview.token}, timeout=10
        )
        assert r.headers.get("service-worker-allowed") == "/"
        assert r.headers.get("cross-origin-opener-policy") == "same-origin"

        signed = sandbox.create_signed_preview_url(APP_PORT, expires_in_seconds=60)
        r = requests.get(
            f"{host_based.base_url}/hello", headers={"Host": signed.url.removeprefix("http://")}, timeout=10
        )
        assert r.status_code == 200 and r.text == "hello from the sandbox"
    finally:
        client.delete(sandbox)
