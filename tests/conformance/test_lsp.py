"""Language servers through the pinned SDK (issue 18): `create_lsp_server`
for a Python project on both classes (pylsp) and a TypeScript project
(typescript-language-server) on a container, as an editor agent drives them.
"""

from __future__ import annotations

import pytest
from daytona.common.lsp_server import LspCompletionPosition
from daytona.common.errors import DaytonaError, DaytonaTimeoutError

from conftest import SANDBOX_CLASSES, sandbox_of_class

PYTHON = "import os\nos.pa\n\nclass Greeter:\n    def hello(self):\n        return 1\n\ndef main():\n    return Greeter()\n"
TYPESCRIPT = 'const word: string = "cove";\nword.\n\nexport class Shelf {}\nexport function build(): Shelf { return new Shelf(); }\n'

# Symbol kinds of the LSP specification.
CLASS, FUNCTION = 5, 12


@pytest.fixture(params=SANDBOX_CLASSES)
def box(request, sandboxes):
    return sandbox_of_class(request, sandboxes)


def project(sandbox, name: str, files: dict[str, str]) -> str:
    home = sandbox.get_user_home_dir()
    root = f"{home}/{name}"
    sandbox.fs.create_folder(root, "755")
    for file, text in files.items():
        sandbox.fs.upload_file(text.encode(), f"{root}/{file}")
    return root


def test_python_completions_and_symbols(box):
    root = project(box, "pyproj", {"main.py": PYTHON})
    lsp = box.create_lsp_server("python", root)
    lsp.start()
    try:
        lsp.did_open("main.py")
        position = LspCompletionPosition(line=1, character=5)
        try:
            completions = lsp.completions("main.py", position)
        except DaytonaTimeoutError:
            # The first completion has Jedi index the standard library: in a
            # VM under TCG (no KVM) that can pass the agent's 30 s, and the
            # server goes on with it, so the second answers from what it made.
            completions = lsp.completions("main.py", position)
        labels = [item.label for item in completions.items]
        assert "path" in labels, labels
        symbols = {(s.name, s.kind) for s in lsp.document_symbols("main.py")}
        assert ("Greeter", CLASS) in symbols and ("main", FUNCTION) in symbols, symbols
        lsp.did_close("main.py")
    finally:
        lsp.stop()
    # A stopped server answers a clear error, not a hang.
    with pytest.raises(DaytonaError):
        lsp.completions("main.py", LspCompletionPosition(line=1, character=5))


def test_typescript_completions_and_symbols(sandbox):
    root = project(sandbox, "tsproj", {"main.ts": TYPESCRIPT})
    lsp = sandbox.create_lsp_server("typescript", root)
    lsp.start()
    try:
        lsp.did_open("main.ts")
        completions = lsp.completions("main.ts", LspCompletionPosition(line=1, character=5))
        labels = [item.label for item in completions.items]
        assert "charAt" in labels, labels[:20]
        names = {s.name for s in lsp.document_symbols("main.ts")}
        assert {"Shelf", "build"} <= names, names
    finally:
        lsp.stop()


def test_an_unknown_language_is_refused(sandbox):
    with pytest.raises(DaytonaError) as refused:
        sandbox.create_lsp_server("cobol", "/home/daytona").start()
    assert "cobol" in str(refused.value)
