"""Faults of what a run stands on: the Prefect server stopped mid-run, the disk full.

Each ends the run with one line naming what went away and exit code 1, keeps the finished steps, and the next run
resumes to the results of an undisturbed run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, fast_params, free_port, make_workspace, ran_steps, run_cli, start_prefect_server, stop
from test_cancel import _digests

from flows.outages import outage_line
from mergeflow.files import atomic_path

# SSF reads low-rank Fisher factors: 3 MB per client, and align writes 9 MB of them, the run's largest output.
PARAMS = fast_params(
    merge={"methods": ["ssf"], "options": {"ssf": {"steps": 10}}},
    federated={"algorithms": []},
    tracking={"log_models": False},
)
KEPT = "; the finished steps stay cached: "


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, cli_env) -> Path:
    """The workspace of an undisturbed run of :data:`PARAMS`."""
    path = make_workspace(tmp_path_factory.mktemp("undisturbed") / "run", PARAMS)
    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return path


def test_a_full_disk_names_the_file_being_written_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "out.safetensors"
    with pytest.raises(OSError) as raised, atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        # as safetensors reports it: a library error that carries the OS error only in its text
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(target))
    assert not list(tmp_path.iterdir())


def test_a_full_disk_without_a_file_name_names_the_project_directory(tmp_path):
    line = outage_line(sqlite3.OperationalError("database or disk is full"), tmp_path)  # MLflow's store
    assert line == f"no space left on device writing under {tmp_path}{KEPT}free some space and run again"


def test_only_a_request_to_the_prefect_api_counts_as_its_server_gone(tmp_path):
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    def refused(url: str) -> httpx.ConnectError:
        return httpx.ConnectError("[Errno 111] Connection refused", request=httpx.Request("POST", url))

    api = "http://127.0.0.1:4200/api"
    with temporary_settings(updates={PREFECT_API_URL: api}):
        line = outage_line(refused(f"{api}/flow_runs/"), tmp_path)
        assert line.startswith(f"the Prefect server at {api} does not answer ([Errno 111] Connection refused)")
        assert outage_line(refused("https://huggingface.co/api/models/gpt2"), tmp_path) is None


def test_a_prefect_server_that_does_not_answer_is_one_line(tmp_path, cli_env):
    api = f"http://127.0.0.1:{free_port()}/api"
    path = make_workspace(tmp_path / "run", PARAMS)
    done = run_cli(["run"], path, cli_env | {"PREFECT_API_URL": api}, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    line = f"mergeflow: error: the Prefect server at {api} does not answer ([Errno 111] Connection refused){KEPT}"
    assert done.stderr.rstrip().splitlines()[-1].startswith(line) and "Traceback" not in done.stderr, done.stderr


def _intact(path: Path) -> list[str]:
    """The step records under ``path`` whose every blob is in the store with its recorded sha256 (asserted)."""
    names = []
    for record in sorted((path / ".mergeflow/results").iterdir()):
        for digest in json.loads(record.read_text())["files"].values():
            blob = path / ".mergeflow/store" / digest[:2] / digest
            assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest, record.name
        names.append(record.name)
    return names


@pytest.mark.slow
def test_the_prefect_server_stopped_mid_run_ends_it_with_one_line_and_the_next_run_resumes(
    tmp_path, cli_env, undisturbed
):
    server, api = start_prefect_server(tmp_path / "prefect-server")
    path = make_workspace(tmp_path / "run", PARAMS)
    try:
        process = subprocess.Popen(
            [str(BIN / "mergeflow"), "run"],
            cwd=path,
            env=cli_env | {"PREFECT_API_URL": api},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            for line in process.stderr:
                if line.startswith("mergeflow: pretrain:"):
                    break
            stop(server)  # SIGKILL, the server's whole process group
            stopped = time.monotonic()
            stderr = process.communicate(timeout=120)[1]
            seconds = time.monotonic() - stopped
        finally:
            stop(process)
    finally:
        stop(server)

    assert process.returncode == 1 and seconds < 90, stderr[-3000:]
    line = f"mergeflow: error: the Prefect server at {api} does not answer ("
    last = stderr.rstrip().splitlines()[-1]
    assert last.startswith(line) and KEPT in last and "Traceback" not in stderr, stderr[-3000:]
    assert not list(path.rglob("*.tmp"))
    assert len(_intact(path)) == 15  # Prefect 3 runs task runs in the client: the steps went on without it

    done = run_cli(["run"], path, cli_env)  # against the session's server
    assert done.returncode == 0, done.stderr[-3000:]
    assert not ran_steps(path) and _digests(path) == _digests(undisturbed)


def _can_mount_tmpfs(directory: Path) -> bool:
    """Whether a private user and mount namespace (``unshare -rm``) can mount a tmpfs here."""
    if shutil.which("unshare") is None:
        return False
    script = f"mount -t tmpfs -o size=1m tmpfs {directory}"
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, timeout=30).returncode == 0


def _bytes_before_align(path: Path) -> int:
    """The bytes of the blobs of ``path``'s steps up to the align stage, plus half of align's: a disk that size
    fills while align writes."""
    sizes = {}
    for record in (path / ".mergeflow/results").iterdir():
        files = json.loads(record.read_text())["files"].values()
        sizes[record.name] = sum((path / ".mergeflow/store" / d[:2] / d).stat().st_size for d in files)
    late = ("align-", "merge-", "federated-", "evaluate-", "track-")
    align = sum(size for name, size in sizes.items() if name.startswith("align-"))
    return sum(size for name, size in sizes.items() if not name.startswith(late)) + align // 2


@pytest.mark.slow
def test_a_full_disk_ends_the_run_with_one_line_and_the_next_run_resumes_once_space_is_freed(
    tmp_path, cli_env, undisturbed
):
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _can_mount_tmpfs(disk):
        pytest.skip("no private mount namespace here (unshare -rm) to mount a small tmpfs in")
    size = _bytes_before_align(undisturbed) // 1024
    make_workspace(tmp_path / "params", PARAMS)
    # The tmpfs lives as long as the namespace: the workspace is copied out after each run, for the checks.
    script = f"""
        mount -t tmpfs -o size={size}k tmpfs {disk} && cp {tmp_path}/params/params.yaml {disk} && cd {disk} || exit 9
        mergeflow run 2> {tmp_path}/full.err; echo $? > {tmp_path}/full.rc; cp -a . {tmp_path}/full
        mount -o remount,size=64m {disk} || exit 9
        mergeflow run 2> {tmp_path}/resumed.err; echo $? > {tmp_path}/resumed.rc; cp -a . {tmp_path}/resumed
    """
    namespace = subprocess.Popen(["unshare", "-rm", "sh", "-c", script], env=cli_env, start_new_session=True)
    try:
        assert namespace.wait(timeout=240) == 0
    finally:
        stop(namespace)

    full, stderr = tmp_path / "full", (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "1", stderr[-3000:]
    last = stderr.rstrip().splitlines()[-1]
    line = f"mergeflow: error: no space left on device writing {disk}/"
    assert last.startswith(line) and last.endswith(f"{KEPT}free some space and run again"), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not list(full.rglob("*.tmp")) and not any(p.is_file() for p in (full / ".mergeflow/tmp").rglob("*"))
    recorded = _intact(full)
    assert sum(name.startswith("finetune-") for name in recorded) == 3
    assert not any(name.startswith("align-") for name in recorded)

    resumed = tmp_path / "resumed"
    assert (tmp_path / "resumed.rc").read_text().strip() == "0", (tmp_path / "resumed.err").read_text()[-3000:]
    assert not any(name.startswith(("finetune/", "fisher/")) for name in ran_steps(resumed))
    assert "align" in ran_steps(resumed) and _digests(resumed) == _digests(undisturbed)
