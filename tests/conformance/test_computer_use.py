"""Computer use through the pinned SDK (issue 18), on a container and on a VM:
the desktop of the default image started on request, driven as computer-use
agents drive it (screenshots, mouse, keyboard, windows, recordings), and
stopped with nothing of it left running.
"""

from __future__ import annotations

import base64
import shlex
import struct
import time

import pytest
from daytona import CreateSandboxFromSnapshotParams, SessionExecuteRequest
from daytona.common.computer_use import ScreenshotOptions, ScreenshotRegion
from daytona.common.errors import DaytonaError

from conftest import SANDBOX_CLASSES, VM_SNAPSHOT, VM_TIMEOUT, SandboxFactory, unique, vm_assets, wait_until

# What the desktop runs, by Daytona's names (and the session bus and panel).
DESKTOP_PROCESSES = ["xvfb", "xfce4", "x11vnc", "novnc"]
# The desktop's programs, as `ps` shows their command lines, with the
# services its session bus starts (which leave their parent).
DESKTOP_PROGRAMS = [
    "Xvfb", "xfwm4", "xfce4-panel", "x11vnc", "websockify", "dbus-daemon",
    "at-spi-bus-launcher", "at-spi2-registryd", "xfconfd",
]
# A VM under TCG starts GTK programs slowly.
SLOW = 120


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    return struct.unpack(">II", data[16:24])


def jpeg_size(data: bytes) -> tuple[int, int]:
    assert data[:2] == b"\xff\xd8", data[:4]
    at = 2
    while at < len(data):
        marker, length = data[at + 1], struct.unpack(">H", data[at + 2 : at + 4])[0]
        if 0xC0 <= marker <= 0xC3:
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            return width, height
        at += 2 + length
    raise AssertionError("no JPEG frame header")


def decoded(response) -> bytes:
    data = base64.b64decode(response.screenshot)
    assert response.size_bytes == len(data)
    return data


@pytest.fixture(params=SANDBOX_CLASSES)
def desktop_sandbox(request: pytest.FixtureRequest, sandboxes: SandboxFactory):
    """A sandbox whose desktop is started, and stopped again after the test.
    The container asks for its own size through VNC_RESOLUTION."""
    if request.param == "vm":
        sandbox = request.getfixturevalue("module_vm")
        size = (1024, 768)
    else:
        sandbox = sandboxes(CreateSandboxFromSnapshotParams(env_vars={"VNC_RESOLUTION": "1280x800"}))
        size = (1280, 800)
    try:
        yield sandbox, size
    finally:
        sandbox.computer_use.stop()


def running_programs(sandbox) -> list[str]:
    listing = sandbox.process.exec("ps -eo args=").result
    return [name for name in DESKTOP_PROGRAMS if name in listing]


def window_titled(sandbox, title: str):
    for window in sandbox.computer_use.display.get_windows().windows:
        if window.title == title:
            return window
    return None


def test_the_desktop_is_driven_like_a_computer(desktop_sandbox):
    sandbox, (width, height) = desktop_sandbox
    cu = sandbox.computer_use
    assert cu.get_status().status == "inactive"
    with pytest.raises(DaytonaError) as refused:
        cu.screenshot.take_full_screen()
    assert "computer_use.start()" in str(refused.value)

    started = cu.start()
    for name in DESKTOP_PROCESSES:
        assert started.status[name].running, (name, started)
    assert wait_until(lambda: cu.get_status().status == "active", SLOW), cu.get_status()
    assert cu.get_process_status("xvfb").running

    displays = cu.display.get_info().displays
    assert [(d.width, d.height, d.is_active) for d in displays] == [(width, height, True)]
    before = decoded(cu.screenshot.take_full_screen())
    assert png_size(before) == (width, height)

    # A program the user starts finds the desktop without being told where.
    sandbox.process.create_session("desktop")
    sandbox.process.execute_session_command(
        "desktop",
        SessionExecuteRequest(
            command="xterm -geometry 60x10+40+40 -T typed-term -e sh -c 'cat > /tmp/typed.txt'",
            run_async=True,
        ),
    )
    assert wait_until(lambda: window_titled(sandbox, "typed-term") is not None, SLOW), (
        cu.display.get_windows(),
        cu.get_process_errors("xvfb"),
    )
    term = window_titled(sandbox, "typed-term")
    assert term.width > 100 and term.height > 50, term
    clicked = cu.mouse.click(term.x + term.width // 2, term.y + term.height // 2)
    assert (clicked.x, clicked.y) == (term.x + term.width // 2, term.y + term.height // 2)
    assert wait_until(lambda: window_titled(sandbox, "typed-term").is_active, SLOW)
    cu.keyboard.type("hello cove")
    cu.keyboard.press("Return")
    assert wait_until(
        lambda: sandbox.process.exec("cat /tmp/typed.txt 2>/dev/null").result == "hello cove\n", SLOW
    ), sandbox.process.exec("cat /tmp/typed.txt").result
    # Shifted characters and a hotkey reach the program too.
    cu.keyboard.type("A-Z!")
    cu.keyboard.press("enter")
    assert wait_until(
        lambda: sandbox.process.exec("cat /tmp/typed.txt").result == "hello cove\nA-Z!\n", SLOW
    ), sandbox.process.exec("cat /tmp/typed.txt").result

    after = decoded(cu.screenshot.take_full_screen(show_cursor=True))
    assert after != before

    region = decoded(cu.screenshot.take_region(ScreenshotRegion(x=10, y=20, width=200, height=100)))
    assert png_size(region) == (200, 100)
    jpeg = cu.screenshot.take_compressed(ScreenshotOptions(fmt="jpeg", quality=70, scale=0.5))
    assert jpeg_size(decoded(jpeg)) == (width // 2, height // 2)
    webp = decoded(cu.screenshot.take_compressed(ScreenshotOptions(fmt="webp")))
    assert webp[:4] == b"RIFF" and webp[8:12] == b"WEBP"
    small = cu.screenshot.take_compressed_region(
        ScreenshotRegion(x=0, y=0, width=100, height=60), ScreenshotOptions(fmt="png", scale=0.5)
    )
    assert png_size(decoded(small)) == (50, 30)
    with pytest.raises(DaytonaError) as outside:
        cu.screenshot.take_region(ScreenshotRegion(x=width - 10, y=0, width=100, height=100))
    assert "not inside" in str(outside.value)

    moved = cu.mouse.move(50, 60)
    assert (moved.x, moved.y) == (50, 60)
    position = cu.mouse.get_position()
    assert (position.x, position.y) == (50, 60)
    assert cu.mouse.scroll(50, 60, "down", 2) is True
    with pytest.raises(DaytonaError):
        cu.keyboard.press("no-such-key")

    # Ctrl+D at the start of a line ends `cat`, and with it the terminal.
    cu.mouse.click(term.x + term.width // 2, term.y + term.height // 2)
    cu.keyboard.hotkey("ctrl+d")
    assert wait_until(lambda: window_titled(sandbox, "typed-term") is None, SLOW), cu.display.get_windows()

    logs = cu.get_process_logs("xvfb")
    assert logs.process_name == "xvfb"
    with pytest.raises(DaytonaError) as unknown:
        cu.get_process_status("nonsense")
    assert "xvfb" in str(unknown.value)

    stopped = cu.stop()
    assert all(not status.running for status in stopped.status.values()), stopped
    assert cu.get_status().status == "inactive"
    assert wait_until(lambda: running_programs(sandbox) == [], 30), running_programs(sandbox)
    # Nothing of the desktop is left in the user's tree but X's own socket dir.
    listing = sandbox.process.exec("ls -A /tmp").result.split()
    assert [n for n in listing if n not in ("typed.txt", ".X11-unix", ".ICE-unix")] == [], listing


def test_a_recording_is_a_playable_mp4(desktop_sandbox, tmp_path):
    sandbox, _ = desktop_sandbox
    cu = sandbox.computer_use
    cu.start()
    recording = cu.recording.start("demo run")
    assert recording.status == "recording"
    assert recording.file_name.startswith("demo_run_") and recording.file_name.endswith(".mp4")
    for x in range(0, 300, 30):
        cu.mouse.move(x, x)
        time.sleep(0.3)
    with pytest.raises(DaytonaError) as busy:
        cu.recording.delete(recording.id)
    assert "still running" in str(busy.value)
    done = cu.recording.stop(recording.id)
    assert done.status == "completed", done
    assert done.duration_seconds >= 2.5 and done.size_bytes > 0
    assert [r.id for r in cu.recording.list().recordings] == [recording.id]
    assert cu.recording.get(recording.id).status == "completed"

    probed = sandbox.process.exec(
        f"ffprobe -v error -show_entries format=duration -of csv=p=0 '{done.file_path}'"
    )
    assert probed.exit_code == 0, probed.result
    assert float(probed.result) >= 2.0, probed.result

    local = tmp_path / "recording.mp4"
    cu.recording.download(recording.id, str(local))
    data = local.read_bytes()
    assert len(data) == done.size_bytes
    assert data[4:8] == b"ftyp"

    cu.recording.delete(recording.id)
    assert cu.recording.list().recordings == []
    with pytest.raises(DaytonaError):
        cu.recording.get(recording.id)
    assert sandbox.process.exec(f"test -e '{done.file_path}'").exit_code != 0


def test_a_dialog_is_read_and_answered_through_the_accessibility_tree(desktop_sandbox):
    sandbox, _ = desktop_sandbox
    cu = sandbox.computer_use
    cu.start()
    sandbox.process.create_session("dialog")
    shown = sandbox.process.execute_session_command(
        "dialog",
        SessionExecuteRequest(command="zenity --info --title cove-dialog --text 'cove says hi'", run_async=True),
    )

    def ok_button():
        # 404 until an application has joined the accessibility bus.
        # Every application's: the default scope is the focused one's.
        found = _try(
            lambda: cu.accessibility.find_nodes(role="push button", name="OK", name_match="exact", scope="all")
        )
        return found.matches[0] if found and found.matches else None

    assert wait_until(lambda: ok_button() is not None, SLOW, interval=1), (
        [(app.name, len(app.children or [])) for app in cu.accessibility.get_tree(scope="all").root.children],
        sandbox.process.exec("ps -eo pid,ppid,etime,args | grep -v '\\['").result,
        sandbox.process.get_session_command_logs("dialog", shown.cmd_id),
    )
    names = []

    def collect(node):
        names.append((node.role, node.name))
        for child in node.children or []:
            collect(child)

    collect(cu.accessibility.get_tree(scope="all").root)
    assert ("label", "cove says hi") in names, names
    assert ("dialog", "cove-dialog") in names, names

    button = ok_button()
    assert "Click" in button.actions, button
    cu.accessibility.invoke_node(button.id)

    def exit_code():
        return sandbox.process.get_session_command("dialog", shown.cmd_id).exit_code

    assert wait_until(lambda: exit_code() is not None, SLOW), "the dialog is still open"
    assert exit_code() == 0
    with pytest.raises(DaytonaError):
        cu.accessibility.invoke_node(button.id)


def test_a_person_watches_the_desktop_through_novnc(sandboxes: SandboxFactory):
    """noVNC on port 6080, through a signed preview: its page, and its
    WebSocket reaching x11vnc (the RFB greeting)."""
    import httpx
    from httpx_ws import connect_ws

    sandbox = sandboxes()
    sandbox.computer_use.start()
    try:
        assert wait_until(lambda: sandbox.computer_use.get_status().status == "active", SLOW)
        signed = sandbox.create_signed_preview_url(6080, expires_in_seconds=300)
        base = signed.url.rstrip("/")
        # websockify and x11vnc come up a moment after start answers.
        pages = []
        assert wait_until(lambda: pages.append(httpx.get(f"{base}/vnc.html", timeout=10)) or pages[-1].status_code == 200, 30, interval=0.5), (
            pages[-1].text,
            sandbox.computer_use.get_process_errors("novnc").errors,
        )
        assert "noVNC" in pages[-1].text

        def greeting():
            with httpx.Client(timeout=10) as client:
                with connect_ws(f"{base}/websockify", client, subprotocols=["binary"]) as ws:
                    return ws.receive_bytes(timeout=10)

        got = []
        assert wait_until(lambda: got.append(_try(greeting)) or got[-1] is not None, 30, interval=0.5)
        assert got[-1].startswith(b"RFB 003."), got[-1]
        # The desktop listens on loopback only: VNC, noVNC, and no X over TCP.
        listening = sandbox.process.exec(f"python3 -c {shlex.quote(LISTENERS)}").result.split()
        assert {entry.rsplit(":", 1)[1] for entry in listening} == {"5900", "6080"}, listening
        assert all(entry.rsplit(":", 1)[0] in ("127.0.0.1", "::1") for entry in listening), listening
    finally:
        sandbox.computer_use.stop()


# The TCP sockets listening in the sandbox, as address:port, from /proc.
LISTENERS = """
import socket, struct
for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
    for line in open(table).readlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state != "0A":
            continue
        address, port = local.split(":")
        raw = bytes.fromhex(address)
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        print("%s:%d" % (socket.inet_ntop(family, raw), int(port, 16)))
"""


def type_into(sandbox, window, text: str) -> None:
    cu = sandbox.computer_use
    cu.mouse.click(window.x + window.width // 2, window.y + window.height // 2)
    assert wait_until(lambda: window_titled(sandbox, window.title).is_active, SLOW)
    cu.keyboard.type(text)
    cu.keyboard.press("Return")


def test_a_vm_desktop_goes_on_across_pause_and_into_a_fork(sandboxes: SandboxFactory):
    """Memory is kept: the desktop, its windows and their programs are where
    they were after a pause, and running in a fork child, which types into
    its own copy."""
    if vm_assets() is None:
        pytest.skip("COVE_TEST_VM_ASSETS is not set (scripts/vm-assets)")
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(snapshot=VM_SNAPSHOT), timeout=VM_TIMEOUT)
    cu = sandbox.computer_use
    cu.start()
    sandbox.process.create_session("kept")
    sandbox.process.execute_session_command(
        "kept",
        SessionExecuteRequest(command="xterm -T kept-term -e sh -c 'cat >> /tmp/kept.txt'", run_async=True),
    )
    assert wait_until(lambda: window_titled(sandbox, "kept-term") is not None, SLOW)
    type_into(sandbox, window_titled(sandbox, "kept-term"), "before")

    def kept(box) -> str:
        return box.process.exec("cat /tmp/kept.txt 2>/dev/null").result

    assert wait_until(lambda: kept(sandbox) == "before\n", SLOW), kept(sandbox)

    sandbox.pause()
    sandbox.start(timeout=VM_TIMEOUT)
    assert cu.get_status().status == "active"
    assert png_size(decoded(cu.screenshot.take_full_screen())) == (1024, 768)
    type_into(sandbox, window_titled(sandbox, "kept-term"), "after pause")
    assert wait_until(lambda: kept(sandbox) == "before\nafter pause\n", SLOW), kept(sandbox)

    child = sandbox.fork(name=unique("desktop-fork"), timeout=VM_TIMEOUT)
    sandboxes.track(child.id)
    assert child.computer_use.get_status().status == "active"
    type_into(child, window_titled(child, "kept-term"), "in the child")
    assert wait_until(lambda: kept(child) == "before\nafter pause\nin the child\n", SLOW), kept(child)
    assert kept(sandbox) == "before\nafter pause\n"
    child.computer_use.stop()
    assert wait_until(lambda: running_programs(child) == [], 30), running_programs(child)
    assert cu.get_status().status == "active"
    cu.stop()


def _try(call):
    try:
        return call()
    except Exception:  # noqa: BLE001 - retried until the deadline
        return None
