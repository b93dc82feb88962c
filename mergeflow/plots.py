"""Figures of the pipeline's metrics (no pyplot global state): each ``*_figure`` function builds a
figure a test can inspect, each ``plot_*`` one writes it as a PNG.

matplotlib loads when a figure is drawn: planning a run imports this module without it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.files import atomic_path

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# The models every merge is judged against, drawn as labelled lines across the merges' bars.
REFERENCE_STYLES = {
    "base": {"color": "tab:gray", "linestyle": "--"},
    "best_client": {"color": "tab:green", "linestyle": "-."},
    "ensemble": {"color": "tab:purple", "linestyle": ":"},
    "centralized": {"color": "tab:red", "linestyle": "-"},
}
# A multi-task run's references (mergeflow.task_scores): lines across each task's group of bars.
TASK_REFERENCE_STYLES = {
    "floor": REFERENCE_STYLES["base"],
    "individual": {"color": "black", "linestyle": ":"},
    "best_single": REFERENCE_STYLES["best_client"],
    "centralized": REFERENCE_STYLES["centralized"],
}
# The bars of a multi-task plot: no colour of its reference lines.
BAR_COLOURS = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
# Per federated algorithm, so that curves which coincide (FedAvg and FedProx) stay visible.
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
ROUND_TITLES = {
    "drift": "client drift: mean ‖θ_k − θ̄‖ (log scale)",
    "train_loss": "clients' train loss (last local epoch)",
    "epsilon": "ε spent (δ fixed)",
}


def comparison_figure(metrics: dict[str, dict], *, task: str, title: str = "Test metrics by model") -> Figure:
    """Horizontal bars of each merged and federated model's headline metric (accuracy, mse or
    perplexity), NLL and, where the objective has it, ECE; base, best client, ensemble and centralized
    as labelled vertical reference lines. Each panel's axis spans the data, not zero, so close models
    differ visibly. Individual clients (``client_NNN``) are left out: ``best_client`` stands for them.
    """
    from matplotlib.figure import Figure

    from mergeflow.schema.objectives import declared_objective

    keys = [k for k in (declared_objective(task).headline, "nll", "ece") if any(k in m for m in metrics.values())]
    references = {name: metrics[name] for name in REFERENCE_STYLES if name in metrics}
    models = [name for name in metrics if any(key in metrics[name] for key in keys)]  # not the report's other entries
    compared = [name for name in models if name not in REFERENCE_STYLES and not name.startswith("client_")]
    fig = Figure(figsize=(4.5 * len(keys), 1.8 + 0.28 * max(len(compared), 4)), layout="constrained")
    axes = fig.subplots(1, len(keys), sharey=True, squeeze=False)[0]
    for ax, key in zip(axes, keys, strict=True):
        values = [float(metrics[name].get(key, math.nan)) for name in compared]
        bars = ax.barh(range(len(compared)), values, color="tab:blue", alpha=0.8)
        ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=2)
        lines = {name: float(row[key]) for name, row in references.items() if math.isfinite(row.get(key, math.nan))}
        for name, value in lines.items():
            ax.axvline(value, label=f"{name} {value:.3g}", linewidth=1.5, **REFERENCE_STYLES[name])
        ax.set_xlim(*_zoomed(values + list(lines.values())))
        ax.set_title(f"test {key} ({'higher' if key == 'accuracy' else 'lower'} is better)")
        ax.grid(axis="x", alpha=0.3)
        if lines:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=2)
    axes[0].set_yticks(range(len(compared)), compared, fontsize=8)
    axes[0].invert_yaxis()  # the first model on top, as in params
    fig.suptitle(title)
    return fig


def _zoomed(values: list[float]) -> tuple[float, float]:
    """Axis limits around the finite ``values``, with room for the bar labels on the right; not below zero
    for non-negative values. Bars from zero would flatten differences of a few percent."""
    finite = [v for v in values if math.isfinite(v)] or [0.0, 1.0]
    lo, hi = min(finite), max(finite)
    pad = (hi - lo) * 0.1 or abs(hi) * 0.05 or 0.5
    left = lo - pad
    return (max(left, 0.0) if lo >= 0 else left), hi + 1.5 * pad


def plot_comparison(
    metrics: dict[str, dict],
    path: str | Path,
    *,
    task: str,
    title: str = "Test metrics by model",
) -> None:
    """Write :func:`comparison_figure` as a PNG, atomically, so readers never see a partial one."""
    save_figure(comparison_figure(metrics, task=task, title=title), path)


def task_comparison_figure(summary: dict, *, title: str = "Test metrics by task") -> Figure:
    """A multi-task run's summary (:func:`mergeflow.task_scores.summarise`) as grouped bars: one group per
    task and one for the average over tasks, one bar per merged and federated model; a panel for the
    normalised and one for the absolute accuracy (the NLL where a task has no accuracy). The floor, the
    task's own model, the best single client and the ceiling (centralized) are labelled lines across each
    group. Each panel's axis spans the data, not zero, so close models differ visibly.
    """
    from matplotlib.figure import Figure

    compared = [name for name in summary if name.startswith(("merged/", "federated/"))]
    references = [name for name in TASK_REFERENCE_STYLES if name in summary]
    averaged = [key for key in ("normalized_accuracy", "accuracy") if f"avg_{key}" in summary["individual"]]
    keys = averaged or ["nll"]  # accuracy only where every task has it, as the summary averages it
    groups = [*summary["tasks"], "average"]
    width = 0.8 / max(len(compared), 1)

    def values(name: str, key: str) -> list[float]:
        row = summary[name]
        return [float(row["tasks"][task].get(key, math.nan)) for task in summary["tasks"]] + [
            float(row.get(f"avg_{key}", math.nan))
        ]

    size = (max(6.0, 1.0 + 0.22 * len(groups) * max(len(compared), 2)), 3.4 * len(keys))
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(len(keys), 1, squeeze=False)[:, 0]
    for ax, key in zip(axes, keys, strict=True):
        shown = []
        for i, name in enumerate(compared):
            heights = values(name, key)
            offsets = [g - 0.4 + width * (i + 0.5) for g in range(len(groups))]
            ax.bar(offsets, heights, width, color=BAR_COLOURS[i % len(BAR_COLOURS)], label=name)
            shown += heights
        for name in references:
            heights = values(name, key)
            ax.hlines(heights, [g - 0.45 for g in range(len(groups))], [g + 0.45 for g in range(len(groups))],
                      linewidth=1.5, label=name, **TASK_REFERENCE_STYLES[name])  # fmt: skip
            shown += heights
        ax.set_ylim(*_zoomed(shown))
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(f"test {key.replace('_', ' ')} ({'lower' if key == 'nll' else 'higher'} is better)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title)
    return fig


def plot_task_comparison(summary: dict, path: str | Path, *, title: str = "Test metrics by task") -> None:
    """Write :func:`task_comparison_figure` as a PNG, atomically."""
    save_figure(task_comparison_figure(summary, title=title), path)


def barrier_figure(report: dict) -> Figure:
    """Loss along the linear path from the reference to each client, without alignment and, where the
    align stage aligned (``method`` other than ``none``), after alignment and after alignment with REPAIR.

    ``report`` is the align stage's metrics: ``{"method": m, "reference": r, "before": {name: curve},
    "after": {...}, "repaired": {...}}`` (``after`` empty with method ``none``, ``repaired`` only with
    ``align.repair``), each curve holding ``ts``, ``losses`` and ``barrier``. A client keeps its colour
    in every phase; the phase is the line style.
    """
    from matplotlib.figure import Figure

    method = report["method"]
    phases = {"before": ("unaligned", "--"), "after": (f"aligned ({method})", "-"), "repaired": ("REPAIR", ":")}
    colours = {name: f"C{i}" for i, name in enumerate(report["before"])}
    fig = Figure(figsize=(7.0, 4.5))
    ax = fig.subplots()
    for phase, (label, style) in phases.items():
        for name, curve in report.get(phase, {}).items():
            ax.plot(
                curve["ts"],
                curve["losses"],
                style,
                color=colours[name],
                marker="o",
                markersize=3,
                label=f"{name} {label} (barrier {curve['barrier']:.3g})",
            )
    ax.set_xlabel(f"t (0 = reference client_{report['reference']:03d}, 1 = client)")
    ax.set_ylabel("test loss")
    aligned = "" if report.get("after") else f"\nno alignment ran (align.method: {method})"
    ax.set_title(f"Linear interpolation between models{aligned}")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    return fig


def plot_barriers(report: dict, path: str | Path) -> None:
    """Write :func:`barrier_figure` as a PNG, atomically."""
    save_figure(barrier_figure(report), path)


def rounds_figure(curves: dict[str, list[dict]]) -> Figure:
    """Per round, each federated algorithm's global model: test accuracy (or MSE, or perplexity) with
    the base model (round 0) as a reference line, test NLL, the clients' mean drift from the global
    model and their train loss, and the ε spent where DP ran.

    ``curves`` maps an algorithm to its per-round metrics, round 0 being the starting model (the base).
    """
    from matplotlib.figure import Figure

    rows = [row for rows in curves.values() for row in rows]
    primary = next((key for key in ("accuracy", "mse", "perplexity") if rows and key in rows[0]), "nll")
    keys = (primary, "nll", "drift", "train_loss") + (("epsilon",) if any("epsilon" in row for row in rows) else ())
    columns = math.ceil(len(keys) / 2)
    fig = Figure(figsize=(4.5 * columns, 7.0))
    # Fixed margins: a constrained layout or a tight bounding box would draw the figure twice, and this
    # plot ends every federated run.
    fig.subplots_adjust(left=0.2 / columns, right=0.98, top=0.95, bottom=0.13, hspace=0.35, wspace=0.25)
    axes = list(fig.subplots(2, columns).flat)
    for ax in axes[len(keys) :]:
        ax.remove()
    for ax, key in zip(axes, keys, strict=False):
        _round_curves(ax, curves, key)
    if rows:
        base = rows[0][primary]
        axes[0].axhline(base, label=f"base (round 0) {base:.3g}", **REFERENCE_STYLES["base"])
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(handles), 5), fontsize=8)
    return fig


def _round_curves(ax: Axes, curves: dict[str, list[dict]], key: str) -> None:
    """One line per algorithm of ``key`` against the round, each with its own line style and marker."""
    from matplotlib.ticker import MaxNLocator

    for i, (name, rows) in enumerate(curves.items()):
        points = [(r["round"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(
                *zip(*points, strict=True),
                color=f"C{i}",
                linestyle=LINE_STYLES[i % len(LINE_STYLES)],
                marker=MARKERS[i % len(MARKERS)],
                markersize=5,
                markerfacecolor="none",  # hollow: a marker on top leaves the one under it visible
                alpha=0.85,
                label=name,
            )
    if key == "drift":
        # Drifts differ by orders of magnitude between algorithms (IVON-ADMM's first rounds).
        ax.set_yscale("log", nonpositive="mask")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_title(ROUND_TITLES.get(key, f"test {key}"))
    ax.grid(alpha=0.3)


def plot_rounds(curves: dict[str, list[dict]], path: str | Path) -> None:
    """Write :func:`rounds_figure` as a PNG, atomically."""
    save_figure(rounds_figure(curves), path, tight=False)


def plot_selection(selection: dict[str, dict], path: str | Path) -> None:
    """Each searched merge's validation score per candidate (labelled by the searched values), the chosen
    one circled. ``selection`` maps a merge name to the ``selection`` record of its checkpoint."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.2 * len(selection)))
    axes = fig.subplots(len(selection), 1, squeeze=False)[:, 0]
    for ax, (name, record) in zip(axes, selection.items(), strict=True):
        metric = record["select_by"]
        values = [c["validation"][metric] for c in record["candidates"]]
        labels = [", ".join(f"{k}={c['options'][k]}" for k in record["searched"]) for c in record["candidates"]]
        ax.plot(range(len(values)), values, marker="o")
        ax.plot([record["chosen"]], [values[record["chosen"]]], "o", markersize=12, fillstyle="none", color="tab:red")
        ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(f"validation {metric}")
        ax.set_title(f"{name}: chosen on validation")
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 120, tight: bool = True) -> None:
    """Write a figure as PNG atomically (temp file + rename), creating the folder.

    ``tight`` crops the PNG to what is drawn (rotated tick labels, long legends).
    """
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight" if tight else None)
