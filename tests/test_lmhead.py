"""The LM-head core (fastppo/kernels/_lmhead.py) on its own: the pieces every LM-head kernel shares.

The module tests (test_logprobs, test_kl, test_ppo_loss) check each kernel
end to end; these check the shared pieces where a drift would hide behind a
kernel's tolerance (issue 14), and that each kernel really goes through them.
"""
import inspect

import pytest
import torch

from fastppo.kernels import _lmhead, fused_full_kl, fused_token_logprobs
from fastppo.kernels._common import override_tile
from fastppo.kernels import kl as kl_mod
from fastppo.kernels import logprobs as logprobs_mod
from helpers import assert_close, lm_head_inputs


def _bf16_cancelling_chunks(hdim: int, chunk: int):
    """A [2·chunk, hdim] bf16 weight whose two column chunks sum to S and S − 1.375 per hidden unit.

    Every entry is a multiple of 1/8 below 32 (exact in bf16) and every sum is
    exact in fp32; S ≈ 48·16 is not a bf16 number (its bf16 spacing is 4).
    """
    g = torch.Generator().manual_seed(0)
    first = torch.randint(8, 256, (chunk, hdim), generator=g).double() / 8
    second = first.clone()
    second[0] -= 1.375
    return torch.cat([first, second]).bfloat16()


def test_chunked_backward_accumulates_grad_hidden_in_fp32(triton_device):
    # dx = +1 on the first chunk, −1 on the second: grad_hidden = S − (S − 1.375) = 1.375 exactly, per entry.
    # Adding each chunk's product rounded to bf16 (the full-KL backward did: dx_c @ w_c in bf16) gives
    # round(S) − round(S − 1.375), off by up to 4: far outside bf16's tolerance of this 1.375.
    n_rows, hdim, chunk = 3, 8, 48
    weight = _bf16_cancelling_chunks(hdim, chunk).to(triton_device)
    hidden = torch.randn(n_rows, hdim, device=triton_device).bfloat16()

    def dlogits(v0, v1, x_c):
        assert x_c.dtype == torch.float32 and x_c.shape == (n_rows, chunk)  # fp32 logits of one chunk
        return torch.full(x_c.shape, 1.0 if v0 == 0 else -1.0, dtype=torch.bfloat16, device=x_c.device)

    with override_tile("lmhead_backward", chunk):  # two chunks on any device
        grad_h, grad_w, grad_b = _lmhead.vocab_chunked_backward(hidden, weight, None, dlogits, (True, True, False))
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16 and grad_b is None
    torch.testing.assert_close(grad_h.double().cpu(), torch.full((n_rows, hdim), 1.375, dtype=torch.float64),
                               atol=0, rtol=0)
    sign = torch.cat([torch.ones(chunk), -torch.ones(chunk)]).double().to(triton_device)
    assert_close(grad_w, sign[:, None] * hidden.double().sum(0)[None, :], torch.bfloat16)


def test_addmm_acc_adds_a_16_bit_product_unrounded():
    # 255 + 2·1 = 257 needs 9 significant bits: a bf16 product would be 256 or 258.
    a = torch.tensor([[255.0, 1.0, 1.0]]).bfloat16()
    b = torch.ones(3, 1).bfloat16()
    out = torch.zeros(1, 1)
    _lmhead.addmm_acc_(out, a, b)
    assert out.item() == 257.0
    assert _lmhead.mm_acc(a, b).item() == 257.0


def _module_state():
    """_lmhead's module-level data (not its functions, classes or modules), copied: a global fallback shows here."""
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(_lmhead).items()
            if not (callable(v) or inspect.ismodule(v) or k.startswith("__"))}


class _ClaimsCuda(torch.Tensor):
    is_cuda = True


def test_an_error_in_the_real_gemm_propagates_and_flips_nothing(monkeypatch):
    # The wide-output GEMM is decided once from (device type, dtypes); an out-of-memory of the real call
    # is that call's error. The old code caught it, switched every later call to upcast operands (twice
    # the memory) for the rest of the process, and retried the call that had just run out of memory.
    monkeypatch.setattr(_lmhead, "_WIDE_OUT", {("cpu", torch.bfloat16, torch.float32): True}, raising=False)
    calls = []

    def failing(real):
        def op(*args, **kwargs):
            calls.append(real.__name__)
            if "out_dtype" in kwargs:
                raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return real(*args, **kwargs)
        return op

    monkeypatch.setattr(torch, "mm", failing(torch.mm))
    monkeypatch.setattr(torch, "addmm", failing(torch.addmm))
    # CPU tensors that also claim is_cuda: the wide path is taken whichever check picks it.
    a, b = (torch.ones(*shape).bfloat16().as_subclass(_ClaimsCuda) for shape in ((4, 3), (3, 2)))
    before = _module_state()
    for call in (lambda: _lmhead.mm_acc(a, b), lambda: _lmhead.mm_acc(a, b, out=torch.empty(4, 2)),
                 lambda: _lmhead.addmm_acc_(torch.zeros(4, 2), a, b)):
        with pytest.raises(RuntimeError, match="out of memory"):
            call()
    assert calls == ["mm", "mm", "addmm"]  # no retry
    assert _module_state() == before


def test_the_wide_output_decision_is_a_probe_on_tiny_tensors(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(_lmhead, "_WIDE_OUT", {})
    assert not _lmhead.wide_output_ok(cpu, torch.bfloat16, torch.float32)  # CPU upcasts: never a probe
    assert _lmhead._WIDE_OUT == {("cpu", torch.bfloat16, torch.float32): False}
    shapes = []
    for error, supported in ((None, True), (NotImplementedError("no aten::mm.dtype for this backend"), False),
                             (TypeError("mm() got an unexpected keyword argument 'out_dtype'"), False)):
        def fake(*args, out_dtype=None, out=None, error=error):
            shapes.append(args[-1].shape)
            if error is not None:
                raise error
            result = args[0].to(out_dtype) + args[1].to(out_dtype) @ args[2].to(out_dtype) if len(args) == 3 else \
                args[0].to(out_dtype) @ args[1].to(out_dtype)
            return result if out is None else out.copy_(result)

        monkeypatch.setattr(torch, "mm", fake)
        monkeypatch.setattr(torch, "addmm", fake)
        assert _lmhead._probe_wide_out(cpu, torch.bfloat16, torch.float32) is supported
    assert set(shapes) == {(2, 2)}

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    # An out-of-memory in the probe says nothing about support: it propagates and nothing is cached.
    monkeypatch.setattr(torch, "mm", oom)
    with pytest.raises(torch.OutOfMemoryError):
        _lmhead._probe_wide_out(cpu, torch.bfloat16, torch.float32)
    monkeypatch.setattr(_lmhead, "_probe_wide_out", oom)
    monkeypatch.setattr(_lmhead, "_HAS_OUT_DTYPE", True)
    monkeypatch.setattr(_lmhead, "_WIDE_OUT", {})
    with pytest.raises(torch.OutOfMemoryError):
        _lmhead.wide_output_ok(torch.device("cuda"), torch.float16, torch.float32)
    assert _lmhead._WIDE_OUT == {}


def test_gemms_with_a_wide_output_equal_the_upcast_product_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(7, 33, generator=g).to(dtype), torch.randn(33, 5, generator=g).to(dtype)
        ref = torch.mm(a.float(), b.float())
        assert torch.equal(_lmhead.mm_acc(a, b), ref)
        start = torch.randn(7, 5, generator=g)
        assert torch.equal(_lmhead.addmm_acc_(start.clone(), a, b), start + ref if dtype != torch.float32
                           else start.clone().addmm_(a, b))


def test_every_lm_head_backward_goes_through_the_core(triton_device, monkeypatch):
    calls = []
    real = _lmhead.vocab_chunked_backward

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    for module in (logprobs_mod, kl_mod):
        monkeypatch.setattr(module, "vocab_chunked_backward", spy)
    h, w, _ = lm_head_inputs((4,), 16, 30, torch.float32, triton_device)
    rh, rw, _ = lm_head_inputs((4,), 16, 30, torch.float32, triton_device)
    h.requires_grad_()
    index = torch.randint(0, 30, (4,), device=triton_device)
    fused_token_logprobs(h, w, index).sum().backward()
    fused_full_kl(h, w, rh, rw).sum().backward()
    assert calls == [(4, 16), (4, 16)]


def test_merge_splits_equals_one_pass():
    # States of 3 vocabulary slices, one slice entirely −inf (banned tokens): the merge by (L3)/(L4)
    # equals lse, H and E_p[w] of the whole row.
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 30, dtype=torch.float64, generator=g) * 4
    z[:, 10:20] = float("-inf")
    w = torch.randn(2, 30, dtype=torch.float64, generator=g)
    parts = []
    for sl in (slice(0, 10), slice(10, 20), slice(20, 30)):
        m = z[:, sl].amax(1)
        m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        e = torch.exp(z[:, sl] - m_ref[:, None])
        t = (e * torch.where(e > 0, z[:, sl] - m_ref[:, None], torch.zeros_like(e))).sum(1)
        parts.append((m, e.sum(1), t, (e * w[:, sl]).sum(1)))
    m_part, s_part, t_part, a_part = (torch.stack(x) for x in zip(*parts))
    stats = _lmhead.merge_splits(m_part, s_part, t_part, a_part)
    log_p = torch.log_softmax(z, -1)
    p = log_p.exp()
    torch.testing.assert_close(stats.lse, torch.logsumexp(z, -1))
    torch.testing.assert_close(stats.entropy, -(p * log_p.masked_fill(p == 0, 0)).sum(-1))
    torch.testing.assert_close(stats.mean, (p * w).sum(-1))


def test_dot_precision_is_one_rule():
    # One function answers for every kernel (kl.py once answered "tf32" for bf16 on CUDA, logprobs.py "ieee").
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    try:
        for allow in (True, False):
            matmul.allow_tf32 = allow
            for dtype in (torch.bfloat16, torch.float16, torch.float64):
                assert _lmhead.dot_precision(dtype, cuda) == "ieee"
            assert _lmhead.dot_precision(torch.float32, cuda) == ("tf32" if allow else "ieee")
            assert _lmhead.dot_precision(torch.float32, cpu) == "ieee"
    finally:
        matmul.allow_tf32 = saved


@pytest.mark.parametrize("n_rows, vocab", [(1, 97), (40, 1000), (5, 16)])
def test_split_plan_covers_the_vocabulary_without_empty_splits(n_rows, vocab):
    tile = _lmhead.INTERPRETER_LMHEAD_TILE
    plan = _lmhead.split_plan(n_rows, vocab, tile, torch.device("cpu"))
    v_tiles = -(-vocab // tile.block_v)
    assert plan.splits * plan.tiles_per_split >= v_tiles > (plan.splits - 1) * plan.tiles_per_split
    assert plan.row_blocks * tile.block_n >= n_rows
