"""Issue 23, item 1: sandboxes of the default snapshot run as `daytona`, as
Daytona's do (uid 1000, home /home/daytona, passwordless sudo); `user` on
create picks another user of the image, root included; an unknown user is
refused before anything is made. Neither user is root on the host. VMs the
same: their root agent hands the toolbox to an agent running as the user."""

from __future__ import annotations

import uuid

import pytest
from daytona import CreateSandboxFromSnapshotParams, DaytonaError, SessionExecuteRequest

from conftest import SANDBOX_CLASSES, VM_SNAPSHOT, sandbox_of_class
from test_isolation import host_ids, host_pids

HOME = "/home/daytona"


@pytest.fixture(params=SANDBOX_CLASSES)
def sandbox(request, sandboxes):
    """A fresh container, or this module's VM: both run as `daytona`."""
    return sandbox_of_class(request, sandboxes)


def test_a_default_sandbox_runs_as_daytona_in_its_home(sandbox):
    assert sandbox.process.exec("whoami").result.strip() == "daytona"
    assert sandbox.process.exec("id -u; id -g").result.split() == ["1000", "1000"]
    assert sandbox.process.exec("pwd").result.strip() == HOME
    assert sandbox.process.exec("echo $HOME").result.strip() == HOME
    assert sandbox.get_user_home_dir() == HOME
    assert sandbox.get_work_dir() == HOME
    # Daytona's habit from the issue: a cwd in the home directory.
    assert sandbox.process.exec("pwd", cwd=f"{HOME}").result.strip() == HOME
    # The image's dotfiles are the user's own.
    assert sandbox.process.exec("stat -c %U .bashrc").result.strip() == "daytona"


def test_sudo_needs_no_password_and_is_the_sandboxs_root(sandbox):
    done = sandbox.process.exec("sudo -n true")
    assert done.exit_code == 0, done.result
    assert sandbox.process.exec("sudo -n whoami").result.strip() == "root"
    # What only root may do works through sudo, and not without it.
    assert sandbox.process.exec("touch /etc/cove-probe").exit_code != 0
    assert sandbox.process.exec("sudo -n touch /etc/cove-probe && stat -c %U /etc/cove-probe").result.strip() == "root"


def test_neither_the_user_nor_its_sudo_is_host_root(sandboxes):
    sandbox = sandboxes()
    # A process of the user and one of its sudo, both alive while the host looks.
    sandbox.process.create_session("ids")
    sandbox.process.execute_session_command("ids", SessionExecuteRequest(command="sleep 60", run_async=True))
    sandbox.process.execute_session_command("ids", SessionExecuteRequest(command="sudo -n sleep 61", run_async=True))
    inside, outside, count = sandbox.process.exec("cat /proc/self/uid_map").result.split()
    assert (inside, count) == ("0", "65536")
    low = int(outside)
    assert low >= 65536
    seen = set()
    for _ in range(50):
        pids = host_pids(sandbox.id)
        seen = {tuple(host_ids(pid)[0]) for pid in pids}
        if (low + 1000,) * 4 in seen and (low,) * 4 in seen:
            break
        sandbox.process.exec("sleep 0.1")
    assert (low + 1000,) * 4 in seen, seen
    for uids in seen:
        assert all(low <= uid < low + 65536 for uid in uids), (uids, low)


def test_files_uploaded_belong_to_the_user(sandbox):
    sandbox.fs.upload_file(b"hello", "notes.txt")
    sandbox.fs.create_folder(f"{HOME}/work", "755")
    sandbox.fs.upload_file(b"x", f"{HOME}/work/a.txt")
    owners = sandbox.process.exec(f"stat -c '%U %n' {HOME}/notes.txt {HOME}/work {HOME}/work/a.txt").result
    assert owners.strip().split("\n") == [f"daytona {HOME}/notes.txt", f"daytona {HOME}/work", f"daytona {HOME}/work/a.txt"]
    assert sandbox.fs.get_file_info(f"{HOME}/notes.txt").owner == "daytona"
    # And the user can change what it uploaded.
    assert sandbox.process.exec(f"echo more >> {HOME}/notes.txt && cat {HOME}/notes.txt").result.strip() == "hellomore"


def test_sessions_and_git_act_as_the_user(sandbox):
    sandbox.process.create_session("me")
    answer = sandbox.process.execute_session_command("me", SessionExecuteRequest(command="whoami && pwd"))
    assert answer.output.split() == ["daytona", HOME]
    sandbox.process.exec("git init -q repo && cd repo && git config user.email a@b && git config user.name a "
                         "&& echo x > f && git add f && git commit -qm one")
    assert sandbox.process.exec("stat -c %U repo/.git/HEAD").result.strip() == "daytona"
    assert sandbox.git.status(f"{HOME}/repo").current_branch in ("master", "main")


def test_a_root_sandbox_is_root_and_still_not_host_root(sandboxes):
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(os_user="root"))
    assert sandbox.process.exec("whoami").result.strip() == "root"
    assert sandbox.process.exec("pwd").result.strip() == "/root"
    assert sandbox.get_user_home_dir() == "/root"
    assert sandbox.user == "root"
    for pid in host_pids(sandbox.id):
        uids, _ = host_ids(pid)
        assert all(uid >= 65536 for uid in uids), (pid, uids)


def test_another_user_of_the_image_may_be_asked_for(sandboxes):
    sandbox = sandboxes(CreateSandboxFromSnapshotParams(os_user="nobody"))
    assert sandbox.process.exec("whoami").result.strip() == "nobody"
    # Its home does not exist: commands start at the root, as Docker's do.
    assert sandbox.process.exec("pwd").result.strip() == "/"
    assert sandbox.user == "nobody"


def test_a_user_the_image_lacks_is_refused_and_nothing_is_made(cove, sandboxes):
    before = cove.sandbox_ids()
    name = f"ghost-{uuid.uuid4().hex[:8]}"
    with pytest.raises(DaytonaError) as refused:
        sandboxes(CreateSandboxFromSnapshotParams(os_user=name))
    assert "400" in str(refused.value) or getattr(refused.value, "status_code", None) == 400, refused.value
    assert name in str(refused.value) and "/etc/passwd" in str(refused.value)
    assert cove.sandbox_ids() == before


def test_a_vm_asked_for_root_is_root(module_root_vm):
    sandbox = module_root_vm
    assert sandbox.process.exec("whoami").result.strip() == "root"
    assert sandbox.process.exec("pwd").result.strip() == "/root"
    assert sandbox.get_user_home_dir() == "/root"
    sandbox.fs.upload_file(b"x", "/etc/cove-root-probe")
    assert sandbox.process.exec("stat -c %U /etc/cove-root-probe").result.strip() == "root"


def test_a_vm_refuses_a_user_its_image_lacks(cove, sandboxes):
    before = cove.sandbox_ids()
    with pytest.raises(DaytonaError) as refused:
        sandboxes(CreateSandboxFromSnapshotParams(snapshot=VM_SNAPSHOT, os_user="ghost-of-a-vm"))
    assert "ghost-of-a-vm" in str(refused.value) and "/etc/passwd" in str(refused.value)
    assert cove.sandbox_ids() == before
