"""The kernel API's contracts as other trainers rely on them (issue 36), on both paths, against float64 oracles:

* non-finite values: what is masked never reaches an output or a gradient; a ratio that overflows fp32 gives
  the clipped branch's gradient;
* one compute-dtype rule for every LM-head entry point (``_lmhead.COMPUTE_DTYPE_RULE``), under autocast
  too; fp64 stays fp64 (``kl_penalty``, a mixed fp32/fp64 ``fused_full_kl``);
* double backward: supported (``kl_penalty``) or refused with an error, never silently without its term;
* float arguments reach a kernel as a GPU passes them (fp32), under the interpreter too;
* ``clipped_surrogate`` checks its arguments; ``truncate_at_stop`` traces under torch.compile at first use.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fastppo.kernels import (clipped_surrogate, fused_full_kl, fused_ppo_policy_loss, fused_token_logprobs, gae,
                             kl_penalty, masked_var, token_logprobs)
from fastppo.kernels._common import exact_in_fp32, fp32_product
from fastppo.kernels._lmhead import COMPUTE_DTYPE_RULE

from helpers import assert_close, assert_grad_close, recorded_launches, triton_device_or_skip

PATHS = ("reference", "triton")
B, T, H, V = 2, 3, 16, 20


@pytest.fixture(params=PATHS)
def device(request, monkeypatch):
    """The device of a call on the named path: the CPU reference, or the Triton path (interpreter or CUDA)."""
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return torch.device("cpu")
    return triton_device_or_skip()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def head(dtype=torch.float32, device="cpu", seed=0, lead=(B, T)):
    g = _gen(seed)
    hidden = torch.randn(*lead, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 2 / H ** 0.5
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    index = torch.randint(0, V, lead, generator=g)
    return [t.to(device, dtype) for t in (hidden, weight, bias)] + [index.to(device)]


def oracle_token_stats(hidden, weight, bias, index, temperature):
    z = (hidden.double() @ weight.double().t() + bias.double()) / temperature
    log_p = z.log_softmax(-1)
    return log_p.gather(-1, index[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def oracle_ppo_loss(hidden, weight, bias, index, old, adv, mask, eps, coef, temperature):
    """(P1)-(P4) from the definitions in float64, masked tokens selected out before anything is computed."""
    logp, ent = oracle_token_stats(hidden, weight, bias, index, temperature)
    real = mask != 0
    logp, ent, old, adv = logp[real], ent[real], old.double()[real], adv.double()[real]
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    return pg.mean() - coef * ent.mean()


# ---------------------------------------------------------------------------- non-finite values


def _ppo_inputs(device, seed=1):
    hidden, weight, bias, index = head(device=device, seed=seed)
    g = _gen(seed + 1)
    old = (-torch.rand(B, T, generator=g) * 2 - 2).to(device)
    adv = torch.randn(B, T, generator=g).to(device)
    mask = torch.tensor([[True, True, False], [True, False, True]], device=device)
    return hidden, weight, bias, index, old, adv, mask


def _loss_and_grads(fn, hidden, weight, bias, *args):
    leaves = [t.detach().requires_grad_() for t in (hidden, weight, bias)]
    out = fn(leaves[0], leaves[1], *args, bias=leaves[2])
    return out, torch.autograd.grad(out.loss, leaves)


def test_masked_nonfinite_inputs_reach_no_loss_and_no_gradient(device):
    hidden, weight, bias, index, old, adv, mask = _ppo_inputs(device)
    bad_old = torch.where(mask, old, float("nan"))
    bad_adv = torch.where(mask, adv, torch.tensor([[1.0, -1.0, float("inf")], [1.0, -float("inf"), 1.0]],
                                                   device=device))
    args = (0.25, 0.01, 0.5)
    out, grads = _loss_and_grads(fused_ppo_policy_loss, hidden, weight, bias, index, bad_old, bad_adv, mask, *args)
    oracle_leaves = [t.detach().double().cpu().requires_grad_() for t in (hidden, weight, bias)]
    want = oracle_ppo_loss(*oracle_leaves, index.cpu(), old.cpu(), adv.cpu(), mask.cpu(), *args)
    want_grads = torch.autograd.grad(want, oracle_leaves)
    assert torch.isfinite(out.loss)
    assert_close(out.loss, want, torch.float32)
    for g, w in zip(grads, want_grads):
        assert torch.isfinite(g).all()
        assert_grad_close(g, w, torch.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the kernel's ρ = inf
def test_an_overflowing_ratio_takes_the_clipped_branchs_gradient(device):
    hidden, weight, bias, index, old, adv, mask = _ppo_inputs(device, seed=3)
    old = old.clone()
    adv = adv.abs() + 0.1
    old[0, 0] = -200.0  # ρ = e^{logp + 200} overflows fp32; A > 0: the clipped branch (gradient 0) wins
    args = (0.25, 0.01, 0.5)
    out, grads = _loss_and_grads(fused_ppo_policy_loss, hidden, weight, bias, index, old, adv, mask, *args)
    assert out.ratio[0, 0] == float("inf") and out.clipped[0, 0]
    oracle_leaves = [t.detach().double().cpu().requires_grad_() for t in (hidden, weight, bias)]
    want = oracle_ppo_loss(*oracle_leaves, index.cpu(), old.cpu(), adv.cpu(), mask.cpu(), *args)  # fp64: finite
    want_grads = torch.autograd.grad(want, oracle_leaves)
    assert_close(out.loss, want, torch.float32)
    for g, w in zip(grads, want_grads):
        assert torch.isfinite(g).all()
        assert_grad_close(g, w, torch.float32)


def test_clipped_surrogate_overflow_and_masked_tokens():
    g = _gen(4)
    logp = (-torch.rand(7, generator=g) * 3).requires_grad_()
    old = -torch.rand(7, generator=g) * 3
    adv = torch.randn(7, generator=g).abs() + 0.1
    old[2] = -200.0
    loss, ratio, clipped = clipped_surrogate(logp, old, adv, 0.2)
    assert ratio[2] == float("inf") and clipped[2]
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    logp64 = logp.detach().double().requires_grad_()
    r = torch.exp(logp64 - old.double())
    want = torch.maximum(-adv.double() * r, -adv.double() * r.clamp(0.8, 1.2))
    (want_grad,) = torch.autograd.grad(want.sum(), logp64, retain_graph=True)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), want_grad, rtol=2e-5, atol=2e-5)
    # masked tokens: NaN old log-probs and ±inf advantages there change nothing
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 0], dtype=torch.bool)
    bad_old = torch.where(mask, old, float("nan"))
    bad_adv = torch.where(mask, adv, torch.tensor([float("inf"), -float("inf")]).repeat(4)[:7])
    loss_m, _, _ = clipped_surrogate(logp, bad_old, bad_adv, 0.2, mask=mask)
    (grad_m,) = torch.autograd.grad(loss_m.sum(), logp)
    (want_m,) = torch.autograd.grad(torch.where(mask.double().bool(), want, 0.0).sum(), logp64)
    assert torch.isfinite(loss_m).all() and (loss_m[~mask] == 0).all()
    torch.testing.assert_close(grad_m.double(), want_m, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(cliprange=-0.2), ValueError, "cliprange"),
    (dict(cliprange="0.2"), TypeError, "cliprange"),
    (dict(old_logprobs=torch.zeros(5)), ValueError, "old_logprobs has shape"),
    (dict(advantages=torch.zeros(6, dtype=torch.long)), TypeError, "advantages"),
    (dict(logprobs=[0.0] * 6), TypeError, "logprobs"),
    (dict(mask=torch.ones(5, dtype=torch.bool)), ValueError, "mask has shape"),
])
def test_clipped_surrogate_checks_its_arguments(kwargs, error, match):
    args = dict(logprobs=torch.randn(6), old_logprobs=torch.randn(6), advantages=torch.randn(6), cliprange=0.2)
    mask = kwargs.pop("mask", None)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        clipped_surrogate(**args, mask=mask)


def test_masked_var_gradient_ignores_masked_values():
    """A sibling: masked_var's gradient multiplied the masked entries' (x − mean) by 0 (NaN from inf/NaN)."""
    g = _gen(5)
    x = torch.randn(3, 4, generator=g) * 2
    mask = torch.rand(3, 4, generator=g) < 0.6
    mask[0, :2] = True
    bad = torch.where(mask, x, float("nan")).requires_grad_()
    (grad,) = torch.autograd.grad(masked_var(bad, mask), bad)
    x64 = x.double().requires_grad_()
    sel = x64[mask]
    (want,) = torch.autograd.grad(((sel - sel.mean()) ** 2).sum() / (sel.numel() - 1), x64)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter on the NaN rows
def test_ignored_rows_nonfinite_values_reach_no_output_and_no_gradient(device):
    """A sibling in the LM-head options: rows whose index is ignore_index (TRL's −100 on padding) may hold
    inf/NaN hidden states or logits; they reached every gradient (0·NaN in the backward's products)."""
    hidden, weight, bias, index = head(device=device, seed=18, lead=(6,))
    index = index.clone()
    index[[1, 4]] = -100
    keep = index != -100
    bad_hidden = hidden.clone()
    bad_hidden[1], bad_hidden[4, :3] = float("nan"), float("inf")
    g = _gen(19)
    up_logp, up_ent = torch.randn(6, generator=g).to(device), torch.randn(6, generator=g).to(device)

    def grads(h, w, b, logits_form):
        leaves = [t.detach().requires_grad_() for t in (h, w, b)]
        if logits_form:
            logits = leaves[0] @ leaves[1].t() + leaves[2]
            logp, ent = token_logprobs(logits, index, 0.5, return_entropy=True)
        else:
            logp, ent = fused_token_logprobs(leaves[0], leaves[1], index, 0.5, bias=leaves[2], return_entropy=True)
        return (logp, ent), torch.autograd.grad((logp * up_logp + ent * up_ent).sum(), leaves)

    # the oracle: float64, ignored rows dropped before anything is computed
    leaves = [t.detach().double().cpu().requires_grad_() for t in (hidden, weight, bias)]
    want_logp, want_ent = oracle_token_stats(leaves[0][keep.cpu()], leaves[1], leaves[2], index[keep].cpu(), 0.5)
    want_grads = torch.autograd.grad((want_logp * up_logp[keep].cpu() + want_ent * up_ent[keep].cpu()).sum(),
                                     leaves)
    for logits_form in (False, True):
        (logp, ent), got = grads(bad_hidden, weight, bias, logits_form)
        assert (logp[~keep] == 0).all() and (ent[~keep] == 0).all()
        assert_close(logp[keep], want_logp, torch.float32)
        assert_close(ent[keep], want_ent, torch.float32)
        for name, g_, w in zip(("hidden", "weight", "bias"), got, want_grads):
            if logits_form and name != "bias":
                continue  # the caller's own matmul multiplies the NaN rows (token_logprobs sees logits only)
            assert torch.isfinite(g_[keep] if name == "hidden" else g_).all(), (logits_form, name)
            if name == "hidden":
                assert (g_[~keep] == 0).all()
                g_ = g_[keep]
                w = w[keep.cpu()]
            assert_grad_close(g_, w, torch.float32)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter on the NaN row
def test_token_logprobs_ignored_rows_nonfinite_logits(device):
    g = _gen(20)
    logits = (torch.randn(5, V, generator=g) * 2).to(device)
    index = torch.randint(0, V, (5,), generator=g).to(device)
    index[2] = -100
    logits[2, :4] = float("nan")
    logits[2, 7] = float("inf")
    leaf = logits.clone().requires_grad_()
    logp, ent = token_logprobs(leaf, index, 1.0, return_entropy=True)
    (grad,) = torch.autograd.grad((logp + ent).sum(), leaf)
    keep = index != -100
    ref = logits[keep].double().requires_grad_()
    want_logp, want_ent = oracle_token_stats(ref.cpu(), torch.eye(V, dtype=torch.float64), torch.zeros(V).double(),
                                             index[keep].cpu(), 1.0)
    (want,) = torch.autograd.grad((want_logp + want_ent).sum(), ref)
    assert torch.isfinite(grad).all() and (grad[2] == 0).all()
    assert_close(logp[keep], want_logp, torch.float32)
    assert_grad_close(grad[keep], want, torch.float32)


def test_gae_masked_nonfinite_values_reach_no_output(device):
    """GAE's default semantics zero r and V on masked positions first: inf/NaN there change nothing."""
    from fastppo.kernels import gae_reference

    g = _gen(21)
    rewards, values = torch.randn(2, 9, generator=g), torch.randn(2, 9, generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:], mask[1, 3] = False, False
    bad_r = torch.where(mask, rewards, float("nan"))
    bad_v = torch.where(mask, values, float("inf"))
    adv, ret = gae(bad_r.to(device), bad_v.to(device), mask.to(device), 0.9, 0.8)
    want_adv, want_ret = gae_reference(rewards.double(), values.double(), mask, 0.9, 0.8)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    torch.testing.assert_close(adv.cpu().double(), want_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), want_ret, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- the compute-dtype rule


def test_the_rule_is_written_once():
    assert "autocast" in COMPUTE_DTYPE_RULE and "never rounded to 16 bits" in COMPUTE_DTYPE_RULE


def _bf16(*tensors):
    """The operands as the rule multiplies them under bf16 autocast: rounded to bf16, then exact in float64."""
    return [t.bfloat16().double() for t in tensors]


def test_lm_head_entry_points_follow_autocast_on_both_paths(device):
    """fp32 hidden and head under bf16 autocast: operands in bf16, accumulation fp32, logits never 16-bit; the
    reference formed its logits in bf16 (1.5% off in the policy loss, 16% in the full KL)."""
    hidden, weight, bias, index = head(device=device, seed=6)
    ref_hidden, ref_weight, ref_bias, _ = head(device=device, seed=7)
    g = _gen(8)
    old = (-torch.rand(B, T, generator=g) - 2).to(device)
    adv = torch.randn(B, T, generator=g).to(device)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logp = fused_token_logprobs(hidden, weight, index, 0.5, bias=bias)
        kl = fused_full_kl(hidden, weight, ref_hidden, ref_weight, 0.5, bias=bias, ref_bias=ref_bias)
        loss = fused_ppo_policy_loss(hidden, weight, index, old, adv, mask, 0.25, 0.01, 0.5, bias=bias).loss
    h, w, b, rh, rw, rb = (t.cpu() for t in _bf16(hidden, weight, bias, ref_hidden, ref_weight, ref_bias))
    want_logp, _ = oracle_token_stats(h, w, b, index.cpu(), 0.5)
    z, y = (h @ w.t() + b) / 0.5, (rh @ rw.t() + rb) / 0.5
    want_kl = (z.softmax(-1) * (z.log_softmax(-1) - y.log_softmax(-1))).sum(-1)
    want_loss = oracle_ppo_loss(h, w, b, index.cpu(), old.cpu(), adv.cpu(), mask.cpu(), 0.25, 0.01, 0.5)
    for got, want in ((logp, want_logp), (kl, want_kl), (loss, want_loss)):
        assert got.dtype == torch.float32
        assert_close(got, want, torch.float32)


def test_fused_full_kl_fp64_reference_model_makes_the_call_fp64(device, monkeypatch):
    """fp32 policy, fp64 reference: the KL is computed in fp64, both models' logits formed in fp64 (the reference
    path formed the policy's in fp32), and a temperature fp32 cannot hold takes the reference path whatever
    hidden's dtype (dispatch looked at hidden's only)."""
    from fastppo.kernels import kl as kl_module

    hidden, weight, bias, _ = head(device=device, seed=9)
    ref_hidden, ref_weight, ref_bias, _ = head(torch.float64, device=device, seed=10)
    apply = kl_module._FusedFullKL.apply
    for temperature in (0.5, 0.9):
        calls = []
        with monkeypatch.context() as patch:
            patch.setattr(kl_module._FusedFullKL, "apply", lambda *a: calls.append(1) or apply(*a))
            got = fused_full_kl(hidden, weight, ref_hidden, ref_weight, temperature, bias=bias, ref_bias=ref_bias)
        z = (hidden.double() @ weight.double().t() + bias.double()) / temperature
        y = (ref_hidden @ ref_weight.t() + ref_bias) / temperature
        want = (z.softmax(-1) * (z.log_softmax(-1) - y.log_softmax(-1))).sum(-1)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)
        if temperature == 0.9:
            assert not calls, "an fp64 call with T = 0.9 must not reach the kernel (it would take T as fp32)"
        elif device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
            assert calls


# ---------------------------------------------------------------------------- double backward


def test_kl_penalty_double_backward(device):
    g = _gen(11)
    logp = (-torch.rand(2, 5, generator=g, dtype=torch.float64) * 3).to(device).requires_grad_()
    ref = (-torch.rand(2, 5, generator=g, dtype=torch.float64) * 3).to(device).requires_grad_()
    for est in ("k1", "k2", "k3", "abs", "mse"):
        assert torch.autograd.gradgradcheck(lambda a, b: kl_penalty(a, b, est), (logp, ref))
        (grad,) = torch.autograd.grad(kl_penalty(logp, ref, est).sum(), logp, create_graph=True)
        if est in ("k2", "k3", "mse"):  # f'' ≠ 0: the gradient depends on logp (the kernel's dropped it)
            assert grad.requires_grad


def test_lm_head_double_backward_is_refused_on_the_kernel_path():
    device = triton_device_or_skip()
    hidden, weight, bias, index = head(device=device, seed=12)
    hidden.requires_grad_()
    g = _gen(13)
    old, adv = (-torch.rand(B, T, generator=g) - 2).to(device), torch.randn(B, T, generator=g).to(device)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    calls = {
        "token_logprobs": lambda: token_logprobs(hidden @ weight.t(), index, 1.0),
        "fused_token_logprobs": lambda: fused_token_logprobs(hidden, weight, index, 1.0),
        "fused_full_kl": lambda: fused_full_kl(hidden, weight, hidden.detach(), weight * 0.5),
        "fused_ppo_policy_loss": lambda: fused_ppo_policy_loss(hidden, weight, index, old, adv, mask, 0.25).loss,
    }
    for name, call in calls.items():
        out = call()
        with pytest.raises(RuntimeError, match=f"{name}: double backward"):
            torch.autograd.grad(out.sum(), hidden, create_graph=True)
        (grad,) = torch.autograd.grad(call().sum(), hidden)  # a first-order gradient is still fine
        assert torch.isfinite(grad).all()


def test_lm_head_double_backward_works_on_the_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hidden, weight, bias, index = head(torch.float64, seed=14)
    hidden.requires_grad_()
    logp = fused_token_logprobs(hidden, weight, index, 1.0)
    (grad,) = torch.autograd.grad(logp.sum(), hidden, create_graph=True)
    assert grad.requires_grad
    assert torch.autograd.gradgradcheck(lambda h: fused_token_logprobs(h, weight, index, 1.0), (hidden,))


# ---------------------------------------------------------------------------- float arguments as a GPU passes them


def test_float_arguments_reach_kernels_as_fp32():
    device = triton_device_or_skip()
    gae_mod = importlib.import_module("fastppo.kernels.gae")  # the module (fastppo.kernels.gae is the function)
    g = _gen(15)
    rewards, values = torch.randn(2, 9, generator=g).to(device), torch.randn(2, 9, generator=g).to(device)
    mask = torch.ones(2, 9, dtype=torch.bool, device=device)
    with recorded_launches(gae_mod, "_gae_fwd_kernel") as launches:
        gae(rewards, values, mask, 0.99, 0.95)
    (args,) = launches
    floats = [a for a in args if isinstance(a, float)]
    assert floats and all(exact_in_fp32(a) for a in floats)
    assert fp32_product(0.99, 0.95) in floats  # γ·λ formed once, on the host, as a GPU forms it
    assert fp32_product(0.99, 0.95) != 0.99 * 0.95


def test_fp64_softcap_backward_is_exact():
    """cap_in = 1 + 2⁻²⁰ and cap_out = 1 + 2⁻²¹ are exact in fp32, their product is not: a kernel that multiplies
    them as scalars rounds it to fp32 on a GPU (and, since issue 36, under the interpreter) and moves fp64
    gradients by 1e-13; tile × cap_in × cap_out keeps them exact."""
    device = triton_device_or_skip()
    from fastppo.kernels import fused_token_logprobs_reference

    softcap = 1 + 2 ** -21
    logit_scale = softcap * (1 + 2 ** -20)
    hidden, weight, bias, index = head(torch.float64, device=device, seed=16, lead=(6,))
    leaves = [hidden.requires_grad_(), weight.requires_grad_()]
    kw = dict(softcap=softcap, logit_scale=logit_scale, return_entropy=True)
    got = fused_token_logprobs(hidden, weight, index, 1.0, **kw)
    want = fused_token_logprobs_reference(hidden, weight, index, 1.0, **kw)
    for a, b in zip(torch.autograd.grad(sum(x.sum() for x in got), leaves),
                    torch.autograd.grad(sum(x.sum() for x in want), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


def test_gae_gamma_lam_product_matches_the_reference_in_fp32(device):
    """The scan and the loop agree for a γ·λ that fp32 rounds (values of order 1: 1e-6)."""
    from fastppo.kernels import gae_reference

    g = _gen(17)
    rewards, values = torch.randn(2, 40, generator=g).to(device), torch.randn(2, 40, generator=g).to(device)
    mask = torch.ones(2, 40, dtype=torch.bool, device=device)
    adv, ret = gae(rewards, values, mask, 0.99, 0.95)
    want_adv, want_ret = gae_reference(rewards.double(), values.double(), mask, 0.99, 0.95)
    torch.testing.assert_close(adv.double(), want_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), want_ret, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- truncate_at_stop under torch.compile


def test_truncate_at_stop_traces_on_first_use_in_a_fresh_process(tmp_path):
    """Its fake is registered at import: the first call may be inside torch.compile(fullgraph=True)."""
    script = textwrap.dedent("""
        import torch
        from fastppo.kernels import truncate_at_stop, truncate_at_stop_reference
        @torch.compile(fullgraph=True, backend="eager")
        def f(r):
            truncated, lengths, mask, has_stop = truncate_at_stop(r, [2, 3], 0)
            return truncated * mask, lengths + 1
        x = torch.randint(0, 6, (3, 7), generator=torch.Generator().manual_seed(0))
        want = truncate_at_stop_reference(x, [2, 3], 0)
        got = f(x)
        assert torch.equal(got[0], want[0] * want[2]) and torch.equal(got[1], want[1] + 1)
        print("TRACED")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "TRACED" in done.stdout, done.stderr[-3000:]
