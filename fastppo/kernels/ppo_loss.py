"""The clipped PPO policy loss (+ entropy bonus) from hidden states, its gradient formed in the forward.

Semantics: exactly the policy part of the trainer's ``ppo_losses``
(fastppo/train.py), per token n with mask m_n, advantage A_n, old log-prob
o_n, clip range ε (ε_h above 1, DAPO's clip-higher; ε by default), dual-clip
bound δ (none by default), entropy coefficient c, token weight u_n (m_n by
default) and normaliser d:

    logp_n = log softmax((h_n·Wᵀ + b) / T)[index_n],   H_n its entropy     (P1)
    ρ_n = exp(logp_n − o_n)                           ("token" level)     (P2)
    ρ_n = exp(Σ_{t∈s(n)} m_t (logp_t − o_t) / max(Σ_{t∈s(n)} m_t, 1))
                                     ("sequence" level, GSPO: s(n) is n's sequence)
    pg_n = max(−A_n min(ρ_n, δ), −A_n clip(ρ_n, 1 − ε, 1 + ε_h))           (P3)
    pg_n = −A_n · sg(min(ρ_n, ε_max)) · logp_n       (P3', surrogate "cispo": TRL GRPO's loss_type; ε_max = ε_h)
    pg_n = −A_n · σ(τ_n (ρ_n − 1)) · 4/τ_n,  τ_n = τ₊ if A_n > 0 else τ₋     (P3'', "sapo")
    pg_n = −A_n · sg(φ(w_s(n))) · logp_n,  φ(w) = exp(λ + k log w − λ w),
           w_s = exp Σ_{t∈s} m_t clamp(logp_t − o_t, ±20)                  (P3v, "vespo": ``vespo_weights``)
    pg_n = 0 where A_n < 0 and the mean over s(n) of m_t (o_t − logp_t) exceeds the off-policy threshold  (P6)
    loss = Σ u_n pg_n / d − c · Σ m_n H_n / Σ m_n   ("token_mean"; d = Σ m_n by default)  (P4)
           (with u or d given, or on the sequence path: the sequence level, (P3v), (P6), Σ m_n counts at
           least 1: an empty mask gives 0)
           Σ u_n pg_n / d − c · Σ m_n H_n           ("sum"; d = 1 by default)
    clipped_n = −A_n clip(ρ_n, 1 − ε, 1 + ε_h) > −A_n min(ρ_n, δ)  (the trainer's clipfrac)
                (cispo: ρ_n > ε_max where A_n > 0, TRL's cispo_clip_ratio; sapo: never)

u and d are how a caller aggregates (TRL GRPO's ``loss_type``: the trainer's
``fastppo.policy_terms.policy_loss_weights``); the entropy term is always the masked mean (or sum),
as TRL GRPO's bonus is, whatever the aggregation.

Masked tokens are selected out (``torch.where``, not multiplied by 0), so
inf/NaN in their advantages or old log-probs reach neither the loss nor any
gradient, on both paths; an empty mask gives a NaN "token_mean" loss and zero
gradients, as ``masked_mean`` does. A ratio that overflows (logp − o > 88.7 in
fp32) is inf; its token takes the clipped branch's gradient, 0 for A > 0 (the
reference's autograd of exp would form 0·inf = NaN: ``clipped_surrogate``
differentiates through a ratio whose overflowed entries are constants). The
LM head follows ``_lmhead.COMPUTE_DTYPE_RULE`` (under autocast, operands in
autocast's dtype, accumulation fp32) on both paths. The
gradient with respect to logp_n follows autograd of (P3)-(P4): torch.maximum
splits ties evenly and clamp passes its gradient on [1 − ε, 1 + ε] inclusive,

    d1 = −A_n ρ_n · [ρ_n ≤ δ],   d2 = −A_n ρ_n · [1 − ε ≤ ρ_n ≤ 1 + ε_h]
    g_n = m_n u_n/d · (d1 if pg1 > pg2; d2 if pg2 > pg1; (d1 + d2)/2 on a tie)  (P5)
    g_H,n = −c·s·m_n,   s = 1/Σ m ("token_mean") or 1 ("sum")
    cispo: g_n = m_n u_n/d · (−A_n min(ρ_n, ε_max))                                      (P5')
    sapo:  g_n = m_n u_n/d · (−4 A_n σ_n (1 − σ_n) ρ_n),  σ_n = σ(τ_n (ρ_n − 1))          (P5'')
           (0 where ρ_n overflowed: the gate is flat there)

(at the sequence level, g_n = m_n/max(Σ_{t∈s(n)} m_t, 1) · Σ_{t∈s(n)} of the
token terms of (P5): every token of a sequence moves its one ratio)

and the gradient with respect to the logits is (L5)/T of the LM-head core
(``_lmhead``) with (g_n, g_H,n).

Why the gradient is formed in the forward: everything (P5) needs (old
log-probs, advantages, mask, ε, c) is known when the forward runs, so each
logit row's gradient is formed while its logits are at hand, and the backward
needs no recompute: three GEMMs (logits, grad_hidden, grad_weight) instead of
the four of log-probs + a loss in PyTorch (the fourth is the logits' recompute
in ``fused_token_logprobs``'s backward), which is the floor of any fused
cross-entropy. For each chunk of C tokens (C·V ≈ 2^27 elements on a GPU, so
memory stays bounded whatever N is):

    x_c = h_c @ Wᵀ (+ b)          [C, V] fp32 (fp64), a GEMM with fp32 output
    one Triton program per row:   pass 1 over V: lse, H (L3), logp, ρ, pg, (P5)
                                  pass 2 over V: dx by (L5)/T, in the weight's dtype
    grad_h[c] = dx_c @ W          (complete rows: one rounding to the output dtype)
    grad_W   += dx_cᵀ @ h_c
    grad_b   += Σ_rows dx_c

At the sequence level (and for (P3v) and (P6)) a token's gradient needs its whole sequence's log-probs
(its one ratio, its weight, its mask), so the chunks hold whole sequences (a sequence longer than C
is a chunk of its own: the logits buffer grows to it), and the one row kernel
is split in two launches with the per-token math between them: pass 1 (lse, H,
logp per row), then (P2)-(P5) on the chunk's [rows] vectors by
``clipped_surrogate`` and autograd, then pass 2 (dx). The same two passes over
the logits and the same three GEMMs.

The autograd backward only multiplies the saved gradients by the upstream
scalar. The saved gradients are the size of the gradients themselves (they
are held from the forward to the backward).

How grad_W is accumulated across token chunks in fp32: an fp32/fp64 weight
accumulates in its own gradient (no extra buffer); a 16-bit weight whose
tokens fit in one chunk gets one GEMM (fp32 inside, rounded once, no extra
buffer). A 16-bit weight over several chunks needs an fp32 [V, H] accumulator
(``addmm_acc_`` adds each chunk's product unrounded; 2 GiB at V = 128,256,
H = 4096), and this is the one case we cannot avoid it: every token chunk
touches every row of grad_W (the softmax is dense), and the alternatives are
rounding each chunk's product to 16 bits (the drift issue 14 removed from the
full-KL backward) or chunking over V instead, which needs each row's lse
before the gradient and so a second logits GEMM (the four-GEMM
``fused_token_logprobs`` backward). Larger token chunks mean fewer
read-modify-writes of that accumulator; the chunk size is the tuner's
``fused_ppo_policy_loss`` tile.

``cliprange``, ``entropy_coef`` and ``temperature`` reach the kernel as fp32
scalars (like every kernel here): for fp64 inputs, values that fp32 holds
exactly (0.25, 1 ± 0.25, ...) give fp64-exact results.

Layout, as every kernel module: kernels, launchers, autograd, public, references.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fastppo.kernels._common import FLOAT_DTYPES, HAS_TRITON, INDEX_DTYPES, MASK_DTYPES, check_float
from fastppo.kernels._common import check_index_range, check_same_device, check_same_shape, check_temperature
from fastppo.kernels._common import check_tensor, launch, tile_choice, tl, triton, use_triton
from fastppo.kernels._common import autograd_inside_op
from fastppo.kernels._lmhead import acc_dtype, addmm_acc_, check_lm_head_args, chunked_logprobs_entropy
from fastppo.kernels._lmhead import lm_head_logits_reference, mm_acc
from fastppo.kernels._lmhead import lm_head_operands, no_autocast, row_tile, tl_dtype
from fastppo.kernels.logprobs import HeadMath, _launch_softmax_dlogits, _launch_token_logprobs_fwd
from fastppo.kernels.logprobs import token_logprobs_reference

if HAS_TRITON:
    from fastppo.kernels._lmhead import row_pick, row_softmax, softmax_dlogits, store_dlogits

REDUCTIONS = ("token_mean", "sum")
SURROGATES = ("clip", "cispo", "sapo", "vespo")  # (P3), (P3'), (P3''), (P3v): the row kernel's SURROGATE is the index
WHOLE_SEQUENCE_SURROGATES = ("vespo",)  # a token's term needs its whole sequence: the sequence path
VESPO_GAMMA = (2.0, 3.0, 3.0, 2.0)  # TRL GRPO's (vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
VESPO_LOG_W_MIN = math.log(1e-8)  # VESPO's (and TRL's) floor of log w


class PPOPolicyLossOutput(NamedTuple):
    """What ``fused_ppo_policy_loss`` returns. Every per-token field has ``index``'s shape."""

    loss: torch.Tensor  # 0-d, fp32 (fp64 for fp64 inputs); differentiable in hidden, weight, bias
    logprobs: torch.Tensor  # logp (P1), no gradient
    ratio: torch.Tensor  # ρ (P2), no gradient
    clipped: torch.Tensor  # bool: the clipped branch of (P3) is the larger (the trainer's clipfrac)
    entropy: torch.Tensor  # H (P1), no gradient


# --------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _ppo_policy_loss_rows_kernel(
        x_ptr, stride_xn,  # logits chunk [rows, V] in ACC_DTYPE (raw: before /T)
        dx_ptr, stride_dxn,  # ∂loss/∂x out [rows, V] in the weight's dtype; may alias x
        idx_ptr, old_ptr, adv_ptr, mask_ptr,  # [rows]
        count_ptr,  # 0-d Σ mask over the whole input (read for TOKEN_MEAN)
        weight_ptr, norm_ptr, ent_weight_ptr,  # [rows] u, 0-d d of (P4) (WEIGHTED); [rows] e (ENTROPY_WEIGHTED)
        logp_ptr, ratio_ptr, clipped_ptr, ent_ptr, loss_ptr,  # [rows] outputs; loss: this token's term of (P4)
        n_cols, temperature, clip_low, clip_high, delta, entropy_coef, tau_pos, tau_neg,
        TOKEN_MEAN: tl.constexpr, WEIGHTED: tl.constexpr, ENTROPY_WEIGHTED: tl.constexpr, HAS_DELTA: tl.constexpr,
        SURROGATE: tl.constexpr,  # 0 clip, 1 cispo (clip_high: ε_max), 2 sapo (tau_pos, tau_neg)
        NEEDS_GRAD: tl.constexpr,
        ACC_DTYPE: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_xn
        lse, ent = row_softmax(x_row, n_cols, temperature, True, ACC_DTYPE, BLOCK_V)  # pass 1 over V
        idx = tl.load(idx_ptr + row).to(tl.int64)
        logp = row_pick(x_row, idx, n_cols, temperature, ACC_DTYPE) - lse
        # (P2)-(P4) for this token.
        old = tl.load(old_ptr + row).to(ACC_DTYPE)
        adv = tl.load(adv_ptr + row).to(ACC_DTYPE)
        real = tl.load(mask_ptr + row) != 0
        ratio = tl.exp(logp - old)
        if SURROGATE == 1:  # (P3'): the capped ratio is a constant weight on logp
            w = tl.minimum(ratio, clip_high)
            pg = -adv * w * logp
            clipped = (ratio > clip_high) & (adv > 0)
        elif SURROGATE == 2:  # (P3''): a sigmoid gate in place of the clip
            tau = tl.where(adv > 0, tau_pos, tau_neg)
            gate = tl.sigmoid(tau * (ratio - 1.0))
            pg = -adv * gate * (4.0 / tau)
            clipped = ratio < 0.0  # never: SAPO does not clip
        else:
            if HAS_DELTA:
                pg1 = -adv * tl.minimum(ratio, delta)
            else:
                pg1 = -adv * ratio
            pg2 = -adv * tl.minimum(tl.maximum(ratio, clip_low), clip_high)
            pg = tl.maximum(pg1, pg2)
            clipped = pg2 > pg1
        tl.store(logp_ptr + row, logp)
        tl.store(ratio_ptr + row, ratio)
        tl.store(clipped_ptr + row, clipped)
        tl.store(ent_ptr + row, ent)
        ent_scale = 1.0
        if TOKEN_MEAN:
            # count = 0 means no real token: every term below is 0 whatever the scale (no 1/0 needed).
            ent_scale = 1.0 / tl.maximum(tl.load(count_ptr).to(ACC_DTYPE), 1.0)
        if ENTROPY_WEIGHTED:
            ent_scale = tl.load(ent_weight_ptr + row).to(ACC_DTYPE)
        if WEIGHTED:
            pg_scale = tl.load(weight_ptr + row).to(ACC_DTYPE) / tl.load(norm_ptr).to(ACC_DTYPE)
            tl.store(loss_ptr + row, tl.where(real, pg_scale * pg - entropy_coef * ent_scale * ent, 0.0))
        else:
            pg_scale = ent_scale
            tl.store(loss_ptr + row, tl.where(real, pg - entropy_coef * ent, 0.0))
        if NEEDS_GRAD:
            if SURROGATE == 1:
                g_pg = -adv * w  # (P5')
            elif SURROGATE == 2:  # (P5''); an overflowed ratio's gate is flat (0, not 0·inf)
                g_pg = tl.where(ratio == float("inf"), 0.0, -adv * 4.0 * gate * (1.0 - gate) * ratio)
            else:
                d1 = -adv * ratio
                if HAS_DELTA:
                    d1 = tl.where(ratio <= delta, d1, 0.0)
                d2 = tl.where((ratio >= clip_low) & (ratio <= clip_high), -adv * ratio, 0.0)
                g_pg = tl.where(pg1 > pg2, d1, tl.where(pg2 > pg1, d2, 0.5 * (d1 + d2)))  # (P5)
            g_logp = tl.where(real, g_pg * pg_scale, 0.0)
            g_ent = tl.where(real, -entropy_coef * ent_scale, 0.0)
            # Pass 2 over V: ∂loss/∂x by (L5)/T.
            cols = tl.arange(0, BLOCK_V)
            for v0 in range(0, n_cols, BLOCK_V):
                c = v0 + cols
                col_mask = c < n_cols
                z = tl.load(x_row + c, mask=col_mask, other=float("-inf")).to(ACC_DTYPE) / temperature
                dz = softmax_dlogits(z, lse, ent, g_logp, g_ent, c == idx, True, True)
                store_dlogits(dx_ptr, stride_dxn, row, c, col_mask, dz, temperature)


# --------------------------------------------------------------------------- launchers


class PPOLossTile(NamedTuple):
    """``fused_ppo_policy_loss``'s launch choice (what ``bench/tune.py`` varies)."""

    chunk_rows: int  # tokens per chunk: the [chunk_rows, V] fp32 logits are the extra memory
    block_v: int  # columns per step of the row kernel
    num_warps: int


def _ppo_loss_tile(n_rows: int, vocab: int, device: torch.device) -> PPOLossTile:
    """C·V ≈ 2^27 elements on a GPU (512 MiB of fp32 logits), not tuned yet; 8 under the
    interpreter so small tests walk several chunks (and the fp32 grad_W accumulator)."""
    block_v, num_warps = row_tile(vocab, device)
    chunk = max(16, ((1 << 27) // vocab) // 16 * 16) if device.type == "cuda" else 8
    return tile_choice("fused_ppo_policy_loss", PPOLossTile(chunk, block_v, num_warps))


class PolicyTerms(NamedTuple):
    """How (P2)-(P4) are formed beyond the plain clipped surrogate: the options of ``fused_ppo_policy_loss``,
    checked, as the launcher and the reference take them."""

    cliprange: float  # ε: ratios below 1 − ε are clipped
    cliprange_high: float  # ε_h: ratios above 1 + ε_h are clipped
    delta: float | None  # δ, the bound on the unclipped ratio (None: none)
    entropy_coef: float
    token_mean: bool  # reduction "token_mean" (else "sum")
    sequence_lengths: list[int] | None  # tokens of each sequence in order (the sequence path); None: token rows
    token_weights: torch.Tensor | None  # [N] u (None: the mask)
    normalizer: torch.Tensor | None  # 0-d d (None: Σ m for token_mean, 1 for sum)
    entropy_weights: torch.Tensor | None = None  # [N] e, the entropy term's weights (None: by the reduction)
    surrogate: str = "clip"  # (P3), (P3'), (P3'') or (P3v): SURROGATES
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)  # sapo's τ for A > 0 and for A <= 0
    level: str = "token"  # importance_sampling_level (sequence_lengths may be set at "token" too: vespo, (P6))
    vespo_gamma: tuple[float, float, float, float] = VESPO_GAMMA
    off_policy_mask_threshold: float | None = None  # (P6)

    @property
    def surrogate_options(self) -> dict:
        """``clipped_surrogate``'s keywords beyond the clip's."""
        pos, neg = self.sapo_temperatures
        return dict(surrogate=self.surrogate, sapo_temperature_pos=pos, sapo_temperature_neg=neg,
                    importance_sampling_level=self.level, vespo_gamma=self.vespo_gamma,
                    off_policy_mask_threshold=self.off_policy_mask_threshold)

    @property
    def clip_high(self) -> float:
        """The kernel's upper bound on the ratio: 1 + ε_h, or cispo's ε_max (``cliprange_high`` itself)."""
        return self.cliprange_high if self.surrogate == "cispo" else 1.0 + self.cliprange_high

    @property
    def weighted(self) -> bool:
        """Whether the kernel scales each token's term itself (u/d), rather than the sum by 1/Σ m at the end."""
        return self.token_weights is not None or self.normalizer is not None or self.sequence_lengths is not None \
            or self.entropy_weights is not None


def _sequence_chunks(lengths: list[int], target: int) -> list[tuple[int, int, list[int]]]:
    """(first token, end, sequence lengths) of chunks of whole sequences, each about ``target`` tokens: a
    sequence's ratio needs all its log-probs before any of its gradients, so no chunk splits one; a longer
    sequence is a chunk of its own (the logits buffer grows to it)."""
    chunks, start, members = [], 0, []
    for n in lengths:
        if members and sum(members) + n > target:
            chunks.append((start, start + sum(members), members))
            start, members = start + sum(members), []
        members.append(n)
    if members:
        chunks.append((start, start + sum(members), members))
    return chunks


def _launch_ppo_policy_loss(hidden2d, weight, bias, index, old, adv, mask, temperature, terms: PolicyTerms, needs):
    """Returns (loss, (logp, ratio, clipped, entropy), (grad_hidden, grad_weight, grad_bias))."""
    n_rows, hdim = hidden2d.shape
    vocab = weight.shape[0]
    device, dtype = hidden2d.device, hidden2d.dtype
    acc = acc_dtype(dtype)
    need_h, need_w, need_b = needs
    needs_grad = any(needs)
    logp, ratio, ent, loss_rows = torch.empty(4, n_rows, dtype=acc, device=device).unbind(0)
    clipped = torch.empty(n_rows, dtype=torch.bool, device=device)
    count = (mask != 0).sum(dtype=acc)  # on the device: no sync
    norm = None
    if terms.weighted:  # at the sequence level, too: its kernel pair scales each token's term
        norm = terms.normalizer if terms.normalizer is not None else count.clamp(min=1.0) if terms.token_mean \
            else torch.ones((), dtype=acc, device=device)
        norm = norm.to(acc)
    weights = None if not terms.weighted else \
        (mask != 0).to(acc) if terms.token_weights is None else terms.token_weights.to(acc)

    tile = _ppo_loss_tile(n_rows, vocab, device)
    if terms.sequence_lengths is None:
        step = max(1, tile.chunk_rows)
        chunks = [(r0, min(n_rows, r0 + step), None) for r0 in range(0, n_rows, step)]
    else:
        chunks = _sequence_chunks(terms.sequence_lengths, tile.chunk_rows)
    chunk = max(r1 - r0 for r0, r1, _ in chunks)
    x_buf = torch.empty(chunk, vocab, dtype=acc, device=device)
    dx_buf = x_buf if dtype == acc or not needs_grad else torch.empty(chunk, vocab, dtype=dtype, device=device)
    grad_h = torch.empty(n_rows, hdim, dtype=dtype, device=device) if need_h else None
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=device) if need_w else None
    # grad_W over several chunks: in grad_w itself when it is fp32/fp64, else in an fp32 accumulator (docstring).
    acc_w = None
    if need_w and weight.dtype != acc and len(chunks) > 1:
        acc_w = torch.zeros(weight.shape, dtype=acc, device=device)
    grad_b = torch.zeros(vocab, dtype=acc, device=device) if need_b else None

    for r0, r1, lengths in chunks:
        h_c = hidden2d[r0:r1]
        x_c = mm_acc(h_c, weight.t(), out=x_buf[: r1 - r0])
        if bias is not None:
            x_c += bias
        dx_c = dx_buf[: r1 - r0]
        rows = slice(r0, r1)
        if terms.sequence_lengths is None:
            launch(_ppo_policy_loss_rows_kernel, (r1 - r0,), device,
                   x_c, x_c.stride(0), dx_c, dx_c.stride(0), index[rows], old[rows], adv[rows], mask[rows], count,
                   weights[rows] if weights is not None else adv[rows], norm if norm is not None else count,
                   terms.entropy_weights[rows] if terms.entropy_weights is not None else adv[rows],
                   logp[rows], ratio[rows], clipped[rows], ent[rows], loss_rows[rows],
                   vocab, temperature, 1.0 - terms.cliprange, terms.clip_high,
                   terms.delta if terms.delta is not None else 0.0, terms.entropy_coef, *terms.sapo_temperatures,
                   TOKEN_MEAN=terms.token_mean, WEIGHTED=weights is not None,
                   ENTROPY_WEIGHTED=terms.entropy_weights is not None, HAS_DELTA=terms.delta is not None,
                   SURROGATE=SURROGATES.index(terms.surrogate),
                   NEEDS_GRAD=needs_grad, ACC_DTYPE=tl_dtype(acc), BLOCK_V=tile.block_v, num_warps=tile.num_warps)
        else:
            ent_w = None if terms.entropy_weights is None else terms.entropy_weights[rows]
            _sequence_rows(x_c, dx_c, index[rows], old[rows], adv[rows], mask[rows], count, weights[rows], norm,
                           ent_w, temperature, terms, lengths, (logp[rows], ratio[rows], clipped[rows], ent[rows],
                                                         loss_rows[rows]), needs_grad)
        if need_h:
            torch.mm(dx_c, weight, out=grad_h[rows])
        if acc_w is not None:
            addmm_acc_(acc_w, dx_c.t(), h_c)
        elif need_w and r0 == 0:
            torch.mm(dx_c.t(), h_c, out=grad_w)
        elif need_w:
            grad_w.addmm_(dx_c.t(), h_c)
        if need_b:
            grad_b += dx_c.sum(0, dtype=acc)
    if acc_w is not None:
        grad_w.copy_(acc_w)
    if grad_b is not None:
        grad_b = grad_b.to(bias.dtype)
    loss = loss_rows.sum()
    if terms.token_mean and weights is None:
        loss = loss / count
    return loss, (logp, ratio, clipped, ent), (grad_h, grad_w, grad_b)


def _sequence_rows(x_c, dx_c, index, old, adv, mask, count, weights, norm, entropy_weights, temperature,
                   terms: PolicyTerms, lengths: list[int], outs, needs_grad: bool) -> None:
    """One chunk of whole sequences at the sequence level: pass 1 over V gives each token's lse, entropy and
    log-prob; (P2)-(P5) on those [rows] vectors by the reference's own PyTorch (``clipped_surrogate``, so the
    math has one statement), its gradient by autograd; pass 2 over V forms ∂loss/∂x from it. Still two
    passes over the logits and no extra GEMM: the chunk holds every token of its sequences."""
    logp_out, ratio_out, clipped_out, ent_out, loss_out = outs
    lp, lse, ent = _launch_token_logprobs_fwd(x_c, index, temperature, True)
    real = mask != 0
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=x_c.device),
                                  torch.as_tensor(lengths, device=x_c.device))
    with torch.enable_grad(), autograd_inside_op():  # the op's forward runs below autograd (custom_ops.py)
        lp_leaf = lp.detach().requires_grad_(needs_grad)
        pg, ratio, clipped = clipped_surrogate(lp_leaf, old.to(lp.dtype), adv.to(lp.dtype), terms.cliprange,
                                               mask=real, cliprange_high=terms.cliprange_high, delta=terms.delta,
                                               sequence_ids=ids, num_sequences=len(lengths),
                                               **terms.surrogate_options)
        ent_scale = 1.0 / count.clamp(min=1.0) if terms.token_mean else 1.0
        if entropy_weights is not None:
            ent_scale = entropy_weights.to(lp.dtype)
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        pg_term = pg * (weights / norm)
        rows_loss = pg_term - terms.entropy_coef * torch.where(real, ent, zero) * ent_scale
        if needs_grad:
            (g_logp,) = torch.autograd.grad(pg_term.sum(), lp_leaf)
    logp_out.copy_(lp)
    ratio_out.copy_(ratio.detach())
    clipped_out.copy_(clipped)
    ent_out.copy_(ent)
    loss_out.copy_(torch.where(real, rows_loss.detach(), zero))
    if needs_grad:
        g_ent = torch.where(real, -terms.entropy_coef * (ent_scale * torch.ones_like(ent)), zero)
        _launch_softmax_dlogits(x_c, dx_c, index, lse, ent, torch.where(real, g_logp, zero), g_ent,
                                HeadMath(temperature, 1.0, 1.0, False))


def _scaled(grad: torch.Tensor, scale: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """grad · scale formed in the scale's dtype and rounded once to the grad's: explicit, so a
    backend that casts a 0-d operand to the 16-bit common dtype first cannot round the scale
    (1/3 would be off by 2^-9 in every entry). Chunked: no full fp32 copy of grad_W."""
    if grad.dtype == scale.dtype:
        return grad * scale
    flat = grad.reshape(-1)
    out = torch.empty_like(flat)
    for i in range(0, flat.numel(), chunk):
        out[i:i + chunk].copy_(flat[i:i + chunk].to(scale.dtype) * scale)
    return out.view(grad.shape)


# --------------------------------------------------------------------------- autograd


# The Triton path's differentiable call: a custom op (``custom_ops.py`` registers ``_launch_ppo_policy_loss`` as
# ``torch.ops.fastppo.fused_ppo_policy_loss``, its fake, and the backward that scales the saved gradients).


class _FusedPPOPolicyLoss:
    """``fused_ppo_policy_loss``'s Triton path: (loss, logp, ratio, clipped, entropy), the loss differentiable in
    hidden2d, weight and bias."""

    @staticmethod
    def apply(hidden2d, weight, bias, index, old, adv, mask, temperature: float, terms: PolicyTerms):
        needs = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden2d, weight, bias)]
        out = torch.ops.fastppo.fused_ppo_policy_loss(
            hidden2d, weight, bias, index, old, adv, mask, terms.token_weights, terms.normalizer,
            terms.entropy_weights, temperature, terms.cliprange, terms.cliprange_high, terms.delta,
            terms.entropy_coef, terms.token_mean, terms.sequence_lengths, terms.surrogate,
            list(terms.sapo_temperatures), terms.level, list(terms.vespo_gamma), terms.off_policy_mask_threshold,
            needs)
        return out[:5]


# --------------------------------------------------------------------------- public API

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# clipped_surrogate's levels: the fused kernel's, and RLOO's (TRL 1.16's RLOOTrainer: one ratio per completion,
# exp(Σ_t logp − old) over its real tokens, the sum where GSPO takes the mean)
SURROGATE_LEVELS = (*IMPORTANCE_SAMPLING_LEVELS, "sequence_sum")


def _check_ppo_policy_loss_args(hidden, weight, index, old_logprobs, advantages, mask, cliprange, entropy_coef,
                                temperature, bias, reduction, cliprange_high, delta, importance_sampling_level,
                                sequence_lengths, token_weights, normalizer, entropy_weights=None, surrogate="clip",
                                sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_gamma=VESPO_GAMMA,
                                off_policy_mask_threshold=None):
    check_lm_head_args(hidden, weight, bias)
    check_tensor("index", index, dtypes=INDEX_DTYPES)
    check_tensor("old_logprobs", old_logprobs, dtypes=FLOAT_DTYPES)
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask, dtypes=MASK_DTYPES)
    if index.shape != hidden.shape[:-1]:
        raise ValueError(
            f"index has shape {tuple(index.shape)} but must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}"
        )
    for name, t in (("token_weights", token_weights), ("entropy_weights", entropy_weights)):
        if t is not None:
            check_tensor(name, t, dtypes=FLOAT_DTYPES)
    check_same_shape(index=index, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                     token_weights=token_weights, entropy_weights=entropy_weights)
    check_same_device(hidden=hidden, index=index, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                      token_weights=token_weights, entropy_weights=entropy_weights)
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}; got {reduction!r}")
    cliprange, cliprange_high, delta = check_clip_args(cliprange, cliprange_high, delta)
    temperatures, vespo_gamma, off_policy_mask_threshold = check_surrogate_args(
        surrogate, cliprange_high, delta, sapo_temperature_pos, sapo_temperature_neg, vespo_gamma,
        off_policy_mask_threshold)
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}; "
                         f"got {importance_sampling_level!r}")
    lengths = None
    if (importance_sampling_level == "sequence" or surrogate in WHOLE_SEQUENCE_SURROGATES
            or off_policy_mask_threshold is not None):
        lengths = _sequence_lengths(index, sequence_lengths)
    elif sequence_lengths is not None:
        raise ValueError("sequence_lengths is read only with importance_sampling_level='sequence', surrogate "
                         "'vespo' or off_policy_mask_threshold")
    if normalizer is not None:
        if isinstance(normalizer, torch.Tensor):
            if normalizer.numel() != 1 or not normalizer.is_floating_point():
                raise ValueError(f"normalizer must be a float or a 0-d float tensor; got shape "
                                 f"{tuple(normalizer.shape)}, dtype {normalizer.dtype}")
            check_same_device(hidden=hidden, normalizer=normalizer)
            normalizer = normalizer.reshape(())
        else:
            value = check_float("normalizer", normalizer, minimum=0.0, exclusive_minimum=True)
            normalizer = torch.tensor(value, dtype=acc_dtype(hidden.dtype), device=hidden.device)
    terms = PolicyTerms(cliprange, cliprange_high, delta, check_float("entropy_coef", entropy_coef),
                        reduction == "token_mean", lengths, token_weights, normalizer, entropy_weights, surrogate,
                        temperatures, importance_sampling_level, vespo_gamma, off_policy_mask_threshold)
    return terms, check_temperature(temperature)


def _sequence_lengths(index: torch.Tensor, sequence_lengths) -> list[int]:
    """Each sequence's token count, in order: ``sequence_lengths`` (flat tokens, e.g. packed), or by default the
    rows of ``index`` (its last dimension is a sequence)."""
    if sequence_lengths is None:
        per_row = index.shape[-1] if index.dim() else 1
        return [per_row] * (index.numel() // max(per_row, 1)) if per_row else [0] * (index.numel() or 1)
    if isinstance(sequence_lengths, torch.Tensor):
        sequence_lengths = sequence_lengths.tolist()
    lengths = list(sequence_lengths)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths):
        raise ValueError(f"sequence_lengths must be non-negative ints; got {lengths!r}")
    if sum(lengths) != index.numel():
        raise ValueError(f"sequence_lengths sum to {sum(lengths)} but index has {index.numel()} tokens")
    return lengths


def check_clip_args(cliprange, cliprange_high=None, delta=None) -> tuple[float, float, float | None]:
    """ε >= 0; ε_h >= ε (ε when None); δ > 1 or None: refused by name otherwise."""
    cliprange = check_float("cliprange", cliprange, minimum=0.0)
    if cliprange_high is None:
        cliprange_high = cliprange
    cliprange_high = check_float("cliprange_high", cliprange_high, minimum=0.0)
    if cliprange_high < cliprange:
        raise ValueError(f"cliprange_high (ε_high, {cliprange_high}) must be >= cliprange (ε, {cliprange}): the "
                         "upper clip is the wider one (DAPO's clip-higher)")
    if delta is not None:
        delta = check_float("delta", delta, minimum=1.0, exclusive_minimum=True)
    return cliprange, cliprange_high, delta


def check_surrogate_args(surrogate, cliprange_high: float, delta: float | None, sapo_temperature_pos=1.0,
                         sapo_temperature_neg=1.05, vespo_gamma=VESPO_GAMMA, off_policy_mask_threshold=None):
    """``surrogate`` one of SURROGATES; cispo's ε_max (``cliprange_high``) > 0 (at or below 1 it caps every
    on-policy token, as TRL's cispo does with epsilon_high unset); ``delta`` only with "clip";
    sapo's temperatures > 0; vespo's (k₊, λ₊, k₋, λ₋) four numbers >= 0; the off-policy threshold >= 0 or None:
    refused by name otherwise. Returns (the sapo temperatures, vespo's gamma, the threshold), checked."""
    if not isinstance(surrogate, str) or surrogate not in SURROGATES:
        raise ValueError(f"surrogate must be one of {', '.join(SURROGATES)}; got {surrogate!r}")
    if surrogate == "cispo" and not (math.isfinite(cliprange_high) and cliprange_high > 0):
        raise ValueError(f"surrogate 'cispo' caps the ratio at cliprange_high itself (TRL GRPO's epsilon_high as "
                         f"ScaleRL's ε_max, 5.0 recommended), a finite number > 0; got {cliprange_high}")
    if surrogate != "clip" and delta is not None:
        raise ValueError(f"delta bounds the clipped surrogate's ratio and has no meaning for surrogate {surrogate!r}; "
                         "leave it unset")
    temperatures = (check_float("sapo_temperature_pos", sapo_temperature_pos, minimum=0.0, exclusive_minimum=True),
                    check_float("sapo_temperature_neg", sapo_temperature_neg, minimum=0.0, exclusive_minimum=True))
    if not isinstance(vespo_gamma, (tuple, list)) or len(vespo_gamma) != 4:
        raise ValueError(f"vespo_gamma must be (k_pos, lambda_pos, k_neg, lambda_neg); got {vespo_gamma!r}")
    gamma = tuple(check_float(f"vespo_gamma[{i}]", x, minimum=0.0) for i, x in enumerate(vespo_gamma))
    if off_policy_mask_threshold is not None:
        off_policy_mask_threshold = check_float("off_policy_mask_threshold", off_policy_mask_threshold, minimum=0.0)
    return temperatures, gamma, off_policy_mask_threshold


def fused_ppo_policy_loss(hidden, weight, index, old_logprobs, advantages, mask, cliprange, entropy_coef=0.0,
                          temperature=1.0, bias=None, reduction="token_mean", *, cliprange_high=None, delta=None,
                          importance_sampling_level="token", sequence_lengths=None, token_weights=None,
                          normalizer=None, entropy_weights=None, surrogate="clip", sapo_temperature_pos=1.0,
                          sapo_temperature_neg=1.05, vespo_gamma=VESPO_GAMMA,
                          off_policy_mask_threshold=None) -> PPOPolicyLossOutput:
    """The clipped PPO policy loss with entropy bonus, from hidden states and the LM head (module docstring).

    Args:
        hidden: [..., H] policy hidden states (fp16, bf16, fp32 or fp64).
        weight: [V, H] LM-head weight, same dtype; any strides (a tied
            embedding's transposed view is read in place). Under autocast both are
            multiplied in autocast's dtype (``_lmhead.COMPUTE_DTYPE_RULE``).
        index: [...] int32/int64 ids of the sampled tokens, ``hidden.shape[:-1]``.
        old_logprobs: [...] log-probs of those tokens under the rollout policy.
        advantages: [...] advantages A.
        mask: [...] bool (or numbers, nonzero = real) marking the tokens the loss averages over.
        cliprange: ε >= 0; ratios are clipped below at 1 − ε (and above at 1 + ε unless ``cliprange_high``).
        entropy_coef: c; the loss subtracts c times the mean (``"sum"``: the sum) entropy of the masked tokens.
        temperature: float > 0; the policy is softmax(logits / temperature).
        bias: optional [V] LM-head bias.
        reduction: "token_mean" (the mean over mask-true tokens of the whole
            input, as the trainer's ``masked_mean``) or "sum" (the masked sum,
            for a caller that normalises across micro-batches itself).
        cliprange_high: ε_h >= ε, the upper clip 1 + ε_h (TRL GRPO's ``epsilon_high``, DAPO's clip-higher).
        delta: δ > 1, an upper bound on the unclipped ratio (TRL GRPO's ``delta``, two-sided clipping).
        importance_sampling_level: "token" (one ratio per token) or "sequence" (GSPO: each token's ratio is its
            sequence's exp(masked mean of logp − old), TRL GRPO's ``importance_sampling_level``).
        sequence_lengths: with "sequence", the token count of each sequence in order (ints summing to
            ``index.numel()``; a packed batch's rows); default: each row of ``index``'s last dimension.
        token_weights: [...] u, each token's weight in the policy term (default: the mask); masked tokens
            count 0 whatever their weight.
        normalizer: d > 0 (a float or a 0-d tensor, kept on the device), the policy term's divisor
            (default Σ mask for "token_mean", 1 for "sum"). u and d express TRL GRPO's ``loss_type``s.
        entropy_weights: [...] e, each masked token's weight in the entropy term, which becomes −c·Σ e·H
            (default: the reduction's mean or sum; the trainer's token-budget micro-batches give each token the
            weight it has in row-count micro-batches).
        surrogate: "clip" (P3), "cispo" (P3': ``cliprange_high`` is ε_max, > 0), "sapo" (P3'', with
            ``sapo_temperature_pos`` and ``sapo_temperature_neg``) or "vespo" (P3v, with ``vespo_gamma`` =
            (k₊, λ₊, k₋, λ₋)): TRL GRPO's loss_types of those names.
        off_policy_mask_threshold: (P6), TRL GRPO's off-policy sequence mask (None: off). It and "vespo" read
            each token's whole sequence (``sequence_lengths`` or the rows of ``index``), as the sequence level does.

    Returns:
        ``PPOPolicyLossOutput(loss, logprobs, ratio, clipped, entropy)``: the
        0-d loss, differentiable in ``hidden``, ``weight`` and ``bias``
        (``old_logprobs``, ``advantages`` and the weights and normaliser are constants), and
        per-token statistics without gradient (fp32, or fp64 for fp64 inputs; ``clipped``
        bool), computed for every token, masked or not.
    """
    terms, temperature = _check_ppo_policy_loss_args(
        hidden, weight, index, old_logprobs, advantages, mask, cliprange, entropy_coef, temperature, bias, reduction,
        cliprange_high, delta, importance_sampling_level, sequence_lengths, token_weights, normalizer, entropy_weights,
        surrogate, sapo_temperature_pos, sapo_temperature_neg, vespo_gamma, off_policy_mask_threshold)
    hidden, weight, bias = lm_head_operands(hidden, weight, bias)
    vocab, hdim = weight.shape
    kernel_scalars = (1.0 - terms.cliprange, terms.clip_high, terms.entropy_coef, temperature,
                      *(terms.sapo_temperatures if terms.surrogate == "sapo" else ()),
                      *(() if terms.delta is None else (terms.delta,)))
    if not use_triton(hidden, kernel_scalars) or index.numel() == 0:
        # a CPU: the same math over the chunked LM-head core (never the [N, V] logits; the reference's are)
        return _ppo_policy_loss_math(hidden, weight, index, old_logprobs, advantages, mask, temperature, bias, terms,
                                     chunked=True)
    check_index_range(index, vocab)  # on CUDA an assertion on the device, no sync
    flat = [t.reshape(-1).contiguous() for t in (index, old_logprobs.detach(), advantages.detach(), mask)]
    for name in ("token_weights", "entropy_weights"):
        if getattr(terms, name) is not None:
            terms = terms._replace(**{name: getattr(terms, name).detach().reshape(-1).contiguous()})
    with no_autocast(hidden.device):
        loss, logp, ratio, clipped, ent = _FusedPPOPolicyLoss.apply(
            hidden.reshape(-1, hdim), weight, bias, *flat, temperature, terms)
    shape = index.shape
    return PPOPolicyLossOutput(loss, logp.view(shape), ratio.view(shape), clipped.view(shape), ent.view(shape))


# --------------------------------------------------------------------------- references


def _check_clipped_surrogate_args(logprobs, old_logprobs, advantages, cliprange, mask, cliprange_high, delta,
                                  sequence_ids):
    check_tensor("logprobs", logprobs, dtypes=FLOAT_DTYPES)
    check_tensor("old_logprobs", old_logprobs, dtypes=FLOAT_DTYPES)
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    if mask is not None:
        check_tensor("mask", mask, dtypes=MASK_DTYPES)
    if sequence_ids is not None:
        check_tensor("sequence_ids", sequence_ids, dtypes=INDEX_DTYPES)
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                     sequence_ids=sequence_ids)
    check_same_device(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                      sequence_ids=sequence_ids)
    return check_clip_args(cliprange, cliprange_high, delta)


def _surrogate(log_ratio, advantages, cliprange, cliprange_high, delta, logprobs, surrogate, sapo_temperatures):
    """(P2)-(P3) (or (P3'), (P3'')) from the log-ratio, with a ratio that may overflow: where it passes log(fp
    max), ρ = inf is a constant (its gradient is the clipped branch's, 0: autograd of exp would form 0·inf = NaN
    there). Returns (per-token loss, ρ, the clip flag)."""
    overflow = torch.exp(log_ratio.detach()) == float("inf")
    ratio = torch.where(overflow, float("inf"), torch.exp(torch.where(overflow, 0.0, log_ratio)))
    if surrogate == "cispo":  # ε_max = cliprange_high caps the ratio, a constant weight on logp
        return -advantages * ratio.detach().clamp(max=cliprange_high) * logprobs, ratio, \
            (ratio > cliprange_high) & (advantages > 0)
    if surrogate == "sapo":
        pos, neg = (torch.tensor(t, dtype=ratio.dtype, device=ratio.device) for t in sapo_temperatures)
        tau = torch.where(advantages > 0, pos, neg)
        return -advantages * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau), ratio, torch.zeros_like(overflow)
    unclipped = -advantages * (ratio if delta is None else ratio.clamp(max=delta))
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange_high)
    return torch.max(unclipped, clipped), ratio, clipped > unclipped


def sequence_sum(x: torch.Tensor, real: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int,
                 mean: bool = False) -> torch.Tensor:
    """Per token, the sum (``mean``: the mean) of ``x`` over the real tokens of its sequence (0 for a sequence with
    none). ``sequence_ids`` [x's shape] numbers the sequences 0..num_sequences − 1."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    ids = sequence_ids.reshape(-1).long()
    sums = x.new_zeros(num_sequences).index_add(0, ids, torch.where(real, x, zero).reshape(-1))
    if mean:
        sums = sums / x.new_zeros(num_sequences).index_add(0, ids, real.reshape(-1).to(x.dtype)).clamp(min=1.0)
    return sums.index_select(0, ids).view(x.shape)


def sequence_mean(x: torch.Tensor, real: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int):
    """Per token, the mean of ``x`` over the real tokens of its sequence (0 for a sequence with none): GSPO's
    length-normalised log-ratio."""
    return sequence_sum(x, real, sequence_ids, num_sequences, mean=True)


def vespo_weights(token_log_ratio, advantages, real, sequence_ids, num_sequences, gamma=VESPO_GAMMA):
    """(P3v) VESPO's φ(w) = exp(λ + k·log w − λ·w) per token, without gradient (TRL GRPO's ``get_gamma_weights``;
    1 at w = 1): w is the token's sequence ratio exp(Σ clamp(log ρ_t, ±20)) over its real tokens, log w clamped to
    [log 1e-8, 20]; (k, λ) = ``gamma``'s (k₊, λ₊) where A >= 0, else (k₋, λ₋), λ at least 1e-4. An overflow is 0."""
    k_pos, lambda_pos, k_neg, lambda_neg = gamma
    log_w = sequence_sum(token_log_ratio.detach().clamp(-20.0, 20.0), real, sequence_ids, num_sequences)
    log_w = log_w.clamp(VESPO_LOG_W_MIN, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_keep(token_log_ratio, advantages, real, sequence_ids, num_sequences, threshold: float):
    """(P6) DeepSeek-V3.2's off-policy sequence mask (TRL GRPO's ``off_policy_mask_threshold``), per token: A >= 0,
    or the mean over its sequence's real tokens of log π_old − log π_θ (−log ρ) at most ``threshold``."""
    mean_kl = sequence_sum(-token_log_ratio.detach(), real, sequence_ids, num_sequences, mean=True)
    return (advantages >= 0) | (mean_kl <= threshold)


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      cliprange: float, *, mask: torch.Tensor | None = None, cliprange_high: float | None = None,
                      delta: float | None = None, sequence_ids: torch.Tensor | None = None,
                      num_sequences: int | None = None, surrogate: str = "clip",
                      sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                      importance_sampling_level: str | None = None, vespo_gamma=VESPO_GAMMA,
                      off_policy_mask_threshold: float | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's per-token clipped surrogate loss, max(−A·min(ρ, δ), −A·clip(ρ, 1 − ε, 1 + ε_h)) with
    ρ = exp(logp − old): (the per-token loss, ρ, where the clipped term won). The one PyTorch statement of
    (P2)-(P3), of the other ``surrogate``s (P3'), (P3''), (P3v) and of the off-policy mask (P6): the trainer, the
    reference below, the sequence-level kernel path and the tests use it; the Triton kernel computes (P2)-(P3'')
    per row and is tested against it.

    ``surrogate``: "clip" (the above), "cispo" (−sg(min(ρ, ε_max))·A·logp with ε_max = ``cliprange_high``
    itself, > 0: TRL GRPO's loss_type cispo; the flag marks ρ > ε_max where A > 0), "sapo"
    (−A·σ(τ(ρ − 1))·4/τ, τ = ``sapo_temperature_pos`` where A > 0 else ``sapo_temperature_neg``: TRL GRPO's
    loss_type sapo; never flagged) or "vespo" (−sg(φ)·A·logp with ``vespo_weights``' φ at ``vespo_gamma``,
    (k₊, λ₊, k₋, λ₋): TRL GRPO's loss_type vespo; never flagged; needs ``sequence_ids``); ``delta`` is read by
    "clip" only. ``off_policy_mask_threshold``: the tokens ``off_policy_keep`` drops get loss 0 (needs
    ``sequence_ids``).

    The three tensors have one shape and device; ``cliprange`` ε >= 0, ``cliprange_high`` ε_h >= ε (default ε),
    ``delta`` δ > 1 (default none), checked as ``fused_ppo_policy_loss`` checks them. A ratio that overflows
    fp32 (logp − old > 88.7) is inf, and its token's gradient is the clipped branch's (0 for A > 0), not NaN.
    ``mask`` (optional, bool or numbers, nonzero = real): masked tokens get loss 0 and pass no gradient, and
    their ``old_logprobs`` and ``advantages`` never reach the loss or a gradient (inf/NaN allowed there); ρ and
    the flag are still reported for every token. ``sequence_ids`` (int, same shape; ``num_sequences`` of them,
    counted when None) number the sequences; ``importance_sampling_level`` "sequence" (the default when they are
    given, GSPO) makes ρ of every token of a sequence exp(``sequence_mean`` of its real tokens' logp − old),
    "sequence_sum" exp(``sequence_sum`` of them) (RLOO's, TRL 1.16's RLOOTrainer), "token" keeps one ρ per token
    (vespo's and the off-policy mask's sequences without GSPO).
    """
    cliprange, cliprange_high, delta = _check_clipped_surrogate_args(
        logprobs, old_logprobs, advantages, cliprange, mask, cliprange_high, delta, sequence_ids)
    temperatures, vespo_gamma, off_policy_mask_threshold = check_surrogate_args(
        surrogate, cliprange_high, delta, sapo_temperature_pos, sapo_temperature_neg, vespo_gamma,
        off_policy_mask_threshold)
    level = importance_sampling_level or ("token" if sequence_ids is None else "sequence")
    if level not in SURROGATE_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {', '.join(SURROGATE_LEVELS)}; "
                         f"got {importance_sampling_level!r}")
    whole_sequences = level != "token" or surrogate == "vespo" or off_policy_mask_threshold is not None
    if whole_sequences and sequence_ids is None:
        raise ValueError("sequence_ids are needed: the sequence level, surrogate 'vespo' and "
                         "off_policy_mask_threshold read each token's whole sequence")
    bounds = (cliprange, cliprange_high, delta)
    own = "clip" if surrogate == "vespo" else surrogate  # vespo's ρ and flags are the clipped surrogate's
    if mask is None and not whole_sequences:
        return _surrogate(logprobs - old_logprobs, advantages, *bounds, logprobs, own, temperatures)
    real = torch.ones_like(logprobs, dtype=torch.bool) if mask is None else mask != 0
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    token_log_ratio = logprobs - torch.where(real, old_logprobs, logprobs.detach())
    log_ratio = token_log_ratio
    count = 0
    if sequence_ids is not None:
        count = (int(sequence_ids.max()) + 1 if sequence_ids.numel() else 0) if num_sequences is None \
            else num_sequences
    if level == "sequence":
        log_ratio = sequence_mean(token_log_ratio, real, sequence_ids, count)
    elif level == "sequence_sum":
        log_ratio = sequence_sum(token_log_ratio, real, sequence_ids, count)
    adv = torch.where(real, advantages, zero)
    loss, ratio, clipped = _surrogate(log_ratio, adv, *bounds, logprobs, own, temperatures)
    if surrogate == "vespo":
        loss = -vespo_weights(token_log_ratio, adv, real, sequence_ids, count, vespo_gamma) * adv * logprobs
        clipped = torch.zeros_like(clipped)
    if off_policy_mask_threshold is not None:
        keep = off_policy_keep(token_log_ratio, adv, real, sequence_ids, count, off_policy_mask_threshold)
        loss = torch.where(keep, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    with torch.no_grad():  # the statistics of the masked tokens, from their own values
        raw_log_ratio = log_ratio.detach() if level != "token" else logprobs.detach() - old_logprobs
        _, raw_ratio, raw_clipped = _surrogate(raw_log_ratio, advantages, *bounds, logprobs.detach(), own,
                                               temperatures)
        if surrogate == "vespo":
            raw_clipped = torch.zeros_like(raw_clipped)
    return (torch.where(real, loss, torch.zeros((), dtype=loss.dtype, device=loss.device)),
            torch.where(real, ratio, raw_ratio), torch.where(real, clipped, raw_clipped))


def clip_sides(ratio: torch.Tensor, advantages: torch.Tensor, cliprange: float, cliprange_high: float | None = None,
               delta: float | None = None, surrogate: str = "clip") -> tuple[torch.Tensor, torch.Tensor]:
    """TRL GRPO's clip_ratio/low and /high flags per token: the ratio (after δ's bound) below 1 − ε where A < 0,
    above 1 + ε_h where A > 0 (where the clip took the gradient away). "cispo": no low side, the high side above
    ε_max (TRL's cispo_clip_ratio); "sapo", "vespo": neither (they do not clip)."""
    cliprange, cliprange_high, delta = check_clip_args(cliprange, cliprange_high, delta)
    check_surrogate_args(surrogate, cliprange_high, delta)
    if surrogate != "clip":
        high = (ratio > cliprange_high) & (advantages > 0)
        if surrogate != "cispo":
            high = torch.zeros_like(high)
        return torch.zeros_like(high), high
    bounded = ratio if delta is None else ratio.clamp(max=delta)
    return (bounded < 1.0 - cliprange) & (advantages < 0), (bounded > 1.0 + cliprange_high) & (advantages > 0)


def fused_ppo_policy_loss_reference(hidden, weight, index, old_logprobs, advantages, mask, cliprange,
                                    entropy_coef=0.0, temperature=1.0, bias=None, reduction="token_mean", *,
                                    cliprange_high=None, delta=None, importance_sampling_level="token",
                                    sequence_lengths=None, token_weights=None, normalizer=None,
                                    entropy_weights=None, surrogate="clip", sapo_temperature_pos=1.0,
                                    sapo_temperature_neg=1.05, vespo_gamma=VESPO_GAMMA,
                                    off_policy_mask_threshold=None) -> PPOPolicyLossOutput:
    """Plain PyTorch ``fused_ppo_policy_loss``: materialised fp32 (fp64) logits (``COMPUTE_DTYPE_RULE``), then
    (P1)-(P4) as the trainer writes them."""
    terms, temperature = _check_ppo_policy_loss_args(
        hidden, weight, index, old_logprobs, advantages, mask, cliprange, entropy_coef, temperature, bias, reduction,
        cliprange_high, delta, importance_sampling_level, sequence_lengths, token_weights, normalizer, entropy_weights,
        surrogate, sapo_temperature_pos, sapo_temperature_neg, vespo_gamma, off_policy_mask_threshold)
    hidden, weight, bias = lm_head_operands(hidden, weight, bias)
    return _ppo_policy_loss_math(hidden, weight, index, old_logprobs, advantages, mask, temperature, bias, terms)


def _ppo_policy_loss_math(hidden, weight, index, old_logprobs, advantages, mask, temperature, bias,
                          terms: PolicyTerms, chunked: bool = False) -> PPOPolicyLossOutput:
    """(P1)-(P4) in PyTorch: log-probs and entropy from materialised logits (the reference), or ``chunked`` from
    ``_lmhead.chunked_logprobs_entropy`` (a CPU call of ``fused_ppo_policy_loss``: no [N, V] tensor)."""
    if chunked and index.numel():
        check_index_range(index, weight.shape[0])
        logp, ent = chunked_logprobs_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, bias, index.reshape(-1),
                                             temperature)
        logp, ent = logp.view(index.shape), ent.view(index.shape)
    else:
        logp, ent = token_logprobs_reference(lm_head_logits_reference(hidden, weight, bias), index, temperature,
                                             return_entropy=True, ignore_index=None)
    acc = logp.dtype
    old, adv, real = old_logprobs.detach().to(acc), advantages.detach().to(acc), mask != 0
    ids = None
    if terms.sequence_lengths is not None:
        ids = torch.repeat_interleave(torch.arange(len(terms.sequence_lengths), device=logp.device),
                                      torch.as_tensor(terms.sequence_lengths, device=logp.device)).view(index.shape)
    # masked tokens: their old log-probs and advantages reach neither the loss nor a gradient (inf/NaN allowed)
    pg_losses, ratio, clipped = clipped_surrogate(
        logp, old, adv, terms.cliprange, mask=real, cliprange_high=terms.cliprange_high, delta=terms.delta,
        sequence_ids=ids, num_sequences=None if ids is None else len(terms.sequence_lengths), **terms.surrogate_options)
    zero = torch.zeros((), dtype=acc, device=logp.device)
    if terms.token_weights is not None:
        pg_losses = pg_losses * torch.where(real, terms.token_weights.detach().to(acc), zero)
    pg_sum = pg_losses.sum()
    ent_sum = torch.where(real, ent, zero).sum()
    normalizer = None if terms.normalizer is None else terms.normalizer.detach().to(acc)
    if terms.entropy_weights is not None:
        pg_part = pg_sum / (real.sum().clamp(min=1) if normalizer is None and terms.token_mean else
                            1.0 if normalizer is None else normalizer)
        entropy_part = torch.where(real, terms.entropy_weights.detach().to(acc) * ent, zero).sum()
        loss = pg_part - terms.entropy_coef * entropy_part
    elif terms.token_mean and not terms.weighted:
        count = real.sum()
        loss = pg_sum / count - terms.entropy_coef * (ent_sum / count)
    elif terms.token_mean:  # u/d given: an empty mask gives 0, as the kernel's per-token terms do
        loss = pg_sum / (real.sum().clamp(min=1) if normalizer is None else normalizer) \
            - terms.entropy_coef * (ent_sum / real.sum().clamp(min=1))
    else:
        loss = (pg_sum if normalizer is None else pg_sum / normalizer) - terms.entropy_coef * ent_sum
    return PPOPolicyLossOutput(loss, logp.detach(), ratio.detach(), clipped, ent.detach())
