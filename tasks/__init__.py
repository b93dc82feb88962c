"""Prefect tasks wrapping mergeflow library calls: cache keys, artifact store, MLflow logging."""
