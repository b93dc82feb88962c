"""The pipeline end to end through the CLI: outputs, caching across processes, MLflow."""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import version

import pytest
from conftest import fast_params, make_workspace, ran_steps, run_cli

pytestmark = pytest.mark.slow

# The tests' methods plus a variant: one method run a second time with other settings.
MERGE = fast_params()["merge"]
MERGE = {
    "methods": [*MERGE["methods"], "ssf_50"],
    "options": {**MERGE["options"], "ssf_50": {"method": "ssf", "mask_rate": 0.5, "steps": 50}},
}
METHODS = MERGE["methods"]
MERGES = {f"merge/{method}" for method in METHODS}
CLIENTS = ("client_000", "client_001", "client_002")
ALL_STEPS = {
    "prepare",
    "partition",
    "pretrain",
    *(f"finetune/{c}" for c in CLIENTS),
    *(f"fisher/{c}" for c in CLIENTS),
    "centralized",
    "align",
    *MERGES,
    "evaluate",
    "track",
}
FEDERATED = fast_params()["federated"]
for _name in FEDERATED["algorithms"]:
    ALL_STEPS.add(f"federated/{_name}/init")
    for _round in range(1, FEDERATED["rounds"] + 1):
        ALL_STEPS |= {f"federated/{_name}/r{_round:03d}/{c}" for c in (*CLIENTS, "server")}
ALL_STEPS.add("federated/summary")


def _result_hashes(path) -> dict[str, str]:
    files = [*path.glob("models/**/*.safetensors"), path / "metrics/evaluate.json"]
    return {f.relative_to(path).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory, cli_env):
    """A workspace after one cold run of the fast pipeline, and its result hashes then."""
    path = make_workspace(tmp_path_factory.mktemp("pipeline"), fast_params(merge=MERGE))
    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return path, _result_hashes(path), done


@pytest.fixture(scope="module")
def workspace(cold_run):
    return cold_run[0]


def test_cold_run_executes_every_step_and_writes_outputs(cold_run):
    workspace, _, done = cold_run
    assert ran_steps(workspace) == ALL_STEPS
    # The console: MLflow's hints and registry lines stay off it; the summary names the new versions.
    assert "UserWarning" not in done.stderr and "Successfully registered" not in done.stderr
    assert "registered: mergeflow.digits.average version 1" in done.stdout
    metrics = json.loads((workspace / "metrics/evaluate.json").read_text())
    expected = {"base", "centralized", "ensemble", "best_client", "client_000", "client_001", "client_002"}
    expected |= {f"merged/{m}" for m in METHODS} | {f"federated/{a}" for a in FEDERATED["algorithms"]}
    assert set(metrics) == expected | {"sanity", "splits"}
    assert metrics.pop("splits")["models"] == "test"
    sanity = metrics.pop("sanity")
    assert sanity["warning"] is None and sanity["baseline"] == "majority class"
    for values in metrics.values():
        assert 0 <= values["accuracy"] <= 1 and values["nll"] > 0 and 0 <= values["ece"] <= 1
    gain = metrics["merged/average"]["accuracy_gain"]
    assert gain == pytest.approx(metrics["merged/average"]["accuracy"] - metrics["centralized"]["accuracy"])
    assert metrics["centralized"]["accuracy"] > 0.5
    for name in ("plots/comparison.png", "plots/partition.png"):
        assert (workspace / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stats = json.loads((workspace / "metrics/partition.json").read_text())
    assert sum(stats["sizes"]) == stats["total"] and len(stats["sizes"]) == 3


def test_same_params_and_seed_give_bit_identical_weights_and_metrics_on_a_dask_cluster(cold_run, tmp_path, cli_env):
    """A second workspace, run on a 2-process Dask LocalCluster, two steps to a task run."""
    path = make_workspace(tmp_path / "again", fast_params(merge=MERGE))
    dask = ["-S", "orchestration.task_runner=dask", "-S", "orchestration.dask_workers=2"]
    done = run_cli(["run", *dask, "-S", "orchestration.steps_per_task=2"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(path) == ALL_STEPS  # its own store: nothing came from the first run's cache
    hashes = _result_hashes(path)
    # base, centralized, clients, diagonal Fishers and factors (no merge here reads input Grams, so none are
    # made), the same three aligned, merges, metrics
    one_shot = 1 + 1 + 3 + 3 * 2 + 3 * 3 + len(METHODS) + 1
    # per algorithm: round 0 (server, global, 3 client states), then per round server, global,
    # 3 messages and 3 client states; FedAvg's and FedProx's clients keep no state (no file)
    algorithms = fast_params()["federated"]["algorithms"]
    stateless = len({"fedavg", "fedprox"} & set(algorithms))
    federated = len(algorithms) * (5 + 2 * 8) - stateless * 3 * (1 + 2)
    assert len(hashes) == one_shot + federated
    assert hashes == cold_run[1]


def test_second_run_is_fully_cached_and_imports_no_torch_prefect_datasets_or_flwr(workspace, cli_env):
    before = (workspace / "models/merged/average.safetensors").read_bytes()
    done = run_cli(["run"], workspace, {**cli_env, "PYTHONPROFILEIMPORTTIME": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(workspace) == set()
    assert (workspace / "models/merged/average.safetensors").read_bytes() == before
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    heavy = {"torch", "scipy", "prefect", "datasets", "flwr_datasets", "mlflow", "matplotlib"}
    assert imported and not heavy & imported  # the plan is the stored one: no stage module is imported


def test_a_no_op_run_starts_no_prefect_and_restores_deleted_outputs(workspace, monkeypatch, capsys):
    import prefect.client.orchestration

    import flows.pipeline
    from flows.cli import main

    def no_prefect(*args, **kwargs):
        raise AssertionError("a run with nothing to do must not start Prefect")

    monkeypatch.setattr(flows.pipeline, "run_pipeline", no_prefect)
    monkeypatch.setattr(prefect.client.orchestration, "get_client", no_prefect)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # other tests' mlflow.set_tracking_uri sets it
    monkeypatch.chdir(workspace)
    merged = workspace / "models/merged/average.safetensors"
    before = merged.read_bytes()
    merged.unlink()
    (workspace / "metrics/evaluate.json").unlink()
    assert main(["run"]) == 0
    assert merged.read_bytes() == before and (workspace / "metrics/evaluate.json").is_file()
    assert "0 ran" in capsys.readouterr().out
    assert ran_steps(workspace) == set()
    from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):  # forcing a re-run goes through the flow
        with pytest.raises(AssertionError, match="must not start Prefect"):
            main(["run"])


def test_changing_a_merge_option_reruns_only_that_merge(workspace, cli_env):
    done = run_cli(["run", "-S", "merge.options.task_arithmetic.scaling=0.5"], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(workspace) == {"merge/task_arithmetic", "evaluate", "track"}


def test_changing_one_client_lr_retrains_only_that_client(workspace, cli_env):
    done = run_cli(["run", "-S", "finetune.clients.1.lr=0.2"], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = {"finetune/client_001", "fisher/client_001", "align", *MERGES, "evaluate", "track"}
    assert ran_steps(workspace) == expected


def test_aligning_reruns_only_align_merge_and_evaluate_and_logs_barriers(workspace, cli_env):
    import mlflow

    overrides = ["-S", "align.method=weights", "-S", "align.reference=0", "-S", "align.repair=true"]
    done = run_cli(["run", *overrides], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    # The console: a line per stage and the summary; Prefect's INFO records go to its API, not here.
    assert "mergeflow: align: 1 steps, 1 ran" in done.stderr and "Finished in state" not in done.stderr
    ran = ran_steps(workspace)
    # Clients fine-tuned from one base align to the identity: the merges re-run on the new
    # aligned files (their metadata names the reference) but give the same weights, so
    # evaluate is a cache hit. Nothing upstream of align runs.
    assert {"align", "track"} <= ran <= {"align", *MERGES, "evaluate", "track"}
    report = json.loads((workspace / "metrics/align.json").read_text())
    assert report["method"] == "weights" and report["reference"] == 0
    assert set(report["before"]) == set(report["after"]) == set(report["repaired"]) == {"client_001", "client_002"}
    for client, curve in report["repaired"].items():  # REPAIR leaves the endpoints as they are
        assert curve["losses"][0] == pytest.approx(report["after"][client]["losses"][0], rel=1e-4)
        assert curve["losses"][-1] == pytest.approx(report["after"][client]["losses"][-1], rel=1e-4)
    for client, curve in report["after"].items():
        assert len(curve["losses"]) == 11 and curve["barrier"] >= 0
        assert curve["losses"][0] == pytest.approx(report["before"][client]["losses"][0])  # the reference
        assert curve["losses"][-1] == pytest.approx(report["before"][client]["losses"][-1])  # same function
    assert (workspace / "plots/barrier.png").read_bytes()[:4] == b"\x89PNG"
    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["mergeflow"], filter_string="tags.`mergeflow.kind` = 'pipeline'")
    latest = runs.iloc[0]  # the mean barriers of this run (each client's are in metrics/align.json, an artifact)
    for phase in ("before", "after", "repaired"):
        mean = sum(curve["barrier"] for curve in report[phase].values()) / 2
        assert latest[f"metrics.barrier_{phase}_mean"] == pytest.approx(mean)
    assert not [column for column in runs.columns if column.startswith("metrics.barrier_before.")]


def test_deleted_outputs_are_restored_from_the_store(workspace, cli_env):
    target = workspace / "models/clients/client_000.safetensors"
    original = target.read_bytes()
    target.unlink()
    done = run_cli(["run"], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(workspace) == set()
    assert target.read_bytes() == original


def test_mlflow_holds_runs_tags_metrics_and_a_reloadable_model(workspace):
    import mlflow
    import numpy as np

    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["mergeflow"])
    kinds = runs["tags.mergeflow.kind"]
    parents = runs[kinds == "pipeline"]
    assert len(parents) >= 1
    parent = parents.iloc[-1]  # the first run's parent
    assert parent["params.partition.num_clients"] == "3"
    assert len(parent["tags.mergeflow.data_hash"]) == 16
    assert parent["tags.mergeflow.git_commit"]
    import torch

    assert parent["tags.mergeflow.version.torch"] == version("torch")  # keys leave it out, the run notes it
    assert torch.__version__.startswith(parent["tags.mergeflow.version.torch"])
    records = list((workspace / ".mergeflow/results").iterdir())
    assert records and all(json.loads(r.read_text())["versions"]["torch"] for r in records)
    children = runs[runs["tags.mlflow.parentRunId"] == parent.run_id]
    expected_kinds = ["client"] * 3 + ["federated"] * len(FEDERATED["algorithms"]) + ["merge"] * len(METHODS)
    assert sorted(children["tags.mergeflow.kind"]) == expected_kinds
    merges = children[children["tags.mergeflow.kind"] == "merge"]
    assert set(merges["tags.mergeflow.merge"]) == set(METHODS)
    assert set(merges["tags.mergeflow.method"]) == set(METHODS) - {"ssf_50"}
    ssf_run = merges[merges["tags.mergeflow.merge"] == "ssf_50"].iloc[0]
    assert ssf_run["params.option.mask_rate"] == "0.5"
    ssf_curve = mlflow.tracking.MlflowClient().get_metric_history(ssf_run.run_id, "ssf_loss")
    assert len(ssf_curve) == 50
    exact_run = merges[merges["tags.mergeflow.method"] == "exact"].iloc[0]
    inputs = mlflow.get_run(exact_run.run_id).inputs.dataset_inputs  # what the merge was scored on
    assert {t.value for d in inputs for t in d.tags if t.key == "mlflow.data.context"} == {"evaluation"}
    assert exact_run["metrics.cg_relative_residual"] < 1e-6
    residuals = mlflow.tracking.MlflowClient().get_metric_history(exact_run.run_id, "cg_relative_residual")
    assert len(residuals) >= 2
    assert merges["metrics.test_accuracy"].between(0, 1).all()
    assert merges["metrics.test_nll"].gt(0).all() and merges["metrics.test_ece"].notna().all()
    client_run = children[children["tags.mergeflow.kind"] == "client"].iloc[0]
    # The pipeline run spans the whole run; a client's spans its fine-tuning step, within it (not its logging).
    assert parent.start_time < client_run.start_time < client_run.end_time < parent.end_time
    history = mlflow.tracking.MlflowClient().get_metric_history(client_run.run_id, "train_loss")
    assert len(history) > 1 and [m.step for m in history] == sorted(m.step for m in history)

    logged = mlflow.search_logged_models(experiment_ids=[parent.experiment_id], output_format="list")
    from mlflow.types import DataType

    signature = mlflow.models.get_model_info(logged[0].model_uri).signature
    assert signature.inputs is None  # feature arrays of any float type; the outputs are typed
    assert signature.outputs.input_types()[:2] == [DataType.long, DataType.double]
    model = mlflow.pyfunc.load_model(logged[0].model_uri)
    pixels = np.random.default_rng(0).random((5, 64))
    predicted = model.predict(pixels)
    single = model.predict(pixels.astype(np.float32))  # any float array is taken
    np.testing.assert_allclose(single["score"], predicted["score"], rtol=1e-6)
    assert list(predicted.columns[:2]) == ["label", "score"] and len(predicted) == 5
    assert set(predicted["label"]) <= set(range(10)) and predicted["score"].between(0, 1).all()  # digits are ints


def test_registry_gains_a_version_only_when_a_merged_model_changes(workspace, cli_env):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    client = mlflow.tracking.MlflowClient()
    versions = {name: client.search_model_versions(f"name='mergeflow.digits.{name}'") for name in METHODS}
    # cold run: every merge; the cached re-run: none; scaling=0.5: task_arithmetic only;
    # client 1's lr: every merge; alignment to the identity: none (same weights).
    expected = {name: 2 for name in METHODS} | {"task_arithmetic": 3}
    assert {name: len(found) for name, found in versions.items()} == expected
    experiment = mlflow.get_experiment_by_name("mergeflow").experiment_id
    logged = mlflow.search_logged_models(experiment_ids=[experiment], output_format="list")
    # One model per distinct merged checkpoint, named after its merge: a merge served from the cache
    # logs no model (and no checkpoint copy) again, its run points to the earlier one.
    assert sorted(model.name for model in logged) == sorted(name for name, found in versions.items() for _ in found)
    reused = mlflow.search_runs(experiment_ids=[experiment], filter_string="tags.`mergeflow.kind` = 'merge'")
    assert reused["tags.mergeflow.reused_from_run"].notna().sum() == len(reused) - len(logged)
    for found in versions.values():
        digests = [v.tags["mergeflow.checkpoint_sha256"] for v in found]
        assert len(set(digests)) == len(digests)
        assert all(len(v.tags["mergeflow.data_hash"]) == 16 for v in found)

    done = run_cli(["best", "--metric", "test_nll", "--top", "3"], workspace, cli_env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 4 and "test_nll" in lines[0]
    values = [float(line.split()[2]) for line in lines[1:]]
    assert values == sorted(values)  # lowest NLL first


def test_bad_params_exit_2_and_write_nothing(tmp_path, cli_env):
    path = make_workspace(tmp_path / "bad", fast_params(merge=MERGE))
    done = run_cli(["run", "-S", "partition.alpha=0", "-S", "merge.methods=[average, nope]"], path, cli_env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert any("partition.alpha" in line for line in lines)
    assert any("merge.methods[1]" in line and "nope" in line for line in lines)
    assert sorted(p.name for p in path.iterdir()) == ["params.yaml"]


def test_missing_label_column_is_one_clear_error(tmp_path, cli_env):
    path = make_workspace(tmp_path / "nolabel", {})
    (path / "t.csv").write_text("a,b\n1,2\n3,4\n")
    params = fast_params(data={"source": "table", "table": {"path": "csv", "data_files": str(path / "t.csv")}})
    make_workspace(path, params)
    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "mergeflow: error:" in done.stderr and "'label'" in done.stderr
    assert not (path / "data").exists()
