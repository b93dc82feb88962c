"""Comparison bar charts of per-model test metrics (no pyplot global state).

matplotlib loads when a figure is drawn: planning a run imports this module without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.files import atomic_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_comparison(
    metrics: dict[str, dict],
    path: str | Path,
    *,
    task: str,
    title: str = "Test metrics by model",
) -> None:
    """Write a PNG with two bar-chart panels: accuracy (classification), mse (regression) or
    perplexity (causal LM) on the left, NLL on the right, one bar per model name.

    The file is written atomically, so readers never see a partial PNG.
    """
    from mergeflow.schema.objectives import declared_objective

    primary = declared_objective(task).headline
    names = list(metrics)
    positions = range(len(names))
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(10.0, 0.9 * len(names)), 5.0))
    axes = fig.subplots(1, 2)
    for ax, key in zip(axes, (primary, "nll"), strict=True):
        values = [float(metrics[name][key]) for name in names]
        ax.bar(positions, values, color="tab:blue" if key == primary else "tab:orange")
        ax.set_title(key)
        ax.set_xticks(list(positions), names, rotation=45, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        for x, value in zip(positions, values, strict=True):
            ax.annotate(f"{value:.3g}", (x, value), ha="center", va="bottom", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()

    save_figure(fig, path)


def plot_barriers(report: dict, path: str | Path) -> None:
    """Loss along the linear path from the reference to each client, before and after alignment, and after
    alignment with REPAIR.

    ``report`` is the align stage's metrics: ``{"reference": r, "before": {name: curve}, "after": {...},
    "repaired": {...}}`` (``repaired`` only with ``align.repair``), each curve holding ``ts``, ``losses``
    and ``barrier``.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5))
    ax = fig.subplots()
    for phase, style in (("before", "--"), ("after", "-"), ("repaired", ":")):
        for name, curve in report.get(phase, {}).items():
            label = f"{name} {phase} (barrier {curve['barrier']:.3g})"
            ax.plot(curve["ts"], curve["losses"], style, marker="o", markersize=3, label=label)
    ax.set_xlabel(f"t (0 = reference client_{report['reference']:03d}, 1 = client)")
    ax.set_ylabel("test loss")
    ax.set_title("Linear interpolation between models")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_rounds(curves: dict[str, list[dict]], path: str | Path) -> None:
    """Test accuracy (or MSE, or perplexity) and NLL of each federated algorithm's global model against the round.

    ``curves`` maps an algorithm to its per-round metrics, round 0 being the starting model.
    """
    from matplotlib.figure import Figure

    rows = [row for rows in curves.values() for row in rows]
    primary = next((key for key in ("accuracy", "mse", "perplexity") if rows and key in rows[0]), "nll")
    # A DP run's spent ε per round gets a third panel.
    keys = (primary, "nll", "epsilon") if any("epsilon" in row for row in rows) else (primary, "nll")
    fig = Figure(figsize=(5.0 * len(keys), 4.0))
    axes = fig.subplots(1, len(keys))
    for ax, key in zip(axes, keys, strict=True):
        for name, rows in curves.items():
            points = [(r["round"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=name)
        ax.set_xlabel("round")
        ax.set_title("ε spent (δ fixed)" if key == "epsilon" else f"test {key}")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    # Two plain panels fit the default margins; a tight bounding box would draw the figure twice.
    save_figure(fig, path, tight=False)


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
