#!/usr/bin/env bash
# One GPU lease, one call: install, check the compiled kernels against their
# references, then time everything; full logs and JSON under $OUT (or ./gpu-out).
#
# Usage on a lent GPU machine (device tool), from the repo root:
#   bash bench/gpu_session.sh            # tests + full bench
#   QUICK=1 bash bench/gpu_session.sh    # tests + the headline shapes only
# Wheels missing from the image (datasets, liger-kernel, trl) may be carried in
# .whl/ (see the device README); they are installed to /tmp/site when present.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git rev-parse HEAD; date -u; } | tee "$OUT/env.txt"

# 1. Correctness of the compiled kernels and the CUDA op on CUDA tensors.
python3 -m pytest tests/test_masking.py tests/test_logprobs.py tests/test_kl.py tests/test_gae.py tests/test_stats.py \
  -q -x -p no:cacheprovider --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
tests_status=${PIPESTATUS[0]}

# 2. Benchmarks (only meaningful if the kernels are correct).
if [ "$tests_status" -eq 0 ]; then
  select=()
  [ "${QUICK:-0}" = 1 ] && select=(-k "8192 or B=1024 or B=512")
  python3 -m pytest bench/ -q -p no:cacheprovider --benchmark-group-by=group --benchmark-columns=median,iqr,rounds \
    --benchmark-json="$OUT/bench.json" "${select[@]}" 2>&1 | tee "$OUT/bench.log"
fi
echo "tests exit status: $tests_status"
