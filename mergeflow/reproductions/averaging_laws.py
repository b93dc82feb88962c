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

# State-dict keys that are not counted in N (as in Kaplan et al.: embeddings; and the task's head).
_NOT_COUNTED = ("embeddings.", "classifier.", "score.")


def non_embedding_parameters(state: Mapping[str, torch.Tensor]) -> int:
    """N: the parameters of a transformer's state dict outside its embeddings and classification head."""
    return sum(t.numel() for key, t in state.items() if not any(part in key for part in _NOT_COUNTED))


@dataclass(frozen=True)
class RunResult:
    """One run's test accuracies: FedAvg's global model at the final round, the centralized model
    (at its best epoch on validation), and both per domain; and which domains ever took part."""

    model: str
    setting: str
    seed: int
    federated: float
    centralized: float
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


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def seen_unseen(runs: Sequence[RunResult], setting: str) -> dict[str, dict[str, list[float]]]:
    """Per model, the mean accuracy over seen and over unseen domains of each seed of ``setting`` (seeds
    in which every domain took part give no unseen value): ``federated_seen``, ``federated_unseen``,
    ``centralized_seen``, ``centralized_unseen``."""
    out: dict[str, dict[str, list[float]]] = {}
    for run in (r for r in runs if r.setting == setting):
        cells = out.setdefault(run.model, {})
        domains = sorted(run.federated_by_domain)
        seen = [d for d in domains if d in run.seen_domains]
        unseen = [d for d in domains if d not in run.seen_domains]
        for model, by_domain in (("federated", run.federated_by_domain), ("centralized", run.centralized_by_domain)):
            for kind, chosen in (("seen", seen), ("unseen", unseen)):
                if chosen:
                    cells.setdefault(f"{model}_{kind}", []).append(statistics.mean(by_domain[d] for d in chosen))
    return out


def correlations(
    facts: Mapping[str, ModelFacts], gain: Mapping[tuple[str, str, int], float], setting: str, models: Sequence[str]
) -> dict[str, list[float]]:
    """Per seed, the Pearson correlation of log10 compute with the gain and the Spearman rank correlation,
    over ``models`` in ``setting``; seeds missing a model are left out."""
    from scipy.stats import pearsonr, spearmanr

    seeds = sorted({seed for (_, s, seed) in gain if s == setting})
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
    series: Mapping[str, str],
    gap: tuple[str, str],
    path: str | Path,
) -> None:
    """Two panels: the gain against the compute budget for each setting in ``series`` (label → setting),
    the paper's Figure 1; and the gap between the two settings of ``gap`` (IID − non-IID), its Figure 5.
    Mean ± std over seeds; written atomically."""
    from matplotlib.figure import Figure

    models = sorted(facts, key=lambda m: facts[m].compute)
    fig = Figure(figsize=(12.0, 4.8))
    left, right = fig.subplots(1, 2)
    for label, setting in series.items():
        points = [(m, mean_std([100 * v for v in _seed_values(gain, m, setting)])) for m in models
                  if _seed_values(gain, m, setting)]  # fmt: skip
        left.errorbar([facts[m].compute for m, _ in points], [mean for _, (mean, _) in points],
                      [std for _, (_, std) in points], marker="o", capsize=3, label=label)  # fmt: skip
    differences = []
    for m in models:
        first, second = _seed_values(gain, m, gap[0], by_seed=True), _seed_values(gain, m, gap[1], by_seed=True)
        common = sorted(set(first) & set(second))
        if common:
            differences.append((m, mean_std([100 * (first[s] - second[s]) for s in common])))
    right.errorbar([facts[m].compute for m, _ in differences], [mean for _, (mean, _) in differences],
                   [std for _, (_, std) in differences], marker="o", capsize=3, color="tab:red")  # fmt: skip
    for m, (mean, _) in differences:
        right.annotate(m, (facts[m].compute, mean), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for ax, title, ylabel in (
        (left, "Accuracy gain of FedAvg over centralized (test)", "gain (accuracy points)"),
        (right, f"{gap[0]} − {gap[1]} gain gap (test)", "gap (accuracy points)"),
    ):
        ax.set_xscale("log")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xlabel("compute budget 6·N·tokens (FLOPs)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    left.legend()
    save_figure(fig, path)


def _seed_values(gain: Mapping[tuple[str, str, int], float], model: str, setting: str, by_seed: bool = False):
    chosen = {seed: value for (m, s, seed), value in gain.items() if m == model and s == setting}
    return chosen if by_seed else list(chosen.values())
