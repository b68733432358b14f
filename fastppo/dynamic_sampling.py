"""DAPO's dynamic sampling (verl's ``algorithm.filter_groups``, OpenRLHF's ``--dynamic_filtering``): step 1 as
rounds of the next prompts of the data order, until the batch holds its ``local_prompts`` groups whose completions
differ in ``dynamic_sampling_metric``. A group whose completions all score the same has advantage 0 everywhere
under grpo and rloo: it would cost its share of the step and teach nothing.

What it keeps and drops (verl's ``filter_groups``): groups whole; a group is kept when its completions' metric is
not the same for all of them (max > min over the completions a reward judged: verl's ``std > 0``, without the
rounding of a float std); the batch is the first ``local_prompts`` kept groups in the data order, the surplus of
the last round dropped as verl drops it. ``dynamic_sampling_max_rounds`` bounds the rounds per batch, the first
included (verl's ``max_num_gen_batches``); at the bound with too few groups the batch is completed with the
earliest dropped groups, said in the log and counted (``dynamic_sampling/groups_without_spread_trained``), or
``dynamic_sampling_at_bound="raise"`` raises ``SamplingBoundReached`` on every process, as verl does.

Several processes: each fills its own share of the batch from its own shard of the data order, and the rounds run
in step: after each round one all-reduce says whether any process is still short, and every process samples
another round until none is. A group's tensors never leave the process that sampled them (nothing but two numbers
crosses per round), the per-process batch is exactly what it is without the setting (DDP's optimizer steps stay
equal), and each process's data order is the one it has without the setting, so resuming replays it exactly. The
rounds must run in step anyway: a rollout holds collectives (the tool metrics' all-reduce, ZeRO-3's sampling and
reward models). The cost: a process that is already full samples a round another one needs (its surplus dropped);
gathering every process's groups and sharing them out would save that round's surplus but move every row.

Everything after step 1 sees a batch of the usual shape: the optimizer steps, ``num_iterations``,
``steps_per_generation``, the learning-rate schedule and the logging count trained batches as without the setting.
The prompts a run has drawn (``PPOTrainer.prompt_batches_drawn``) are saved in each checkpoint, so a resume draws
the same next prompts; ``state.epoch`` counts the prompts drawn.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from fastppo import dist as fdist
from fastppo.config import PPOConfig
from fastppo.errors import SettingsError
from fastppo.rollout import ScoredRollout, take_rows
from fastppo.sizes import Sizes

REWARD = "reward"  # dynamic_sampling_metric's name of the summed, weighted reward (TRL GRPO logs it as "reward")
ENVIRONMENTS, EXTRA = "environments", "log_extra/"  # the per-row values that travel with a round's rows


class SamplingBoundReached(RuntimeError):
    """``dynamic_sampling_at_bound="raise"``: the bound on generation rounds was reached with too few groups."""


def group_spread(values: torch.Tensor, k: int) -> torch.Tensor:
    """[B / k] bool: whether each group of ``k`` consecutive ``values`` holds two different ones. NaN (a completion
    no reward judged) is left out: a group with fewer than two judged completions has no spread."""
    v = values.reshape(-1, k).double()
    judged = ~torch.isnan(v)
    highest = torch.where(judged, v, -torch.inf).amax(1)
    lowest = torch.where(judged, v, torch.inf).amin(1)
    return highest > lowest


def metric_values(batch: ScoredRollout, metric: str) -> torch.Tensor:
    """[B] what a group must differ in: the summed reward (``"reward"``), or one reward's own column."""
    return batch.scores if metric == REWARD else batch.reward_columns[metric]


def check_metric(config: PPOConfig, reward_names: Sequence[str]) -> None:
    """``dynamic_sampling_metric`` names the summed reward or one of the run's rewards (checked once the rewards
    are known, before any model loads)."""
    metric = config.dynamic_sampling_metric
    if config.dynamic_sampling and metric != REWARD and metric not in reward_names:
        raise SettingsError(f"dynamic_sampling_metric {metric!r} is neither 'reward' (the summed reward) nor one of "
                            f"this run's rewards ({', '.join(reward_names)})")


class Round(NamedTuple):
    """One round of step 1: its scored rollout, and values of each row that go where the row goes (each rollout's
    environment, the reward functions' ``log_extra`` columns)."""

    batch: ScoredRollout
    rows: dict[str, list]


class Filled(NamedTuple):
    """A filled batch: its rollout, its rows' values (``Round.rows``, only those every round had), and the rounds
    it took."""

    batch: ScoredRollout
    rows: dict[str, list]
    rounds: int


class DynamicSampling:
    """The settings of dynamic sampling for one run, what the last batch took (``last_rounds``) and its metrics until
    they are logged (``take_metrics``)."""

    def __init__(self, config: PPOConfig, sizes: Sizes):
        self.metric, self.max_rounds = config.dynamic_sampling_metric, config.dynamic_sampling_max_rounds
        self.raise_at_bound = config.dynamic_sampling_at_bound == "raise"
        self.groups, self.k, self.world = sizes.local_prompts, sizes.num_generations, sizes.world_size
        self.last_rounds = 1
        self.metrics: dict[str, float] = {}

    @classmethod
    def of(cls, config: PPOConfig, sizes: Sizes) -> DynamicSampling | None:
        return cls(config, sizes) if config.dynamic_sampling else None

    def fill(self, sample_round: Callable[[], Round], device: torch.device, pad_id: int, eos_id: int | None,
             log: Callable[[str], None]) -> Filled:
        """Rounds of ``sample_round`` (the next prompts' rollout) until every process holds ``groups`` groups with
        a spread, or the bound; the batch of the first of them in the data order."""
        rounds: list[Round] = []
        kept: list[tuple[int, int]] = []  # (round, group) in the data order
        dropped: list[tuple[int, int]] = []
        while True:
            rounds.append(sample_round())
            spread = group_spread(metric_values(rounds[-1].batch, self.metric), self.k).tolist()
            for g, has in enumerate(spread):
                (kept if has else dropped).append((len(rounds) - 1, g))
            # one all-reduce per round, every process in step: how many are still short, how many groups are held
            short, held = fdist.all_reduce(torch.tensor([float(len(kept) < self.groups),
                                                         float(min(len(kept), self.groups))], device=device)).tolist()
            if not short:
                break
            if len(rounds) >= self.max_rounds:
                needed = self.groups * self.world
                if self.raise_at_bound:
                    raise SamplingBoundReached(
                        f"dynamic sampling: {int(held)} of the {needed} groups a batch needs have completions that "
                        f"differ in {self.metric!r} after {len(rounds)} generation rounds (dynamic_sampling_max_rounds"
                        "); raise dynamic_sampling_max_rounds, or set dynamic_sampling_at_bound='train' to train on "
                        "what was collected")
                log(f"dynamic sampling: {int(held)} of the {needed} groups a batch needs differ in {self.metric!r} "
                    f"after {len(rounds)} generation rounds (dynamic_sampling_max_rounds): the batch is completed "
                    f"with {needed - int(held)} groups whose completions do not")
                break
        groups = sorted(kept[:self.groups] + dropped[:max(0, self.groups - len(kept))])
        picks = [(r, g * self.k + j) for r, g in groups for j in range(self.k)]
        batch = take_rows([r.batch for r in rounds], picks, pad_id, eos_id)
        names = [name for name in rounds[0].rows if all(name in r.rows for r in rounds)]
        rows = {name: [rounds[r].rows[name][i] for r, i in picks] for name in names}
        self._measure(rounds, batch, len(dropped), max(0, self.groups - len(kept)), device)
        return Filled(batch, rows, len(rounds))

    def _measure(self, rounds: list[Round], batch: ScoredRollout, dropped: int, filled: int,
                 device: torch.device) -> None:
        """The batch's metrics, every process's (one all-reduce): the rounds, the share of the sampled groups
        dropped for having no spread, the groups without one trained at the bound, the completion tokens sampled
        per completion token trained (the model's own tokens, the rollouts' trained mask), and the mean summed
        reward of every completion sampled (the policy's, where ``reward`` is the kept groups')."""
        sampled_tokens = sum(int(r.batch.rollout.response_mask.sum()) for r in rounds)
        scores = torch.cat([r.batch.scores.double().cpu() for r in rounds])
        judged = ~torch.isnan(scores)
        totals = fdist.all_reduce(torch.tensor([len(rounds) * self.groups, dropped, filled, sampled_tokens,
                                                int(batch.rollout.response_mask.sum()), float(scores[judged].sum()),
                                                int(judged.sum())], dtype=torch.float64, device=device)).tolist()
        groups, dropped_all, filled_all, sampled, trained, reward_sum, reward_count = totals
        self.last_rounds = len(rounds)
        self.metrics = {"dynamic_sampling/generation_rounds": float(len(rounds)),
                        "dynamic_sampling/frac_groups_dropped": dropped_all / groups,
                        "dynamic_sampling/groups_without_spread_trained": filled_all,
                        "dynamic_sampling/sampled_per_trained_token": sampled / max(trained, 1.0),
                        "dynamic_sampling/sampled_reward_mean": reward_sum / reward_count if reward_count
                        else float("nan")}

    def take_metrics(self) -> dict[str, float]:
        """The last filled batch's metrics, once."""
        metrics, self.metrics = self.metrics, {}
        return metrics


def fill_batch(trainer) -> ScoredRollout:
    """Step 1 of a ``PPOTrainer`` with ``dynamic_sampling`` (its ``dynamic_sampling``): rounds of its ``rollout()``
    (each the next prompts), filled (``DynamicSampling.fill``); the trainer's ``environments`` and the reward
    functions' logged columns are then the kept rows', and ``dynamic_sampling/prompts_consumed`` (every process's
    prompts drawn so far) joins the metrics. This is the trainer's own step 1, kept here for its size: it holds the
    trainer's pool of environments (``environments.Environments.held``) while the batch fills, so that a later round
    takes fresh instances and a kept rollout's environment is the one its round reset and its reward read."""
    pool = trainer._environments

    def sample_round() -> Round:
        batch = trainer.rollout()
        rows = {EXTRA + name: values for name, values in trainer.reward_logs.take_extra(len(batch.scores)).items()}
        if trainer.environments and len(trainer.environments) == len(batch.scores):
            rows[ENVIRONMENTS] = list(trainer.environments)
            pool.held.update(map(id, trainer.environments))
        return Round(batch, rows)

    sampling, tokenizer, sizes = trainer.dynamic_sampling, trainer.tokenizer, trainer.sizes
    tool_rollouts = len(trainer.reward_logs.tool_counts)
    try:
        filled = sampling.fill(sample_round, trainer.device, tokenizer.pad_token_id, tokenizer.eos_token_id,
                               trainer.log)
    finally:
        if pool is not None:
            pool.held.clear()
    trainer.reward_logs.pool_tool_counts(tool_rollouts)  # TRL's tool metrics over every completion sampled
    for name, values in filled.rows.items():
        if name == ENVIRONMENTS:
            trainer.environments = values
        else:
            trainer.reward_logs.log_extra(name[len(EXTRA):], values)
    sampling.metrics["dynamic_sampling/prompts_consumed"] = float(
        trainer.prompt_batches_drawn * sizes.local_prompts * sizes.world_size)
    return filled.batch
