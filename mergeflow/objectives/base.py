"""The objective interface: what a model is trained for, from targets to metrics.

An objective owns everything that differs between classification, regression and a causal LM:
the training targets and loss, what prediction returns, the test metrics and how they rank models,
the output ensemble, the input-blind baseline of the sanity check, and the Fisher's targets. Stage
code, the trainers, the Fishers and the barrier ask the objective; none of them tests its name.
:func:`get_objective` imports the module its declaration (:mod:`mergeflow.schema.objectives`) names,
and no other objective's.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Generator, Tensor, nn

from mergeflow.device import host_tensor
from mergeflow.schema.objectives import ObjectiveDeclaration, declared_objective

FisherTarget = tuple[torch.Tensor, torch.Tensor]  # (target, weight per example)


class EnsembleAccumulator(Protocol):
    """An output ensemble being built: :meth:`add` one member's raw outputs, :meth:`result` the combined ones."""

    def add(self, outputs: np.ndarray) -> None:
        """Add one member's raw outputs."""

    def result(self) -> np.ndarray:
        """The members' combined raw output."""


@dataclass(frozen=True)
class Baseline:
    """The input-blind model of the sanity check.

    Attributes:
        scores: its higher-is-better score on each test row.
        report: what the evaluation records of it (``baseline`` and its metric).
        reference: it in words, for the warning.
        describe: a model's mean row score in the objective's words (``"0.91 test accuracy"``).
    """

    scores: np.ndarray
    report: dict[str, Any]
    reference: str
    describe: Callable[[float], str]


class Objective(ABC):
    """Interface of an objective; a declaration's ``implementation`` names a subclass.

    Tensor methods get tensors on the model's device; array methods get float64 numpy arrays of
    :meth:`outputs`, as :func:`mergeflow.training.predict` returns them. ``declaration`` is its
    torch-free declaration (metrics, selection, Fisher kinds).
    """

    def __init__(self, declaration: ObjectiveDeclaration) -> None:
        self.declaration = declaration

    @property
    def name(self) -> str:
        """The objective's declared name."""
        return self.declaration.name

    # Training.
    @abstractmethod
    def targets(self, y: np.ndarray | torch.Tensor, inputs: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """The training targets of ``inputs`` with labels ``y``."""

    @abstractmethod
    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss training minimises."""

    def outputs(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """What prediction keeps of a batch: the model's raw outputs."""
        return model(inputs)

    def outputs_loss(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean training loss from what :meth:`outputs` kept, against labels ``y`` (a loss barrier's)."""
        return self.loss(outputs, torch.as_tensor(y, device=outputs.device).reshape(-1))

    def output_dim(self, info: dict[str, Any]) -> int:
        """Outputs per example a model needs for the data ``info`` describes (one here)."""
        return 1

    # Evaluation.
    @abstractmethod
    def metrics(self, outputs: np.ndarray, y: np.ndarray | None, *, n_bins: int, noise_std: float) -> dict:
        """Test metrics of raw outputs."""

    def in_target_units(self, metrics: dict, std: float) -> dict:
        """Metrics of a model trained on a standardised target, in the target's own units (unchanged here)."""
        return metrics

    def ensemble_accumulator(self) -> EnsembleAccumulator:
        """An empty output ensemble: members' raw outputs are added one at a time (``add``), and ``result``
        combines them into one raw output, holding one member's worth of values whatever their number."""
        raise ValueError(f"a {self.name} objective has no output ensemble")

    def ensemble(self, outputs_list: list[np.ndarray]) -> np.ndarray:
        """Several models' raw outputs combined into one raw output (:meth:`ensemble_accumulator`'s)."""
        combined = self.ensemble_accumulator()
        for outputs in outputs_list:
            combined.add(outputs)
        return combined.result()

    def predictions(self, outputs: np.ndarray, scale: dict[str, float]) -> np.ndarray:
        """What the sanity check compares: raw outputs here (``scale``: a standardised target's mean and std)."""
        return outputs

    def served_columns(self, outputs: np.ndarray, info: dict[str, Any]) -> dict[str, Any]:
        """The columns a served model answers with, per input row."""
        raise ValueError(f"a {self.name} model is not served over table rows")

    def baseline_targets(
        self, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray], info: dict[str, Any]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The training and test targets the input-blind baseline is fitted to and scored on."""
        return train[1], test[1]

    @abstractmethod
    def baseline(self, y_train: np.ndarray, y_test: np.ndarray, predictions: dict[str, np.ndarray]) -> Baseline:
        """The model that ignores its input, fitted on ``y_train`` and scored on ``y_test``."""

    @abstractmethod
    def row_scores(self, predicted: np.ndarray, y_test: np.ndarray) -> np.ndarray:
        """A model's higher-is-better score on each test row (same scale as :attr:`Baseline.scores`)."""

    def versus(self, result: dict, reference: dict) -> dict:
        """Metrics comparing a combined model with the centralized one (none here)."""
        return {}

    # Fisher information.
    def fisher_labels(self, y: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The data's labels as the Fisher's loss takes them (``dtype``: the model's)."""
        return host_tensor(y, torch.long)

    def summed_loss(self) -> nn.Module:
        """The negative log-likelihood summed over examples, up to :meth:`score_scale`."""
        raise ValueError(f"a {self.name} objective has no Fisher information (no likelihood to differentiate)")

    def loss_target(self, y: torch.Tensor) -> torch.Tensor:
        """Labels shaped for :meth:`summed_loss`."""
        return y

    def fisher_targets(
        self, model: nn.Module, X: Tensor, y: Tensor, kind: str, noise_std: float, rng: Generator
    ) -> Tensor:
        """Targets of the ``empirical`` (the data's) and ``sampled`` (drawn from the model) Fishers."""
        raise ValueError(f"a {self.name} objective has no Fisher information (no likelihood to sample)")

    def exact_targets(self, model: nn.Module, X: torch.Tensor, noise_std: float) -> list[FisherTarget]:
        """(target, weight per example) pairs whose weighted squared scores sum to the exact Fisher."""
        raise ValueError(f"a {self.name} objective has no exact Fisher; use empirical or sampled")

    def score_scale(self, noise_std: float) -> float:
        """The negative log-likelihood over :meth:`summed_loss`: times the loss's gradient it gives the score
        ∇ log p (up to sign), times the loss's GGN the Fisher."""
        return 1.0


def get_objective(name: str | Objective) -> Objective:
    """The declared objective ``name``, its module imported now (an objective is returned as is).

    Raises:
        ConfigError: naming the known objectives.
    """
    return name if isinstance(name, Objective) else _implementation(declared_objective(name))


@functools.cache
def _implementation(declaration: ObjectiveDeclaration) -> Objective:
    return declaration.load()(declaration)
