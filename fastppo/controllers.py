"""The coefficients the run moves as it goes: the KL penalty's β (fixed, or legacy TRL's adaptive controller) and TRL
GRPO's adaptive entropy coefficient. ``build`` makes them, ``train`` reads and updates them, ``checkpoint`` saves
the entropy coefficient's state."""
from __future__ import annotations

import math


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Legacy TRL / Ziegler et al. (2019) controller: e = clip(KL/target − 1, −0.2, 0.2);
    β ← β·(1 + e·n_steps/horizon), with n_steps the episodes of the iteration."""

    def __init__(self, kl_coef: float, target: float, horizon: float):
        self.value, self.target, self.horizon = kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class AdaptiveEntropyController:
    """TRL GRPO's adaptive entropy coefficient (``use_adaptive_entropy``): each optimizer step applies c_H while the
    previous step's entropy H (every process's trained tokens, the bonus's mask) is at most ``target``, else 0 (no
    step before the first measurement); after the step, c_H ← min(c_H + δ, c_max) where H ≤ target, else
    max(c_H − δ, c_min)."""

    def __init__(self, coef: float, target: float, delta: float, minimum: float, maximum: float):
        self.value, self.target, self.delta, self.minimum, self.maximum = coef, target, delta, minimum, maximum
        self.last_entropy = math.inf

    def applied(self) -> float:
        return self.value if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        self.value = (min(self.value + self.delta, self.maximum) if entropy <= self.target
                      else max(self.value - self.delta, self.minimum))
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"value": self.value, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.last_entropy = state["value"], state["last_entropy"]
