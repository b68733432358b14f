"""Generalised advantage estimation (GAE) as a reverse scan over the response.

Per row, with γ = ``gamma``, λ = ``lam`` and the recurrence run from the last
position T-1 down to 0 (Schulman et al. 2016, eq. 11-16):

    δ_t = r_t + γ·V_next(t) − V_t                                   (1)
    A_t = δ_t + γλ·A_next(t)                                        (2)
    returns_t = A_t + V_t                                           (3)

``mask`` marks real response tokens (bool, or numbers where nonzero = real).
The two semantics differ only in what "next" means and what is written on
masked positions.

``skip_masked=False`` (default) — the loop of TRL's PPOTrainer and of "The N+
implementation details of RLHF with PPO": rewards and values are zeroed on
masked positions first (TRL: ``values = masked_fill(values, padding_mask_p1,
0)``; its rewards are 0 on padding), then (1)-(2) run over every position with
V_next(t) = V_{t+1} (0 at t = T-1) and A_next(t) = A_{t+1} (A_T = 0). Outputs
are zeroed where mask is 0: advantages = 0 and returns = 0 there. For a
right-padded mask this is exactly "V beyond the end is 0". An interior hole
behaves as a step with zero reward and zero value: the discount still advances
across it and the value before it bootstraps from 0.
TRL itself puts the score one past the last real token and keeps that
position's value (its ``sequence_lengths + 1`` convention); passing TRL's
``~padding_mask_p1`` as ``mask`` reproduces TRL's loop output exactly
(tests/test_gae.py::test_default_equals_trl_loop).

``skip_masked=True`` — verl's ``compute_gae_advantage_return`` (masked tokens
are tool output / observations in multi-turn rollouts): masked positions do not
update the running next-value or the running advantage, so they carry across
them. On a real position, V_next(t) is the value of the next *real* position
and A_next(t) its advantage (γ is applied once per real step, not per token);
on a masked position verl writes the carried advantage, i.e. the advantage of
the next real token (0 when there is none), and returns = that + V_t with the
raw V_t. We write the same values. For a right-padding mask the advantages
equal the default's everywhere and the returns on real tokens; on padding the
default writes returns 0 and this mode writes V_t.

Both are computed in fp32 whatever the input dtype and returned as fp32; no
gradients (advantages and returns are targets, never differentiated).

Kernel: one program per BLOCK_B rows walks the row from the end in tiles of
BLOCK_T positions loaded in reverse, so the tile's index 0 is its latest time.
Inside a tile each recurrence x_t = a_t·x_next + b_t is solved with
``tl.associative_scan`` over affine maps, then seeded with the carry from the
later tile: T/BLOCK_T serial steps per row instead of T.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from fastppo.kernels._common import FLOAT_DTYPES, HAS_TRITON, MASK_DTYPES, check_same_device, check_float
from fastppo.kernels._common import check_same_shape, check_tensor, fp32_product, launch, tile_choice, tl, triton
from fastppo.kernels._common import use_triton


# --------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _affine_combine(a1, b1, a2, b2):
        # Maps x -> a·x + b, composed in scan order: (a1, b1) is applied first
        # (the later time), then (a2, b2): a2·(a1·x + b1) + b2.
        return a1 * a2, a2 * b1 + b2

    @triton.jit
    def _gae_fwd_kernel(
        rewards_ptr,
        values_ptr,
        mask_ptr,
        adv_ptr,
        ret_ptr,
        B,
        T,
        stride_r,
        stride_v,
        stride_m,
        stride_o,
        gamma,
        gamma_lam,  # γ·λ formed on the host as a GPU forms it (``_common.fp32_product``)
        SKIP_MASKED: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        rows64 = rows.to(tl.int64)  # 64-bit row offsets: B·T may exceed 2**31
        j = tl.arange(0, BLOCK_T)
        r_row = rewards_ptr + rows64[:, None] * stride_r
        v_row = values_ptr + rows64[:, None] * stride_v
        m_row = mask_ptr + rows64[:, None] * stride_m
        o_off = rows64[:, None] * stride_o
        gl = gamma_lam
        zeros = tl.zeros([BLOCK_B, BLOCK_T], dtype=tl.float32)
        is_first = (j == BLOCK_T - 1)[None, :]  # the tile's earliest time
        # Carries from the later tile: the running advantage A_next and, for
        # skip_masked, the value of the first real token after the tile.
        carry_a = tl.zeros([BLOCK_B], dtype=tl.float32)
        carry_v = tl.zeros([BLOCK_B], dtype=tl.float32)
        for start in range(0, T, BLOCK_T):
            t = T - 1 - start - j  # reversed: j = 0 is the latest time
            ok = row_ok[:, None] & (t >= 0)[None, :]
            ok1 = ok & (t + 1 < T)[None, :]
            tt = t[None, :]
            r = tl.load(r_row + tt, mask=ok, other=0.0).to(tl.float32)
            v = tl.load(v_row + tt, mask=ok, other=0.0).to(tl.float32)
            m = tl.load(m_row + tt, mask=ok, other=0) != 0
            # Position t+1 again (a cache hit) rather than shifting registers.
            v1 = tl.load(v_row + tt + 1, mask=ok1, other=0.0).to(tl.float32)
            m1 = tl.load(m_row + tt + 1, mask=ok1, other=0) != 0
            if SKIP_MASKED:
                # V_next(t) = value of the first real position > t:
                # x_t = m_{t+1} ? V_{t+1} : x_{t+1}, seeded with carry_v.
                pa, pb = tl.associative_scan(
                    (tl.where(m1, zeros, zeros + 1.0), tl.where(m1, v1, zeros)), 1, _affine_combine
                )
                v_next = pa * carry_v[:, None] + pb
                carry_v = tl.sum(tl.where(is_first, v_next, zeros), axis=1)
                delta = r + gamma * v_next - v  # (1)
                # (2) on real positions; masked ones pass A through unchanged.
                a = tl.where(m, zeros + gl, zeros + 1.0)
                b = tl.where(m, delta, zeros)
            else:
                # Zero r and V on masked positions first, as TRL does; where()
                # rather than a product so inf/NaN on padding cannot leak.
                v = tl.where(m, v, zeros)
                delta = tl.where(m, r, zeros) + gamma * tl.where(m1, v1, zeros) - v  # (1)
                a = zeros + gl  # (2) on every position
                b = delta
            pa, pb = tl.associative_scan((a, b), 1, _affine_combine)
            adv = pa * carry_a[:, None] + pb
            carry_a = tl.sum(tl.where(is_first, adv, zeros), axis=1)
            ret = adv + v  # (3); skip_masked: raw V_t on masked positions, as verl writes
            if not SKIP_MASKED:
                adv = tl.where(m, adv, zeros)
                ret = tl.where(m, ret, zeros)
            tl.store(adv_ptr + o_off + tt, adv, mask=ok)
            tl.store(ret_ptr + o_off + tt, ret, mask=ok)


# --------------------------------------------------------------------------- launchers


class GAETile(NamedTuple):
    """``gae``'s launch choice (what ``bench/tune.py`` varies)."""

    block_b: int  # rows per program
    block_t: int  # positions per serial step of the scan
    num_warps: int


def _gae_tile(B: int, T: int, device: torch.device) -> GAETile:
    """One row per program keeps B programs in flight (the rows are independent); a tile of up to
    512 positions per serial step. Not tuned on a GPU yet."""
    block_b = 1 if B < 4096 else 4
    return tile_choice("gae", GAETile(block_b, min(512, max(16, triton.next_power_of_2(T))), 4))


def _launch_gae_fwd(rewards, values, mask, gamma, lam, skip_masked):
    B, T = rewards.shape
    adv = torch.empty((B, T), dtype=torch.float32, device=rewards.device)
    ret = torch.empty((B, T), dtype=torch.float32, device=rewards.device)
    if B == 0 or T == 0:
        return adv, ret
    # The kernel reads along T with unit stride; rows may be strided.
    rewards, values, mask = (x if x.stride(1) == 1 else x.contiguous() for x in (rewards, values, mask))
    tile = _gae_tile(B, T, rewards.device)
    launch(_gae_fwd_kernel, (triton.cdiv(B, tile.block_b),), rewards.device,
           rewards, values, mask, adv, ret, B, T,
           rewards.stride(0), values.stride(0), mask.stride(0), adv.stride(0), gamma, fp32_product(gamma, lam),
           SKIP_MASKED=skip_masked, BLOCK_B=tile.block_b, BLOCK_T=tile.block_t, num_warps=tile.num_warps)
    return adv, ret


# --------------------------------------------------------------------------- public API


def _check_gae_args(rewards, values, mask, gamma, lam, skip_masked):
    check_tensor("rewards", rewards, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("values", values, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask, ndim=2, dtypes=MASK_DTYPES)
    check_same_shape(rewards=rewards, values=values, mask=mask)
    check_same_device(rewards=rewards, values=values, mask=mask)
    if not isinstance(skip_masked, bool):
        raise TypeError(f"skip_masked must be a bool, got {type(skip_masked).__name__}")
    return (check_float("gamma", gamma, minimum=0.0, maximum=1.0), check_float("lam", lam, minimum=0.0, maximum=1.0))


@torch.no_grad()
def gae(rewards, values, mask, gamma: float, lam: float, skip_masked: bool = False):
    """Advantages and returns by GAE, each [B, T] fp32.

    Args:
        rewards: [B, T] per-token rewards, any float dtype.
        values: [B, T] value estimates V_t, any float dtype.
        mask: [B, T] bool (or numbers, nonzero = real) marking real response tokens.
        gamma: discount γ in [0, 1].
        lam: GAE λ in [0, 1].
        skip_masked: False = TRL / N+ loop over right-padded responses (outputs 0
            on masked positions); True = verl semantics, masked interior tokens
            carry the running value and advantage across them. Exact definitions
            in the module docstring.

    CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run the Triton
    scan; other CPU tensors run :func:`gae_reference`. No host syncs on CUDA.
    """
    gamma, lam = _check_gae_args(rewards, values, mask, gamma, lam, skip_masked)
    if use_triton(rewards):
        return torch.ops.fastppo.gae(rewards, values, mask, gamma, lam, skip_masked)  # custom_ops.py: the launcher
    adv, ret = gae_reference(rewards, values, mask, gamma, lam, skip_masked)
    return adv.float(), ret.float()


# --------------------------------------------------------------------------- references


@torch.no_grad()
def gae_reference(rewards, values, mask, gamma: float, lam: float, skip_masked: bool = False):
    """The plain reverse loop over t, both semantics (see the module docstring).

    Computes in float64 when either input is float64 (the tests' oracle), in
    float32 otherwise. Returns (advantages, returns), each [B, T].
    """
    gamma, lam = _check_gae_args(rewards, values, mask, gamma, lam, skip_masked)
    dtype = torch.float64 if torch.float64 in (rewards.dtype, values.dtype) else torch.float32
    r, v, m = rewards.to(dtype), values.to(dtype), mask != 0
    if not skip_masked:
        zero = torch.zeros((), dtype=dtype, device=r.device)
        r, v = torch.where(m, r, zero), torch.where(m, v, zero)
    B, T = r.shape
    adv = torch.empty((B, T), dtype=dtype, device=r.device)
    last_a = torch.zeros(B, dtype=dtype, device=r.device)  # A_next, 0 beyond the end
    next_v = torch.zeros(B, dtype=dtype, device=r.device)  # V_next, 0 beyond the end
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - v[:, t]  # (1)
        a_t = delta + gamma * lam * last_a  # (2)
        if skip_masked:
            last_a = torch.where(m[:, t], a_t, last_a)
            next_v = torch.where(m[:, t], v[:, t], next_v)
        else:
            last_a, next_v = a_t, v[:, t]
        adv[:, t] = last_a
    ret = adv + v  # (3)
    if not skip_masked:
        zero = torch.zeros((), dtype=dtype, device=r.device)
        adv, ret = torch.where(m, adv, zero), torch.where(m, ret, zero)
    return adv, ret


__all__ = ["gae", "gae_reference"]
