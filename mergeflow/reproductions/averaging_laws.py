"""The parameter-averaging-laws analysis: accuracy gain of FedAvg over centralized training against
each model's representation power (compute budget 6·N·tokens), from per-run results.

A run is one pipeline run of one model, one seed and one setting (partition and participation),
summarised as a :class:`RunResult`. Everything here is plain Python over those results; the runs
themselves are made by ``flows.reproduce.averaging_laws``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergeflow.plots import save_figure
from mergeflow.reproductions.tables import markdown_table, mean_std, mean_std_cell

# The settings the analysis reads, by their names in the preset (any may be left out but the reference):
# the centralized reference, the IID − non-IID gap, partial participation, seen/unseen domains.
REFERENCE, NON_IID = "iid", "non-iid"
PARTIAL = ("iid-partial", "non-iid-partial")
SEEN_UNSEEN = "seen-unseen"

# State-dict keys that are not counted in N (as in Kaplan et al.: embeddings; and the task's head).
_NOT_COUNTED = ("embeddings.", "classifier.", "score.")


def non_embedding_parameters(state: Mapping[str, torch.Tensor]) -> int:
    """N: the parameters of a transformer's state dict outside its embeddings and classification head."""
    return sum(t.numel() for key, t in state.items() if not any(part in key for part in _NOT_COUNTED))


@dataclass(frozen=True)
class RunResult:
    """One run's test accuracies: FedAvg's global model at the final round, the centralized model
    (at its best epoch on validation; None when the run trained none, ``centralized.enabled: false``), and both
    per domain; and which domains ever took part."""

    model: str
    setting: str
    seed: int
    federated: float
    centralized: float | None
    federated_by_domain: dict[str, float] = field(default_factory=dict)
    centralized_by_domain: dict[str, float] = field(default_factory=dict)
    seen_domains: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelFacts:
    """A model's size and pre-training: N, the tokens it was pre-trained on and where that count comes from
    (counted for a model the pipeline pre-trains, declared for a published one), and its vocabulary."""

    name: str
    parameters: int
    tokens: float
    tokens_source: str
    vocabulary: int

    @property
    def compute(self) -> float:
        """The compute budget 6·N·tokens (FLOPs)."""
        return 6.0 * self.parameters * self.tokens


def gains(runs: Sequence[RunResult], reference_setting: str) -> dict[tuple[str, str, int], float]:
    """Accuracy gain per (model, setting, seed): FedAvg's final-round accuracy minus the centralized
    accuracy of the same model and seed in ``reference_setting`` (one centralized model per model and
    seed, whatever the partition)."""
    central = {(r.model, r.seed): r.centralized for r in runs if r.setting == reference_setting}
    return {(r.model, r.setting, r.seed): r.federated - central[(r.model, r.seed)] for r in runs}


def seen_unseen(runs: Sequence[RunResult], setting: str, reference: str) -> dict[str, dict[str, list[float]]]:
    """Per model, the mean test accuracy over the seen and over the unseen domains of each seed of ``setting``:
    ``federated_seen``, ``federated_unseen``, ``centralized_seen``, ``centralized_unseen``. The centralized
    model is the ``reference`` run's, the one the gains are measured against. A seed in which every domain
    took part gives no unseen value."""
    central = {(r.model, r.seed): r.centralized_by_domain for r in runs if r.setting == reference}
    out: dict[str, dict[str, list[float]]] = {}
    for run in (r for r in runs if r.setting == setting):
        cells = out.setdefault(run.model, {})
        domains = sorted(run.federated_by_domain)
        seen = [d for d in domains if d in run.seen_domains]
        unseen = [d for d in domains if d not in run.seen_domains]
        for model, by_domain in (
            ("federated", run.federated_by_domain),
            ("centralized", central[(run.model, run.seed)]),
        ):
            for kind, chosen in (("seen", seen), ("unseen", unseen)):
                if chosen:
                    cells.setdefault(f"{model}_{kind}", []).append(statistics.mean(by_domain[d] for d in chosen))
    return out


def per_domain(runs: Sequence[RunResult], setting: str, reference: str) -> list[list[str]]:
    """Rows ``model, domain, seeds it took part in, FedAvg − centralized when seen, when unseen`` (test
    accuracy points, mean over those seeds) for ``setting``, against the ``reference`` run's centralized model."""
    central = {(r.model, r.seed): r.centralized_by_domain for r in runs if r.setting == reference}
    cells: dict[tuple[str, str], dict[bool, list[float]]] = {}
    for run in (r for r in runs if r.setting == setting):
        for domain, accuracy in sorted(run.federated_by_domain.items()):
            difference = 100 * (accuracy - central[(run.model, run.seed)][domain])
            cells.setdefault((run.model, domain), {True: [], False: []})[domain in run.seen_domains].append(difference)
    return [
        [model, domain, f"{len(by[True])} of {len(by[True]) + len(by[False])}",
         *(f"{statistics.mean(by[seen]):+.1f}" if by[seen] else "" for seen in (True, False))]
        for (model, domain), by in cells.items()
    ]  # fmt: skip


def correlations(
    facts: Mapping[str, ModelFacts], gain: Mapping[tuple[str, str, int], float], setting: str, models: Sequence[str]
) -> dict[str, list[float]]:
    """Per seed, the Pearson correlation of log10 compute with the gain and the Spearman rank correlation,
    over ``models`` in ``setting`` (those with a compute budget); seeds missing a model are left out."""
    from scipy.stats import pearsonr, spearmanr

    seeds = sorted({seed for (_, s, seed) in gain if s == setting})
    models = [m for m in models if facts[m].compute > 0]
    out: dict[str, list[float]] = {"pearson": [], "spearman": []}
    for seed in seeds:
        if any((m, setting, seed) not in gain for m in models) or len(models) < 3:
            continue
        x = [math.log10(facts[m].compute) for m in models]
        y = [gain[(m, setting, seed)] for m in models]
        out["pearson"].append(float(pearsonr(x, y).statistic))
        out["spearman"].append(float(spearmanr(x, y).statistic))
    return out


def plot_laws(
    facts: Mapping[str, ModelFacts],
    gain: Mapping[tuple[str, str, int], float],
    series: Sequence[str],
    gap: tuple[str, str] | None,
    path: str | Path,
) -> None:
    """The gain against the compute budget for each setting in ``series`` (the paper's Figure 1) and, given
    ``gap``, the gap between its two settings (IID − non-IID, its Figure 5), in accuracy points, mean ± std
    over seeds. Models without a compute budget are left out. Written atomically."""
    from matplotlib.figure import Figure

    models = sorted((m for m in facts if facts[m].compute > 0), key=lambda m: facts[m].compute)
    fig = Figure(figsize=(12.0 if gap else 6.5, 4.8))
    axes = fig.subplots(1, 2 if gap else 1, squeeze=False)[0]
    for setting in series:
        points = [(m, values) for m in models if (values := _by_seed(gain, m, setting))]
        _errorbar(axes[0], facts, [(m, [100 * v for v in values.values()]) for m, values in points], label=setting)
    axes[0].legend()
    panels = [(axes[0], "Accuracy gain of FedAvg over centralized (test)", "gain (accuracy points)")]
    if gap:
        differences = []
        for m in models:
            first, second = _by_seed(gain, m, gap[0]), _by_seed(gain, m, gap[1])
            common = sorted(set(first) & set(second))
            if common:
                differences.append((m, [100 * (first[s] - second[s]) for s in common]))
        _errorbar(axes[1], facts, differences, color="tab:red")
        for m, values in differences:
            axes[1].annotate(m, (facts[m].compute, statistics.mean(values)), textcoords="offset points",
                             xytext=(4, 4), fontsize=7)  # fmt: skip
        panels.append((axes[1], f"{gap[0]} − {gap[1]} gain gap (test)", "gap (accuracy points)"))
    for ax, title, ylabel in panels:
        ax.set_xscale("log")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xlabel("compute budget 6·N·tokens (FLOPs)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def _errorbar(ax, facts: Mapping[str, ModelFacts], points: list[tuple[str, list[float]]], **style) -> None:
    stats = [mean_std(values) for _, values in points]
    xs = [facts[m].compute for m, _ in points]
    ax.errorbar(xs, [m for m, _ in stats], [s for _, s in stats], marker="o", capsize=3, **style)


def _by_seed(gain: Mapping[tuple[str, str, int], float], model: str, setting: str) -> dict[int, float]:
    return {seed: value for (m, s, seed), value in gain.items() if m == model and s == setting}


def _points(values: Sequence[float]) -> str:
    """Accuracy differences in points, mean ± std over seeds."""
    return mean_std_cell([100 * v for v in values], 2) if values else ""


def report(
    runs: Sequence[RunResult], facts: Mapping[str, ModelFacts], settings: Sequence[str], vocabulary: Sequence[str]
) -> tuple[str, dict[str, list[float]]]:
    """The markdown tables (models; gains with the IID − non-IID gap; seen/unseen, overall and per domain;
    correlations of gain with compute; the vocabulary pair) and the per-seed correlations by setting."""
    gain = gains(runs, REFERENCE)
    models = sorted(facts, key=lambda m: facts[m].compute)
    centralized = {m: [r.centralized for r in runs if r.model == m and r.setting == REFERENCE] for m in models}
    rows = [
        [m, f"{f.parameters:,}", str(f.vocabulary), f"{f.tokens:.3g} ({f.tokens_source})", f"{f.compute:.3g}",
         mean_std_cell(centralized[m], 3)]
        for m, f in ((m, facts[m]) for m in models)
    ]  # fmt: skip
    text = "### Models (centralized: test accuracy at its best epoch on validation)\n\n"
    text += markdown_table(["model", "N (non-embedding)", "vocabulary", "pre-training tokens", "6·N·tokens",
                            "centralized"], rows)  # fmt: skip
    columns = [s for s in (REFERENCE, NON_IID, *PARTIAL, SEEN_UNSEEN) if s in settings]
    rows = []
    for m in models:
        cells = [_points(list(_by_seed(gain, m, c).values())) for c in columns]
        if NON_IID in settings:
            first, second = _by_seed(gain, m, REFERENCE), _by_seed(gain, m, NON_IID)
            cells.append(_points([first[x] - second[x] for x in sorted(set(first) & set(second))]))
        rows.append([m, *cells])
    gap = [f"gap {REFERENCE} − {NON_IID}"] if NON_IID in settings else []
    text += "\n### Accuracy gain of FedAvg (final round) over centralized, test, points (mean ± std over seeds)\n\n"
    text += markdown_table(["model", *columns, *gap], rows)
    if SEEN_UNSEEN in settings:
        cells = seen_unseen(runs, SEEN_UNSEEN, REFERENCE)
        keys = ("federated_seen", "federated_unseen", "centralized_seen", "centralized_unseen")
        rows = [[m, *(mean_std_cell(cells[m][k], 3) if cells[m].get(k) else "" for k in keys),
                 str(len(cells[m].get("federated_unseen", [])))] for m in models if m in cells]  # fmt: skip
        text += f"\n### Seen and unseen domains ({SEEN_UNSEEN}: test accuracy, mean over domains, then seeds)\n\n"
        text += markdown_table(["model", "FedAvg seen", "FedAvg unseen", "centralized seen", "centralized unseen",
                                "seeds with an unseen domain"], rows)  # fmt: skip
        text += f"\n### Per domain ({SEEN_UNSEEN}: FedAvg − centralized, test accuracy points, mean over seeds)\n\n"
        text += markdown_table(["model", "domain", "seeds it took part in", "when seen", "when unseen"],
                               per_domain(runs, SEEN_UNSEEN, REFERENCE))  # fmt: skip
    found, rows = {}, []
    for setting in (s for s in (REFERENCE, NON_IID) if s in settings):
        values = found[setting] = correlations(facts, gain, setting, models)
        if values["pearson"]:
            pearson, spearman = mean_std_cell(values["pearson"], 2), mean_std_cell(values["spearman"], 2)
            rows.append([setting, pearson, spearman, str(len(values["pearson"]))])
    if rows:
        text += "\n### Correlation of gain with compute budget (per seed, over models; mean ± std over seeds)\n\n"
        text += markdown_table(["setting", "Pearson (log10 compute)", "Spearman", "seeds"], rows)
    pair = [m for m in vocabulary if m in facts]
    if len(pair) == 2:
        rows = [[c, *(_points(list(_by_seed(gain, m, c).values())) for m in pair)] for c in columns]
        text += "\n### Vocabulary: gain in points of two models that differ only in their vocabulary\n\n"
        text += markdown_table(["setting", *(f"{m} (vocabulary {facts[m].vocabulary})" for m in pair)], rows)
    return text, found
