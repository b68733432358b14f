"""fused_ppo_policy_loss: Triton path vs the unfused composition, reference path, bad input.

The oracle is what the fused op replaces: ``fused_token_logprobs`` (with the
entropy) followed by the policy part of the trainer's ``ppo_losses`` written
out in PyTorch. Float64 cases hold the fused op to fp64 tolerances (clip range
and entropy coefficient are values fp32 holds exactly: the kernel takes them
as fp32 scalars). Under the interpreter the op walks 8-token chunks, so the
shapes below cover one and several chunks (and, for 16-bit weights, the fp32
grad_W accumulator).
"""
import math

import pytest
import torch

from fastppo.kernels import PPOPolicyLossOutput, clipped_surrogate, fused_ppo_policy_loss, fused_ppo_policy_loss_reference
from fastppo.kernels import fused_token_logprobs, fused_token_logprobs_reference, masked_mean
from fastppo.kernels import ppo_loss as ppo_mod
from helpers import assert_close, assert_grad_close, lm_head_inputs, recorded_launches

CLIP = 0.25  # 1 ± 0.25 are exact in fp32


def unfused(hidden, weight, index, old, adv, mask, cliprange, entropy_coef, temperature, bias, reduction):
    """fused_token_logprobs + the trainer's policy loss (fastppo/train.py ``ppo_losses``) in PyTorch."""
    logp, ent = fused_token_logprobs(hidden, weight, index, temperature, bias=bias, return_entropy=True)
    pg, ratio, clipped = clipped_surrogate(logp, old, adv, cliprange)
    if reduction == "token_mean":
        loss = masked_mean(pg, mask) - entropy_coef * masked_mean(ent, mask)
    else:
        real = mask != 0
        loss = torch.where(real, pg, 0.0).sum() - entropy_coef * torch.where(real, ent, 0.0).sum()
    return PPOPolicyLossOutput(loss, logp, ratio, clipped, ent)


def make_case(lead, hdim, vocab, dtype, device, *, bias, temperature, masked_fraction=0.3, generator=None):
    """Inputs with ratios away from the clip bounds (so low precision cannot flip a token's branch),
    clipped and unclipped tokens of both advantage signs, and masked tokens."""
    g = generator or torch.Generator().manual_seed(1)
    hidden, weight, b = lm_head_inputs(lead, hdim, vocab, torch.float64, "cpu", bias=bias, generator=g)
    index = torch.randint(0, vocab, lead, generator=g)
    logp64 = fused_token_logprobs_reference(hidden.to(dtype).double(), weight.to(dtype).double(), index,
                                            temperature, bias=None if b is None else b.to(dtype).double())
    bands = torch.tensor([0.55, 0.9, 1.0, 1.1, 1.45])  # below, inside and above [0.75, 1.25]
    ratio = bands[torch.randint(0, 5, lead, generator=g)] * (1 + 0.05 * torch.rand(lead, generator=g))
    adv = torch.randn(lead, dtype=torch.float64, generator=g) + 0.3 * torch.sign(torch.randn(lead, generator=g))
    mask = torch.rand(lead, generator=g) >= masked_fraction
    # The first three tokens: clipped above (A > 0), clipped below (A < 0), inside the range.
    first = min(3, ratio.numel())
    ratio.view(-1)[:first] = torch.tensor([1.45, 0.55, 1.0])[:first]
    adv.view(-1)[:first] = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)[:first] * adv.view(-1)[:first].abs()
    mask.view(-1)[:first] = True
    old = logp64 - torch.log(ratio.double())
    to = dict(device=device)
    return dict(hidden=hidden.to(dtype=dtype, **to), weight=weight.to(dtype=dtype, **to),
                bias=None if b is None else b.to(dtype=dtype, **to), index=index.to(**to),
                old_logprobs=old.to(dtype=torch.float32 if dtype != torch.float64 else dtype, **to),
                advantages=adv.to(**to), mask=mask.to(**to))


def run(fn, case, *, cliprange=CLIP, entropy_coef=0.0, temperature=1.0, reduction="token_mean", as64=False,
        upstream=1.0):
    """(output, gradients to hidden, weight[, bias]) of ``fn`` on ``case``; ``as64``: on float64 copies."""
    params = [case["hidden"], case["weight"]] + ([case["bias"]] if case["bias"] is not None else [])
    params = [(p.double() if as64 else p).detach().requires_grad_() for p in params]
    bias = params[2] if len(params) == 3 else None
    old, adv = case["old_logprobs"], case["advantages"]
    if as64:
        old, adv = old.double(), adv.double()
    out = fn(params[0], params[1], case["index"], old, adv, case["mask"], cliprange, entropy_coef, temperature,
             bias, reduction)
    return out, torch.autograd.grad(out.loss * upstream, params)


def check_against(out, grads, want, want_grads, dtype):
    assert out.loss.shape == () and out.loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.clipped.dtype == torch.bool and out.logprobs.shape == out.clipped.shape == out.entropy.shape
    assert_close(out.loss, want.loss, dtype)
    for field in ("logprobs", "ratio", "entropy"):
        assert_close(getattr(out, field), getattr(want, field), dtype)
    assert torch.equal(out.clipped, want.clipped)
    for g, w in zip(grads, want_grads):
        assert g.abs().max() > 0
        assert_grad_close(g, w, dtype)


CASES = [
    # lead, H, V, dtype, bias, temperature, entropy_coef, reduction
    ((2, 5), 24, 37, torch.float64, True, 1.0, 0.0, "token_mean"),
    ((13,), 16, 50, torch.float64, False, 0.75, 0.0625, "token_mean"),  # two chunks, entropy bonus
    ((1,), 16, 17, torch.float64, True, 1.75, 0.25, "sum"),
    ((3, 4), 20, 45, torch.float32, True, 1.0, 0.0625, "token_mean"),
    ((11,), 16, 33, torch.bfloat16, True, 1.0, 0.0625, "token_mean"),  # bf16 over two chunks: fp32 grad_W
    ((6,), 16, 40, torch.float16, False, 1.0, 0.0, "sum"),
]


@pytest.mark.parametrize("lead, hdim, vocab, dtype, bias, temperature, entropy_coef, reduction", CASES, ids=str)
def test_matches_unfused_composition(triton_device, lead, hdim, vocab, dtype, bias, temperature, entropy_coef,
                                     reduction):
    case = make_case(lead, hdim, vocab, dtype, triton_device, bias=bias, temperature=temperature)
    kw = dict(entropy_coef=entropy_coef, temperature=temperature, reduction=reduction)
    with recorded_launches(ppo_mod, "_ppo_policy_loss_rows_kernel") as launches:
        out, grads = run(fused_ppo_policy_loss, case, **kw)
    assert len(launches) == math.ceil(math.prod(lead) / ppo_mod._ppo_loss_tile(1, vocab, triton_device).chunk_rows)
    want, want_grads = run(unfused, case, as64=True, **kw)  # the composition, in float64
    if math.prod(lead) >= 3:  # real tokens on both branches of (P3)
        real = case["mask"]
        assert want.clipped[real].any() and (~want.clipped[real]).any()
    check_against(out, grads, want, want_grads, dtype)
    assert [g.dtype for g in grads] == [dtype] * len(grads)


def test_entropy_bonus_changes_the_gradient_by_its_own_term(triton_device):
    case = make_case((9,), 16, 30, torch.float64, triton_device, bias=True, temperature=1.0)
    base, g0 = run(fused_ppo_policy_loss, case)
    bonus, g1 = run(fused_ppo_policy_loss, case, entropy_coef=0.5)
    ent = masked_mean(base.entropy, case["mask"])
    assert_close(bonus.loss, base.loss - 0.5 * ent, torch.float64)
    # The difference of the gradients is −c·∇ mean(H): that of the unfused entropy alone.
    h, w, b = (case[k].detach().requires_grad_() for k in ("hidden", "weight", "bias"))
    _, H = fused_token_logprobs(h, w, case["index"], bias=b, return_entropy=True)
    want = torch.autograd.grad(-0.5 * masked_mean(H, case["mask"]), (h, w, b))
    for a, z, d in zip(g1, g0, want):
        assert_grad_close(a - z, d, torch.float64)


def test_backward_only_scales_what_the_forward_formed(triton_device):
    case = make_case((10,), 16, 30, torch.float32, triton_device, bias=True, temperature=1.0)
    h, w, b = (case[k].detach().requires_grad_() for k in ("hidden", "weight", "bias"))
    args = (h, w, case["index"], case["old_logprobs"], case["advantages"], case["mask"], CLIP)
    out = fused_ppo_policy_loss(*args, entropy_coef=0.0625, bias=b)
    with recorded_launches(ppo_mod, "_ppo_policy_loss_rows_kernel") as launches:
        once = torch.autograd.grad(out.loss, (h, w, b), retain_graph=True)
        scaled = torch.autograd.grad(out.loss * 0.37, (h, w, b))
    assert not launches  # no recompute in the backward
    for a, s in zip(once, scaled):
        assert_close(s, a * 0.37, torch.float32)
    with torch.no_grad():  # no gradient is formed, the outputs are the same
        again = fused_ppo_policy_loss(*args, entropy_coef=0.0625, bias=b)
    assert not again.loss.requires_grad
    for x, y in zip(again, out):
        assert torch.equal(x, y.detach())


def test_ties_at_ratio_one_take_the_unclipped_gradient(triton_device):
    # old = the op's own log-probs: every ratio is exactly 1, pg1 == pg2 on every token (torch.max's tie).
    case = make_case((7,), 16, 25, torch.float64, triton_device, bias=False, temperature=1.0)
    with torch.no_grad():
        case["old_logprobs"] = fused_ppo_policy_loss(*(case[k] for k in ("hidden", "weight", "index", "old_logprobs",
                                                                          "advantages", "mask")), CLIP).logprobs
    out, grads = run(fused_ppo_policy_loss, case)
    assert (out.ratio == 1).all() and not out.clipped.any()
    want, want_grads = run(unfused, case, as64=True)
    check_against(out, grads, want, want_grads, torch.float64)


def test_garbage_under_the_mask_does_not_leak(triton_device):
    # NaN advantages and inf old log-probs on masked tokens change nothing (the unfused composition's
    # backward would turn them into NaN gradients: −A·ρ's derivative is NaN·0 there).
    case = make_case((10,), 16, 30, torch.float32, triton_device, bias=True, temperature=1.0)
    clean, clean_grads = run(fused_ppo_policy_loss, case, entropy_coef=0.0625)
    masked = ~case["mask"]
    assert masked.any()
    case["advantages"] = case["advantages"].masked_fill(masked, float("nan"))
    case["old_logprobs"] = case["old_logprobs"].masked_fill(masked, float("inf"))
    dirty, dirty_grads = run(fused_ppo_policy_loss, case, entropy_coef=0.0625)
    assert torch.equal(dirty.loss, clean.loss)
    for a, b in zip(dirty_grads, clean_grads):
        assert torch.equal(a, b)


def test_sum_reduction_and_empty_mask(triton_device):
    case = make_case((9,), 16, 30, torch.float32, triton_device, bias=False, temperature=1.0)
    mean, g_mean = run(fused_ppo_policy_loss, case, entropy_coef=0.0625)
    total, g_sum = run(fused_ppo_policy_loss, case, entropy_coef=0.0625, reduction="sum")
    n = case["mask"].sum()
    assert_close(total.loss, mean.loss * n, torch.float32)
    for a, b in zip(g_sum, g_mean):
        assert_grad_close(a, b * n, torch.float32)
    case["mask"] = torch.zeros_like(case["mask"])  # as masked_mean: NaN mean, no gradient
    empty, grads = run(fused_ppo_policy_loss, case)
    assert empty.loss.isnan() and all((g == 0).all() for g in grads)
    assert run(fused_ppo_policy_loss, case, reduction="sum")[0].loss == 0


def test_frozen_weight_tied_view_and_numeric_mask(triton_device):
    emb = torch.randn(16, 40, device=triton_device)
    case = make_case((6,), 16, 40, torch.float32, triton_device, bias=False, temperature=1.0)
    case["weight"] = emb.T  # tied embedding, read through its strides
    h = case["hidden"].detach().requires_grad_()
    args = (case["index"], case["old_logprobs"], case["advantages"])
    out = fused_ppo_policy_loss(h, emb.T, *args, case["mask"].float(), CLIP)  # 0/1 float mask
    (g,) = torch.autograd.grad(out.loss, h)
    h64 = h.detach().double().requires_grad_()
    want = unfused(h64, emb.T.double(), *[a.double() if a.is_floating_point() else a for a in args],
                   case["mask"], CLIP, 0.0, 1.0, None, "token_mean")
    assert_close(out.loss, want.loss, torch.float32)
    assert_grad_close(g, torch.autograd.grad(want.loss, h64)[0], torch.float32)


def test_gradcheck_triton_fp64(triton_device):
    case = make_case((5,), 16, 20, torch.float64, triton_device, bias=True, temperature=0.5)
    rest = (case["index"], case["old_logprobs"], case["advantages"], case["mask"], CLIP)
    fn = lambda h, w, b: fused_ppo_policy_loss(h, w, *rest, 0.25, 0.5, b).loss  # noqa: E731
    params = tuple(case[k].requires_grad_() for k in ("hidden", "weight", "bias"))
    torch.autograd.gradcheck(fn, params, fast_mode=True)


# --------------------------------------------------------------------------- reference path


def test_reference_path_matches_the_composition(reference_path, monkeypatch):
    monkeypatch.setattr(ppo_mod._FusedPPOPolicyLoss, "apply", None)  # the Triton path must not run
    case = make_case((2, 6), 12, 30, torch.float64, "cpu", bias=True, temperature=1.3)
    out, grads = run(fused_ppo_policy_loss, case, entropy_coef=0.1, temperature=1.3)
    want, want_grads = run(unfused, case, entropy_coef=0.1, temperature=1.3)  # reference logprobs on the CPU
    check_against(out, grads, want, want_grads, torch.float64)
    fn = lambda h, w, b: fused_ppo_policy_loss_reference(  # noqa: E731
        h, w, case["index"], case["old_logprobs"], case["advantages"], case["mask"], 0.2, 0.1, 1.3, b).loss
    torch.autograd.gradcheck(fn, tuple(case[k].requires_grad_() for k in ("hidden", "weight", "bias")))


def test_reference_path_computes_16_bit_inputs_in_fp32(reference_path):
    case = make_case((8,), 16, 30, torch.bfloat16, "cpu", bias=False, temperature=1.0)
    out, grads = run(fused_ppo_policy_loss, case)
    assert out.loss.dtype == out.logprobs.dtype == torch.float32 and grads[0].dtype == torch.bfloat16
    want, want_grads = run(unfused, case, as64=True)
    check_against(out, grads, want, want_grads, torch.bfloat16)


# --------------------------------------------------------------------------- bad input

_BAD = [
    (dict(hidden=lambda x: x.long()), TypeError, "hidden"),
    (dict(weight=lambda x: x[:, :3]), ValueError, "hidden"),
    (dict(weight=lambda x: x.double()), TypeError, "weight"),
    (dict(bias=lambda x: x[:4]), ValueError, "bias"),
    (dict(index=lambda x: x.float()), TypeError, "index"),
    (dict(index=lambda x: x[:2]), ValueError, "index"),
    (dict(index=lambda x: x + 100), ValueError, "index"),
    (dict(old_logprobs=lambda x: x.long()), TypeError, "old_logprobs"),
    (dict(old_logprobs=lambda x: x[:2]), ValueError, "old_logprobs"),
    (dict(advantages=lambda x: x[None]), ValueError, "advantages"),
    (dict(advantages=lambda x: x.to("meta")), ValueError, "advantages"),
    (dict(mask=lambda x: x.to(torch.complex64)), TypeError, "mask"),
    (dict(mask=lambda x: x[:1]), ValueError, "mask"),
    (dict(cliprange=lambda x: -0.1), ValueError, "cliprange"),
    (dict(cliprange=lambda x: float("nan")), ValueError, "cliprange"),
    (dict(cliprange=lambda x: "0.2"), TypeError, "cliprange"),
    (dict(entropy_coef=lambda x: float("inf")), ValueError, "entropy_coef"),
    (dict(temperature=lambda x: 0.0), ValueError, "temperature"),
    (dict(reduction=lambda x: "mean"), ValueError, "reduction"),
]


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("case", range(len(_BAD)), ids=[f"{next(iter(c))}-{e.__name__}" for c, e, _ in _BAD])
def test_bad_input(monkeypatch, path, case):
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    change, err, name = _BAD[case]
    args = dict(hidden=torch.randn(3, 4), weight=torch.randn(10, 4), index=torch.randint(0, 10, (3,)),
                old_logprobs=-torch.rand(3), advantages=torch.randn(3), mask=torch.ones(3, dtype=torch.bool),
                cliprange=0.2, entropy_coef=0.0, temperature=1.0, bias=torch.randn(10), reduction="token_mean")
    args = {k: change.get(k, lambda v: v)(v) for k, v in args.items()}
    for fn in (fused_ppo_policy_loss, fused_ppo_policy_loss_reference):
        with pytest.raises(err, match=name):
            fn(**args)
