"""Server plans: server optimizers in closed form, robust aggregators on hand-made updates, attacks, DP-FedAvg."""

from __future__ import annotations

import math
import re

import pytest
import torch
from sklearn.datasets import load_digits

from mergeflow.accounting import epsilon, mechanism, noise_for_target
from mergeflow.federated import ClientData, LocalTraining, get_algorithm, run_rounds
from mergeflow.federated.privacy import clip_update, private_average
from mergeflow.federated.robust import krum_scores
from mergeflow.federated.server_plan import (
    ServerPlan,
    aggregate,
    attack_message,
    attackers,
    planned_server_update,
    server_optimizer_step,
)
from mergeflow.models.sequential import build_model
from mergeflow.schema.federated import (
    AggregatorOptions,
    AttackOptions,
    DPOptions,
    ServerOptimizerOptions,
    server_step_members,
)

# ----------------------------------------------------------------------------- server optimizers


def _reference(optimizer: str, deltas: list[float], lr: float, b1: float, b2: float, tau: float, beta: float):
    """Reddi et al. 2021, Algorithm 2 (and FedAvgM), on a scalar in plain floats: the x_t after each Δ_t."""
    x, m, v, xs = 0.0, 0.0, tau**2, []
    for d in deltas:
        if optimizer == "avgm":
            m = beta * m + d
            x += lr * m
        else:
            m = b1 * m + (1 - b1) * d
            if optimizer == "adagrad":
                v = v + d * d
            elif optimizer == "adam":
                v = b2 * v + (1 - b2) * d * d
            else:
                v = v - (1 - b2) * d * d * math.copysign(1.0, v - d * d) if v != d * d else v
            x += lr * m / (math.sqrt(v) + tau)
        xs.append(x)
    return xs


@pytest.mark.parametrize("optimizer", ["avgm", "adagrad", "adam", "yogi"])
def test_server_optimizers_follow_the_papers_update_rules_on_a_hand_sequence(optimizer):
    options = ServerOptimizerOptions(optimizer=optimizer, lr=0.3, beta1=0.8, beta2=0.9, tau=0.01, momentum=0.7)
    aggregates = [1.0, -0.5, 2.0, 0.25, 0.25]  # θ̄_agg of each round; Δ_t = θ̄_agg − x_t
    state, xs, deltas = {"mean.w": torch.zeros(1, dtype=torch.float64)}, [], []
    for t, target in enumerate(aggregates, start=1):
        deltas.append(target - float(state["mean.w"]))
        state = server_optimizer_step(state, {"w": torch.tensor([target], dtype=torch.float64)}, options, t)
        xs.append(float(state["mean.w"]))
    assert xs == pytest.approx(_reference(optimizer, deltas, 0.3, 0.8, 0.9, 0.01, 0.7), rel=1e-12, abs=1e-15)


def test_fedavgm_on_a_quadratic_is_the_heavy_ball_recurrence_and_converges():
    # Clients with ℓ_k = ½ n_k (θ − c_k)²: FedAvg's aggregate is the minimiser θ* = Σ n_k c_k / N in one step,
    # so Δ_t = θ* − x_t and FedAvgM is x_{t+1} = x_t + η(β m_t + θ* − x_t), solved here in closed form.
    fedavg = get_algorithm("fedavg")
    options, plan = (
        fedavg.parse_options({}),
        ServerPlan(server=ServerOptimizerOptions(optimizer="avgm", lr=0.5, momentum=0.5)),
    )
    sizes, centres = {0: 1, 1: 3}, {0: 2.0, 1: 6.0}
    optimum = (1 * 2.0 + 3 * 6.0) / 4
    server, x, m = {"mean.w": torch.zeros(1, dtype=torch.float64)}, 0.0, 0.0
    for t in range(1, 40):
        messages = {k: {"mean.w": torch.tensor([c], dtype=torch.float64)} for k, c in centres.items()}
        server, _ = planned_server_update(fedavg, server, messages, sizes, 2, options, plan, t)
        m = 0.5 * m + (optimum - x)
        x += 0.5 * m
        assert float(server["mean.w"]) == pytest.approx(x, rel=1e-12)
    assert x == pytest.approx(optimum, abs=1e-2)


def test_sgd_with_lr_one_is_plain_averaging_bit_for_bit():
    target = {"w": torch.tensor([0.1, 0.7], dtype=torch.float64)}
    state = server_optimizer_step({"mean.w": torch.zeros(2, dtype=torch.float64)}, target, ServerOptimizerOptions(), 1)
    assert torch.equal(state["mean.w"], target["w"]) and set(state) == {"mean.w"}


# ----------------------------------------------------------------------------- robust aggregators


def _rows(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _run(name: str, stack: torch.Tensor, **options):
    weights = torch.full((stack.shape[0],), 1.0 / stack.shape[0], dtype=torch.float64)
    return aggregate(stack, weights, AggregatorOptions(name=name, **options))


def test_median_and_trimmed_mean_exactly():
    stack = _rows([1.0, 10.0], [2.0, -5.0], [100.0, 0.0], [3.0, 1.0], [-50.0, 2.0])
    median, kept = _run("median", stack)
    assert median.tolist() == [2.0, 1.0]
    assert kept.tolist() == [0.0, 0.5, 0.0, 0.5, 0.0]
    even, _ = _run("median", stack[:4])
    assert even.tolist() == [2.5, 0.5]
    trimmed, kept = _run("trimmed_mean", stack, beta=0.2)  # drop 1 largest and 1 smallest per coordinate
    assert trimmed.tolist() == [2.0, 1.0]
    assert trimmed.tolist() == [(1 + 2 + 3) / 3, (0 + 1 + 2) / 3]
    assert kept.tolist() == [0.5, 0.5, 0.5, 1.0, 0.5]


def test_krum_multikrum_and_bulyan_keep_the_planted_honest_cluster():
    generator = torch.Generator().manual_seed(0)
    honest = 1.0 + 0.01 * torch.randn(9, 4, generator=generator, dtype=torch.float64)
    byzantine = _rows([50.0, -50.0, 50.0, -50.0], [-30.0, 30.0, 0.0, 0.0])
    stack = torch.cat([honest[:3], byzantine, honest[3:]])  # attackers at rows 3 and 4
    chosen, kept = _run("krum", stack, f=2)
    assert kept[3] == kept[4] == 0 and kept.sum() == 1
    assert any(torch.equal(chosen, row) for row in honest)
    scores = krum_scores(stack, 2)
    assert int(torch.argmin(scores)) == int(torch.argmax(kept))
    many, kept = _run("multikrum", stack, f=2)
    assert kept.tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1] and torch.allclose(many, honest.mean(0))
    robust, kept = _run("bulyan", stack, f=2)  # n = 11 = 4f + 3; θ = 7 chosen, 3 kept per coordinate
    assert kept[3] == kept[4] == 0 and math.isclose(float(kept.sum()), 3.0)
    assert (robust - 1.0).abs().max() < 0.05


@pytest.mark.parametrize(
    ("options", "n", "needle"),
    [({"name": "krum", "f": 2}, 6, "n ≥ 2f + 3"), ({"name": "bulyan", "f": 1}, 6, "n ≥ 4f + 3")],
)
def test_rules_refuse_too_few_messages(options, n, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        _run(stack=torch.zeros(n, 2, dtype=torch.float64), **options)


# ----------------------------------------------------------------------------- members a server step runs


def test_a_server_step_runs_the_members_that_change_it_and_only_those():
    plain = server_step_members(ServerOptimizerOptions(), AggregatorOptions(), AttackOptions(clients=0))
    assert plain == ()  # plain averaging, no attacker: the algorithm's own step alone
    chosen = (ServerOptimizerOptions(optimizer="yogi"), AggregatorOptions(name="krum"), AttackOptions(kind="gaussian"))
    assert [member.name for member in server_step_members(*chosen)] == ["yogi", "krum", "gaussian"]
    assert [member.module for member in server_step_members(*chosen)] == [
        "mergeflow.federated.server_opt",
        "mergeflow.federated.robust",
        "mergeflow.federated.attacks",
    ]
    data_attack = AttackOptions(kind="label_flip")  # acts on the attackers' training, not at the server
    only = server_step_members(ServerOptimizerOptions(lr=0.5), AggregatorOptions(), data_attack)
    assert [member.name for member in only] == ["sgd"]


# ----------------------------------------------------------------------------- attacks


def test_attackers_come_from_the_seed_and_attacks_rewrite_the_update():
    assert attackers(10, AttackOptions(clients=3), 4) == attackers(10, AttackOptions(clients=3), 4)
    assert len(set(attackers(10, AttackOptions(clients=3), 4))) == 3
    with pytest.raises(ValueError, match="federated.attack.clients"):
        attackers(2, AttackOptions(clients=3), 0)
    anchor, theta = {"w": torch.tensor([1.0, 1.0])}, {"mean.w": torch.tensor([2.0, 0.0])}
    generator = torch.Generator().manual_seed(0)
    flipped = attack_message(theta, anchor, AttackOptions(kind="sign_flip", scale=2.0), generator)
    scaled = attack_message(theta, anchor, AttackOptions(kind="scaled", scale=3.0), generator)
    assert flipped["mean.w"].tolist() == [-1.0, 3.0] and scaled["mean.w"].tolist() == [4.0, -2.0]


@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    X, y = torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target)
    clients = [ClientData(X[i : i + 100], y[i : i + 100]) for i in range(0, 700, 100)]
    return clients, ClientData(X[1000:], y[1000:])


def _distance(a, b) -> float:
    return math.sqrt(sum(float(((a[k] - b[k]) ** 2).sum()) for k in a))


def test_an_attacked_run_stays_near_the_clean_run_under_median_and_not_under_the_mean(digits):
    clients, test = digits

    def run(aggregator, attack):
        return run_rounds(
            "fedavg",
            lambda: build_model("linear", [64], 10, seed=0),
            clients,
            2,
            train=LocalTraining(epochs=1, lr=0.5, batch_size=50),
            eval_data=test,
            seed=1,
            aggregator=aggregator,
            attack=attack,
        )

    attack = {"clients": 2, "kind": "sign_flip", "scale": 10.0}
    clean_mean, clean_median = run("mean", None), run("median", None)
    attacked_mean, attacked_median = run("mean", attack), run("median", attack)
    scale = _distance(clean_mean.global_state, {k: 0 * v for k, v in clean_mean.global_state.items()})
    assert _distance(attacked_median.global_state, clean_median.global_state) < 0.25 * scale
    assert _distance(attacked_mean.global_state, clean_mean.global_state) > 1.0 * scale
    assert attacked_median.metrics[-1]["accuracy"] > attacked_mean.metrics[-1]["accuracy"] + 0.2
    assert attacked_mean.metrics[-1]["attacked_kept"] == 2.0 and attacked_median.metrics[-1]["attacked_kept"] < 1.0


# ----------------------------------------------------------------------------- DP-FedAvg


def test_epsilon_is_opacus_own_accounting_for_the_same_q_sigma_and_rounds():
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for _ in range(25):
        accountant.step(noise_multiplier=1.3, sample_rate=0.3)
    assert epsilon(1.3, 0.3, 25, 1e-5) == accountant.get_epsilon(delta=1e-5)
    sigma = noise_for_target(4.0, 1e-5, 0.3, 25)
    assert 3.98 <= epsilon(sigma, 0.3, 25, 1e-5) <= 4.0


def test_clipping_bounds_every_clients_contribution():
    mean = {"w": torch.zeros(3, dtype=torch.float64)}
    messages = {k: {"mean.w": torch.tensor([10.0**k, -(3.0**k), 0.5], dtype=torch.float64)} for k in range(4)}
    options = DPOptions(clip=0.7, noise_multiplier=0.0)
    noise = mechanism(options, 4, 0.5, 3)
    full, _, metrics = private_average(mean, messages, options, noise, 0.7, 2.0, 0, 1)
    for k in messages:
        without = private_average(mean, {j: m for j, m in messages.items() if j != k}, options, noise, 0.7, 2.0, 0, 1)
        assert float((full["w"] - without[0]["w"]).norm()) <= 0.7 / 2.0 + 1e-12
    assert metrics["unclipped"] == 0.0
    assert clip_update(torch.tensor([0.3, 0.4]), 1.0)[1] and not clip_update(torch.tensor([3.0, 4.0]), 1.0)[1]


def test_a_dp_run_reports_epsilon_per_round_and_poisson_samples_its_clients(digits):
    clients, test = digits
    dp = {"clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-4, "adaptive": True, "count_noise": 2.0}
    run = run_rounds(
        "fedavg",
        lambda: build_model("linear", [64], 10, seed=0),
        clients,
        3,
        fraction=0.5,
        seed=2,
        eval_data=test,
        dp=dp,
    )
    rows = run.metrics[1:]
    assert [r["epsilon"] for r in rows] == [epsilon(1.0, 0.5, t, 1e-4) for t in (1, 2, 3)]
    assert rows[0]["epsilon_round"] == epsilon(1.0, 0.5, 1, 1e-4)
    assert rows[0]["clip"] == 1.0 and rows[1]["clip"] != 1.0  # adaptive
    assert len({r["participants"] for r in rows}) > 1 or rows[0]["participants"] != 4  # not a fixed count
    with pytest.raises(ValueError, match="federated.dp.target_epsilon: .* unreachable"):
        mechanism(DPOptions(target_epsilon=0.1), 7, 0.5, 3)
    with pytest.raises(ValueError, match="federated.dp.target_epsilon: adaptive clipping needs"):
        mechanism(DPOptions(target_epsilon=2.0, adaptive=True, count_noise=0.1), 7, 0.5, 3)
