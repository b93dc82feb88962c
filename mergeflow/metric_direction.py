"""Which way each metric improves: the one table that choosing (``merge.select_by``, a best epoch), ranking
(the best client) and ``mergeflow best`` read. Dependency-free, so that reading MLflow's records imports no
torch."""

from __future__ import annotations

import re

# Each metric's name and whether a lower value is better. A new objective's lower-is-better metric goes here.
LOWER_IS_BETTER = {
    "accuracy": False,
    "nll": True,
    "ece": True,
    "mse": True,
    "mae": True,
    "perplexity": True,
    "loss": True,
    "residual": True,
    "barrier": True,
}


def lower_is_better(metric: str) -> bool:
    """Whether a lower value of ``metric`` is better.

    ``metric`` is a metric's name (``nll``) or a key it is logged under (``test_nll``, ``val_accuracy``,
    ``test_<group>_nll``, ``round_train_loss``, ``barrier_before_mean``, ``cg_relative_residual``): the last of
    its words that :data:`LOWER_IS_BETTER` names decides. A metric it does not name is a score (higher is
    better): ``soup_score``, ``accuracy_gain``.
    """
    words = re.split(r"[^a-z0-9]+", metric.lower())
    return next((LOWER_IS_BETTER[word] for word in reversed(words) if word in LOWER_IS_BETTER), False)
