"""The MLflow pyfunc model of a merged (non-transformer) model: raw table rows in, predictions out."""

from __future__ import annotations

import mlflow.pyfunc
import pandas as pd

CHECKPOINT = "checkpoint"
INFO = "info"


class RawRowsModel(mlflow.pyfunc.PythonModel):
    """Wraps :class:`mergeflow.predictor.TablePredictor`, built from the logged checkpoint and data info."""

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        """Rebuild the predictor from the model's artifacts."""
        from mergeflow.predictor import TablePredictor

        self.predictor = TablePredictor.from_files(context.artifacts[CHECKPOINT], context.artifacts[INFO])

    def predict(
        self, context: mlflow.pyfunc.PythonModelContext, model_input: pd.DataFrame, params: dict | None = None
    ) -> pd.DataFrame:
        """Predictions for raw rows (see ``TablePredictor.predict``). A DataFrame hint is one MLflow
        derives no schema from: the logged signature says what is checked, and arrays of features
        (built-in sources) pass through as they are."""
        return self.predictor.predict(model_input)
