"""Split a numeric source and encode its features with a transform fitted on the training split."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mergeflow.data.errors import DataError
from mergeflow.data.features import Categorical, Missing, Standardize, fit_encoder, missing_rows, standardization
from mergeflow.data.rows import RawData, make_dataset
from mergeflow.data.split import split_indices

if TYPE_CHECKING:  # datasets loads where it is used: planning a run does not need it
    import datasets


def encode_splits(
    raw: RawData,
    *,
    test_fraction: float,
    server_fraction: float = 0.0,
    validation_fraction: float = 0.0,
    seed: int = 0,
    standardize: Standardize = "auto",
    categorical: Categorical = "error",
    missing: Missing = "error",
) -> tuple[dict[str, datasets.Dataset], dict[str, Any]]:
    """Split ``raw`` (as :func:`split_dataset`), fit the feature encoding on the training rows and
    apply it to every split; ``info["features"]`` holds the fitted encoder.

    Data with a multi-dimensional ``input_shape`` (images) is never standardised by ``"auto"``. A
    regression target is standardised by the same rule; ``info["target_scale"]`` (mean, std) undoes it,
    and a known ``info["noise_std"]`` is rescaled to the model's units.
    """
    info = dict(raw.info)
    labels = raw.y if info["task"] == "classification" else None
    fractions = {"test_fraction": test_fraction, "server_fraction": server_fraction}
    indices = split_indices(labels, len(raw.y), **fractions, validation_fraction=validation_fraction, seed=seed)
    shape = info.get("input_shape")
    encoder = fit_encoder(
        raw.features.take(indices["train"]),
        raw.features.column_names,
        standardize=standardize,
        categorical=categorical,
        missing=missing,
        tabular=shape is None or len(shape) == 1,
    )
    if shape is None:
        shape = [encoder.width]
    elif int(np.prod(shape)) != encoder.width:
        raise DataError(f"input_shape {shape} does not match the {encoder.width} feature values per row")
    info["input_shape"] = shape
    info["features"] = encoder.to_dict()
    gaps = {name: int(missing_rows(raw.features, [name]).sum()) for name in raw.features.column_names}
    info["missing_values"] = {name: count for name, count in gaps.items() if count}  # filled, or one-hot zeros
    info["raw_example"] = raw.features.take(indices["train"][:2]).to_pydict()  # what a logged model is shown
    y = raw.y
    if info["task"] == "regression":
        y, info["target_scale"] = _scale_target(y, indices["train"], standardize)
        if info["target_scale"]["std"] != 1.0 and info.get("noise_std"):
            info["noise_std"] = info["noise_std"] / info["target_scale"]["std"]  # the model's units
    splits = {}
    for name, rows in indices.items():
        x = encoder.transform(raw.features.take(rows))
        group = raw.group[rows] if raw.group is not None else None
        splits[name] = make_dataset(x, y[rows], group, row=raw.source_rows[rows])
    return splits, info


def _scale_target(y: np.ndarray, train: np.ndarray, standardize: Standardize) -> tuple[np.ndarray, dict[str, Any]]:
    """A regression target z-scored with its training mean and std under the same rule as the features
    (``auto``: when it is not on a unit scale), and the scale to undo it (mean 0, std 1 when left alone)."""
    values = y[train].astype(np.float64)[:, None]
    apply, reason = standardization(values, standardize)
    spread = float(values.std())
    if not apply or spread == 0:
        return y, {"mean": 0.0, "std": 1.0, "reason": reason}
    mean = float(values.mean())
    return ((y - mean) / spread).astype(np.float32), {"mean": mean, "std": spread, "reason": reason}


def target_scale(info: dict[str, Any]) -> dict[str, float]:
    """The mean and std a regression target was standardised with (0 and 1 when it was not)."""
    return info.get("target_scale", {"mean": 0.0, "std": 1.0})
