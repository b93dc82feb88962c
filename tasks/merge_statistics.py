"""Which per-client statistics the merges read: the fisher stage computes them and the align stage permutes
them, nothing more (the merge stage is their only reader)."""

from __future__ import annotations

from mergeflow.config import Params
from mergeflow.schema.merge import DECLARED

# The merge inputs (``mergeflow.schema.merge.NEEDS``) the fisher stage computes, in the order it computes them.
STATISTICS = ("fishers", "grams", "factors")


def statistics_read(params: Params) -> tuple[str, ...]:
    """The statistics of :data:`STATISTICS` that some entry of ``merge.methods`` reads: those among its
    method's declared inputs (``uses``, the optional ones included, since the merge stage passes them
    when it has them); factors only with ``fisher.low_rank``, as the merge stage reads them."""
    read: set[str] = set()
    for name in params.merge.methods:
        read |= DECLARED[params.merge.method_of(name)].uses
    if not params.fisher.low_rank:
        read.discard("factors")
    return tuple(statistic for statistic in STATISTICS if statistic in read)
