"""The model-family interface: building, reloading and exporting one kind of model.

A family owns everything that differs between plain ``nn.Sequential`` models and transformers:
building the base model from the params and the data's description, rebuilding a checkpoint's
architecture from its spec, and exporting a merged model as a directory its own ecosystem loads.
What it supports (alignment, BackPACK, language models, its MLflow flavour, the extra inputs of its
steps) is its torch-free declaration (:mod:`mergeflow.schema.families`), whose ``implementation``
names the family's class. Stage code asks the family of ``model.arch`` or of a spec's ``arch``; none
of it tests an arch's name.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mergeflow.schema.families import FamilyDeclaration, family_of_arch


class ModelFamily(ABC):
    """Interface of a model family; a declaration's ``implementation`` names a subclass."""

    def __init__(self, declaration: FamilyDeclaration) -> None:
        self.declaration = declaration

    @property
    def name(self) -> str:
        """The family's declared name."""
        return self.declaration.name

    @abstractmethod
    def build_base(
        self, model: dict[str, Any], info: dict[str, Any], output_dim: int, seed: int
    ) -> tuple[nn.Module, dict[str, Any]]:
        """The untrained base model and its spec.

        Args:
            model: the params' ``model`` section (plain JSON data).
            info: the prepared data's description (input shape, classes, tokenizer, task).
            output_dim: outputs per example the objective needs (classes, or 1).
            seed: seed of the initialisation.
        """

    @abstractmethod
    def from_spec(self, spec: dict[str, Any]) -> nn.Module:
        """The architecture a checkpoint's spec describes, deterministically initialised."""

    def head_names(self, spec: dict[str, Any]) -> tuple[str, ...]:
        """The state-dict keys of the task head of ``spec``'s model: the parameters a multi-task run keeps per
        task (``()``: a model without a head, every parameter shared by the tasks)."""
        raise TypeError(f"model family {self.name!r} declares no task head: it has no multi-task runs")

    def with_outputs(self, spec: dict[str, Any], output_dim: int, seed: int | None = None) -> dict[str, Any]:
        """``spec``'s architecture with a head of ``output_dim`` outputs, initialised from ``seed`` (None: the
        spec's own); a model without a head (:meth:`head_names` empty) keeps its spec."""
        raise TypeError(f"model family {self.name!r} declares no task head: it has no multi-task runs")

    def export(
        self, spec: dict[str, Any], state: dict[str, torch.Tensor], directory: Path, inputs: dict[str, Path]
    ) -> None:
        """Write a directory the family's own ecosystem loads, for a family declared with ``exports``
        (``inputs``: its declared extra inputs by name)."""
        raise TypeError(f"model family {self.name!r} is not declared with exports: its checkpoint is the model")


def family_of(arch: str) -> ModelFamily:
    """The family that builds ``arch`` (``model.arch``, or a checkpoint spec's ``arch``): its module, and
    no other family's, imported now."""
    return _implementation(family_of_arch(arch))


@functools.cache
def _implementation(declaration: FamilyDeclaration) -> ModelFamily:
    return declaration.load()(declaration)
