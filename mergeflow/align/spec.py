"""Permutation specs: which axes of which state-dict tensors each hidden-unit permutation acts on.

A permutation group (``"P_0"``, ``"P_1"``, ...) is the set of hidden units of one layer. Permuting
it reorders the rows of that layer's weight and bias, the entries of any normalisation layer that
follows, and the columns of the next layer. An axis entry ``(key, axis, block)`` says that along
``axis`` of ``state[key]`` unit ``i`` occupies the ``block`` consecutive entries
``[i * block, (i + 1) * block)``; ``block > 1`` arises when a conv output is flattened into a
Linear layer (one block of H*W columns per channel).

A permutation ``p`` (a LongTensor of size ``n``) maps the new unit ``i`` to the old unit ``p[i]``,
i.e. ``new = old.index_select(axis, p)``, which is ``P @ W`` for the permutation matrix
``P[i, p[i]] = 1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class AxisRef(NamedTuple):
    """One axis of one state-dict tensor acted on by a permutation group."""

    key: str
    axis: int
    block: int = 1


class Probe(NamedTuple):
    """Where a group's units can be observed: the output of module ``module`` (a name from
    ``named_modules``), whose dimension ``axis`` holds the units in blocks of ``block``."""

    module: str
    axis: int
    block: int = 1


@dataclass(frozen=True)
class PermGroup:
    """One permutation group: ``size`` units acting on ``axes``; ``probe`` serves activation matching."""

    size: int
    axes: tuple[AxisRef, ...]
    probe: Probe | None = None


@dataclass(frozen=True)
class PermutationSpec:
    """Permutation groups by name, in forward order."""

    groups: dict[str, PermGroup]

    def keys(self) -> list[str]:
        """State-dict keys touched by at least one group, in first-seen order."""
        return list(self.by_key())

    def by_key(self) -> dict[str, list[tuple[str, int, int]]]:
        """For every touched key, its ``(group, axis, block)`` entries."""
        out: dict[str, list[tuple[str, int, int]]] = {}
        for name, group in self.groups.items():
            for ref in group.axes:
                out.setdefault(ref.key, []).append((name, ref.axis, ref.block))
        return out

    def identity(self) -> dict[str, torch.Tensor]:
        """The identity permutation of every group."""
        return {name: torch.arange(group.size, device="cpu") for name, group in self.groups.items()}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form; :meth:`from_dict` reverses it."""
        return {
            name: {
                "size": group.size,
                "axes": [list(ref) for ref in group.axes],
                "probe": list(group.probe) if group.probe is not None else None,
            }
            for name, group in self.groups.items()
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PermutationSpec:
        """Rebuild a spec from :meth:`to_dict` output."""
        groups = {
            name: PermGroup(
                size=int(g["size"]),
                axes=tuple(AxisRef(str(k), int(a), int(b)) for k, a, b in g["axes"]),
                probe=Probe(str(g["probe"][0]), int(g["probe"][1]), int(g["probe"][2])) if g.get("probe") else None,
            )
            for name, g in data.items()
        }
        return cls(groups)
