"""masked_mean / masked_var / masked_whiten vs the same statistic of the selected elements."""
import math

import pytest
import torch

from fastppo.kernels import masked_mean, masked_var, masked_whiten
from helpers import tol

FP32 = tol(torch.float32)  # fp32 results vs float64 statistics of the same elements


def make_inputs(B=5, T=13, dtype=torch.float32):
    x = (torch.randn(B, T, dtype=torch.float64) * 3 + 1.5).to(dtype)
    lengths = torch.randint(2, T + 1, (B,))
    lengths[0] = 0  # an all-masked row
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask &= torch.rand(B, T) > 0.2
    mask[-1, :2] = True  # at least two selected elements overall
    return x, mask


def test_mean_all():
    x, mask = make_inputs()
    torch.testing.assert_close(masked_mean(x, mask).double(), x.double()[mask].mean(), **FP32)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_mean_dim(dim):
    x, mask = make_inputs()
    got = masked_mean(x, mask, dim=dim)
    xs, ms = (x, mask) if dim == 0 else (x.t(), mask.t())
    expected = torch.stack([xs[:, j].double()[ms[:, j]].mean() for j in range(xs.shape[1])])
    torch.testing.assert_close(got.double(), expected, equal_nan=True, **FP32)
    if dim != 0:
        assert torch.isnan(got[0])  # the all-masked row: nothing to average


def test_mean_empty_selection_is_nan():
    x, _ = make_inputs()
    assert torch.isnan(masked_mean(x, torch.zeros_like(x, dtype=torch.bool)))


@pytest.mark.parametrize("unbiased", [True, False])
def test_var_matches_torch_var(unbiased):
    x, mask = make_inputs()
    expected = torch.var(x.double()[mask], correction=1 if unbiased else 0)
    torch.testing.assert_close(masked_var(x, mask, unbiased=unbiased).double(), expected, **FP32)


def test_var_default_is_unbiased():
    x, mask = make_inputs()
    torch.testing.assert_close(masked_var(x, mask), masked_var(x, mask, unbiased=True))


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_explicit(shift_mean):
    x, mask = make_inputs()
    sel = x.double()[mask]
    mean, var = sel.mean(), sel.var()
    expected = (x.double() - mean) / torch.sqrt(var + 1e-8)
    if not shift_mean:
        expected = expected + mean
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=shift_mean).double(), expected, **FP32)


def test_whiten_moments():
    x, mask = make_inputs(8, 40)
    w = masked_whiten(x, mask)[mask].double()
    torch.testing.assert_close(w.mean(), torch.zeros((), dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(w.var(), torch.ones((), dtype=torch.float64), atol=1e-5, rtol=0)


def test_whiten_without_shift_keeps_mean():
    x, mask = make_inputs(8, 40)
    w = masked_whiten(x, mask, shift_mean=False)[mask].double()
    torch.testing.assert_close(w.mean(), x.double()[mask].mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.var(), torch.ones((), dtype=torch.float64), atol=1e-5, rtol=0)


def test_garbage_off_the_mask_does_not_leak():
    x, mask = make_inputs()
    dirty = x.masked_fill(~mask, math.inf)
    dirty[~mask & (torch.rand_like(x) > 0.5)] = math.nan
    torch.testing.assert_close(masked_mean(dirty, mask), masked_mean(x, mask))
    torch.testing.assert_close(masked_var(dirty, mask), masked_var(x, mask))
    torch.testing.assert_close(masked_whiten(dirty, mask)[mask], masked_whiten(x, mask)[mask])


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.uint8, torch.float32])
def test_numeric_mask_equals_bool_mask(mask_dtype):
    x, mask = make_inputs()
    m = mask.to(mask_dtype)
    torch.testing.assert_close(masked_mean(x, m, dim=1), masked_mean(x, mask, dim=1), equal_nan=True)
    torch.testing.assert_close(masked_var(x, m), masked_var(x, mask))
    torch.testing.assert_close(masked_whiten(x, m), masked_whiten(x, mask))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_input_computes_in_fp32(dtype):
    x, mask = make_inputs(dtype=dtype)
    for out in (masked_mean(x, mask), masked_var(x, mask), masked_whiten(x, mask)):
        assert out.dtype == torch.float32
    torch.testing.assert_close(masked_var(x, mask).double(), torch.var(x.double()[mask]), **FP32)


def test_float64_stays_float64():
    x, mask = make_inputs(dtype=torch.float64)
    assert masked_whiten(x, mask).dtype == torch.float64


# --------------------------------------------------------------------------- errors


def test_var_empty_selection_raises():
    x, _ = make_inputs()
    none = torch.zeros_like(x, dtype=torch.bool)
    for unbiased in (True, False):
        with pytest.raises(ValueError, match="mask"):
            masked_var(x, none, unbiased=unbiased)
    with pytest.raises(ValueError, match="mask"):
        masked_whiten(x, none)


@pytest.mark.parametrize("unbiased", [True, False])
def test_unchecked_var_equals_checked_and_is_nan_when_too_small(unbiased):
    x, mask = make_inputs()
    torch.testing.assert_close(masked_var(x, mask, unbiased, check=False), masked_var(x, mask, unbiased))
    one = torch.zeros_like(mask, dtype=torch.bool)
    one[1, 2] = True
    assert math.isnan(masked_var(x, torch.zeros_like(one), unbiased, check=False))
    small = masked_var(x, one, unbiased, check=False)
    assert math.isnan(small) if unbiased else small == 0


def test_unbiased_var_of_one_element_raises():
    x, _ = make_inputs()
    one = torch.zeros_like(x, dtype=torch.bool)
    one[2, 3] = True
    with pytest.raises(ValueError, match="mask"):
        masked_var(x, one)
    with pytest.raises(ValueError, match="mask"):
        masked_whiten(x, one)
    assert masked_var(x, one, unbiased=False) == 0


@pytest.mark.parametrize("fn", [masked_mean, masked_var, masked_whiten])
@pytest.mark.parametrize(
    "mutate,exc,name",
    [
        (lambda x, m: (x.long(), m), TypeError, "x"),
        (lambda x, m: (x.tolist(), m), TypeError, "x"),
        (lambda x, m: (x, m[:, :-1]), ValueError, "mask"),
        (lambda x, m: (x, m.to(torch.complex64)), TypeError, "mask"),
        (lambda x, m: (x, m.to("meta")), ValueError, "mask"),
    ],
)
def test_bad_input(fn, mutate, exc, name):
    x, m = mutate(*make_inputs())
    with pytest.raises(exc, match=name):
        fn(x, m)
