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
- ``averaging-laws``: FedAvg's accuracy gain over centralized training against each transformer's
  compute budget, IID and non-IID (one domain per client), full and partial participation, and
  seen against unseen domains (:mod:`mergeflow.reproductions.averaging_laws`).
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
    "averaging-laws": "experiments/averaging_laws.yaml",
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


# The settings the averaging-laws analysis reads, by their names in the preset (any may be left out but
# the reference): the centralized reference, the IID − non-IID gap, partial participation, seen/unseen.
LAWS_REFERENCE, LAWS_NON_IID = "iid", "non-iid"
LAWS_PARTIAL = ("iid-partial", "non-iid-partial")
LAWS_SEEN_UNSEEN = "seen-unseen"


def averaging_laws(preset: Path, root: Path) -> Path:
    """The parameter-averaging-laws sweep: every model × setting × seed of the preset through the
    pipeline in one workspace (so each model's data, pre-training and centralized model are shared
    across settings, and a second run or an added seed runs only what is new); then the gain table,
    the seen/unseen table, the correlations of gain with compute and the two plots.

    The preset holds ``params`` (the base), ``seeds``, ``settings`` (name → dotted overrides; ``iid``
    is required, as the centralized reference) and ``models`` (name → ``params`` overrides, and for a
    published model ``package``, a module whose ``get_model_path()`` is its directory, with ``tokens``
    and ``tokens_source``, its declared pre-training tokens).
    """
    from mergeflow.reproductions import averaging_laws as laws

    spec = _read_yaml(preset)
    settings, models, seeds = spec.get("settings", {}), spec.get("models", {}), spec.get("seeds", [0])
    if LAWS_REFERENCE not in settings or not models:
        raise ConfigError([f"{preset}: needs settings (with {LAWS_REFERENCE!r}) and models"])
    workspace = root / "results" / "averaging_laws-workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    runs, facts, notes = [], {}, []
    for seed in seeds:
        for model, entry in models.items():
            overrides = dict(entry.get("params", {}))
            if "package" in entry:
                path = _package_model(entry["package"])
                if path is None:
                    note = f"{model}: left out, its package {entry['package']!r} is not installed"
                    notes += [note] if note not in notes else []
                    continue
                overrides["model.hf.pretrained"] = path
            for setting, changes in settings.items():
                record, state_facts = _laws_run(spec, overrides | changes | {"seed": seed}, workspace, preset)
                runs.append(laws.RunResult(model=model, setting=setting, seed=seed, **record))
                if model not in facts:
                    tokens = entry.get("tokens", state_facts["tokens"])
                    source = entry.get("tokens_source", "counted: pre-training epochs × non-padding tokens")
                    facts[model] = laws.ModelFacts(
                        model, state_facts["parameters"], float(tokens), source, state_facts["vocabulary"]
                    )
    return _laws_report(root, runs, facts, spec, notes)


def _package_model(module: str) -> str | None:
    """The model directory a pip-installed model package ships (its ``get_model_path()``), or None."""
    import importlib

    try:
        return str(importlib.import_module(module).get_model_path())
    except ImportError:
        return None


def _laws_run(spec: dict[str, Any], changes: dict[str, Any], workspace: Path, preset: Path):
    """One pipeline run of the sweep; its :class:`RunResult` fields, and the model's N and counted tokens."""
    from safetensors.torch import load_file

    from flows.runs import run_and_record
    from mergeflow.checkpoints import load_checkpoint_meta
    from mergeflow.federated import sample_participants
    from mergeflow.reproductions.averaging_laws import non_embedding_parameters
    from tasks.data import client_file, read_groups
    from tasks.training import BASE

    point = [f"{key}={json.dumps(value)}" for key, value in changes.items()]
    params = validate_params(apply_overrides(spec.get("params", {}), point), f"{preset}: {' '.join(point)}")
    run_and_record(params, workspace)
    metrics = json.loads((workspace / "metrics/evaluate.json").read_text())
    federated, central = metrics["federated/fedavg"], metrics["centralized"]
    clients = params.partition.num_clients
    domains = [read_groups(workspace / client_file(k)) for k in range(clients)]
    takers = {
        k
        for r in range(params.federated.rounds)
        for k in sample_participants(clients, params.federated.fraction, params.seed, r)
    }
    seen = sorted({str(g) for k in takers for g in set(domains[k].tolist())}) if domains[0] is not None else []
    record = {
        "federated": federated["accuracy"],
        "centralized": central["accuracy"],
        "federated_by_domain": {g: v["accuracy"] for g, v in federated.get("by_group", {}).items()},
        "centralized_by_domain": {g: v["accuracy"] for g, v in central.get("by_group", {}).items()},
        "seen_domains": tuple(seen),
    }
    meta = load_checkpoint_meta(workspace / BASE)
    info = json.loads((workspace / "data/prepared/info.json").read_text())
    facts = {
        "parameters": non_embedding_parameters(load_file(workspace / BASE)),
        "tokens": meta.get("language_model_tokens", 0),
        "vocabulary": info["tokenizer"]["vocab_size"],
    }
    return record, facts


def _points(values: list[float]) -> str:
    """Accuracy differences in points, mean ± std over seeds."""
    return _mean_std([100 * v for v in values], 2) if values else ""


def _laws_report(root: Path, runs: list, facts: dict, spec: dict[str, Any], notes: list[str]) -> Path:
    """The tables (results/averaging_laws.md), the runs and facts (.json) and the plots (.png)."""
    from dataclasses import asdict

    from mergeflow.reproductions import averaging_laws as laws

    settings = spec["settings"]
    gain = laws.gains(runs, LAWS_REFERENCE)
    models = sorted(facts, key=lambda m: facts[m].compute)
    by_model = {m: [r for r in runs if r.model == m] for m in models}
    fact_rows = [
        [
            m,
            f"{facts[m].parameters:,}",
            str(facts[m].vocabulary),
            f"{facts[m].tokens:.3g} ({facts[m].tokens_source})",
            f"{facts[m].compute:.3g}",
            _mean_std([r.centralized for r in by_model[m] if r.setting == LAWS_REFERENCE], 3),
        ]
        for m in models
    ]
    text = "### Models (centralized: test accuracy at its best epoch on validation)\n\n"
    text += _markdown(
        ["model", "N (non-embedding)", "vocabulary", "pre-training tokens", "6·N·tokens", "centralized"], fact_rows
    )
    columns = [s for s in (LAWS_REFERENCE, LAWS_NON_IID, *LAWS_PARTIAL, LAWS_SEEN_UNSEEN) if s in settings]
    rows = []
    for m in models:
        cells = [_points([v for (mm, s, _), v in gain.items() if mm == m and s == c]) for c in columns]
        if LAWS_NON_IID in settings:
            seeds = sorted({seed for (mm, s, seed) in gain if mm == m and s == LAWS_NON_IID})
            cells.append(_points([gain[(m, LAWS_REFERENCE, x)] - gain[(m, LAWS_NON_IID, x)] for x in seeds]))
        rows.append([m, *cells])
    gap = [f"gap {LAWS_REFERENCE} − {LAWS_NON_IID}"] if LAWS_NON_IID in settings else []
    text += "\n### Accuracy gain of FedAvg (final round) over centralized, test, points (mean ± std over seeds)\n\n"
    text += _markdown(["model", *columns, *gap], rows)
    if LAWS_SEEN_UNSEEN in settings:
        cells = laws.seen_unseen(runs, LAWS_SEEN_UNSEEN)
        keys = ("federated_seen", "federated_unseen", "centralized_seen", "centralized_unseen")
        seen_rows = [[m, *(_mean_std(cells[m].get(k, []), 3) if cells[m].get(k) else "" for k in keys),
                      str(len(cells[m].get("federated_unseen", [])))] for m in models if m in cells]  # fmt: skip
        text += f"\n### Seen and unseen domains ({LAWS_SEEN_UNSEEN}: test accuracy, mean over domains, then seeds)\n\n"
        text += _markdown(["model", "FedAvg seen", "FedAvg unseen", "centralized seen", "centralized unseen",
                           "seeds with an unseen domain"], seen_rows)  # fmt: skip
    correlation_rows, correlation_data = [], {}
    for setting in (LAWS_REFERENCE, LAWS_NON_IID):
        if setting in settings:
            values = laws.correlations(facts, gain, setting, models)
            correlation_data[setting] = values
            if values["pearson"]:
                correlation_rows.append([setting, _mean_std(values["pearson"], 2), _mean_std(values["spearman"], 2),
                                         str(len(values["pearson"]))])  # fmt: skip
    if correlation_rows:
        text += "\n### Correlation of gain with compute budget (per seed, over models; mean ± std over seeds)\n\n"
        text += _markdown(["setting", "Pearson (log10 compute)", "Spearman", "seeds"], correlation_rows)
    pair = [m for m in spec.get("vocabulary", []) if m in facts]
    if len(pair) == 2:
        header = ["setting", *(f"{m} (vocabulary {facts[m].vocabulary})" for m in pair)]
        vocabulary_rows = [
            [c, *(_points([v for (mm, s, _), v in gain.items() if mm == m and s == c]) for m in pair)] for c in columns
        ]
        text += "\n### Vocabulary: gain in points of two models that differ only in their vocabulary\n\n"
        text += _markdown(header, vocabulary_rows)
    series = {s: s for s in (LAWS_REFERENCE, LAWS_NON_IID, *LAWS_PARTIAL) if s in settings}
    gap_pair = (LAWS_REFERENCE, LAWS_NON_IID) if LAWS_NON_IID in settings else (LAWS_REFERENCE, LAWS_REFERENCE)
    plot = root / "results" / "averaging_laws.png"
    laws.plot_laws(facts, gain, series, gap_pair, plot)
    text += f"\nPlots: {plot.name} (gain and gap against compute budget).\n"
    if notes:
        text += "\n" + "\n".join(f"- {note}" for note in notes) + "\n"
    data = {
        "runs": [asdict(r) for r in runs],
        "models": {m: {**asdict(f), "compute": f.compute} for m, f in facts.items()},
        "correlations": correlation_data,
        "notes": notes,
    }
    return _write(root, "averaging_laws", data, text)


def reproduce(name: str, root: Path, preset: str | None = None) -> Path:
    """Run one reproduction by name; return the path of its markdown table."""
    runners = {
        "linear-gaussian": linear_gaussian,
        "pinwheel": pinwheel,
        "alignment": alignment,
        "federated": federated,
        "participation": federated,
        "merges": merges,
        "averaging-laws": averaging_laws,
    }
    if name not in runners:
        raise ConfigError([f"reproduce: unknown experiment {name!r}; known: {', '.join(runners)}"])
    return runners[name](Path(preset or root / PRESETS[name]), root)
