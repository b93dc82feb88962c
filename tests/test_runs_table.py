"""MLflow's runs table, as a browser shows it without choosing columns, tells two pipeline runs apart."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import browser_page, fast_params, free_port, make_workspace, run_cli


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs a headless Chromium (Debian's chromium package)")
def test_two_runs_with_other_merge_options_differ_in_the_runs_table(tmp_path, cli_env):
    merge = {"methods": ["average", "task_arithmetic"], "options": {"task_arithmetic": {"scaling": 0.3}}}
    params = fast_params(merge=merge, federated={"algorithms": ["fedavg"], "rounds": 1})
    workspace = make_workspace(tmp_path / "project", params)
    for overrides in ([], ["-S", "merge.options.task_arithmetic.scaling=0.5"]):
        done = run_cli(["run", *overrides], workspace, cli_env)
        assert done.returncode == 0, done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    page = browser_page(workspace, free_port(), env, showing=">digits task_arithmetic.scaling=0.5<")
    # The first run is named by its data; the second by its data and the option it changed.
    assert ">digits<" in page and ">digits task_arithmetic.scaling=0.5<" in page, page[-3000:]
