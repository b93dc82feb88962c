"""Fisher information of a model's parameters, computed per example.

Three kinds, all averaged over examples (so ``n_k * F`` is a client's data precision):

- ``empirical``: E_n[(∇ log p(y_n|x_n))²] with the data labels;
- ``sampled``:   the same with labels drawn from the model (a seeded generator);
- ``exact``:     E_n Σ_c p_c (∇ log p_c)², i.e. the GGN, as Matena & Raffel compute it.

Never the square of a batch gradient (FusionBench's shortcut, wrong for batch size > 1).
BackPACK gives per-example quantities in one backward pass (SumGradSquared, DiagGGNExact,
BatchGrad, SqrtGGNExact); modules it cannot handle fall back to ``torch.func`` (vmap of
per-example gradients). Regression models are Gaussian with noise ``noise_std``. A causal LM's
example is a text: its score is the gradient of the summed log-likelihood of its next tokens (the
data's for ``empirical``, drawn from the model at every position for ``sampled``); ``exact``
would sum over the vocabulary at every position and is refused.

The Fisher runs on the model's device: the data stay on the CPU and move there a chunk at a time;
sampled labels are drawn from a CPU generator (the same draws on every device) and moved.

``fisher_factors`` returns U (rows × D, over the flattened parameters) with F ≈ UᵀU, so a
low-rank-plus-diagonal precision can be used without ever forming D × D.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from mergeflow import cancel
from mergeflow.device import module_device, to_device
from mergeflow.models.token_model import TokenModel, trim_padding
from mergeflow.objectives import Objective, get_objective
from mergeflow.training import as_inputs, token_lengths

FISHER_KINDS = ("empirical", "sampled", "exact")
BACKENDS = ("auto", "backpack", "functorch")
_BACKPACK_LOCK = threading.Lock()


def _as_tensors(model: nn.Module, X, y, objective: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs in the model's dtype (float64 models give float64 Fishers)."""
    dtype = next(model.parameters()).dtype
    return as_inputs(X, dtype), objective.fisher_labels(y, dtype)


def _objective(kind: str, task: str | Objective) -> Objective:
    """The objective, once ``kind`` is known to be one of its Fisher kinds."""
    if kind not in FISHER_KINDS:
        raise ValueError(f"fisher kind must be one of {FISHER_KINDS}, got {kind!r}")
    objective = get_objective(task)
    kinds = objective.declaration.fisher_kinds
    if kind not in kinds:
        raise ValueError(f"a {objective.name} objective has no {kind} Fisher; use one of {', '.join(kinds)}")
    return objective


def _batches(n: int, batch_size: int) -> Iterator[slice]:
    for start in range(0, n, batch_size):
        cancel.check()
        yield slice(start, min(start + batch_size, n))


def _by_length(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id inputs sorted by length, so that each chunk can run at its own longest text (sums over
    examples do not depend on their order); other inputs unchanged."""
    lengths = token_lengths(model, X)
    if lengths is None:
        return X, y
    order = torch.argsort(lengths, stable=True)
    return X[order], y[order]


def _chunk(model: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """A chunk of token ids without the columns that are padding in every row (vmap cannot trim)."""
    if not isinstance(model, TokenModel) or X.is_floating_point():
        return X
    return trim_padding(X, model.pad_token_id)


# Modules every BackPACK extension used here supports (first- and second-order).
_BACKPACK_MODULES = (
    nn.Sequential,
    nn.Linear,
    nn.Conv2d,
    nn.Flatten,
    nn.ReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.Identity,
)


def _backpack_supported(model: nn.Module) -> bool:
    return all(type(m) in _BACKPACK_MODULES for m in model.modules())


def _use_backpack(model: nn.Module, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"fisher backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "functorch":
        return False
    supported = _backpack_supported(model)
    if backend == "backpack" and not supported:
        raise ValueError("BackPACK does not support every module of this model; use backend='functorch'")
    return supported


def _backpack_quantity(
    model: nn.Module, X: torch.Tensor, target: torch.Tensor, objective: Objective, extension, field: str
) -> dict[str, torch.Tensor]:
    from backpack import backpack, extend

    extended = extend(copy.deepcopy(model).eval())
    # BackPACK keeps its active extensions in global state: one pass at a time per process.
    with _BACKPACK_LOCK, backpack(extension), warnings.catch_warnings():
        loss = extend(objective.summed_loss())(extended(X), target)
        # Inputs never require grad here, which makes torch warn about BackPACK's module hooks.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss.backward()
    return {name: getattr(p, field).detach() for name, p in extended.named_parameters()}


def _functorch_grads(
    model: nn.Module, X: torch.Tensor, target: torch.Tensor, objective: Objective
) -> dict[str, torch.Tensor]:
    """Per-example gradients of the summed loss, {name: (N, *shape)}."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    loss_fn = objective.summed_loss()

    def single(p, x, t):
        out = functional_call(model, (p, buffers), (x[None],))
        return loss_fn(out, t[None])

    return vmap(grad(single), in_dims=(None, 0, 0))(params, X, target)


def diagonal_fisher(
    model: nn.Module,
    X,
    y,
    *,
    kind: str = "exact",
    task: str | Objective = "classification",
    batch_size: int = 256,
    noise_std: float = 1.0,
    seed: int = 0,
    backend: str = "auto",
) -> dict[str, torch.Tensor]:
    """The diagonal Fisher, averaged over examples, as {parameter name: tensor}.

    ``task`` is the objective (or its name) that says what the labels and the likelihood are.
    """
    objective = _objective(kind, task)
    scale = objective.score_scale(noise_std)
    X, y = _by_length(model, *_as_tensors(model, X, y, objective))
    generator = torch.Generator().manual_seed(seed)
    use_backpack = _use_backpack(model, backend)
    totals = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    device = module_device(model)
    for rows in _batches(len(X), batch_size):
        xb, yb = to_device(_chunk(model, X[rows]), device), to_device(y[rows], device)
        if kind == "exact" and use_backpack:
            from backpack.extensions import DiagGGNExact

            target = objective.loss_target(yb)
            batch = _backpack_quantity(model, xb, target, objective, DiagGGNExact(), "diag_ggn_exact")
            batch = {k: v * scale for k, v in batch.items()}
        elif kind == "exact":
            batch = _functorch_exact_diag(model, xb, objective, noise_std)
        else:
            target = objective.fisher_targets(model, xb, yb, kind, noise_std, generator)
            if use_backpack:
                from backpack.extensions import SumGradSquared

                batch = _backpack_quantity(model, xb, target, objective, SumGradSquared(), "sum_grad_squared")
            else:
                batch = _functorch_squared_grads(model, xb, target, objective)
            batch = {k: v * scale**2 for k, v in batch.items()}
        for name, value in batch.items():
            totals[name] += value
    return {name: total / len(X) for name, total in totals.items()}


def _functorch_exact_diag(
    model: nn.Module, X: torch.Tensor, objective: Objective, noise_std: float
) -> dict[str, torch.Tensor]:
    totals: dict[str, torch.Tensor] = {}
    for target, weight in objective.exact_targets(model, X, noise_std):
        squares = _functorch_squared_grads(model, X, target, objective, weight)
        for name, value in squares.items():
            totals[name] = totals.get(name, 0) + value * objective.score_scale(noise_std) ** 2
    return totals


def _functorch_squared_grads(
    model: nn.Module, X: torch.Tensor, target: torch.Tensor, objective: Objective, weight: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Σ_n w_n (∇ loss_n)², per parameter, from per-example gradients (``w`` = 1 without ``weight``).

    A token-embedding table is done sparsely: a text's gradient touches only the rows of its
    tokens, so per-token gradients of the embedding output are summed per (text, token id) and
    squared, instead of materialising a dense vocabulary × width gradient per example (which
    dominates the time and memory of a small transformer).
    """
    embedding = model.token_embedding() if isinstance(model, TokenModel) else None
    if embedding is None:
        grads = _functorch_grads(model, X, target, objective)
        return {k: _weighted_sum(g**2, weight) for k, g in grads.items()}
    table_name, module = embedding
    params = {name: p.detach() for name, p in model.named_parameters() if name != table_name}
    fixed = {table_name: module.weight.detach(), **dict(model.named_buffers())}
    loss_fn = objective.summed_loss()
    added: dict[str, torch.Tensor] = {}
    handle = module.register_forward_hook(lambda _module, _args, output: output + added["delta"])

    def single(p, delta, x, t):
        added["delta"] = delta[None]
        out = functional_call(model, ({**p, **fixed},), (x[None],))
        return loss_fn(out, t[None])

    try:
        zeros = torch.zeros(*X.shape, module.weight.shape[1], dtype=module.weight.dtype, device=X.device)
        grads, token_grads = vmap(grad(single, argnums=(0, 1)), in_dims=(None, 0, 0, 0))(params, zeros, X, target)
    finally:
        handle.remove()
    squares = {k: _weighted_sum(g**2, weight) for k, g in grads.items()}
    vocab = module.weight.shape[0]
    keys = (torch.arange(len(X), device=X.device)[:, None] * vocab + X).reshape(-1)
    rows, inverse = torch.unique(keys, return_inverse=True)
    if weight is not None:
        token_grads = token_grads * weight.sqrt().reshape(-1, 1, 1)
    per_text = torch.zeros(len(rows), token_grads.shape[-1], dtype=token_grads.dtype, device=token_grads.device)
    per_text.index_add_(0, inverse, token_grads.reshape(-1, token_grads.shape[-1]))
    table = torch.zeros_like(module.weight).index_add_(0, rows % vocab, per_text**2)
    return {name: squares[name] if name != table_name else table for name, _ in model.named_parameters()}


def _weighted_sum(values: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    if weight is None:
        return values.sum(0)
    return (weight.reshape(-1, *([1] * (values.dim() - 1))) * values).sum(0)


def flatten_parameters(values: dict[str, torch.Tensor], model: nn.Module) -> torch.Tensor:
    """Concatenate per-parameter tensors (or (rows, *shape) factors) in the model's parameter order."""
    names = [name for name, _ in model.named_parameters()]
    first = values[names[0]]
    lead = first.shape[: first.dim() - dict(model.named_parameters())[names[0]].dim()]
    return torch.cat([values[n].reshape(*lead, -1) for n in names], dim=-1)


def _score_blocks(
    model: nn.Module,
    X,
    y,
    *,
    kind: str,
    task: str | Objective,
    batch_size: int,
    noise_std: float,
    seed: int,
    backend: str,
) -> Iterator[torch.Tensor]:
    """Per-example score rows (rows × D over the flattened parameters), a chunk of examples at a time;
    their Gram summed over all chunks is N·F."""
    objective = _objective(kind, task)
    scale = objective.score_scale(noise_std)
    X, y = _by_length(model, *_as_tensors(model, X, y, objective))
    generator = torch.Generator().manual_seed(seed)
    use_backpack = _use_backpack(model, backend)
    device = module_device(model)
    for rows in _batches(len(X), batch_size):
        xb, yb = to_device(_chunk(model, X[rows]), device), to_device(y[rows], device)
        if kind == "exact" and use_backpack:
            from backpack.extensions import SqrtGGNExact

            target = objective.loss_target(yb)
            sqrt = _backpack_quantity(model, xb, target, objective, SqrtGGNExact(), "sqrt_ggn_exact")
            flat = flatten_parameters(sqrt, model)  # (C, N, D)
            yield flat.reshape(-1, flat.shape[-1]) * scale**0.5
        elif kind == "exact":
            for target, weight in objective.exact_targets(model, xb, noise_std):
                grads = flatten_parameters(_functorch_grads(model, xb, target, objective), model)
                yield grads * weight.sqrt()[:, None] * scale
        else:
            target = objective.fisher_targets(model, xb, yb, kind, noise_std, generator)
            if use_backpack:
                from backpack.extensions import BatchGrad

                grads = _backpack_quantity(model, xb, target, objective, BatchGrad(), "grad_batch")
            else:
                grads = _functorch_grads(model, xb, target, objective)
            yield flatten_parameters(grads, model) * scale


def fisher_factors(
    model: nn.Module,
    X,
    y,
    *,
    kind: str = "exact",
    task: str | Objective = "classification",
    batch_size: int = 256,
    noise_std: float = 1.0,
    seed: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """U (rows × D) over the flattened parameters with the averaged Fisher F ≈ UᵀU.

    Empirical and sampled kinds give one row per example; the exact kind gives C rows per
    example for C classes (BackPACK's SqrtGGNExact, or √p_c-weighted scores).
    """
    options = {"kind": kind, "task": task, "noise_std": noise_std, "seed": seed, "backend": backend}
    blocks = list(_score_blocks(model, X, y, batch_size=batch_size, **options))
    return torch.cat(blocks) / len(X) ** 0.5


def factor_rows_within(memory_bytes: float, dim: int) -> int:
    """Sketch rows ℓ whose memory fits ``memory_bytes``: the 2ℓ-row float32 buffer and a chunk of at most
    ℓ per-example score rows, 3ℓ·D·4 bytes in all (at least one row)."""
    return max(1, int(memory_bytes // (3 * 4 * dim)))


def fisher_sketch(
    model: nn.Module,
    X,
    y,
    *,
    rows: int,
    kind: str = "exact",
    task: str | Objective = "classification",
    batch_size: int = 256,
    noise_std: float = 1.0,
    seed: int = 0,
    backend: str = "auto",
) -> tuple[torch.Tensor, dict[str, float]]:
    """U (at most ``rows`` × D) with UᵀU a Frequent Directions sketch of the averaged Fisher over every example.

    The per-example scores of all of ``X`` stream through the sketch (:class:`~mergeflow.sketch.FrequentDirections`),
    a chunk of at most ``rows`` examples at a time, so memory stays about ``3 · rows · D`` floats however many
    examples there are. F − UᵀU is positive semi-definite with spectral norm at most the returned
    ``shrinkage`` (the diagonal merges use diag(F) exactly and UᵀU for the off-diagonal part).

    Returns:
        U, and ``{"rows", "examples", "shrinkage", "trace"}`` (shrinkage and trace of F, per example).
    """
    from mergeflow.sketch import FrequentDirections

    dim = sum(p.numel() for p in model.parameters())
    first = next(model.parameters())
    sketch = FrequentDirections(rows, dim, dtype=first.dtype, device=first.device)
    options = {"kind": kind, "task": task, "noise_std": noise_std, "seed": seed, "backend": backend}
    trace = 0.0
    for block in _score_blocks(model, X, y, batch_size=min(batch_size, rows), **options):
        trace += float((block.to(torch.float64) ** 2).sum())
        sketch.insert(block)
    n = len(X)
    factors = sketch.sketch() / n**0.5
    summary = {"rows": float(len(factors)), "examples": float(n), "shrinkage": sketch.shrinkage / n, "trace": trace / n}
    return factors, summary
