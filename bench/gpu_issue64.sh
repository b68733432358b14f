#!/usr/bin/env bash
# Issue 64's device call (at most BUDGET = 570 s on one H200): stages in order of value, each writing its Markdown
# table to $OUT/<stage>.md when it ends, so that a call cut short keeps what finished:
#   1. tests.md: the CUDA tests touched since the last lease (custom ops, the static and graph decode and its KV
#      cache, the episode decode, the compile tests), 16 workers when pytest-xdist is there;
#   2. long.md (+ long.json, long.png): GRPO with long completions beside TRL 1.16 (bench/long_completions.py:
#      GRPOConfig's defaults except the sizes, random weights at Qwen2.5-0.5B's and 1.5B's shapes, 8 prompts × 8
#      completions, bf16), one cell (shape:length) after another in LONG_CELLS' order, each side of a cell in its
#      own process under its own limit (LONG_SIDE_SECONDS);
#   3. lmhead-loss.md (+ lmhead-loss.json): the fused LM head and the fused PPO loss beside their GEMM floors
#      (pytest-benchmark medians, --quick);
#   4. episode-decode.md (+ episode-decode.json): bench/episode_decode_time.py --device cuda at SmolLM2-135M's
#      shape (random weights);
#   5. bisect.md (+ bisect.json): the longest completion each side fits at 64 completions, with what is left (each
#      try generates every token, so at 8,192 tokens and more a try takes minutes: give it its own call with
#      STAGES=bisect).
#
#   bash bench/fetch_wheels.sh     # here, beforehand: datasets, liger-kernel, ... in .whl; TRL 1.16 in .whl/trl1
#   device run: bash bench/gpu_issue64.sh   carry: [".whl"]   timeout_s: 600
#
# TRL 1.16: $FASTPPO_TRL1 when set, else .trl1 when it holds trl (a directory, not a link), else the wheel in
# .whl/trl1 installed into /tmp/trl1. The models are written on the device (configs in bench/long_completions.py,
# random weights, no download), so nothing else needs carrying. Knobs (environment): BUDGET, STAGES ("tests long
# lmhead decode bisect"), TEST_FILES, TEST_SECONDS (90), LONG_CELLS ("qwen2.5-0.5b:1024 qwen2.5-0.5b:4096
# qwen2.5-1.5b:1024 qwen2.5-1.5b:4096 qwen2.5-0.5b:8192 qwen2.5-1.5b:8192"; a cell may name its sides:
# "qwen2.5-0.5b:4096:fastppo,trl,trl-liger"), LONG_SIDES (fastppo,trl), LONG_SIDE_SECONDS (180), LONG_SECONDS (330),
# LONG_STEPS (1), BENCH_SECONDS (60), DECODE_SECONDS (45), BISECT_SHAPE (qwen2.5-0.5b), BISECT_SIDES (fastppo,trl),
# BISECT_START (8192), BISECT_RESOLUTION (2048).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-570}
START=$SECONDS
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false FASTPPO_CACHE=/tmp/fastppo-cache
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
STAGES=${STAGES:-tests long lmhead decode bisect}
WORK=/tmp/gpu_issue64
rm -rf "$WORK" && mkdir -p "$WORK"

# shellcheck source=bench/gpu_stages.sh
source "$(dirname "$0")/gpu_stages.sh"  # left, cap, stage, setup
wants() { [[ " $STAGES " == *" $1 "* ]]; }
table() { python3 bench/gpu_tables.py "$@" >/dev/null; }  # table KIND INPUT OUT_MD

trl1() {  # where TRL 1.16 is found (bench/trl_envs.py reads FASTPPO_TRL1)
  if [ -z "${FASTPPO_TRL1:-}" ]; then
    if [ -f .trl1/trl/__init__.py ]; then
      export FASTPPO_TRL1=$PWD/.trl1
    elif compgen -G ".whl/trl1/trl-1.*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/trl1 .whl/trl1/trl-1.*.whl
      export FASTPPO_TRL1=/tmp/trl1
    fi
  fi
  echo "TRL 1.x from: ${FASTPPO_TRL1:-nowhere (the TRL sides will refuse to start)}"
}

long() {  # one cell after another while the stage's time lasts; the table rewritten after every side's run
  local end=$((SECONDS + $(cap "${LONG_SECONDS:-330}" "$1"))) cell shape length sides t
  for cell in ${LONG_CELLS:-qwen2.5-0.5b:1024 qwen2.5-0.5b:4096 qwen2.5-1.5b:1024 qwen2.5-1.5b:4096 \
      qwen2.5-0.5b:8192 qwen2.5-1.5b:8192}; do
    IFS=: read -r shape length sides <<<"$cell"
    t=$((end - SECONDS))
    [ "$t" -lt 30 ] && { echo "=== long-$shape-$length: SKIPPED (the stage's time is spent)"; continue; }
    # each side's own limit stays inside the stage's, so a side cut short is recorded as such
    stage "$t" "long-$shape-$length" python3 bench/long_completions.py --device cuda --shape "$shape" \
      --lengths "$length" --prompts 8 --completions 8 --steps "${LONG_STEPS:-1}" \
      --sides "${sides:-${LONG_SIDES:-fastppo,trl}}" \
      --side_seconds "$(( t - 10 < ${LONG_SIDE_SECONDS:-180} ? t - 10 : ${LONG_SIDE_SECONDS:-180} ))" \
      --append --json "$OUT/long.json" --markdown "$OUT/long.md" --plot "$OUT/long.png"
  done
}

main() {
  setup 120 60  # gpu_stages.sh: the wheels, the build (whatever else is asked for), the device
  trl1
  local xdist=()
  python3 -c "import xdist" 2>/dev/null && xdist=(-n 16)
  if wants tests; then
    # shellcheck disable=SC2086
    stage "$(cap "${TEST_SECONDS:-90}" 330)" tests python3 -m pytest ${TEST_FILES:-tests/test_custom_ops.py \
      tests/test_static_decode.py tests/test_graph_decode.py tests/test_episode_decode.py tests/test_compile.py} \
      -k "not smollm2" -q -rfEs -p no:cacheprovider "${xdist[@]}" --junitxml="$WORK/tests.xml"
    table junit "$WORK/tests.xml" "$OUT/tests.md"
  fi
  wants long && long 60
  if wants lmhead; then
    stage "$(cap "${BENCH_SECONDS:-60}" 50)" lmhead-loss python3 -m pytest bench/bench_logprobs.py \
      bench/bench_ppo_loss.py --quick -k "fused and gpu and not compile" -q -rs -p no:cacheprovider \
      --benchmark-columns=median,iqr,rounds --benchmark-json="$OUT/lmhead-loss.json"
    table benchmark "$OUT/lmhead-loss.json" "$OUT/lmhead-loss.md"
  fi
  if wants decode; then
    # SmolLM2-135M's shape: long_completions.py writes its config and tokenizer (e2e_common.smollm2_shaped_dir
    # draws the weights from them); --stops: enough stop ids that random weights end turns (see its help)
    local smollm2
    smollm2=$(timeout 120 python3 -c "import sys; sys.path.insert(0, 'bench'); import long_completions as L
print(L.shape_dir('smollm2-135m'))" 2>"$WORK/shape.err" | tail -1)
    FASTPPO_SMOLLM2_SHAPE=$smollm2 stage "$(cap "${DECODE_SECONDS:-45}" 5)" episode-decode python3 \
      bench/episode_decode_time.py --device cuda --stops 1024 --out "$OUT/episode-decode.json"
    table episodes "$OUT/episode-decode.json" "$OUT/episode-decode.md"
  fi
  if wants bisect && [ "$(left)" -ge 60 ]; then
    local secs=$(( ($(left) - 20) / 2 ))  # each side its own half of what is left
    stage "$(cap $((2 * secs + 10)) 5)" bisect python3 bench/long_completions.py --device cuda \
      --shape "${BISECT_SHAPE:-qwen2.5-0.5b}" --sides "${BISECT_SIDES:-fastppo,trl}" --prompts 8 --completions 8 \
      --bisect --bisect_start "${BISECT_START:-8192}" --bisect_resolution "${BISECT_RESOLUTION:-2048}" \
      --bisect_seconds "$secs" --side_seconds "$secs" --json "$OUT/bisect.json" --markdown "$OUT/bisect.md"
  fi
  cat "$WORK/stages" 2>/dev/null
}

main 2>&1 | tee "$OUT/call.log"
echo "total $((SECONDS - START))s"
