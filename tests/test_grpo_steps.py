"""TRL GRPO's step counting on fastppo's loop: several optimizer steps per generation batch (``num_iterations``,
``steps_per_generation``), ``global_step``/``max_steps``/the schedule/``save_steps`` in optimizer steps, callbacks once
per optimizer step, the same minibatches revisited on each pass, the adaptive entropy coefficient, and an exact
resume in the middle of all that."""
from __future__ import annotations

import math

import datasets
import pytest
import torch
from transformers import TrainerCallback

import fastppo.train as T
from fastppo import GRPOConfig, GRPOTrainer
from fastppo.checkpoint import checkpoints
from fastppo.errors import SettingsError
from fastppo.controllers import AdaptiveEntropyController
from helpers import digest

pytestmark = pytest.mark.usefixtures("reference_path")


def prompts():
    return datasets.Dataset.from_dict({"prompt": ["the movie was", "i think the plot is", "overall the cast",
                                                  "the ending felt", "a story of", "my friend said"] * 4})


def length_reward(completions, **kwargs):
    return [0.1 * len(c) for c in completions]


def grpo_args(tmp_path, name="out", **kw):
    base = dict(output_dir=str(tmp_path / name), num_generations=4, per_device_train_batch_size=4,
                gradient_accumulation_steps=2, steps_per_generation=4, num_iterations=2, max_completion_length=5,
                max_steps=7, logging_steps=3, save_strategy="no", bf16=False, disable_tqdm=True,
                gradient_checkpointing=False, report_to="none", learning_rate=1e-3, seed=5)
    return GRPOConfig(**{**base, **kw})


class Events(TrainerCallback):
    def __init__(self):
        self.begins, self.ends = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self.begins.append(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(state.global_step)


def test_the_config_fills_the_generation_batch_as_trl_does(tmp_path):
    args = grpo_args(tmp_path, steps_per_generation=None, generation_batch_size=None)
    assert (args.steps_per_generation, args.generation_batch_size) == (2, 8)  # gradient_accumulation_steps
    args = grpo_args(tmp_path, steps_per_generation=None, generation_batch_size=16)
    assert args.steps_per_generation == 4
    with pytest.raises(SettingsError, match="generation_batch_size \\(10\\) must be divisible by the global batch"):
        grpo_args(tmp_path, steps_per_generation=None, generation_batch_size=10)
    with pytest.raises(SettingsError, match="'generation_batch_size' \\(12\\) and 'steps_per_generation' \\(4\\) can "
                                            "not be both configured"):
        grpo_args(tmp_path, steps_per_generation=4, generation_batch_size=12)


@pytest.mark.parametrize("given, sizes", [
    # (the settings, (completions per generation batch, per optimizer step, micro-batches per step, steps per batch))
    (dict(steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=2), (8, 4, 2, 2)),
    (dict(steps_per_generation=4, gradient_accumulation_steps=1, per_device_train_batch_size=2), (8, 2, 1, 4)),
    (dict(generation_batch_size=12, steps_per_generation=None, gradient_accumulation_steps=1,
          per_device_train_batch_size=4), (12, 4, 1, 3)),
    (dict(steps_per_generation=None, gradient_accumulation_steps=3, per_device_train_batch_size=4), (12, 12, 3, 1)),
])
def test_the_batches_are_trls(tmp_path, model_dir, given, sizes):
    """TRL GRPO's generation batch is per_device_train_batch_size × steps_per_generation completions, and each
    optimizer step per_device_train_batch_size × gradient_accumulation_steps of them (fastppo once took the rollout as
    the latter: half of TRL's batch when steps_per_generation = 2 × gradient_accumulation_steps)."""
    args = grpo_args(tmp_path, num_generations=2, num_iterations=2, max_steps=8,
                     **{"generation_batch_size": None, **given})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=prompts(), args=args)
    s = trainer.sizes
    assert (s.local_batch_size, s.local_mini_batch_size, s.micro_steps, s.num_mini_batches) == sizes
    assert s.local_micro_batch_size == args.per_device_train_batch_size and s.steps_per_iteration == 2 * sizes[3]


def test_trls_batch_settings_are_refused_in_trls_words(tmp_path):
    with pytest.raises(SettingsError, match="^generation_batch_size \\(6\\) must be divisible by num_generations \\(4\\)$"):
        grpo_args(tmp_path, steps_per_generation=None, generation_batch_size=6, per_device_train_batch_size=2,
                  gradient_accumulation_steps=1)


def test_several_optimizer_steps_per_generation_batch_count_as_trl_counts_them(tmp_path, model_dir, monkeypatch):
    """2 iterations × (4 / 2) minibatches = 4 optimizer steps per generation batch; max_steps 7 ends inside the second
    batch, which takes 3. The linear schedule moves after every optimizer step, each callback sees each step, and
    a save asked for at step 5 happens at the batch's end (step 7)."""
    lrs, orders = [], []
    real_step = torch.optim.AdamW.step

    def recording_step(self, *a, **k):
        lrs.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    real_micro = T.micro_batches

    def recording_micro(order, *a, **k):
        orders.append(list(order))
        return real_micro(order, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    monkeypatch.setattr(T, "micro_batches", recording_micro)
    events = Events()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=prompts(), callbacks=[events],
                          args=grpo_args(tmp_path, save_strategy="steps", save_steps=5))
    assert (trainer.sizes.steps_per_iteration, trainer.sizes.num_total_batches, trainer.state.max_steps) == (4, 2, 7)
    output = trainer.train()
    assert trainer.state.global_step == output.global_step == 7 and trainer.iterations_done == 2
    # two generation batches of per_device_train_batch_size × steps_per_generation = 16 completions (TRL's), each
    # optimizer step per_device_train_batch_size × gradient_accumulation_steps = 8 of them in 2 micro-batches
    assert trainer.state.episode == 32 and trainer.sizes.local_mini_batch_size == 8
    assert trainer.sizes.micro_steps == 2
    assert events.ends == [1, 2, 3, 4, 5, 6, 7] and events.begins == [0, 1, 2, 3, 4, 5, 6]
    assert lrs == pytest.approx([1e-3 * (1 - k / 7) for k in range(7)])  # transformers' linear schedule over 7
    # each generation batch shuffled once, its two minibatches walked in that order on both passes
    assert len(orders) == 4 and orders[0] == orders[1] and orders[2] == orders[3] and orders[0] != orders[2]
    assert [s for s, _ in checkpoints(str(tmp_path / "out"))] == [7]
    rows = trainer.state.log_history
    logged = [row["step"] for row in rows if "loss" in row]
    assert logged == [3, 6]  # one row per logging_steps (3) optimizer steps, as transformers logs them
    assert "train_loss" in rows[-1] and rows[-1]["step"] == 7 and "loss" not in rows[-1]


def test_ppo_counting_is_unchanged(tmp_path, model_dir):
    """PPOConfig keeps TRL PPO's: global_step counts iterations, the schedule steps once per iteration."""
    from fastppo import PPOConfig, PPOTrainer

    args = PPOConfig(output_dir=str(tmp_path / "ppo"), advantage_estimator="grpo", num_generations=4,
                     per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2,
                     num_ppo_epochs=2, response_length=5, max_steps=2, save_strategy="no", bf16=False,
                     disable_tqdm=True, gradient_checkpointing=False, report_to="none", stop_token="eos")
    trainer = PPOTrainer(args=args, model=model_dir, reward_model=length_reward, train_dataset=prompts())
    assert not trainer.sizes.counts_optimizer_steps and trainer.sizes.total_steps == 2
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.lr_scheduler.last_epoch == 2


def test_the_adaptive_entropy_controller_is_trls():
    """TRL 1.16: the first step applies no bonus (no entropy measured yet); then c_H while the last step's entropy
    is at most the target, else 0; c_H moves by δ within [c_min, c_max] after each step."""
    ctl = AdaptiveEntropyController(0.3, target=1.0, delta=0.25, minimum=0.1, maximum=0.6)
    applied = []
    for entropy in (0.5, 0.7, 2.0, 3.0, 0.9, 0.2):
        applied.append(ctl.applied())
        ctl.update(entropy)
    assert applied == pytest.approx([0.0, 0.55, 0.6, 0.0, 0.0, 0.35])  # 0.35: 0.1 + δ after the 0.9
    assert ctl.value == pytest.approx(0.6) and ctl.last_entropy == 0.2


@pytest.mark.parametrize("target,direction", [(50.0, 1), (0.0, -1)])
def test_the_adaptive_coefficient_moves_once_per_optimizer_step(tmp_path, model_dir, target, direction):
    args = grpo_args(tmp_path, use_adaptive_entropy=True, entropy_coef=0.02, entropy_coef_delta=0.005,
                     entropy_target=target, max_steps=6)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=prompts(), args=args)
    trainer.train()
    assert trainer.entropy_coef == pytest.approx(max(0.02 + direction * 0.005 * 6, 0.0))
    logged = [row for row in trainer.state.log_history if "entropy_coef" in row]
    # TRL logs the coefficient after each step's update; a row (logging_steps 3) holds the mean of steps 4-6
    after = [max(0.02 + direction * 0.005 * k, 0.0) for k in (4, 5, 6)]
    assert [row["step"] for row in logged] == [3, 6] and logged[-1]["entropy_coef"] == pytest.approx(sum(after) / 3)


def test_a_bonus_the_gate_holds_shut_changes_nothing(tmp_path, model_dir):
    """With the entropy above the target every step, the applied coefficient is 0: the weights are those of a run
    without the bonus."""
    runs = []
    for name, kw in (("gated", dict(use_adaptive_entropy=True, entropy_coef=0.5, entropy_target=0.0)),
                     ("plain", dict(entropy_coef=0.0))):
        trainer = GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=prompts(),
                              args=grpo_args(tmp_path, name, max_steps=4, **kw))
        trainer.train()
        runs.append(digest(trainer.policy.state_dict()))
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_a_resume_between_generation_batches_equals_the_whole_run(tmp_path, model_dir):
    """Saved after the first generation batch (step 4 of 7), resumed: the weights, the schedule, the adaptive
    coefficient and the logs are the uninterrupted run's."""
    # a row every 2 steps: none spans the resume at step 4 (TRL's, like transformers' running loss, would start
    # afresh there)
    kw = dict(use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=50.0, logging_steps=2)
    whole = GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=prompts(),
                        args=grpo_args(tmp_path, "whole", **kw))
    whole.train()

    class StopAt4(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 4

    cut = GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=prompts(), callbacks=[StopAt4()],
                      args=grpo_args(tmp_path, "cut", save_strategy="steps", save_steps=100, **kw))
    cut.train()
    assert [s for s, _ in checkpoints(str(tmp_path / "cut"))] == [4]
    resumed = GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=prompts(),
                          args=grpo_args(tmp_path, "cut", resume_from_checkpoint="latest", **kw))
    resumed.train()
    assert resumed.state.global_step == 7 and resumed.iterations_done == 2
    assert digest(resumed.policy.state_dict()) == digest(whole.policy.state_dict())
    assert resumed.entropy_coef == whole.entropy_coef and resumed.lr_scheduler.last_epoch == 7

    def logged(trainer):
        return [(r["step"], r["loss"], r.get("num_tokens"), r["learning_rate"], r["epoch"])
                for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    assert logged(resumed) == logged(whole) and not math.isnan(logged(whole)[-1][1])


def test_logging_strategy_epoch_writes_a_row_at_each_epoch_end(tmp_path, model_dir):
    """transformers' logging_strategy="epoch": a row where an epoch of the prompts ends (here every generation
    batch of 4 steps: 4 prompts × 4 completions), none between."""
    data = datasets.Dataset.from_dict({"prompt": ["the movie was", "i think the plot is", "overall the cast",
                                                  "the ending felt"]})
    args = grpo_args(tmp_path, max_steps=8, logging_strategy="epoch", logging_steps=500)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=data, args=args)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in rows] == [4, 8] and [r["epoch"] for r in rows] == pytest.approx([1.0, 2.0])
