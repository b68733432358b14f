"""KL penalties between the policy π and the frozen reference π_ref.

Two families, each with a Triton kernel, an autograd wrapper and a plain
PyTorch reference of the same math:

``kl_penalty(logprobs, ref_logprobs, estimator)``
    Per-token *estimates* of KL(π‖π_ref) from the sampled token's log-probs,
    with d = log π(y) − log π_ref(y) (Schulman, "Approximating KL divergence"):

    ==========  =================================  ==============
    estimator   value f(d)                         f'(d)
    ==========  =================================  ==============
    ``k1``      d                                  1
    ``k2``      ½·d²                               d
    ``k3``      e^{−d} + d − 1                     1 − e^{−d}
                (= exp(ref−logp) − (ref−logp) − 1)
    ``abs``     |d|                                sign(d)
    ``mse``     ½·d²                               d
    ==========  =================================  ==============

    ``abs`` and ``mse`` are TRL's legacy ``PPOTrainer._kl_penalty`` names
    (TRL ≤ 0.11: ``"kl"`` → d, ``"abs"`` → |d|, ``"mse"`` → 0.5·d²), so
    ``mse`` is k2 under another name; ``k1`` is TRL's ``"kl"``. ``k3`` is not
    clamped (verl's ``low_var_kl`` clamps it to [−10, 10]); clamp the result
    yourself if you want that. The estimator is a compile-time constant of
    both kernels, chosen in one function (``_kl_estimate``).

``fused_full_kl(hidden, weight, ref_hidden, ref_weight, temperature, bias, ref_bias)``
    The exact per-token KL(π‖π_ref) over the whole vocabulary, from both
    models' last hidden states and LM heads, without materialising either
    [N, V] distribution (TRL's legacy ``kl_penalty="full"`` needs both full
    logit tensors). With z = (hidden·Wᵀ + b)/T, y = (ref_hidden·W_refᵀ + b_ref)/T,
    p = softmax(z), q = softmax(y):

        KL = Σ_v p_v (log p_v − log q_v) = E_p[z − y] − lse_p + lse_q      (K1)
        ∂KL/∂z_j = p_j (log p_j − log q_j − KL)                           (K2)

    (the Σ_v p_v ∂log p_v/∂z_j term of (K2) is 0). The forward is one fused
    kernel on the LM-head core (``_lmhead``): both logit tiles by
    ``logits_tile``, lse_p and E_p[z − y] by ``online_update`` and
    ``online_expectation`` (L3)/(L4), lse_q by ``online_update``, V split over
    programs and merged by ``merge_splits``. E_p[z − y] keeps the difference of
    the two models' logits small (near-identical models) instead of
    subtracting two large expectations. The backward is
    ``_lmhead.vocab_chunked_backward`` (L6) with (K2) as its dlogits:
    both models' logit chunks come from GEMMs with fp32 (fp64) output.
    Accumulation and output are fp32, or fp64 when either model is fp64.
    Without Triton (CPU tensors) the same state and (K2) run in plain
    PyTorch over [rows, cols] tiles of both models' logits
    (``_lmhead.chunked_full_kl``); ``fused_full_kl_reference`` materialises
    both and is the oracle of both paths.

Gradients of ``fused_full_kl`` flow to the policy side (``hidden``,
``weight``, ``bias``) only: the reference model is frozen in PPO, so
``ref_hidden``, ``ref_weight`` and ``ref_bias`` are constants on both paths
even when they require grad.

Layout, as every kernel module: kernels, launchers, autograd, public, references.
"""
from __future__ import annotations

import torch

from fastppo.kernels._common import FLOAT_DTYPES, HAS_TRITON, check_same_device, check_same_shape, check_temperature
from fastppo.kernels._common import check_tensor, launch, tile_choice, tl, triton, use_triton
from fastppo.kernels._lmhead import FP64_LMHEAD_TILE, LMHeadTile, RowTile, acc_dtype, check_lm_head_args
from fastppo.kernels._lmhead import dot_precision, dot_upcast, lm_head_logits_reference, merge_splits, mm_acc
from fastppo.kernels._lmhead import lm_head_operands, no_autocast, softmax_dlogits_tile, split_plan, tl_dtype
from fastppo.kernels._lmhead import chunked_full_kl, vocab_chunked_backward

if HAS_TRITON:
    from fastppo.kernels._lmhead import elementwise_tile, logits_tile, online_expectation, online_update, split_program
    from fastppo.kernels._lmhead import store_dlogits

KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "mse")

# Kernel-side code of each estimator: mse and k2 are the same function.
_ESTIMATOR_CODE = {"k1": 0, "k2": 1, "mse": 1, "k3": 2, "abs": 3}

# --------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _k3_and_slope(d, LONG_SERIES: tl.constexpr):
        """k3(d) = e^{−d} + d − 1 and k3'(d) = 1 − e^{−d}, accurate near d = 0.

        Both formulas cancel catastrophically for small |d| (PPO's early steps
        have |d| ~ 1e-4), so for |d| < ½ we use their Taylor series,
        k3 = d²·Σ_{k≥0} (−d)^k/(k+2)!, k3' = d·Σ_{k≥0} (−d)^k/(k+1)!, truncated
        where the next term is < 1e-8 relative (fp32), or, with LONG_SERIES
        (fp64), < 1e-18 relative: 17 terms in Horner form,
        Q_k = 1 + c·Q_{k+1}/(k+3), Σ_k c^k/(k+2)! = Q_0/2 (and likewise for k3').
        """
        small = tl.abs(d) < 0.5
        e = tl.exp(-d)
        c = -d
        if LONG_SERIES:
            poly_v = tl.full(d.shape, 1.0, d.dtype)
            poly_g = tl.full(d.shape, 1.0, d.dtype)
            for k in tl.static_range(16, -1, -1):
                poly_v = 1.0 + c * poly_v / (k + 3)
                poly_g = 1.0 + c * poly_g / (k + 2)
            poly_v = poly_v * 0.5
        else:
            poly_v = 1.0 / 2 + c * (1.0 / 6 + c * (1.0 / 24 + c * (1.0 / 120 + c * (1.0 / 720 + c * (
                1.0 / 5040 + c * (1.0 / 40320 + c * (1.0 / 362880)))))))
            poly_g = 1.0 + c * (1.0 / 2 + c * (1.0 / 6 + c * (1.0 / 24 + c * (1.0 / 120 + c * (
                1.0 / 720 + c * (1.0 / 5040 + c * (1.0 / 40320 + c * (1.0 / 362880))))))))
        value = tl.where(small, d * d * poly_v, e + d - 1.0)
        slope = tl.where(small, d * poly_g, 1.0 - e)
        return value, slope

    @triton.jit
    def _kl_estimate(d, EST: tl.constexpr):
        """(f(d), f'(d)) of estimator EST (the table above): the one place the estimator is chosen.

        EST is a compile-time constant, so each kernel compiles one branch and
        drops the output it does not use. d is fp32, or fp64 for fp64 inputs.
        """
        if EST == 0:
            value = d
            slope = tl.full(d.shape, 1.0, d.dtype)
        elif EST == 1:
            value = 0.5 * d * d
            slope = d
        elif EST == 2:
            value, slope = _k3_and_slope(d, d.dtype == tl.float64)
        else:
            value = tl.abs(d)
            slope = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0)).to(d.dtype)  # sign(d), 0 at 0 like abs's grad
        return value, slope

    @triton.jit
    def _kl_penalty_fwd_kernel(logp_ptr, ref_ptr, out_ptr, n, EST: tl.constexpr, ACC_DTYPE: tl.constexpr,
                               BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(logp_ptr + offs, mask=mask, other=0.0).to(ACC_DTYPE)
        r = tl.load(ref_ptr + offs, mask=mask, other=0.0).to(ACC_DTYPE)
        kl, _ = _kl_estimate(x - r, EST)
        tl.store(out_ptr + offs, kl.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _kl_penalty_bwd_kernel(
        grad_ptr, logp_ptr, ref_ptr, dlogp_ptr, dref_ptr, n,
        EST: tl.constexpr, HAS_DLOGP: tl.constexpr, HAS_DREF: tl.constexpr, ACC_DTYPE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # f = f(logp − ref): ∂f/∂logp = f'(d), ∂f/∂ref = −f'(d).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(ACC_DTYPE)
        x = tl.load(logp_ptr + offs, mask=mask, other=0.0).to(ACC_DTYPE)
        r = tl.load(ref_ptr + offs, mask=mask, other=0.0).to(ACC_DTYPE)
        _, slope = _kl_estimate(x - r, EST)
        gd = g * slope
        if HAS_DLOGP:
            tl.store(dlogp_ptr + offs, gd.to(dlogp_ptr.dtype.element_ty), mask=mask)
        if HAS_DREF:
            tl.store(dref_ptr + offs, (-gd).to(dref_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _full_kl_fwd_kernel(
        h_ptr, stride_hn, stride_hh, w_ptr, stride_wv, stride_wh, b_ptr, stride_b,  # policy LM head
        rh_ptr, stride_rhn, stride_rhh, rw_ptr, stride_rwv, stride_rwh, rb_ptr, stride_rb,  # reference LM head
        m_p_ptr, s_p_ptr, a_ptr, m_q_ptr, s_q_ptr,  # per-split states [splits, N]
        N, V, H, H_REF, temperature, tiles_per_split,
        HAS_BIAS: tl.constexpr, HAS_REF_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
        REF_DOT_PRECISION: tl.constexpr, REF_DOT_UPCAST: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        # The states of (K1) for BLOCK_N rows over one vocabulary split, for the host merge.
        rows, row_mask, v_begin, v_end = split_program(N, V, tiles_per_split, BLOCK_N, BLOCK_V)

        m_p = tl.full([BLOCK_N], float("-inf"), ACC_DTYPE)
        s_p = tl.zeros([BLOCK_N], ACC_DTYPE)
        a = tl.zeros([BLOCK_N], ACC_DTYPE)
        m_q = tl.full([BLOCK_N], float("-inf"), ACC_DTYPE)
        s_q = tl.zeros([BLOCK_N], ACC_DTYPE)
        for v0 in range(v_begin, v_end, BLOCK_V):
            cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
            col_mask = cols < v_end
            z = logits_tile(h_ptr, stride_hn, stride_hh, w_ptr, stride_wv, stride_wh, b_ptr, stride_b,
                            rows, cols, row_mask, col_mask, H, temperature,
                            HAS_BIAS, ACC_DTYPE, DOT_PRECISION, DOT_UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
            y = logits_tile(rh_ptr, stride_rhn, stride_rhh, rw_ptr, stride_rwv, stride_rwh, rb_ptr, stride_rb,
                            rows, cols, row_mask, col_mask, H_REF, temperature,
                            HAS_REF_BIAS, ACC_DTYPE, REF_DOT_PRECISION, REF_DOT_UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
            m_p, s_p, _, alpha, e = online_update(m_p, s_p, s_p, z, 1, False)
            # z − y on padding lanes would be (−inf) − (−inf); e = 0 drops them anyway.
            a = online_expectation(a, alpha, e, z - tl.where(col_mask[None, :], y, 0.0), 1)
            m_q, s_q, _, _, _ = online_update(m_q, s_q, s_q, y, 1, False)
        out = tl.program_id(1).to(tl.int64) * N + rows  # splits·N may pass 2^31 in i32
        tl.store(m_p_ptr + out, m_p, mask=row_mask)
        tl.store(s_p_ptr + out, s_p, mask=row_mask)
        tl.store(a_ptr + out, a, mask=row_mask)
        tl.store(m_q_ptr + out, m_q, mask=row_mask)
        tl.store(s_q_ptr + out, s_q, mask=row_mask)

    @triton.jit
    def _full_kl_dlogits_kernel(
        x_ptr, stride_xn,  # policy logits chunk [N, n_cols] (raw: before /T)
        y_ptr, stride_yn,  # reference logits chunk, same columns
        dx_ptr, stride_dxn,  # ∂KL/∂x out; may alias x
        lse_p_ptr, lse_q_ptr, kl_ptr, g_ptr,  # [N]
        n_cols, temperature,
        ACC_DTYPE: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        # (K2)/T times the upstream gradient; grid (rows, column blocks).
        row, c, mask, z = elementwise_tile(x_ptr, stride_xn, n_cols, temperature, ACC_DTYPE, BLOCK_V)
        y = tl.load(y_ptr + row * stride_yn + c, mask=mask, other=0.0).to(ACC_DTYPE) / temperature
        lse_p = tl.load(lse_p_ptr + row).to(ACC_DTYPE)
        lse_q = tl.load(lse_q_ptr + row).to(ACC_DTYPE)
        kl = tl.load(kl_ptr + row).to(ACC_DTYPE)
        g = tl.load(g_ptr + row).to(ACC_DTYPE)
        p = tl.exp(z - lse_p)
        # log p − log q as (z − y) − (lse_p − lse_q): small for near-identical models.
        log_ratio = (z - y) - (lse_p - lse_q)
        dz = tl.where(p > 0, p * (log_ratio - kl), 0.0) * g  # p = 0 (banned token): no gradient
        store_dlogits(dx_ptr, stride_dxn, row, c, mask, dz, temperature)


# --------------------------------------------------------------------------- launchers


def _kl_penalty_tile(device: torch.device) -> RowTile:
    """Elements per program and warps of both kl_penalty kernels (not tuned on a GPU yet)."""
    return tile_choice("kl_penalty", RowTile(1024, 4) if device.type == "cuda" else RowTile(1024, 1))


def _full_kl_tile(dtype: torch.dtype, device: torch.device) -> LMHeadTile:
    """The fused forward keeps four [BLOCK_N, BLOCK_V] tiles live (both logit tiles, their difference,
    the exponentials), which is what bounds BLOCK_V. The CUDA tile is the common 64×64×64 tensor-core
    tile (fp64: the log-probs' fp64 tile), not tuned; the interpreter's is small."""
    cuda_tile = FP64_LMHEAD_TILE if dtype == torch.float64 else LMHeadTile(64, 64, 64, 4, 3)
    return tile_choice("fused_full_kl", cuda_tile if device.type == "cuda" else LMHeadTile(16, 32, 16, 1, 1))


def _kl_penalty_dtype(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.dtype:
    """Compute and output dtype of ``kl_penalty``: fp32, fp64 when either input is fp64 (both paths)."""
    return torch.promote_types(torch.promote_types(logprobs.dtype, ref_logprobs.dtype), torch.float32)


def _launch_kl_penalty_fwd(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, code: int) -> torch.Tensor:
    x = logprobs.contiguous().view(-1)
    r = ref_logprobs.contiguous().view(-1)
    acc = _kl_penalty_dtype(logprobs, ref_logprobs)
    out = torch.empty(x.shape, dtype=acc, device=x.device)
    n = x.numel()
    if n:
        tile = _kl_penalty_tile(x.device)
        launch(_kl_penalty_fwd_kernel, (triton.cdiv(n, tile.block_v),), x.device, x, r, out, n,
               EST=code, ACC_DTYPE=tl_dtype(acc), BLOCK=tile.block_v, num_warps=tile.num_warps)
    return out.view(logprobs.shape)


def _launch_kl_penalty_bwd(grad, logprobs, ref_logprobs, code, need_dlogp, need_dref):
    g = grad.contiguous().view(-1)
    x = logprobs.contiguous().view(-1)
    r = ref_logprobs.contiguous().view(-1)
    # Gradients in each input's own dtype, as autograd expects.
    dlogp = torch.empty_like(x) if need_dlogp else None
    dref = torch.empty_like(r) if need_dref else None
    n = x.numel()
    if n and (need_dlogp or need_dref):
        tile = _kl_penalty_tile(x.device)
        launch(_kl_penalty_bwd_kernel, (triton.cdiv(n, tile.block_v),), x.device,
               g, x, r, dlogp if need_dlogp else x, dref if need_dref else r, n,
               EST=code, HAS_DLOGP=need_dlogp, HAS_DREF=need_dref,
               ACC_DTYPE=tl_dtype(_kl_penalty_dtype(logprobs, ref_logprobs)), BLOCK=tile.block_v,
               num_warps=tile.num_warps)
    return (
        dlogp.view(logprobs.shape) if need_dlogp else None,
        dref.view(ref_logprobs.shape) if need_dref else None,
    )


def _full_kl_acc_dtype(hidden: torch.Tensor, ref_hidden: torch.Tensor) -> torch.dtype:
    return torch.promote_types(acc_dtype(hidden.dtype), acc_dtype(ref_hidden.dtype))


def _launch_full_kl_fwd(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature):
    """Returns (kl, lse_p, lse_q), each [N] in the accumulation dtype."""
    n_rows, vocab, device = hidden.shape[0], weight.shape[0], hidden.device
    acc = _full_kl_acc_dtype(hidden, ref_hidden)
    tile = _full_kl_tile(acc, device)
    plan = split_plan(n_rows, vocab, tile, device)
    m_p, s_p, a, m_q, s_q = torch.empty(5, plan.splits, n_rows, dtype=acc, device=device).unbind(0)
    launch(_full_kl_fwd_kernel, (plan.row_blocks, plan.splits), device,
           hidden, hidden.stride(0), hidden.stride(1), weight, weight.stride(0), weight.stride(1),
           bias if bias is not None else weight, bias.stride(0) if bias is not None else 0,
           ref_hidden, ref_hidden.stride(0), ref_hidden.stride(1), ref_weight, ref_weight.stride(0),
           ref_weight.stride(1), ref_bias if ref_bias is not None else ref_weight,
           ref_bias.stride(0) if ref_bias is not None else 0,
           m_p, s_p, a, m_q, s_q, n_rows, vocab, hidden.shape[1], ref_hidden.shape[1], temperature,
           plan.tiles_per_split,
           HAS_BIAS=bias is not None, HAS_REF_BIAS=ref_bias is not None, ACC_DTYPE=tl_dtype(acc),
           DOT_PRECISION=dot_precision(hidden.dtype, device), DOT_UPCAST=dot_upcast(hidden.dtype, acc, device),
           REF_DOT_PRECISION=dot_precision(ref_hidden.dtype, device),
           REF_DOT_UPCAST=dot_upcast(ref_hidden.dtype, acc, device),
           BLOCK_N=tile.block_n, BLOCK_V=tile.block_v, BLOCK_H=tile.block_h,
           num_warps=tile.num_warps, num_stages=tile.num_stages)
    policy = merge_splits(m_p, s_p, a_part=a)
    reference = merge_splits(m_q, s_q)
    return policy.mean - policy.lse + reference.lse, policy.lse, reference.lse  # (K1)


def _full_kl_backward(grad_kl, hidden, weight, bias, ref_hidden, ref_weight, ref_bias, lse_p, lse_q, kl,
                      temperature, needs):
    """Policy-side gradients by (L6) with (K2) as the dlogits of each vocabulary chunk."""
    acc = lse_p.dtype
    g = grad_kl.contiguous().to(acc)
    def dlogits(v0, v1, x_c):
        y_c = mm_acc(ref_hidden, ref_weight[v0:v1].t())
        if ref_bias is not None:
            y_c += ref_bias[v0:v1]
        dx_c = x_c if x_c.dtype == hidden.dtype else torch.empty_like(x_c, dtype=hidden.dtype)
        n_rows, n_cols = x_c.shape
        tile = softmax_dlogits_tile(n_cols, x_c.device)
        launch(_full_kl_dlogits_kernel, (n_rows, triton.cdiv(n_cols, tile.block_v)), x_c.device,
               x_c, x_c.stride(0), y_c, y_c.stride(0), dx_c, dx_c.stride(0), lse_p, lse_q, kl, g,
               n_cols, temperature, ACC_DTYPE=tl_dtype(acc), BLOCK_V=tile.block_v, num_warps=tile.num_warps)
        return dx_c

    return vocab_chunked_backward(hidden, weight, bias, dlogits, needs)


# --------------------------------------------------------------------------- autograd


# The Triton paths' differentiable calls: custom ops (``custom_ops.py`` registers the launchers above as
# ``torch.ops.fastppo.kl_penalty`` and ``fused_full_kl``, their fakes, and backwards that are ops too).


class _KLPenalty:
    """``kl_penalty``'s Triton path (differentiable twice: the double backward is PyTorch's)."""

    @staticmethod
    def apply(logprobs, ref_logprobs, code: int, estimator: str):
        return torch.ops.fastppo.kl_penalty(logprobs, ref_logprobs, code)


class _FusedFullKL:
    """``fused_full_kl``'s Triton path: KL [N], differentiable in the policy's hidden2d, weight and bias."""

    @staticmethod
    def apply(hidden2d, weight, bias, ref_hidden2d, ref_weight, ref_bias, temperature: float):
        kl, _lse_p, _lse_q = torch.ops.fastppo.fused_full_kl(hidden2d, weight, bias, ref_hidden2d, ref_weight,
                                                             ref_bias, temperature)
        return kl


# --------------------------------------------------------------------------- public API


def _check_kl_penalty_args(logprobs, ref_logprobs, estimator) -> int:
    if not isinstance(estimator, str) or estimator not in _ESTIMATOR_CODE:
        raise ValueError(f"estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")
    check_tensor("logprobs", logprobs, dtypes=FLOAT_DTYPES)
    check_tensor("ref_logprobs", ref_logprobs, dtypes=FLOAT_DTYPES)
    check_same_device(logprobs=logprobs, ref_logprobs=ref_logprobs)
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return _ESTIMATOR_CODE[estimator]


def _check_full_kl_args(hidden, weight, ref_hidden, ref_weight, temperature, bias, ref_bias) -> float:
    check_lm_head_args(hidden, weight, bias)
    check_lm_head_args(ref_hidden, ref_weight, ref_bias, prefix="ref_")
    check_same_device(hidden=hidden, ref_hidden=ref_hidden)
    if ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"ref_weight has vocabulary size {ref_weight.shape[0]} but weight has {weight.shape[0]}; "
            "the KL needs one vocabulary"
        )
    if ref_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"ref_hidden has leading shape {tuple(ref_hidden.shape[:-1])} but hidden has "
            f"{tuple(hidden.shape[:-1])}; one reference state per policy token"
        )
    return check_temperature(temperature)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate between policy and reference log-probs of the sampled tokens.

    Args:
        logprobs: log π(y_t) of the sampled tokens, any shape, any float dtype.
        ref_logprobs: log π_ref(y_t), same shape and device.
        estimator: one of ``KL_ESTIMATORS`` (see the module docstring for the formulas).

    Returns:
        fp32 tensor of the inputs' shape (fp64, computed in fp64, when either input is fp64);
        differentiable with respect to both inputs, twice too (``create_graph=True``).
    """
    code = _check_kl_penalty_args(logprobs, ref_logprobs, estimator)
    if use_triton(logprobs):
        return _KLPenalty.apply(logprobs, ref_logprobs, code, estimator)
    return _kl_penalty_math(logprobs, ref_logprobs, estimator)


def fused_full_kl(hidden, weight, ref_hidden, ref_weight, temperature=1.0, bias=None, ref_bias=None) -> torch.Tensor:
    """Exact per-token KL(π‖π_ref) over the whole vocabulary, from hidden states and LM heads.

    p = softmax((hidden @ weightᵀ + bias) / T), q = softmax((ref_hidden @ ref_weightᵀ + ref_bias) / T),
    KL = Σ_v p_v (log p_v − log q_v), computed tile by tile: neither [N, V]
    distribution is ever stored. Extra memory: O(N) in the forward, one
    [N, chunk] logits chunk per model in the backward. No weight is copied
    (a tied embedding's transposed view is read through its strides).

    Args:
        hidden: policy hidden states [..., H] (fp16, bf16, fp32 or fp64).
        weight: policy LM-head weight [V, H], same dtype as ``hidden``.
        ref_hidden: reference hidden states [..., H_ref], same leading shape as ``hidden``.
        ref_weight: reference LM-head weight [V, H_ref] of ``ref_hidden``'s dtype; H_ref may differ from H.
        temperature: logits are divided by it (> 0).
        bias: optional policy LM-head bias [V].
        ref_bias: optional reference LM-head bias [V]. −inf entries (banned
            tokens) are allowed in either bias.

    Without Triton (CPU tensors) this is ``_lmhead.chunked_full_kl``: the same (K1)/(K2) over tiles of both
    models' logits in plain PyTorch, no [N, V] tensor either (a double backward excepted).

    Both models follow ``_lmhead.COMPUTE_DTYPE_RULE`` (under autocast, an fp32
    model's operands are multiplied in autocast's dtype with fp32 accumulation);
    the accumulation is fp64 when either model computes in fp64, and then both
    models' logits are formed in fp64.

    Returns:
        KL of shape ``hidden.shape[:-1]``, fp32 (fp64 when either model is
        fp64, computed in fp64). Differentiable with respect to ``hidden``,
        ``weight`` and ``bias``; the reference tensors are constants (frozen
        reference model) and never receive a gradient. Rounding can leave
        values of order 1e-7 below zero.
    """
    temperature = _check_full_kl_args(hidden, weight, ref_hidden, ref_weight, temperature, bias, ref_bias)
    hidden, weight, bias = lm_head_operands(hidden, weight, bias)
    ref_hidden, ref_weight, ref_bias = lm_head_operands(ref_hidden.detach(), ref_weight.detach(),
                                                        None if ref_bias is None else ref_bias.detach())
    h2 = hidden.reshape(-1, hidden.shape[-1])
    rh2 = ref_hidden.reshape(-1, ref_hidden.shape[-1])
    with no_autocast(hidden.device):
        # No tokens: nothing to launch; the chunked path handles [0, H] and keeps autograd connected.
        # Dispatch sees both models' dtypes: an fp64 reference makes the call fp64 (exact scalars only).
        if use_triton(hidden, (temperature,), ref_hidden) and h2.shape[0] > 0:
            kl = _FusedFullKL.apply(h2, weight, bias, rh2, ref_weight, ref_bias, temperature)
        else:  # the chunked PyTorch path (_lmhead): neither [N, V] logits tensor is formed here either
            kl = chunked_full_kl(h2, weight, bias, rh2, ref_weight, ref_bias, temperature)
    return kl.reshape(hidden.shape[:-1])


# --------------------------------------------------------------------------- references


def kl_penalty_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Plain PyTorch ``kl_penalty``: computes and returns fp32 (fp64 when either input is fp64)."""
    _check_kl_penalty_args(logprobs, ref_logprobs, estimator)
    return _kl_penalty_math(logprobs, ref_logprobs, estimator)


def _kl_slope_math(d, estimator):
    """f'(d) of the table in the module docstring, differentiable (the Triton path's double backward)."""
    if estimator == "k1":
        return torch.ones_like(d)
    if estimator in ("k2", "mse"):
        return d
    if estimator == "k3":
        return -torch.expm1(-d)
    return torch.sign(d)


def _k3_math(d):
    """k3(d) = e^{−d} − 1 + d: expm1(−d) + d for |d| >= ½, and for |d| < ½, where that sum cancels (relative
    error ~1e-16/|d|), the kernel's series d²·Σ_k (−d)^k/(k+2)!, 17 terms (< 1e-18 relative)."""
    c = -d
    poly = torch.ones_like(d)
    for k in range(16, -1, -1):
        poly = 1.0 + c * poly / (k + 3)
    return torch.where(d.abs() < 0.5, d * d * poly * 0.5, torch.expm1(-d) + d)


def _kl_penalty_math(logprobs, ref_logprobs, estimator):
    dtype = _kl_penalty_dtype(logprobs, ref_logprobs)
    d = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if estimator == "k1":
        kl = d
    elif estimator in ("k2", "mse"):
        kl = 0.5 * d.square()
    elif estimator == "k3":
        kl = _k3_math(d)
    else:
        kl = d.abs()
    return kl


def fused_full_kl_reference(hidden, weight, ref_hidden, ref_weight, temperature=1.0, bias=None, ref_bias=None):
    """Plain PyTorch ``fused_full_kl``: materialises both [N, V] logit tensors.

    Computes and returns fp32 (fp64 when either model is fp64); like the
    kernel, the reference side is detached.
    """
    temperature = _check_full_kl_args(hidden, weight, ref_hidden, ref_weight, temperature, bias, ref_bias)
    hidden, weight, bias = lm_head_operands(hidden, weight, bias)
    ref_hidden, ref_weight, ref_bias = lm_head_operands(ref_hidden.detach(), ref_weight.detach(),
                                                        None if ref_bias is None else ref_bias.detach())
    h2 = hidden.reshape(-1, hidden.shape[-1])
    rh2 = ref_hidden.reshape(-1, ref_hidden.shape[-1])
    kl = _full_kl_math(h2, weight, bias, rh2, ref_weight, ref_bias, temperature)
    return kl.reshape(hidden.shape[:-1])


def _full_kl_math(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature):
    acc = _full_kl_acc_dtype(hidden, ref_hidden)  # both models' logits are formed in it
    log_p = torch.log_softmax(lm_head_logits_reference(hidden, weight, bias, acc) / temperature, dim=-1)
    log_q = torch.log_softmax(lm_head_logits_reference(ref_hidden, ref_weight, ref_bias, acc) / temperature, dim=-1)
    p = log_p.exp()
    # p = 0 (a token the policy bans) contributes 0, whatever log q is.
    return (p * torch.where(p > 0, log_p - log_q, torch.zeros_like(log_p))).sum(-1)
