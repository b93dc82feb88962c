"""Reproductions of the papers' experiments, as library code (no Prefect or MLflow)."""
