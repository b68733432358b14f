#!/usr/bin/env bash
# One GPU call for generation and the end-to-end comparison (issue 22's GPU half): the machine's ceilings, the
# compiled decode's exactness tests on CUDA, generation eager vs compiled vs TRL 0.26, and fastppo (eager and
# compiled decode) beside TRL 0.26 end to end. Logs and JSON under $OUT; the summary tables last.
#
#   bash bench/fetch_wheels.sh       # here, beforehand: datasets, trl 0.26.2, ... into .whl/
#   device run: bash bench/gpu_decode_session.sh    carry: [".whl", ".gpu-carry"]
#
# SmolLM2's GGUF (98 MB) cannot travel (64 MiB a call): .gpu-carry/smollm2-shape holds its config, tokenizer,
# chat template and generation_config, and the model is built with seeded random weights there
# (e2e_common.smollm2_shaped_dir): the same shapes and work per token.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false FASTPPO_CACHE=/tmp/fastppo-cache
export FASTPPO_SMOLLM2_SHAPE=$PWD/.gpu-carry/smollm2-shape
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git rev-parse HEAD 2>/dev/null; date -u; } 2>&1 | tee "$OUT/env.txt"

stage() { local secs=$1; shift; [ "$secs" = 0 ] && return; echo "=== $* (at most ${secs}s)"; timeout "$secs" "$@"; echo "=== exit $?"; }

stage 120 python3 -c "import fastppo.kernels as k; print('extension', k.extension_backend())" 2>&1 | tee "$OUT/ext.log"
stage 40 python3 bench/machine_limits.py --tokens 1280 --json "$OUT/limits.json" 2>&1 | tee "$OUT/limits.log"
stage ${TEST_SECONDS:-100} python3 -m pytest tests/test_static_decode.py -q -rfEs -p no:cacheprovider -k "${TEST_K:-not smollm2}" 2>&1 \
  | tee "$OUT/tests.log"
if [ -n "${KERNEL_TESTS:-}" ]; then  # the kernel suite on CUDA (TRITON_INTERPRET=0): compiled Triton and the C++ op
  stage "${KERNEL_TESTS}" python3 -m pytest tests/test_masking.py tests/test_lmhead.py tests/test_logprobs.py \
    tests/test_logprobs_options.py tests/test_kl.py tests/test_ppo_loss.py tests/test_gae.py tests/test_stats.py \
    tests/test_gpu_compile.py -q -rfE -p no:cacheprovider -n 8 2>&1 | tee "$OUT/kernels.log"
fi
stage ${DECODE_SECONDS:-170} python3 bench/decode_bench.py --reps 3 --batches ${DECODE_BATCHES:-16} --lengths ${DECODE_LENGTHS:-24 53} --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log"
E2E="--model smollm2 --per_device_train_batch_size 16 --gradient_accumulation_steps 1 --num_ppo_epochs 4
  --learning_rate 3e-6 --temperature 0.7 --stop_on_eos true --missing_eos_penalty 1.0 --iterations 3
  --warmup_iterations 1 --threads 0 --local_rollout_forward_batch_size 16"
stage ${E2E_SECONDS:-170} python3 bench/trl_baseline.py $E2E --response_length ${E2E_LENGTH:-53} \
  --impl fastppo-eager,fastppo-compiled,trl --json "$OUT/e2e${E2E_LENGTH:-53}.json" 2>&1 | tee "$OUT/e2e.log"

echo; echo "##### summary"; grep -hE "passed|failed|error" "$OUT/tests.log" "$OUT"/kernels.log 2>/dev/null | tail -4
tail -4 "$OUT/limits.log"; sed -n '/^NVIDIA\|^cpu (/,$p' "$OUT/decode.log"; sed -n '/^config:/,$p' "$OUT/e2e.log" | tail -30
