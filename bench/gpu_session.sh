#!/usr/bin/env bash
# A GPU lease in as few calls as possible: install, check the compiled kernels against their
# references, then time; full logs and JSON under $OUT (or ./gpu-out).
#
# Usage on a lent GPU machine (device tool; at most 10 minutes a call), from the repo root:
#   bash bench/gpu_session.sh --quick                      # call 1: tests + every kernel at its headline shape
#   SKIP_TESTS=1 TAG=logprobs bash bench/gpu_session.sh bench/bench_logprobs.py     # call 2: the LM-head grid
#   SKIP_TESTS=1 TAG=rest bash bench/gpu_session.sh bench/bench_ppo_loss.py bench/bench_kl.py bench/bench_gae.py \
#       bench/bench_masking.py bench/bench_train.py                                  # call 3: the other full shapes
# Arguments go to `pytest bench/` (paths, -k, --quick). The wheels the image lacks (datasets,
# liger-kernel, trl and their missing needs) come from `bash bench/fetch_wheels.sh`, run here
# beforehand; name `.whl` in the device call's carry and they are installed to /tmp/site.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
TAG=${TAG:-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; python3 -c "import fastppo.kernels as k; print('extension', k.extension_backend())"; for m in datasets liger_kernel trl transformers; do python3 -c "import importlib.metadata as md, $m; print('$m', md.version('${m/_/-}'))" 2>&1 | tail -1; done; git rev-parse HEAD; date -u; } | tee "$OUT/env-$TAG.txt"

# 1. Correctness of the compiled kernels and the CUDA op on CUDA tensors.
tests_status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest tests/test_masking.py tests/test_lmhead.py tests/test_logprobs.py tests/test_kl.py \
    tests/test_ppo_loss.py tests/test_gae.py tests/test_stats.py \
    -q -x -p no:cacheprovider --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
  tests_status=${PIPESTATUS[0]}
fi

# 2. Benchmarks (only meaningful if the kernels are correct). Each case checks its own output
#    against the reference before it is timed; the summary table is printed last.
if [ "$tests_status" -eq 0 ]; then
  has_path=0
  for arg in "$@"; do [[ $arg == bench/* ]] && has_path=1; done
  [ "$has_path" = 1 ] || set -- bench/ "$@"
  python3 -m pytest "$@" -q -rs -p no:cacheprovider --benchmark-group-by=group --benchmark-columns=median,iqr,rounds \
    --benchmark-json="$OUT/$TAG.json" 2>&1 | tee "$OUT/$TAG.log"
fi
echo "tests exit status: $tests_status"
