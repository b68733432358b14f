"""kl_penalty and fused_full_kl: Triton path vs float64 references, properties, bad input.

The Triton path runs on CUDA, or on CPU under TRITON_INTERPRET=1 (the
``triton_device`` fixture), so shapes here stay small.
"""
import decimal

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fastppo.kernels import kl as kl_mod
from fastppo.kernels.kl import (
    KL_ESTIMATORS,
    fused_full_kl,
    fused_full_kl_reference,
    kl_penalty,
    kl_penalty_reference,
)
from helpers import assert_close, assert_grad_close, lm_head_inputs, recorded_launches, tol, triton_device_or_skip

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((1,), (1, 1), (3, 17), (2, 5, 7), (257,))

PROPERTY_SETTINGS = settings(max_examples=20, deadline=None)


# ---------------------------------------------------------------------------
# kl_penalty
# ---------------------------------------------------------------------------


def _logprob_pair(shape, dtype, device, spread=0.7):
    """Random log-probs in [-4.1, -0.1] and a reference that differs by N(0, spread²)."""
    logp = -(torch.rand(shape) * 4 + 0.1)
    ref = logp + torch.randn(shape) * spread
    return logp.to(device=device, dtype=dtype), ref.to(device=device, dtype=dtype)


def _penalty_and_grads(fn, logp, ref, estimator, upstream):
    logp = logp.detach().requires_grad_()
    ref = ref.detach().requires_grad_()
    out = fn(logp, ref, estimator)
    d_logp, d_ref = torch.autograd.grad(out, (logp, ref), upstream.to(out.dtype))
    return out, d_logp, d_ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_penalty_matches_float64_reference(triton_device, estimator, shape, dtype):
    logp, ref = _logprob_pair(shape, dtype, triton_device)
    upstream = torch.randn(shape, device=triton_device)
    out, d_logp, d_ref = _penalty_and_grads(kl_penalty, logp, ref, estimator, upstream)
    # Truth: the same (already rounded) inputs, in float64.
    want, want_logp, want_ref = _penalty_and_grads(
        kl_penalty_reference, logp.double(), ref.double(), estimator, upstream.double()
    )
    assert out.dtype == torch.float32 and out.shape == logp.shape
    assert d_logp.dtype == dtype and d_ref.dtype == dtype
    torch.testing.assert_close(out, want.float(), **tol(torch.float32))
    # Gradients are returned in the input dtype, so they carry its rounding.
    torch.testing.assert_close(d_logp.double(), want_logp, **tol(dtype))
    torch.testing.assert_close(d_ref.double(), want_ref, **tol(dtype))


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_penalty_tiny_differences_keep_precision(triton_device, estimator):
    # Early in PPO |logp − ref| ~ 1e-4: e^{−d} + d − 1 computed naively in fp32
    # has an error of ~1e-7, i.e. 100% of k3 ≈ d²/2 = 5e-9.
    logp = -(torch.rand(64, dtype=torch.float64) * 2 + 0.5)
    ref = logp + torch.randn(64, dtype=torch.float64) * 1e-4
    logp32, ref32 = logp.float(), ref.float()
    upstream = torch.randn(64)
    out, d_logp, _ = _penalty_and_grads(
        kl_penalty, logp32.to(triton_device), ref32.to(triton_device), estimator, upstream.to(triton_device)
    )
    want, want_logp, _ = _penalty_and_grads(kl_penalty_reference, logp32.double(), ref32.double(), estimator,
                                            upstream.double())
    torch.testing.assert_close(out.cpu().double(), want.double(), rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(d_logp.cpu().double(), want_logp, rtol=1e-5, atol=1e-12)


def test_kl_penalty_non_contiguous_and_empty(triton_device):
    logp, ref = _logprob_pair((6, 5), torch.float32, triton_device)
    for est in KL_ESTIMATORS:
        got = kl_penalty(logp.t(), ref.t(), est)
        torch.testing.assert_close(got, kl_penalty_reference(logp.t(), ref.t(), est), **tol(torch.float32))
    empty = torch.empty(0, 3, device=triton_device)
    assert kl_penalty(empty, empty, "k3").shape == (0, 3)


def test_kl_penalty_definitions_match_trl_legacy(triton_device):
    # TRL ≤ 0.11 PPOTrainer._kl_penalty: "kl" → d, "abs" → |d|, "mse" → 0.5·d²; k3 from Schulman's note.
    logp, ref = _logprob_pair((4, 9), torch.float32, triton_device)
    d = (logp - ref).double()
    expected = {
        "k1": d,
        "abs": d.abs(),
        "mse": 0.5 * d.square(),
        "k2": 0.5 * d.square(),
        "k3": torch.exp(ref.double() - logp.double()) - (ref.double() - logp.double()) - 1,
    }
    for est, want in expected.items():
        torch.testing.assert_close(kl_penalty(logp, ref, est).double(), want, **tol(torch.float32))


@pytest.mark.parametrize("path", ["triton", "reference"])
@PROPERTY_SETTINGS
@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([1e-6, 1e-3, 0.3, 3.0, 20.0]),
)
def test_kl_penalty_properties(path, n, seed, scale):
    if path == "triton":
        device, fn = triton_device_or_skip(), kl_penalty  # hypothesis cannot take the function-scoped fixture
    else:
        device, fn = torch.device("cpu"), kl_penalty_reference
    gen = torch.Generator().manual_seed(seed)
    logp = -(torch.rand(n, generator=gen) * 10 + 0.01)
    ref = logp + torch.randn(n, generator=gen) * scale
    logp, ref = logp.to(device), ref.to(device)
    vals = {est: fn(logp, ref, est) for est in KL_ESTIMATORS}
    for est in ("k2", "k3", "abs", "mse"):
        assert (vals[est] >= 0).all(), est
    torch.testing.assert_close(fn(ref, logp, "k1"), -vals["k1"], rtol=0, atol=0)
    for est in ("k2", "abs", "mse"):  # symmetric in (logp, ref)
        torch.testing.assert_close(fn(ref, logp, est), vals[est], rtol=0, atol=0)
    torch.testing.assert_close(vals["mse"], vals["k2"], rtol=0, atol=0)
    # Equal, non-zero inputs: every estimator is exactly zero.
    for est in KL_ESTIMATORS:
        assert (fn(logp, logp.clone(), est) == 0).all(), est


def test_kl_penalty_float64_stays_float64(triton_device):
    """fp64 log-probs are computed and returned in fp64 on both paths (issue 36: the kernel cast them to fp32
    before subtracting), k3's series included: |d| from 1e-9 to 3, against the definitions in float64."""
    logp, ref = _logprob_pair((4, 6), torch.float64, triton_device)
    scale = torch.logspace(-9, 0.5, 24, dtype=torch.float64, device=triton_device).view(4, 6)
    sign = torch.where(torch.rand(4, 6, device=triton_device) < 0.5, -1.0, 1.0).double()
    ref = (logp - sign * scale).detach()  # d = logp − ref = ±scale
    upstream = torch.randn(4, 6, dtype=torch.float64, device=triton_device)
    d = (logp - ref).detach()
    with decimal.localcontext() as ctx:  # k3 in 50 digits: expm1(−d) + d itself cancels at d = 1e-9
        ctx.prec = 50
        exact = [(decimal.Decimal(x).exp() ** -1 + decimal.Decimal(x) - 1, 1 - decimal.Decimal(x).exp() ** -1)
                 for x in d.flatten().tolist()]
    k3 = torch.tensor([[float(v) for v, _ in exact], [float(g) for _, g in exact]], dtype=torch.float64)
    k3 = k3.to(d.device).view(2, *d.shape)
    oracle = {"k1": (d, torch.ones_like(d)), "k2": (d * d / 2, d), "mse": (d * d / 2, d),
              "k3": (k3[0], k3[1]), "abs": (d.abs(), d.sign())}
    for fn in (kl_penalty, kl_penalty_reference):
        for est in KL_ESTIMATORS:
            out, d_logp, d_ref = _penalty_and_grads(fn, logp, ref, est, upstream)
            assert out.dtype == torch.float64 and d_logp.dtype == torch.float64, (fn.__name__, est)
            value, slope = oracle[est]
            torch.testing.assert_close(out, value, rtol=1e-13, atol=0)
            torch.testing.assert_close(d_logp, upstream * slope, rtol=1e-13, atol=0)
            torch.testing.assert_close(d_ref, -upstream * slope, rtol=1e-13, atol=0)


def test_kl_penalty_mixed_dtypes_compute_in_the_wider(triton_device):
    """bf16 policy log-probs beside fp64 reference ones: fp64, as the reference path promotes."""
    logp, ref = _logprob_pair((3, 5), torch.float64, triton_device)
    for est in KL_ESTIMATORS:
        got = kl_penalty(logp.bfloat16(), ref, est)
        want = kl_penalty_reference(logp.bfloat16().double(), ref, est)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------------------
# fused_full_kl
# ---------------------------------------------------------------------------


def _models(lead, hid, hid_ref, vocab, dtype, device, scale=1.0, bias=False):
    """Policy and reference (hidden, weight, bias) with O(1)·scale logits; biases only with ``bias``."""
    hidden, weight, b = lm_head_inputs(lead, hid, vocab, dtype, device, bias=bias, logit_scale=3.0)
    ref_hidden, ref_weight, ref_b = lm_head_inputs(lead, hid_ref, vocab, dtype, device, bias=bias, logit_scale=3.0)
    if scale != 1.0:
        hidden, ref_hidden = hidden * scale, ref_hidden * scale
    return (hidden, weight, ref_hidden, ref_weight) + ((b, ref_b) if bias else ())


def _full_kl_and_grads(fn, hidden, weight, ref_hidden, ref_weight, temperature, upstream, bias=None, ref_bias=None):
    """(kl, grad_hidden, grad_weight[, grad_bias]) for the upstream gradient."""
    params = [hidden.detach().requires_grad_(), weight.detach().requires_grad_()]
    if bias is not None:
        params.append(bias.detach().requires_grad_())
    kl = fn(params[0], params[1], ref_hidden, ref_weight, temperature, bias=params[2] if bias is not None else None,
            ref_bias=ref_bias)
    return (kl, *torch.autograd.grad(kl, params, upstream.to(kl.dtype)))


FULL_KL_CASES = [
    # lead, H, H_ref, V, temperature, dtype, biases
    ((5,), 16, 16, 37, 1.0, torch.float32, False),
    ((1,), 24, 40, 130, 0.3, torch.float32, True),
    ((2, 3), 32, 16, 37, 1.7, torch.float32, True),
    ((20,), 16, 24, 100, 1.0, torch.float32, False),  # two row blocks, several V chunks
    ((2, 3), 16, 16, 130, 1.0, torch.bfloat16, True),
    ((7,), 16, 24, 37, 0.3, torch.float16, False),
    ((3,), 16, 24, 53, 1.75, torch.float64, True),  # fp64 end to end: held to fp64 tolerances
]


@pytest.mark.parametrize("lead,hid,hid_ref,vocab,temperature,dtype,biases", FULL_KL_CASES, ids=str)
def test_fused_full_kl_matches_float64_reference(triton_device, lead, hid, hid_ref, vocab, temperature, dtype, biases):
    h, w, rh, rw, *b = _models(lead, hid, hid_ref, vocab, dtype, triton_device, bias=biases)
    bias, ref_bias = b if biases else (None, None)
    upstream = torch.randn(lead, device=triton_device)
    got = _full_kl_and_grads(fused_full_kl, h, w, rh, rw, temperature, upstream, bias, ref_bias)
    as64 = [None if t is None else t.double() for t in (h, w, rh, rw, bias, ref_bias)]
    want = _full_kl_and_grads(fused_full_kl_reference, *as64[:4], temperature, upstream.double(), *as64[4:])
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert got[0].shape == lead and got[0].dtype == acc
    assert [g.dtype for g in got[1:]] == [dtype] * len(got[1:])
    # The forward accumulates in fp32 (fp64 for fp64) whatever the input dtype.
    assert_close(got[0], want[0], acc, extra_atol=0.0 if dtype == torch.float64 else 1e-5)
    for g, g_ref in zip(got[1:], want[1:]):
        assert g.abs().max() > 0
        assert_grad_close(g, g_ref, dtype)


def test_fused_full_kl_gradcheck_fp64(triton_device):
    h, w, rh, rw, b, rb = _models((3,), 16, 16, 40, torch.float64, triton_device, bias=True)
    fn = lambda h, w, b: fused_full_kl(h, w, rh, rw, 0.5, bias=b, ref_bias=rb)  # noqa: E731
    torch.autograd.gradcheck(fn, (h.requires_grad_(), w.requires_grad_(), b.requires_grad_()), fast_mode=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NumPy, on lanes the kernel drops
def test_fused_full_kl_banned_tokens(triton_device):
    # −inf biases (vocabulary masking) in both models, covering a whole first tile and split boundaries;
    # one more token banned by the policy only (p = 0 there: it adds nothing, whatever q is).
    h, w, rh, rw, b, rb = _models((4,), 16, 16, 100, torch.float32, triton_device, bias=True)
    banned = torch.zeros(100, dtype=torch.bool, device=triton_device)
    banned[:40] = True
    banned[60::7] = True
    b, rb = b.masked_fill(banned, float("-inf")), rb.masked_fill(banned, float("-inf"))
    b[50] = float("-inf")
    upstream = torch.randn(4, device=triton_device)
    got = _full_kl_and_grads(fused_full_kl, h, w, rh, rw, 1.0, upstream, b, rb)
    want = _full_kl_and_grads(fused_full_kl_reference, h.double(), w.double(), rh.double(), rw.double(), 1.0,
                              upstream.double(), b.double(), rb.double())
    assert all(torch.isfinite(t).all() for t in got)
    assert_close(got[0], want[0], torch.float32)
    for g, g_ref in zip(got[1:], want[1:]):
        assert_grad_close(g, g_ref, torch.float32)
    assert (got[2][banned] == 0).all() and (got[3][banned] == 0).all()  # no gradient to banned tokens


def test_fused_full_kl_tied_weights_are_read_in_place(triton_device):
    # Tied embeddings as LM heads through transposed views: the kernel reads their strides, nothing is copied.
    emb, ref_emb = torch.randn(16, 45, device=triton_device), torch.randn(24, 45, device=triton_device)
    h, rh = torch.randn(5, 16, device=triton_device), torch.randn(5, 24, device=triton_device)
    with recorded_launches(kl_mod, "_full_kl_fwd_kernel") as launches:
        kl = fused_full_kl(h, emb.T, rh, ref_emb.T)
    assert [(a[3].data_ptr(), a[11].data_ptr()) for a in launches] == [(emb.data_ptr(), ref_emb.data_ptr())]
    assert_close(kl, fused_full_kl_reference(h.double(), emb.T.double(), rh.double(), ref_emb.T.double()),
                 torch.float32)


def test_fused_full_kl_reference_is_the_kl_divergence():
    # The reference against TRL's legacy "full" formula, F.kl_div(log q, log p, log_target) summed over V.
    h, w, rh, rw = _models((2, 4), 8, 12, 29, torch.float64, "cpu")
    log_p = torch.log_softmax(h @ w.t() / 0.7, -1)
    log_q = torch.log_softmax(rh @ rw.t() / 0.7, -1)
    want = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(fused_full_kl_reference(h, w, rh, rw, 0.7).double(), want, rtol=1e-6, atol=1e-7)


def test_fused_full_kl_large_magnitude(triton_device):
    # Logits of order 1e3–1e4: exp would overflow without the running max.
    h, w, rh, rw = _models((4,), 16, 16, 37, torch.float32, triton_device, scale=300.0)
    upstream = torch.randn(4, device=triton_device)
    kl, d_h, d_w = _full_kl_and_grads(fused_full_kl, h, w, rh, rw, 1.0, upstream)
    want, want_h, want_w = _full_kl_and_grads(
        fused_full_kl_reference, h.double(), w.double(), rh.double(), rw.double(), 1.0, upstream.double()
    )
    assert torch.isfinite(kl).all() and torch.isfinite(d_h).all() and torch.isfinite(d_w).all()
    logit_scale = (h.double() @ w.double().t()).abs().max().item()
    assert logit_scale > 1e3
    # fp32 logits of size L carry ~L·6e-8 of rounding each; the KL inherits it.
    torch.testing.assert_close(kl.double(), want.double(), rtol=1e-5, atol=logit_scale * 1e-6)
    # The gradients: dz = p·(log p − log q − KL) pairs the forward's KL with log-ratios recomputed in the
    # backward. Here p is one-hot, the exact dz is 0 and the KL is 220–3,600 nats, so a few fp32 ulps of the
    # KL survive the cancellation and are multiplied by |h| (for d_w) or |w| (for d_h): 0.18 on an H100's
    # tiled dot, 1e-39 under the interpreter's numpy dot. Bound it by 4 ulps of each row's KL; PPO's KLs
    # are small, where the same bound is tight.
    ulps = 4 * torch.finfo(torch.float32).eps * upstream.abs().double().cpu() * want.detach().abs().cpu()
    rounding_w = (ulps * h.double().abs().amax(-1).cpu()).sum().item()
    rounding_h = ulps.max().item() * w.abs().max().item()
    assert_grad_close(d_h, want_h, torch.float32, extra_atol=rounding_h + logit_scale * 1e-6)
    assert_grad_close(d_w, want_w, torch.float32, extra_atol=rounding_w + logit_scale * 1e-6)


def test_fused_full_kl_nonnegative_and_zero_for_identical_models(triton_device):
    h, w, rh, rw = _models((3, 4), 16, 24, 70, torch.float32, triton_device)
    kl = fused_full_kl(h, w, rh, rw, 1.0)
    assert (kl > 0).all()
    # Same random weights and states (policy == reference, as at PPO step 0).
    h_same = h.detach().clone().requires_grad_()
    w_same = w.detach().clone().requires_grad_()
    kl0 = fused_full_kl(h_same, w_same, h.clone(), w.clone(), 0.8)
    torch.testing.assert_close(kl0, torch.zeros_like(kl0), rtol=0, atol=1e-6)
    kl0.sum().backward()
    # zero up to fp32 rounding: the backward recomputes the policy's logits in its own tiles, so p − q is a few
    # ulps, not 0 (1.2e-6 in the weight's gradient on an H100)
    torch.testing.assert_close(h_same.grad, torch.zeros_like(h), rtol=0, atol=1e-5)
    torch.testing.assert_close(w_same.grad, torch.zeros_like(w), rtol=0, atol=1e-5)


def test_fused_full_kl_edge_shapes(triton_device):
    # One token as a 1-D hidden state: a 0-D KL.
    h, w, rh, rw = _models((), 16, 16, 37, torch.float32, triton_device)
    kl = fused_full_kl(h, w, rh, rw)
    assert kl.shape == ()
    torch.testing.assert_close(kl, fused_full_kl_reference(h, w, rh, rw), rtol=1e-5, atol=1e-5)
    # Non-contiguous states (every other token of a [B, T, H] batch).
    h, w, rh, rw = _models((2, 6), 16, 16, 37, torch.float32, triton_device)
    torch.testing.assert_close(fused_full_kl(h[:, ::2], w, rh[:, ::2], rw),
                               fused_full_kl_reference(h[:, ::2], w, rh[:, ::2], rw), rtol=1e-5, atol=1e-5)
    # No tokens: empty result, and backward still runs.
    h = torch.randn(0, 3, 16, device=triton_device, requires_grad=True)
    kl = fused_full_kl(h, w, torch.randn(0, 3, 16, device=triton_device), rw)
    assert kl.shape == (0, 3)
    kl.sum().backward()
    assert h.grad.shape == h.shape


def test_fused_full_kl_reference_side_is_frozen(triton_device):
    h, w, rh, rw = _models((3,), 16, 16, 37, torch.float32, triton_device)
    for t in (h, w, rh, rw):
        t.requires_grad_()
    fused_full_kl(h, w, rh, rw).sum().backward()
    assert h.grad is not None and w.grad is not None
    assert rh.grad is None and rw.grad is None


def test_fused_full_kl_only_weight_needs_grad(triton_device):
    h, w, rh, rw = _models((3,), 16, 16, 37, torch.float32, triton_device)
    w.requires_grad_()
    fused_full_kl(h, w, rh, rw).sum().backward()
    want_w = w.detach().double().requires_grad_()
    fused_full_kl_reference(h.double(), want_w, rh.double(), rw.double()).sum().backward()
    assert_grad_close(w.grad, want_w.grad, torch.float32)


# ---------------------------------------------------------------------------
# Reference path (CPU tensors with the interpreter switched off)
# ---------------------------------------------------------------------------


def test_reference_path_is_taken_on_cpu(reference_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the Triton path ran on the reference path")

    monkeypatch.setattr(kl_mod._KLPenalty, "apply", fail)
    monkeypatch.setattr(kl_mod._FusedFullKL, "apply", fail)
    logp, ref = _logprob_pair((3, 5), torch.bfloat16, "cpu")
    logp.requires_grad_()
    for est in KL_ESTIMATORS:
        out = kl_penalty(logp, ref, est)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, kl_penalty_reference(logp, ref, est))
    kl_penalty(logp, ref, "k3").sum().backward()
    assert logp.grad is not None and logp.grad.dtype == torch.bfloat16

    h, w, rh, rw = _models((2, 3), 8, 8, 19, torch.float32, "cpu")
    h.requires_grad_()
    rw.requires_grad_()
    kl = fused_full_kl(h, w, rh, rw, 1.3)
    torch.testing.assert_close(kl, fused_full_kl_reference(h, w, rh, rw, 1.3))
    kl.sum().backward()
    assert h.grad is not None and rw.grad is None


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [kl_penalty, kl_penalty_reference])
def test_kl_penalty_bad_input(fn):
    logp, ref = _logprob_pair((3, 4), torch.float32, "cpu")
    with pytest.raises(ValueError, match="estimator must be one of k1, k2, k3, abs, mse"):
        fn(logp, ref, "kl")
    with pytest.raises(ValueError, match="estimator"):
        fn(logp, ref, None)
    with pytest.raises(TypeError, match="logprobs"):
        fn(torch.ones(3, 4, dtype=torch.int64), ref, "k1")
    with pytest.raises(TypeError, match="ref_logprobs"):
        fn(logp, torch.ones(3, 4, dtype=torch.int32), "k1")
    with pytest.raises(TypeError, match="logprobs"):
        fn(logp.tolist(), ref, "k1")
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        fn(logp, ref[:, :3], "k1")
    with pytest.raises(ValueError, match="ref_logprobs is on meta"):
        fn(logp, ref.to("meta"), "k1")


@pytest.mark.parametrize("fn", [fused_full_kl, fused_full_kl_reference])
def test_fused_full_kl_bad_input(fn):
    h, w, rh, rw = _models((2, 3), 8, 12, 19, torch.float32, "cpu")
    for bad_t in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            fn(h, w, rh, rw, bad_t)
    with pytest.raises(ValueError, match="ref_weight has vocabulary size 18"):
        fn(h, w, rh, rw[:18])
    with pytest.raises(ValueError, match="hidden has last dimension 8.*weight"):
        fn(h, w[:, :7], rh, rw)
    with pytest.raises(ValueError, match="ref_hidden has last dimension 12.*ref_weight"):
        fn(h, w, rh, rw[:, :11])
    with pytest.raises(ValueError, match="ref_hidden has leading shape"):
        fn(h, w, rh[:, :2], rw)
    with pytest.raises(TypeError, match="hidden must have dtype"):
        fn(torch.ones(2, 3, 8, dtype=torch.int64), w, rh, rw)
    with pytest.raises(TypeError, match="ref_weight must have dtype"):
        fn(h, w, rh, rw.to(torch.int32))
    with pytest.raises(TypeError, match="weight has dtype torch.bfloat16 but hidden has torch.float32"):
        fn(h, w.bfloat16(), rh, rw)
    with pytest.raises(ValueError, match="ref_bias has shape"):
        fn(h, w, rh, rw, bias=torch.randn(19), ref_bias=torch.randn(18))
    with pytest.raises(TypeError, match="bias must have dtype"):
        fn(h, w, rh, rw, bias=torch.ones(19, dtype=torch.int64))
    with pytest.raises(ValueError, match="bias is on meta"):
        fn(h, w, rh, rw, bias=torch.randn(19, device="meta"))
    with pytest.raises(ValueError, match="weight must be 2-D"):
        fn(h, w[None], rh, rw)
    with pytest.raises(ValueError, match="ref_weight is on meta"):
        fn(h, w, rh, rw.to("meta"))
