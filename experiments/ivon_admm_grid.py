"""A grid of IVON-ADMM settings run with the plain round loop on a federated preset's problem.

Usage (from the project root, after ``make install``):
    .venv/bin/python experiments/ivon_admm_grid.py [--preset experiments/federated.yaml] [--rounds 20]
        [--lr 0.1 0.2 0.5] [--rho 0.02 0.05 0.1 0.3] [--temperature 1.0] [--beta2 0.99]
        [--clip-radius inf] [--out results/ivon_admm_grid.jsonl]

For each sweep point of the preset (e.g. Dirichlet α × seed) the pipeline's prepare, partition and
pretrain stages make a workspace under ``results/ivon_admm_grid-workspace/``; then
``mergeflow.federated.run_rounds`` runs FedAvg and every combination of the IVON-ADMM settings given,
the rest of the options taken from the preset's ``bayes_admm`` entry. No Prefect task per client:
about 1.5 s per 20-round run of 10 clients, so a grid of dozens of settings takes minutes. A run whose
client loss turns non-finite is recorded as diverged. One JSON line per (point, setting) goes to
``--out``; a table of mean final accuracy per group, with the number of diverged runs and the final
client drift, is printed at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def point_params(preset: dict[str, Any], point: list[str]) -> Any:
    """The preset's params at one sweep point, validated."""
    from mergeflow.config import apply_overrides, validate_params

    return validate_params(apply_overrides(preset.get("params", {}), point), " ".join(point))


def workspace_data(params: Any, workspace: Path) -> tuple[Any, list[Any], Any]:
    """Prepare, partition and pre-train (cached), then the loop's model builder, client and test data."""
    from flows.pipeline import run_pipeline
    from tasks.federated import loop_inputs

    run_pipeline(params, workspace, ["prepare", "partition", "pretrain"])
    return loop_inputs(workspace, params.partition.num_clients)


def settings(args: argparse.Namespace, base: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """FedAvg, then one IVON-ADMM option set per combination of the grid's values."""
    grid = {"lr": args.lr, "rho": args.rho, "temperature": args.temperature, "beta2": args.beta2}
    grid["clip_radius"] = args.clip_radius
    named = {"fedavg": {"algorithm": "fedavg"}}
    for values in itertools.product(*grid.values()):
        changes = dict(zip(grid, values, strict=True))
        name = " ".join(f"{k}={v:g}" for k, v in changes.items())
        named[name] = {"algorithm": "bayes_admm", **base, **changes}
    return named


def run_one(options: dict[str, Any], inputs: tuple[Any, list[Any], Any], params: Any, rounds: int) -> dict[str, Any]:
    """One federated run; accuracy and drift every 5 rounds, or ``diverged``."""
    from mergeflow.federated import LocalTraining, run_rounds
    from mergeflow.training import DivergenceError

    model_builder, clients, test = inputs
    options = dict(options)
    algorithm = options.pop("algorithm")
    train = LocalTraining(**params.section("federated.local"))
    try:
        run = run_rounds(
            algorithm, model_builder, clients, rounds, options=options, train=train, seed=params.seed, eval_data=test
        )
    except DivergenceError as error:
        return {"diverged": str(error)}
    rows = run.metrics[::5] + ([run.metrics[-1]] if rounds % 5 else [])
    return {
        "final": run.metrics[-1]["accuracy"],
        "accuracy": [round(r["accuracy"], 4) for r in rows],
        "drift": [round(r.get("drift", 0.0), 2) for r in rows],
    }


def summary(records: list[dict[str, Any]], group_keys: list[str]) -> str:
    """Mean final accuracy per setting and group (diverged runs left out and counted)."""
    groups = sorted({tuple(r["point"][k] for k in group_keys) for r in records})
    names = list(dict.fromkeys(r["setting"] for r in records))
    header = ["setting", *(f"{'/'.join(group_keys)}={'/'.join(g)}" for g in groups), "diverged", "max final drift"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        runs = [r for r in records if r["setting"] == name]
        cells = []
        for group in groups:
            finals = [r["final"] for r in runs if tuple(r["point"][k] for k in group_keys) == group and "final" in r]
            cells.append(f"{statistics.mean(finals):.3f}" if finals else "n/a")
        drifts = [r["drift"][-1] for r in runs if "drift" in r]
        diverged = sum("diverged" in r for r in runs)
        lines.append(f"| {name} | {' | '.join(cells)} | {diverged}/{len(runs)} | {max(drifts, default=0):.3g} |")
    return "\n".join(lines)


def main() -> None:
    """Run the grid over every sweep point of the preset and print the summary table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", type=Path, default=ROOT / "experiments/federated.yaml")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lr", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    parser.add_argument("--rho", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.3])
    parser.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    parser.add_argument("--beta2", type=float, nargs="+", default=[0.99])
    parser.add_argument("--clip-radius", type=float, nargs="+", default=[float("inf")])
    parser.add_argument("--out", type=Path, default=ROOT / "results/ivon_admm_grid.jsonl")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from flows.environment import configure

    configure()
    import torch
    import yaml

    torch.set_num_threads(1)  # as every flow step does: the loop then matches the flow bit for bit
    preset = yaml.safe_load(args.preset.read_text())
    sweep = preset.get("sweep", {})
    base = dict(preset["params"]["federated"]["options"].get("bayes_admm", {}))
    named = settings(args, base)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = []
    with args.out.open("w") as out:
        for values in itertools.product(*sweep.values()):
            point = [f"{k}={json.dumps(v)}" for k, v in zip(sweep, values, strict=True)]
            params = point_params(preset, point)
            workspace = ROOT / "results/ivon_admm_grid-workspace" / "_".join(p.replace("=", "") for p in point)
            workspace.mkdir(parents=True, exist_ok=True)
            inputs = workspace_data(params, workspace)
            for name, options in named.items():
                record = {"point": dict(zip(sweep, map(str, values), strict=True)), "setting": name}
                record |= run_one(options, inputs, params, args.rounds)
                records.append(record)
                print(json.dumps(record), file=out, flush=True)
    print(summary(records, [k for k in sweep if k != "seed"]))


if __name__ == "__main__":
    main()
