"""Objectives: what a model is trained for, one module per member (``classification``, ``regression``,
``causal_lm``), each registered with :func:`register_objective` and declared in
:mod:`mergeflow.schema.objectives`."""

from mergeflow.objectives import causal_lm, classification, regression  # noqa: F401  (registers them)
from mergeflow.objectives.base import OBJECTIVES, Baseline, Objective, get_objective, register_objective

__all__ = ["OBJECTIVES", "Baseline", "Objective", "get_objective", "register_objective"]
