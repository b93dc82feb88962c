"""A Dask cluster as users start it (``dask scheduler``, ``dask worker``), and faults on it: a worker killed
mid-step, every worker lost, the driver killed. All on 127.0.0.1; every process stopped at the end."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BIN, ROOT, fast_params, free_port, make_workspace, ran_steps, run_cli, stop

TINY = {
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

    def _start(self, args: list[str], name: str) -> subprocess.Popen:
        log = (self.logs / f"{name}.log").open("w")
        process = subprocess.Popen(
            [str(BIN / "dask"), *args], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self.processes.append(process)
        return process

    def start(self, workers: int = 2) -> None:
        self._start(["scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"], "scheduler")
        self.add_workers(workers)

    def add_workers(self, count: int) -> None:
        for _ in range(count):
            args = ["worker", self.address, "--host", "127.0.0.1", "--nthreads", "1", "--no-dashboard"]
            self.workers.append(self._start(args, f"worker-{len(self.workers)}"))
        self.wait_for_workers(len([w for w in self.workers if w.poll() is None]))

    def client(self):
        from distributed import Client

        return Client(self.address, timeout=30)

    def wait_for_workers(self, count: int, timeout: float = 60) -> None:
        with self.client() as client:
            client.wait_for_workers(count, timeout=timeout)

    def stop(self) -> None:
        for process in self.processes:
            stop(process)


@pytest.fixture
def cluster(tmp_path, cli_env) -> Iterator[Cluster]:
    """A scheduler and two single-threaded workers on 127.0.0.1 that import this tree's code."""
    logs = tmp_path / "cluster-logs"
    logs.mkdir()
    env = {**cli_env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), cli_env.get("PYTHONPATH")]))}
    cluster = Cluster(env, logs)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cli_env) -> dict[str, str]:
    """The result digests of the tiny pipeline run in threads."""
    path = make_workspace(tmp_path_factory.mktemp("threads"), fast_params(**TINY))
    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return _digests(path)


def _on(cluster: Cluster) -> list[str]:
    return ["-S", "orchestration.task_runner=dask", "-S", f"orchestration.dask_address={cluster.address}"]


def test_a_run_on_a_cluster_users_start_gives_the_threaded_results(reference, cluster, tmp_path, cli_env):
    path = make_workspace(tmp_path / "dask", fast_params(**TINY))
    done = run_cli(["run", *_on(cluster)], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finetune/client_000" in ran_steps(path)
    assert _digests(path) == reference
    _nothing_partial(path)


# One client fine-tunes for seconds: long enough to be killed mid-step.
LONG_CLIENT = {"epochs": 2, "clients": {1: {"epochs": 150}}}


def _start_run(path: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "mergeflow"), "run", *args], cwd=path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def _read_until(process: subprocess.Popen, prefix: str) -> str:
    """The run's stderr up to and with the first line that starts with ``prefix``."""
    seen = []
    for line in process.stderr:
        seen.append(line)
        if line.startswith(prefix):
            return "".join(seen)
    raise AssertionError("".join(seen)[-3000:])


def _busy_worker(cluster: Cluster, timeout: float = 60) -> tuple[str, int]:
    """The address and pid of a worker that has run a task for a second."""
    deadline = time.monotonic() + timeout
    with cluster.client() as client:
        busy: dict[str, float] = {}
        while time.monotonic() < deadline:
            now = time.monotonic()
            working = {address for address, keys in client.processing().items() if keys}
            busy = {address: busy.get(address, now) for address in working}
            for address, since in busy.items():
                if now - since >= 1:
                    return address, client.run(os.getpid, workers=[address])[address]
            time.sleep(0.1)
    raise AssertionError("no worker ran a step")


def test_a_worker_killed_mid_step(reference, cluster, tmp_path, cli_env):
    path = make_workspace(tmp_path / "killed", fast_params(**TINY, finetune=LONG_CLIENT))
    run = _start_run(path, _on(cluster), cli_env)
    try:
        _read_until(run, "mergeflow: pretrain:")
        address, pid = _busy_worker(cluster)
        os.kill(pid, signal.SIGKILL)
        stderr = run.communicate(timeout=120)[1]
    finally:
        stop(run)
    print(stderr[-3000:])
    assert run.returncode == 0, stderr[-3000:]
