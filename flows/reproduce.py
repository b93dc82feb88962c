"""Reproductions of the papers' experiments, each an experiment preset under ``experiments/``.

``mergeflow reproduce NAME`` runs one and writes ``results/NAME.json`` and ``results/NAME.md``.

- ``linear-gaussian``: SSF §3.1 in closed form (``mergeflow.reproductions.linear_gaussian``).
  Its per-step SSF curves go to MLflow as step metrics.
- ``pinwheel``: SSF Table 1 through the real pipeline, once per point of the preset's
  ``sweep`` (number of clients × seeds), in a workspace of its own under ``results/``;
  every pipeline run is logged to MLflow as usual.
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

PRESETS = {"linear-gaussian": "experiments/linear_gaussian.yaml", "pinwheel": "experiments/pinwheel.yaml"}


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


def pinwheel(preset: Path, root: Path) -> Path:
    """The pipeline once per sweep point; test NLL of every merge, mean ± std over seeds."""
    from flows.pipeline import run_pipeline

    spec = _read_yaml(preset)
    base, sweep, schedule = spec.get("params", {}), spec.get("sweep", {}), spec.get("clients", [])
    workspace = root / "results" / "pinwheel-workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    runs = []
    for point in _sweep_points(sweep):
        raw = apply_overrides(base, point)
        clients = raw["partition"]["num_clients"]
        raw.setdefault("finetune", {})["clients"] = {k: dict(s) for k, s in enumerate(schedule[:clients])}
        params = validate_params(raw, f"{preset}: {' '.join(point)}")
        run_pipeline(params, workspace)
        metrics = json.loads((workspace / "metrics/evaluate.json").read_text())
        runs.append({"clients": params.partition.num_clients, "seed": params.seed, "metrics": metrics})
    names = ["centralized", "ensemble", "best_client"] + [f"merged/{m}" for m in base["merge"]["methods"]]
    rows = []
    for clients in sorted({r["clients"] for r in runs}):
        group = [r["metrics"] for r in runs if r["clients"] == clients]
        cells = []
        for name in names:
            values = [m[name]["nll"] for m in group]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.4f} ± {spread:.4f}")
        rows.append([str(clients), *cells])
    header = ["K", *(n.removeprefix("merged/") for n in names)]
    return _write(root, "pinwheel", {"runs": runs}, _markdown(header, rows))


def reproduce(name: str, root: Path, preset: str | None = None) -> Path:
    """Run one reproduction by name; return the path of its markdown table."""
    runners = {"linear-gaussian": linear_gaussian, "pinwheel": pinwheel}
    if name not in runners:
        raise ConfigError([f"reproduce: unknown experiment {name!r}; known: {', '.join(runners)}"])
    return runners[name](Path(preset or root / PRESETS[name]), root)
