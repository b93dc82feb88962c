"""What MLflow runs to rebuild a logged raw-rows model ("models from code"): no pickle is stored."""

import mlflow.models

from tasks.serving import RawRowsModel

mlflow.models.set_model(RawRowsModel())
