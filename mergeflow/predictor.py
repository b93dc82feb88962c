"""Prediction on raw rows: a model together with the feature encoding its training data went through."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from mergeflow.checkpoints import load_model
from mergeflow.data.features import FeatureEncoder
from mergeflow.data.rows import list_array
from mergeflow.errors import MergeflowError
from mergeflow.objectives import get_objective
from mergeflow.training import predict


class TablePredictor:
    """Raw rows in (a DataFrame with the source's feature columns, or an array of feature values),
    predictions out: the stored encoding (one-hot categories, filled gaps, standardisation) is applied
    first, so nobody applies it by hand.
    """

    def __init__(self, model: torch.nn.Module, info: dict[str, Any]) -> None:
        if "features" not in info:
            raise MergeflowError("the data info has no feature encoding (text models take text, not rows)")
        self.model = model.eval()
        self.info = info
        self.encoder = FeatureEncoder.from_dict(info["features"])

    @classmethod
    def from_files(cls, checkpoint: str | Path, info_file: str | Path) -> TablePredictor:
        """A predictor from a safetensors checkpoint and the prepared data's ``info.json``."""
        return cls(load_model(checkpoint), json.loads(Path(info_file).read_text()))

    def features(self, rows: pd.DataFrame | np.ndarray | pa.Table | dict) -> np.ndarray:
        """The encoded ``(N, *input_shape)`` model inputs of raw rows."""
        x = self.encoder.transform(self._table(rows))
        return x.reshape(len(x), *self.info["input_shape"])

    def _table(self, rows: pd.DataFrame | np.ndarray | pa.Table | dict) -> pa.Table:
        if isinstance(rows, pa.Table):
            return rows
        if isinstance(rows, pd.DataFrame):
            return pa.Table.from_pandas(rows, preserve_index=False)
        if isinstance(rows, dict):
            return pa.table(rows)
        array = np.asarray(rows, dtype=np.float64)
        array = array.reshape(len(array), -1)
        names = [c.name for c in self.encoder.columns]
        if names == ["x"]:
            return pa.table({"x": list_array(array)})
        if array.shape[1] != len(names) or any(c.width != 1 or c.kind != "numeric" for c in self.encoder.columns):
            raise MergeflowError(f"pass a DataFrame with the feature columns {names}, not an array")
        return pa.table({name: array[:, i] for i, name in enumerate(names)})

    def predict(self, rows: pd.DataFrame | np.ndarray | pa.Table | dict, batch_size: int = 1024) -> pd.DataFrame:
        """Classification: ``label`` (the class name), ``score`` and one ``probability_<class>`` column each;
        regression: ``prediction``, in the target's own units."""
        objective = get_objective(self.info["task"])
        outputs = predict(self.model, self.features(rows), task=objective, batch_size=batch_size)
        return pd.DataFrame(objective.served_columns(outputs, self.info))
