"""The federated stage with a server plan (attack, robust aggregator, server optimizer, DP) through the CLI:
the same numbers as the plain loop, the attackers and ε in the round metrics and MLflow."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fast_params, make_workspace, run_cli

pytestmark = pytest.mark.slow

ROBUST = {
    "algorithms": ["fedavg_median", "fedadam"],
    "rounds": 2,
    "attack": {"clients": 1, "kind": "label_flip"},
    "options": {
        "fedavg_median": {"algorithm": "fedavg", "aggregator": "median"},
        "fedadam": {"algorithm": "fedavg", "server": {"optimizer": "adam", "lr": 0.03}},
    },
}
PRIVATE = {"algorithms": ["fedavg"], "rounds": 2, "fraction": 0.67, "dp": {"clip": 0.5, "noise_multiplier": 0.8}}


def _loop(workspace, federated: dict, name: str):
    from mergeflow.federated import LocalTraining, run_rounds
    from tasks.federated import loop_inputs

    model_builder, clients, test = loop_inputs(workspace, 3)
    entry = dict(federated.get("options", {}).get(name, {}))
    threads = torch.get_num_threads()
    torch.set_num_threads(fast_params()["orchestration"]["torch_threads"])
    try:
        return run_rounds(
            entry.pop("algorithm", name),
            model_builder,
            clients,
            federated["rounds"],
            train=LocalTraining(**fast_params()["federated"]["local"]),
            fraction=federated.get("fraction", 1.0),
            seed=0,
            eval_data=test,
            predictive_samples=fast_params()["federated"]["predictive_samples"],
            server=entry.get("server"),
            aggregator=entry.get("aggregator"),
            attack=federated.get("attack"),
            dp=federated.get("dp"),
        )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("federated", [ROBUST, PRIVATE], ids=["robust", "private"])
def test_a_server_plan_in_the_flow_matches_the_plain_loop(tmp_path, cli_env, federated):
    params = fast_params(merge={"methods": ["average"]}, federated=federated)
    workspace = make_workspace(tmp_path, params)
    done = run_cli(["run"], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    curves = json.loads((workspace / "metrics/federated.json").read_text())
    for name in federated["algorithms"]:
        run = _loop(workspace, federated, name)
        for key in ("accuracy", "nll", "attackers", "kept", "epsilon", "clip"):
            assert [row.get(key) for row in curves[name]] == [row.get(key) for row in run.metrics], (name, key)
    rows = curves[federated["algorithms"][0]][1:]
    if "attack" in federated:
        assert all(len(row["attackers"]) == 1 and row["kept"] for row in rows)
    else:
        assert 0 < rows[0]["epsilon"] < rows[1]["epsilon"]
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
        found = mlflow.search_runs(experiment_names=["mergeflow"], filter_string="tags.`mergeflow.kind` = 'federated'")
        history = mlflow.tracking.MlflowClient().get_metric_history(found.iloc[0].run_id, "round_epsilon")
        assert sorted((m.step, m.value) for m in history) == [(r["round"], r["epsilon"]) for r in rows]
