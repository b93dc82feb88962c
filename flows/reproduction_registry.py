"""The paper reproductions that ``mergeflow reproduce NAME`` runs, each declared once: its default experiment
preset, the function that runs it and what it reproduces. Importing this module imports none of them."""

from __future__ import annotations

from dataclasses import dataclass

from mergeflow.registry import Member, Registry


@dataclass(frozen=True)
class Reproduction(Member):
    """A reproduction: ``name``, its default ``preset`` (relative to the project), ``summary`` and
    ``implementation``, the ``"module:function"`` that runs it: ``function(preset, root)`` writes its results
    under ``root/results`` and returns the path of its markdown table."""

    name: str
    preset: str
    summary: str
    implementation: str


REPRODUCTIONS: Registry[Reproduction] = Registry("reproduction", key="reproduce")


def _declare(name: str, runner: str, summary: str) -> None:
    """A reproduction run by ``flows.reproduce``'s function ``runner``, its preset ``experiments/<name>.yaml``."""
    preset = f"experiments/{name.replace('-', '_')}.yaml"
    REPRODUCTIONS.declare(Reproduction(name, preset, summary, f"flows.reproduce:{runner}"))


_declare(
    "linear-gaussian",
    "linear_gaussian",
    "SSF §3.1 in closed form (mergeflow.reproductions.linear_gaussian); its per-step SSF curves go to MLflow as "
    "step metrics.",
)
_declare(
    "pinwheel",
    "pinwheel",
    "SSF Table 1 through the real pipeline, once per point of the preset's sweep (number of clients × seeds), in "
    "a workspace of its own under results/; every pipeline run is logged to MLflow as usual.",
)
_declare(
    "alignment",
    "alignment",
    "Independently initialised digits MLPs: barriers and merges with and without weight or activation matching.",
)
_declare("federated", "federated", "The federated algorithms under label skew.")
_declare("participation", "federated", "FedAvg with partial against full participation.")
_declare(
    "merges",
    "merges",
    "Every merge method beside the best client, the ensemble and the centralized oracle, each searched option "
    "chosen on the validation split (experiments/merges.yaml: independent inits, K = 2…5, aligned and not; "
    "experiments/merges_digits.yaml: the default digits setting).",
)
_declare(
    "averaging-laws",
    "averaging_laws",
    "FedAvg's accuracy gain over centralized training against each transformer's compute budget, IID and non-IID "
    "(one domain per client), full and partial participation, and seen against unseen domains "
    "(mergeflow.reproductions.averaging_laws).",
)
_declare(
    "robustness",
    "robustness",
    "Each aggregator against 0–3 attackers of each kind, and the adaptive server optimizers against FedAvg "
    "(mergeflow.reproductions.robustness).",
)
_declare("privacy", "privacy", "DP-FedAvg's accuracy against ε (mergeflow.reproductions.robustness).")
