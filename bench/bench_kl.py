"""kl_penalty and fused_full_kl against their PyTorch references.

Run: ``pytest bench/bench_kl.py --benchmark-group-by=group`` (GPU cases skip without CUDA;
``--quick`` shrinks the CPU case; ``--smoke`` runs the GPU cases' code on the CPU).

Floors (the ``% floor`` column of the summary):
  * kl_penalty: bytes it must move (fwd: read logp, ref, write kl = 12 B/token;
    fwd+bwd adds read grad, logp, ref, write two grads = 32 B/token in fp32)
    at the measured copy bandwidth;
  * fused_full_kl: the bare bf16 GEMMs a materialising implementation cannot
    avoid, timed in the same run (fwd: the two logit GEMMs; fwd+bwd: those
    plus dX @ W and dXᵀ @ hidden).
"""
import pytest
import torch

import peers
from benchutil import assert_agrees, bench_dtype, dtype_name, gemm_floor
from fastppo.kernels import fused_full_kl, fused_full_kl_reference, kl_penalty, kl_penalty_reference

ESTIMATOR = "k3"  # the one with transcendental math in both passes
PASSES = pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])


def logprob_pair(shape, device, requires_grad):
    logp = -(torch.rand(shape, device=device) * 4 + 0.1)
    ref = logp + torch.randn(shape, device=device) * 0.1
    return logp.requires_grad_(requires_grad), ref.requires_grad_(requires_grad)


def penalty_call(fn, logp, ref, backward, upstream):
    if not backward:
        return lambda: fn(logp, ref, ESTIMATOR)
    return lambda: torch.autograd.grad(fn(logp, ref, ESTIMATOR), (logp, ref), upstream)


def test_kl_penalty_cpu(measure, quick):
    shape = (64, 4096) if quick else (512, 4096)
    logp, ref = logprob_pair(shape, "cpu", requires_grad=False)
    measure(lambda: kl_penalty_reference(logp, ref, ESTIMATOR),
            group=f"kl: kl_penalty {ESTIMATOR} fwd cpu {list(shape)} fp32", impl="reference", device="cpu")


@PASSES
@pytest.mark.parametrize("impl", ["reference", "reference torch.compile", "fastppo triton"])
def test_kl_penalty_gpu(measure, gpu_device, copy_bandwidth, penalty_shape, impl, passes):
    backward = passes == "fwd+bwd"
    logp, ref = logprob_pair(penalty_shape, gpu_device, requires_grad=backward)
    upstream = torch.randn(penalty_shape, device=gpu_device)
    fn = {
        "reference": kl_penalty_reference,
        "reference torch.compile": peers.compiled(kl_penalty_reference, gpu_device),
        "fastppo triton": kl_penalty,
    }[impl]
    call = penalty_call(fn, logp, ref, backward, upstream)
    assert_agrees(call(), penalty_call(kl_penalty_reference, logp, ref, backward, upstream)(), impl,
                  atol=1e-5, rtol=1e-4)  # also compiles / JITs outside the timed region
    bytes_moved = logp.numel() * (32 if backward else 12)
    measure(call, group=f"kl: kl_penalty {ESTIMATOR} {passes} {gpu_device} {list(penalty_shape)} fp32", impl=impl,
            device=gpu_device, floor_s=bytes_moved / copy_bandwidth)


@PASSES
@pytest.mark.parametrize("impl", ["reference", "fastppo triton"])
def test_fused_full_kl_gpu(measure, gpu_device, full_kl_shape, impl, passes):
    n_tokens, hid, vocab = full_kl_shape
    dtype = bench_dtype(gpu_device)
    backward = passes == "fwd+bwd"
    hidden = torch.randn(n_tokens, hid, device=gpu_device, dtype=dtype)
    weight = (torch.randn(vocab, hid, device=gpu_device, dtype=dtype) / hid**0.5).requires_grad_(backward)
    hidden.requires_grad_(backward)
    ref_hidden = hidden.detach() + 0.1 * torch.randn_like(hidden)
    ref_weight = weight.detach() + 0.01 * torch.randn_like(weight) / hid**0.5
    upstream = torch.randn(n_tokens, device=gpu_device)

    def call_of(fn):
        def call():
            kl = fn(hidden, weight, ref_hidden, ref_weight, 1.0)
            return torch.autograd.grad(kl, (hidden, weight), upstream) if backward else kl
        return call

    call = call_of(fused_full_kl if impl == "fastppo triton" else fused_full_kl_reference)
    # Compared relative to each output's scale: bf16 GEMMs on the kernel's side, fp32 in the reference.
    assert_agrees(call(), call_of(fused_full_kl_reference)(), impl, rtol=5e-2, atol_of_max=3e-2)

    floor_s = gemm_floor(gpu_device, [(hidden, weight), (ref_hidden, ref_weight)],
                         (hidden, weight) if backward else None)
    measure(call, group=f"kl: fused_full_kl {passes} {gpu_device} N={n_tokens} H={hid} V={vocab} "
                        f"{dtype_name(dtype)}",
            impl=impl, device=gpu_device, floor_s=floor_s, rounds=10)
