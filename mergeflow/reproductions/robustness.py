"""The robustness and privacy reproductions: grids of plain-loop federated runs on one prepared workspace.

Every run is :func:`mergeflow.federated.run_rounds` (which the pipeline's federated stage reproduces bit
for bit) on the workspace's clients, base model, validation and test splits. Settings are chosen on the
validation split; tables report the test split.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from mergeflow.federated import ClientData, LocalTraining, run_rounds
from mergeflow.reproductions.tables import markdown_table, mean_std_cell


@dataclass(frozen=True)
class LoopInputs:
    """What every run of a grid shares: the base model's builder, the clients, the two held-out splits,
    the local training, the rounds and the participation."""

    builder: Callable[[], nn.Module]
    clients: Sequence[ClientData]
    test: ClientData
    validation: ClientData
    train: LocalTraining
    rounds: int
    fraction: float = 1.0
    num_classes: int | None = None


def fedavg_run(inputs: LoopInputs, seed: int, **plan: Any) -> list[dict[str, Any]]:
    """FedAvg's per-round metrics (test, and validation as ``val_*``) with a server plan's options."""
    run = run_rounds(
        "fedavg",
        inputs.builder,
        inputs.clients,
        inputs.rounds,
        train=inputs.train,
        fraction=inputs.fraction,
        seed=seed,
        eval_data=inputs.test,
        validation_data=inputs.validation,
        predictive_samples=0,
        num_classes=inputs.num_classes,
        **plan,
    )
    return run.metrics


def rounds_to(rows: Sequence[Mapping[str, Any]], target: float, key: str = "accuracy") -> int | None:
    """The first round whose ``key`` reaches ``target`` (None if none does)."""
    return next((int(row["round"]) for row in rows if row[key] >= target), None)


# ----------------------------------------------------------------------------- robustness


def robustness_grid(inputs: LoopInputs, spec: Mapping[str, Any], log: Callable[[str], None] = print) -> list[dict]:
    """Each aggregator against each attack with each number of attackers (0 once per aggregator)."""
    records = []
    for (aggregator, rule), seed in itertools.product(spec["aggregators"].items(), spec["attack_seeds"]):
        for count in spec["attackers"]:
            kinds = spec["attacks"].items() if count else [("none", None)]
            for kind, attack in kinds:
                rows = fedavg_run(
                    inputs, seed, aggregator=rule, attack=None if attack is None else {**attack, "clients": count}
                )
                sent = sum(len(row.get("attackers", [])) for row in rows[1:])
                kept = sum(row.get("attacked_kept", 0.0) for row in rows[1:])
                record = {
                    "aggregator": aggregator,
                    "attack": kind,
                    "attackers": count,
                    "seed": seed,
                    "test_accuracy": rows[-1]["accuracy"],
                    "val_accuracy": rows[-1]["val_accuracy"],
                    "attacked_sent": sent,
                    "attacked_kept": kept,
                }
                log(f"robustness: {record}")
                records.append(record)
    return records


def robustness_tables(records: Sequence[Mapping[str, Any]], spec: Mapping[str, Any]) -> str:
    """Per attack: the final test accuracy of each aggregator by number of attackers, and what it kept."""
    text = ""
    counts = [c for c in spec["attackers"] if c]
    clean = {
        agg: statistics.mean(r["test_accuracy"] for r in records if r["aggregator"] == agg and r["attackers"] == 0)
        for agg in spec["aggregators"]
    }
    for kind in spec["attacks"]:
        header = ["aggregator", "0 attackers", *(f"{c} attackers (kept / sent)" for c in counts)]
        rows = []
        for agg in spec["aggregators"]:
            cells = [f"{clean[agg]:.3f}"]
            for c in counts:
                group = [r for r in records if r["aggregator"] == agg and r["attack"] == kind and r["attackers"] == c]
                accuracy = statistics.mean(r["test_accuracy"] for r in group)
                kept = statistics.mean(r["attacked_kept"] for r in group)
                sent = statistics.mean(r["attacked_sent"] for r in group)
                cells.append(f"{accuracy:.3f} ({kept:.1f} / {sent:.0f})")
            rows.append([agg, *cells])
        text += f"\n#### Attack: {kind} ({spec['attacks'][kind]})\n\n" + markdown_table(header, rows)
    return text


# ----------------------------------------------------------------------------- server optimizers


def _candidates(options: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each setting of a server optimizer entry whose ``lr`` may be a list (searched on validation)."""
    rates = options["lr"] if isinstance(options["lr"], list) else [options["lr"]]
    return [{**options, "lr": lr} for lr in rates]


def server_optimizer_grid(inputs: LoopInputs, spec: Mapping[str, Any], log: Callable[[str], None] = print) -> dict:
    """Each server optimizer's lr chosen on validation (final round, first seed), then run on every seed."""
    results = {}
    seeds = spec["server_seeds"]
    for name, options in spec["server_optimizers"].items():
        candidates = _candidates(options)
        scores = []
        for candidate in candidates:
            rows = fedavg_run(inputs, seeds[0], server=candidate)
            scores.append(rows[-1]["val_accuracy"])
        chosen = candidates[max(range(len(scores)), key=scores.__getitem__)]
        runs = [fedavg_run(inputs, seed, server=chosen) for seed in seeds]
        results[name] = {"chosen": chosen, "validation": scores, "curves": runs}
        log(f"server optimizer {name}: chose lr {chosen['lr']} (validation {scores})")
    return results


def server_optimizer_table(results: Mapping[str, Any], target: float) -> str:
    """Final test accuracy (mean ± std over seeds) and rounds to the target test accuracy."""
    header = ["server optimizer", "chosen lr (validation)", "test accuracy, final", f"rounds to test acc ≥ {target}"]
    rows = []
    for name, result in results.items():
        finals = [curve[-1]["accuracy"] for curve in result["curves"]]
        reached = [rounds_to(curve, target) for curve in result["curves"]]
        reached_cell = ", ".join("—" if r is None else str(r) for r in reached)
        rows.append([name, f"{result['chosen']['lr']:g}", mean_std_cell(finals, 3), reached_cell])
    return markdown_table(header, rows)


# ----------------------------------------------------------------------------- privacy


def privacy_grid(inputs: LoopInputs, spec: Mapping[str, Any], log: Callable[[str], None] = print) -> dict:
    """DP-FedAvg at each noise multiplier over the seeds, with the clip chosen on validation at the middle
    noise (first seed); FedAvg without DP (same participation rate, fixed-size sampling) as the reference."""
    seeds, noises, delta = spec["seeds"], spec["noise_multipliers"], spec["delta"]
    middle = noises[len(noises) // 2]
    scores = []
    for clip in spec["clips"]:
        rows = fedavg_run(inputs, seeds[0], dp={"clip": clip, "noise_multiplier": middle, "delta": delta})
        scores.append(rows[-1]["val_accuracy"])
    clip = spec["clips"][max(range(len(scores)), key=scores.__getitem__)]
    log(f"privacy: chose clip {clip} (validation {scores} at σ = {middle})")
    levels = {}
    for sigma in noises:
        dp = {"clip": clip, "noise_multiplier": sigma, "delta": delta}
        levels[str(sigma)] = [fedavg_run(inputs, seed, dp=dp) for seed in seeds]
        log(f"privacy: σ = {sigma}: {[c[-1]['accuracy'] for c in levels[str(sigma)]]}")
    reference = [fedavg_run(inputs, seed) for seed in seeds]
    return {"clip": clip, "clip_validation": scores, "levels": levels, "no_dp": reference, "delta": delta}


def privacy_table(results: Mapping[str, Any]) -> str:
    """Per noise multiplier: the total ε at δ, the ε of one round, the final test accuracy over seeds."""
    header = ["noise multiplier σ", f"ε total (δ = {results['delta']:g})", "ε one round", "test accuracy, final"]
    rows = []
    for sigma, curves in results["levels"].items():
        last = curves[0][-1]
        finals = [curve[-1]["accuracy"] for curve in curves]
        rows.append([sigma, f"{last['epsilon']:.3g}", f"{last['epsilon_round']:.3g}", mean_std_cell(finals, 3)])
    finals = [curve[-1]["accuracy"] for curve in results["no_dp"]]
    rows.append(["no DP (FedAvg)", "∞", "∞", mean_std_cell(finals, 3)])
    return markdown_table(header, rows)
