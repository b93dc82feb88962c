"""Choose federated settings on the validation split with the plain round loop, then report test.

Usage (from the project root, after ``make install``):
    .venv/bin/python experiments/federated_grid.py --preset experiments/bayes_admm_reference.yaml
        [--rounds 50] [--out results/federated_grid.jsonl]

The preset's ``grid`` section maps an entry name to its options, written as in
``federated.options`` (an ``algorithm`` key, a ``local`` section for that entry's local training);
any value given as a list is searched over, every combination with every other. The preset's
data must have a validation split (``data.validation_fraction`` > 0).

For each sweep point of the preset (e.g. partition × seed) the pipeline's prepare, partition and
pretrain stages make a workspace under ``results/federated_grid-workspace/``; then
``mergeflow.federated.run_rounds`` runs every combination there, without a Prefect task per client
(a flow with the same settings reproduces these numbers bit for bit). The score of a run is the
mean validation accuracy of its last three rounds. A run whose clients diverge scores nothing, and
so does a run whose client drift still grows over its last rounds (:func:`drift_grows`): a
setting that runs away later is rejected, not chosen for where it stands at the last round. Each
entry's chosen combination is the one with the best mean score over all sweep points where none
of its runs was rejected; test accuracy is read only for what is printed next to it and plays no
part in the choice.

One JSON line per (point, combination) goes to ``--out``; the table of every combination and the
chosen settings (a ``federated.options`` block to paste into a preset) are printed at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LAST = 3  # rounds averaged into a run's score, as the Bayes-ADMM reference reports
DRIFT_WINDOW = 10  # rounds averaged on each side of the drift-growth comparison
DRIFT_LAG = 25  # rounds between the two windows
DRIFT_GROWTH = 1.25  # the last window's mean drift over the earlier one's that rejects a run


def drift_grows(drifts: list[float]) -> bool:
    """Whether the mean drift of the last rounds exceeds that of ``DRIFT_LAG`` rounds earlier by
    more than ``DRIFT_GROWTH``× (each a mean over ``DRIFT_WINDOW`` rounds); too few rounds: False."""
    if len(drifts) < DRIFT_LAG + DRIFT_WINDOW:
        return False
    late = statistics.mean(drifts[-DRIFT_WINDOW:])
    early = statistics.mean(drifts[-DRIFT_LAG - DRIFT_WINDOW : -DRIFT_LAG])
    return not late <= DRIFT_GROWTH * early  # nan drifts count as growing


def point_params(preset: dict[str, Any], point: list[str]) -> Any:
    """The preset's params at one sweep point, validated (its federated entries are the grid's)."""
    from mergeflow.config import apply_overrides, validate_params

    raw = apply_overrides(preset.get("params", {}), point)
    raw.setdefault("federated", {}).update(algorithms=[], options={})
    return validate_params(raw, " ".join(point))


def expand(grid: dict[str, dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every combination of every entry: ``"entry key=value …"`` → (entry, concrete options)."""
    combinations = {}
    for entry, options in grid.items():
        flat = {key: value for key, value in options.items() if key != "local"}
        flat |= {f"local.{key}": value for key, value in options.get("local", {}).items()}
        searched = [key for key, value in flat.items() if isinstance(value, list)]
        for values in itertools.product(*(flat[key] for key in searched)):
            chosen = dict(zip(searched, values, strict=True))
            concrete = {key: chosen.get(key, value) for key, value in flat.items()}
            options_out = {key: value for key, value in concrete.items() if not key.startswith("local.")}
            local = {key.removeprefix("local."): value for key, value in concrete.items() if key.startswith("local.")}
            if local:
                options_out["local"] = local
            label = " ".join([entry, *(f"{key}={value:g}" for key, value in chosen.items())])
            combinations[label] = (entry, options_out)
    return combinations


def run_entry(federated: Any, entry: str, seed: int, inputs: tuple[Any, ...], rounds: int, **extra: Any) -> Any:
    """The plain round loop for ``entry`` of a validated ``federated`` config on a point's inputs;
    ``extra`` goes to ``run_rounds`` (e.g. a validation split)."""
    from mergeflow.federated import LocalTraining, run_rounds

    algorithm, options = federated.resolve(entry)
    model_builder, clients, test, _ = inputs
    train = LocalTraining(**federated.local_for(entry).model_dump())
    return run_rounds(
        algorithm, model_builder, clients, rounds, options=options, train=train, seed=seed, eval_data=test, **extra
    )


def run_one(
    entry: str, options: dict[str, Any], params: Any, inputs: tuple[Any, list[Any], Any, Any], rounds: int
) -> dict[str, Any]:
    """One federated run: validation score, test accuracy (mean of the last rounds), or ``diverged``."""
    from mergeflow.config import validate_params
    from mergeflow.training import DivergenceError

    raw = params.model_dump(mode="json")
    raw["federated"]["options"] = {entry: options}
    raw["federated"]["algorithms"] = [entry]
    config = validate_params(raw, entry).federated
    try:
        run = run_entry(config, entry, params.seed, inputs, rounds, validation_data=inputs[3], predictive_samples=0)
    except DivergenceError as error:
        return {"diverged": str(error)}
    last = run.metrics[-LAST:]
    drifts = [row["drift"] for row in run.metrics[1:]]
    result = {
        "score": statistics.mean(row["val_accuracy"] for row in last),
        "test": statistics.mean(row["accuracy"] for row in last),
        "val_curve": [round(row["val_accuracy"], 4) for row in run.metrics[::5]],
        "drift_curve": [round(d, 4) for d in drifts[4::5]],
    }
    if drift_grows(drifts):
        result["drift_grows"] = True
    return result


def point_inputs(params: Any, point: list[str], name: str) -> tuple[Any, list[Any], Any, Any]:
    """The plain loop's inputs at one sweep point (model builder, clients, test, validation or None),
    from the pipeline's prepare, partition and pretrain stages in ``results/<name>-workspace/<point>``."""
    from flows.pipeline import run_pipeline
    from mergeflow.preflight import check_paths
    from tasks.federated import loop_inputs, validation_data

    check_paths(params, " ".join(point))
    workspace = ROOT / f"results/{name}-workspace" / ("_".join(p.replace("=", "") for p in point) or "all")
    workspace.mkdir(parents=True, exist_ok=True)
    run_pipeline(params, workspace, ["prepare", "partition", "pretrain"])
    validation = validation_data(workspace) if params.data.validation_fraction > 0 else None
    return (*loop_inputs(workspace, params.partition.num_clients), validation)


_JOBS: list[tuple[Callable[..., dict[str, Any]], tuple[Any, ...]]] = []


def _run_job(index: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    function, args = _JOBS[index]
    return function(*args)


def run_in_workers(jobs: list[tuple[Callable[..., dict[str, Any]], tuple[Any, ...]]], workers: int) -> list[dict]:
    """``function(*args)`` of every job, in ``workers`` forked processes (they inherit the jobs: the
    model builder is a closure, which cannot be pickled)."""
    _JOBS[:] = jobs
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_run_job, range(len(jobs)), chunksize=1)


def command_line(
    description: str, default_preset: str, default_out: str, extra: dict[str, str] | None = None
) -> argparse.Namespace:
    """The arguments of a script over a preset's sweep points, with the pipeline's environment set up;
    ``extra``: more options that take a list of values (option → help)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", type=Path, default=ROOT / default_preset)
    parser.add_argument("--rounds", type=int, default=None, help="default: the preset's federated.rounds")
    parser.add_argument("--out", type=Path, default=ROOT / default_out)
    parser.add_argument("--workers", type=int, default=1, help="processes running side by side")
    for option, text in (extra or {}).items():
        parser.add_argument(option, nargs="+", default=None, help=text)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from flows.environment import configure

    configure()
    import torch

    torch.set_num_threads(1)  # as every flow step does: the loop then matches the flow bit for bit
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return args


def sweep_points(sweep: dict[str, list[Any]]) -> Iterator[tuple[dict[str, str], list[str]]]:
    """Every point of a preset's sweep: (key → value as text, the ``key=json`` overrides)."""
    for values in itertools.product(*sweep.values()):
        point = [f"{k}={json.dumps(v)}" for k, v in zip(sweep, values, strict=True)]
        yield dict(zip(sweep, map(str, values), strict=True)), point


def choose(records: list[dict[str, Any]]) -> dict[str, str]:
    """Each entry's combination with the best mean validation score over every point (none rejected)."""
    scores: dict[str, dict[str, list[float]]] = {}
    failed = {r["combination"] for r in records if rejected(r)}
    for record in records:
        if record["combination"] not in failed:
            scores.setdefault(record["entry"], {}).setdefault(record["combination"], []).append(record["score"])
    return {
        entry: max(by_combination, key=lambda c: statistics.mean(by_combination[c]))
        for entry, by_combination in scores.items()
    }


def rejected(record: dict[str, Any]) -> bool:
    """A run that diverged or whose drift still grows at its end."""
    return "diverged" in record or bool(record.get("drift_grows"))


def summary(records: list[dict[str, Any]], group_keys: list[str], chosen: dict[str, str]) -> str:
    """Mean validation score and test accuracy per combination and sweep group; chosen rows marked."""
    groups = sorted({tuple(r["point"][k] for k in group_keys) for r in records})
    names = list(dict.fromkeys(r["combination"] for r in records))
    header = ["combination"]
    for group in groups:
        label = "/".join(group) or "all"
        header += [f"val {label}", f"test {label}"]
    header += ["diverged", "drift grows"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        runs = [r for r in records if r["combination"] == name]
        cells = []
        for group in groups:
            done = [r for r in runs if tuple(r["point"][k] for k in group_keys) == group and "score" in r]
            for key in ("score", "test"):
                cells.append(f"{statistics.mean(r[key] for r in done):.3f}" if done else "n/a")
        mark = " **chosen**" if name in chosen.values() else ""
        diverged = sum("diverged" in r for r in runs)
        grows = sum(bool(r.get("drift_grows")) for r in runs)
        lines.append(f"| {name}{mark} | {' | '.join(cells)} | {diverged}/{len(runs)} | {grows}/{len(runs)} |")
    failed = {r["combination"] for r in records if rejected(r)}
    lines.append(f"\nRejected (a run diverged or its drift grows): {len(failed)} of {len(names)} combinations.")
    return "\n".join(lines)


def main() -> None:
    """Run the grid over every sweep point of the preset, print the table and the chosen options."""
    args = command_line(
        __doc__.splitlines()[0], "experiments/bayes_admm_reference.yaml", "results/federated_grid.jsonl"
    )
    import yaml

    preset = yaml.safe_load(args.preset.read_text())
    sweep, combinations = preset.get("sweep", {}), expand(preset["grid"])
    records = []
    with args.out.open("w") as out:
        for values, point in sweep_points(sweep):
            params = point_params(preset, point)
            if params.data.validation_fraction <= 0:
                sys.exit(f"{args.preset}: data.validation_fraction must be > 0: settings are chosen on validation")
            inputs = point_inputs(params, point, "federated_grid")
            rounds = args.rounds or params.federated.rounds
            jobs = [(run_one, (entry, options, params, inputs, rounds)) for entry, options in combinations.values()]
            results = run_in_workers(jobs, args.workers)
            for (label, (entry, options)), result in zip(combinations.items(), results, strict=True):
                record = {"point": values, "combination": label, "entry": entry, "options": options, **result}
                records.append(record)
                print(json.dumps(record), file=out, flush=True)
    chosen = choose(records)
    print(summary(records, [k for k in sweep if k != "seed"], chosen))
    options = {
        entry: next(r["options"] for r in records if r["combination"] == label) for entry, label in chosen.items()
    }
    print("\nChosen on validation (federated.options):\n" + yaml.safe_dump(options, sort_keys=False))


if __name__ == "__main__":
    main()
