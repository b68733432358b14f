"""token_logprobs and fused_token_logprobs against their PyTorch references.

Run: ``pytest bench/bench_logprobs.py --benchmark-group-by=group`` (GPU cases
skip without CUDA; ``--quick`` shrinks the CPU cases, which time the reference
only: on CPU tensors there is no fast path, the Triton kernels run on CUDA).

Shapes are the issue's: logits [8192, 128256] bf16 for ``token_logprobs``;
N=8192, H=4096, V=128256 bf16 for ``fused_token_logprobs``.

References:
  * token_logprobs: ``token_logprobs_reference`` (fp32 log_softmax of the
    materialised logits, gather, entropy from the same log-probabilities);
  * fused_token_logprobs: what a trainer does without the fused op (TRL,
    verl): bf16 logits = hidden @ weight.T, then ``token_logprobs_reference``.
    ``fused_token_logprobs_reference`` upcasts hidden and weight to fp32 first
    (it is the accuracy oracle), which would make the baseline needlessly slow.
  * Liger-Kernel's fused linear cross-entropy (reduction="none") as a peer,
    entropy off only (it has none). Its per-token loss is −logprob at T = 1.
    Upstream gradients are all ones (``.sum()``) for every implementation:
    Liger's reduction="none" backward scales by the first upstream element only.

Floors (the ``% floor`` column of the summary):
  * token_logprobs: one read of the logits (fwd), plus one read of the logits
    and one write of their gradient (fwd+bwd), at the measured copy bandwidth;
  * fused_token_logprobs: the bare bf16 GEMMs, timed in the same run: hidden @
    weight.T (fwd), plus dlogits @ weight and dlogitsᵀ @ hidden (fwd+bwd).
"""
import pytest
import torch

from benchutil import cuda_event_median, requires_cuda
from fastppo.kernels import (
    fused_token_logprobs,
    token_logprobs,
    token_logprobs_reference,
)

try:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
except Exception:  # liger is a GPU extra; its import can fail without CUDA/triton
    LigerFusedLinearCrossEntropyLoss = None

N_TOKENS, HIDDEN, VOCAB = 8192, 4096, 128256


def _outputs_sum(out):
    return sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()


def _call(fn, inputs, backward):
    """fn() → outputs; with ``backward``, also the gradients to ``inputs`` (upstream ones)."""
    if not backward:
        return fn
    return lambda: torch.autograd.grad(_outputs_sum(fn()), inputs)


# --------------------------------------------------------------------------- token_logprobs


def test_token_logprobs_cpu(measure, quick):
    shape = (64, 4096) if quick else (256, 32000)
    logits = torch.randn(shape)
    index = torch.randint(0, shape[-1], shape[:-1])
    measure(lambda: token_logprobs_reference(logits, index, 1.0, return_entropy=True),
            group=f"logprobs: token_logprobs+entropy fwd cpu {list(shape)} fp32", impl="reference", device="cpu")


@requires_cuda
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("impl", ["reference", "reference torch.compile", "fastppo triton"])
def test_token_logprobs_cuda(measure, copy_bandwidth, impl, passes):
    backward = passes == "fwd+bwd"
    logits = torch.randn(N_TOKENS, VOCAB, device="cuda", dtype=torch.bfloat16).requires_grad_(backward)
    index = torch.randint(0, VOCAB, (N_TOKENS,), device="cuda")
    fn = {
        "reference": token_logprobs_reference,
        "reference torch.compile": torch.compile(token_logprobs_reference),
        "fastppo triton": token_logprobs,
    }[impl]
    call = _call(lambda: fn(logits, index, 1.0, return_entropy=True), (logits,), backward)
    call()  # compile / JIT outside the timed region
    # copy_bandwidth counts read + write bytes; fwd reads the logits once, bwd reads them and writes the grad.
    bytes_moved = logits.numel() * logits.element_size() * (3 if backward else 1)
    measure(call, group=f"logprobs: token_logprobs+entropy {passes} cuda [{N_TOKENS}, {VOCAB}] bf16", impl=impl,
            device="cuda", floor_s=bytes_moved / copy_bandwidth, rounds=10)


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


@requires_cuda
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("impl", ["reference", "fastppo triton", "liger flce"])
def test_fused_token_logprobs_cuda(measure, impl, passes, entropy):
    backward = passes == "fwd+bwd"
    if impl == "liger flce":
        if entropy:
            pytest.skip("Liger's fused linear cross-entropy has no entropy output")
        if LigerFusedLinearCrossEntropyLoss is None:
            pytest.skip("liger_kernel is not importable")
    dtype = torch.bfloat16
    hidden = torch.randn(N_TOKENS, HIDDEN, device="cuda", dtype=dtype).requires_grad_(backward)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", dtype=dtype) / HIDDEN**0.5).requires_grad_(backward)
    index = torch.randint(0, VOCAB, (N_TOKENS,), device="cuda")
    if impl == "liger flce":
        loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
        fn = lambda: loss(weight, hidden, index)  # noqa: E731
    else:
        op = fused_token_logprobs if impl == "fastppo triton" else _materialised_reference
        fn = lambda: op(hidden, weight, index, 1.0, return_entropy=entropy)  # noqa: E731
    call = _call(fn, (hidden, weight), backward)

    def bare_gemms():
        with torch.no_grad():
            logits = hidden @ weight.t()
            if backward:  # dlogits has the logits' shape and dtype
                logits @ weight
                logits.t() @ hidden
            return logits

    call()  # Triton JIT outside the timed region
    floor_s = cuda_event_median(bare_gemms, repeats=10)
    name = "+entropy" if entropy else ""
    measure(call, group=f"logprobs: fused_token_logprobs{name} {passes} cuda N={N_TOKENS} H={HIDDEN} V={VOCAB} bf16",
            impl=impl, device="cuda", floor_s=floor_s, rounds=10)
