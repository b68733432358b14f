#!/usr/bin/env bash
# Issue 48's device call (at most BUDGET = 550 s): GRPO beside TRL 1.16's GRPOTrainer at SmolLM2-135M's shape, at
# the chat prompts and at the long prompts (each after a 400-word passage: ~494 tokens), k 8, 64-token completions,
# β 0 and β 0.04; at the long prompts also fastppo with share_prompts=False (the same samples, each row its own
# prompt). First the CUDA graph decode's tests on CUDA (the shared prefill's among them) and the shared update's
# forward and gradients through the fused kernels.
#
#   bash bench/fetch_wheels.sh     # here, beforehand (datasets, liger-kernel, ...); TRL 1.16 in .trl1
#   (.gpu-carry/smollm2-shape: SmolLM2-135M's config and tokenizer; see gpu_call1.sh)
#   device run: bash bench/gpu_issue48.sh   carry: [".whl", ".trl1", ".gpu-carry"]   timeout_s: 590
#
# Each GRPO side runs in its own process under its own limit (GRPO_SIDE_SECONDS), so a slow side cannot starve
# the others; each stage runs under `timeout -s INT`. Knobs: BUDGET, GRPO_ITERATIONS (5), GRPO_SIDE_SECONDS (70).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-550}
START=$SECONDS
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false FASTPPO_CACHE=/tmp/fastppo-cache
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
ITER=${GRPO_ITERATIONS:-5} SIDE=${GRPO_SIDE_SECONDS:-70}

# shellcheck source=bench/gpu_stages.sh
source "$(dirname "$0")/gpu_stages.sh"  # left, cap, stage, setup
grpo() {  # grpo NAME CONTEXT_WORDS SIDES CAP RESERVE
  FASTPPO_SMOLLM2_SHAPE=$PWD/.gpu-carry/smollm2-shape stage "$(cap "$4" "$5")" "grpo-$1" python3 bench/grpo_baseline.py \
    --rounds 1 --iterations "$ITER" --betas 0,0.04 --sides "$3" --prompts_per_step 8 --num_generations 8 \
    --max_completion_length 64 --context_words "$2" --side_seconds "$SIDE" --json "$OUT/grpo-$1.json"
}

main() {
  setup 100 400  # gpu_stages.sh: the wheels, the build, the device
  local xdist=(-n 8)
  python3 -c "import xdist" 2>/dev/null || xdist=()
  stage "$(cap 70 360)" tests-cuda python3 -m pytest tests/test_graph_decode.py \
    "tests/test_shared_prompts.py::test_the_trained_forward_and_every_gradient_are_the_unshared_ones_on_each_device" \
    -q -rfEs -p no:cacheprovider "${xdist[@]}" --junitxml="$OUT/tests-cuda.xml"
  grpo long 400 fastppo,fastppo-noshare,trl 230 130
  grpo chat 0 fastppo,trl 160 0
}

main 2>&1 | tee "$OUT/call.log"
echo "total $((SECONDS - START))s"
