"""Faults: a kill -9 mid-run loses no finished client, and concurrent runs do not corrupt each other."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import BIN, fast_params, make_workspace, ran_steps, run_cli

pytestmark = pytest.mark.slow

# Four clients trained one at a time, slowly enough to kill the run between them.
PARAMS = {
    "partition": {"num_clients": 4, "alpha": 1.0},
    "finetune": {"epochs": 150},
    "merge": {"methods": ["average", "fisher"], "options": {}},
    "federated": {"algorithms": []},
    "orchestration": {"max_workers": 1},
}


def _digests(path: Path) -> dict[str, str]:
    files = sorted(path.glob("models/clients/*.safetensors")) + sorted(path.glob("models/merged/*.safetensors"))
    return {f.relative_to(path).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def _finished_clients(path: Path) -> list[str]:
    results = path / ".mergeflow" / "results"
    return sorted(p.name for p in results.glob("finetune-client_*")) if results.is_dir() else []


def _reference_and_killed_run(
    tmp_path: Path, cli_env: dict, params: dict, finished: Callable[[Path], list], enough: int, settle: float
) -> tuple[Path, Path, list]:
    """A reference workspace run to the end, and one whose run is killed (-9, with its whole
    process group) once ``finished(path)`` lists ``enough`` entries and ``settle`` seconds passed.

    Returns both workspaces and what ``finished`` listed just before the kill.
    """
    reference = make_workspace(tmp_path / "reference", fast_params(**params))
    assert run_cli(["run"], reference, cli_env).returncode == 0
    path = make_workspace(tmp_path / "killed", fast_params(**params))
    process = subprocess.Popen(
        [str(BIN / "mergeflow"), "run"],
        cwd=path,
        env=cli_env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while len(finished(path)) < enough and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    time.sleep(settle)
    done = finished(path)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return reference, path, done


def test_kill_9_during_finetuning_keeps_finished_clients_and_the_result(tmp_path, cli_env):
    # settle: past the result write, so the kill lands between clients, not inside Prefect's own write
    reference, path, finished = _reference_and_killed_run(tmp_path, cli_env, PARAMS, _finished_clients, 1, 0.5)
    assert 1 <= len(finished) < 4, f"the kill came too late or too early: {finished}"

    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    retrained = {step for step in ran_steps(path) if step.startswith("finetune/")}
    for name in finished:  # result files are named after the step, e.g. finetune-client_000-<key>
        assert f"finetune/{name.split('-')[1]}" not in retrained
    assert len(retrained) == 4 - len(finished)
    assert _digests(path) == _digests(reference)
    assert not list(path.rglob("*.tmp"))  # no half-written file anywhere


# FedAvg over 6 rounds of slow client updates, so that a kill lands between rounds.
FEDERATED_PARAMS = {
    "merge": {"methods": ["average"], "options": {}},
    "federated": {"algorithms": ["fedavg"], "rounds": 6, "local": {"epochs": 150}},
    "orchestration": {"max_workers": 1},
}


def _finished_rounds(path: Path) -> list[int]:
    results = path / ".mergeflow" / "results"
    records = results.glob("federated-fedavg-r*-server-*") if results.is_dir() else []
    return sorted(int(p.name.split("-")[2][1:]) for p in records)


def test_kill_9_during_federated_rounds_resumes_at_the_last_finished_round(tmp_path, cli_env):
    reference, path, finished = _reference_and_killed_run(tmp_path, cli_env, FEDERATED_PARAMS, _finished_rounds, 2, 0.0)
    assert 2 <= len(finished) < 6, f"the kill came too late or too early: {finished}"

    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    rerun = {int(step.split("/")[2][1:]) for step in ran_steps(path) if step.startswith("federated/fedavg/r")}
    assert rerun and min(rerun) > finished[-1]  # no finished round ran again
    final = "models/federated/fedavg/round_006/global.safetensors"
    assert (path / final).read_bytes() == (reference / final).read_bytes()
    assert not list(path.rglob("*.tmp"))


def test_two_concurrent_runs_with_different_params_leave_both_results_intact(tmp_path, cli_env):
    path = make_workspace(tmp_path / "shared", fast_params(**{**PARAMS, "finetune": {"epochs": 2}}))
    first = ["run", "-S", "merge.methods=[average]"]
    second = ["run", "-S", "merge.methods=[fisher]", "-S", "finetune.clients.0.lr=0.1"]
    processes = [
        subprocess.Popen(
            [str(BIN / "mergeflow"), *args],
            cwd=path,
            env=cli_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in (first, second)
    ]
    outputs = [p.communicate(timeout=600)[1] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert any("waiting for it" in out for out in outputs)  # one run waited for the other
    for args in (first, second):  # each run's work is intact in the cache: re-running it executes nothing
        done = run_cli(args, path, cli_env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert ran_steps(path) == set()
