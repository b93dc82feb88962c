"""One layout of the artifacts: step modules read each other's outputs through :mod:`tasks.layout`, never
through each other, so that a step's key is its own code; and the stages declare the layout's paths."""

from __future__ import annotations

import inspect

from conftest import ROOT

import tasks.layout
from mergeflow.import_graph import import_closure
from tasks.stages import HEADLINE_METRICS, STAGES

# The modules that plan and run a stage's steps (the modules of its phases).
STEP_MODULES = sorted({phase.partition(":")[0] for stage in STAGES for phase in stage.phases})


def _file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def test_the_layout_imports_nothing_of_this_repository():
    assert import_closure("tasks.layout", ROOT) == ("tasks/__init__.py", "tasks/layout.py")


def test_no_step_module_imports_another():
    assert len(STEP_MODULES) == 9
    for module in STEP_MODULES:
        closure = set(import_closure(module, ROOT))
        assert {_file(other) for other in STEP_MODULES} & closure == {_file(module)}, module


def _headline_files() -> set[str]:
    return {tasks.layout.HEADLINE.format(kind=kind) for kind in tasks.layout.HEADLINE_KINDS}


def _layout_paths() -> set[str]:
    """Every path the layout names: its string constants and what its path functions give for client 0,
    round 1, and merge or algorithm ``x``."""
    samples = {"client": 0, "round_index": 1, "name": "x", "candidate": "c", "statistics": ("fishers",)}
    paths = {value for value in vars(tasks.layout).values() if isinstance(value, str) and "/" in value}
    paths = {path for path in paths if "{" not in path} | _headline_files()
    for name, function in vars(tasks.layout).items():
        if inspect.isfunction(function) and not name.startswith("_"):
            arguments = inspect.signature(function).parameters
            made = function(**{argument: samples[argument] for argument in arguments})
            paths |= set(made) if isinstance(made, list) else {made}
    return paths


def test_every_output_a_stage_declares_is_a_layout_path_or_holds_some():
    paths = _layout_paths()
    for stage in STAGES:
        for produced in stage.produced:
            assert produced in paths or any(path.startswith(produced + "/") for path in paths), (stage.name, produced)
    assert _headline_files() == set(HEADLINE_METRICS)


def test_every_metrics_and_plot_file_of_the_layout_is_a_stage_output():
    produced = {path for stage in STAGES for path in stage.produced}
    # Drawn only when a merge is searched: DVC fails on a declared output that a run did not make.
    sometimes = {tasks.layout.SELECTION_PLOT}
    for path in _layout_paths() - sometimes:
        if path.startswith(("metrics/", "plots/")):
            assert path in produced, path
