#!/usr/bin/env bash
# Issue 37's second device call (at most ~200 s): the fused PPO loss beside its bare GEMMs, checked against the
# fp32 oracle, and why calling the CUDA build's op directly with a bad argument crashes (the first lease's
# finding 3, reproduced by gpu_call1.sh with the AOT build): which std::string ABI the extension and libc10 use,
# a cuda-gdb backtrace, and the same probe with the CPU-only build of the same sources.
#   device run: bash bench/gpu_call2.sh   carry: [".whl"]   timeout_s: 240
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
{
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
git rev-parse HEAD; date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "=== build (CUDA)"; timeout 120 python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
echo "=== the fused PPO loss"
timeout 100 python3 -m pytest bench/bench_ppo_loss.py::test_fused_ppo_policy_loss_gpu --quick -q -rsfE \
  -p no:cacheprovider --benchmark-columns=median,rounds 2>&1 | tail -30
echo "=== ABI"; g++ --version | head -1; nvcc --version | tail -1
python3 -c "import torch; print('torch cxx11 abi', torch._C._GLIBCXX_USE_CXX11_ABI, '| compiled with', [l.strip() for l in torch.__config__.show().splitlines() if 'C++ Version' in l or 'GCC' in l or 'CXX_COMPILER' in l][:3])"
SO=$(ls fastppo/_C*.so); C10=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libc10.so'))")
echo "extension needs:"; nm -D --undefined-only "$SO" | grep -i -E "torchCheckFail|c10.*Error" | c++filt | head -8
echo "libc10 has:"; nm -D --defined-only "$C10" | grep -i torchCheckFail | c++filt | head -8
ldd "$SO" | grep -E "stdc|c10|torch|gcc"
PROBE='import torch, fastppo.kernels as k; print("backend", k.extension_backend())
try:
    torch.ops.fastppo.truncate_at_stop(torch.ones(2, 3, dtype=torch.long), torch.tensor([1]), -2)
except RuntimeError as e:
    print("raised RuntimeError:", str(e).splitlines()[0])'
echo "=== backtrace"; timeout 60 cuda-gdb -q -batch -ex run -ex bt --args python3 -c "$PROBE" 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -30
echo "=== CPU-only build of the same sources"
FASTPPO_NO_CUDA=1 timeout 90 python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
timeout 60 python3 -X faulthandler -c "$PROBE" 2>&1 | tail -4; echo "exit ${PIPESTATUS[0]} (139 = segfault)"
} 2>&1 | tee "$OUT/call2.log"
