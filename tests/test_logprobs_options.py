"""The LM-head kernels' options for other trainers: ignore_index, softcap/logit_scale, outputs, compute dtype.

Every case is held to a float64 oracle written here from the definitions
(not to ``fastppo``'s own references), on the Triton path (the interpreter on
a CPU machine) and on the reference path. Shapes are tiny for the
interpreter but cover several vocabulary tiles, splits and backward chunks.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastppo.kernels import TokenStats, fused_token_logprobs, fused_token_logprobs_reference, token_logprobs
from fastppo.kernels import token_logprobs_reference
from helpers import assert_close, assert_grad_close, lm_head_inputs, triton_device_or_skip
from helpers import lm_head_stats_oracle as oracle

ALL = ("logprobs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
PATHS = pytest.mark.parametrize("path", ["triton", "reference"])


def _device(path, monkeypatch):
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return torch.device("cpu")
    return triton_device_or_skip()


def _grads(out_logp, out_ent, params, upstream):
    loss = (out_logp.double() * upstream[0]).sum() + (out_ent.double() * upstream[1]).sum()
    return torch.autograd.grad(loss, params)


@PATHS
@pytest.mark.parametrize("softcap, logit_scale, temperature", [(None, 1.0, 1.0), (None, 0.25, 0.7), (3.0, 1.0, 1.3),
                                                               (2.0, 4.0, 0.6)])
def test_softcap_and_logit_scale_forward_and_backward(path, monkeypatch, softcap, logit_scale, temperature):
    device = _device(path, monkeypatch)
    g = torch.Generator().manual_seed(7)
    hidden, weight, bias = lm_head_inputs((2, 5), 24, 70, torch.float32, device, bias=True, logit_scale=4.0,
                                          generator=g)
    index = torch.randint(0, 70, (2, 5), generator=g).to(device)
    params = [t.requires_grad_() for t in (hidden, weight, bias)]
    out = fused_token_logprobs(hidden, weight, index, temperature, bias=bias, softcap=softcap,
                               logit_scale=logit_scale, outputs=("logprobs", "entropy"))
    leaves = [t.detach().double().requires_grad_() for t in params]
    ref = oracle(*leaves[:2], leaves[2], index, temperature, softcap, logit_scale)
    assert_close(out.logprobs, ref["logprobs"], torch.float32)
    assert_close(out.entropy, ref["entropy"], torch.float32)
    if softcap is not None:  # the cap matters here: the uncapped logits give other numbers
        uncapped = oracle(*leaves[:2], leaves[2], index, temperature, None, logit_scale)
        assert (uncapped["logprobs"] - out.logprobs.double()).abs().max() > 1e-2
    upstream = tuple(torch.randn(2, 5, dtype=torch.float64, generator=g).to(device) for _ in range(2))
    for got, want in zip(_grads(out.logprobs, out.entropy, params, upstream),
                         _grads(ref["logprobs"], ref["entropy"], leaves, upstream)):
        assert got.abs().max() > 0
        assert_grad_close(got, want, torch.float32)


def test_softcap_gradcheck_triton_fp64():
    device = triton_device_or_skip()
    hidden = torch.randn(3, 16, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(20, 16, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(20, dtype=torch.float64, device=device, requires_grad=True)
    index = torch.tensor([0, 19, 7], device=device)

    def fn(h, w, b):
        out = fused_token_logprobs(h, w, index, 0.8, bias=b, softcap=2.5, logit_scale=1.5,
                                   outputs=("logprobs", "entropy"))
        return out.logprobs, out.entropy

    torch.autograd.gradcheck(fn, (hidden, weight, bias), fast_mode=True)


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_ignore_index_rows_are_zero_pass_no_gradient_and_leave_the_others_unchanged(path, monkeypatch, dtype):
    device = _device(path, monkeypatch)
    g = torch.Generator().manual_seed(3)
    hidden, weight, _ = lm_head_inputs((4, 5), 16, 50, dtype, device, generator=g)
    index = torch.randint(0, 50, (4, 5), generator=g).to(device)
    index[0, :3] = -100  # a prompt
    index[2, 4] = -100  # padding
    index[3] = -100  # a row with nothing to score
    hidden.requires_grad_()
    weight.requires_grad_()
    out = fused_token_logprobs(hidden, weight, index, 0.9, outputs=ALL)
    keep = index != -100
    for name in ALL:
        field = getattr(out, name)
        assert field.shape == index.shape
        assert not field[~keep].any(), name  # 0 / False on ignored rows
    ref = oracle(hidden.detach(), weight.detach(), None, index, 0.9)
    for name in ("logprobs", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert_close(getattr(out, name)[keep], ref[name][keep], dtype)
    assert torch.equal(out.is_top1, ref["is_top1"]) or dtype != torch.float64
    # Gradients: the ignored rows' hidden states get exactly zero; the weight's equals the kept rows' alone.
    upstream = torch.randn(4, 5, dtype=torch.float64, generator=g).to(device)
    grad_h, grad_w = torch.autograd.grad((out.logprobs.double() * upstream).sum() + out.entropy.double().sum(),
                                         (hidden, weight))
    assert not grad_h[~keep].any() and grad_h[keep].abs().amax(-1).min() > 0
    kept_h = hidden.detach()[keep].double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    sub = oracle(kept_h, w64, None, index[keep], 0.9)
    want_h, want_w = torch.autograd.grad((sub["logprobs"] * upstream[keep]).sum() + sub["entropy"].sum(), (kept_h, w64))
    assert_grad_close(grad_h[keep], want_h, dtype)
    assert_grad_close(grad_w, want_w, dtype)


@PATHS
def test_ignore_index_on_token_logprobs_and_turned_off(path, monkeypatch):
    device = _device(path, monkeypatch)
    logits = torch.randn(3, 4, 37, device=device, requires_grad=True)
    index = torch.randint(0, 37, (3, 4), device=device)
    index[1, 1:] = -100
    lp, ent = token_logprobs(logits, index, 1.1, return_entropy=True)
    keep = index != -100
    ref_lp, ref_ent = token_logprobs_reference(logits.detach().double()[keep], index[keep], 1.1, return_entropy=True)
    assert_close(lp[keep], ref_lp, torch.float32)
    assert_close(ent[keep], ref_ent, torch.float32)
    assert not lp[~keep].any() and not ent[~keep].any()
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), logits)
    assert not grad[~keep].any() and grad[keep].abs().amax(-1).min() > 0
    # Another ignore value, and none: then -100 is an out-of-range index, refused by name.
    index7 = torch.where(keep, index, 7)
    assert torch.equal(token_logprobs(logits, index7, 1.1, ignore_index=7)[index7 == 7], torch.zeros(3, device=device))
    if device.type == "cuda":  # the range check costs a host sync: reference path and interpreter only (by design)
        return
    with pytest.raises(ValueError, match=r"index values must lie in \[0, 37\), got min -100"):
        token_logprobs(logits, index, 1.1, ignore_index=None)


@PATHS
@pytest.mark.parametrize("vocab, with_bias", [(70, True), (33, False)])
def test_statistics_of_the_same_pass(path, monkeypatch, vocab, with_bias):
    device = _device(path, monkeypatch)
    g = torch.Generator().manual_seed(11)
    hidden, weight, bias = lm_head_inputs((9,), 20, vocab, torch.float32, device, bias=with_bias, generator=g)
    weight[5] = weight[2]  # tokens 2 and 5 tie in every row: only the first counts as the argmax
    if bias is not None:
        bias[5] = bias[2]
        bias[9] = float("-inf")  # a banned token: p = 0
    z = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
    top = z.argmax(-1)
    index = torch.randint(0, vocab, (9,), generator=g).to(device)
    index[:3] = top[:3]  # certain top-1 hits
    hidden[3] = 4 * weight[2]  # rows 3, 4 peak at the tie: target 2 is the top-1, target 5 is not
    hidden[4] = 4 * weight[2]
    index[3], index[4] = 2, 5
    out = fused_token_logprobs(hidden, weight, index, 1.0, bias=bias, outputs=ALL, softcap=8.0)
    ref = oracle(hidden, weight, bias, index, 1.0, softcap=8.0)
    for name in ("logprobs", "entropy", "log_sum_sq_probs"):
        assert_close(getattr(out, name), ref[name], torch.float32)
    if bias is None:
        assert_close(out.mean_logits, ref["mean_logits"], torch.float32)
    else:  # a banned token's capped logit is −cap, not −inf: (L7) caps the bias as well
        assert_close(out.mean_logits, ref["mean_logits"], torch.float32)
    assert out.is_top1.dtype == torch.bool
    assert torch.equal(out.is_top1, ref["is_top1"])
    assert out.is_top1[:4].all() and not out.is_top1[4]
    # Statistics carry no gradient; the requested differentiable fields still do.
    assert not out.log_sum_sq_probs.requires_grad and not out.mean_logits.requires_grad


@PATHS
def test_entropy_only_needs_no_index(path, monkeypatch):
    device = _device(path, monkeypatch)
    hidden, weight, _ = lm_head_inputs((2, 3), 16, 45, torch.float32, device)
    hidden.requires_grad_()
    out = fused_token_logprobs(hidden, weight, None, 0.7, outputs="entropy")
    assert isinstance(out, TokenStats) and out.logprobs is None and out.is_top1 is None
    _, ent = fused_token_logprobs(hidden, weight, torch.zeros(2, 3, dtype=torch.long, device=device), 0.7, return_entropy=True)
    torch.testing.assert_close(out.entropy, ent)
    want = oracle(hidden.detach(), weight, None, torch.zeros(2, 3, dtype=torch.long, device=device), 0.7)["entropy"]
    assert_close(out.entropy, want, torch.float32)
    (grad,) = torch.autograd.grad(out.entropy.sum(), hidden)
    assert grad.abs().min() > 0
    logits = (hidden @ weight.T).detach()
    only = token_logprobs(logits, None, 0.7, outputs=("entropy",))
    torch.testing.assert_close(only.entropy, ent.detach(), atol=1e-5, rtol=1e-5)


def test_mixed_dtypes_follow_trls_compute_dtype_rule(reference_path):
    """hidden fp32 with a bf16 weight computes in fp32 (hidden's dtype); under autocast, in autocast's dtype;
    an explicit compute_dtype wins. Gradients reach each tensor in its own dtype."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 32, generator=g, requires_grad=True)
    weight16 = (torch.randn(40, 32, generator=g) / 4).bfloat16().requires_grad_()
    index = torch.randint(0, 40, (6,), generator=g)
    lp = fused_token_logprobs(hidden, weight16, index)
    assert_close(lp, oracle(hidden.detach(), weight16.detach(), None, index)["logprobs"], torch.float32)
    grad_h, grad_w = torch.autograd.grad(lp.sum(), (hidden, weight16))
    assert grad_h.dtype == torch.float32 and grad_w.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = fused_token_logprobs(hidden, weight16.float(), index)
    explicit = fused_token_logprobs(hidden, weight16.float(), index, compute_dtype=torch.bfloat16)
    torch.testing.assert_close(auto, explicit, atol=0, rtol=0)
    # bf16 operands, fp32 accumulation: the oracle on the rounded operands, not on the fp32 ones.
    assert_close(auto, oracle(hidden.detach().bfloat16(), weight16.detach(), None, index)["logprobs"], torch.float32)
    assert (auto - lp).abs().max() > 1e-4  # the operands were rounded, as TRL rounds them
    # The reference under autocast computes what it says (its matmul is not silently autocast).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = fused_token_logprobs_reference(hidden, weight16.float(), index)
    torch.testing.assert_close(ref, explicit, atol=1e-6, rtol=1e-6)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 12), vocab=st.integers(2, 60), cap=st.sampled_from([None, 1.5, 30.0]),
       scale=st.sampled_from([1.0, 0.0625, 3.0]), temperature=st.floats(0.3, 2.0), ignore=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**16))
def test_options_property_triton_equals_the_float64_oracle(n, vocab, cap, scale, temperature, ignore, seed):
    device = triton_device_or_skip()
    g = torch.Generator().manual_seed(seed)
    hidden, weight, bias = lm_head_inputs((n,), 16, vocab, torch.float32, device, bias=True, generator=g)
    index = torch.randint(0, vocab, (n,), generator=g)
    index[torch.rand(n, generator=g) < ignore] = -100
    index = index.to(device)
    out = fused_token_logprobs(hidden, weight, index, temperature, bias=bias, softcap=cap, logit_scale=scale,
                               outputs=ALL)
    ref = oracle(hidden, weight, bias, index, temperature, cap, scale)
    for name in ("logprobs", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert_close(getattr(out, name), ref[name], torch.float32, extra_atol=1e-5 * math.sqrt(vocab))
    # is_top1 may differ only where the two largest logits tie to fp32 rounding
    x = scale * (hidden.double() @ weight.double().T + bias.double())
    z = (x if cap is None else cap * torch.tanh(x / cap)) / temperature
    top2 = z.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1e-4
    assert torch.equal(out.is_top1[clear], ref["is_top1"][clear])
