"""Merge options given as lists are searched on the validation split: each candidate is a cached step,
the best validation score is kept, test data is never read for it, and every number says its split."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fast_params, make_workspace, ran_steps, run_cli

from mergeflow.checkpoints import load_checkpoint, save_checkpoint
from mergeflow.config import load_params
from mergeflow.errors import ConfigError
from mergeflow.schema.search import candidate_id, choose, search_grid
from tasks import merging, scoring
from tasks.layout import PREPARED, candidate_checkpoint, merged_checkpoint

SCALINGS = [0.1, 0.3, 0.6, 1.0]


def test_a_grid_of_lists_and_the_best_validation_score():
    grid = search_grid({"density": [0.2, 0.5], "scaling": [1.0, 0.5], "seed": 3})
    assert grid == [
        {"density": 0.2, "scaling": 1.0, "seed": 3},
        {"density": 0.2, "scaling": 0.5, "seed": 3},
        {"density": 0.5, "scaling": 1.0, "seed": 3},
        {"density": 0.5, "scaling": 0.5, "seed": 3},
    ]
    assert search_grid({"scaling": 0.3}) == [{"scaling": 0.3}]
    with pytest.raises(ConfigError, match="merge.options.ties.density: an empty search list"):
        search_grid({"density": []}, prefix="merge.options.ties.")
    scores = [{"accuracy": 0.8, "nll": 0.5}, {"accuracy": 0.9, "nll": 0.7}, {"accuracy": 0.9, "nll": 0.4}]
    assert choose(scores, "accuracy") == 1  # ties go to the first
    assert choose(scores, "nll") == 2


@pytest.fixture(scope="module")
def searched(tmp_path_factory, cli_env):
    """A fast pipeline with a validation split and two searched merges."""
    options = {"task_arithmetic": {"scaling": SCALINGS}, "ties": {"density": [0.2, 0.6], "scaling": 0.5}}
    merge = {"methods": ["average", "task_arithmetic", "ties", "greedy_soup"], "options": options}
    params = fast_params(data={"validation_fraction": 0.15}, merge=merge)
    params["federated"].update(algorithms=["fedavg"])
    path = make_workspace(tmp_path_factory.mktemp("search") / "run", params)
    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return path


@pytest.mark.slow
def test_each_candidate_is_scored_on_validation_and_the_best_is_kept(searched):
    selection = json.loads((searched / "metrics/selection.json").read_text())
    assert set(selection) == {"task_arithmetic", "ties"}
    record = selection["task_arithmetic"]
    assert record["split"] == "validation" and record["select_by"] == "accuracy"
    assert [c["options"]["scaling"] for c in record["candidates"]] == SCALINGS
    accuracies = [c["validation"]["accuracy"] for c in record["candidates"]]
    assert record["chosen"] == accuracies.index(max(accuracies))
    chosen = load_checkpoint(searched / "models/merged/task_arithmetic.safetensors")
    best_options = record["candidates"][record["chosen"]]["options"]
    candidate = load_checkpoint(searched / candidate_checkpoint("task_arithmetic", candidate_id(best_options)))
    assert chosen[1]["options"]["scaling"] == SCALINGS[record["chosen"]]
    for key, tensor in chosen[0].items():
        assert torch.equal(tensor, candidate[0][key])
    metrics = json.loads((searched / "metrics/evaluate.json").read_text())
    assert metrics["splits"] == {"models": "test", "sanity": "test", "selection": "validation"}
    assert (searched / "plots/selection.png").read_bytes()[:4] == b"\x89PNG"
    soup = load_checkpoint(searched / "models/merged/greedy_soup.safetensors")[1]
    assert 1 <= soup["summary"]["soup_size"] <= 3 and len(soup["curves"]["soup_score_tried"]) == 3


@pytest.mark.slow
def test_mlflow_shows_the_validation_curve_and_the_choice(searched):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{searched / 'mlflow.db'}")
    found = "tags.`mergeflow.merge` = 'task_arithmetic'"
    runs = mlflow.search_runs(experiment_names=["mergeflow"], filter_string=found)
    run = mlflow.get_run(runs.run_id.iloc[0])
    assert run.data.tags["mergeflow.selected_on"] == "validation"
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "val_accuracy")
    assert [m.step for m in history] == list(range(len(SCALINGS)))
    assert float(run.data.params["selected.scaling"]) == float(run.data.params["option.scaling"])


@pytest.mark.slow
def test_adding_a_value_runs_only_that_candidate(searched, cli_env):
    done = run_cli(["run", "-S", f"merge.options.task_arithmetic.scaling={[*SCALINGS, 0.45]}"], searched, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    merges = {name for name in ran_steps(searched) if name.startswith("merge/")}
    new = candidate_id({"scaling": 0.45})
    assert merges == {f"merge/task_arithmetic/{new}", "merge/task_arithmetic"}


@pytest.mark.slow
def test_selection_never_reads_test_data_and_keeps_the_planted_best(searched, tmp_path, monkeypatch):
    read = []
    real = scoring.read_arrays

    def spy(path, info):
        read.append(path.name)
        return real(path, info)

    monkeypatch.setattr(scoring, "read_arrays", spy)
    params = load_params(searched / "params.yaml", [])
    merges, selections = merging.plan_merge(params)
    candidates = [step for step in merges if step.name.startswith("merge/task_arithmetic/")]
    (soup,) = [step for step in merges if step.name == "merge/greedy_soup"]
    assert f"{PREPARED}/validation.parquet" in soup.inputs
    for step in (*candidates, *selections, soup):
        assert not any("test" in path for path in step.inputs), step.name
    for step in candidates:
        merging.merge_candidate(step.params, searched, tmp_path, {})
    merging.merge_clients(soup.params, searched, tmp_path, {})
    assert read and set(read) == {"validation.parquet"}

    planted = {0.1: 0.5, 0.3: 0.9, 0.6: 0.7, 1.0: 0.2}  # the best is inside the grid, not at an edge
    for step in candidates:
        state, meta = load_checkpoint(tmp_path / step.params["path"])
        meta["validation"] = {"accuracy": planted[meta["options"]["scaling"]], "nll": 1.0, "ece": 0.1}
        save_checkpoint(tmp_path / step.params["path"], state, meta)
    (select,) = [s for s in selections if s.name == "merge/task_arithmetic"]
    out = tmp_path / "out"
    summary = merging.select_candidate(select.params, tmp_path, out, {})
    assert summary["chosen"] == {"scaling": 0.3}
    assert load_checkpoint(out / merged_checkpoint("task_arithmetic"))[1]["selection"]["chosen"] == 1


@pytest.mark.slow
def test_merges_above_the_size_threshold_stream_to_the_same_checkpoints_under_the_same_keys(
    searched, tmp_path, monkeypatch
):
    from tasks.steps import resolve, step_key

    streamed = []
    real = merging.merge_files
    monkeypatch.setattr(
        merging, "merge_files", lambda method, *a, **k: (streamed.append(method), real(method, *a, **k))
    )
    default = merging.plan_merge(load_params(searched / "params.yaml", []))[0]
    merges = merging.plan_merge(load_params(searched / "params.yaml", ["merge.stream_above_mb=0"]))[0]
    assert [step_key(s, searched) for s in merges] == [step_key(s, searched) for s in default]  # a setting, no key
    for step in merges:
        assert step.settings["stream_above_mb"] == 0
        resolve(step.fn)(step.params, searched, tmp_path, step.settings)
    assert sorted(set(streamed)) == ["average", "task_arithmetic", "ties"]  # greedy_soup is model-scope: in memory
    assert streamed.count("task_arithmetic") == len(SCALINGS)
    for step in merges:
        path = step.params.get("path") or merged_checkpoint(step.params["name"])
        (expected, expected_meta), (got, meta) = load_checkpoint(searched / path), load_checkpoint(tmp_path / path)
        assert meta == expected_meta and got.keys() == expected.keys(), step.name
        assert all(torch.equal(got[key], expected[key]) for key in expected), step.name


def test_a_search_needs_a_validation_split(tmp_path, capsys, monkeypatch):
    from flows.cli import main

    monkeypatch.chdir(tmp_path)
    make_workspace(tmp_path, fast_params(merge={"methods": ["ties"], "options": {"ties": {"density": [0.1, 0.5]}}}))
    assert main(["run"]) == 2
    line = capsys.readouterr().err.strip()
    assert "merge.options.ties.density" in line and "data.validation_fraction" in line


@pytest.mark.slow
def test_the_merges_reproduction_tables_every_method_and_the_choices(tmp_path, cli_env):
    import yaml

    params = fast_params(
        data={"validation_fraction": 0.15},
        merge={"methods": ["average", "task_arithmetic"], "options": {"task_arithmetic": {"scaling": [0.2, 0.6]}}},
    )
    params["federated"].update(algorithms=[])
    preset = tmp_path / "tiny.yaml"
    preset.write_text(yaml.safe_dump({"sweep": {"seed": [0]}, "params": params}))
    done = run_cli(["reproduce", "merges", "--preset", str(preset)], tmp_path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "results/tiny.md").read_text()
    header = "| average | task_arithmetic | best_client | ensemble | centralized |"
    assert header in table and "chosen on validation" in table
    runs = json.loads((tmp_path / "results/tiny.json").read_text())["runs"]
    record = runs[0]["selection"]["task_arithmetic"]
    chosen = record["candidates"][record["chosen"]]["options"]["scaling"]
    assert f"| task_arithmetic | scaling={chosen} |" in table
