"""What TRL GRPO's policy-loss settings make of each token, for step 5 (``fastppo.train.ppo_losses``):

* ``loss_type``'s aggregation, as token weights and a normaliser (``policy_loss_weights``);
* the per-token surrogate each ``loss_type`` asks for (``surrogate_options``; the surrogates themselves are
  ``fastppo.kernels.clipped_surrogate``'s, and VESPO's weights, which need a whole completion, are
  ``vespo_weights``);
* the token masks: ``top_entropy_quantile`` (``high_entropy_mask``) and ``off_policy_mask_threshold``
  (``off_policy_keep_mask``).

Each against TRL 1.16's ``GRPOTrainer._compute_loss`` in tests/test_trl1_loss_match.py."""
from __future__ import annotations

import math

import torch

from fastppo import dist as fdist
from fastppo.config import PPOConfig

GLOBAL_TOKEN_LOSS_TYPES = ("dapo", "cispo", "vespo")  # divided by the rollout's active tokens (dapo_tokens)


def policy_loss_weights(loss_type: str, mask: torch.Tensor, response_length: int, dapo_tokens):
    """TRL GRPO's ``loss_type`` for one micro-batch of [b, T] ``mask``, as the token weights u and normaliser d of
    ``fastppo.kernels.ppo_loss``'s (P4) (None: the mask, and max(Σ mask, 1)). Each micro-batch's loss is on the
    scale of the optimizer step's (the update divides it by the micro-steps), and DDP averages the processes'
    gradients, so:

    * bnpo: the micro-batch's token mean (TRL 0.26 PPO's aggregation, and TRL GRPO's bnpo);
    * grpo: each sequence's token mean, then the mean over the micro-batch's sequences (those with no trained
      token count, as in TRL);
    * dr_grpo: the token sum over sequences × response_length (TRL's max_completion_length);
    * dapo: the token sum over ``dapo_tokens``, the active tokens of the whole rollout on every process divided
      by the micro-batches that cover it (processes × minibatches × micro-steps): the step's gradient is then its
      tokens' sum over the mean active tokens per step, however the batch was split (TRL GRPO's
      num_items_in_batch);
    * luspo: each sequence's token sum, then the mean over the micro-batch's sequences;
    * cispo and vespo, sapo: dapo's, grpo's, as TRL aggregates them (their token losses differ: ``surrogate_options``).
    """
    if loss_type == "bnpo":
        return None, None
    rows = float(mask.shape[0])
    if loss_type in ("grpo", "sapo"):
        per_row = mask.sum(1, keepdim=True).clamp(min=1)
        return mask / per_row, rows
    if loss_type == "dr_grpo":
        return None, rows * response_length
    if loss_type == "luspo":
        return None, rows
    if loss_type in GLOBAL_TOKEN_LOSS_TYPES:
        if dapo_tokens is None:  # not a micro-batch token mean in disguise
            raise ValueError(f"loss_type {loss_type!r} divides by the rollout's active tokens: dapo_tokens is needed")
        return None, dapo_tokens
    raise ValueError(f"unknown loss_type {loss_type!r}")


# TRL GRPO's loss_types with a token loss of their own: fastppo.kernels.clipped_surrogate's surrogates, and vespo
# (``vespo_weights``: its weights need each completion's whole ratio, which the fused kernel's rows do not have)
SURROGATE_OF_LOSS_TYPE = {"cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}


def surrogate_options(config: PPOConfig) -> dict:
    """The per-token policy loss the config asks for, as keywords of ``clipped_surrogate`` (beyond ε), of
    ``ppo_losses`` and of ``fused_ppo_policy_loss``: the clip's upper side (cispo's ε_max), δ, and the
    surrogate with sapo's temperatures."""
    options = dict(cliprange_high=config.epsilon_high, delta=config.delta,
                   surrogate=SURROGATE_OF_LOSS_TYPE.get(config.loss_type, "clip"),
                   sapo_temperature_pos=config.sapo_temperature_pos, sapo_temperature_neg=config.sapo_temperature_neg)
    if config.loss_type == "vespo":  # ppo_losses' own (the fused loss refuses it)
        options["vespo_gamma"] = (config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg,
                                  config.vespo_lambda_neg)
    return options


VESPO_LOG_W_MIN = math.log(1e-8)  # VESPO's (and TRL's) floor of log w


def vespo_weights(new_logprobs, old_logprobs, advantages, mask, gamma: tuple[float, float, float, float]):
    """[b, T] VESPO's φ(w) = exp(λ + k·log w − λ·w) (TRL GRPO's ``get_gamma_weights``; 1 at w = 1), without
    gradient: w is the row's ratio exp(Σ_t clamp(log ρ_t, ±20)) over its trained tokens, log w clamped to
    [log 1e-8, 20]; (k, λ) = ``gamma``'s (k₊, λ₊) where A >= 0, else (k₋, λ₋), λ at least 1e-4. An overflow is 0."""
    k_pos, lambda_pos, k_neg, lambda_neg = gamma
    real = mask != 0
    zero = torch.zeros((), dtype=new_logprobs.dtype, device=new_logprobs.device)
    log_ratio = torch.where(real, (new_logprobs.detach() - old_logprobs).clamp(-20.0, 20.0), zero)
    log_w = log_ratio.sum(1, keepdim=True).clamp(VESPO_LOG_W_MIN, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


QUANTILE_LIMIT = 1 << 24  # torch.quantile refuses more values; past it the same interpolation over a sort


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """TRL GRPO's ``top_entropy_quantile`` ("Beyond the 80/20 Rule"): [b, T] bool, the trained tokens whose
    entropy is at least the (1 − quantile) quantile (``torch.quantile``'s linear interpolation) of the entropies
    of this micro-batch's trained tokens on every process; none when no process has a trained token."""
    real = mask != 0
    entropy = entropy.detach().to(torch.promote_types(entropy.dtype, torch.float32))
    values = entropy[real]
    if fdist.is_distributed():  # every process's values: their counts first, then the values padded to the most
        world = torch.distributed.get_world_size()
        count = torch.tensor([values.numel()], device=values.device)
        counts = fdist.all_gather([torch.empty_like(count) for _ in range(world)], count)
        padded = values.new_zeros(int(max(c.item() for c in counts)))
        padded[: values.numel()] = values
        parts = fdist.all_gather([torch.empty_like(padded) for _ in range(world)], padded)
        values = torch.cat([part[: int(c.item())] for part, c in zip(parts, counts)])
    if values.numel() == 0:
        return torch.zeros_like(real)
    level = torch.tensor(1.0 - quantile, dtype=values.dtype, device=values.device)
    if values.numel() <= QUANTILE_LIMIT:
        threshold = torch.quantile(values, level)
    else:  # the same linear interpolation over the sorted values
        ordered = values.sort().values
        position = level * (values.numel() - 1)
        low = position.floor().long()
        high = torch.clamp(low + 1, max=values.numel() - 1)
        threshold = ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    return real & (entropy >= threshold)


def off_policy_keep_mask(new_logprobs, old_logprobs, advantages, mask, threshold: float) -> torch.Tensor:
    """TRL GRPO's ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence masking): [b, T] bool, the
    tokens whose advantage is >= 0 or whose row's mean of log π_θ_old − log π_θ over its trained tokens is at most
    ``threshold``; the others leave the policy term."""
    real = mask != 0
    zero = torch.zeros((), dtype=new_logprobs.dtype, device=new_logprobs.device)
    kl = torch.where(real, old_logprobs - new_logprobs.detach(), zero)
    mean_kl = kl.sum(1, keepdim=True) / real.sum(1, keepdim=True).clamp(min=1)
    return (advantages >= 0) | (mean_kl <= threshold)
