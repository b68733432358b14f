"""The chunked PyTorch path of the LM-head log-probs (``_lmhead.chunked_lm_head_stats``), what
``fused_token_logprobs`` runs on CPU tensors without the interpreter: held to a float64 oracle on
fresh random inputs, over tiles small enough that every shape splits into several row blocks and
vocabulary chunks (ragged last ones included), and shown never to allocate an [N, V] tensor.
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastppo.kernels import _lmhead, fused_token_logprobs, fused_token_logprobs_reference
from fastppo.kernels import custom_ops
from fastppo.kernels import logprobs as logprobs_module
from fastppo.kernels._lmhead import ChunkPlan, LogitTransform, chunk_plan, chunked_lm_head_stats
from fastppo.kernels._lmhead import chunked_logprobs_entropy
from helpers import assert_close, assert_grad_close, lm_head_inputs
from helpers import lm_head_stats_oracle as oracle

ALL = ("logprobs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
H, V = 12, 53  # V prime: no chunk width divides it


@pytest.fixture
def small_tiles(reference_path, monkeypatch):
    """The public CPU path with tiles of at most 8 rows × 8 columns (7 vocabulary chunks of 53)."""
    monkeypatch.setattr(_lmhead, "CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(_lmhead, "MIN_CHUNK_COLS", 8)


def _inputs(n, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden, weight, b = lm_head_inputs((n,), H, V, dtype, "cpu", bias=bias, generator=g)
    index = torch.randint(0, V, (n,), generator=g)
    leaves = [t.requires_grad_() for t in (hidden, weight, b) if t is not None]
    return hidden, weight, b, index, leaves


def _upstream(n, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


def _check_against_oracle(out_logp, out_ent, want, leaves, dtype, seed, n):
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert out_logp.dtype == out_dtype
    # The operands are exact in fp32 whatever their dtype: the results are fp32 (fp64) accurate.
    assert_close(out_logp, want["logprobs"], out_dtype)
    up_logp, up_ent = _upstream(n, seed)
    loss = (out_logp.double() * up_logp).sum()
    want_loss = (want["logprobs"] * up_logp).sum()
    if out_ent is not None:
        assert_close(out_ent, want["entropy"], out_dtype)
        loss = loss + (out_ent.double() * up_ent).sum()
        want_loss = want_loss + (want["entropy"] * up_ent).sum()
    got = torch.autograd.grad(loss, leaves)
    expected = torch.autograd.grad(want_loss, leaves)
    for g, e, leaf in zip(got, expected, leaves):
        assert g.dtype == leaf.dtype
        assert_grad_close(g, e, dtype)  # the gradient is rounded to the leaf's dtype
        assert g.abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n, bias, temperature, entropy", [
    (19, True, 0.7, True),  # 3 row blocks, the last one ragged
    (5, False, 1.0, True),  # fewer rows than a block
    (1, True, 1.3, False),
    (16, True, 1.0, False),  # whole row blocks
    (7, False, 0.45, True),
])
def test_public_cpu_path_equals_the_float64_oracle(small_tiles, dtype, n, bias, temperature, entropy):
    seed = n * 7 + int(bias) + int(entropy) * 3
    hidden, weight, b, index, leaves = _inputs(n, dtype, seed, bias)
    got = fused_token_logprobs(hidden, weight, index, temperature, bias=b, return_entropy=entropy)
    logp, ent = got if entropy else (got, None)
    want = oracle(hidden, weight, b, index, temperature)
    _check_against_oracle(logp, ent, want, leaves, dtype, seed, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [ChunkPlan(4, 9), ChunkPlan(64, 5), ChunkPlan(1, 53), 11, None])
def test_chunked_helper_equals_the_float64_oracle(dtype, chunk):
    """``chunked_logprobs_entropy`` (the core a CPU policy loss builds on) under several tilings."""
    n = 13
    hidden, weight, b, index, leaves = _inputs(n, dtype, 3, bias=True)
    logp, ent = chunked_logprobs_entropy(hidden, weight, b, index, 0.8, chunk=chunk)
    _check_against_oracle(logp, ent, oracle(hidden, weight, b, index, 0.8), leaves, dtype, 3, n)
    logp_only, none = chunked_logprobs_entropy(hidden, weight, b, index, 0.8, compute_entropy=False, chunk=chunk)
    assert none is None
    torch.testing.assert_close(logp_only, logp, atol=0, rtol=0)


@pytest.mark.parametrize("softcap, logit_scale, temperature", [(None, 0.25, 0.7), (3.0, 1.0, 1.3), (2.0, 4.0, 0.6)])
def test_every_output_with_caps_and_scales(small_tiles, softcap, logit_scale, temperature):
    n = 11
    hidden, weight, b, index, leaves = _inputs(n, torch.float32, 5)
    out = fused_token_logprobs(hidden, weight, index, temperature, bias=b, outputs=ALL, softcap=softcap,
                               logit_scale=logit_scale)
    want = oracle(hidden, weight, b, index, temperature, softcap, logit_scale)
    for name in ALL[2:4]:
        assert_close(getattr(out, name), want[name], torch.float32)
    assert torch.equal(out.is_top1, want["is_top1"])
    _check_against_oracle(out.logprobs, out.entropy, want, leaves, torch.float32, 5, n)


def test_is_top1_takes_the_first_maximum_across_chunks(small_tiles):
    """Ties in different vocabulary chunks: the first one is the argmax, as ``argmax`` counts it."""
    hidden = torch.ones(3, 2)
    weight = torch.zeros(V, 2)
    weight[[4, 20, 40], 0] = 5.0  # equal top logits in chunks 0, 2 and 5
    index = torch.tensor([4, 20, 40])
    out = fused_token_logprobs(hidden, weight, index, outputs=("is_top1",))
    assert out.is_top1.tolist() == [True, False, False]
    want = fused_token_logprobs_reference(hidden, weight, index, outputs=("is_top1",)).is_top1
    assert out.is_top1.tolist() == want.tolist()


def test_ignored_rows_are_zero_and_pass_no_gradient(small_tiles):
    n = 12
    hidden, weight, b, index, leaves = _inputs(n, torch.float32, 8)
    index[[0, 5, 11]] = -100
    with torch.no_grad():
        hidden[5] = float("nan")  # an ignored row's hidden state reaches nothing
        hidden[11] = float("inf")
    logp, ent = fused_token_logprobs(hidden, weight, index, 0.9, bias=b, return_entropy=True)
    assert (logp[[0, 5, 11]] == 0).all() and (ent[[0, 5, 11]] == 0).all()
    clean = torch.where((index != -100)[:, None], hidden, 0.0)  # the oracle's rows: same graph, finite
    want = oracle(clean, weight, b, index, 0.9)
    grads = torch.autograd.grad(logp.sum() + ent.sum(), leaves)
    want_grads = torch.autograd.grad(want["logprobs"].sum() + want["entropy"].sum(), leaves)
    assert (grads[0][[0, 5, 11]] == 0).all()
    for g, e in zip(grads, want_grads):
        assert torch.isfinite(g).all()
        assert_grad_close(g, e, torch.float32)
    assert_close(logp, want["logprobs"], torch.float32)
    assert_close(ent, want["entropy"], torch.float32)


def test_banned_tokens_minus_inf_bias(small_tiles):
    """−inf bias entries (in several chunks, and a whole chunk of them): p = 0 there, finite gradients."""
    n = 9
    hidden, weight, b, index, leaves = _inputs(n, torch.float32, 9)
    with torch.no_grad():
        b[[0, 3, 30]] = float("-inf")
        b[8:16] = float("-inf")  # one whole 8-column chunk
    index[index == 0] = 1
    index[(index >= 8) & (index < 16)] = 17
    index[(index == 3) | (index == 30)] = 2
    logp, ent = fused_token_logprobs(hidden, weight, index, 0.8, bias=b, return_entropy=True)
    want = oracle(hidden, weight, b, index, 0.8)
    _check_against_oracle(logp, ent, want, leaves, torch.float32, 9, n)


def test_transposed_tied_weight_is_read_in_place(small_tiles):
    """A tied embedding's [H, V] parameter given as its transposed [V, H] view: values and its gradient."""
    n = 10
    hidden, weight, b, index, _ = _inputs(n, torch.float32, 10)
    param = weight.detach().t().contiguous().requires_grad_()  # [H, V]
    view = param.t()
    assert not view.is_contiguous()
    logp, ent = fused_token_logprobs(hidden, view, index, 0.7, return_entropy=True)
    want = oracle(hidden, view, None, index, 0.7)
    _check_against_oracle(logp, ent, want, [hidden, param], torch.float32, 10, n)


def test_under_autocast_the_operands_are_in_autocasts_dtype(small_tiles):
    n = 9
    hidden, weight, b, index, _ = _inputs(n, torch.float32, 11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = fused_token_logprobs(hidden, weight, index, bias=b)
    explicit = fused_token_logprobs(hidden, weight, index, bias=b, compute_dtype=torch.bfloat16)
    torch.testing.assert_close(auto, explicit, atol=0, rtol=0)
    rounded = [t.detach().bfloat16() for t in (hidden, weight, b)]
    assert_close(auto, oracle(*rounded, index)["logprobs"], torch.float32)
    assert auto.dtype == torch.float32


def test_no_rows():
    hidden, weight, b, _, leaves = _inputs(0, torch.float32, 12)
    logp, ent = chunked_logprobs_entropy(hidden, weight, b, torch.zeros(0, dtype=torch.long), chunk=ChunkPlan(4, 8))
    assert logp.shape == ent.shape == (0,)
    grads = torch.autograd.grad(logp.sum() + ent.sum(), leaves)
    assert all((g == 0).all() for g in grads)


def test_chunk_plan():
    assert chunk_plan(1024, 151936) == ChunkPlan(1024, _lmhead.CHUNK_ELEMENTS // 1024)
    assert chunk_plan(3, 100) == ChunkPlan(3, 100)  # a vocabulary narrower than the budget: one chunk
    rows, cols = chunk_plan(1 << 20, 50000)  # too many rows for MIN_CHUNK_COLS: token blocks
    assert cols == _lmhead.MIN_CHUNK_COLS and rows * cols == _lmhead.CHUNK_ELEMENTS
    assert chunk_plan(10, 100, 7) == ChunkPlan(10, 7)
    assert chunk_plan(10, 100, (3, 500)) == ChunkPlan(3, 100)
    with pytest.raises(ValueError, match="chunk"):
        chunk_plan(10, 100, (0, 5))


# ---------------------------------------------------------------------------- no [N, V] tensor


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op returns (allocations included: empty, zeros, mm, exp...), inside
    fastppo's custom ops too."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = custom_ops.body_of(func)  # a fastppo custom op: what runs inside it, under this mode
        if body is not None:
            with self:
                out = body(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_n_by_v_tensor_is_allocated(reference_path, monkeypatch, dtype):
    """Forward and backward of the public CPU path, log-probs and entropy: no tensor (storage) anywhere near
    [N, V]; the same measurement sees the reference's [N, V] logits (so it can fail)."""
    n, hdim, vocab = 96, 16, 1000
    monkeypatch.setattr(_lmhead, "CHUNK_ELEMENTS", 2048)  # tiles of 96 × 21
    g = torch.Generator().manual_seed(13)
    hidden, weight, b = (t.requires_grad_() for t in lm_head_inputs((n,), hdim, vocab, dtype, "cpu", bias=True,
                                                                    generator=g))
    index = torch.randint(0, vocab, (n,), generator=g)
    index[3] = -100

    def run(fn):
        with _LargestTensor() as mode:
            logp, ent = fn(hidden, weight, index, 0.7, bias=b, return_entropy=True)
            torch.autograd.grad((logp * 0.5).sum() + ent.sum(), (hidden, weight, b))
        return mode

    chunked = run(fused_token_logprobs)
    assert {"addmm_", "scatter_add_"} <= chunked.ops  # the backward's ops were seen too
    assert chunked.largest <= max(vocab * hdim, 2 * 2048), chunked.largest  # grad_W [V, H] is the largest
    assert chunked.largest < n * vocab / 4
    assert run(fused_token_logprobs_reference).largest >= n * vocab  # the oracle's logits are seen


def test_double_backward_goes_through_the_materialised_logits():
    hidden, weight, b, index, _ = _inputs(6, torch.float64, 14)
    f = lambda h, w: chunked_lm_head_stats(h, w, b.detach(), index, LogitTransform(0.6),  # noqa: E731
                                           (True, True, False, False, False), ChunkPlan(4, 9))[:2]
    assert torch.autograd.gradcheck(f, (hidden, weight))
    assert torch.autograd.gradgradcheck(f, (hidden, weight), fast_mode=True)


def test_fp64_with_an_inexact_temperature_takes_the_chunked_path_under_the_interpreter(monkeypatch):
    """An fp64 call with T = 0.9 never reaches the Triton kernel (``use_triton``): it takes this path."""
    calls = []
    real = logprobs_module.chunked_lm_head_stats
    monkeypatch.setattr(logprobs_module, "chunked_lm_head_stats", lambda *a: calls.append(1) or real(*a))
    hidden, weight, b, index, leaves = _inputs(5, torch.float64, 15)
    logp = fused_token_logprobs(hidden, weight, index, 0.9, bias=b)
    assert calls
    assert_close(logp, oracle(hidden, weight, b, index, 0.9)["logprobs"], torch.float64)
    assert math.isfinite(logp.sum().item())


# ---------------------------------------------------------------------------- fused_full_kl's chunked path


def kl_oracle(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature):
    """KL(π‖π_ref) in float64 from its definition, autograd to the policy side only."""
    z = (hidden.double() @ weight.double().T + (0 if bias is None else bias.double())) / temperature
    y = (ref_hidden.double() @ ref_weight.double().T + (0 if ref_bias is None else ref_bias.double())) / temperature
    log_p, log_q = z.log_softmax(-1), y.detach().log_softmax(-1)
    p = log_p.exp()
    return (p * torch.where(p > 0, log_p - log_q, 0.0)).sum(-1)


def _kl_models(n, dtype, seed, bias=True, hid_ref=9, ref_dtype=None):
    g = torch.Generator().manual_seed(seed)
    hidden, weight, b = lm_head_inputs((n,), H, V, dtype, "cpu", bias=bias, logit_scale=3.0, generator=g)
    ref = lm_head_inputs((n,), hid_ref, V, ref_dtype or dtype, "cpu", bias=bias, logit_scale=3.0, generator=g)
    leaves = [t.requires_grad_() for t in (hidden, weight, b) if t is not None]
    return (hidden, weight, b), ref, leaves


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n, bias, temperature", [(19, True, 0.7), (5, False, 1.0), (1, True, 1.3)])
def test_full_kl_cpu_path_equals_the_float64_oracle(small_tiles, dtype, n, bias, temperature):
    from fastppo.kernels import fused_full_kl

    (hidden, weight, b), (rh, rw, rb), leaves = _kl_models(n, dtype, n + int(bias), bias)
    rw.requires_grad_()  # the reference side never gets a gradient, even when it asks
    kl = fused_full_kl(hidden, weight, rh, rw, temperature, bias=b, ref_bias=rb)
    want = kl_oracle(hidden, weight, b, rh, rw, rb, temperature)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert kl.dtype == out_dtype
    assert_close(kl, want, out_dtype)
    up = _upstream(n, n)[0]
    got = torch.autograd.grad((kl.double() * up).sum(), leaves)
    expected = torch.autograd.grad((want * up).sum(), leaves)
    for g_, e, leaf in zip(got, expected, leaves):
        assert g_.dtype == leaf.dtype
        assert_grad_close(g_, e, dtype)


def test_full_kl_fp64_reference_model_and_banned_tokens(small_tiles):
    """An fp32 policy beside an fp64 reference computes in fp64; −inf bias entries: banned by both models, and
    by the policy alone (p = 0 adds nothing and passes no gradient, whatever log q is)."""
    from fastppo.kernels import fused_full_kl, fused_full_kl_reference

    (hidden, weight, b), (rh, rw, rb), leaves = _kl_models(7, torch.float32, 20, ref_dtype=torch.float64)
    with torch.no_grad():
        b[[2, 40]] = float("-inf")
        rb[[2, 41]] = float("-inf")
        b[41] = float("-inf")  # the reference bans 41 too: q = 0 and p = 0 there
    kl = fused_full_kl(hidden, weight, rh, rw, 0.9, bias=b, ref_bias=rb)
    assert kl.dtype == torch.float64
    want = kl_oracle(hidden, weight, b, rh, rw, rb, 0.9)
    assert_close(kl, want, torch.float64, extra_atol=1e-12)
    torch.testing.assert_close(kl, fused_full_kl_reference(hidden, weight, rh, rw, 0.9, bias=b, ref_bias=rb),
                               rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(kl.sum(), leaves)
    expected = torch.autograd.grad(want.sum(), leaves)
    for g_, e in zip(got, expected):
        assert torch.isfinite(g_).all()
        assert_grad_close(g_, e, torch.float32)


def test_full_kl_no_n_by_v_tensor_and_double_backward(reference_path, monkeypatch):
    from fastppo.kernels import fused_full_kl, fused_full_kl_reference

    n, vocab = 96, 1000
    monkeypatch.setattr(_lmhead, "CHUNK_ELEMENTS", 2048)
    g = torch.Generator().manual_seed(21)
    hidden, weight, b = (t.requires_grad_() for t in lm_head_inputs((n,), 16, vocab, torch.float32, "cpu",
                                                                    bias=True, generator=g))
    rh, rw, rb = lm_head_inputs((n,), 8, vocab, torch.float32, "cpu", bias=True, generator=g)

    def run(fn):
        with _LargestTensor() as mode:
            kl = fn(hidden, weight, rh, rw, 0.8, bias=b, ref_bias=rb)
            torch.autograd.grad(kl.sum(), (hidden, weight, b))
        return mode

    chunked = run(fused_full_kl)
    assert "addmm_" in chunked.ops and chunked.largest < n * vocab / 4, chunked.largest
    assert run(fused_full_kl_reference).largest >= n * vocab
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    f = lambda h, w: _lmhead.chunked_full_kl(h, w, None, rh.double()[:5], rw.double(), None, 0.8,  # noqa: E731
                                             chunk=ChunkPlan(2, 300))
    assert torch.autograd.gradcheck(f, (h64[:5], w64), fast_mode=True)
    assert torch.autograd.gradgradcheck(f, (h64[:5], w64), fast_mode=True)
