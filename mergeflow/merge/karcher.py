"""Karcher mean: the Riemannian mean of K models on the sphere of each tensor, as mergekit's ``karcher``.

Each tensor x_k is split into its norm n_k and direction u_k = x_k/n_k. The merged direction u minimises
Σ_k a_k·d(u, u_k)², d the great-circle angle, and is found by Riemannian gradient steps
u ← exp_u(Σ_k a_k·log_u(u_k)), log_u(u_k) = θ_k/sin θ_k · (u_k − cos θ_k·u). The merge is (Σ_k a_k n_k)·u.

Every iterate stays in the span of the u_k, so the iteration runs on K coefficients, reading the
tensors only through their K × K Gram matrix: the output is Σ_k c_k x_k, elementwise once c is known.
It therefore streams in blocks (declared with ``gram="inputs"``: a first pass sums the Gram, a second
merges), and never holds a whole tensor.

For K = 2 with equal weights the first step is already the fixed point: the merge is the mean norm
times the geodesic midpoint, slerp(u_1, u_2, ½). mergekit's ``multislerp`` takes one tangent step from
the normalised mean with projections u_k − cos θ_k·u in place of the logarithm, so it approximates
this mean and equals it for K = 2 and equal weights (docs/guide.md).
"""

from __future__ import annotations

import math

import torch

from mergeflow.merge.engine import TensorInputs
from mergeflow.schema.merge import KarcherOptions


def karcher_coefficients(gram: torch.Tensor, weights: torch.Tensor, max_iter: int, tol: float) -> torch.Tensor:
    """The c with Karcher mean = Σ_k c_k x_k, for inputs with Gram matrix ``gram`` and weights ``weights``.

    Follows mergekit 0.1.5's ``karcher_merge_tensors``: inputs of norm ≤ ``tol`` are left out of the
    direction but count, as zero, in the norm Σ_k a_k n_k; the start is the normalised weighted mean of
    the directions (the first direction if that mean vanishes); a direction within ``tol`` radians of u
    adds nothing to the step; iteration stops when the step is shorter than ``tol``.
    """
    norms = torch.sqrt(torch.diagonal(gram).clamp(min=0))
    coefficients = torch.zeros_like(norms)
    valid = [k for k in range(len(norms)) if float(norms[k]) > tol]
    if not valid:
        return coefficients
    n = norms[valid]
    unit_gram = gram[valid][:, valid] / torch.outer(n, n)  # Gram of the directions u_k
    alphas = weights[valid] / weights[valid].sum()

    def length(c: torch.Tensor) -> float:
        return math.sqrt(max(float(c @ unit_gram @ c), 0.0))

    u = alphas.clone()
    if length(u) < tol:
        u = torch.zeros_like(u)
        u[0] = 1.0
    else:
        u = u / length(u)
    for _ in range(max_iter):
        cosines = (unit_gram @ u).clamp(-1.0, 1.0)  # cos θ_k = <u, u_k>
        step = torch.zeros_like(u)
        for k in range(len(valid)):
            theta = math.acos(float(cosines[k]))
            if theta < tol:
                continue
            scale = float(alphas[k]) * theta / math.sin(theta)
            step[k] += scale
            step -= scale * float(cosines[k]) * u
        step_length = length(step)
        if step_length < tol:
            break
        u = math.cos(step_length) * u + (math.sin(step_length) / step_length) * step
        if length(u) > tol:
            u = u / length(u)
    scale = float(weights @ norms)
    coefficients[valid] = scale * u / n
    return coefficients


def karcher(x: TensorInputs, options: KarcherOptions) -> torch.Tensor:
    """Karcher mean: the Riemannian mean of K ≥ 2 models on each tensor's sphere, scaled by the mean norm."""
    assert x.gram is not None  # guaranteed by gram=
    count = len(x.tensors)
    if count == 1:
        return x.tensors[0].clone()
    weights = x.weights if options.by_size else torch.full_like(x.weights, 1.0 / count)
    c = karcher_coefficients(x.gram, weights.to(x.gram), options.max_iter, options.tol)
    merged = x.tensors[0] * float(c[0])
    for tensor, coefficient in zip(x.tensors[1:], c[1:].tolist(), strict=True):
        merged.add_(tensor, alpha=coefficient)
    return merged
