"""Byzantine-robust aggregation rules on the clients' flattened models, the implementations of the
aggregators declared in ``mergeflow.schema.federated`` (:data:`~mergeflow.schema.federated.AGGREGATORS`).

Each rule takes the n messages as the rows of an ``(n, P)`` tensor and returns the aggregate
(length P) and, per client, the fraction of the aggregate's coordinates its message took part in
(1 for every client under the mean; 1 for the chosen one and 0 otherwise under Krum; per-coordinate
shares under the median and the trimmed mean), which the round metrics report as what was kept.
"""

from __future__ import annotations

import torch

from mergeflow.schema.federated import AggregatorOptions


def used_share(order: torch.Tensor, lo: int, hi: int, n: int) -> torch.Tensor:
    """Per client, the fraction of coordinates where its rank (``order``: the sorting indices along
    the client axis) lies in ``[lo, hi)``."""
    chosen = order[lo:hi].reshape(-1)
    counts = torch.bincount(chosen, minlength=n).to(torch.float64)
    return counts / order.shape[1]


def weighted_average(stack: torch.Tensor, weights: torch.Tensor, options: AggregatorOptions):
    """Σ_k w_k θ_k (the weights sum to one)."""
    return weights.to(stack.dtype) @ stack, torch.ones(stack.shape[0], dtype=torch.float64, device=stack.device)


def coordinate_median(stack: torch.Tensor, weights: torch.Tensor, options: AggregatorOptions):
    """Coordinate-wise median (Yin et al. 2018); an even count averages the two middle values."""
    n = stack.shape[0]
    values, order = torch.sort(stack, dim=0, stable=True)
    lo, hi = (n - 1) // 2, n // 2 + 1
    return values[lo:hi].mean(dim=0), used_share(order, lo, hi, n)


def trimmed_mean(stack: torch.Tensor, weights: torch.Tensor, options: AggregatorOptions):
    """Coordinate-wise β-trimmed mean (Yin et al. 2018): drop the ⌊βn⌋ largest and smallest values."""
    n = stack.shape[0]
    cut = int(options.beta * n)
    values, order = torch.sort(stack, dim=0, stable=True)
    return values[cut : n - cut].mean(dim=0), used_share(order, cut, n - cut, n)


def krum_scores(stack: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's score of each row: the sum of its squared distances to its n − f − 2 nearest other rows."""
    n = stack.shape[0]
    distances = torch.cdist(stack, stack).pow(2)
    distances.fill_diagonal_(float("inf"))
    nearest = max(1, n - f - 2)
    return torch.topk(distances, nearest, dim=1, largest=False).values.sum(dim=1)


def _selection(selected: list[int], like: torch.Tensor) -> torch.Tensor:
    kept = torch.zeros(like.shape[0], dtype=torch.float64, device=like.device)
    kept[selected] = 1.0
    return kept


def krum(stack: torch.Tensor, weights: torch.Tensor, options: AggregatorOptions):
    """Krum (Blanchard et al. 2017): the message with the least score."""
    best = int(torch.argmin(krum_scores(stack, options.f)))
    return stack[best].clone(), _selection([best], stack)


def multikrum(stack: torch.Tensor, weights: torch.Tensor, options: AggregatorOptions):
    """Multi-Krum: the mean of the m messages with the least Krum scores (m = n − f by default)."""
    n = stack.shape[0]
    m = options.m if options.m is not None else n - options.f
    chosen = torch.argsort(krum_scores(stack, options.f), stable=True)[:m].tolist()
    return stack[chosen].mean(dim=0), _selection(chosen, stack)


def bulyan(stack: torch.Tensor, weights: torch.Tensor, options: AggregatorOptions):
    """Bulyan (El Mhamdi et al. 2018): θ = n − 2f messages picked one by one by Krum on those left,
    then per coordinate the mean of the θ − 2f values closest to the coordinate's median."""
    n, f = stack.shape[0], options.f
    remaining, chosen = list(range(n)), []
    for _ in range(n - 2 * f):
        scores = krum_scores(stack[remaining], f)
        chosen.append(remaining.pop(int(torch.argmin(scores))))
    picked = stack[chosen]
    keep = len(chosen) - 2 * f
    median = coordinate_median(picked, weights[chosen], options)[0]
    order = torch.argsort((picked - median).abs(), dim=0, stable=True)[:keep]
    aggregate = torch.gather(picked, 0, order).mean(dim=0)
    share = used_share(order, 0, keep, len(chosen))
    kept = torch.zeros(n, dtype=torch.float64, device=stack.device)
    kept[chosen] = share
    return aggregate, kept
