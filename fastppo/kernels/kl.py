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
    yourself if you want that.

``fused_full_kl(hidden, weight, ref_hidden, ref_weight, temperature)``
    The exact per-token KL(π‖π_ref) = Σ_v p_v (log p_v − log q_v) over the
    whole vocabulary, from both models' last hidden states and LM-head
    weights, without materialising either [N, V] distribution (TRL's legacy
    ``kl_penalty="full"`` needs both full logit tensors).

Gradients of ``fused_full_kl`` flow to the policy side (``hidden``,
``weight``) only: the reference model is frozen in PPO, so ``ref_hidden`` and
``ref_weight`` are treated as constants on both paths even when they require
grad.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from fastppo.kernels._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_same_device,
    check_same_shape,
    check_temperature,
    check_tensor,
    tl,
    triton,
    use_triton,
)


KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "mse")

# Kernel-side code of each estimator: mse and k2 are the same function.
_ESTIMATOR_CODE = {"k1": 0, "k2": 1, "mse": 1, "k3": 2, "abs": 3}


# ---------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _k3_and_slope(d):
        """k3(d) = e^{−d} + d − 1 and k3'(d) = 1 − e^{−d}, accurate near d = 0.

        Both formulas cancel catastrophically for small |d| in fp32 (PPO's
        early steps have |d| ~ 1e-4), so for |d| < ½ we use their Taylor
        series, k3 = d²·Σ_{k≥0} (−d)^k/(k+2)!, k3' = d·Σ_{k≥0} (−d)^k/(k+1)!,
        truncated where the next term is < 1e-8 relative.
        """
        small = tl.abs(d) < 0.5
        e = tl.exp(-d)
        c = -d
        poly_v = 1.0 / 2 + c * (1.0 / 6 + c * (1.0 / 24 + c * (1.0 / 120 + c * (1.0 / 720 + c * (
            1.0 / 5040 + c * (1.0 / 40320 + c * (1.0 / 362880)))))))
        poly_g = 1.0 + c * (1.0 / 2 + c * (1.0 / 6 + c * (1.0 / 24 + c * (1.0 / 120 + c * (
            1.0 / 720 + c * (1.0 / 5040 + c * (1.0 / 40320 + c * (1.0 / 362880))))))))
        value = tl.where(small, d * d * poly_v, e + d - 1.0)
        slope = tl.where(small, d * poly_g, 1.0 - e)
        return value, slope

    @triton.jit
    def _kl_penalty_fwd_kernel(logp_ptr, ref_ptr, out_ptr, n, EST: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(logp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(ref_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        d = x - r
        if EST == 0:
            kl = d
        elif EST == 1:
            kl = 0.5 * d * d
        elif EST == 2:
            kl, _ = _k3_and_slope(d)
        else:
            kl = tl.abs(d)
        tl.store(out_ptr + offs, kl, mask=mask)

    @triton.jit
    def _kl_penalty_bwd_kernel(
        grad_ptr, logp_ptr, ref_ptr, dlogp_ptr, dref_ptr, n,
        EST: tl.constexpr, HAS_DLOGP: tl.constexpr, HAS_DREF: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # f = f(logp − ref): ∂f/∂logp = f'(d), ∂f/∂ref = −f'(d).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(logp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(ref_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        d = x - r
        if EST == 0:
            slope = tl.full(d.shape, 1.0, tl.float32)
        elif EST == 1:
            slope = d
        elif EST == 2:
            _, slope = _k3_and_slope(d)
        else:
            # sign(d), 0 at d = 0 like torch.abs's gradient.
            slope = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        gd = g * slope
        if HAS_DLOGP:
            tl.store(dlogp_ptr + offs, gd, mask=mask)
        if HAS_DREF:
            tl.store(dref_ptr + offs, -gd, mask=mask)

    @triton.jit
    def _logits_tile(
        x_ptr, w_ptr, rows, cols, row_mask, col_mask, H, stride_x, stride_w, inv_t,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """(x[rows] @ w[cols]ᵀ) / T as a [BLOCK_N, BLOCK_V] fp32 tile, looping over H."""
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_mask = ks < H
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            # wᵀ tile [BLOCK_H, BLOCK_V], read straight from the row-major [V, H] weight.
            w = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None],
                        mask=col_mask[None, :] & k_mask[:, None], other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        return acc * inv_t

    @triton.jit
    def _full_kl_fwd_kernel(
        h_ptr, w_ptr, rh_ptr, rw_ptr, part_ptr,
        N, V, H, H_REF, stride_h, stride_w, stride_rh, stride_rw, inv_t, tiles_per_split,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
        DOT_P: tl.constexpr, DOT_Q: tl.constexpr, UP_P: tl.constexpr, UP_Q: tl.constexpr,
    ):
        """Partial online-softmax statistics of one row block over one slice of V.

        Program (i, s) covers rows [i·BLOCK_N, (i+1)·BLOCK_N) and V tiles
        [s·tiles_per_split, (s+1)·tiles_per_split). With z = policy logits/T and
        y = reference logits/T it keeps, per row,
            m_p = max z,   s_p = Σ e^{z − m_p},   a = Σ e^{z − m_p} (z − y),
            m_q = max y,   s_q = Σ e^{y − m_q},
        rescaling s_p and a by e^{m_p,old − m_p,new} whenever the max grows, and
        writes the five numbers to part[:, s, row]. The host merges the slices.
        """
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N

        m_p = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s_p = tl.zeros((BLOCK_N,), tl.float32)
        a = tl.zeros((BLOCK_N,), tl.float32)
        m_q = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s_q = tl.zeros((BLOCK_N,), tl.float32)

        t_begin = pid_s * tiles_per_split
        t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(V, BLOCK_V))
        for t in range(t_begin, t_end):
            # 64-bit: cols · stride_w exceeds 2^31 for V·H beyond ~2.1e9 (e.g. 151,936 × 16,384).
            cols = (t * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
            col_mask = cols < V
            z = _logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, H, stride_h, stride_w, inv_t,
                             BLOCK_N, BLOCK_V, BLOCK_H, DOT_P, UP_P)
            y = _logits_tile(rh_ptr, rw_ptr, rows, cols, row_mask, col_mask, H_REF, stride_rh, stride_rw, inv_t,
                             BLOCK_N, BLOCK_V, BLOCK_H, DOT_Q, UP_Q)
            # Padding columns: −inf so they vanish from both sums; their (z − y) set to 0, not −inf − −inf.
            diff = tl.where(col_mask[None, :], z - y, 0.0)
            z = tl.where(col_mask[None, :], z, float("-inf"))
            y = tl.where(col_mask[None, :], y, float("-inf"))

            m_p_new = tl.maximum(m_p, tl.max(z, axis=1))
            scale = tl.exp(m_p - m_p_new)  # e^{−inf} = 0 on the first tile
            e = tl.exp(z - m_p_new[:, None])
            s_p = s_p * scale + tl.sum(e, axis=1)
            a = a * scale + tl.sum(e * diff, axis=1)
            m_p = m_p_new

            m_q_new = tl.maximum(m_q, tl.max(y, axis=1))
            s_q = s_q * tl.exp(m_q - m_q_new) + tl.sum(tl.exp(y - m_q_new[:, None]), axis=1)
            m_q = m_q_new

        slice_ptr = part_ptr + pid_s.to(tl.int64) * N + rows
        stride_stat = tl.num_programs(1).to(tl.int64) * N
        tl.store(slice_ptr, m_p, mask=row_mask)
        tl.store(slice_ptr + stride_stat, s_p, mask=row_mask)
        tl.store(slice_ptr + 2 * stride_stat, a, mask=row_mask)
        tl.store(slice_ptr + 3 * stride_stat, m_q, mask=row_mask)
        tl.store(slice_ptr + 4 * stride_stat, s_q, mask=row_mask)

    @triton.jit
    def _full_kl_dlogits_kernel(
        h_ptr, w_ptr, rh_ptr, rw_ptr, lse_p_ptr, lse_q_ptr, kl_ptr, grad_ptr, dx_ptr,
        N, V, H, H_REF, v_begin, chunk_v, stride_h, stride_w, stride_rh, stride_rw, inv_t,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
        DOT_P: tl.constexpr, DOT_Q: tl.constexpr, UP_P: tl.constexpr, UP_Q: tl.constexpr,
    ):
        """dKL/dx for the raw policy logits x = hidden @ weightᵀ, columns [v_begin, v_begin + chunk_v).

        With z = x/T, log p = z − lse_p, log q = y − lse_q:
            ∂KL/∂z_j = p_j (log p_j − log q_j − KL)     (the Σ_v p_v ∂log p_v/∂z_j term is 0)
            ∂KL/∂x_j = ∂KL/∂z_j / T.
        Both logit tiles are recomputed in fp32 from the inputs, because
        log p − log q of two near-identical models is a small difference of
        large numbers that bf16 logits would swamp.
        """
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        local = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        cols = v_begin + local
        col_mask = (local < chunk_v) & (cols < V)

        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, H, stride_h, stride_w, inv_t,
                         BLOCK_N, BLOCK_V, BLOCK_H, DOT_P, UP_P)
        y = _logits_tile(rh_ptr, rw_ptr, rows, cols, row_mask, col_mask, H_REF, stride_rh, stride_rw, inv_t,
                         BLOCK_N, BLOCK_V, BLOCK_H, DOT_Q, UP_Q)
        lse_p = tl.load(lse_p_ptr + rows, mask=row_mask, other=0.0)
        lse_q = tl.load(lse_q_ptr + rows, mask=row_mask, other=0.0)
        kl = tl.load(kl_ptr + rows, mask=row_mask, other=0.0)
        g = tl.load(grad_ptr + rows, mask=row_mask, other=0.0)

        log_p = z - lse_p[:, None]
        log_ratio = (z - y) - (lse_p - lse_q)[:, None]
        dx = tl.exp(log_p) * (log_ratio - kl[:, None]) * (g * inv_t)[:, None]
        out = dx_ptr + rows[:, None] * chunk_v + local[None, :]
        tl.store(out, dx, mask=row_mask[:, None] & col_mask[None, :])


# ---------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------

_KL_PENALTY_BLOCK = 1024


class _FullKLConfig(NamedTuple):
    block_n: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int
    num_splits: int  # V slices the forward runs in parallel per row block
    tiles_per_split: int
    bwd_chunk_v: int  # vocab columns per backward chunk: dlogits memory is N × bwd_chunk_v


class FullKLTile(NamedTuple):
    """``fused_full_kl``'s tile and launch choice (what a tuner varies; ``bench/tune.py``)."""

    block_n: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int


def _full_kl_tile(device: torch.device) -> FullKLTile:
    """The CUDA tile is the common 64×64×64, 4-warp tensor-core tile, not tuned. The forward keeps
    four [BLOCK_N, BLOCK_V] fp32 tiles live (both logit tiles, their difference, the exponentials),
    which is what bounds BLOCK_V; a larger BLOCK_N would cut the N/BLOCK_N re-reads of the weights.
    Under the Triton interpreter: the smallest tiles tl.dot accepts (16)."""
    if device.type == "cuda":
        return FullKLTile(64, 64, 64, 4, 3)
    return FullKLTile(16, 32, 16, 1, 1)


def _full_kl_config(n_rows: int, vocab: int, device: torch.device) -> _FullKLConfig:
    """Every block-size decision of ``fused_full_kl`` in one place (the tile in :func:`_full_kl_tile`)."""
    block_n, block_v, block_h, num_warps, num_stages = _full_kl_tile(device)
    if device.type == "cuda":
        # Enough programs to fill the GPU twice over: few row blocks (small N)
        # are compensated by splitting V. Device properties are cached by torch: no sync.
        target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        dlogits_budget = 1 << 25  # elements of the [N, chunk] dlogits buffer (64 MiB in bf16)
    else:
        # Two V slices and narrow backward chunks, so small test shapes still walk
        # the split-merge and multi-chunk code paths.
        target_programs = 2
        dlogits_budget = 0
    n_row_blocks = triton.cdiv(n_rows, block_n)
    n_v_tiles = triton.cdiv(vocab, block_v)
    splits = min(n_v_tiles, max(1, triton.cdiv(target_programs, n_row_blocks)))
    tiles_per_split = triton.cdiv(n_v_tiles, splits)
    splits = triton.cdiv(n_v_tiles, tiles_per_split)  # no empty slice
    chunk_v = max(block_v, (dlogits_budget // max(n_rows, 1)) // block_v * block_v)
    return _FullKLConfig(block_n, block_v, block_h, num_warps, num_stages, splits, tiles_per_split, chunk_v)


def _dot_args(hidden: torch.Tensor, ref_hidden: torch.Tensor) -> dict:
    """Per-model tl.dot settings: DOT_* the fp32 input precision, UP_* upcast-before-dot.

    UP_* works around the Triton interpreter (3.9), whose tl.dot multiplies
    bf16 operands as their raw uint16 bit patterns; upcasting bf16 to fp32 is
    exact and gives the same products, so only the interpreter pays for it.
    """
    return dict(
        DOT_P=_dot_precision(hidden), DOT_Q=_dot_precision(ref_hidden),
        UP_P=not hidden.is_cuda and hidden.dtype == torch.bfloat16,
        UP_Q=not ref_hidden.is_cuda and ref_hidden.dtype == torch.bfloat16,
    )


def _dot_precision(t: torch.Tensor) -> str:
    # fp32 logits on CUDA follow torch's own matmul setting, so the kernel and
    # the reference make the same TF32 trade; for 16-bit operands the setting
    # is moot (products are exact in fp32) and we leave Triton's default.
    if not t.is_cuda or (t.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


# ---------------------------------------------------------------------------
# Host launchers
# ---------------------------------------------------------------------------


def _kl_penalty_forward(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, code: int) -> torch.Tensor:
    x = logprobs.contiguous().view(-1)
    r = ref_logprobs.contiguous().view(-1)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        grid = (triton.cdiv(n, _KL_PENALTY_BLOCK),)
        _kl_penalty_fwd_kernel[grid](x, r, out, n, EST=code, BLOCK=_KL_PENALTY_BLOCK)
    return out.view(logprobs.shape)


def _kl_penalty_backward(grad, logprobs, ref_logprobs, code, need_dlogp, need_dref):
    g = grad.contiguous().view(-1)
    x = logprobs.contiguous().view(-1)
    r = ref_logprobs.contiguous().view(-1)
    # Gradients in each input's own dtype, as autograd expects.
    dlogp = torch.empty_like(x) if need_dlogp else None
    dref = torch.empty_like(r) if need_dref else None
    n = x.numel()
    if n and (need_dlogp or need_dref):
        grid = (triton.cdiv(n, _KL_PENALTY_BLOCK),)
        _kl_penalty_bwd_kernel[grid](
            g, x, r, dlogp if need_dlogp else x, dref if need_dref else r, n,
            EST=code, HAS_DLOGP=need_dlogp, HAS_DREF=need_dref, BLOCK=_KL_PENALTY_BLOCK,
        )
    return (
        dlogp.view(logprobs.shape) if need_dlogp else None,
        dref.view(ref_logprobs.shape) if need_dref else None,
    )


def _kernel_operand(t: torch.Tensor) -> torch.Tensor:
    # The kernels compute in fp32; fp64 operands are narrowed here because
    # tl.dot has no fp64 path on every backend.
    t = t.detach()
    if t.dtype == torch.float64:
        t = t.float()
    return t.contiguous()


def _full_kl_forward(hidden, weight, ref_hidden, ref_weight, temperature):
    """Returns (kl, lse_p, lse_q), each fp32 [N]."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    cfg = _full_kl_config(n_rows, vocab, hidden.device)
    part = torch.empty((5, cfg.num_splits, n_rows), dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(n_rows, cfg.block_n), cfg.num_splits)
    _full_kl_fwd_kernel[grid](
        hidden, weight, ref_hidden, ref_weight, part,
        n_rows, vocab, hidden.shape[1], ref_hidden.shape[1],
        hidden.stride(0), weight.stride(0), ref_hidden.stride(0), ref_weight.stride(0),
        1.0 / temperature, cfg.tiles_per_split,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
        **_dot_args(hidden, ref_hidden),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # Merge the V slices: m = max_s m_s, s = Σ_s s_s e^{m_s − m}, a likewise.
    # Then Σ_v p_v (z_v − y_v) = a / s_p and
    #   KL = Σ_v p_v [(z_v − lse_p) − (y_v − lse_q)] = a/s_p − lse_p + lse_q.
    m_p_s, s_p_s, a_s, m_q_s, s_q_s = part.unbind(0)
    m_p = m_p_s.amax(0)
    w_p = torch.exp(m_p_s - m_p)
    s_p = (s_p_s * w_p).sum(0)
    a = (a_s * w_p).sum(0)
    m_q = m_q_s.amax(0)
    s_q = (s_q_s * torch.exp(m_q_s - m_q)).sum(0)
    lse_p = m_p + torch.log(s_p)
    lse_q = m_q + torch.log(s_q)
    kl = a / s_p - lse_p + lse_q
    return kl, lse_p, lse_q


def _full_kl_backward(grad_kl, hidden, weight, ref_hidden, ref_weight, lse_p, lse_q, kl, temperature,
                      need_hidden, need_weight):
    """Policy-side gradients, V chunk by V chunk.

    For each chunk C of vocabulary columns a Triton kernel writes
    dX_C = ∂KL/∂x[:, C] (x = hidden @ weightᵀ, [N, |C|], in the weight's
    dtype), then two GEMMs apply the chain rule:
        grad_weight[C] = dX_Cᵀ @ hidden          (complete: every row is in dX_C)
        grad_hidden   += dX_C @ weight[C]         (accumulated in fp32 across chunks)
    Chunking over V rather than rows writes each grad_weight row once and
    keeps the running sum in the small [N, H] buffer instead of [V, H].
    """
    n_rows, hid = hidden.shape
    vocab = weight.shape[0]
    cfg = _full_kl_config(n_rows, vocab, hidden.device)
    g = grad_kl.contiguous().float()
    grad_weight = torch.empty_like(weight) if need_weight else None
    grad_hidden = torch.zeros((n_rows, hid), dtype=torch.float32, device=hidden.device) if need_hidden else None
    dx_buf = torch.empty(n_rows * min(cfg.bwd_chunk_v, vocab), dtype=hidden.dtype, device=hidden.device)
    for v_begin in range(0, vocab, cfg.bwd_chunk_v):
        width = min(cfg.bwd_chunk_v, vocab - v_begin)
        dx_c = dx_buf[: n_rows * width].view(n_rows, width)  # (N, width), row stride = width
        grid = (triton.cdiv(n_rows, cfg.block_n), triton.cdiv(width, cfg.block_v))
        _full_kl_dlogits_kernel[grid](
            hidden, weight, ref_hidden, ref_weight, lse_p, lse_q, kl, g, dx_c,
            n_rows, vocab, hid, ref_hidden.shape[1], v_begin, width,
            hidden.stride(0), weight.stride(0), ref_hidden.stride(0), ref_weight.stride(0),
            1.0 / temperature,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
            **_dot_args(hidden, ref_hidden),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if need_weight:
            torch.mm(dx_c.t(), hidden, out=grad_weight[v_begin:v_begin + width])
        if need_hidden:
            w_c = weight[v_begin:v_begin + width]
            if hidden.dtype == torch.float32:
                grad_hidden.addmm_(dx_c, w_c)
            else:
                grad_hidden += dx_c @ w_c
    if need_hidden:
        grad_hidden = grad_hidden.to(hidden.dtype)
    return grad_hidden, grad_weight


# ---------------------------------------------------------------------------
# Autograd wrappers
# ---------------------------------------------------------------------------


class _KLPenalty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprobs, ref_logprobs, code):
        ctx.save_for_backward(logprobs, ref_logprobs)
        ctx.code = code
        return _kl_penalty_forward(logprobs, ref_logprobs, code)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        logprobs, ref_logprobs = ctx.saved_tensors
        need_dlogp, need_dref = ctx.needs_input_grad[:2]
        dlogp, dref = _kl_penalty_backward(grad, logprobs, ref_logprobs, ctx.code, need_dlogp, need_dref)
        return dlogp, dref, None


class _FusedFullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, temperature):
        h, w = _kernel_operand(hidden), _kernel_operand(weight)
        rh, rw = _kernel_operand(ref_hidden), _kernel_operand(ref_weight)
        kl, lse_p, lse_q = _full_kl_forward(h, w, rh, rw, temperature)
        ctx.save_for_backward(h, w, rh, rw, lse_p, lse_q, kl)
        ctx.temperature = temperature
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl):
        h, w, rh, rw, lse_p, lse_q, kl = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden, grad_weight = _full_kl_backward(
            grad_kl, h, w, rh, rw, lse_p, lse_q, kl, ctx.temperature, need_hidden, need_weight
        )
        # Back to fp64 where _kernel_operand narrowed; the reference side is frozen (no gradient).
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(ctx.dtypes[0])
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.dtypes[1])
        return grad_hidden, grad_weight, None, None, None


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _check_estimator(estimator) -> int:
    if not isinstance(estimator, str) or estimator not in _ESTIMATOR_CODE:
        raise ValueError(f"estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")
    return _ESTIMATOR_CODE[estimator]


def _check_kl_penalty_inputs(logprobs, ref_logprobs, estimator) -> int:
    code = _check_estimator(estimator)
    check_tensor("logprobs", logprobs, dtypes=FLOAT_DTYPES)
    check_tensor("ref_logprobs", ref_logprobs, dtypes=FLOAT_DTYPES)
    check_same_device(logprobs=logprobs, ref_logprobs=ref_logprobs)
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return code


def _check_full_kl_inputs(hidden, weight, ref_hidden, ref_weight, temperature) -> float:
    check_tensor("hidden", hidden, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("ref_hidden", ref_hidden, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("ref_weight", ref_weight, ndim=2, dtypes=FLOAT_DTYPES)
    check_same_device(hidden=hidden, weight=weight, ref_hidden=ref_hidden, ref_weight=ref_weight)
    temperature = check_temperature(temperature)
    for h_name, h, w_name, w in (("hidden", hidden, "weight", weight),
                                 ("ref_hidden", ref_hidden, "ref_weight", ref_weight)):
        if h.shape[-1] != w.shape[1]:
            raise ValueError(
                f"{h_name} has hidden size {h.shape[-1]} (shape {tuple(h.shape)}) but {w_name} "
                f"expects {w.shape[1]} (shape {tuple(w.shape)}); {w_name} must be [V, {h.shape[-1]}]"
            )
        if h.dtype != w.dtype:
            raise TypeError(f"{h_name} is {h.dtype} but {w_name} is {w.dtype}; they must share a dtype")
    if ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"ref_weight has vocabulary size {ref_weight.shape[0]} but weight has {weight.shape[0]}; "
            "the KL needs one vocabulary"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary (shape[0] == 0)")
    if ref_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"ref_hidden has leading shape {tuple(ref_hidden.shape[:-1])} but hidden has "
            f"{tuple(hidden.shape[:-1])}; one reference state per policy token"
        )
    return temperature


# ---------------------------------------------------------------------------
# Public functions and their references
# ---------------------------------------------------------------------------


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate between policy and reference log-probs of the sampled tokens.

    Args:
        logprobs: log π(y_t) of the sampled tokens, any shape, any float dtype.
        ref_logprobs: log π_ref(y_t), same shape and device.
        estimator: one of ``KL_ESTIMATORS`` (see the module docstring for the formulas).

    Returns:
        fp32 tensor of the inputs' shape; differentiable with respect to both inputs.
    """
    code = _check_kl_penalty_inputs(logprobs, ref_logprobs, estimator)
    if use_triton(logprobs):
        return _KLPenalty.apply(logprobs, ref_logprobs, code)
    return _kl_penalty_math(logprobs, ref_logprobs, estimator)


def kl_penalty_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Plain PyTorch ``kl_penalty``: computes in fp32 (fp64 for fp64 inputs), returns fp32."""
    _check_kl_penalty_inputs(logprobs, ref_logprobs, estimator)
    return _kl_penalty_math(logprobs, ref_logprobs, estimator)


def _kl_penalty_math(logprobs, ref_logprobs, estimator):
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, ref_logprobs.dtype), torch.float32)
    d = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if estimator == "k1":
        kl = d
    elif estimator in ("k2", "mse"):
        kl = 0.5 * d.square()
    elif estimator == "k3":
        kl = torch.expm1(-d) + d  # e^{−d} − 1 + d without the e^{−d} − 1 cancellation
    else:
        kl = d.abs()
    return kl.float()


def fused_full_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Exact per-token KL(π‖π_ref) over the whole vocabulary, from hidden states and LM heads.

    p = softmax(hidden @ weightᵀ / T), q = softmax(ref_hidden @ ref_weightᵀ / T),
    KL = Σ_v p_v (log p_v − log q_v), computed tile by tile: neither [N, V]
    distribution is ever stored. Extra memory: O(N) in the forward, one
    [N, chunk] dlogits buffer in the backward.

    Args:
        hidden: policy hidden states [..., H], fp32/bf16/fp16 (fp64 is computed in fp32).
        weight: policy LM-head weight [V, H], same dtype as ``hidden``.
        ref_hidden: reference hidden states [..., H_ref], same leading shape as ``hidden``.
        ref_weight: reference LM-head weight [V, H_ref]; H_ref may differ from H.
        temperature: logits are divided by it (> 0).

    Returns:
        fp32 KL of shape ``hidden.shape[:-1]``. Differentiable with respect to
        ``hidden`` and ``weight``; the reference tensors are treated as
        constants (frozen reference model) and never receive a gradient.
        Rounding can leave values of order 1e-7 below zero.
    """
    temperature = _check_full_kl_inputs(hidden, weight, ref_hidden, ref_weight, temperature)
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1])
    rh2 = ref_hidden.reshape(-1, ref_hidden.shape[-1])
    # No tokens: nothing to launch; the reference math handles [0, H] and keeps autograd connected.
    if use_triton(hidden) and h2.shape[0] > 0:
        kl = _FusedFullKL.apply(h2, weight, rh2, ref_weight, temperature)
    else:
        kl = _full_kl_math(h2, weight, rh2.detach(), ref_weight.detach(), temperature)
    return kl.reshape(lead)


def fused_full_kl_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Plain PyTorch ``fused_full_kl``: materialises both [N, V] logit tensors.

    Computes in fp32 (fp64 for fp64 inputs), returns fp32; like the kernel, the
    reference side is detached.
    """
    temperature = _check_full_kl_inputs(hidden, weight, ref_hidden, ref_weight, temperature)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    rh2 = ref_hidden.reshape(-1, ref_hidden.shape[-1])
    kl = _full_kl_math(h2, weight, rh2.detach(), ref_weight.detach(), temperature)
    return kl.reshape(hidden.shape[:-1])


def _full_kl_math(hidden, weight, ref_hidden, ref_weight, temperature):
    def log_probs(h, w):
        dtype = torch.promote_types(h.dtype, torch.float32)
        return torch.log_softmax((h.to(dtype) @ w.to(dtype).t()) / temperature, dim=-1)  # (N, V)

    log_p = log_probs(hidden, weight)
    log_q = log_probs(ref_hidden, ref_weight)
    return (log_p.exp() * (log_p - log_q)).sum(-1).float()
