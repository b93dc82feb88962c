"""Objectives: what a model is trained for, one module per member (``classification``, ``regression``,
``causal_lm``), each named by its declaration in :mod:`mergeflow.schema.objectives` (:data:`OBJECTIVES`)
and imported by :func:`get_objective` when used."""

from mergeflow.objectives.base import Baseline, Objective, get_objective
from mergeflow.schema.objectives import DECLARED as OBJECTIVES

__all__ = ["OBJECTIVES", "Baseline", "Objective", "get_objective"]
