"""Reproductions of the papers' experiments, each an experiment preset under ``experiments/``.

``mergeflow reproduce NAME`` runs one and writes ``results/NAME.json`` and ``results/NAME.md``.

- ``linear-gaussian``: SSF §3.1 in closed form (``mergeflow.reproductions.linear_gaussian``).
  Its per-step SSF curves go to MLflow as step metrics.
- ``pinwheel``: SSF Table 1 through the real pipeline, once per point of the preset's
  ``sweep`` (number of clients × seeds), in a workspace of its own under ``results/``;
  every pipeline run is logged to MLflow as usual.
- ``alignment``: independently initialised digits MLPs, barriers and merges with and without
  weight or activation matching.
- ``federated`` and ``participation``: the federated algorithms under label skew, and FedAvg
  with partial against full participation.
- ``merges``: every merge method beside the best client, the ensemble and the centralized oracle,
  each searched option chosen on the validation split (``experiments/merges.yaml``: independent
  inits, K = 2…5, aligned and not; ``experiments/merges_digits.yaml``: the default digits setting).
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from mergeflow.checkpoints import write_json
from mergeflow.config import apply_overrides, validate_params
from mergeflow.errors import ConfigError
from tasks.evaluation import SELECTION

PRESETS = {
    "linear-gaussian": "experiments/linear_gaussian.yaml",
    "pinwheel": "experiments/pinwheel.yaml",
    "alignment": "experiments/alignment.yaml",
    "federated": "experiments/federated.yaml",
    "participation": "experiments/participation.yaml",
    "merges": "experiments/merges.yaml",
}


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError([f"{path}: experiment preset not found"])
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping"])
    return data


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def _write(root: Path, name: str, data: dict[str, Any], table: str) -> Path:
    out = root / "results"
    write_json(out / f"{name}.json", data)
    (out / f"{name}.md").write_text(table)
    return out / f"{name}.md"


def linear_gaussian(preset: Path, root: Path) -> Path:
    """Closed-form linear-Gaussian merges; one results table per case in the preset."""
    from mergeflow.reproductions.linear_gaussian import LinearGaussianSettings, run_linear_gaussian
    from tasks.tracking import log_reproduction

    cases = _read_yaml(preset)
    results, text = {}, ""
    for case, raw in cases.items():
        try:
            settings = LinearGaussianSettings.model_validate(raw)
        except ValidationError as error:
            raise ConfigError([f"{preset}: {case}: {error}".replace("\n", " ")]) from None
        table, curves = run_linear_gaussian(settings)
        results[case] = {"settings": settings.model_dump(), "table": table}
        log_reproduction(root, f"linear-gaussian/{case}", settings.model_dump(), table, curves)
        metrics = ["relative_error_to_pooled_posterior", "parameter_mse_to_truth", "test_mse"]
        rows = [[method, *(f"{values[m]:.3g}" for m in metrics)] for method, values in table.items()]
        text += f"### {case}\n\n" + _markdown(["merge", *metrics], rows) + "\n"
    return _write(root, "linear_gaussian", results, text)


def _sweep_points(sweep: dict[str, list[Any]]) -> list[list[str]]:
    """Every combination of the sweep's values, as ``-S``-style overrides."""
    keys = list(sweep)
    combinations = itertools.product(*sweep.values())
    return [[f"{k}={json.dumps(v)}" for k, v in zip(keys, values, strict=True)] for values in combinations]


def _run_sweep(preset: Path, root: Path, name: str) -> list[dict[str, Any]]:
    """The pipeline once per sweep point, in one workspace (so unchanged stages are cache hits).

    A preset holds ``params`` (the base params), ``sweep`` (dotted key → values, every
    combination runs) and optionally ``clients``: per-client training settings, the first K
    used when the point has K clients (the SSF paper trains each model differently).
    """
    from flows.pipeline import run_pipeline

    spec = _read_yaml(preset)
    base, sweep, schedule = spec.get("params", {}), spec.get("sweep", {}), spec.get("clients", [])
    workspace = root / "results" / f"{name}-workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    runs = []
    for point in _sweep_points(sweep):
        raw = apply_overrides(base, point)
        if schedule:
            clients = raw["partition"]["num_clients"]
            raw.setdefault("finetune", {})["clients"] = {k: dict(s) for k, s in enumerate(schedule[:clients])}
        params = validate_params(raw, f"{preset}: {' '.join(point)}")
        run_pipeline(params, workspace)
        values = {key: str(yaml.safe_load(value)) for key, value in (p.split("=", 1) for p in point)}
        record = {"point": values, "params": params.model_dump(mode="json")}
        files = (("metrics", "metrics/evaluate.json"), ("align", "metrics/align.json"), ("selection", SELECTION))
        for key, path in files:
            record[key] = json.loads((workspace / path).read_text())
        record["federated"] = json.loads((workspace / "metrics/federated.json").read_text())
        runs.append(record)
    return runs


def _mean_std(values: list[float], digits: int = 4) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f}"


def _groups(runs: list[dict[str, Any]], keys: list[str]) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Runs grouped by the values of some sweep keys (the rest, e.g. seeds, are replicates)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(tuple(run["point"][k] for k in keys), []).append(run)
    return groups


def pinwheel(preset: Path, root: Path) -> Path:
    """SSF Table 1: test NLL of every merge by number of clients, mean ± std over seeds."""
    runs = _run_sweep(preset, root, "pinwheel")
    methods = runs[0]["params"]["merge"]["methods"]
    names = ["centralized", "ensemble", "best_client"] + [f"merged/{m}" for m in methods]
    rows = [
        [clients, *(_mean_std([r["metrics"][n]["nll"] for r in group]) for n in names)]
        for (clients,), group in _groups(runs, ["partition.num_clients"]).items()
    ]
    header = ["K", *(n.removeprefix("merged/") for n in names)]
    return _write(root, "pinwheel", {"runs": runs}, _markdown(header, rows))


_ALIGNMENT_MODELS = ("merged/average", "merged/fisher", "best_client", "ensemble")


def _mean_barrier(curves: dict[str, dict[str, Any]]) -> float:
    return statistics.mean(curve["barrier"] for curve in curves.values())


def alignment(preset: Path, root: Path) -> Path:
    """Barriers and merge accuracy by number of independently trained clients and alignment method."""
    runs = _run_sweep(preset, root, "alignment")
    rows = []
    for (clients, method), group in _groups(runs, ["partition.num_clients", "align.method"]).items():
        before = [_mean_barrier(r["align"]["before"]) for r in group]
        after = [_mean_barrier(r["align"]["after"] or r["align"]["before"]) for r in group]
        columns = [before, after]
        columns += [[r["metrics"][name]["accuracy"] for r in group] for name in _ALIGNMENT_MODELS]
        rows.append([clients, method, *(_mean_std(v, 3) for v in columns)])
    header = ["K", "align", "barrier before", "barrier after", *(f"{n} acc" for n in _ALIGNMENT_MODELS)]
    return _write(root, "alignment", {"runs": runs}, _markdown(header, rows))


_REFERENCES = ("best_client", "ensemble", "centralized")


def _chosen(record: dict[str, Any]) -> str:
    """The searched option values one search chose, e.g. ``density=0.5, scaling=1.0``."""
    options = record["candidates"][record["chosen"]]["options"]
    return ", ".join(f"{key}={options[key]}" for key in record["searched"])


def merges(preset: Path, root: Path) -> Path:
    """Test accuracy of every merge method by sweep group (mean ± std over seeds), beside the best client,
    the ensemble and the centralized oracle; and the option values each search chose on validation."""
    runs = _run_sweep(preset, root, preset.stem)
    group_keys = [k for k in _read_yaml(preset).get("sweep", {}) if k != "seed"]
    names = [f"merged/{m}" for m in runs[0]["params"]["merge"]["methods"]] + list(_REFERENCES)
    rows, choices = [], []
    for values, group in _groups(runs, group_keys).items():
        rows.append([*values, *(_mean_std([r["metrics"][n]["accuracy"] for r in group], 3) for n in names)])
        for merge in group[0]["selection"]:
            choices.append([*values, merge, "; ".join(_chosen(r["selection"][merge]) for r in group)])
    header = [*group_keys, *(n.removeprefix("merged/") for n in names)]
    text = "### Test accuracy (mean ± std over seeds; searched options chosen on validation)\n\n"
    text += _markdown(header, rows)
    if choices:
        text += "\n### Chosen on validation (one entry per seed)\n\n"
        text += _markdown([*group_keys, "merge", "chosen"], choices)
    return _write(root, preset.stem, {"runs": runs}, text)


_LAST_ROUNDS = 3  # the Bayes-ADMM reference reports the mean of the last 3 rounds


def _last_rounds(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows[-_LAST_ROUNDS:] if key in row]
    return statistics.mean(values) if values else None


def _cell(values: list[float | None]) -> str:
    return "" if any(v is None for v in values) else _mean_std(values, 3)


def federated(preset: Path, root: Path) -> Path:
    """Each federated algorithm's test accuracy by sweep group: final round, mean of the last 3 rounds
    (at the mean and, for Gaussian models, by the Monte-Carlo predictive), and on validation."""
    runs = _run_sweep(preset, root, preset.stem)
    spec = _read_yaml(preset)
    group_keys = [k for k in spec.get("sweep", {}) if k != "seed"]
    algorithms = runs[0]["params"]["federated"]["algorithms"]
    header = [
        *group_keys,
        "algorithm",
        "test, final round",
        f"test, last {_LAST_ROUNDS}",
        f"test predictive, last {_LAST_ROUNDS}",
        f"validation, last {_LAST_ROUNDS}",
        "final − centralized",
    ]
    text, rows = "", []
    for values, group in _groups(runs, group_keys).items():
        for a in algorithms:
            curves = [r["federated"][a] for r in group]
            rows.append(
                [
                    *values,
                    a,
                    _mean_std([r["metrics"][f"federated/{a}"]["accuracy"] for r in group], 3),
                    *(
                        _cell([_last_rounds(c, key) for c in curves])
                        for key in ("accuracy", "bma_accuracy", "val_accuracy")
                    ),
                    _mean_std([r["metrics"][f"federated/{a}"]["accuracy_gain"] for r in group], 3),
                ]
            )
        oracle = _mean_std([r["metrics"]["centralized"]["accuracy"] for r in group], 3)
        rows.append([*values, "centralized", oracle, "", "", "", ""])
        rounds = len(group[0]["federated"][algorithms[0]])
        curve_rows = [
            [str(t), *(f"{statistics.mean(r['federated'][a][t]['accuracy'] for r in group):.3f}" for a in algorithms)]
            for t in range(rounds)
        ]
        label = ", ".join(f"{k}={v}" for k, v in zip(group_keys, values, strict=True))
        text += f"\n### Test accuracy per round ({label}; mean over seeds)\n\n"
        text += _markdown(["round", *algorithms], curve_rows)
    samples = runs[0]["params"]["federated"]["predictive_samples"]
    table = f"### Accuracy (mean ± std over seeds; the predictive averages {samples} sampled models)\n\n"
    return _write(root, preset.stem, {"runs": runs}, table + _markdown(header, rows) + text)


def reproduce(name: str, root: Path, preset: str | None = None) -> Path:
    """Run one reproduction by name; return the path of its markdown table."""
    runners = {
        "linear-gaussian": linear_gaussian,
        "pinwheel": pinwheel,
        "alignment": alignment,
        "federated": federated,
        "participation": federated,
        "merges": merges,
    }
    if name not in runners:
        raise ConfigError([f"reproduce: unknown experiment {name!r}; known: {', '.join(runners)}"])
    return runners[name](Path(preset or root / PRESETS[name]), root)
