"""The loader of the ``pinwheel`` source: the synthetic 2-D pinwheel."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mergeflow.data.loader import Loaded, SourceLoader
from mergeflow.data.rows import classification_info, make_dataset
from mergeflow.schema.sources.pinwheel import PinwheelOptions


def make_pinwheel(
    clusters: int = 5,
    per_cluster: int = 1000,
    radial_std: float = 0.3,
    tangential_std: float = 0.05,
    rate: float = 0.25,
    seed: int = 0,
) -> Loaded:
    """The 2-D pinwheel of Johnson et al. (2016); the class id is the cluster (arm)."""
    rng = np.random.default_rng(seed)
    rads = np.linspace(0, 2 * np.pi, clusters, endpoint=False)
    features = rng.standard_normal((clusters * per_cluster, 2)) * np.array([radial_std, tangential_std])
    features[:, 0] += 1.0
    labels = np.repeat(np.arange(clusters, dtype=np.int64), per_cluster)
    angles = rads[labels] + rate * np.exp(features[:, 0])
    cos, sin = np.cos(angles), np.sin(angles)
    rotations = np.stack([cos, -sin, sin, cos], axis=1).reshape(-1, 2, 2)
    points = np.einsum("ti,tij->tj", features, rotations)
    return make_dataset(points, labels), classification_info("pinwheel", clusters, [2], None)


class PinwheelLoader(SourceLoader):
    """Draws the pinwheel from its options and the seed."""

    def load(self, options: PinwheelOptions, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        return make_pinwheel(**options.model_dump(), seed=seed)
