"""SSF §3.1: Bayesian linear regression, where every client posterior and their product are exact.

K clients hold overlapping, non-i.i.d. windows of one synthetic dataset (sorted along a
random direction, so each sees a different region of input space). Each client's model
is its exact posterior mean (SSF Eq. 8: S_N⁻¹ = αI + βΦᵀΦ, m_N = βS_NΦᵀt). Its precision
comes from ``mergeflow.fisher`` on that model: for a Gaussian likelihood the Fisher is
ΦᵀΦ/σ² exactly, which the result reports as a check.

The product of the client posteriors, with the prior counted once, is the posterior of the
pooled client data: the clients' rows concatenated, so a row that two clients hold counts
twice, as it does in any product of their posteriors. The exact merge must land on its
mean; SSF must approach it; averaging and the diagonal Fisher merge show the gap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from mergeflow.fisher import diagonal_fisher, fisher_factors
from mergeflow.merge import run_merge
from mergeflow.merge.engine import model_inputs
from mergeflow.merge.ssf import ssf_iterates
from mergeflow.models.sequential import build_model
from mergeflow.schema.merge import validate_options


class LinearGaussianSettings(BaseModel):
    """The synthetic problem and the SSF runs of the reproduction."""

    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    n: int = Field(600, ge=4)
    n_test: int = Field(2000, ge=1)
    dim: int = Field(8, ge=1)
    noise_std: float = Field(0.5, gt=0)
    prior_precision: float = Field(1.0, gt=0)
    clients: int = Field(3, ge=2)
    overlap: float = Field(0.3, ge=0, lt=1)
    correlation: float = Field(0.0, ge=0)
    ssf: dict = Field(default_factory=dict)
    mask_rates: list[float] = [0.2, 0.3, 0.4, 0.5, 1.0]


@dataclass
class LinearGaussianProblem:
    """Client models, Fishers and factors, plus the closed-form quantities to check against."""

    states: list[dict[str, torch.Tensor]]
    fishers: list[dict[str, torch.Tensor]]
    factors: list[torch.Tensor]
    sizes: list[int]
    pooled_mean: np.ndarray
    true_weights: np.ndarray
    fisher_error: float
    test: tuple[np.ndarray, np.ndarray] = field(repr=False)


def _with_bias(X: np.ndarray) -> np.ndarray:
    return np.concatenate([X, np.ones((len(X), 1))], axis=1)


def _posterior_mean(Phi: np.ndarray, t: np.ndarray, sigma: float, alpha: float) -> np.ndarray:
    precision = Phi.T @ Phi / sigma**2 + alpha * np.eye(Phi.shape[1])
    return np.linalg.solve(precision, Phi.T @ t / sigma**2)


def client_windows(order: np.ndarray, clients: int, overlap: float) -> list[np.ndarray]:
    """K contiguous windows of ``order``; neighbours share an ``overlap`` fraction of a window."""
    n = len(order)
    width = n / (clients - (clients - 1) * overlap)
    step = width * (1 - overlap)
    return [order[int(round(k * step)) : int(round(k * step + width))] for k in range(clients)]


def linear_gaussian_problem(
    *,
    seed: int = 0,
    n: int = 600,
    n_test: int = 2000,
    dim: int = 8,
    noise_std: float = 0.5,
    prior_precision: float = 1.0,
    clients: int = 3,
    overlap: float = 0.3,
    correlation: float = 0.0,
) -> LinearGaussianProblem:
    """Draw the data, give each client its exact posterior mean, and measure its Fisher."""
    rng = np.random.default_rng(seed)
    true_weights = rng.normal(size=dim + 1) / np.sqrt(prior_precision)
    # correlation > 0 mixes the inputs, so the Fisher's off-diagonal matters, as it does in networks.
    mixing = np.eye(dim) + correlation * rng.normal(size=(dim, dim)) / np.sqrt(dim)
    X = rng.normal(size=(n + n_test, dim)) @ mixing
    t = _with_bias(X) @ true_weights + noise_std * rng.normal(size=n + n_test)
    X, t, X_test, t_test = X[:n], t[:n], X[n:], t[n:]
    order = np.argsort(X @ rng.normal(size=dim))
    windows = client_windows(order, clients, overlap)
    states, fishers, factors, fisher_error = [], [], [], 0.0
    for rows in windows:
        Phi = _with_bias(X[rows])
        mean = _posterior_mean(Phi, t[rows], noise_std, prior_precision)
        model = build_model("linear", [dim], 1).double()
        with torch.no_grad():
            model[1].weight.copy_(torch.from_numpy(mean[:dim])[None])
            model[1].bias.copy_(torch.tensor([mean[dim]]))
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        kwargs = {"kind": "exact", "task": "regression", "noise_std": noise_std}
        fishers.append(diagonal_fisher(model, X[rows], t[rows], **kwargs))
        factors.append(fisher_factors(model, X[rows], t[rows], **kwargs))
        closed_form = Phi.T @ Phi / (len(rows) * noise_std**2)
        measured = (factors[-1].T @ factors[-1]).numpy()
        fisher_error = max(fisher_error, float(np.abs(measured - closed_form).max() / np.abs(closed_form).max()))
    pooled = np.concatenate(windows)
    return LinearGaussianProblem(
        states=states,
        fishers=fishers,
        factors=factors,
        sizes=[len(rows) for rows in windows],
        pooled_mean=_posterior_mean(_with_bias(X[pooled]), t[pooled], noise_std, prior_precision),
        true_weights=true_weights,
        fisher_error=fisher_error,
        test=(X_test, t_test),
    )


def flat_weights(state: dict[str, torch.Tensor]) -> np.ndarray:
    """A linear model's weights then bias, the order of the closed-form vectors."""
    return np.concatenate([state["1.weight"].numpy().ravel(), state["1.bias"].numpy()])


def _report(problem: LinearGaussianProblem, theta: np.ndarray) -> dict[str, float]:
    X_test, t_test = problem.test
    pooled = problem.pooled_mean
    return {
        "relative_error_to_pooled_posterior": float(np.linalg.norm(theta - pooled) / np.linalg.norm(pooled)),
        "parameter_mse_to_truth": float(np.mean((theta - problem.true_weights) ** 2)),
        "test_mse": float(np.mean((_with_bias(X_test) @ theta - t_test) ** 2)),
    }


def run_linear_gaussian(settings: LinearGaussianSettings) -> tuple[dict[str, dict], dict[str, list[float]]]:
    """Every merge's errors against the closed forms, and SSF's per-step curves.

    Returns ``(table, curves)``: table rows keyed by merge name, curves keyed by
    ``"<merge>/<metric>"`` with one value per SSF step.
    """
    problem = linear_gaussian_problem(**settings.model_dump(exclude={"ssf", "mask_rates"}))
    common = {"weights": problem.sizes, "fishers": problem.fishers}
    table: dict[str, dict] = {
        "pooled posterior (closed form)": _report(problem, problem.pooled_mean),
        "average": _report(problem, flat_weights(run_merge("average", problem.states).state)),
        "fisher (diagonal)": _report(problem, flat_weights(run_merge("fisher", problem.states, **common).state)),
    }
    delta = settings.prior_precision
    exact = run_merge("exact", problem.states, factors=problem.factors, prior_precision=delta, **common)
    table["exact"] = {**_report(problem, flat_weights(exact.state)), "cg_iterations": exact.summary["cg_iterations"]}
    inputs = model_inputs(problem.states, weights=problem.sizes, fishers=problem.fishers, factors=problem.factors)
    curves: dict[str, list[float]] = {}
    for rate in settings.mask_rates:
        name = f"ssf {int(round(rate * 100))}%"
        options = validate_options(
            "ssf", {**settings.ssf, "mask_rate": rate, "prior_precision": settings.prior_precision}
        )
        steps: dict[str, list[float]] = {"relative_error_to_pooled_posterior": [], "parameter_mse_to_truth": []}
        losses = []
        for theta, loss in ssf_iterates(inputs, options):
            report = _report(problem, theta.numpy())
            for metric, values in steps.items():
                values.append(report[metric])
            losses.append(loss)
        table[name] = _report(problem, theta.numpy())
        curves |= {f"{name}/{metric}": values for metric, values in steps.items()}
        curves[f"{name}/ssf_loss"] = losses
    table["exact"]["fisher_closed_form_max_relative_error"] = problem.fisher_error
    return table, curves
