#!/usr/bin/env bash
# The GPU path in one command, for the day a GPU is available: host cost (tiny GPT, eager and
# compiled per block) and the bench GPT side by side, on CUDA/NCCL, one GPU per rank, with MFU.
#
#   bash bench/gpu.sh                 # every GPU of the machine
#   W=1 PEAK=989 bash bench/gpu.sh    # one GPU; PEAK: the GPU's dense TFLOP/s in the dtype trained (here float32 math
#                                     # runs as TF32 where enabled: pass that figure)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
W=${W:-$($PY -c 'import torch; print(torch.cuda.device_count())')}
PEAK=${PEAK:-989}
mkdir -p out
set -x
$PY bench/overhead.py --device cuda --world "$W" --layers 2,16 --reps 3 --peak-tflops "$PEAK" --json out/gpu_overhead.json
$PY bench/overhead.py --device cuda --world "$W" --layers 4 --d-model 128 --vocab 1024 --seq 64 --reps 2 --compile \
    --peak-tflops "$PEAK" --json out/gpu_overhead_compiled.json
$PY bench/compare.py --device cuda --world "$W" --systems fsdp_fn,fsdp2,ddp --peak-tflops "$PEAK" --json out/gpu_compare.json
