"""Applying permutations to state dicts, diagonal Fishers and flattened factor matrices.

Permutations are CPU integer tensors (their assignment problems are solved on the CPU); each is
moved to the device of the tensor it permutes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from mergeflow.align.spec import PermutationSpec
from mergeflow.device import host_tensor
from mergeflow.grams import CONV1D

Perms = Mapping[str, torch.Tensor]


def block_index(perm: torch.Tensor, block: int, repeat: int = 1) -> torch.Tensor:
    """Indices along an axis of ``repeat`` runs of ``len(perm) * block`` entries that move whole
    blocks by ``perm`` within every run."""
    perm = host_tensor(perm, torch.long)
    index = perm if block == 1 else (perm[:, None] * block + torch.arange(block, device=perm.device)).reshape(-1)
    if repeat == 1:
        return index
    run = len(perm) * block
    return (torch.arange(repeat, device=perm.device)[:, None] * run + index).reshape(-1)


def permute_tensor(
    tensor: torch.Tensor, axis: int, perm: torch.Tensor, block: int = 1, repeat: int = 1
) -> torch.Tensor:
    """``tensor`` with the units of ``axis`` (blocks of ``block`` entries, in ``repeat`` runs) reordered by ``perm``."""
    if tensor.shape[axis] != len(perm) * block * repeat:
        raise ValueError(
            f"axis {axis} of a tensor of shape {tuple(tensor.shape)} does not hold {repeat} x {len(perm)} "
            f"units of {block}"
        )
    return tensor.index_select(axis, block_index(perm, block, repeat).to(tensor.device))


def _check_perms(spec: PermutationSpec, perms: Perms) -> None:
    for name, group in spec.groups.items():
        if name not in perms:
            raise KeyError(f"no permutation given for group {name!r}")
        if len(perms[name]) != group.size:
            raise ValueError(f"permutation {name!r} has {len(perms[name])} entries, the group has {group.size}")


def apply_permutation(
    spec: PermutationSpec, state: Mapping[str, torch.Tensor], perms: Perms
) -> dict[str, torch.Tensor]:
    """A new dict with every tensor of ``state`` permuted as ``perms`` says.

    Works on anything keyed and shaped like the state: a state dict, a diagonal Fisher, a
    gradient. Keys of the spec absent from ``state`` are skipped; tensors no group touches
    are shared with ``state``, not copied.
    """
    _check_perms(spec, perms)
    out = dict(state)
    for key, entries in spec.by_key().items():
        if key not in out:
            continue
        tensor = out[key]
        for group, axis, block, repeat in entries:
            tensor = permute_tensor(tensor, axis, perms[group], block, repeat)
        out[key] = tensor
    return out


def permute_grams(spec: PermutationSpec, grams: Mapping[str, torch.Tensor], perms: Perms) -> dict[str, torch.Tensor]:
    """Gram matrices of linear layers' inputs, both axes permuted as the layer's input axis is.

    A Gram is keyed by its layer's weight: an ``(out, in)`` ``nn.Linear`` weight (input axis 1), or
    :data:`~mergeflow.grams.CONV1D` + a transformers ``Conv1D`` weight stored ``(in, out)`` (axis 0).
    """
    _check_perms(spec, perms)
    by_key = spec.by_key()
    out = dict(grams)
    for key, gram in grams.items():
        weight, input_axis = (key.removeprefix(CONV1D), 0) if key.startswith(CONV1D) else (key, 1)
        for group, axis, block, repeat in by_key.get(weight, []):
            if axis == input_axis:
                for side in (0, 1):
                    gram = permute_tensor(gram, side, perms[group], block, repeat)
        out[key] = gram
    return out


def invert_permutation(perms: Perms) -> dict[str, torch.Tensor]:
    """The inverse of every permutation: ``apply_permutation`` with it undoes one with ``perms``."""
    return {name: torch.argsort(host_tensor(p, torch.long)) for name, p in perms.items()}


def compose_permutations(first: Perms, second: Perms) -> dict[str, torch.Tensor]:
    """Permutations equal to applying ``first`` and then ``second``."""
    return {
        name: host_tensor(first[name])[host_tensor(second[name]).to(host_tensor(first[name]).device)] for name in first
    }


def random_permutation(spec: PermutationSpec, seed: int | torch.Generator = 0) -> dict[str, torch.Tensor]:
    """A uniformly random permutation of every group, from an explicit generator."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(int(seed))
    return {name: torch.randperm(group.size, generator=gen, device=gen.device) for name, group in spec.groups.items()}


def flat_column_index(
    spec: PermutationSpec, names: Sequence[str], shapes: Sequence[Sequence[int]], perms: Perms
) -> torch.Tensor:
    """Column indices ``idx`` such that ``flat[..., idx]`` permutes a concatenation of flattened tensors.

    ``names[i]`` (a state-dict key) has shape ``shapes[i]``; the flat vector is their
    concatenation in that order, each flattened row-major.
    """
    if len(names) != len(shapes):
        raise ValueError("names and shapes differ in length")
    pieces, offset = {}, 0
    for name, shape in zip(names, shapes, strict=True):
        size = math.prod(shape)
        pieces[name] = torch.arange(offset, offset + size, device="cpu").reshape(tuple(shape))
        offset += size
    permuted = apply_permutation(spec, pieces, perms)
    return torch.cat([permuted[name].reshape(-1) for name in names])


def permute_flat_columns(
    spec: PermutationSpec,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    matrix: torch.Tensor,
    perms: Perms,
) -> torch.Tensor:
    """Permute the columns of ``matrix`` (``(N, D)``, or any ``(..., D)``), whose columns are the
    flattened tensors ``names`` (of ``shapes``) concatenated, as :func:`apply_permutation` would
    permute those tensors. Used for per-example gradient factors U with F ≈ UᵀU."""
    index = flat_column_index(spec, names, shapes, perms)
    if matrix.shape[-1] != len(index):
        raise ValueError(f"matrix has {matrix.shape[-1]} columns, the named tensors have {len(index)} entries")
    return matrix.index_select(matrix.dim() - 1, index.to(matrix.device))
