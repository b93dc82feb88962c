"""The user's own table: it trains on the defaults (standardised when its scales differ), one-hot
categories and filled gaps fitted on the training split, the encoding travels with the logged model,
a run that learns nothing says so, and a bad table fails before any orchestration starts."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from conftest import fast_params, make_workspace, run_cli

from flows.cli import main
from mergeflow.data.encode import encode_splits
from mergeflow.data.errors import DataError
from mergeflow.data.features import FeatureEncoder, fit_encoder
from mergeflow.data.table import load_table_raw
from mergeflow.evaluation import sanity_check
from mergeflow.schema.sources import get_source

# Very different scales: an unscaled SGD run sees only the 1e4 column.
SCALES = np.array([1e-3, 1.0, 1e4, 50.0, 1e-2, 300.0])
SITES = ["north", "south", "east"]


def mixed_scale_table(path, rows: int = 360, seed: int = 0, gaps: int = 0) -> pd.DataFrame:
    """Three well-separated classes in standardised space, features at very different scales, a text
    column ``site`` and, with ``gaps``, that many missing values in column ``f1``; written to ``path``."""
    rng = np.random.default_rng(seed)
    labels = np.arange(rows) % 3
    centres = rng.normal(0.0, 2.5, size=(3, len(SCALES)))
    features = (centres[labels] + rng.normal(0.0, 0.6, size=(rows, len(SCALES)))) * SCALES + 5 * SCALES
    frame = pd.DataFrame(features, columns=[f"f{i}" for i in range(len(SCALES))])
    frame["site"] = [SITES[(label + int(rng.integers(0, 2))) % 3] for label in labels]
    frame.loc[rng.choice(rows, size=gaps, replace=False), "f1"] = np.nan
    frame["kind"] = [f"kind_{label}" for label in labels]
    frame.to_csv(path, index=False)
    return frame


# --- the encoder -------------------------------------------------------------------------------


def test_auto_standardises_mixed_scales_only_and_never_images():
    rng = np.random.default_rng(0)
    mixed = pa.table({"a": rng.normal(0, 1e3, 200), "b": rng.normal(0, 1e-2, 200)})
    unit = pa.table({"a": rng.normal(0, 1, 200), "b": rng.normal(1, 2, 200)})
    large = pa.table({"a": rng.normal(5e3, 1e3, 200), "b": rng.normal(5e3, 2e3, 200)})
    assert fit_encoder(mixed, ["a", "b"]).standardized
    assert not fit_encoder(unit, ["a", "b"]).standardized
    assert fit_encoder(large, ["a", "b"]).standardized  # similar spreads, far from unit scale
    assert not fit_encoder(mixed, ["a", "b"], tabular=False).standardized
    assert fit_encoder(unit, ["a", "b"], standardize=True).standardized
    assert not fit_encoder(mixed, ["a", "b"], standardize=False).standardized
    encoder = fit_encoder(mixed, ["a", "b"])
    x = encoder.transform(mixed)
    np.testing.assert_allclose(x.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(x.std(0), 1, atol=1e-5)
    assert "range from" in encoder.reason


def test_one_hot_uses_the_training_categories_and_unseen_ones_are_zero(tmp_path):
    frame = pd.DataFrame({"n": np.arange(40.0), "c": ["a", "b"] * 20, "y": [0, 1] * 20})
    frame.loc[[3, 17], "c"] = "zz"  # one of these rows is bound to leave the training split
    frame.to_csv(tmp_path / "t.csv", index=False)
    raw = load_table_raw("csv", data_files=str(tmp_path / "t.csv"), label_column="y", categorical="onehot")
    splits, info = encode_splits(raw, test_fraction=0.25, server_fraction=0.1, seed=0, categorical="onehot")
    columns = {c["name"]: c for c in info["features"]["columns"]}
    train_rows = set(splits["train"]["row"])
    expected = sorted({frame["c"][r] for r in train_rows})
    assert columns["c"]["categories"] == expected and info["input_shape"] == [1 + len(expected)]
    encoder = FeatureEncoder.from_dict(info["features"])
    for name in ("test", "server"):
        x = np.asarray(splits[name]["x"])
        for row, values in zip(splits[name]["row"], x, strict=True):
            category = frame["c"][row]
            onehot = values[1:] * np.asarray(encoder.std[1:]) + np.asarray(encoder.mean[1:])
            assert np.allclose(onehot, [float(category == c) for c in expected], atol=1e-6)
    with pytest.raises(DataError, match=r"'c' holds text.*data.categorical: onehot"):
        load_table_raw("csv", data_files=str(tmp_path / "t.csv"), label_column="y")


def test_missing_values_error_drop_rows_or_training_mean(tmp_path):
    frame = pd.DataFrame({"a": np.arange(30.0), "b": np.ones(30), "y": [0, 1, 2] * 10})
    frame.loc[[4, 9], "a"] = np.nan
    frame.to_csv(tmp_path / "t.csv", index=False)
    table = get_source("table")
    options = table.parse({"path": "csv", "data_files": str(tmp_path / "t.csv"), "label_column": "y"})
    with pytest.raises(DataError, match=r"column 'a' has 2 missing value\(s\) in 30 rows; set data.missing"):
        table.loader.load_raw(options)
    dropped = table.loader.load_raw(options, data={"missing": "drop_rows"})
    assert dropped.features.num_rows == 28 and dropped.info["dropped_rows"] == 2
    assert 4 not in dropped.source_rows and 9 not in dropped.source_rows
    raw = table.loader.load_raw(options, data={"missing": "mean"})
    splits, info = encode_splits(raw, test_fraction=0.3, seed=0, missing="mean", standardize=False)
    train_rows = [r for r in splits["train"]["row"] if r not in (4, 9)]
    mean = frame["a"][train_rows].mean()
    (fill,) = (c["fill"] for c in info["features"]["columns"] if c["name"] == "a")
    assert fill == pytest.approx([mean])
    for name, split in splits.items():
        for row, x in zip(split["row"], split["x"], strict=True):
            assert x[0] == pytest.approx(mean if row in (4, 9) else frame["a"][row]), name


def test_a_float_label_with_many_values_suggests_regression(tmp_path):
    rng = np.random.default_rng(0)
    pd.DataFrame({"a": rng.normal(size=60), "price": rng.normal(100, 20, 60)}).to_csv(tmp_path / "p.csv", index=False)
    with pytest.raises(DataError, match=r"'price' holds 60 distinct numbers in 60 rows.*data.table.task: regression"):
        load_table_raw("csv", data_files=str(tmp_path / "p.csv"), label_column="price")
    pd.DataFrame({"a": np.arange(60.0), "n": np.arange(60) // 2}).to_csv(tmp_path / "n.csv", index=False)
    with pytest.raises(DataError, match="'n' holds 30 distinct numbers"):  # whole numbers, two rows a class
        load_table_raw("csv", data_files=str(tmp_path / "n.csv"), label_column="n")
    pd.DataFrame({"a": np.arange(200.0), "n": np.arange(200) % 25}).to_csv(tmp_path / "ok.csv", index=False)
    assert load_table_raw("csv", data_files=str(tmp_path / "ok.csv"), label_column="n").y.max() == 24  # 8 rows a class
    raw = load_table_raw("csv", data_files=str(tmp_path / "p.csv"), label_column="price", task="regression")
    assert raw.y.dtype == np.float32


def test_a_large_regression_target_is_standardised_and_every_number_is_reported_in_its_units(tmp_path):
    import torch

    from mergeflow.metrics import regression_metrics
    from mergeflow.objectives import get_objective
    from mergeflow.predictor import TablePredictor

    in_target_units = get_objective("regression").in_target_units

    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"a": rng.normal(size=200), "b": rng.normal(size=200)})
    frame["price"] = 150 + 80 * frame["a"] - 30 * frame["b"] + rng.normal(0, 5, 200)
    frame.to_csv(tmp_path / "p.csv", index=False)
    raw = load_table_raw("csv", data_files=str(tmp_path / "p.csv"), label_column="price", task="regression")
    splits, info = encode_splits(raw, test_fraction=0.25, seed=0)
    scale = info["target_scale"]
    train_y = frame["price"].to_numpy()[np.asarray(splits["train"]["row"])]
    assert scale["mean"] == pytest.approx(train_y.mean()) and scale["std"] == pytest.approx(train_y.std())
    assert np.asarray(splits["train"]["y"]).std() == pytest.approx(1.0, abs=1e-5)
    assert not info["features"]["mean"]  # the features were already on a unit scale
    unit = encode_splits(raw._replace(y=raw.y / 100), test_fraction=0.25, seed=0)[1]["target_scale"]
    assert unit["std"] == 1.0  # prices in hundreds are left alone

    test_y = np.asarray(splits["test"]["y"], dtype=np.float64)
    predicted = test_y + rng.normal(0, 0.1, len(test_y))  # in the model's units
    in_model_units = regression_metrics(predicted, test_y, noise_std=0.2)
    original = regression_metrics(predicted * scale["std"], test_y * scale["std"], noise_std=0.2 * scale["std"])
    assert in_target_units(in_model_units, scale["std"]) == pytest.approx(original)

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 1))
    predictor = TablePredictor(model, info)
    outputs = model(torch.as_tensor(predictor.features(frame[["a", "b"]]))).detach().numpy()[:, 0]
    np.testing.assert_allclose(
        predictor.predict(frame[["a", "b"]])["prediction"], outputs * scale["std"] + scale["mean"], atol=1e-3
    )


@pytest.mark.parametrize("classes", [[0, 1, 2], [3, 7, 9]])
def test_a_served_model_answers_with_labels_of_the_datas_type(tmp_path, classes):
    import torch

    from mergeflow.predictor import TablePredictor

    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"a": rng.normal(size=90), "label": np.repeat(classes, 30)})
    frame.to_csv(tmp_path / "t.csv", index=False)
    raw = load_table_raw("csv", data_files=str(tmp_path / "t.csv"), label_column="label")
    info = encode_splits(raw, test_fraction=0.25, seed=0)[1]
    predicted = TablePredictor(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(1, 3)), info).predict(frame)
    assert set(predicted["label"]) <= set(classes) and all(isinstance(v, int | np.integer) for v in predicted["label"])


# --- the sanity check --------------------------------------------------------------------------


def test_sanity_check_is_a_paired_test_against_ignoring_the_input():
    y_train = np.array([0] * 60 + [1] * 30 + [2] * 10)
    y_test = np.array([0] * 50 + [1] * 30 + [2] * 20)
    majority = np.zeros(100, dtype=int)
    three_more = majority.copy()
    three_more[[50, 60, 70]] = 1  # 3 more right than the majority class: a gain of 0.03 ± 2·0.017
    blind = {"centralized": majority, "merged/average": three_more}
    report = sanity_check(blind, y_train, y_test, task="classification", hints="h.")
    assert report["baseline_accuracy"] == 0.5 and report["models_at_baseline"] == ["centralized", "merged/average"]
    assert report["warning"].startswith("every model is within noise of always predicting the majority class")
    learned = {"centralized": y_test, "merged/average": majority}  # perfect: a gain of 0.5 ± 2·0.050
    report = sanity_check(learned, y_train, y_test, task="classification", hints="h.")
    assert report["warning"] is None and report["models_at_baseline"] == ["merged/average"]
    y = np.linspace(-1, 1, 200)
    report = sanity_check({"centralized": np.full(200, 0.01)}, y, y, task="regression", hints="h.")
    assert report["baseline_mse"] == pytest.approx(np.mean(y**2)) and "training mean" in report["warning"]
    fitted = {"centralized": y + 0.05, "ensemble": np.zeros(200)}
    report = sanity_check(fitted, y, y, task="regression", hints="")
    assert report["warning"] is None and report["models_at_baseline"] == ["ensemble"]


# --- through the CLI ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table_run(tmp_path_factory, cli_env):
    """One pipeline run on the mixed-scale table: default standardisation, one-hot ``site``, gaps filled."""
    path = make_workspace(tmp_path_factory.mktemp("own") / "run", {})
    frame = mixed_scale_table(path / "table.csv", gaps=12)
    hf = {"path": "csv", "data_files": str(path / "table.csv"), "label_column": "kind"}
    data = {"source": "table", "table": hf, "categorical": "onehot", "missing": "mean"}
    params = fast_params(data=data, merge={"methods": ["average"]})
    params["federated"].update(algorithms=["fedavg"])
    make_workspace(path, params)
    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return path, frame, done


@pytest.mark.slow
def test_mixed_scales_train_on_the_defaults_and_the_choice_is_recorded(table_run):
    path, _, done = table_run
    metrics = json.loads((path / "metrics/evaluate.json").read_text())
    assert metrics["centralized"]["accuracy"] > 0.9 and metrics["merged/average"]["accuracy"] > 0.9
    assert metrics["sanity"]["warning"] is None and "mergeflow: warning" not in done.stderr
    report = json.loads((path / "metrics/data.json").read_text())
    assert report["standardize"] == "auto" and report["standardized"] is True
    assert report["onehot_columns"] == {"site": 3} and report["missing_values"] == {"f1": 12}
    info = json.loads((path / "data/prepared/info.json").read_text())
    assert info["class_names"] == ["kind_0", "kind_1", "kind_2"] and info["input_shape"] == [len(SCALES) + 3]


@pytest.mark.slow
def test_the_registered_model_predicts_from_raw_rows_as_the_checkpoint_does(table_run):
    import mlflow

    from mergeflow.checkpoints import load_model
    from mergeflow.data.storage import load_dataset_file, to_arrays
    from mergeflow.metrics import softmax
    from mergeflow.training import predict

    path, frame, _ = table_run
    info = json.loads((path / "data/prepared/info.json").read_text())
    test = load_dataset_file(path / "data/prepared/test.parquet")
    x, _ = to_arrays(test, info)
    expected = softmax(predict(load_model(path / "models/merged/average.safetensors"), x))
    raw = pd.read_csv(path / "table.csv").drop(columns=["kind"]).iloc[np.asarray(test["row"])]
    assert raw["f1"].isna().any()  # a gap, filled with the training mean inside the model
    mlflow.set_tracking_uri(f"sqlite:///{path / 'mlflow.db'}")
    from mlflow.types import DataType

    signature = mlflow.models.get_model_info("models:/mergeflow.table.average/1").signature
    assert signature.inputs.input_names() == list(raw.columns)  # the raw columns, numbers as doubles
    assert signature.inputs.input_types()[list(raw.columns).index("f1")] == DataType.double
    assert signature.outputs.input_names()[:2] == ["label", "score"]
    predicted = mlflow.pyfunc.load_model("models:/mergeflow.table.average/1").predict(raw)
    probabilities = predicted[[f"probability_kind_{k}" for k in range(3)]].to_numpy()
    np.testing.assert_allclose(probabilities, expected, atol=1e-6)
    assert (predicted["label"] == frame["kind"].iloc[np.asarray(test["row"])].to_numpy()).mean() > 0.9


@pytest.mark.slow
def test_mlflow_marks_training_and_logs_the_datasets(table_run):
    import mlflow

    path, _, _ = table_run
    mlflow.set_tracking_uri(f"sqlite:///{path / 'mlflow.db'}")
    experiment = mlflow.get_experiment_by_name("mergeflow")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = mlflow.search_runs(experiment_ids=[experiment.experiment_id])
    parent = mlflow.get_run(runs[runs["tags.mergeflow.kind"] == "pipeline"].run_id.iloc[0])
    inputs = {d.dataset.name: d.dataset.digest for d in parent.inputs.dataset_inputs}
    assert set(inputs) == {"table:csv:train", "table:csv:test", "table:csv:server"}
    assert parent.data.params["data.standardized"] == "true"
    assert parent.data.metrics["baseline.test_accuracy"] == pytest.approx(1 / 3, abs=0.02)
    client = mlflow.get_run(runs[runs["tags.mergeflow.client"] == "0"].run_id.iloc[0])
    assert [d.dataset.name for d in client.inputs.dataset_inputs] == ["table:csv:client_000"]


@pytest.mark.slow
def test_unscaled_features_give_the_chance_level_warning(table_run, cli_env):
    path, _, _ = table_run
    done = run_cli(["run", "-S", "data.standardize=false"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("mergeflow: warning:")]
    assert len(warnings) == 1 and "majority class" in warnings[0] and "data.standardize" in warnings[0]
    metrics = json.loads((path / "metrics/evaluate.json").read_text())
    assert metrics["sanity"]["warning"] == warnings[0].removeprefix("mergeflow: warning: ")
    assert json.loads((path / "metrics/data.json").read_text())["standardized"] is False


@pytest.mark.slow
def test_editing_the_table_re_runs_prepare(table_run, cli_env):
    from mergeflow.config import load_params
    from tasks.data import plan_prepare
    from tasks.steps import step_key

    path, _, _ = table_run
    params = load_params(path / "params.yaml", [])
    (step,) = plan_prepare(params)
    before = step_key(step, path)
    with (path / "table.csv").open("a") as handle:
        handle.write("1,1,1,1,1,1,north,kind_0\n")
    assert step_key(step, path) != before


@pytest.mark.parametrize(
    ("policy", "needle"),
    [("error", "column 'f1' has 5 missing value(s)"), ("drop_rows", None)],
)
def test_a_table_with_gaps_fails_before_any_prefect_work(tmp_path, monkeypatch, capsys, policy, needle):
    import flows.runs

    def no_orchestration(*args, **kwargs):
        raise AssertionError("Prefect must not start for a bad table")

    monkeypatch.setattr(flows.runs, "run_and_record", no_orchestration)
    monkeypatch.chdir(tmp_path)
    mixed_scale_table(tmp_path / "table.csv", gaps=5)
    hf = {"path": "csv", "data_files": "table.csv", "label_column": "kind"}
    make_workspace(tmp_path, fast_params(data={"source": "table", "table": hf, "missing": policy}))
    if needle is None:  # a good table gets as far as orchestration; the same table is not checked twice
        with pytest.raises(AssertionError, match="Prefect must not start"):
            main(["run", "-S", "data.categorical=onehot"])
        import mergeflow.data.check

        def checked_again(*args, **kwargs):
            raise AssertionError("checked again")

        monkeypatch.setattr(mergeflow.data.check, "check_source", checked_again)
        with pytest.raises(AssertionError, match="Prefect must not start"):
            main(["run", "-S", "data.categorical=onehot"])
        with (tmp_path / "table.csv").open("a") as handle:  # an edited table is checked again
            handle.write("1,1,1,1,1,1,north,kind_0\n")
        with pytest.raises(AssertionError, match="checked again"):
            main(["run", "-S", "data.categorical=onehot"])
        return
    assert main(["run", "-S", "data.categorical=onehot"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "data.missing" in lines[0]
    assert sorted(os.listdir(tmp_path)) == ["params.yaml", "table.csv"]
    assert main(["validate", "-S", "data.categorical=onehot"]) == 2
