"""DVC: dvc.yaml matches the stage registry, and `dvc repro` runs, skips and re-runs as it should."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import BIN, ROOT, fast_params, ran_steps, run_cli

from mergeflow.dvcfile import render
from mergeflow.stages import STAGES


def test_committed_dvc_yaml_is_generated_from_the_registry():
    assert (ROOT / "dvc.yaml").read_text() == render(), "run `mergeflow dvc-yaml --write`"


def test_dvc_deps_are_the_code_every_step_of_the_stage_is_keyed_on():
    """dvc repro and the Prefect pipeline re-run on the same edits: a stage's code is its steps' code."""
    from mergeflow.config import load_params
    from tasks.runner import _waves
    from tasks.steps import resolve

    # the committed params, and with the options whose steps read more
    variants = [[], ["centralized.keep=best_validation", "data.validation_fraction=0.2"]]
    for overrides in variants:
        params = load_params(ROOT / "params.yaml", overrides)
        for stage in STAGES:
            steps = {
                path
                for phase in stage.phases
                for wave in _waves(resolve(phase)(params))
                for step in wave
                for path in step.code
            }
            assert steps <= set(stage.code), f"stage {stage.name} ({overrides}): {sorted(steps - set(stage.code))}"
            assert all((ROOT / path).is_file() for path in stage.code)
    deps = yaml.safe_load(render())["stages"]["federated"]["deps"]
    assert {"mergeflow/training.py", "mergeflow/seeding.py", "mergeflow/federated/local.py"} <= set(deps)


def test_dvc_yaml_lists_every_stage_with_its_params_and_paths():
    stages = yaml.safe_load(render())["stages"]
    assert list(stages) == [stage.name for stage in STAGES]
    for stage in STAGES:
        entry = stages[stage.name]
        assert entry["cmd"] == f"mergeflow stage {stage.name}"
        assert set(stage.deps) <= set(entry["deps"]) and set(stage.code) <= set(entry["deps"])
        assert entry["params"] == list(stage.params)
        for out in stage.deps:
            assert any(out in s.produced for s in STAGES), f"{stage.name} depends on {out}, which no stage makes"


def _copy_project(target: Path) -> Path:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    subprocess.run(["git", "init", "-q"], cwd=target, check=True)
    return target


def _repro(path: Path, env: dict[str, str]) -> str:
    done = subprocess.run([str(BIN / "dvc"), "repro"], cwd=path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.mark.slow
def test_dvc_repro_runs_skips_and_reruns_only_changed_stages(tmp_path, cli_env):
    project = _copy_project(tmp_path / "project")
    # Every stage runs; lighter merges and one short federated algorithm keep each stage quick.
    merge = {"methods": ["average", "task_arithmetic", "fisher"], "options": {"task_arithmetic": {"scaling": 0.3}}}
    params = fast_params(merge=merge, federated={"algorithms": ["fedavg"], "rounds": 1})
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    first = _repro(project, cli_env)
    for stage in STAGES:
        assert f"Running stage '{stage.name}'" in first
    assert (project / "metrics/evaluate.json").is_file()

    second = _repro(project, cli_env)
    assert "Running stage" not in second

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["merge"]["options"]["task_arithmetic"]["scaling"] = 0.45
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    third = _repro(project, cli_env)
    ran = {stage.name for stage in STAGES if f"Running stage '{stage.name}'" in third}
    assert ran == {"merge", "evaluate"}
    assert "ran: merge/task_arithmetic\n" in third  # the other merge methods were Prefect cache hits

    # Experiments compare: the baseline commit's and an experiment's metrics both come back.
    dvc = str(BIN / "dvc")
    subprocess.run([dvc, "remote", "add", "-d", "local", str(tmp_path / "remote")], cwd=project, check=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "add", "-A"], cwd=project, check=True)
    subprocess.run([*git, "commit", "-qm", "baseline"], cwd=project, check=True)
    pushed = subprocess.run([dvc, "push"], cwd=project, env=cli_env, capture_output=True, text=True)
    assert pushed.returncode == 0, (pushed.stdout + pushed.stderr)[-2000:]
    done = subprocess.run([dvc, "exp", "run", "-S", "merge.options.task_arithmetic.scaling=0.6"], cwd=project,
                          env=cli_env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    shown = subprocess.run([dvc, "exp", "show", "--json"], cwd=project, env=cli_env, capture_output=True, text=True)
    accuracies = [m["merged/task_arithmetic"]["accuracy"] for m in _evaluate_metrics(json.loads(shown.stdout))]
    assert len(accuracies) >= 2 and all(0 < a <= 1 for a in accuracies)  # the workspace, the baseline, the experiment
    diff = subprocess.run([dvc, "metrics", "diff", "--json"], cwd=project, env=cli_env, capture_output=True, text=True)
    assert diff.returncode == 0 and "metrics/evaluate.json" in json.loads(diff.stdout), diff.stderr[-2000:]

    # A fresh clone of the baseline, its data pulled: neither mergeflow nor DVC has anything to do.
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(project), str(clone)], check=True)
    pulled = subprocess.run([dvc, "pull"], cwd=clone, env=cli_env, capture_output=True, text=True)
    assert pulled.returncode == 0, (pulled.stdout + pulled.stderr)[-2000:]
    done = run_cli(["run"], clone, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(clone) == set(), done.stdout[-2000:]
    status = subprocess.run([dvc, "status"], cwd=clone, env=cli_env, capture_output=True, text=True)
    assert "up to date" in status.stdout, status.stdout[-2000:]
    assert "Running stage" not in _repro(clone, cli_env)


def _evaluate_metrics(node) -> list[dict]:
    """Every ``metrics/evaluate.json`` payload in ``dvc exp show --json``'s output, wherever it nests."""
    found = []
    if isinstance(node, dict):
        payload = node.get("metrics", {}).get("metrics/evaluate.json", {}).get("data") if "metrics" in node else None
        found += [payload] if payload else []
        for value in node.values():
            found += _evaluate_metrics(value)
    elif isinstance(node, list):
        for value in node:
            found += _evaluate_metrics(value)
    return found
