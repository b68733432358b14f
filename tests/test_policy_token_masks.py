"""The policy term's token masks from TRL GRPO: ``top_entropy_quantile`` ("Beyond the 80/20 Rule",
``high_entropy_mask``) and ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence masking,
``fastppo.kernels.ppo_loss.off_policy_keep``, applied by ``clipped_surrogate``), and their place in ``ppo_losses``. Against TRL 1.16's own loss and gradients:
``test_trl1_loss_match.py`` (variants top_entropy*, off_policy_mask*).

The entropy mask keeps the trained tokens whose entropy reaches the (1 − q) quantile of the micro-batch's trained
tokens on every process; the policy term and the entropy bonus read only them, the KL term and the normalisers all.
The off-policy mask drops, from the policy term only, the tokens of negative advantage in rows whose mean
log π_old − log π_θ over their trained tokens exceeds the threshold."""
from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

import fastppo.policy_terms as P
from fastppo.kernels.ppo_loss import off_policy_keep
import fastppo.train as T
from fastppo.errors import SettingsError
from helpers import make_trainer, metrics_without_clock, small_config, grid_losses


def case(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(rows, cols, generator=g) > 0.3
    return entropy, mask


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 9), seed=st.integers(0, 2**16),
       q=st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0]))
def test_the_kept_tokens_are_the_top_quantile_of_the_trained_ones(rows, cols, seed, q):
    entropy, mask = case(rows, cols, seed)
    kept = P.high_entropy_mask(entropy, mask, q)
    assert not (kept & ~mask).any()  # an untrained token is never kept
    values = entropy[mask]
    if values.numel() == 0:
        assert not kept.any()
        return
    # every kept token's entropy is at least every dropped trained token's
    dropped = entropy[mask & ~kept]
    if kept.any() and dropped.numel():
        assert entropy[kept].min() >= dropped.max()
    n = values.numel()
    # linear interpolation keeps between ⌊q·(n − 1)⌋ + 1 and ⌈q·(n − 1)⌉ + 1 tokens (distinct random values)
    assert int(kept.sum()) in range(int(q * (n - 1) + 1e-9) + 1, -int(-q * (n - 1) - 1e-9) + 2), (q, n)
    if q == 0:
        assert int(kept.sum()) == 1 and entropy[kept].item() == values.max()
    if q == 1:
        assert torch.equal(kept, mask)


def test_past_torch_quantile_limit_the_sort_gives_the_same_mask(monkeypatch):
    entropy, mask = case(7, 13, 5)
    for q in (0.0, 0.2, 0.37, 0.8):
        want = P.high_entropy_mask(entropy, mask, q)
        monkeypatch.setattr(P, "QUANTILE_LIMIT", 3)
        got = P.high_entropy_mask(entropy, mask, q)
        monkeypatch.undo()
        assert torch.equal(got, want), q


def _rank(rank: int, port: int, out: str, parts, q: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        entropy, mask = parts[rank]
        torch.save(P.high_entropy_mask(entropy, mask, q), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_the_quantile_is_over_every_process(tmp_path):
    """Two Gloo processes with micro-batches of different sizes (one with no trained token at all): each one's mask
    is its share of the mask of the processes' tokens together, as TRL gathers them."""
    entropy, mask = case(6, 5, 9)
    entropy[0, :3] = -1e-7  # what rounding makes of a one-hot distribution's entropy: still a value to count
    mask[0, :3] = True
    mask[4:] = False  # the second process trains nothing of its own
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "mask")
    entropy_b, mask_b = entropy.clone(), mask.clone()
    mask_b[:2] = False  # and a case where both processes train tokens, unevenly
    mask_b[4:] = torch.rand(2, 5, generator=torch.Generator().manual_seed(2)) > 0.2
    for e, m in ((entropy, mask), (entropy_b, mask_b)):
        parts = [(e[:4], m[:4]), (e[4:], m[4:])]
        mp.spawn(_rank, args=(port, out, parts, 0.3), nprocs=2, join=True)
        together = P.high_entropy_mask(e, m, 0.3)
        assert torch.equal(torch.cat([torch.load(f"{out}.0"), torch.load(f"{out}.1")]), together)
        port += 1
        local = P.high_entropy_mask(e[:4], m[:4], 0.3)
        if m[4:].any():  # the other process's tokens move the threshold
            assert not torch.equal(local, together[:4])


def loss_inputs(seed: int, row_advantages: bool):
    """[4, 6] float64 log-probs (a leaf), old ones and reference ones off them, advantages (one per row, or one
    per token), entropies (a leaf) and a ragged mask, fresh from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    new = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    old = new.detach() + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    ref = new.detach() + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = (torch.randn(4, 1, generator=g, dtype=torch.float64).expand(shape).clone() if row_advantages
           else torch.randn(shape, generator=g, dtype=torch.float64))
    entropy = (torch.rand(shape, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    mask = torch.rand(shape, generator=g) > 0.2
    return new, old, ref, adv, entropy, mask


def test_ppo_losses_masks_the_policy_term_and_the_bonus_only():
    new, old, ref, adv, entropy, mask = loss_inputs(1, row_advantages=False)
    common = dict(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.1, ratio_threshold=10.0,
                  ref_logprobs=ref, beta=0.04)

    def loss_of(q, mask_for_policy=None):
        kw = dict(common, top_entropy_quantile=q)
        if mask_for_policy is not None:  # the same loss written out with an explicit mask
            pg, ratio, _ = T.clipped_surrogate(new, old, adv, 0.2, mask=mask)
            pg_loss = T.aggregate(torch.where(mask_for_policy, pg, 0.0), mask)
            kl = T.aggregate(T.kl_penalty(new, ref, "k3") * ratio, mask)
            return pg_loss - 0.1 * T.aggregate(entropy, mask_for_policy) + 0.04 * kl
        return grid_losses(new, None, entropy, old, None, adv, None, mask, **kw)[0]

    kept = P.high_entropy_mask(entropy, mask, 0.5)
    assert 0 < int(kept.sum()) < int(mask.sum())
    for q, policy_mask in ((0.5, kept), (1.0, mask)):
        got, want = loss_of(q), loss_of(q, policy_mask)
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
        grads = torch.autograd.grad(got, (new, entropy))
        expected = torch.autograd.grad(want, (new, entropy))
        for a, b in zip(grads, expected):
            torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)
    assert (loss_of(0.5) - loss_of(1.0)).abs() > 1e-4  # it bites here


def test_a_run_trains_with_it(tmp_path, model_dir):
    """Through the trainer (the config reaches ppo_losses): the policy moves, every logged loss is finite."""
    trainer = make_trainer(small_config(tmp_path, advantage_estimator="grpo", num_generations=2,
                                        top_entropy_quantile=0.2, save_strategy="no", total_episodes=8))
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.policy.parameters()))
    row = metrics_without_clock(tmp_path / "out" / "metrics.jsonl")[-1]
    assert all(math.isfinite(row[k]) for k in ("loss/policy_avg", "policy/entropy_avg", "clip_ratio/region_mean"))


def keep_of(new, old, adv, mask, threshold):
    """The off-policy mask as clipped_surrogate applies it: the tokens whose loss it leaves alone."""
    rows = torch.arange(new.shape[0])[:, None].expand(new.shape)
    return off_policy_keep(new - torch.where(mask, old, new), adv, mask, rows, new.shape[0], threshold)


def test_the_off_policy_mask_drops_negative_advantages_of_drifted_rows():
    g = torch.Generator().manual_seed(4)
    new = torch.randn(5, 7, generator=g, dtype=torch.float64)
    old = new + 0.3 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[3] = False  # a row with no trained token: mean KL 0
    old[~mask] = float("nan")  # what sits off the trained tokens never counts
    adv = torch.randn(5, 1, generator=g, dtype=torch.float64).expand(5, 7).clone()
    adv[0, :3] = -adv[0, :3]  # per-token advantages (a critic's) of both signs in one row
    old[:2] += 0.3  # two rows drifted well past the threshold, the others about as far as it
    adv[1] = -adv[1].abs()
    threshold = 0.05
    keep = keep_of(new, old, adv, mask, threshold)
    for r in range(5):
        m = mask[r]
        mean_kl = (old[r][m] - new[r][m]).sum() / max(int(m.sum()), 1)
        for t in range(7):
            assert keep[r, t] == bool(adv[r, t] >= 0 or mean_kl <= threshold), (r, t)
    assert keep[3].all()  # nothing trained, no drift
    assert (~keep & mask).any() and (keep & mask & (adv < 0)).any()  # it drops some and keeps some here


def test_ppo_losses_drops_them_from_the_policy_term_only():
    new, old, ref, adv, entropy, mask = loss_inputs(6, row_advantages=True)
    old[:2] += 0.3  # drifted rows with negative advantages: dropped
    adv[:2] = -adv[:2].abs()
    kw = dict(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.1, ratio_threshold=10.0,
              ref_logprobs=ref, beta=0.04)
    keep = keep_of(new.detach(), old, adv, mask, 0.01)
    assert (mask & ~keep).any() and (mask & keep).any()
    got = grid_losses(new, None, entropy, old, None, adv, None, mask, off_policy_mask_threshold=0.01, **kw)[0]
    pg, ratio, _ = T.clipped_surrogate(new, old, adv, 0.2, mask=mask)
    want = (T.aggregate(torch.where(keep, pg, 0.0), mask) - 0.1 * T.aggregate(entropy, mask)
            + 0.04 * T.aggregate(T.kl_penalty(new, ref, "k3") * ratio, mask))
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    for a, b in zip(torch.autograd.grad(got, (new, entropy)), torch.autograd.grad(want, (new, entropy))):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("kwargs, message", [
    (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold must be >= 0"),
    (dict(off_policy_mask_threshold=float("inf")), "off_policy_mask_threshold must be >= 0"),
    (dict(top_entropy_quantile=1.5), r"top_entropy_quantile must be in \[0, 1\]"),
    (dict(top_entropy_quantile=-0.1), r"top_entropy_quantile must be in \[0, 1\]"),
    (dict(top_entropy_quantile=float("nan")), r"top_entropy_quantile must be in \[0, 1\]"),
    (dict(top_entropy_quantile=0.2, max_tokens_per_micro_batch=64), "max_tokens_per_micro_batch regroups"),
])
def test_bad_settings_are_refused_by_name(tmp_path, kwargs, message):
    with pytest.raises(SettingsError, match=message):
        make_trainer(small_config(tmp_path, advantage_estimator="grpo", num_generations=2, **kwargs))
