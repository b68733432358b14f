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
    4. GAE        δ_t = R_t + γV_{t+1} − V_t,  A_t = Σ_l (γλ)^l δ_{t+l},  returns G_t = A_t + V_t
    5. update     num_ppo_epochs × num_mini_batches × micro-batches of
                  L = E[max(−A·ρ, −A·clip(ρ, 1±ε))] + c_v·½E[max((V−G)², (V_clip−G)²)] − c_H·E[H],
                  ρ = π_θ(y_t)/π_θ_old(y_t)
    6. logging    every metric TRL's PPOTrainer logs, masked to real response tokens

Every per-token computation (log-probs, entropy, KL, GAE, masking, whitening) is a
``fastppo.kernels`` call. The plumbing lives beside this file: ``config`` (flags, sizes), ``models``
(loading, the actor-critic forward), ``data``, ``rewards``, ``generation``, ``metrics``, ``dist``,
``checkpoint``.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from fastppo import dist as fdist
from fastppo.data import load_prompts
from fastppo.generation import stop_ids_of
from fastppo.legacy import bind_arguments, check_step_inputs
from fastppo.rewards import call_reward_fn, resolve_reward, reward_fn_columns, reward_model_scores
from fastppo.config import PPOConfig, Sizes, cli_config, derive_legacy_sizes, derive_sizes, resolve_config
from fastppo.kernels import fused_full_kl, gae, kl_penalty, masked_mean, masked_var, masked_whiten, truncate_at_stop
from fastppo.metrics import STAT, STAT_NAMES, UpdateResult

# ============================================================================ 1. rollout


@dataclass(frozen=True)
class Rollout:
    """One iteration's samples, per process. B rows, context C, response T, L = C + T.

    T is the longest real response of the batch (the sampler's response_length when one ran to the end):
    columns of padding only are never computed on.
    """

    query_responses: torch.Tensor  # [B, L] left-padded query, right-padded response cut after the stop token
    attention_mask: torch.Tensor  # [B, L] 1 on real query and response tokens
    context_length: int  # C
    response_mask: torch.Tensor  # [B, T] bool: tokens trained on (real, and not masked out by the caller)
    lengths: torch.Tensor  # [B] real response tokens
    has_stop: torch.Tensor  # [B] bool: the response ended with a stop token
    query_lengths: tuple[int, ...]  # real query tokens per row, on the host (layouts are built there)
    response_lengths: tuple[int, ...]  # real response tokens per row, on the host

    @property
    def responses(self) -> torch.Tensor:
        return self.query_responses[:, self.context_length:]

    @property
    def score_index(self) -> torch.Tensor:
        """[B] the last trained response position: where the score goes."""
        t = self.response_mask.shape[1]
        return t - 1 - self.response_mask.flip(1).int().argmax(1)

    def token_ids(self) -> tuple[list[list[int]], list[list[int]]]:
        """Each row's real prompt tokens and real response tokens (up to and including the stop token)."""
        ids, real, c = self.query_responses.cpu(), self.attention_mask.bool().cpu(), self.context_length
        return ([q[m].tolist() for q, m in zip(ids[:, :c], real[:, :c])],
                [r[m].tolist() for r, m in zip(ids[:, c:], real[:, c:])])

    def layout(self, rows: Sequence[int] | None = None, packed: bool = False):
        """The model layout of ``rows`` (default: all): see ``fastppo.models.Layout``."""
        from fastppo.models import make_layout

        if rows is None:
            return make_layout(self.query_responses, self.context_length, list(self.query_lengths),
                               list(self.response_lengths), packed)
        index = torch.as_tensor(rows, device=self.query_responses.device)
        return make_layout(self.query_responses.index_select(0, index), self.context_length,
                           [self.query_lengths[r] for r in rows], [self.response_lengths[r] for r in rows], packed)


def make_rollout(queries, query_mask, responses, stop_ids: list[int], pad_id: int) -> Rollout:
    """Step 1b: cut each response after its first stop token and lay out x+y for scoring and training."""
    if stop_ids:
        responses, _, real, has_stop = truncate_at_stop(responses, stop_ids, pad_id)
    else:
        real = torch.ones_like(responses, dtype=torch.bool)
        has_stop = torch.zeros(responses.shape[0], dtype=torch.bool, device=responses.device)
    return assemble(queries, query_mask, responses, real, has_stop)


def assemble(queries, query_mask, responses, real, has_stop, train_mask: torch.Tensor | None = None) -> Rollout:
    """x+y as one [B, L] batch: left-padded queries, right-padded responses (``real`` marks their tokens),
    cut to the longest real response. The real lengths go to the host here, once per iteration.

    ``train_mask`` (optional, [B, T]): tokens the caller excludes from training inside the real
    response (tool output in multi-turn); they stay in the sequence and in attention.
    """
    lengths = real.sum(1)
    query_lengths, response_lengths = query_mask.sum(1).tolist(), lengths.tolist()
    t = max(1, max(response_lengths))
    responses, real = responses[:, :t], real[:, :t]
    mask = real if train_mask is None else real & train_mask[:, :t].bool()
    return Rollout(
        query_responses=torch.cat([queries, responses], 1),
        attention_mask=torch.cat([query_mask, real.long()], 1),
        context_length=queries.shape[1],
        response_mask=mask,
        lengths=lengths,
        has_stop=has_stop,
        query_lengths=tuple(query_lengths),
        response_lengths=tuple(response_lengths),
    )


def eos_count(rollout: Rollout, eos_id: int | None) -> torch.Tensor:
    """TRL's val/num_eos_tokens: eos tokens among the real response tokens (padding never counts)."""
    if eos_id is None:
        return torch.zeros((), device=rollout.lengths.device)
    real = torch.arange(rollout.responses.shape[1], device=rollout.lengths.device) < rollout.lengths[:, None]
    return ((rollout.responses == eos_id) & real).sum()


def contains_stop(rollout: Rollout, stop_ids: list[int], eos_id: int | None) -> torch.Tensor:
    """[B] bool: the response ended with a stop token (no stop token set: it contains eos, as TRL)."""
    if stop_ids:
        return rollout.has_stop
    if eos_id is None:
        return torch.zeros_like(rollout.has_stop)
    return (rollout.responses == eos_id).any(1)


def apply_eos_penalties(scores, has_stop, missing_eos_penalty: float | None, non_eos_penalty: bool,
                        penalty_reward_value: float) -> torch.Tensor:
    """TRL 0.26's missing_eos_penalty (subtracted) or PPOv2's non_eos_penalty (the score replaced by
    penalty_reward_value) for responses without a stop token."""
    if non_eos_penalty:
        return torch.where(has_stop, scores, torch.full_like(scores, penalty_reward_value))
    return scores if missing_eos_penalty is None else scores - missing_eos_penalty * (~has_stop).float()


# ============================================================================ 2. scoring


@dataclass(frozen=True)
class Experience:
    """The rollout as π_θ_old, π_ref and V saw it: [B, T] each, 0 on untrained positions (KL, V)."""

    logprobs: torch.Tensor  # log π_θ_old(y_t)
    ref_logprobs: torch.Tensor  # log π_ref(y_t)
    values: torch.Tensor  # V(s_t)
    kl: torch.Tensor  # per-token KL estimate


def score_rollout(actor_critic, reference, rollout: Rollout, temperature: float, kl_estimator: str,
                  chunk: int, packed: bool = False, seconds: dict | None = None) -> Experience:
    """Step 2: log π_θ_old and V (one call of the trained module), log π_ref and the per-token KL, in
    chunks of ``chunk`` rows, under ``torch.inference_mode``.

    ``actor_critic`` is the same module and call as the training forward, on the same layout, so with
    dropout off the first PPO ratio is exactly 1. ``seconds`` collects the time of each model's forwards.
    """
    full = kl_estimator == "full"
    logprobs, ref_logprobs, values, kls = [], [], [], []
    clock = {"policy_value": 0.0, "reference": 0.0}
    with torch.inference_mode():
        for i in range(0, rollout.query_responses.shape[0], chunk):
            layout = rollout.layout(range(i, min(i + chunk, rollout.query_responses.shape[0])), packed)
            t0 = time.perf_counter()
            logp, _, value, hidden = actor_critic(layout, temperature, return_hidden=full)
            t1 = time.perf_counter()
            ref_logp, ref_state = reference(layout, temperature, with_hidden=full)
            if full:
                from fastppo.models import gathered, lm_head_of

                ref_hidden, ref_head = ref_state
                head = lm_head_of(actor_critic.policy)
                bias, ref_bias = getattr(head, "bias", None), getattr(ref_head, "bias", None)
                with gathered(head.weight, bias, ref_head.weight, ref_bias):  # ZeRO-3 only: read outside a forward
                    kls.append(layout.scatter(fused_full_kl(
                        hidden, head.weight.to(hidden.dtype), ref_hidden, ref_head.weight.to(ref_hidden.dtype),
                        temperature, bias=None if bias is None else bias.to(hidden.dtype),
                        ref_bias=None if ref_bias is None else ref_bias.to(ref_hidden.dtype))))
            else:
                kls.append(kl_penalty(logp, ref_logp, kl_estimator))
            clock["policy_value"] += t1 - t0
            clock["reference"] += time.perf_counter() - t1
            logprobs.append(logp)
            ref_logprobs.append(ref_logp)
            values.append(value)
        mask = rollout.response_mask
        out = [torch.cat(logprobs), torch.cat(ref_logprobs), torch.cat(values) * mask, torch.cat(kls) * mask]
    if seconds is not None:
        seconds.update(clock)
    return Experience(*(t.clone() for t in out))  # out of inference mode: usable as constants in the loss


# ============================================================================ 3-4. rewards and advantages


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


@dataclass(frozen=True)
class Targets:
    """What the update regresses to: [B, T] each, 0 on untrained positions."""

    rewards: torch.Tensor
    non_score_reward: torch.Tensor
    advantages: torch.Tensor  # whitened over trained tokens
    returns: torch.Tensor


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


def compute_advantages(rewards, values, response_mask, gamma: float, lam: float, whiten_rewards: bool,
                       skip_masked: bool = False):
    """Step 4: GAE and returns; the advantages are whitened over trained tokens (0 elsewhere).

    ``skip_masked``: positions the caller masked inside a response (tool output) are skipped by the
    recursion, which bootstraps across them from the next trained token (verl's multi-turn GAE).
    """
    if whiten_rewards:
        rewards = masked_whiten(rewards, response_mask, shift_mean=False) * response_mask
    advantages, returns = gae(rewards, values, response_mask, gamma, lam, skip_masked=skip_masked)
    advantages = masked_whiten(advantages, response_mask) * response_mask
    return advantages, returns


# ============================================================================ 5. PPO update


def ppo_losses(new_logprobs, new_values, entropy, old_logprobs, old_values, advantages, returns, mask,
               cliprange: float, cliprange_value: float, vf_coef: float, entropy_coef: float,
               ratio_threshold: float, fused_policy_loss=None):
    """Step 5 for one micro-batch. Returns (loss, stats [len(STAT_NAMES)]), all means over trained tokens.

    ``fused_policy_loss``: the policy part already computed by ``fused_ppo_policy_loss`` (its ``loss``
    is pg − c_H·H̄ with the gradient formed in the forward); ``new_logprobs`` and ``entropy`` are then its
    per-token values laid out as grids, for the statistics.
    """
    # clipped value loss: ½·max((V − G)², (V_old + clip(V − V_old, ±ε_v) − G)²)
    v_clipped = old_values + (new_values - old_values).clamp(-cliprange_value, cliprange_value)
    vf_losses1 = (new_values - returns) ** 2
    vf_losses2 = (v_clipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    # clipped surrogate: max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε))
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses1, pg_losses2), mask)
    mean_entropy = masked_mean(entropy, mask)
    policy_loss = pg_loss - entropy_coef * mean_entropy if fused_policy_loss is None else fused_policy_loss.loss
    loss = policy_loss + vf_coef * vf_loss
    mean_ratio = masked_mean(ratio, mask)
    # legacy TRL's ratio_threshold: a micro-batch whose ratios blew up contributes nothing (no host sync);
    # its logged losses are the ones applied (0), and ratio_skipped counts it
    kept = (mean_ratio <= ratio_threshold).to(loss.dtype)
    loss = loss * kept
    with torch.no_grad():
        stats = torch.empty(len(STAT_NAMES), device=loss.device)
        for name, value in (
            ("approxkl", 0.5 * masked_mean(log_ratio**2, mask)),
            ("policykl", masked_mean(-log_ratio, mask)),
            ("pg_clipfrac", masked_mean((pg_losses2 > pg_losses1).float(), mask)),
            ("pg_loss", pg_loss * kept),
            ("vf_loss", vf_loss * kept),
            ("vf_clipfrac", masked_mean((vf_losses2 > vf_losses1).float(), mask)),
            ("entropy", mean_entropy),
            ("ratio", mean_ratio),
            ("advantages_mean", masked_mean(advantages, mask)),
            ("returns_mean", masked_mean(returns, mask)),
            ("returns_var", masked_var(returns, mask, check=False)),  # NaN under 2 tokens, no sync
            ("vpred_mean", masked_mean(new_values, mask)),
            ("vf_error", masked_mean(vf_losses1, mask)),
            ("values_mean", masked_mean(old_values, mask)),
            ("values_var", masked_var(old_values, mask, check=False)),
            ("ratio_skipped", 1.0 - kept),
        ):
            stats[STAT[name]] = value
    return loss, stats


def micro_batches(order: list[int], sizes: Sizes, lengths: Sequence[int], group_by_length: bool) -> list[list[list[int]]]:
    """The rows of each micro-batch of each minibatch of one epoch, from the epoch's random order.

    Minibatches are consecutive slices of the order (TRL's). ``group_by_length``: within a minibatch,
    rows of similar length share a micro-batch (less padding to compute on); the minibatch, and so
    the optimizer step's rows, is the same random draw.
    """
    out = []
    for mb in range(sizes.num_mini_batches):
        rows = order[mb * sizes.local_mini_batch_size : (mb + 1) * sizes.local_mini_batch_size]
        if group_by_length and sizes.micro_steps > 1:
            rows = sorted(rows, key=lambda r: lengths[r])
        out.append([rows[k * sizes.micro_batch_size : (k + 1) * sizes.micro_batch_size]
                    for k in range(sizes.micro_steps)])
    return out


def ppo_update(model, optimizer, rollout: Rollout, experience: Experience, targets: Targets, config: PPOConfig,
               sizes: Sizes, generator: torch.Generator, autocast: Callable = contextlib.nullcontext,
               log: Callable[[str], None] = print, zero=None) -> UpdateResult:
    """Step 5: num_ppo_epochs × num_mini_batches optimizer steps, each over micro_steps micro-batches.

    A step whose loss or gradient is not finite (on any process) is skipped: the weights and the
    optimizer state never see it. With fused AdamW the skip happens on the device (its ``found_inf``),
    so the loop never waits for the device; another optimizer needs one host sync per step.
    ``zero`` (``fastppo.zero.ZeRO``, ``model`` its engine): DeepSpeed accumulates, clips, steps and skips.
    """
    device = rollout.query_responses.device
    shape = (config.num_ppo_epochs, sizes.num_mini_batches, sizes.micro_steps)
    stats = torch.full((len(STAT_NAMES), *shape), float("nan"), device=device)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = config.max_grad_norm if config.max_grad_norm else float("inf")
    on_device_skip = zero is None and bool(optimizer.defaults.get("fused")) and isinstance(
        optimizer, torch.optim.Adam | torch.optim.AdamW)
    skipped = torch.zeros((), device=device)
    total_lengths = [q + r for q, r in zip(rollout.query_lengths, rollout.response_lengths)]
    fused = getattr(config, "fused_policy_loss", False)
    epochs_run = config.num_ppo_epochs
    model.train()
    for epoch in range(config.num_ppo_epochs):
        order = torch.randperm(sizes.local_batch_size, generator=generator).tolist()
        for mb, micro in enumerate(micro_batches(order, sizes, total_lengths, config.group_by_length)):
            finite = torch.ones((), device=device)
            for k, rows in enumerate(micro):
                layout = rollout.layout(rows, config.padding_free)
                index = torch.as_tensor(rows, device=device)
                old_logprobs, old_values, advantages, returns, mask = (
                    t.index_select(0, index) for t in (experience.logprobs, experience.values, targets.advantages,
                                                       targets.returns, rollout.response_mask))
                policy_loss = dict(old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                                   cliprange=config.cliprange, entropy_coef=config.entropy_coef) if fused else None
                sync = k == sizes.micro_steps - 1  # DDP all-reduces gradients on the last micro-step only
                ddp_accumulates = zero is None and hasattr(model, "no_sync") and not sync
                ctx = model.no_sync() if ddp_accumulates else contextlib.nullcontext()
                with ctx:
                    with autocast():
                        new_logprobs, entropy, new_values, _ = model(layout, config.temperature, return_entropy=True,
                                                                     policy_loss=policy_loss)
                    fused_out = None
                    if fused:
                        fused_out = new_logprobs
                        new_logprobs, entropy = layout.scatter(fused_out.logprobs), layout.scatter(fused_out.entropy)
                    loss, stats[:, epoch, mb, k] = ppo_losses(
                        new_logprobs, new_values, entropy, old_logprobs, old_values, advantages, returns, mask,
                        config.cliprange, config.cliprange_value, config.vf_coef, config.entropy_coef,
                        config.ratio_threshold, fused_out,
                    )
                    finite = finite * torch.isfinite(loss.detach())
                    if zero is not None:
                        zero.backward(loss, finite if sync else None, sizes.micro_steps)
                    else:
                        (loss / sizes.micro_steps).backward()
            if zero is not None:
                if zero.step():
                    skipped += 1.0
                    log(f"non-finite loss or gradient at PPO epoch {epoch}, minibatch {mb}: "
                        "step skipped, weights unchanged")
                continue
            if math.isinf(max_norm):  # no clipping: the norm only for the finite check (no scaling pass)
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            ok = (finite * torch.isfinite(grad_norm)).float()
            fdist.all_reduce_min(ok)
            if on_device_skip:
                optimizer.found_inf = 1.0 - ok  # fused AdamW leaves weights and moments alone where it is 1
                optimizer.step()
                skipped += 1.0 - ok
            elif ok.item() == 1.0:
                optimizer.step()
            else:
                skipped += 1.0
                log(f"non-finite loss or gradient at PPO epoch {epoch}, minibatch {mb}: "
                    "step skipped, weights unchanged")
            optimizer.zero_grad(set_to_none=True)
        if config.early_stopping:
            # legacy TRL: after each epoch, the policy KL of its last minibatch against 1.5 × target_kl
            kl_now = torch.nanmean(stats[STAT["policykl"], epoch, sizes.num_mini_batches - 1]).reshape(1)
            fdist.all_reduce(kl_now)
            if kl_now.item() / sizes.world_size > 1.5 * config.target_kl:
                epochs_run = epoch + 1
                break
    if on_device_skip:
        optimizer.found_inf = None
    steps = epochs_run * sizes.num_mini_batches - skipped
    return UpdateResult(stats, skipped, steps, epochs_run)


# ============================================================================ the trainer object

@dataclass
class RolloutBatch:
    """What ``PPOTrainer.rollout()`` returns: the samples, their scores r(x, y), texts and timing."""

    rollout: Rollout
    scores: torch.Tensor  # [B] after the missing-eos penalty (TRL's objective/scores)
    eos_count: torch.Tensor
    prompts: list[str] | None
    completions: list[str] | None
    seconds: dict[str, float]


class PPOTrainer:
    """PPO on a causal LM: TRL 0.26's ``PPOTrainer`` and legacy TRL's (<= 0.11), in one object.

    TRL 0.26 (``trl.experimental.ppo``)::

        PPOTrainer(args=PPOConfig(...), processing_class=tokenizer, model=policy, ref_model=None,
                   reward_model=rm_or_fn, train_dataset=dataset, value_model=None, peft_config=None,
                   callbacks=None).train()

    Every model argument takes an object or a path; ``reward_model`` also takes a function
    ``fn(prompts, completions, **kwargs)`` or a ``"module:function"`` string. ``None`` falls back to
    the config's paths, and with no model anywhere to the embedded tiny model.

    Legacy TRL (``trl.PPOTrainer``, also Intel's extension)::

        trainer = PPOTrainer(config, model, ref_model, tokenizer, dataset=dataset, data_collator=collator)
        for batch in trainer.dataloader:
            responses = trainer.generate(batch["input_ids"], return_prompt=False, **generation_kwargs)
            stats = trainer.step(batch["input_ids"], responses, rewards)
            trainer.log_stats(stats, batch, rewards)

    Both drive the same steps: ``train()`` loops over ``rollout()`` (step 1) and the update that
    ``step()`` runs on the caller's own samples (steps 2-5).
    """

    def __init__(self, *args, **kwargs):
        from fastppo import models as M
        from fastppo.config import validate_config

        self.api, bound = bind_arguments(args, kwargs)
        legacy = self.api == "legacy"
        config = bound.get("config" if legacy else "args") or PPOConfig()
        if not isinstance(config, PPOConfig):
            raise TypeError(f"{'config' if legacy else 'args'} must be a fastppo.PPOConfig, got {type(config).__name__}")
        self.config = self.args = config = resolve_config(config, self.api)
        notes = validate_config(config)
        model = bound.get("model")
        if legacy and model is None:
            raise ValueError("the legacy PPOTrainer(config, model, ref_model, tokenizer, ...) needs a model")
        # the embedded model is built before the process group exists (transformers saves on rank 0 only after)
        policy_path = model if isinstance(model, str) else (
            None if model is not None else config.sft_model_path or config.model_name_or_path)
        self.embedded = model is None and policy_path is None
        if self.embedded:
            from fastppo.embedded import embedded_model_path

            policy_path = embedded_model_path()
        from fastppo.config import deepspeed_request

        ds_request = deepspeed_request(config)  # DeepSpeed asked for (--deepspeed, --zero_stage, accelerate launch)
        if ds_request is not None and legacy:
            raise ValueError(f"DeepSpeed ({ds_request[1]}) runs with TRL 0.26's PPOTrainer(args=..., ...) API and "
                             "train(); the legacy PPOTrainer(config, model, ...) API trains with DDP (torchrun)")
        if ds_request is not None and (bound.get("peft_config") is not None or (
                isinstance(model, nn.Module) and M.is_peft(model))):
            raise ValueError(f"a PEFT (LoRA) policy with DeepSpeed ({ds_request[1]}) is not supported yet; train LoRA "
                             "with torchrun (DDP)")
        self.dist = fdist.setup_distributed(config.ddp_timeout, config.use_cpu, need_group=ds_request is not None)
        self.device = self.dist.device
        self._setup_console()
        for note in notes:
            self.log(note)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.bf16 = config.bf16 if config.bf16 is not None else (
            self.device.type == "cuda" and torch.cuda.is_bf16_supported())
        self.autocast = lambda: torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)
        if self.bf16 and self.device.type == "cpu":
            self.log("bf16 on a CPU: runs, but usually slower than fp32")

        # --- reward, tokenizer and data first: bad input fails here, before any model is loaded
        reward = bound.get("reward_model")
        if reward is not None and not isinstance(reward, (nn.Module, str)) and not callable(reward):
            raise TypeError(f"reward_model must be a model, a function or a path, got {type(reward).__name__}")
        self.reward_fn, self.reward_fn_name, reward_path = (None, None, None) if legacy else resolve_reward(reward, config)
        tokenizer = bound.get("tokenizer" if legacy else "processing_class")
        if tokenizer is None:
            if legacy:
                raise ValueError("the legacy PPOTrainer needs a tokenizer")
            tokenizer_path = config.model_name_or_path or policy_path or getattr(
                getattr(model, "config", None), "_name_or_path", None)
            if not tokenizer_path:
                raise ValueError("processing_class (the tokenizer) is required when model is an object")
            tokenizer = M.load_tokenizer(tokenizer_path, config, self.log)
        M.ensure_pad_token(tokenizer, self.log)
        self.processing_class = self.tokenizer = tokenizer
        self.stop_ids = stop_ids_of(config, tokenizer)
        vocab = len(tokenizer)
        for token in self.stop_ids:
            if not 0 <= token < vocab:
                raise ValueError(f"stop_token_id {token} is outside the tokenizer's vocabulary (0..{vocab - 1}): "
                                 "responses would never stop")
        if legacy:
            self._legacy_dataset = bound.get("dataset")
            self.prompts = self.prompt_rows = self.eval_prompts = self._resume_path = self.ds_config = None
            self.sizes = derive_legacy_sizes(config, self.dist.world_size)
        else:
            self.prompts, self.prompt_rows = load_prompts(bound.get("train_dataset"), config, tokenizer, log=self.log)
            self.eval_prompts = (load_prompts(bound["eval_dataset"], config, tokenizer, "eval_dataset", self.log)[0]
                                 if bound.get("eval_dataset") is not None else None)
            self.sizes = derive_sizes(config, self.dist.world_size, len(self.prompts))
            self.ds_config = None
            if ds_request is not None:
                from fastppo.zero import resolve_deepspeed_config

                self.ds_config, ds_notes = resolve_deepspeed_config(ds_request, config, self.sizes)
                for note in ds_notes:
                    self.log(note)
            self._resume_path = self._decide_resume()
            M.check_positions(model if isinstance(model, nn.Module) else policy_path, config,
                              max(len(p) for p in self.prompts + (self.eval_prompts or [])))
        if self.embedded:
            self.log(f"no model given: the embedded default (tiny Llama at {policy_path}, built-in prompts, "
                     f"reward {self.reward_fn_name})")

        # --- models
        torch.manual_seed(config.seed)  # the same fresh value head on every process
        built = M.build_models(bound, config, policy_path, tokenizer, reward_path, legacy, self.bf16, self.device,
                               self.log)
        self.policy, self.ref_model, self.value_model, self.reward_model = built
        self.actor_critic = M.PolicyAndValue(self.policy, self.value_model)
        self.model = self.actor_critic
        self.zero = None
        if self.dist.world_size > 1 and self.ds_config is None:
            self.model = nn.parallel.DistributedDataParallel(
                self.actor_critic, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        self.reference = M.Reference(self.ref_model, self.policy)

        # --- optimizer, schedule, controllers, randomness
        optimizers = (bound.get("optimizer"), bound.get("lr_scheduler")) if legacy else (
            bound.get("optimizers") or (None, None))
        self.optimizer = optimizers[0] or self._adamw()
        if self.ds_config is not None:  # DeepSpeed wraps our AdamW; our scheduler keeps driving its param groups
            from fastppo.zero import ZeRO

            self.zero = ZeRO(self.actor_critic, self.optimizer, self.ds_config, [self.ref_model, self.reward_model],
                             self.device, self.log, ds_request[1])
            self.model = self.zero.engine
        self.lr_scheduler = optimizers[1] if optimizers[1] is not None or legacy else self._scheduler()
        self.kl_ctl = (AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon) if config.adaptive_kl
                       else FixedKLController(config.kl_coef))
        from fastppo.rewards import RunningMoments

        self.moments = RunningMoments() if config.use_score_scaling else None
        torch.manual_seed(config.seed + self.dist.rank * 100003)  # each process samples different responses
        self.shuffle = torch.Generator().manual_seed(config.seed + self.dist.rank)
        if not legacy:
            from fastppo.data import prompt_batches

            self._batches = prompt_batches(len(self.prompts), self.sizes.local_batch_size, self.dist.rank,
                                           self.dist.world_size, config.seed)
        self.callbacks = list(bound.get("callbacks") or [])
        self.state = _new_state(self.sizes, len(self.prompts) if self.prompts else None, self.dist.is_main)
        from transformers import TrainerControl

        self.control = TrainerControl()
        self._logger = None
        self._legacy_dataloader = None
        self._legacy_collator = bound.get("data_collator") if legacy else None

    def _adamw(self) -> torch.optim.Optimizer:
        """AdamW over every trainable parameter; ``adamw_torch_fused``: one fused kernel for all of them
        where the device has one (5x faster than the foreach one on the embedded model)."""
        config = self.config
        fused = config.optim == "adamw_torch_fused" and self.device.type in ("cuda", "cpu")
        return torch.optim.AdamW(
            [p for p in self.actor_critic.parameters() if p.requires_grad], lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon, weight_decay=config.weight_decay,
            fused=fused, foreach=None if fused else True,
        )

    def _scheduler(self):
        """transformers' scheduler over the PPO iterations (stepped once each), with the linear warmup asked for."""
        from transformers import get_scheduler

        config, total = self.config, self.sizes.num_total_batches
        warmup = config.warmup_steps if config.warmup_steps >= 1 else (config.warmup_steps or config.warmup_ratio) * total
        return get_scheduler(config.lr_scheduler_type, self.optimizer, num_warmup_steps=math.ceil(warmup),
                             num_training_steps=total, scheduler_specific_kwargs=config.lr_scheduler_kwargs or {})

    # ------------------------------------------------------------------ setup helpers

    def _setup_console(self) -> None:
        from rich.console import Console
        from transformers.utils import logging as hf_logging

        self.console = Console(stderr=False)
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        try:  # transformers 5 writes checkpoints with huggingface_hub's progress bars
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        except ImportError:  # pragma: no cover
            pass

    def log(self, msg: str) -> None:
        if self.dist.is_main:
            self.console.print(f"[fastppo] {msg}", highlight=False, markup=False, soft_wrap=True)

    # ------------------------------------------------------------------ 1. rollout

    @torch.no_grad()
    def rollout(self, prompt_ids: Sequence[Sequence[int]] | None = None, temperature: float | None = None
                ) -> RolloutBatch:
        """Step 1: the next prompts (or ``prompt_ids``), responses y ~ π_θ_old, cut at the stop token, scored.

        ``temperature``: sample at this one instead of the config's (the near-greedy sample table)."""
        from fastppo.data import left_pad
        from fastppo.generation import sample_responses

        config, tok = self.config, self.tokenizer
        t0 = time.perf_counter()
        rows = None
        if prompt_ids is None:
            rows = next(self._batches)
            prompt_ids = [self.prompts[i] for i in rows]
        queries, query_mask = left_pad(prompt_ids, tok.pad_token_id, config.pad_to_multiple_of)
        queries, query_mask = queries.to(self.device), query_mask.to(self.device)
        self.actor_critic.eval()
        context, synced = (contextlib.nullcontext(), False) if self.zero is None else \
            self.zero.generation(self._lm(), config.ds3_gather_for_generation)
        with self.autocast(), context:
            responses = sample_responses(
                self._lm(), queries, query_mask, config.response_length,
                config.temperature if temperature is None else temperature, self.stop_ids,
                tok.pad_token_id, config.local_rollout_forward_batch_size, **({"synced": True} if synced else {}),
            )
        rollout = make_rollout(queries, query_mask, responses, self.stop_ids, tok.pad_token_id)
        t1 = time.perf_counter()
        prompts = completions = None
        with self.autocast():
            if self.reward_model is not None:
                scores = reward_model_scores(self.reward_model, rollout, config.local_rollout_forward_batch_size,
                                             config.padding_free)
            else:
                prompt_ids, completion_ids = rollout.token_ids()
                prompts, completions = self.decode(prompt_ids, completion_ids)
                columns = reward_fn_columns(prompt_ids, completion_ids,
                                            None if rows is None else self.prompt_rows.select(rows))
                scores = call_reward_fn(self.reward_fn, self.reward_fn_name, prompts, completions, self.device,
                                        **columns)
        has_stop = contains_stop(rollout, self.stop_ids, tok.eos_token_id)
        scores = apply_eos_penalties(scores, has_stop, config.missing_eos_penalty, config.non_eos_penalty,
                                     config.penalty_reward_value)
        seconds = {"generation": t1 - t0, "reward": time.perf_counter() - t1}
        return RolloutBatch(rollout, scores, eos_count(rollout, tok.eos_token_id), prompts, completions, seconds)

    # TRL's sample table decodes near-greedily (its generate_completions' temperature)
    SAMPLE_TABLE_TEMPERATURE = 0.01 + 1e-7

    def generate_completions(self, sampling: bool = False) -> tuple[list[str], list[str], list[float]]:
        """TRL's sample table: completions of the eval_dataset's prompts, near-greedy, scored; printed
        on the main process (and appended to samples.jsonl). ``sampling``: the first
        ``per_device_eval_batch_size`` prompts only (what ``train()`` shows), else every eval prompt.

        Generated under a forked random state, so showing samples never changes what training draws.
        Every process runs it (generation and frozen models are collectives under ZeRO-3)."""
        from fastppo.metrics import print_samples

        if self.eval_prompts is None:
            raise ValueError("generate_completions needs an eval_dataset (PPOTrainer(eval_dataset=...))")
        chunk = self.config.per_device_eval_batch_size
        starts = range(0, chunk if sampling else len(self.eval_prompts), chunk)
        prompts, completions, scores = [], [], []
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for start in starts:
                batch = self.rollout(self.eval_prompts[start:start + chunk], self.SAMPLE_TABLE_TEMPERATURE)
                texts = (batch.prompts, batch.completions) if batch.prompts is not None else self.decode(*batch.rollout.token_ids())
                prompts += texts[0]
                completions += texts[1]
                scores += batch.scores.tolist()
        if self.dist.is_main:
            print_samples(self.console, prompts, completions, scores, self.state.global_step,
                          os.path.join(self.config.output_dir, "samples.jsonl"), n=len(prompts))
        return prompts, completions, scores

    def _lm(self):
        from fastppo.models import lm_of

        return lm_of(self.policy)

    def decode(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> tuple[list[str], list[str]]:
        """Prompts and completions as text (``Rollout.token_ids``), special tokens skipped."""
        return (self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=True),
                self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True))

    # ------------------------------------------------------------------ 2-5. scoring, rewards, GAE, update

    def _optimize(self, rollout: Rollout, scores: torch.Tensor, skip_masked: bool = False) -> dict:
        """Steps 2-5 on one rollout batch; returns what the iteration's metrics are made of."""
        config = self.config
        t0 = time.perf_counter()
        # 2. scoring: log π_θ_old and V (one forward of the trained module), log π_ref, per-token KL
        self.actor_critic.eval()
        with self.autocast():
            seconds = {}
            experience = score_rollout(self.actor_critic, self.reference, rollout, config.temperature,
                                       config.kl_estimator, config.local_rollout_forward_batch_size,
                                       config.padding_free, seconds)
        from fastppo.rewards import transform_scores

        final_scores = transform_scores(scores, config.use_score_scaling, config.use_score_norm, config.score_clip,
                                        self.moments)
        # 3. rewards: R_t = −β·KL_t, + score on the last trained token
        kl_coef = self.kl_ctl.value
        rewards, non_score_reward = per_token_rewards(experience.kl, final_scores, rollout.response_mask,
                                                      rollout.score_index, kl_coef)
        # 4. advantages and returns (GAE)
        advantages, returns = compute_advantages(rewards, experience.values, rollout.response_mask, config.gamma,
                                                 config.lam, config.whiten_rewards, skip_masked)
        targets = Targets(rewards, non_score_reward, advantages, returns)
        t1 = time.perf_counter()
        # 5. PPO update, at the learning rate of this iteration
        lr = self.optimizer.param_groups[0]["lr"]
        result = ppo_update(self.model, self.optimizer, rollout, experience, targets, config, self.sizes,
                            self.shuffle, self.autocast, self.log, zero=self.zero)
        t2 = time.perf_counter()
        return dict(experience=experience, targets=targets, result=result, kl_coef=kl_coef, lr=lr,
                    final_scores=final_scores, seconds={"scoring": t1 - t0, "update": t2 - t1,
                                                        **{f"scoring/{k}": v for k, v in seconds.items()}})

    def _end_iteration(self, rollout: Rollout, out: dict, logged_scores, eos) -> dict:
        """6. the iteration's metrics (one all-reduce), the β update, the schedule, the counters."""
        from fastppo.metrics import gather_metrics, objective_sums

        objective = objective_sums(out["experience"].kl, out["experience"].logprobs, out["targets"].non_score_reward,
                                   rollout.response_mask, logged_scores, eos)
        metrics = gather_metrics(objective, out["result"], self.sizes.world_size)
        if metrics["train/skipped_steps"]:
            self.log(f"{metrics['train/skipped_steps']:g} optimizer step(s) skipped for a non-finite loss or gradient "
                     "(weights and optimizer state unchanged by them)")
        self.kl_ctl.update(metrics["objective/kl"], self.sizes.batch_size)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.state.global_step += 1
        self.state.episode += self.sizes.batch_size
        return metrics

    def step(self, queries: list[torch.Tensor], responses: list[torch.Tensor], scores,
             response_masks: list[torch.Tensor] | None = None) -> dict:
        """Legacy TRL's ``step``: one PPO iteration (steps 2-5) on the caller's samples and scores.

        ``queries``/``responses``: lists of 1-D token tensors (responses as ``generate`` returns them,
        cut after the stop token); ``scores``: one score per sample (0-d tensors, floats or a 1-D
        tensor); ``response_masks``: optional 0/1 per response token, 0 on tokens not to train on
        (tool output): GAE then bootstraps across them. Returns legacy TRL's stats keys (and TRL 0.26's).
        """
        from fastppo.data import left_pad, right_pad
        from fastppo.legacy import legacy_step_stats

        scores = check_step_inputs(queries, responses, scores, response_masks, self.sizes.local_batch_size,
                                   self.device)
        pad = self.tokenizer.pad_token_id
        q, q_mask = left_pad([x.tolist() for x in queries], pad, self.config.pad_to_multiple_of)
        r, real = right_pad([x.tolist() for x in responses], pad)
        user_mask = None
        if response_masks is not None:
            user_mask, _ = right_pad([m.long().tolist() for m in response_masks], 0)
        rollout = assemble(q.to(self.device), q_mask.to(self.device), r.to(self.device), real.to(self.device),
                           torch.zeros(len(queries), dtype=torch.bool, device=self.device),
                           None if user_mask is None else user_mask.to(self.device))
        if not bool(rollout.response_mask.any(1).all()):
            raise ValueError("step: every response needs at least one token to train on (check response_masks)")
        out = self._optimize(rollout, scores, skip_masked=response_masks is not None)
        metrics = self._end_iteration(rollout, out, out["final_scores"], eos_count(rollout, self.tokenizer.eos_token_id))
        return legacy_step_stats(metrics, out, rollout, self.config.vf_coef)

    # ------------------------------------------------------------------ the TRL 0.26 loop

    def train(self):
        """``num_total_batches`` iterations of rollout → update; metrics, samples, callbacks, checkpoints.

        Resumes from ``resume_from_checkpoint`` (or, after a torchrun elastic restart, from ``latest``);
        SIGTERM or Ctrl-C makes every process finish its iteration, save a checkpoint and return."""
        from fastppo.metrics import MetricsLogger, plot_curves, print_samples

        config, sizes, state = self.config, self.sizes, self.state
        if self.api == "legacy":
            raise RuntimeError("train() is TRL 0.26's loop; the legacy API drives step() from the caller's loop")
        first = self._start_output()
        self.log(f"{sizes.num_total_batches} iterations × {sizes.batch_size} episodes on {sizes.world_size} "
                 f"process(es), {sizes.local_batch_size} per process; output in {config.output_dir}"
                 + (f"; resuming after iteration {first - 1}" if first > 1 else ""))
        logger = self._logger = MetricsLogger(config, self.dist.is_main, self.log)
        progress = None
        stack = contextlib.ExitStack()
        stack.callback(logger.close)
        stop = stack.enter_context(_StopSignals(self.log))
        if self.dist.is_main and not config.disable_tqdm:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            progress = Progress(TextColumn("episodes"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                console=self.console, transient=False)
            task = progress.add_task("train", total=sizes.num_total_batches * sizes.batch_size,
                                     completed=state.episode)
            progress.start()
            stack.callback(progress.stop)
        self._callback("on_train_begin")
        start, start_episode = time.perf_counter(), state.episode
        preempted = False
        with stack:
            for update in range(first, sizes.num_total_batches + 1):
                # 1. rollout, then 2-5. scoring, rewards, GAE, update
                batch = self.rollout()
                out = self._optimize(batch.rollout, batch.scores)
                # 6. metrics, samples, callbacks, checkpoints
                metrics = self._end_iteration(batch.rollout, out, batch.scores, batch.eos_count)
                state.epoch = state.episode / max(len(self.prompts), 1)
                metrics.update({
                    "eps": (state.episode - start_episode) / (time.perf_counter() - start),
                    "lr": out["lr"],
                    "episode": state.episode,
                    **{f"time/{k}": v for k, v in {**batch.seconds, **out["seconds"]}.items()},
                })
                if config.adaptive_kl:
                    metrics["kl_coef"] = out["kl_coef"]
                if progress is not None:
                    progress.update(task, completed=state.episode)
                if (update % config.logging_steps == 0 or update == sizes.num_total_batches
                        or (update == 1 and config.logging_first_step)):
                    logger.log(metrics, update)
                    self._log_state(metrics)
                    self.log(f"iter {update}/{sizes.num_total_batches} episode {state.episode}: scores "
                             f"{metrics['objective/scores']:.3f} kl {metrics['objective/kl']:.2f} entropy "
                             f"{metrics['objective/entropy']:.1f} vf_loss {metrics['loss/value_avg']:.3f}")
                if sizes.sample_generations_freq and (update - 1) % sizes.sample_generations_freq == 0:
                    if self.eval_prompts is not None:  # TRL's table: the eval prompts, near-greedy
                        self.generate_completions(sampling=True)
                    elif self.dist.is_main:  # no eval_dataset: this iteration's own samples
                        prompts, completions = (batch.prompts, batch.completions) if batch.prompts is not None \
                            else self.decode(*batch.rollout.token_ids())
                        print_samples(self.console, prompts, completions, batch.scores.tolist(), update,
                                      os.path.join(config.output_dir, "samples.jsonl"))
                self._callback("on_step_end")
                preempted = stop.requested_anywhere()
                if preempted or (update % config.save_steps == 0 and update != sizes.num_total_batches):
                    self.save_checkpoint()
                if preempted:
                    self.log(f"stopped by a signal after iteration {update}: checkpoint saved; continue with "
                             "--resume_from_checkpoint latest")
                    break
                if self.control.should_training_stop:
                    self.log(f"a callback stopped training after iteration {update}")
                    break
        if not preempted:
            self.save_model(config.output_dir)  # every rank: a collective under ZeRO-3; rank 0 writes
        if self.dist.is_main and not preempted:
            plot_curves(state.log_history, os.path.join(config.output_dir, "curves.png"), self.log)
            self.log(f"done: {state.episode} episodes in {time.perf_counter() - start:.1f}s; model saved to "
                     f"{config.output_dir}")
        self._callback("on_train_end")
        # DDP's reducer holds the process group: release it here, while every rank is alive, rather than
        # when the trainer is collected after destroy_process_group (a rank once hung in that late teardown).
        self.model = self.actor_critic
        fdist.barrier()
        if self.dist.initialized_here:
            import torch.distributed as dist

            if self.zero is not None:  # DeepSpeed's hooks and buffers, while every rank is alive
                self.zero.destroy()
            dist.destroy_process_group()
        return state

    # ------------------------------------------------------------------ checkpoints and resuming

    def _start_output(self) -> int:
        """The output_dir for this run (resumed, overwritten or fresh); returns the first iteration to run."""
        from fastppo import checkpoint as C

        config = self.config
        path = self._resume_path
        if path is None:
            if config.overwrite_output_dir and self.dist.is_main:
                C.remove_run_files(config.output_dir)
            fdist.barrier()
            return 1
        self._load_checkpoint(path)
        if self.dist.is_main:
            for name, key in (("metrics.jsonl", "step"), ("samples.jsonl", "iteration")):
                C.truncate_jsonl(os.path.join(config.output_dir, name), key, self.state.global_step)
        fdist.barrier()
        return self.state.global_step + 1

    def _decide_resume(self) -> str | None:
        """Before any model loads: which checkpoint this run continues (None: a fresh run), and whether the
        output_dir may be written. A previous run there is never silently mixed with or overwritten."""
        from fastppo import checkpoint as C

        config = self.config
        spec = config.resume_from_checkpoint
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if spec is None and restarted:  # torchrun --max-restarts: carry on from the last checkpoint, if any
            spec = "latest" if C.checkpoints(config.output_dir) else None
            if spec:
                self.log("elastic restart: resuming from the latest checkpoint")
        if spec is not None:
            path = C.resolve_checkpoint(spec, config.output_dir)
            from fastppo.zero import zero_stage_of

            for note in C.check_compatible(path, config, self.dist.world_size, zero_stage_of(self.ds_config)):
                self.log(note)
            return path
        existing = C.run_files(config.output_dir)
        if existing and not config.overwrite_output_dir and not restarted:
            raise ValueError(
                f"--output_dir {config.output_dir!r} already holds a run ({', '.join(existing[:6])}"
                f"{', ...' if len(existing) > 6 else ''}); pass --resume_from_checkpoint latest to continue it, "
                "--overwrite_output_dir to replace it, or another --output_dir"
            )
        return None

    def save_checkpoint(self) -> str:
        """``checkpoint-<iteration>`` with everything needed to continue exactly (see ``fastppo.checkpoint``)."""
        from fastppo import checkpoint as C

        config, state = self.config, self.state
        tag = f"global_step{state.global_step}"
        trainer_state = {
            # under DeepSpeed its engine checkpoint (deepspeed/<tag>) holds each rank's optimizer partition
            "optimizer": self.optimizer.state_dict() if self.zero is None else None,
            "deepspeed": None if self.zero is None else {"zero_stage": self.zero.stage, "tag": tag},
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "kl_coef": self.kl_ctl.value,
            "moments": self.moments.state_dict() if self.moments is not None else None,
            "global_step": state.global_step, "episode": state.episode, "log_history": state.log_history,
            "prompt_batches_drawn": state.global_step,
        }
        states = [None, None]  # whole weights gathered under ZeRO-3 (rank 0)

        def every_rank(tmp):
            self.zero.save(tmp, tag)
            states[:] = self.zero.full_state_dicts(self.dist.rank, self.value_model is not None)

        start = time.perf_counter()
        path = C.save_checkpoint(
            config.output_dir, state.global_step, self.dist.rank, self.dist.world_size,
            lambda tmp: C.save_model_files(tmp, self.policy, self.value_model, self.tokenizer, config, *states),
            trainer_state, C.rng_state(self.shuffle), config.save_total_limit, fdist.barrier,
            every_rank if self.zero is not None else None)
        if self.dist.is_main:
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
            self.log(f"checkpoint saved: {path} ({size / 1e6:.1f} MB in {time.perf_counter() - start:.2f} s)")
        return path

    def _load_checkpoint(self, path: str) -> None:
        from fastppo import checkpoint as C
        from fastppo.models import AutoModelForCausalLMWithValueHead, is_peft, lm_of, read_value_head

        state = torch.load(os.path.join(path, C.STATE_FILE), map_location="cpu", weights_only=False)
        policy = self.policy
        lm = lm_of(policy)
        if self.zero is not None:  # the engine's checkpoint: weights (fp32 partitions) and optimizer state, exactly
            self.zero.load(path, state["deepspeed"]["tag"])
        else:
            if is_peft(policy):
                from peft import set_peft_model_state_dict
                from safetensors.torch import load_file

                set_peft_model_state_dict(lm, load_file(os.path.join(path, "adapter_model.safetensors")))
            else:
                C.load_weights(lm, path)
            if isinstance(policy, AutoModelForCausalLMWithValueHead):
                policy.v_head.load_state_dict(read_value_head(path))
            if self.value_model is not None:
                C.load_weights(self.value_model, os.path.join(path, "value_model"))
            self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.kl_ctl.value = state["kl_coef"]
        if self.moments is not None and state["moments"] is not None:
            self.moments.load_state_dict(state["moments"])
        self.state.global_step, self.state.episode = state["global_step"], state["episode"]
        self.state.log_history = list(state["log_history"])
        for _ in range(state["prompt_batches_drawn"]):  # the prompt order is a function of the seed: replay it
            next(self._batches)
        rng = torch.load(os.path.join(path, f"rng_state_{self.dist.rank}.pt"), map_location="cpu", weights_only=False)
        C.set_rng_state(rng, self.shuffle)
        self.log(f"resumed from {path} (iteration {state['global_step']}, episode {state['episode']})")

    def _log_state(self, metrics: dict) -> None:
        entry = {**metrics, "step": self.state.global_step}
        self.state.log_history.append(entry)
        self._callback("on_log", logs=metrics)

    def _callback(self, event: str, **kwargs) -> None:
        for callback in self.callbacks:
            handler = getattr(callback, event, None)
            if handler is None:
                continue
            control = handler(self.config, self.state, self.control, model=self.actor_critic,
                              processing_class=self.tokenizer, optimizer=self.optimizer,
                              lr_scheduler=self.lr_scheduler, **kwargs)
            if control is not None:
                self.control = control

    # ------------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None) -> None:
        """Policy (+ value head on its trunk), tokenizer and a separate value model (``value_model/``)."""
        from fastppo.checkpoint import save_model_files

        states = (None, None) if self.zero is None else \
            self.zero.full_state_dicts(self.dist.rank, self.value_model is not None)  # ZeRO-3: every rank calls
        if self.dist.is_main:
            save_model_files(output_dir or self.config.output_dir, self.policy, self.value_model, self.tokenizer,
                             self.config, *states)

    def save_pretrained(self, save_directory: str) -> None:
        """Legacy TRL's name: the policy with its value head, and the tokenizer."""
        self.save_model(save_directory)

    # ------------------------------------------------------------------ the legacy loop's helpers

    @property
    def dataloader(self):
        """Legacy TRL's ``trainer.dataloader``: batches of ``batch_size`` rows per process, shuffled, last one
        dropped; rows are dicts of lists (``input_ids`` as 1-D tensors when the dataset is in torch format)."""
        from fastppo.legacy import legacy_dataloader

        if self._legacy_dataloader is None and self.api == "legacy" and self._legacy_dataset is not None:
            self._legacy_dataloader = legacy_dataloader(self._legacy_dataset, self.config, self.dist,
                                                        self._legacy_collator)
        return self._legacy_dataloader

    @property
    def accelerator(self):
        from fastppo.legacy import AcceleratorView

        return AcceleratorView(self.dist)

    @property
    def current_device(self) -> torch.device:
        return self.device

    def generate(self, query_tensor, length_sampler: Callable[[], int] | None = None, batch_size: int = 4,
                 return_prompt: bool = True, generate_ref_response: bool = False, remove_padding: bool = True,
                 **generation_kwargs):
        """Legacy TRL's ``generate``: responses for one query (1-D tensor → [1, L] tensor) or a list of them
        (→ list of 1-D tensors, left padding removed, cut after the first eos). Samples exactly from
        softmax(logits / temperature) unless ``generation_kwargs`` ask for other processing (top_k,
        top_p, min_length, ...), which is then honoured; the checkpoint's generation_config never leaks in."""
        from fastppo.legacy import legacy_generate

        return legacy_generate(self, query_tensor, length_sampler, batch_size, return_prompt, generate_ref_response,
                               remove_padding, generation_kwargs)

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log: Sequence[str] = ("query", "response")):
        """Legacy TRL's ``log_stats``: the step's scalar stats and env/reward_* to the loggers, samples to the table."""
        from fastppo.legacy import legacy_log_stats

        legacy_log_stats(self, stats, batch, rewards, columns_to_log)


class _StopSignals:
    """While training, SIGTERM (preemption, scancel, Kubernetes) and Ctrl-C ask every process to finish its
    iteration, save a checkpoint and return; a second Ctrl-C interrupts at once."""

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self, log):
        self.log = log
        self.flag = False
        self.previous = {}

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                number = getattr(signal, name)
                self.previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number, frame):
        import signal

        if self.flag and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = True
        self.log(f"{signal.Signals(number).name} received: finishing this iteration, then saving a checkpoint")

    def requested_anywhere(self) -> bool:
        """Whether any process got a signal (one small all-reduce per iteration, so all stop together)."""
        flag = torch.tensor([float(self.flag)])
        if fdist.is_distributed():
            import torch.distributed as dist

            backend = dist.get_backend()
            flag = flag.to("cuda") if backend == "nccl" else flag
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def __exit__(self, *exc):
        import signal

        for number, handler in self.previous.items():
            signal.signal(number, handler)
        return False


def _new_state(sizes: Sizes, num_prompts: int | None, is_main: bool):
    """transformers' TrainerState with TRL's ``episode`` counter (TRL's OnlineTrainerState)."""
    from transformers import TrainerState

    state = TrainerState(is_local_process_zero=is_main, is_world_process_zero=is_main)
    state.episode = 0
    state.max_steps = sizes.num_total_batches
    state.num_train_epochs = sizes.num_total_batches * sizes.batch_size / num_prompts if num_prompts else 0
    return state


# ============================================================================ command line


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fastppo.train``: flags to a PPOTrainer, train, save. Bad input: exit 2, no traceback."""
    config = cli_config(argv)
    main_guard(lambda: PPOTrainer(args=config).train(), config)


def main_guard(run: Callable, config: PPOConfig | None = None):
    """Run ``run``; bad input becomes a one-line error and exit 2, a collective that timed out (a frozen
    or dead process) a line naming this rank and --ddp_timeout, and exit 1."""
    from fastppo.rewards import RewardFunctionError

    try:
        return run()
    except (ValueError, TypeError, OSError, RewardFunctionError) as e:  # bad input: the message says it all
        print(f"fastppo.train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    except RuntimeError as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        rank = os.environ.get("RANK", "0")
        timeout = config.ddp_timeout if config is not None else "?"
        print(f"fastppo.train: error: rank {rank}: a collective did not complete within --ddp_timeout {timeout} s; "
              f"another process is frozen or dead ({str(e).splitlines()[0]})", file=sys.stderr)
        raise SystemExit(1) from e


if __name__ == "__main__":
    main()
