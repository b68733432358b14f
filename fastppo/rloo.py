"""TRL 1.16's ``RLOOConfig`` and ``RLOOTrainer`` on fastppo's trainer: ``from fastppo import RLOOConfig, RLOOTrainer``.

TRL 1.16's RLOO, and how fastppo runs it:

* the reward: the weighted sum of the reward functions, clamped to ``reward_clip_range``, minus β times the
  completion's summed per-token KL, log π_θ_old − log π_ref (the k1 estimate, in the reward: fastppo's
  ``kl_coef`` with ``kl_estimator="k1"``; TRL's ``beta`` means this here, where GRPO's means a KL in the loss);
* the advantage: the leave-one-out baseline over the completion's group (``advantage_estimator="rloo"``),
  standardised over the batch with ``normalize_advantages``;
* the loss: one ratio per completion, exp(Σ_t log π_θ − log π_θ_old) over its tokens, clipped at
  [1 − ε, 1 + ε_high], −min(ρ·A, clip(ρ)·A) per completion and the mean over the completions
  (``importance_sampling_level="sequence_sum"`` with ``loss_type="grpo"``: the per-token loss is the
  completion's, so the per-completion token mean is that loss);
* the logs: TRL's names, ``kl`` the token mean of the reward's KL.

Everything else is ``GRPOTrainer``'s (``fastppo.grpo``): the constructor, the reward-function contract,
``evaluate()``, the datasets, and the settings refused by name.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import field

from fastppo.grpo import GRPOConfig, GRPOTrainer

# TRL 1.16 RLOOConfig's defaults where GRPOConfig's differ, and the engine settings that make TRL RLOO's
# reward, advantage and loss (fastppo's own fields, set here so that the config shows them)
RLOO_DEFAULTS = {
    "num_generations": (int | None, 2),
    "beta": (float, 0.05),
    "advantage_estimator": (str, "rloo"),
    "importance_sampling_level": (str, "sequence_sum"),
    "loss_type": (str, "grpo"),
}

RLOOConfig = dataclasses.make_dataclass(
    "RLOOConfig",
    [(name, kind, field(default=default, metadata={"help": f"TRL 1.16 RLOOConfig's (default {default!r})."}))
     for name, (kind, default) in RLOO_DEFAULTS.items()],
    bases=(GRPOConfig,),
    namespace={"__doc__": "TRL 1.16's RLOOConfig: GRPOConfig with TRL RLOO's defaults; beta is the KL in the reward "
                          "(fastppo.rloo)."},
)
RLOOConfig.__module__ = __name__


class RLOOTrainer(GRPOTrainer):
    """TRL 1.16's ``RLOOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config)`` on fastppo's trainer (module docstring).
    ``trainer.args`` is the config as given; the trainer runs a copy whose ``kl_coef`` is ``args.beta`` (the KL in
    the reward) and whose in-loss ``beta`` is 0."""

    config_class = RLOOConfig
    run_suffix = "RLOO"

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None):
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, quantization_config, peft_config)

    @staticmethod
    def _engine_config(args):
        engine = copy.copy(args)
        engine.kl_coef, engine.kl_estimator, engine.beta = args.beta, "k1", 0.0
        return engine
