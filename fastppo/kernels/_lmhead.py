"""The LM-head softmax core shared by ``fused_token_logprobs``, ``fused_full_kl`` and ``fused_ppo_policy_loss``.

Every LM-head kernel computes, for rows of logits z = (h·Wᵀ + b) / T over a
vocabulary of V, statistics of p = softmax(z) without storing [N, V]. What
they share lives here, once, so the copies cannot drift (issue 14):

* ``online_update``: the −inf-safe online log-sum-exp with the entropy state,
  and ``online_expectation``, a running Σ p·w folded in with the same rescale;
* ``logits_tile``: one [BLOCK_N, BLOCK_V] tile of z read through the strides
  of h and W (a tied, transposed weight is never copied), accumulated in an
  explicit dtype (fp32, or fp64 for fp64 inputs), bias added, temperature divided;
* ``softmax_dlogits``: ∂(g·log p_i + g_H·H)/∂z of one row, eq. (L5);
* host side: the tile/launch config type (``LMHeadTile``, ``RowTile``), the
  vocabulary split plan and the merge of split states, ``dot_precision``,
  ``sm_count``, GEMMs with an fp32 (fp64) *output* (``mm_acc``,
  ``addmm_acc_``), and the vocabulary-chunked backward
  ``vocab_chunked_backward(hidden, weight, bias, dlogits_fn)``;
* the chunked PyTorch path, what an LM-head call runs without Triton (on a
  CPU): ``chunked_lm_head_stats`` (the five per-token statistics, log-probs and
  entropy differentiable), ``chunked_logprobs_entropy`` (log-probs and entropy
  only: the core of ``fused_ppo_policy_loss``'s CPU path) and ``chunked_full_kl``
  (``fused_full_kl``'s), the same equations over [rows, cols] logits tiles; its
  section says why it chunks the vocabulary and how its passes are arranged.

Math, for one row with target token i (cited as (L1)-(L6) by the kernel modules):

    lse = log Σ_j e^{z_j},   log p_j = z_j − lse,   logprob = z_i − lse         (L1)
    H = −Σ_j p_j log p_j = lse − Σ_j p_j z_j                                    (L2)

The online state (m, s, t) with m the running max, s = Σ_j e^{z_j − m} and
t = Σ_j e^{z_j − m}(z_j − m) gives lse = m + log s and H = log s − t/s. t is
kept relative to m so that H is not a difference of two numbers of size |z|
(with logits near ±1e4 that alone would lose ~1e-3 in fp32). When a tile
raises the max from m to m', with α = e^{m − m'} and e_j = e^{z_j − m'}:

    s' = α s + Σ_tile e_j,   t' = α (t + (m − m') s) + Σ_tile e_j (z_j − m')   (L3)
    a' = α a + Σ_tile e_j w_j          (a running Σ e^{z−m} w: E_p[w] = a / s)   (L4)

Two states of disjoint vocabulary ranges combine the same way: the fused
forwards split V over programs and ``merge_splits`` combines the splits.
Logits equal to −inf (banned tokens) are allowed everywhere: they get p = 0,
add nothing to H or to a, and receive a zero gradient. m' = −inf only while
every logit seen is −inf; the update then uses 0 as the reference so that
exp never sees (−inf) − (−inf).

Gradients of L = g·logprob + g_H·H with respect to z_j (times 1/T for x = T·z):

    ∂L/∂z_j = g (δ_ij − p_j) − g_H p_j (log p_j + H)                            (L5)

Final-logit soft-capping (Gemma 2/3) and a logit scale s (Cohere, Granite,
Falcon-H1, ...) transform the raw logits x before the temperature, in TRL's
order: z = c·tanh(s·x / c) / T. With cap_in = s/c and cap_out = c/T:

    z = cap_out·tanh(cap_in·x),   ∂z/∂x = cap_in·cap_out·(1 − tanh²(cap_in·x))  (L7)

Without a cap, z = s·x / T is a temperature of T/s, and the kernels take it as one.

The vocabulary-chunked backward, for any loss of the logits x = h·Wᵀ + b
given ∂L/∂x chunk by chunk (``dlogits_fn``), for each chunk c of C columns:

    x_c = h @ W_cᵀ (+ b_c)   (a GEMM with fp32 output: no 16-bit logits)
    dx_c = dlogits_fn(c, x_c)
    grad_W[c] = dx_cᵀ @ h        (a complete slice: no reduction across chunks)
    grad_b[c] = Σ_n dx_c
    grad_h   += dx_c @ W_c       (an fp32 [N, H] accumulator; each chunk's product
                                  goes in unrounded: ``addmm_acc_``)            (L6)

Why chunked over V and not one fused backward kernel: a fused kernel would
keep a [BLOCK_N, H] grad_h accumulator per program (256 KiB at H = 4096: not
in registers), or recompute the logit tile once per H chunk, or use atomics;
chunking over V keeps the three GEMMs in cuBLAS, makes grad_W exact and
deterministic with no fp32 [V, H] buffer (2 GiB at V = 128,256, H = 4096), and
bounds extra memory by O(N·C + N·H) with N·C ≈ 2^25 elements whatever V is.
Chunking over N (Liger's choice) would need that fp32 [V, H] accumulator. The
recomputed logits round differently from the forward's tl.dot (last bits), so
gradients are exact to fp32 rounding relative to each row's largest entry.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from fastppo.kernels._common import FLOAT_DTYPES, HAS_TRITON, check_same_device, check_tensor, tile_choice, tl, triton

# --------------------------------------------------------------------------- kernels (device functions)

if HAS_TRITON:

    @triton.jit
    def online_update(m, s, t, z, AXIS: tl.constexpr, COMPUTE_T: tl.constexpr):
        """Folds a tile z (−inf on masked lanes) into (m, s, t) by (L3); returns (m', s', t', α, e)."""
        m_new = tl.maximum(m, tl.max(z, AXIS))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        m_b = tl.expand_dims(m_ref, AXIS)
        e = tl.exp(z - m_b)
        if COMPUTE_T:
            # e = 0 at z = −inf and s = 0 exactly while m = −inf: the products
            # below would be 0·(−inf) = nan there, so the −inf factor is
            # replaced first (not the product afterwards).
            ez = e * (tl.where(e > 0, z, m_b) - m_b)
            shift = (tl.where(s > 0, m, m_ref) - m_ref) * s
            t = alpha * (t + shift) + tl.sum(ez, AXIS)
        s = alpha * s + tl.sum(e, AXIS)
        return m_new, s, t, alpha, e

    @triton.jit
    def online_expectation(a, alpha, e, w, AXIS: tl.constexpr):
        """(L4) with the α and e of the same ``online_update``; lanes with e = 0 add nothing (w may be ±inf there)."""
        return alpha * a + tl.sum(e * tl.where(e > 0, w, 0.0), AXIS)

    @triton.jit
    def row_softmax(x_row, n_cols, temperature, COMPUTE_ENTROPY: tl.constexpr, ACC_DTYPE: tl.constexpr,
                    BLOCK_V: tl.constexpr):
        """(lse, H) of one row of logits x / T by (L1)-(L3), one pass in BLOCK_V tiles (H: with COMPUTE_ENTROPY)."""
        cols = tl.arange(0, BLOCK_V)
        m = tl.full((), float("-inf"), ACC_DTYPE)
        s = tl.zeros((), ACC_DTYPE)
        t = tl.zeros((), ACC_DTYPE)
        for v0 in range(0, n_cols, BLOCK_V):
            c = v0 + cols
            z = tl.load(x_row + c, mask=c < n_cols, other=float("-inf")).to(ACC_DTYPE) / temperature
            m, s, t, _, _ = online_update(m, s, t, z, 0, COMPUTE_ENTROPY)
        log_s = tl.log(s)
        return m + log_s, log_s - t / s

    @triton.jit
    def row_pick(x_row, idx, n_cols, temperature, ACC_DTYPE: tl.constexpr):
        """z_idx = x_row[idx] / T. Out-of-range indices are not checked on CUDA (it would cost a host
        sync): they give nan instead of a wrong number or a fault."""
        valid = (idx >= 0) & (idx < n_cols)
        return tl.load(x_row + idx, mask=valid, other=float("nan")).to(ACC_DTYPE) / temperature

    @triton.jit
    def split_program(N, V, tiles_per_split, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
        """Program (pid_n, pid_s) of a V-split fused forward: rows [pid_n·BLOCK_N, +BLOCK_N) (int64) and
        their mask, vocabulary tiles [pid_s·tiles_per_split, +tiles_per_split) as [v_begin, v_end)."""
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        v_begin = tl.program_id(1) * tiles_per_split * BLOCK_V
        return rows, rows < N, v_begin, tl.minimum(V, v_begin + tiles_per_split * BLOCK_V)

    @triton.jit
    def logits_tile(
        x_ptr, stride_xn, stride_xh,  # hidden [N, H]
        w_ptr, stride_wv, stride_wh,  # weight [V, H]
        b_ptr, stride_b,  # bias [V] (unused unless HAS_BIAS)
        rows, cols, row_mask, col_mask,  # int64 [BLOCK_N], int64 [BLOCK_V] and their masks
        H, temperature,
        HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """z = (x[rows] @ w[cols]ᵀ + b[cols]) / T as a [BLOCK_N, BLOCK_V] ACC_DTYPE tile, −inf on masked columns.

        Every operand is read through its strides (any layout: transposed, expanded with stride 0,
        offset views), and every offset is formed in int64: rows and columns are int64 here, and so is
        h, so h·stride_wh of a transposed (tied) [V, H] head, (H − 1)·V ≥ 2^31 at V = 128K, H = 16K,
        cannot wrap (a stride below 2^31 arrives as i32).
        """
        acc = tl.zeros([BLOCK_N, BLOCK_V], ACC_DTYPE)
        hs = tl.arange(0, BLOCK_H).to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + hs
            h_mask = h < H
            a = tl.load(x_ptr + rows[:, None] * stride_xn + h[None, :] * stride_xh,
                        mask=row_mask[:, None] & h_mask[None, :], other=0.0)
            # Wᵀ tile [BLOCK_H, BLOCK_V] read through W's strides: no transposed copy is ever made.
            b = tl.load(w_ptr + cols[None, :] * stride_wv + h[:, None] * stride_wh,
                        mask=h_mask[:, None] & col_mask[None, :], other=0.0)
            if DOT_UPCAST:
                # Triton's interpreter multiplies the raw bits of bf16 operands
                # (numpy has no bf16), and an fp64 accumulator needs fp64
                # operands: the upcast is exact either way.
                a = a.to(ACC_DTYPE)
                b = b.to(ACC_DTYPE)
            # out_dtype explicitly: Triton 3.6 defaults it to fp32 and rejects an fp64 acc.
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols * stride_b, mask=col_mask, other=0.0).to(ACC_DTYPE)[None, :]
        return tl.where(col_mask[None, :], acc / temperature, float("-inf"))

    @triton.jit
    def tanh(x):
        """tanh from one exp (Triton has no portable tanh); exact ±1 at ±inf, odd by construction."""
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def softcap_logits(x, col_mask, cap_in, cap_out):
        """z = cap_out·tanh(cap_in·x) by (L7) on a [BLOCK_N, BLOCK_V] tile of raw logits; −inf on masked columns."""
        return tl.where(col_mask[None, :], cap_out * tanh(cap_in * x), float("-inf"))

    @triton.jit
    def elementwise_tile(x_ptr, stride_xn, n_cols, temperature, ACC_DTYPE: tl.constexpr, BLOCK_V: tl.constexpr):
        """Program (row, column block) of an elementwise dlogits kernel: (row, columns, their mask, z = x / T)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = c < n_cols
        z = tl.load(x_ptr + row * stride_xn + c, mask=mask, other=0.0).to(ACC_DTYPE) / temperature
        return row, c, mask, z

    @triton.jit
    def store_dlogits(dx_ptr, stride_dxn, row, c, mask, dz, temperature):
        """∂L/∂x = ∂L/∂z / T into row ``row``, columns ``c`` of dx, in dx's dtype."""
        tl.store(dx_ptr + row * stride_dxn + c, (dz / temperature).to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def softmax_dlogits(z, lse, ent, g_logp, g_ent, onehot, HAS_G_LOGP: tl.constexpr, HAS_G_ENT: tl.constexpr):
        """∂L/∂z by (L5) for a tile of one row's z (−inf allowed: p = 0 and a zero gradient there)."""
        log_p = z - lse
        p = tl.exp(log_p)
        dz = tl.zeros_like(z)
        if HAS_G_LOGP:
            dz += g_logp * (tl.where(onehot, 1.0, 0.0) - p)
        if HAS_G_ENT:
            dz -= g_ent * p * tl.where(p > 0, log_p + ent, 0.0)  # p log p → 0 at z = −inf
        return dz


# --------------------------------------------------------------------------- launch configuration


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation and output dtype: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of an accumulation dtype (``acc_dtype``'s answer)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot's input precision: fp32 on CUDA follows torch's matmul setting (TF32 off by
    default) so a kernel agrees with ``hidden @ weight.T``; 16-bit and fp64 ignore it ("ieee")."""
    if device.type == "cuda" and dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def dot_upcast(dtype: torch.dtype, acc: torch.dtype, device: torch.device) -> bool:
    """Whether ``logits_tile`` casts its operands to the accumulation dtype first (see there)."""
    return (dtype == torch.bfloat16 and device.type != "cuda") or (acc == torch.float64 and dtype != acc)


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: no query per call)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


class LMHeadTile(NamedTuple):
    """A fused LM-head forward's tile and launch choice (what ``bench/tune.py`` varies)."""

    block_n: int  # rows per program
    block_v: int  # vocabulary columns per tile
    block_h: int  # reduction chunk of tl.dot
    num_warps: int
    num_stages: int


class RowTile(NamedTuple):
    """A row (or elementwise) kernel's tile: columns per step and warps."""

    block_v: int
    num_warps: int


INTERPRETER_LMHEAD_TILE = LMHeadTile(16, 16, 16, 1, 1)  # tl.dot's minimum: tiny tests still cover many tiles
FP64_LMHEAD_TILE = LMHeadTile(32, 32, 16, 4, 3)  # fp64 operands take twice the shared memory of fp32


def row_tile(n_cols: int, device: torch.device) -> RowTile:
    """Default for a kernel that walks rows of ``n_cols`` columns (not tuned on a GPU yet)."""
    if device.type != "cuda":
        return RowTile(32, 1)  # several tiles per row even for tiny test vocabularies
    block = min(4096, triton.next_power_of_2(n_cols))
    return RowTile(block, 8 if block >= 2048 else 4)


class SplitPlan(NamedTuple):
    row_blocks: int
    splits: int  # vocabulary slices per row block, each a program
    tiles_per_split: int


def split_plan(n_rows: int, vocab: int, tile: LMHeadTile, device: torch.device) -> SplitPlan:
    """Split V over programs when there are too few row blocks to fill the GPU (twice over)."""
    target_programs = 2 * sm_count(device) if device.type == "cuda" else 4  # 4: the merge runs in tests
    row_blocks = triton.cdiv(n_rows, tile.block_n)
    v_tiles = triton.cdiv(vocab, tile.block_v)
    splits = max(1, min(v_tiles, triton.cdiv(target_programs, row_blocks)))
    tiles_per_split = triton.cdiv(v_tiles, splits)
    return SplitPlan(row_blocks, triton.cdiv(v_tiles, tiles_per_split), tiles_per_split)  # no empty split


def softmax_dlogits_tile(n_cols: int, device: torch.device) -> RowTile:
    """The elementwise dlogits kernels of both LM-head backwards (logprobs' (L5), kl's (K2)):
    shorter blocks than a row kernel's, more programs rather than longer ones."""
    block, warps = row_tile(n_cols, device)
    return tile_choice("softmax_dlogits", RowTile(min(block, 1024), min(warps, 4)))


def bwd_chunk_cols(n_rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary columns per chunk of ``vocab_chunked_backward``: N·C ≈ 2^25 on a GPU."""
    if device.type != "cuda":
        cols = min(vocab, 48)  # small, and not a multiple of any kernel's block
    else:
        cols = min(vocab, max(256, ((1 << 25) // max(n_rows, 1)) // 256 * 256))
    return tile_choice("lmhead_backward", cols)


# --------------------------------------------------------------------------- launchers (host side of the core)


def check_lm_head_args(hidden, weight, bias, prefix: str = "", same_dtype: bool = True) -> None:
    """hidden [..., H], weight [V, H] (hidden's dtype if ``same_dtype``), bias [V]: errors name ``prefix + name``."""
    h_name, w_name, b_name = (prefix + n for n in ("hidden", "weight", "bias"))
    check_tensor(h_name, hidden, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor(w_name, weight, ndim=2, dtypes=FLOAT_DTYPES)
    if bias is not None:
        check_tensor(b_name, bias, ndim=1, dtypes=FLOAT_DTYPES)
    vocab, hdim = weight.shape
    if vocab == 0 or hdim == 0:
        raise ValueError(f"{w_name} must be a non-empty [V, H] matrix, got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != hdim:
        raise ValueError(
            f"{h_name} has last dimension {hidden.shape[-1]} but {w_name} has shape {tuple(weight.shape)} = [V, H]; "
            f"{h_name}'s last dimension must equal H"
        )
    if same_dtype and weight.dtype != hidden.dtype:
        raise TypeError(f"{w_name} has dtype {weight.dtype} but {h_name} has {hidden.dtype}; they must match")
    if bias is not None and bias.shape[0] != vocab:
        raise ValueError(f"{b_name} has shape {tuple(bias.shape)} but must be [V] = [{vocab}] to match {w_name}")
    if same_dtype and bias is not None and bias.dtype != hidden.dtype:
        raise TypeError(f"{b_name} has dtype {bias.dtype} but {h_name} has {hidden.dtype}; they must match")
    check_same_device(**{h_name: hidden, w_name: weight, b_name: bias})


COMPUTE_DTYPE_RULE = """The compute-dtype rule of every LM-head entry point (fused_token_logprobs, fused_full_kl,
fused_ppo_policy_loss), on the Triton path and the reference alike, applied by ``lm_head_operands``:

* the operands (hidden, weight, bias) are multiplied in the compute dtype: ``compute_dtype`` when the
  function takes one and it is given; else autocast's dtype when autocast is on for hidden's device and
  hidden is not fp64 (autocast never lowers fp64); else hidden's dtype. An operand of another dtype is
  cast (a weight cast copies [V, H]);
* accumulation is fp32, fp64 when the compute dtype is fp64 (fused_full_kl: when either model's is);
* the logits are never rounded to 16 bits: GEMMs with an fp32 (fp64) output, autocast off inside;
* outputs are in the accumulation dtype; gradients in the dtype of the tensor they belong to.
"""


def compute_dtype_of(hidden: torch.Tensor, compute_dtype=None) -> torch.dtype:
    """The compute dtype of ``COMPUTE_DTYPE_RULE`` for ``hidden`` (``compute_dtype`` None: the default)."""
    if compute_dtype is not None:
        if compute_dtype not in FLOAT_DTYPES:
            raise TypeError(f"compute_dtype must be one of {', '.join(map(str, FLOAT_DTYPES))} or None, "
                            f"got {compute_dtype!r}")
        return compute_dtype
    device_type = hidden.device.type
    if hidden.dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def no_autocast(device: torch.device):
    """Autocast off for ``device``'s type: the LM-head launchers and backwards choose their own dtypes."""
    return torch.autocast(device.type, enabled=False)


def lm_head_operands(hidden, weight, bias, compute_dtype=None):
    """(hidden, weight, bias) in the compute dtype of ``COMPUTE_DTYPE_RULE`` (a no-op when they already are)."""
    dtype = compute_dtype_of(hidden, compute_dtype)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


class SoftmaxStats(NamedTuple):
    lse: torch.Tensor  # [N]
    entropy: torch.Tensor | None  # [N], from t
    mean: torch.Tensor | None  # [N], E_p[w] from a
    log_sum_sq: torch.Tensor | None = None  # [N], log Σ_j p_j² from q


def merge_splits(m_part, s_part, t_part=None, a_part=None, q_part=None) -> SoftmaxStats:
    """Combine [splits, N] states of disjoint vocabulary slices by (L3)/(L4): a few [splits, N] ops, no sync.

    ``q_part`` is Σ e^{2(z − m)} per split (rescaled by α² when the max moves):
    log Σ p² = log q − 2 log s.
    """
    m = m_part.amax(0)
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    alpha = torch.exp(m_part - m_ref)
    s = (alpha * s_part).sum(0)
    log_s = torch.log(s)
    entropy = mean = None
    if t_part is not None:
        shift = (torch.where(s_part > 0, m_part, m_ref) - m_ref) * s_part
        entropy = log_s - (alpha * (t_part + shift)).sum(0) / s
    if a_part is not None:
        mean = (alpha * a_part).sum(0) / s
    log_sum_sq = None
    if q_part is not None:
        log_sum_sq = torch.log((alpha * alpha * q_part).sum(0)) - 2 * log_s
    return SoftmaxStats(m_ref + log_s, entropy, mean, log_sum_sq)


# torch.mm(..., out_dtype=torch.float32) (aten::mm.dtype) keeps 16-bit operands and
# writes fp32; addmm likewise accumulates into fp32. Where that is missing for a
# (device type, operand dtype, output dtype) the operands are upcast instead
# (twice the memory for the operands). The choice is made once per key, before any
# real call, by ``wide_output_ok``: an error of a real call (an out-of-memory
# above all) is that call's error and propagates; nothing retries it.
_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads() and "dtype_out" in torch.ops.aten.addmm.overloads()
_WIDE_OUT: dict[tuple[str, torch.dtype, torch.dtype], bool] = {}  # (device type, operand, output dtype) -> ok


def _probe_wide_out(device: torch.device, in_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether the three wide-output calls of ``mm_acc``/``addmm_acc_`` run and are right on 2×2 tensors.

    Not supported (the op refuses the device or dtypes, or is too old for
    ``out_dtype``) is False; an out-of-memory propagates (it says nothing
    about support, and nothing is cached then).
    """
    with torch.no_grad():
        a = torch.ones(2, 2, dtype=in_dtype, device=device)
        try:
            results = (
                torch.mm(a, a, out_dtype=out_dtype),
                torch.mm(a, a, out_dtype=out_dtype, out=torch.empty(2, 2, dtype=out_dtype, device=device)),
                torch.addmm(torch.ones(2, 2, dtype=out_dtype, device=device), a, a, out_dtype=out_dtype,
                            out=torch.empty(2, 2, dtype=out_dtype, device=device)),
            )
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError):
            return False
        return all(r.dtype == out_dtype for r in results) and [r.tolist() for r in results] == [
            [[2.0, 2.0]] * 2, [[2.0, 2.0]] * 2, [[3.0, 3.0]] * 2]


def wide_output_ok(device: torch.device, in_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether ``mm_acc``/``addmm_acc_`` multiply ``in_dtype`` operands on ``device`` straight into ``out_dtype``.

    Decided once per (device type, in_dtype, out_dtype): on CUDA by a probe on
    tiny tensors (``_probe_wide_out``); elsewhere never (CPU has no such
    kernel, and its upcast operands are the reference numerics).
    """
    key = (device.type, in_dtype, out_dtype)
    ok = _WIDE_OUT.get(key)
    if ok is None:
        ok = device.type == "cuda" and _HAS_OUT_DTYPE and _probe_wide_out(device, in_dtype, out_dtype)
        _WIDE_OUT[key] = ok
    return ok


def mm_acc(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with an fp32 (fp64 for fp64) *output* (into ``out`` if given): never rounded to 16 bits."""
    acc = acc_dtype(a.dtype)
    if a.dtype == acc:
        return torch.mm(a, b, out=out)
    if wide_output_ok(a.device, a.dtype, acc):
        return torch.mm(a, b, out_dtype=acc) if out is None else torch.mm(a, b, out_dtype=acc, out=out)
    return torch.mm(a.to(acc), b.to(acc), out=out)


def addmm_acc_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out += a @ b, ``out`` in the accumulation dtype; a 16-bit product is added unrounded.

    Adding ``a @ b`` computed in 16 bits would round every call's product to
    16 bits before the fp32 sum: the rounding fused_full_kl's backward had
    (issue 14; tests/test_lmhead.py has a test that sees it).
    """
    if a.dtype == out.dtype:
        return out.addmm_(a, b)
    if wide_output_ok(a.device, a.dtype, out.dtype):
        return torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    return out.add_(mm_acc(a, b))


def vocab_chunked_backward(
    hidden2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dlogits_fn: Callable[[int, int, torch.Tensor], torch.Tensor],
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(grad_hidden, grad_weight, grad_bias) of a loss of x = hidden @ weightᵀ + bias, by (L6).

    ``hidden2d`` and ``weight`` share a dtype. ``dlogits_fn(v0, v1, x_c)`` gets
    the fp32 (fp64) logits of columns [v0, v1) for every row and returns
    ∂L/∂x_c [N, v1 − v0] in that dtype (as autograd of ``hidden @ weight.T``
    would have it); it may write into ``x_c`` when the dtypes agree. ``needs``
    says which of the three gradients to form; each comes back in the dtype of
    the tensor it belongs to.
    """
    need_h, need_w, need_b = needs
    n_rows, hdim = hidden2d.shape
    vocab = weight.shape[0]
    acc = acc_dtype(hidden2d.dtype)
    grad_h = torch.zeros(n_rows, hdim, dtype=acc, device=hidden2d.device) if need_h else None
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
    grad_b = torch.empty(vocab, dtype=bias.dtype, device=bias.device) if need_b else None
    chunk = bwd_chunk_cols(n_rows, vocab, hidden2d.device)
    for v0, v1 in _spans(vocab, chunk):
        w_c = weight[v0:v1]
        x_c = mm_acc(hidden2d, w_c.t())  # [N, C] fp32 (fp64): the forward's rounding
        if bias is not None:
            x_c += bias[v0:v1]
        dx_c = dlogits_fn(v0, v1, x_c)
        if need_w:
            torch.mm(dx_c.t(), hidden2d, out=grad_w[v0:v1])
        if need_b:
            grad_b[v0:v1] = dx_c.sum(0, dtype=acc)
        if need_h:
            addmm_acc_(grad_h, dx_c, w_c)
    if grad_h is not None:
        grad_h = grad_h.to(hidden2d.dtype)
    return grad_h, grad_w, grad_b


# --------------------------------------------------------------------------- the chunked PyTorch path (CPU)
#
# What a call takes when it does not take the Triton path (``_common.use_triton`` False: CPU tensors without
# the interpreter, and fp64 calls with a scalar fp32 cannot hold): the same (L1)-(L7) in plain PyTorch, over
# tiles of [rows, cols] logits, so the fp32 (fp64) [N, V] logits never exist in the forward or the backward.
#
# Why vocabulary chunks with an online log-sum-exp (the fused kernel's (L3)) and not chunks of tokens
# (Liger's): the backward then writes each chunk's grad_W slice completely (no accumulation across chunks, so
# no fp32 [V, H] buffer for a 16-bit weight, and for an fp32 weight the gradient is written in place), grad_h
# is an [N, H] accumulator (small: N·H ≪ V·H), and all rows go through one GEMM per chunk, the shape at which
# a CPU GEMM runs at full rate. Token blocks are added only when N alone would pass the tile budget.
#
# Per tile the forward is one GEMM (operands upcast to the accumulation dtype: exact, as the reference does),
# the reference's elementwise transform in place, and a fold of a few in-place passes into [N] states
# (m, s, t, q, Σz, the target's z, the running first argmax); the backward recomputes the tile and forms
# (L5)·(L7) with the per-row lse and H the forward saved, in three passes without entropy and five with it:
#
#     u = z − (lse − H) = log p + H,   p' = e^u = p·e^H,
#     ∂L/∂x = k·p'·(a'·u + b') + k·g·δ_i,   a' = −g_H·e^{−H},  b' = −g·e^{−H},  k = logit_scale / T   (no cap)
#
# (with a cap, k = logit_scale / T times (1 − tanh²), (L7)). A −inf logit (a −inf bias entry, no cap) has
# p' = 0 and u = −inf; u is clamped to −1e4 after the exp (where p' is already exactly 0) so 0·(−inf) never
# forms; the clamp runs only when the bias holds a −inf.


class LogitTransform(NamedTuple):
    """The reference's transform of raw logits x, (L7): z = softcap·tanh(logit_scale·x / softcap) / T, or
    z = logit_scale·x / T without a cap."""

    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0


class ChunkPlan(NamedTuple):
    """Rows and vocabulary columns of one logits tile of the chunked path."""

    rows: int
    cols: int


# Elements of one [rows, cols] logits tile (fp32: 16 MiB; two such buffers live at once, three in a backward
# with entropy). Swept over 2^21-2^24 on the project's 2-core Xeon at the two heads of
# bench/cpu_lmhead_memory.py (N 1,024 × V 151,936 and N 2,048 × V 49,152), fp32 and bf16, fwd and fwd+bwd:
# 2^22 was the fastest or within 8% of it in every case (larger tiles were never faster, and cost memory).
CHUNK_ELEMENTS = 1 << 22
MIN_CHUNK_COLS = 1024  # below this a CPU GEMM loses rate: more rows are split off into token blocks instead


def chunk_plan(n_rows: int, vocab: int, chunk: int | tuple[int, int] | None = None) -> ChunkPlan:
    """The tile of the chunked path: ``chunk`` given as (rows, cols) or as cols (all rows), else the default:
    all rows and CHUNK_ELEMENTS / N columns while that is at least MIN_CHUNK_COLS, else token blocks too."""
    if chunk is None:
        rows = max(1, min(n_rows, CHUNK_ELEMENTS // MIN_CHUNK_COLS))
        cols = CHUNK_ELEMENTS // rows
    elif isinstance(chunk, int):
        rows, cols = max(1, n_rows), chunk
    else:
        rows, cols = chunk
    if rows < 1 or cols < 1:
        raise ValueError(f"chunk must give at least one row and one column, got {chunk!r}")
    return ChunkPlan(rows, min(vocab, cols))


def _tile(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous [rows, cols] view of the front of a flat buffer (GEMMs write into it with out=)."""
    return buffer[:rows * cols].view(rows, cols)


def _spans(total: int, step: int):
    """(start, stop) of each chunk of ``step`` (the last one shorter) covering range(total)."""
    for start in range(0, total, step):
        yield start, min(total, start + step)


def span_tiles(total: int, step: int, width: int, dtype: torch.dtype, device: torch.device):
    """(start, stop, tile) for each chunk of ``step`` rows of range(total): ``tile`` a contiguous [stop − start,
    width] view of one buffer allocated once, for a GEMM to write with out=."""
    buffer = torch.empty(min(step, total) * width, dtype=dtype, device=device)
    for start, stop in _spans(total, step):
        yield start, stop, _tile(buffer, stop - start, width)


def _weight_grad_tile(grad_w, gw_acc, v0: int, v1: int, hdim: int):
    """Where a vocabulary chunk's weight gradient is summed: ``grad_w``'s rows themselves, or the accumulation
    dtype's tile (``gw_acc``) when the weight's dtype is narrower."""
    return grad_w[v0:v1] if gw_acc is None else _tile(gw_acc, v1 - v0, hdim)


class _Operands(NamedTuple):
    hidden: torch.Tensor  # [N, H] in the accumulation dtype (an upcast copy of a 16-bit hidden)
    weight: torch.Tensor  # [V, H] as given (any strides)
    bias: torch.Tensor | None
    acc: torch.dtype
    hidden_dtype: torch.dtype  # the caller's: grad_hidden's dtype
    wbuf: torch.Tensor | None  # [cols·H] for a 16-bit weight's chunk, upcast

    def weight_chunk(self, v0: int, v1: int) -> torch.Tensor:
        w_c = self.weight[v0:v1]
        if self.wbuf is None:
            return w_c
        return _tile(self.wbuf, v1 - v0, w_c.shape[1]).copy_(w_c)  # exact upcast, no allocation

    def logits_(self, x: torch.Tensor, r0: int, r1: int, v0: int, v1: int, w_c: torch.Tensor) -> torch.Tensor:
        """x ← hidden[r0:r1] @ weight[v0:v1]ᵀ (+ bias[v0:v1]) in the accumulation dtype."""
        torch.mm(self.hidden[r0:r1], w_c.t(), out=x)
        if self.bias is not None:
            x.add_(self.bias[v0:v1])
        return x


def _operands(hidden2d, weight, bias, plan: ChunkPlan, acc: torch.dtype | None = None) -> _Operands:
    acc = acc_dtype(hidden2d.dtype) if acc is None else acc
    wbuf = None
    if weight.dtype != acc:
        wbuf = torch.empty(plan.cols * weight.shape[1], dtype=acc, device=weight.device)
    return _Operands(hidden2d.to(acc), weight, None if bias is None else bias.to(acc), acc, hidden2d.dtype, wbuf)


def _neg_inf_logits_possible(bias, transform: LogitTransform) -> bool:
    """Whether a logit can be −inf (a banned token's −inf bias; a cap bounds it): the guarded passes are needed."""
    return bias is not None and transform.softcap is None and bool(torch.isneginf(bias).any())


def _transform_(x: torch.Tensor, transform: LogitTransform, tanh_out: torch.Tensor | None = None) -> torch.Tensor:
    """z from raw logits x, in place, in the reference's order of operations (``cap_logits_reference`` then
    ``/ T``: the same rounding); with ``tanh_out`` the capped tanh is kept there (for (L7)'s derivative)."""
    temperature, softcap, logit_scale = transform
    if logit_scale != 1.0:
        x.mul_(logit_scale)
    if softcap is not None:
        x.div_(softcap)
        if tanh_out is None:
            x.tanh_()
        else:
            torch.tanh(x, out=tanh_out)
            x.copy_(tanh_out)
        x.mul_(softcap)
    if temperature != 1.0:
        x.div_(temperature)
    return x


def _chunked_forward(ops: _Operands, index, transform: LogitTransform, wants, plan: ChunkPlan, guard: bool):
    """(logp, lse, entropy, log_sum_sq_probs, mean_logits, is_top1) [N], each of the last four None unless wanted."""
    want_logp, want_entropy, want_sum_sq, want_mean, want_top1 = wants
    n_rows = ops.hidden.shape[0]
    vocab = ops.weight.shape[0]
    acc, device = ops.acc, ops.hidden.device
    m = torch.full((n_rows,), float("-inf"), dtype=acc, device=device)
    s = torch.zeros(n_rows, dtype=acc, device=device)
    t = torch.zeros_like(s) if want_entropy else None
    q = torch.zeros_like(s) if want_sum_sq else None
    zsum = torch.zeros_like(s) if want_mean else None
    pick = torch.zeros_like(s)
    best = torch.full_like(s, float("-inf")) if want_top1 else None
    best_at = torch.zeros(n_rows, dtype=torch.long, device=device) if want_top1 else None
    index = index.long()
    size = plan.rows * plan.cols
    xbuf = torch.empty(size, dtype=acc, device=device)
    ebuf = torch.empty(size, dtype=acc, device=device)
    for v0, v1 in _spans(vocab, plan.cols):
        w_c = ops.weight_chunk(v0, v1)
        for r0, r1 in _spans(n_rows, plan.rows):
            x = _transform_(ops.logits_(_tile(xbuf, r1 - r0, v1 - v0), r0, r1, v0, v1, w_c), transform)
            rs = slice(r0, r1)
            if want_mean:
                zsum[rs] += x.sum(1)
            local = index[rs] - v0
            inside = (local >= 0) & (local < v1 - v0)
            target = x.gather(1, local.clamp(0, v1 - v0 - 1)[:, None])[:, 0]
            pick[rs] = torch.where(inside, target, pick[rs])
            if want_top1:  # the first argmax over V: a later chunk wins only with a strictly larger max
                chunk_max, chunk_at = torch.max(x, 1)
                better = chunk_max > best[rs]
                best_at[rs] = torch.where(better, chunk_at + v0, best_at[rs])
                best[rs] = torch.where(better, chunk_max, best[rs])
            else:
                chunk_max = x.amax(1)
            # (L3): rebase the state from m to m' (0 as the reference while every logit seen is −inf)
            m_old, s_old = m[rs], s[rs]
            m_new = torch.maximum(m_old, chunk_max)
            m_ref = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m_old - m_ref)
            d = x.sub_(m_ref[:, None])  # z − m'
            e = torch.exp(d, out=_tile(ebuf, r1 - r0, v1 - v0))
            # d is not needed after this: e·d and e² are formed in its place (a batched dot, bmm, is 4x slower)
            if want_entropy:
                if guard:
                    d.clamp_min_(-1e4)  # e is exactly 0 there already: 0·(−1e4) instead of 0·(−inf)
                shift = (torch.where(s_old > 0, m_old, m_ref) - m_ref) * s_old
                t[rs] = alpha * (t[rs] + shift) + torch.mul(e, d, out=d).sum(1)
            if want_sum_sq:
                q[rs] = alpha * alpha * q[rs] + torch.mul(e, e, out=d).sum(1)
            s[rs] = alpha * s_old + e.sum(1)
            m[rs] = m_new
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    log_s = torch.log(s)
    lse = m_ref + log_s
    logp = pick - lse if want_logp else None
    entropy = log_s - t / s if want_entropy else None
    log_sum_sq = torch.log(q) - 2 * log_s if want_sum_sq else None
    mean = zsum / vocab if want_mean else None
    top1 = best_at == index if want_top1 else None
    return logp, lse, entropy, log_sum_sq, mean, top1


def _add_tile_gradients(x, hidden_rows, w_c, first_block: bool, gw_c, grad_b, grad_h, rows: slice, cols: slice):
    """One [rows, cols] tile of ∂L/∂logits into the gradients (each None when not wanted): grad_W's chunk
    (written by the first row block, added to by the others), grad_b's columns, grad_h's rows."""
    if gw_c is not None:
        if first_block:
            torch.mm(x.t(), hidden_rows, out=gw_c)
        else:
            gw_c.addmm_(x.t(), hidden_rows)
    if grad_b is not None:
        grad_b[cols] += x.sum(0)
    if grad_h is not None:
        grad_h[rows].addmm_(x, w_c)


def _chunked_backward(ops: _Operands, weight, bias, index, lse, ent, g_logp, g_ent, transform: LogitTransform,
                      plan: ChunkPlan, guard: bool, needs):
    """(grad_hidden, grad_weight, grad_bias) of L = Σ g·logp + g_H·H by (L5)·(L7), recomputing tile by tile."""
    need_h, need_w, need_b = needs
    n_rows, hdim = ops.hidden.shape
    vocab = weight.shape[0]
    acc, device = ops.acc, ops.hidden.device
    k = transform.logit_scale / transform.temperature  # ∂z/∂x without a cap; with one, times (1 − tanh²)
    capped = transform.softcap is not None
    index = index.long()
    # per-row coefficients (module comment above): u = z − (lse − H), ∂L/∂x = k·p'·(a'u + b') + k·g·δ
    if g_ent is not None:
        g_ent = g_ent.to(acc)
        shift = lse - ent
        scale = torch.exp(-ent)
        a_coef = (-k * g_ent * scale)[:, None]
        b_coef = (torch.zeros_like(lse) if g_logp is None else -k * g_logp.to(acc) * scale)[:, None]
    else:
        shift = lse
        b_coef = (-k * g_logp.to(acc))[:, None]
    target_add = None if g_logp is None else k * g_logp.to(acc)
    grad_h = torch.zeros(n_rows, hdim, dtype=acc, device=device) if need_h else None
    grad_w = (torch.zeros if n_rows == 0 else torch.empty)(weight.shape, dtype=weight.dtype, device=device) \
        if need_w else None
    grad_b = torch.zeros(vocab, dtype=acc, device=device) if need_b else None
    gw_acc = None
    if need_w and weight.dtype != acc:
        gw_acc = torch.empty(plan.cols * hdim, dtype=acc, device=device)
    size = plan.rows * plan.cols
    xbuf = torch.empty(size, dtype=acc, device=device)
    pbuf = torch.empty(size, dtype=acc, device=device) if g_ent is not None else None
    tbuf = torch.empty(size, dtype=acc, device=device) if capped else None
    for v0, v1 in _spans(vocab, plan.cols):
        c = v1 - v0
        w_c = ops.weight_chunk(v0, v1)
        gw_c = None
        if need_w:
            gw_c = _weight_grad_tile(grad_w, gw_acc, v0, v1, hdim)
        for r0, r1 in _spans(n_rows, plan.rows):
            rs = slice(r0, r1)
            th = _tile(tbuf, r1 - r0, c) if capped else None
            x = _transform_(ops.logits_(_tile(xbuf, r1 - r0, c), r0, r1, v0, v1, w_c), transform, th)
            x.sub_(shift[rs, None])
            if g_ent is None:  # ∂L/∂x = −k·g·p (+ k·g at the target): three passes
                x.exp_().mul_(b_coef[rs])
            else:
                p = torch.exp(x, out=_tile(pbuf, r1 - r0, c))
                if guard:
                    x.clamp_min_(-1e4)  # p' is exactly 0 there already
                torch.addcmul(b_coef[rs], x, a_coef[rs], out=x)
                x.mul_(p)
            if target_add is not None:
                local = index[rs] - v0
                inside = (local >= 0) & (local < c)
                x.scatter_add_(1, local.clamp(0, c - 1)[:, None],
                               torch.where(inside, target_add[rs], torch.zeros_like(target_add[rs]))[:, None])
            if capped:  # (L7): times 1 − tanh²
                x.mul_(torch.addcmul(torch.ones((), dtype=acc, device=device), th, th, value=-1.0, out=th))
            _add_tile_gradients(x, ops.hidden[rs], w_c, r0 == 0, gw_c, grad_b, grad_h, rs, slice(v0, v1))
        if gw_acc is not None and n_rows > 0:
            grad_w[v0:v1].copy_(gw_c)
    return (None if grad_h is None else grad_h.to(ops.hidden_dtype),
            grad_w, None if grad_b is None else grad_b.to(bias.dtype))


def _materialised_stats(hidden2d, weight, bias, index, transform: LogitTransform, want_entropy: bool):
    """(logp, entropy) from the whole [N, V] logits with autograd: the chunked path's double backward only
    (``create_graph=True`` needs a differentiable first backward; this one costs O(N·V), as the reference)."""
    logits = cap_logits_reference(lm_head_logits_reference(hidden2d, weight, bias), transform.softcap,
                                  transform.logit_scale)
    log_p = torch.log_softmax(logits / transform.temperature, dim=-1)
    logp = log_p.gather(-1, index.long()[:, None])[:, 0]
    entropy = None
    if want_entropy:
        p = log_p.exp()
        entropy = -(p * log_p.masked_fill(p == 0, 0.0)).sum(-1)
    return logp, entropy


# the profiler range the chunked LM head runs under (bench/profile_update.py sums the time inside it)
LM_HEAD_RANGE = "fastppo.lm_head"


# ``chunked_lm_head_stats`` and ``chunked_full_kl`` below are custom ops (``custom_ops.py``: the forward and backward
# above as ``torch.ops.fastppo.chunked_lm_head_stats``/``chunked_full_kl`` and their ``*_backward``, with fakes and the
# autograd formula), so ``torch.compile(fullgraph=True)`` traces a call as one op.


def chunked_lm_head_stats(hidden2d, weight, bias, index, transform: LogitTransform = LogitTransform(),
                          wants=(True, False, False, False, False), chunk=None):
    """The chunked path's five raw per-token results (logprobs, entropy, log_sum_sq_probs, mean_logits,
    is_top1: ``logprobs.OUTPUTS``), each None unless ``wants`` says so, for rows of hidden2d [N, H].

    The caller has checked the arguments and cast the operands to the compute dtype (``lm_head_operands``);
    ``index`` [N] holds valid ids (ignored rows already replaced). Log-probs and entropy are differentiable
    in hidden2d, weight and bias; the other three are statistics. Outputs are in the accumulation dtype.
    Extra memory: two (three with a cap) [rows, cols] tiles of ``chunk_plan(N, V, chunk)``, an upcast copy of
    a 16-bit hidden and a 16-bit weight's chunk, [N] states; the backward adds grad_h's [N, H] accumulator
    and, for a 16-bit weight, one chunk's fp32 grad_W. Never an [N, V] tensor (double backward excepted).
    """
    plan = chunk_plan(hidden2d.shape[0], weight.shape[0], chunk)
    logp, _lse, *rest = torch.ops.fastppo.chunked_lm_head_stats(
        hidden2d, weight, bias, index, float(transform.temperature),
        None if transform.softcap is None else float(transform.softcap), float(transform.logit_scale), list(wants),
        list(plan))
    return tuple(x if want else None for x, want in zip((logp, *rest), wants))


def chunked_logprobs_entropy(hidden2d, weight, bias, index, temperature: float = 1.0, *,
                             compute_entropy: bool = True, chunk=None):
    """(logp, entropy or None) [N] of the tempered LM head by the chunked path, differentiable in hidden2d,
    weight and bias: the plain-PyTorch core for a CPU loss over hidden states (``chunked_lm_head_stats``
    with the default transform; the same caller contract)."""
    logp, entropy, *_ = chunked_lm_head_stats(hidden2d, weight, bias, index, LogitTransform(temperature),
                                              (True, compute_entropy, False, False, False), chunk)
    return logp, entropy


# The exact KL(π‖π_ref) over the vocabulary, (K1)/(K2) of ``kl.py``, on the same tiles: both models' logits of a
# tile (z the policy's, y the reference's, over T), the policy's state (m_p, s_p) with a = Σ e^{z−m_p}(z − y)
# rescaled as s_p is ((L4) with w = z − y), the reference's (m_q, s_q); KL = a/s_p − lse_p + lse_q. The backward
# recomputes both tiles: ∂KL/∂z_j = p_j (z_j − y_j − (lse_p − lse_q + KL)) (K2), times g/T. Only the policy
# side is differentiable (the reference model is frozen).


def _chunked_full_kl_forward(pol: _Operands, ref: _Operands, temperature: float, plan: ChunkPlan, guard: bool):
    """(kl, lse_p, lse_q) [N] in the accumulation dtype."""
    n_rows, vocab = pol.hidden.shape[0], pol.weight.shape[0]
    acc, device = pol.acc, pol.hidden.device
    transform = LogitTransform(temperature)
    states = {name: torch.full((n_rows,), float("-inf"), dtype=acc, device=device) for name in ("m_p", "m_q")}
    s_p, s_q, a = (torch.zeros(n_rows, dtype=acc, device=device) for _ in range(3))
    size = plan.rows * plan.cols
    zbuf, ybuf, ebuf = (torch.empty(size, dtype=acc, device=device) for _ in range(3))

    def rebase(m, chunk_max):
        m_new = torch.maximum(m, chunk_max)
        m_ref = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        return m_new, m_ref, torch.exp(m - m_ref)

    for v0, v1 in _spans(vocab, plan.cols):
        w_c, rw_c = pol.weight_chunk(v0, v1), ref.weight_chunk(v0, v1)
        for r0, r1 in _spans(n_rows, plan.rows):
            rs, shape = slice(r0, r1), (r1 - r0, v1 - v0)
            z = _transform_(pol.logits_(_tile(zbuf, *shape), r0, r1, v0, v1, w_c), transform)
            y = _transform_(ref.logits_(_tile(ybuf, *shape), r0, r1, v0, v1, rw_c), transform)
            e = _tile(ebuf, *shape)
            m_new, m_ref, alpha = rebase(states["m_q"][rs], y.amax(1))
            s_q[rs] = alpha * s_q[rs] + torch.exp(torch.sub(y, m_ref[:, None], out=e), out=e).sum(1)
            states["m_q"][rs] = m_new
            m_new, m_ref, alpha = rebase(states["m_p"][rs], z.amax(1))
            diff = torch.sub(z, y, out=y)  # z − y
            e = torch.exp(z.sub_(m_ref[:, None]), out=e)
            if guard:
                diff.masked_fill_(e == 0, 0.0)  # p = 0 adds nothing, whatever z − y is (−inf − y, −inf + inf)
            a[rs] = alpha * a[rs] + torch.mul(e, diff, out=diff).sum(1)
            s_p[rs] = alpha * s_p[rs] + e.sum(1)
            states["m_p"][rs] = m_new
    lse = {}
    for name, s in (("p", s_p), ("q", s_q)):
        m = states["m_" + name]
        lse[name] = torch.where(m == float("-inf"), torch.zeros_like(m), m) + torch.log(s)
    return a / s_p - lse["p"] + lse["q"], lse["p"], lse["q"]


def _chunked_full_kl_backward(pol: _Operands, ref: _Operands, weight, bias, kl, lse_p, lse_q, g, temperature: float,
                              plan: ChunkPlan, guard: bool, needs):
    need_h, need_w, need_b = needs
    n_rows, hdim = pol.hidden.shape
    vocab = weight.shape[0]
    acc, device = pol.acc, pol.hidden.device
    transform = LogitTransform(temperature)
    shift = lse_p - lse_q + kl
    scale = (g.to(acc) / temperature)[:, None]
    grad_h = torch.zeros(n_rows, hdim, dtype=acc, device=device) if need_h else None
    grad_w = (torch.zeros if n_rows == 0 else torch.empty)(weight.shape, dtype=weight.dtype, device=device) \
        if need_w else None
    grad_b = torch.zeros(vocab, dtype=acc, device=device) if need_b else None
    gw_acc = torch.empty(plan.cols * hdim, dtype=acc, device=device) if need_w and weight.dtype != acc else None
    size = plan.rows * plan.cols
    zbuf, ybuf = (torch.empty(size, dtype=acc, device=device) for _ in range(2))
    for v0, v1 in _spans(vocab, plan.cols):
        c = v1 - v0
        w_c, rw_c = pol.weight_chunk(v0, v1), ref.weight_chunk(v0, v1)
        gw_c = None
        if need_w:
            gw_c = _weight_grad_tile(grad_w, gw_acc, v0, v1, hdim)
        for r0, r1 in _spans(n_rows, plan.rows):
            rs = slice(r0, r1)
            z = _transform_(pol.logits_(_tile(zbuf, r1 - r0, c), r0, r1, v0, v1, w_c), transform)
            y = _transform_(ref.logits_(_tile(ybuf, r1 - r0, c), r0, r1, v0, v1, rw_c), transform)
            u = torch.sub(z, y, out=y).sub_(shift[rs, None])  # log p − log q − KL
            p = z.sub_(lse_p[rs, None]).exp_()
            if guard:
                u.masked_fill_(p == 0, 0.0)  # p = 0: a zero gradient whatever log q is
            x = p.mul_(u).mul_(scale[rs])
            _add_tile_gradients(x, pol.hidden[rs], w_c, r0 == 0, gw_c, grad_b, grad_h, rs, slice(v0, v1))
        if gw_acc is not None and n_rows > 0:
            grad_w[v0:v1].copy_(gw_c)
    return (None if grad_h is None else grad_h.to(pol.hidden_dtype), grad_w,
            None if grad_b is None else grad_b.to(bias.dtype))


def _materialised_full_kl(hidden2d, weight, bias, ref_hidden2d, ref_weight, ref_bias, temperature, acc):
    """KL from both models' whole [N, V] logits with autograd: the chunked KL's double backward only."""
    log_p = torch.log_softmax(lm_head_logits_reference(hidden2d, weight, bias, acc) / temperature, dim=-1)
    log_q = torch.log_softmax(lm_head_logits_reference(ref_hidden2d, ref_weight, ref_bias, acc) / temperature, dim=-1)
    p = log_p.exp()
    return (p * torch.where(p > 0, log_p - log_q, torch.zeros_like(log_p))).sum(-1)


def chunked_full_kl(hidden2d, weight, bias, ref_hidden2d, ref_weight, ref_bias, temperature: float = 1.0, chunk=None):
    """KL(π‖π_ref) [N] over the whole vocabulary by the chunked path (``kl.fused_full_kl`` without Triton),
    differentiable in hidden2d, weight and bias; the reference tensors must come detached (frozen model).

    Each model's operands in its compute dtype (``lm_head_operands``); accumulation in fp32, fp64 when either
    model is fp64, both models' logits formed in it. Extra memory: three [rows, cols] tiles of
    ``chunk_plan(N, V, chunk)`` (two in the backward), upcast copies of 16-bit hiddens and weight chunks, [N]
    states, grad_h's [N, H] accumulator; never an [N, V] tensor (double backward excepted).
    """
    plan = chunk_plan(hidden2d.shape[0], weight.shape[0], chunk)
    kl, _lse_p, _lse_q = torch.ops.fastppo.chunked_full_kl(hidden2d, weight, bias, ref_hidden2d, ref_weight, ref_bias,
                                                           float(temperature), list(plan))
    return kl


# --------------------------------------------------------------------------- references


def lm_head_logits_reference(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                             acc: torch.dtype | None = None):
    """hidden @ weight.T (+ bias) materialised in ``acc`` (default: fp32, fp64 for fp64 inputs): the references'
    logits. The operands are upcast (exact) and multiplied in ``acc`` with autocast off, so the logits are never
    formed or rounded in 16 bits whatever autocast the caller runs under (``COMPUTE_DTYPE_RULE``)."""
    acc = acc_dtype(hidden.dtype) if acc is None else acc
    with torch.autocast(hidden.device.type, enabled=False):
        logits = hidden.to(acc) @ weight.to(acc).t()
        return logits if bias is None else logits + bias.to(acc)


def cap_logits_reference(logits: torch.Tensor, softcap: float | None, logit_scale: float = 1.0) -> torch.Tensor:
    """(L7) before the temperature: softcap·tanh(logit_scale·logits / softcap), or logit_scale·logits without a cap."""
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits
