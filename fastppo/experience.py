"""What steps 2-4 hand the update: ``Experience`` (the rollout as π_θ_old, π_ref and V saw it, step 2) and
``Targets`` (what the update regresses to, steps 3-4). Records of their own, below both ``train`` (which makes
them) and ``update_steps`` (which reads them), so that neither imports the other's floor (issue 63 item 8)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Experience:
    """The rollout as π_θ_old, π_ref and V saw it: [B, T] each, 0 on untrained positions (KL, V)."""

    logprobs: torch.Tensor  # log π_θ_old(y_t)
    ref_logprobs: torch.Tensor | None  # log π_ref(y_t); None when no KL is computed (no reference is held)
    values: torch.Tensor | None  # V(s_t); None for the critic-free estimators
    kl: torch.Tensor  # per-token KL estimate (0 without a reference)


@dataclass(frozen=True)
class Targets:
    """What the update regresses to: [B, T] each, 0 on untrained positions."""

    rewards: torch.Tensor
    non_score_reward: torch.Tensor
    advantages: torch.Tensor  # GAE's whitened over trained tokens; a critic-free one per the estimator
    returns: torch.Tensor | None  # the value model's regression target; None without a critic
