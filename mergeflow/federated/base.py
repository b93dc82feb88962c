"""Shared types, the algorithm interface and the registry of federated algorithms.

Everything that crosses a task boundary (server state, client state, messages) is a flat
``dict[str, torch.Tensor]`` so that it can be stored as safetensors. Keys carry a prefix that
says what the tensor is, followed by the parameter name of the model (``model.named_parameters()``):

- ``mean.<param>``: a point estimate or a Gaussian mean (server global model, client messages);
- ``precision.<param>``: a diagonal Gaussian precision (Bayes-ADMM);
- ``dual.<param>``, ``dual_mean.<param>``, ``dual_prec.<param>``: per-client duals;
- ``dual_sum.<param>``, ``dual_mean_sum.<param>``, ``dual_prec_sum.<param>``: the server's running
  sums of all clients' duals (the dual updates are deterministic functions of what the server sends
  and receives, so the server tracks them itself and never needs the clients' states);
- ``prior_mean.<param>``: the mean of the global prior.

Server and client states are float64; model parameters keep their own dtype and are cast on load.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel
from torch import nn

from mergeflow.objectives import OBJECTIVES
from mergeflow.schema.federated import ALGORITHMS, Algorithm, participants_per_round
from mergeflow.seeding import derive_seed
from mergeflow.training import OPTIMIZERS

if TYPE_CHECKING:
    from mergeflow.federated.quadratic_loss import QuadraticProblem

State = dict[str, torch.Tensor]
ServerState = State
ClientState = State
Message = State

MEAN = "mean."
PRECISION = "precision."
PRIOR_MEAN = "prior_mean."


@dataclass(frozen=True)
class ClientData:
    """One client's local data set.

    Attributes:
        X: float features, shape ``(N, *input_shape)``.
        y: class indices (classification) or float targets (regression), shape ``(N,)``; a causal
            LM's targets are its inputs shifted, ``y`` then only labels rows (partitions, groups).
        task: a registered objective's name (:data:`mergeflow.objectives.OBJECTIVES`).
    """

    X: torch.Tensor
    y: torch.Tensor
    task: str = "classification"

    def __post_init__(self) -> None:
        if self.task not in OBJECTIVES:
            raise ValueError(f"unknown task {self.task!r}; expected one of {tuple(OBJECTIVES)}")
        if len(self.X) != len(self.y):
            raise ValueError(f"X has {len(self.X)} rows but y has {len(self.y)}")

    def __len__(self) -> int:
        return int(self.X.shape[0])


@dataclass(frozen=True)
class LocalTraining:
    """Local optimisation settings shared by the SGD-based algorithms.

    IVON-ADMM uses ``epochs`` and ``batch_size`` only: its optimizer, learning rate and prior come
    from its own options.
    """

    epochs: int = 1
    lr: float = 0.05
    batch_size: int = 32
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; expected one of {tuple(OPTIMIZERS)}")
        if self.epochs < 0 or self.batch_size < 1 or self.lr < 0:
            raise ValueError("LocalTraining needs epochs >= 0, batch_size >= 1 and lr >= 0")


class FederatedAlgorithm:
    """Interface of a federated algorithm, the implementation of its declaration
    (:class:`~mergeflow.schema.federated.Algorithm`), which gives it its name and options model.

    A round is: every participating client calls :meth:`client_update` (independently, e.g. one
    cached task each), then the server calls :meth:`server_update` once with the messages of the
    participants. All methods are pure functions of their inputs (they never modify them).
    """

    def __init__(self, declaration: Algorithm) -> None:
        self.declaration = declaration

    @property
    def name(self) -> str:
        """Its declared name."""
        return self.declaration.name

    @property
    def summary(self) -> str:
        """First line of the class docstring."""
        doc = (type(self).__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    def parse_options(self, options: BaseModel | Mapping[str, Any] | None = None) -> BaseModel:
        """Validate options (a mapping, an options model or None for the defaults).

        Raises:
            ConfigError: naming the algorithm and the offending key.
        """
        return self.declaration.parse(options)

    def init_server(
        self, global_state: Mapping[str, torch.Tensor], num_clients: int, options: BaseModel
    ) -> ServerState:
        """The server state before round 0, from the initial model parameters."""
        return {MEAN + k: _f64(v) for k, v in global_state.items()}

    def init_client(self, global_state: Mapping[str, torch.Tensor], options: BaseModel) -> ClientState:
        """A client's state before its first round (possibly empty)."""
        return {}

    def client_update(
        self,
        model: nn.Module,
        server: ServerState,
        client: ClientState,
        data: ClientData,
        train: LocalTraining,
        options: BaseModel,
        generator: torch.Generator,
    ) -> tuple[Message, ClientState, dict[str, float]]:
        """Local training of one client from the server state; returns (message, new state, metrics).

        ``model`` only supplies the architecture: its parameters are overwritten by the server's.
        All randomness (shuffling, weight noise) comes from ``generator``.
        """
        raise NotImplementedError

    def server_update(
        self,
        server: ServerState,
        messages: Mapping[int, Message],
        sizes: Mapping[int, int],
        num_clients: int,
        options: BaseModel,
    ) -> ServerState:
        """The new server state from the participants' messages (keys of ``messages``)."""
        raise NotImplementedError

    def stability_warning(
        self, sizes: Sequence[int], train: LocalTraining, rounds: int, options: BaseModel
    ) -> str | None:
        """One line when these settings are known to run away with clients of these sizes, else None.

        Args:
            sizes: every client's number of examples.
            train: the local training settings (epochs and batch size set the steps per round).
            rounds: the rounds the run is asked for.
            options: the algorithm's options.
        """
        return None

    def global_state(self, server: ServerState) -> dict[str, torch.Tensor]:
        """The model parameters to evaluate (float64; cast when loading into a model)."""
        return take_prefix(server, MEAN)

    def posterior(self, server: ServerState) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
        """The global model as a diagonal Gaussian (means, precisions), or None for a point estimate."""
        return None

    def exact_client_update(
        self,
        server: ServerState,
        client: ClientState,
        problem: QuadraticProblem,
        options: BaseModel,
    ) -> tuple[Message, ClientState, dict[str, float]]:
        """Closed-form client step for a quadratic loss (see :mod:`mergeflow.federated.quadratic`)."""
        raise NotImplementedError(f"{self.name} has no closed-form client step")


def register_algorithm(
    cls: type[FederatedAlgorithm] | None = None, /, *, averages_messages: bool = False, point_estimate: bool = False
) -> Any:
    """Class decorator of a notebook's (or a module's) own algorithm, bare or with the flags of its
    declaration (:class:`~mergeflow.schema.federated.Algorithm`): declare it in
    :data:`~mergeflow.schema.federated.ALGORITHMS` with its class attributes ``name`` and ``Options`` (a
    pydantic model, extra keys forbidden). The class must be defined at the top level of its module, which
    the rounds import it from. A built-in algorithm is declared in ``mergeflow.schema.federated`` instead.

    Raises:
        ValueError: when the name is taken, the options accept extra keys, or the class is not at the top
            level of its module.
    """

    def register(cls: type[FederatedAlgorithm]) -> type[FederatedAlgorithm]:
        if cls.__qualname__ != cls.__name__:
            raise ValueError(
                f"federated algorithm {cls.name!r}: define {cls.__qualname__} at the top level of a module"
            )
        reference = f"{cls.__module__}:{cls.__name__}"
        ALGORITHMS.declare(Algorithm(cls.name, reference, cls.Options, averages_messages, point_estimate))
        return cls

    return register if cls is None else register(cls)


def get_algorithm(name: str | FederatedAlgorithm) -> FederatedAlgorithm:
    """The declared algorithm ``name``, its implementation imported now (an algorithm instance is returned as is).

    Raises:
        ConfigError: on an unknown name.
    """
    return name if isinstance(name, FederatedAlgorithm) else implementation(ALGORITHMS.lookup(name))


@functools.cache
def implementation(declaration: Algorithm) -> FederatedAlgorithm:
    """The algorithm that ``declaration`` names, made once: its module is imported now, and no other's."""
    return declaration.load()(declaration)


# ----------------------------------------------------------------------------- state helpers


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64).clone()


def take_prefix(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors whose key starts with ``prefix``, keyed by the rest of the key."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def add_prefix(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with ``prefix`` prepended to every key."""
    return {prefix + k: v for k, v in tensors.items()}


KEPT_LOCAL = "mergeflow_kept_local"  # a model's attribute: the names of the parameters it trains and never sends


def trained_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters local training updates: every parameter that requires a gradient (all of them, unless
    frozen, e.g. a transformer's body under ``federated.exchange: adapters``, a head under ``federated.heads:
    frozen``)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def exchanged_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters clients train and exchange with the server: the trained ones but those the model keeps
    local (its head under ``federated.heads: local``, :class:`mergeflow.federated.heads.LocalHeads`)."""
    kept = getattr(model, KEPT_LOCAL, frozenset())
    return [(name, p) for name, p in trained_parameters(model) if name not in kept]


def model_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached float64 copies of the model's exchanged parameters, keyed by parameter name."""
    return {name: _f64(p) for name, p in exchanged_parameters(model)}


@torch.no_grad()
def load_parameters(model: nn.Module, params: Mapping[str, torch.Tensor]) -> nn.Module:
    """Copy ``params`` (any float dtype) into the model's exchanged parameters in place.

    Raises:
        KeyError: when an exchanged parameter is missing from ``params``.
    """
    for name, p in exchanged_parameters(model):
        if name not in params:
            raise KeyError(f"parameter {name!r} missing from the federated state")
        p.copy_(params[name].reshape(p.shape))
    return model


def flat(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """All tensors flattened into one vector, in sorted name order."""
    return torch.cat([tensors[name].reshape(-1) for name in sorted(tensors)])


def unflat(vector: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`flat`: tensors shaped as ``like``'s, cut from ``vector`` in sorted name order."""
    out, start = {}, 0
    for name in sorted(like):
        size = like[name].numel()
        out[name] = vector[start : start + size].reshape(like[name].shape)
        start += size
    return out


def client_generator(seed: int, round_index: int, client: int) -> torch.Generator:
    """The private generator of one client in one round, derived from (seed, round, client)."""
    return torch.Generator().manual_seed(derive_seed(seed, "federated", round_index, client))


def sample_participants(
    num_clients: int, fraction: float, seed: int, round_index: int, *, poisson: bool = False
) -> list[int]:
    """Sorted ids of the clients that take part in a round.

    ``max(1, round(fraction * num_clients))`` clients are drawn without replacement by a generator
    derived from (seed, round_index), so the draw is deterministic and independent of other RNG use.
    With ``poisson`` (DP-FedAvg) each client takes part independently with probability ``fraction``
    (possibly none), from a generator derived from (seed, "poisson", round_index).

    Raises:
        ValueError: unless ``num_clients >= 1`` and ``0 < fraction <= 1``.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if poisson:
        gen = torch.Generator().manual_seed(derive_seed(seed, "poisson", round_index))
        draws = torch.rand(num_clients, generator=gen, dtype=torch.float64, device=gen.device)
        return [k for k in range(num_clients) if float(draws[k]) < fraction]
    count = participants_per_round(num_clients, fraction)
    if count == num_clients:
        return list(range(num_clients))
    gen = torch.Generator().manual_seed(derive_seed(seed, "participants", round_index))
    return sorted(torch.randperm(num_clients, generator=gen)[:count].tolist())


def client_drift(
    global_state: Mapping[str, torch.Tensor],
    client_states_or_messages: Mapping[int, Mapping[str, torch.Tensor]] | Iterable[Mapping[str, torch.Tensor]],
) -> float:
    """Mean over clients of the ℓ2 distance ‖θ_k − θ̄‖ (all parameters flattened together).

    Each client dict holds its parameters either under ``mean.<param>`` (messages) or under the
    bare parameter names. Returns 0.0 for no clients.
    """
    items = client_states_or_messages
    if isinstance(items, Mapping):
        items = items.values()
    distances = []
    for state in items:
        params = take_prefix(state, MEAN) or dict(state)
        # fsum is exactly rounded, so the result does not depend on the order of the keys
        # (model order in memory, alphabetical when read back from safetensors).
        sq = math.fsum(
            float(((params[name].to(torch.float64) - ref.to(torch.float64)) ** 2).sum())
            for name, ref in global_state.items()
        )
        distances.append(math.sqrt(sq))
    return sum(distances) / len(distances) if distances else 0.0


def participant_weights(
    messages: Mapping[int, Message], sizes: Mapping[int, int], *, uniform: bool = False
) -> dict[int, float]:
    """Aggregation weights n_k / Σ_{participants} n_j (or 1/|participants| when ``uniform``)."""
    if not messages:
        raise ValueError("a server update needs at least one message")
    if uniform:
        return {k: 1.0 / len(messages) for k in messages}
    missing = [k for k in messages if k not in sizes]
    if missing:
        raise ValueError(f"no data size for clients {missing}")
    total = float(sum(sizes[k] for k in messages))
    if total <= 0:
        raise ValueError("client data sizes must have a positive sum")
    return {k: sizes[k] / total for k in messages}
