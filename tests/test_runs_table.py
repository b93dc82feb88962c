"""MLflow's runs table, as a browser shows it without choosing columns, tells two pipeline runs apart."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import browser_page, fast_params, free_port, make_workspace, run_cli

NAMES = ["digits", "digits task_arithmetic.scaling=0.5"]  # the first run by its data, the second by what it changed


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, cli_env):
    """A workspace after two pipeline runs that differ in one merge option."""
    merge = {"methods": ["average", "task_arithmetic"], "options": {"task_arithmetic": {"scaling": 0.3}}}
    params = fast_params(merge=merge, federated={"algorithms": ["fedavg"], "rounds": 1})
    workspace = make_workspace(tmp_path_factory.mktemp("runs-table") / "project", params)
    for overrides in ([], ["-S", "merge.options.task_arithmetic.scaling=0.5"]):
        done = run_cli(["run", *overrides], workspace, cli_env)
        assert done.returncode == 0, done.stderr[-3000:]
    return workspace


@pytest.mark.slow
def test_two_runs_with_other_merge_options_are_named_apart(two_runs):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{two_runs / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("mergeflow").experiment_id
    parents = client.search_runs([experiment], "tags.`mergeflow.kind` = 'pipeline'", order_by=["start_time ASC"])
    assert [run.info.run_name for run in parents] == NAMES


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs a headless Chromium (Debian's chromium package)")
def test_two_runs_with_other_merge_options_differ_in_the_runs_table(two_runs):
    workspace = two_runs
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    page = browser_page(workspace, free_port(), env, showing=">digits task_arithmetic.scaling=0.5<")
    assert all(f">{name}<" in page for name in NAMES), page[-3000:]
