"""The run's batch sizes, derived once from the config (TRL 0.17-0.26's formulas: rollout, minibatch and
micro-batch rows per process and in all, iterations, what ``global_step`` counts), and the logging and saving
cadence as transformers reads it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

from fastppo.errors import SettingsError


class SizeSettings(Protocol):
    """The config's settings the sizes are derived from (``PPOConfig`` has them all). A protocol, not
    ``PPOConfig``: ``Sizes`` is read on floors below the config's (the micro-batch cuts), and a type-only import
    of the config would lift it, and them, above it (issue 63 item 8)."""

    ROLLOUT_STEPS: ClassVar[str]  # the field that multiplies a process's rollout (TRL PPO's or TRL GRPO's name)
    COUNTS_OPTIMIZER_STEPS: ClassVar[bool]  # global_step counts optimizer steps (TRL GRPO's), not iterations
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_mini_batches: int
    num_ppo_epochs: int
    num_generations: int
    total_episodes: int | None
    num_train_epochs: float
    max_steps: int
    num_sample_generations: int


@dataclass(frozen=True)
class Sizes:
    """Every batch size of the run, derived once (names as TRL's PPOConfig)."""

    world_size: int
    local_batch_size: int  # rollout rows per process per iteration
    batch_size: int  # rollout rows per iteration, all processes
    local_mini_batch_size: int  # rows per process per optimizer step
    mini_batch_size: int
    local_micro_batch_size: int  # rows per process per forward/backward (the config's micro_batch_size: all processes)
    micro_steps: int  # backward passes per optimizer step
    num_mini_batches: int  # optimizer steps per PPO epoch
    num_total_batches: int  # PPO iterations
    sample_generations_freq: int  # iterations between sample tables (0: never)
    num_generations: int = 1  # completions per prompt, side by side in the rollout (a group never spans processes)
    local_prompts: int = 0  # prompts per process per iteration: local_batch_size / num_generations
    # what global_step counts: iterations (TRL PPO: one per generation batch, steps_per_iteration 1), or optimizer
    # steps (TRL GRPO: num_ppo_epochs × num_mini_batches per generation batch, the schedule stepped after each)
    counts_optimizer_steps: bool = False
    steps_per_iteration: int = 1
    total_steps: int = 0  # where global_step ends: max_steps, or num_total_batches × steps_per_iteration


def exact_div(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b:
        raise SettingsError(f"{what}: {a} is not divisible by {b}")
    return a // b


def derive_sizes(config: SizeSettings, world_size: int, num_prompts: int) -> Sizes:
    """All sizes from the flags (TRL 0.17-0.26's formulas; a GRPOConfig's rollout is TRL GRPO's generation
    batch, ``per_device_train_batch_size × steps_per_generation``, of ``num_mini_batches`` =
    ``steps_per_generation / gradient_accumulation_steps`` optimizer steps); raises ValueError on any inexact
    split."""
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs"):
        if getattr(config, name) < 1:
            raise SettingsError(f"{name} must be >= 1, got {getattr(config, name)}")
    # a process's rollout: per_device_train_batch_size rows × ROLLOUT_STEPS (TRL PPO's gradient_accumulation_steps,
    # TRL GRPO's steps_per_generation), named in the messages by the settings the user wrote
    rollout_steps = config.ROLLOUT_STEPS
    local_batch_size = config.per_device_train_batch_size * getattr(config, rollout_steps)
    rollout = f"per_device_train_batch_size × {rollout_steps} = {local_batch_size}"
    local_mini = exact_div(
        local_batch_size,
        config.num_mini_batches,
        f"the rollout per process ({rollout}) must be divisible by num_mini_batches",
    )
    k = config.num_generations
    if not isinstance(k, int) or k < 1:
        raise SettingsError(f"num_generations must be an integer >= 1, got {k!r}")
    local_prompts = exact_div(
        local_batch_size, k,
        f"num_generations ({k} completions per prompt) must divide the rollout batch per process ({rollout}): a "
        "prompt's group stays in one process")
    micro = min(config.per_device_train_batch_size, local_mini)
    micro_steps = exact_div(
        local_mini,
        micro,
        f"each minibatch ({local_mini} rows = {rollout} / num_mini_batches) must be a whole number of "
        "per_device_train_batch_size micro-batches",
    )
    batch_size = local_batch_size * world_size
    total_episodes = config.total_episodes
    if total_episodes is None:
        total_episodes = int(config.num_train_epochs * num_prompts * k)  # each prompt's k completions
    if total_episodes < 1 and config.max_steps <= 0:
        raise SettingsError(f"total_episodes must be >= 1, got {total_episodes}")
    # TRL GRPO counts optimizer steps (config.COUNTS_OPTIMIZER_STEPS): max_steps of them may end inside the last
    # generation batch's update, which then runs only the steps left
    counted = config.COUNTS_OPTIMIZER_STEPS
    per_iteration = config.num_ppo_epochs * config.num_mini_batches if counted else 1
    if config.max_steps > 0:
        total_steps, num_total_batches = config.max_steps, math.ceil(config.max_steps / per_iteration)
    else:
        num_total_batches = math.ceil(total_episodes / batch_size)
        total_steps = num_total_batches * per_iteration
    freq = max(1, num_total_batches // config.num_sample_generations) if config.num_sample_generations > 0 else 0
    return Sizes(
        world_size=world_size,
        local_batch_size=local_batch_size,
        batch_size=batch_size,
        local_mini_batch_size=local_mini,
        mini_batch_size=local_mini * world_size,
        local_micro_batch_size=micro,
        micro_steps=micro_steps,
        num_mini_batches=config.num_mini_batches,
        num_total_batches=num_total_batches,
        sample_generations_freq=freq,
        num_generations=k,
        local_prompts=local_prompts,
        counts_optimizer_steps=counted,
        steps_per_iteration=per_iteration,
        total_steps=total_steps,
    )


def every(steps: float, total: int) -> int:
    """``logging_steps``/``save_steps`` as transformers reads them: a count, or in (0, 1) a fraction of ``total``."""
    return max(1, math.ceil(steps * total)) if 0 < steps < 1 else max(1, int(steps))
