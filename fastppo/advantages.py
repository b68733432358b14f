"""Step 4, the advantage estimators: each one a function and a row of ``ESTIMATORS``, which the config (its choices
and the defaults each estimator's source sets), the checks (groups, the value model, the settings each one reads)
and the trainer (``estimate_advantages``) all read. Adding an estimator is one function and one row here.

Names are verl's (``algorithm.adv_estimator``); docs/usage.md maps OpenRLHF's and TRL's onto them:

* ``gae``: GAE over a value model's values, whitened over the trained tokens (TRL 0.26's PPO);
* ``rloo``: the leave-one-out baseline over each prompt's ``num_generations`` samples (TRL's RLOOTrainer);
* ``grpo``: each group's mean and std (TRL's GRPOTrainer), or GDPO's per-reward normalisation;
* ``reinforce_plus_plus``: the discounted return of the per-token rewards, whitened over the batch (verl's).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fastppo import dist as fdist
from fastppo.kernels import gae, masked_whiten
from fastppo.kernels.stats import WHITEN_EPS
from fastppo.metrics import nan_std


class AdvantageSettings(Protocol):
    """The config's settings the estimators read (``PPOConfig`` has them all). A protocol, not ``PPOConfig``: the
    config imports this module for its table, and importing the config here, even for annotations, would close an
    import circle (issue 63 item 8)."""

    gamma: float
    lam: float
    whiten_rewards: bool
    num_generations: int
    normalize_advantages: bool
    scale_rewards: str
    multi_objective_aggregation: str
    reward_weights: Sequence[float] | None


def gae_advantages(rewards, values, response_mask, gamma: float, lam: float, whiten_rewards: bool,
                   skip_masked: bool = False):
    """Step 4: GAE and returns; the advantages are whitened over trained tokens (0 elsewhere).

    ``skip_masked``: positions the caller masked inside a response (tool output) are skipped by the
    recursion, which bootstraps across them from the next trained token (verl's multi-turn GAE).
    """
    if whiten_rewards:
        rewards = whiten_trained(rewards, response_mask, shift_mean=False)
    advantages, returns = gae(rewards, values, response_mask, gamma, lam, skip_masked=skip_masked)
    return whiten_trained(advantages, response_mask), returns


# ---------------------------------------------------------------------------- the critic-free estimators
# No value model: each advantage comes from the rewards alone. rloo and grpo compare the num_generations samples of
# one prompt (rows g·k .. g·k + k − 1 of the rollout; a group never spans processes); their sequence reward is the
# sum of step 3's per-token rewards, the score minus kl_coef·Σ_t KL_t (TRL RLOO's KL-in-reward), and the sequence's
# advantage goes to each of its trained tokens. reinforce_plus_plus keeps step 3's per-token rewards.


# The group statistics below are taken in float64 and the advantages rounded back once: a group of equal rewards
# then gets advantages of exactly 0 (k·r is exact in float64, and so is k·r / k), where float32 means an ulp off,
# divided by std + 1e-4, would hand each completion of a prompt-only reward a push of ~1e-3 (a full AdamW step).


def rloo_advantages(sequence_rewards: torch.Tensor, k: int) -> torch.Tensor:
    """[B] A_i = r_i − mean_{j≠i} r_j over the k samples of i's prompt (RLOO; TRL's RLOOTrainer). A NaN reward (no
    reward judged the completion) is left out of its siblings' baselines, as TRL's; its own advantage is NaN (the
    caller makes it 0), as is that of a completion whose group has no other judged one."""
    r = sequence_rewards.view(-1, k).double()
    judged = (~torch.isnan(r)).sum(1, keepdim=True)
    baseline = (r.nansum(1, keepdim=True) - r) / (judged - 1)
    return (r - baseline).view(-1).to(sequence_rewards.dtype)


GRPO_STD_EPS = 1e-4  # TRL GRPO's: a group of equal rewards gets advantage 0, not 0/0


def grpo_advantages(sequence_rewards: torch.Tensor, k: int, scale_rewards: str) -> torch.Tensor:
    """[B] A_i = (r_i − mean_group) / (std + 1e-4) (GRPO; TRL's GRPOTrainer), the std (unbiased) of i's group
    (``scale_rewards="group"``), of the whole batch over every process (``"batch"``), or no division
    (``"none"``: Dr. GRPO). A group of one (an evaluation's ``num_generations_eval=1``) has a std of 0, as in TRL,
    hence advantage 0. A NaN reward (no reward judged the completion) is left out of the means and stds, as TRL's
    nanmean and nanstd leave it; its own advantage is NaN (the caller makes it 0)."""
    r = sequence_rewards.view(-1, k).double()
    centred = (r - r.nanmean(1, keepdim=True)).view(-1)
    if scale_rewards == "none":
        return centred.to(sequence_rewards.dtype)
    if scale_rewards == "group":
        std = (nan_std(r, 1, keepdim=True) if k > 1 else torch.zeros_like(r)).expand(-1, k).reshape(-1)
    elif r.numel() == 1:
        std = torch.zeros_like(centred)
    else:
        _, var = batch_moments(r.view(-1).nan_to_num(0.0), ~torch.isnan(sequence_rewards))
        std = var.sqrt()
    return (centred / (std + GRPO_STD_EPS)).to(sequence_rewards.dtype)


def gdpo_advantages(reward_columns: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    """[B] GDPO (TRL GRPO's ``multi_objective_aggregation="normalize_then_sum"``) from [B, F] each reward's scores
    (NaN where a reward function did not judge) and its [F] weights: each reward centred and scaled by its group's
    mean and unbiased std (+1e-4), ignoring NaNs; their weighted sum, NaNs left out; that sum centred and scaled
    by the whole batch's mean and unbiased std over every process. A group where a reward judged under two
    completions adds nothing of that reward (its std is NaN, as in TRL)."""
    grouped = reward_columns.view(-1, k, reward_columns.shape[1]).double()
    mean = grouped.nanmean(1, keepdim=True)
    judged = (~torch.isnan(grouped)).sum(1, keepdim=True)
    var = ((grouped - mean) ** 2).nanmean(1, keepdim=True) * judged / (judged - 1)
    std = torch.where(judged > 1, var.sqrt(), torch.full_like(var, float("nan")))
    normalised = ((grouped - mean) / (std + GRPO_STD_EPS)).view(reward_columns.shape)
    combined = (normalised * weights.to(normalised.dtype)).nansum(1)
    batch_mean, batch_var = batch_moments(combined, torch.ones_like(combined, dtype=torch.bool))
    return torch.nan_to_num((combined - batch_mean) / (batch_var.sqrt() + GRPO_STD_EPS), nan=0.0).to(
        reward_columns.dtype)


def reinforce_plus_plus_advantages(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float):
    """[B, T] REINFORCE++ (verl's ``reinforce_plus_plus``): the discounted return of step 3's per-token rewards,
    G_t = Σ_l γ^l R_{t+l} (GAE's scan with V = 0 and λ = 1), whitened over the trained tokens of the whole batch,
    every process's. Returns (advantages, returns)."""
    _, returns = gae(rewards, torch.zeros_like(rewards), response_mask, gamma, 1.0)
    mean, var = batch_moments(returns, response_mask)
    if not torch.isfinite(var):  # under two trained tokens in the batch: no spread to scale by
        return torch.zeros_like(returns), returns
    return (returns - mean) * torch.rsqrt(var + WHITEN_EPS) * response_mask, returns


def batch_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of ``x`` over ``mask``'s entries on every process (two all-reduces; NaN
    variance under two entries)."""
    m = mask.to(x.dtype)
    sums = fdist.all_reduce(torch.stack([(x * m).sum(), m.sum()]))
    mean = sums[0] / sums[1]
    squares = fdist.all_reduce(((x - mean) ** 2 * m).sum().reshape(1))[0]
    n = sums[1]
    return mean, torch.where(n > 1, squares / (n - 1), torch.full_like(n, float("nan")))


def whiten_trained(x, mask, shift_mean: bool = True):
    """``masked_whiten`` over the trained tokens, 0 elsewhere. A batch of fewer than two trained tokens (one
    process's batch of one response that stopped at once) has no variance: its single value is centred
    (0, or the value itself when ``shift_mean=False``) instead of raising mid-run, where TRL's NaN would
    end in a skipped step anyway."""
    if int(mask.sum()) >= 2:
        return masked_whiten(x, mask, shift_mean=shift_mean) * mask
    return (x if not shift_mean else torch.zeros_like(x)) * mask


# ---------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: ``estimate(rewards, values, response_mask, config, skip_masked, reward_columns,
    reward_weights)`` -> (advantages [B, T], returns [B, T] or None), and what the rest of fastppo must know of it."""

    estimate: Callable
    critic: bool = False  # reads a value model's values (and trains it): GAE
    grouped: bool = False  # compares each prompt's num_generations samples (2 or more)
    unjudged: bool = False  # a completion no reward judged (NaN score) gets advantage 0, as in TRL; else refused
    reads: tuple[str, ...] = ()  # the config's settings it reads (the others of this table's are named as no-ops)
    defaults: dict = field(default_factory=dict)  # where its source's defaults differ from TRL 0.26 PPO's
    summary: str = ""  # what it does and whose it is: the config's help lists it


def _gae(rewards, values, response_mask, config: AdvantageSettings, skip_masked=False, reward_columns=None,
         reward_weights=None):
    return gae_advantages(rewards, values, response_mask, config.gamma, config.lam, config.whiten_rewards,
                          skip_masked)


def _reinforce_plus_plus(rewards, values, response_mask, config: AdvantageSettings, skip_masked=False,
                         reward_columns=None, reward_weights=None):
    advantages, _ = reinforce_plus_plus_advantages(rewards, response_mask, config.gamma)
    return advantages, None


def _rloo(rewards, values, response_mask, config: AdvantageSettings, skip_masked=False, reward_columns=None,
          reward_weights=None):
    advantage = rloo_advantages(rewards.sum(1), config.num_generations)
    if config.normalize_advantages:  # TRL RLOO's: over the whole batch of every process, judged ones only
        mean, var = batch_moments(advantage.nan_to_num(0.0), ~torch.isnan(advantage))
        advantage = (advantage - mean) / (var.sqrt().nan_to_num(0.0) + GRPO_STD_EPS)
    return _per_token(advantage, response_mask)


def _grpo(rewards, values, response_mask, config: AdvantageSettings, skip_masked=False, reward_columns=None,
          reward_weights=None):
    if config.multi_objective_aggregation == "normalize_then_sum":
        if reward_columns is None:
            raise ValueError("multi_objective_aggregation normalize_then_sum needs each reward's scores "
                             "(reward_columns)")
        return _per_token(gdpo_advantages(reward_columns, reward_weights, config.num_generations), response_mask)
    return _per_token(grpo_advantages(rewards.sum(1), config.num_generations, config.scale_rewards), response_mask)


def _per_token(advantage: torch.Tensor, response_mask: torch.Tensor):
    """A group estimator's [B] sequence advantages on each trained token; a completion no reward judged (NaN)
    carries no signal: advantage 0, as in TRL."""
    return advantage.nan_to_num(0.0)[:, None] * response_mask, None


# Each row's defaults where its source differs from TRL 0.26's PPO: num_generations (TRL 1.16's RLOOConfig 2,
# GRPOConfig 8; one sample per prompt for the others), kl_coef, the per-token KL in the reward (TRL GRPO has none:
# its KL, beta, is in the loss; TRL RLOO's beta is the summed k1 in the reward, which is kl_coef here), and
# loss_type: bnpo is TRL 0.26 PPO's aggregation (a token mean per micro-batch), dapo TRL GRPO's default.
ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(_gae, critic=True, reads=("gamma", "lam", "whiten_rewards", "vf_coef", "cliprange_value"),
                     defaults={"num_generations": 1, "kl_coef": 0.05, "loss_type": "bnpo"},
                     summary="a value model, TRL's PPO"),
    "rloo": Estimator(_rloo, grouped=True, unjudged=True, reads=("normalize_advantages",),
                      defaults={"num_generations": 2, "kl_coef": 0.05, "loss_type": "dapo"},
                      summary="critic-free: the leave-one-out baseline over the num_generations samples of a "
                              "prompt, TRL's RLOO"),
    "grpo": Estimator(_grpo, grouped=True, unjudged=True, reads=("scale_rewards", "multi_objective_aggregation"),
                      defaults={"num_generations": 8, "kl_coef": 0.0, "loss_type": "dapo"},
                      summary="critic-free: the group's mean and std, TRL's GRPO; scale_rewards"),
    "reinforce_plus_plus": Estimator(_reinforce_plus_plus, reads=("gamma",),
                                     defaults={"num_generations": 1, "kl_coef": 0.05, "loss_type": "dapo"},
                                     summary="critic-free: per-token returns of the KL-shaped reward whitened over "
                                             "the batch, verl's"),
}


def estimators_help() -> str:
    """Every row, as the config's ``advantage_estimator`` help lists them."""
    return "; ".join(f"{name} ({row.summary})" for name, row in ESTIMATORS.items())


def reward_columns_of(reward_columns: Mapping[str, torch.Tensor], config: AdvantageSettings, dtype: torch.dtype):
    """GDPO's inputs (``multi_objective_aggregation="normalize_then_sum"``) from each reward's [B] scores (a
    ``ScoredRollout``'s ``reward_columns``): [B, F] the scores and their [F] weights; (None, None) otherwise."""
    if config.multi_objective_aggregation != "normalize_then_sum":
        return None, None
    columns = torch.stack(list(reward_columns.values()), 1).to(dtype)
    return columns, torch.tensor(config.reward_weights or [1.0] * columns.shape[1], device=columns.device)


def estimate_advantages(estimator: str, rewards, values, response_mask, config: AdvantageSettings,
                        skip_masked: bool = False, reward_columns: torch.Tensor | None = None,
                        reward_weights: torch.Tensor | None = None):
    """Step 4 by ``advantage_estimator``: (advantages [B, T], returns [B, T] or None without a critic).
    ``reward_columns`` [B, F] and ``reward_weights`` [F]: each reward's scores and weight, which grpo's
    ``multi_objective_aggregation="normalize_then_sum"`` reads instead of ``rewards``."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage_estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[estimator].estimate(rewards, values, response_mask, config, skip_masked, reward_columns,
                                          reward_weights)
