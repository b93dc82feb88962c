"""Train / test / server splits and feature standardisation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from mergeflow.data.errors import DataError
from mergeflow.data.features import fit_encoder
from mergeflow.data.rows import list_array, wrap_table
from mergeflow.data.storage import arrow_table

if TYPE_CHECKING:  # datasets loads where it is used: planning a run does not need it
    import datasets


def _subset(ds: datasets.Dataset, indices: np.ndarray) -> datasets.Dataset:
    """Rows ``indices`` (sorted, so row order stays deterministic) as a new in-memory dataset."""
    return wrap_table(arrow_table(ds.select(np.sort(indices))))


def _split_off(indices: np.ndarray, labels: np.ndarray | None, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``size`` of ``indices`` off, stratified by ``labels`` when that is possible."""
    stratify = None
    if labels is not None:
        counts = np.unique(labels[indices], return_counts=True)[1]
        n_classes = len(counts)
        if counts.min() >= 2 and size >= n_classes and len(indices) - size >= n_classes:
            stratify = labels[indices]
    from sklearn.model_selection import train_test_split

    rest, taken = train_test_split(indices, test_size=size, random_state=seed, shuffle=True, stratify=stratify)
    return rest, taken


def split_indices(
    labels: np.ndarray | None,
    n: int,
    *,
    test_fraction: float,
    server_fraction: float = 0.0,
    validation_fraction: float = 0.0,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Sorted row indices of ``"train"``, ``"test"`` and, when their fractions are > 0, ``"server"``
    and ``"validation"`` (see :func:`split_dataset`); ``labels`` (class ids) stratify, None does not."""
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must be in (0, 1), got {test_fraction}")
    for key, fraction in (("server_fraction", server_fraction), ("validation_fraction", validation_fraction)):
        if not 0.0 <= fraction < 1.0:
            raise DataError(f"{key} must be in [0, 1), got {fraction}")
    n_test = math.ceil(test_fraction * n)
    n_server = math.ceil(server_fraction * n)
    n_validation = math.ceil(validation_fraction * n)
    if n - n_test - n_server - n_validation < 1:
        raise DataError(
            f"test_fraction {test_fraction} + server_fraction {server_fraction} + validation_fraction "
            f"{validation_fraction} leave no training rows out of {n}"
        )
    rest, test = _split_off(np.arange(n), labels, n_test, seed)
    splits = {"test": np.sort(test)}
    for name, size in (("server", n_server), ("validation", n_validation)):
        if size:
            rest, taken = _split_off(rest, labels, size, seed)
            splits[name] = np.sort(taken)
    return {"train": np.sort(rest), **splits}


def split_dataset(
    ds: datasets.Dataset,
    info: dict[str, Any],
    *,
    test_fraction: float,
    server_fraction: float = 0.0,
    validation_fraction: float = 0.0,
    seed: int = 0,
) -> dict[str, datasets.Dataset]:
    """Split into ``"train"``, ``"test"`` and, when their fractions are > 0, ``"server"`` and ``"validation"``.

    Fractions are of the whole dataset (rounded up to whole rows). Classification data
    is stratified by ``"y"`` unless some class has fewer than two rows. The result is
    deterministic for a seed and every split keeps the original row order. The validation
    split is held out from everything else (hyperparameters are chosen on it, never on test);
    test and server rows are the same with or without it.
    """
    labels = arrow_table(ds).column("y").to_numpy() if info["task"] == "classification" else None
    fractions = {"test_fraction": test_fraction, "server_fraction": server_fraction}
    indices = split_indices(labels, ds.num_rows, **fractions, validation_fraction=validation_fraction, seed=seed)
    return {name: _subset(ds, rows) for name, rows in indices.items()}


def standardize(
    splits: dict[str, datasets.Dataset], fit_on: str = "train"
) -> tuple[dict[str, datasets.Dataset], dict[str, list[float]]]:
    """Z-score ``"x"`` in every split with the mean/std of ``splits[fit_on]`` (std 0 -> 1).

    Returns the new splits and ``{"mean": [...], "std": [...]}``.
    """
    if fit_on not in splits:
        raise DataError(f"cannot fit standardisation on missing split {fit_on!r}")
    encoder = fit_encoder(arrow_table(splits[fit_on]), ["x"], standardize=True)
    out = {}
    for name, ds in splits.items():
        table = arrow_table(ds)
        column = table.schema.get_field_index("x")
        out[name] = wrap_table(table.set_column(column, "x", list_array(encoder.transform(table))))
    return out, {"mean": encoder.mean, "std": encoder.std}
