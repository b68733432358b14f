"""What TRL GRPO's policy-loss settings make of each token, for step 5 (``fastppo.train.ppo_losses``):

* the loss's settings, built once from the config and frozen (``LossSettings``);
* the per-token surrogate each ``loss_type`` asks for (its row of ``fastppo.loss_types.LOSS_TYPES``, whose
  ``policy_loss_weights`` is its aggregation), with the off-policy sequence mask (``LossSettings.surrogate_options``;
  the surrogates and the mask themselves are ``fastppo.kernels.clipped_surrogate``'s);
* ``top_entropy_quantile``'s token mask (``high_entropy_mask``): the micro-batch's entropy quantile.

Each against TRL 1.16's ``GRPOTrainer._compute_loss`` in tests/test_trl1_loss_match.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastppo import dist as fdist
from fastppo.config import PPOConfig
from fastppo.kernels.ppo_loss import VESPO_GAMMA
from fastppo.loss_types import loss_type_row


@dataclass(frozen=True)
class LossSettings:
    """Step 5's settings for every micro-batch of a run (``fastppo.train.ppo_losses``), built once from the config
    (``of``) and frozen: the clip ranges and coefficients, legacy TRL's ratio threshold, the in-loss KL (β, its
    estimator, its ratio weighting), the ratio's level, TRL GRPO's entropy mask and the surrogate's options
    (``surrogate_options``). The defaults are TRL 0.26 PPO's."""

    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    ratio_threshold: float = 10.0
    beta: float = 0.0
    kl_loss_type: str = "k3"
    bias_correction_kl: bool = True
    importance_sampling_level: str = "token"
    top_entropy_quantile: float = 1.0
    cliprange_high: float | None = None
    delta: float | None = None
    surrogate: str = "clip"  # clipped_surrogate's: the loss_type's row (fastppo.loss_types)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_gamma: tuple[float, float, float, float] = VESPO_GAMMA
    off_policy_mask_threshold: float | None = None

    @classmethod
    def of(cls, config: PPOConfig) -> LossSettings:
        return cls(cliprange=config.cliprange, cliprange_value=config.cliprange_value, vf_coef=config.vf_coef,
                   ratio_threshold=config.ratio_threshold, beta=config.beta, kl_loss_type=config.kl_loss_type,
                   bias_correction_kl=config.use_bias_correction_kl,
                   importance_sampling_level=config.importance_sampling_level,
                   top_entropy_quantile=config.top_entropy_quantile, cliprange_high=config.epsilon_high,
                   delta=config.delta, surrogate=loss_type_row(config.loss_type).surrogate,
                   sapo_temperature_pos=config.sapo_temperature_pos, sapo_temperature_neg=config.sapo_temperature_neg,
                   vespo_gamma=(config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg,
                                config.vespo_lambda_neg),
                   off_policy_mask_threshold=config.off_policy_mask_threshold)

    def surrogate_options(self) -> dict:
        """The per-token policy loss as keywords of ``clipped_surrogate`` (beyond ε and the sequences) and of
        ``fused_ppo_policy_loss``: the clip's upper side (cispo's ε_max), δ, the surrogate with sapo's temperatures
        and vespo's (k₊, λ₊, k₋, λ₋), and the off-policy sequence mask."""
        return dict(cliprange_high=self.cliprange_high, delta=self.delta, surrogate=self.surrogate,
                    sapo_temperature_pos=self.sapo_temperature_pos, sapo_temperature_neg=self.sapo_temperature_neg,
                    vespo_gamma=self.vespo_gamma, off_policy_mask_threshold=self.off_policy_mask_threshold)


def reads_whole_sequences(config: PPOConfig) -> bool:
    """Whether a token's policy term needs its whole completion: the sequence level (GSPO), vespo's weight, the
    off-policy mask. The fused loss then takes the completions' lengths."""
    return (config.importance_sampling_level != "token" or loss_type_row(config.loss_type).whole_sequences
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
