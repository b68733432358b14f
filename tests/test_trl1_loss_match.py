"""fastppo's critic-free advantages, loss and policy gradient equal TRL 1.16's own on one identical batch.

``tests/trl1_loss_match.py`` runs in TRL 1.16's environment (``.trl1`` first on ``PYTHONPATH``, as
``tests/test_trl1_integration.py`` does; a missing ``.trl1`` fails there with the command that makes it) and
hands one batch (3 prompts × 4 ragged completions, rewards with an all-equal group, old and reference
log-probs 0.3 off the model's own so the clip acts) to TRL's unedited GRPOTrainer / RLOOTrainer through
their own code paths and to fastppo's ``assemble`` / ``estimate_advantages`` / ``PolicyAndValue`` /
``ppo_losses`` (its docstring says exactly how). One subprocess (~20 s of imports on a 2-core CPU, ~2 s a
case) serves every test here.

Tolerances, against what was measured (the embedded tiny Llama in fp32; per-token log-probs ≈ −5.3, whose
fp32 ulp is 4.8e-7; the two sides' forwards differ in layout, TRL's left-padded rows against fastppo's cut
and re-positioned ones, so their log-probs agree to ~1e-6, not bitwise):

* advantages: rtol 1e-6, atol 1e-6 (measured ≤ 1.2e-7 for GRPO, ≤ 3.6e-7 for RLOO: an ulp or two of
  values up to 2);
* loss: atol 1e-7 (measured ≤ 1.7e-8 on losses of 0.03-0.06, means of O(1) per-token terms; what a wrong
  formula moves it by, at beta 0.04: no bias correction 1.3e-4, k1 instead of k3 1.8e-3, a clip of 0.19 1.1e-3);
* gradients: each parameter's within 1e-5 of its own largest entry, elementwise rtol 1e-5 on top (measured
  ≤ 7.9e-7 of it; no bias correction moves them by 1.2e-2 of it, k1 for k3 by 0.15).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from test_trl1_integration import ROOT, trl1_dir
from helpers import TRL_GRPO_LOSS_VARIANT_BETAS as VARIANT_BETAS
from helpers import trl_grpo_loss_variant_runs

SCRIPT = ROOT / "tests" / "trl1_loss_match.py"
SCALES = ("group", "batch", "none")
BETAS = (0.0, 0.04)


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("trl1-loss-match")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(trl1_dir()), str(ROOT)]), TRITON_INTERPRET="0",
               FASTPPO_CACHE=str(tmp / "cache"), TRL_EXPERIMENTAL_SILENCE="1")
    out = tmp / "record.pt"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rec = torch.load(out, weights_only=False)
    assert rec["trl_version"] == "1.16.0"
    return rec


@pytest.mark.slow
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("scale", SCALES)
def test_grpo_advantages_loss_and_gradients_equal_trls(record, scale, beta):
    rec = record["grpo"][f"{scale}-{beta}"]
    theirs, ours = rec["trl"], rec["fastppo"]
    torch.testing.assert_close(ours["advantages"], theirs["advantages"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours["loss"], theirs["loss"], rtol=0, atol=1e-7)
    assert ours["grads"].keys() == theirs["grads"].keys() and len(ours["grads"]) == 21
    for name, trl_grad in theirs["grads"].items():
        scale_of = trl_grad.abs().max().item()
        assert scale_of > 0, name  # every parameter takes part (the LM head and embeddings included)
        torch.testing.assert_close(ours["grads"][name], trl_grad, rtol=1e-5, atol=1e-5 * scale_of, msg=name)
    # the batch is the one claimed: the clip is taken for positive and for negative advantages, the
    # equal-reward group's advantages are 0, and TRL's DAPO normaliser counts every real completion token
    assert ours["clip_active_pos"] > 0 and ours["clip_active_neg"] > 0
    assert (theirs["advantages"].view(-1, 4)[2] == 0).all()
    assert theirs["num_items_in_batch"] == ours["tokens"] == int(record["batch"]["real"].sum())
    if beta:  # TRL's own forward (its reference model, the same weights) on the batch against fastppo's
        assert rec["forward_max_abs"] <= 5e-6


@pytest.mark.slow
@pytest.mark.parametrize("name, kind", trl_grpo_loss_variant_runs())
def test_policy_loss_settings_equal_trls(record, name, kind):
    """Each of TRL GRPO's policy-loss settings (loss_type, among them cispo, sapo, luspo and vespo, epsilon_high,
    delta, importance_sampling_level, mask_truncated_completions, entropy_coef, the sapo and vespo settings, the
    token masks), unfused with beta and through the fused loss: TRL's loss and every gradient, at the tolerances
    above (measured: loss ≤ 3.6e-7, for cispo's loss of about 1.1 summed in fp32 from token terms −A·w·log π of
    about 10 each; gradients ≤ 3e-7 of their scale)."""
    rec = record["variants"][f"{name}-{kind}"]
    theirs, ours = rec["trl"], rec["fastppo"]
    torch.testing.assert_close(ours["loss"], theirs["loss"], rtol=1e-6, atol=1e-7)
    if VARIANT_BETAS[kind]:  # the logged "kl": the global token mean of the in-loss KL, whatever loss_type aggregates
        assert ours["kl_metric"] == pytest.approx(theirs["kl_metric"], rel=1e-5, abs=1e-7), name
    assert ours["grads"].keys() == theirs["grads"].keys() and len(ours["grads"]) == 21
    for param, trl_grad in theirs["grads"].items():
        scale_of = trl_grad.abs().max().item()
        assert scale_of > 0, param
        torch.testing.assert_close(ours["grads"][param], trl_grad, rtol=1e-5, atol=1e-5 * scale_of, msg=param)
    # the setting bites on this batch: TRL's own loss or gradient moves away from its plain dapo run at this beta
    # (bnpo is dapo on one micro-batch of one process; how they differ across micro-batches is test_trainer_math's)
    if name == "bnpo":
        return
    plain = record["grpo"][f"group-{VARIANT_BETAS[kind]}"]["trl"]
    moved = max((theirs["grads"][p] - plain["grads"][p]).abs().max().item() / plain["grads"][p].abs().max().item()
                for p in plain["grads"])
    assert abs(theirs["loss"].item() - plain["loss"].item()) > 1e-5 or moved > 1e-3, (name, moved)


@pytest.mark.slow
def test_rloo_advantages_loss_and_gradients_equal_trls(record):
    """TRL 1.16 RLOOTrainer's advantages, and its sequence-level loss (exp of the summed log-ratio, clipped per
    completion, mean over completions) and gradients, against fastppo's RLOOTrainer settings (sequence_sum,
    loss_type grpo). Measured: loss within 3.8e-7 of 0.0267 (one ratio sums ~10 token log-ratios, each ~5e-7 apart
    between the two forwards), gradients within 1.3e-6 of their largest entry; 4 of 12 completions clipped."""
    rec = record["rloo"]
    theirs, ours = rec["trl"], rec["fastppo"]
    assert theirs["beta"] == 0.05  # RLOOConfig's default: the summed k1 of old − ref is in the reward
    torch.testing.assert_close(ours["advantages"], theirs["advantages"], rtol=1e-6, atol=1e-6)
    assert rec["loss_abs"] <= 2e-6 and rec["grad_max_abs_over_global_scale"] <= 1e-5, rec["grad_diffs"]
    assert ours["clipped_pos"] + ours["clipped_neg"] > 0  # the clip acts on this batch
    assert (ours["mean_level_loss"] - theirs["loss"]).abs() > 1e-3  # GSPO's mean would be told apart
    # the KL term moved the advantages (a test at beta 0 would not see it): same rewards, no KL, differ
    no_kl = record["batch"]["rewards"].view(-1, 4)
    no_kl = (no_kl - (no_kl.sum(1, keepdim=True) - no_kl) / 3).view(-1)
    assert (theirs["advantages"] - no_kl).abs().max() > 1e-2
    assert rec["forward_max_abs"] <= 5e-6


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_two_weighted_rewards_give_trls_advantages(record, aggregation):
    """Two reward functions weighted 1 and 0.5, the second judging only some completions (None, and a group where it
    judged one): TRL GRPO's multi_objective_aggregation by both of its values, against fastppo's weighted sum
    (combine_rewards) and GDPO (gdpo_advantages). Measured: equal to the bit on this batch."""
    rec = record["multi_reward"][aggregation]
    torch.testing.assert_close(rec["fastppo"], rec["trl"], rtol=1e-6, atol=1e-6)
    assert rec["trl"].abs().max() > 0.5
    other = record["multi_reward"][{"sum_then_normalize": "normalize_then_sum"}.get(aggregation,
                                                                                  "sum_then_normalize")]
    assert (rec["trl"] - other["trl"]).abs().max() > 0.1  # the two aggregations differ on this batch
