"""DELLA (Deep et al. 2024): drop task-vector entries with probabilities ranked by magnitude, rescale the rest.

As mergekit's ``della`` (TIES' sign election and disjoint mean of the pruned vectors) and
``della_linear`` (their sum). Each row of a task vector ranks its entries by magnitude; the keep
probability rises evenly from ``density − ε`` (smallest) to ``density + ε`` (largest), and a kept entry
is divided by its probability (``rescale``). Rows are of the whole tensor and ``1/p`` differs per entry,
so these methods are not elementwise: a streamed merge takes each such tensor whole (the K clients'
copies of one tensor at a time), not in blocks.
"""

from __future__ import annotations

import torch

from mergeflow.merge.registry import TensorInputs, merge_method
from mergeflow.merge.sparsify import bernoulli_draws, disjoint_mean, tensor_generator
from mergeflow.merge.sums import running_sum
from mergeflow.schema.merge import DellaOptions

_ROW_CHUNK = 1 << 20  # entries of whole rows ranked and drawn at a time: bounds the temporaries


def keep_probabilities(task: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """Each entry's keep probability, shaped like ``task``: per row, by the rank of its magnitude.

    Rows: a 1-D (or 0-D) tensor is one row, as in mergekit; a matrix's rows are its rows; a conv
    kernel ``(out, in, ...)`` has one row per output channel (mergekit ranks along dim 1 instead). The
    smallest magnitude of a row gets ``density − epsilon``, the largest ``density + epsilon``, evenly
    spaced by rank; equal magnitudes are ranked by index. A row of one entry gets ``density``.
    """
    return _row_probabilities(_rows(task), density, epsilon).view(task.shape)


def _rows(task: torch.Tensor) -> torch.Tensor:
    return task.reshape(1, -1) if task.dim() < 2 else task.reshape(task.shape[0], -1)


def _row_probabilities(rows: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    width = rows.shape[1]
    if width == 1:
        return torch.full_like(rows, density)
    order = rows.abs().argsort(dim=1, stable=True)
    steps = torch.arange(width, dtype=rows.dtype, device=rows.device).mul_(2.0 * epsilon / (width - 1))
    return torch.empty_like(rows).scatter_(1, order, steps.expand_as(rows)).add_(density - epsilon)


def prune_(tasks: torch.Tensor, options: DellaOptions, name: str) -> torch.Tensor:
    """DELLA's drops and rescaling of the ``(K, ...)`` task vectors, in place (and returned).

    Drawn client after client, a chunk of whole rows at a time, from a generator on their device seeded
    by ``seed`` and the tensor's name; temporaries stay a few chunks' size whatever the tensor's.
    """
    generator = tensor_generator(options.seed, name, tasks.device)
    tasks = tasks.contiguous()  # so that each row chunk is a view
    for task in tasks:
        rows = _rows(task)
        before = task.abs().sum() if options.rescale == "l1" else None
        step = max(1, _ROW_CHUNK // max(1, rows.shape[1]))
        for start in range(0, rows.shape[0], step):
            chunk = rows[start : start + step]
            probabilities = _row_probabilities(chunk, options.density, options.epsilon)
            chunk.mul_(bernoulli_draws(chunk.shape, probabilities, generator))
            if options.rescale == "probability":
                chunk.div_(probabilities)
        if before is not None:
            after = task.abs().sum()
            if before >= 1e-7 and after >= 1e-7:  # mergekit's guard against tiny norms
                task.mul_(before / after)
    return tasks


def pruned(tasks: torch.Tensor, options: DellaOptions, name: str) -> torch.Tensor:
    """The ``(K, ...)`` task vectors after DELLA's drops and rescaling, as a new tensor (``prune_``)."""
    return prune_(tasks.clone(), options, name)


def _pruned_tasks(x: TensorInputs, options: DellaOptions) -> torch.Tensor:
    assert x.base is not None  # needs base (schema)
    return prune_(x.stacked() - x.base, options, x.name)


@merge_method("della")
def della(x: TensorInputs, options: DellaOptions) -> torch.Tensor:
    """DELLA: base + λ · disjoint mean of the magnitude-ranked, randomly pruned, rescaled, sign-elected task vectors."""
    return x.base + options.scaling * disjoint_mean(_pruned_tasks(x, options), overwrite=True)


@merge_method("della_linear")
def della_linear(x: TensorInputs, options: DellaOptions) -> torch.Tensor:
    """DELLA + task arithmetic: base + λ · Σ_k of the magnitude-ranked, randomly pruned, rescaled task vectors."""
    return x.base + options.scaling * running_sum(_pruned_tasks(x, options))
