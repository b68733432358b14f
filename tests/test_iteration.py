"""``fastppo.train.ppo_iteration``, the one driver of steps 1-6, as the trainer and a caller with its own samples
use it: what its typed result holds, and that it is the same iteration either way."""
from __future__ import annotations

import pytest
import torch

from fastppo import PPOConfig
from fastppo.cli import EMBEDDED_PRESET
from fastppo.train import IterationResult, ppo_iteration
from fastppo.rollout import ScoredRollout, eos_count
from fastppo.trainer import PPOTrainer
from helpers import digest

pytestmark = pytest.mark.usefixtures("reference_path")


def trainer(tmp_path, name, **overrides):
    config = PPOConfig(**{**EMBEDDED_PRESET, **dict(
        output_dir=str(tmp_path / name), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_ppo_epochs=1, response_length=5, total_episodes=24, num_sample_generations=0, disable_tqdm=True,
        lr_scheduler_type="linear", seed=7), **overrides})
    return PPOTrainer(args=config)


def test_an_iteration_returns_what_it_was_made_of(tmp_path, model_dir):
    t = trainer(tmp_path, "a")
    lr_before = t.optimizer.param_groups[0]["lr"]
    result = t.iteration()
    assert isinstance(result, IterationResult) and isinstance(result.batch, ScoredRollout)
    assert t.state.global_step == 1 and t.state.episode == t.sizes.batch_size
    assert result.lr == lr_before and t.optimizer.param_groups[0]["lr"] < lr_before  # the schedule moved on
    b = result.batch.rollout.response_mask.shape[0]
    assert result.scores.shape == (b,) and result.experience.logprobs.shape == result.targets.advantages.shape
    assert {"objective/kl", "objective/scores", "loss/policy_avg", "val/num_eos_tokens"} <= set(result.metrics)
    assert result.metrics["objective/scores"] == pytest.approx(result.batch.scores.mean().item(), rel=1e-6)
    assert {"generation", "reward", "scoring", "update", "scoring/forwards", "scoring/advantages"} <= set(result.seconds)
    assert result.seconds["scoring/forwards"] + result.seconds["scoring/advantages"] == pytest.approx(
        result.seconds["scoring"])


def test_a_callers_own_samples_run_the_same_iteration(tmp_path, model_dir):
    """A caller's own samples and scores (the legacy step()'s way in: a ScoredRollout without texts or reward
    columns) and the trainer's own rollout give one iteration."""
    drawn = trainer(tmp_path, "own")
    collected = trainer(tmp_path, "given")
    torch.manual_seed(0)
    batch = drawn.rollout()
    torch.manual_seed(0)
    same = collected.rollout()
    assert torch.equal(batch.rollout.query_responses, same.rollout.query_responses)
    first = drawn.iteration(lambda: batch)
    given = ScoredRollout(same.rollout, same.scores, eos_count(same.rollout, collected.tokenizer.eos_token_id))
    second = collected.iteration(lambda: given)
    assert digest(drawn.actor_critic.state_dict()) == digest(collected.actor_critic.state_dict())
    # the same metrics, but for each reward's own columns: a caller hands over its total scores only
    mine = {k: v for k, v in first.metrics.items() if not k.startswith("rewards/")}
    assert mine == second.metrics and set(first.metrics) - set(mine) == {"rewards/positive_words/mean",
                                                                          "rewards/positive_words/std"}


def test_the_driver_is_a_function_of_its_parts(tmp_path, model_dir):
    t = trainer(tmp_path, "parts")
    batch = t.rollout()
    result = ppo_iteration(t.learner, t.config, t.sizes, lambda: batch)
    assert result.batch is batch and t.state.global_step == 0  # counters are the trainer's, not the step's
