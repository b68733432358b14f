"""The clipped PPO policy loss (+ entropy bonus) from hidden states, its gradient formed in the forward.

Semantics: exactly the policy part of the trainer's ``ppo_losses``
(fastppo/train.py), per token n with mask m_n, advantage A_n, old log-prob
o_n, clip range ε and entropy coefficient c:

    logp_n = log softmax((h_n·Wᵀ + b) / T)[index_n],   H_n its entropy     (P1)
    ρ_n = exp(logp_n − o_n)                                               (P2)
    pg_n = max(−A_n ρ_n, −A_n clip(ρ_n, 1 − ε, 1 + ε))                     (P3)
    loss = Σ m_n pg_n / Σ m_n − c · Σ m_n H_n / Σ m_n   ("token_mean")    (P4)
           Σ m_n pg_n − c · Σ m_n H_n                    ("sum")
    clipped_n = −A_n clip(ρ_n, 1 − ε, 1 + ε) > −A_n ρ_n  (the trainer's clipfrac)

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

    d1 = −A_n ρ_n,   d2 = d1 · [1 − ε ≤ ρ_n ≤ 1 + ε]
    g_n = s·m_n · (d1 if pg1 > pg2; d2 if pg2 > pg1; (d1 + d2)/2 on a tie)  (P5)
    g_H,n = −c·s·m_n,   s = 1/Σ m ("token_mean") or 1 ("sum")

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

from typing import NamedTuple

import torch

from fastppo.kernels._common import FLOAT_DTYPES, HAS_TRITON, INDEX_DTYPES, MASK_DTYPES, check_float
from fastppo.kernels._common import check_index_range, check_same_device, check_same_shape, check_temperature
from fastppo.kernels._common import check_tensor, launch, refuse_double_backward, tile_choice, tl, triton, use_triton
from fastppo.kernels._lmhead import acc_dtype, addmm_acc_, check_lm_head_args, lm_head_logits_reference, mm_acc
from fastppo.kernels._lmhead import lm_head_operands, no_autocast, row_tile, tl_dtype
from fastppo.kernels.logprobs import token_logprobs_reference

if HAS_TRITON:
    from fastppo.kernels._lmhead import row_pick, row_softmax, softmax_dlogits, store_dlogits

REDUCTIONS = ("token_mean", "sum")


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
        logp_ptr, ratio_ptr, clipped_ptr, ent_ptr, loss_ptr,  # [rows] outputs; loss: m·(pg − c·H) unscaled
        n_cols, temperature, clip_low, clip_high, entropy_coef,
        TOKEN_MEAN: tl.constexpr, NEEDS_GRAD: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_V: tl.constexpr,
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
        pg1 = -adv * ratio
        pg2 = -adv * tl.minimum(tl.maximum(ratio, clip_low), clip_high)
        tl.store(logp_ptr + row, logp)
        tl.store(ratio_ptr + row, ratio)
        tl.store(clipped_ptr + row, pg2 > pg1)
        tl.store(ent_ptr + row, ent)
        tl.store(loss_ptr + row, tl.where(real, tl.maximum(pg1, pg2) - entropy_coef * ent, 0.0))
        if NEEDS_GRAD:
            scale = 1.0
            if TOKEN_MEAN:
                # count = 0 means no real token: every g below is 0 whatever the scale (no 1/0 needed).
                scale = 1.0 / tl.maximum(tl.load(count_ptr).to(ACC_DTYPE), 1.0)
            d1 = -adv * ratio
            d2 = tl.where((ratio >= clip_low) & (ratio <= clip_high), d1, 0.0)
            g_pg = tl.where(pg1 > pg2, d1, tl.where(pg2 > pg1, d2, 0.5 * (d1 + d2)))  # (P5)
            g_logp = tl.where(real, g_pg * scale, 0.0)
            g_ent = tl.where(real, -entropy_coef * scale, 0.0)
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


def _launch_ppo_policy_loss(hidden2d, weight, bias, index, old, adv, mask, clip_low, clip_high, entropy_coef,
                            temperature, token_mean, needs):
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

    tile = _ppo_loss_tile(n_rows, vocab, device)
    chunk = max(1, min(tile.chunk_rows, n_rows))
    x_buf = torch.empty(chunk, vocab, dtype=acc, device=device)
    dx_buf = x_buf if dtype == acc or not needs_grad else torch.empty(chunk, vocab, dtype=dtype, device=device)
    grad_h = torch.empty(n_rows, hdim, dtype=dtype, device=device) if need_h else None
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=device) if need_w else None
    # grad_W over several chunks: in grad_w itself when it is fp32/fp64, else in an fp32 accumulator (docstring).
    acc_w = None
    if need_w and weight.dtype != acc and chunk < n_rows:
        acc_w = torch.zeros(weight.shape, dtype=acc, device=device)
    grad_b = torch.zeros(vocab, dtype=acc, device=device) if need_b else None

    for r0 in range(0, n_rows, chunk):
        r1 = min(n_rows, r0 + chunk)
        h_c = hidden2d[r0:r1]
        x_c = mm_acc(h_c, weight.t(), out=x_buf[: r1 - r0])
        if bias is not None:
            x_c += bias
        dx_c = dx_buf[: r1 - r0]
        launch(_ppo_policy_loss_rows_kernel, (r1 - r0,), device,
               x_c, x_c.stride(0), dx_c, dx_c.stride(0), index[r0:r1], old[r0:r1], adv[r0:r1], mask[r0:r1], count,
               logp[r0:r1], ratio[r0:r1], clipped[r0:r1], ent[r0:r1], loss_rows[r0:r1],
               vocab, temperature, clip_low, clip_high, entropy_coef,
               TOKEN_MEAN=token_mean, NEEDS_GRAD=needs_grad, ACC_DTYPE=tl_dtype(acc), BLOCK_V=tile.block_v,
               num_warps=tile.num_warps)
        if need_h:
            torch.mm(dx_c, weight, out=grad_h[r0:r1])
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
    if token_mean:
        loss = loss / count
    return loss, (logp, ratio, clipped, ent), (grad_h, grad_w, grad_b)


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


class _FusedPPOPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, bias, index, old, adv, mask, clip_low, clip_high, entropy_coef, temperature,
                token_mean):
        loss, stats, grads = _launch_ppo_policy_loss(
            hidden2d, weight, bias, index, old, adv, mask, clip_low, clip_high, entropy_coef, temperature,
            token_mean, ctx.needs_input_grad[:3],  # all False under no_grad: no gradient is formed
        )
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(*stats)
        return (loss, *stats)

    @staticmethod
    def backward(ctx, g_loss, *_):
        # Formed in the forward from the inputs' values: they carry no graph for a second derivative.
        refuse_double_backward("fused_ppo_policy_loss")
        # The gradients were formed in the forward for an upstream gradient of 1: only scale them.
        grads = tuple(None if g is None else _scaled(g, g_loss) for g in ctx.saved_tensors)
        return (*grads, *(None,) * 9)


# --------------------------------------------------------------------------- public API


def _check_ppo_policy_loss_args(hidden, weight, index, old_logprobs, advantages, mask, cliprange, entropy_coef,
                                temperature, bias, reduction):
    check_lm_head_args(hidden, weight, bias)
    check_tensor("index", index, dtypes=INDEX_DTYPES)
    check_tensor("old_logprobs", old_logprobs, dtypes=FLOAT_DTYPES)
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask, dtypes=MASK_DTYPES)
    if index.shape != hidden.shape[:-1]:
        raise ValueError(
            f"index has shape {tuple(index.shape)} but must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}"
        )
    check_same_shape(index=index, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    check_same_device(hidden=hidden, index=index, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}; got {reduction!r}")
    return (check_float("cliprange", cliprange, minimum=0.0), check_float("entropy_coef", entropy_coef),
            check_temperature(temperature))


def fused_ppo_policy_loss(hidden, weight, index, old_logprobs, advantages, mask, cliprange, entropy_coef=0.0,
                          temperature=1.0, bias=None, reduction="token_mean") -> PPOPolicyLossOutput:
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
        cliprange: ε >= 0; ratios are clipped to [1 − ε, 1 + ε].
        entropy_coef: c; the loss subtracts c times the mean entropy.
        temperature: float > 0; the policy is softmax(logits / temperature).
        bias: optional [V] LM-head bias.
        reduction: "token_mean" (the mean over mask-true tokens of the whole
            input, as the trainer's ``masked_mean``) or "sum" (the masked sum,
            for a caller that normalises across micro-batches itself).

    Returns:
        ``PPOPolicyLossOutput(loss, logprobs, ratio, clipped, entropy)``: the
        0-d loss, differentiable in ``hidden``, ``weight`` and ``bias``
        (``old_logprobs`` and ``advantages`` are constants), and per-token
        statistics without gradient (fp32, or fp64 for fp64 inputs; ``clipped``
        bool), computed for every token, masked or not.
    """
    cliprange, entropy_coef, temperature = _check_ppo_policy_loss_args(
        hidden, weight, index, old_logprobs, advantages, mask, cliprange, entropy_coef, temperature, bias, reduction)
    hidden, weight, bias = lm_head_operands(hidden, weight, bias)
    vocab, hdim = weight.shape
    kernel_scalars = (1.0 - cliprange, 1.0 + cliprange, entropy_coef, temperature)
    if not use_triton(hidden, kernel_scalars) or index.numel() == 0:
        return _ppo_policy_loss_math(hidden, weight, index, old_logprobs, advantages, mask, cliprange,
                                     entropy_coef, temperature, bias, reduction)
    if not hidden.is_cuda:  # interpreter: cheap here; on CUDA it would sync
        check_index_range(index, vocab)
    flat = [t.reshape(-1).contiguous() for t in (index, old_logprobs.detach(), advantages.detach(), mask)]
    with no_autocast(hidden.device):
        loss, logp, ratio, clipped, ent = _FusedPPOPolicyLoss.apply(
            hidden.reshape(-1, hdim), weight, bias, *flat, 1.0 - cliprange, 1.0 + cliprange, entropy_coef,
            temperature, reduction == "token_mean",
        )
    shape = index.shape
    return PPOPolicyLossOutput(loss, logp.view(shape), ratio.view(shape), clipped.view(shape), ent.view(shape))


# --------------------------------------------------------------------------- references


def _check_clipped_surrogate_args(logprobs, old_logprobs, advantages, cliprange, mask) -> float:
    check_tensor("logprobs", logprobs, dtypes=FLOAT_DTYPES)
    check_tensor("old_logprobs", old_logprobs, dtypes=FLOAT_DTYPES)
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    if mask is not None:
        check_tensor("mask", mask, dtypes=MASK_DTYPES)
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    check_same_device(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    return check_float("cliprange", cliprange, minimum=0.0)


def _surrogate(logprobs, old_logprobs, advantages, cliprange):
    """(P2)-(P3) with a ratio that may overflow: where logp − old passes log(fp max), ρ = inf is a constant
    (its gradient is the clipped branch's, 0: autograd of exp would form 0·inf = NaN there)."""
    log_ratio = logprobs - old_logprobs
    overflow = torch.exp(log_ratio.detach()) == float("inf")
    ratio = torch.where(overflow, float("inf"), torch.exp(torch.where(overflow, 0.0, log_ratio)))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    return torch.max(unclipped, clipped), ratio, clipped > unclipped


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      cliprange: float, *, mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's per-token clipped surrogate loss, max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)) with ρ = exp(logp − old):
    (the per-token loss, ρ, where the clipped term won). The one PyTorch statement of (P2)-(P3): the trainer,
    the reference below and the tests use it; the Triton kernel computes the same per row and is tested
    against it.

    The three tensors have one shape and device; ``cliprange`` ε >= 0 (checked as ``fused_ppo_policy_loss``
    checks them). A ratio that overflows fp32 (logp − old > 88.7) is inf, and its token's gradient is the
    clipped branch's (0 for A > 0), not NaN. ``mask`` (optional, bool or numbers, nonzero = real): masked
    tokens get loss 0 and pass no gradient, and their ``old_logprobs`` and ``advantages`` never reach the
    loss or a gradient (inf/NaN allowed there); ρ and the flag are still reported for every token.
    """
    cliprange = _check_clipped_surrogate_args(logprobs, old_logprobs, advantages, cliprange, mask)
    if mask is None:
        return _surrogate(logprobs, old_logprobs, advantages, cliprange)
    real = mask != 0
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    loss, ratio, clipped = _surrogate(logprobs, torch.where(real, old_logprobs, logprobs.detach()),
                                      torch.where(real, advantages, zero), cliprange)
    with torch.no_grad():  # the statistics of the masked tokens, from their own values
        _, raw_ratio, raw_clipped = _surrogate(logprobs.detach(), old_logprobs, advantages, cliprange)
    return (torch.where(real, loss, torch.zeros((), dtype=loss.dtype, device=loss.device)),
            torch.where(real, ratio, raw_ratio), torch.where(real, clipped, raw_clipped))


def fused_ppo_policy_loss_reference(hidden, weight, index, old_logprobs, advantages, mask, cliprange,
                                    entropy_coef=0.0, temperature=1.0, bias=None,
                                    reduction="token_mean") -> PPOPolicyLossOutput:
    """Plain PyTorch ``fused_ppo_policy_loss``: materialised fp32 (fp64) logits (``COMPUTE_DTYPE_RULE``), then
    (P1)-(P4) as the trainer writes them."""
    cliprange, entropy_coef, temperature = _check_ppo_policy_loss_args(
        hidden, weight, index, old_logprobs, advantages, mask, cliprange, entropy_coef, temperature, bias, reduction)
    hidden, weight, bias = lm_head_operands(hidden, weight, bias)
    return _ppo_policy_loss_math(hidden, weight, index, old_logprobs, advantages, mask, cliprange, entropy_coef,
                                 temperature, bias, reduction)


def _ppo_policy_loss_math(hidden, weight, index, old_logprobs, advantages, mask, cliprange, entropy_coef,
                          temperature, bias, reduction) -> PPOPolicyLossOutput:
    logp, ent = token_logprobs_reference(lm_head_logits_reference(hidden, weight, bias), index, temperature,
                                         return_entropy=True, ignore_index=None)
    acc = logp.dtype
    old, adv, real = old_logprobs.detach().to(acc), advantages.detach().to(acc), mask != 0
    # masked tokens: their old log-probs and advantages reach neither the loss nor a gradient (inf/NaN allowed)
    pg_losses, ratio, clipped = clipped_surrogate(logp, old, adv, cliprange, mask=real)
    zero = torch.zeros((), dtype=acc, device=logp.device)
    pg_sum = pg_losses.sum()
    ent_sum = torch.where(real, ent, zero).sum()
    if reduction == "token_mean":
        count = real.sum()
        loss = pg_sum / count - entropy_coef * (ent_sum / count)
    else:
        loss = pg_sum - entropy_coef * ent_sum
    return PPOPolicyLossOutput(loss, logp.detach(), ratio.detach(), clipped, ent.detach())
