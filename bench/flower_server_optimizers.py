"""Side-by-side check of mergeflow's server optimizers and robust aggregators against Flower's strategies.

Both sides get the same sequence of client updates: in round t client k sends θ̄_t + U[t, k] (U drawn
once from a seed, θ̄_t each side's own global model), so any difference in a server rule compounds over
the rounds. mergeflow runs its real server path (``planned_server_update`` with FedAvg and a
``ServerPlan``), Flower its strategies' ``aggregate_train`` (FedAvgM, FedAdam, FedYogi, FedAdagrad).

Usage (Flower in its own venv, never a mergeflow dependency)::

    python3 -m venv /tmp/flwr-venv && /tmp/flwr-venv/bin/pip install flwr==1.41.0
    PYTHONPATH=. .venv/bin/python bench/flower_server_optimizers.py [--flower-python /tmp/flwr-venv/bin/python]

The robust rules (FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan) get, each round, 9 clients of equal
size: 7 honest updates and 2 far-off ones, and both sides' aggregates are compared round by round.

The Flower side is this file run with ``--flower SEQUENCE.npz RESULT.npz`` by the venv's Python (numpy
and flwr only). Conventions matched: Flower starts v at 0 (mergeflow's default is the paper's τ²:
``initial_v: 0`` here) and bias-corrects FedAdam with t + 1 at server round t (mergeflow is fed t + 1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROUNDS, CLIENTS, SHAPES = 30, 5, {"layer.weight": (20, 30), "layer.bias": (20,)}
SIZES = [30, 50, 20, 80, 40]
# name → (mergeflow server options, Flower strategy class, its keyword arguments)
CASES = {
    "fedavgm": (
        {"optimizer": "avgm", "lr": 0.7, "momentum": 0.9},
        "FedAvgM",
        {"server_learning_rate": 0.7, "server_momentum": 0.9},
    ),
    "fedadam": (
        {
            "optimizer": "adam",
            "lr": 0.05,
            "beta1": 0.9,
            "beta2": 0.99,
            "tau": 1e-3,
            "initial_v": 0.0,
            "bias_correction": True,
        },
        "FedAdam",
        {"eta": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
    ),
    "fedyogi": (
        {"optimizer": "yogi", "lr": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3, "initial_v": 0.0},
        "FedYogi",
        {"eta": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
    ),
    "fedadagrad": (
        {"optimizer": "adagrad", "lr": 0.05, "beta1": 0.0, "tau": 1e-3, "initial_v": 0.0},
        "FedAdagrad",
        {"eta": 0.05, "tau": 1e-3},
    ),
}


# name → (mergeflow aggregator options, Flower strategy class, its keyword arguments); 9 clients a round.
ROBUST = {
    "median": ({"name": "median"}, "FedMedian", {}),
    "trimmed_mean": ({"name": "trimmed_mean", "beta": 0.2}, "FedTrimmedAvg", {"beta": 0.2}),
    "krum": ({"name": "krum", "f": 2}, "Krum", {"num_malicious_nodes": 2}),
    "multikrum": (
        {"name": "multikrum", "f": 2, "m": 5},
        "MultiKrum",
        {"num_malicious_nodes": 2, "num_nodes_to_select": 5},
    ),
    "bulyan": ({"name": "bulyan", "f": 1}, "Bulyan", {"num_malicious_nodes": 1}),
}
ROBUST_CLIENTS = 9


def robust_sequence(seed: int = 1) -> dict[str, np.ndarray]:
    """Every round's client models: 7 near a shared centre, the last 2 far off (Byzantine)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in SHAPES.items():
        models = rng.normal(size=(ROUNDS, 1, *shape)) + rng.normal(scale=0.1, size=(ROUNDS, ROBUST_CLIENTS, *shape))
        models[:, -2:] += rng.normal(scale=5.0, size=(ROUNDS, 2, *shape))
        out[f"robust/{name}"] = models
    return out


def sequence(seed: int = 0) -> dict[str, np.ndarray]:
    """The initial model and every round's client offsets U[t, k] (a drift shared by the clients plus noise)."""
    rng = np.random.default_rng(seed)
    out = {f"init/{name}": rng.normal(size=shape) for name, shape in SHAPES.items()}
    for name, shape in SHAPES.items():
        drift = rng.normal(scale=0.1, size=(ROUNDS, 1, *shape))
        out[f"offsets/{name}"] = drift + rng.normal(scale=0.05, size=(ROUNDS, CLIENTS, *shape))
    return out


def run_mergeflow(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each case through mergeflow's server step; the global model after every round."""
    import torch

    from mergeflow.federated import get_algorithm
    from mergeflow.federated.server_plan import ServerPlan, planned_server_update
    from mergeflow.schema.federated import ServerOptimizerOptions

    fedavg = get_algorithm("fedavg")
    options = fedavg.parse_options({})
    results = {}
    for case, (server_options, _, _) in CASES.items():
        settings = ServerOptimizerOptions.model_validate(server_options)
        plan = ServerPlan(server=settings)
        state = {f"mean.{n}": torch.from_numpy(data[f"init/{n}"]) for n in SHAPES}
        history = {n: [] for n in SHAPES}
        for t in range(ROUNDS):
            messages = {
                k: {f"mean.{n}": state[f"mean.{n}"] + torch.from_numpy(data[f"offsets/{n}"][t, k]) for n in SHAPES}
                for k in range(CLIENTS)
            }
            # Flower's FedAdam bias-corrects with server_round + 1 (rounds from 1): feed mergeflow t + 2.
            number = t + 2 if settings.bias_correction else t + 1
            state, _ = planned_server_update(
                fedavg, state, messages, dict(enumerate(SIZES)), CLIENTS, options, plan, number
            )
            for n in SHAPES:
                history[n].append(state[f"mean.{n}"].numpy().copy())
        results |= {f"{case}/{n}": np.stack(h) for n, h in history.items()}
    return results | robust_mergeflow(data)


def robust_mergeflow(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each robust rule on every round's client models (all arrays flattened together, sorted by name)."""
    import torch

    from mergeflow.federated.base import flat, unflat
    from mergeflow.federated.server_plan import aggregate
    from mergeflow.schema.federated import AggregatorOptions

    like = {n: torch.zeros(shape, dtype=torch.float64) for n, shape in SHAPES.items()}
    weights = torch.full((ROBUST_CLIENTS,), 1.0 / ROBUST_CLIENTS, dtype=torch.float64)
    results = {}
    for case, (options, _, _) in ROBUST.items():
        rule = AggregatorOptions.model_validate(options)
        history = {n: [] for n in SHAPES}
        for t in range(ROUNDS):
            rows = [
                flat({n: torch.from_numpy(data[f"robust/{n}"][t, k]) for n in SHAPES}) for k in range(ROBUST_CLIENTS)
            ]
            vector, _ = aggregate(torch.stack(rows), weights, rule)
            for n, value in unflat(vector, like).items():
                history[n].append(value.numpy().copy())
        results |= {f"{case}/{n}": np.stack(h) for n, h in history.items()}
    return results


def run_flower(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each case through Flower's strategy ``aggregate_train`` (its FedAvg weighting by num-examples)."""
    import logging

    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp import strategy as strategies
    from flwr.supercore.task_identity import TaskIdentity

    logging.getLogger("flwr").setLevel(logging.WARNING)

    # Messages are made inside a run in Flower; outside one, give them a run (and task) identity.
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    results = {}
    for case, (_, class_name, kwargs) in CASES.items():
        strategy = getattr(strategies, class_name)(**kwargs)
        current = {n: data[f"init/{n}"].copy() for n in SHAPES}
        history = {n: [] for n in SHAPES}
        for t in range(ROUNDS):
            record = ArrayRecord({n: Array(current[n]) for n in SHAPES})
            # What configure_train stores: FedAvgM keeps the ArrayRecord, the FedOpt family numpy arrays.
            strategy.current_arrays = record if class_name == "FedAvgM" else {n: current[n].copy() for n in SHAPES}
            replies = []
            for k in range(CLIENTS):
                arrays = ArrayRecord({n: Array(current[n] + data[f"offsets/{n}"][t, k]) for n in SHAPES})
                content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": SIZES[k]})})
                replies.append(Message(content=content, dst_node_id=k + 1, message_type="train"))
            arrays, _ = strategy.aggregate_train(t + 1, replies)
            current = {n: arrays[n].numpy().copy() for n in SHAPES}
            for n in SHAPES:
                history[n].append(current[n])
        results |= {f"{case}/{n}": np.stack(h) for n, h in history.items()}
    for case, (_, class_name, kwargs) in ROBUST.items():
        strategy = getattr(strategies, class_name)(**kwargs)
        history = {n: [] for n in SHAPES}
        for t in range(ROUNDS):
            replies = []
            for k in range(ROBUST_CLIENTS):
                arrays = ArrayRecord({n: Array(data[f"robust/{n}"][t, k]) for n in SHAPES})
                content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 10})})
                replies.append(Message(content=content, dst_node_id=k + 1, message_type="train"))
            arrays, _ = strategy.aggregate_train(t + 1, replies)
            for n in SHAPES:
                history[n].append(arrays[n].numpy().copy())
        results |= {f"{case}/{n}": np.stack(h) for n, h in history.items()}
    return results


def main() -> None:
    """Run both sides on one sequence and print (and return as JSON) the largest differences."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flower", nargs=2, metavar=("SEQUENCE", "RESULT"), help="run the Flower side only")
    parser.add_argument("--flower-python", default="/tmp/flwr-venv/bin/python")
    args = parser.parse_args()
    if args.flower:
        with np.load(args.flower[0]) as f:
            data = dict(f)
        np.savez(args.flower[1], **run_flower(data))
        return
    data = sequence() | robust_sequence()
    ours = run_mergeflow(data)
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "sequence.npz", **data)
        result = Path(tmp) / "flower.npz"
        subprocess.run(
            [args.flower_python, __file__, "--flower", str(Path(tmp) / "sequence.npz"), str(result)], check=True
        )
        with np.load(result) as f:
            theirs = dict(f)
        version = subprocess.run(
            [args.flower_python, "-c", "import flwr; print(flwr.__version__)"], capture_output=True, text=True
        ).stdout.strip()
    report = {"flwr": version, "rounds": ROUNDS, "clients": CLIENTS, "cases": {}}
    for case in CASES:
        keys = [f"{case}/{n}" for n in SHAPES]
        diff = max(float(np.abs(ours[k] - theirs[k]).max()) for k in keys)
        scale = max(float(np.abs(theirs[k]).max()) for k in keys)
        moved = max(float(np.abs(theirs[k][-1] - data[f"init/{k.split('/', 1)[1]}"]).max()) for k in keys)
        report["cases"][case] = {"max_abs_diff": diff, "max_abs_value": scale, "max_abs_change": moved}
    for case in ROBUST:
        keys = [f"{case}/{n}" for n in SHAPES]
        diff = max(float(np.abs(ours[k] - theirs[k]).max()) for k in keys)
        rounds_equal = sum(all(np.array_equal(ours[k][t], theirs[k][t]) for k in keys) for t in range(ROUNDS))
        report["cases"][case] = {"max_abs_diff": diff, "rounds_bit_equal": rounds_equal}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
