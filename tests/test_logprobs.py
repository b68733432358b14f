"""token_logprobs / fused_token_logprobs: Triton path vs a float64 reference.

Under TRITON_INTERPRET=1 (set by conftest on a CPU machine) the ``triton_device``
tests run the Triton kernels on CPU tensors; shapes stay tiny because the
interpreter runs each program in Python. The kernels use BLOCK_V = 32 (row
kernels) and 16×16×16 tiles with up to 4 vocabulary splits (fused forward) and
48-column chunks (fused backward) there, so the vocabularies below cover
partial tiles, several tiles, several splits and several chunks.
"""
import math
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastppo.kernels import logprobs as logprobs_mod
from fastppo.kernels._common import override_tile
from fastppo.kernels import (
    fused_token_logprobs,
    fused_token_logprobs_reference,
    token_logprobs,
    token_logprobs_reference,
)
from helpers import assert_close, assert_grad_close, recorded_launches, triton_device_or_skip

F32_EPS = torch.finfo(torch.float32).eps


def _reference64(logits, index, temperature, return_entropy=True):
    """Float64 oracle with autograd: (leaf, outputs)."""
    leaf = logits.detach().double().requires_grad_()
    out = token_logprobs_reference(leaf, index, temperature, return_entropy=return_entropy)
    return leaf, out


def _loss(outputs, upstream):
    """Σ g·out over the outputs that get a gradient (upstream None = no gradient)."""
    terms = [(o * g.to(o.dtype)).sum() for o, g in zip(outputs, upstream) if g is not None]
    return sum(terms)


def _check_token_logprobs(device, lead_shape, vocab, dtype, temperature, *, scale=3.0, return_entropy=True,
                          grad_logp=True, grad_ent=True, logits=None):
    if logits is None:
        logits = torch.randn(*lead_shape, vocab, dtype=torch.float64) * scale
    logits = logits.to(device=device, dtype=dtype).requires_grad_()
    index = torch.randint(0, vocab, lead_shape, device=device)

    out = token_logprobs(logits, index, temperature, return_entropy=return_entropy)
    out = out if return_entropy else (out,)
    leaf, ref = _reference64(logits, index, temperature, return_entropy)
    ref = ref if return_entropy else (ref,)

    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    # fp32 cannot hold z = x/T closer than half an ulp of |z|; that bounds any fp32 kernel.
    extra = 8 * F32_EPS * logits.detach().abs().max().item() / temperature
    for o, r in zip(out, ref):
        assert o.dtype == expected_dtype and o.shape == index.shape
        assert_close(o, r, dtype, extra_atol=extra)
    if return_entropy:
        ent = out[1].detach()
        assert (ent >= -1e-4).all() and (ent <= math.log(vocab) + 1e-4).all()

    upstream = [torch.randn(index.shape, dtype=torch.float64, device=device) if grad_logp else None]
    if return_entropy:
        upstream.append(torch.randn(index.shape, dtype=torch.float64, device=device) if grad_ent else None)
    (grad,) = torch.autograd.grad(_loss(out, upstream), logits)
    (grad_ref,) = torch.autograd.grad(_loss(ref, upstream), leaf)
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert grad.abs().max() > 0
    assert_grad_close(grad, grad_ref, dtype, extra_atol=extra)


# --------------------------------------------------------------------------- token_logprobs, Triton path


@pytest.mark.parametrize("vocab", [7, 33, 129, 1000])
def test_vocab_sizes(triton_device, vocab):
    _check_token_logprobs(triton_device, (3,), vocab, torch.float32, 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(triton_device, dtype):
    # 1.75 is exact in fp32, so the fp64 case can be held to fp64 tolerances.
    _check_token_logprobs(triton_device, (2, 3), 100, dtype, 1.75)


@pytest.mark.parametrize("temperature", [0.3, 1.7])
def test_temperatures(triton_device, temperature):
    _check_token_logprobs(triton_device, (2, 2), 65, torch.float32, temperature)


@pytest.mark.parametrize("lead_shape", [(), (1,), (2, 1), (2, 3)], ids=["0d", "N1", "T1", "2x3"])
def test_leading_shapes(triton_device, lead_shape):
    _check_token_logprobs(triton_device, lead_shape, 40, torch.float32, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_magnitude_logits(triton_device, dtype):
    logits = (torch.rand(3, 70, dtype=torch.float64) * 2 - 1) * 1e4
    logits[1, :] = 1e4  # a row of ties at the top: uniform distribution, H = log V
    _check_token_logprobs(triton_device, (3,), 70, dtype, 1.0, logits=logits)


@pytest.mark.parametrize(
    "return_entropy, grad_logp, grad_ent",
    [(False, True, False), (True, False, True), (True, True, False)],
    ids=["no-entropy", "entropy-grad-only", "logprob-grad-only"],
)
def test_partial_gradients(triton_device, return_entropy, grad_logp, grad_ent):
    _check_token_logprobs(triton_device, (2, 2), 50, torch.float32, 0.7, return_entropy=return_entropy,
                          grad_logp=grad_logp, grad_ent=grad_ent)


def test_banned_tokens_minus_inf(triton_device):
    logits = torch.randn(3, 45, dtype=torch.float64)
    logits[:, ::3] = float("-inf")  # vocabulary masking
    logits[2, :40] = float("-inf")  # first tiles entirely −inf
    _check_token_logprobs(triton_device, (3,), 45, torch.float32, 1.3, logits=logits)


def test_non_contiguous_logits(triton_device):
    base = torch.randn(4, 3, 50, device=triton_device)
    cases = [
        base[..., :40],  # row stride 50 ≠ V: a strided 2-D view
        base[..., :40].transpose(0, 1),  # no 2-D view exists: reshaped by copy
        torch.randn(40, 3, device=triton_device).T,  # stride along V ≠ 1
    ]
    for logits in cases:
        index = torch.randint(0, 40, logits.shape[:-1], device=triton_device)
        lp, ent = token_logprobs(logits, index, 1.0, return_entropy=True)
        lp_ref, ent_ref = token_logprobs_reference(logits.double(), index, 1.0, return_entropy=True)
        assert_close(lp, lp_ref, torch.float32)
        assert_close(ent, ent_ref, torch.float32)


def test_gradcheck_triton_fp64(triton_device):
    logits = torch.randn(2, 37, dtype=torch.float64, device=triton_device, requires_grad=True)
    index = torch.tensor([3, 36], device=triton_device)
    torch.autograd.gradcheck(lambda x: token_logprobs(x, index, 0.5, return_entropy=True), (logits,), fast_mode=True)


def test_int32_index(triton_device):
    logits = torch.randn(3, 20, device=triton_device)
    index = torch.randint(0, 20, (3,), device=triton_device)
    torch.testing.assert_close(token_logprobs(logits, index.int()), token_logprobs(logits, index))


def test_without_grad_and_under_no_grad(triton_device):
    logits = torch.randn(2, 30, device=triton_device)
    index = torch.randint(0, 30, (2,), device=triton_device)
    with torch.no_grad():
        lp = token_logprobs(logits.requires_grad_(), index)
    assert not lp.requires_grad
    assert_close(lp, token_logprobs_reference(logits.detach().double(), index), torch.float32)


# --------------------------------------------------------------------------- properties (Triton path)


@settings(max_examples=12, deadline=None)
@given(
    vocab=st.integers(1, 24),
    rows=st.integers(1, 2),
    scale=st.floats(0.01, 30.0),
    temperature=st.floats(0.25, 4.0),
    shift=st.floats(-1e3, 1e3),
    seed=st.integers(0, 2**31 - 1),
)
def test_properties(vocab, rows, scale, temperature, shift, seed):
    device = triton_device_or_skip()  # hypothesis cannot take the function-scoped fixture
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(device)
    # Every index value for every row: rows·V queries of the same distributions.
    every = logits.repeat_interleave(vocab, 0)
    index = torch.arange(vocab, device=device).repeat(rows)
    lp, ent = token_logprobs(every, index, temperature, return_entropy=True)
    assert (lp <= 1e-5).all()  # log p <= 0 up to fp32 rounding of the lse (2.2e-6 seen on an H100 at |z| ~ 20)
    torch.testing.assert_close(lp.view(rows, vocab).exp().sum(-1), torch.ones(rows, device=device), atol=1e-5, rtol=0)
    assert (ent >= -1e-5).all() and (ent <= math.log(vocab) + 1e-5).all()
    # Shift invariance, up to the fp32 rounding of the shifted logits themselves.
    lp_shift = token_logprobs(every + shift, index, temperature)
    atol = 1e-5 + 8 * F32_EPS * (abs(shift) + every.abs().max().item()) / temperature
    torch.testing.assert_close(lp_shift, lp, atol=atol, rtol=1e-5)


# --------------------------------------------------------------------------- reference path


def test_reference_matches_categorical(reference_path):
    logits = torch.randn(2, 3, 57, dtype=torch.float64)
    index = torch.randint(0, 57, (2, 3))
    lp, ent = token_logprobs(logits, index, 1.3, return_entropy=True)
    dist = torch.distributions.Categorical(logits=logits / 1.3)
    torch.testing.assert_close(lp, dist.log_prob(index))
    torch.testing.assert_close(ent, dist.entropy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_computes_in_fp32(reference_path, dtype):
    logits = torch.randn(3, 30).to(dtype)
    index = torch.randint(0, 30, (3,))
    lp, ent = token_logprobs(logits, index, return_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    lp64, ent64 = token_logprobs_reference(logits.double(), index, return_entropy=True)
    assert_close(lp, lp64, torch.float32)
    assert_close(ent, ent64, torch.float32)


def test_reference_gradcheck(reference_path):
    logits = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    logits.data[0, 2] = float("-inf")  # banned token: gradient stays finite
    index = torch.tensor([1, 0, 10])
    fn = lambda x: token_logprobs(x, index, 0.8, return_entropy=True)  # noqa: E731
    torch.autograd.gradcheck(fn, (logits,))
    hidden = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True)
    fused = lambda h, w, b: fused_token_logprobs(h, w, index, 0.8, bias=b, return_entropy=True)  # noqa: E731
    torch.autograd.gradcheck(fused, (hidden, weight, bias))


# --------------------------------------------------------------------------- fused_token_logprobs


def _check_fused(device, lead_shape, hdim, vocab, dtype, temperature, *, with_bias, return_entropy,
                 grad_logp=True, grad_ent=True, frozen_weight=False):
    hidden = torch.randn(*lead_shape, hdim, dtype=torch.float64).to(device=device, dtype=dtype)
    weight = (torch.randn(vocab, hdim, dtype=torch.float64) * 2 / math.sqrt(hdim)).to(device=device, dtype=dtype)
    bias = torch.randn(vocab, dtype=torch.float64).to(device=device, dtype=dtype) if with_bias else None
    index = torch.randint(0, vocab, lead_shape, device=device)
    params = [hidden, weight] + ([bias] if with_bias else [])
    for p in params:
        p.requires_grad_(not (frozen_weight and p is weight))
    leaves = [p.detach().double().requires_grad_(p.requires_grad) for p in params]

    out = fused_token_logprobs(hidden, weight, index, temperature, bias=bias, return_entropy=return_entropy)
    # The oracle: token_logprobs of the materialised float64 logits.
    logits64 = leaves[0] @ leaves[1].T + (leaves[2] if with_bias else 0)
    ref = token_logprobs_reference(logits64, index, temperature, return_entropy=return_entropy)
    out, ref = (out, ref) if return_entropy else ((out,), (ref,))
    for o, r in zip(out, ref):
        assert o.shape == index.shape and o.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert_close(o, r, dtype)

    upstream = [torch.randn(index.shape, dtype=torch.float64, device=device) if grad_logp else None]
    if return_entropy:
        upstream.append(torch.randn(index.shape, dtype=torch.float64, device=device) if grad_ent else None)
    wanted = [p for p in params if p.requires_grad]
    grads = torch.autograd.grad(_loss(out, upstream), wanted)
    grads_ref = torch.autograd.grad(_loss(ref, upstream), [q for q in leaves if q.requires_grad])
    for g, g_ref, p in zip(grads, grads_ref, wanted):
        assert g.dtype == p.dtype and g.shape == p.shape
        assert g.abs().max() > 0
        assert_grad_close(g, g_ref, dtype)


@pytest.mark.parametrize(
    "lead_shape, hdim, vocab, dtype, temperature, with_bias",
    [
        ((2, 5), 40, 150, torch.float32, 1.3, True),  # 10 V tiles over 4 splits, 4 backward chunks
        ((20,), 24, 33, torch.float32, 0.3, False),  # 2 row blocks, partial tiles everywhere
        ((7,), 32, 61, torch.bfloat16, 1.0, True),
        ((1,), 17, 50, torch.float16, 1.7, False),
        ((3,), 16, 40, torch.float64, 0.5, True),
    ],
)
def test_fused_matches_materialised(triton_device, lead_shape, hdim, vocab, dtype, temperature, with_bias):
    _check_fused(triton_device, lead_shape, hdim, vocab, dtype, temperature, with_bias=with_bias, return_entropy=True)


@pytest.mark.parametrize(
    "return_entropy, grad_logp, grad_ent, frozen_weight",
    [(False, True, False, False), (True, False, True, False), (True, True, True, True)],
    ids=["no-entropy", "entropy-grad-only", "frozen-weight"],
)
def test_fused_partial_gradients(triton_device, return_entropy, grad_logp, grad_ent, frozen_weight):
    _check_fused(triton_device, (4,), 20, 70, torch.float32, 1.0, with_bias=True, return_entropy=return_entropy,
                 grad_logp=grad_logp, grad_ent=grad_ent, frozen_weight=frozen_weight)


# The GEMM-then-rows forward (``_gemm_rows_forward``, CUDA's default forward, the interpreter's only when the tile
# is set): the same five cases
# as the fused kernel, 3 rows per GEMM so every case has several chunks and a short last one; the backward is
# the same chunked one either way.
@pytest.mark.parametrize(
    "lead_shape, hdim, vocab, dtype, temperature, with_bias",
    [((2, 5), 40, 150, torch.float32, 1.3, True), ((20,), 24, 33, torch.float32, 0.3, False),
     ((7,), 32, 61, torch.bfloat16, 1.0, True), ((1,), 17, 50, torch.float16, 1.7, False),
     ((3,), 16, 40, torch.float64, 0.5, True)],
)
def test_gemm_rows_forward_matches_materialised(triton_device, lead_shape, hdim, vocab, dtype, temperature,
                                                with_bias):
    rows = 3
    with override_tile("lmhead_forward_rows", rows), \
            recorded_launches(logprobs_mod, "_token_logprobs_fwd_kernel") as row_launches, \
            recorded_launches(logprobs_mod, "_fused_token_logprobs_fwd_kernel") as fused_launches:
        _check_fused(triton_device, lead_shape, hdim, vocab, dtype, temperature, with_bias=with_bias,
                     return_entropy=True)
    assert len(row_launches) == math.ceil(math.prod(lead_shape) / rows) and not fused_launches


@pytest.mark.parametrize("vocab, acc, rows", [(128256, torch.float32, 1024), (151936, torch.float32, 832),
                                               (256000, torch.float32, 512), (128256, torch.float64, 512),
                                               (32000, torch.float32, 1024), (10**7, torch.float32, 64)])
def test_gemm_rows_forward_is_cudas_default_within_512_mib_of_logits(vocab, acc, rows):
    # At most 1,024 rows a GEMM (the H200's best), fewer where their logits would pass 512 MiB, in whole 64-row
    # blocks and never under 64; the interpreter keeps the fused kernel.
    assert logprobs_mod._lmhead_forward_rows(vocab, torch.device("cuda"), acc) == rows
    assert rows == 64 or rows * vocab * acc.itemsize <= 512 * 2**20
    assert logprobs_mod._lmhead_forward_rows(vocab, torch.device("cpu"), acc) == 0


def test_token_logprobs_tile_at_a_large_vocabulary_on_cuda():
    # The H200's best row tile from 65,536 columns on; below it, and in the interpreter, row_tile's.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert logprobs_mod._token_logprobs_tile(128256, cuda) == (8192, 4)
    assert logprobs_mod._token_logprobs_tile(49152, cuda) == logprobs_mod.row_tile(49152, cuda)
    assert logprobs_mod._token_logprobs_tile(128256, cpu) == logprobs_mod.row_tile(128256, cpu)


def test_gemm_rows_forward_takes_any_layout_ignored_rows_and_autocast(triton_device):
    # A strided hidden (every other column of a wider one), a tied head read through its transpose, an index with
    # ignored rows and an offset view, with and without bf16 autocast: the candidate gives the fused kernel's
    # values and gradients, and ignored rows hold 0 and pass no gradient.
    wide = torch.randn(7, 40, device=triton_device)
    emb = torch.randn(20, 53, device=triton_device)
    index = torch.randint(0, 53, (9,), device=triton_device)[2:]
    index[[1, 4]] = -100
    for autocast in (False, True):
        results = []
        for rows in (0, 3):  # the fused kernel, then the candidate
            hidden = wide.clone().requires_grad_()
            weight = emb.clone().requires_grad_()
            with override_tile("lmhead_forward_rows", rows), \
                    torch.autocast(triton_device.type, dtype=torch.bfloat16, enabled=autocast):
                lp, ent = fused_token_logprobs(hidden[:, ::2], weight.T, index, 0.8, return_entropy=True)
            grads = torch.autograd.grad((lp * torch.linspace(-1, 1, 7, device=triton_device)).sum() + ent.sum(),
                                        (hidden, weight))
            results.append((lp, ent, *grads))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        lp, ent, grad_h, _ = results[1]
        assert lp[[1, 4]].eq(0).all() and ent[[1, 4]].eq(0).all() and grad_h[[1, 4]].eq(0).all()
        assert grad_h.abs().sum() > 0


def test_gemm_rows_forward_leaves_what_it_cannot_do_to_the_fused_kernel(triton_device):
    # The statistics beyond log-probs and entropy, and a soft cap, are the fused kernel's alone.
    hidden = torch.randn(6, 16, device=triton_device)
    weight = torch.randn(40, 16, device=triton_device)
    index = torch.randint(0, 40, (6,), device=triton_device)
    for kwargs in (dict(outputs=("logprobs", "is_top1")), dict(softcap=5.0, return_entropy=True)):
        with override_tile("lmhead_forward_rows", 4), \
                recorded_launches(logprobs_mod, "_fused_token_logprobs_fwd_kernel") as fused_launches:
            fused_token_logprobs(hidden, weight, index, **kwargs)
        assert len(fused_launches) == 1, kwargs


def test_fused_equals_token_logprobs(triton_device):
    hidden = torch.randn(2, 3, 24, device=triton_device, requires_grad=True)
    weight = torch.randn(45, 24, device=triton_device, requires_grad=True)
    index = torch.randint(0, 45, (2, 3), device=triton_device)
    upstream = torch.randn(2, 2, 3, device=triton_device)
    lp, ent = fused_token_logprobs(hidden, weight, index, 1.2, return_entropy=True)
    g = torch.autograd.grad(_loss((lp, ent), upstream), (hidden, weight))
    lp2, ent2 = token_logprobs(hidden @ weight.T, index, 1.2, return_entropy=True)
    g2 = torch.autograd.grad(_loss((lp2, ent2), upstream), (hidden, weight))
    for a, b in zip((lp, ent, *g), (lp2, ent2, *g2)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fused_tied_weight_is_read_in_place(triton_device):
    # A tied embedding used as the LM head through a transposed view: the fused kernel (not CUDA's default forward,
    # so asked for) reads its strides.
    emb = torch.randn(16, 60, device=triton_device)
    weight = emb.T.requires_grad_()  # [V=60, H=16], strides (1, 60)
    hidden = torch.randn(5, 16, device=triton_device, requires_grad=True)
    index = torch.randint(0, 60, (5,), device=triton_device)
    with override_tile("lmhead_forward_rows", 0), \
            recorded_launches(logprobs_mod, "_fused_token_logprobs_fwd_kernel") as launches:
        lp = fused_token_logprobs(hidden, weight, index)
    assert [a[3].data_ptr() for a in launches] == [emb.data_ptr()]  # the caller's storage, not a copy
    leaves = [hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()]
    ref = fused_token_logprobs_reference(*leaves, index)
    assert_close(lp, ref, torch.float32)
    upstream = torch.randn(5, device=triton_device)
    grads = torch.autograd.grad(lp, (hidden, weight), upstream)
    for g, r in zip(grads, torch.autograd.grad(ref, leaves, upstream.double())):
        assert_grad_close(g, r, torch.float32)


def test_fused_gradcheck_triton_fp64(triton_device):
    hidden = torch.randn(3, 16, dtype=torch.float64, device=triton_device, requires_grad=True)
    weight = torch.randn(20, 16, dtype=torch.float64, device=triton_device, requires_grad=True)
    bias = torch.randn(20, dtype=torch.float64, device=triton_device, requires_grad=True)
    index = torch.tensor([0, 19, 7], device=triton_device)
    fn = lambda h, w, b: fused_token_logprobs(h, w, index, 0.5, bias=b, return_entropy=True)  # noqa: E731
    torch.autograd.gradcheck(fn, (hidden, weight, bias), fast_mode=True)


def test_fused_reference_path(reference_path):
    hidden = torch.randn(4, 8).bfloat16()
    weight = torch.randn(30, 8).bfloat16()
    index = torch.randint(0, 30, (4,))
    lp, ent = fused_token_logprobs(hidden, weight, index, 0.9, return_entropy=True)
    assert lp.dtype == torch.float32
    lp2, ent2 = token_logprobs_reference(hidden.double() @ weight.double().T, index, 0.9, return_entropy=True)
    assert_close(lp, lp2, torch.float32)
    assert_close(ent, ent2, torch.float32)


# --------------------------------------------------------------------------- bad input

_BAD_TOKEN = [
    (lambda x, i: (x, i + 100), ValueError, "index"),  # out of [0, V)
    (lambda x, i: (x, i - 100), ValueError, "index"),
    (lambda x, i: (x, i[:, :1]), ValueError, "index"),  # shape mismatch
    (lambda x, i: (x, i.float()), TypeError, "index"),
    (lambda x, i: (x.long(), i), TypeError, "logits"),
    (lambda x, i: (x[..., :0], i), ValueError, "logits"),
    (lambda x, i: (x, i.to("meta")), ValueError, "index"),  # devices differ
]


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("case", range(len(_BAD_TOKEN)))
def test_bad_input_token_logprobs(monkeypatch, path, case):
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    make, err, name = _BAD_TOKEN[case]
    logits = torch.randn(2, 3, 10)
    index = torch.randint(0, 10, (2, 3))
    x, i = make(logits, index)
    with pytest.raises(err, match=name):
        token_logprobs(x, i)
    with pytest.raises(err, match=name):
        token_logprobs_reference(x, i)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature(temperature):
    logits, index = torch.randn(2, 10), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, index, temperature)
    with pytest.raises(ValueError, match="temperature"):
        fused_token_logprobs(torch.randn(2, 4), torch.randn(10, 4), index, temperature)


_BAD_FUSED = [
    (dict(index=lambda i: i + 10), ValueError, "index"),
    (dict(index=lambda i: i[:1]), ValueError, "index"),
    (dict(index=lambda i: i.float()), TypeError, "index"),
    (dict(weight=lambda w: w[:, :3]), ValueError, "hidden"),  # H mismatch
    # (a weight of another dtype is cast to the compute dtype: tests/test_logprobs_options.py)
    (dict(weight=lambda w: w[0]), ValueError, "weight"),
    (dict(hidden=lambda h: h.int()), TypeError, "hidden"),
    (dict(bias=lambda b: b[:5]), ValueError, "bias"),
    (dict(bias=lambda b: b.long()), TypeError, "bias"),
    (dict(weight=lambda w: w.to("meta")), ValueError, "weight"),
    (dict(bias=lambda b: b.to("meta")), ValueError, "bias"),
]


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("case", range(len(_BAD_FUSED)))
def test_bad_input_fused(monkeypatch, path, case):
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    change, err, name = _BAD_FUSED[case]
    args = dict(hidden=torch.randn(3, 4), weight=torch.randn(10, 4), index=torch.randint(0, 10, (3,)),
                bias=torch.randn(10))
    args = {k: change.get(k, lambda v: v)(v) for k, v in args.items()}
    with pytest.raises(err, match=name):
        fused_token_logprobs(args["hidden"], args["weight"], args["index"], bias=args["bias"])
    with pytest.raises(err, match=name):
        fused_token_logprobs_reference(args["hidden"], args["weight"], args["index"], bias=args["bias"])

