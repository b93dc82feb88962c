"""experiments/federated_grid.py: the search space it expands and the choice it makes (validation only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("federated_grid", ROOT / "experiments/federated_grid.py")
grid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grid)


def test_lists_are_searched_every_combination_with_every_other():
    combinations = grid.expand(
        {
            "fedavg_sgd": {"algorithm": "fedavg", "local": {"optimizer": "sgd", "lr": [0.05, 0.1]}},
            "ivon": {"algorithm": "bayes_admm", "lr": [0.01, 0.03], "rho": [1.0, 5.0], "beta2": 0.999},
        }
    )
    assert len(combinations) == 2 + 4
    assert combinations["fedavg_sgd local.lr=0.1"] == (
        "fedavg_sgd",
        {"algorithm": "fedavg", "local": {"optimizer": "sgd", "lr": 0.1}},
    )
    assert combinations["ivon lr=0.03 rho=1"] == (
        "ivon",
        {"algorithm": "bayes_admm", "lr": 0.03, "rho": 1.0, "beta2": 0.999},
    )


def test_the_choice_is_the_best_mean_validation_score_and_ignores_test():
    def record(combination: str, seed: int, score: float | None, test: float) -> dict:
        entry = combination.split()[0]
        result = {"diverged": "round 3"} if score is None else {"score": score, "test": test}
        return {"entry": entry, "combination": combination, "point": {"seed": str(seed)}, **result}

    records = [
        record("a x=1", 0, 0.90, 0.99),  # best on test, not on validation
        record("a x=1", 1, 0.90, 0.99),
        record("a x=2", 0, 0.95, 0.80),
        record("a x=2", 1, 0.93, 0.80),
        record("a x=3", 0, 0.99, 0.99),  # best on the seed where it did not diverge
        record("a x=3", 1, None, 0.0),
        record("b", 0, 0.5, 0.5),
    ]
    assert grid.choose(records) == {"a": "a x=2", "b": "b"}
