"""Per-token log-probabilities and entropies of a tempered softmax.

For one row of logits x ∈ R^V, temperature T and target token i, with z = x / T:
logprob = z_i − lse (L1), H = lse − Σ_j p_j z_j (L2), and the gradient of
L = g·logprob + g_H·H with respect to x_j is (L5) divided by T. The equations
(L1)-(L6) and the online state they are computed with live in
``fastppo/kernels/_lmhead.py``, the core this module shares with ``kl.py``
and ``ppo_loss.py``.

Precision: accumulation is fp32 for fp16/bf16/fp32 inputs and fp64 for fp64
inputs (so the Triton path can be gradchecked); outputs are fp32, or fp64 for
fp64 inputs. Gradients have the dtype of the input they belong to. The
temperature reaches the kernels as an fp32 scalar (T = 0.3 is off by 1e-8
relative even for fp64 inputs).

``token_logprobs``: one program per row walks V once with the online state
(L3); the backward is elementwise given the lse and H saved by the forward.

``fused_token_logprobs``: the forward is one fused kernel: each program owns
BLOCK_N rows and a contiguous range of V tiles; a logit tile is
``_lmhead.logits_tile`` (hidden tile @ weight tileᵀ accumulated over H in
fp32) folded into the per-row state at once, so [N, V] never exists. V is
split over several programs when there are too few row blocks to fill the
GPU; the [splits, N] states are merged by ``_lmhead.merge_splits``. The
backward is ``_lmhead.vocab_chunked_backward`` (L6) with this module's
elementwise dlogits kernel: why chunked over V and not fused is written there.

Layout (flash-attn's ``ops/triton/cross_entropy.py`` order, as every kernel
module here): Triton kernels, host launchers, autograd Functions, the public
functions, the plain PyTorch references (the tests' oracle and the path CPU
tensors take).
"""
from __future__ import annotations

import torch

from fastppo.kernels._common import FLOAT_DTYPES, HAS_TRITON, INDEX_DTYPES, check_index_range, check_same_device
from fastppo.kernels._common import check_bool, check_temperature, check_tensor, launch, tile_choice, tl, triton, use_triton
from fastppo.kernels._lmhead import FP64_LMHEAD_TILE, INTERPRETER_LMHEAD_TILE, LMHeadTile, RowTile, acc_dtype
from fastppo.kernels._lmhead import check_lm_head_args, dot_precision, dot_upcast, lm_head_logits_reference
from fastppo.kernels._lmhead import merge_splits, row_tile, softmax_dlogits_tile, split_plan, tl_dtype
from fastppo.kernels._lmhead import vocab_chunked_backward

if HAS_TRITON:
    from fastppo.kernels._lmhead import elementwise_tile, logits_tile, online_update, row_pick, row_softmax
    from fastppo.kernels._lmhead import softmax_dlogits, split_program, store_dlogits

# --------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _token_logprobs_fwd_kernel(
        x_ptr, stride_xn,  # logits [N, V], unit stride along V
        idx_ptr,  # [N] int32/int64
        logp_ptr, lse_ptr, ent_ptr,  # [N] outputs in ACC_DTYPE
        n_cols, temperature,
        COMPUTE_ENTROPY: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # One program per row, one pass over V in BLOCK_V tiles.
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_xn  # 64-bit: row·stride passes 2^31 at N·V > 2.1e9
        lse, ent = row_softmax(x_row, n_cols, temperature, COMPUTE_ENTROPY, ACC_DTYPE, BLOCK_V)
        idx = tl.load(idx_ptr + row).to(tl.int64)
        tl.store(logp_ptr + row, row_pick(x_row, idx, n_cols, temperature, ACC_DTYPE) - lse)
        tl.store(lse_ptr + row, lse)
        if COMPUTE_ENTROPY:
            tl.store(ent_ptr + row, ent)

    @triton.jit
    def _softmax_dlogits_kernel(
        x_ptr, stride_xn,  # logits (or a column chunk of them) [N, n_cols]
        dx_ptr, stride_dxn,  # gradient out, same shape; may alias x
        idx_ptr, lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr,  # [N]
        col_offset,  # vocabulary id of column 0 of x (chunked backward)
        n_cols, temperature,
        HAS_G_LOGP: tl.constexpr, HAS_G_ENT: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        # Elementwise given the per-row lse and H saved by the forward, (L5)/T;
        # grid (rows, column blocks) so every element is read and written once.
        row, c, mask, z = elementwise_tile(x_ptr, stride_xn, n_cols, temperature, ACC_DTYPE, BLOCK_V)
        lse = tl.load(lse_ptr + row).to(ACC_DTYPE)
        g_logp = 0.0
        onehot = c < 0
        if HAS_G_LOGP:
            g_logp = tl.load(g_logp_ptr + row).to(ACC_DTYPE)
            onehot = (c + col_offset) == tl.load(idx_ptr + row).to(tl.int64)
        g_ent = 0.0
        ent = 0.0
        if HAS_G_ENT:
            g_ent = tl.load(g_ent_ptr + row).to(ACC_DTYPE)
            ent = tl.load(ent_ptr + row).to(ACC_DTYPE)
        dz = softmax_dlogits(z, lse, ent, g_logp, g_ent, onehot, HAS_G_LOGP, HAS_G_ENT)
        store_dlogits(dx_ptr, stride_dxn, row, c, mask, dz, temperature)

    @triton.jit
    def _fused_token_logprobs_fwd_kernel(
        h_ptr, stride_hn, stride_hh,  # hidden [N, H]
        w_ptr, stride_wv, stride_wh,  # weight [V, H]
        b_ptr,  # bias [V] (unused unless HAS_BIAS)
        idx_ptr,  # [N]
        m_ptr, s_ptr, t_ptr, pick_ptr,  # per-split states [splits, N]
        N, V, H, temperature, tiles_per_split,
        HAS_BIAS: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr, ACC_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        # The states (L3) of BLOCK_N rows over one vocabulary split, for the host merge.
        rows, row_mask, v_begin, v_end = split_program(N, V, tiles_per_split, BLOCK_N, BLOCK_V)
        idx = tl.load(idx_ptr + rows, mask=row_mask, other=-1).to(tl.int64)

        m = tl.full([BLOCK_N], float("-inf"), ACC_DTYPE)
        s = tl.zeros([BLOCK_N], ACC_DTYPE)
        t = tl.zeros([BLOCK_N], ACC_DTYPE)
        pick = tl.zeros([BLOCK_N], ACC_DTYPE)
        for v0 in range(v_begin, v_end, BLOCK_V):
            cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
            z = logits_tile(h_ptr, stride_hn, stride_hh, w_ptr, stride_wv, stride_wh, b_ptr,
                            rows, cols, row_mask, cols < v_end, H, temperature,
                            HAS_BIAS, ACC_DTYPE, DOT_PRECISION, DOT_UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
            m, s, t, _, _ = online_update(m, s, t, z, 1, COMPUTE_ENTROPY)
            # The target logit sits in exactly one tile of one split.
            pick += tl.sum(tl.where(cols[None, :] == idx[:, None], z, 0.0), 1)
        out = tl.program_id(1) * N + rows
        tl.store(m_ptr + out, m, mask=row_mask)
        tl.store(s_ptr + out, s, mask=row_mask)
        tl.store(pick_ptr + out, pick, mask=row_mask)
        if COMPUTE_ENTROPY:
            tl.store(t_ptr + out, t, mask=row_mask)


# --------------------------------------------------------------------------- launchers

# Tile choices, one function per kernel (bench/tune.py sweeps each through
# _common.override_tile; its winners belong here). Under the interpreter they
# are small so the tests cover several tiles, splits and chunks with tiny tensors.


def _token_logprobs_tile(n_cols: int, device: torch.device) -> RowTile:
    """The row forward kernel of ``token_logprobs``."""
    return tile_choice("token_logprobs", row_tile(n_cols, device))


# The fused forward's CUDA tiles by dtype, 16-bit for any other (not tuned on a GPU yet).
_FUSED_TILES = {torch.float64: FP64_LMHEAD_TILE, torch.float32: LMHeadTile(64, 64, 32, 8, 3)}
_FUSED_TILE_16BIT = LMHeadTile(64, 128, 64, 8, 3)


def _fused_token_logprobs_tile(dtype: torch.dtype, device: torch.device) -> LMHeadTile:
    """The fused forward's tile; under the interpreter tl.dot's minimum."""
    tile = _FUSED_TILES.get(dtype, _FUSED_TILE_16BIT) if device.type == "cuda" else INTERPRETER_LMHEAD_TILE
    return tile_choice("fused_token_logprobs", tile)


def _launch_token_logprobs_fwd(x2d: torch.Tensor, index: torch.Tensor, temperature: float, compute_entropy: bool):
    n_rows, n_cols = x2d.shape
    acc = acc_dtype(x2d.dtype)
    logp = torch.empty(n_rows, dtype=acc, device=x2d.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if compute_entropy else None
    if n_rows > 0:
        tile = _token_logprobs_tile(n_cols, x2d.device)
        launch(_token_logprobs_fwd_kernel, (n_rows,), x2d.device,
               x2d, x2d.stride(0), index, logp, lse, ent if compute_entropy else lse, n_cols, temperature,
               COMPUTE_ENTROPY=compute_entropy, ACC_DTYPE=tl_dtype(acc), BLOCK_V=tile.block_v,
               num_warps=tile.num_warps)
    return logp, lse, ent


def _launch_softmax_dlogits(x2d, dx2d, index, lse, ent, g_logp, g_ent, temperature, col_offset=0):
    """dx2d ← ∂L/∂x2d by (L5)/T. x2d may be a column chunk starting at ``col_offset``."""
    n_rows, n_cols = x2d.shape
    if n_rows == 0 or n_cols == 0:
        return dx2d
    tile = softmax_dlogits_tile(n_cols, x2d.device)
    launch(_softmax_dlogits_kernel, (n_rows, triton.cdiv(n_cols, tile.block_v)), x2d.device,
           x2d, x2d.stride(0), dx2d, dx2d.stride(0), index, lse,
           ent if ent is not None else lse, g_logp if g_logp is not None else lse,
           g_ent if g_ent is not None else lse, col_offset, n_cols, temperature,
           HAS_G_LOGP=g_logp is not None, HAS_G_ENT=g_ent is not None,
           ACC_DTYPE=tl_dtype(acc_dtype(x2d.dtype)), BLOCK_V=tile.block_v, num_warps=tile.num_warps)
    return dx2d


def _launch_fused_token_logprobs_fwd(hidden2d, weight, bias, index, temperature, compute_entropy):
    n_rows = hidden2d.shape[0]
    vocab, hdim = weight.shape
    acc = acc_dtype(hidden2d.dtype)
    device = hidden2d.device
    if n_rows == 0:
        empty = hidden2d.new_empty(0, dtype=acc)
        return empty, empty, (empty if compute_entropy else None)
    tile = _fused_token_logprobs_tile(hidden2d.dtype, device)
    plan = split_plan(n_rows, vocab, tile, device)
    m_part = torch.empty(plan.splits, n_rows, dtype=acc, device=device)
    s_part, pick_part = torch.empty_like(m_part), torch.empty_like(m_part)
    t_part = torch.empty_like(m_part) if compute_entropy else None
    launch(_fused_token_logprobs_fwd_kernel, (plan.row_blocks, plan.splits), device,
           hidden2d, hidden2d.stride(0), hidden2d.stride(1), weight, weight.stride(0), weight.stride(1),
           bias if bias is not None else weight, index, m_part, s_part, t_part if compute_entropy else s_part,
           pick_part, n_rows, vocab, hdim, temperature, plan.tiles_per_split,
           HAS_BIAS=bias is not None, COMPUTE_ENTROPY=compute_entropy, ACC_DTYPE=tl_dtype(acc),
           DOT_PRECISION=dot_precision(hidden2d.dtype, device), DOT_UPCAST=dot_upcast(hidden2d.dtype, acc, device),
           BLOCK_N=tile.block_n, BLOCK_V=tile.block_v, BLOCK_H=tile.block_h,
           num_warps=tile.num_warps, num_stages=tile.num_stages)
    stats = merge_splits(m_part, s_part, t_part)
    valid = (index >= 0) & (index < vocab)
    logp = torch.where(valid, pick_part.sum(0) - stats.lse, torch.full_like(stats.lse, float("nan")))
    return logp, stats.lse, stats.entropy


def _fused_token_logprobs_backward(hidden2d, weight, bias, index, lse, ent, g_logp, g_ent, temperature, needs):
    def dlogits(v0, v1, x_c):
        # dx in the operand dtype (as autograd of hidden @ W.T would have it); in place when that is x's dtype.
        dx_c = x_c if x_c.dtype == hidden2d.dtype else torch.empty_like(x_c, dtype=hidden2d.dtype)
        return _launch_softmax_dlogits(x_c, dx_c, index, lse, ent, g_logp, g_ent, temperature, col_offset=v0)

    return vocab_chunked_backward(hidden2d, weight, bias, dlogits, needs)


# --------------------------------------------------------------------------- autograd


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, index, temperature, compute_entropy):
        logp, lse, ent = _launch_token_logprobs_fwd(logits2d, index, temperature, compute_entropy)
        ctx.save_for_backward(logits2d, index, lse, ent)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # a None grad skips its term in (L5)
        return (logp, ent) if compute_entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        logits2d, index, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None
        grad = torch.empty_like(logits2d, memory_format=torch.contiguous_format)
        _launch_softmax_dlogits(
            logits2d, grad, index, lse, ent,
            None if g_logp is None else g_logp.contiguous(),
            None if g_ent is None else g_ent.contiguous(),
            ctx.temperature,
        )
        return grad, None, None, None


class _FusedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, bias, index, temperature, compute_entropy):
        logp, lse, ent = _launch_fused_token_logprobs_fwd(hidden2d, weight, bias, index, temperature, compute_entropy)
        ctx.save_for_backward(hidden2d, weight, bias, index, lse, ent)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return (logp, ent) if compute_entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        hidden2d, weight, bias, index, lse, ent = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        if (g_logp is None and g_ent is None) or not any(needs):
            return None, None, None, None, None, None
        grad_h, grad_w, grad_b = _fused_token_logprobs_backward(
            hidden2d, weight, bias, index, lse, ent,
            None if g_logp is None else g_logp.contiguous(),
            None if g_ent is None else g_ent.contiguous(),
            ctx.temperature, needs,
        )
        return grad_h, grad_w, grad_b, None, None, None


# --------------------------------------------------------------------------- public API


def _check_token_logprobs_args(logits, index, temperature) -> float:
    check_tensor("logits", logits, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("index", index, dtypes=INDEX_DTYPES)
    if logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary (last) dimension, got shape {tuple(logits.shape)}")
    if index.shape != logits.shape[:-1]:
        raise ValueError(
            f"index has shape {tuple(index.shape)} but must equal logits.shape[:-1] = {tuple(logits.shape[:-1])}"
        )
    check_same_device(logits=logits, index=index)
    return check_temperature(temperature)


def _check_fused_token_logprobs_args(hidden, weight, index, temperature, bias) -> float:
    check_lm_head_args(hidden, weight, bias)
    check_tensor("index", index, dtypes=INDEX_DTYPES)
    if index.shape != hidden.shape[:-1]:
        raise ValueError(
            f"index has shape {tuple(index.shape)} but must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}"
        )
    check_same_device(hidden=hidden, index=index)
    return check_temperature(temperature)


def token_logprobs(logits, index, temperature=1.0, return_entropy=False):
    """log_softmax(logits / temperature) gathered at ``index``, one pass over V.

    Args:
        logits: [..., V] floating tensor (fp16, bf16, fp32 or fp64).
        index: [...] int32/int64 token ids in [0, V), the shape of ``logits.shape[:-1]``.
        temperature: float > 0; the distribution is softmax(logits / temperature).
        return_entropy: also return the entropy of that distribution.

    Returns:
        ``logprobs`` [...] (fp32; fp64 for fp64 logits), or ``(logprobs,
        entropy)`` with ``return_entropy``. Differentiable in ``logits``
        through both outputs.

    A drop-in for TRL's ``selective_log_softmax(logits / T, index)`` and
    ``entropy_from_logits(logits / T)``.
    """
    temperature = _check_token_logprobs_args(logits, index, temperature)
    check_bool("return_entropy", return_entropy)
    if not use_triton(logits):
        return token_logprobs_reference(logits, index, temperature, return_entropy)
    vocab = logits.shape[-1]
    if not logits.is_cuda:  # interpreter: the check is cheap here; on CUDA it would sync
        check_index_range(index, vocab)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = _TokenLogprobs.apply(
        logits.reshape(-1, vocab), index.reshape(-1).contiguous(), temperature, bool(return_entropy)
    )
    if return_entropy:
        return out[0].view(index.shape), out[1].view(index.shape)
    return out.view(index.shape)


def fused_token_logprobs(hidden, weight, index, temperature=1.0, bias=None, return_entropy=False):
    """``token_logprobs(hidden @ weight.T + bias, index, ...)`` without the [N, V] logits.

    Args:
        hidden: [..., H] hidden states (fp16, bf16, fp32 or fp64).
        weight: [V, H] LM-head weight, same dtype as ``hidden``; any strides
            (a tied embedding's transposed view is read in place, never copied).
        index: [...] int32/int64 token ids in [0, V), the shape of ``hidden.shape[:-1]``.
        temperature: float > 0.
        bias: optional [V] LM-head bias.
        return_entropy: also return the entropy of softmax(logits / temperature).

    Returns:
        ``logprobs`` [...] fp32 (fp64 for fp64 inputs), or ``(logprobs,
        entropy)``. Differentiable in ``hidden``, ``weight`` and ``bias``
        through both outputs (the entropy gradient is not dropped).
    """
    temperature = _check_fused_token_logprobs_args(hidden, weight, index, temperature, bias)
    check_bool("return_entropy", return_entropy)
    if not use_triton(hidden):
        return fused_token_logprobs_reference(hidden, weight, index, temperature, bias, return_entropy)
    vocab, hdim = weight.shape
    if not hidden.is_cuda:
        check_index_range(index, vocab)
    out = _FusedTokenLogprobs.apply(
        hidden.reshape(-1, hdim), weight, bias, index.reshape(-1).contiguous(), temperature, bool(return_entropy)
    )
    if return_entropy:
        return out[0].view(index.shape), out[1].view(index.shape)
    return out.view(index.shape)


# --------------------------------------------------------------------------- references


def token_logprobs_reference(logits, index, temperature=1.0, return_entropy=False):
    """Plain PyTorch ``token_logprobs``: materialised log_softmax, then gather.

    Computed in fp32 (fp64 for fp64 logits), never in a wider dtype, so a bf16
    [N, V] input costs fp32 [N, V] temporaries, not fp64 ones.
    """
    temperature = _check_token_logprobs_args(logits, index, temperature)
    check_bool("return_entropy", return_entropy)
    check_index_range(index, logits.shape[-1])
    z = logits.to(acc_dtype(logits.dtype)) / temperature
    log_p = torch.log_softmax(z, dim=-1)
    logp = log_p.gather(-1, index.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp
    p = log_p.exp()
    # p log p → 0 where p = 0: masking log p (not the product) keeps the
    # gradient finite at z = −inf as well.
    ent = -(p * log_p.masked_fill(p == 0, 0.0)).sum(-1)
    return logp, ent


def fused_token_logprobs_reference(hidden, weight, index, temperature=1.0, bias=None, return_entropy=False):
    """Plain PyTorch ``fused_token_logprobs``: logits = hidden @ weight.T (+ bias) materialised in fp32."""
    temperature = _check_fused_token_logprobs_args(hidden, weight, index, temperature, bias)
    check_bool("return_entropy", return_entropy)
    return token_logprobs_reference(lm_head_logits_reference(hidden, weight, bias), index, temperature, return_entropy)
