"""Clients that keep their own heads across rounds: FedPer (``federated.heads: local``) and FedBABU (``frozen``).

FedPer (Arivazhagan et al. 2019) trains the whole model locally and sends the body only; FedBABU (Oh et al.
2022) freezes the head at its initialisation during the rounds, trains and sends the body only, and after the
last round fine-tunes each client's head on the final global body (:meth:`LocalHeads.finetune`). Either way
the head is kept out of the exchanged parameters (:func:`mergeflow.federated.base.exchanged_parameters`), so
every algorithm's server state, the messages and what acts on them (attacks, robust rules, DP, server
optimizers) hold the body only, with no change to the algorithms. A client's head travels in its client state
under ``head.<param>``, beside the algorithm's own entries (ADMM duals), from the base model's head on.

A task's model is the global body with :func:`mergeflow.heads.task_head` of its clients' heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import nn

from mergeflow.federated.base import (
    KEPT_LOCAL,
    ClientData,
    ClientState,
    LocalTraining,
    add_prefix,
    load_parameters,
    take_prefix,
)
from mergeflow.federated.local import local_train
from mergeflow.heads import task_head

HEAD = "head."
HeadsMode = Literal["local", "frozen"]


def clients_head(states: Mapping[int, ClientState], sizes: Mapping[int, int], clients: Sequence[int]) -> dict:
    """The head of a task held by ``clients``: :func:`task_head` of the heads in their states, weighted by size."""
    return task_head([take_prefix(states[k], HEAD) for k in clients], [sizes[k] for k in clients])


@dataclasses.dataclass(frozen=True)
class LocalHeads:
    """How clients keep their heads: ``mode`` ``local`` (FedPer) or ``frozen`` (FedBABU), ``names`` the head's
    parameter names (:func:`head_names`), ``epochs`` of FedBABU's final head fine-tuning."""

    mode: HeadsMode
    names: tuple[str, ...]
    epochs: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("local", "frozen"):
            raise ValueError(f"federated.heads: {self.mode!r} is not local or frozen")
        if not self.names:
            raise ValueError("federated.heads: the model has no head to keep local")

    def prepare(self, model: nn.Module) -> nn.Module:
        """``model`` (in place) with its head out of the exchange: trained and never sent (``local``), or not
        trained (``frozen``: no gradient reaches it).

        Raises:
            KeyError: when the model has no parameter of one of the head's names.
        """
        parameters = dict(model.named_parameters())
        for name in self.names:
            if name not in parameters:
                raise KeyError(f"the model has no head parameter {name!r}")
        if self.mode == "frozen":
            for name in self.names:
                parameters[name].requires_grad_(False)
        else:
            setattr(model, KEPT_LOCAL, frozenset(self.names))
        return model

    def head_of(self, state_or_model: Mapping[str, torch.Tensor] | nn.Module) -> dict[str, torch.Tensor]:
        """The head's tensors of a model or a state dict, as float64 copies."""
        if isinstance(state_or_model, nn.Module):
            state_or_model = dict(state_or_model.named_parameters())
        return {name: state_or_model[name].detach().to(torch.float64, copy=True) for name in self.names}

    def with_head(self, state: ClientState, head: Mapping[str, torch.Tensor]) -> ClientState:
        """A client's state with ``head`` beside the algorithm's entries."""
        return {**state, **add_prefix(HEAD, head)}

    @staticmethod
    def split(state: ClientState) -> tuple[ClientState, dict[str, torch.Tensor]]:
        """A client's state as (the algorithm's entries, its head)."""
        return {k: v for k, v in state.items() if not k.startswith(HEAD)}, take_prefix(state, HEAD)

    @torch.no_grad()
    def load(self, model: nn.Module, head: Mapping[str, torch.Tensor]) -> nn.Module:
        """Copy ``head`` into the model's head in place."""
        parameters = dict(model.named_parameters())
        for name in self.names:
            parameters[name].copy_(head[name].reshape(parameters[name].shape))
        return model

    def finetune(
        self,
        model: nn.Module,
        body: Mapping[str, torch.Tensor],
        head: Mapping[str, torch.Tensor],
        data: ClientData,
        train: LocalTraining,
        generator: torch.Generator,
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """FedBABU's fine-tuning: ``head`` trained for :attr:`epochs` epochs of ``train`` on ``data`` with the body
        frozen at ``body``; returns the new head and the training metrics."""
        load_parameters(self.prepare(model), body)
        self.load(model, head)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name in self.names)
        metrics = local_train(model, data, dataclasses.replace(train, epochs=self.epochs), generator)
        return self.head_of(model), metrics
