"""The PPO update's mechanics, so that ``fastppo.train.ppo_update`` reads as the algorithm: what a micro-batch's loss
reads (``LossInputs``, ``MicroBatch``, ``MicroBatchInputs``: the rows, the aggregation weights, the token budget's
regrouping and its step weights, the fused loss's arguments), the minibatch order (``shuffled_rows``), DDP's
accumulation and the backward (``accumulating``, ``backward``), legacy TRL's early stopping (``kl_past_target``)
and the optimizer steps with their clipping and non-finite skips (``OptimizerSteps``)."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from fastppo import dist as fdist
from fastppo.batching import token_budget_batches
from fastppo.config import PPOConfig
from fastppo.experience import Experience, Targets
from fastppo.loss_types import divides_by_rollout_tokens, policy_loss_weights
from fastppo.metrics import STAT
from fastppo.policy_terms import LossSettings, reads_whole_sequences
from fastppo.rollout import Rollout, trained_mask
from fastppo.sizes import Sizes


class LossInputs(NamedTuple):
    """What a micro-batch's loss reads beside the forward's outputs: [b, T] grids, and how its terms aggregate."""

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor  # the trained tokens the loss reads (trained_mask)
    old_values: torch.Tensor | None = None  # with a critic
    returns: torch.Tensor | None = None  # with a critic
    ref_logprobs: torch.Tensor | None = None  # with beta
    token_weights: torch.Tensor | None = None  # the policy and KL terms' aggregation (policy_loss_weights)
    normalizer: torch.Tensor | float | None = None
    mean_weights: torch.Tensor | None = None  # the token means' weights under a token budget (step_token_weights)


class MicroBatch(NamedTuple):
    """One micro-batch: its rows of the rollout (``index``) and what its loss reads of them."""

    index: torch.Tensor
    inputs: LossInputs


class MicroBatchInputs:
    """What the update's micro-batches read, set up once per update: the loss mask, the rollout's active tokens
    (dapo's normaliser), the loss settings, and each micro-batch's rows of the targets (``rows``) with their
    aggregation weights, the token budget's regrouping (``step_micro_batches``) and the fused loss's arguments."""

    def __init__(self, rollout: Rollout, experience: Experience, targets: Targets, config: PPOConfig, sizes: Sizes):
        self.rollout, self.experience, self.targets, self.config = rollout, experience, targets, config
        self.loss_mask = trained_mask(rollout, config.mask_truncated_completions)
        self.rollout_tokens = rollout_tokens(self.loss_mask, config.loss_type, sizes)
        # the step weights' dtype: the loss's (fp64 when the policy computes in fp64)
        self.weight_dtype = torch.promote_types(
            targets.advantages.dtype, torch.float32 if experience.logprobs is None else experience.logprobs.dtype)
        self.whole_sequences = reads_whole_sequences(config)  # the fused loss then takes the completions' lengths
        self.settings = LossSettings.of(config)

    def step_micro_batches(self, micro: list[list[int]]):
        """The optimizer step's micro-batches and, under a token budget, their regrouping with the step weights
        that keep the step's loss the row-count micro-batches' (``step_token_weights``)."""
        config = self.config
        if config.max_tokens_per_micro_batch is None:
            return micro, None
        weights = step_token_weights(micro, self.loss_mask, config.loss_type, config.response_length,
                                     self.rollout_tokens, self.weight_dtype)
        regrouped = token_budget_batches([r for rows in micro for r in rows], self.rollout.query_lengths,
                                         self.rollout.response_lengths, config.max_tokens_per_micro_batch,
                                         config.padding_free)
        return regrouped, weights

    def rows(self, rows: list[int], step_weights) -> MicroBatch:
        """The micro-batch of ``rows``: the targets' rows and the aggregation weights (``policy_loss_weights``, or
        the step weights' rows)."""
        e, t, config = self.experience, self.targets, self.config
        index = torch.as_tensor(rows, device=self.loss_mask.device)
        old_logprobs, old_values, advantages, returns, mask, ref_logprobs = (
            None if x is None else x.index_select(0, index) for x in (
                e.logprobs, e.values, t.advantages, t.returns, self.loss_mask, e.ref_logprobs if config.beta else None))
        if step_weights is None:
            token_weights, normalizer = policy_loss_weights(config.loss_type, mask, config.response_length,
                                                            self.rollout_tokens)
            mean_weights = None
        else:
            token_weights, mean_weights = (w.index_select(0, index) for w in step_weights)
            normalizer = 1.0
        return MicroBatch(index, LossInputs(old_logprobs, advantages, mask, old_values, returns, ref_logprobs,
                                           token_weights, normalizer, mean_weights))

    def fused_loss(self, batch: MicroBatch, rows: list[int], entropy_coef: float) -> dict | None:
        """``fused_ppo_policy_loss``'s arguments for the micro-batch (``fused_policy_loss``), else None."""
        config, b = self.config, batch.inputs
        if not getattr(config, "fused_policy_loss", False):
            return None
        return dict(old_logprobs=b.old_logprobs, advantages=b.advantages, mask=b.mask, cliprange=config.cliprange,
                    entropy_coef=entropy_coef, token_weights=b.token_weights, normalizer=b.normalizer,
                    entropy_weights=b.mean_weights, importance_sampling_level=config.importance_sampling_level,
                    sequence_lengths=([self.rollout.response_lengths[r] for r in rows] if self.whole_sequences
                                      else None),
                    top_entropy_quantile=config.top_entropy_quantile, **self.settings.surrogate_options())


def rollout_tokens(loss_mask: torch.Tensor, loss_type: str, sizes: Sizes):
    """The normaliser of a loss type that divides by the rollout's active tokens (``divides_by_rollout_tokens``):
    the active tokens on every process, per micro-batch; else None."""
    if not divides_by_rollout_tokens(loss_type):
        return None
    tokens = loss_mask.sum().float()
    fdist.all_reduce(tokens)
    # at least 1, as TRL's num_items_in_batch: a batch with every token masked (every completion truncated under
    # mask_truncated_completions) has a loss of 0, not 0/0
    return tokens.clamp(min=1) / (sizes.world_size * sizes.num_mini_batches * sizes.micro_steps)


def accumulating(model, zero, last: bool):
    """DDP's ``no_sync`` on every micro-step but the step's last (DeepSpeed accumulates itself)."""
    if zero is None and hasattr(model, "no_sync") and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def backward(loss: torch.Tensor, accumulation: int, zero, finite: torch.Tensor | None) -> None:
    """The micro-batch's backward, its loss on the step's scale (÷ ``accumulation``); under DeepSpeed the
    engine's, given the step's finiteness on its last micro-step."""
    if zero is not None:
        zero.backward(loss, finite, accumulation)
    else:
        (loss / accumulation).backward()


def kl_past_target(stats: torch.Tensor, epoch: int, config: PPOConfig, sizes: Sizes) -> bool:
    """Legacy TRL's early stopping: after each epoch, the policy KL of its last minibatch (mean over every process)
    against 1.5 × target_kl."""
    kl_now = torch.nanmean(stats[STAT["policykl"], epoch, sizes.num_mini_batches - 1]).reshape(1)
    fdist.all_reduce(kl_now)
    return kl_now.item() / sizes.world_size > 1.5 * config.target_kl


class OptimizerSteps:
    """The update's optimizer steps: clip the gradient, skip a step whose loss or gradient is not finite on any
    process (the weights and the optimizer state never see it), step, zero the gradients. With fused AdamW the
    skip happens on the device (its ``found_inf``), so the loop never waits for the device; another optimizer needs
    one host sync per step. ``zero``: DeepSpeed accumulates, clips, steps and skips. Counts the skipped steps and
    keeps each step's gradient norm and learning rate (transformers' logged grad_norm and learning_rate)."""

    def __init__(self, optimizer, max_grad_norm: float | None, zero, log: Callable[[str], None],
                 after_step: Callable[[], None] | None, device: torch.device):
        self.optimizer, self.zero, self.log, self.after_step = optimizer, zero, log, after_step
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.max_norm = max_grad_norm if max_grad_norm else float("inf")
        self.on_device_skip = zero is None and bool(optimizer.defaults.get("fused")) and isinstance(
            optimizer, torch.optim.Adam | torch.optim.AdamW)
        self.skipped = torch.zeros((), device=device)
        self.last_norm = float("nan")
        self.norms, self.lrs = [], []  # each step's gradient norm and the learning rate it stepped with

    def step(self, finite: torch.Tensor, where: str) -> None:
        """One optimizer step after the step's micro-batches (``finite``: every loss of them was)."""
        if self.zero is not None:
            if self.zero.step():
                self.skipped += 1.0
                self.log(f"non-finite loss or gradient at {where}: step skipped, weights unchanged")
            self.last_norm = self.zero.grad_norm()
        else:
            self._step(finite, where)
        self.norms.append(self.last_norm)
        self.lrs.append(self.optimizer.param_groups[0]["lr"])  # before the schedule moves on (transformers' log)
        if self.after_step is not None:
            self.after_step()

    def _step(self, finite: torch.Tensor, where: str) -> None:
        if math.isinf(self.max_norm):  # no clipping: the norm only for the finite check (no scaling pass)
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.last_norm = grad_norm.detach()
        ok = (finite * torch.isfinite(grad_norm)).float()
        fdist.all_reduce_min(ok)
        if self.on_device_skip:
            self.optimizer.found_inf = 1.0 - ok  # fused AdamW leaves weights and moments alone where it is 1
            self.optimizer.step()
            self.skipped += 1.0 - ok
        elif ok.item() == 1.0:
            self.optimizer.step()
        else:
            self.skipped += 1.0
            self.log(f"non-finite loss or gradient at {where}: step skipped, weights unchanged")
        self.optimizer.zero_grad()  # torch frees the gradients (set_to_none); a caller may have rebound it

    def close(self) -> None:
        if self.on_device_skip:
            self.optimizer.found_inf = None


def shuffled_rows(rows: int, group_size: int, generator: torch.Generator) -> list[int]:
    """A random order of ``rows`` rows; with ``group_size`` > 1, of their groups (each ``group_size`` consecutive
    rows), every group's rows kept together in their order."""
    if group_size == 1:
        return torch.randperm(rows, generator=generator).tolist()
    groups = torch.randperm(rows // group_size, generator=generator).tolist()
    return [g * group_size + j for g in groups for j in range(group_size)]


def step_token_weights(micro: list[list[int]], loss_mask: torch.Tensor, loss_type: str, response_length: int,
                       rollout_tokens, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] each token's weight in one optimizer step's loss as the update defines it, the mean of its
    row-count micro-batches' losses: (the policy and in-loss KL terms' weights, by ``loss_type``; the token-mean
    terms' weights: entropy, value). Rows off this step weigh 0. With them any regrouping of the step's rows
    (``token_budget_batches``) sums to the same loss, and so the same gradient."""
    policy = torch.zeros(loss_mask.shape, dtype=dtype, device=loss_mask.device)
    mean = torch.zeros_like(policy)
    for rows in micro:
        index = torch.as_tensor(rows, device=loss_mask.device)
        mask = loss_mask.index_select(0, index)
        weights, normalizer = policy_loss_weights(loss_type, mask, response_length, rollout_tokens)
        count = mask.sum().clamp(min=1)
        policy[index] = (mask if weights is None else weights).to(dtype) / (count if normalizer is None else
                                                                           normalizer) / len(micro)
        mean[index] = mask.to(dtype) / count / len(micro)
    return policy, mean
