"""IVON-ADMM's outer loop in flat directions (issue 29): the closed-form recursion, the real code path
against it, the stable defaults, the run-away guard and the stability warning."""

from __future__ import annotations

import pytest
import torch

from mergeflow.federated import ClientData, LocalTraining, client_generator, get_algorithm, run_rounds
from mergeflow.federated.divergence import DISTANCES, FIRST_DISTANCE, guard_runaway
from mergeflow.federated.flat_direction import flat_offsets, local_steps, max_flat_growth, min_stable_rho
from mergeflow.schema.federated import BayesADMMOptions
from mergeflow.training import DivergenceError

# The settings that were the defaults until issue 29: they run away after about 10 rounds.
UNTIL_ISSUE_29 = {"rho": 0.3, "temperature": 1.0, "lr": 0.2, "hess_init": 1.0, "beta2": 0.99, "damping": 0.1}
# The default pipeline's client sizes (digits, 5 clients, Dirichlet 0.5, seed 0), 2 epochs of batches of 32.
DEFAULT_SIZES = [188, 243, 248, 332, 246]
DEFAULT_STEPS = local_steps(DEFAULT_SIZES, 2, 32)
SIZES = [40, 25, 17]  # small clients for the real code path
TRAIN = LocalTraining(epochs=2, batch_size=8)


class _Untouched(torch.nn.Module):
    """Zero inputs: the loss is 0 for every weight, so each weight's gradient and Hessian are exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([[1.0, -0.5, 2.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def _clients() -> list[ClientData]:
    return [ClientData(torch.zeros(n, 3), torch.zeros(n), task="regression") for n in SIZES]


def _server_means(options: dict, rounds: int) -> list[torch.Tensor]:
    """The server mean after each round, through BayesADMM's own client and server updates."""
    algo = get_algorithm("bayes_admm")
    opts = algo.parse_options({**options, "prior_mean": "zero"})  # the exact posterior's mean is 0
    initial = dict(_Untouched().named_parameters())
    server = algo.init_server(initial, len(SIZES), opts)
    clients = {k: algo.init_client(initial, opts) for k in range(len(SIZES))}
    data = _clients()
    means = [server["mean.weight"].reshape(-1)]
    for r in range(rounds):
        messages = {}
        for k in range(len(SIZES)):
            generator = client_generator(0, r, k)
            messages[k], clients[k], _ = algo.client_update(
                _Untouched(), server, clients[k], data[k], TRAIN, opts, generator
            )
        server = algo.server_update(server, messages, dict(enumerate(SIZES)), len(SIZES), opts)
        means.append(server["mean.weight"].reshape(-1))
    return means


def test_the_closed_form_recursion_reproduces_the_reported_run_away_of_the_old_defaults() -> None:
    # Issue 29 measured a flat parameter's server mean in the default pipeline: 1 → 0.91 → −3.2 → −154
    # at rounds 1, 10, 20, 30. The recursion on that pipeline's client sizes gives the same numbers.
    offsets = flat_offsets(DEFAULT_SIZES, DEFAULT_STEPS, BayesADMMOptions(**UNTIL_ISSUE_29), 30)
    assert [round(offsets[r], 3) for r in (1, 10, 20, 30)] == [0.999, 0.913, -3.241, -154.019]


def test_the_recursion_shows_the_documented_stability_threshold() -> None:
    # docs/results.md: on the default pipeline's clients, the old settings are stable from ρ ≈ 0.59
    # (K·ρ ≈ 2.9); ρ = 0.3 (K·ρ = 1.5) and 0.5 run away, 0.7 and 1 stay put over 200 rounds.
    old = BayesADMMOptions(**UNTIL_ISSUE_29)
    growth = {
        rho: max_flat_growth(DEFAULT_SIZES, DEFAULT_STEPS, old.model_copy(update={"rho": rho}), 200)
        for rho in (0.3, 0.5, 0.7, 1.0)
    }
    assert growth[0.3] > 1e15 and growth[0.5] > 5.0
    assert growth[0.7] == growth[1.0] == 1.0
    assert min_stable_rho(DEFAULT_SIZES, DEFAULT_STEPS, old, 200) == pytest.approx(0.587, abs=0.012)
    # hess_init is what feeds it: the same settings with hess_init 0.01 are stable at ρ = 0.3.
    assert max_flat_growth(DEFAULT_SIZES, DEFAULT_STEPS, old.model_copy(update={"hess_init": 0.01}), 200) == 1.0
    # The library defaults stay put on these clients for 1,000 rounds, and at 10 local epochs.
    assert max_flat_growth(DEFAULT_SIZES, DEFAULT_STEPS, BayesADMMOptions(), 1000) == 1.0
    assert max_flat_growth(DEFAULT_SIZES, local_steps(DEFAULT_SIZES, 10, 32), BayesADMMOptions(), 200) == 1.0


def test_the_real_client_and_server_follow_the_closed_form_recursion() -> None:
    rounds = 15
    means = _server_means({**UNTIL_ISSUE_29, "runaway_window": 0}, rounds)
    offsets = flat_offsets(
        SIZES, local_steps(SIZES, TRAIN.epochs, TRAIN.batch_size), BayesADMMOptions(**UNTIL_ISSUE_29), rounds
    )
    initial = means[0]
    for r in range(rounds + 1):
        torch.testing.assert_close(means[r], initial * offsets[r], rtol=2e-4, atol=1e-6)
    assert abs(offsets[rounds]) > 2.0  # it has run away by then: the comparison covers the growth


def test_a_parameter_no_data_touches_stays_bounded_on_the_library_defaults() -> None:
    means = _server_means({}, 40)
    initial = means[0].abs()
    for mean in means[1:]:
        assert bool((mean.abs() <= initial * (1 + 1e-6)).all()), mean
    assert bool((means[-1].abs() < initial).all())  # and it moves toward the prior mean


def test_the_old_defaults_let_that_parameter_run_away() -> None:
    means = _server_means({**UNTIL_ISSUE_29, "runaway_window": 0}, 25)
    assert float((means[-1].abs() / means[0].abs()).min()) > 10.0


def test_guard_compares_with_the_last_rounds_the_first_one_and_a_scale() -> None:
    state = guard_runaway({}, 0.2, window=3, growth=10.0)
    assert float(state[FIRST_DISTANCE]) == 0.2 and state[DISTANCES].numel() == 0
    for distance in (1.0, 0.5, 0.8):
        state = {**state, **guard_runaway(state, distance, window=3, growth=10.0)}
    assert state[DISTANCES].tolist() == [1.0, 0.5, 0.8]
    state = {**state, **guard_runaway(state, 4.9, window=3, growth=10.0)}  # 9.8x the smallest: still fine
    assert state[DISTANCES].tolist() == [0.5, 0.8, 4.9]
    with pytest.raises(DivergenceError, match=r"ran away: .* 5\.1, is more than 10x .* \(the largest: 0\.5\); raise"):
        guard_runaway(state, 5.1, window=3, growth=10.0)
    assert guard_runaway(state, 1e9, window=0, growth=10.0) == {}
    assert guard_runaway(state, 5.1, 3, 10.0, scale=1.0)[DISTANCES].tolist() == [0.8, 4.9, 5.1]  # below 10x scale
    # A client whose first round was damped, converging: 100x its recent smallest, below 10x its first.
    calm = {
        FIRST_DISTANCE: torch.tensor(0.1, dtype=torch.float64),
        DISTANCES: torch.tensor([1e-5, 2e-5, 1e-5], dtype=torch.float64),
    }
    assert guard_runaway(calm, 1e-3, window=3, growth=10.0)[DISTANCES].tolist() == pytest.approx([2e-5, 1e-5, 1e-3])
    short = {
        FIRST_DISTANCE: torch.tensor(0.01, dtype=torch.float64),
        DISTANCES: torch.tensor([0.01], dtype=torch.float64),
    }
    assert guard_runaway(short, 100.0, 3, 10.0)[DISTANCES].tolist() == [0.01, 100.0]  # fewer than W: no verdict


def test_a_run_away_stops_the_run_or_its_messages_are_dropped() -> None:
    options = {**UNTIL_ISSUE_29, "prior_mean": "zero"}
    with pytest.raises(DivergenceError, match=r"round \d+: local training diverged \(client \d: client drift ran away"):
        run_rounds("bayes_admm", _Untouched, _clients(), 40, options=options, train=TRAIN)
    run = run_rounds("bayes_admm", _Untouched, _clients(), 40, options=options, train=TRAIN, on_divergence="exclude")
    dropped = [row["diverged"] for row in run.metrics[1:]]
    first = next(r for r, ids in enumerate(dropped) if ids)
    assert 4 <= first + 1 <= 30  # not before two distances after the first round
    weight = run.global_state["weight"]
    assert bool(torch.isfinite(weight).all()) and float(weight.abs().max()) < 1e3


def test_the_stability_warning_names_the_stable_rho() -> None:
    algo = get_algorithm("bayes_admm")
    train = LocalTraining(epochs=2, batch_size=32)
    warning = algo.stability_warning(DEFAULT_SIZES, train, 10, algo.parse_options(UNTIL_ISSUE_29))
    assert warning.startswith("K·ρ = 1.5 is below IVON-ADMM's stable range for these 5 clients")
    assert "within 200 rounds" in warning and "rho >= 0.59 (K·ρ >= 2.9)" in warning
    assert algo.stability_warning(DEFAULT_SIZES, train, 10, algo.parse_options({})) is None
    assert (
        get_algorithm("fedadmm").stability_warning(
            DEFAULT_SIZES, train, 10, get_algorithm("fedadmm").parse_options({"rho": 0.01})
        )
        is None
    )
    with pytest.warns(RuntimeWarning, match="bayes_admm: K·ρ = 0.9 is below"):
        run = run_rounds("bayes_admm", _Untouched, _clients(), 1, options=UNTIL_ISSUE_29, train=TRAIN)
    assert run.metrics[0]["warning"].startswith("K·ρ = 0.9")


@pytest.mark.slow
def test_the_default_pipeline_keeps_its_drift_over_50_rounds(tmp_path, cli_env):
    import json

    from conftest import make_workspace, pipeline_params, run_cli

    workspace = make_workspace(tmp_path / "defaults", pipeline_params())
    overrides = ["federated.algorithms=[bayes_admm]", "federated.rounds=50", "merge.methods=[average]"]
    done = run_cli(["run", *(arg for o in overrides for arg in ("-S", o))], workspace, cli_env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mergeflow: warning: federated" not in done.stderr
    rounds = json.loads((workspace / "metrics/federated.json").read_text())["bayes_admm"]
    assert len(rounds) == 51
    assert rounds[50]["drift"] <= 3.0 * rounds[10]["drift"]  # 1.4x a round on the old defaults
    assert rounds[50]["accuracy"] > 0.9 and rounds[50]["diverged"] == []


def test_the_client_reports_its_effective_sample_size():
    algo = get_algorithm("bayes_admm")
    opts = algo.parse_options({})
    initial = dict(_Untouched().named_parameters())
    server, client = algo.init_server(initial, 3, opts), algo.init_client(initial, opts)
    data = _clients()[0]
    _, _, metrics = algo.client_update(_Untouched(), server, client, data, TRAIN, opts, client_generator(0, 0, 0))
    assert metrics["ess"] == pytest.approx(len(data) / (opts.temperature * opts.rho))  # N_k / (τρ)
