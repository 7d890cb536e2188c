#!/usr/bin/env bash
# The GPU checks of the engine room, in one run of a few minutes on one CUDA GPU (never needed by CI):
#   1. bench/step_phases.py: the hf engine's generation and the Learner's update on the GPU, in bf16
#      and fp32, at 8x8x64 (real_step.py's shape) and 64x8x128 (512 completions), on a model of
#      SmolLM2-135M-Instruct's architecture (random weights: the shapes set the time, not the values);
#   2. posttrain demo --quick on the GPU (the tiny demo: SFT, GRPO, control; model.device=auto);
#   3. the test suite's train/models/algorithms/rollout tests with model.device="auto" = the GPU
#      (exact resume after kill -9, micro-batch equality, LoRA, ... on CUDA kernels).
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   (CONFIG_DIR: a directory with SmolLM2's config.json and
# tokenizer files, default .gpu/smollm2-config; QUICK=1: tiny shapes, for a dry run on a CPU machine.)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
config=${CONFIG_DIR:-.gpu/smollm2-config}
device=cuda
python3 -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" || device=cpu
shapes=8x8x64,64x8x128
steps=4
if [ "${QUICK:-0}" = 1 ]; then shapes=1x2x4,2x2x4; steps=2; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import sys,torch,transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$out/versions.txt"
echo "== 1. step phases on $device"
for dtype in bfloat16 float32; do
    (cd bench && timeout 130 python3 step_phases.py --device "$device" --dtype "$dtype" --shapes "$shapes" \
        --steps "$steps" --config-dir "../$config") 2>&1 | grep -v "it/s\]" | tee "$out/phases_$dtype.txt"
done
echo "== 2. posttrain demo --quick on $device (SFT warm-up, GRPO, equal-time SFT control, model.device=auto)"
rm -rf /tmp/gpu_check_demo
timeout 110 python3 -m posttrain.cli demo --quick --out /tmp/gpu_check_demo 2>&1 | tail -9 | tee "$out/demo_table.txt"
echo "== 3. tests on $device"
if [ "${QUICK:-0}" = 1 ]; then tests=tests/train/test_microbatch.py; else
    tests="tests/train tests/models tests/algorithms tests/rollout"; fi
par=""
python3 -c "import xdist" 2>/dev/null && par="-n 12"
python3 -c "import pytest_timeout" 2>/dev/null && par="$par --timeout 150"
timeout 200 python3 -m pytest -p no:cacheprovider $par $tests -rfE 2>&1 \
    | tail -60 | tee "$out/pytest_tail.txt"
