"""What TRL GRPO's policy-loss settings make of each token, for step 5 (``fastppo.train.ppo_losses``):

* ``loss_type``'s aggregation, as token weights and a normaliser (``policy_loss_weights``);
* the per-token surrogate each ``loss_type`` asks for, with the off-policy sequence mask (``surrogate_options``;
  the surrogates and the mask themselves are ``fastppo.kernels.clipped_surrogate``'s);
* ``top_entropy_quantile``'s token mask (``high_entropy_mask``): the micro-batch's entropy quantile.

Each against TRL 1.16's ``GRPOTrainer._compute_loss`` in tests/test_trl1_loss_match.py."""
from __future__ import annotations

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


# TRL GRPO's loss_types with a token loss of their own: fastppo.kernels.clipped_surrogate's surrogates
SURROGATE_OF_LOSS_TYPE = {"cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}


def surrogate_options(config: PPOConfig) -> dict:
    """The per-token policy loss the config asks for, as keywords of ``clipped_surrogate`` (beyond ε and the
    sequences), of ``ppo_losses`` and of ``fused_ppo_policy_loss``: the clip's upper side (cispo's ε_max), δ, the
    surrogate with sapo's temperatures and vespo's (k₊, λ₊, k₋, λ₋), and the off-policy sequence mask."""
    return dict(cliprange_high=config.epsilon_high, delta=config.delta,
                surrogate=SURROGATE_OF_LOSS_TYPE.get(config.loss_type, "clip"),
                sapo_temperature_pos=config.sapo_temperature_pos, sapo_temperature_neg=config.sapo_temperature_neg,
                vespo_gamma=(config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg, config.vespo_lambda_neg),
                off_policy_mask_threshold=config.off_policy_mask_threshold)


def reads_whole_sequences(config: PPOConfig) -> bool:
    """Whether a token's policy term needs its whole completion: the sequence level (GSPO), vespo's weight, the
    off-policy mask. The fused loss then takes the completions' lengths."""
    return (config.importance_sampling_level != "token" or config.loss_type == "vespo"
            or config.off_policy_mask_threshold is not None)


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
        counts = torch.cat(fdist.all_gather([torch.empty_like(count) for _ in range(world)], count)).tolist()
        padded = values.new_zeros(max(counts))  # one host read of the counts above
        padded[: values.numel()] = values
        parts = fdist.all_gather([torch.empty_like(padded) for _ in range(world)], padded)
        values = torch.cat([part[:n] for part, n in zip(parts, counts)])
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
