"""Stopping a run: SIGTERM cancels the running step within seconds, and the next run resumes to the same results."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml
from conftest import BIN, fast_params, make_workspace, ran_steps, run_cli

from mergeflow import cancel
from mergeflow.errors import Cancelled
from mergeflow.models.sequential import build_model
from mergeflow.training import train


@pytest.fixture(autouse=True)
def no_stop_requested(monkeypatch):
    """A fresh stop request and cancelled list for each test, so that no other test's loops see this one's."""
    monkeypatch.setattr(cancel, "_requested", threading.Event())
    monkeypatch.setattr(cancel, "_cancelled", [])


def test_a_training_loop_stops_at_its_next_batch():
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 2, 64)
    model = build_model("mlp", [4], 2, widths=[8], seed=0)
    started, raised = threading.Event(), []

    def train_for_ever() -> None:
        try:
            with cancel.running("finetune/client_000"):
                train(model, X, y, task="classification", epochs=10**9, lr=0.01, on_epoch=lambda _: started.set())
        except Cancelled as error:
            raised.append(error)

    thread = threading.Thread(target=train_for_ever, daemon=True)  # a loop that never stops fails, not hangs
    thread.start()
    assert started.wait(30)
    cancel.request()
    thread.join(5)
    assert not thread.is_alive() and raised
    assert cancel.cancelled() == ["finetune/client_000"]


def test_an_interrupt_through_a_run_requests_a_stop_and_a_step_failure_does_not():
    with pytest.raises(ValueError), cancel.stops_running_steps():
        raise ValueError("a step failed")
    assert not cancel.requested()  # the other steps finish and stay cached
    with pytest.raises(KeyboardInterrupt), cancel.stops_running_steps():
        raise KeyboardInterrupt
    assert cancel.requested()
    with cancel.stops_running_steps():  # the next run in this process starts afresh
        assert not cancel.requested()
        cancel.check()


def test_sigterm_raises_stopped_and_requests_a_stop():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(cancel.Stopped) as stopped, cancel.stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in this (the main) thread first
    assert stopped.value.name == "SIGTERM" and cancel.requested()
    assert signal.getsignal(signal.SIGTERM) is before


# The SSF merge is the long step (seconds even on a fast machine); the rest of the pipeline is quick.
LONG_SSF = {
    "merge": {"methods": ["ssf"], "options": {"ssf": {"steps": 100}}},
    "federated": {"algorithms": []},
    "tracking": {"log_models": False},
}


def _digests(path: Path) -> dict[str, str]:
    files = [*path.glob("models/**/*.safetensors"), path / "metrics/evaluate.json"]
    return {f.relative_to(path).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(files)}


def _stop_during_the_merge(path: Path, cli_env: dict, command: tuple[str, ...] = ("run",)) -> tuple[int, float, str]:
    """Run the pipeline (or ``command``), SIGTERM it a second into the merge stage; its exit code, seconds to exit
    and stderr."""
    process = subprocess.Popen(
        [str(BIN / "mergeflow"), *command],
        cwd=path,
        env=cli_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in process.stderr:
            if line.startswith("mergeflow: align:"):  # the stage before the merge is done
                break
        time.sleep(1)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        stderr = process.communicate(timeout=60)[1]
        return process.returncode, time.monotonic() - sent, stderr
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_sigterm_cancels_the_running_step_and_the_next_run_resumes_to_the_same_results(tmp_path, cli_env):
    reference = make_workspace(tmp_path / "reference", fast_params(**LONG_SSF))
    assert run_cli(["run"], reference, cli_env).returncode == 0
    path = make_workspace(tmp_path / "stopped", fast_params(**LONG_SSF))

    code, seconds, stderr = _stop_during_the_merge(path, cli_env)
    assert code == 143 and seconds < 5, stderr[-3000:]
    line = "mergeflow: stopped on SIGTERM: cancelled merge/ssf; the finished steps stay cached"
    assert stderr.rstrip().endswith(line) and "Traceback" not in stderr, stderr[-3000:]
    assert not (path / "models/merged").exists() or not any((path / "models/merged").iterdir())
    assert not list(path.rglob("*.tmp"))

    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "merge/ssf" in ran_steps(path) and not any(s.startswith(("finetune/", "fisher/")) for s in ran_steps(path))
    assert _digests(path) == _digests(reference)


def _processes_in(path: Path) -> list[psutil.Process]:
    """The processes working in ``path`` (a run's Dask workers work in its directory)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.cwd() == str(path):
                found.append(process)
        except psutil.Error:  # gone, or not ours to look at
            pass
    return found


@pytest.mark.slow
def test_sigterm_stops_a_reproduction_and_the_prefect_server_it_started(tmp_path, cli_env):
    path = tmp_path / "reproduction"
    path.mkdir()
    (path / "preset.yaml").write_text(yaml.safe_dump({"params": fast_params(**LONG_SSF), "sweep": {"seed": [0]}}))

    code, seconds, stderr = _stop_during_the_merge(path, cli_env, ("reproduce", "merges", "--preset", "preset.yaml"))
    assert code == 143 and seconds < 5, stderr[-3000:]
    line = "mergeflow: stopped on SIGTERM: cancelled merge/ssf; the finished steps stay cached"
    assert stderr.rstrip().endswith(line) and "Traceback" not in stderr, stderr[-3000:]
    assert not _processes_in(path.resolve())  # the ephemeral Prefect server went with it


@pytest.mark.slow
def test_sigterm_stops_the_dask_workers_the_run_started(tmp_path, cli_env):
    dask = {"task_runner": "dask", "dask_workers": 2}
    path = make_workspace(tmp_path / "dask", fast_params(**LONG_SSF, orchestration=dask))

    code, seconds, stderr = _stop_during_the_merge(path, cli_env)
    assert code == 143 and seconds < 10, stderr[-3000:]  # Dask waits 4 s before killing a busy worker itself
    line = "mergeflow: stopped on SIGTERM: cancelled the steps on its 2 Dask worker processes; the finished steps stay"
    assert line in stderr, stderr[-3000:]  # multiprocessing may then warn of the semaphores the workers left
    assert not _processes_in(path.resolve())
    assert not list((path / ".mergeflow/results").glob("merge-ssf-*"))
