"""kl_penalty and fused_full_kl against their PyTorch references.

Run: ``pytest bench/bench_kl.py --benchmark-group-by=group`` (GPU cases skip
without CUDA; ``--quick`` shrinks the CPU case).

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

from benchutil import cuda_event_median, requires_cuda
from fastppo.kernels import fused_full_kl, fused_full_kl_reference, kl_penalty, kl_penalty_reference

ESTIMATOR = "k3"  # the one with transcendental math in both passes


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


@requires_cuda
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("shape", [(64, 4096), (512, 4096)], ids=str)
@pytest.mark.parametrize("impl", ["reference", "reference torch.compile", "fastppo triton"])
def test_kl_penalty_cuda(measure, copy_bandwidth, impl, shape, passes):
    backward = passes == "fwd+bwd"
    logp, ref = logprob_pair(shape, "cuda", requires_grad=backward)
    upstream = torch.randn(shape, device="cuda")
    fn = {
        "reference": kl_penalty_reference,
        "reference torch.compile": torch.compile(kl_penalty_reference),
        "fastppo triton": kl_penalty,
    }[impl]
    call = penalty_call(fn, logp, ref, backward, upstream)
    call()  # compile / JIT outside the timed region
    bytes_moved = logp.numel() * (32 if backward else 12)
    measure(call, group=f"kl: kl_penalty {ESTIMATOR} {passes} cuda {list(shape)} fp32", impl=impl,
            device="cuda", floor_s=bytes_moved / copy_bandwidth)


@requires_cuda
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("hid,vocab", [(2048, 32000), (4096, 128256)], ids=lambda v: str(v))
@pytest.mark.parametrize("impl", ["reference", "fastppo triton"])
def test_fused_full_kl_cuda(measure, impl, hid, vocab, passes):
    n_tokens, dtype = 4096, torch.bfloat16
    backward = passes == "fwd+bwd"
    hidden = torch.randn(n_tokens, hid, device="cuda", dtype=dtype)
    weight = (torch.randn(vocab, hid, device="cuda", dtype=dtype) / hid**0.5).requires_grad_(backward)
    hidden.requires_grad_(backward)
    ref_hidden = hidden.detach() + 0.1 * torch.randn_like(hidden)
    ref_weight = weight.detach() + 0.01 * torch.randn_like(weight) / hid**0.5
    upstream = torch.randn(n_tokens, device="cuda")
    fn = fused_full_kl if impl == "fastppo triton" else fused_full_kl_reference

    def call():
        kl = fn(hidden, weight, ref_hidden, ref_weight, 1.0)
        if backward:
            return torch.autograd.grad(kl, (hidden, weight), upstream)
        return kl

    def bare_gemms():
        with torch.no_grad():
            logits = hidden @ weight.t()
            ref_logits = ref_hidden @ ref_weight.t()
            if backward:  # dX has the logits' shape and dtype
                logits @ weight
                logits.t() @ hidden
            return ref_logits

    call()  # Triton JIT outside the timed region
    floor_s = cuda_event_median(bare_gemms, repeats=10)
    measure(call, group=f"kl: fused_full_kl {passes} cuda N={n_tokens} H={hid} V={vocab} bf16", impl=impl,
            device="cuda", floor_s=floor_s, rounds=10)
