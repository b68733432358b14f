"""Metrics: the per-micro-batch statistics of the update, gathered once per iteration into TRL's
metric names (and legacy TRL's ``step()`` stats); the loggers, the sample table and the curves."""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from rich.markup import escape
from rich.table import Table

from fastppo.dist import all_gather, all_reduce, is_distributed
from fastppo.kernels.ppo_loss import vespo_weights

# One row per statistic of ppo_losses, kept per (epoch, minibatch, micro-step); NaN where not run.
STAT_NAMES = (
    "approxkl", "policykl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio",
    "advantages_mean", "returns_mean", "returns_var", "vpred_mean", "vf_error", "values_mean", "values_var",
    "ratio_skipped", "kl_loss", "clip_low", "clip_high", "clip_region", "kl_token_sum", "entropy_token_sum",
    "tokens", "clip_low_sum", "clip_high_sum", "clip_region_sum", "clip_units", "loss", "policy_loss",
    "bonus_entropy_sum", "bonus_tokens", "clip_low_row_min", "clip_high_row_max", "phi_sum", "rows",
)
# Per micro-step sums and their counts, all-reduced slot by slot: TRL GRPO's metrics are, for each micro-step, a mean
# over every process's trained tokens (rows, for the clip fractions under GSPO), then averaged over the micro-steps
GLOBAL_MEANS = {"kl": ("kl_token_sum", "tokens"), "entropy": ("entropy_token_sum", "tokens"),
                "clip_ratio/low_mean": ("clip_low_sum", "clip_units"),
                "clip_ratio/high_mean": ("clip_high_sum", "clip_units"),
                "clip_ratio/region_mean": ("clip_region_sum", "clip_units"),
                "vespo/phi_seq_mean": ("phi_sum", "rows")}
# TRL GRPO's clip metrics by surrogate: the clip family's five; cispo's one (its high side); vespo's mean φ; sapo none
CLIP_METRICS = {"clip": ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                         "clip_ratio/low_min", "clip_ratio/high_max"),
                "cispo": ("cispo_clip_ratio",), "vespo": ("vespo/phi_seq_mean",), "sapo": ()}
SLOT_ROWS = ("kl_token_sum", "entropy_token_sum", "clip_low_sum", "clip_high_sum", "clip_region_sum", "tokens",
             "clip_units", "loss", "policy_loss", "phi_sum", "rows")
STAT = {name: i for i, name in enumerate(STAT_NAMES)}


@dataclass
class UpdateResult:
    stats: torch.Tensor  # [len(STAT_NAMES), epochs, minibatches, micro_steps], NaN where not run
    skipped_steps: torch.Tensor | float  # optimizer steps skipped for a non-finite loss or gradient (on the device)
    optimizer_steps: torch.Tensor | float
    epochs_run: int
    logprobs: torch.Tensor | None = None  # [B, T] π_θ_old's log-probs where the update measured them (no step 2)
    grad_norm: torch.Tensor | float = float("nan")  # the last optimizer step's gradient norm, before clipping
    # each optimizer step's gradient norm (before clipping) and learning rate (the one it stepped with), in order:
    # transformers' grad_norm and learning_rate of a log row at that step
    step_norms: list = field(default_factory=list)
    step_lrs: list[float] = field(default_factory=list)
    step_entropy_coefs: list[float] = field(default_factory=list)  # the adaptive coefficient after each step


# objective_sums' entries, in order
OBJECTIVE_ROWS = ("kl", "entropy", "non_score_reward", "scores", "num_eos", "kl_token_sum", "tokens")


def objective_sums(kl, logprobs, non_score_reward, response_mask, raw_scores, eos_count) -> torch.Tensor:
    """Per-process values of TRL's objective/* metrics: per-sequence sums over real tokens, batch means; then the
    KL's sum over the tokens and their count (TRL RLOO's ``kl``, a token mean over every process)."""
    mask = response_mask
    return torch.stack([
        (kl * mask).sum(1).mean(),
        (-logprobs * mask).sum(1).mean(),
        (non_score_reward * mask).sum(1).mean(),
        raw_scores.nanmean(),  # NaN: a completion no reward judged (TRL's nanmean leaves it out)
        eos_count.float(),
        (kl * mask).sum(),
        mask.sum(),
    ]).float()


# What a run without a value model does not log (TRL GRPO logs no value terms either), and TRL GRPO's name of the
# in-loss KL (beta)
VALUE_METRICS = ("loss/value_avg", "val/clipfrac_avg")
KL_IN_LOSS_METRIC = "kl"


@dataclass(frozen=True)
class MetricTerms:
    """The terms a run has, which decide the metrics it logs. ``critic=False``: no value terms; ``kl=False``: no
    reference ran, so no ``objective/kl``; ``kl_in_loss``: + TRL GRPO's ``kl``, the in-loss per-token KL
    (ρ-weighted under ``use_bias_correction_kl``) as a token mean over every process for each micro-step, averaged
    over the micro-steps, whatever ``loss_type`` aggregates the loss by; ``kl_in_reward``: + TRL RLOO's ``kl``, the
    reward's per-token KL (π_θ_old against π_ref) as a token mean over every process; ``entropy_coef`` not None
    (critic-free, the bonus on: a coefficient ≠ 0, or the adaptive one): + TRL GRPO's ``policy_loss`` (the loss
    before the entropy bonus) and ``entropy_coef``, as TRL logs them."""

    critic: bool = True
    kl: bool = True
    kl_in_loss: bool = False
    kl_in_reward: bool = False
    entropy_coef: float | None = None
    surrogate: str = "clip"  # the loss_type's token loss: which of TRL GRPO's clip metrics it logs (CLIP_METRICS)


def gather_metrics(objective: torch.Tensor, result: UpdateResult, world_size: int, terms: MetricTerms = MetricTerms(),
                   reward_columns: dict[str, torch.Tensor] | None = None,
                   steps_out: list | None = None) -> dict[str, float]:
    """TRL 0.26's metrics from this process's sums: one all-reduce and one host transfer per iteration (two more
    for the rewards' moments); ``terms`` says which (``MetricTerms``). ``reward_columns``: each reward's scores
    (NaN where it did not judge), logged as TRL GRPO's ``rewards/<name>/mean`` and ``/std`` over the completions
    it judged on every process (``reward_moments``). ``steps_out`` (critic-free runs): appended with each
    optimizer step's own metrics, as TRL GRPO records them per step (``optimizer_step_metrics``), from the same
    all-reduce."""
    stats = result.stats.flatten(1)  # [S, n]
    ran = torch.isfinite(stats)
    counts = ran.sum(1).float()
    sums = torch.where(ran, stats, torch.zeros_like(stats)).sum(1)
    ratio_row = stats[STAT["ratio"]]
    ratio = torch.where(ran[STAT["ratio"]], ratio_row, torch.zeros_like(ratio_row))
    columns = reward_columns or {}
    slots = stats.shape[1]  # GLOBAL_MEANS' sums and counts per micro-step, all-reduced slot by slot
    slot_sums = stats[[STAT[n] for n in SLOT_ROWS]].reshape(-1).to(objective.device, objective.dtype)
    packed = torch.cat([
        objective, sums, counts, (ratio**2).sum().reshape(1),
        torch.as_tensor(result.skipped_steps, dtype=torch.float32).to(objective.device).reshape(1), slot_sums,
    ])
    packed = all_reduce(packed).tolist()
    n_obj, n = objective.numel(), len(STAT_NAMES)
    kl_sum, entropy, nsr, scores, num_eos, kl_tokens, tokens = packed[:n_obj]
    sums, counts = packed[n_obj : n_obj + n], packed[n_obj + n : n_obj + 2 * n]
    ratio_sq, skipped = packed[n_obj + 2 * n], packed[n_obj + 2 * n + 1]
    first = n_obj + 2 * n + 2
    by_slot = {name: packed[first + i * slots: first + (i + 1) * slots] for i, name in enumerate(SLOT_ROWS)}
    mean = {name: (s / c if c else float("nan")) for name, s, c in zip(STAT_NAMES, sums, counts)}
    c = counts[STAT["ratio"]]
    ratio_var = (ratio_sq - c * mean["ratio"] ** 2) / (c - 1) if c > 1 else 0.0
    w = world_size
    metrics = {
        "objective/kl": kl_sum / w,
        "objective/entropy": entropy / w,
        "objective/non_score_reward": nsr / w,
        "objective/rlhf_reward": (nsr + scores) / w,
        "objective/scores": scores / w,
        "policy/approxkl_avg": mean["approxkl"],
        "policy/clipfrac_avg": mean["pg_clipfrac"],
        # TRL GRPO's per-side clip fractions (fastppo.kernels.clip_sides), global means (GLOBAL_MEANS)
        **{name: _global_mean(by_slot, name) for name in GLOBAL_MEANS if name.startswith("clip_ratio/")},
        "loss/policy_avg": mean["pg_loss"],
        "loss/value_avg": mean["vf_loss"],
        "val/clipfrac_avg": mean["vf_clipfrac"],
        "policy/entropy_avg": mean["entropy"],
        "val/ratio": mean["ratio"],
        "val/ratio_var": max(ratio_var, 0.0),
        "val/num_eos_tokens": num_eos,
        "train/skipped_steps": skipped / w,
        "train/ratio_skipped_microbatches": sums[STAT["ratio_skipped"]],
    }
    if terms.kl_in_loss:  # TRL GRPO's: each micro-step's token mean over every process, averaged over the micro-steps
        metrics[KL_IN_LOSS_METRIC] = _global_mean(by_slot, KL_IN_LOSS_METRIC)
    elif terms.kl_in_reward:  # TRL RLOO's: the reward's KL, a token mean over the batch of every process
        metrics[KL_IN_LOSS_METRIC] = kl_tokens / max(tokens, 1.0)
    if not terms.critic:  # TRL GRPO's entropy and loss (a critic-free run logs TRL GRPO's names)
        metrics["entropy"] = _global_mean(by_slot, "entropy")
        metrics["loss"] = mean["loss"]  # each optimizer step's loss as minimised, averaged
        low_min, high_max = extreme_clip_shares(result.stats)
        metrics["clip_ratio/low_min"], metrics["clip_ratio/high_max"] = _finite_mean(low_min), _finite_mean(high_max)
        metrics["cispo_clip_ratio"] = metrics["clip_ratio/high_mean"]  # cispo's one side
        metrics["vespo/phi_seq_mean"] = _global_mean(by_slot, "vespo/phi_seq_mean")
        for name in {n for names in CLIP_METRICS.values() for n in names} - set(CLIP_METRICS[terms.surrogate]):
            del metrics[name]  # TRL logs its loss type's clip metrics only
        if steps_out is not None:
            steps_out.extend(optimizer_step_metrics(result, by_slot, (low_min, high_max), world_size, terms))
        metrics["grad_norm"] = float(result.grad_norm)  # transformers': the last step's, before clipping
        if terms.entropy_coef is not None:
            metrics["policy_loss"], metrics["entropy_coef"] = mean["policy_loss"], terms.entropy_coef
    for name, (mean_r, std_r) in zip(columns, reward_moments(list(columns.values()))):
        metrics[f"rewards/{name}/mean"] = mean_r
        metrics[f"rewards/{name}/std"] = std_r
    for name in (() if terms.critic else VALUE_METRICS) + (() if terms.kl else ("objective/kl",)):
        del metrics[name]
    return metrics


def sampling_difference(sampled: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """TRL's ``sampling/sampling_logp_difference/{mean,max}``: |log π_θ_old − the sampler's log-prob| over the trained
    tokens the sampler reported, every process's."""
    shared = mask.bool() & ~torch.isnan(sampled)
    gap = torch.where(shared, (old.float() - sampled.float()).abs(), torch.zeros((), device=old.device))
    total = all_reduce(torch.stack([gap.sum(), shared.sum().float()]))
    largest = all_reduce(gap.max().reshape(1), torch.distributed.ReduceOp.MAX if is_distributed() else None)
    return {"sampling/sampling_logp_difference/mean": (total[0] / total[1].clamp(min=1)).item(),
            "sampling/sampling_logp_difference/max": largest.item()}


def extreme_clip_shares(stats: torch.Tensor) -> tuple[list[float], list[float]]:
    """TRL GRPO's ``clip_ratio/low_min`` and ``clip_ratio/high_max`` per micro-step: the smallest (largest) share of
    a sequence's tokens clipped below (above) the range, over every process's sequences (one all-reduce: the
    largest high share is minus the smallest of its negation); NaN where the micro-step did not run or no sequence
    had a token."""
    # NaN where the micro-step did not run or had no sequence: +inf, which a MIN passes over (TRL's nanmin, nanmax)
    shares = torch.stack([stats[STAT["clip_low_row_min"]].flatten(), -stats[STAT["clip_high_row_max"]].flatten()])
    shares = torch.nan_to_num(shares, nan=math.inf, posinf=math.inf, neginf=math.inf)
    if is_distributed():
        shares = all_reduce(shares, torch.distributed.ReduceOp.MIN)
    low, high = shares.tolist()
    return ([v if math.isfinite(v) else math.nan for v in low], [-v if math.isfinite(v) else math.nan for v in high])


def row_statistics(stats: torch.Tensor, sides: list[torch.Tensor], real: torch.Tensor, log_ratio: torch.Tensor,
                   advantages: torch.Tensor, vespo_gamma: tuple | None) -> None:
    """A micro-batch's per-sequence statistics into ``stats``: its rows; the smallest share of a sequence's units
    clipped low and the largest clipped high (TRL GRPO's ``masked_seq_mean`` per sequence, before its nanmin and
    nanmax over the sequences; ``sides``: the low and high flags per token [B, T], or per row [B] under a
    sequence-level ratio; a sequence without a token has no share and is passed over: ±inf where none has one);
    with ``vespo_gamma``, the sum over the rows of VESPO's φ(w) (TRL's ``vespo/phi_seq_mean``)."""
    low, high = sides[0].float(), sides[1].float()
    if low.dim() == 2:
        count = real.sum(1).float()
        low, high = low.sum(1) / count, high.sum(1) / count  # NaN where count is 0
    else:
        has = real.any(1)
        low, high = torch.where(has, low, math.nan), torch.where(has, high, math.nan)
    stats[STAT["clip_low_row_min"]] = low.nan_to_num(nan=math.inf).min()
    stats[STAT["clip_high_row_max"]] = high.nan_to_num(nan=-math.inf).max()
    stats[STAT["rows"]] = float(real.shape[0])
    if vespo_gamma is not None:
        rows = torch.arange(real.shape[0], device=real.device)[:, None].expand_as(real)
        stats[STAT["phi_sum"]] = vespo_weights(log_ratio, advantages, real, rows, real.shape[0], vespo_gamma)[:, 0].sum()


def _finite_mean(values: list[float]) -> float:
    kept = [v for v in values if math.isfinite(v)]
    return sum(kept) / len(kept) if kept else float("nan")


def optimizer_step_metrics(result: UpdateResult, by_slot: dict[str, list[float]],
                           extremes: tuple[list[float], list[float]], world_size: int,
                           terms: MetricTerms) -> list[dict]:
    """Each optimizer step's metrics as TRL GRPO records them: its ``loss`` (the mean over processes of the
    step's loss as minimised; ``local_loss``, this process's), ``grad_norm`` and ``learning_rate`` (transformers'
    log row at that step), and the per-micro-step values its ``compute_loss`` appends (``entropy``, ``kl``, ``clip_ratio/*``, ``policy_loss``,
    ``entropy_coef``), which a log row averages with every other value appended since the last row. Steps the
    update did not run (``max_steps`` ended inside the batch) are left out."""
    epochs, minibatches, micro = result.stats.shape[1:]
    low_min, high_max = extremes
    slot_means = {name: [s / max(c, 1.0) if math.isfinite(s) else math.nan
                         for s, c in zip(by_slot[GLOBAL_MEANS[name][0]], by_slot[GLOBAL_MEANS[name][1]])]
                  for name in GLOBAL_MEANS}
    clip_names = {"cispo_clip_ratio": "clip_ratio/high_mean"}  # cispo's is its high side
    names = ["entropy", *(["kl"] if terms.kl_in_loss else []),
             *(n for n in CLIP_METRICS[terms.surrogate] if n in GLOBAL_MEANS or n in clip_names)]
    local_losses = result.stats[STAT["loss"]].flatten().tolist()  # this process's (the slot sums are every one's)
    steps = []
    for index in range(epochs * minibatches):
        window = range(index * micro, (index + 1) * micro)
        ran = [i for i in window if math.isfinite(by_slot["tokens"][i])]
        if not ran:
            continue
        values = {name: [slot_means[clip_names.get(name, name)][i] for i in ran] for name in names}
        if terms.surrogate == "clip":
            values["clip_ratio/low_min"] = [low_min[i] for i in ran]
            values["clip_ratio/high_max"] = [high_max[i] for i in ran]
        position = len(steps)
        if terms.entropy_coef is not None:  # policy_loss per micro-step; the coefficient once per step
            values["policy_loss"] = [by_slot["policy_loss"][i] / world_size for i in ran]
            coefficients = result.step_entropy_coefs
            values["entropy_coef"] = [coefficients[position] if position < len(coefficients) else terms.entropy_coef]
        steps.append({"loss": sum(by_slot["loss"][i] for i in ran) / len(ran) / world_size,
                      "local_loss": sum(local_losses[i] for i in ran) / len(ran),
                      "grad_norm": float(result.step_norms[position]) if position < len(result.step_norms)
                      else float("nan"),
                      "learning_rate": result.step_lrs[position] if position < len(result.step_lrs)
                      else float("nan"),
                      "values": values})
    return steps


def nan_std(r: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased std over the non-NaN entries (TRL's nanstd): NaN under two of them."""
    if dim is None:
        r, dim = r.reshape(-1), 0
    n = (~torch.isnan(r)).sum(dim, keepdim=keepdim)
    squares = ((r - r.nanmean(dim, keepdim=True)) ** 2).nansum(dim, keepdim=keepdim)
    return torch.where(n > 1, squares / (n - 1).clamp(min=1), torch.full_like(squares, float("nan"))).sqrt()


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor, scores: torch.Tensor, k: int,
                       scale_rewards: str) -> dict[str, float]:
    """TRL GRPO's metrics of the rollout, over every process: ``completions/{mean,min,max}_length``,
    ``completions/clipped_ratio`` (the share that ran out of tokens before a stop token),
    ``completions/{mean,min,max}_terminated_length`` (of those that stopped; 0 when none did), ``reward`` and
    ``reward_std`` (the score's mean and unbiased std) and ``frac_reward_zero_std`` (the share of completions whose
    group's std, or under ``scale_rewards="batch"`` the batch's, is 0; k > 1). Taken in float64 (a group of equal
    float32 rewards has a std of exactly 0, which TRL's float32 std can miss); a NaN score (no reward judged the
    completion) is left out, as TRL's nanmean and nanstd leave it."""
    local = torch.stack([lengths.double(), truncated.double(), scores.double()], 1)
    if is_distributed():  # groups never span processes: the concatenation keeps them whole
        local = torch.cat(all_gather([torch.empty_like(local) for _ in range(torch.distributed.get_world_size())],
                                     local))
    length, cut, reward = local.unbind(1)
    stopped = length[cut == 0] if bool((cut == 0).any()) else torch.zeros(1, dtype=length.dtype)
    metrics = {"completions/mean_length": length.mean(), "completions/min_length": length.min(),
               "completions/max_length": length.max(), "completions/clipped_ratio": cut.mean(),
               "completions/mean_terminated_length": stopped.mean(),
               "completions/min_terminated_length": stopped.min(),
               "completions/max_terminated_length": stopped.max(), "reward": reward.nanmean(),
               "reward_std": nan_std(reward)}
    if k > 1:
        std = nan_std(reward).expand(reward.shape) if scale_rewards == "batch" else nan_std(reward.view(-1, k), 1)
        metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).double().mean()
    return {name: float(value) for name, value in metrics.items()}


def _global_mean(by_slot: dict[str, list[float]], metric: str) -> float:
    """A GLOBAL_MEANS metric: per micro-step its sum over every process / its count (at least 1, as TRL's), then
    the mean over the micro-steps that ran (NaN: none did)."""
    total, count = GLOBAL_MEANS[metric]
    per_slot = [s / max(c, 1.0) for s, c in zip(by_slot[total], by_slot[count]) if math.isfinite(s)]
    return sum(per_slot) / len(per_slot) if per_slot else float("nan")


def reward_moments(columns: list[torch.Tensor]) -> list[tuple[float, float]]:
    """(mean, unbiased std) of each reward's scores over the completions it judged (NaN: not judged) on every
    process: TRL GRPO's nanmean and nanstd, computed in float64 and in two passes (the second around the first's
    mean, with its residual subtracted), so that rewards near 1,000 with a spread of 0.02 keep their spread."""
    if not columns:
        return []
    judged = [~torch.isnan(c) for c in columns]
    first = torch.stack([torch.stack([torch.where(j, c.double(), 0.0).sum(), j.sum().double()])
                         for c, j in zip(columns, judged)])
    all_reduce(first)
    counts = first[:, 1]
    centre = first[:, 0] / counts.clamp(min=1)
    second = torch.stack([torch.stack([torch.where(j, c.double() - m, 0.0).sum(),
                                       torch.where(j, (c.double() - m) ** 2, 0.0).sum()])
                          for c, j, m in zip(columns, judged, centre)])
    all_reduce(second)
    out = []
    for (residual, squares), m, n in zip(second.tolist(), centre.tolist(), counts.tolist()):
        mean = m + residual / n if n else float("nan")
        var = (squares - residual * residual / n) / (n - 1) if n > 1 else float("nan")
        out.append((mean, math.sqrt(max(var, 0.0)) if n > 1 else float("nan")))
    return out


class MetricsLogger:
    """metrics.jsonl always; tensorboard / wandb when asked for and installed (rank 0 only)."""

    def __init__(self, config, is_main: bool, log: Callable[[str], None]):
        self.is_main = is_main
        self.tb = self.wandb = None
        if not is_main:
            return
        os.makedirs(config.output_dir, exist_ok=True)
        self.path = os.path.join(config.output_dir, "metrics.jsonl")
        self.file = None  # opened at the first line: a run that fails before it leaves no empty file behind
        # TRL names a run exp_name__seed__time; a run_name the user set is kept
        self.run_name = config.run_name or f"{config.exp_name}__{config.seed}__{int(time.time())}"
        targets = {t.lower() for t in config.report_to}
        everything = "all" in targets
        if everything or "tensorboard" in targets:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(config.output_dir, "runs", self.run_name))
            except ImportError:
                if not everything:
                    log("report_to tensorboard: tensorboard is not installed; skipping it")
        if everything or "wandb" in targets:
            try:
                import wandb

                self.wandb = wandb.init(name=self.run_name, project=getattr(config, "project", None) or "fastppo",
                                        config=config.to_dict())
            except ImportError:
                if not everything:
                    log("report_to wandb: wandb is not installed; skipping it")

    def log(self, metrics: dict, step: int) -> None:
        if not self.is_main:
            return
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.file is None:  # a fresh run starts from an empty output_dir; a resumed one appends
            self.file = open(self.path, "a")
        self.file.write(json.dumps({**scalars, "step": step}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        """Each sink closed once (``train()``'s end, then ``end()``, close nothing twice)."""
        if self.is_main:
            if self.file is not None:
                self.file.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()
            self.file = self.tb = self.wandb = None


# dynamic sampling's metrics of a batch, in curves.png (fastppo.dynamic_sampling)
DYNAMIC_SAMPLING_CURVES = ("dynamic_sampling/generation_rounds", "dynamic_sampling/frac_groups_dropped",
                           "dynamic_sampling/sampled_per_trained_token")


def plot_curves(history: list[dict], path: str, log: Callable[[str], None]) -> None:
    """PNG of scores / RLHF reward, KL and entropy against episodes; under dynamic sampling also its rounds, dropped
    groups and sampled tokens per trained token against episodes, and the reward against the prompts drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no curves.png")
        return
    history = [m for m in history if "episode" in m and "objective/scores" in m]
    if not history:
        return
    episodes = [m["episode"] for m in history]
    panels = [(("objective/scores", "objective/rlhf_reward"), "reward", "episode"),
              (("objective/kl",), "KL to reference (nats / sequence)", "episode"),
              (("objective/entropy",), "entropy (nats / sequence)", "episode")]
    if "dynamic_sampling/generation_rounds" in history[0]:
        panels += [(DYNAMIC_SAMPLING_CURVES, "dynamic sampling, per batch", "episode"),
                   (("objective/scores", "dynamic_sampling/sampled_reward_mean"), "reward against prompts drawn",
                    "dynamic_sampling/prompts_consumed")]
    fig, axes = plt.subplots(1, len(panels), figsize=(13 * len(panels) / 3, 3.6))
    for ax, (keys, title, x) in zip(axes, panels):
        shown = [key for key in keys if key in history[0]]  # no objective/kl where no reference ran
        for key in shown:
            ax.plot([m[x] for m in history], [m[key] for m in history], label=key)
        ax.set_title(title if shown else f"{title}: not computed in this run")
        ax.set_xlabel(x.split("/")[-1].replace("_", " "))
        if shown:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_completions(console, table: dict[str, list], step: int, rows: list[int]) -> None:
    """TRL GRPO's ``log_completions`` table: ``table``'s columns (prompt, completion, each reward, advantage, the
    reward functions' logged columns), the given ``rows``. Text is escaped: rich would read ``[none]`` in a
    completion as markup and drop it."""
    shown = Table(title=f"completions at step {step}", show_lines=True)
    for name in table:
        shown.add_column(escape(name), overflow="fold",
                         justify="right" if name not in ("prompt", "completion") else "left")
    for i in rows:
        shown.add_row(*(f"{v[i]:.2f}" if isinstance(v[i], float) else escape(str(v[i])) for v in table.values()))
    console.print(shown)


class Samples(NamedTuple):
    """The rows of a sample table: prompts, completions and their scores; ``columns``: each reward's own score
    beside the total (NaN: that reward did not judge the row); ``extra``: the columns reward functions logged
    (``log_extra``), one value per row."""

    prompts: list[str]
    completions: list[str]
    scores: list[float]
    columns: dict[str, list[float]] | None = None
    extra: dict[str, list] | None = None


def print_samples(console, samples: Samples, update: int, path: str | None, n: int = 6) -> None:
    """A rich table of sample completions, also appended to ``path`` (samples.jsonl; None: printed only). Text is
    escaped for the table (rich reads ``[none]`` as markup), written as it is to the file."""
    prompts, completions, scores, columns, extra = samples
    columns = columns if columns and len(columns) > 1 else {}  # one reward: its column is the score
    extra = extra or {}
    table = Table(title=f"samples at iteration {update}", show_lines=False)
    table.add_column("query", overflow="fold")
    table.add_column("response", overflow="fold")
    for name in columns:
        table.add_column(escape(name), justify="right")
    for name in extra:
        table.add_column(escape(name), overflow="fold")
    table.add_column("score", justify="right")
    rows = list(zip(prompts, completions, scores, *columns.values(), *extra.values()))[:n]
    for p, c, s, *each in rows:
        scored, logged = each[:len(columns)], each[len(columns):]
        table.add_row(escape(p), escape(c), *(f"{x:.3f}" for x in scored), *(escape(str(x)) for x in logged),
                      f"{s:.3f}")
    if path is not None:
        with open(path, "a") as f:
            for p, c, s, *each in rows:
                scored, logged = each[:len(columns)], each[len(columns):]
                more = {"rewards": dict(zip(columns, (None if x != x else x for x in scored)))} if columns else {}
                if extra:
                    more["extra"] = dict(zip(extra, logged))
                f.write(json.dumps({"iteration": update, "query": p, "response": c, "score": s, **more},
                                   default=str) + "\n")
    console.print(table)


class RewardLogs:
    """What reward functions log through the keywords TRL GRPO passes them: ``log_metric(name, value)``, scalars
    averaged over the calls of an iteration on every process, and ``log_extra(column, values)``, a column of the
    sample table (one value per completion)."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.metrics: dict[str, list[float]] = {}
        self.extra: dict[str, list] = {}
        self.tool_counts: list[tuple[float, float, float]] = []  # each rollout's (calls, failures, completions)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_tool_counts(self, calls: float, failures: float, completions: float) -> None:
        """A rollout's TRL ``tools/call_frequency`` (calls per completion) and ``tools/failure_frequency``
        (failures per call), every process's counts."""
        self.tool_counts.append((calls, failures, completions))
        self.log_metric("tools/call_frequency", calls / completions)
        self.log_metric("tools/failure_frequency", failures / calls if calls else 0.0)

    def pool_tool_counts(self, since: int) -> None:
        """The rollouts logged from ``since`` on (one batch's rounds of dynamic sampling) as one rollout of all
        their completions: the mean of the rounds' failure frequencies would count a round without calls as 0."""
        rounds = len(self.tool_counts) - since
        if rounds < 2:
            return
        calls, failures, completions = map(sum, zip(*self.tool_counts[since:]))
        del self.tool_counts[since:]
        for name in ("tools/call_frequency", "tools/failure_frequency"):
            del self.metrics[name][-rounds:]
        self.log_tool_counts(calls, failures, completions)

    def log_extra(self, column: str, values) -> None:
        self.extra.setdefault(str(column), []).extend(list(values))

    def take_metrics(self, device) -> dict[str, float]:
        """This iteration's metrics, each the mean of its values over every process (a collective: every process
        calls it in step; its sums on ``device``, the process group's), and cleared."""
        names = set(self.metrics)
        if is_distributed():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, sorted(names))
            names = set().union(*map(set, gathered))
        out = {}
        for name in sorted(names):
            values = self.metrics.get(name, [])
            total, count = all_reduce(torch.tensor([sum(values), len(values)], dtype=torch.float64,
                                                   device=device)).tolist()
            out[name] = total / count if count else float("nan")
        self.metrics.clear()
        self.tool_counts.clear()
        return out

    def take_extra(self, rows: int) -> dict[str, list]:
        """This iteration's logged columns of ``rows`` values, and cleared; a column of another length is left out
        of the table, saying so."""
        out = {}
        for column, values in self.extra.items():
            if len(values) == rows:
                out[column] = values
            else:
                self.log(f"log_extra({column!r}): {len(values)} values for {rows} completions; not shown")
        self.extra.clear()
        return out
