"""Per-token log-probabilities and entropies of a tempered softmax.

For one row of logits x ∈ R^V, temperature T and target token i:

    z = x / T,   lse = log Σ_j exp(z_j),   log p_j = z_j − lse              (1)
    logprob = z_i − lse                                                     (2)
    H = −Σ_j p_j log p_j = lse − Σ_j p_j z_j                                (3)

Gradients, with upstream g (for the logprob) and g_H (for the entropy):

    ∂ logprob / ∂z_j = δ_ij − p_j                                           (4)
    ∂H / ∂z_j = −Σ_k p_k(δ_kj − p_j)(log p_k + 1) = −p_j (log p_j + H)      (5)
    ∂L / ∂x_j = (g (δ_ij − p_j) − g_H p_j (log p_j + H)) / T                (6)

Both outputs come from one pass over the vocabulary with an online
log-sum-exp. The running state per row is (m, s, t) with m the running max,

    s = Σ_j exp(z_j − m),   t = Σ_j exp(z_j − m)(z_j − m),

so that lse = m + log s and, by (3), H = log s − t / s. t is kept relative to m
(not Σ e·z) so that H does not come from subtracting two numbers of size |z|:
with logits near ±1e4 that subtraction alone would lose ~1e-3 in fp32. When a
tile raises the max from m to m', with α = exp(m − m'):

    s' = α s + Σ_tile e_j,   t' = α (t + (m − m') s) + Σ_tile e_j (z_j − m')  (7)

where e_j = exp(z_j − m'). Two such states (from disjoint vocabulary ranges)
combine the same way, which is how the fused kernel splits V over programs.

Logits equal to −inf (banned tokens) are allowed: they get p = 0, contribute 0
to H (p log p → 0) and receive a zero gradient.

Precision: accumulation is fp32 for fp16/bf16/fp32 inputs and fp64 for fp64
inputs (so the Triton path can be gradchecked); outputs are fp32, or fp64 for
fp64 inputs. Gradients have the dtype of the input they belong to. The
temperature reaches the kernels as an fp32 scalar (T = 0.3 is off by 1e-8
relative even for fp64 inputs).

Layout of this module (flash-attn's ``ops/triton/cross_entropy.py`` order):
Triton kernels, host launchers, autograd Functions, the public functions, and
the plain PyTorch references, which are the oracle in the tests and the path
CPU tensors take.

``fused_token_logprobs`` design (why the backward is chunked, not fused):

* Forward is one fused Triton kernel: each program owns BLOCK_N rows and a
  contiguous range of V tiles; a logit tile [BLOCK_N, BLOCK_V] is
  ``tl.dot(hidden_block, weight_tileᵀ)`` accumulated over H in BLOCK_H chunks
  in fp32 and folded into the per-row state (7) at once, so [N, V] never
  exists. V is split over several programs when there are too few row blocks
  to fill the GPU; the per-split states [splits, N] are combined with (7).
  Extra memory O(N · splits).
* Backward is chunked over the *vocabulary*: for each chunk c of C columns,
  logits_c = hidden @ W_cᵀ (+ b_c) is recomputed by a GEMM with fp32 output, the
  Triton kernel shared with ``token_logprobs`` turns it into dz_c by (6) using
  the lse and H saved by the forward, then
      grad_W[c] = dz_cᵀ @ hidden        (a complete slice: no reduction across chunks)
      grad_b[c] = Σ_n dz_c
      grad_hidden += dz_c @ W_c         (fp32 accumulator, [N, H])
  A fully fused backward kernel would have to keep a [BLOCK_N, H] grad_hidden
  accumulator per program (256 KiB at H = 4096: does not fit in registers) or
  recompute the logit tile once per H chunk, or use atomics of that size per
  tile; chunking over V instead keeps the three GEMMs in cuBLAS, makes grad_W
  exact and deterministic with no fp32 [V, H] buffer (2 GiB at V=128256,
  H=4096), and bounds extra memory by O(N·C + N·H) with N·C ≈ 2^25 elements
  (128 MiB of fp32 logits) whatever V is. Chunking over N (Liger's choice)
  would need that fp32 [V, H] accumulator for grad_W. The recomputed logits
  round differently from the forward's tl.dot (last-bit differences), so the
  gradients are exact to fp32 rounding relative to each row's largest entry.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from fastppo.kernels._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    INDEX_DTYPES,
    check_index_range,
    check_same_device,
    check_temperature,
    check_tensor,
    tl,
    triton,
    use_triton,
)


# --------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _online_update(m, s, t, z, AXIS: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr):
        # Folds a tile z (−inf on masked lanes) into the state (m, s, t), eq. (7).
        # m' = −inf only while every logit seen so far is −inf; m_ref = 0 then
        # keeps exp() away from (−inf) − (−inf) = nan.
        m_new = tl.maximum(m, tl.max(z, AXIS))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        e = tl.exp(z - tl.expand_dims(m_ref, AXIS))
        if COMPUTE_ENTROPY:
            # e = 0 at z = −inf and s = 0 exactly while m = −inf: the products
            # below would be 0·(−inf) = nan there, so the −inf factor is
            # replaced by 0 first (not the product afterwards).
            m_b = tl.expand_dims(m_ref, AXIS)
            ez = e * (tl.where(e > 0, z, m_b) - m_b)
            shift = (tl.where(s > 0, m, m_ref) - m_ref) * s
            t = alpha * (t + shift) + tl.sum(ez, AXIS)
        s = alpha * s + tl.sum(e, AXIS)
        return m_new, s, t

    @triton.jit
    def _token_logprobs_fwd_kernel(
        X, stride_x,  # logits [N, V], unit stride along V
        IDX,  # [N] int32/int64
        LOGP, LSE, ENT,  # [N] outputs in ACC_DTYPE
        n_cols, temperature,
        COMPUTE_ENTROPY: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # One program per row, one pass over V in BLOCK_V tiles.
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x  # 64-bit: row·stride passes 2^31 at N·V > 2.1e9
        cols = tl.arange(0, BLOCK_V)
        m = tl.full((), float("-inf"), ACC_DTYPE)
        s = tl.zeros((), ACC_DTYPE)
        t = tl.zeros((), ACC_DTYPE)
        for v0 in range(0, n_cols, BLOCK_V):
            c = v0 + cols
            z = tl.load(x_row + c, mask=c < n_cols, other=float("-inf")).to(ACC_DTYPE) / temperature
            m, s, t = _online_update(m, s, t, z, 0, COMPUTE_ENTROPY)
        log_s = tl.log(s)
        lse = m + log_s
        # Out-of-range indices are not checked on CUDA (it would cost a host
        # sync); they give a nan logprob instead of a wrong number or a fault.
        idx = tl.load(IDX + row).to(tl.int64)
        valid = (idx >= 0) & (idx < n_cols)
        z_idx = tl.load(x_row + idx, mask=valid, other=float("nan")).to(ACC_DTYPE) / temperature
        tl.store(LOGP + row, z_idx - lse)
        tl.store(LSE + row, lse)
        if COMPUTE_ENTROPY:
            tl.store(ENT + row, log_s - t / s)

    @triton.jit
    def _token_logprobs_bwd_kernel(
        X, stride_x,  # logits (or a column chunk of them) [N, n_cols]
        DX, stride_dx,  # gradient out, same shape; may alias X
        IDX, LSE, ENT, G_LOGP, G_ENT,  # [N]
        col_offset,  # global vocabulary id of column 0 of X (chunked backward)
        n_cols, temperature,
        HAS_G_LOGP: tl.constexpr,
        HAS_G_ENT: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # Elementwise given the per-row lse and H saved by the forward, eq. (6);
        # grid (rows, column blocks) so every element is read and written once.
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = c < n_cols
        x = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(ACC_DTYPE)
        lse = tl.load(LSE + row).to(ACC_DTYPE)
        log_p = x / temperature - lse
        p = tl.exp(log_p)
        dz = tl.zeros([BLOCK_V], ACC_DTYPE)
        if HAS_G_LOGP:
            g = tl.load(G_LOGP + row).to(ACC_DTYPE)
            idx = tl.load(IDX + row).to(tl.int64)
            onehot = (c + col_offset) == idx
            dz += g * (tl.where(onehot, 1.0, 0.0) - p)
        if HAS_G_ENT:
            g_ent = tl.load(G_ENT + row).to(ACC_DTYPE)
            ent = tl.load(ENT + row).to(ACC_DTYPE)
            # p log p → 0 at z = −inf (p = 0, log p = −inf).
            dz -= g_ent * p * tl.where(p > 0, log_p + ent, 0.0)
        tl.store(DX + row * stride_dx + c, (dz / temperature).to(DX.dtype.element_ty), mask=mask)

    @triton.jit
    def _fused_logprobs_fwd_kernel(
        HID, stride_hn, stride_hh,  # hidden [N, H]
        W, stride_wv, stride_wh,  # weight [V, H]
        B,  # bias [V] (unused unless HAS_BIAS)
        IDX,  # [N]
        M_OUT, S_OUT, T_OUT, PICK_OUT,  # per-split states [splits, N]
        N, V, H, temperature, tiles_per_split,
        HAS_BIAS: tl.constexpr,
        COMPUTE_ENTROPY: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # Program (pid_n, pid_s): rows [pid_n·BLOCK_N, +BLOCK_N), vocabulary
        # tiles [pid_s·tiles_per_split, +tiles_per_split).
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        rows64 = rows.to(tl.int64)
        idx = tl.load(IDX + rows, mask=row_mask, other=-1).to(tl.int64)
        v_begin = pid_s * tiles_per_split * BLOCK_V
        v_end = tl.minimum(V, v_begin + tiles_per_split * BLOCK_V)

        m = tl.full([BLOCK_N], float("-inf"), ACC_DTYPE)
        s = tl.zeros([BLOCK_N], ACC_DTYPE)
        t = tl.zeros([BLOCK_N], ACC_DTYPE)
        pick = tl.zeros([BLOCK_N], ACC_DTYPE)
        hs = tl.arange(0, BLOCK_H)
        for v0 in range(v_begin, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_mask = cols < v_end
            cols64 = cols.to(tl.int64)
            acc = tl.zeros([BLOCK_N, BLOCK_V], ACC_DTYPE)
            # Logit tile = hidden[rows] @ W[cols]ᵀ; W is read transposed through
            # its strides, so no transposed copy of the weight is ever made.
            for h0 in range(0, H, BLOCK_H):
                h = h0 + hs
                h_mask = h < H
                a = tl.load(
                    HID + rows64[:, None] * stride_hn + h[None, :] * stride_hh,
                    mask=row_mask[:, None] & h_mask[None, :], other=0.0,
                )
                b = tl.load(
                    W + cols64[None, :] * stride_wv + h[:, None] * stride_wh,
                    mask=h_mask[:, None] & col_mask[None, :], other=0.0,
                )
                if DOT_UPCAST:
                    # Triton's interpreter multiplies the raw bits of bf16
                    # operands (numpy has no bf16); fp32 operands give the same
                    # products, which bf16 → fp32 represents exactly.
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                # out_dtype explicitly: Triton 3.6 defaults it to fp32 and rejects an fp64 acc.
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
            if HAS_BIAS:
                acc += tl.load(B + cols, mask=col_mask, other=0.0).to(ACC_DTYPE)[None, :]
            z = tl.where(col_mask[None, :], acc / temperature, float("-inf"))
            m, s, t = _online_update(m, s, t, z, 1, COMPUTE_ENTROPY)
            # The target logit sits in exactly one tile of one split.
            pick += tl.sum(tl.where(cols64[None, :] == idx[:, None], z, 0.0), 1)
        out = pid_s * N + rows64
        tl.store(M_OUT + out, m, mask=row_mask)
        tl.store(S_OUT + out, s, mask=row_mask)
        tl.store(PICK_OUT + out, pick, mask=row_mask)
        if COMPUTE_ENTROPY:
            tl.store(T_OUT + out, t, mask=row_mask)


# --------------------------------------------------------------------------- launchers


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation and output dtype: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Block sizes. Under the interpreter they are small so the tests cover several
# tiles (and the multi-split / multi-chunk paths) with tiny tensors. On GPU
# they are reasonable fixed choices, not yet tuned: `bench/tune.py` sweeps
# _row_block and _fused_tile on a GPU, and its winners belong here.


def _row_block(n_cols: int, on_gpu: bool) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for the row kernels of ``token_logprobs``."""
    if not on_gpu:
        return 32, 1
    block = min(4096, triton.next_power_of_2(n_cols))
    return block, (8 if block >= 2048 else 4)


class FusedTile(NamedTuple):
    """The fused forward's tile and launch choice (what a tuner varies; ``bench/tune.py``)."""

    block_n: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int


def _fused_tile(dtype: torch.dtype, device: torch.device) -> FusedTile:
    """Tile sizes and launch options of the fused forward, by dtype."""
    if device.type != "cuda":
        return FusedTile(16, 16, 16, 1, 1)  # tl.dot's minimum
    if dtype == torch.float64:
        return FusedTile(32, 32, 16, 4, 3)
    if dtype == torch.float32:
        return FusedTile(64, 64, 32, 8, 3)
    return FusedTile(64, 128, 64, 8, 3)


def _fused_blocks(n_rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile sizes, warps and the number of vocabulary splits for the fused forward."""
    tile = _fused_tile(dtype, device)
    if device.type != "cuda":
        target_programs = 4  # enough to exercise the split combine
    else:
        target_programs = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    row_blocks = triton.cdiv(n_rows, tile.block_n)
    v_tiles = triton.cdiv(vocab, tile.block_v)
    splits = max(1, min(v_tiles, triton.cdiv(target_programs, row_blocks)))
    tiles_per_split = triton.cdiv(v_tiles, splits)
    splits = triton.cdiv(v_tiles, tiles_per_split)  # no empty splits
    return dict(BLOCK_N=tile.block_n, BLOCK_V=tile.block_v, BLOCK_H=tile.block_h, splits=splits,
                tiles_per_split=tiles_per_split, row_blocks=row_blocks, num_warps=tile.num_warps,
                num_stages=tile.num_stages)


def _bwd_chunk_cols(n_rows: int, vocab: int, on_gpu: bool) -> int:
    """Columns per backward chunk of ``fused_token_logprobs``: N·C ≈ 2^25 on GPU."""
    if not on_gpu:
        return min(vocab, 48)  # small, and not a multiple of the kernel's BLOCK_V
    cols = max(256, ((1 << 25) // max(n_rows, 1)) // 256 * 256)
    return min(vocab, cols)


def _dot_precision(x: torch.Tensor) -> str:
    # fp32 follows torch's matmul setting (tf32 off by default) so the fused
    # kernel agrees with hidden @ weight.T; 16-bit and fp64 ignore it.
    if x.is_cuda and x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _launch_logprobs_fwd(x2d: torch.Tensor, index: torch.Tensor, temperature: float, compute_entropy: bool):
    n_rows, n_cols = x2d.shape
    acc = _acc_dtype(x2d.dtype)
    logp = torch.empty(n_rows, dtype=acc, device=x2d.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if compute_entropy else lse  # placeholder pointer when unused
    if n_rows > 0:
        block, warps = _row_block(n_cols, x2d.is_cuda)
        _token_logprobs_fwd_kernel[(n_rows,)](
            x2d, x2d.stride(0), index, logp, lse, ent, n_cols, temperature,
            COMPUTE_ENTROPY=compute_entropy, ACC_DTYPE=_tl_dtype(acc), BLOCK_V=block, num_warps=warps,
        )
    return logp, lse, (ent if compute_entropy else None)


def _launch_logprobs_bwd(x2d, dx2d, index, lse, ent, g_logp, g_ent, temperature, col_offset=0):
    """dx2d ← ∂L/∂x2d by (6). x2d may be a column chunk starting at ``col_offset``."""
    n_rows, n_cols = x2d.shape
    if n_rows == 0 or n_cols == 0:
        return dx2d
    block, warps = _row_block(n_cols, x2d.is_cuda)
    block = min(block, 1024)  # elementwise: more programs rather than longer ones
    grid = (n_rows, triton.cdiv(n_cols, block))
    _token_logprobs_bwd_kernel[grid](
        x2d, x2d.stride(0), dx2d, dx2d.stride(0), index, lse,
        ent if ent is not None else lse,
        g_logp if g_logp is not None else lse,
        g_ent if g_ent is not None else lse,
        col_offset, n_cols, temperature,
        HAS_G_LOGP=g_logp is not None, HAS_G_ENT=g_ent is not None,
        ACC_DTYPE=_tl_dtype(_acc_dtype(x2d.dtype)), BLOCK_V=block, num_warps=min(warps, 4),
    )
    return dx2d


def _launch_fused_fwd(hidden2d, weight, bias, index, temperature, compute_entropy):
    n_rows, _ = hidden2d.shape
    vocab, hdim = weight.shape
    acc = _acc_dtype(hidden2d.dtype)
    if n_rows == 0:
        empty = hidden2d.new_empty(0, dtype=acc)
        return empty, empty, (empty if compute_entropy else None)
    cfg = _fused_blocks(n_rows, vocab, hidden2d.dtype, hidden2d.device)
    splits = cfg["splits"]
    m_part = torch.empty(splits, n_rows, dtype=acc, device=hidden2d.device)
    s_part = torch.empty_like(m_part)
    pick_part = torch.empty_like(m_part)
    t_part = torch.empty_like(m_part) if compute_entropy else s_part
    _fused_logprobs_fwd_kernel[(cfg["row_blocks"], splits)](
        hidden2d, hidden2d.stride(0), hidden2d.stride(1),
        weight, weight.stride(0), weight.stride(1),
        bias if bias is not None else weight,
        index, m_part, s_part, t_part, pick_part,
        n_rows, vocab, hdim, temperature, cfg["tiles_per_split"],
        HAS_BIAS=bias is not None, COMPUTE_ENTROPY=compute_entropy,
        ACC_DTYPE=_tl_dtype(acc), DOT_PRECISION=_dot_precision(hidden2d),
        DOT_UPCAST=hidden2d.dtype == torch.bfloat16 and not hidden2d.is_cuda,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_V=cfg["BLOCK_V"], BLOCK_H=cfg["BLOCK_H"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    # Combine the split states with (7); a handful of [splits, N] ops, no sync.
    m = m_part.amax(0)
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    alpha = torch.exp(m_part - m_ref)
    s = (alpha * s_part).sum(0)
    log_s = torch.log(s)
    lse = m_ref + log_s
    valid = (index >= 0) & (index < vocab)
    logp = torch.where(valid, pick_part.sum(0) - lse, torch.full_like(lse, float("nan")))
    ent = None
    if compute_entropy:
        shift = (torch.where(s_part > 0, m_part, m_ref) - m_ref) * s_part
        t = (alpha * (t_part + shift)).sum(0)
        ent = log_s - t / s
    return logp, lse, ent


# torch.mm(..., out_dtype=torch.float32) (aten::mm.dtype, a CUDA kernel) keeps
# 16-bit operands and writes fp32. Where it is missing or refuses the dtypes
# we upcast the operands instead (slower, same result) and stop trying.
_mm_out_dtype_ok = "dtype" in torch.ops.aten.mm.overloads()


def _mm_acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 (fp64 for fp64) *output*: no rounding of the product to 16 bits."""
    global _mm_out_dtype_ok
    acc = _acc_dtype(a.dtype)
    if a.dtype == acc:
        return a @ b
    if a.is_cuda and _mm_out_dtype_ok:
        try:
            return torch.mm(a, b, out_dtype=acc)
        except (RuntimeError, TypeError, NotImplementedError):
            _mm_out_dtype_ok = False
    return a.to(acc) @ b.to(acc)


def _fused_backward(hidden2d, weight, bias, index, lse, ent, g_logp, g_ent, temperature, needs):
    """Gradients of ``fused_token_logprobs`` by V chunks (module docstring)."""
    need_h, need_w, need_b = needs
    n_rows, hdim = hidden2d.shape
    vocab = weight.shape[0]
    acc = _acc_dtype(hidden2d.dtype)
    grad_h = torch.zeros(n_rows, hdim, dtype=acc, device=hidden2d.device) if need_h else None
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
    grad_b = torch.empty_like(bias) if need_b else None
    chunk = _bwd_chunk_cols(n_rows, vocab, hidden2d.is_cuda)
    for v0 in range(0, vocab, chunk):
        v1 = min(vocab, v0 + chunk)
        w_c = weight[v0:v1]
        logits_c = _mm_acc(hidden2d, w_c.t())  # [N, C] fp32: same rounding as the forward
        if bias is not None:
            logits_c += bias[v0:v1]
        # dz in the operand dtype for the GEMMs (as autograd of hidden @ W.T would
        # have it); in place when that is already the accumulation dtype.
        dz_c = logits_c if hidden2d.dtype == acc else torch.empty_like(logits_c, dtype=hidden2d.dtype)
        _launch_logprobs_bwd(logits_c, dz_c, index, lse, ent, g_logp, g_ent, temperature, col_offset=v0)
        if need_w:
            torch.mm(dz_c.t(), hidden2d, out=grad_w[v0:v1])
        if need_b:
            grad_b[v0:v1] = dz_c.sum(0, dtype=acc)
        if need_h:
            if hidden2d.dtype == acc:
                grad_h.addmm_(dz_c, w_c)
            else:
                grad_h += _mm_acc(dz_c, w_c)
    if grad_h is not None:
        grad_h = grad_h.to(hidden2d.dtype)
    return grad_h, grad_w, grad_b


# --------------------------------------------------------------------------- autograd


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, index, temperature, compute_entropy):
        logp, lse, ent = _launch_logprobs_fwd(logits2d, index, temperature, compute_entropy)
        ctx.save_for_backward(logits2d, index, lse, ent)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # a None grad skips its term in (6)
        return (logp, ent) if compute_entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        logits2d, index, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None
        grad = torch.empty_like(logits2d, memory_format=torch.contiguous_format)
        _launch_logprobs_bwd(
            logits2d, grad, index, lse, ent,
            None if g_logp is None else g_logp.contiguous(),
            None if g_ent is None else g_ent.contiguous(),
            ctx.temperature,
        )
        return grad, None, None, None


class _FusedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, bias, index, temperature, compute_entropy):
        logp, lse, ent = _launch_fused_fwd(hidden2d, weight, bias, index, temperature, compute_entropy)
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
        grad_h, grad_w, grad_b = _fused_backward(
            hidden2d, weight, bias, index, lse, ent,
            None if g_logp is None else g_logp.contiguous(),
            None if g_ent is None else g_ent.contiguous(),
            ctx.temperature, needs,
        )
        return grad_h, grad_w, grad_b, None, None, None


# --------------------------------------------------------------------------- public API


def _check_logits_args(logits, index, temperature) -> float:
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


def _check_fused_args(hidden, weight, index, temperature, bias) -> float:
    check_tensor("hidden", hidden, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("index", index, dtypes=INDEX_DTYPES)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
    vocab, hdim = weight.shape
    if vocab == 0 or hdim == 0:
        raise ValueError(f"weight must be a non-empty [V, H] matrix, got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != hdim:
        raise ValueError(
            f"hidden has last dimension {hidden.shape[-1]} but weight has shape {tuple(weight.shape)} = [V, H]; "
            "hidden's last dimension must equal H"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}; they must match")
    if bias is not None and bias.shape[0] != vocab:
        raise ValueError(f"bias has shape {tuple(bias.shape)} but must be [V] = [{vocab}] to match weight")
    if index.shape != hidden.shape[:-1]:
        raise ValueError(
            f"index has shape {tuple(index.shape)} but must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}"
        )
    check_same_device(hidden=hidden, weight=weight, index=index, bias=bias)
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
    temperature = _check_logits_args(logits, index, temperature)
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
        weight: [V, H] LM-head weight, same dtype as ``hidden``.
        index: [...] int32/int64 token ids in [0, V), the shape of ``hidden.shape[:-1]``.
        temperature: float > 0.
        bias: optional [V] LM-head bias.
        return_entropy: also return the entropy of softmax(logits / temperature).

    Returns:
        ``logprobs`` [...] fp32 (fp64 for fp64 inputs), or ``(logprobs,
        entropy)``. Differentiable in ``hidden``, ``weight`` and ``bias``
        through both outputs (the entropy gradient is not dropped).
    """
    temperature = _check_fused_args(hidden, weight, index, temperature, bias)
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
    temperature = _check_logits_args(logits, index, temperature)
    check_index_range(index, logits.shape[-1])
    z = logits.to(_acc_dtype(logits.dtype)) / temperature
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
    temperature = _check_fused_args(hidden, weight, index, temperature, bias)
    acc = _acc_dtype(hidden.dtype)
    logits = hidden.to(acc) @ weight.to(acc).t()
    if bias is not None:
        logits = logits + bias.to(acc)
    return token_logprobs_reference(logits, index, temperature, return_entropy)
