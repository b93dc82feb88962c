"""The paper reproductions' runners: ``mergeflow reproduce NAME`` runs one and writes ``results/NAME.json`` and
``results/NAME.md``. Each is declared, with its default preset and what it reproduces, in
:mod:`flows.reproduction_registry`; the analyses are :mod:`mergeflow.reproductions`'.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flows.reproduction_registry import REPRODUCTIONS
from mergeflow.config import apply_overrides, validate_params
from mergeflow.errors import ConfigError
from mergeflow.files import write_json
from mergeflow.preflight import check_model, check_paths
from mergeflow.reproductions.tables import markdown_table, mean_std_cell
from tasks.layout import (
    ALIGN_METRICS,
    ALIGNED,
    CLIENTS,
    FEDERATED,
    FEDERATED_METRICS,
    FISHERS,
    METRICS,
    PREPARED,
    SELECTION,
)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError([f"{path}: experiment preset not found"])
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping"])
    return data


def _write(root: Path, name: str, data: dict[str, Any], table: str) -> Path:
    out = root / "results"
    write_json(out / f"{name}.json", data)
    (out / f"{name}.md").write_text(table)
    return out / f"{name}.md"


def linear_gaussian(preset: Path, root: Path) -> Path:
    """Closed-form linear-Gaussian merges; one results table per case in the preset."""
    from flows.reproduction_logging import log_reproduction
    from mergeflow.reproductions.linear_gaussian import LinearGaussianSettings, run_linear_gaussian

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
        text += f"### {case}\n\n" + markdown_table(["merge", *metrics], rows) + "\n"
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
        check_paths(params, f"{preset}: {' '.join(point)}")
        check_model(params, f"{preset}: {' '.join(point)}")
        run_pipeline(params, workspace)
        values = {key: str(yaml.safe_load(value)) for key, value in (p.split("=", 1) for p in point)}
        record = {"point": values, "params": params.model_dump(mode="json")}
        files = (("metrics", METRICS), ("align", ALIGN_METRICS), ("selection", SELECTION))
        for key, path in files:
            record[key] = json.loads((workspace / path).read_text())
        record["federated"] = json.loads((workspace / FEDERATED_METRICS).read_text())
        runs.append(record)
    return runs


def _groups(runs: list[dict[str, Any]], keys: list[str]) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Runs grouped by the values of some sweep keys (the rest, e.g. seeds, are replicates)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(tuple(run["point"][k] for k in keys), []).append(run)
    return groups


def pinwheel(preset: Path, root: Path) -> Path:
    """SSF Table 1: test NLL of every merge by number of clients, mean ± std over seeds, and the merges
    ordered by their mean (lowest first)."""
    runs = _run_sweep(preset, root, preset.stem)
    methods = runs[0]["params"]["merge"]["methods"]
    names = ["centralized", "ensemble", "best_client"] + [f"merged/{m}" for m in methods]
    rows = []
    for (clients,), group in _groups(runs, ["partition.num_clients"]).items():
        nll = {name: [r["metrics"][name]["nll"] for r in group] for name in names}
        order = sorted(methods, key=lambda m: statistics.mean(nll[f"merged/{m}"]))
        rows.append([clients, *(mean_std_cell(nll[n]) for n in names), " < ".join(order)])
    header = ["K", *(n.removeprefix("merged/") for n in names), "merges by mean NLL"]
    text = markdown_table(header, rows) + _choices_table(runs, ["partition.num_clients"])
    return _write(root, preset.stem, {"runs": runs}, text)


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
        rows.append([clients, method, *(mean_std_cell(v, 3) for v in columns)])
    header = ["K", "align", "barrier before", "barrier after", *(f"{n} acc" for n in _ALIGNMENT_MODELS)]
    return _write(root, "alignment", {"runs": runs}, markdown_table(header, rows))


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
    rows = []
    for values, group in _groups(runs, group_keys).items():
        rows.append([*values, *(mean_std_cell([r["metrics"][n]["accuracy"] for r in group], 3) for n in names)])
    header = [*group_keys, *(n.removeprefix("merged/") for n in names)]
    text = "### Test accuracy (mean ± std over seeds; searched options chosen on validation)\n\n"
    text += markdown_table(header, rows) + _choices_table(runs, group_keys)
    return _write(root, preset.stem, {"runs": runs}, text)


def _choices_table(runs: list[dict[str, Any]], group_keys: list[str]) -> str:
    """The option values each searched merge chose on validation, one entry per seed ("" without searches)."""
    choices = []
    for values, group in _groups(runs, group_keys).items():
        for merge in group[0]["selection"]:
            choices.append([*values, merge, "; ".join(_chosen(r["selection"][merge]) for r in group)])
    if not choices:
        return ""
    return "\n### Chosen on validation (one entry per seed)\n\n" + markdown_table(
        [*group_keys, "merge", "chosen"], choices
    )


_LAST_ROUNDS = 3  # the Bayes-ADMM reference reports the mean of the last 3 rounds


def _last_rounds(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows[-_LAST_ROUNDS:] if key in row]
    return statistics.mean(values) if values else None


def _cell(values: list[float | None]) -> str:
    return "" if any(v is None for v in values) else mean_std_cell(values, 3)


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
                    mean_std_cell([r["metrics"][f"federated/{a}"]["accuracy"] for r in group], 3),
                    *(
                        _cell([_last_rounds(c, key) for c in curves])
                        for key in ("accuracy", "bma_accuracy", "val_accuracy")
                    ),
                    mean_std_cell([r["metrics"][f"federated/{a}"]["accuracy_gain"] for r in group], 3),
                ]
            )
        oracle = mean_std_cell([r["metrics"]["centralized"]["accuracy"] for r in group], 3)
        rows.append([*values, "centralized", oracle, "", "", "", ""])
        rounds = len(group[0]["federated"][algorithms[0]])
        curve_rows = [
            [str(t), *(f"{statistics.mean(r['federated'][a][t]['accuracy'] for r in group):.3f}" for a in algorithms)]
            for t in range(rounds)
        ]
        label = ", ".join(f"{k}={v}" for k, v in zip(group_keys, values, strict=True))
        text += f"\n### Test accuracy per round ({label}; mean over seeds)\n\n"
        text += markdown_table(["round", *algorithms], curve_rows)
    samples = runs[0]["params"]["federated"]["predictive_samples"]
    table = f"### Accuracy (mean ± std over seeds; the predictive averages {samples} sampled models)\n\n"
    return _write(root, preset.stem, {"runs": runs}, table + markdown_table(header, rows) + text)


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
    if laws.REFERENCE not in settings or not models:
        raise ConfigError([f"{preset}: needs settings (with {laws.REFERENCE!r}) and models"])
    workspace = root / "results" / f"{preset.stem}-workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    runs, facts, notes = [], {}, []
    overrides = {}
    for model, entry in models.items():
        path = _package_model(entry["package"]) if "package" in entry else None
        if "package" in entry and path is None:
            notes.append(f"{model}: left out, its package {entry['package']!r} is not installed")
            continue
        overrides[model] = dict(entry.get("params", {})) | ({"model.transformers.pretrained": path} if path else {})
    for seed in seeds:
        for model, entry in models.items():
            if model not in overrides:
                continue
            outcomes: list[dict[str, Any]] = []
            for setting, changes in settings.items():
                point = overrides[model] | changes | {"seed": seed}
                record, state_facts = _laws_run(spec, point, workspace, preset, outcomes)
                _drop_bulky_blobs(workspace, outcomes, _ROUNDS)  # no other setting reads a run's rounds
                record["seen_domains"] = tuple(record["seen_domains"])
                runs.append(laws.RunResult(model=model, setting=setting, seed=seed, **record))
                if model not in facts:
                    tokens = entry.get("tokens", state_facts["tokens"])
                    source = entry.get("tokens_source", "counted: pre-training epochs × non-padding tokens")
                    facts[model] = laws.ModelFacts(
                        model, state_facts["parameters"], float(tokens), source, state_facts["vocabulary"]
                    )
            _drop_bulky_blobs(workspace, outcomes)
    return _laws_report(root, preset.stem, runs, facts, spec, notes)


# The per-client and per-round checkpoints of a run (clients, their Fishers and aligned copies, every
# round's messages): tens of GB over the sweep. The settings of a model and seed share the first ones.
_ROUNDS = (f"{FEDERATED}/",)
_BULKY = (f"{CLIENTS}/", f"{FISHERS}/", f"{ALIGNED}/", *_ROUNDS)
_LAWS_RECORDS = "records"


def _drop_bulky_blobs(workspace: Path, outcomes: list[dict[str, Any]], prefixes: tuple[str, ...] = _BULKY) -> None:
    """Delete from the workspace's store the blobs that only outputs under ``prefixes`` use: the runs'
    results are kept as records, and a step whose blobs are gone is a cache miss, never an error."""
    from tasks.store import ArtifactStore

    bulky, kept = set(), set()
    for outcome in outcomes:
        for rel, digest in outcome["files"].items():
            (bulky if rel.startswith(prefixes) else kept).add(digest)
    store = ArtifactStore(workspace)
    for digest in bulky - kept:
        store.blob(digest).unlink(missing_ok=True)


def _code_hashes() -> dict[str, str]:
    """The code a sweep run's record comes from, by file (sha256), as the cache keys see code: every stage's
    (:attr:`tasks.stages.Stage.code`, the import closures of its steps' modules) and the import closure of
    this module, which reads the record from the run's outputs. A record is reused only with the same code."""
    from tasks.stages import STAGES
    from tasks.steps import code_closure, project_root_of_code
    from tasks.store import hash_paths

    files = {*code_closure((__name__,)), *(path for stage in STAGES for path in stage.code)}
    return hash_paths(project_root_of_code(), sorted(files))


def _package_model(module: str) -> str | None:
    """The model directory a pip-installed model package ships (its ``get_model_path()``), or None."""
    import importlib

    try:
        return str(importlib.import_module(module).get_model_path())
    except ImportError:
        return None


def _laws_run(
    spec: dict[str, Any], changes: dict[str, Any], workspace: Path, preset: Path, outcomes: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run of the sweep: its :class:`RunResult` fields and the model's N, counted tokens and vocabulary,
    from its record when the same params already ran with the same code, else from a pipeline run (whose
    step outcomes are added to ``outcomes``)."""
    import hashlib

    point = [f"{key}={json.dumps(value)}" for key, value in changes.items()]
    params = validate_params(apply_overrides(spec.get("params", {}), point), f"{preset}: {' '.join(point)}")
    check_paths(params, f"{preset}: {' '.join(point)}")
    check_model(params, f"{preset}: {' '.join(point)}")
    if "fedavg" not in params.federated.algorithms:
        raise ConfigError([f"{preset}: federated.algorithms: the averaging laws are FedAvg's; list fedavg"])
    identity = json.dumps({"params": params.model_dump(mode="json"), "code": _code_hashes()}, sort_keys=True)
    path = workspace / _LAWS_RECORDS / f"{hashlib.sha256(identity.encode()).hexdigest()}.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        return saved["record"], saved["facts"]
    record, facts = _laws_pipeline_run(params, workspace, outcomes)
    write_json(path, {"record": record, "facts": facts})
    return record, facts


def _laws_pipeline_run(params, workspace: Path, outcomes: list[dict[str, Any]]):
    """Run the pipeline on ``params`` and read what the analysis needs from its outputs."""
    from safetensors.torch import load_file

    from flows.runs import run_and_record
    from mergeflow.checkpoints import load_checkpoint_meta
    from mergeflow.federated import sample_participants
    from mergeflow.reproductions.averaging_laws import non_embedding_parameters
    from tasks.layout import BASE, client_file
    from tasks.prepared import read_groups

    outcomes += run_and_record(params, workspace)[0]
    metrics = json.loads((workspace / METRICS).read_text())
    federated, central = metrics["federated/fedavg"], metrics.get("centralized", {})
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
        "centralized": central.get("accuracy"),
        "federated_by_domain": {g: v["accuracy"] for g, v in federated.get("by_group", {}).items()},
        "centralized_by_domain": {g: v["accuracy"] for g, v in central.get("by_group", {}).items()},
        "seen_domains": seen,
    }
    meta = load_checkpoint_meta(workspace / BASE)
    info = json.loads((workspace / PREPARED / "info.json").read_text())
    facts = {
        "parameters": non_embedding_parameters(load_file(workspace / BASE)),
        "tokens": meta.get("language_model_tokens", 0),
        "vocabulary": info["tokenizer"]["vocab_size"],
    }
    return record, facts


def _laws_report(root: Path, name: str, runs: list, facts: dict, spec: dict[str, Any], notes: list[str]) -> Path:
    """The tables (results/NAME.md, NAME being the preset's stem), the runs and facts (.json) and the plots
    (.png)."""
    from dataclasses import asdict

    from mergeflow.reproductions import averaging_laws as laws

    settings = list(spec["settings"])
    text, correlations = laws.report(runs, facts, settings, spec.get("vocabulary", []))
    notes = notes + [f"{m}: no pre-training tokens counted, so no compute budget: left out of the correlations "
                     "and plots" for m, f in facts.items() if f.compute == 0]  # fmt: skip
    series = [s for s in (laws.REFERENCE, laws.NON_IID, *laws.PARTIAL) if s in settings]
    gap = (laws.REFERENCE, laws.NON_IID) if laws.NON_IID in settings else None
    plot = root / "results" / f"{name}.png"
    laws.plot_laws(facts, laws.gains(runs, laws.REFERENCE), series, gap, plot)
    text += f"\nPlots: {plot.name} (gain and gap against compute budget).\n"
    text += "".join(f"\n- {note}" for note in notes) + ("\n" if notes else "")
    data = {
        "runs": [asdict(r) for r in runs],
        "models": {m: {**asdict(f), "compute": f.compute} for m, f in facts.items()},
        "correlations": correlations,
        "notes": notes,
    }
    return _write(root, name, data, text)


def _loop_inputs(preset: Path, root: Path, name: str):
    """The preset's spec and the plain loop's inputs, from a workspace whose data, partition and base
    model the pipeline prepares (results/NAME-workspace)."""
    from flows.pipeline import run_pipeline
    from mergeflow.federated import LocalTraining
    from mergeflow.reproductions.robustness import LoopInputs
    from tasks.federated import loop_inputs, validation_data

    spec = _read_yaml(preset)
    params = validate_params(spec.get("params", {}), str(preset))
    check_paths(params, str(preset))
    check_model(params, str(preset))
    workspace = root / "results" / f"{name}-workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    run_pipeline(params, workspace, stages=["prepare", "partition", "pretrain"])
    builder, clients, test = loop_inputs(workspace, params.partition.num_clients)
    federated = params.federated
    train = federated.local_for(federated.algorithms[0]).model_dump(mode="json")
    from tasks.prepared import read_info

    inputs = LoopInputs(
        builder,
        clients,
        test,
        validation_data(workspace),
        LocalTraining(**train),
        federated.rounds,
        federated.fraction,
        read_info(workspace).get("num_classes"),
    )
    return spec, params, inputs


def _split_note(params) -> str:
    data, partition = params.data, params.partition
    return (
        f"digits ({data.source}), {partition.num_clients} clients, Dirichlet α = {partition.alpha}, "
        f"{params.federated.rounds} rounds, test split {data.test_fraction}, validation {data.validation_fraction} "
        "(settings chosen on validation; accuracies on test)"
    )


def robustness(preset: Path, root: Path) -> Path:
    """Each aggregator against 0–3 attackers of each kind (the preset's ``aggregators``), and the server
    optimizers against FedAvg (its ``server_optimizers``): either part, or both."""
    from mergeflow.reproductions.robustness import (
        robustness_grid,
        robustness_tables,
        server_optimizer_grid,
        server_optimizer_table,
    )

    spec, params, inputs = _loop_inputs(preset, root, "robustness")
    text, data = f"{_split_note(params)}\n", {}
    if spec.get("aggregators"):
        data["robustness"] = records = robustness_grid(inputs, spec)
        text += "\n### Aggregators against attacks (final test accuracy; attacked messages kept / sent over all"
        text += " rounds, a coordinate-wise rule counting the share of coordinates kept)\n"
        text += robustness_tables(records, spec)
    if spec.get("server_optimizers"):
        data["server_optimizers"] = servers = server_optimizer_grid(inputs, spec)
        seeds = len(spec["server_seeds"])
        text += f"\n### Server optimizers ({seeds} seeds)\n\n" + server_optimizer_table(
            servers, spec["target_accuracy"]
        )
    return _write(root, preset.stem, data, text)


def privacy(preset: Path, root: Path) -> Path:
    """DP-FedAvg's final test accuracy against ε (several noise levels, seeds)."""
    from mergeflow.reproductions.robustness import privacy_grid, privacy_table

    spec, params, inputs = _loop_inputs(preset, root, "privacy")
    results = privacy_grid(inputs, spec)
    text = f"{_split_note(params)}; Poisson sampling q = {params.federated.fraction}\n\n"
    text += (
        f"### DP-FedAvg (clip {results['clip']} chosen on validation; mean ± std over {len(spec['seeds'])} seeds)\n\n"
    )
    return _write(root, "privacy", results, text + privacy_table(results))


def reproduce(name: str, root: Path, preset: str | None = None) -> Path:
    """Run one reproduction by name; return the path of its markdown table."""
    reproduction = REPRODUCTIONS.lookup(name)
    return reproduction.load()(Path(preset or root / reproduction.preset), root)
