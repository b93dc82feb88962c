"""Stored plans: used only while the params, the stages' code, the data files and the tracking URI are
the same, and step for step what the stages' plan functions compute."""

from __future__ import annotations

from dataclasses import dataclass

import tasks.plan_cache
from mergeflow.config import validate_params
from tasks.plan_cache import plan_of
from tasks.runner import _plan_stage
from tasks.stages import STAGES
from tasks.steps import Step, step_key


@dataclass(frozen=True)
class _Stage:
    name: str
    code: tuple[str, ...]


def test_a_stored_plan_is_used_until_what_it_depends_on_changes(tmp_path, monkeypatch):
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "stage.py").write_text("X = 1\n")
    monkeypatch.setattr(tasks.plan_cache, "project_root_of_code", lambda: code)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.csv").write_text("x,label\n1,0\n")
    table = {"path": "csv", "data_files": "*.csv", "label_column": "label"}
    params = validate_params({"data": {"source": "table", "table": table}})
    stages = [_Stage("prepare", ("pkg/stage.py",))]
    planned = []

    def plan_stage(stage, params):
        planned.append(stage.name)
        return [[Step("prepare", "tasks.data:prepare", {"n": len(planned)}, inputs=("a.csv",))]]

    def plan():
        return plan_of(stages, params, tmp_path, plan_stage)

    first = plan()
    assert plan() == first and len(planned) == 1  # stored: the plan functions are not called again
    (tmp_path / "b.csv").write_text("x,label\n2,1\n")  # the glob now matches another file
    assert plan() != first and len(planned) == 2
    (code / "pkg" / "stage.py").write_text("X = 2\n")  # the stage's code changed
    plan()
    assert len(planned) == 3
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    plan()
    assert len(planned) == 4
    params = validate_params({"data": {"source": "table", "table": table}, "seed": 1})
    plan()
    assert len(planned) == 5


def test_a_stored_plan_keys_every_step_as_the_plan_functions_do(tmp_path):
    params = validate_params({"federated": {"algorithms": ["fedavg"], "rounds": 2}})
    fresh = [_plan_stage(stage, params) for stage in STAGES]
    plan_of(STAGES, params, tmp_path, _plan_stage)
    stored = plan_of(STAGES, params, tmp_path, lambda stage, params: [])  # must not be called
    keys = [[[step_key(s, tmp_path) for s in wave] for wave in stage] for stage in fresh]
    assert [[[step_key(s, tmp_path) for s in wave] for wave in stage] for stage in stored] == keys
    assert sum(len(wave) for stage in stored for wave in stage) > 20
    assert stored == fresh  # every field, those outside the key too (settings, the logging step's holds and local)
    assert any(step.holds and step.local for stage in stored for wave in stage for step in wave)
