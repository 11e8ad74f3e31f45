"""cove's prelude of `/process/code-run` for Python: runs the user's code as
`__main__` in this fresh process and reports its matplotlib figures as
Daytona charts.

The agent starts `python3 -c BOOTSTRAP ARGV...` (see `code_run/runtime.rs`)
with this run's private directory in COVE_CODE_RUN_DIR. The directory holds
this file, `code.py` (the user's code) and, when figures exist, receives
`charts.jsonl`: one chart per line, the agent's only side channel. Nothing
here writes to stdout or stderr, so the program's output stays its own.

Figures are reported when `pyplot.show()` is called (and then closed, so each
is reported once) and, at exit, those still open. Only what matplotlib keeps
on its artists is read; a figure that cannot be described is reported as
`unknown` with its PNG, and a failure here never changes the program's exit.
"""

import atexit
import base64
import builtins
import io
import json
import linecache
import math
import os
import sys
import traceback
import types
import warnings

CODE_NAME = "<code>"
# Bounds on what one run reports; the agent bounds the file as well.
MAX_FIGURES = 32
MAX_POINTS = 10_000
MAX_ELEMENTS = 1_000
MAX_TICKS = 200
THIS_FILE = __file__


def main(run_dir):
    with open(os.path.join(run_dir, "code.py"), encoding="utf-8") as f:
        source = f.read()
    # Non-interactive by default; inherited by the program's own children,
    # which is harmless there too.
    os.environ.setdefault("MPLBACKEND", "Agg")
    warnings.filterwarnings("ignore", message=".*non-interactive.*")
    charts = Charts(os.path.join(run_dir, "charts.jsonl"))
    sys.meta_path.insert(0, PyplotWatch(charts))

    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    # Tracebacks show the user's lines, and none of this prelude.
    linecache.cache[CODE_NAME] = (len(source), None, source.splitlines(True), CODE_NAME)
    sys.excepthook = without_prelude_frames(sys.excepthook)
    exec(compile(source, CODE_NAME, "exec"), module.__dict__)


def without_prelude_frames(hook):
    ours = {THIS_FILE, "<string>"}

    def excepthook(kind, value, tb):
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        value = value.with_traceback(tb)
        if hook is sys.__excepthook__:
            # The built-in hook reads source lines from files; this one
            # reads them from linecache, where the code is.
            traceback.print_exception(kind, value, tb)
        else:
            hook(kind, value, tb)

    return excepthook


class PyplotWatch:
    """A meta path finder that finds nothing itself: when `matplotlib.pyplot`
    is first imported, it wraps that module's loading so `show` and the box
    plot drawing are hooked before the import statement returns."""

    def __init__(self, charts):
        self.charts = charts

    def find_spec(self, name, path=None, target=None):
        if name != "matplotlib.pyplot":
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        sys.meta_path.remove(self)
        load = spec.loader.exec_module
        charts = self.charts

        def exec_module(module):
            load(module)
            try:
                charts.hook(module)
            except Exception:  # noqa: BLE001 - pyplot works without the hooks
                pass

        spec.loader.exec_module = exec_module
        return spec


class Charts:
    """Describes figures and appends them to the side channel."""

    def __init__(self, path):
        self.path = path
        self.pyplot = None
        self.reported = 0

    def hook(self, pyplot):
        self.pyplot = pyplot
        # After pyplot's own exit handler, which closes every figure, so
        # before it: exit handlers run last registered first.
        atexit.register(self.report_open_figures)
        shown = pyplot.show

        def show(*args, **kwargs):
            self.report_open_figures()

        show.__doc__ = shown.__doc__
        pyplot.show = show
        from matplotlib.axes import Axes

        draw_boxes = Axes.bxp

        def bxp(axes, bxpstats, *args, **kwargs):
            drawn = draw_boxes(axes, bxpstats, *args, **kwargs)
            # The statistics are not kept on the artists; remember them.
            axes._cove_boxes = getattr(axes, "_cove_boxes", []) + list(bxpstats)
            return drawn

        bxp.__doc__ = draw_boxes.__doc__
        Axes.bxp = bxp

    def report_open_figures(self):
        pyplot = self.pyplot
        if pyplot is None:
            return
        try:
            for number in pyplot.get_fignums():
                self.report(pyplot.figure(number))
            pyplot.close("all")
        except Exception:  # noqa: BLE001 - never the program's problem
            pass

    def report(self, figure):
        if self.reported >= MAX_FIGURES:
            return
        self.reported += 1
        # Whatever matplotlib or numpy warns about while we read the figure
        # is ours, not the program's output.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            png = figure_png(figure)
            try:
                chart = describe_figure(figure)
            except Exception:  # noqa: BLE001
                chart = {"type": "unknown"}
        if png is not None:
            chart["png"] = png
        line = json.dumps(chart, allow_nan=False, separators=(",", ":"))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def figure_png(figure):
    """PNG (base64) of the whole figure; drawing it also lays out the ticks."""
    try:
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", bbox_inches="tight")
        return base64.b64encode(buffer.getvalue()).decode("ascii")
    except Exception:  # noqa: BLE001
        return None


def describe_figure(figure):
    axes = [
        ax
        for ax in figure.get_axes()
        if ax.get_visible() and getattr(ax, "_colorbar", None) is None
    ]
    title = text_of(getattr(figure, "_suptitle", None))
    if not axes:
        return {"type": "unknown", "title": title}
    if len(axes) == 1:
        chart = describe_axes(axes[0])
        if not chart.get("title"):
            chart["title"] = title
        return chart
    return {
        "type": "composite_chart",
        "title": title,
        "elements": [describe_axes(ax) for ax in axes[:MAX_ELEMENTS]],
    }


def describe_axes(ax):
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer
    from matplotlib.patches import Wedge

    chart = {"title": ax.get_title(), "x_label": ax.get_xlabel(), "y_label": ax.get_ylabel()}
    boxes = getattr(ax, "_cove_boxes", None)
    if boxes:
        chart["type"] = "box_and_whisker"
        chart["elements"] = [box_element(box) for box in boxes[:MAX_ELEMENTS]]
        return chart
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    if wedges and not ax.lines:
        return {
            "type": "pie",
            "title": chart["title"],
            "elements": [
                without_none(
                    {
                        "label": label_of(w),
                        "angle": number(w.theta2 - w.theta1),
                        "radius": number(w.r),
                    }
                )
                for w in wedges[:MAX_ELEMENTS]
            ],
        }
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    if bars:
        chart["type"] = "bar"
        chart["elements"] = bar_elements(ax, bars)
        return chart
    lines = [line for line in ax.get_lines() if line.get_visible()]
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    if lines:
        chart["type"] = "line"
        chart["elements"] = [
            {"label": label_of(line), "points": points(line.get_xydata())}
            for line in lines[:MAX_ELEMENTS]
        ]
    elif scatters:
        chart["type"] = "scatter"
        chart["elements"] = [
            {"label": label_of(c), "points": points(c.get_offsets())}
            for c in scatters[:MAX_ELEMENTS]
        ]
    else:
        chart["type"] = "unknown"
        return chart
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        pairs = visible_ticks(axis)[:MAX_TICKS]
        chart[f"{name}_ticks"] = [t for t, _ in pairs]
        chart[f"{name}_tick_labels"] = [label for _, label in pairs]
        chart[f"{name}_scale"] = scale_of(axis)
    return chart


def bar_elements(ax, containers):
    elements = []
    for container in containers:
        horizontal = getattr(container, "orientation", None) == "horizontal"
        group = container.get_label()
        group = "" if not group or group.startswith("_") else group
        ticks = visible_ticks(ax.yaxis if horizontal else ax.xaxis)
        for rect in container.patches:
            if len(elements) >= MAX_ELEMENTS:
                return elements
            if horizontal:
                center, size, value = rect.get_y() + rect.get_height() / 2, rect.get_height(), rect.get_width()
            else:
                center, size, value = rect.get_x() + rect.get_width() / 2, rect.get_width(), rect.get_height()
            # The category under the bar: the nearest tick within its width.
            near = [(abs(t - center), text) for t, text in ticks if abs(t - center) <= abs(size) / 2]
            label = min(near)[1] if near else number_text(center)
            elements.append({"label": label, "group": group, "value": number_text(value)})
    return elements


def box_element(box):
    return without_none(
        {
            "label": str(box.get("label", "")),
            "min": number(box.get("whislo")),
            "first_quartile": number(box.get("q1")),
            "median": number(box.get("med")),
            "third_quartile": number(box.get("q3")),
            "max": number(box.get("whishi")),
            "outliers": [
                v for v in (number(f) for f in box.get("fliers", [])[:MAX_POINTS]) if v is not None
            ],
        }
    )


def visible_ticks(axis):
    """(position, label) of the major ticks inside the axis's view; the
    locator also places some just outside, which are not drawn."""
    low, high = sorted(axis.get_view_interval())
    slack = (high - low) * 1e-9
    labels = [t.get_text() for t in axis.get_majorticklabels()]
    pairs = [(number(t), label) for t, label in zip(axis.get_majorticklocs(), labels)]
    return [(t, label) for t, label in pairs if t is not None and low - slack <= t <= high + slack]


def scale_of(axis):
    converter = getattr(axis, "get_converter", None)
    converter = converter() if converter is not None else getattr(axis, "converter", None)
    kind = type(converter).__name__
    if "Category" in kind:
        return "categorical"
    if "Date" in kind:
        return "datetime"
    return axis.get_scale()


def points(data):
    kept = []
    # Sliced first: a plot of millions of points is listed only as far as kept.
    for row in data[:MAX_POINTS]:
        pair = [number(v) for v in list(row)[:2]]
        if len(pair) == 2 and None not in pair:
            kept.append(pair)
    return kept


def number(value):
    """A finite float, or None: JSON has no NaN, and the SDK wants numbers."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def number_text(value):
    value = number(value)
    if value is None:
        return ""
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def label_of(artist):
    label = artist.get_label()
    return "" if not isinstance(label, str) or label.startswith("_") else label


def text_of(text_artist):
    return text_artist.get_text() if text_artist is not None else ""


def without_none(element):
    return {key: value for key, value in element.items() if value is not None}
