"""Prefect flows that compose mergeflow's cached tasks."""
