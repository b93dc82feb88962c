"""What the server does around an algorithm's own step: attacks, robust aggregation, DP, server optimizer.

A round's messages go through, in order:

1. the attack: the attackers among the participants send a rewritten message
   (:mod:`~mergeflow.federated.attacks`; ``label_flip`` acted on their training instead);
2. the aggregation: DP-FedAvg's clipped, noised average (:mod:`~mergeflow.federated.privacy`), or a
   robust rule (:mod:`~mergeflow.federated.robust`) whose aggregate is handed to the algorithm as the
   one message of weight 1, or the algorithm's own server step on all messages (``mean``);
3. the server optimizer on the change of the global model (:mod:`~mergeflow.federated.server_opt`).

Steps 2's replacements apply only to algorithms whose server step averages the messages, and step 3
only to point-estimate global models; the params check that (``mergeflow.config``). The attack, the
robust rule and the server optimizer are declared members (``mergeflow.schema.federated``): this module
imports the implementation of the one a round runs, when it runs it, and no other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel

from mergeflow.accounting import Mechanism, epsilon, mechanism
from mergeflow.federated.base import (
    MEAN,
    ClientData,
    FederatedAlgorithm,
    Message,
    ServerState,
    add_prefix,
    flat,
    take_prefix,
    unflat,
)
from mergeflow.federated.privacy import CLIP_KEY, private_average
from mergeflow.schema.federated import (
    AggregatorOptions,
    AttackOptions,
    DPOptions,
    ServerOptimizerOptions,
    participants_per_round,
)
from mergeflow.seeding import derive_seed

AGGREGATE = -1  # the client id under which a replaced aggregation hands its aggregate to the algorithm


@dataclass(frozen=True)
class ServerPlan:
    """The server-side settings of one algorithm's rounds (all defaults: the algorithm's own step).

    Build it with :meth:`build`, which draws the attackers and fixes the DP noise.
    """

    server: ServerOptimizerOptions = field(default_factory=ServerOptimizerOptions)
    aggregator: AggregatorOptions = field(default_factory=AggregatorOptions)
    attack: AttackOptions | None = None
    attackers: tuple[int, ...] = ()
    dp: DPOptions | None = None
    noise: Mechanism | None = None
    fraction: float = 1.0
    num_clients: int = 1
    seed: int = 0
    num_classes: int | None = None

    @classmethod
    def build(
        cls,
        num_clients: int,
        rounds: int,
        fraction: float,
        seed: int,
        *,
        server: ServerOptimizerOptions | Mapping[str, Any] | None = None,
        aggregator: AggregatorOptions | Mapping[str, Any] | str | None = None,
        attack: AttackOptions | Mapping[str, Any] | None = None,
        dp: DPOptions | Mapping[str, Any] | None = None,
        num_classes: int | None = None,
    ) -> ServerPlan:
        """The plan of a run of ``rounds`` rounds over ``num_clients`` clients (options as models or mappings).

        Raises:
            ValueError: on attackers beyond the clients or unreachable DP settings (one line, the key).
        """
        attack = _model(AttackOptions, attack)
        dp = _model(DPOptions, dp)
        if attack is not None and attack.poisons_data and num_classes is None:
            raise ValueError("federated.attack.kind: label_flip needs the number of classes")
        return cls(
            server=_model(ServerOptimizerOptions, server) or ServerOptimizerOptions(),
            aggregator=_model(AggregatorOptions, aggregator) or AggregatorOptions(),
            attack=attack,
            attackers=tuple(attackers(num_clients, attack, seed)),
            dp=dp,
            noise=mechanism(dp, num_clients, fraction, rounds) if dp is not None else None,
            fraction=fraction,
            num_clients=num_clients,
            seed=seed,
            num_classes=num_classes,
        )

    def check(self, algorithm: FederatedAlgorithm) -> None:
        """Raise ValueError (one line, the key) when the algorithm's maths does not allow this plan."""
        declared = algorithm.declaration
        if not self.server.is_identity and not declared.point_estimate:
            raise ValueError(f"federated.server: {algorithm.name} has no point-estimate global model to step on")
        replaces = self.dp is not None or not self.aggregator.is_identity
        if replaces and not declared.averages_messages:
            raise ValueError(f"federated.aggregator: {algorithm.name}'s server step does not average the messages")
        if self.dp is not None and not self.aggregator.is_identity:
            raise ValueError("federated.aggregator: DP-FedAvg's noised sum needs name: mean")
        if not self.poisson and (problem := self.aggregator.check_participants(self.participants)):
            raise ValueError(problem)

    @property
    def participants(self) -> int:
        """Participants per round without Poisson sampling."""
        return participants_per_round(self.num_clients, self.fraction)

    @property
    def poisson(self) -> bool:
        """Whether participants are sampled independently with probability q (DP-FedAvg)."""
        return self.dp is not None

    def training_data(self, client: int, data: ClientData) -> ClientData:
        """The data a client trains on: its own, with flipped labels if it is a label-flipping attacker."""
        if self.attack is not None and self.attack.poisons_data and client in self.attackers:
            return self.attack.declaration.load()(data, self.num_classes)
        return data


def _model(model: type[BaseModel], value: Any) -> Any:
    if value is None or isinstance(value, model):
        return value
    return model.model_validate(value)


def attackers(num_clients: int, options: AttackOptions | None, seed: int) -> list[int]:
    """The sorted ids of the attacking clients, drawn without replacement from (seed, "attack")."""
    if options is None or options.clients == 0:
        return []
    if options.clients > num_clients:
        raise ValueError(f"federated.attack.clients: {options.clients} attackers but only {num_clients} clients")
    generator = torch.Generator().manual_seed(derive_seed(seed, "attack"))
    return sorted(torch.randperm(num_clients, generator=generator, device=generator.device)[: options.clients].tolist())


def attack_message(
    message: Message, server_mean: Mapping[str, torch.Tensor], options: AttackOptions, generator: torch.Generator
) -> Message:
    """What an attacker sends instead of ``message`` (θ_k under ``mean.<param>``); other keys unchanged.

    ``server_mean`` is the global model θ̄ the client started from (parameter name → tensor). A data
    attack's message is the honest one (it acted on the attacker's training).
    """
    if options.poisons_data:
        return dict(message)
    attack = options.declaration.load()
    attacked = dict(message)
    for name in sorted(server_mean):
        anchor = server_mean[name]
        attacked[MEAN + name] = attack(anchor, message[MEAN + name].to(anchor.dtype), options, generator)
    return attacked


def attacked_messages(
    plan: ServerPlan, server_mean: Mapping[str, torch.Tensor], messages: Mapping[int, Message], round_number: int
) -> dict[int, Message]:
    """The messages as the server receives them: the attackers' rewritten by the attack."""
    received = dict(messages)
    for k in messages:
        if k in plan.attackers:
            generator = torch.Generator().manual_seed(derive_seed(plan.seed, "attack", round_number, k))
            received[k] = attack_message(messages[k], server_mean, plan.attack, generator)
    return received


def aggregate(
    stack: torch.Tensor, weights: torch.Tensor, options: AggregatorOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """The aggregate of the rows of ``stack`` by the rule ``options.name``, and each row's kept share.

    Raises:
        ValueError: when the rule cannot run on this many rows (e.g. Krum with n ≤ 2f + 2).
    """
    if problem := options.check_participants(stack.shape[0]):
        raise ValueError(problem)
    return options.declaration.load()(stack, weights, options)


def step_size(options: ServerOptimizerOptions, round_number: int) -> float:
    """η, times √(1−β2ᵗ)/(1−β1ᵗ) with ``bias_correction`` (t = ``round_number``, from 1)."""
    if not options.bias_correction:
        return options.lr
    t = float(round_number)
    return options.lr * (1.0 - options.beta2**t) ** 0.5 / (1.0 - options.beta1**t)


def server_optimizer_step(
    server: ServerState,
    aggregate: Mapping[str, torch.Tensor],
    options: ServerOptimizerOptions,
    round_number: int,
) -> ServerState:
    """The server state after one step of the server optimizer ``options.optimizer`` towards ``aggregate``
    (parameter name → θ̄_agg).

    ``server`` holds θ̄ under ``mean.<param>`` and the optimizer's moments; keys other than the ones
    it steps are kept. ``sgd`` with lr 1 returns θ̄ = θ̄_agg exactly.
    """
    step, lr, new = options.declaration.load(), step_size(options, round_number), dict(server)
    for name, target in aggregate.items():
        new |= step(server, name, target.to(server[MEAN + name].dtype), options, lr)
    return new


def planned_server_update(
    algorithm: FederatedAlgorithm,
    server: ServerState,
    messages: Mapping[int, Message],
    sizes: Mapping[int, int],
    num_clients: int,
    options: BaseModel,
    plan: ServerPlan,
    round_number: int,
) -> tuple[ServerState, dict[str, Any]]:
    """The new server state after the plan's attack, aggregation and server optimizer, and the row's
    additions: ``attackers`` (participating attackers), ``kept`` (each participant's kept share) and
    ``attacked_kept`` (their sum over the attackers) with an attack or a robust rule; ``epsilon``,
    ``epsilon_round``, ``clip`` and ``unclipped`` under DP."""
    mean = take_prefix(server, MEAN)
    row: dict[str, Any] = {}
    if plan.attackers:
        row["attackers"] = sorted(k for k in messages if k in plan.attackers)
        messages = attacked_messages(plan, mean, messages, round_number)
    kept = dict.fromkeys(messages, 1.0)
    if plan.dp is not None:
        clip = float(server[CLIP_KEY]) if CLIP_KEY in server else plan.dp.clip
        expected = plan.fraction * num_clients
        new_mean, new_clip, metrics = private_average(
            mean, messages, plan.dp, plan.noise, clip, expected, plan.seed, round_number
        )
        updated = algorithm.server_update(
            server, {AGGREGATE: add_prefix(MEAN, new_mean)}, {AGGREGATE: 1}, num_clients, options
        )
        if plan.dp.adaptive:
            like = next(iter(mean.values()))
            updated[CLIP_KEY] = torch.tensor(new_clip, dtype=torch.float64, device=like.device)
        sigma, delta = plan.noise.noise_multiplier, plan.dp.delta
        row |= metrics | {
            "epsilon": epsilon(sigma, plan.fraction, round_number, delta),
            "epsilon_round": epsilon(sigma, plan.fraction, 1, delta),
        }
    elif not plan.aggregator.is_identity and messages:
        ids = sorted(messages)
        stack = torch.stack([flat({name: messages[k][MEAN + name] for name in mean}) for k in ids])
        weights = torch.full((len(ids),), 1.0 / len(ids), dtype=torch.float64, device=stack.device)
        try:
            vector, shares = aggregate(stack.to(torch.float64), weights, plan.aggregator)
        except ValueError as error:
            raise ValueError(f"round {round_number}: {error}") from None
        kept = {k: float(shares[i]) for i, k in enumerate(ids)}
        message = add_prefix(MEAN, unflat(vector, mean))
        updated = algorithm.server_update(server, {AGGREGATE: message}, {AGGREGATE: 1}, num_clients, options)
    else:
        updated = algorithm.server_update(server, messages, sizes, num_clients, options) if messages else server
    if plan.attackers or not plan.aggregator.is_identity:
        row["kept"] = {str(k): share for k, share in sorted(kept.items())}
        row["attacked_kept"] = sum(kept[k] for k in row.get("attackers", []))
    if not plan.server.is_identity and updated is not server:
        target = take_prefix(updated, MEAN)
        updated = server_optimizer_step({**updated, **add_prefix(MEAN, mean)}, target, plan.server, round_number)
    return updated, row
