"""IVON with a Gaussian prior of any mean and diagonal precision, plus a Gaussian "dual" factor.

:class:`IVONWithPrior` subclasses ``ivon.IVON`` (ivon-opt). Its variational objective, with q =
N(m, diag(1/σ²)) and the mean mini-batch loss ℓ̄, is (per example, i.e. divided by ``ess``)

    E_q[ℓ̄(θ) − dual_meanᵀθ + ½ θᵀdiag(dual_prec)θ] + KL(q ‖ N(prior_mean, diag(prior_prec)⁻¹)) / ess,

so (dual_mean, dual_prec) are the natural parameters of an extra Gaussian factor multiplied into
the prior (negative values divide one out). With wd = prior_prec / ess (a vector) one step is

- sample θ = m + ε, ε ~ N(0, 1/(ess·(h + wd))), using the optimizer's own ``torch.Generator``;
- ĝ = ∇ℓ̄(θ), Hessian estimate ĥ (Price: avg(ε⊙ĝ)·(h + wd)·ess), momentum g ← β1 g + (1 − β1)ĝ;
- Hessian target f = ĥ + dual_prec; h ← β2 h + (1 − β2) f + ½(1 − β2)²(h − f)²/(h + wd), which
  keeps h + wd > 0 for any target;
- m ← m − lr·clip((g/(1 − β1ᵗ) − dual_mean + dual_prec⊙m + wd⊙(m − prior_mean)) / (h + wd)).

The posterior precision is ess·(h + wd). With zero duals, a zero prior mean and a constant prior
precision δ·ess this is plain ``ivon.IVON`` with ``weight_decay=δ`` (and ``rescale_lr=False``).
Unlike plain IVON, ``hess_init`` may be 0, and ``rescale_lr`` defaults to False. One parameter
group only (the prior and duals are flat vectors over all parameters in group order).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import ivon
import torch
from torch import Tensor, nn


class IVONWithPrior(ivon.IVON):
    """``ivon.IVON`` with a prior mean, a vector prior precision and dual terms (see the module doc)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        ess: float,
        *,
        generator: torch.Generator,
        prior_precision: float | Tensor = 1.0,
        prior_mean: Tensor | None = None,
        dual_mean: Tensor | None = None,
        dual_precision: Tensor | None = None,
        hess_init: float = 1.0,
        beta1: float = 0.9,
        beta2: float = 0.99999,
        mc_samples: int = 1,
        hess_approx: str = "price",
        clip_radius: float = math.inf,
        debias: bool = True,
        rescale_lr: bool = False,
    ) -> None:
        """Args as ``ivon.IVON`` except: ``generator`` draws all weight noise; ``prior_precision``
        (scalar or flat vector, > 0) and ``prior_mean`` replace ``weight_decay``; ``dual_mean`` and
        ``dual_precision`` are flat vectors (zeros by default); ``hess_init`` may be 0."""
        if not isinstance(generator, torch.Generator):
            raise TypeError("IVONWithPrior needs an explicit torch.Generator")
        if hess_init < 0:
            raise ValueError(f"Invalid Hessian initialization: {hess_init}")
        super().__init__(
            params,
            lr=lr,
            ess=ess,
            hess_init=hess_init if hess_init > 0 else 1.0,
            beta1=beta1,
            beta2=beta2,
            weight_decay=0.0,
            mc_samples=mc_samples,
            hess_approx=hess_approx,
            clip_radius=clip_radius,
            sync=False,
            debias=debias,
            rescale_lr=rescale_lr,
        )
        if len(self.param_groups) != 1:
            raise ValueError("IVONWithPrior supports exactly one parameter group")
        self.generator = generator
        group = self.param_groups[0]
        group["hess_init"] = float(hess_init)
        group["hess"] = self._flat(hess_init)
        self.set_prior(prior_mean if prior_mean is not None else 0.0, prior_precision)
        self.set_dual(
            dual_mean if dual_mean is not None else 0.0, dual_precision if dual_precision is not None else 0.0
        )

    # --------------------------------------------------------------------------- accessors

    def _init_buffers(self) -> None:
        # ivon's adds a CPU scalar tensor to its buffers; these are made where the parameters are.
        for group in self.param_groups:
            group["momentum"] = torch.zeros(group["numel"], device=self._device, dtype=self._dtype)
            group["hess"] = torch.full(
                (group["numel"],), float(group["hess_init"]), device=self._device, dtype=self._dtype
            )

    def _flat(self, value: float | Tensor) -> Tensor:
        """A flat vector over all parameters (a scalar is broadcast) in the parameters' dtype."""
        out = torch.zeros(self._numel, device=self._device, dtype=self._dtype)
        if isinstance(value, Tensor) and value.numel() != 1:
            if value.numel() != self._numel:
                raise ValueError(f"expected {self._numel} values, got {value.numel()}")
            return out.copy_(value.reshape(-1))
        return out.fill_(float(value))

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.param_groups[0]["params"] if p is not None]

    def set_prior(self, mean: float | Tensor, precision: float | Tensor) -> None:
        """Set the prior N(mean, diag(precision)⁻¹); ``weight_decay`` becomes precision / ess."""
        group = self.param_groups[0]
        prec = self._flat(precision)
        if not bool((prec > 0).all()):
            raise ValueError("the prior precision must be positive")
        group["prior_mean"] = self._flat(mean)
        group["weight_decay"] = prec / group["ess"]

    def set_dual(self, mean: float | Tensor, precision: float | Tensor) -> None:
        """Set the dual factor's natural parameters (per example, i.e. already divided by ess)."""
        group = self.param_groups[0]
        group["dual_mean"] = self._flat(mean)
        group["dual_prec"] = self._flat(precision)

    def get_prior(self) -> tuple[Tensor, Tensor]:
        """(prior mean, prior precision) as flat vectors."""
        group = self.param_groups[0]
        return group["prior_mean"].clone(), group["weight_decay"] * group["ess"]

    @torch.no_grad()
    def get_posterior(self) -> tuple[Tensor, Tensor]:
        """(mean m, precision ess·(h + wd)) of q as flat vectors (call outside ``sampled_params``)."""
        group = self.param_groups[0]
        mean = torch.cat([p.detach().reshape(-1) for p in self._params()])
        return mean, group["ess"] * (group["hess"] + group["weight_decay"])

    @torch.no_grad()
    def set_posterior(self, mean: Tensor, precision: float | Tensor) -> None:
        """Set q = N(mean, diag(precision)⁻¹): the parameters to ``mean``, h = precision/ess − wd."""
        group = self.param_groups[0]
        flat = self._flat(mean)
        offset = 0
        for p in self._params():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        group["hess"] = self._flat(precision) / group["ess"] - group["weight_decay"]

    def get_momentum(self) -> tuple[Tensor, int]:
        """(gradient momentum as a flat vector, number of steps taken): the state that debiases it."""
        return self.param_groups[0]["momentum"].clone(), self.current_step

    def set_momentum(self, momentum: Tensor, steps: int) -> None:
        """Restore the momentum and step count of an earlier optimizer (e.g. a client's last round)."""
        self.param_groups[0]["momentum"] = self._flat(momentum)
        self.current_step = int(steps)

    # --------------------------------------------------------------------------- the algorithm

    def _sample_params(self) -> tuple[Tensor, Tensor]:
        """θ = m + ε with ε ~ N(0, 1/(ess·(h + wd))) drawn from ``self.generator``."""
        group = self.param_groups[0]
        noise = (
            # drawn where the generator is (the CPU: the same draws on every device), then moved
            torch.randn(self._numel, generator=self.generator, device=self.generator.device, dtype=self._dtype).to(
                self._device
            )
            / (group["ess"] * (group["hess"] + group["weight_decay"])).sqrt()
        )
        means = []
        offset = 0
        for p in self._params():
            flat = p.data.flatten()
            means.append(flat)
            p.data = (flat + noise[offset : offset + p.numel()]).view(p.shape)
            offset += p.numel()
        return torch.cat(means, 0), noise

    def _update(self) -> None:
        self.current_step += 1
        group = self.param_groups[0]
        b1, b2, ess = group["beta1"], group["beta2"], group["ess"]
        wd, hess = group["weight_decay"], group["hess"]
        mean = torch.cat([p.detach().reshape(-1) for p in self._params()], 0)

        group["momentum"] = self._new_momentum(self.state["avg_grad"], group["momentum"], b1)

        everything = slice(0, self._numel)
        nll_hess = self._get_nll_hess(
            self.hess_approx, hess + wd, self.state["avg_nxg"], self.state["avg_gsq"], everything
        )
        target = nll_hess * ess + group["dual_prec"]
        hess = b2 * hess + (1.0 - b2) * target + (0.5 * (1 - b2) ** 2) * (hess - target).square() / (hess + wd)
        group["hess"] = hess

        debias = 1.0 - math.pow(b1, float(self.current_step)) if self.debias else 1.0
        lr = group["lr"] * (group["hess_init"] + wd) if self.rescale_lr else group["lr"]
        direction = (
            group["momentum"] / debias
            - group["dual_mean"]
            + group["dual_prec"] * mean
            + wd * (mean - group["prior_mean"])
        )
        new_mean = mean - lr * torch.clip(direction / (hess + wd), min=-group["clip_radius"], max=group["clip_radius"])

        offset = 0
        for p in self._params():
            p.data = new_mean[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
