"""TRL GRPO's ``loss_type``, one row each of ``LOSS_TYPES``: how an optimizer step aggregates its token losses, and
which token loss ``fastppo.kernels.clipped_surrogate`` computes for it. The config (its choices and help), the checks
(δ, the settings each one reads, the sequence-level notes), ``policy_terms`` (the surrogate, whether a token needs
its whole completion) and the update (``policy_loss_weights``) all read this table: a loss type that only
aggregates differently is one row here; a new aggregation is one more branch of ``policy_loss_weights``.

Each against TRL 1.16's ``GRPOTrainer._compute_loss`` in tests/test_trl1_loss_match.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossType:
    """One ``loss_type``: its aggregation (a branch of ``policy_loss_weights``), its token loss (a surrogate of
    ``clipped_surrogate``: "clip", "cispo", "sapo" or "vespo"), the settings only it reads, and what it asks of the
    rest of the update."""

    aggregation: str
    surrogate: str = "clip"
    reads: tuple[str, ...] = ()
    clips: bool = True  # its token loss clips the ratio (δ bounds that clip; cispo, sapo and vespo have none)
    whole_sequences: bool = False  # a token's loss needs its whole completion (vespo's weight of the sequence ratio)
    per_sequence: bool = False  # weighs each completion once: a sequence-level ratio's aggregation (GSPO's grpo)
    summary: str = ""  # what it does and whose it is: the config's help lists it


_VESPO = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
LOSS_TYPES: dict[str, LossType] = {
    "bnpo": LossType("micro_batch_token_mean", summary="a token mean per micro-batch: TRL 0.26 PPO's, the default "
                     "for gae"),
    "dapo": LossType("rollout_token_sum", summary="the token sum divided by the active tokens of the whole rollout "
                     "batch on all processes, spread evenly over the optimizer steps: TRL GRPO's default, the "
                     "default of the critic-free estimators"),
    "grpo": LossType("sequence_token_mean", per_sequence=True, summary="each sequence's token mean, then the mean "
                     "over sequences"),
    "dr_grpo": LossType("sequence_sum_over_length", summary="the token sum divided by sequences × response_length"),
    "cispo": LossType("rollout_token_sum", surrogate="cispo", clips=False, summary="−sg(min(ρ, epsilon_high))·A·log "
                      "π, epsilon_high being ε_max itself, > 1, 5.0 recommended; aggregated as dapo: "
                      "MiniMax-M1/ScaleRL"),
    "sapo": LossType("sequence_token_mean", surrogate="sapo", clips=False, per_sequence=True,
                     reads=("sapo_temperature_pos", "sapo_temperature_neg"), summary="a sigmoid gate "
                     "−A·σ(τ(ρ − 1))·4/τ in place of the clip, τ the sapo_temperature of A's sign; aggregated as grpo"),
    "luspo": LossType("sequence_sum", per_sequence=True, summary="each sequence's token sum, then the mean over "
                      "sequences: LUSPO, meant with importance_sampling_level sequence"),
    "vespo": LossType("rollout_token_sum", surrogate="vespo", clips=False, whole_sequences=True, reads=_VESPO,
                      summary="−sg(φ(w))·A·log π, φ a gamma weight of the completion's ratio w = exp Σ log ρ, the "
                      "vespo_k/lambda of A's sign; aggregated as dapo"),
}


def loss_types_help() -> str:
    """Every row, as the config's ``loss_type`` help lists them."""
    return "; ".join(f"{name} ({row.summary})" for name, row in LOSS_TYPES.items())


def loss_type_row(loss_type: str) -> LossType:
    """``loss_type``'s row; an unknown name is a ``ValueError`` naming the choices."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    return LOSS_TYPES[loss_type]


def divides_by_rollout_tokens(loss_type: str) -> bool:
    """Whether ``loss_type``'s normaliser is the rollout's active tokens on every process (``rollout_tokens``)."""
    return loss_type_row(loss_type).aggregation == "rollout_token_sum"


def policy_loss_weights(loss_type: str, mask: torch.Tensor, response_length: int, rollout_tokens):
    """TRL GRPO's ``loss_type`` for one micro-batch of [b, T] ``mask``, as the token weights u and normaliser d of
    ``fastppo.kernels.ppo_loss``'s (P4) (None: the mask, and max(Σ mask, 1)). Each micro-batch's loss is on the
    scale of the optimizer step's (the update divides it by the micro-steps), and DDP averages the processes'
    gradients, so by the row's aggregation:

    * micro_batch_token_mean (bnpo): the micro-batch's token mean (TRL 0.26 PPO's aggregation, TRL GRPO's bnpo);
    * sequence_token_mean (grpo, sapo): each sequence's token mean, then the mean over the micro-batch's sequences
      (those with no trained token count, as in TRL);
    * sequence_sum_over_length (dr_grpo): the token sum over sequences × response_length (TRL's
      max_completion_length);
    * rollout_token_sum (dapo, cispo, vespo): the token sum over ``rollout_tokens``, the active tokens of the whole
      rollout on every process divided by the micro-batches that cover it (processes × minibatches × micro-steps):
      the step's gradient is then its tokens' sum over the mean active tokens per step, however the batch was split
      (TRL GRPO's num_items_in_batch);
    * sequence_sum (luspo): each sequence's token sum, then the mean over the micro-batch's sequences.
    """
    aggregation = loss_type_row(loss_type).aggregation
    if aggregation == "micro_batch_token_mean":
        return None, None
    rows = float(mask.shape[0])
    if aggregation == "sequence_token_mean":
        per_row = mask.sum(1, keepdim=True).clamp(min=1)
        return mask / per_row, rows
    if aggregation == "sequence_sum_over_length":
        return None, rows * response_length
    if aggregation == "sequence_sum":
        return None, rows
    if aggregation == "rollout_token_sum":
        if rollout_tokens is None:  # not a micro-batch token mean in disguise
            raise ValueError(f"loss_type {loss_type!r} divides by the rollout's active tokens: rollout_tokens is "
                             "needed")
        return None, rollout_tokens
    raise ValueError(f"loss_type {loss_type!r}: unknown aggregation {aggregation!r}")
