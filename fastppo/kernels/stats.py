"""Masked mean, variance and whitening: the trainer's small statistics helpers.

Same definitions as TRL's ``masked_mean`` / ``masked_var`` / ``masked_whiten``
(also verl's), over the entries where ``mask`` is nonzero:

    mean  = Σ_i m_i·x_i / Σ_i m_i
    var   = Σ_i m_i·(x_i − mean)² / Σ_i m_i  ·  n/(n − 1) if unbiased   (n = Σ_i m_i)
    white = (x − mean) · rsqrt(var + 1e-8)   (+ mean when shift_mean=False)

Differences from TRL, all deliberate:
  * masked entries are *selected out* with ``torch.where``, not multiplied by 0,
    so inf/NaN on padding cannot turn the statistic into NaN;
  * a numeric mask is read as nonzero = selected (TRL would weight by it);
  * ``masked_var`` raises ValueError when n = 0 and, with ``unbiased``, when
    n = 1 (TRL raises only for n = 0 and returns inf for n = 1). The check
    reads n on the host: one sync per ``masked_var`` / ``masked_whiten`` call;
  * ``masked_mean`` does not check (no sync, so it can run every step and per
    row): an empty selection gives NaN, like ``torch.mean`` of nothing.

Plain PyTorch: these are a handful of reductions over [B, T], and a kernel would
not beat them. Computed in fp32 (fp64 stays fp64); results are fp32 (fp64 for
fp64 input). Masked positions of ``masked_whiten``'s output are transformed the
same way as the others; the caller masks them if needed.
"""
from __future__ import annotations

import torch

from fastppo.kernels._common import FLOAT_DTYPES, MASK_DTYPES, check_same_device, check_same_shape, check_tensor

WHITEN_EPS = 1e-8  # as TRL and verl: keeps rsqrt finite for a constant input


def _prepare(x, mask):
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("mask", mask, dtypes=MASK_DTYPES)
    check_same_shape(x=x, mask=mask)
    check_same_device(x=x, mask=mask)
    dtype = torch.promote_types(x.dtype, torch.float32)
    return x.to(dtype), mask != 0


def _mean(x: torch.Tensor, m: torch.Tensor, dim=None) -> torch.Tensor:
    total = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return total.sum() / m.sum()
    return total.sum(dim=dim) / m.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is nonzero, over ``dim`` (all if None).

    ``x`` and ``mask`` have one shape. An empty selection gives NaN (no check:
    checking would cost a host sync).
    """
    x, m = _prepare(x, mask)
    return _mean(x, m, dim)


def _var(x: torch.Tensor, m: torch.Tensor, unbiased: bool, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    if check:
        n = int(m.sum())  # host sync: the only way to raise on a too-small selection
        if n == 0:
            raise ValueError("mask selects no element; the masked variance is undefined (the sum of the mask is zero)")
        if unbiased and n < 2:
            raise ValueError("mask selects 1 element; the unbiased masked variance needs at least 2")
    else:
        n = m.sum().to(x.dtype)  # stays on the device
    mean = _mean(x, m)
    # (x − mean) selected before it is squared: the square's gradient, 2(x − mean)·0 on a masked entry,
    # would be NaN for an inf/NaN there (and poison every gradient through the mean)
    var = _mean(torch.where(m, x - mean, torch.zeros((), dtype=x.dtype, device=x.device)) ** 2, m)
    if unbiased:
        # Bessel's correction; unchecked, a selection too small for it gives NaN
        var = var * (n / (n - 1)) if check else torch.where(n > 1, var * n / (n - 1), float("nan"))
    return mean, var


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, check: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all entries where ``mask`` is nonzero (a 0-d tensor).

    Raises ValueError when the mask selects nothing, or a single element with
    ``unbiased=True``. ``check=False`` skips that check and its host sync (for
    statistics inside a training step): such a selection then gives NaN.
    """
    x, m = _prepare(x, mask)
    return _var(x, m, unbiased, check)[1]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x − mean)·rsqrt(var + 1e-8) with mean and unbiased var over the masked entries.

    ``shift_mean=False`` adds the mean back: the scale is normalised, the
    location kept (TRL uses this to whiten rewards).
    """
    x, m = _prepare(x, mask)
    mean, var = _var(x, m, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


__all__ = ["masked_mean", "masked_var", "masked_whiten"]
