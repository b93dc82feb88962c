"""The ``mergeflow`` command line.

Heavy libraries (torch, Prefect, MLflow) are imported inside the commands that need them,
so ``--help`` and config errors answer at once. Bad input exits with code 2 and one line
per problem, naming the key or file, before anything is written.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from pathlib import Path

from flows.summary import print_summary, step_summary
from mergeflow.cancel import Stopped, stop_on_signals
from mergeflow.errors import ConfigError, MergeflowError, Outage


def _add_params_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument(
        "-S",
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a param, e.g. -S merge.options.task_arithmetic.scaling=0.5 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from flows.reproduction_registry import REPRODUCTIONS
    from tasks.stages import STAGE_NAMES

    parser = argparse.ArgumentParser(prog="mergeflow", description="Federated model merging pipeline.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the whole pipeline flow (cached stages are skipped)")
    _add_params_options(run)
    stage = commands.add_parser("stage", help="run one stage (what dvc.yaml calls)")
    stage.add_argument("name", choices=STAGE_NAMES)
    _add_params_options(stage)
    validate = commands.add_parser("validate", help="check a params file and exit")
    _add_params_options(validate)
    dvc = commands.add_parser("dvc-yaml", help="print dvc.yaml generated from the stage registry")
    dvc.add_argument("--write", action="store_true", help="write ./dvc.yaml instead of printing")
    reference = commands.add_parser("params-doc", help="print docs/params.md, the params reference, from the schema")
    reference.add_argument("--write", action="store_true", help="write ./docs/params.md instead of printing")
    ui = commands.add_parser("ui", help="open the MLflow UI on 127.0.0.1")
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument("--params", default="params.yaml", help="whose tracking.experiment to open")
    ui.add_argument("--print-url", action="store_true", help="print the runs page's URL and exit")
    export = commands.add_parser("export-lora", help="a merged transformer as a PEFT LoRA adapter over the base")
    export.add_argument("merge", help="an entry of merge.methods (models/merged/MERGE.safetensors)")
    size = export.add_mutually_exclusive_group(required=True)
    size.add_argument("--rank", type=int, help="each module's LoRA rank")
    size.add_argument("--energy", type=float, help="each module keeps this share of its squared singular values")
    export.add_argument("--out", type=Path, help="the adapter's directory (default: models/adapters/MERGE)")
    commands.add_parser("methods", help="the registered merge methods: summary, inputs and options")
    commands.add_parser("algorithms", help="the registered federated algorithms: summary and options")
    serve = commands.add_parser("serve", help="deploy the pipeline on a schedule and serve it (needs a Prefect server)")
    serve.add_argument("--cron", help='cron schedule, e.g. "0 3 * * *"')
    serve.add_argument("--interval", type=float, help="seconds between runs")
    serve.add_argument("--name", default="mergeflow", help="deployment name")
    _add_params_options(serve)
    best = commands.add_parser("best", help="the best merged models of the experiment in MLflow")
    best.add_argument(
        "--metric",
        help="e.g. test_accuracy (highest first), test_nll (lowest), avg_normalized_accuracy (multi-task); "
        "default: the latest run's headline (test_accuracy, test_avg_normalized_accuracy)",
    )
    best.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment of the params)")
    best.add_argument("--top", type=int, default=5)
    best.add_argument("--all-data", action="store_true", help="rank all data together (default: the latest run's)")
    _add_params_options(best)
    reproduce = commands.add_parser("reproduce", help="run a paper reproduction (results/NAME.md)")
    reproduce.add_argument("name", choices=tuple(REPRODUCTIONS))
    reproduce.add_argument("--preset", help="experiment preset (default: experiments/<name>.yaml)")
    return parser


def _run(args: argparse.Namespace, stages: list[str] | None) -> int:
    from mergeflow.config import load_params

    params = load_params(args.params, args.overrides)
    from mergeflow.preflight import check_model, check_paths

    check_paths(params, args.params)
    check_model(params, args.params)
    if stages is None or "prepare" in stages:
        from tasks.checks import check_data

        check_data(params, Path.cwd())  # a bad table fails before Prefect starts
    from flows.environment import configure

    configure()
    from flows.dvc_lock import ParamsSource
    from flows.runs import run_and_record
    from tasks.store import sha256_file

    # A whole run locks its stages in dvc.lock; one stage is what dvc.yaml runs, and DVC locks it itself.
    read = sha256_file(Path(args.params))  # the params this run read, for dvc.lock
    source = ParamsSource(args.params, tuple(args.overrides), read) if stages is None else None
    outcomes, elapsed = run_and_record(params, Path.cwd(), stages, source)
    print_summary(outcomes, elapsed)
    warnings: list[str] = []
    if stages is None or "federated" in stages:
        from tasks.reports import run_warnings

        warnings += run_warnings(Path.cwd())
    if stages is None or "evaluate" in stages:
        from tasks.reports import run_warning

        warnings += [warning] if (warning := run_warning(Path.cwd())) else []
    for warning in warnings:
        print(f"mergeflow: warning: {warning}", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    if (args.cron is None) == (args.interval is None):
        raise ConfigError(["serve: give exactly one of --cron or --interval"])
    from flows.environment import configure

    configure()
    from flows.schedule import serve

    if serve(Path(args.params), args.overrides, Path.cwd(), cron=args.cron, interval=args.interval, name=args.name):
        # A stop request, not a failure: exit 0, as service managers (systemd, docker stop) expect.
        print("mergeflow: serve: stopped on SIGTERM; a run in flight, if any, was cancelled")
    return 0


def _ui(args: argparse.Namespace) -> int:
    """Serve the MLflow UI (flows.ui) or, with --print-url, print the URL of the experiment's runs."""
    from functools import partial

    from flows.ui import base_url, serve_ui
    from mergeflow.config import load_params
    from tasks.mlflow_queries import runs_url
    from tasks.mlflow_store import tracking_uri

    experiment = load_params(args.params).tracking.experiment if Path(args.params).is_file() else "mergeflow"
    page_url = partial(runs_url, Path.cwd(), experiment)
    if args.print_url:
        print(page_url(base_url(args.port)))
        return 0
    return serve_ui(tracking_uri(Path.cwd()), args.port, page_url)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        return _run(args, None)
    if args.command == "stage":
        return _run(args, [args.name])
    if args.command == "validate":
        from mergeflow.config import load_params
        from mergeflow.data.check import check_inputs
        from mergeflow.preflight import check_device, check_paths

        params = load_params(args.params, args.overrides)
        check_paths(params, args.params)
        check_device(params, args.params)  # imports torch only for a named accelerator or a reduced precision
        check_inputs(params)
        print(f"{args.params}: ok")
        return 0
    if args.command == "dvc-yaml":
        from tasks.dvcfile import render

        text = render(_given_files(Path("params.yaml")))
        if args.write:
            Path("dvc.yaml").write_text(text)
        else:
            sys.stdout.write(text)
        return 0
    if args.command == "params-doc":
        from mergeflow.params_reference import render as render_reference

        text = render_reference()
        if args.write:
            Path("docs").mkdir(exist_ok=True)
            Path("docs/params.md").write_text(text)
        else:
            sys.stdout.write(text)
        return 0
    if args.command == "reproduce":
        from flows.environment import configure

        configure()
        from flows.reproduce import reproduce

        table = reproduce(args.name, Path.cwd(), args.preset)
        print(table.read_text(), end="")
        print(f"mergeflow: wrote {table} and {table.with_suffix('.json')}")
        return 0
    if args.command == "serve":
        return _serve(args)
    if args.command == "export-lora":
        from flows.export import export_lora

        export_lora(Path.cwd(), args.merge, args.out, args.rank, args.energy)
        return 0
    if args.command == "best":
        return _best(args)
    if args.command in ("methods", "algorithms"):
        from flows.catalog import render_algorithms, render_methods

        sys.stdout.write(render_methods() if args.command == "methods" else render_algorithms())
        return 0
    return _ui(args)


def _given_files(params_file: Path) -> dict[str, tuple[str, ...]]:
    """The files of the models ``params_file`` gives (the deps DVC adds to the stages that read them); none without
    the file."""
    if not params_file.is_file():
        return {}
    from mergeflow.config import load_params
    from mergeflow.given import given_files

    return given_files(load_params(str(params_file)))


def _best(args: argparse.Namespace) -> int:
    experiment = args.experiment
    if experiment is None:
        from mergeflow.config import load_params

        experiment = load_params(args.params, args.overrides).tracking.experiment
    from flows.environment import configure

    configure()
    from tasks.mlflow_queries import best_runs

    ranking = best_runs(Path.cwd(), experiment, args.metric, args.top, args.all_data)
    if ranking.left_out:
        others = ", ".join(ranking.other_data)
        print(
            f"mergeflow: best: ranked on the data of the latest run ({ranking.data}); {ranking.left_out} models of "
            f"other data ({others}) left out: --all-data ranks them together",
            file=sys.stderr,
        )
    width = max(14, len(ranking.metric))  # test_avg_normalized_accuracy
    print(_fit(f"{'name':20s} {'kind':9s} {ranking.metric:>{width}s} {'version':>7s}  {'data':12s} {'started':16s}  "
               f"{'run_id':32s}  differs"))  # fmt: skip
    for row in ranking.rows:
        version = f"v{row['version']}" if row["version"] is not None else "-"
        differs = " ".join(f"{key}={value}" for key, value in row["differs"].items())
        line = f"{row['name']:20s} {row['kind']:9s} {row[ranking.metric]:{width}.4f} {version:>7s}  {row['data']:12s} "
        print(_fit(f"{line}{row['started']:16s}  {row['run_id']:32s}  {differs}".rstrip()))
    return 0


def _fit(line: str) -> str:
    """``line`` cut to the terminal's width (with an ellipsis) when the output is a terminal."""
    import shutil

    if not sys.stdout.isatty():
        return line
    width = shutil.get_terminal_size().columns
    return line if len(line) <= width else line[: width - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mergeflow`` console script."""
    from flows.environment import configure

    configure()  # before anything imports huggingface_hub, MLflow or Prefect: they read it on import
    args = build_parser().parse_args(argv)
    try:
        # run, stage and a reproduction's pipeline runs stop within seconds of SIGTERM or Ctrl-C, cancelling their
        # running steps (and the ephemeral Prefect server goes with the process)
        with stop_on_signals() if args.command in ("run", "stage", "reproduce") else nullcontext():
            return _dispatch(args)
    except Stopped as stop:
        print(_stopped_line(stop), file=sys.stderr)
        return 128 + stop.signum  # as a shell reports a process ended by the signal: 143, 130
    except ConfigError as error:
        for line in error.lines:
            print(f"mergeflow: error: {line}", file=sys.stderr)
        return 2
    except Outage as error:  # a cluster gone: run again once it is back
        print(f"mergeflow: error: {error}", file=sys.stderr)
        return 1
    except MergeflowError as error:
        print(f"mergeflow: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        from flows.outages import report_outage

        if not report_outage(error, Path.cwd()):  # the Prefect server gone, the disk full: one line
            raise
        return 1
    except KeyboardInterrupt:
        return 130


def _stopped_line(stop: Stopped) -> str:
    """One line: the signal, and the steps it cancelled."""
    from mergeflow.cancel import cancelled

    names = cancelled()
    what = f"cancelled {step_summary(names)}" if names else "no step was cancelled"
    return f"mergeflow: stopped on {stop.name}: {what}; the finished steps stay cached"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
