"""TRL GRPO's log rows: one ``log_history`` row per ``logging_steps`` optimizer steps, as TRL 1.16's
``GRPOTrainer.log`` and transformers' ``Trainer`` write them.

TRL appends each metric to a list when it is measured (the generation's ``reward``, ``completions/*``,
``num_tokens`` once per generation batch; ``entropy``, ``kl``, ``clip_ratio/*`` once per micro-batch;
``step_time`` once per optimizer step), and a log row holds each list's mean (NaNs left out; ``None`` when nothing
valid is left), then empties them: the generation's metrics reach the first row after it, and metrics measured
after the last row reach the summary row at the end of ``train()``. Trainer adds the row's ``loss`` (the mean of
the steps' losses since the last row), the last step's ``grad_norm``, and the ``learning_rate`` that step took.
fastppo's own metrics of a generation batch (``objective/*``, ``policy/*``, ``time/*``, ...) are kept as TRL keeps
the generation's: once per batch, in the first row after it.
"""
from __future__ import annotations

import math

# the metrics of an iteration that TRL GRPO measures per optimizer step or per micro-batch; the rest of the
# iteration's metrics are the generation batch's (``kl`` is the in-loss KL's only where beta is set: TRL RLOO's
# ``kl`` is the reward's, measured at generation)
STEP_METRICS = frozenset({"loss", "grad_norm", "learning_rate", "step_time", "entropy", "policy_loss", "entropy_coef",
                          "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                          "clip_ratio/low_min", "clip_ratio/high_max"})
# set, not appended: TRL keeps the newest count of tokens seen (and a row the newest count of prompts drawn)
REPLACED = frozenset({"num_tokens", "dynamic_sampling/prompts_consumed"})


class StepLogs:
    """What TRL GRPO's trainer holds between log rows (its ``_metrics`` and transformers' ``tr_loss``), and the
    losses of one ``train()`` call (its ``train_loss``)."""

    def __init__(self):
        self.pending: dict[str, list[float]] = {}
        self.losses: list[float] = []  # the steps' losses since the last row (every process's mean)
        self.local_losses: list[float] = []  # the same steps' losses of this process alone
        self.logged_total, self.steps_run = 0.0, 0

    def add_generation(self, metrics: dict[str, float], kl_in_loss: bool) -> None:
        """A generation batch's own metrics, from the iteration's (the per-step ones are added by ``add_step``)."""
        step_names = STEP_METRICS | ({"kl"} if kl_in_loss else set())
        self._add({name: value for name, value in metrics.items() if name not in step_names})

    def add_step(self, step: dict, step_time: float) -> None:
        """One optimizer step's metrics (``metrics.optimizer_step_metrics``) and its seconds."""
        self._add(step["values"])
        self._add({"step_time": step_time})
        self.losses.append(step["loss"])
        self.local_losses.append(step["local_loss"])
        self.steps_run += 1

    def _add(self, values: dict) -> None:
        for name, value in values.items():
            listed = list(value) if isinstance(value, (list, tuple)) else [value]
            if name in REPLACED:
                self.pending[name] = listed
            else:
                self.pending.setdefault(name, []).extend(listed)

    def take(self) -> dict[str, float | None]:
        """Each pending metric's mean over its valid values (None where none is), then nothing pending."""
        means = {}
        for name, values in self.pending.items():
            valid = [float(v) for v in values if v is not None and not math.isnan(float(v))]
            means[name] = sum(valid) / len(valid) if valid else None
        self.pending = {}
        return means

    def row(self, step: dict, epoch: float) -> dict:
        """Transformers' row at a logged step: ``loss`` since the last row, this step's ``grad_norm`` and
        ``learning_rate``, then TRL's pending metrics and the ``epoch``."""
        row = {"loss": sum(self.losses) / len(self.losses), "grad_norm": step["grad_norm"],
               "learning_rate": step["learning_rate"], **self.take(), "epoch": epoch}
        self.logged_total += sum(self.losses)
        self.losses, self.local_losses = [], []
        return row

    def train_loss(self) -> float:
        """transformers' ``train_loss``: the mean loss of the optimizer steps this ``train()`` call ran, each
        logged step's as logged (every process's mean) and the steps after the last row at this process's own
        loss (transformers adds its running loss there without gathering it: on several processes each one's
        ``train_loss`` differs, as TRL's does)."""
        total = self.logged_total + sum(self.local_losses)
        return total / self.steps_run if self.steps_run else float("nan")

