"""Run a preset's federated algorithms for many rounds and report whether their client drift stays bounded.

Usage (from the project root, after ``make install``):
    .venv/bin/python experiments/drift_horizon.py --preset experiments/bayes_admm_horizon.yaml
        [--rounds 200] [--workers 2] [--out results/drift_horizon.jsonl] [--algorithms NAME …] [--seeds N …]

For each sweep point of the preset (e.g. partition × seed) the pipeline's prepare, partition and
pretrain stages make a workspace under ``results/drift_horizon-workspace/``, then every entry of
``federated.algorithms`` runs with the plain round loop (which a flow reproduces bit for bit).
Each run reports the client drift (mean ‖θ_k − θ̄‖) at a few rounds, whether it still grows over
its last rounds (``federated_grid.drift_grows``), its test accuracy at the last round, or where it
diverged. Nothing is chosen here, so nothing is read from a validation split.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))
from federated_grid import (  # noqa: E402
    command_line,
    drift_grows,
    point_inputs,
    run_entry,
    run_in_workers,
    sweep_points,
)


def run_one(entry: str, params: Any, inputs: tuple[Any, ...], rounds: int) -> dict[str, Any]:
    """One run of ``entry``: drift per round, test accuracy at the last round, or ``diverged``."""
    from mergeflow.training import DivergenceError

    try:
        run = run_entry(
            params.federated, entry, params.seed, inputs, rounds, on_divergence=params.federated.on_divergence
        )
    except DivergenceError as error:
        return {"diverged": str(error)}
    drifts = [row["drift"] for row in run.metrics[1:]]
    return {"drift": drifts, "grows": drift_grows(drifts), "test_accuracy": run.metrics[-1]["accuracy"]}


def table(records: list[dict[str, Any]], rounds: int) -> str:
    """One row per (point, entry): drift at a few rounds, round 50 over round 10, growth, test accuracy."""
    marks = [r for r in (1, 10, 50, 100, 150, 200, rounds) if r <= rounds]
    marks = list(dict.fromkeys(marks))
    header = ["point", "algorithm", *(f"drift r{r}" for r in marks), "r50 / r10", "grows at end", "test acc (last)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for record in records:
        if "diverged" in record:
            cells = [record["diverged"][:60]] + [""] * (len(header) - 3)
        else:
            drift = record["drift"]
            ratio = f"{drift[49] / drift[9]:.2f}" if rounds >= 50 else ""
            cells = [*(f"{drift[r - 1]:.3g}" for r in marks), ratio, str(record["grows"])]
            cells.append(f"{record['test_accuracy']:.3f}")
        lines.append(f"| {record['point']} | {record['entry']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    """Run every entry at every sweep point and print the drift table."""
    args = command_line(
        __doc__.splitlines()[0],
        "experiments/bayes_admm_horizon.yaml",
        "results/drift_horizon.jsonl",
        extra={"--algorithms": "only these entries of federated.algorithms", "--seeds": "only these seeds"},
    )
    import yaml

    from mergeflow.config import apply_overrides, validate_params

    preset = yaml.safe_load(args.preset.read_text())
    records, rounds = [], 0
    with args.out.open("w") as out:
        sweep = preset.get("sweep", {})
        if args.seeds:
            sweep = {**sweep, "seed": [int(seed) for seed in args.seeds]}
        for _, point in sweep_points(sweep):
            params = validate_params(apply_overrides(preset.get("params", {}), point), " ".join(point))
            inputs = point_inputs(params, point, "drift_horizon")
            rounds = args.rounds or params.federated.rounds
            entries = args.algorithms or params.federated.algorithms
            results = run_in_workers([(run_one, (entry, params, inputs, rounds)) for entry in entries], args.workers)
            for entry, result in zip(entries, results, strict=True):
                record = {"point": " ".join(point), "entry": entry, **result}
                records.append(record)
                print(json.dumps(record), file=out, flush=True)
    print(table(records, rounds))


if __name__ == "__main__":
    main()
