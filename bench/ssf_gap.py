"""SSF's test-loss gap to the exact merge's optimum against the number of optimisation steps.

Usage: python bench/ssf_gap.py [--case correlated_inputs] [--rates 0.2 0.5 1.0] [--steps 1000]
       python bench/ssf_gap.py --workspace results/pinwheel-workspace [--rates 0.3] [--steps 2000]

Without ``--workspace``: a case of ``experiments/linear_gaussian.yaml`` (test loss = test MSE).
With it: the clients, Fishers and factors a pipeline run left in that workspace (e.g. the last
point of ``mergeflow reproduce pinwheel``; test loss = test NLL), SSF options from
``experiments/pinwheel.yaml``. One SSF run per mask rate (``mergeflow.merge.ssf.ssf_iterates``, so the
cosine schedule spans ``--steps``); θ is scored at steps 1, 3, 10, 30, … of that run.

Besides the exact optimum θ* (the product of the Gaussians) it computes the optimum of SSF's
expected objective at a partial mask, to tell the noise of SSF's SGD from its bias. With the prior
correction per client (the default), each client's Gaussian less (K−1)/K of the prior is N(μ'_k, Λ'_k⁻¹),
Λ'_k = Λ_k − (K−1)/K·δI, and θ_CL = (Σ_k A'_k)⁻¹ Σ_k A'_k μ'_k with A'_k = E_M[Λ'_{:M} Λ'_MM⁻¹ Λ'_{M:}];
as printed (``--correction as_printed``), θ_CL = (Σ_k A_k − (K−1)δ(m/D)I)⁻¹ Σ_k A_k θ_k. The expectations are
exact over all masks when there are at most ``--max-masks``, else Monte Carlo over ``--mc-masks`` random ones.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from mergeflow.merge import run_merge
from mergeflow.merge.engine import ModelInputs, model_inputs
from mergeflow.merge.precision import client_precisions, prior_mean
from mergeflow.merge.ssf import ssf_iterates
from mergeflow.schema.merge import validate_options

Setting = tuple[ModelInputs, Callable[[torch.Tensor], float], dict, float]


def linear_gaussian(case: str) -> Setting:
    """Inputs, test MSE of a flat θ, SSF options and δ of one linear-Gaussian case."""
    from mergeflow.reproductions.linear_gaussian import LinearGaussianSettings, linear_gaussian_problem

    settings = LinearGaussianSettings.model_validate(
        yaml.safe_load(Path("experiments/linear_gaussian.yaml").read_text())[case]
    )
    problem = linear_gaussian_problem(**settings.model_dump(exclude={"ssf", "mask_rates"}))
    inputs = model_inputs(problem.states, weights=problem.sizes, fishers=problem.fishers, factors=problem.factors)
    X, t = (torch.from_numpy(a) for a in problem.test)

    def test_mse(theta: torch.Tensor) -> float:
        return float(((X @ theta[:-1] + theta[-1] - t) ** 2).mean())

    return inputs, test_mse, {**settings.ssf, "prior_precision": settings.prior_precision}, settings.prior_precision


def pinwheel_workspace(root: Path) -> Setting:
    """Inputs, test NLL of a flat θ, SSF options and δ from a pinwheel pipeline workspace."""
    from mergeflow.checkpoints import load_checkpoint
    from mergeflow.data.storage import load_dataset_file, to_arrays
    from mergeflow.models import build_from_spec, parameter_names

    _, meta = load_checkpoint(root / "models/base/base.safetensors")
    order = parameter_names(meta["spec"])
    paths = sorted((root / "models/clients").glob("client_*.safetensors"))
    loaded = [load_checkpoint(p) for p in paths]
    fishers = [load_file(root / "models/fishers" / p.name) for p in paths]
    factors = [
        load_file(root / "models/fishers" / p.name.replace(".safetensors", ".factors.safetensors"))["U"] for p in paths
    ]
    inputs = model_inputs(
        [s for s, _ in loaded],
        weights=[m["num_examples"] for _, m in loaded],
        fishers=[{n: f[n] for n in order} for f in fishers],
        factors=factors,
    )
    info = json.loads((root / "data/prepared/info.json").read_text())
    X, y = (torch.tensor(a) for a in to_arrays(load_dataset_file(root / "data/prepared/test.parquet"), info))
    model = build_from_spec(meta["spec"]).eval()

    def test_nll(theta: torch.Tensor) -> float:
        state = {k: v.to(torch.float32) for k, v in inputs.unflatten(theta).items()}
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(torch.func.functional_call(model, state, (X,)), y))

    options = yaml.safe_load(Path("experiments/pinwheel.yaml").read_text())["params"]["merge"]["options"]["ssf_30"]
    options = {k: v for k, v in options.items() if k not in ("method", "mask_rate")}
    return inputs, test_nll, options, options["prior_precision"]


def composite_optimum(
    inputs: ModelInputs, delta: float, masked: int, max_masks: int, mc_masks: int, correction: str, seed: int = 0
) -> torch.Tensor:
    """θ_CL, the minimiser of SSF's objective averaged over masks of ``masked`` coordinates (window = D)."""
    clients = client_precisions(inputs, by_size=True)
    dim, count = len(clients[0].theta), len(clients)
    if math.comb(dim, masked) <= max_masks:
        masks = torch.tensor(list(itertools.combinations(range(dim), masked)))
    else:
        g = torch.Generator().manual_seed(seed)
        masks = torch.stack([torch.randperm(dim, generator=g)[:masked] for _ in range(mc_masks)])
    theta0 = prior_mean(inputs, "auto")
    printed = correction == "as_printed"
    removed = 0.0 if printed else (count - 1) / count * delta  # the prior taken out of each client's Gaussian
    system = -(count - 1) * delta * masked / dim * torch.eye(dim, dtype=torch.float64) if printed else 0.0
    rhs = torch.zeros(dim, dtype=torch.float64)
    for c in clients:
        u = c.factors.to(torch.float64) * c.factor_scale**0.5
        precision = u.T @ u + torch.diag(c.diagonal + delta - removed)
        mean = torch.linalg.solve(precision, precision @ c.theta + removed * (c.theta - theta0))  # μ'_k
        a = torch.zeros(dim, dim, dtype=torch.float64)
        for chunk in torch.split(masks, max(1, min(4096, 2**24 // dim**2))):
            rows = precision[chunk]  # (J, m, D): Λ_{M:}
            block = torch.gather(rows, 2, chunk[:, None, :].expand(-1, masked, -1))  # Λ_MM
            a += (rows.transpose(1, 2) @ torch.linalg.solve(block, rows)).sum(0)
        a /= len(masks)
        system = system + a
        rhs += a @ mean
    return torch.linalg.solve(system, rhs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="correlated_inputs")
    parser.add_argument("--workspace", type=Path)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.5, 1.0])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--max-masks", type=int, default=400_000)
    parser.add_argument("--mc-masks", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--correction", choices=["per_client", "as_printed"], default="per_client")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    inputs, test_loss, ssf_options, delta = (
        pinwheel_workspace(args.workspace) if args.workspace else linear_gaussian(args.case)
    )
    if args.steps:
        ssf_options["steps"] = args.steps
    assert ssf_options.get("window") is None, "θ_CL assumes masks over the whole model (window: null)"
    exact = run_merge(
        "exact",
        inputs.states,
        weights=inputs.sizes,
        fishers=inputs.fishers,
        factors=inputs.factors,
        prior_precision=delta,
    )
    theta_star = inputs.flatten(exact.state)
    loss_star = test_loss(theta_star)
    dim = len(theta_star)

    def distance(theta: torch.Tensor, reference: torch.Tensor) -> float:
        return float((theta - reference).norm() / reference.norm())

    setting = f"pinwheel workspace {args.workspace}" if args.workspace else f"linear-Gaussian {args.case}"
    print(f"{setting}: D = {dim}, K = {len(inputs.states)}, exact test loss {loss_star:.6f}")
    print(f"SSF options: {ssf_options}\n")
    baselines = {
        "average (isotropic)": run_merge("average", inputs.states),
        "fisher (diagonal)": run_merge("fisher", inputs.states, weights=inputs.sizes, fishers=inputs.fishers),
    }
    for name, result in baselines.items():
        theta = inputs.flatten(result.state)
        gap = test_loss(theta) - loss_star
        print(f"{name}: test-loss gap {gap:+.2e}, ‖θ − θ*‖/‖θ*‖ {distance(theta, theta_star):.2e}")
    checkpoints = {n for n in (10**e * f for e in range(6) for f in (1, 3)) if n < ssf_options["steps"]}
    checkpoints.add(ssf_options["steps"])
    for rate in args.rates:
        options = validate_options("ssf", {**ssf_options, "mask_rate": rate, "prior_correction": args.correction})
        masked = max(1, round(rate * dim))
        theta_cl = composite_optimum(inputs, delta, masked, args.max_masks, args.mc_masks, args.correction)
        print(
            f"\n### mask rate {rate:.0%} (m = {masked} of {dim})\n\n"
            f"θ_CL (mask-averaged SSF optimum): test-loss gap {test_loss(theta_cl) - loss_star:+.2e}, "
            f"‖θ_CL − θ*‖/‖θ*‖ {distance(theta_cl, theta_star):.2e}\n"
        )
        print("| step | test-loss gap to θ* | ‖θ − θ*‖/‖θ*‖ | ‖θ − θ_CL‖/‖θ_CL‖ |\n|---:|---:|---:|---:|")
        for step, (theta, _) in enumerate(ssf_iterates(inputs, options), start=1):
            if step in checkpoints:
                gap = test_loss(theta) - loss_star
                print(f"| {step} | {gap:+.2e} | {distance(theta, theta_star):.2e} | {distance(theta, theta_cl):.2e} |")


if __name__ == "__main__":
    main()
