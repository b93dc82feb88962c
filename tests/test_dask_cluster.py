"""A Dask cluster as users start it (``dask scheduler``, ``dask worker``), and faults on it: a worker killed
mid-step, every worker lost, the driver killed. All on 127.0.0.1; every process stopped at the end."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import BIN, ROOT, fast_params, free_port, make_workspace, ran_steps, run_cli, stop

from flows.runs import workspace_lock
from mergeflow import cancel
from mergeflow.errors import Cancelled
from tasks import run_lease

# One client fine-tunes for seconds: long enough to be killed mid-step.
TINY = {
    "pretrain": {"epochs": 1},
    "finetune": {"epochs": 2, "clients": {1: {"epochs": 800}}},
    "merge": {"methods": ["average"]},
    "federated": {"algorithms": ["fedavg"], "rounds": 2},
    "tracking": {"log_models": False},
}


def _digests(path: Path) -> dict[str, str]:
    files = [*path.glob("models/**/*.safetensors"), path / "metrics/evaluate.json"]
    return {f.relative_to(path).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(files)}


def _nothing_partial(path: Path) -> None:
    """No temp file anywhere, and every record's blobs in the store."""
    assert not list(path.rglob("*.tmp"))
    store = path / ".mergeflow/store"
    for record in (path / ".mergeflow/results").iterdir():
        for digest in json.loads(record.read_text())["files"].values():
            assert (store / digest[:2] / digest).is_file(), record.name


class Cluster:
    """A ``dask scheduler`` and its ``dask worker`` processes (each with its nanny), started as the guide says."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.env, self.logs = env, logs
        self.processes: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []

    def _start(self, args: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = (self.logs / f"{name}.log").open("w")
        process = subprocess.Popen(
            [str(BIN / "dask"), *args], cwd=ROOT, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self.processes.append(process)
        return process

    def start(self, workers: int = 2, scheduler_env: dict[str, str] | None = None) -> None:
        args = ["scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"]
        self._start(args, "scheduler", scheduler_env)
        for number in range(workers):
            args = ["worker", self.address, "--host", "127.0.0.1", "--nthreads", "1", "--no-dashboard"]
            self.workers.append(self._start(args, f"worker-{number}"))
        self.wait_for_workers(workers)

    def client(self):
        from distributed import Client

        return Client(self.address, timeout=30)

    def wait_for_workers(self, count: int, timeout: float = 60) -> None:
        with self.client() as client:
            client.wait_for_workers(count, timeout=timeout)

    def stop(self) -> None:
        for process in self.processes:
            stop(process)


@contextmanager
def _running_cluster(logs: Path, env: dict[str, str], scheduler_env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """A scheduler and two single-threaded workers on 127.0.0.1 that import this tree's code; stopped at the end."""
    logs.mkdir(exist_ok=True)
    path = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cluster = Cluster({**env, "PYTHONPATH": path, "DASK_TEMPORARY_DIRECTORY": str(logs)}, logs)  # its scratch there
    try:
        cluster.start(scheduler_env=scheduler_env)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory, cli_env) -> Iterator[Cluster]:
    """One cluster for the tests that leave it whole (a killed worker's nanny starts another)."""
    with _running_cluster(tmp_path_factory.mktemp("cluster-logs"), cli_env) as cluster:
        yield cluster


@pytest.fixture
def two_workers(shared_cluster) -> Cluster:
    """The shared cluster, once it has two workers again."""
    shared_cluster.wait_for_workers(2)
    return shared_cluster


@pytest.fixture
def cluster(request, tmp_path, cli_env) -> Iterator[Cluster]:
    """A cluster of the test's own, the scheduler with the environment the test's parameter gives, if any."""
    with _running_cluster(tmp_path / "cluster-logs", cli_env, getattr(request, "param", None)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def threaded(tmp_path_factory, cli_env) -> Path:
    """A workspace after the tiny pipeline ran in threads."""
    path = make_workspace(tmp_path_factory.mktemp("threads"), fast_params(**TINY))
    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def reference(threaded) -> dict[str, str]:
    """The result digests of the tiny pipeline run in threads."""
    return _digests(threaded)


def _without_finetuning(threaded: Path, path: Path) -> Path:
    """A copy of the threaded run's workspace without its fine-tuned clients (records, blobs, files): a run there
    fine-tunes them again and finds every other step cached (their inputs come out the same)."""
    shutil.copytree(threaded, path)
    for record in (path / ".mergeflow/results").glob("finetune-*"):
        for digest in json.loads(record.read_text())["files"].values():
            (path / ".mergeflow/store" / digest[:2] / digest).unlink(missing_ok=True)
        record.unlink()
    shutil.rmtree(path / "models/clients")
    return path


def _on(cluster: Cluster) -> list[str]:
    return ["-S", "orchestration.task_runner=dask", "-S", f"orchestration.dask_address={cluster.address}"]


@pytest.mark.slow
def test_a_run_on_a_cluster_users_start_gives_the_threaded_results(reference, two_workers, tmp_path, cli_env):
    path = make_workspace(tmp_path / "dask", fast_params(**TINY))
    done = run_cli(["run", *_on(two_workers)], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finetune/client_000" in ran_steps(path)
    assert _digests(path) == reference
    _nothing_partial(path)


def _start_run(path: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "mergeflow"), "run", *args], cwd=path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def _read_until(process: subprocess.Popen, prefix: str) -> None:
    """Read the run's stderr up to and with the first line that starts with ``prefix``."""
    seen = []
    for line in process.stderr:
        seen.append(line)
        if line.startswith(prefix):
            return
    raise AssertionError("".join(seen)[-3000:])


def _worker_on_the_long_step(cluster: Cluster, path: Path, timeout: float = 120) -> int:
    """The pid of the worker fine-tuning the long client (client 1): the one busy once the others are recorded."""
    results, deadline = path / ".mergeflow/results", time.monotonic() + timeout
    with cluster.client() as client:
        while True:
            recorded = all(any(results.glob(f"finetune-client_00{n}-*")) for n in (0, 2))
            busy = [address for address, keys in client.processing().items() if keys]
            if recorded and len(busy) == 1:  # the short client's task run may still be ending
                return client.run(os.getpid, workers=busy)[busy[0]]
            assert time.monotonic() < deadline, f"no worker on the long step: {busy}"
            time.sleep(0.05)


def _kill_a_worker_mid_step(cluster: Cluster, path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run the pipeline on ``cluster`` and SIGKILL the worker process fine-tuning the long client; the run's end."""
    run = _start_run(path, _on(cluster), env)
    try:
        _read_until(run, "mergeflow: pretrain:")
        pid = _worker_on_the_long_step(cluster, path)
        os.kill(pid, signal.SIGKILL)  # the worker, not its nanny: the nanny starts a new one
        stderr = run.communicate(timeout=120)[1]
        return subprocess.CompletedProcess(run.args, run.returncode, "", stderr)
    finally:
        stop(run)


@pytest.mark.slow
def test_a_worker_killed_mid_step_is_replaced_and_the_step_runs_again(
    threaded, reference, two_workers, tmp_path, cli_env
):
    path = _without_finetuning(threaded, tmp_path / "killed")
    done = _kill_a_worker_mid_step(two_workers, path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _digests(path) == reference
    _nothing_partial(path)


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [{"DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}], indirect=True)
def test_a_step_whose_workers_die_stops_the_run_with_one_line_and_the_next_run_finishes(
    threaded, reference, cluster, tmp_path, cli_env
):
    path = _without_finetuning(threaded, tmp_path / "killed")
    done = _kill_a_worker_mid_step(cluster, path, cli_env)
    assert done.returncode == 1, done.stderr[-3000:]  # an outage, not bad input
    last = done.stderr.splitlines()[-1]
    died = f": 1 Dask worker of {cluster.address} died running it (the last "
    assert last.startswith("mergeflow: error: finetune/") and "finetune/client_001" in last and died in last, last
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    _nothing_partial(path)

    again = run_cli(["run", *_on(cluster)], path, cli_env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert ran_steps(path) == {"finetune/client_001"}  # resumed
    assert _digests(path) == reference


@pytest.mark.slow
def test_a_run_that_loses_every_worker_stops_with_one_line(threaded, cluster, tmp_path, cli_env):
    path = _without_finetuning(threaded, tmp_path / "lost")
    args = [*_on(cluster), "-S", "orchestration.dask_lost_workers_timeout=3"]
    run = _start_run(path, args, cli_env)
    try:
        _read_until(run, "mergeflow: pretrain:")
        _worker_on_the_long_step(cluster, path)
        for worker in cluster.workers:  # each worker with its nanny
            stop(worker)
        killed = time.monotonic()
        stderr = run.communicate(timeout=60)[1]
        seconds = time.monotonic() - killed
    finally:
        stop(run)
    assert run.returncode == 1 and seconds < 30, stderr[-3000:]
    line = f"mergeflow: error: no Dask worker is left on {cluster.address} (none for 3 s: "
    assert stderr.splitlines()[-1].startswith(line) and "Traceback" not in stderr, stderr[-3000:]
    records = {json.loads(r.read_text())["step"] for r in (path / ".mergeflow/results").iterdir()}
    assert {"finetune/client_000", "finetune/client_002"} <= records  # the steps finished before stay cached
    _nothing_partial(path)


@pytest.mark.slow
def test_the_driver_killed_mid_step_leaves_no_write_behind_and_the_next_run_resumes(
    threaded, reference, two_workers, tmp_path, cli_env
):
    path = _without_finetuning(threaded, tmp_path / "driver")
    # A long client 1 (minutes, not TINY's seconds), so that on a loaded machine its step cannot finish between
    # the moment it is seen running and the kill; the next run, with TINY's params, resumes.
    endless = ["-S", "finetune.clients={1: {epochs: 100000}}"]
    run = _start_run(path, [*_on(two_workers), *endless], cli_env)
    try:
        _read_until(run, "mergeflow: pretrain:")
        _worker_on_the_long_step(two_workers, path)
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
    finally:
        stop(run)
    # The orphaned step stops within seconds of its driver's end, recording nothing
    deadline = time.monotonic() + 30
    while not any("stopped a step of an earlier run" in log.read_text() for log in two_workers.logs.glob("worker-*")):
        assert time.monotonic() < deadline, "the orphaned step did not stop"
        time.sleep(0.2)
    records = {json.loads(r.read_text())["step"] for r in (path / ".mergeflow/results").iterdir()}
    assert "finetune/client_001" not in records
    _nothing_partial(path)

    done = run_cli(["run", *_on(two_workers)], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(path) == {"finetune/client_001"}
    assert _digests(path) == reference


def test_a_step_on_a_worker_writes_only_while_its_run_holds_the_workspace(tmp_path):
    with workspace_lock(tmp_path):
        held = run_lease.held(tmp_path)
        assert held.local()
        run_lease.ensure_held(held)
        lease = replace(held, pid=-1)  # as a Dask worker sees it
        run_lease.ensure_held(lease)
    with pytest.raises(Cancelled, match=r"writing nothing: its run \(pid -1 on .*\) has ended"):
        run_lease.ensure_held(lease)
    with workspace_lock(tmp_path), pytest.raises(Cancelled, match="writing nothing: a newer run holds"):
        run_lease.ensure_held(lease)
    run_lease.ensure_held(held)  # the run's own process (threads): never checked


def test_the_watcher_stops_a_running_step_once_its_run_has_ended(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lease, "WATCH_SECONDS", 0.05)
    run = ExitStack()
    run.enter_context(workspace_lock(tmp_path))
    lease, stopped = replace(run_lease.held(tmp_path), pid=-1), []

    def step() -> None:
        try:
            with run_lease.watched(lease):
                while True:
                    cancel.check()
                    time.sleep(0.01)
        except Cancelled as error:
            stopped.append(str(error))
        cancel.check()  # the thread's next step runs

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive()
    run.close()
    thread.join(10)
    assert not thread.is_alive() and "has ended" in stopped[0]
