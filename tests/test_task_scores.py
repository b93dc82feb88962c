"""Multi-task scores as papers report them (mergeflow.task_scores): normalised accuracy, averages over tasks,
the references, the validation selection score; the multi-task plot and DVC headline files."""

from __future__ import annotations

import json
import math

import pytest

from mergeflow.task_scores import headline, is_summary, models, normalised_validation_score, summarise

TASKS = ("low", "high", "parity")
OBJECTIVES = dict.fromkeys(TASKS, "classification")


def _scores(accuracy: float) -> dict[str, float]:
    return {"accuracy": accuracy, "nll": 1.0 - accuracy / 2, "ece": 0.05}


def _per_task(centralized: bool = True, singles: bool = False) -> dict[str, dict[str, dict]]:
    """Each task's evaluate.json: one client per task (global ids 0, 1, 2), its references and two merges."""
    per_task = {}
    for i, task in enumerate(TASKS):
        models = {
            "base": _scores(0.2),
            "floor": _scores(0.5 + 0.05 * i),
            f"client_{i:03d}": _scores(0.9 - 0.1 * i),
            "individual": _scores(0.9 - 0.1 * i),
            "merged/average": _scores(0.6 + 0.05 * i),
            "merged/ties": _scores(0.75 - 0.02 * i),
            "federated/fedavg": _scores(0.7),
        }
        if centralized:
            models["centralized"] = _scores(0.95 - 0.1 * i)
        if singles:
            models |= {f"single/client_{c:03d}": _scores(0.9 - 0.1 * i if c == i else 0.3 + 0.1 * c) for c in range(3)}
        per_task[task] = models | {"sanity": {"warning": "at baseline" if task == "parity" else None}, "splits": {}}
    return per_task


def test_normalised_accuracy_is_the_ratio_of_the_reported_accuracies_and_the_averages_their_means():
    per_task = _per_task()
    summary = summarise(per_task, OBJECTIVES)

    for name in ("base", "floor", "individual", "centralized", "merged/average", "merged/ties", "federated/fedavg"):
        row = summary[name]
        for task in TASKS:
            scored = row["tasks"][task]
            assert scored["accuracy"] == per_task[task][name]["accuracy"]  # the absolute number, as scored
            assert scored["normalized_accuracy"] == scored["accuracy"] / per_task[task]["individual"]["accuracy"]
        for key in ("accuracy", "normalized_accuracy", "nll"):
            assert row[f"avg_{key}"] == pytest.approx(sum(row["tasks"][t][key] for t in TASKS) / len(TASKS))
    assert summary["individual"]["avg_normalized_accuracy"] == pytest.approx(1.0)
    assert headline(summary) == "avg_normalized_accuracy"


def test_the_summary_names_its_tasks_clients_splits_and_warnings():
    summary = summarise(_per_task(), OBJECTIVES)

    assert is_summary(summary) and is_summary(summary["merged/ties"]) and not is_summary(_scores(0.5))
    assert summary["tasks"]["high"] == {"objective": "classification", "headline": "accuracy", "clients": [1]}
    assert summary["splits"] == {"models": "test", "sanity": "test", "selection": "validation"}
    assert summary["sanity"]["warning"] == "parity: at baseline"
    # a client is scored on its own task only; rows of every task are those scored on every task
    assert list(summary["client_001"]["tasks"]) == ["high"]
    assert summary["client_001"]["avg_accuracy"] == summary["client_001"]["tasks"]["high"]["accuracy"]
    assert set(models(summary)) == {
        *("base", "floor", "individual", "centralized", "merged/average", "merged/ties", "federated/fedavg"),
        *("client_000", "client_001", "client_002"),
    }


def test_a_run_without_a_ceiling_has_no_centralized_row():
    summary = summarise(_per_task(centralized=False), OBJECTIVES)
    assert "centralized" not in summary and "avg_normalized_accuracy" in summary["merged/ties"]


def test_the_best_single_client_is_the_best_on_average_over_every_task():
    summary = summarise(_per_task(singles=True), OBJECTIVES)
    best = max((f"single/client_{c:03d}" for c in range(3)), key=lambda name: summary[name]["avg_normalized_accuracy"])
    assert summary["best_single"] == {**summary[best], "client": int(best.removeprefix("single/client_"))}
    assert "best_single" not in summarise(_per_task(), OBJECTIVES)  # only when clients are scored on every task


def test_tasks_scored_by_nll_have_no_normalised_accuracy_and_rank_by_the_average_nll():
    from mergeflow.plots import task_comparison_figure

    per_task = {
        task: {
            name: {"nll": nll, "perplexity": math.exp(nll)} for name, nll in (("individual", 2.0), ("merged/a", 2.5))
        }
        for task in ("news", "code")
    }
    summary = summarise(per_task, dict.fromkeys(per_task, "causal_lm"))
    assert summary["merged/a"] == {
        "tasks": {task: {"nll": 2.5, "perplexity": math.exp(2.5)} for task in per_task},
        "avg_nll": 2.5,
    }
    assert headline(summary) == "avg_nll"
    assert [ax.get_title() for ax in task_comparison_figure(summary).axes] == ["test nll (lower is better)"]


def test_a_task_without_its_individual_model_is_refused():
    per_task = _per_task()
    del per_task["high"]["individual"]
    with pytest.raises(ValueError, match="task 'high': no 'individual' model"):
        summarise(per_task, OBJECTIVES)


def test_the_selection_score_is_the_mean_normalised_validation_score():
    validation = {"low": {"accuracy": 0.6}, "high": {"accuracy": 0.8}, "news": {"nll": 3.0}}
    individual = {"low": {"accuracy": 0.8}, "high": {"accuracy": 0.8}, "news": {"nll": 2.0}}
    assert normalised_validation_score(validation, individual) == pytest.approx((0.75 + 1.0 + 2.0 / 3.0) / 3)
    with pytest.raises(ValueError, match="news"):
        normalised_validation_score({"low": validation["low"]}, {"low": individual["low"], "news": {"nll": 1.0}})


def test_the_selection_score_reads_only_the_validation_numbers_it_is_given():
    """The search's score comes from validation scores; the test summary of the same models differs."""
    per_task = _per_task()
    summary = summarise(per_task, OBJECTIVES)
    validation = {task: _scores(0.5) for task in TASKS}
    individual = {task: _scores(0.5) for task in TASKS}
    assert normalised_validation_score(validation, individual) == 1.0
    assert summary["merged/average"]["avg_normalized_accuracy"] != 1.0


def test_the_comparison_plot_has_a_group_per_task_and_the_average_with_floor_and_ceiling_lines(tmp_path):
    from mergeflow.plots import plot_task_comparison, task_comparison_figure

    summary = summarise(_per_task(singles=True), OBJECTIVES)
    fig = task_comparison_figure(summary)

    assert [ax.get_title().split(" (")[0] for ax in fig.axes] == ["test normalized accuracy", "test accuracy"]
    compared = ["merged/average", "merged/ties", "federated/fedavg"]
    for ax, key in zip(fig.axes, ("normalized_accuracy", "accuracy"), strict=True):
        assert [t.get_text() for t in ax.get_xticklabels()] == [*TASKS, "average"]
        assert [c.get_label() for c in ax.containers] == compared
        heights = [bar.get_height() for bar in ax.containers[1]]  # merged/ties, per task then its average
        row = summary["merged/ties"]
        assert heights == [row["tasks"][t][key] for t in TASKS] + [row[f"avg_{key}"]]
        lines = {c.get_label(): c for c in ax.collections}
        assert list(lines) == ["floor", "individual", "best_single", "centralized"]
        floor = [segment[0][1] for segment in lines["floor"].get_segments()]
        assert floor == [summary["floor"]["tasks"][t][key] for t in TASKS] + [summary["floor"][f"avg_{key}"]]

    plot_task_comparison(summary, tmp_path / "plots" / "comparison.png")
    assert (tmp_path / "plots" / "comparison.png").read_bytes().startswith(b"\x89PNG")


def test_the_reports_carry_the_summary_and_the_headline_files_the_averages(tmp_path):
    from tasks.evaluation import report_tasks, task_headline_metrics
    from tasks.layout import HEADLINE, METRICS, PLOT

    summary = report_tasks(_per_task(), OBJECTIVES, tmp_path)

    assert json.loads((tmp_path / METRICS).read_text()) == summary
    assert (tmp_path / PLOT).is_file()
    written = {kind: json.loads((tmp_path / HEADLINE.format(kind=kind)).read_text()) for kind in ("merged", "models")}
    assert written == {kind: rows for kind, rows in task_headline_metrics(summary).items() if kind in written}
    averages = ("avg_accuracy", "avg_normalized_accuracy", "avg_nll")
    assert written["merged"]["ties"] == {key: summary["merged/ties"][key] for key in averages}
    assert set(written["models"]) == {
        "base",
        "floor",
        "individual",
        "centralized",
        *(f"client_{c:03d}" for c in range(3)),
    }
    federated = json.loads((tmp_path / HEADLINE.format(kind="federated")).read_text())
    assert federated == {"fedavg": {key: summary["federated/fedavg"][key] for key in averages}}
