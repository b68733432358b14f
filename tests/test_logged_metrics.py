"""Logged metrics held to their definitions (TRL GRPO's, for TRL's names): each reward's mean and std over the
completions it judged, stable for large rewards with a small spread and over every process; the in-loss ``kl`` as
a token mean whatever ``loss_type`` aggregates the loss by. TRL 1.16's own logged ``kl`` for each loss type is in
test_trl1_loss_match.py."""
from __future__ import annotations

import math
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastppo.metrics import OBJECTIVE_ROWS, STAT, MetricTerms, UpdateResult, gather_metrics, reward_moments
from fastppo.loss_types import policy_loss_weights
from helpers import grid_losses

pytestmark = pytest.mark.usefixtures("reference_path")


def judged_rewards(seed: int, n: int, centre: float, spread: float) -> torch.Tensor:
    """[n] float32 rewards around ``centre``, a third of them NaN (not judged)."""
    g = torch.Generator().manual_seed(seed)
    x = (centre + spread * torch.randn(n, generator=g, dtype=torch.float64)).float()
    x[torch.rand(n, generator=g) < 0.33] = float("nan")
    return x


def nanstd_float64(x: torch.Tensor) -> float:
    values = x[~torch.isnan(x)].double().numpy()
    return float(np.std(values, ddof=1))


@pytest.mark.parametrize("centre, spread", [(1000.0, 0.0245), (0.0, 1.0), (-3e5, 2.0), (7.0, 0.0)])
def test_reward_mean_and_std_are_the_float64_ones(centre, spread):
    """Rewards near 1,000 with a spread of 0.0245: a one-pass sum of squares in float32 logged 0 (TRL's nanstd:
    0.0245)."""
    columns = {"a": judged_rewards(1, 40, centre, spread), "b": judged_rewards(2, 40, centre, spread)}
    stats = torch.full((len(STAT), 1, 1, 1), math.nan)
    logged = gather_metrics(torch.zeros(len(OBJECTIVE_ROWS)), UpdateResult(stats, 0.0, 1.0, 1), 1,
                            MetricTerms(critic=False, kl=False),
                            reward_columns=columns)
    for name, column in columns.items():
        mean, std = logged[f"rewards/{name}/mean"], logged[f"rewards/{name}/std"]
        values = column[~torch.isnan(column)].double()
        assert mean == pytest.approx(values.mean().item(), rel=1e-12, abs=1e-12)
        assert std == pytest.approx(nanstd_float64(column), rel=1e-9, abs=1e-12)
        if spread:
            assert std > 0.5 * spread


def test_a_reward_that_judged_under_two_completions_has_no_std():
    (mean, std), (none_mean, none_std) = reward_moments([torch.tensor([float("nan"), 2.5]), torch.full((3,), math.nan)])
    assert mean == 2.5 and math.isnan(std) and math.isnan(none_mean) and math.isnan(none_std)


def _moments_rank(rank: int, port: int, out: str, parts, batches) -> None:
    from fastppo.metrics import completion_metrics

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.save((reward_moments(parts[rank]), completion_metrics(*batches[rank], 2, "group")), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_reward_moments_are_over_every_process(tmp_path):
    whole = [judged_rewards(3, 24, 1000.0, 0.03), judged_rewards(4, 24, -2.0, 5.0)]
    parts = [[c[:9] for c in whole], [c[9:] for c in whole]]  # uneven shares
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from fastppo.metrics import completion_metrics

    g = torch.Generator().manual_seed(5)
    lengths, scores = torch.randint(1, 9, (8,), generator=g), torch.randn(8, generator=g)
    scores[4:6] = 0.3  # a group of equal rewards on the second process
    batches = [(lengths[:4], lengths[:4] == 8, scores[:4]), (lengths[4:], lengths[4:] == 8, scores[4:])]
    mp.spawn(_moments_rank, args=(port, str(tmp_path / "m"), parts, batches), nprocs=2, join=True)
    together = reward_moments(whole)
    batch = completion_metrics(lengths, lengths == 8, scores, 2, "group")
    for rank in (0, 1):
        moments, completions = torch.load(f"{tmp_path / 'm'}.{rank}")
        for got, want in zip(moments, together):
            assert got == pytest.approx(want, rel=1e-12)
        assert completions == pytest.approx(batch, rel=1e-12)
    assert batch["frac_reward_zero_std"] >= 0.25


def kl_case(seed: int, rows: int):
    """One micro-step's inputs with ratios away from 1 and a ragged mask (one row without a trained token)."""
    g = torch.Generator().manual_seed(seed)
    new = -torch.rand(rows, 7, generator=g, dtype=torch.float64) * 3
    old = new + 0.3 * torch.randn(rows, 7, generator=g, dtype=torch.float64)
    ref = new + 0.4 * torch.randn(rows, 7, generator=g, dtype=torch.float64)
    advantages = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, 7)
    mask = torch.arange(7)[None] < torch.randint(1, 8, (rows, 1), generator=g)
    mask[0] = False
    return new, old, ref, advantages, mask


def logged_kl(loss_type: str, cases) -> float:
    stats = []
    for new, old, ref, advantages, mask in cases:
        weights, normalizer = policy_loss_weights(loss_type, mask, 7, mask.sum().double() if loss_type in (
            "dapo", "cispo", "vespo") else None)
        loss, row = grid_losses(new, None, torch.zeros_like(new), old, None, advantages, None, mask, cliprange=0.2,
                               cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0, ratio_threshold=math.inf,
                               ref_logprobs=ref, beta=0.04, kl_loss_type="k3", token_weights=weights,
                               normalizer=normalizer)
        assert row[STAT["loss"]].item() == pytest.approx(loss.item(), rel=1e-6)  # the logged loss is the minimised one
        stats.append(row)
    stacked = torch.stack(stats, 1)[:, None, None, :]  # [S, epochs 1, minibatches 1, micro-steps]
    metrics = gather_metrics(torch.zeros(len(OBJECTIVE_ROWS)), UpdateResult(stacked, 0.0, 1.0, 1), 1,
                             MetricTerms(critic=False, kl=False, kl_in_loss=True))
    return metrics["kl"], stacked


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "luspo", "dapo", "bnpo", "sapo"])
def test_the_logged_kl_is_the_token_mean_of_each_micro_step_for_every_loss_type(loss_type):
    """TRL GRPO's ``kl``: per micro-step, Σ k3·ρ over the trained tokens / their count; the mean over micro-steps.
    Once logged as the loss's own aggregation (grpo 0.130, dr_grpo 0.116, luspo 0.695 where TRL logs 0.150)."""
    cases = [kl_case(seed, rows) for seed, rows in ((1, 5), (2, 3))]
    want = []
    for new, old, ref, _, mask in cases:
        d = ref - new
        per_token = (torch.exp(d) - d - 1) * torch.exp(new - old)
        want.append((per_token[mask].sum() / mask.sum()).item())
    got, stacked = logged_kl(loss_type, cases)
    assert got == pytest.approx(sum(want) / len(want), rel=1e-6)
    if loss_type in ("grpo", "dr_grpo", "luspo"):  # the loss's own aggregation is another number
        aggregated = stacked[STAT["kl_loss"]].mean().item()
        assert abs(aggregated - got) > 1e-3


def test_entropy_and_clip_fractions_are_global_means_in_trls_units():
    """TRL GRPO's entropy and clip_ratio/*_mean: per micro-step, over the trained tokens (rows, under GSPO's one
    ratio per row) of every process, then averaged over the micro-steps."""
    cases = [kl_case(seed, rows) for seed, rows in ((3, 5), (4, 2))]
    for sequence_level in (False, True):
        rows, want = [], {"entropy": [], "clip_ratio/low_mean": [], "clip_ratio/high_mean": []}
        for new, old, ref, advantages, mask in cases:
            entropy = torch.rand(new.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
            _, row = grid_losses(new, None, entropy, old, None, advantages, None, mask, cliprange=0.02,
                                cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0, ratio_threshold=math.inf,
                                cliprange_high=0.03,
                                importance_sampling_level="sequence" if sequence_level else "token")
            rows.append(row)
            want["entropy"].append((entropy[mask].sum() / mask.sum()).item())
            if sequence_level:  # exp of each row's mean log-ratio over its trained tokens; every row counts
                ratio = torch.exp(((new - old) * mask).sum(1) / mask.sum(1).clamp(min=1))[:, None]
                a = advantages[:, :1]
                want["clip_ratio/low_mean"].append((((ratio < 0.98) & (a < 0)).sum() / len(ratio)).item())
                want["clip_ratio/high_mean"].append((((ratio > 1.03) & (a > 0)).sum() / len(ratio)).item())
            else:
                ratio = torch.exp(new - old)
                want["clip_ratio/low_mean"].append((((ratio < 0.98) & (advantages < 0))[mask].sum() / mask.sum()).item())
                want["clip_ratio/high_mean"].append((((ratio > 1.03) & (advantages > 0))[mask].sum()
                                                     / mask.sum()).item())
        stacked = torch.stack(rows, 1)[:, None, None, :]
        logged = gather_metrics(torch.zeros(len(OBJECTIVE_ROWS)), UpdateResult(stacked, 0.0, 1.0, 1), 1,
                                MetricTerms(critic=False, kl=False))
        for name, values in want.items():
            assert logged[name] == pytest.approx(sum(values) / len(values), rel=1e-6, abs=1e-7), (name, sequence_level)
        assert 0 < logged["clip_ratio/low_mean"] + logged["clip_ratio/high_mean"] < 1


def test_completion_and_reward_metrics_against_their_definitions():
    """TRL GRPO's completions/* and reward metrics on a batch with truncated completions and a group of equal
    float32 rewards (0.1: its float32 std is not 0, its float64 one is)."""
    from fastppo.metrics import completion_metrics

    lengths = torch.tensor([3, 8, 8, 1, 5, 8, 2, 7])
    truncated = lengths == 8
    scores = torch.tensor([0.1, 0.1, 0.1, 0.1, 1.0, -2.0, 0.5, 3.0])
    got = completion_metrics(lengths, truncated, scores, 4, "group")
    stopped = lengths[~truncated].double()
    want = {"completions/mean_length": lengths.double().mean(), "completions/min_length": 1.0,
            "completions/max_length": 8.0, "completions/clipped_ratio": 3 / 8,
            "completions/mean_terminated_length": stopped.mean(), "completions/min_terminated_length": 1.0,
            "completions/max_terminated_length": 7.0, "reward": scores.double().mean(),
            "reward_std": scores.double().std(), "frac_reward_zero_std": 0.5}
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(float(value), rel=1e-12), name
    assert completion_metrics(lengths, truncated, scores, 4, "batch")["frac_reward_zero_std"] == 0.0
    none_stopped = completion_metrics(lengths, torch.ones(8, dtype=torch.bool), scores, 1, "group")
    assert none_stopped["completions/mean_terminated_length"] == 0.0 and "frac_reward_zero_std" not in none_stopped


def test_a_critic_free_run_logs_trl_grpos_names(tmp_path, model_dir):
    from helpers import make_trainer, small_config

    trainer = make_trainer(small_config(tmp_path, advantage_estimator="grpo", num_generations=4, beta=0.04,
                                        total_episodes=16, num_sample_generations=0))
    trainer.train()
    names = {"reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
             "completions/mean_terminated_length", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
             "clip_ratio/region_mean"}
    for row in trainer.state.log_history:
        if "reward" in row:
            assert names <= set(row)
            assert row["reward"] == pytest.approx(row["objective/scores"], rel=1e-5, abs=1e-6)


def test_the_extreme_clip_fractions_are_trls():
    """TRL GRPO's clip_ratio/low_min and high_max: per micro-step, the smallest (largest) share of one sequence's
    tokens clipped below (above) the range (its masked_seq_mean, then nanmin/nanmax over the sequences: a sequence
    without a token is passed over), averaged over the micro-steps that had one."""
    from fastppo.metrics import STAT_NAMES, extreme_clip_shares, row_statistics

    torch.manual_seed(3)
    stats = torch.full((len(STAT_NAMES), 1, 2, 2), float("nan"))
    expected_low, expected_high = [], []
    for slot, rows in ((0, 3), (1, 5), (2, 4)):  # the fourth micro-step did not run
        real = torch.rand(rows, 7) < 0.7
        real[0] = False  # a sequence with no token: no share
        low, high = torch.rand(rows, 7) < 0.3, torch.rand(rows, 7) < 0.4
        slot_stats = torch.full((len(STAT_NAMES),), float("nan"))
        row_statistics(slot_stats, [low & real, high & real], real, torch.zeros(rows, 7), torch.zeros(rows, 7), None)
        stats[:, 0, slot // 2, slot % 2] = slot_stats
        shares = [((s & real).sum(1).float() / real.sum(1))[1:] for s in (low, high)]  # by hand, row by row
        expected_low.append(shares[0].min().item())
        expected_high.append(shares[1].max().item())
    low, high = extreme_clip_shares(stats)
    assert low[:3] == pytest.approx(expected_low) and high[:3] == pytest.approx(expected_high)
    assert math.isnan(low[3]) and math.isnan(high[3])  # the micro-step that did not run: passed over
    # a generation batch's log averages the micro-steps that ran (TRL's mean of its appended values)
    assert sum(low[:3]) / 3 == pytest.approx(sum(expected_low) / 3)
