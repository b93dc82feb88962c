"""Wall time of FedAvg (10 clients, 5 rounds): the plain loop vs mergeflow's Prefect flow vs Flower's simulation.

Usage:
    python bench/federated_speed.py [--epochs 2] [--workers 1 2] [--steps-per-task auto 1 10] [--repeat 3]
                                    [--flower-python /tmp/flwr-venv/bin/python]
    (Prefect logs go to stderr: append ``2>/dev/null`` to see only the table.)

Flower runs in its own venv (it is no dependency of mergeflow), made once with:
    python3 -m venv /tmp/flwr-venv
    /tmp/flwr-venv/bin/pip install torch==2.13.0 "flwr[simulation]" scikit-learn safetensors
Without it the Flower rows are skipped with a note.

One fresh workspace (digits, Dirichlet α = 0.5 over 10 clients, MLP 64-128-10, the params.yaml local SGD
settings) is prepared by the pipeline's prepare, partition and pretrain stages, outside the timing, after a
throw-away flow that starts Prefect's ephemeral server (also outside the timing). Then, in this process:

- the plain loop: ``mergeflow.federated.run_rounds`` on the workspace's partitions and base model;
- the flow: the ``federated`` stage alone through ``flows.pipeline.run_pipeline``, cold (the ``.mergeflow``
  store and Prefect results deleted first, so no cache hit) for each ``--workers`` and ``--steps-per-task``
  value; after the first, cold again with the store's (empty) blob folders kept, as a later run after a
  change finds them (a first run creates a few hundred folders: a millisecond each on a slow disk), and a
  fully cached re-run (each the best of ``--repeat`` runs, like the loop: the machine is shared);
- Flower: ``bench/flower_fedavg.py`` in the other venv, on the same partitions, base model, per-(round,
  client) shuffling seeds and local training, timed inside that process (``ray.init`` apart).

The table gives each way's wall seconds, its ratio to the plain loop, CPU seconds (user + system of this
process and its children, i.e. with Prefect's server: less sensitive than wall time to other load on a shared
machine; not measured for Flower, whose Ray processes are gone when it returns), the final test accuracy
(mergeflow's evaluation of each way's final global model) and whether the final weights equal the loop's bit
for bit. Wall and CPU seconds are each the least over ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
PREP_STAGES = ["prepare", "partition", "pretrain"]
FLOWER_SCRIPT = Path(__file__).resolve().parent / "flower_fedavg.py"


@dataclass
class Row:
    """One line of the table."""

    way: str
    seconds: float
    cpu: float | None
    accuracy: float | None
    identical: str


def cpu_seconds() -> tuple[float, float]:
    """User + system CPU seconds of this process and of its live descendants (Prefect's server), from /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        return time.process_time(), 0.0
    parents, usage = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        usage[pid] = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    descendants, frontier = set(), [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in descendants]
        descendants.update(children)
        frontier += children
    tick = os.sysconf("SC_CLK_TCK")
    return usage.get(os.getpid(), 0) / tick, sum(usage.get(pid, 0) for pid in descendants) / tick


@dataclass
class Timing:
    """Best of several runs: least wall seconds (and that run's result), least CPU seconds (and its split)."""

    wall: float = float("inf")
    cpu: float = float("inf")
    cpu_own: float = 0.0
    cpu_children: float = 0.0
    result: Any = None


def best_of(repeat: int, run: Callable[[], Any]) -> Timing:
    """Time ``repeat`` calls of ``run``."""
    best = Timing()
    for _ in range(repeat):
        (own, children), started = cpu_seconds(), time.perf_counter()
        result = run()
        wall, (own_after, children_after) = time.perf_counter() - started, cpu_seconds()
        own, children = own_after - own, children_after - children
        if own + children < best.cpu:
            best.cpu, best.cpu_own, best.cpu_children = own + children, own, children
        if wall < best.wall:
            best.wall, best.result = wall, result
    return best


def bench_params(args: argparse.Namespace, workers: int, steps_per_task: int | str = "auto") -> dict[str, Any]:
    """params.yaml with the benchmark's settings."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["data"]["source"] = "digits"
    raw["partition"].update(method="dirichlet", num_clients=args.clients, alpha=args.alpha)
    raw["model"].update(arch="mlp", widths=[128])
    raw["federated"].update(algorithms=["fedavg"], rounds=args.rounds, fraction=1.0)
    raw["federated"]["local"]["epochs"] = args.epochs
    raw["orchestration"].update(
        task_runner="threads", max_workers=workers, torch_threads=1, steps_per_task=steps_per_task
    )
    return raw


def set_environment(home: Path) -> None:
    """What ``mergeflow run`` sets (flows.environment), with a private Prefect home; before Prefect is imported."""
    os.environ["PREFECT_HOME"] = str(home)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    from flows.environment import configure

    configure()


def workspace_inputs(workspace: Path) -> tuple[Any, list[Any], Any, dict[str, Any]]:
    """The loop's model builder, client data, test data and base-model spec, read from the workspace files."""
    from mergeflow.checkpoints import load_checkpoint_meta
    from tasks.federated import loop_inputs
    from tasks.layout import BASE, PARTITIONS

    num_clients = len(list((workspace / PARTITIONS).glob("client_*.parquet")))
    model_builder, clients, test = loop_inputs(workspace, num_clients)
    return model_builder, clients, test, load_checkpoint_meta(workspace / BASE)["spec"]


def export_for_flower(
    workspace: Path, export: Path, clients: list[Any], test: Any, spec: dict[str, Any], params: Any
) -> None:
    """Partitions, test set, shuffling seeds (npz), base model (safetensors) and settings (json) for Flower."""
    from mergeflow.seeding import derive_seed
    from tasks.layout import BASE

    export.mkdir(parents=True)
    rounds, num_clients = params.federated.rounds, len(clients)
    # client_generator(seed, r, k) seeds a torch.Generator with exactly this number.
    seeds = np.array(
        [[derive_seed(params.seed, "federated", r, k) for k in range(num_clients)] for r in range(rounds)], np.int64
    )
    arrays = {f"X_{k}": c.X.numpy() for k, c in enumerate(clients)} | {
        f"y_{k}": c.y.numpy() for k, c in enumerate(clients)
    }
    np.savez(export / "data.npz", X_test=test.X.numpy(), y_test=test.y.numpy(), seeds=seeds, **arrays)
    shutil.copyfile(workspace / BASE, export / "base.safetensors")
    local = params.section("federated.local")
    if local["optimizer"] != "sgd":
        raise SystemExit("the Flower client replicates SGD only")
    setup = {
        "widths": spec["widths"],
        "activation": spec["activation"],
        "input_shape": spec["input_shape"],
        "output_dim": spec["output_dim"],
        "local": local,
        "rounds": rounds,
        "num_clients": num_clients,
        "cpus": len(os.sched_getaffinity(0)),
    }
    (export / "setup.json").write_text(json.dumps(setup, indent=2) + "\n")


def final_accuracy(model_builder: Any, weights: dict[str, Any], test: Any) -> float:
    """mergeflow's test accuracy of a global model."""
    from mergeflow.federated.loop import evaluate_global

    return evaluate_global(model_builder(), weights, test)["accuracy"]


def same_weights(weights: dict[str, Any], reference: dict[str, Any]) -> str:
    """'yes' when every parameter equals the loop's after the cast to the compared dtype."""
    import torch

    equal = all(torch.equal(torch.as_tensor(v), reference[k].to(torch.as_tensor(v).dtype)) for k, v in weights.items())
    return "yes" if equal and set(weights) == set(reference) else "no"


def fresh_store(workspace: Path, keep_folders: bool = False) -> None:
    """Forget every cached step and federated output: the next flow run is cold. ``keep_folders`` keeps the
    store's blob folders (empty), as a store that has served runs before has them: a first run creates them."""
    shutil.rmtree(workspace / "models" / "federated", ignore_errors=True)
    if not keep_folders:
        shutil.rmtree(workspace / ".mergeflow", ignore_errors=True)
        return
    shutil.rmtree(workspace / ".mergeflow" / "results", ignore_errors=True)
    for blob in (workspace / ".mergeflow" / "store").rglob("*"):
        if blob.is_file():
            blob.unlink()


def timed_flow(params: Any, workspace: Path, repeat: int, *, cold: bool, keep_folders: bool = False) -> Timing:
    """Best of ``repeat`` runs of the federated stage (each cold one from a fresh store, or with its folders
    kept), with its step outcomes."""
    from flows.pipeline import run_pipeline

    def run() -> list[dict[str, Any]]:
        outcomes = run_pipeline(params, workspace, ["federated"])
        hits = [o["cached"] for o in outcomes]
        if any(hits) if cold else not all(hits):
            raise RuntimeError("a cold run hit the cache" if cold else "a re-run missed the cache")
        return outcomes

    def cold_run() -> list[dict[str, Any]]:
        fresh_store(workspace, keep_folders)  # inside the timing, but a few milliseconds
        return run()

    return best_of(repeat, cold_run if cold else run)


def overhead_lines(label: str, timing: Timing, loop_seconds: float, workers: int) -> list[str]:
    """Where the flow's time goes: seconds inside the steps by kind, the rest per step, the CPU split."""
    outcomes, wall = timing.result, timing.wall
    kinds: dict[str, list[float]] = defaultdict(list)
    for outcome in outcomes:
        kind = outcome["name"].rsplit("/", 1)[-1].split("_")[0]
        kinds[kind].append(outcome["seconds"])
    inside = sum(sum(v) for v in kinds.values())
    parts = ", ".join(
        f"{len(v)} {k} steps {sum(v):.2f} s ({1000 * sum(v) / len(v):.0f} ms each)" for k, v in kinds.items()
    )
    lines = [
        f"- {label}: {len(outcomes)} steps; inside the steps: {parts}; total {inside:.2f} s. "
        f"CPU: {timing.cpu_own:.2f} s in this process, {timing.cpu_children:.2f} s in Prefect's server."
    ]
    if workers == 1:
        rest = wall - inside
        lines.append(
            f"  Outside the steps (Prefect task runs, cache keys, result files, materialising): {rest:.2f} s, "
            f"{1000 * rest / len(outcomes):.0f} ms per step. Inside minus the loop (I/O, hashing, re-evaluation): "
            f"{inside - loop_seconds:.2f} s."
        )
    return lines


def run_flower(python: Path, export: Path) -> tuple[dict[str, Any] | None, str]:
    """Flower's result JSON (None on failure) and a note."""
    result_path = export / "flower.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0")
    started = time.perf_counter()
    done = subprocess.run(
        [str(python), str(FLOWER_SCRIPT), str(export), str(result_path)], env=env, capture_output=True, text=True
    )
    total = time.perf_counter() - started
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return None, "Flower run failed: " + " | ".join(tail)
    result = json.loads(result_path.read_text())
    note = (
        f"Flower {result['flwr']} with Ray {result['ray']}: ray.init {result['ray_init_seconds']:.1f} s, "
        f"run_simulation {result['simulation_seconds']:.1f} s, the whole process (imports included) {total:.1f} s; "
        "one virtual SuperNode per client, client_resources num_cpus=1 (one Ray actor per core), "
        "1 torch thread per actor; run_simulation includes starting the actors."
    )
    return result, note


def main() -> None:
    """Prepare the workspace, time every way, print the table and the notes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2, help="local epochs per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="flow max_workers, one cold run each")
    parser.add_argument(
        "--steps-per-task",
        type=lambda value: value if value == "auto" else int(value),
        nargs="+",
        default=["auto", 1, 10],
        help="orchestration.steps_per_task values to time (auto: the default, one task run per worker per wave)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="best of N for the loop and the flow runs")
    parser.add_argument("--flower-python", type=Path, default=Path("/tmp/flwr-venv/bin/python"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory(prefix="federated-speed-") as tmp:
        workspace = Path(tmp) / "workspace"
        workspace.mkdir()
        set_environment(Path(tmp) / "prefect")
        import torch
        from prefect import flow

        import tasks.federated  # noqa: F401  (imported before timing, like mergeflow.federated for the loop)
        from flows.pipeline import run_pipeline
        from mergeflow.config import validate_params
        from mergeflow.federated import LocalTraining, run_rounds
        from tasks.layout import global_checkpoint

        notes: list[str] = []
        started = time.perf_counter()
        flow(name="warm-up")(lambda: None)()
        seconds = time.perf_counter() - started
        notes.append(f"- Prefect ephemeral server start (throw-away flow, not timed below): {seconds:.1f} s.")
        params = validate_params(bench_params(args, args.workers[0]))
        started = time.perf_counter()
        run_pipeline(params, workspace, PREP_STAGES)
        seconds = time.perf_counter() - started
        notes.append(f"- Workspace preparation ({', '.join(PREP_STAGES)}; not timed below): {seconds:.1f} s.")
        model_builder, clients, test, spec = workspace_inputs(workspace)
        sizes = sorted(len(c) for c in clients)
        notes.append(
            f"- {len(clients)} clients, sizes {sizes}; test set {len(test)}; local {params.section('federated.local')}."
        )

        torch.set_num_threads(1)  # what every flow step does (orchestration.torch_threads = 1)
        local = LocalTraining(**params.section("federated.local"))
        seed = params.seed
        loop = best_of(
            args.repeat,
            lambda: run_rounds("fedavg", model_builder, clients, args.rounds, train=local, seed=seed, eval_data=test),
        )
        loop_seconds, run = loop.wall, loop.result
        rows = [
            Row("plain loop (`run_rounds`, 1 thread)", loop.wall, loop.cpu, run.metrics[-1]["accuracy"], "reference")
        ]

        from mergeflow.checkpoints import load_checkpoint

        combos = [(w, n) for w in args.workers for n in args.steps_per_task]
        for i, (workers, per_task) in enumerate(combos):
            params = validate_params(bench_params(args, workers, per_task))
            setting = f"max_workers={workers}, steps_per_task={per_task}"
            cold = timed_flow(params, workspace, args.repeat, cold=True)
            final, _ = load_checkpoint(workspace / global_checkpoint("fedavg", params.federated.rounds))
            accuracy = json.loads((workspace / "metrics/federated.json").read_text())["fedavg"][-1]["accuracy"]
            identical = same_weights(final, run.global_state)
            rows.append(Row(f"mergeflow flow, cold, {setting}", cold.wall, cold.cpu, accuracy, identical))
            notes += overhead_lines(f"flow cold, {setting}", cold, loop_seconds, workers)
            if i == 0:
                kept = timed_flow(params, workspace, args.repeat, cold=True, keep_folders=True)
                rows.append(
                    Row(
                        f"mergeflow flow, cold, store folders kept, {setting}", kept.wall, kept.cpu, accuracy, identical
                    )
                )
                cached = timed_flow(params, workspace, args.repeat, cold=False)
                rows.append(
                    Row(f"mergeflow flow, cached re-run, {setting}", cached.wall, cached.cpu, accuracy, identical)
                )
                notes.append(
                    f"- cached re-run, {setting}: {len(cached.result)} cache hits; CPU "
                    f"{cached.cpu_own:.2f} s in this process, {cached.cpu_children:.2f} s in Prefect's server."
                )

        if args.flower_python.is_file():
            export = Path(tmp) / "flower"
            export_for_flower(workspace, export, clients, test, spec, params)
            result, note = run_flower(args.flower_python, export)
            notes.append(f"- {note}")
            if result is not None:
                with np.load(result["final"]) as data:
                    weights = {k: torch.from_numpy(data[k]) for k in data.files}
                accuracy = final_accuracy(model_builder, weights, test)
                identical = same_weights(weights, run.global_state)
                version = f"Flower {result['flwr']} + Ray {result['ray']}"
                rows.append(
                    Row(f"{version}, run_simulation (Ray up)", result["simulation_seconds"], None, accuracy, identical)
                )
                total = result["ray_init_seconds"] + result["simulation_seconds"]
                rows.append(Row(f"{version}, ray.init + run_simulation", total, None, accuracy, identical))
                notes.append(
                    f"- Flower's own server-side accuracy per round: {[round(a, 4) for a in result['accuracy']]}."
                )
        else:
            notes.append(f"- Flower skipped: no {args.flower_python} (see the usage in this file's docstring).")

    print("| way | seconds | ratio to plain loop | CPU seconds | final test accuracy | weights bit-identical to loop |")
    print("|---|---:|---:|---:|---:|---|")
    for row in rows:
        accuracy = "n/a" if row.accuracy is None else f"{row.accuracy:.4f}"
        cpu = "n/a" if row.cpu is None else f"{row.cpu:.2f}"
        ratio = row.seconds / loop_seconds
        print(f"| {row.way} | {row.seconds:.2f} | {ratio:.2f} | {cpu} | {accuracy} | {row.identical} |")
    print()
    print("\n".join(notes))


if __name__ == "__main__":
    main()
