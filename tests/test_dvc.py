"""DVC: dvc.yaml matches the stage registry, `dvc repro` runs, skips and re-runs as it should, and
`mergeflow run` leaves dvc.lock in step with its outputs.

Each project here is a fresh `dvc init` with its own config: no remote or setting of the checkout's
`.dvc/`, nor of the user's or the system's DVC config, reaches it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import BIN, ROOT, fast_params, ran_steps, run_cli

from tasks.dvcfile import render
from tasks.stages import STAGES

DVC = str(BIN / "dvc")
# Every stage runs; lighter merges and one short federated algorithm keep each stage quick.
LIGHT = {
    "merge": {"methods": ["average", "task_arithmetic", "fisher"], "options": {"task_arithmetic": {"scaling": 0.3}}},
    "federated": {"algorithms": ["fedavg"], "rounds": 1},
}


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


def _copy_project(target: Path, env: dict[str, str], source: Path = ROOT) -> Path:
    """The files of ``source``'s working tree that git does not ignore (the code the tests run), in a new git
    repository, and a new DVC project there: the source's ``.dvc/`` (its remotes, its cache settings)
    stays behind."""
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    files = subprocess.run(listed, cwd=source, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (source / name).is_file() and Path(name).parts[0] != ".dvc":
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, target / name)
    subprocess.run(["git", "init", "-q"], cwd=target, check=True)
    subprocess.run([DVC, "init", "-q"], cwd=target, env=env, check=True)
    return target


def _project(target: Path, env: dict[str, str]) -> Path:
    """A copy of the project whose params.yaml is the light pipeline."""
    project = _copy_project(target, env)
    (project / "params.yaml").write_text(yaml.safe_dump(fast_params(**LIGHT), sort_keys=False))
    return project


def _dvc(args: list[str], project: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run([DVC, *args], cwd=project, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def test_a_project_copy_has_its_own_dvc_config(tmp_path, dvc_env):
    """A remote named `local` in the checkout's .dvc/config does not follow the copy (the tests add their own)."""
    source = tmp_path / "checkout"
    (source / ".dvc").mkdir(parents=True)
    (source / ".dvc/config").write_text("[core]\n    remote = local\n['remote \"local\"']\n    url = /elsewhere\n")
    (source / "params.yaml").write_text("seed: 0\n")
    subprocess.run(["git", "init", "-q"], cwd=source, check=True)
    subprocess.run(["git", "add", "-A"], cwd=source, check=True)
    project = _copy_project(tmp_path / "project", dvc_env, source)
    assert (project / "params.yaml").is_file()
    _dvc(["remote", "add", "-d", "local", str(tmp_path / "remote")], project, dvc_env)
    assert "/elsewhere" not in _dvc(["remote", "list"], project, dvc_env).stdout


def test_only_the_headline_files_are_dvc_metrics():
    """`dvc exp show` has a column per metric key: only each model's test headline, NLL and ECE are metrics;
    every other JSON (per-client curves, data notes, per-round rows, the full evaluation) a plain output."""
    from tasks.layout import HEADLINE, HEADLINE_KINDS

    stages = yaml.safe_load(render())["stages"]
    metrics = [path for entry in stages.values() for path in entry.get("metrics", [])]
    assert metrics == [HEADLINE.format(kind=kind) for kind in HEADLINE_KINDS]
    outs = {path for entry in stages.values() for path in entry["outs"]}
    assert {"metrics/evaluate.json", "metrics/align.json", "metrics/federated.json", "metrics/data.json"} <= outs


def test_the_headline_is_each_models_test_headline_nll_and_ece():
    from tasks.evaluation import headline_metrics

    scores = {"accuracy": 0.9, "ece": 0.05, "nll": 0.3}
    metrics = {
        "base": scores | {"by_group": {"a": scores}},
        "best_client": scores | {"client": 1},
        "merged/task_arithmetic": scores | {"accuracy_gain": -0.02},
        "federated/fedavg": scores | {"accuracy_gain": 0.01},
    }
    assert headline_metrics(metrics, "accuracy") == {
        "models": {"base": scores, "best_client": scores},
        "merged": {"task_arithmetic": scores},
        "federated": {"fedavg": scores},
    }
    regression = {"mse": 0.2, "nll": 1.1}
    assert headline_metrics({"merged/average": regression}, "mse")["merged"] == {"average": regression}


OVERRIDDEN = "DVC does not know the -S overrides (use `dvc exp run -S …` to track them)"


@pytest.mark.slow
def test_mergeflow_run_writes_dvc_lock_for_the_params_dvc_knows(tmp_path, dvc_env):
    """A run of params.yaml leaves `dvc status` clean and the outputs in DVC's cache (so `dvc push` sends
    them); a run with -S overrides or another params file says so in one line and leaves dvc.lock alone,
    and so does one stage (dvc.yaml's command: DVC locks it itself)."""
    project = _project(tmp_path / "project", dvc_env)
    done = run_cli(["run"], project, dvc_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dvc.lock" not in done.stderr
    assert _dvc(["status"], project, dvc_env).stdout.strip() == "Data and pipelines are up to date."
    headline = sorted(path.name for path in (project / "metrics/headline").iterdir())
    assert headline == ["federated.json", "merged.json", "models.json"]

    _dvc(["remote", "add", "-d", "local", str(tmp_path / "remote")], project, dvc_env)
    _dvc(["push"], project, dvc_env)
    lock = (project / "dvc.lock").read_text()
    evaluated = yaml.safe_load(lock)["stages"]["evaluate"]["outs"]
    digest = next(out["md5"] for out in evaluated if out["path"] == "metrics/evaluate.json")
    assert (tmp_path / "remote/files/md5" / digest[:2] / digest[2:]).is_file()

    # An unchanged re-run finds the lock written for it: no DVC import, no output hashed again.
    code = "import sys; from flows.cli import main; code = main(['run']); sys.exit(code or 3 * ('dvc' in sys.modules))"
    done = subprocess.run([str(BIN / "python"), "-c", code], cwd=project, env=dvc_env, capture_output=True, text=True)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert (project / "dvc.lock").read_text() == lock

    changed = ["-S", "merge.options.task_arithmetic.scaling=0.45"]
    done = run_cli(["run", *changed], project, dvc_env)
    assert done.returncode == 0, done.stderr[-3000:]
    told = [line for line in done.stderr.splitlines() if "dvc.lock" in line]
    assert told == [f"mergeflow: dvc.lock not updated: {OVERRIDDEN}"]
    assert (project / "dvc.lock").read_text() == lock
    assert "models/merged" in _dvc(["status"], project, dvc_env).stdout  # the outputs did change

    other = yaml.safe_load((project / "params.yaml").read_text())
    other["merge"]["options"]["task_arithmetic"]["scaling"] = 0.45
    (project / "other.yaml").write_text(yaml.safe_dump(other, sort_keys=False))
    done = run_cli(["run", "--params", "other.yaml"], project, dvc_env)
    assert done.returncode == 0, done.stderr[-3000:]
    told = [line for line in done.stderr.splitlines() if "dvc.lock" in line]
    assert len(told) == 1 and "not updated" in told[0] and "other.yaml" in told[0], done.stderr[-2000:]
    assert (project / "dvc.lock").read_text() == lock

    (project / "dvc.lock").unlink()
    done = run_cli(["stage", "merge"], project, dvc_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (project / "dvc.lock").exists() and "dvc.lock" not in done.stderr


def _repro(path: Path, env: dict[str, str]) -> str:
    return _dvc(["repro"], path, env).stdout


@pytest.mark.slow
def test_dvc_repro_runs_skips_and_reruns_only_changed_stages(tmp_path, dvc_env):
    project = _project(tmp_path / "project", dvc_env)

    first = _repro(project, dvc_env)
    for stage in STAGES:
        assert f"Running stage '{stage.name}'" in first
    assert (project / "metrics/evaluate.json").is_file()

    second = _repro(project, dvc_env)
    assert "Running stage" not in second

    # An experiment with one merge option changed re-runs only that merge and the evaluation, and the
    # baseline commit's and the experiment's metrics both come back.
    _dvc(["remote", "add", "-d", "local", str(tmp_path / "remote")], project, dvc_env)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "add", "-A"], cwd=project, check=True)
    subprocess.run([*git, "commit", "-qm", "baseline"], cwd=project, check=True)
    _dvc(["push"], project, dvc_env)
    experiment = _dvc(["exp", "run", "-S", "merge.options.task_arithmetic.scaling=0.6"], project, dvc_env).stdout
    ran = {stage.name for stage in STAGES if f"Running stage '{stage.name}'" in experiment}
    assert ran == {"merge", "evaluate"}, experiment[-3000:]
    assert "ran: merge/task_arithmetic\n" in experiment  # the other merge methods were Prefect cache hits
    shown = json.loads(_dvc(["exp", "show", "--json"], project, dvc_env).stdout)
    accuracies = [m["task_arithmetic"]["accuracy"] for m in _metrics_of(shown, "metrics/headline/merged.json")]
    assert len(accuracies) >= 2 and all(0 < a <= 1 for a in accuracies)  # the workspace, the baseline, the experiment
    diff = json.loads(_dvc(["metrics", "diff", "--json"], project, dvc_env).stdout)
    assert "metrics/headline/merged.json" in diff, diff
    # One merge option changed: its merge's headline columns come first, and no other metric shows.
    columns = _dvc(["exp", "show", "--only-changed", "--csv"], project, dvc_env).stdout.splitlines()[0].split(",")
    assert columns[4:8] == [
        "task_arithmetic.accuracy",
        "task_arithmetic.ece",
        "task_arithmetic.nll",
        "merge.options.task_arithmetic.scaling",
    ], columns

    # A fresh clone of the baseline, its data pulled: neither mergeflow nor DVC has anything to compute
    # (the clone's own MLflow store gets the runs once: tests/test_tracking_store.py), and the lock stays.
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(project), str(clone)], check=True)
    _dvc(["pull"], clone, dvc_env)
    done = run_cli(["run"], clone, dvc_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(clone) == {"track"}, done.stdout[-2000:]
    assert "up to date" in _dvc(["status"], clone, dvc_env).stdout
    assert subprocess.run(["git", "diff", "--exit-code", "dvc.lock"], cwd=clone).returncode == 0
    assert "Running stage" not in _repro(clone, dvc_env)


def _metrics_of(node, path: str) -> list[dict]:
    """Every payload of the metrics file ``path`` in ``dvc exp show --json``'s output, wherever it nests."""
    found = []
    if isinstance(node, dict):
        payload = node.get("metrics", {}).get(path, {}).get("data") if "metrics" in node else None
        found += [payload] if payload else []
        for value in node.values():
            found += _metrics_of(value, path)
    elif isinstance(node, list):
        for value in node:
            found += _metrics_of(value, path)
    return found


def test_dvc_lock_is_left_alone_when_the_params_file_changed_during_the_run(tmp_path):
    from flows.dvc_lock import ParamsSource, untracked_reason
    from tasks.store import sha256_file

    (tmp_path / "params.yaml").write_text("seed: 0\n")
    read = sha256_file(tmp_path / "params.yaml")
    assert untracked_reason(ParamsSource("params.yaml", (), read), tmp_path) is None
    (tmp_path / "params.yaml").write_text("seed: 1\n")  # edited while the run went on
    reason = untracked_reason(ParamsSource("params.yaml", (), read), tmp_path)
    assert reason == "params.yaml changed during the run: its outputs are of the params it read (run again)"
