"""The sections of the steps that analyse the client models: ``align``, ``fisher`` and ``evaluate``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mergeflow.config.section import Section


class AlignConfig(Section):
    """Permutation alignment of the client models to a reference before merging (Git Re-Basin).

    ``reference`` is a client id or ``largest`` (the client with the most examples).
    Activation matching uses up to ``examples`` inputs of the server split (else of the
    reference client's data). Loss barriers are measured at ``barrier_points`` on
    ``barrier_examples`` rows of the test split (they cost a forward pass per row, point and client).
    Rows are drawn at random (with ``seed``), not taken from the top: splits may be stored sorted.
    Left unset (null), these three take the model family's defaults: 512, 11 and 1024 for MLPs and
    CNNs; 256, 5 and 256 for transformers (MLP units, whole attention heads and the residual stream
    of BERT- and GPT-2-style models are permuted).

    ``repair`` (MLP/CNN, with ``method`` weights or activations): REPAIR (Jordan et al. 2022) along
    each barrier's path: every interpolated model's units are rescaled so that each unit's mean and
    standard deviation (after its layer, or after the norm that follows it) are the interpolation of
    the two endpoints' statistics, measured on up to ``examples`` rows of the two clients' training
    data; the barriers are reported with and without it.
    """

    method: Literal["none", "weights", "activations"] = "none"
    reference: int | Literal["largest"] = "largest"
    metric: Literal["correlation", "l2"] = "correlation"
    max_iter: int = Field(100, ge=1)
    examples: int | None = Field(None, ge=1)
    barrier_points: int | None = Field(None, ge=3)
    barrier_examples: int | None = Field(None, ge=1)
    repair: bool = False


class FisherConfig(Section):
    """Per-client Fisher estimation: diagonal always, factors F ≈ UᵀU when ``low_rank``.

    The factors are the per-example scores of ``rank_examples`` examples, or, with
    ``factor_memory_mb``, a Frequent Directions sketch of the scores of all ``n_examples`` examples
    in about that much memory (its rows: the budget over 12 bytes per parameter).
    """

    kind: Literal["empirical", "sampled", "exact"] = "exact"
    n_examples: int = Field(1024, ge=1)
    batch_size: int = Field(256, ge=1)
    low_rank: bool = False
    rank_examples: int = Field(64, ge=1)
    factor_memory_mb: float | None = Field(None, gt=0)
    backend: Literal["auto", "backpack", "functorch"] = "auto"


class EvaluateConfig(Section):
    ece_bins: int = Field(15, ge=1)
    batch_size: int = Field(1024, ge=1)
    noise_std: float = Field(1.0, gt=0)
