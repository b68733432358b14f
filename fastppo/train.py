"""fastppo.train: PPO for causal language models (RLHF), the algorithm top to bottom.

    python -m fastppo.train [flags]                      # one process
    torchrun --nproc_per_node N -m fastppo.train [flags] # DDP (NCCL on GPU, Gloo on CPU)

    from fastppo import PPOConfig, PPOTrainer            # the library: TRL 0.26's constructor,
    PPOTrainer(args=config, processing_class=tok, model=policy, ...).train()
    # or legacy TRL's loop: trainer.generate(...), trainer.step(queries, responses, scores)

One iteration (numbers match the step comments below):

    1. rollout    sample prompts; y ~ π_θ_old(·|x) with a KV cache; cut at the stop token; score r(x, y)
    2. scoring    one forward per model over x+y: log π_θ_old(y_t), V(s_t) (one pass), log π_ref(y_t)
    3. rewards    R_t = −β·KL_t  (+ score on the last real token);  β fixed or adaptive
    4. advantages GAE: δ_t = R_t + γV_{t+1} − V_t,  A_t = Σ_l (γλ)^l δ_{t+l},  returns G_t = A_t + V_t;
                  or critic-free (no V): rloo, grpo over each prompt's num_generations samples, reinforce_plus_plus
    5. update     num_ppo_epochs × num_mini_batches × micro-batches of
                  L = E[max(−A·ρ, −A·clip(ρ, 1±ε))] + c_v·½E[max((V−G)², (V_clip−G)²)] − c_H·E[H] + β_loss·E[KL],
                  ρ = π_θ(y_t)/π_θ_old(y_t)
    6. logging    every metric TRL's PPOTrainer logs, masked to real response tokens

The per-token math of steps 2-5 (log-probs, entropy, KL, GAE, masking, the surrogates, the masked statistics)
is ``fastppo.kernels`` calls; REINFORCE++'s whitening over the batch and ``top_entropy_quantile``'s quantile
are PyTorch in ``advantages`` and ``policy_terms``. The plumbing lives beside this file: ``config`` (flags), ``sizes``
(the batch sizes), ``rollout`` (step 1's records), ``experience`` (steps 2-4's), ``advantages`` (step 4: each
estimator a function and a row of its table), ``loss_types`` (TRL GRPO's ``loss_type``, a row each), ``policy_terms``
(the loss's settings and what they make of each token), ``update_steps`` (the update's mechanics), ``controllers`` (β
and the entropy coefficient), ``sharing`` (which forwards run each group's prompt once), ``layout`` and
``actor_critic`` (the forwards), ``batching`` (micro-batch and scoring cuts), ``data``, ``rewards`` and
``reward_scores``, ``generation``, ``metrics``, ``dist``; ``build`` makes a ``Learner``.
"""
from __future__ import annotations

if __name__ == "__main__":  # python -m fastppo.train: the command line (the algorithm does not import it), run
    import runpy            # before this file's imports, so that --help waits for no torch (issue 63)
    runpy.run_module("fastppo.cli", run_name="__main__", alter_sys=True)
    raise SystemExit

import contextlib
import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from fastppo import dist as fdist
from fastppo.advantages import estimate_advantages, reward_columns_of
from fastppo.batching import micro_batches, scoring_rows
from fastppo.config import PPOConfig
from fastppo.controllers import AdaptiveEntropyController, AdaptiveKLController, FixedKLController
from fastppo.experience import Experience, Targets  # steps 2 and 3-4's records (the update reads them too)
from fastppo.kernels import clip_sides, clipped_surrogate, fused_full_kl, kl_penalty, masked_mean, masked_var
from fastppo.layout import gathered, head_input, head_precision, lm_head_of
from fastppo.metrics import (STAT, STAT_NAMES, MetricTerms, UpdateResult, completion_metrics, gather_metrics,
                             objective_sums, row_statistics, sampling_difference)
from fastppo.policy_terms import LossSettings, high_entropy_mask
from fastppo.rewards import transform_scores
from fastppo.rollout import Rollout, ScoredRollout
from fastppo.sharing import reference_sharing, update_sharing
from fastppo.sizes import Sizes
from fastppo.update_steps import (LossInputs, MicroBatchInputs, OptimizerSteps, accumulating, backward,
                                  kl_past_target, shuffled_rows)

# ============================================================================ 1. rollout: fastppo.rollout; 2. scoring


@dataclass(frozen=True)
class Scoring:
    """How step 2's forwards run: at ``temperature``, the KL by ``kl_estimator``, ``chunk`` rows at a time, packed
    or padded. ``policy=False``: π_θ_old is not run (``old_logprobs_in_update``): its log-probs and KL come back
    None and 0, and the update fills them in. ``shared`` (``reference_sharing``): the reference runs each group's
    prompt once (its layout's outputs land in the same order, so the full KL's hidden states still pair up);
    ``policy_shared`` (``update_sharing``, with a ``chunk`` of whole groups): π_θ_old too, as the update will."""

    temperature: float
    kl_estimator: str
    chunk: int
    packed: bool = False
    policy: bool = True
    shared: tuple | None = None
    policy_shared: tuple | None = None


def compute_experience(actor_critic, reference, rollout: Rollout, scoring: Scoring,
                       seconds: dict | None = None) -> Experience:
    """Step 2: log π_θ_old and V (one call of the trained module), log π_ref and the per-token KL, in
    chunks of rows, under ``torch.inference_mode`` (``scoring`` says how).

    ``actor_critic`` is the same module and call as the training forward, on the same layout, so with
    dropout off the first PPO ratio is exactly 1. ``seconds`` collects the time of each model's forwards.
    ``reference=None``: no KL anywhere (critic-free at kl_coef = beta = 0): π_ref is never run, the KL is 0.
    """
    temperature, chunk = scoring.temperature, scoring.chunk
    shared, policy_shared = scoring.shared, scoring.policy_shared
    full = scoring.kl_estimator == "full" and reference is not None and scoring.policy
    logprobs, ref_logprobs, values, kls = [], [], [], []
    clock = {"policy_value": 0.0, "reference": 0.0}
    with torch.inference_mode():
        for i in range(0, rollout.query_responses.shape[0], chunk):
            rows = range(i, min(i + chunk, rollout.query_responses.shape[0]))
            layout = rollout.layout(rows, scoring.packed, shared=policy_shared)
            t0 = time.perf_counter()
            if scoring.policy:
                out = actor_critic(layout, temperature, return_hidden=full)
                logp, value, hidden = out.logprobs, out.values, out.hidden
            else:
                logp, value, hidden = None, None, None
            t1 = time.perf_counter()
            ref_layout = layout if shared is None or shared == policy_shared else rollout.layout(rows, shared=shared)
            ref_logp, ref_state = reference(ref_layout, temperature, with_hidden=full) if reference else (None, None)
            if reference is None or logp is None:
                kls.append(torch.zeros(layout.shape, device=rollout.response_mask.device))
            elif full:
                ref_hidden, ref_head = ref_state
                head = lm_head_of(actor_critic.policy)
                bias, ref_bias = getattr(head, "bias", None), getattr(ref_head, "bias", None)
                hidden, precision = head_precision(actor_critic.policy, head_input(actor_critic.policy, hidden))
                ref_hidden, ref_precision = head_precision(reference.model, head_input(reference.model, ref_hidden))
                # ZeRO-3 only: read outside a forward
                with gathered(head.weight, bias, ref_head.weight, ref_bias), precision, ref_precision:
                    kls.append(layout.scatter(fused_full_kl(
                        hidden, head.weight.to(hidden.dtype), ref_hidden, ref_head.weight.to(ref_hidden.dtype),
                        temperature, bias=None if bias is None else bias.to(hidden.dtype),
                        ref_bias=None if ref_bias is None else ref_bias.to(ref_hidden.dtype))))
            else:
                kls.append(kl_penalty(logp, ref_logp, scoring.kl_estimator))
            clock["policy_value"] += t1 - t0
            clock["reference"] += time.perf_counter() - t1
            logprobs.append(logp)
            ref_logprobs.append(ref_logp)
            values.append(value)
        mask = rollout.response_mask
        out = [torch.cat(logprobs) if scoring.policy else None, None if reference is None else torch.cat(ref_logprobs),
               None if values[0] is None else torch.cat(values) * mask, torch.cat(kls) * mask]
    if seconds is not None:
        seconds.update(clock)
    return Experience(*(None if t is None else t.clone() for t in out))  # out of inference mode: usable in the loss


# ============================================================================ 3. rewards (4, advantages: advantages.py)
# (β's controllers: controllers.py)


def per_token_rewards(kl, scores, response_mask, score_index, kl_coef: float):
    """Step 3: R_t = −β·KL_t on trained tokens, plus the score on the last one.

    Returns (rewards, non_score_reward), both [B, T] and 0 elsewhere. The score goes on the last
    real response token, as legacy TRL and verl place it; TRL 0.26 (and the N+ details' code) put it
    one position past that and keep one more value there.
    """
    non_score_reward = -kl_coef * kl * response_mask
    rewards = non_score_reward.clone()
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, score_index] += scores
    return rewards, non_score_reward


# ============================================================================ 5. PPO update


def aggregate(x: torch.Tensor, mask: torch.Tensor, token_weights: torch.Tensor | None = None, normalizer=None):
    """(P4)'s aggregation of per-token terms: Σ u·x / d over the trained tokens, u the mask and d max(Σ mask, 1)
    unless given (``policy_loss_weights``). With neither, ``masked_mean`` to the bit on a non-empty mask, and 0
    (not NaN) on an empty one: a micro-batch whose completions were all masked (mask_truncated_completions)
    adds nothing to the step instead of voiding it."""
    real = mask != 0
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    total = torch.where(real, x if token_weights is None else x * token_weights, zero).sum()
    return total / (real.sum().clamp(min=1) if normalizer is None else normalizer)


def ppo_losses(new_logprobs, new_values, entropy, inputs: LossInputs, settings: LossSettings,
               entropy_coef: float = 0.0, fused_policy_loss=None):
    """Step 5 for one micro-batch. Returns (loss, stats [len(STAT_NAMES)]); the statistics are means over trained
    tokens.

    ``fused_policy_loss``: the policy part already computed by ``fused_ppo_policy_loss`` (its ``loss``
    is pg − c_H·H̄ with the gradient formed in the forward); ``new_logprobs`` and ``entropy`` are then its
    per-token values laid out as grids, for the statistics. ``new_values=None``: no critic, no value loss.
    ``settings`` (``LossSettings``): ``beta``: + β·KL_t(π‖π_ref) by ``kl_loss_type`` in each token's loss (TRL
    GRPO's in-loss KL), weighted by ρ_t when ``bias_correction_kl`` (TRL's default: the samples came from
    π_θ_old, not π_θ); ``importance_sampling_level`` (not "token": one ratio per row, GSPO's or RLOO's) and the
    surrogate's options (the clip's upper side, δ, the surrogate, its settings, the off-policy mask):
    ``clipped_surrogate``'s, each row one sequence; ``top_entropy_quantile`` < 1: only the tokens of
    ``high_entropy_mask`` take the policy term and the entropy bonus (TRL GRPO's).
    ``inputs``' ``token_weights`` and ``normalizer``: how the policy and KL terms are aggregated
    (``policy_loss_weights``); the entropy bonus and the value loss are token means whatever they are (TRL GRPO's
    bonus is), or, with ``mean_weights``, Σ over the tokens of mean_weights·x (``step_token_weights``: token-budget
    micro-batches).
    """
    old_logprobs, advantages, mask, old_values, returns, ref_logprobs, token_weights, normalizer, mean_weights = \
        inputs
    means = (mean_weights, None if mean_weights is None else 1.0)  # the token means' weights and divisor
    value = None
    if new_values is not None:  # clipped value loss: ½·max((V − G)², (V_old + clip(V − V_old, ±ε_v) − G)²)
        v_clipped = old_values + (new_values - old_values).clamp(-settings.cliprange_value, settings.cliprange_value)
        value = ValueTerms(new_values, old_values, returns, (new_values - returns) ** 2, (v_clipped - returns) ** 2)
        value = value._replace(loss=0.5 * aggregate(torch.max(value.error, value.clipped_error), mask, *means))
    # clipped surrogate: max(−A·min(ρ, δ), −A·clip(ρ, 1 − ε, 1 + ε_h)) (or cispo's, sapo's, vespo's)
    b, t = new_logprobs.shape
    rows = torch.arange(b, device=new_logprobs.device)[:, None].expand(b, t)  # each row one sequence
    # masked: what a caller left in old_logprobs / advantages off the trained tokens reaches no gradient
    pg_losses, ratio, clipped = clipped_surrogate(
        new_logprobs, old_logprobs, advantages, settings.cliprange, mask=mask, sequence_ids=rows, num_sequences=b,
        importance_sampling_level=settings.importance_sampling_level, **settings.surrogate_options())
    policy_mask = mask  # the tokens the policy term and the entropy bonus read
    if settings.top_entropy_quantile < 1:
        policy_mask = high_entropy_mask(entropy, mask, settings.top_entropy_quantile)
        pg_losses = torch.where(policy_mask, pg_losses, torch.zeros((), dtype=pg_losses.dtype,
                                                                     device=pg_losses.device))
    pg_loss = aggregate(pg_losses, mask, token_weights, normalizer)
    mean_entropy = aggregate(entropy, policy_mask, *means)
    policy_loss = pg_loss - entropy_coef * mean_entropy if fused_policy_loss is None else fused_policy_loss.loss
    loss = policy_loss if value is None else policy_loss + settings.vf_coef * value.loss
    kl = None
    if settings.beta:  # + β·KL_t by kl_loss_type, weighted by ρ_t under bias correction (TRL GRPO's)
        kl_tokens = kl_penalty(new_logprobs, ref_logprobs, settings.kl_loss_type)
        kl_tokens = kl_tokens * ratio if settings.bias_correction_kl else kl_tokens
        kl = (kl_tokens, aggregate(kl_tokens, mask, token_weights, normalizer))
        loss = loss + settings.beta * kl[1]
    # legacy TRL's ratio_threshold: a micro-batch whose ratios blew up contributes nothing (no host sync);
    # its logged losses are the ones applied (0), and ratio_skipped counts it
    kept = (aggregate(ratio, mask) <= settings.ratio_threshold).to(loss.dtype)
    loss = loss * kept
    terms = LossTerms(loss, pg_loss, entropy_coef * mean_entropy, kept, new_logprobs - old_logprobs, ratio, clipped,
                      entropy, policy_mask, value, kl)
    return loss, loss_statistics(terms, inputs, settings)


LOSS_ROWS = [STAT[name] for name in ("pg_loss", "vf_loss", "kl_loss", "loss", "policy_loss")]  # the loss statistics


def bonus_entropy(step_stats: torch.Tensor) -> float:
    """An optimizer step's mean entropy over every process's bonus tokens (the adaptive entropy coefficient's
    measurement), from its micro-batches' statistics [len(STAT_NAMES), micro-steps]."""
    window = step_stats[[STAT["bonus_entropy_sum"], STAT["bonus_tokens"]]].nansum(1)
    fdist.all_reduce(window)
    return (window[0] / window[1].clamp(min=1.0)).item()


class ValueTerms(NamedTuple):
    """The value loss's pieces (``ppo_losses``), for its statistics."""

    new_values: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    error: torch.Tensor  # (V − G)²
    clipped_error: torch.Tensor  # (V_old + clip(V − V_old, ±ε_v) − G)²
    loss: torch.Tensor | None = None


class LossTerms(NamedTuple):
    """What ``ppo_losses`` computed for one micro-batch, for its statistics."""

    loss: torch.Tensor
    pg_loss: torch.Tensor
    bonus: torch.Tensor  # c_H · the mean entropy: TRL GRPO's policy_loss is the loss before it
    kept: torch.Tensor  # 0 where legacy TRL's ratio threshold dropped the micro-batch
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    entropy: torch.Tensor
    policy_mask: torch.Tensor  # the tokens the policy term and the entropy bonus read
    value: ValueTerms | None
    kl: tuple[torch.Tensor, torch.Tensor] | None  # (β's per-token KL, its aggregate)


@torch.no_grad()
def loss_statistics(terms: LossTerms, inputs: LossInputs, settings: LossSettings) -> torch.Tensor:
    """[len(STAT_NAMES)] a micro-batch's statistics (NaN: not computed, e.g. without a critic): means over its trained
    tokens, and the token sums whose global means over every process TRL GRPO logs (``gather_metrics``)."""
    t, mask, advantages = terms, inputs.mask, inputs.advantages
    stats = torch.full((len(STAT_NAMES),), float("nan"), device=t.loss.device)
    clip_low, clip_high = clip_sides(t.ratio, advantages, settings.cliprange, settings.cliprange_high,
                                     settings.delta, settings.surrogate)
    for name, value in (
        ("loss", t.loss),  # this micro-step's share of its optimizer step's loss, as minimised
        ("policy_loss", t.loss + t.bonus * t.kept),
        ("approxkl", 0.5 * masked_mean(t.log_ratio**2, mask)),
        ("policykl", masked_mean(-t.log_ratio, mask)),
        ("pg_clipfrac", masked_mean(t.clipped.float(), mask)),
        ("clip_low", masked_mean(clip_low.float(), mask)),
        ("clip_high", masked_mean(clip_high.float(), mask)),
        ("clip_region", masked_mean((clip_low | clip_high).float(), mask)),
        ("pg_loss", t.pg_loss * t.kept),
        ("entropy", masked_mean(t.entropy, mask)),
        ("ratio", masked_mean(t.ratio, mask)),
        ("advantages_mean", masked_mean(advantages, mask)),
        ("ratio_skipped", 1.0 - t.kept),
    ):
        stats[STAT[name]] = value
    if t.value is not None:
        v = t.value
        for name, value in (
            ("vf_loss", v.loss * t.kept),
            ("vf_clipfrac", masked_mean((v.clipped_error > v.error).float(), mask)),
            ("returns_mean", masked_mean(v.returns, mask)),
            ("returns_var", masked_var(v.returns, mask, check=False)),  # NaN under 2 tokens, no sync
            ("vpred_mean", masked_mean(v.new_values, mask)),
            ("vf_error", masked_mean(v.error, mask)),
            ("values_mean", masked_mean(v.old_values, mask)),
            ("values_var", masked_var(v.old_values, mask, check=False)),
        ):
            stats[STAT[name]] = value
    # sums over the trained tokens (for the clip fractions under GSPO, over the rows: TRL's units)
    real = mask != 0
    stats[STAT["tokens"]] = real.sum()
    stats[STAT["entropy_token_sum"]] = torch.where(real, t.entropy.detach(), 0.0).sum()
    bonus_tokens = t.policy_mask != 0  # the tokens the entropy bonus reads (the adaptive coefficient's)
    stats[STAT["bonus_entropy_sum"]] = torch.where(bonus_tokens, t.entropy.detach(), 0.0).sum()
    stats[STAT["bonus_tokens"]] = bonus_tokens.sum()
    if settings.importance_sampling_level != "token":  # one ratio per row: a row is clipped or not (none without a
        first = real.float().argmax(1, keepdim=True)  # token)
        sides = [c.gather(1, first).squeeze(1) & real.any(1) for c in (clip_low, clip_high, clip_low | clip_high)]
        stats[STAT["clip_units"]] = float(mask.shape[0])
    else:
        sides = [c & real for c in (clip_low, clip_high, clip_low | clip_high)]
        stats[STAT["clip_units"]] = stats[STAT["tokens"]]
    for name, side in zip(("clip_low_sum", "clip_high_sum", "clip_region_sum"), sides):
        stats[STAT[name]] = side.sum()
    row_statistics(stats, sides, real, t.log_ratio, advantages,
                   settings.vespo_gamma if settings.surrogate == "vespo" else None)
    if t.kl is not None:  # the term as aggregated, and its token sum
        stats[STAT["kl_loss"]] = t.kl[1]
        stats[STAT["kl_token_sum"]] = torch.where(real, t.kl[0].detach(), 0.0).sum()
    return stats


@dataclass(frozen=True)
class UpdateModel:
    """What the update trains and how it steps: ``model`` (the actor-critic, or DDP's or DeepSpeed's wrapper around
    it) and its optimizer; ``zero`` (``fastppo.zero.ZeRO``, ``model`` its engine): DeepSpeed accumulates, clips,
    steps and skips; ``entropy_ctl``: TRL GRPO's adaptive entropy coefficient, read before each step and moved
    after it; ``after_step``: called after each optimizer step (TRL GRPO's schedule, stepped per optimizer step)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: Callable = contextlib.nullcontext
    log: Callable[[str], None] = print
    zero: object | None = None
    entropy_ctl: AdaptiveEntropyController | None = None
    after_step: Callable[[], None] | None = None


@dataclass(frozen=True)
class UpdateBatch:
    """What the update learns from: the rollout, step 2's forwards and steps 3-4's targets; ``shared``
    (``update_sharing``): each micro-batch's forward runs each group's prompt once, the minibatch order drawing
    whole groups."""

    rollout: Rollout
    experience: Experience
    targets: Targets
    shared: tuple | None = None


def ppo_update(trained: UpdateModel, data: UpdateBatch, config: PPOConfig, sizes: Sizes, generator: torch.Generator,
               train: bool = True, max_steps: int | None = None) -> UpdateResult:
    """Step 5: num_ppo_epochs × num_mini_batches optimizer steps, each over micro_steps micro-batches.

    ``max_steps``: stop after this many (the run's last steps, where TRL GRPO's max_steps ends inside a generation
    batch). Where ``sizes.counts_optimizer_steps`` (TRL GRPO's loop), the rows are shuffled once and every epoch
    walks the same minibatches in the same order, as TRL's buffered generation batch is revisited.

    ``train=False`` (an evaluation, under the caller's ``torch.no_grad``): one epoch of the same forwards and
    losses with the model in eval mode, and no backward or step: the stats are the loss and metrics at θ_old
    (ratio 1), as TRL's ``prediction_step`` computes them.

    A step whose loss or gradient is not finite (on any process) is skipped (``OptimizerSteps``).
    """
    model, zero, entropy_ctl = trained.model, trained.zero, trained.entropy_ctl
    rollout, experience, shared = data.rollout, data.experience, data.shared
    device = rollout.query_responses.device
    budget = config.max_tokens_per_micro_batch
    # a token budget may cut a minibatch into up to one micro-batch per row
    shape = (config.num_ppo_epochs, sizes.num_mini_batches,
             sizes.micro_steps if budget is None else sizes.local_mini_batch_size)
    stats = torch.full((len(STAT_NAMES), *shape), float("nan"), device=device)
    # no scoring forward ran (old_logprobs_in_update): every micro-batch is computed once, at θ_old, so its own
    # log-probs are π_θ_old's; they are kept for the metrics
    seen = torch.zeros_like(rollout.response_mask, dtype=torch.float32) if experience.logprobs is None else None
    total_lengths = [q + r for q, r in zip(rollout.query_lengths, rollout.response_lengths)]
    inputs = MicroBatchInputs(rollout, experience, data.targets, config, sizes)
    stepper = OptimizerSteps(trained.optimizer, config.max_grad_norm, zero, trained.log, trained.after_step, device)
    epochs_run = config.num_ppo_epochs if train else 1
    steps_left = math.inf if max_steps is None or not train else max_steps
    model.train(train)
    order, coefficients = None, []
    group = 1 if shared is None else shared[0]  # the rows the order keeps together
    for epoch in range(epochs_run):
        if steps_left <= 0:
            epochs_run = epoch
            break
        if order is None or not sizes.counts_optimizer_steps:
            order = shuffled_rows(sizes.local_batch_size, group, generator)
        for mb, micro in enumerate(micro_batches(order, sizes, total_lengths, config.group_by_length, group)):
            if steps_left <= 0:
                break
            steps_left -= 1
            entropy_coef = config.entropy_coef if entropy_ctl is None else entropy_ctl.applied()
            micro, step_weights = inputs.step_micro_batches(micro)
            finite = torch.ones((), device=device)
            for k, rows in enumerate(micro):
                batch = inputs.rows(rows, step_weights)
                last = k == len(micro) - 1  # DDP all-reduces gradients on the last micro-step only
                with accumulating(model, zero, last):
                    with trained.autocast():
                        out = model(rollout.layout(rows, config.padding_free, shared=shared), config.temperature,
                                    return_entropy=True, policy_loss=inputs.fused_loss(batch, rows, entropy_coef))
                    if seen is not None:
                        batch = batch._replace(inputs=batch.inputs._replace(old_logprobs=out.logprobs.detach()))
                        seen[batch.index] = batch.inputs.old_logprobs.float()
                    loss, stats[:, epoch, mb, k] = ppo_losses(out.logprobs, out.values, out.entropy, batch.inputs,
                                                              inputs.settings, entropy_coef, out.policy_loss)
                    # each micro-batch's loss is on the step's scale and the step is their mean; with step weights
                    # it is already this micro-batch's share of the step (its losses logged ×count)
                    accumulation = sizes.micro_steps if step_weights is None else 1
                    if step_weights is not None:
                        stats[LOSS_ROWS, epoch, mb, k] *= len(micro)
                    if train:
                        finite = finite * torch.isfinite(loss.detach())
                        backward(loss, accumulation, zero, finite if last else None)
            if not train:
                continue
            if entropy_ctl is not None:  # the step's entropy over every process's bonus tokens
                entropy_ctl.update(bonus_entropy(stats[:, epoch, mb]))
                coefficients.append(entropy_ctl.value)  # TRL logs each step's coefficient after its update
            stepper.step(finite, f"PPO epoch {epoch}, minibatch {mb}")
        if config.early_stopping and train and kl_past_target(stats, epoch, config, sizes):
            epochs_run = epoch + 1
            break
    stepper.close()
    taken = (max_steps if max_steps is not None and max_steps < epochs_run * sizes.num_mini_batches
             else epochs_run * sizes.num_mini_batches)
    skipped = stepper.skipped
    steps = taken - skipped if train else skipped
    return UpdateResult(stats, skipped, steps, epochs_run, seen, stepper.last_norm, stepper.norms, stepper.lrs,
                        coefficients)


def old_logprobs_in_update(config: PPOConfig) -> bool:
    """Whether step 2 can skip π_θ_old's forward (TRL GRPO's shortcut at num_iterations 1): nothing reads its
    log-probs before the update (no critic, no KL in the reward, no adaptive β), and the update computes each
    sample exactly once before its only optimizer step (one epoch of one minibatch), so the training forward's
    own log-probs are π_θ_old's, bit for bit. The fused loss takes them as an input: it keeps the forward."""
    return (config.critic_free and config.kl_coef == 0 and not config.adaptive_kl and config.num_ppo_epochs == 1
            and config.num_mini_batches == 1 and not config.fused_policy_loss and config.kl_estimator != "full")


def with_old_logprobs(experience: Experience, logprobs: torch.Tensor, mask: torch.Tensor,
                      kl_estimator: str) -> Experience:
    """``experience`` with π_θ_old's log-probs the update measured, and their KL to π_ref (for the metrics)."""
    kl = torch.zeros_like(logprobs) if experience.ref_logprobs is None else \
        kl_penalty(logprobs, experience.ref_logprobs, kl_estimator) * mask
    return Experience(logprobs, experience.ref_logprobs, experience.values, kl)


# ============================================================================ 6. one iteration, steps 1-6 in order


@dataclass(frozen=True)
class Learner:
    """What an iteration reads and updates, built once by the trainer. ``model`` is what the update calls
    (``actor_critic`` itself, or DDP's or DeepSpeed's wrapper around it)."""

    actor_critic: nn.Module
    model: nn.Module
    reference: object  # fastppo.actor_critic.Reference
    optimizer: torch.optim.Optimizer
    lr_scheduler: object | None
    kl_ctl: FixedKLController | AdaptiveKLController
    moments: object | None  # fastppo.rewards.RunningMoments under use_score_scaling
    shuffle: torch.Generator
    autocast: Callable
    log: Callable[[str], None]
    zero: object | None = None  # fastppo.zero.ZeRO
    entropy_ctl: AdaptiveEntropyController | None = None  # TRL GRPO's use_adaptive_entropy


@dataclass(frozen=True)
class IterationResult:
    """What one iteration made: its samples, what the update was made of, TRL's metrics, and timing."""

    batch: ScoredRollout
    experience: Experience
    targets: Targets
    update: UpdateResult
    scores: torch.Tensor  # [B] the scores the rewards used (after use_score_scaling/norm/clip)
    metrics: dict[str, float]  # TRL 0.26's names, over every process
    kl_coef: float  # β of this iteration (before the adaptive controller's update)
    lr: float  # the learning rate of this iteration's update
    # step 1's phases; "scoring" (steps 2-4), split as "scoring/forwards" (step 2, and each model's share of it)
    # and "scoring/advantages" (steps 3-4); "update" (step 5)
    seconds: dict[str, float]
    step_metrics: tuple[dict, ...] = ()  # critic-free: each optimizer step's own (metrics.optimizer_step_metrics)


def ppo_iteration(learner: Learner, config: PPOConfig, sizes: Sizes, collect: Callable[[], ScoredRollout],
                  skip_masked: bool = False, train: bool = True, max_steps: int | None = None) -> IterationResult:
    """One PPO iteration. ``collect`` is step 1 (the trainer samples and scores; the legacy ``step()`` hands
    over the caller's samples). ``skip_masked``: GAE bootstraps across positions a caller masked out.
    ``train=False``: an evaluation of the same steps, which changes nothing: no gradient or optimizer step, and
    the score moments, β and the learning rate stay where they are. ``max_steps``: at most this many optimizer
    steps (the run's last ones). The schedule steps once per iteration (TRL PPO), or after each optimizer step
    where ``sizes.counts_optimizer_steps`` (TRL GRPO)."""
    # 1. rollout: prompts, responses y ~ π_θ_old, cut at the stop token, scored r(x, y)
    batch = collect()
    rollout = batch.rollout
    # 2. scoring: log π_θ_old and V (one forward of the trained module), log π_ref, per-token KL
    t0 = time.perf_counter()
    learner.actor_critic.eval()
    scoring_seconds, in_update, k = {}, old_logprobs_in_update(config), sizes.num_generations
    chunk = scoring_rows(config.local_rollout_forward_batch_size, rollout.query_lengths, rollout.response_lengths,
                         config.max_tokens_per_micro_batch, config.critic_free and sizes.local_micro_batch_size, k)
    shared = reference_sharing(config, learner.reference, rollout, chunk)
    update_shared = update_sharing(config, sizes, learner.actor_critic, rollout)
    with learner.autocast():
        scoring = Scoring(config.temperature, config.kl_estimator, chunk, config.padding_free, not in_update, shared,
                          update_shared if update_shared and chunk % update_shared[0] == 0 else None)
        experience = compute_experience(learner.actor_critic, learner.reference, rollout, scoring, scoring_seconds)
    t_forward = time.perf_counter()
    # 3. rewards: R_t = −β·KL_t, + the (transformed) score on the last trained token
    moments = learner.moments if train else copy.deepcopy(learner.moments)  # an evaluation moves no moment
    scores = transform_scores(batch.scores, config.use_score_scaling, config.use_score_norm, config.score_clip,
                              moments, config.reward_clip_range)
    kl_coef = learner.kl_ctl.value
    rewards, non_score_reward = per_token_rewards(experience.kl, scores, rollout.response_mask, rollout.score_index,
                                                  kl_coef)
    # 4. advantages (and GAE's returns) by the advantage_estimator (GDPO: from each reward's own scores)
    advantages, returns = estimate_advantages(config.advantage_estimator, rewards, experience.values,
                                              rollout.response_mask, config, skip_masked,
                                              *reward_columns_of(batch.reward_columns, config, scores.dtype))
    targets = Targets(rewards, non_score_reward, advantages, returns)
    t1 = time.perf_counter()
    # 5. PPO update, at this iteration's learning rate
    lr = learner.optimizer.param_groups[0]["lr"]
    with contextlib.nullcontext() if train else torch.no_grad():
        # an evaluation leaves the minibatch order's generator alone (its order does not change a loss without steps)
        order = learner.shuffle if train else torch.Generator().manual_seed(0)
        per_step = learner.lr_scheduler.step if learner.lr_scheduler is not None and sizes.counts_optimizer_steps \
            else None
        trained = UpdateModel(learner.model, learner.optimizer, learner.autocast, learner.log, learner.zero,
                              learner.entropy_ctl, after_step=per_step)
        update = ppo_update(trained, UpdateBatch(rollout, experience, targets, update_shared), config, sizes, order,
                            train, max_steps)
    t2 = time.perf_counter()
    if in_update:  # π_θ_old's log-probs, and the KL they make with π_ref, as step 2 would have measured them
        experience = with_old_logprobs(experience, update.logprobs, rollout.response_mask, config.kl_estimator)
    # 6. metrics (one all-reduce), then β and the learning-rate schedule move on
    objective = objective_sums(experience.kl, experience.logprobs, non_score_reward, rollout.response_mask,
                               batch.scores, batch.eos_count)
    terms = MetricTerms(critic=experience.values is not None, kl=experience.ref_logprobs is not None,
                        kl_in_loss=bool(config.beta),
                        kl_in_reward=config.advantage_estimator == "rloo" and bool(kl_coef),
                        entropy_coef=learner.entropy_ctl.value if learner.entropy_ctl is not None
                        else config.entropy_coef or None, surrogate=LossSettings.of(config).surrogate)
    step_metrics = []
    metrics = gather_metrics(objective, update, sizes.world_size, terms, batch.reward_columns, step_metrics)
    if batch.sampling_logprobs is not None:  # how far a caller's sampler was from π_θ_old (TRL's vLLM metrics)
        metrics.update(sampling_difference(batch.sampling_logprobs, experience.logprobs, rollout.response_mask))
    if config.critic_free:  # TRL GRPO's completion and reward metrics
        # the lengths count the model's own tokens (TRL's: a tool call's results are the template's, not the model's)
        metrics.update(completion_metrics(rollout.response_mask.sum(1), ~rollout.has_stop, batch.scores,
                                          config.num_generations,
                                          config.scale_rewards))
    if metrics["train/skipped_steps"]:
        learner.log(f"{metrics['train/skipped_steps']:g} optimizer step(s) skipped for a non-finite loss or gradient "
                    "(weights and optimizer state unchanged by them)")
    if "objective/kl" in metrics and train:  # the adaptive controller reads the KL; a run without a reference has none
        learner.kl_ctl.update(metrics["objective/kl"], sizes.batch_size)
    if learner.lr_scheduler is not None and train and not sizes.counts_optimizer_steps:
        learner.lr_scheduler.step()
    seconds = {**batch.seconds, "scoring": t1 - t0, "update": t2 - t1, "scoring/forwards": t_forward - t0,
               "scoring/advantages": t1 - t_forward, **{f"scoring/{k}": v for k, v in scoring_seconds.items()}}
    return IterationResult(batch, experience, targets, update, scores, metrics, kl_coef, lr, seconds,
                           tuple(step_metrics))

