"""Greedy model soup (Wortsman et al. 2022); the uniform soup is ``average``."""

from __future__ import annotations

import torch

from mergeflow.merge.engine import MergeResult, ModelInputs


def _soup(x: ModelInputs, members: list[int]) -> dict[str, torch.Tensor]:
    """The uniform average of ``members``' parameters, other tensors from the first model."""
    state = dict(x.states[0])
    for name in x.names:
        state[name] = torch.stack([x.states[k][name].to(torch.float64) for k in members]).mean(dim=0)
    return state


def greedy_soup(x: ModelInputs, options: object) -> MergeResult:
    """Greedy soup: clients by held-out score, each added only if the soup's score does not drop."""
    assert x.scorer is not None  # needed, per mergeflow.schema.merge
    scores = [x.scorer(state) for state in x.states]
    order = sorted(range(len(scores)), key=lambda k: (-scores[k], k))
    members, best, trail = [order[0]], scores[order[0]], [scores[order[0]]]
    for k in order[1:]:
        score = x.scorer(_soup(x, [*members, k]))
        trail.append(score)
        if score >= best:
            members, best = [*members, k], score
    state = {name: tensor for name, tensor in _soup(x, members).items() if name in x.names}
    summary = {"soup_size": float(len(members)), "soup_score": float(best)}
    return MergeResult(state, curves={"soup_score_tried": trail}, summary=summary)
