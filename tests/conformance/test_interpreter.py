"""The code interpreter through the SDK: persistent globals, streaming,
errors, timeouts that keep the context, envs and contexts."""

from __future__ import annotations

import time

import pytest
from daytona import DaytonaTimeoutError

from conftest import SANDBOX_CLASSES, sandbox_of_class

@pytest.fixture(params=SANDBOX_CLASSES)
def sandbox(request, sandboxes):
    """A fresh container, or this module's VM: every test runs on both."""
    return sandbox_of_class(request, sandboxes)


def test_run_code_keeps_variables_and_streams(sandbox):
    interpreter = sandbox.code_interpreter
    assert interpreter.run_code("x = 41").stdout == ""
    chunks = []
    result = interpreter.run_code(
        "import sys\nprint(x + 1)\nprint('careful', file=sys.stderr)",
        on_stdout=lambda message: chunks.append(message.output),
    )
    assert result.stdout == "42\n"
    assert result.stderr == "careful\n"
    assert result.error is None
    assert chunks == ["42\n"]
    # Like a REPL, the last expression's value is shown.
    assert interpreter.run_code("x * 2").stdout == "82\n"


def test_run_code_reports_errors(sandbox):
    result = sandbox.code_interpreter.run_code("def f():\n    return {}['missing']\nf()")
    assert result.error is not None
    assert result.error.name == "KeyError"
    assert result.error.value == "'missing'"
    assert "return {}['missing']" in result.error.traceback


def test_timeout_interrupts_but_keeps_the_context(sandbox):
    interpreter = sandbox.code_interpreter
    interpreter.run_code("kept = 'still here'")
    started = time.monotonic()
    with pytest.raises(DaytonaTimeoutError):
        interpreter.run_code("while True:\n    pass", timeout=1)
    assert time.monotonic() - started < 5
    assert interpreter.run_code("print(kept)").stdout == "still here\n"


def test_envs_apply_to_one_run(sandbox):
    interpreter = sandbox.code_interpreter
    code = "import os\nprint(os.environ.get('COLOR'))"
    assert interpreter.run_code(code, envs={"COLOR": "blue"}).stdout == "blue\n"
    assert interpreter.run_code(code).stdout == "None\n"


def test_contexts_are_isolated(sandbox):
    interpreter = sandbox.code_interpreter
    interpreter.run_code("shared = 1")
    context = interpreter.create_context(cwd="/tmp")
    assert context.cwd == "/tmp"
    assert context.language == "python"
    assert context.active is True
    assert context.created_at
    result = interpreter.run_code("import os\nprint(os.getcwd(), 'shared' in globals())", context=context)
    assert result.stdout == "/tmp False\n"
    assert [c.id for c in interpreter.list_contexts()] == [context.id]
    interpreter.delete_context(context)
    assert interpreter.list_contexts() == []
