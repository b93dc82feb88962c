"""What the comparison, barrier and round figures show, read from the figures' axes (no pixels)."""

from __future__ import annotations

import pytest

from mergeflow.plots import barrier_figure, comparison_figure, rounds_figure

REFERENCES = ["base", "best_client", "ensemble", "centralized"]


def _metrics(keys: tuple[str, ...], merges: int = 25) -> dict[str, dict]:
    """Evaluate-style metrics: references, two clients, ``merges`` merges and two federated models."""
    models = [*REFERENCES, "client_000", "client_001"]
    models += [f"merged/m{i:02d}" for i in range(merges)] + ["federated/fedavg", "federated/fedprox"]
    return {name: {key: 0.79 + 0.18 * i / len(models) for key in keys} for i, name in enumerate(models)}


def _line_labels(ax) -> list[str]:
    return [line.get_label().split()[0] for line in ax.lines]


@pytest.mark.parametrize(
    "task,keys",
    [
        ("classification", ("accuracy", "nll", "ece")),
        ("regression", ("mse", "nll")),
        ("causal_lm", ("perplexity", "nll")),
    ],
)
def test_comparison_has_a_panel_per_metric_with_the_merges_and_reference_lines(task: str, keys: tuple) -> None:
    metrics = _metrics(keys)
    fig = comparison_figure(metrics, task=task)

    assert [ax.get_title().split()[1] for ax in fig.axes] == list(keys)
    compared = [name for name in metrics if name.startswith(("merged/", "federated/"))]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == compared  # no client_NNN, no reference bar
    for ax, key in zip(fig.axes, keys, strict=True):
        assert _line_labels(ax) == REFERENCES
        assert [line.get_xdata()[0] for line in ax.lines] == [metrics[name][key] for name in REFERENCES]
        assert len(ax.patches) == len(compared)


def test_comparison_zooms_each_axis_to_the_data() -> None:
    fig = comparison_figure(_metrics(("accuracy", "nll", "ece")), task="classification")
    for ax in fig.axes:
        left, right = ax.get_xlim()
        assert 0.7 < left < 0.79 and 0.97 < right < 1.1  # values span 0.79 to 0.97


def test_comparison_draws_only_the_references_it_has() -> None:
    metrics = {k: v for k, v in _metrics(("perplexity", "nll"), merges=2).items() if k != "ensemble"}
    fig = comparison_figure(metrics, task="causal_lm")
    assert _line_labels(fig.axes[0]) == ["base", "best_client", "centralized"]


def _curve(losses: list[float]) -> dict:
    return {"ts": [0.0, 0.5, 1.0], "losses": losses, "barrier": max(losses) - losses[0]}


def test_barriers_without_alignment_say_so_and_draw_no_after_curve() -> None:
    report = {"method": "none", "reference": 2, "before": {"client_000": _curve([1, 2, 1])}, "after": {}}
    ax = barrier_figure(report).axes[0]
    assert "no alignment ran (align.method: none)" in ax.get_title()
    assert [line.get_label() for line in ax.lines] == ["client_000 unaligned (barrier 1)"]


def test_barriers_keep_a_colour_per_client_and_a_style_per_phase() -> None:
    curves = {"client_000": _curve([1, 2, 1]), "client_001": _curve([1, 3, 1])}
    report = {"method": "weights", "reference": 2, "before": curves, "after": curves, "repaired": curves}
    ax = barrier_figure(report).axes[0]
    assert "no alignment" not in ax.get_title()
    styles = {(line.get_label().split()[0], line.get_color(), line.get_linestyle()) for line in ax.lines}
    assert {(name, colour) for name, colour, _ in styles} == {("client_000", "C0"), ("client_001", "C1")}
    assert {style for _, _, style in styles} == {"--", "-", ":"}
    assert [line.get_label().split()[1] for line in ax.lines[::2]] == ["unaligned", "aligned", "REPAIR"]


def _rounds(start: float, step: float, dp: bool = False) -> list[dict]:
    rows = [{"round": 0, "accuracy": start, "nll": 1.0}]
    for r in (1, 2, 3):
        row = {"round": r, "accuracy": start + step * r, "nll": 1.0 - step, "drift": 0.5, "train_loss": 0.3}
        rows.append(row | ({"epsilon": 0.5 * r} if dp else {}))
    return rows


@pytest.mark.parametrize("dp", [False, True])
def test_rounds_show_metric_drift_and_train_loss_with_the_base_line(dp: bool) -> None:
    fig = rounds_figure({"fedavg": _rounds(0.9, 0.01, dp), "fedprox": _rounds(0.9, 0.01, dp)})

    titles = [ax.get_title() for ax in fig.axes]
    expected = ["test accuracy", "test nll", "client drift", "clients' train loss"] + ["ε spent"] * dp
    assert len(titles) == len(expected) and all(t.startswith(e) for t, e in zip(titles, expected, strict=True))
    base = fig.axes[0].lines[-1]
    assert base.get_label() == "base (round 0) 0.9" and list(base.get_ydata()) == [0.9, 0.9]
    for ax in fig.axes[2:4]:  # drift and train loss start at round 1
        assert [list(line.get_xdata()) for line in ax.lines] == [[1, 2, 3]] * 2
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["fedavg", "fedprox", "base (round 0) 0.9"]


def test_rounds_keep_coinciding_algorithms_apart() -> None:
    fig = rounds_figure({name: _rounds(0.9, 0.01) for name in ("fedavg", "fedprox", "fedadmm")})
    for ax in fig.axes:
        algorithms = [line for line in ax.lines if line.get_label() in ("fedavg", "fedprox", "fedadmm")]
        assert (
            len({line.get_linestyle() for line in algorithms}) == len({line.get_marker() for line in algorithms}) == 3
        )
        assert all(line.get_markerfacecolor() == "none" for line in algorithms)
