"""gae: Triton scan and reference loop vs an independent float64 loop, both semantics.

The oracle below is written element by element in plain Python floats so it
shares no code (and no vectorisation) with ``gae_reference``. Its two branches
follow TRL's PPOTrainer loop (after TRL zeroes values and rewards on padding)
and verl's ``compute_gae_advantage_return`` respectively.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastppo.kernels import gae, gae_reference
from helpers import tol, triton_device_or_skip

# Interpreter-friendly shapes: T spans one partial tile, several tiles and T=1.
BATCHES = (1, 3, 17)
LENGTHS = (1, 2, 7, 33, 300)
COEFFS = ((1.0, 1.0), (0.99, 0.95), (0.0, 0.0))
PROPERTY_SETTINGS = settings(max_examples=15, deadline=None)


def oracle(rewards, values, mask, gamma, lam, skip_masked):
    """float64 GAE, one scalar at a time; returns (advantages, returns) as float64 tensors."""
    r, v, m = rewards.double().tolist(), values.double().tolist(), (mask != 0).tolist()
    B, T = rewards.shape
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        if skip_masked:  # verl: masked steps leave the running value and advantage as they are
            next_v, last_a = 0.0, 0.0
            for t in reversed(range(T)):
                if m[b][t]:
                    last_a = r[b][t] + gamma * next_v - v[b][t] + gamma * lam * last_a
                    next_v = v[b][t]
                adv[b][t] = last_a
                ret[b][t] = last_a + v[b][t]
        else:  # TRL: zero r and V off the mask, run the plain loop, zero the outputs off the mask
            rm = [r[b][t] if m[b][t] else 0.0 for t in range(T)]
            vm = [v[b][t] if m[b][t] else 0.0 for t in range(T)]
            last_a = 0.0
            for t in reversed(range(T)):
                next_v = vm[t + 1] if t < T - 1 else 0.0
                last_a = rm[t] + gamma * next_v - vm[t] + gamma * lam * last_a
                adv[b][t] = last_a if m[b][t] else 0.0
                ret[b][t] = last_a + vm[t] if m[b][t] else 0.0
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def make_inputs(B, T, *, holes=False, dtype=torch.float32, device="cpu", generator=None):
    """Random rewards/values (never zeros) and a right-padding mask with random lengths.

    With B >= 2 the first row is all masked and the last row is full length.
    ``holes`` also knocks random interior positions out (tool-output tokens).
    """
    g = generator
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) + 0.5
    values = torch.randn(B, T, generator=g, dtype=torch.float64) - 0.5
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    if B >= 2:
        lengths[0], lengths[-1] = 0, T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(B, T, generator=g) > 0.35
    return rewards.to(dtype).to(device), values.to(dtype).to(device), mask.to(device)


def path_device(request, path):
    """Device on which a call takes ``path`` ("triton" or "reference"), via the conftest fixtures."""
    if path == "triton":
        return request.getfixturevalue("triton_device")
    request.getfixturevalue("reference_path")
    return torch.device("cpu")


def right_padding(mask):
    """True when every row is a run of True followed by a run of False."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def check_against_oracle(rewards, values, mask, gamma, lam, skip_masked, dtype):
    adv, ret = gae(rewards, values, mask, gamma, lam, skip_masked=skip_masked)
    assert adv.dtype == ret.dtype == torch.float32
    assert adv.shape == ret.shape == rewards.shape and adv.device == rewards.device
    exp_adv, exp_ret = oracle(rewards.cpu(), values.cpu(), mask.cpu(), gamma, lam, skip_masked)
    torch.testing.assert_close(adv.cpu().double(), exp_adv, **tol(dtype))
    torch.testing.assert_close(ret.cpu().double(), exp_ret, **tol(dtype))


# --------------------------------------------------------------------------- vs the oracle


@pytest.mark.parametrize("skip_masked", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("B", BATCHES)
def test_triton_matches_oracle(triton_device, B, T, skip_masked):
    rewards, values, mask = make_inputs(B, T, holes=skip_masked, device=triton_device)
    check_against_oracle(rewards, values, mask, 0.99, 0.95, skip_masked, torch.float32)


@pytest.mark.parametrize("skip_masked", [False, True])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("B", BATCHES)
def test_reference_matches_oracle(reference_path, B, T, skip_masked):
    rewards, values, mask = make_inputs(B, T, holes=skip_masked)
    check_against_oracle(rewards, values, mask, 0.99, 0.95, skip_masked, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gamma,lam", COEFFS)
@pytest.mark.parametrize("skip_masked", [False, True])
@pytest.mark.parametrize("path", ["triton", "reference"])
def test_coefficients_and_dtypes(request, path, skip_masked, gamma, lam, dtype):
    device = path_device(request, path)
    # Holes in both semantics: the default treats them as zero-reward, zero-value steps.
    rewards, values, mask = make_inputs(5, 40, holes=True, dtype=dtype, device=device)
    check_against_oracle(rewards, values, mask, gamma, lam, skip_masked, dtype)


@pytest.mark.parametrize("skip_masked", [False, True])
def test_triton_long_rows(triton_device, skip_masked):
    # Eight 512-wide tiles per row: the carries between tiles are exercised many times.
    rewards, values, mask = make_inputs(2, 4096, holes=skip_masked, device=triton_device)
    check_against_oracle(rewards, values, mask, 0.99, 0.95, skip_masked, torch.float32)


def test_default_equals_trl_loop(triton_device):
    """TRL's own preparation (score one past the last token, values kept there) and loop.

    TRL: sequence_lengths = index of the last real token; padding_mask_p1 =
    idx > sequence_lengths + 1; values zeroed there; rewards = -kl·coef on real
    tokens, 0 on padding, plus the score at sequence_lengths + 1 (clamped to T-1).
    Passing ~padding_mask_p1 as our mask gives TRL's loop output exactly.
    """
    B, T, gamma, lam = 6, 19, 0.97, 0.9
    seq_len = torch.tensor([-1, 0, 5, 16, 17, 18])  # -1: empty response
    idx = torch.arange(T)[None, :]
    padding_mask = idx > seq_len[:, None]
    padding_mask_p1 = idx > (seq_len[:, None] + 1)
    values = torch.randn(B, T, dtype=torch.float64)
    values_trl = values.masked_fill(padding_mask_p1, 0.0)
    rewards = (-0.1 * torch.randn(B, T, dtype=torch.float64)).masked_fill(padding_mask, 0.0)
    actual_end = torch.where(seq_len + 1 < T, seq_len + 1, seq_len)
    rewards[torch.arange(B), actual_end] += torch.randn(B, dtype=torch.float64)

    last, trl_adv = torch.zeros(B, dtype=torch.float64), []
    for t in reversed(range(T)):
        next_v = values_trl[:, t + 1] if t < T - 1 else 0.0
        last = rewards[:, t] + gamma * next_v - values_trl[:, t] + gamma * lam * last
        trl_adv.append(last)
    trl_adv = torch.stack(trl_adv[::-1], dim=1)
    trl_ret = trl_adv + values_trl

    dev = triton_device
    adv, ret = gae(rewards.float().to(dev), values.float().to(dev), (~padding_mask_p1).to(dev), gamma, lam)
    torch.testing.assert_close(adv.cpu().double(), trl_adv, **tol(torch.float32))
    torch.testing.assert_close(ret.cpu().double(), trl_ret, **tol(torch.float32))


# --------------------------------------------------------------------------- properties


def _property_inputs(seed, B, T, holes):
    """Inputs on the Triton path's device (hypothesis cannot take the function-scoped fixture)."""
    g = torch.Generator().manual_seed(seed)
    return make_inputs(B, T, holes=holes, device=triton_device_or_skip(), generator=g)


@PROPERTY_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(1, 24), skip_masked=st.booleans())
def test_property_monte_carlo_return(seed, B, T, skip_masked):
    """γ = λ = 1: on a real token, returns_t = Σ_{s ≥ t, real} r_s (δ telescopes)."""
    rewards, values, mask = _property_inputs(seed, B, T, skip_masked)
    _, ret = gae(rewards, values, mask, 1.0, 1.0, skip_masked=skip_masked)
    masked_r = torch.where(mask, rewards, torch.zeros_like(rewards)).double()
    mc = masked_r.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(ret.double()[mask], mc[mask], atol=1e-4, rtol=1e-5)


@PROPERTY_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(1, 24),
       gamma=st.floats(0.0, 1.0), skip_masked=st.booleans())
def test_property_lambda_zero_is_td_error(seed, B, T, gamma, skip_masked):
    """λ = 0: on a real token A_t = δ_t = r_t + γ·V_next − V_t (V_next: next real value, 0 at the end)."""
    rewards, values, mask = _property_inputs(seed, B, T, skip_masked)
    adv, _ = gae(rewards, values, mask, gamma, 0.0, skip_masked=skip_masked)
    r, v, m = rewards.double().cpu(), values.double().cpu(), mask.cpu()
    next_v = torch.zeros_like(v)
    for b in range(B):
        real = m[b].nonzero().flatten().tolist()
        for i, t in enumerate(real):
            if skip_masked:
                next_v[b, t] = v[b, real[i + 1]] if i + 1 < len(real) else 0.0
            else:  # the default bootstraps from position t+1, zero when it is masked
                next_v[b, t] = v[b, t + 1] if t + 1 < T and m[b, t + 1] else 0.0
    delta = r + gamma * next_v - v
    torch.testing.assert_close(adv.double().cpu()[m], delta[m], atol=1e-5, rtol=1e-5)
    if not skip_masked:
        assert (adv.cpu()[~m] == 0).all()


@PROPERTY_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(1, 24),
       gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0))
def test_property_skip_masked_equals_default_on_right_padding(seed, B, T, gamma, lam):
    """With a right-padding mask the semantics agree, except returns on padding (0 vs V_t)."""
    rewards, values, mask = _property_inputs(seed, B, T, False)
    assert right_padding(mask)
    adv_d, ret_d = gae(rewards, values, mask, gamma, lam)
    adv_s, ret_s = gae(rewards, values, mask, gamma, lam, skip_masked=True)
    torch.testing.assert_close(adv_s, adv_d, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret_s[mask], ret_d[mask], atol=1e-5, rtol=1e-5)
    assert (ret_d[~mask] == 0).all()
    torch.testing.assert_close(ret_s[~mask], values.float()[~mask])


# --------------------------------------------------------------------------- masked positions, layouts


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_garbage_on_padding_does_not_leak(request, path):
    device = path_device(request, path)
    rewards, values, mask = make_inputs(4, 20, device=device)
    clean = gae(rewards, values, mask, 0.99, 0.95)
    dirty = gae(rewards.masked_fill(~mask, math.nan), values.masked_fill(~mask, math.inf), mask, 0.99, 0.95)
    for c, d in zip(clean, dirty):
        torch.testing.assert_close(d, c)
        assert torch.isfinite(d).all()


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.uint8, torch.float32])
@pytest.mark.parametrize("skip_masked", [False, True])
def test_numeric_mask_equals_bool_mask(triton_device, mask_dtype, skip_masked):
    rewards, values, mask = make_inputs(3, 21, holes=True, device=triton_device)
    expected = gae(rewards, values, mask, 0.9, 0.8, skip_masked=skip_masked)
    got = gae(rewards, values, mask.to(mask_dtype), 0.9, 0.8, skip_masked=skip_masked)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


def test_strided_inputs(triton_device):
    rewards, values, mask = make_inputs(3, 40, holes=True, device=triton_device)
    wide = torch.randn(3, 50, dtype=torch.float32, device=triton_device)
    wide[:, 5:45] = rewards
    strided_r = wide[:, 5:45]  # row stride 50
    strided_v = values.t().contiguous().t()  # column-major
    for skip in (False, True):
        got = gae(strided_r, strided_v, mask, 0.99, 0.95, skip_masked=skip)
        expected = gae(rewards, values, mask, 0.99, 0.95, skip_masked=skip)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=0, rtol=0)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty(triton_device, shape):
    x = torch.randn(shape, device=triton_device)
    adv, ret = gae(x, x, torch.ones(shape, dtype=torch.bool, device=triton_device), 0.99, 0.95)
    assert adv.shape == ret.shape == shape and adv.dtype == torch.float32


def test_reference_keeps_float64():
    rewards, values, mask = make_inputs(2, 5, dtype=torch.float64)
    adv, ret = gae_reference(rewards, values, mask, 0.99, 0.95)
    assert adv.dtype == ret.dtype == torch.float64


def test_no_grad():
    rewards, values, mask = make_inputs(2, 5)
    values.requires_grad_(True)
    adv, ret = gae(rewards, values, mask, 0.99, 0.95)
    assert not adv.requires_grad and not ret.requires_grad


# --------------------------------------------------------------------------- bad input


def _good():
    return make_inputs(2, 4)


@pytest.mark.parametrize(
    "mutate,exc,name",
    [
        (lambda r, v, m: (r[0], v, m), ValueError, "rewards"),
        (lambda r, v, m: (r, v[:, :3], m), ValueError, "values"),
        (lambda r, v, m: (r, v, m[:1]), ValueError, "mask"),
        (lambda r, v, m: (r, v, m[None]), ValueError, "mask"),
        (lambda r, v, m: (r.long(), v, m), TypeError, "rewards"),
        (lambda r, v, m: (r, v.int(), m), TypeError, "values"),
        (lambda r, v, m: (r, v, m.to(torch.complex64)), TypeError, "mask"),
        (lambda r, v, m: (r, v, m.tolist()), TypeError, "mask"),
        (lambda r, v, m: (r, v.to("meta"), m), ValueError, "values"),
        (lambda r, v, m: (r, v, m.to("meta")), ValueError, "mask"),
    ],
)
def test_bad_tensors(mutate, exc, name):
    r, v, m = mutate(*_good())
    with pytest.raises(exc, match=name):
        gae(r, v, m, 0.99, 0.95)


@pytest.mark.parametrize(
    "gamma,lam,exc,name",
    [
        (1.5, 0.95, ValueError, "gamma"),
        (-0.1, 0.95, ValueError, "gamma"),
        (math.nan, 0.95, ValueError, "gamma"),
        (0.99, 1.01, ValueError, "lam"),
        (0.99, -1, ValueError, "lam"),
        ("0.99", 0.95, TypeError, "gamma"),
        (0.99, True, TypeError, "lam"),
        (0.99, None, TypeError, "lam"),
    ],
)
@pytest.mark.parametrize("fn", [gae, gae_reference])
def test_bad_coefficients(fn, gamma, lam, exc, name):
    r, v, m = _good()
    with pytest.raises(exc, match=name):
        fn(r, v, m, gamma, lam)


def test_bad_skip_masked():
    r, v, m = _good()
    with pytest.raises(TypeError, match="skip_masked"):
        gae(r, v, m, 0.99, 0.95, skip_masked="yes")
