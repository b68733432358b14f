"""fused_ppo_policy_loss's TRL GRPO options against a float64 oracle written from their definitions.

The options: ``cliprange_high`` (ε_h, clip-higher), ``delta`` (δ, a bound on the unclipped ratio),
``importance_sampling_level="sequence"`` (GSPO: one ratio per sequence, the exp of its trained tokens' mean
log-ratio), ``token_weights`` and ``normalizer`` (how TRL GRPO's loss_types aggregate). The oracle below does
not call ``clipped_surrogate``: it walks the sequences one by one and writes each token's loss as TRL GRPO's
``_compute_loss`` does (−min(ρ·A, clip(ρ)·A), δ clamping only ρ·A), from float64 logits; its gradients are
autograd's. Cases: fresh random inputs, ragged masks, a sequence with no trained token, a zero-length
sequence in a packed batch, masked tokens holding inf/NaN, clips active on both sides; the Triton path (the
interpreter on a CPU, CUDA on a GPU) and the PyTorch path against the oracle. The trainer's use of these
options is tested against TRL 1.16's own GRPOTrainer in ``test_trl1_loss_match.py``.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastppo.kernels import clip_sides, fused_ppo_policy_loss, fused_ppo_policy_loss_reference
from helpers import lm_head_inputs, triton_device_or_skip

V, H = 29, 12


def oracle(hidden, weight, bias, index, old, adv, mask, eps, eps_high, delta, level, lengths, weights, normalizer,
           entropy_coef, temperature, reduction, entropy_weights=None, surrogate="clip", sapo=(1.0, 1.05),
           vespo=(2.0, 3.0, 3.0, 2.0), off_policy=None):
    """(loss, ratio per token) in float64, sequence by sequence, as TRL GRPO writes the loss (its loss_types
    cispo, sapo and vespo: ``surrogate``, ``eps_high`` being cispo's ε_max; its off-policy sequence mask)."""
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t() + (0 if bias is None else bias)) / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(1, index.reshape(-1, 1)).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    old, adv, real = old.reshape(-1), adv.reshape(-1), mask.reshape(-1) != 0
    u = real.double() if weights is None else weights.reshape(-1) * real
    pg_terms, ratios, start = [], [], 0
    for n in lengths:
        rows = slice(start, start + n)
        start += n
        if n == 0:
            continue
        m = real[rows]
        if level == "sequence":
            log_ratio = torch.where(m, logp[rows] - torch.where(m, old[rows], 0.0), 0.0).sum() / max(int(m.sum()), 1)
            coef = torch.exp(log_ratio).expand(n)
        else:
            coef = torch.exp(logp[rows] - torch.where(m, old[rows], logp[rows].detach()))
        a = torch.where(m, adv[rows], 0.0)
        token_log_ratio = torch.where(m, logp[rows] - torch.where(m, old[rows], 0.0), 0.0).detach()
        if surrogate == "vespo":  # TRL's get_gamma_weights for this one sequence
            log_w = min(max(token_log_ratio.clamp(-20, 20).sum().item(), math.log(1e-8)), 20.0)
            k = torch.where(a >= 0, vespo[0], vespo[2]).double()
            lam = torch.where(a >= 0, vespo[1], vespo[3]).double()
            phi = torch.exp(lam + k * log_w - lam * math.exp(log_w))
            token_loss = -phi * a * logp[rows]
        elif surrogate == "cispo":
            token_loss = -torch.clamp(coef, max=eps_high).detach() * a * logp[rows]
        elif surrogate == "sapo":
            tau = torch.where(a > 0, a.new_tensor(sapo[0]), a.new_tensor(sapo[1]))
            token_loss = -torch.sigmoid(tau * (coef - 1)) * 4 / tau * a
        else:
            clipped = torch.clamp(coef, 1 - eps, 1 + eps_high) * a
            unclipped = (coef if delta is None else torch.clamp(coef, max=delta)) * a
            token_loss = -torch.minimum(unclipped, clipped)
        if off_policy is not None:  # TRL's get_off_policy_mask for this one sequence
            mean_kl = -token_log_ratio.sum() / max(int(m.sum()), 1)
            token_loss = torch.where((a >= 0) | (mean_kl <= off_policy), token_loss, 0.0)
        pg_terms.append(torch.where(m, token_loss, 0.0) * u[rows])
        ratios.append(coef.detach())
    pg = torch.cat(pg_terms).sum()
    ent = torch.where(real, entropy, 0.0).sum()
    count = real.sum().double()
    plain = (weights is None and normalizer is None and level == "token" and entropy_weights is None
             and surrogate != "vespo" and off_policy is None)  # else the kernel's sequence path: Σ m at least 1
    if entropy_weights is not None:  # each token's own weight in the entropy term
        d = normalizer if normalizer is not None else count.clamp(min=1) if reduction == "token_mean" else 1.0
        loss = pg / d - entropy_coef * torch.where(real, entropy_weights.reshape(-1) * entropy, 0.0).sum()
    elif reduction == "token_mean":
        d = (count if plain else count.clamp(min=1)) if normalizer is None else normalizer
        loss = pg / d - entropy_coef * ent / (count if plain else count.clamp(min=1))
    else:
        loss = pg / (1.0 if normalizer is None else normalizer) - entropy_coef * ent
    return loss, torch.cat(ratios)


def make(lengths, *, seed, dtype=torch.float64, bias=True, noise=0.6):
    """Packed tokens of sequences of ``lengths``; old log-probs the current ones + N(0, noise²) (ratios from about
    0.3 to 3: every clip acts), advantages of both signs, a ragged mask with masked tokens holding inf/NaN and
    the second sequence fully masked."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    hidden, weight, b = lm_head_inputs((n,), H, V, torch.float64, "cpu", bias=bias, generator=g)
    index = torch.randint(0, V, (n,), generator=g)
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.t() + (0 if b is None else b), -1).gather(1, index[:, None])[:, 0]
    old = logp + noise * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.25
    if len(lengths) > 1:
        mask[lengths[0]:lengths[0] + lengths[1]] = False  # a sequence with no trained token
    old[~mask] = float("nan")
    adv[~mask] = float("inf")
    cast = dict(dtype=dtype)
    return dict(hidden=hidden.to(**cast), weight=weight.to(**cast), bias=None if b is None else b.to(**cast),
                index=index, old_logprobs=old.to(**cast), advantages=adv.to(**cast), mask=mask)


OPTIONS = {
    "clip_higher": dict(cliprange_high=0.375),
    "delta": dict(cliprange_high=0.25, delta=1.5),
    "sequence": dict(importance_sampling_level="sequence"),
    "sequence_delta_clip_higher": dict(importance_sampling_level="sequence", cliprange_high=0.5, delta=1.75),
    "weights": dict(token_weights="grpo"),
    "normalizer": dict(normalizer=7.0),
    "sequence_weights_normalizer": dict(importance_sampling_level="sequence", token_weights="grpo", normalizer=3.0),
    "sum": dict(reduction="sum", cliprange_high=0.375),
    "entropy_weights": dict(entropy_weights="random", normalizer=5.0),
    "sequence_entropy_weights": dict(importance_sampling_level="sequence", entropy_weights="random"),
    "cispo": dict(surrogate="cispo", cliprange_high=1.25),
    # TRL's cispo with epsilon_high unset (ε's 0.25): every token capped, on-policy a scaled REINFORCE
    "cispo_capped_below_one": dict(surrogate="cispo", cliprange_high=0.25),
    "cispo_sequence_weights": dict(surrogate="cispo", cliprange_high=1.125, importance_sampling_level="sequence",
                                   token_weights="grpo", normalizer=3.0),
    "sapo": dict(surrogate="sapo"),
    "sapo_temperatures_sum": dict(surrogate="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0,
                                  reduction="sum"),
    "sapo_sequence": dict(surrogate="sapo", sapo_temperature_pos=1.25, sapo_temperature_neg=0.75,
                          importance_sampling_level="sequence", token_weights="grpo"),
    "vespo": dict(surrogate="vespo"),
    "vespo_sequence_gamma_weights": dict(surrogate="vespo", importance_sampling_level="sequence",
                                         vespo_gamma=(1.0, 2.0, 2.0, 1.0), token_weights="grpo", normalizer=3.0),
    "off_policy": dict(off_policy_mask_threshold=0.0625),
    "off_policy_sequence_sapo": dict(off_policy_mask_threshold=0.0, surrogate="sapo", sapo_temperature_pos=1.25,
                                     sapo_temperature_neg=0.75, importance_sampling_level="sequence"),
}
LENGTHS = [5, 3, 0, 9, 1, 6]  # a zero-length sequence, a one-token one, and sequences over an 8-token chunk


def grpo_weights(case, lengths):
    """TRL GRPO's loss_type "grpo" as token weights: 1 / the trained tokens of the token's sequence."""
    real = case["mask"].double()
    counts = torch.cat([real[s:s + n].sum().clamp(min=1).expand(n) for s, n in
                        zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths)])
    return (real / counts).to(case["hidden"].dtype)


def entropy_weights(case):
    """Fresh positive per-token weights of the entropy term (what token-budget micro-batches hand the kernel)."""
    g = torch.Generator().manual_seed(11)
    return (torch.rand(case["mask"].shape, generator=g, dtype=torch.float64) + 0.5).to(case["hidden"].device,
                                                                                       case["hidden"].dtype)


def run(fn, case, lengths, options, entropy_coef=0.125, temperature=0.75):
    leaves = {k: case[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight", "bias")}
    kw = dict(options)
    if kw.get("token_weights") == "grpo":
        kw["token_weights"] = grpo_weights(case, lengths)
    if kw.get("entropy_weights") == "random":
        kw["entropy_weights"] = entropy_weights(case)
    if (kw.get("importance_sampling_level") == "sequence" or kw.get("surrogate") == "vespo"
            or kw.get("off_policy_mask_threshold") is not None):  # the options that read whole sequences
        kw["sequence_lengths"] = lengths
    out = fn(leaves["hidden"], leaves["weight"], case["index"], case["old_logprobs"], case["advantages"],
             case["mask"], 0.25, entropy_coef, temperature, bias=leaves["bias"], **kw)
    grads = torch.autograd.grad(out.loss, list(leaves.values()))
    return out, grads


def run_oracle(case, lengths, options, entropy_coef=0.125, temperature=0.75):
    leaves = {k: case[k].detach().double().clone().requires_grad_(True) for k in ("hidden", "weight", "bias")}
    weights = grpo_weights(case, lengths).double() if options.get("token_weights") == "grpo" else None
    ent_weights = entropy_weights(case).double() if options.get("entropy_weights") == "random" else None
    level = options.get("importance_sampling_level", "token")
    loss, ratio = oracle(leaves["hidden"], leaves["weight"], leaves["bias"], case["index"],
                         case["old_logprobs"].double(), case["advantages"].double(), case["mask"], 0.25,
                         options.get("cliprange_high", 0.25), options.get("delta"), level, lengths, weights,
                         options.get("normalizer"), entropy_coef, temperature, options.get("reduction", "token_mean"),
                         ent_weights, options.get("surrogate", "clip"),
                         (options.get("sapo_temperature_pos", 1.0), options.get("sapo_temperature_neg", 1.05)),
                         options.get("vespo_gamma", (2.0, 3.0, 3.0, 2.0)), options.get("off_policy_mask_threshold"))
    return loss, ratio, torch.autograd.grad(loss, list(leaves.values()))


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("path", ["pytorch", "triton"])
def test_each_option_against_the_float64_oracle(name, path):
    options = OPTIONS[name]
    case = make(LENGTHS, seed=3)
    if path == "triton":
        device = triton_device_or_skip()
        case = {k: None if v is None else v.to(device) for k, v in case.items()}
        fn = fused_ppo_policy_loss
    else:
        fn = fused_ppo_policy_loss_reference
    out, grads = run(fn, case, LENGTHS, options)
    loss, ratio, expected = run_oracle({k: None if v is None else v.cpu() for k, v in case.items()}, LENGTHS, options)
    assert math.isfinite(out.loss.item())
    torch.testing.assert_close(out.loss.cpu(), loss.detach(), rtol=1e-10, atol=1e-12)
    real = case["mask"].cpu()
    torch.testing.assert_close(out.ratio.cpu()[real], ratio[real], rtol=1e-10, atol=0)
    for got, want in zip(grads, expected):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu(), want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("options", [dict(surrogate="cispo", cliprange_high=1.2), dict(surrogate="sapo"),
                                     dict(surrogate="sapo", importance_sampling_level="sequence")])
def test_surrogates_through_the_kernel_at_fp32(options):
    """fp32 inputs take the Triton kernel whatever the scalars (fp64 ones take it only when fp32 holds them
    exactly, which sapo's default τ₋ = 1.05 is not), held to the float64 oracle at fp32's tolerance, masked
    tokens' inf/NaN included."""
    device = triton_device_or_skip()
    case = {k: None if v is None else v.to(device) for k, v in make(LENGTHS, seed=5).items()}
    case32 = {k: v.float() if v is not None and v.is_floating_point() else v for k, v in case.items()}
    out, grads = run(fused_ppo_policy_loss, case32, LENGTHS, options)
    loss, ratio, expected = run_oracle({k: None if v is None else v.cpu() for k, v in case32.items()}, LENGTHS,
                                       options)
    torch.testing.assert_close(out.loss.double().cpu(), loss.detach(), rtol=2e-5, atol=2e-6)
    real = case["mask"].cpu()
    torch.testing.assert_close(out.ratio.double().cpu()[real], ratio[real], rtol=2e-5, atol=0)
    for got, want in zip(grads, expected):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-5, atol=2e-6 * max(1.0, want.abs().max().item()))


def test_the_options_bite_on_these_inputs():
    """Each option moves the loss or gradient away from the plain symmetric token-level loss on the test inputs,
    and both clip sides act: a wrong option (ignored, or applied to the other branch) cannot pass above."""
    case = make(LENGTHS, seed=3)
    base, base_grads = run(fused_ppo_policy_loss_reference, case, LENGTHS, {})
    low, high = clip_sides(base.ratio, case["advantages"], 0.25)
    real = case["mask"]
    assert (low & real).any() and (high & real).any()
    for name, options in OPTIONS.items():
        out, grads = run(fused_ppo_policy_loss_reference, case, LENGTHS, options)
        moved = max((a - b).abs().max().item() for a, b in zip(grads, base_grads))
        assert abs(out.loss.item() - base.loss.item()) > 1e-6 or moved > 1e-6, name


def test_sequence_level_ratio_is_one_per_sequence_and_one_for_an_untrained_one():
    case = make(LENGTHS, seed=5)
    out, _ = run(fused_ppo_policy_loss_reference, case, LENGTHS, OPTIONS["sequence"])
    start = 0
    for n in LENGTHS:
        ratio = out.ratio[start:start + n]
        assert (ratio == ratio[:1]).all()
        if n and not case["mask"][start:start + n].any():
            assert (ratio == 1).all()  # exp(0): no trained token, no evidence of a policy change
        start += n


def test_sequence_level_defaults_to_the_rows_of_index():
    """[B, T] inputs without sequence_lengths: each row is a sequence (TRL's layout)."""
    case = make([7] * 3, seed=9)
    grid = {k: None if v is None or k in ("weight", "bias") else v.reshape(3, 7, *v.shape[1:])
            for k, v in case.items()}
    grid["weight"], grid["bias"] = case["weight"], case["bias"]
    flat, g_flat = run(fused_ppo_policy_loss_reference, case, [7] * 3, OPTIONS["sequence"])
    rows = fused_ppo_policy_loss_reference(grid["hidden"], grid["weight"], grid["index"], grid["old_logprobs"],
                                           grid["advantages"], grid["mask"], 0.25, 0.125, 0.75, bias=grid["bias"],
                                           importance_sampling_level="sequence")
    torch.testing.assert_close(rows.loss, flat.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(rows.ratio.reshape(-1), flat.ratio, rtol=1e-12, atol=0)


def test_an_empty_mask_with_weights_gives_zero_not_nan():
    """A micro-batch whose completions were all masked (mask_truncated_completions) adds nothing, and voids
    nothing: with a normaliser the loss and its gradients are 0 (the plain token mean stays NaN, as masked_mean)."""
    case = make([4, 4], seed=2)
    case["mask"] = torch.zeros_like(case["mask"])
    for fn in (fused_ppo_policy_loss_reference, fused_ppo_policy_loss):
        out, grads = run(fn, case, [4, 4], dict(normalizer=3.0), entropy_coef=0.5)
        assert out.loss.item() == 0 and all((g == 0).all() for g in grads)
        out, _ = run(fn, case, [4, 4], dict(importance_sampling_level="sequence"), entropy_coef=0.5)
        assert out.loss.item() == 0


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5).filter(lambda xs: sum(xs) > 0),
       seed=st.integers(0, 2**16), option=st.sampled_from(sorted(OPTIONS)), entropy_coef=st.sampled_from([0.0, 0.25]))
def test_property_reference_equals_oracle(lengths, seed, option, entropy_coef):
    case = make(lengths, seed=seed)
    out, grads = run(fused_ppo_policy_loss_reference, case, lengths, OPTIONS[option], entropy_coef=entropy_coef)
    loss, _, expected = run_oracle(case, lengths, OPTIONS[option], entropy_coef=entropy_coef)
    plain = not {"token_weights", "normalizer", "importance_sampling_level", "entropy_weights", "reduction",
                 "off_policy_mask_threshold"} & set(OPTIONS[option]) and OPTIONS[option].get("surrogate") != "vespo"
    if not case["mask"].any() and plain:  # plain token mean of nothing: NaN, as masked_mean
        assert math.isnan(out.loss.item()) and math.isnan(loss.item())
        return
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kwargs, message", [
    (dict(cliprange_high=0.1), "cliprange_high"),
    (dict(delta=1.0), "delta"),
    (dict(delta=float("nan")), "delta"),
    (dict(importance_sampling_level="row"), "importance_sampling_level"),
    (dict(importance_sampling_level="sequence", sequence_lengths=[3, 3]), "sequence_lengths"),
    (dict(importance_sampling_level="sequence", sequence_lengths=[8, -1, 1]), "sequence_lengths"),
    (dict(sequence_lengths=[8]), "sequence_lengths"),
    (dict(token_weights=torch.ones(3, dtype=torch.float64)), "token_weights"),
    (dict(token_weights=torch.ones(8, dtype=torch.long)), "token_weights"),
    (dict(normalizer=0.0), "normalizer"),
    (dict(normalizer=torch.ones(2, dtype=torch.float64)), "normalizer"),
    (dict(entropy_weights=torch.ones(5, dtype=torch.float64)), "entropy_weights"),
    (dict(surrogate="ppo"), "surrogate"),
    (dict(surrogate="cispo", cliprange_high=0.0), "cliprange_high"),  # a cap at 0 takes every gradient away
    (dict(surrogate="cispo", cliprange_high=float("nan")), "cliprange_high"),
    (dict(surrogate="sapo", delta=2.0), "delta"),
    (dict(surrogate="cispo", cliprange_high=5.0, delta=2.0), "delta"),
    (dict(surrogate="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg"),
    (dict(surrogate="sapo", sapo_temperature_pos=float("inf")), "sapo_temperature_pos"),
])
def test_bad_options_are_refused_by_name(kwargs, message):
    case = make([4, 4], seed=1)
    for fn in (fused_ppo_policy_loss, fused_ppo_policy_loss_reference):
        with pytest.raises((ValueError, TypeError), match=message):
            fn(case["hidden"], case["weight"], case["index"], case["old_logprobs"], case["advantages"], case["mask"],
               0.25, **kwargs)


def test_the_cpu_path_never_forms_the_logits(monkeypatch):
    """Without Triton (a CPU), fused_ppo_policy_loss runs the chunked LM-head core, not the reference's [N, V]
    logits, and still equals the oracle."""
    from fastppo.kernels import ppo_loss

    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU path formed the [N, V] logits")

    monkeypatch.setattr(ppo_loss, "lm_head_logits_reference", refuse)
    case = make(LENGTHS, seed=8)
    for name in ("clip_higher", "sequence_weights_normalizer"):
        out, grads = run(fused_ppo_policy_loss, case, LENGTHS, OPTIONS[name])
        loss, _, expected = run_oracle(case, LENGTHS, OPTIONS[name])
        torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-10, atol=1e-12)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_weights_in_any_layout():
    """Token and entropy weights given as strided or expanded views (a per-sequence weight broadcast over its
    tokens) give the contiguous copies' result on both paths."""
    case = make([6, 6, 6], seed=12)
    per_row = torch.tensor([0.5, 2.0, 1.25], dtype=torch.float64)
    expanded = per_row[:, None].expand(3, 6)  # stride 0 along the tokens
    strided = torch.rand(18, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))[:, 1]
    grid = {k: None if v is None or k in ("weight", "bias") else v.reshape(3, 6, *v.shape[1:])
            for k, v in case.items()}
    grid["weight"], grid["bias"] = case["weight"], case["bias"]
    for fn in (fused_ppo_policy_loss, fused_ppo_policy_loss_reference):
        for weights in (expanded, strided.view(3, 6)):
            args = (grid["hidden"], grid["weight"], grid["index"], grid["old_logprobs"], grid["advantages"],
                    grid["mask"], 0.25, 0.125, 0.75)
            got = fn(*args, bias=grid["bias"], token_weights=weights, entropy_weights=weights, normalizer=4.0)
            want = fn(*args, bias=grid["bias"], token_weights=weights.contiguous(),
                      entropy_weights=weights.contiguous(), normalizer=4.0)
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=0)


SURROGATE_OPTIONS = [dict(surrogate="cispo", cliprange_high=1.2), dict(surrogate="sapo"), dict(surrogate="vespo"),
                     dict(off_policy_mask_threshold=0.05, cliprange_high=0.375)]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the kernel's ρ = inf
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("options", SURROGATE_OPTIONS, ids=lambda o: o.get("surrogate", "off_policy"))
def test_new_surrogates_with_an_overflowing_ratio_in_both_paths(options, autocast):
    """A real token whose ratio overflows fp32 (old log-prob −200), beside masked tokens holding inf/NaN: the
    loss and every gradient stay finite, and the Triton path (the interpreter here) agrees with the PyTorch one,
    in fp32 and under bf16 autocast."""
    device = triton_device_or_skip()
    case = {k: None if v is None else v.to(device) for k, v in make(LENGTHS, seed=7).items()}
    case = {k: v.float() if v is not None and v.is_floating_point() else v for k, v in case.items()}
    first_real = int(case["mask"].nonzero()[0])
    case["old_logprobs"][first_real] = -200.0
    ctx = torch.autocast(device.type if hasattr(device, "type") else str(device), dtype=torch.bfloat16) \
        if autocast else contextlib.nullcontext()
    with ctx:
        out, grads = run(fused_ppo_policy_loss, case, LENGTHS, options)
        ref, ref_grads = run(fused_ppo_policy_loss_reference, case, LENGTHS, options)
    assert out.ratio[first_real] == float("inf") and ref.ratio[first_real] == float("inf")  # it did overflow
    assert torch.isfinite(out.loss) and torch.isfinite(ref.loss)
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, **tol)
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all() and torch.isfinite(want).all()
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=tol["atol"] * scale)


def test_rloo_summed_sequence_ratio_in_float64_any_layout_masked_and_overflowing():
    """importance_sampling_level "sequence_sum" (TRL 1.16 RLOOTrainer's ratio): per row ρ = exp(Σ over its real
    tokens of logp − old), −min(ρ·A, clip(ρ)·A) on every real token; against that formula in float64 with
    transposed (strided) inputs, masked tokens whose old log-probs are inf, and a row whose ratio overflows."""
    from fastppo.kernels import clipped_surrogate

    gen = torch.Generator().manual_seed(11)
    b, t = 5, 7
    new = (-torch.rand(t, b, generator=gen, dtype=torch.float64) * 2).t().requires_grad_()  # strided [b, t]
    old = (new.detach() + torch.randn(t, b, generator=gen, dtype=torch.float64).t() * 0.15).clone()
    mask = torch.ones(b, t, dtype=torch.bool)
    for row, n in enumerate([7, 4, 1, 6, 3]):
        mask[row, n:] = False
    old[~mask] = float("inf")  # never read
    old[3, :6] = new.detach()[3, :6] - 150.0  # Σ log-ratio = 900: ρ overflows to inf even in float64
    advantages = torch.tensor([1.5, -0.7, 0.4, 2.0, -1.1], dtype=torch.float64)[:, None].expand(b, t)
    rows = torch.arange(b)[:, None].expand(b, t)
    loss, ratio, _ = clipped_surrogate(new, old, advantages, 0.2, mask=mask, sequence_ids=rows, num_sequences=b,
                                       importance_sampling_level="sequence_sum")
    loss.sum().backward()
    got_grad = new.grad.clone()
    new.grad = None
    log_ratio = torch.where(mask, new - torch.where(mask, old, 0.0), 0.0).sum(1, keepdim=True)
    rho = log_ratio.exp()
    want = torch.where(mask, -torch.min(rho * advantages, rho.clamp(0.8, 1.2) * advantages), 0.0)
    finite = torch.isfinite(rho).squeeze(1)
    torch.testing.assert_close(loss[finite], want[finite], rtol=1e-12, atol=1e-12)
    assert torch.isinf(ratio[3, 0])  # the clipped branch: A > 0 capped at 1 + ε
    torch.testing.assert_close(loss[3].detach(), -(1 + 0.2) * 2.0 * mask[3].double(), rtol=1e-12, atol=0)
    want[finite].sum().backward()
    torch.testing.assert_close(got_grad[finite], new.grad[finite], rtol=1e-12, atol=1e-12)
    assert torch.isfinite(got_grad).all() and (got_grad[3] == 0).all()  # no gradient through the clipped row
    assert (got_grad[~mask] == 0).all() and (ratio[mask] == rho.expand(b, t)[mask]).all()
