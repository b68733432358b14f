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
On CUDA the forward does as the backward does instead: the fp32 logits of up
to 1,024 rows at a time by one GEMM, then ``token_logprobs``'s row kernel over
them (``_gemm_rows_forward``); an H200 ran it 2.3x faster than the fused
forward, whose tile reaches well under cuBLAS's rate (bench/RESULTS.md). The
fused forward stays for the statistics the row kernel lacks (sum of squared
probabilities, mean logit, top-1, soft cap) and for the interpreter.

Without Triton (CPU tensors, and fp64 calls whose scalars fp32 cannot hold:
``_common.use_triton``), ``fused_token_logprobs`` takes the chunked PyTorch
path, ``_lmhead.chunked_lm_head_stats``: the same statistics over [rows, cols]
logits tiles with the online state (L3), the backward recomputing tile by
tile, so no [N, V] tensor exists there either (a double backward excepted:
it goes through the materialised logits). ``token_logprobs`` is given its
[N, V] logits and computes on CPU tensors by the reference.

Layout (flash-attn's ``ops/triton/cross_entropy.py`` order, as every kernel
module here): Triton kernels, host launchers, autograd Functions, the public
functions, the plain PyTorch references (the tests' oracle; ``token_logprobs``'s
CPU path; ``fused_token_logprobs_reference`` materialises the fp32 [N, V] logits
and is the oracle of both the Triton and the chunked path).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from fastppo.kernels._common import FLOAT_DTYPES, HAS_TRITON, INDEX_DTYPES, check_index_range, check_same_device
from fastppo.kernels._common import check_bool, check_float, check_temperature, check_tensor, launch, tile_choice, tl
from fastppo.kernels._common import triton, use_triton
from fastppo.kernels._lmhead import FP64_LMHEAD_TILE, INTERPRETER_LMHEAD_TILE, LMHeadTile, RowTile, acc_dtype
from fastppo.kernels._lmhead import check_lm_head_args, dot_precision, dot_upcast, lm_head_logits_reference
from fastppo.kernels._lmhead import cap_logits_reference, merge_splits, row_tile, softmax_dlogits_tile, split_plan
from fastppo.kernels._lmhead import compute_dtype_of, lm_head_operands, no_autocast, tl_dtype  # noqa: F401
from fastppo.kernels._lmhead import LogitTransform, chunked_lm_head_stats, mm_acc, span_tiles, vocab_chunked_backward

if HAS_TRITON:
    from fastppo.kernels._lmhead import elementwise_tile, logits_tile, online_update, row_pick, row_softmax
    from fastppo.kernels._lmhead import softcap_logits, softmax_dlogits, split_program, store_dlogits, tanh

# What a call can ask for, in the order ``TokenStats`` holds them. The first two are differentiable;
# the last three are statistics of the same pass (TRL 1.x's fused LM head returns them too).
OUTPUTS = ("logprobs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
DIFFERENTIABLE_OUTPUTS = OUTPUTS[:2]


class TokenStats(NamedTuple):
    """Per-token statistics of softmax(z), z the (capped, scaled) logits over the temperature; None where not asked.

    ``logprobs`` log p_i of the target i (L1); ``entropy`` H (L2); ``log_sum_sq_probs`` log Σ_j p_j²;
    ``mean_logits`` Σ_j z_j / V; ``is_top1`` whether i is the first argmax of z. Rows whose index is
    ``ignore_index`` hold 0 (False) in every field and pass no gradient.
    """

    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


class HeadMath(NamedTuple):
    """The logit transform a kernel applies, (L7): z = cap_out·tanh(cap_in·x) with a cap, else z = x / temperature."""

    temperature: float  # T / logit_scale without a cap; 1.0 with one (the cap carries T)
    cap_in: float
    cap_out: float
    has_softcap: bool

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
        n_cols, temperature, cap_in, cap_out,
        HAS_G_LOGP: tl.constexpr, HAS_G_ENT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ACC_DTYPE: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # Elementwise given the per-row lse and H saved by the forward, (L5)/T (or (L5)·(L7)'s ∂z/∂x with a
        # cap, where temperature is 1); grid (rows, column blocks) so every element is read and written once.
        row, c, mask, z = elementwise_tile(x_ptr, stride_xn, n_cols, temperature, ACC_DTYPE, BLOCK_V)
        if HAS_SOFTCAP:
            capped = tanh(cap_in * z)
            z = cap_out * capped
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
        if HAS_SOFTCAP:
            # tile × scalar × scalar, never cap_in·cap_out as a scalar product: on a GPU that would be
            # rounded to fp32 (and off in an fp64 backward), under the interpreter formed in fp64
            dz = dz * cap_in * cap_out * (1.0 - capped * capped)
        # A row with no upstream gradient (an ignored row) passes exactly 0, selected rather than multiplied:
        # its logits may be inf/NaN.
        dz = tl.where((g_logp != 0) | (g_ent != 0), dz, 0.0)
        store_dlogits(dx_ptr, stride_dxn, row, c, mask, dz, temperature)

    @triton.jit
    def _fused_token_logprobs_fwd_kernel(
        h_ptr, stride_hn, stride_hh,  # hidden [N, H]
        w_ptr, stride_wv, stride_wh,  # weight [V, H]
        b_ptr, stride_b,  # bias [V] (unused unless HAS_BIAS)
        idx_ptr,  # [N]
        m_ptr, s_ptr, t_ptr, pick_ptr,  # per-split states [splits, N]
        q_ptr, zsum_ptr, before_ptr,  # per-split extra statistics [splits, N] (each only when asked)
        N, V, H, temperature, cap_in, cap_out, tiles_per_split,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr,
        COMPUTE_SUM_SQ: tl.constexpr, COMPUTE_SUM_Z: tl.constexpr, COMPUTE_TOP1: tl.constexpr,
        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        # The states (L3) of BLOCK_N rows over one vocabulary split, for the host merge, and the extra
        # statistics of the same tiles: q = Σ e^{2(z − m)} (rescaled by α²), Σ z, and the max of z over the
        # columns before the target (the target is the first argmax iff it beats that and ties the max).
        rows, row_mask, v_begin, v_end = split_program(N, V, tiles_per_split, BLOCK_N, BLOCK_V)
        idx = tl.load(idx_ptr + rows, mask=row_mask, other=-1).to(tl.int64)

        m = tl.full([BLOCK_N], float("-inf"), ACC_DTYPE)
        s = tl.zeros([BLOCK_N], ACC_DTYPE)
        t = tl.zeros([BLOCK_N], ACC_DTYPE)
        pick = tl.zeros([BLOCK_N], ACC_DTYPE)
        q = tl.zeros([BLOCK_N], ACC_DTYPE)
        zsum = tl.zeros([BLOCK_N], ACC_DTYPE)
        before = tl.full([BLOCK_N], float("-inf"), ACC_DTYPE)
        for v0 in range(v_begin, v_end, BLOCK_V):
            cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
            col_mask = cols < v_end
            z = logits_tile(h_ptr, stride_hn, stride_hh, w_ptr, stride_wv, stride_wh, b_ptr, stride_b,
                            rows, cols, row_mask, col_mask, H, temperature,
                            HAS_BIAS, ACC_DTYPE, DOT_PRECISION, DOT_UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
            if HAS_SOFTCAP:
                z = softcap_logits(z, col_mask, cap_in, cap_out)
            m, s, t, alpha, e = online_update(m, s, t, z, 1, COMPUTE_ENTROPY)
            if COMPUTE_SUM_SQ:
                q = alpha * alpha * q + tl.sum(e * e, 1)
            if COMPUTE_SUM_Z:
                zsum += tl.sum(tl.where(col_mask[None, :], z, 0.0), 1)
            if COMPUTE_TOP1:
                before = tl.maximum(before, tl.max(tl.where(cols[None, :] < idx[:, None], z, float("-inf")), 1))
            # The target logit sits in exactly one tile of one split.
            pick += tl.sum(tl.where(cols[None, :] == idx[:, None], z, 0.0), 1)
        out = tl.program_id(1).to(tl.int64) * N + rows  # splits·N may pass 2^31 in i32
        tl.store(m_ptr + out, m, mask=row_mask)
        tl.store(s_ptr + out, s, mask=row_mask)
        tl.store(pick_ptr + out, pick, mask=row_mask)
        if COMPUTE_ENTROPY:
            tl.store(t_ptr + out, t, mask=row_mask)
        if COMPUTE_SUM_SQ:
            tl.store(q_ptr + out, q, mask=row_mask)
        if COMPUTE_SUM_Z:
            tl.store(zsum_ptr + out, zsum, mask=row_mask)
        if COMPUTE_TOP1:
            tl.store(before_ptr + out, before, mask=row_mask)


# --------------------------------------------------------------------------- launchers

# Tile choices, one function per kernel (bench/tune.py sweeps each through
# _common.override_tile; its winners belong here). Under the interpreter they
# are small so the tests cover several tiles, splits and chunks with tiny tensors.


def _token_logprobs_tile(n_cols: int, device: torch.device) -> RowTile:
    """The row forward kernel of ``token_logprobs``: on CUDA at a large vocabulary, 8,192 columns a tile over 4
    warps, 1.15x faster than ``row_tile``'s [4,096, 8] on an H200 at [16, 512, 128,256] bf16, the best of 12 tiles
    (bench/RESULTS.md, third lease; 96 registers, no spills)."""
    large = device.type == "cuda" and n_cols >= 65536
    return tile_choice("token_logprobs", RowTile(8192, 4) if large else row_tile(n_cols, device))


# The fused forward's CUDA tiles by dtype, 16-bit for any other (not tuned on a GPU yet).
_FUSED_TILES = {torch.float64: FP64_LMHEAD_TILE, torch.float32: LMHeadTile(64, 64, 32, 8, 3)}
_FUSED_TILE_16BIT = LMHeadTile(64, 128, 64, 8, 3)


def _fused_token_logprobs_tile(dtype: torch.dtype, device: torch.device) -> LMHeadTile:
    """The fused forward's tile; under the interpreter tl.dot's minimum."""
    tile = _FUSED_TILES.get(dtype, _FUSED_TILE_16BIT) if device.type == "cuda" else INTERPRETER_LMHEAD_TILE
    return tile_choice("fused_token_logprobs", tile)


def _lmhead_forward_rows(vocab: int, device: torch.device, acc: torch.dtype) -> int:
    """Rows per chunk of ``fused_token_logprobs``'s GEMM-then-rows forward (``_gemm_rows_forward``), or 0 for the
    fused kernel. On CUDA the GEMM-then-rows forward, 1,024 rows a chunk, at most 512 MiB of logits: on an H200
    (bench/RESULTS.md, third lease) it took 15.3 ms where the fused kernel took 35.5 ms (N 8,192, H 4,096,
    V 128,256, entropy; 512 rows 15.9 ms, 2,048 15.3 ms), since cuBLAS runs the GEMM near its rate and the fused
    tile does not. Elsewhere (the interpreter) the fused kernel."""
    rows = 0
    if device.type == "cuda":
        budget_rows = (512 * 2**20) // (vocab * acc.itemsize)
        rows = max(64, min(1024, budget_rows // 64 * 64))
    return tile_choice("lmhead_forward_rows", rows)


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


def _launch_softmax_dlogits(x2d, dx2d, index, lse, ent, g_logp, g_ent, head: HeadMath, col_offset=0):
    """dx2d ← ∂L/∂x2d by (L5)/T, or (L5)·(L7)'s ∂z/∂x with a cap; x2d may be a column chunk from ``col_offset``."""
    n_rows, n_cols = x2d.shape
    if n_rows == 0 or n_cols == 0:
        return dx2d
    tile = softmax_dlogits_tile(n_cols, x2d.device)
    launch(_softmax_dlogits_kernel, (n_rows, triton.cdiv(n_cols, tile.block_v)), x2d.device,
           x2d, x2d.stride(0), dx2d, dx2d.stride(0), index, lse,
           ent if ent is not None else lse, g_logp if g_logp is not None else lse,
           g_ent if g_ent is not None else lse, col_offset, n_cols, head.temperature, head.cap_in, head.cap_out,
           HAS_G_LOGP=g_logp is not None, HAS_G_ENT=g_ent is not None, HAS_SOFTCAP=head.has_softcap,
           ACC_DTYPE=tl_dtype(acc_dtype(x2d.dtype)), BLOCK_V=tile.block_v, num_warps=tile.num_warps)
    return dx2d


def _launch_fused_token_logprobs_fwd(hidden2d, weight, bias, index, head: HeadMath, wants):
    """(logp, lse, entropy, log_sum_sq_probs, mean_logits, is_top1) [N], each of the last four None unless wanted."""
    _, want_entropy, want_sum_sq, want_mean, want_top1 = wants
    n_rows = hidden2d.shape[0]
    vocab, hdim = weight.shape
    acc = acc_dtype(hidden2d.dtype)
    device = hidden2d.device
    if n_rows == 0:
        empty = hidden2d.new_empty(0, dtype=acc)
        return (empty, empty, *(empty if w else None for w in (want_entropy, want_sum_sq, want_mean)),
                empty.bool() if want_top1 else None)
    rows = _lmhead_forward_rows(vocab, device, acc)
    if rows > 0 and not (want_sum_sq or want_mean or want_top1 or head.has_softcap):
        logp, lse, ent = _gemm_rows_forward(hidden2d, weight, bias, index, head.temperature, want_entropy, rows)
        return logp, lse, ent, None, None, None
    tile = _fused_token_logprobs_tile(hidden2d.dtype, device)
    plan = split_plan(n_rows, vocab, tile, device)
    m_part = torch.empty(plan.splits, n_rows, dtype=acc, device=device)
    s_part, pick_part = torch.empty_like(m_part), torch.empty_like(m_part)
    t_part, q_part, zsum_part, before_part = (torch.empty_like(m_part) if w else None
                                              for w in (want_entropy, want_sum_sq, want_mean, want_top1))
    launch(_fused_token_logprobs_fwd_kernel, (plan.row_blocks, plan.splits), device,
           hidden2d, hidden2d.stride(0), hidden2d.stride(1), weight, weight.stride(0), weight.stride(1),
           bias if bias is not None else weight, bias.stride(0) if bias is not None else 0, index,
           m_part, s_part, t_part if t_part is not None else s_part, pick_part,
           *(p if p is not None else s_part for p in (q_part, zsum_part, before_part)),
           n_rows, vocab, hdim, head.temperature, head.cap_in, head.cap_out, plan.tiles_per_split,
           HAS_BIAS=bias is not None, HAS_SOFTCAP=head.has_softcap, COMPUTE_ENTROPY=want_entropy,
           COMPUTE_SUM_SQ=want_sum_sq, COMPUTE_SUM_Z=want_mean, COMPUTE_TOP1=want_top1, ACC_DTYPE=tl_dtype(acc),
           DOT_PRECISION=dot_precision(hidden2d.dtype, device), DOT_UPCAST=dot_upcast(hidden2d.dtype, acc, device),
           BLOCK_N=tile.block_n, BLOCK_V=tile.block_v, BLOCK_H=tile.block_h,
           num_warps=tile.num_warps, num_stages=tile.num_stages)
    stats = merge_splits(m_part, s_part, t_part, q_part=q_part)
    target = pick_part.sum(0)  # the target's z: exactly one split holds it, the others add 0
    valid = (index >= 0) & (index < vocab)
    logp = torch.where(valid, target - stats.lse, torch.full_like(stats.lse, float("nan")))
    mean = zsum_part.sum(0) / vocab if want_mean else None
    top1 = None
    if want_top1:  # the same z values are compared, so the ties are exact
        top1 = valid & (target >= m_part.amax(0)) & (target > before_part.amax(0))
    return logp, stats.lse, stats.entropy, stats.log_sum_sq, mean, top1


def _gemm_rows_forward(hidden2d, weight, bias, index, temperature: float, want_entropy: bool, rows: int):
    """(logp, lse, entropy or None) [N] as the backward computes logits: ``rows`` rows at a time, their fp32 (fp64)
    logits [rows, V] by one GEMM (``mm_acc``: 16-bit operands, an unrounded output, the fused kernel's numerics),
    then ``token_logprobs``'s row kernel over them. One [rows, V] buffer exists at a time, never [N, V]."""
    n_rows, vocab = hidden2d.shape[0], weight.shape[0]
    acc = acc_dtype(hidden2d.dtype)
    logp = torch.empty(n_rows, dtype=acc, device=hidden2d.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if want_entropy else None
    # An id outside [0, V) must not be read by the row kernel: it is clamped there and its log-prob is NaN, as
    # the fused kernel returns it.
    valid = (index >= 0) & (index < vocab)
    safe_index = index.clamp(0, vocab - 1)
    for r0, r1, x in span_tiles(n_rows, rows, vocab, acc, hidden2d.device):
        mm_acc(hidden2d[r0:r1], weight.t(), out=x)
        if bias is not None:
            x += bias
        lp, ls, en = _launch_token_logprobs_fwd(x, safe_index[r0:r1], temperature, want_entropy)
        logp[r0:r1], lse[r0:r1] = lp, ls
        if want_entropy:
            ent[r0:r1] = en
    logp = torch.where(valid, logp, torch.full_like(logp, float("nan")))
    return logp, lse, ent


def _fused_token_logprobs_backward(hidden2d, weight, bias, index, lse, ent, g_logp, g_ent, head, needs):
    def dlogits(v0, v1, x_c):
        # dx in the operand dtype (as autograd of hidden @ W.T would have it); in place when that is x's dtype.
        dx_c = x_c if x_c.dtype == hidden2d.dtype else torch.empty_like(x_c, dtype=hidden2d.dtype)
        return _launch_softmax_dlogits(x_c, dx_c, index, lse, ent, g_logp, g_ent, head, col_offset=v0)

    return vocab_chunked_backward(hidden2d, weight, bias, dlogits, needs)


# --------------------------------------------------------------------------- autograd


# The Triton paths' differentiable calls: custom ops (``custom_ops.py`` registers the ops above as
# ``torch.ops.fastppo.token_logprobs`` and ``fused_token_logprobs``, their fakes, and backwards that are ops too).


class _TokenLogprobs:
    """``token_logprobs``' Triton path: (logp, entropy or None) [N] of logits2d [N, V]."""

    @staticmethod
    def apply(logits2d, index, temperature: float, compute_entropy: bool):
        logp, _lse, ent = torch.ops.fastppo.token_logprobs(logits2d, index, temperature, compute_entropy)
        return logp, (ent if compute_entropy else None)


class _FusedTokenLogprobs:
    """``fused_token_logprobs``' Triton path: the five raw results of ``TokenStats`` [N], None where not wanted."""

    @staticmethod
    def apply(hidden2d, weight, bias, index, head: HeadMath, wants):
        logp, _lse, *rest = torch.ops.fastppo.fused_token_logprobs(hidden2d, weight, bias, index, *head, list(wants))
        return tuple(x if want else None for x, want in zip((logp, *rest), wants))


# --------------------------------------------------------------------------- public API
# Options shared by every entry point.


def requested_outputs(outputs, return_entropy, allowed: Sequence[str] = OUTPUTS) -> tuple[bool, ...]:
    """Which of ``OUTPUTS`` a call computes, as five flags: ``outputs`` names them, else (logprobs[, entropy])."""
    check_bool("return_entropy", return_entropy)
    if outputs is None:
        return (True, return_entropy, False, False, False)
    if return_entropy:
        raise ValueError("pass outputs=(...) or return_entropy=True, not both: outputs=('logprobs', 'entropy') "
                         "asks for both fields")
    names = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    unknown = [n for n in names if n not in OUTPUTS]
    if unknown or not names:
        raise ValueError(f"outputs must name one or more of {', '.join(OUTPUTS)}; got {outputs!r}")
    elsewhere = [n for n in names if n not in allowed]
    if elsewhere:
        raise ValueError(f"outputs: {', '.join(elsewhere)} need the vocabulary pass of the fused LM head; "
                         f"token_logprobs computes {' and '.join(allowed)} (use fused_token_logprobs for the others)")
    return tuple(n in names for n in OUTPUTS)


def _needs_index(wants) -> bool:
    return wants[0] or wants[4]


def _prepare_index(index, lead_shape, device, wants, ignore_index):
    """(index with ignored rows set to 0, the rows kept or None): ignored rows are never read out of range."""
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"ignore_index must be an int or None, got {type(ignore_index).__name__} {ignore_index!r}")
    if index is None:
        if _needs_index(wants):
            raise ValueError("index is required for the logprobs and is_top1 outputs; only outputs=('entropy',) "
                             "(or other target-free statistics) may pass index=None")
        return torch.zeros(lead_shape, dtype=torch.long, device=device), None
    if ignore_index is None:
        return index, None
    keep = index != ignore_index
    return torch.where(keep, index, torch.zeros((), dtype=index.dtype, device=index.device)), keep


def _ignored_rows_zeroed(hidden, keep):
    """hidden with the ignored rows replaced by 0 (a [N, H] select, no sync): their values, inf/NaN included,
    then reach no output and no gradient (the backward's dxᵀ·h would multiply them by a zero dx)."""
    if keep is None:
        return hidden
    return torch.where(keep[..., None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))


def _finish(raw, wants, keep, shape, return_entropy, outputs):
    """The caller's form of the five raw [N] results: ignored rows zeroed (no gradient through them), shaped."""
    fields = []
    for want, x in zip(wants, raw):
        if not want or x is None:
            fields.append(None)
            continue
        x = x.view(shape)
        if keep is not None:
            x = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
        fields.append(x)
    stats = TokenStats(*fields)
    if outputs is not None:
        return stats
    return (stats.logprobs, stats.entropy) if return_entropy else stats.logprobs


def head_math(temperature, softcap, logit_scale) -> HeadMath:
    """Checks ``softcap`` (None or > 0) and ``logit_scale`` (> 0) and folds them with T into (L7)'s constants."""
    temperature = check_temperature(temperature)
    logit_scale = check_float("logit_scale", logit_scale, minimum=0.0, exclusive_minimum=True)
    if softcap is None:
        return HeadMath(temperature / logit_scale, 1.0, 1.0, False)
    softcap = check_float("softcap", softcap, minimum=0.0, exclusive_minimum=True)
    return HeadMath(1.0, logit_scale / softcap, softcap / temperature, True)


# The public functions (their options are checked and shaped by the helpers above).


def _check_index(index, rows_name: str, rows: torch.Tensor) -> None:
    """``index`` (None allowed here; ``_prepare_index`` decides whether it is needed) of ``rows.shape[:-1]``."""
    if index is None:
        return
    check_tensor("index", index, dtypes=INDEX_DTYPES)
    if index.shape != rows.shape[:-1]:
        raise ValueError(
            f"index has shape {tuple(index.shape)} but must equal {rows_name}.shape[:-1] = {tuple(rows.shape[:-1])}"
        )
    check_same_device(**{rows_name: rows, "index": index})


def _check_token_logprobs_args(logits, index, temperature) -> float:
    check_tensor("logits", logits, min_ndim=1, dtypes=FLOAT_DTYPES)
    if logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary (last) dimension, got shape {tuple(logits.shape)}")
    _check_index(index, "logits", logits)
    return check_temperature(temperature)


def _check_fused_token_logprobs_args(hidden, weight, index, bias, compute_dtype):
    """Checks the tensors and casts them to the compute dtype: (hidden, weight, bias)."""
    check_lm_head_args(hidden, weight, bias, same_dtype=False)
    _check_index(index, "hidden", hidden)
    return lm_head_operands(hidden, weight, bias, compute_dtype)


def token_logprobs(logits, index, temperature=1.0, *, return_entropy=False, outputs=None, ignore_index=-100):
    """log_softmax(logits / temperature) gathered at ``index``, one pass over V.

    Args:
        logits: [..., V] floating tensor (fp16, bf16, fp32 or fp64).
        index: [...] int32/int64 token ids in [0, V) (or ``ignore_index``), the shape of
            ``logits.shape[:-1]``; None with ``outputs=("entropy",)``.
        temperature: float > 0; the distribution is softmax(logits / temperature). Positional, as in
            TRL's ``selective_log_softmax``; everything after it is keyword-only.
        return_entropy: also return the entropy of that distribution.
        outputs: instead of ``return_entropy``, the fields to compute among "logprobs" and "entropy"
            ("entropy" alone needs no index); the result is then a ``TokenStats``.
        ignore_index: rows whose index equals it (TRL's -100 on prompt and padding positions) get
            log-prob 0 and entropy 0 and pass no gradient, whatever their logits hold (inf/NaN
            included); None turns this off.

    Returns:
        ``logprobs`` [...] (fp32; fp64 for fp64 logits), or ``(logprobs, entropy)`` with
        ``return_entropy``, or a ``TokenStats`` with ``outputs``. Differentiable in ``logits``
        through both outputs.

    A drop-in for TRL's ``selective_log_softmax(logits / T, index)`` and
    ``entropy_from_logits(logits / T)``. Soft-capping and logit scales are a model's own
    forward's business when it returns logits; ``fused_token_logprobs`` applies them from hidden states.
    """
    temperature = _check_token_logprobs_args(logits, index, temperature)
    wants = requested_outputs(outputs, return_entropy, DIFFERENTIABLE_OUTPUTS)
    safe_index, keep = _prepare_index(index, logits.shape[:-1], logits.device, wants, ignore_index)
    if not use_triton(logits, (temperature,)):
        check_index_range(safe_index, logits.shape[-1])
        raw = _token_stats_reference(logits, safe_index, temperature, wants, keep)
        return _finish(raw, wants, keep, safe_index.shape, return_entropy, outputs)
    vocab = logits.shape[-1]
    check_index_range(safe_index, vocab)  # on CUDA an assertion on the device, no sync
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    logp, ent = _TokenLogprobs.apply(
        logits.reshape(-1, vocab), safe_index.reshape(-1).contiguous(), temperature, wants[1]
    )
    return _finish((logp, ent, None, None, None), wants, keep, safe_index.shape, return_entropy, outputs)


def fused_token_logprobs(hidden, weight, index, temperature=1.0, *, bias=None, return_entropy=False, outputs=None,
                         ignore_index=-100, softcap=None, logit_scale=1.0, compute_dtype=None):
    """``token_logprobs(hidden @ weight.T + bias, index, ...)`` without the [N, V] logits.

    Args:
        hidden: [..., H] hidden states (fp16, bf16, fp32 or fp64).
        weight: [V, H] LM-head weight; any strides (a tied embedding's transposed view is read in
            place, never copied).
        index: [...] int32/int64 token ids in [0, V) (or ``ignore_index``), the shape of
            ``hidden.shape[:-1]``; None when no requested output needs a target.
        temperature: float > 0, positional as in TRL; every option after it is keyword-only.
        bias: optional [V] LM-head bias.
        return_entropy: also return the entropy of softmax(z).
        outputs: instead of ``return_entropy``, the fields of ``TokenStats`` to compute, among
            ``OUTPUTS``: "logprobs", "entropy" (both differentiable), "log_sum_sq_probs",
            "mean_logits", "is_top1" (statistics of the same pass, no gradient).
        ignore_index: rows whose index equals it (default -100, TRL's label padding) hold 0 in every
            output and pass no gradient; their targets are never read, and their hidden states (inf/NaN
            included) reach no output and no gradient. None turns this off.
        softcap, logit_scale: the model's final-logit soft-cap (Gemma 2/3) and logit multiplier:
            z = softcap·tanh(logit_scale·x / softcap) / temperature, x = hidden @ weight.T + bias (L7);
            without ``softcap``, z = logit_scale·x / temperature.
        compute_dtype: the dtype hidden, weight and bias are multiplied in; None is TRL 1.x's rule
            (autocast's dtype when autocast is on for hidden's device and hidden is not fp64, else
            hidden's dtype). Operands of another dtype are cast first (a weight cast copies [V, H]).
            Accumulation is fp32 (fp64 for fp64) whatever it is, and the logits are never rounded to
            16 bits: ``_lmhead.COMPUTE_DTYPE_RULE``, the rule of every LM-head entry point.

    Returns:
        ``logprobs`` [...] fp32 (fp64 for fp64 operands), or ``(logprobs, entropy)``, or a
        ``TokenStats`` with ``outputs`` (``is_top1`` bool). Differentiable in ``hidden``, ``weight``
        and ``bias`` through log-probs and entropy (the entropy gradient is not dropped).
    """
    hidden, weight, bias = _check_fused_token_logprobs_args(hidden, weight, index, bias, compute_dtype)
    head = head_math(temperature, softcap, logit_scale)
    wants = requested_outputs(outputs, return_entropy)
    safe_index, keep = _prepare_index(index, hidden.shape[:-1], hidden.device, wants, ignore_index)
    hidden = _ignored_rows_zeroed(hidden, keep)
    vocab, hdim = weight.shape
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes above are the ones computed in
        if not use_triton(hidden, head[:3]):
            check_index_range(safe_index, vocab)
            transform = LogitTransform(float(temperature), None if softcap is None else float(softcap),
                                       float(logit_scale))
            raw = chunked_lm_head_stats(hidden.reshape(-1, hdim), weight, bias, safe_index.reshape(-1), transform,
                                        wants)
        else:
            check_index_range(safe_index, vocab)  # on CUDA an assertion on the device, no sync
            raw = _FusedTokenLogprobs.apply(
                hidden.reshape(-1, hdim), weight, bias, safe_index.reshape(-1).contiguous(), head, wants
            )
    return _finish(raw, wants, keep, safe_index.shape, return_entropy, outputs)


# --------------------------------------------------------------------------- references


def _token_stats_reference(logits, index, temperature, wants, keep=None):
    """The five raw results of ``TokenStats`` from materialised logits, in fp32 (fp64 for fp64 logits).

    Never in a wider dtype than that, so a bf16 [N, V] input costs fp32 [N, V]
    temporaries, not fp64 ones. The statistics are detached, as the kernel's are.
    ``keep``: the rows not ignored; an ignored row's logits are replaced by 0 first, so an inf/NaN there
    reaches no gradient (log_softmax's backward would multiply it by the row's zero gradient).
    """
    want_logp, want_entropy, want_sum_sq, want_mean, want_top1 = wants
    z = logits.to(acc_dtype(logits.dtype)) / temperature
    if keep is not None:
        z = torch.where(keep[..., None], z, torch.zeros((), dtype=z.dtype, device=z.device))
    log_p = torch.log_softmax(z, dim=-1)
    logp = log_p.gather(-1, index.long().unsqueeze(-1)).squeeze(-1) if want_logp else None
    ent = sum_sq = mean = top1 = None
    if want_entropy:
        p = log_p.exp()
        # p log p → 0 where p = 0: masking log p (not the product) keeps the
        # gradient finite at z = −inf as well.
        ent = -(p * log_p.masked_fill(p == 0, 0.0)).sum(-1)
    if want_sum_sq:
        sum_sq = torch.logsumexp(2 * log_p.detach(), dim=-1)
    if want_mean:
        mean = z.detach().mean(-1)
    if want_top1:
        top1 = z.detach().argmax(-1) == index  # argmax: the first maximum, as the kernel counts ties
    return logp, ent, sum_sq, mean, top1


def _lm_head_stats_reference(hidden, weight, bias, index, temperature, softcap, logit_scale, wants):
    """``_token_stats_reference`` of the materialised (L7) logits of an LM head."""
    logits = cap_logits_reference(lm_head_logits_reference(hidden, weight, bias), softcap, logit_scale)
    return _token_stats_reference(logits, index, temperature, wants)


def token_logprobs_reference(logits, index, temperature=1.0, *, return_entropy=False, outputs=None, ignore_index=-100):
    """Plain PyTorch ``token_logprobs`` (same arguments): materialised log_softmax, then gather.

    Also computes the three statistics of ``OUTPUTS`` (the fused kernel's oracle on given logits).
    """
    temperature = _check_token_logprobs_args(logits, index, temperature)
    wants = requested_outputs(outputs, return_entropy)
    safe_index, keep = _prepare_index(index, logits.shape[:-1], logits.device, wants, ignore_index)
    check_index_range(safe_index, logits.shape[-1])
    raw = _token_stats_reference(logits, safe_index, temperature, wants, keep)
    return _finish(raw, wants, keep, safe_index.shape, return_entropy, outputs)


def fused_token_logprobs_reference(hidden, weight, index, temperature=1.0, *, bias=None, return_entropy=False,
                                   outputs=None, ignore_index=-100, softcap=None, logit_scale=1.0,
                                   compute_dtype=None):
    """Plain PyTorch ``fused_token_logprobs`` (same arguments): the logits materialised in fp32 (fp64), then (L7)."""
    hidden, weight, bias = _check_fused_token_logprobs_args(hidden, weight, index, bias, compute_dtype)
    head_math(temperature, softcap, logit_scale)  # the same checks
    wants = requested_outputs(outputs, return_entropy)
    safe_index, keep = _prepare_index(index, hidden.shape[:-1], hidden.device, wants, ignore_index)
    hidden = _ignored_rows_zeroed(hidden, keep)
    check_index_range(safe_index, weight.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):
        raw = _lm_head_stats_reference(hidden, weight, bias, safe_index, temperature, softcap, logit_scale, wants)
    return _finish(raw, wants, keep, safe_index.shape, return_entropy, outputs)
