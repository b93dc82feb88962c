"""The loader of the ``linreg`` source: synthetic Bayesian linear regression with known truth."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mergeflow.data.loader import Loaded, SourceLoader
from mergeflow.data.rows import make_dataset
from mergeflow.schema.sources.linreg import LinregOptions


def make_linreg(
    n: int = 1000,
    dim: int = 10,
    noise_std: float = 0.5,
    prior_std: float = 1.0,
    seed: int = 0,
) -> Loaded:
    """Bayesian linear regression with known truth: ``y = X w + noise_std * eps``.

    ``w ~ N(0, prior_std^2 I)``, ``X ~ N(0, I)``, no bias term.
    """
    rng = np.random.default_rng(seed)
    weights = rng.normal(0.0, prior_std, size=dim)
    x = rng.standard_normal((n, dim))
    y = x @ weights + noise_std * rng.standard_normal(n)
    info = {
        "source": "linreg",
        "task": "regression",
        "num_classes": None,
        "input_shape": [dim],
        "class_names": None,
        "noise_std": float(noise_std),
        "prior_std": float(prior_std),
        "true_weights": [float(w) for w in weights],
    }
    return make_dataset(x, y.astype(np.float32)), info


class LinregLoader(SourceLoader):
    """Draws the regression problem from its options and the seed."""

    def load(self, options: LinregOptions, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        return make_linreg(**options.model_dump(), seed=seed)
