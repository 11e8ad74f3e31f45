"""Driver of one cove code-interpreter context (embedded in cove-agent).

Protocol, one JSON object per line:
  agent -> driver on stdin:  {"code": "...", "envs": {...}}
  driver -> agent on stdout: {"type": "stdout"|"stderr", "text"}
                             {"type": "error", "name", "value", "traceback"}
                             {"type": "result", "text", "html"?, "png"?, ...}
                             {"type": "control", "text": "completed"|"interrupted"}
                             {"type": "done"}   (end of one run, agent-only)

At start the protocol pipes move to private descriptors and fds 1 and 2
become pipes this driver reads itself, so output of subprocesses and C code
is captured too and user code cannot corrupt the protocol. SIGINT interrupts
the running code with KeyboardInterrupt; the globals survive it.
"""

import ast
import base64
import codecs
import io
import json
import linecache
import os
import select
import signal
import sys
import threading
import traceback
import warnings

PROTOCOL_IN = os.fdopen(os.dup(0), "r", encoding="utf-8")
PROTOCOL_OUT = os.dup(1)
OUTPUT_LOCK = threading.Lock()
MAIN_THREAD = threading.main_thread()
STREAM_BUFFER = 1024

os.environ.setdefault("MPLBACKEND", "Agg")
warnings.filterwarnings("ignore", message=".*non-interactive.*")


class State:
    running = False  # user code is executing: SIGINT raises KeyboardInterrupt
    in_run = False  # a run is being handled: captured fd output is sent
    emitting = False  # the main thread is writing a message: SIGINT waits
    interrupt_pending = False


def emit(message):
    data = (json.dumps(message) + "\n").encode("utf-8")
    main = threading.current_thread() is MAIN_THREAD
    if main:
        State.emitting = True
    try:
        with OUTPUT_LOCK:
            view = memoryview(data)
            while view:
                view = view[os.write(PROTOCOL_OUT, view):]
    finally:
        if main:
            State.emitting = False
    if main and State.interrupt_pending and State.running:
        State.interrupt_pending = False
        raise KeyboardInterrupt


def on_sigint(_signum, _frame):
    if not State.running:
        return
    if State.emitting:
        # Never raise in the middle of a protocol line.
        State.interrupt_pending = True
        return
    raise KeyboardInterrupt


class Stream(io.TextIOBase):
    """sys.stdout / sys.stderr: line-buffered, sent as protocol messages."""

    def __init__(self, name):
        self.name = name
        self.parts = []
        self.size = 0

    def writable(self):
        return True

    def isatty(self):
        return False

    @property
    def encoding(self):
        return "utf-8"

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if text:
            self.parts.append(text)
            self.size += len(text)
            if "\n" in text or self.size >= STREAM_BUFFER:
                self.flush()
        return len(text)

    def flush(self):
        if self.parts:
            text = "".join(self.parts)
            self.parts, self.size = [], 0
            emit({"type": self.name, "text": text})


class FdCapture(threading.Thread):
    """Reads what processes write to fds 1 and 2 and sends it during runs."""

    def __init__(self):
        super().__init__(daemon=True)
        self.lock = threading.Lock()
        self.streams = {}
        for fd, name in ((1, "stdout"), (2, "stderr")):
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            os.set_blocking(read_end, False)
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            self.streams[read_end] = (name, decoder)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)

    def run(self):
        while True:
            ready, _, _ = select.select(list(self.streams), [], [])
            for fd in ready:
                self.read(fd)

    def read(self, fd):
        with self.lock:
            name, decoder = self.streams[fd]
            while True:
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    return
                text = decoder.decode(data)
                if text and State.in_run:
                    emit({"type": name, "text": text})
                if not data:
                    return

    def drain(self):
        """Sends what is already in the pipes (output of finished children)."""
        for fd in self.streams:
            self.read(fd)


def user_traceback(error):
    """The traceback without the driver's own frames."""
    tb = error.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell-"):
        tb = tb.tb_next
    if isinstance(error, SyntaxError):
        tb = None
    return "".join(traceback.format_exception(type(error), error, tb))


def rich_bundle(value):
    """The display forms of a value: text always, plus what it can render."""
    bundle = {"text": repr(value)}
    for method, key in (
        ("_repr_html_", "html"),
        ("_repr_markdown_", "markdown"),
        ("_repr_svg_", "svg"),
        ("_repr_png_", "png"),
        ("_repr_jpeg_", "jpeg"),
        ("_repr_latex_", "latex"),
        ("_repr_json_", "json"),
    ):
        render = getattr(value, method, None)
        if not callable(render):
            continue
        try:
            rendered = render()
        except Exception:
            continue
        if isinstance(rendered, tuple):
            rendered = rendered[0]
        if isinstance(rendered, bytes):
            rendered = base64.b64encode(rendered).decode("ascii")
        if rendered is not None:
            bundle[key] = rendered
    figure = figure_png(value)
    if figure is not None:
        bundle["png"] = figure
    return bundle


def figure_png(value):
    """PNG (base64) of a matplotlib figure, closing it so it is shown once."""
    figure_module = sys.modules.get("matplotlib.figure")
    if figure_module is None or not isinstance(value, figure_module.Figure):
        return None
    buffer = io.BytesIO()
    value.savefig(buffer, format="png", bbox_inches="tight")
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close(value)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def open_figures():
    """PNGs of the figures pyplot still has open, which are then closed."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return []
    images = []
    for number in pyplot.get_fignums():
        png = figure_png(pyplot.figure(number))
        if png is not None:
            images.append(png)
    pyplot.close("all")
    return images


class Driver:
    def __init__(self):
        self.globals = {"__name__": "__main__", "__doc__": None, "__builtins__": __builtins__}
        self.runs = 0
        self.capture = FdCapture()
        self.stdout = Stream("stdout")
        self.stderr = Stream("stderr")
        sys.stdout, sys.stderr = self.stdout, self.stderr
        signal.signal(signal.SIGINT, on_sigint)
        self.capture.start()

    def serve(self):
        for line in PROTOCOL_IN:
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except ValueError as error:
                emit({"type": "error", "name": "ProtocolError", "value": str(error), "traceback": ""})
                emit({"type": "done"})
                continue
            self.run(request.get("code") or "", request.get("envs") or {})

    def run(self, code, envs):
        self.runs += 1
        filename = f"<cell-{self.runs}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        saved_env = {key: os.environ.get(key) for key in envs}
        os.environ.update({str(k): str(v) for k, v in envs.items()})
        State.in_run = True
        State.interrupt_pending = False
        interrupted = False
        error = None
        try:
            value = None
            tree = ast.parse(code, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            body = compile(tree, filename, "exec")
            tail = compile(last, filename, "eval") if last is not None else None
            State.running = True
            exec(body, self.globals)
            if tail is not None:
                value = eval(tail, self.globals)
            State.running = False
            if value is not None:
                # What the code printed comes before the value, as in the REPL.
                self.stdout.flush()
                self.stderr.flush()
                self.capture.drain()
                self.globals["_"] = value
                self.display(value)
        except KeyboardInterrupt:
            interrupted = True
        except SystemExit:
            pass
        except BaseException as caught:  # noqa: BLE001 - everything is the user's
            error = caught
        finally:
            State.running = False
        try:
            self.stdout.flush()
            self.stderr.flush()
            self.capture.drain()
            if error is not None:
                emit({
                    "type": "error",
                    "name": type(error).__name__,
                    "value": str(error),
                    "traceback": user_traceback(error),
                })
            try:
                for png in open_figures():
                    emit({"type": "result", "png": png})
            except Exception as figure_error:  # noqa: BLE001
                emit({"type": "stderr", "text": f"cannot render figures: {figure_error}\n"})
        finally:
            State.in_run = False
            for key, previous in saved_env.items():
                if previous is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = previous
            emit({"type": "control", "text": "interrupted" if interrupted else "completed"})
            emit({"type": "done"})

    def display(self, value):
        try:
            bundle = rich_bundle(value)
        except Exception as error:  # noqa: BLE001
            bundle = {"text": f"<unrepresentable: {error}>"}
        # Like the REPL: the value's text goes to stdout, where every client sees it.
        self.stdout.write(bundle["text"] + "\n")
        self.stdout.flush()
        emit({"type": "result", **bundle})


if __name__ == "__main__":
    Driver().serve()
