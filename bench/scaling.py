"""How the pipeline's own cost grows with the number of clients: planning, per-step orchestration, store, memory,
no-op re-runs.

Usage: python bench/scaling.py [--runs digits:5,50 pinwheel:500,1000] [--merges average,weighted,…] [--json FILE]

Each run is the default pipeline (``params.yaml``) with FedAvg only, ``federated.fraction`` 0.1 over 20 rounds,
written into the workspace's ``params.yaml`` (not ``-S``: DVC then knows the params, and ``mergeflow run``
writes ``dvc.lock``), in a fresh copy of the project's tracked files (``git ls-files``, as a clone has them, with
``git init`` and ``.dvc/``), a fresh Prefect home (its database migrated first) and a local MLflow store. The
``ssf`` merge is left out by default: its cost is the method's own (its search's steps grow with the clients),
measured in docs/benchmarks.md at 5 and 50 clients. ``pinwheel`` is the synthetic table (20,000 rows per
cluster, Dirichlet(1.0), at least 5 rows per client), so that 1,000 clients all have data; ``digits`` has
1,437 training rows, enough for 50 clients at 10 rows each.

Per run, recorded:

- ``plan_s``: planning every stage (their plan functions; modules imported beforehand), in the workspace;
- ``run_s``: the cold ``mergeflow run`` as ``.mergeflow/last_run.json`` times it (planning, steps, orchestration;
  not the process's start-up nor the ``dvc.lock`` commit after it); ``wall_s`` the process's wall time;
- ``steps``, ``steps_s``: the steps run and the sum of their own seconds (each record's ``seconds``, which
  times the step's function and the ingest of its outputs);
- ``overhead_s`` = ``run_s`` - ``steps_s``: what the orchestration cost around the steps (planning, keys,
  lookups, Prefect task runs, materialising, records, logging), and ``per_step_ms`` its slope: the extra
  overhead per extra step against the smallest run of the same source, so the fixed start-up (a flow run, the
  first imports) drops out; ``per_step_prev_ms`` the same against the previous size;
- ``rss_mb``: peak resident memory of the ``mergeflow run`` process (``wait4``: the largest of it and its
  children; steps run in its threads, so a step that loads every client counts here);
- ``store_mb``, ``store_files``: ``.mergeflow`` (blobs, records, plans); ``output_files``: files under the
  stages' outputs (hard links to the blobs: no extra space); ``dvc_cache_mb``: DVC's cache after the lock;
- ``noop_s``: a second ``mergeflow run`` (process wall); ``dvc_status_s`` and ``dvc_repro_s``: ``dvc status``
  and ``dvc repro`` (both no-ops) on the same workspace.

With ``--task-runs N``, also the orchestration alone: N steps that each write one small file, through
``tasks.execution.run_steps`` in a flow on one thread, one Prefect task run per step and all in one task run,
then looked up cached (``tasks.records.cached_outcomes``, what a no-op run does per step): milliseconds per
step beyond the steps' own seconds.

Prints a markdown table and writes the rows as JSON (``--json``). The default sweep (digits 5, 50; pinwheel 5,
50, 500, 1000) takes about 15 minutes on 2 cores; ``--runs digits:5`` takes about a minute.
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
from pathlib import Path

import yaml

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUNS = ("digits:5,50", "pinwheel:5,50,500,1000")
DEFAULT_MERGES = "average,weighted,task_arithmetic,fisher,exact"
COMMON = (
    "orchestration.max_workers=1",  # the steps' own seconds then add up to the time they took
    "federated.algorithms=[fedavg]",
    "federated.fraction=0.1",
    "federated.rounds=20",
)
SOURCES = {
    "digits": (),
    "pinwheel": (
        "data.source=pinwheel",
        "data.pinwheel.per_cluster=20000",
        "partition.alpha=1.0",
        "partition.min_partition_size=5",
    ),
}
OUTPUTS = ("data", "models", "metrics", "plots")
PLAN = """
import json, sys, time
from mergeflow.config import load_params
from tasks.runner import _plan_stage
from tasks.stages import STAGES
from tasks.steps import resolve
params = load_params("params.yaml")
for stage in STAGES:
    for phase in stage.phases:
        resolve(phase)
started = time.perf_counter()
plan = [_plan_stage(stage, params) for stage in STAGES]
seconds = time.perf_counter() - started
print(json.dumps({"plan_s": seconds, "planned": sum(len(wave) for waves in plan for wave in waves)}))
"""


def copy_project(workspace: Path) -> None:
    """The project's tracked files as they are now (uncommitted edits too), in a new git repository."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in listed.splitlines():
        if (ROOT / name).is_file():
            (workspace / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, workspace / name)
    subprocess.run(["git", "init", "-q"], cwd=workspace, check=True)


def write_params(workspace: Path, overrides: list[str]) -> None:
    """The workspace's ``params.yaml``: the project's, with ``overrides`` written in."""
    from mergeflow.config.overrides import apply_overrides

    raw = yaml.safe_load((workspace / "params.yaml").read_text())
    (workspace / "params.yaml").write_text(yaml.safe_dump(apply_overrides(raw, overrides), sort_keys=False))


def environment(workspace: Path) -> dict[str, str]:
    """Offline, this workspace's code first, a private Prefect home whose database is migrated already."""
    env = {**os.environ, "PREFECT_HOME": str(workspace.parent / "prefect"), "HF_DATASETS_OFFLINE": "1"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(workspace)
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        env.pop(name, None)
    warm_up = "from prefect import flow; flow(name='warm-up')(lambda: None)()"
    subprocess.run([sys.executable, "-c", warm_up], env=env, check=True, capture_output=True, cwd=workspace)
    return env


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS in MB (the process and its children) and stdout of a process, which must succeed."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed in {cwd}:\n{(stdout + stderr)[-3000:]}")
    return seconds, usage.ru_maxrss / 1024, stdout


def tree_size(paths: list[Path]) -> tuple[float, int]:
    """MB (each inode once) and file count under ``paths``."""
    seen, size, count = set(), 0, 0
    for top in paths:
        for folder, _, files in os.walk(top):
            for name in files:
                stat = os.lstat(os.path.join(folder, name))
                count += 1
                if (stat.st_dev, stat.st_ino) not in seen:
                    seen.add((stat.st_dev, stat.st_ino))
                    size += stat.st_size
    return size / 1e6, count


def measure(source: str, clients: int, merges: str, tmp: Path) -> dict:
    """One run's measures (the module docstring's keys)."""
    workspace = tmp / "workspace"
    workspace.mkdir()
    copy_project(workspace)
    write_params(
        workspace, [*SOURCES[source], *COMMON, f"partition.num_clients={clients}", f"merge.methods=[{merges}]"]
    )
    env = environment(workspace)
    run = [str(BIN / "mergeflow"), "run"]
    wall, rss, _ = timed(run, workspace, env)
    record = json.loads((workspace / ".mergeflow" / "last_run.json").read_text())
    ran = [step for step in record["steps"] if not step["cached"]]
    stages: dict[str, float] = {}
    for step in ran:
        stage = step["name"].split("/", 1)[0]
        stages[stage] = stages.get(stage, 0.0) + step["seconds"]
    plan = json.loads(timed([sys.executable, "-c", PLAN], workspace, env)[2])
    noop, _, _ = timed(run, workspace, env)
    noop_run = json.loads((workspace / ".mergeflow" / "last_run.json").read_text())["seconds"]
    dvc_status, _, status = timed([str(BIN / "dvc"), "status"], workspace, env)
    dvc_repro, _, repro = timed([str(BIN / "dvc"), "repro"], workspace, env)
    if "Running stage" in repro:
        raise SystemExit(f"`dvc repro` after `mergeflow run` ran a stage in {workspace}:\n{repro[-2000:]}")
    store_mb, store_files = tree_size([workspace / ".mergeflow"])
    _, output_files = tree_size([workspace / name for name in OUTPUTS])
    dvc_cache_mb, _ = tree_size([workspace / ".dvc" / "cache"])
    steps_s = sum(step["seconds"] for step in ran)
    return {
        "source": source,
        "clients": clients,
        "steps": len(record["steps"]),
        "ran": len(ran),
        "plan_s": plan["plan_s"],
        "run_s": record["seconds"],
        "wall_s": wall,
        "steps_s": steps_s,
        "overhead_s": record["seconds"] - steps_s,
        "stages_s": stages,
        "rss_mb": rss,
        "store_mb": store_mb,
        "store_files": store_files,
        "output_files": output_files,
        "dvc_cache_mb": dvc_cache_mb,
        "noop_s": noop,
        "noop_run_s": noop_run,
        "dvc_status_s": dvc_status,
        "dvc_status_clean": "up to date" in status,
        "dvc_repro_s": dvc_repro,
    }


def touch(params: dict, _root: Path, out: Path, _settings: dict) -> dict:
    """A step that writes one small file: the orchestration's cost per step, measured alone (``--task-runs``)."""
    (out / "touched").mkdir(exist_ok=True)
    (out / "touched" / f"{params['index']:05d}.txt").write_text(str(params["index"]))
    return {}


def task_run_costs(count: int, tmp: Path) -> dict[str, float]:
    """Milliseconds per step beyond its own seconds: ``count`` :func:`touch` steps run one Prefect task run each,
    all in one task run, and then looked up cached."""
    os.environ["PREFECT_HOME"] = str(tmp / "prefect")  # before Prefect is imported
    warm_up = "from prefect import flow; flow(name='warm-up')(lambda: None)()"  # its database migrated first
    subprocess.run([sys.executable, "-c", warm_up], check=True, capture_output=True)
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from tasks.execution import run_steps
    from tasks.records import cached_outcomes
    from tasks.steps import Step

    def planned(group: str) -> list[Step]:
        return [
            Step(f"touch/{group}/{i:05d}", "bench.scaling:touch", {"group": group, "index": i}) for i in range(count)
        ]

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=1))
    def timed() -> dict[str, float]:
        costs = {}
        for label, per_task in (("task_run_per_step_ms", 1), ("one_task_run_ms", count)):
            root = tmp / label
            started = time.perf_counter()
            outcomes = run_steps(planned(label), root, 1, per_task)
            own = sum(outcome.seconds for outcome in outcomes)
            costs[label] = (time.perf_counter() - started - own) / count * 1000
            started = time.perf_counter()
            cached_outcomes(planned(label), root, {})  # code hashed once, as a no-op run does
            costs["cached_lookup_ms"] = (time.perf_counter() - started) / count * 1000
        return costs

    return timed()


def add_slopes(rows: list[dict]) -> None:
    """``per_step_ms`` against the smallest run of the same source, ``per_step_prev_ms`` against the previous."""
    measured = [row for row in rows if "error" not in row]
    for source in dict.fromkeys(row["source"] for row in measured):
        ordered = sorted((row for row in measured if row["source"] == source), key=lambda row: row["steps"])
        for row, previous in zip(ordered, [None, *ordered[:-1]], strict=True):
            for key, other in (("per_step_ms", ordered[0]), ("per_step_prev_ms", previous)):
                extra = row["steps"] - other["steps"] if other is not None else 0
                row[key] = (row["overhead_s"] - other["overhead_s"]) / extra * 1000 if extra else None


COLUMNS = (
    ("source", "source", "{}"),
    ("clients", "clients", "{}"),
    ("steps", "steps", "{}"),
    ("plan_s", "plan s", "{:.2f}"),
    ("run_s", "run s", "{:.1f}"),
    ("steps_s", "steps' own s", "{:.1f}"),
    ("overhead_s", "overhead s", "{:.1f}"),
    ("per_step_ms", "ms/step (vs smallest)", "{:.1f}"),
    ("per_step_prev_ms", "ms/step (vs previous)", "{:.1f}"),
    ("rss_mb", "peak RSS MB", "{:.0f}"),
    ("store_mb", "store MB", "{:.0f}"),
    ("store_files", "store files", "{}"),
    ("output_files", "output files", "{}"),
    ("noop_s", "no-op `mergeflow run` s", "{:.2f}"),
    ("dvc_status_s", "`dvc status` s", "{:.2f}"),
    ("dvc_repro_s", "`dvc repro` no-op s", "{:.2f}"),
)


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |"]
    lines.append("|" + "|".join("---" if key == "source" else "---:" for key, _, _ in COLUMNS) + "|")
    for row in rows:
        cells = ["–" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in COLUMNS]
        if "error" in row:  # the last line of its output (mergeflow: error: …), in the columns after its size
            cells[2:] = [f"failed: {row['error'].strip().splitlines()[-1]}"] + [""] * (len(COLUMNS) - 3)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_runs(texts: list[str]) -> list[tuple[str, int]]:
    """``SOURCE:N,N,…`` texts as (source, clients) pairs."""
    runs = []
    for text in texts:
        source, _, sizes = text.partition(":")
        if source not in SOURCES or not sizes:
            raise SystemExit(f"--runs {text}: expected SOURCE:N[,N…] with SOURCE one of {', '.join(SOURCES)}")
        runs += [(source, int(size)) for size in sizes.split(",")]
    return runs


def main() -> None:
    """Run each (source, clients) in a fresh workspace; print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=list(DEFAULT_RUNS), help="SOURCE:N,N,… (default: %(default)s)")
    parser.add_argument(
        "--merges", default=DEFAULT_MERGES, help="merge.methods, comma-separated (default: %(default)s; ssf left out)"
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--keep", action="store_true", help="keep the workspaces (printed), for profiling")
    parser.add_argument("--task-runs", type=int, metavar="N", help="also time N trivial steps' orchestration alone")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.task_runs:
        with tempfile.TemporaryDirectory(prefix="scaling-task-runs-") as tmp:
            costs = task_run_costs(args.task_runs, Path(tmp))
        print(", ".join(f"{key} {value:.2f}" for key, value in costs.items()), flush=True)
    rows = []
    for source, clients in parse_runs(args.runs):
        tmp = Path(tempfile.mkdtemp(prefix=f"scaling-{source}-{clients}-"))
        started = time.perf_counter()
        try:
            rows.append(measure(source, clients, args.merges, tmp))
        except SystemExit as failure:  # a failed run (the output's end is in the JSON) leaves the others to run
            print(failure, file=sys.stderr)
            rows.append({"source": source, "clients": clients, "error": str(failure)})
        finally:
            if args.keep:
                print(f"kept {tmp}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        print(f"{source} {clients} clients: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if not rows:  # --task-runs alone
        return
    add_slopes(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
