"""The fisher and align stages compute only what some merge reads: the statistics among the declared inputs
of ``merge.methods``' methods (none for data-free merges), leaving DVC an empty output directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import fast_params, pipeline_params

from mergeflow.config import apply_overrides, validate_params
from mergeflow.schema.merge import DECLARED, MergeMethod
from tasks.align import plan_align
from tasks.fisher import plan_fisher
from tasks.merge_statistics import statistics_read

UP_TO_MERGE = ["prepare", "partition", "pretrain", "finetune", "fisher", "align", "merge"]


def _params(*overrides: str):
    return validate_params(apply_overrides(pipeline_params(), list(overrides)))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["merge.methods=[]"], ()),
        (["merge.methods=[average,weighted,task_arithmetic,ties,dare_linear,model_stock]"], ()),
        (["merge.methods=[average,fisher]"], ("fishers",)),
        (["merge.methods=[regmean]"], ("grams",)),
        (["merge.methods=[exact]", "fisher.low_rank=true"], ("fishers", "factors")),
        (["merge.methods=[ssf]", "fisher.low_rank=false"], ("fishers",)),
        (["merge.methods=[average,ssf_half]", "merge.options.ssf_half={method: ssf}"], ("fishers", "factors")),
        ([], ("fishers", "factors")),  # the committed params: fisher, exact and ssf with low_rank
    ],
)
def test_the_statistics_read_are_those_the_merge_methods_declare(overrides, expected):
    assert statistics_read(_params(*overrides)) == expected


def test_a_newly_declared_method_brings_its_statistics_without_a_list_of_names(monkeypatch):
    declared = MergeMethod("gram_user", "gram_user_module:merge", needs={"grams"}, uses={"base"})
    monkeypatch.setitem(DECLARED, "gram_user", declared)
    assert statistics_read(_params("merge.methods=[gram_user]")) == ("grams",)


def test_no_fisher_step_and_no_statistic_among_align_inputs_when_no_merge_reads_one():
    params = _params("merge.methods=[average,task_arithmetic]")
    assert plan_fisher(params) == []
    [align] = plan_align(params)
    assert not any(path.startswith("models/fishers/") for path in align.inputs)
    assert align.params["statistics"] == [] and align.params["checkpoints"] is True
    assert plan_align(_params("merge.methods=[]"))[0].params["checkpoints"] is False

    [align] = plan_align(_params("merge.methods=[regmean]"))
    read = {path for path in align.inputs if path.startswith("models/fishers/")}
    assert read == {f"models/fishers/client_{c:03d}.grams.safetensors" for c in range(5)}
    steps = plan_fisher(_params("merge.methods=[regmean]"))
    assert [step.params["statistics"] for step in steps] == [["grams"]] * 5


def _files(root: Path, folder: str) -> set[str]:
    return {path.name for path in (root / folder).iterdir()}


@pytest.mark.slow
def test_a_data_free_merge_computes_no_fisher_and_a_fisher_merge_does(tmp_path, prefect_settings, monkeypatch):
    import tasks.fisher
    from flows.runs import run_and_record

    def no_fisher(*args, **kwargs):
        raise AssertionError("a Fisher was computed that no merge reads")

    monkeypatch.setattr(tasks.fisher, "client_fisher", no_fisher)
    average = fast_params(merge={"methods": ["average"], "options": {}})
    outcomes, _ = run_and_record(validate_params(average), tmp_path, UP_TO_MERGE)
    assert not [o["name"] for o in outcomes if o["name"].startswith("fisher/")]
    assert not list((tmp_path / ".mergeflow/results").glob("fisher-*"))
    assert (tmp_path / "models/fishers").is_dir() and not _files(tmp_path, "models/fishers")  # DVC's output
    clients = {f"client_{c:03d}.safetensors" for c in range(3)}
    assert _files(tmp_path, "models/aligned") == clients  # the checkpoints only: no Fisher or Gram copies
    assert (tmp_path / "models/merged/average.safetensors").is_file()

    monkeypatch.undo()
    with_fisher = fast_params(merge={"methods": ["average", "fisher"], "options": {}})
    outcomes, _ = run_and_record(validate_params(with_fisher), tmp_path, UP_TO_MERGE)
    ran = {o["name"] for o in outcomes if not o["cached"]}
    assert {f"fisher/client_{c:03d}" for c in range(3)} <= ran and "merge/average" not in ran
    assert _files(tmp_path, "models/fishers") == clients  # the diagonals only: the fisher merge reads no Gram
    aligned = {f"client_{c:03d}.fisher.safetensors" for c in range(3)}
    assert _files(tmp_path, "models/aligned") == clients | aligned
    summary = json.loads((tmp_path / ".mergeflow/last_run.json").read_text())["steps"]
    assert {step["name"] for step in summary if step["name"].startswith("fisher/")} == {
        f"fisher/client_{c:03d}" for c in range(3)
    }

    run_and_record(validate_params(average), tmp_path, UP_TO_MERGE)  # all cached: the Fishers are pruned again
    assert not _files(tmp_path, "models/fishers") and _files(tmp_path, "models/aligned") == clients
