"""Federated algorithms: closed forms on quadratics, server rules, IVON with a prior, small neural runs."""

from __future__ import annotations

import math
import subprocess
import sys

import ivon
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load, save
from sklearn.datasets import load_digits

from mergeflow.errors import ConfigError
from mergeflow.federated import (
    ALGORITHMS,
    ClientData,
    LocalTraining,
    client_drift,
    client_generator,
    exact_posterior,
    get_algorithm,
    linear_gaussian_problem,
    load_parameters,
    model_parameters,
    register_algorithm,
    run_quadratic_rounds,
    run_rounds,
    sample_participants,
    scalar_problem,
)
from mergeflow.federated.fedavg import FedAvg
from mergeflow.federated.ivon_prior import IVONWithPrior
from mergeflow.federated.local import local_train
from mergeflow.federated.quadratic_loss import QuadraticProblem
from mergeflow.metrics import softmax
from mergeflow.models.sequential import build_model
from mergeflow.schema import federated
from mergeflow.schema.federated import FedAvgOptions
from mergeflow.seeding import derive_seed
from mergeflow.training import DivergenceError, predict
from mergeflow.training import train as central_train

TOY = [[1.0, 2.0, 3.0], [4.0, 6.0, 5.0, 5.0, 10.0]]


def _toy() -> list[QuadraticProblem]:
    return [scalar_problem(x) for x in TOY]


def _track(run, key: str) -> list[float]:
    return [float(s[key]) for s in run.servers]


# ----------------------------------------------------------------------------- the slides' toy


def test_toy_bayes_admm_is_exact_after_one_round_and_stays() -> None:
    delta = 1e-8
    run = run_quadratic_rounds(
        "bayes_admm", _toy(), 5, {"rho": 0.5, "damping": 1.0, "prior_precision": delta, "temperature": 1.0}
    )
    means, precisions = _track(run, "mean.theta"), _track(run, "precision.theta")
    assert means[0] == 0.0 and precisions[0] == delta
    for mean, precision in zip(means[1:], precisions[1:], strict=True):
        assert mean == pytest.approx(36.0 / (8.0 + delta), abs=1e-12)  # = 4.5 up to δ
        assert precision == pytest.approx(8.0 + delta, abs=1e-12)


@pytest.mark.parametrize(
    "rho,damping,expected",
    [(1.0, 1.0, [16 / 3, 56 / 9, 184 / 27]), (1.0, 0.5, [4.0, 6.0, 7.0, 7.5])],
)
def test_toy_bayes_admm_other_steps_converge_slowly(rho: float, damping: float, expected: list[float]) -> None:
    # The precision sequences the reference toy script gives (notes §1); the mean is 4.5 at once.
    run = run_quadratic_rounds(
        "bayes_admm",
        _toy(),
        len(expected),
        {"rho": rho, "damping": damping, "prior_precision": 1e-12, "temperature": 1.0},
    )
    assert _track(run, "precision.theta")[1:] == pytest.approx(expected, abs=1e-9)
    assert _track(run, "mean.theta")[1:] == pytest.approx([4.5] * len(expected), abs=1e-9)


def test_toy_uniform_average_is_4_and_size_weighted_fedavg_is_4_5() -> None:
    uniform = run_quadratic_rounds("fedavg", _toy(), 2, {"weighting": "uniform"})
    weighted = run_quadratic_rounds("fedavg", _toy(), 2)
    assert _track(uniform, "mean.theta")[1:] == pytest.approx([4.0, 4.0], abs=1e-12)
    assert _track(weighted, "mean.theta")[1:] == pytest.approx([4.5, 4.5], abs=1e-12)


def test_toy_fedadmm_approaches_4_5_monotonically() -> None:
    means = _track(run_quadratic_rounds("fedadmm", _toy(), 25, {"rho": 5.0}), "mean.theta")
    assert means[1:4] == pytest.approx([3.75, 4.125, 4.3125], abs=1e-12)  # the notes' sequence
    assert all(b >= a for a, b in zip(means, means[1:], strict=False))
    assert abs(means[-1] - 4.5) < 1e-2
    # With a server prior δ the fixed point is the regularised optimum Σb/(ΣH + δ).
    regularised = run_quadratic_rounds("fedadmm", _toy(), 200, {"rho": 5.0, "prior_precision": 2.0})
    assert _track(regularised, "mean.theta")[-1] == pytest.approx(36.0 / 10.0, abs=1e-6)


# ----------------------------------------------------------------------------- linear-Gaussian


def _linear_gaussian(num_clients: int = 4, dim: int = 5, seed: int = 0, noise_std: float = 0.7):
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(dim, generator=gen, dtype=torch.float64)
    problems = []
    for k in range(num_clients):
        X = torch.randn(10 + 7 * k, dim, generator=gen, dtype=torch.float64) + 0.5 * k
        y = X @ theta + noise_std * torch.randn(X.shape[0], generator=gen, dtype=torch.float64)
        problems.append(linear_gaussian_problem(X, y, noise_std))
    return problems


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_linear_gaussian_one_bayes_admm_round_is_the_full_posterior(temperature: float) -> None:
    problems = _linear_gaussian()
    delta = 2.0
    options = {"rho": 1.0 / len(problems), "damping": 1.0, "prior_precision": delta, "temperature": temperature}
    run = run_quadratic_rounds("bayes_admm", problems, 3, options)
    mean, precision = exact_posterior(problems, delta, temperature=temperature)
    assert precision.shape == (5, 5)
    for server in run.servers[1:]:
        assert _rel(server["mean.theta"], mean) < 1e-8
        assert _rel(server["precision.theta"], precision) < 1e-8


def test_bayes_admm_server_tracks_the_sum_of_client_duals_under_partial_participation() -> None:
    problems = _linear_gaussian(num_clients=5)
    run = run_quadratic_rounds(
        "bayes_admm",
        problems,
        6,
        {"rho": 0.3, "damping": 0.5, "prior_precision": 1.0, "temperature": 1.0},
        fraction=0.4,
        seed=3,
    )
    server = run.servers[-1]
    for key in ("mean", "prec"):
        total = sum(c[f"dual_{key}.theta"] for c in run.clients.values())
        assert torch.allclose(server[f"dual_{key}_sum.theta"], total, rtol=1e-12, atol=1e-9)
    # Partial participation still converges to the full posterior with ρ = 1/K, d = 1.
    exact = exact_posterior(problems, 1.0)[0]
    partial = run_quadratic_rounds(
        "bayes_admm",
        problems,
        30,
        {"rho": 0.2, "damping": 1.0, "prior_precision": 1.0, "temperature": 1.0},
        fraction=0.6,
        seed=1,
    )
    assert _rel(partial.servers[-1]["mean.theta"], exact) < 1e-6


# ----------------------------------------------------------------------------- server rules, sampling, drift


def test_fedavg_server_weights_by_size_over_participants() -> None:
    algo = get_algorithm("fedavg")
    options = algo.parse_options({})
    server = algo.init_server({"w": torch.zeros(2, 3)}, 4, options)
    messages = {k: {"mean.w": torch.full((2, 3), float(k + 1))} for k in (0, 2, 3)}  # client 1 sits out
    sizes = {0: 10, 1: 1000, 2: 30, 3: 60}
    new = algo.server_update(server, messages, sizes, 4, options)
    expected = (10 * 1 + 30 * 3 + 60 * 4) / 100
    assert torch.equal(new["mean.w"], torch.full((2, 3), expected, dtype=torch.float64))
    uniform = algo.server_update(server, messages, sizes, 4, algo.parse_options({"weighting": "uniform"}))
    assert torch.allclose(uniform["mean.w"], torch.full((2, 3), 8 / 3, dtype=torch.float64))


def test_sample_participants_counts_and_determinism() -> None:
    assert sample_participants(10, 1.0, 0, 5) == list(range(10))
    assert len(sample_participants(10, 0.3, 0, 0)) == 3
    assert len(sample_participants(10, 0.01, 0, 0)) == 1
    assert len(sample_participants(7, 0.5, 0, 0)) == 4
    draws = [sample_participants(20, 0.25, 7, r) for r in range(6)]
    assert draws == [sample_participants(20, 0.25, 7, r) for r in range(6)]
    assert all(len(d) == 5 and d == sorted(set(d)) and 0 <= d[0] and d[-1] < 20 for d in draws)
    assert len({tuple(d) for d in draws}) > 1
    assert sample_participants(20, 0.25, 8, 0) != draws[0] or sample_participants(20, 0.25, 9, 0) != draws[0]
    with pytest.raises(ValueError):
        sample_participants(5, 0.0, 0, 0)


def test_client_drift_is_the_mean_l2_distance() -> None:
    global_state = {"a": torch.zeros(2), "b": torch.zeros(1)}
    clients = {
        0: {"mean.a": torch.tensor([3.0, 0.0]), "mean.b": torch.tensor([4.0])},  # a message: distance 5
        1: {"a": torch.zeros(2), "b": torch.ones(1)},  # bare parameter names: distance 1
    }
    assert client_drift(global_state, clients) == pytest.approx((5.0 + 1.0) / 2)
    assert client_drift(global_state, list(clients.values())) == pytest.approx(3.0)


def test_fedprox_large_mu_keeps_clients_at_the_global_model() -> None:
    problems = _toy()
    algo = get_algorithm("fedprox")
    drifts = []
    for mu in (0.0, 1.0, 100.0, 1e6):
        options = algo.parse_options({"mu": mu})
        server = algo.init_server({"theta": torch.tensor([1.0], dtype=torch.float64)}, 2, options)
        messages = {k: algo.exact_client_update(server, {}, p, options)[0] for k, p in enumerate(problems)}
        drifts.append(client_drift(algo.global_state(server), messages))
    assert drifts[0] == pytest.approx((1.0 + 5.0) / 2)  # the client minimisers 2 and 6
    assert drifts == sorted(drifts, reverse=True) and drifts[-1] < 1e-5


def test_options_are_validated_and_every_algorithm_is_declared() -> None:
    assert {"fedavg", "fedprox", "fedadmm", "bayes_admm"} <= set(ALGORITHMS)
    assert ALGORITHMS is federated.ALGORITHMS
    assert all(get_algorithm(name).declaration is declaration for name, declaration in ALGORITHMS.items())
    with pytest.raises(ConfigError, match="federated.options.fedprox.nu"):
        get_algorithm("fedprox").parse_options({"nu": 1.0})
    with pytest.raises(ConfigError, match="rho"):
        get_algorithm("bayes_admm").parse_options({"rho": -1.0})
    with pytest.raises(ConfigError, match="unknown"):
        get_algorithm("fedsgd")


def test_the_declarations_are_torch_free_and_a_round_imports_its_algorithms_module_only() -> None:
    # In a fresh process: validating names every member without torch; the package imports no algorithm's
    # module, and asking for one imports its module (and what it imports), no other algorithm's.
    code = (
        "import sys; from mergeflow.schema import federated; assert 'torch' not in sys.modules; "
        "members = [m for axis in federated.AXES for m in axis.values()]; "
        "import mergeflow.federated; loaded = lambda: {m.module for m in members} & set(sys.modules); "
        "assert not loaded(), loaded(); mergeflow.federated.get_algorithm('fedprox'); "
        "assert loaded() == {'mergeflow.federated.fedprox', 'mergeflow.federated.fedavg'}, loaded()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


class NotebookFedAvg(FedAvg):
    """FedAvg, as a notebook would register its own algorithm."""

    name = "notebook_fedavg"
    Options = FedAvgOptions


def test_a_notebook_registers_its_own_algorithm() -> None:
    register_algorithm(averages_messages=True, point_estimate=True)(NotebookFedAvg)
    try:
        declaration = ALGORITHMS["notebook_fedavg"]
        assert declaration.implementation == f"{__name__}:NotebookFedAvg" and declaration.point_estimate
        mine, builtin = run_quadratic_rounds("notebook_fedavg", _toy(), 3), run_quadratic_rounds("fedavg", _toy(), 3)
        assert _track(mine, "mean.theta") == _track(builtin, "mean.theta")
        with pytest.raises(ValueError, match="registered twice"):
            register_algorithm(NotebookFedAvg)
    finally:
        del ALGORITHMS["notebook_fedavg"]
    with pytest.raises(ValueError, match="top level of a module"):

        @register_algorithm
        class Local(FedAvg):
            name = "local"
            Options = FedAvgOptions


# ----------------------------------------------------------------------------- IVON with a prior


def _regression_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(64, 5, generator=gen)
    return X, torch.randint(0, 3, (64,), generator=gen)


def _ivon_trajectory(make, steps: int = 20, mc: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    X, y = _regression_data()
    model = build_model("mlp", [5], 3, widths=[8], seed=2)
    opt = make(model)
    for i in range(steps):
        batch = slice(16 * (i % 4), 16 * (i % 4 + 1))
        for _ in range(mc):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(model(X[batch]), y[batch]).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt.param_groups[0]["hess"].clone()


def test_ivon_with_zero_duals_and_zero_prior_mean_is_plain_ivon() -> None:
    ess, delta = 64.0, 0.5
    with torch.random.fork_rng(devices=[]):  # plain IVON draws from the global RNG: keep it private
        torch.manual_seed(7)
        plain = _ivon_trajectory(
            lambda m: ivon.IVON(
                m.parameters(),
                lr=0.05,
                ess=ess,
                hess_init=0.3,
                beta2=0.99,
                weight_decay=delta / ess,
                mc_samples=2,
                rescale_lr=False,
            )
        )
    ours = _ivon_trajectory(
        lambda m: IVONWithPrior(
            m.parameters(),
            lr=0.05,
            ess=ess,
            hess_init=0.3,
            beta2=0.99,
            prior_precision=delta,
            mc_samples=2,
            generator=torch.Generator().manual_seed(7),
        )
    )
    assert torch.equal(plain[0], ours[0]) and torch.equal(plain[1], ours[1])


def test_ivon_prior_mean_pulls_the_mean() -> None:
    target = 2.0

    def make(prior_mean: float):
        def build(m):
            numel = sum(p.numel() for p in m.parameters())
            return IVONWithPrior(
                m.parameters(),
                lr=0.05,
                ess=64.0,
                hess_init=0.3,
                beta2=0.99,
                prior_precision=64.0,
                prior_mean=torch.full((numel,), prior_mean),
                generator=torch.Generator().manual_seed(1),
            )

        return build

    at_zero, _ = _ivon_trajectory(make(0.0), steps=60, mc=1)
    at_target, _ = _ivon_trajectory(make(target), steps=60, mc=1)
    assert (at_target - target).norm() < 0.5 * (at_zero - target).norm()
    assert at_target.mean() > 0.5 * target


def test_ivon_step_uses_the_dual_and_prior_terms() -> None:
    model = build_model("linear", [3], 2, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    c, dm, dp, pm, prec = (torch.randn(numel, generator=gen) for _ in range(5))
    prec, dp, ess, lr, h0 = prec.abs() + 1.0, dp.abs(), 10.0, 0.1, 0.7
    opt = IVONWithPrior(
        model.parameters(),
        lr=lr,
        ess=ess,
        beta1=0.0,
        beta2=1.0,
        hess_init=h0,
        prior_mean=pm,
        prior_precision=prec,
        dual_mean=dm,
        dual_precision=dp,
        generator=gen,
    )
    m0, precision0 = opt.get_posterior()
    assert torch.allclose(precision0, ess * (h0 + prec / ess))

    def linear_loss() -> torch.Tensor:  # gradient c at every sample
        return (torch.cat([p.reshape(-1) for p in model.parameters()]) * c).sum()

    with opt.sampled_params(train=True):
        opt.zero_grad()
        linear_loss().backward()
    opt.step()
    wd = prec / ess
    expected = m0 - lr * (c - dm + dp * m0 + wd * (m0 - pm)) / (h0 + wd)
    assert torch.allclose(opt.get_posterior()[0], expected, rtol=1e-5, atol=1e-6)
    # β2 = 0 with a zero loss: the Hessian target is dual_prec alone.
    opt2 = IVONWithPrior(
        model.parameters(),
        lr=lr,
        ess=ess,
        beta2=0.0,
        hess_init=h0,
        prior_precision=prec,
        dual_precision=dp,
        generator=gen,
    )
    with opt2.sampled_params(train=True):
        opt2.zero_grad()
        (0.0 * linear_loss()).backward()
    opt2.step()
    h = opt2.param_groups[0]["hess"]
    assert torch.allclose(h, dp + 0.5 * (h0 - dp) ** 2 / (h0 + wd), rtol=1e-5)
    # Posterior setter and getter round-trip; an explicit generator is required.
    opt2.set_posterior(pm, prec * 3)
    mean, precision = opt2.get_posterior()
    assert torch.allclose(mean, pm) and torch.allclose(precision, prec * 3, rtol=1e-5)
    with pytest.raises(TypeError):
        IVONWithPrior(model.parameters(), lr=lr, ess=ess, generator=None)  # type: ignore[arg-type]


def test_ivon_without_data_converges_to_the_prior_mean() -> None:
    model = build_model("linear", [3], 2, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    pm = torch.linspace(-1.0, 1.0, numel)
    opt = IVONWithPrior(
        model.parameters(),
        lr=0.2,
        ess=5.0,
        hess_init=0.0,
        beta2=0.9,
        prior_mean=pm,
        prior_precision=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    for _ in range(150):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            (0.0 * sum(p.sum() for p in model.parameters())).backward()
        opt.step()
    assert torch.allclose(opt.get_posterior()[0], pm, atol=1e-3)


# ----------------------------------------------------------------------------- neural runs


@pytest.fixture(scope="module")
def digits() -> tuple[list[ClientData], ClientData]:
    data = load_digits()
    X = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target)
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
    X, y = X[perm], y[perm]
    clients = [ClientData(X[i : i + 400], y[i : i + 400]) for i in (0, 400, 800)]
    return clients, ClientData(X[1200:], y[1200:])


def _builder():
    return build_model("mlp", [64], 10, widths=[16], seed=1)


NEURAL = {
    "fedavg": {},
    "fedprox": {"mu": 0.1},
    "fedadmm": {"rho": 40.0},
    "bayes_admm": {"rho": 0.5, "damping": 0.1, "lr": 0.1, "hess_init": 0.1, "beta2": 0.999},
}
LOCAL = LocalTraining(epochs=1, lr=0.1, batch_size=32, optimizer="sgd", momentum=0.9)


@pytest.mark.parametrize("name", sorted(NEURAL))
def test_neural_run_improves_and_is_bit_deterministic(name: str, digits) -> None:
    clients, test = digits
    runs = [
        run_rounds(name, _builder, clients, 2, options=NEURAL[name], train=LOCAL, eval_data=test, seed=5)
        for _ in range(2)
    ]
    first, second = runs
    assert first.metrics == second.metrics
    assert first.global_state.keys() == second.global_state.keys()
    assert all(torch.equal(first.global_state[k], second.global_state[k]) for k in first.global_state)
    accuracy = [m["accuracy"] for m in first.metrics]
    assert len(accuracy) == 3 and accuracy[-1] > accuracy[0] + 0.3
    assert all(math.isfinite(m["train_loss"]) and m["drift"] > 0 for m in first.metrics[1:])


def test_states_and_messages_are_safetensors_dicts(digits) -> None:
    clients, _ = digits
    for name, options in NEURAL.items():
        algo = get_algorithm(name)
        opts = algo.parse_options(options)
        model = _builder()
        initial = {k: p.detach() for k, p in model.named_parameters()}
        server = algo.init_server(initial, 3, opts)
        client = algo.init_client(initial, opts)
        message, client, metrics = algo.client_update(
            _builder(), server, client, clients[0], LOCAL, opts, client_generator(0, 0, 0)
        )
        server = algo.server_update(server, {0: message}, {0: len(clients[0])}, 3, opts)
        for state in (server, client, message):
            restored = load(save(state))
            assert restored.keys() == state.keys() and all(torch.equal(restored[k], state[k]) for k in state)
        assert all(isinstance(v, float) for v in metrics.values())


def test_fedprox_mu_reduces_neural_drift(digits) -> None:
    clients, test = digits
    drift = {}
    for mu in (0.0, 5.0):
        run = run_rounds("fedprox", _builder, clients, 1, options={"mu": mu}, train=LOCAL, eval_data=test)
        drift[mu] = run.metrics[-1]["drift"]
    assert drift[5.0] < 0.5 * drift[0.0]


def test_partial_participation_in_the_loop(digits) -> None:
    clients, test = digits
    run = run_rounds("fedavg", _builder, clients, 2, train=LOCAL, eval_data=test, fraction=0.5, seed=2)
    assert [m.get("participants") for m in run.metrics[1:]] == [2.0, 2.0]


class _NoSignal(torch.nn.Module):
    """A regression model whose loss on zero inputs and targets is 0 for every weight: no data signal."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4).reshape(1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class _BiasFreeLinear(torch.nn.Module):
    """y = xwᵀ: with the summed half squared error its loss is the quadratic ½‖Xw − y‖²."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


# Full-batch SGD long enough to land on a linear client's minimiser.
_TO_THE_MINIMUM = LocalTraining(epochs=3000, batch_size=30, lr=0.2, optimizer="sgd", momentum=0.0)
_ANCHOR = torch.tensor([[0.3, 0.1, -0.2]], dtype=torch.float64)  # the server's mean θ̄


def _linear_client() -> tuple[torch.Tensor, torch.Tensor, ClientData]:
    """X (30 × 3) and y in float64, and the same as a regression client (loss ½‖Xw − y‖² summed)."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(30, 3, generator=generator)
    y = X @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(30, generator=generator)
    return X.double(), y.double(), ClientData(X, y, task="regression")


def test_fedadmm_neural_client_reaches_the_quadratic_closed_form_and_steps_its_dual() -> None:
    # The neural client minimises the mean loss plus (⟨v, θ⟩ + ρ/2‖θ − θ̄‖²)/N, whose minimiser is
    # the module's step 1, (XᵀX + ρI)⁻¹(Xᵀy − v + ρθ̄) for a linear model.
    X, y, data = _linear_client()
    algo, rho = get_algorithm("fedadmm"), 5.0
    options = algo.parse_options({"rho": rho})
    initial = dict(_BiasFreeLinear().named_parameters())
    server = {**algo.init_server(initial, 2, options), "mean.weight": _ANCHOR}
    v = torch.tensor([[4.0, -3.0, 2.0]], dtype=torch.float64)
    client = {**algo.init_client(initial, options), "dual.weight": v}
    message, new, _ = algo.client_update(
        _BiasFreeLinear(), server, client, data, _TO_THE_MINIMUM, options, client_generator(0, 0, 0)
    )
    expected = torch.linalg.solve(X.T @ X + rho * torch.eye(3, dtype=torch.float64), X.T @ y - v[0] + rho * _ANCHOR[0])
    torch.testing.assert_close(message["mean.weight"][0].double(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(new["dual.weight"], v + rho * (message["mean.weight"].double() - _ANCHOR))


def test_fedprox_neural_client_reaches_the_quadratic_closed_form() -> None:
    # Mean loss plus μ/2‖θ − θ̄‖² (squared, on the per-example scale): (XᵀX/n + μI)⁻¹(Xᵀy/n + μθ̄).
    X, y, data = _linear_client()
    algo, mu, n = get_algorithm("fedprox"), 1.0, len(y)
    options = algo.parse_options({"mu": mu})
    server = {**algo.init_server(dict(_BiasFreeLinear().named_parameters()), 2, options), "mean.weight": _ANCHOR}
    message, _, _ = algo.client_update(
        _BiasFreeLinear(), server, {}, data, _TO_THE_MINIMUM, options, client_generator(0, 0, 0)
    )
    expected = torch.linalg.solve(X.T @ X / n + mu * torch.eye(3, dtype=torch.float64), X.T @ y / n + mu * _ANCHOR[0])
    torch.testing.assert_close(message["mean.weight"][0].double(), expected, rtol=1e-4, atol=1e-5)


def test_ivon_admm_client_step_uses_its_duals_against_the_server_prior() -> None:
    # One IVON step without data signal (ĝ = 0), β1 = 0, β2 = 1 and h = 0 (after a server update):
    # m = m̄ − lr·(−dual_mean + dual_prec⊙m̄)/wd with dual_mean = −v/s, dual_prec = −V/s and wd = ρS̄/s
    # (s = N/τ), i.e. m̄ − lr·(v − V⊙m̄)/(ρS̄), whatever s is.
    data = ClientData(torch.zeros(20, 4), torch.zeros(20), task="regression")
    algo, rho, lr = get_algorithm("bayes_admm"), 0.5, 0.1
    options = algo.parse_options({"rho": rho, "lr": lr, "beta1": 0.0, "beta2": 1.0, "prior_precision": 2.0})
    initial = dict(_NoSignal().named_parameters())
    mean, precision = torch.tensor([[0.5, -1.0, 2.0, 0.3]]).double(), torch.tensor([[3.0, 4.0, 5.0, 6.0]]).double()
    server = algo.init_server(initial, 2, options)
    server.update({"mean.weight": mean, "precision.weight": precision, "server_rounds": torch.tensor(1.0).double()})
    v, V = torch.tensor([[1.0, 2.0, -1.0, 0.5]]).double(), torch.tensor([[0.5, 1.0, 2.0, 0.1]]).double()
    client = {**algo.init_client(initial, options), "dual_mean.weight": v, "dual_prec.weight": V}
    one_step = LocalTraining(epochs=1, batch_size=20)
    message, _, _ = algo.client_update(_NoSignal(), server, client, data, one_step, options, client_generator(0, 0, 0))
    torch.testing.assert_close(
        message["mean.weight"], mean - lr * (v - V * mean) / (rho * precision), rtol=1e-5, atol=0
    )


def test_ivon_admm_restarts_each_round_at_the_server_posterior() -> None:
    # β2 = 1 freezes IVON's h at its start value, so S_k − S̄ = ess·h_start exactly. Restarting at
    # hess_init every round (the bug) sent S̄ + ess·hess_init; the reference restarts at h = 0.
    data = ClientData(torch.zeros(20, 4), torch.zeros(20), task="regression")
    options = {"rho": 0.5, "damping": 0.1, "temperature": 1.0, "prior_precision": 2.0, "hess_init": 1.0, "beta2": 1.0}
    run = run_rounds(
        "bayes_admm", _NoSignal, [data, data], 3, options=options, train=LocalTraining(epochs=2, batch_size=8)
    )
    ess = len(data) / (1.0 * 0.5)
    algo = get_algorithm("bayes_admm")
    opts = algo.parse_options(options)
    server = algo.init_server(dict(_NoSignal().named_parameters()), 2, opts)
    client = algo.init_client(dict(_NoSignal().named_parameters()), opts)
    gen = client_generator(0, 0, 0)
    first, client, _ = algo.client_update(
        _NoSignal(), server, client, data, LocalTraining(epochs=2, batch_size=8), opts, gen
    )
    assert torch.allclose(first["precision.weight"], torch.full((1, 4), 2.0 + ess * 1.0, dtype=torch.float64))
    server = algo.server_update(server, {0: first, 1: first}, {0: 20, 1: 20}, 2, opts)
    later, client, _ = algo.client_update(
        _NoSignal(), server, client, data, LocalTraining(epochs=2, batch_size=8), opts, client_generator(0, 1, 0)
    )
    assert torch.allclose(later["precision.weight"], server["precision.weight"], rtol=1e-6)
    assert float((later["precision.weight"] - server["precision.weight"]).abs().max()) < 1e-3 * ess
    # IVON's momentum and step count are the client's own and carry over: 2 epochs × 3 batches a round.
    assert float(client["ivon_steps"]) == 12.0 and "ivon_momentum.weight" in client
    assert "ivon_steps" not in later  # local state, never sent
    assert [float(v) for v in run.client_states[0]["ivon_steps"].reshape(1)] == [18.0]
    assert run.metrics[-1]["diverged"] == []


def _with_a_diverging_client(digits) -> list[ClientData]:
    clients, _ = digits
    bad = ClientData(clients[1].X * 1e30, clients[1].y)
    return [clients[0], bad, clients[2]]


@pytest.mark.parametrize("name", ["fedavg", "bayes_admm"])
def test_a_diverged_client_fails_the_run_or_is_excluded(name: str, digits) -> None:
    clients, test = _with_a_diverging_client(digits), digits[1]
    with pytest.raises(DivergenceError, match="round 1: local training diverged.*client 1: .*on_divergence: exclude"):
        run_rounds(name, _builder, clients, 1, options=NEURAL[name], train=LOCAL, eval_data=test)
    run = run_rounds(
        name, _builder, clients, 2, options=NEURAL[name], train=LOCAL, eval_data=test, on_divergence="exclude"
    )
    assert [row["diverged"] for row in run.metrics[1:]] == [[1], [1]]
    assert run.metrics[-1]["accuracy"] > run.metrics[0]["accuracy"] + 0.3
    initial = get_algorithm(name).init_client(
        model_parameters(_builder()), get_algorithm(name).parse_options(NEURAL[name])
    )
    assert run.client_states[1].keys() == initial.keys()  # the diverged client's state is kept as it was
    assert all(torch.equal(run.client_states[1][k], initial[k]) for k in initial)


def test_bayes_admm_server_raises_divergence_on_a_non_positive_posterior() -> None:
    algo = get_algorithm("bayes_admm")
    opts = algo.parse_options({"rho": 0.5})
    initial = {"w": torch.zeros(3)}
    server = algo.init_server(initial, 2, opts)
    message = {"mean.w": torch.zeros(3, dtype=torch.float64), "precision.w": torch.tensor([1.0, -50.0, 1.0])}
    with pytest.raises(DivergenceError, match="posterior of 'w' is not finite and positive"):
        algo.server_update(server, {0: message}, {0: 10}, 2, opts)
    message["precision.w"] = torch.tensor([1.0, float("nan"), 1.0], dtype=torch.float64)
    with pytest.raises(DivergenceError):
        algo.server_update(server, {0: message}, {0: 10}, 2, opts)


def test_the_monte_carlo_predictive_averages_sampled_models(digits) -> None:
    clients, test = digits
    options = NEURAL["bayes_admm"]
    runs = [
        run_rounds(
            "bayes_admm", _builder, clients, 1, options=options, train=LOCAL, eval_data=test, predictive_samples=s
        )
        for s in (0, 8)
    ]
    assert "bma_accuracy" not in runs[0].metrics[-1]
    row = runs[1].metrics[-1]
    assert row["accuracy"] == runs[0].metrics[-1]["accuracy"]  # the mean's metrics are unchanged
    assert 0.2 < row["bma_accuracy"] <= 1.0 and math.isfinite(row["bma_nll"])  # chance is 0.1
    # By hand: the same draws from the same derived generator give the same average.
    algo = get_algorithm("bayes_admm")
    means, precisions = algo.posterior(runs[1].server)
    gen = torch.Generator().manual_seed(derive_seed(0, "predictive", 1))
    model, probs = _builder(), 0.0
    for _ in range(8):
        draw = {
            n: m + torch.randn(m.shape, generator=gen, dtype=torch.float64) / precisions[n].sqrt()
            for n, m in sorted(means.items())
        }
        load_parameters(model, draw)
        probs = probs + softmax(predict(model, test.X)) / 8
    assert row["bma_accuracy"] == pytest.approx(float((probs.argmax(1) == test.y.numpy()).mean()))
    assert (
        run_rounds("fedavg", _builder, clients, 1, train=LOCAL, eval_data=test, predictive_samples=8)
        .metrics[-1]
        .get("bma_accuracy")
        is None
    )


def test_local_train_without_penalty_is_mergeflow_train() -> None:
    X, y = _regression_data()
    a, b = build_model("mlp", [5], 3, widths=[8], seed=4), build_model("mlp", [5], 3, widths=[8], seed=4)
    train = LocalTraining(epochs=3, lr=0.05, batch_size=10, optimizer="adam")
    local_train(a, ClientData(X, y), train, torch.Generator().manual_seed(11))
    central_train(b, X, y, task="classification", epochs=3, lr=0.05, optimizer="adam", batch_size=10, seed=11)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_validation_metrics_are_scored_beside_test(digits) -> None:
    clients, test = digits
    validation = ClientData(test.X[:200], test.y[:200])
    run = run_rounds("fedavg", _builder, clients[:2], 1, train=LOCAL, eval_data=test, validation_data=validation)
    plain = run_rounds("fedavg", _builder, clients[:2], 1, train=LOCAL, eval_data=validation)
    assert [row["val_accuracy"] for row in run.metrics] == [row["accuracy"] for row in plain.metrics]
    assert (
        run.metrics[-1]["val_nll"] == plain.metrics[-1]["nll"]
        and run.metrics[-1]["accuracy"] != plain.metrics[-1]["accuracy"]
    )


def test_the_federated_plan_lists_the_clients_a_fixed_number_of_times_whatever_their_number(monkeypatch):
    """Each listing of the clients builds all of them: one per client step made planning quadratic."""
    from conftest import fast_params

    from mergeflow.config import Params, validate_params
    from tasks.federated import plan_federated

    listings = []
    every_client = Params.clients.fget
    monkeypatch.setattr(Params, "clients", property(lambda params: listings.append(1) or every_client(params)))
    counts = {}
    for clients in (10, 40):
        raw = fast_params(federated={"algorithms": ["fedavg"], "rounds": 3, "fraction": 0.5})
        raw["partition"] |= {"num_clients": clients, "min_partition_size": 1}
        listings.clear()
        steps = [step for wave in plan_federated(validate_params(raw)) for step in wave]
        counts[clients] = len(listings)
        assert len(steps) == 1 + 3 * (clients // 2 + 1) + 1
    assert counts[10] == counts[40]
