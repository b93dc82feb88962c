"""Small GPT-2 checkpoints for the benches that compare mergeflow with a peer on shared files."""

from __future__ import annotations

from pathlib import Path

import torch


def noisy_gpt2s(directory: Path, count: int, noise: float, *, save_base: bool = False, **config: int) -> list[str]:
    """``count`` float32 GPT-2 directories ``model_k`` (one file each): a random model (``torch`` seed 0,
    ``GPT2Config(**config)``) plus independent Gaussian noise of scale ``noise`` (seed k + 1); the model
    itself in ``base`` too with ``save_base``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0, **config))
    if save_base:
        model.save_pretrained(directory / "base")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    paths = []
    for k in range(count):
        generator = torch.Generator().manual_seed(k + 1)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(state[name] + noise * torch.randn(parameter.shape, generator=generator))
        model.save_pretrained(directory / f"model_{k}")
        paths.append(str(directory / f"model_{k}"))
    return paths
