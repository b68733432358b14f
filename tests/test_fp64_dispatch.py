"""float64 calls whose float arguments fp32 cannot hold take the reference path, and stay exact.

Compiled Triton passes a Python float to a kernel as fp32: on an H100 a temperature of 0.9 arrived as
0.90000004 and moved fp64 log-probs by 1.9e-7. The rule lives in ``_common.use_triton`` and holds under
the interpreter too, so these tests see the dispatch a GPU sees.
"""
from __future__ import annotations

import pytest
import torch

from fastppo.kernels import (fused_full_kl, fused_full_kl_reference, fused_ppo_policy_loss,
                             fused_ppo_policy_loss_reference, fused_token_logprobs, fused_token_logprobs_reference,
                             token_logprobs, token_logprobs_reference)
from fastppo.kernels import kl as kl_module
from fastppo.kernels import logprobs as logprobs_module
from fastppo.kernels import ppo_loss as ppo_loss_module
from fastppo.kernels._common import exact_in_fp32


def test_exact_in_fp32():
    assert exact_in_fp32(0.5) and exact_in_fp32(1.0) and exact_in_fp32(0.75) and exact_in_fp32(float("inf"))
    assert not exact_in_fp32(0.9) and not exact_in_fp32(0.7) and not exact_in_fp32(1 / 3)
    assert not exact_in_fp32(1.0 - 0.2)  # PPO's default clip bound
    assert not exact_in_fp32(1e40) and not exact_in_fp32(-1e40)  # beyond fp32: never passed to a kernel


def _spy(monkeypatch, function_class):
    calls = []
    apply = function_class.apply

    def counted(*args):
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(function_class, "apply", counted)
    return calls


def _head(device, dtype=torch.float64):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 12, generator=g, dtype=torch.float64).to(device, dtype)
    weight = (torch.randn(29, 12, generator=g, dtype=torch.float64) / 3).to(device, dtype)
    index = torch.randint(0, 29, (6,), generator=g).to(device)
    return hidden, weight, index


def _calls(name, device, dtype, temperature):
    """(kernel function's autograd class, our call, the fp64 reference call) for one public function."""
    hidden, weight, index = _head(device, dtype)
    if name == "token_logprobs":
        logits = hidden @ weight.t()
        return (logprobs_module._TokenLogprobs, lambda: token_logprobs(logits, index, temperature),
                lambda: token_logprobs_reference(logits.double(), index, temperature))
    if name == "fused_token_logprobs":
        return (logprobs_module._FusedTokenLogprobs, lambda: fused_token_logprobs(hidden, weight, index, temperature),
                lambda: fused_token_logprobs_reference(hidden.double(), weight.double(), index, temperature))
    if name == "fused_full_kl":
        ref_hidden, ref_weight = hidden.flip(0), weight.flip(1)
        return (kl_module._FusedFullKL, lambda: fused_full_kl(hidden, weight, ref_hidden, ref_weight, temperature),
                lambda: fused_full_kl_reference(hidden.double(), weight.double(), ref_hidden.double(),
                                                ref_weight.double(), temperature))
    old = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(6)).to(device) - 3
    adv = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).to(device)
    mask = torch.tensor([1, 1, 0, 1, 1, 1], device=device)
    cliprange = 0.25  # 1 ± 0.25 are exact: only the temperature decides
    return (ppo_loss_module._FusedPPOPolicyLoss,
            lambda: fused_ppo_policy_loss(hidden, weight, index, old, adv, mask, cliprange, 0.0, temperature).loss,
            lambda: fused_ppo_policy_loss_reference(hidden.double(), weight.double(), index, old, adv, mask,
                                                    cliprange, 0.0, temperature).loss)


FUNCTIONS = ("token_logprobs", "fused_token_logprobs", "fused_full_kl", "fused_ppo_policy_loss")


@pytest.mark.parametrize("name", FUNCTIONS)
def test_fp64_with_an_inexact_temperature_is_exact(triton_device, monkeypatch, name):
    function_class, ours, reference = _calls(name, triton_device, torch.float64, 0.9)
    calls = _spy(monkeypatch, function_class)
    got, want = ours(), reference()
    assert not calls, "an fp64 call with T=0.9 must not reach the kernel, which would take T as fp32"
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype, temperature", [(torch.float64, 0.5), (torch.float32, 0.9)])
def test_exact_scalars_and_fp32_inputs_still_take_the_kernel(triton_device, monkeypatch, name, dtype, temperature):
    function_class, ours, reference = _calls(name, triton_device, dtype, temperature)
    calls = _spy(monkeypatch, function_class)
    got, want = ours(), reference()
    assert calls, f"{name} at {dtype}, T={temperature} should run the kernel"
    tolerance = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=tolerance, atol=tolerance)


def test_ppo_loss_clip_bounds_decide_too(triton_device, monkeypatch):
    hidden, weight, index = _head(triton_device)
    old = torch.randn(6, dtype=torch.float64, device=triton_device) - 3
    adv = torch.randn(6, dtype=torch.float64, device=triton_device)
    mask = torch.ones(6, device=triton_device)
    calls = _spy(monkeypatch, ppo_loss_module._FusedPPOPolicyLoss)
    got = fused_ppo_policy_loss(hidden, weight, index, old, adv, mask, 0.2, 0.0, 1.0).loss  # 0.8 is not fp32-exact
    want = fused_ppo_policy_loss_reference(hidden, weight, index, old, adv, mask, 0.2, 0.0, 1.0).loss
    assert not calls
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-12, atol=1e-12)
