"""The MLflow pyfunc model of a merged (non-transformer) model: raw table rows in, predictions out."""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc

CHECKPOINT = "checkpoint"
INFO = "info"


class RawRowsModel(mlflow.pyfunc.PythonModel):
    """Wraps :class:`mergeflow.predictor.TablePredictor`, built from the logged checkpoint and data info."""

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        """Rebuild the predictor from the model's artifacts."""
        from mergeflow.predictor import TablePredictor

        self.predictor = TablePredictor.from_files(context.artifacts[CHECKPOINT], context.artifacts[INFO])

    def predict(self, context: mlflow.pyfunc.PythonModelContext, model_input, params: dict | None = None) -> Any:
        """Predictions for raw rows (see ``TablePredictor.predict``); ``model_input`` has no type hint,
        which MLflow would take for a schema of its own."""
        return self.predictor.predict(model_input)
