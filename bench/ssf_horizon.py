"""SSF (Adam, 20% masks, δ = 100, random start) at 5× the pinwheel table's 5000 steps, on the clients of a
pinwheel_paper workspace: the loss and the validation/test NLL along the way (docs/results.md, issue 50), with
the prior correction per client (bounded) and as Eq. 7 prints it (unbounded below from K = 3).

Usage: python bench/ssf_horizon.py [WORKSPACE] [K] [STEPS] [CORRECTION...]   (default
results/pinwheel_paper-workspace, whose last run is K = 5, seed 2, after
`mergeflow reproduce pinwheel --preset experiments/pinwheel_paper.yaml`; 25000 steps; both corrections)
"""

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from mergeflow.checkpoints import load_checkpoint
from mergeflow.merge.engine import model_inputs
from mergeflow.merge.ssf import ssf_iterates
from mergeflow.models import build_from_spec, parameter_names
from mergeflow.schema.merge import SSFOptions
from mergeflow.training import predict
from tasks.prepared import read_arrays

torch.set_num_threads(2)
ws = Path(sys.argv[1] if len(sys.argv) > 1 else "results/pinwheel_paper-workspace")
K = int(sys.argv[2]) if len(sys.argv) > 2 else 5
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 25000
CORRECTIONS = sys.argv[4:] or ["per_client", "as_printed"]
info = json.loads((ws / "data/prepared/info.json").read_text())
splits = {s: read_arrays(ws / f"data/prepared/{s}.parquet", info) for s in ("validation", "test")}
base, bmeta = load_checkpoint(ws / "models/base/base.safetensors")
spec = bmeta["spec"]
order = parameter_names(spec)
states = [load_checkpoint(ws / f"models/aligned/client_{c:03d}.safetensors")[0] for c in range(K)]
fishers = [
    {n: f[n] for n in order}
    for f in (load_file(ws / f"models/aligned/client_{c:03d}.fisher.safetensors") for c in range(K))
]
factors = [load_file(ws / f"models/aligned/client_{c:03d}.factors.safetensors")["U"] for c in range(K)]
x = model_inputs(states, base=base, weights=[350.0] * K, fishers=fishers, factors=factors)


def nll(theta):
    model = build_from_spec(spec)
    model.load_state_dict({**base, **x.unflatten(theta)})
    return {
        s: round(float(torch.nn.functional.cross_entropy(torch.tensor(predict(model, X)), torch.tensor(y).long())), 4)
        for s, (X, y) in splits.items()
    }


for correction in CORRECTIONS:
    opts = SSFOptions(
        mask_rate=0.2,
        masks_per_step=20,
        steps=STEPS,
        window=None,
        optimizer="adam",
        lr=0.01,
        schedule="cosine",
        start="random",
        prior_precision=100,
        prior_correction=correction,
    )
    t = time.time()
    print(correction, flush=True)
    for step, (theta, loss) in enumerate(ssf_iterates(x, opts), 1):
        if step in (100, 1000, 2500, 5000, 10000, 15000, 20000, 25000) or step == STEPS:
            print(step, round(loss, 4), nll(theta), f"{time.time() - t:.0f}s", flush=True)
