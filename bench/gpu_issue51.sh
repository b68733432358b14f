#!/usr/bin/env bash
# Issue 51's device call (at most BUDGET = 560 s): the decode step as a CUDA graph (its tests on CUDA), GRPO beside
# TRL 1.16's GRPOTrainer at SmolLM2-135M's and Qwen2.5-0.5B's shapes (time to the first iteration, s/iteration
# after it, peak CUDA memory), the compile and index-contract tests, the fused loss's sequence path beside its row
# path, then, with what is left, the inductor-compiled decode and the kernel suite.
#
#   bash bench/fetch_wheels.sh     # here, beforehand (datasets, liger-kernel, ...); TRL 1.16 in .trl1
#   (.gpu-carry/smollm2-shape and .gpu-carry/qwen05-shape: configs and SmolLM2's tokenizer; see gpu_call1.sh)
#   device run: bash bench/gpu_issue51.sh   carry: [".whl", ".trl1", ".gpu-carry"]   timeout_s: 590
#
# Each GRPO side runs in its own process under its own limit (GRPO_SIDE_SECONDS), so a slow side cannot starve
# the others; each stage runs under `timeout -s INT`, so pytest still writes its report. Knobs: BUDGET,
# GRPO_ITERATIONS (6), GRPO_LENGTH (256), GRPO_SIDE_SECONDS (120).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-560}
START=$SECONDS
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false FASTPPO_CACHE=/tmp/fastppo-cache
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
ITER=${GRPO_ITERATIONS:-6} LEN=${GRPO_LENGTH:-256} SIDE=${GRPO_SIDE_SECONDS:-120}

# shellcheck source=bench/gpu_stages.sh
source "$(dirname "$0")/gpu_stages.sh"  # left, cap, stage, setup
grpo() {  # grpo SHAPE SIDES CAP RESERVE
  FASTPPO_SMOLLM2_SHAPE=$PWD/.gpu-carry/$1-shape stage "$(cap "$3" "$4")" "grpo-$1-$2" python3 bench/grpo_baseline.py \
    --rounds 1 --iterations "$ITER" --betas 0 --sides "$2" --prompts_per_step 8 --num_generations 8 \
    --max_completion_length "$LEN" --side_seconds "$SIDE" --json "$OUT/grpo-$1-${2//,/_}.json"
}

main() {
  setup 100 420  # gpu_stages.sh: the wheels, the build, the device
  local xdist=(-n 8)
  python3 -c "import xdist" 2>/dev/null || xdist=()
  stage "$(cap 70 380)" tests-decode python3 -m pytest tests/test_graph_decode.py tests/test_static_decode.py \
    -k "not smollm2" -q -rfEs -p no:cacheprovider "${xdist[@]}" --junitxml="$OUT/tests-decode.xml"
  grpo smollm2 fastppo,trl,fastppo-eager 300 150
  grpo qwen05 fastppo,trl 200 60
  stage "$(cap 60 40)" tests-compile python3 -m pytest tests/test_compile.py tests/test_index_contract.py -q -rfEs \
    -p no:cacheprovider -n 16 --junitxml="$OUT/tests-compile.xml"
  stage "$(cap 45 10)" bench-loss-options python3 -m pytest bench/bench_ppo_loss.py -k "gpu" --quick -q -rs \
    -p no:cacheprovider --benchmark-columns=median,iqr,rounds --benchmark-json="$OUT/bench-loss.json"
  grpo smollm2 fastppo-inductor 110 5
}

main 2>&1 | tee "$OUT/call.log"
echo "total $((SECONDS - START))s"
