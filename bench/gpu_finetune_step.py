"""A fine-tuning epoch through ``mergeflow.training.train`` against a plain PyTorch loop, on one device.

Usage: python bench/gpu_finetune_step.py [--device auto] [--layers 4] [--hidden 256] [--examples 4096]
                                         [--length 128] [--batch 32] [--precision fp32] [--repeats 3]

A BERT classifier from config (transformers), random token ids with random lengths (padding at the
right). Both run the same batches in the same order with Adam: mergeflow's train (data on the CPU,
each batch moved pinned and non-blocking, trimmed to its longest text, the loss read every step for
the divergence check, autocast under ``--precision``) and a plain loop over device-resident batches at
full length (``input_ids``, ``attention_mask``). Printed: each one's seconds per epoch (best of
``--repeats``, synchronised) and their ratio. Target (issue 32): mergeflow ≤ 1.2x the plain loop on a GPU.
Tiny sizes run on the CPU: ``--layers 1 --hidden 64 --examples 256 --length 32``.
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification

from mergeflow.device import autocast, device_name, resolve_device
from mergeflow.models.token_model import TokenModel
from mergeflow.training import minibatches, train

PAD = 0


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_epoch(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, batches, precision: str) -> None:
    """One epoch of the plain loop over device-resident batches."""
    device = ids.device
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()
    for idx in batches:
        batch = ids[idx.to(device)]
        with autocast(device, precision):
            logits = model(input_ids=batch, attention_mask=(batch != PAD).long()).logits
            loss = F.cross_entropy(logits, labels[idx.to(device)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--examples", type=int, default=4096)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = resolve_device(args.device)
    config = BertConfig(
        vocab_size=4000,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.length,
        num_labels=4,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    template = BertForSequenceClassification(config)
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.length // 4, args.length + 1, args.examples)
    ids = rng.integers(1, 4000, (args.examples, args.length))
    ids[np.arange(args.length)[None, :] >= lengths[:, None]] = PAD
    labels = rng.integers(0, 4, args.examples)

    def ours() -> None:
        model = TokenModel(copy.deepcopy(template), PAD).to(device)
        train(model, ids, labels, task="classification", epochs=1, lr=1e-4, optimizer="adam",
              batch_size=args.batch, precision=args.precision)  # fmt: skip

    device_ids, device_labels = torch.as_tensor(ids, device=device), torch.as_tensor(labels, device=device)
    order = list(minibatches(args.examples, args.batch, torch.Generator().manual_seed(0)))

    def plain() -> None:
        plain_epoch(copy.deepcopy(template).to(device), device_ids, device_labels, order, args.precision)

    print(f"device: {device} ({device_name(device)}), torch {torch.__version__}, precision {args.precision}")
    print(f"BERT {args.layers} layers, hidden {args.hidden}; {args.examples} texts of up to {args.length} tokens")
    results = {}
    for name, run in (("mergeflow train", ours), ("plain loop", plain)):
        run()  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            synchronise(device)
            started = time.perf_counter()
            run()
            synchronise(device)
            best = min(best, time.perf_counter() - started)
        results[name] = best
        print(f"  {name:<16} {best:.3f} s per epoch")
    print(f"  ratio: {results['mergeflow train'] / results['plain loop']:.2f}x")


if __name__ == "__main__":
    main()
