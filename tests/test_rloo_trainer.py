"""fastppo.RLOOConfig and fastppo.RLOOTrainer: TRL 1.16's names, defaults and constructor on fastppo's trainer
(``fastppo.rloo``). The loss and advantages against TRL's own are in ``test_trl1_loss_match.py``; here the config,
the trainer end to end, and RLOO's own settings (normalize_advantages, reward_clip_range)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from fastppo import GRPOConfig, RLOOConfig, RLOOTrainer
from fastppo.errors import SettingsError
from test_grpo_trainer import COMPUTED, LengthReward, SAME_MEANING, trl_config_defaults, tutorial_dataset

pytestmark = pytest.mark.usefixtures("reference_path")


def test_every_field_of_trls_rloo_config_with_trls_default(tmp_path):
    theirs = trl_config_defaults(tmp_path, "RLOOConfig")
    ours = RLOOConfig(output_dir=str(tmp_path / "ours"))
    missing = sorted(n for n in theirs if not hasattr(ours, n))
    assert not missing, missing
    differ = {n: (v, getattr(ours, n)) for n, v in theirs.items() if n not in COMPUTED
              and json.loads(json.dumps(getattr(ours, n), default=repr)) != v}
    assert differ == SAME_MEANING
    assert (ours.num_generations, ours.beta, ours.advantage_estimator, ours.importance_sampling_level,
            ours.loss_type) == (2, 0.05, "rloo", "sequence_sum", "grpo")
    assert isinstance(ours, GRPOConfig)


def test_a_trl_rloo_script_runs_with_its_import_changed(tmp_path, model_dir):
    """TRL's RLOO at its defaults: beta 0.05 is the KL in the reward (a reference model runs), k 2; TRL's names
    logged, ``kl`` the reward's per-token KL."""
    args = RLOOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_completion_length=6,
                      max_steps=2, logging_steps=1, bf16=False, disable_tqdm=True, gradient_checkpointing=False,
                      save_strategy="no", report_to="none", learning_rate=1e-3, normalize_advantages=True,
                      reward_clip_range=(0.0, 4.0))
    reward = LengthReward()
    trainer = RLOOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=tutorial_dataset())
    assert trainer.args is args and args.beta == 0.05 and args.kl_coef == 0.05
    engine = trainer.config  # the KL in the reward (kl_coef, k1), none in the loss
    assert (engine.kl_coef, engine.kl_estimator, engine.beta) == (0.05, "k1", 0.0)
    assert trainer.reference is not None or trainer.ref_model is not None
    output = trainer.train()
    rows = [m for m in trainer.state.log_history if "reward" in m and "train_runtime" not in m]
    assert len(rows) == 2
    for row in rows:
        assert {"kl", "entropy", "loss", "reward", "reward_std", "frac_reward_zero_std", "clip_ratio/region_mean",
                "completions/mean_length", "rewards/length_reward/mean"} <= set(row)
    # π_θ_old is π_ref before the first step, and differs after it
    assert rows[0]["kl"] == 0.0 and math.isfinite(rows[1]["kl"]) and rows[1]["kl"] != 0.0
    assert output.global_step == 2


def test_rloo_settings_are_checked(tmp_path, model_dir):
    bad = [(dict(reward_clip_range=(2.0, 1.0)), "reward_clip_range must be \\(min, max\\) with min < max"),
           (dict(reward_clip_range=(0.0, 1.0), score_clip=1.0), "reward_clip_range and score_clip"),
           (dict(fused_policy_loss=True), "sequence_sum .* fused_policy_loss to false")]
    for kwargs, match in bad:
        args = RLOOConfig(output_dir=str(tmp_path / "o"), per_device_train_batch_size=4, bf16=False,
                          report_to="none", **kwargs)
        with pytest.raises(SettingsError, match=match):
            RLOOTrainer(model=model_dir, reward_funcs=LengthReward(), args=args, train_dataset=tutorial_dataset())
    with pytest.raises(SettingsError, match="normalize_advantages standardises RLOO's advantages"):
        from fastppo import PPOTrainer, PPOConfig
        PPOTrainer(args=PPOConfig(output_dir=str(tmp_path / "p"), advantage_estimator="grpo",
                                  normalize_advantages=True, report_to="none"))


def test_normalized_rloo_advantages_and_the_clip_range():
    """TRL RLOO's normalize_advantages: the leave-one-out advantages standardised over the batch (unbiased std,
    + 1e-4); reward_clip_range clamps the score before the KL penalty."""
    from fastppo.config import PPOConfig
    from fastppo.rewards import transform_scores
    from fastppo.advantages import estimate_advantages

    gen = torch.Generator().manual_seed(0)
    rewards = torch.zeros(6, 3, dtype=torch.float64)
    rewards[:, 2] = torch.randn(6, generator=gen, dtype=torch.float64) * 3
    mask = torch.ones(6, 3, dtype=torch.bool)
    config = PPOConfig(output_dir=None, advantage_estimator="rloo", num_generations=3, normalize_advantages=True)
    got, _ = estimate_advantages("rloo", rewards, None, mask, config)
    r = rewards.sum(1).view(2, 3)
    loo = (r - (r.sum(1, keepdim=True) - r) / 2).view(-1)
    want = (loo - loo.mean()) / (loo.std() + 1e-4)
    torch.testing.assert_close(got[:, 0], want)
    assert not torch.allclose(got[:, 0], loo)
    scores = torch.tensor([-3.0, 0.5, 7.0])
    assert transform_scores(scores, False, False, None, None, (-1.0, 2.0)).tolist() == [-1.0, 0.5, 2.0]
