"""MLflow's runs table, as a browser shows it without choosing columns, tells two pipeline runs apart."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import fast_params, free_port, make_workspace, run_cli


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs a headless Chromium (Debian's chromium package)")
def test_two_runs_with_other_merge_options_differ_in_the_runs_table(tmp_path, cli_env):
    merge = {"methods": ["average", "task_arithmetic"], "options": {"task_arithmetic": {"scaling": 0.3}}}
    params = fast_params(merge=merge, federated={"algorithms": ["fedavg"], "rounds": 1})
    workspace = make_workspace(tmp_path / "project", params)
    for overrides in ([], ["-S", "merge.options.task_arithmetic.scaling=0.5"]):
        done = run_cli(["run", *overrides], workspace, cli_env)
        assert done.returncode == 0, done.stderr[-3000:]
    port = free_port()
    url = run_cli(["ui", "--print-url", "--port", str(port)], workspace, cli_env).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{workspace / 'mlflow.db'}",
         "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        for _ in range(120):
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                break
            time.sleep(0.5)
        browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000"]
        page = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
    # The first run is named by its data; the second by its data and the option it changed.
    assert ">digits<" in page and ">digits task_arithmetic.scaling=0.5<" in page, page[-3000:]
