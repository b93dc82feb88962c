"""Every tensor-scope merge method over K synthetic GPT-2-sized states held in memory on a device, against
the CPU for the methods named in ``--cpu-methods``.

Usage: python bench/gpu_merges.py [--device auto] [--models 4] [--scale 1.0] [--methods ties,dare_ties]
                                  [--cpu-methods average,ties,dare_ties] [--repeats 3]

The states have GPT-2 124M's tensors (wte 50257×768, wpe 1024×768, 12 blocks of c_attn 768×2304,
attn.c_proj 768×768, mlp.c_fc 768×3072, mlp.c_proj 3072×768, LayerNorms and biases, ln_f), float32: a base
N(0, 0.02²) and per client the base plus N(0, 0.001²) noise, drawn on the device with a seeded generator.
``--scale`` multiplies every width and the vocabulary and context (0.02 runs in seconds on a CPU). A method
merges as many models as its declaration allows (SLERP: exactly 2). Each merge is timed from device tensors
to device tensors (synchronised before each clock read), best of ``--repeats`` after one warm-up (``timed``
of bench/gpu_exact.py); the CPU once after a warm-up. A method with a ``seed`` option (DARE, DELLA) draws on
the device, so its merge differs from the CPU's by design: for those the bench checks that the same seed
gives the same merge twice on the device. For the others it prints the largest relative difference (L2,
over tensors) to the CPU's merge. Target (issue 32): TIES and DARE ≤ 0.2 s on an H100 at K = 4, scale 1.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from gpu_exact import timed  # bench/ is the script's folder

from mergeflow.device import device_name, resolve_device
from mergeflow.merge import METHODS, run_merge
from mergeflow.schema.merge import DECLARED

State = dict[str, torch.Tensor]


def gpt2_shapes(scale: float = 1.0) -> dict[str, tuple[int, ...]]:
    """GPT-2 124M's parameter shapes (its Conv1D weights are (in, out)), widths scaled by ``scale``."""
    width, vocab, context = (max(1, round(n * scale)) for n in (768, 50257, 1024))
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, width), "wpe.weight": (context, width)}
    for layer in range(12):
        block = f"h.{layer}."
        for norm in ("ln_1", "ln_2"):
            shapes |= {f"{block}{norm}.weight": (width,), f"{block}{norm}.bias": (width,)}
        for name, fan_in, fan_out in (
            ("attn.c_attn", width, 3 * width),
            ("attn.c_proj", width, width),
            ("mlp.c_fc", width, 4 * width),
            ("mlp.c_proj", 4 * width, width),
        ):
            shapes |= {f"{block}{name}.weight": (fan_in, fan_out), f"{block}{name}.bias": (fan_out,)}
    return shapes | {"ln_f.weight": (width,), "ln_f.bias": (width,)}


def synthetic_states(
    shapes: dict[str, tuple[int, ...]], models: int, device: torch.device, seed: int = 0
) -> tuple[State, list[State]]:
    """A base state and ``models`` clients (base plus small noise), float32 on ``device``."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device).mul_(std)

    base = {name: normal(shape, 0.02) for name, shape in shapes.items()}
    clients = [{name: value + normal(value.shape, 1e-3) for name, value in base.items()} for _ in range(models)]
    return base, clients


def positive_like(states: list[State], seed: int = 1) -> list[State]:
    """Positive diagonal Fishers shaped like ``states``, on their device (for ``fisher``)."""
    first = next(iter(states[0].values()))
    generator = torch.Generator(device=first.device).manual_seed(seed)
    return [
        {name: torch.rand(v.shape, generator=generator, device=v.device).add_(0.1) for name, v in s.items()}
        for s in states
    ]


def model_count(method: str, wanted: int) -> int:
    """``wanted`` clamped to what the method's declaration allows it to merge."""
    least, most = DECLARED[method].models
    return max(least, wanted if most is None else min(wanted, most))


def draws_on_device(method: str) -> bool:
    """Whether the method draws at random (a ``seed`` option): its draws are the device's own."""
    return "seed" in METHODS[method].Options.model_fields


def largest_relative_difference(merged: State, reference: State) -> float:
    """max over tensors of ‖merged − reference‖ / ‖reference‖ (merged moved to the reference's device)."""
    worst = 0.0
    for name, ref in reference.items():
        diff = (merged[name].to(ref.device, torch.float64) - ref.double()).norm()
        worst = max(worst, float(diff / ref.double().norm().clamp_min(1e-300)))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of GPT-2's widths, vocabulary, context")
    parser.add_argument("--methods", default="", help="comma-separated (default: every tensor-scope method)")
    parser.add_argument("--cpu-methods", default="average,ties,dare_ties", help="also timed on the CPU")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tensor_methods = sorted(name for name, declaration in METHODS.items() if declaration.scope == "tensor")
    methods = [m for m in args.methods.split(",") if m] or tensor_methods
    unknown = sorted(set(methods) - set(tensor_methods))
    if unknown:
        parser.error(f"--methods: {', '.join(unknown)} not tensor-scope methods; known: {', '.join(tensor_methods)}")
    cpu_methods = {m for m in args.cpu_methods.split(",") if m}
    device, cpu = resolve_device(args.device), torch.device("cpu")

    print(f"device: {device} ({device_name(device)}), torch {torch.__version__}")
    shapes = gpt2_shapes(args.scale)
    base, clients = synthetic_states(shapes, args.models, device)
    fishers = positive_like(clients) if "fisher" in methods else None
    sizes = [float(k + 1) for k in range(args.models)]
    size = sum(v.numel() for v in base.values())
    print(f"{len(shapes)} tensors, {size:,} parameters a model (GPT-2 124M x {args.scale}), float32, K = {args.models}")
    compare = device.type != "cpu" and bool(cpu_methods & set(methods))
    on_cpu = (
        ({k: v.cpu() for k, v in base.items()}, [{k: v.cpu() for k, v in s.items()} for s in clients])
        if compare
        else None
    )
    cpu_fishers = [{k: v.cpu() for k, v in f.items()} for f in fishers] if compare and fishers else None

    def merge(method: str, where: torch.device) -> Callable[[], State]:
        count = model_count(method, args.models)
        b, states, fish = (base, clients, fishers) if where == device else (on_cpu[0], on_cpu[1], cpu_fishers)
        inputs = {"states": states[:count], "weights": sizes[:count]}
        declaration = METHODS[method]
        if "base" in declaration.uses:
            inputs["base"] = b
        if "fishers" in declaration.uses:
            inputs["fishers"] = fish[:count]
        return lambda: run_merge(method, **inputs).state

    print(f"{'method':<18}{'K':>3}{device.type:>10}{'cpu':>10}{'ratio':>8}  check")
    for method in methods:
        seconds, merged = timed(merge(method, device), device, args.repeats)
        cpu_seconds, check = None, ""
        if draws_on_device(method):
            again = merge(method, device)()
            same = all(torch.equal(merged[k], again[k]) for k in merged)
            check = f"same seed, same merge on {device.type}: {'yes' if same else 'NO'}"
            del again
        if compare and method in cpu_methods:
            cpu_seconds, cpu_merged = timed(merge(method, cpu), cpu, 1)
            if not draws_on_device(method):
                check = f"largest relative difference to the cpu: {largest_relative_difference(merged, cpu_merged):.1e}"
            del cpu_merged
        del merged
        cpu_text, ratio = ("", "") if cpu_seconds is None else (f"{cpu_seconds:.3f}", f"{cpu_seconds / seconds:.1f}x")
        print(f"{method:<18}{model_count(method, args.models):>3}{seconds:>10.3f}{cpu_text:>10}{ratio:>8}  {check}")
    print(f"seconds: best of {args.repeats} on {device_name(device)}; cpu ({torch.get_num_threads()} threads) once")


if __name__ == "__main__":
    main()
