"""COPY and ADD: an `Image`'s local files reach the image through object storage.

The SDK asks `/api/object-storage/push-access` for credentials, uploads each
build context as a tar over S3 (HTTPS only: cove's `--tls-listen`), and names
the contexts' hashes in `buildInfo.contextHashes`. The SDK code runs in a
child process whose system CA bundle includes the test CA (its own mount
namespace), because the SDK's S3 client trusts nothing else.
"""

from __future__ import annotations

import json
import textwrap
import time
import uuid

from conftest import CoveServer, TlsFiles, sdk_with_test_ca

PRELUDE = """
import io, json, os, stat, tarfile, tempfile, time
from pathlib import Path
from daytona import Daytona, CreateSandboxFromImageParams, CreateSandboxFromSnapshotParams, CreateSnapshotParams, Image

daytona = Daytona()
out = {}
made = []

def create(image):
    sandbox = daytona.create(CreateSandboxFromImageParams(image=image), timeout=300)
    made.append(sandbox)
    return sandbox

def run(sandbox, command):
    response = sandbox.process.exec(command)
    return response.exit_code, response.result.strip()
"""

EPILOGUE = """
for sandbox in made:
    daytona.delete(sandbox)
print("RESULT " + json.dumps(out))
"""


def run_sdk(cove: CoveServer, tls: TlsFiles, body: str) -> dict:
    script = PRELUDE + textwrap.dedent(body) + EPILOGUE
    env = {"DAYTONA_API_URL": cove.api_url, "DAYTONA_API_KEY": cove.api_key}
    done = sdk_with_test_ca(tls, script, env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_local_files_and_directories_are_copied_into_the_image(cove: CoveServer, tls_files: TlsFiles):
    marker = uuid.uuid4().hex
    out = run_sdk(cove, tls_files, f"""
        work = Path(tempfile.mkdtemp())
        (work / "config.json").write_text('{{"marker": "{marker}"}}')
        src = work / "src"
        (src / "sub").mkdir(parents=True)
        (src / "main.py").write_text("print('hello from main')\\n")
        (src / "main.py").chmod(0o755)
        (src / "sub" / "data.txt").write_text("{marker}-data")
        image = (
            Image.base("cove-default")
            .add_local_file(work / "config.json", "/app/config.json")
            .add_local_dir(src, "/app/src")
            .run_commands("cat /app/src/sub/data.txt > /app/copied-by-run.txt")
        )
        sandbox = create(image)
        out["config"] = run(sandbox, "cat /app/config.json")
        out["main"] = run(sandbox, "python3 /app/src/main.py")
        out["mode"] = run(sandbox, "stat -c %a:%U /app/src/main.py")
        out["tree"] = run(sandbox, "cd /app/src && find . | sort")
        out["run"] = run(sandbox, "cat /app/copied-by-run.txt")
        out["download"] = sandbox.fs.download_file("/app/src/sub/data.txt").decode()
        # The same image again: its context is uploaded once (a HEAD finds
        # it) and the build is the one made already.
        again = create(Image.base("cove-default")
            .add_local_file(work / "config.json", "/app/config.json")
            .add_local_dir(src, "/app/src")
            .run_commands("cat /app/src/sub/data.txt > /app/copied-by-run.txt"))
        out["again"] = run(again, "cat /app/config.json")
    """)
    assert out["config"] == [0, json.dumps({"marker": marker})]
    assert out["main"] == [0, "hello from main"]
    assert out["mode"] == [0, "755:root"]
    assert out["tree"] == [0, ".\n./main.py\n./sub\n./sub/data.txt"]
    assert out["run"] == [0, f"{marker}-data"]
    assert out["download"] == f"{marker}-data"
    assert out["again"] == out["config"]
    # One context directory per distinct upload, each holding one archive.
    contexts = cove.data_dir / "build-contexts"
    archives = sorted(contexts.glob("*/context.tar"))
    assert len(archives) >= 2
    assert not list((contexts / ".builds").glob("*")), "a build left its scratch behind"


def test_a_dockerfile_copies_with_chown_and_add_unpacks_archives(cove: CoveServer, tls_files: TlsFiles):
    out = run_sdk(cove, tls_files, """
        work = Path(tempfile.mkdtemp())
        files = work / "files"
        files.mkdir()
        (files / "owned.txt").write_text("owned")
        payload = io.BytesIO(b"inside the archive")
        with tarfile.open(files / "bundle.tar.gz", "w:gz") as tar:
            info = tarfile.TarInfo("pkg/readme.txt")
            info.size = len(payload.getvalue())
            tar.addfile(info, payload)
        (work / "Dockerfile").write_text(
            "FROM cove-default\\n"
            "WORKDIR /srv\\n"
            "COPY --chown=nobody:nogroup files/owned.txt data/\\n"
            "ADD files/bundle.tar.gz unpacked/\\n"
            "COPY files/bundle.tar.gz /srv/kept/\\n"
            "COPY . /srv/all/\\n"
        )
        image = Image.from_dockerfile(work / "Dockerfile")
        name = "ctx-" + os.urandom(4).hex()
        daytona.snapshot.create(CreateSnapshotParams(name=name, image=image), on_logs=print)
        sandbox = daytona.create(CreateSandboxFromSnapshotParams(snapshot=name), timeout=300)
        made.append(sandbox)
        out["owned"] = run(sandbox, "stat -c %U:%G /srv/data/owned.txt && cat /srv/data/owned.txt")
        out["unpacked"] = run(sandbox, "cat /srv/unpacked/pkg/readme.txt")
        out["kept"] = run(sandbox, "ls /srv/kept")
        out["all"] = run(sandbox, "cd /srv/all && find . -type f | sort")
    """)
    assert out["owned"] == [0, "nobody:nogroup\nowned"]
    assert out["unpacked"] == [0, "inside the archive"]
    assert out["kept"] == [0, "bundle.tar.gz"]
    # `COPY .` copies the whole context: the Dockerfile's directory.
    assert out["all"] == [0, "./Dockerfile\n./files/bundle.tar.gz\n./files/owned.txt"]


def test_a_copy_of_something_not_uploaded_fails_the_build_by_name(cove: CoveServer):
    name = "ctx-missing-" + uuid.uuid4().hex[:6]
    response = cove.request("POST", "/snapshots", json={
        "name": name,
        "buildInfo": {
            "dockerfileContent": "FROM cove-default\nCOPY nothere.txt /x\n",
            "contextHashes": ["0123456789abcdef0123456789abcdef"],
        },
    })
    assert response.status_code == 200, response.text
    for _ in range(100):
        snapshot = cove.request("GET", f"/snapshots/{name}").json()
        if snapshot["state"] != "building":
            break
        time.sleep(0.2)
    assert snapshot["state"] == "error"
    assert "no build context 0123456789abcdef0123456789abcdef was uploaded" in snapshot["errorReason"]
    cove.request("DELETE", f"/snapshots/{name}")


def test_uploads_need_the_issued_secret(cove: CoveServer, tls_files: TlsFiles):
    out = run_sdk(cove, tls_files, """
        from daytona._sync.object_storage import ObjectStorage
        access = daytona._object_storage_api.get_push_access()
        work = Path(tempfile.mkdtemp())
        (work / "f.txt").write_text("x")
        for label, secret in [("wrong", "not-the-secret"), ("right", access.secret)]:
            storage = ObjectStorage(access.storage_url, access.access_key, secret,
                                    access.session_token, access.bucket, region=access.region)
            try:
                out[label] = storage.upload(str(work / "f.txt"), access.organization_id)
            except Exception as error:
                out[label] = "error: " + str(error)
    """)
    # The client's first request is a HEAD, whose 403 has no body to name the code.
    assert "403 Forbidden" in out["wrong"], out["wrong"]
    assert len(out["right"]) == 32 and not out["right"].startswith("error"), out["right"]
    assert (cove.data_dir / "build-contexts" / out["right"] / "context.tar").is_file()


def test_a_large_context_goes_up_in_parts_and_arrives_whole(cove: CoveServer, tls_files: TlsFiles):
    # Above the SDK's 5 MiB part size, so the upload is a multipart one.
    out = run_sdk(cove, tls_files, """
        import hashlib
        work = Path(tempfile.mkdtemp())
        blob = os.urandom(13 * 1024 * 1024 + 12345)
        (work / "blob.bin").write_bytes(blob)
        out["sha"] = hashlib.sha256(blob).hexdigest()
        sandbox = create(Image.base("cove-default").add_local_file(work / "blob.bin", "/data/blob.bin"))
        out["inside"] = run(sandbox, "sha256sum /data/blob.bin | cut -d' ' -f1")
    """)
    assert out["inside"] == [0, out["sha"]]
    assert "build context upload in parts started" in cove.log_path.read_text()
    # The parts were joined and removed.
    assert not list((cove.data_dir / "build-contexts" / ".uploads").glob("*/*"))
