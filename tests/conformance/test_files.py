"""sandbox.fs through the SDK: byte-exact transfers, listing, info, folders, errors."""

from __future__ import annotations

import hashlib
import os

import pytest
from daytona import DaytonaError, DaytonaFileNotFoundError, FileUpload

from conftest import SANDBOX_CLASSES, sandbox_of_class

@pytest.fixture(params=SANDBOX_CLASSES)
def sandbox(request, sandboxes):
    """A fresh container, or this module's VM: every test runs on both."""
    return sandbox_of_class(request, sandboxes)


def test_binary_round_trip_is_byte_exact(sandbox):
    payload = os.urandom(3 * 1024 * 1024) + bytes(range(256)) + b"\r\n\x00--boundary--\r\n"
    sandbox.fs.upload_file(payload, "/tmp/blob.bin")
    assert sandbox.fs.download_file("/tmp/blob.bin") == payload
    # And the sandbox itself sees the same bytes.
    digest = sandbox.process.exec("sha256sum /tmp/blob.bin").result.split()[0]
    assert digest == hashlib.sha256(payload).hexdigest()


def test_relative_paths_are_under_the_work_dir(sandbox):
    sandbox.fs.upload_file(b"relative", "rel.txt")
    work_dir = sandbox.get_work_dir().rstrip("/")
    assert sandbox.process.exec(f"cat {work_dir}/rel.txt").result == "relative"
    assert sandbox.fs.download_file("rel.txt") == b"relative"


def test_upload_files_creates_parent_dirs(sandbox):
    sandbox.fs.upload_files(
        [
            FileUpload(source=b"one", destination="/tmp/multi/a/one.txt"),
            FileUpload(source=b"two", destination="/tmp/multi/b/two.txt"),
        ]
    )
    assert sandbox.fs.download_file("/tmp/multi/a/one.txt") == b"one"
    assert sandbox.fs.download_file("/tmp/multi/b/two.txt") == b"two"


def test_list_files_and_file_info(sandbox):
    sandbox.fs.create_folder("/tmp/lst", "755")
    sandbox.fs.upload_file(b"12345", "/tmp/lst/five.txt")
    sandbox.fs.create_folder("/tmp/lst/inner", "700")

    entries = {f.name: f for f in sandbox.fs.list_files("/tmp/lst")}
    assert set(entries) == {"five.txt", "inner"}
    assert entries["five.txt"].size == 5
    assert entries["five.txt"].is_dir is False
    assert entries["inner"].is_dir is True

    info = sandbox.fs.get_file_info("/tmp/lst/five.txt")
    assert info.name == "five.txt"
    assert info.size == 5
    assert info.is_dir is False

    folder = sandbox.fs.get_file_info("/tmp/lst/inner")
    assert folder.is_dir is True
    # create_folder honours the mode it was given.
    assert sandbox.process.exec("stat -c %a /tmp/lst/inner").result.strip() == "700"


def test_delete_file_and_folder(sandbox):
    sandbox.fs.upload_file(b"x", "/tmp/del/file.txt")
    sandbox.fs.delete_file("/tmp/del/file.txt")
    assert sandbox.process.exec("test -e /tmp/del/file.txt").exit_code == 1

    sandbox.fs.upload_file(b"y", "/tmp/del/sub/deep.txt")
    sandbox.fs.delete_file("/tmp/del", recursive=True)
    assert sandbox.process.exec("test -e /tmp/del").exit_code == 1


def test_download_missing_file_names_the_path(sandbox):
    with pytest.raises(DaytonaFileNotFoundError) as info:
        sandbox.fs.download_file("/tmp/no-such-file-here.txt")
    assert "/tmp/no-such-file-here.txt" in str(info.value)


def test_file_info_of_missing_file_is_not_found(sandbox):
    with pytest.raises(DaytonaError) as info:
        sandbox.fs.get_file_info("/tmp/missing-info.txt")
    assert "/tmp/missing-info.txt" in str(info.value)
    assert getattr(info.value, "status_code", None) == 404


def test_empty_file_round_trip(sandbox):
    sandbox.fs.upload_file(b"", "/tmp/empty.txt")
    assert sandbox.process.exec("stat -c %s /tmp/empty.txt").result.strip() == "0"
    assert sandbox.fs.download_file("/tmp/empty.txt") == b""


@pytest.mark.parametrize(
    "name",
    [
        "/tmp/with space/plain name.txt",
        "/tmp/q/semi;colon=\"quoted\".txt",
        "/tmp/q/percent%20name.txt",
        "/tmp/u/ünïcödé ✓.txt",
    ],
    ids=["space", "quotes", "percent", "unicode"],
)
def test_awkward_file_names(sandbox, name):
    sandbox.fs.upload_file(name.encode(), name)
    assert sandbox.process.exec(f"cat '{name}'").result == name
    assert sandbox.fs.download_file(name) == name.encode()


def test_upload_overwrites(sandbox):
    sandbox.fs.upload_file(b"first version, longer", "/tmp/over.txt")
    sandbox.fs.upload_file(b"second", "/tmp/over.txt")
    assert sandbox.fs.download_file("/tmp/over.txt") == b"second"


def test_download_files_mixed_results(sandbox):
    from daytona import FileDownloadRequest

    sandbox.fs.upload_file(b"present", "/tmp/mixed-ok.txt")
    results = sandbox.fs.download_files(
        [FileDownloadRequest(source="/tmp/mixed-ok.txt"), FileDownloadRequest(source="/tmp/mixed-missing.txt")]
    )
    by_source = {r.source: r for r in results}
    assert by_source["/tmp/mixed-ok.txt"].result == b"present"
    assert by_source["/tmp/mixed-ok.txt"].error is None
    assert by_source["/tmp/mixed-missing.txt"].error
    assert "/tmp/mixed-missing.txt" in by_source["/tmp/mixed-missing.txt"].error


def test_list_missing_folder_is_an_error_naming_it(sandbox):
    with pytest.raises(DaytonaError) as info:
        sandbox.fs.list_files("/tmp/no-such-folder")
    assert "/tmp/no-such-folder" in str(info.value)


def test_exec_in_missing_cwd_names_it(sandbox):
    with pytest.raises(DaytonaError) as info:
        response = sandbox.process.exec("pwd", cwd="/no/such/dir")
        # Answering with a failed command instead of an error is acceptable too.
        assert response.exit_code != 0 and "/no/such/dir" in response.result
        raise DaytonaError("/no/such/dir: answered as a failed command")
    assert "/no/such/dir" in str(info.value)
