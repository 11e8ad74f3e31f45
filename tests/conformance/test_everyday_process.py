"""Daytona's everyday habits (issue 23), as its documentation uses them:
`process.code_run` (output, argv, env, exit codes, timeouts, matplotlib charts,
JavaScript), answering a session command's prompt with
`send_session_command_input`, and `exec` of a server started in the background.

The default image has Python and Node.js (Debian's) but not matplotlib. The
chart tests copy matplotlib (and what it imports) from the Python named by
COVE_TEST_MATPLOTLIB_BIN into the sandbox's user site-packages, and one
JavaScript test copies the machine's own `node` into /tmp and runs that, both
through the SDK.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest
from daytona import (
    BarChart,
    ChartType,
    CodeRunParams,
    CreateSandboxFromSnapshotParams,
    LineChart,
    SessionExecuteRequest,
)

from daytona_toolbox_api_client.exceptions import ApiException

from conftest import SANDBOX_CLASSES, SandboxFactory, sandbox_of_class, unique, wait_until

# What matplotlib needs that the sandbox's own Python lacks, as the copy's root.
MPL_LISTING = r"""
import os, sys, sysconfig
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot, numpy
site = os.path.realpath(sysconfig.get_paths()["purelib"])
names = set()
for module in list(sys.modules.values()):
    path = os.path.realpath(getattr(module, "__file__", None) or "")
    if path.startswith(site + os.sep):
        names.add(path[len(site) + 1:].split(os.sep)[0])
# Shared libraries wheels vendor beside their packages (numpy.libs, pillow.libs).
names.update(n for n in os.listdir(site) if n.endswith(".libs"))
print(site)
print("%d.%d" % sys.version_info[:2])
for name in sorted(names):
    print(name)
"""

# Libraries every sandbox has from its own C library; the rest of what `node`
# links to is copied with it.
SYSTEM_LIBRARIES = ("linux-vdso", "ld-linux", "libc.so", "libm.so", "libdl.so", "libpthread.so",
                    "librt.so", "libstdc++.so", "libgcc_s.so")


@pytest.fixture(params=SANDBOX_CLASSES)
def sandbox(request, sandboxes):
    """A fresh container, or this module's VM: the toolbox behaves alike on both."""
    return sandbox_of_class(request, sandboxes)


def tar_gz(entries: list[tuple[Path, str]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for path, name in entries:
            tar.add(path, arcname=name)
    return buffer.getvalue()


def unpack(sandbox, archive: bytes, destination: str) -> None:
    upload = f"/tmp/{unique('upload')}.tar.gz"
    sandbox.fs.upload_file(archive, upload)
    done = sandbox.process.exec(f"mkdir -p '{destination}' && tar -xzf {upload} -C '{destination}' && rm {upload}",
                                timeout=300)
    assert done.exit_code == 0, done.result


@pytest.fixture(scope="module")
def matplotlib_sandbox(cove, daytona):
    """A Python sandbox whose Python imports matplotlib, as after `pip install`."""
    bin_dir = os.environ.get("COVE_TEST_MATPLOTLIB_BIN")
    if not bin_dir or not (Path(bin_dir) / "python3").exists():
        pytest.skip("COVE_TEST_MATPLOTLIB_BIN is not set (the bin dir of a Python with matplotlib)")
    listing = subprocess.run([str(Path(bin_dir) / "python3"), "-c", MPL_LISTING],
                             capture_output=True, text=True, check=True).stdout.split()
    site, version, names = Path(listing[0]), listing[1], listing[2:]
    factory = SandboxFactory(cove, daytona)
    try:
        sandbox = factory()
        theirs = sandbox.process.exec("python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'")
        if theirs.result.strip() != version:
            pytest.skip(f"matplotlib's Python is {version}, the image's {theirs.result.strip()}: "
                        "its compiled modules would not load there")
        user_site = sandbox.process.exec("python3 -c 'import site; print(site.getusersitepackages())'")
        unpack(sandbox, tar_gz([(site / name, name) for name in names]), user_site.result.strip())
        yield sandbox
    finally:
        factory.cleanup()


@pytest.fixture(scope="module")
def node_archive() -> bytes:
    """The machine's `node` and the libraries it needs beyond the C library's."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (apt-get install nodejs)")
    entries = [(Path(node).resolve(), "bin/node")]
    linked = subprocess.run(["ldd", node], capture_output=True, text=True).stdout
    for line in linked.splitlines():
        parts = line.split("=>")
        if len(parts) != 2 or not parts[1].strip().startswith("/"):
            continue
        name, path = parts[0].strip(), parts[1].split()[0]
        if not name.startswith(SYSTEM_LIBRARIES):
            entries.append((Path(path).resolve(), f"lib/{name}"))
    return tar_gz(entries)


# --- the agent stays out of the user's files ----------------------------------

def test_tmp_shows_nothing_of_coves(sandbox):
    """Agent frameworks' file tools list and grep /tmp: the agent's own state
    (session scripts and logs, code runs, the interpreter's driver) lives in
    the sandbox's /run instead."""
    sandbox.process.create_session("tmp-check")
    ran = sandbox.process.execute_session_command("tmp-check", SessionExecuteRequest(command="echo in-a-session"))
    assert ran.exit_code == 0
    assert sandbox.process.code_run("print(6 * 7)").result == "42\n"
    listing = sandbox.process.exec("ls -A /tmp").result.split()
    assert not [name for name in listing if "cove" in name], listing
    found = sandbox.process.exec("grep -rl in-a-session /tmp 2>/dev/null; true").result
    assert found.strip() == "", found
    sandbox.process.delete_session("tmp-check")


# --- code_run: the quick start ------------------------------------------------

def test_code_run_quick_start(sandbox):
    response = sandbox.process.code_run('''
x = 10
y = 20
print(f"Sum: {x + y}")
''')
    assert response.exit_code == 0
    assert response.result == "Sum: 30\n"
    assert response.artifacts.stdout == "Sum: 30\n"
    assert response.artifacts.charts == []


def test_code_run_with_argv_and_env(sandbox):
    code = "import os, sys\nprint(sys.argv[1:])\nprint(os.environ['GREETING'])"
    response = sandbox.process.code_run(code, params=CodeRunParams(argv=["one", "two words"],
                                                                   env={"GREETING": "hello there"}))
    assert response.exit_code == 0
    assert response.result.splitlines() == ["['one', 'two words']", "hello there"]


def test_code_run_reports_a_failing_program(sandbox):
    response = sandbox.process.code_run("import sys\nprint('partial')\nsys.exit(5)")
    assert response.exit_code == 5
    assert response.result == "partial\n"
    crashed = sandbox.process.code_run("def f():\n    raise RuntimeError('boom')\nf()")
    assert crashed.exit_code == 1
    # The traceback (stderr, in the order written, as exec has it) names the user's lines.
    assert "raise RuntimeError('boom')" in crashed.result
    assert crashed.result.endswith("RuntimeError: boom\n")


def test_code_run_timeout_stops_the_program(sandbox):
    started = time.monotonic()
    response = sandbox.process.code_run("import time\nprint('begin')\ntime.sleep(60)\nprint('never')",
                                        timeout=2)
    assert time.monotonic() - started < 20
    # As exec answers a deadline: timeout(1)'s exit code, and timedOut.
    assert response.exit_code == 124
    assert response.additional_properties.get("timedOut") is True
    assert response.result == "begin\n"
    assert "time.sleep(60)" not in sandbox.process.exec("ps -eo args").result


def test_each_code_run_is_a_fresh_process(sandbox):
    sandbox.process.code_run("remembered = 42")
    response = sandbox.process.code_run("print('remembered' in globals())")
    assert response.result == "False\n"


# --- code_run: charts ---------------------------------------------------------

def test_code_run_returns_a_line_chart(matplotlib_sandbox):
    # The SDK's own example.
    code = '''
import matplotlib.pyplot as plt
import numpy as np

x = np.linspace(0, 10, 30)
y = np.sin(x)

plt.figure(figsize=(8, 5))
plt.plot(x, y, 'b-', linewidth=2)
plt.title('Line Chart')
plt.xlabel('X-axis (seconds)')
plt.ylabel('Y-axis (amplitude)')
plt.grid(True)
plt.show()
'''
    response = matplotlib_sandbox.process.code_run(code)
    assert response.exit_code == 0, response.result
    # The chart travels beside the output, never in it.
    assert response.result == ""
    assert len(response.artifacts.charts) == 1
    chart = response.artifacts.charts[0]
    assert isinstance(chart, LineChart)
    assert chart.type == ChartType.LINE
    assert chart.title == "Line Chart"
    assert chart.x_label == "X-axis (seconds)"
    assert chart.y_label == "Y-axis (amplitude)"
    assert chart.x_scale == "linear" and chart.y_scale == "linear"
    assert chart.x_ticks and len(chart.x_ticks) == len(chart.x_tick_labels)
    assert "10" in chart.x_tick_labels
    assert chart.png.startswith("iVBORw0KGgo")
    (line,) = chart.elements
    assert len(line.points) == 30
    assert line.points[0] == [0.0, 0.0]
    assert line.points[-1][0] == pytest.approx(10.0)


def test_code_run_returns_a_bar_chart_left_open_at_exit(matplotlib_sandbox):
    code = '''
import matplotlib.pyplot as plt

fig, ax = plt.subplots()
ax.bar(["apples", "pears", "plums"], [3, 5.5, 2], label="harvest")
ax.set_title("Fruit")
ax.set_xlabel("kind")
ax.set_ylabel("crates")
print("plotted")
'''
    response = matplotlib_sandbox.process.code_run(code)
    assert response.exit_code == 0, response.result
    assert response.result == "plotted\n"
    (chart,) = response.artifacts.charts
    assert isinstance(chart, BarChart)
    assert chart.type == ChartType.BAR
    assert (chart.title, chart.x_label, chart.y_label) == ("Fruit", "kind", "crates")
    assert [(bar.label, bar.value, bar.group) for bar in chart.elements] == [
        ("apples", "3", "harvest"), ("pears", "5.5", "harvest"), ("plums", "2", "harvest")]


def test_code_run_returns_each_shown_figure_once(matplotlib_sandbox):
    code = '''
import matplotlib.pyplot as plt
for n in range(3):
    plt.plot([0, 1], [0, n])
    plt.title(f"figure {n}")
    plt.show()
    plt.close()
fig, (left, right) = plt.subplots(1, 2)
fig.suptitle("side by side")
left.pie([1, 3], labels=["a", "b"])
right.scatter([1, 2], [3, 4])
'''
    response = matplotlib_sandbox.process.code_run(code)
    assert response.exit_code == 0, response.result
    charts = response.artifacts.charts
    assert [c.title for c in charts] == ["figure 0", "figure 1", "figure 2", "side by side"]
    assert charts[3].type == ChartType.COMPOSITE_CHART
    assert [e.type for e in charts[3].elements] == ["pie", "scatter"]


# --- code_run: JavaScript and TypeScript ----------------------------------------

def test_code_run_javascript_on_the_images_node(sandboxes):
    # The default image has Node.js (for the TypeScript language server).
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(language="javascript"))
    response = sandbox.process.code_run("console.log('hi from', typeof process)")
    assert response.exit_code == 0, response.result
    assert response.result == "hi from object\n"


@pytest.mark.parametrize("language", ["typescript"])
def test_code_run_without_the_runtime_names_it(sandboxes, language):
    # The default image has Node.js but no TypeScript runner (tsx, ts-node):
    # a clear refusal, not a fake success.
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(language=language))
    # code_run is the one process call the SDK does not wrap in DaytonaError:
    # the toolbox client's exception reaches the caller, with the body.
    with pytest.raises(ApiException) as info:
        sandbox.process.code_run("console.log('hi')")
    assert info.value.status == 422
    message = json.loads(info.value.body)["message"]
    assert "node" in message and language in message
    assert "install it in the image" in message


def test_code_run_javascript_on_node(sandboxes, node_archive):
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(language="javascript"))
    unpack(sandbox, node_archive, "/tmp/nodejs")
    env = {"PATH": "/tmp/nodejs/bin:/usr/local/bin:/usr/bin:/bin", "LD_LIBRARY_PATH": "/tmp/nodejs/lib",
           "GREETING": "hello"}
    response = sandbox.process.code_run(
        "const [a, b] = process.argv.slice(2);\nconsole.log(`${process.env.GREETING} ${a} and ${b}`);",
        params=CodeRunParams(argv=["one", "two"], env=env),
    )
    assert response.exit_code == 0, response.result
    assert response.result == "hello one and two\n"
    failed = sandbox.process.code_run("console.log('before');\nprocess.exit(3);", params=CodeRunParams(env=env))
    assert failed.exit_code == 3
    assert failed.result == "before\n"


# --- sessions: answering a prompt ---------------------------------------------------

def test_session_command_input_is_echoed_in_order(sandbox):
    session = unique("interactive")
    sandbox.process.create_session(session)
    try:
        command = sandbox.process.execute_session_command(
            session,
            SessionExecuteRequest(command='echo "Enter your name:"; read name; echo "Hello $name"',
                                  run_async=True),
        )
        out, err = [], []
        follow = threading.Thread(target=lambda: asyncio.run(asyncio.wait_for(
            sandbox.process.get_session_command_logs_async(session, command.cmd_id, out.append, err.append),
            timeout=30)))
        follow.start()
        try:
            assert wait_until(lambda: "Enter your name:\n" in "".join(out), timeout=15), out
            sandbox.process.send_session_command_input(session, command.cmd_id, "Alice")
        finally:
            follow.join(timeout=40)
        assert not follow.is_alive()
        assert "".join(out) == "Enter your name:\nAlice\nHello Alice\n"
        assert err == []
        logs = sandbox.process.get_session_command_logs(session, command.cmd_id)
        assert logs.stdout == "Enter your name:\nAlice\nHello Alice\n"
        assert sandbox.process.get_session_command(session, command.cmd_id).exit_code == 0
    finally:
        sandbox.process.delete_session(session)


def test_session_input_echo_can_be_suppressed(sandbox):
    session = unique("secret")
    sandbox.process.create_session(session)
    try:
        command = sandbox.process.execute_session_command(
            session,
            SessionExecuteRequest(command='read -r secret; echo "${#secret} characters"', run_async=True,
                                  suppress_input_echo=True),
        )
        sandbox.process.send_session_command_input(session, command.cmd_id, "hunter2")
        assert wait_until(
            lambda: sandbox.process.get_session_command(session, command.cmd_id).exit_code is not None, timeout=15)
        assert sandbox.process.get_session_command_logs(session, command.cmd_id).stdout == "7 characters\n"
    finally:
        sandbox.process.delete_session(session)


# --- exec: a server in the background --------------------------------------------------

def test_exec_of_a_background_server_returns_and_the_server_serves(sandbox):
    port = 8000 + int(unique("p")[-4:], 16) % 1000
    home = sandbox.get_user_home_dir()
    sandbox.process.exec(f"mkdir -p {home}/site && echo served > {home}/site/index.html")
    started = time.monotonic()
    # No redirect: the server keeps the command's output open.
    response = sandbox.process.exec(f"cd {home}/site && python3 -m http.server {port} & echo $!", timeout=60)
    assert time.monotonic() - started < 30, "exec waited for the background server"
    assert response.exit_code == 0
    server_pid = int(response.result.split()[0])
    assert response.additional_properties.get("timedOut") is None
    fetch = f"python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/').read().decode())\""
    assert wait_until(lambda: sandbox.process.exec(fetch).result.strip() == "served", timeout=20)
    # Twice: the server logs each request into the output exec left it, and lives on.
    assert sandbox.process.exec(fetch).result.strip() == "served"
    assert sandbox.process.exec(f"kill {server_pid}").exit_code == 0
