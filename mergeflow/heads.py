"""Task heads: the body every task shares and the head each task keeps, on plain state dicts.

In a multi-task run the same base is fine-tuned on K tasks, each with its own label set and so its own
head (the parameters its model family names, :meth:`~mergeflow.models.family.ModelFamily.head_names`).
Merges combine the bodies; a head is never averaged across tasks: task k's classes are not task j's,
so row c of one head and row c of another are unrelated (they may not even have the same number of
rows), and their mean would be meaningless. Each task keeps the head of its own clients
(:func:`task_head`), and is scored with the merged body plus that head (:func:`assemble`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from mergeflow.models import family_of

State = Mapping[str, torch.Tensor]


def head_names(spec: dict[str, Any]) -> tuple[str, ...]:
    """The state-dict keys of the task head of ``spec``'s model, as its family names them (``()``: no head)."""
    return family_of(spec["arch"]).head_names(spec)


def split_head(state: State, names: Collection[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``state`` as ``(body, head)``: the tensors outside ``names`` and those in it (the tensors themselves).

    Raises:
        KeyError: naming a head key that ``state`` lacks.
    """
    missing = [name for name in names if name not in state]
    if missing:
        raise KeyError(f"the state has no head tensor {missing[0]!r}")
    return body_of(state, names), {key: value for key, value in state.items() if key in names}


def body_of(statistics: State, names: Collection[str]) -> dict[str, torch.Tensor]:
    """The entries of a per-parameter map (a state, Fishers, Grams keyed by weight name) outside the head
    ``names``: what a merge of tasks with their own heads combines. A head key the map lacks (a Gram has no
    bias) is no error."""
    return {key: value for key, value in statistics.items() if key not in names}


def assemble(body: State, head: State) -> dict[str, torch.Tensor]:
    """One model's state: ``body``'s tensors, then ``head``'s.

    Raises:
        ValueError: naming a key that both hold.
    """
    both = [key for key in head if key in body]
    if both:
        raise ValueError(f"{both[0]!r} is in both the body and the head")
    return {**body, **head}


def task_base(
    spec: dict[str, Any], state: State, output_dim: int, seed: int
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A task's base model: the body of ``state`` (a model of ``spec``), bit for bit, and a new head of
    ``output_dim`` outputs initialised as the family initialises a fresh model of that spec with ``seed``.

    Returns:
        The task's spec (:meth:`~mergeflow.models.family.ModelFamily.with_outputs`) and its state, in the
        order of that spec's model. A model without a head keeps its spec and state.

    Raises:
        KeyError, ValueError: naming a body tensor that ``state`` lacks, or holds with another shape than
            ``spec``'s model.
    """
    family = family_of(spec["arch"])
    body, _ = split_head(state, family.head_names(spec))
    task_spec = family.with_outputs(spec, output_dim, seed)
    fresh = family.from_spec(task_spec).state_dict()
    fresh_body, head = split_head(fresh, family.head_names(task_spec))
    for key in [*fresh_body, *(key for key in body if key not in fresh_body)]:
        if key not in body or key not in fresh_body:
            where = "the spec's model" if key not in fresh_body else "the state"
            raise KeyError(f"body tensor {key!r} is missing from {where}")
        if body[key].shape != fresh_body[key].shape:
            shapes = f"{tuple(body[key].shape)}, the spec's model {tuple(fresh_body[key].shape)}"
            raise ValueError(f"body tensor {key!r} has shape {shapes}")
    return task_spec, {key: body[key] if key in body else head[key] for key in fresh}


def task_head(heads: Sequence[State], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """The head of a task from its clients' heads: one client's is its head bit for bit (no arithmetic);
    several clients' (one task split across clients) their average weighted by ``weights`` (their example
    counts), computed in float64 and cast to the stored dtype. Heads of different tasks never meet here.

    Raises:
        ValueError: on no heads, a weight per head missing, negative weights or a zero sum, or heads with
            different keys or shapes (naming the key).
    """
    if not heads or len(heads) != len(weights):
        raise ValueError(f"task_head needs one weight per head, got {len(heads)} heads and {len(weights)} weights")
    if len(heads) == 1:
        return dict(heads[0])
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("head weights must be non-negative with a positive sum")
    first = heads[0]
    for head in heads[1:]:
        for key in first.keys() | head.keys():
            if key not in head or key not in first or head[key].shape != first[key].shape:
                raise ValueError(f"the clients' heads differ at {key!r}")
    total = float(sum(weights))
    shares = [float(w) / total for w in weights]
    return {key: _weighted_sum([head[key] for head in heads], shares).to(value.dtype) for key, value in first.items()}


def _weighted_sum(tensors: Sequence[torch.Tensor], shares: Sequence[float]) -> torch.Tensor:
    """Σ_k s_k·t_k in float64."""
    total = torch.zeros_like(tensors[0], dtype=torch.float64)
    for tensor, share in zip(tensors, shares, strict=True):
        total += share * tensor.to(torch.float64)
    return total
