"""Permutation specs: which axes of which state-dict tensors each hidden-unit permutation acts on.

A permutation group (``"P_0"``, ``"P_1"``, ...) is the set of hidden units of one layer. Permuting
it reorders the rows of that layer's weight and bias, the entries of any normalisation layer that
follows, and the columns of the next layer. An axis entry ``(key, axis, block)`` says that along
``axis`` of ``state[key]`` unit ``i`` occupies the ``block`` consecutive entries
``[i * block, (i + 1) * block)``; ``block > 1`` arises when a conv output is flattened into a
Linear layer (one block of H*W columns per channel) and for attention heads (one block of
``head_dim`` rows per head). ``repeat > 1`` says the axis holds ``repeat`` such runs one after
another, each permuted alike: GPT-2's fused ``c_attn`` holds the query, key and value projections
side by side.

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
    repeat: int = 1


class Probe(NamedTuple):
    """Where a group's units can be observed: the output of module ``module`` (a name from
    ``named_modules``), or its first input with ``point="input"``, whose dimension ``axis`` holds
    the units in blocks of ``block``.

    The entries of a block are further samples of their unit (a conv channel's positions) unless
    ``features``: then they are the unit's own features (an attention head's ``head_dim``
    dimensions), and two units compare by the best pairing of their features.
    """

    module: str
    axis: int
    block: int = 1
    features: bool = False
    point: str = "output"


@dataclass(frozen=True)
class PermGroup:
    """One permutation group: ``size`` units acting on ``axes``; its probes serve activation matching.

    ``probe`` is one :class:`Probe` or a tuple of them (a transformer's residual stream is observed
    after every block); activation matching sums the units' similarities over the probes.
    """

    size: int
    axes: tuple[AxisRef, ...]
    probe: Probe | tuple[Probe, ...] | None = None

    def probes(self) -> tuple[Probe, ...]:
        """The group's probes as a tuple (empty without one)."""
        if self.probe is None:
            return ()
        return (self.probe,) if isinstance(self.probe, Probe) else tuple(self.probe)


@dataclass(frozen=True)
class PermutationSpec:
    """Permutation groups by name, in forward order."""

    groups: dict[str, PermGroup]

    def keys(self) -> list[str]:
        """State-dict keys touched by at least one group, in first-seen order."""
        return list(self.by_key())

    def by_key(self) -> dict[str, list[tuple[str, int, int, int]]]:
        """For every touched key, its ``(group, axis, block, repeat)`` entries."""
        out: dict[str, list[tuple[str, int, int, int]]] = {}
        for name, group in self.groups.items():
            for ref in group.axes:
                out.setdefault(ref.key, []).append((name, ref.axis, ref.block, ref.repeat))
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
                "probes": [list(probe) for probe in group.probes()],
            }
            for name, group in self.groups.items()
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PermutationSpec:
        """Rebuild a spec from :meth:`to_dict` output."""
        groups = {}
        for name, g in data.items():
            probes = tuple(_probe(p) for p in g.get("probes", [g["probe"]] if g.get("probe") else []))
            groups[name] = PermGroup(
                size=int(g["size"]),
                axes=tuple(AxisRef(str(ref[0]), *(int(v) for v in ref[1:])) for ref in g["axes"]),
                probe=(probes[0] if len(probes) == 1 else probes) if probes else None,
            )
        return cls(groups)


def _probe(values: list) -> Probe:
    """A probe from its list form (specs written before ``features`` and ``point`` list three fields)."""
    given = dict(zip(Probe._fields, values, strict=False))
    return Probe(
        str(given["module"]),
        int(given["axis"]),
        int(given.get("block", 1)),
        bool(given.get("features", False)),
        str(given.get("point", "output")),
    )
