"""Transformers on WordNet glosses: mergeflow's training step and Fisher against plain loops, side by side.

Usage: python bench/text_speed.py [--examples 4000] [--repeats 3]   (needs a WordNet database)

The model is the text preset's (experiments/text.yaml): BERT, 2 layers, hidden 128, 4 heads,
a byte-level BPE vocabulary of 4000 trained on the glosses, max_length 32.

- Fine-tuning throughput (non-padding tokens per second) of one epoch, batch 32, Adam:
  ``mergeflow.training.train`` (the client step: length-bucketed batches, each trimmed to its
  longest text, the 4-D mask built by the wrapper) against a plain transformers loop over the
  same batches in the same order (``input_ids`` and a 2-D ``attention_mask``), and against a
  plain loop over shuffled batches padded to max_length (what bucketing saves).
- Diagonal empirical Fisher over 256 glosses: ``torch.func`` vmap (mergeflow: chunks of
  length-sorted glosses, each at its own longest) against a per-example backward loop, and
  their largest difference relative to the largest Fisher entry.

Each timing is the best of ``--repeats``, with 2 torch threads (CI's machine size).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from fisher_speed import best_of, loop_fisher  # bench/ is the script's folder

from mergeflow.data.storage import to_arrays
from mergeflow.data.tokenize import encode_dataset, train_tokenizer, training_texts
from mergeflow.data.wordnet import load_wordnet_source
from mergeflow.fisher import diagonal_fisher
from mergeflow.models.hf import build_base
from mergeflow.training import minibatches, token_lengths, train

CONFIG = {"model_type": "bert", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 256}  # fmt: skip
MAX_LENGTH = 32
BATCH = 32


def fresh_model(num_labels: int, vocab: int):
    """The preset's model, seeded (every timed run starts from the same weights)."""
    return build_base(
        pretrained=None,
        config=CONFIG,
        num_labels=num_labels,
        vocab_size=vocab,
        max_length=MAX_LENGTH,
        pad_token_id=0,
        sep_token_id=None,
        dropout=0.0,
        seed=0,
    )[0]


def plain_epoch(model, X: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor], trim: bool) -> None:
    """A plain transformers loop: ``input_ids`` + 2-D ``attention_mask``, Adam, one pass over ``batches``."""
    hf = model.model
    hf.train()
    opt = torch.optim.Adam(hf.parameters(), lr=5e-4)
    for idx in batches:
        ids = X[idx]
        if trim:
            ids = ids[:, : int((ids != 0).sum(1).max())]
        loss = torch.nn.functional.cross_entropy(hf(input_ids=ids, attention_mask=(ids != 0).long()).logits, y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    ds, info = load_wordnet_source(max_examples=args.examples)
    tokenizer = train_tokenizer(training_texts(ds), vocab_size=4000)
    X_np, y_np = to_arrays(encode_dataset(ds, tokenizer, MAX_LENGTH), {"input_shape": [MAX_LENGTH], "task": "x"})
    X, y = torch.tensor(X_np), torch.tensor(y_np, dtype=torch.long)
    classes, vocab = info["num_classes"], len(tokenizer)
    tokens = int((X != 0).sum())
    print(f"{len(X)} glosses, {classes} classes, {tokens} tokens ({tokens / len(X):.1f} per gloss), vocab {vocab}")

    def ours() -> None:
        train(fresh_model(classes, vocab), X, y, task="classification", epochs=1, lr=5e-4, optimizer="adam",
              batch_size=BATCH, seed=0)  # fmt: skip

    model = fresh_model(classes, vocab)
    bucketed = list(minibatches(len(X), BATCH, torch.Generator().manual_seed(0), token_lengths(model, X)))
    shuffled = list(minibatches(len(X), BATCH, torch.Generator().manual_seed(0)))
    timings = {
        "mergeflow train() (bucketed, trimmed)": best_of(args.repeats, ours),
        "plain loop, same batches": best_of(
            args.repeats, lambda: plain_epoch(fresh_model(classes, vocab), X, y, bucketed, True)
        ),
        "plain loop, shuffled, padded to max_length": best_of(
            args.repeats, lambda: plain_epoch(fresh_model(classes, vocab), X, y, shuffled, False)
        ),
    }
    reference = timings["plain loop, same batches"]
    print("\n| one epoch | seconds | tokens/s | time / plain loop on the same batches |\n|---|---|---|---|")
    for name, seconds in timings.items():
        print(f"| {name} | {seconds:.2f} | {tokens / seconds:,.0f} | {seconds / reference:.2f} |")

    model.eval()
    Xf, yf = X[:256], y[:256]
    vmapped = best_of(args.repeats, lambda: diagonal_fisher(model, Xf, yf, kind="empirical", batch_size=64,
                                                            backend="functorch"))  # fmt: skip
    looped = best_of(args.repeats, lambda: loop_fisher(model, Xf, yf))
    ours_f = diagonal_fisher(model, Xf, yf, kind="empirical", batch_size=64, backend="functorch")
    theirs = loop_fisher(model, Xf, yf)
    scale = max(float(t.abs().max()) for t in theirs.values())
    error = max(float((ours_f[n] - t).abs().max()) for n, t in theirs.items()) / scale
    params = sum(p.numel() for p in model.parameters())
    print(f"\n| Fisher, 256 glosses, {params:,} parameters | seconds | speed-up |\n|---|---|---|")
    print(f"| per-example loop | {looped:.2f} | 1.0 |")
    print(f"| torch.func vmap (mergeflow, chunks of 64) | {vmapped:.2f} | {looped / vmapped:.1f} |")
    print(f"\nlargest difference, relative to the largest Fisher entry: {error:.1e}")
    np.testing.assert_array_less(error, 1e-4)


if __name__ == "__main__":
    main()
