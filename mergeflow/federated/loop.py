"""A plain sequential round loop, without orchestration: the notebook API and the benchmark baseline.

It drives its rounds with :mod:`mergeflow.federated.rounds` (the schedule, the client step and
the server step) as the pipeline's ``federated`` stage does, states and messages kept in memory
instead of files, so a flow with the same seed reproduces it bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel
from torch import nn

from mergeflow.device import host_tensor
from mergeflow.evaluation import evaluate_outputs
from mergeflow.federated.base import (
    ClientData,
    ClientState,
    FederatedAlgorithm,
    LocalTraining,
    ServerState,
    get_algorithm,
    load_parameters,
    model_parameters,
)
from mergeflow.federated.heads import LocalHeads, clients_head
from mergeflow.federated.rounds import client_step, head_step, round_schedule, server_step
from mergeflow.federated.server_plan import ServerPlan
from mergeflow.objectives import get_objective
from mergeflow.schema.federated import AggregatorOptions, AttackOptions, DPOptions, ServerOptimizerOptions
from mergeflow.seeding import derive_seed
from mergeflow.training import predict


@dataclass
class FederatedRun:
    """Result of :func:`run_rounds`.

    Attributes:
        metrics: one dict per round; index 0 evaluates the initial model (``round`` = 0).
        server: the final server state.
        client_states: the final state of every client.
        global_state: the final model parameters (float64; with ``heads``: the body and the clients' average head).
    """

    metrics: list[dict[str, Any]] = field(default_factory=list)
    server: ServerState = field(default_factory=dict)
    client_states: dict[int, ClientState] = field(default_factory=dict)
    global_state: dict[str, torch.Tensor] = field(default_factory=dict)


def evaluate_global(
    model: nn.Module, params: Mapping[str, torch.Tensor], data: ClientData, *, noise_std: float = 1.0
) -> dict[str, float]:
    """Load ``params`` into ``model`` and return :func:`mergeflow.evaluation.evaluate_outputs` on ``data``."""
    load_parameters(model, params)
    outputs = predict(model, data.X, task=data.task)
    return evaluate_outputs(outputs, data.y.cpu().numpy(), task=data.task, noise_std=noise_std)


def predictive_metrics(
    algorithm: FederatedAlgorithm,
    server: ServerState,
    model: nn.Module,
    data: ClientData,
    samples: int,
    seed: int,
    round_index: int,
    noise_std: float = 1.0,
) -> dict[str, float]:
    """The metrics of the Monte-Carlo predictive of a Gaussian global model, prefixed ``bma_``.

    The outputs of ``samples`` draws θ ~ N(m̄, S̄⁻¹) of the algorithm's
    :meth:`~mergeflow.federated.base.FederatedAlgorithm.posterior` are combined by the objective's
    ensemble (a Bayesian model average: mean class probabilities, mean prediction), drawn from a
    generator derived from (seed, round). Empty for point-estimate algorithms, an objective without an
    ensemble, or ``samples`` = 0.
    """
    posterior, objective = algorithm.posterior(server), get_objective(data.task)
    if posterior is None or samples < 1 or not objective.declaration.ensembles:
        return {}
    means, precisions = posterior
    generator = torch.Generator().manual_seed(derive_seed(seed, "predictive", round_index))
    outputs = []
    for _ in range(samples):
        # Sorted names: the same draws whether the state came from memory or from safetensors.
        draw = {
            name: means[name]
            + torch.randn(means[name].shape, generator=generator, dtype=torch.float64).to(means[name].device)
            / precisions[name].sqrt()
            for name in sorted(means)
        }
        load_parameters(model, draw)
        outputs.append(predict(model, data.X, task=objective))
    labels = data.y.cpu().numpy()
    scores = objective.metrics(objective.ensemble(outputs), labels, n_bins=15, noise_std=noise_std)
    return {f"bma_{key}": value for key, value in scores.items()}


def global_scores(
    algorithm: FederatedAlgorithm,
    server: ServerState,
    model: nn.Module,
    data: ClientData,
    validation: ClientData | None,
    noise_std: float,
    predictive_samples: int,
    seed: int,
    round_index: int,
) -> dict[str, float]:
    """The global model's metrics on ``data`` (and ``val_*`` on ``validation``), with its predictive's."""
    splits = {"": data} if validation is None else {"": data, "val_": validation}
    scores = {}
    for prefix, split in splits.items():
        values = evaluate_global(model, algorithm.global_state(server), split, noise_std=noise_std)
        values |= predictive_metrics(
            algorithm, server, model, split, predictive_samples, seed, round_index, noise_std=noise_std
        )
        scores |= {prefix + key: value for key, value in values.items()}
    return scores


def _concatenate(clients_data: Sequence[ClientData]) -> ClientData:
    return ClientData(
        torch.cat([host_tensor(d.X) for d in clients_data]),
        torch.cat([host_tensor(d.y) for d in clients_data]),
        clients_data[0].task,
    )


def run_rounds(
    algorithm: str | FederatedAlgorithm,
    model_builder: Callable[[], nn.Module],
    clients_data: Sequence[ClientData],
    rounds: int,
    *,
    options: BaseModel | Mapping[str, Any] | None = None,
    train: LocalTraining | None = None,
    fraction: float = 1.0,
    seed: int = 0,
    eval_data: ClientData | None = None,
    validation_data: ClientData | None = None,
    noise_std: float = 1.0,
    on_divergence: str = "fail",
    predictive_samples: int = 0,
    callback: Callable[[dict[str, Any]], None] | None = None,
    server: ServerOptimizerOptions | Mapping[str, Any] | None = None,
    aggregator: AggregatorOptions | Mapping[str, Any] | str | None = None,
    attack: AttackOptions | Mapping[str, Any] | None = None,
    dp: DPOptions | Mapping[str, Any] | None = None,
    num_classes: int | None = None,
    heads: LocalHeads | None = None,
) -> FederatedRun:
    """Run ``rounds`` federated rounds sequentially in this process.

    Args:
        algorithm: a key of :data:`~mergeflow.federated.base.ALGORITHMS` or an algorithm instance.
        model_builder: builds the (deterministically initialised) model; called once for the initial
            global model, once per client update and once for evaluation.
        clients_data: the clients' data sets (client id = index).
        rounds: number of rounds.
        options: the algorithm's options (mapping or options model; defaults when None).
        train: local training settings (``LocalTraining()`` when None).
        fraction: fraction of clients per round (:func:`~mergeflow.federated.base.sample_participants`).
        seed: seed of participant sampling and of every client's generator.
        eval_data: data on which the global model is evaluated (all clients' data when None).
        validation_data: held-out data on which it is also evaluated, as ``val_*`` metrics (to choose
            settings on, never on ``eval_data``).
        noise_std: noise of the regression NLL.
        on_divergence: ``fail`` raises :class:`~mergeflow.training.DivergenceError` when a client
            diverges; ``exclude`` drops its message for that round (see
            :mod:`mergeflow.federated.divergence`).
        predictive_samples: also evaluate the Monte-Carlo predictive of a Gaussian global model
            with this many samples (:func:`predictive_metrics`; 0 = off).
        callback: called with each round's metrics as soon as they exist.
        server: the server optimizer (``federated.server``; plain averaging when None).
        aggregator: the aggregation rule (``federated.aggregator``; the algorithm's mean when None).
        attack: Byzantine clients (``federated.attack``; none when None).
        dp: client-level DP (``federated.dp``; participants are then Poisson-sampled with
            probability ``fraction``). See :class:`~mergeflow.federated.server_plan.ServerPlan`.
        num_classes: the classes a ``label_flip`` attack maps y to C − 1 − y over (the data's info;
            the largest label seen + 1 when None).
        heads: the clients keep their own heads (``federated.heads``: FedPer's ``local``, FedBABU's
            ``frozen``, :class:`~mergeflow.federated.heads.LocalHeads`), from the built model's; the server
            state is the body's, and the model scored (and ``global_state``) is the global body with the
            clients' example-weighted average head, under ``frozen`` after each client's head fine-tuning
            on the final body.

    Returns:
        A :class:`FederatedRun`. Each round's metrics hold ``round``, ``participants``,
        ``train_loss`` (participants' last-epoch losses weighted by n_k), ``drift`` (mean ‖θ_k − θ̄‖
        from the global model the clients started at), ``diverged`` (ids of the participants whose
        message was dropped) and the evaluation metrics of the new global model (accuracy/nll/ece
        or mse/nll, plus ``bma_*`` with ``predictive_samples``). Round 0's also hold ``warning`` when
        the algorithm's :meth:`~mergeflow.federated.base.FederatedAlgorithm.stability_warning` gave
        one, which is also issued as a ``RuntimeWarning``.
    """
    algo = get_algorithm(algorithm)
    opts = algo.parse_options(options)
    train = train or LocalTraining()
    num_clients = len(clients_data)
    if num_clients == 0:
        raise ValueError("run_rounds needs at least one client")
    evaluation = eval_data if eval_data is not None else _concatenate(clients_data)
    eval_model = model_builder()
    base_head = heads.head_of(heads.prepare(eval_model)) if heads is not None else {}
    initial = model_parameters(eval_model)
    if num_classes is None and attack is not None:  # label flipping's C; the data's own count is safer
        num_classes = 1 + max((int(d.y.max()) for d in clients_data if len(d.y)), default=0)
    plan = ServerPlan.build(
        num_clients,
        rounds,
        fraction,
        seed,
        server=server,
        aggregator=aggregator,
        attack=attack,
        dp=dp,
        num_classes=num_classes,
    )
    plan.check(algo)
    server_state = algo.init_server(initial, num_clients, opts)
    clients = {k: algo.init_client(initial, opts) for k in range(num_clients)}
    if heads is not None:
        clients = {k: heads.with_head(state, base_head) for k, state in clients.items()}
    sizes = {k: len(d) for k, d in enumerate(clients_data)}
    run = FederatedRun(server=server_state, client_states=clients)

    def scores(round_index: int) -> dict[str, float]:
        if heads is not None:
            heads.load(eval_model, clients_head(clients, sizes, range(num_clients)))
        return global_scores(
            algo,
            server_state,
            eval_model,
            evaluation,
            validation_data,
            noise_std,
            predictive_samples,
            seed,
            round_index,
        )

    warning = algo.stability_warning([len(d) for d in clients_data], train, rounds, opts)
    first = {"round": 0.0, **scores(0)}
    if warning:
        warnings.warn(f"{algo.name}: {warning}", RuntimeWarning, stacklevel=2)
        first["warning"] = warning
    run.metrics.append(first)
    if callback is not None:
        callback(first)
    for step in round_schedule(num_clients, rounds, fraction, seed, poisson=plan.poisson):
        sent = {}
        for k in step.participants:
            message, clients[k], metrics = client_step(
                algo,
                model_builder(),
                server_state,
                clients[k],
                clients_data[k],
                train,
                opts,
                seed,
                step.number,
                k,
                plan,
                heads,
            )
            sent[k] = (message, metrics)
        server_state, row = server_step(
            algo, server_state, sent, sizes, num_clients, opts, on_divergence, step.number, plan
        )
        if heads is not None and heads.mode == "frozen" and step.number == rounds:
            for k in range(num_clients):
                clients[k] = head_step(
                    algo,
                    heads,
                    model_builder(),
                    server_state,
                    clients[k],
                    clients_data[k],
                    train,
                    seed,
                    rounds,
                    k,
                    plan,
                )
        row = {"round": float(step.number), **row, **scores(step.number)}
        run.metrics.append(row)
        if callback is not None:
            callback(row)
    run.server, run.client_states = server_state, clients
    run.global_state = algo.global_state(server_state)
    if heads is not None:
        run.global_state |= clients_head(clients, sizes, range(num_clients))
    return run
