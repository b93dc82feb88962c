#!/usr/bin/env bash
# Every GPU check and benchmark of issue 32 in one go, for a short lease of a GPU machine:
#   bash bench/gpu_all.sh [OUTPUT_DIR]        (default gpu-results/)
#   PARTS="suite cpu_streaming" bash bench/gpu_all.sh [OUTPUT_DIR]   (only the parts named)
# Each part has its own time limit and its own log in OUTPUT_DIR, so one that hangs or fails costs only
# itself. Wheels the machine lacks (pydantic, ivon-opt, BackPACK, ...) are installed first from .whl/ when
# that folder exists, and its .tar.xz files (site-packages too large as wheels: numba and llvmlite) are unpacked
# beside them (see docs/benchmarks.md for how it is filled). Record the logs in docs/benchmarks.md.
set -u
out=${1:-gpu-results}
mkdir -p "$out"
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    for packed in .whl/*.tar.xz; do [ -e "$packed" ] && tar -xJf "$packed" -C /tmp/site; done
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/env.log" 2>&1
python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|peft|pyarrow|numpy|scipy|datasets|pydantic) " >>"$out/env.log"
python3 -c "import numba; print('numba', numba.__version__)" >>"$out/env.log" 2>&1

part() {  # part NAME SECONDS COMMAND...: run with a limit, log to OUTPUT_DIR/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    if [ -n "${PARTS:-}" ] && [[ " $PARTS " != *" $name "* ]]; then return; fi
    local started=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - started)) s" | tee -a "$out/summary.log"
}

part exact 50 python3 bench/gpu_exact.py --cpu
# what `make gpu-check` runs (a bare machine may have no make)
part suite 240 python3 -m pytest -q -s -rs -m gpu -p no:cacheprovider tests/gpu
part merges 120 python3 bench/gpu_merges.py --repeats 2
part finetune 90 bash -c "python3 bench/gpu_finetune_step.py && python3 bench/gpu_finetune_step.py --precision bf16 \
    && python3 bench/gpu_finetune_step.py --layers 6 --hidden 384 --length 32 --examples 4800"
part streaming 100 python3 bench/gpu_streaming.py --dir /tmp/gpu-streaming
# The machine's CPU, for the sparsifying merges streamed against the streamed average (issue 33): on two of
# its cores (the 2-core CI VM's thread count), then on all of them.
pin=$(command -v taskset >/dev/null && echo "taskset -c 0,1")
# 200 s with the least of 3 ran out on an H100 machine: its Python takes 5 s to import torch and mergeflow.
part cpu_streaming 300 bash -c "$pin python3 bench/streaming_merge.py --models 4 --dir /tmp/cpu-streaming --keep \
    --repeat 2 --cases average ties della && python3 bench/streaming_merge.py --models 4 --dir /tmp/cpu-streaming \
    --keep --repeat 2 --threads 16 --cases average della"
