"""FedAvg with Flower's simulation runtime on partitions exported by ``bench/federated_speed.py``.

Usage (normally started by federated_speed.py, with a separate venv that has ``flwr[simulation]``):
    /tmp/flwr-venv/bin/python bench/flower_fedavg.py EXPORT_DIR RESULT_JSON

EXPORT_DIR holds ``data.npz`` (clients' and test arrays, per-round client seeds), ``base.safetensors``
and ``setup.json`` (model and local-training settings). Each ClientApp call trains exactly like
``mergeflow.federated.local.local_train`` (same model, SGD, loss, batch order from the same generator
seed); the server is Flower's stock FedAvg with the replies put in client order, so the float64
weighted mean is computed in the order mergeflow uses. No mergeflow import: this venv does not have it.
The result JSON has the seconds of ``ray.init`` and of ``run_simulation``, per-round test accuracy
(server-side evaluation of the global model), and the final global parameters go to ``final.npz``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def build_model(setup: dict[str, Any]) -> nn.Sequential:
    """The MLP of mergeflow's ``build_model("mlp", ...)``: Flatten, (Linear, act) per width, Linear."""
    activation = {"relu": nn.ReLU, "tanh": nn.Tanh}[setup["activation"]]
    n_in = int(np.prod(setup["input_shape"]))
    layers: list[nn.Module] = [nn.Flatten()]
    for width in setup["widths"]:
        layers += [nn.Linear(n_in, width), activation()]
        n_in = width
    layers.append(nn.Linear(n_in, setup["output_dim"]))
    return nn.Sequential(*layers)


@torch.no_grad()
def load_parameters(model: nn.Module, arrays: dict[str, torch.Tensor]) -> None:
    """Copy (float64) arrays into the model's float32 parameters, as mergeflow's ``load_parameters``."""
    for name, p in model.named_parameters():
        p.copy_(arrays[name].reshape(p.shape))


def local_train(model: nn.Module, X: torch.Tensor, y: torch.Tensor, local: dict[str, Any], seed: int) -> float:
    """mergeflow's ``local_train`` without a penalty: the last epoch's mean loss."""
    opt = torch.optim.SGD(
        model.parameters(), lr=local["lr"], momentum=local["momentum"], weight_decay=local["weight_decay"]
    )
    generator = torch.Generator().manual_seed(seed)
    n, epoch_loss = X.shape[0], float("nan")
    model.train()
    for _ in range(local["epochs"]):
        order, total = torch.randperm(n, generator=generator), 0.0
        for start in range(0, n, local["batch_size"]):
            idx = order[start : start + local["batch_size"]]
            loss = F.cross_entropy(model(X[idx]), y[idx])
            value = loss.item()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += value * len(idx)
        epoch_loss = total / n
    return epoch_loss


@torch.no_grad()
def accuracy(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy in eval mode, in batches of 1024 like mergeflow's ``predict``."""
    model.eval()
    logits = torch.cat([model(X[i : i + 1024]) for i in range(0, X.shape[0], 1024)]).to(torch.float64)
    return float((logits.argmax(1) == y).to(torch.float64).mean())


def client_train(msg: Any, context: Any) -> Any:
    """One ClientApp train call: the client id comes from the node config, the round from the message."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    torch.set_num_threads(1)
    k = int(context.node_config["partition-id"])
    config = msg.content["config"]
    export = Path(str(config["export"]))
    setup = json.loads((export / "setup.json").read_text())
    with np.load(export / "data.npz") as data:
        X = torch.from_numpy(data[f"X_{k}"]).to(torch.float32)
        y = torch.from_numpy(data[f"y_{k}"]).to(torch.long).reshape(-1)
        seed = int(data["seeds"][int(config["server-round"]) - 1, k])
    model = build_model(setup)
    load_parameters(model, msg.content["arrays"].to_torch_state_dict())
    loss = local_train(model, X, y, setup["local"], seed)
    params = {name: p.detach().to(torch.float64) for name, p in model.named_parameters()}
    metrics = MetricRecord({"num-examples": int(X.shape[0]), "partition-id": k, "train_loss": loss})
    return Message(RecordDict({"arrays": ArrayRecord(params), "metrics": metrics}), reply_to=msg)


def main() -> None:
    """Run the simulation and write the result JSON."""
    import flwr
    import ray
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
    from safetensors.torch import load_file

    export, result_path = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    setup = json.loads((export / "setup.json").read_text())
    torch.set_num_threads(1)
    with np.load(export / "data.npz") as data:
        X_test = torch.from_numpy(data["X_test"]).to(torch.float32)
        y_test = torch.from_numpy(data["y_test"]).to(torch.long)
    base = load_file(export / "base.safetensors")
    model = build_model(setup)
    initial = {name: base[name].to(torch.float64) for name, _ in model.named_parameters()}
    curve: list[float] = []
    final: dict[str, np.ndarray] = {}

    class OrderedFedAvg(FedAvg):
        """Stock FedAvg, with the replies in client order (Ray returns them in completion order)."""

        def aggregate_train(self, server_round: int, replies: Any) -> Any:
            ordered = sorted(replies, key=lambda m: int(m.content["metrics"]["partition-id"]))
            return super().aggregate_train(server_round, ordered)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        load_parameters(model, arrays.to_torch_state_dict())
        curve.append(accuracy(model, X_test, y_test))
        if server_round == setup["rounds"]:
            final.update({k: v.numpy() for k, v in arrays.to_torch_state_dict().items()})
        return MetricRecord({"accuracy": curve[-1]})

    server = ServerApp()

    @server.main()
    def _(grid: Any, context: Any) -> None:
        n = setup["num_clients"]
        strategy = OrderedFedAvg(fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n)
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(initial),
            num_rounds=setup["rounds"],
            train_config=ConfigRecord({"export": str(export)}),
            evaluate_fn=evaluate,
        )

    client = ClientApp()
    client.train()(client_train)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"include_dashboard": False}}
    started = time.perf_counter()
    ray.init(include_dashboard=False, num_cpus=setup["cpus"], logging_level="ERROR")
    ray_seconds = time.perf_counter() - started
    started = time.perf_counter()
    run_simulation(server_app=server, client_app=client, num_supernodes=setup["num_clients"], backend_config=backend)
    simulation_seconds = time.perf_counter() - started
    ray.shutdown()
    np.savez(export / "final.npz", **final)
    result = {
        "ray_init_seconds": ray_seconds,
        "simulation_seconds": simulation_seconds,
        "accuracy": curve,
        "flwr": flwr.__version__,
        "ray": ray.__version__,
        "final": str(export / "final.npz"),
    }
    result_path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
