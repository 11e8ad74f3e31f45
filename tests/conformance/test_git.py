"""sandbox.git through the SDK, against bare repositories inside the sandbox
(no network): clone (branch, commit), status, add, commit, push and pull between
two clones, branches, checkout, history, reset, restore, remotes, config, and the
SDK's GIT_* errors."""

from __future__ import annotations

import pytest
from daytona import (
    DaytonaFileNotFoundError,
    DaytonaGitBranchExistsError,
    DaytonaGitBranchNotFoundError,
    DaytonaGitMergeConflictError,
    DaytonaGitPushRejectedError,
    DaytonaGitRepoNotFoundError,
)

SEED = """
set -e
# A VM sandbox is shared by the module's tests: clear what earlier ones cloned.
rm -rf /tmp/remote.git /tmp/seed one /tmp/two /tmp/dev /tmp/old /tmp/r /tmp/m /tmp/a /tmp/b /tmp/plain
git init -q --bare -b main /tmp/remote.git
git init -q -b main /tmp/seed && cd /tmp/seed
git config user.name Seed && git config user.email seed@example.com
echo hello > README.md && git add . && git commit -q -m first
echo 'hello again' > README.md && git commit -q -am second
git switch -q -c dev && echo dev > dev.txt && git add . && git commit -q -m 'on dev'
git remote add origin /tmp/remote.git && git push -q origin main dev
git log --format=%H main
"""

from conftest import SANDBOX_CLASSES, sandbox_of_class

@pytest.fixture(params=SANDBOX_CLASSES)
def sandbox(request, sandboxes):
    """A fresh container, or this module's VM: every test runs on both."""
    return sandbox_of_class(request, sandboxes)


def run(sandbox, command: str) -> str:
    response = sandbox.process.exec(command)
    assert response.exit_code == 0, response.result
    return response.result


@pytest.fixture
def remote(sandbox) -> list[str]:
    """Seeds /tmp/remote.git; returns main's commits, newest first."""
    return run(sandbox, f"bash -c {quote(SEED)}").split()


def quote(script: str) -> str:
    return "'" + script.replace("'", "'\\''") + "'"


def names(status) -> dict[str, tuple[str, str]]:
    return {f.name: (f.staging.value, f.worktree.value) for f in status.file_status}


def test_git_commit_push_and_pull_between_two_clones(sandbox, remote):
    sandbox.git.clone("/tmp/remote.git", "one")
    sandbox.git.clone("file:///tmp/remote.git", "/tmp/two")
    status = sandbox.git.status("one")
    assert status.current_branch == "main"
    assert status.branch_published is True
    assert (status.ahead, status.behind) == (0, 0)
    assert status.file_status == []

    sandbox.fs.upload_file(b"new\n", "one/new.txt")
    sandbox.fs.upload_file(b"changed\n", "one/README.md")
    assert names(sandbox.git.status("one")) == {
        "new.txt": ("Untracked", "Untracked"),
        "README.md": ("Unmodified", "Modified"),
    }
    sandbox.git.add("one", ["new.txt", "README.md"])
    assert names(sandbox.git.status("one")) == {
        "new.txt": ("Added", "Unmodified"),
        "README.md": ("Modified", "Unmodified"),
    }
    commit = sandbox.git.commit("one", "add new", "Ann", "ann@example.com")
    assert len(commit.sha) == 40
    work_dir = sandbox.get_work_dir().rstrip("/")
    assert run(sandbox, f"git -C {work_dir}/one log -1 --format=%H:%an:%ae").strip() == (
        f"{commit.sha}:Ann:ann@example.com"
    )
    assert sandbox.git.status("one").ahead == 1

    sandbox.git.push("one")
    assert run(sandbox, "git -C /tmp/remote.git rev-parse main").strip() == commit.sha
    sandbox.git.pull("/tmp/two")
    assert sandbox.fs.download_file("/tmp/two/new.txt") == b"new\n"

    history = sandbox.git._api_client.get_commit_history(path="/tmp/two")
    assert [c.hash for c in history] == [commit.sha, *remote]
    assert (history[0].author, history[0].email, history[0].message) == ("Ann", "ann@example.com", "add new")


def test_git_clone_a_branch_and_a_commit(sandbox, remote):
    sandbox.git.clone("/tmp/remote.git", "/tmp/dev", branch="dev")
    assert sandbox.git.status("/tmp/dev").current_branch == "dev"
    assert sandbox.fs.download_file("/tmp/dev/dev.txt") == b"dev\n"

    first = remote[-1]
    sandbox.git.clone("/tmp/remote.git", "/tmp/old", commit_id=first)
    status = sandbox.git.status("/tmp/old")
    assert status.detached is True
    assert run(sandbox, "git -C /tmp/old rev-parse HEAD").strip() == first
    assert sandbox.fs.download_file("/tmp/old/README.md") == b"hello\n"


def test_git_branches_and_checkout(sandbox, remote):
    sandbox.git.clone("/tmp/remote.git", "/tmp/r")
    assert sandbox.git.branches("/tmp/r").branches == ["main"]
    sandbox.git.create_branch("/tmp/r", "feature")
    listed = sandbox.git.branches("/tmp/r")
    assert (listed.branches, listed.current) == (["feature", "main"], "feature")
    with pytest.raises(DaytonaGitBranchExistsError):
        sandbox.git.create_branch("/tmp/r", "main")

    sandbox.git.checkout_branch("/tmp/r", "dev")
    status = sandbox.git.status("/tmp/r")
    assert (status.current_branch, status.upstream) == ("dev", "origin/dev")
    with pytest.raises(DaytonaGitBranchNotFoundError) as info:
        sandbox.git.checkout_branch("/tmp/r", "no-such-branch")
    assert "no-such-branch" in str(info.value)

    sandbox.git.delete_branch("/tmp/r", "feature")
    assert sandbox.git.branches("/tmp/r").branches == ["dev", "main"]
    with pytest.raises(DaytonaGitBranchNotFoundError):
        sandbox.git.delete_branch("/tmp/r", "feature")

    sandbox.git.create_branch("/tmp/r", "topic")
    sandbox.git.push("/tmp/r", branch="topic", set_upstream=True)
    assert sandbox.git.status("/tmp/r").branch_published is True
    run(sandbox, "git -C /tmp/remote.git rev-parse --verify topic")


def test_git_init_reset_and_restore(sandbox):
    sandbox.git.init("/tmp/fresh", initial_branch="trunk")
    assert sandbox.git.status("/tmp/fresh").current_branch == "trunk"
    assert sandbox.git._api_client.get_commit_history(path="/tmp/fresh") == []

    shas = []
    for text in (b"one\n", b"two\n"):
        sandbox.fs.upload_file(text, "/tmp/fresh/a.txt")
        sandbox.git.add("/tmp/fresh", ["."])
        shas.append(sandbox.git.commit("/tmp/fresh", text.decode().strip(), "A", "a@example.com").sha)

    sandbox.fs.upload_file(b"scratch\n", "/tmp/fresh/a.txt")
    sandbox.git.restore("/tmp/fresh", ["a.txt"])
    assert sandbox.fs.download_file("/tmp/fresh/a.txt") == b"two\n"

    sandbox.fs.upload_file(b"staged\n", "/tmp/fresh/a.txt")
    sandbox.git.add("/tmp/fresh", ["a.txt"])
    sandbox.git.restore("/tmp/fresh", ["a.txt"], staged=True)
    assert names(sandbox.git.status("/tmp/fresh")) == {"a.txt": ("Unmodified", "Modified")}
    sandbox.git.restore("/tmp/fresh", ["a.txt"], source=shas[0], worktree=True)
    assert sandbox.fs.download_file("/tmp/fresh/a.txt") == b"one\n"

    sandbox.git.reset("/tmp/fresh", mode="hard")
    assert sandbox.git.status("/tmp/fresh").file_status == []
    sandbox.git.reset("/tmp/fresh", mode="soft", target="HEAD~1")
    assert run(sandbox, "git -C /tmp/fresh rev-parse HEAD").strip() == shas[0]
    assert names(sandbox.git.status("/tmp/fresh")) == {"a.txt": ("Modified", "Unmodified")}
    sandbox.git.reset("/tmp/fresh", files=["a.txt"])
    assert names(sandbox.git.status("/tmp/fresh")) == {"a.txt": ("Unmodified", "Modified")}


def test_git_remotes_and_config(sandbox, remote):
    sandbox.git.clone("/tmp/remote.git", "/tmp/r")
    assert [(r.name, r.url) for r in sandbox.git.remotes("/tmp/r").remotes] == [("origin", "/tmp/remote.git")]
    sandbox.git.remote_add("/tmp/r", "upstream", "/tmp/remote.git", fetch=True)
    run(sandbox, "git -C /tmp/r rev-parse --verify upstream/dev")
    sandbox.git.remote_add("/tmp/r", "upstream", "/elsewhere.git", overwrite=True)
    assert sandbox.git.remote_get("/tmp/r", "upstream") == "/elsewhere.git"
    assert sandbox.git.remote_get("/tmp/r", "nope") is None

    assert sandbox.git.get_config("core.editor") is None
    sandbox.git.set_config("core.editor", "nano -w")
    assert sandbox.git.get_config("core.editor") == "nano -w"
    assert "nano -w" in run(sandbox, "git config --global core.editor")
    sandbox.git.configure_user("Lu", "lu@example.com", scope="local", path="/tmp/r")
    assert sandbox.git.get_config("user.name", scope="local", path="/tmp/r") == "Lu"
    assert run(sandbox, "git -C /tmp/r config user.email").strip() == "lu@example.com"


def test_git_failures_map_to_sdk_errors(sandbox, remote):
    with pytest.raises(DaytonaGitRepoNotFoundError) as info:
        sandbox.git.clone("/tmp/no-such-remote.git", "/tmp/m")
    assert "/tmp/no-such-remote.git" in str(info.value)
    assert info.value.status_code == 404

    with pytest.raises(DaytonaFileNotFoundError):
        sandbox.git.status("/tmp/no-such-dir")
    run(sandbox, "mkdir -p /tmp/plain")
    with pytest.raises(DaytonaGitRepoNotFoundError):
        sandbox.git.status("/tmp/plain")

    # Two clones commit to the same file: the second push is rejected, the
    # pull that follows conflicts.
    for path in ("/tmp/a", "/tmp/b"):
        sandbox.git.clone("/tmp/remote.git", path)
        sandbox.git.configure_user("U", "u@example.com", scope="local", path=path)
        sandbox.fs.upload_file(path.encode() + b"\n", f"{path}/README.md")
        sandbox.git.add(path, ["README.md"])
        sandbox.git.commit(path, f"from {path}", "U", "u@example.com")
    sandbox.git.push("/tmp/a")
    with pytest.raises(DaytonaGitPushRejectedError):
        sandbox.git.push("/tmp/b")
    with pytest.raises(DaytonaGitMergeConflictError) as info:
        sandbox.git.pull("/tmp/b")
    assert "README.md" in str(info.value)
