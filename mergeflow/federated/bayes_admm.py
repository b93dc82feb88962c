"""Bayes-ADMM (Möllenhoff, Swaroop, Doshi-Velez, Khan 2025) with IVON clients (IVON-ADMM).

Sign convention (that of the notes §1, i.e. the reference ``toyexamples/admm.py``): a Gaussian
q = N(m, S⁻¹) has natural parameters (S m, −½S); client k holds duals (v_k, V_k) with v_k ↔ S m and
V_k ↔ S, both 0 at the start. They are the client's "site": at the fixed point q̄ ∝ p0 · Π_k
exp(v_kᵀθ − ½θᵀV_kθ), i.e. S̄ = S0 + Σ V_k and S̄m̄ = S0 m0 + Σ v_k (the reference IVON code stores
−v, −V instead). With prior p0 = N(m0, S0⁻¹), S0 = δI, temperature τ, step ρ, damping d, one round is

1. client: q_k = argmin_q E_q[ℓ_k/τ + v_kᵀθ − ½θᵀV_kθ] + ρ·KL(q ‖ q̄) (ℓ_k: summed loss), so that
   S_k = S̄ + (E_q∇²ℓ_k/τ − V_k)/ρ; exactly, for a quadratic ℓ_k = ½θᵀH_kθ − b_kᵀθ:
   S_k = S̄ + (H_k/τ − V_k)/ρ and S_k m_k = S̄m̄ + (b_k/τ − v_k)/ρ;
2. client dual step: v_k ← v_k + dρ(S_k m_k − S̄m̄), V_k ← V_k + dρ(S_k − S̄);
3. server, α = 1/(1 + Kρ) (or ``server_step``):
   S̄ ← (1 − α)·mean_{k∈P} S_k + α(S0 + Σ_{all k} V_k),
   S̄m̄ ← (1 − α)·mean_{k∈P} S_k m_k + α(S0 m0 + Σ_{all k} v_k).

The server tracks Σv and ΣV itself (``dual_mean_sum.``/``dual_prec_sum.``) by applying step 2 to
the messages it receives, so it never reads the clients' states; non-participants' duals do not
change, and the means in step 3 are over the participants P. With ρ = 1/K, d = 1 and q̄ started at
p0, a quadratic problem is solved exactly in one round.

Neural clients run :class:`~mergeflow.federated.ivon_prior.IVONWithPrior` on the mean mini-batch
loss with ess = N_k/(τρ), prior (m̄, S̄) and dual factor (−v_k, −V_k)/(N_k/τ) (dividing out the
client's own site). As in the reference code (team-approx-bayes/bayes-admm, ``train.py``), every
round starts at the server's Gaussian: mean m̄ and posterior = prior = S̄, i.e. h = S̄/ess − S̄/ess = 0.
Only before the first server update, while q̄ is still the broad prior N(θ0, δ⁻¹I), does IVON start
at h = ``hess_init``. Restarting at ``hess_init`` every round would add about ess·``hess_init`` of
precision per client per round that no data supports: S̄ ratchets up and the clients freeze. The
reference resets every client after every server step, so a client that first takes part in a
later round (partial participation) also starts at h = 0. IVON's momentum and step count are kept
in the client state (local, never sent), as the reference keeps its optimizer across rounds. The
message is the IVON posterior (m_k, S_k = ess·(h + S̄/ess)). With the stochastic IVON solve the
dual step needs damping (d ≈ 0.1; d = 1 diverged in the notes' runs). Evaluation uses the mean m̄;
:meth:`BayesADMM.posterior` gives (m̄, S̄) for a Monte-Carlo predictive.

Stability. The outer loop can run away in directions no data touches
(:mod:`~mergeflow.federated.flat_direction` has the mechanism and its exact recursion): round 0's
``hess_init`` puts precision into V_k that decays by only about d(1 − β2^T) a round (T local
steps), the clients' local problems stay nearly flat there for hundreds of rounds, and the dual
and server steps amplify a client's offset when Kρ is small. On the default pipeline's clients
τ = 1, lr 0.2, ``hess_init`` 1, β2 0.99 need Kρ ≳ 2.9 at 2 local epochs and 3.9 at 10 (they ran
away at Kρ = 1.5); lr 0.05 or ``hess_init`` 0.01 bring that to Kρ ≈ 0.6–0.7, and the defaults
(τ 1e-3, lr 0.01, ``hess_init`` 0.01, β2 0.999) to Kρ ≤ 0.1 (0.6 at 10 epochs).
:meth:`BayesADMM.stability_warning` checks a run's own clients against the recursion, and
:func:`~mergeflow.federated.divergence.guard_runaway` stops a client whose drift grows anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from mergeflow import cancel
from mergeflow.device import module_device, to_device
from mergeflow.federated.base import (
    MEAN,
    PRECISION,
    PRIOR_MEAN,
    ClientData,
    ClientState,
    FederatedAlgorithm,
    LocalTraining,
    Message,
    ServerState,
    client_drift,
    exchanged_parameters,
    load_parameters,
    take_prefix,
)
from mergeflow.federated.divergence import guard_runaway
from mergeflow.federated.flat_direction import local_steps, min_stable_rho
from mergeflow.federated.ivon_prior import IVONWithPrior
from mergeflow.federated.local import check_finite, minibatches, prepared
from mergeflow.federated.quadratic_loss import THETA, QuadraticProblem, eye_like, pmul, psolve
from mergeflow.schema.federated import BayesADMMOptions
from mergeflow.training import DivergenceError, token_lengths

DUAL_MEAN = "dual_mean."
DUAL_PREC = "dual_prec."
DUAL_MEAN_SUM = "dual_mean_sum."
DUAL_PREC_SUM = "dual_prec_sum."
SERVER_ROUNDS = "server_rounds"
IVON_MOMENTUM = "ivon_momentum."
IVON_STEPS = "ivon_steps"
STABILITY_HORIZON = 200  # rounds over which stability_warning asks a parameter no data touches to stay put


class BayesADMM(FederatedAlgorithm):
    """Bayes-ADMM: clients exchange Gaussians (m, S); IVON-ADMM on neural clients."""

    def init_server(self, global_state, num_clients: int, options: BayesADMMOptions) -> ServerState:
        """q̄ = N(θ0, δ⁻¹I), prior mean θ0 or 0, Σv = ΣV = 0."""
        server: ServerState = {}
        for name, value in global_state.items():
            mean = value.detach().to(torch.float64).clone()
            server[MEAN + name] = mean
            server[PRECISION + name] = torch.full_like(mean, options.prior_precision)
            server[PRIOR_MEAN + name] = mean.clone() if options.prior_mean == "init" else torch.zeros_like(mean)
            server[DUAL_MEAN_SUM + name] = torch.zeros_like(mean)
            server[DUAL_PREC_SUM + name] = torch.zeros_like(mean)
        server[SERVER_ROUNDS] = torch.zeros((), dtype=torch.float64, device=mean.device)
        return server

    def init_client(self, global_state, options: BayesADMMOptions) -> ClientState:
        """v_k = V_k = 0."""
        state: ClientState = {}
        for name, value in global_state.items():
            state[DUAL_MEAN + name] = torch.zeros_like(value, dtype=torch.float64)
            state[DUAL_PREC + name] = torch.zeros_like(value, dtype=torch.float64)
        return state

    @staticmethod
    def dual_step(server: ServerState, client: ClientState, message: Message, options: BayesADMMOptions) -> ClientState:
        """v_k += dρ(S_k m_k − S̄m̄), V_k += dρ(S_k − S̄) for every parameter of the message."""
        step = options.damping * options.rho
        new = dict(client)
        for name, m_k in take_prefix(message, MEAN).items():
            s_k, s_bar = message[PRECISION + name], server[PRECISION + name]
            eta_k, eta_bar = pmul(s_k, m_k), pmul(s_bar, server[MEAN + name])
            new[DUAL_MEAN + name] = client[DUAL_MEAN + name] + step * (eta_k - eta_bar)
            new[DUAL_PREC + name] = client[DUAL_PREC + name] + step * (s_k - s_bar)
        return new

    def client_update(
        self,
        model: nn.Module,
        server: ServerState,
        client: ClientState,
        data: ClientData,
        train: LocalTraining,
        options: BayesADMMOptions,
        generator: torch.Generator,
    ) -> tuple[Message, ClientState, dict[str, float]]:
        """IVON-ADMM: IVON with prior q̄ and the dual factor on the client data, then the dual step.

        IVON starts at q̄ (h = 0), or at h = ``hess_init`` before the first server update; its
        momentum and step count carry over from the client's previous round.
        """
        names = [name for name, _ in exchanged_parameters(model)]
        load_parameters(model, take_prefix(server, MEAN))
        scale = len(data) / options.temperature  # N_k / τ

        def flat(state: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor:
            return torch.cat([state[prefix + n].reshape(-1) for n in names])

        opt = IVONWithPrior(
            [p for _, p in exchanged_parameters(model)],
            lr=options.lr,
            ess=scale / options.rho,
            generator=generator,
            prior_precision=flat(server, PRECISION),
            prior_mean=flat(server, MEAN),
            dual_mean=-flat(client, DUAL_MEAN) / scale,
            dual_precision=-flat(client, DUAL_PREC) / scale,
            hess_init=options.hess_init if float(server[SERVER_ROUNDS]) == 0 else 0.0,
            beta1=options.beta1,
            beta2=options.beta2,
            mc_samples=options.mc_samples,
            clip_radius=options.clip_radius,
        )
        if IVON_STEPS in client:
            opt.set_momentum(flat(client, IVON_MOMENTUM), int(client[IVON_STEPS]))
        inputs, targets, loss_fn = prepared(data, model)
        device = module_device(model)
        n = inputs.shape[0]
        lengths = token_lengths(model, inputs)
        epoch_loss, steps = float("nan"), 0
        model.train()
        for epoch in range(train.epochs):
            total = 0.0
            for step, idx in enumerate(minibatches(n, train.batch_size, generator, lengths)):
                cancel.check()
                value = 0.0
                for _ in range(options.mc_samples):
                    with opt.sampled_params(train=True):
                        opt.zero_grad(set_to_none=True)
                        loss = loss_fn(model(to_device(inputs[idx], device)), to_device(targets[idx], device))
                        loss.backward()
                    value += loss.item() / options.mc_samples
                check_finite(value, epoch, step)
                opt.step()
                total += value * len(idx)
                steps += 1
            epoch_loss = total / n
        mean, precision = opt.get_posterior()
        if not (torch.isfinite(mean).all() and torch.isfinite(precision).all() and (precision > 0).all()):
            raise DivergenceError("IVON-ADMM client posterior is not finite and positive")
        message: Message = {}
        offset = 0
        for name, p in exchanged_parameters(model):
            size = p.numel()
            message[MEAN + name] = mean[offset : offset + size].reshape(p.shape).to(torch.float64, copy=True)
            message[PRECISION + name] = precision[offset : offset + size].reshape(p.shape).to(torch.float64, copy=True)
            offset += size
        distance = client_drift(take_prefix(server, MEAN), [message])  # as the round's drift counts it
        prior_std = options.prior_precision**-0.5  # smaller moves never count as running away
        guard = guard_runaway(client, distance, options.runaway_window, options.runaway_growth, prior_std)
        metrics = {
            "train_loss": epoch_loss,
            "steps": float(steps),
            "ess": scale / options.rho,
            "mean_precision": float(precision.double().mean()),
        }
        state = self.dual_step(server, client, message, options) | guard
        momentum, ivon_steps = opt.get_momentum()
        state[IVON_STEPS] = torch.tensor(float(ivon_steps), dtype=torch.float64, device=momentum.device)
        offset = 0
        for name, p in exchanged_parameters(model):
            size = p.numel()
            state[IVON_MOMENTUM + name] = momentum[offset : offset + size].reshape(p.shape).to(torch.float64, copy=True)
            offset += size
        return message, state, metrics

    def server_update(
        self,
        server: ServerState,
        messages: Mapping[int, Message],
        sizes: Mapping[int, int],
        num_clients: int,
        options: BayesADMMOptions,
    ) -> ServerState:
        """Dual sums from the messages, then the natural-parameter mix with α = 1/(1 + Kρ)."""
        if not messages:
            raise ValueError("a server update needs at least one message")
        alpha = options.server_step if options.server_step is not None else 1.0 / (1.0 + num_clients * options.rho)
        step = options.damping * options.rho
        count = len(messages)
        new = dict(server)
        for name, m_bar in take_prefix(server, MEAN).items():
            s_bar = server[PRECISION + name]
            eta_bar = pmul(s_bar, m_bar)
            sum_v, sum_V = server[DUAL_MEAN_SUM + name], server[DUAL_PREC_SUM + name]
            mean_s, mean_eta = torch.zeros_like(s_bar), torch.zeros_like(m_bar)
            for message in messages.values():
                s_k = message[PRECISION + name].to(torch.float64)
                eta_k = pmul(s_k, message[MEAN + name].to(torch.float64))
                sum_v = sum_v + step * (eta_k - eta_bar)
                sum_V = sum_V + step * (s_k - s_bar)
                mean_s = mean_s + s_k / count
                mean_eta = mean_eta + eta_k / count
            s0 = options.prior_precision * eye_like(s_bar, m_bar)
            s_new = (1.0 - alpha) * mean_s + alpha * (s0 + sum_V)
            eta_new = (1.0 - alpha) * mean_eta + alpha * (pmul(s0, server[PRIOR_MEAN + name]) + sum_v)
            new[PRECISION + name] = s_new
            new[MEAN + name] = psolve(s_new, eta_new)
            new[DUAL_MEAN_SUM + name] = sum_v
            new[DUAL_PREC_SUM + name] = sum_V
            variances = s_new if s_new.shape == m_bar.shape else torch.diagonal(s_new)  # diagonal or full S̄
            if not (torch.isfinite(s_new).all() and (variances > 0).all() and torch.isfinite(new[MEAN + name]).all()):
                raise DivergenceError(f"Bayes-ADMM server posterior of {name!r} is not finite and positive")
        new[SERVER_ROUNDS] = server[SERVER_ROUNDS] + 1
        return new

    def stability_warning(
        self, sizes: Sequence[int], train: LocalTraining, rounds: int, options: BayesADMMOptions
    ) -> str | None:
        """A warning when K·ρ is below the stable range for these clients: a parameter no data touches
        runs away within max(``rounds``, 200) rounds in the closed-form recursion of
        :mod:`~mergeflow.federated.flat_direction` (a necessary condition, not a sufficient one)."""
        horizon = max(rounds, STABILITY_HORIZON)
        steps = local_steps(sizes, train.epochs, train.batch_size)
        rho = min_stable_rho(sizes, steps, options, horizon)
        if rho == options.rho:
            return None
        k = len(sizes)
        return (
            f"K·ρ = {k * options.rho:.3g} is below IVON-ADMM's stable range for these {k} clients: a parameter "
            f"no data touches runs away within {horizon} rounds (mergeflow.federated.flat_direction); "
            f"rho >= {rho:.2g} (K·ρ >= {k * rho:.2g}) keeps it bounded, as can a smaller lr or hess_init"
        )

    def posterior(self, server: ServerState) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The global Gaussian q̄: (means m̄, diagonal precisions S̄) by parameter name."""
        return take_prefix(server, MEAN), take_prefix(server, PRECISION)

    def exact_client_update(
        self, server: ServerState, client: ClientState, problem: QuadraticProblem, options: BayesADMMOptions
    ) -> tuple[Message, ClientState, dict[str, float]]:
        """Exact Gaussian client: S_k = S̄ + (H_k/τ − V_k)/ρ, S_k m_k = S̄m̄ + (b_k/τ − v_k)/ρ."""
        s_bar, m_bar = server[PRECISION + THETA], server[MEAN + THETA]
        if s_bar.shape != problem.H.shape:
            raise ValueError("the precision layout differs from H's: run with full=True for a matrix H")
        tau, rho = options.temperature, options.rho
        s_k = s_bar + (problem.H / tau - client[DUAL_PREC + THETA]) / rho
        eta_k = pmul(s_bar, m_bar) + (problem.b / tau - client[DUAL_MEAN + THETA]) / rho
        m_k = psolve(s_k, eta_k)
        message = {MEAN + THETA: m_k, PRECISION + THETA: s_k}
        return message, self.dual_step(server, client, message, options), {"loss": problem.loss(m_k)}
