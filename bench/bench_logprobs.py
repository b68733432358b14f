"""token_logprobs and fused_token_logprobs against their PyTorch references and the peers.

Run: ``pytest bench/bench_logprobs.py --benchmark-group-by=group`` (GPU cases skip without CUDA;
``--quick``: the headline shapes only, or small CPU shapes; ``--smoke``: the GPU cases' code on the CPU).

Shapes (``benchutil.SHAPES``): logits [16, 512, V] for ``token_logprobs`` with V in {32,000,
128,256, 151,936} (headline: V=128,256, bf16); the LM-head grid N in {4,096, 16,384}, H in {2,048,
4,096}, V in {32,000, 128,256, 151,936} plus the headline N=8192, H=4096, V=128,256 (bf16) for
``fused_token_logprobs``.

Implementations (each checked against the reference on the same inputs before it is timed):
  * token_logprobs: ``token_logprobs_reference`` (fp32 log_softmax of the materialised logits,
    gather, entropy from the same log-probabilities) and its ``torch.compile``; TRL's
    ``selective_log_softmax`` + ``entropy_from_logits``; Liger-Kernel's
    ``fused_selective_log_softmax`` (forward only, no entropy); flash-attn's Triton cross-entropy
    (no entropy).
  * fused_token_logprobs: what a trainer does without the fused op (TRL, verl): bf16 logits =
    hidden @ weight.T, then ``token_logprobs_reference`` — and its ``torch.compile`` (headline
    shape only: one compile per shape costs more than the case); Liger-Kernel's fused linear
    cross-entropy, reduction="none" (no entropy); "fastppo fused forward": the same op with its forward
    the fused Triton kernel (its default on CUDA is the GEMM-then-rows forward: cuBLAS logits of up to 1,024 rows at
    a time, then the row kernel). ``fused_token_logprobs_reference`` upcasts hidden
    and weight to fp32 first (it is the accuracy oracle), which would make the baseline needlessly
    slow. Upstream gradients are all ones for every implementation (see ``peers.liger_flce_logprobs``).

Floors (the ``% floor`` column of the summary):
  * token_logprobs: one read of the logits (fwd), plus one read of the logits and one write of
    their gradient (fwd+bwd), at the measured copy bandwidth;
  * fused_token_logprobs: the bare bf16 GEMMs, timed in the same run: hidden @ weight.T (fwd),
    plus dlogits @ weight and dlogitsᵀ @ hidden (fwd+bwd).
"""
import pytest
import torch

import peers
from benchutil import HEADLINE_LM_HEAD, assert_agrees, bench_dtype, dtype_name, fused_forward, gemm_floor
from benchutil import with_backward
from fastppo.kernels import fused_token_logprobs, token_logprobs, token_logprobs_reference

ENTROPY = pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no-entropy"])
PASSES = pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])


# --------------------------------------------------------------------------- token_logprobs


def test_token_logprobs_cpu(measure, quick):
    shape = (64, 4096) if quick else (256, 32000)
    logits = torch.randn(shape)
    index = torch.randint(0, shape[-1], shape[:-1])
    measure(lambda: token_logprobs_reference(logits, index, 1.0, return_entropy=True),
            group=f"logprobs: token_logprobs+entropy fwd cpu {list(shape)} fp32", impl="reference", device="cpu")


TOKEN_IMPLS = ["reference", "reference torch.compile", "fastppo triton", "trl selective_log_softmax",
               "liger fused_selective_log_softmax", "flash-attn cross_entropy"]


def _token_logprobs_impl(impl, device, logits, index, entropy, backward):
    """A zero-argument call of one implementation; skips what it cannot do."""
    if impl in ("liger fused_selective_log_softmax", "flash-attn cross_entropy") and entropy:
        pytest.skip(f"{impl} has no entropy output")
    if impl == "liger fused_selective_log_softmax":
        if backward:
            pytest.skip(f"{impl} is forward-only (no gradient)")
        # Its own input: the causal LM's logits, one position longer; the same B·T rows are scored.
        longer = torch.cat([logits.detach(), logits.detach()[:, -1:]], dim=1)
        return lambda: peers.liger_selective_logprobs(longer, index)
    if impl == "flash-attn cross_entropy":
        return lambda: peers.flash_attn_token_logprobs(logits, index)
    fn = {
        "reference": token_logprobs_reference,
        "reference torch.compile": peers.compiled(token_logprobs_reference, device),
        "fastppo triton": token_logprobs,
        "trl selective_log_softmax": peers.trl_token_logprobs,
    }[impl]
    return lambda: fn(logits, index, 1.0, return_entropy=entropy)


@ENTROPY
@PASSES
@pytest.mark.parametrize("impl", TOKEN_IMPLS)
def test_token_logprobs_gpu(measure, gpu_device, copy_bandwidth, logits_shape, impl, passes, entropy):
    backward = passes == "fwd+bwd"
    logits = torch.randn(logits_shape, device=gpu_device, dtype=bench_dtype(gpu_device)).requires_grad_(backward)
    index = torch.randint(0, logits_shape[-1], logits_shape[:-1], device=gpu_device)
    fn = _token_logprobs_impl(impl, gpu_device, logits, index, entropy, backward)
    # Correct first (this also compiles / JITs outside the timed region).
    assert_agrees(fn(), token_logprobs_reference(logits, index, 1.0, return_entropy=entropy), impl)
    call = with_backward(fn, (logits,), backward)
    call()
    # copy_bandwidth counts read + write bytes; fwd reads the logits once, bwd reads them and writes the grad.
    bytes_moved = logits.numel() * logits.element_size() * (3 if backward else 1)
    name = "+entropy" if entropy else ""
    measure(call, group=f"logprobs: token_logprobs{name} {passes} {gpu_device} {list(logits_shape)} "
                        f"{dtype_name(logits.dtype)}",
            impl=impl, device=gpu_device, floor_s=bytes_moved / copy_bandwidth, rounds=10)


# --------------------------------------------------------------------------- fused_token_logprobs


def _materialised_reference(hidden, weight, index, temperature=1.0, return_entropy=False):
    return token_logprobs_reference(hidden @ weight.t(), index, temperature, return_entropy=return_entropy)


def test_fused_token_logprobs_cpu(measure, quick):
    n, h, v = (64, 128, 2048) if quick else (256, 256, 8192)
    hidden = torch.randn(n, h)
    weight = torch.randn(v, h) / h**0.5
    index = torch.randint(0, v, (n,))
    measure(lambda: _materialised_reference(hidden, weight, index, return_entropy=True),
            group=f"logprobs: fused_token_logprobs+entropy fwd cpu N={n} H={h} V={v} fp32", impl="reference",
            device="cpu")


FUSED_IMPLS = ["reference", "reference torch.compile", "fastppo triton", "fastppo fused forward", "liger flce"]


def _fused_forward_token_logprobs(*args, **kwargs):
    """``fused_token_logprobs`` with its forward the fused Triton kernel (``bench/tune.py lmhead_forward_rows`` 0)."""
    with fused_forward():
        return fused_token_logprobs(*args, **kwargs)


def _fused_impl(impl, device, shape, hidden, weight, index, entropy):
    if impl == "liger flce":
        if entropy:
            pytest.skip("Liger's fused linear cross-entropy has no entropy output")
        return lambda: peers.liger_flce_logprobs(hidden, weight, index)
    if impl == "reference torch.compile" and device == "cuda" and shape != HEADLINE_LM_HEAD:
        pytest.skip("the torch.compile peer is timed at the headline shape only (a compile per shape)")
    op = {
        "reference": _materialised_reference,
        "reference torch.compile": peers.compiled(_materialised_reference, device),
        "fastppo triton": fused_token_logprobs,
        "fastppo fused forward": _fused_forward_token_logprobs,
    }[impl]
    return lambda: op(hidden, weight, index, 1.0, return_entropy=entropy)


@ENTROPY
@PASSES
@pytest.mark.parametrize("impl", FUSED_IMPLS)
def test_fused_token_logprobs_gpu(measure, gpu_device, lm_head_shape, impl, passes, entropy):
    backward = passes == "fwd+bwd"
    n_tokens, hid, vocab = lm_head_shape
    dtype = bench_dtype(gpu_device)
    hidden = torch.randn(n_tokens, hid, device=gpu_device, dtype=dtype).requires_grad_(backward)
    weight = (torch.randn(vocab, hid, device=gpu_device, dtype=dtype) / hid**0.5).requires_grad_(backward)
    index = torch.randint(0, vocab, (n_tokens,), device=gpu_device)
    fn = _fused_impl(impl, gpu_device, lm_head_shape, hidden, weight, index, entropy)
    assert_agrees(fn(), _materialised_reference(hidden, weight, index, return_entropy=entropy), impl)
    call = with_backward(fn, (hidden, weight), backward)
    call()

    floor_s = gemm_floor(gpu_device, [(hidden, weight)], (hidden, weight) if backward else None)
    name = "+entropy" if entropy else ""
    measure(call, group=f"logprobs: fused_token_logprobs{name} {passes} {gpu_device} N={n_tokens} H={hid} V={vocab} "
                        f"{dtype_name(dtype)}",
            impl=impl, device=gpu_device, floor_s=floor_s, rounds=10)
