"""The model-family interface and its registry: building, reloading and exporting one kind of model.

A family owns everything that differs between plain ``nn.Sequential`` models and transformers:
building the base model from the params and the data's description, rebuilding a checkpoint's
architecture from its spec, and exporting a merged model as a directory its own ecosystem loads.
What it supports (alignment, BackPACK, language models, its MLflow flavour, the extra inputs of its
steps) is its torch-free declaration (:mod:`mergeflow.schema.families`). Stage code asks the
family of ``model.arch`` or of a spec's ``arch``; none of it tests an arch's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from mergeflow.errors import ConfigError
from mergeflow.registry import Registry
from mergeflow.schema.families import DECLARED, FamilyDeclaration, family_of_arch


class ModelFamily(ABC):
    """Interface of a model family; members subclass it and are registered with :func:`register_family`."""

    name: ClassVar[str]

    @property
    def declaration(self) -> FamilyDeclaration:
        """The torch-free declaration (archs, inputs, what the family supports)."""
        return DECLARED[self.name]

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

    def export(
        self, spec: dict[str, Any], state: dict[str, torch.Tensor], directory: Path, inputs: dict[str, Path]
    ) -> None:
        """Write a directory the family's own ecosystem loads, for a family declared with ``exports``
        (``inputs``: its declared extra inputs by name)."""
        raise TypeError(f"model family {self.name!r} is not declared with exports: its checkpoint is the model")


FAMILIES: Registry[ModelFamily] = Registry("model family")


def register_family(cls: type[ModelFamily]) -> type[ModelFamily]:
    """Class decorator: register one instance of ``cls`` under ``cls.name`` (it must be declared)."""
    if cls.name not in DECLARED:
        raise ConfigError([f"model family {cls.name!r} has no declaration (mergeflow.schema.families)"])
    FAMILIES.add(cls.name, cls())
    return cls


def family_of(arch: str) -> ModelFamily:
    """The registered family that builds ``arch`` (``model.arch``, or a checkpoint spec's ``arch``)."""
    return FAMILIES[family_of_arch(arch).name]
