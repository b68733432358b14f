"""The legacy adapter's statistics (``fastppo.legacy``): ``step()``'s return value under legacy TRL's key names
beside TRL 0.26's, and ``log_stats()``, which gathers the rewards over the processes and writes the loggers and
samples.jsonl. Legacy-only: the core trainer never reads them (a module of their own keeps ``legacy.py``, the
adapter's API, readable)."""
from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from fastppo.dist import all_gather, is_distributed
from fastppo.kernels import masked_mean
from fastppo.metrics import STAT_NAMES, MetricsLogger, UpdateResult
from fastppo.train import IterationResult

__all__ = ["legacy_step_stats", "legacy_log_stats", "every_rank_arrives", "RENDEZVOUS_TIMEOUT_S"]


def legacy_step_stats(result: IterationResult, vf_coef: float) -> dict:
    """``step()``'s return value: legacy TRL's stats keys (arrays included) beside TRL 0.26's names."""
    rollout, experience, targets, scores = result.batch.rollout, result.experience, result.targets, result.scores
    mask = rollout.response_mask
    query_lengths = rollout.attention_mask[:, : rollout.context_length].sum(1).float().cpu()
    response_lengths = rollout.lengths.float().cpu()
    extra = dict(
        vf_coef=vf_coef, kl_coef=result.kl_coef, learning_rate=result.lr,
        mean_non_score_reward=masked_mean(targets.non_score_reward, mask).item(),
        mean_scores=scores.mean().item(), std_scores=scores.std().item() if scores.numel() > 1 else float("nan"),
        arrays={
            "objective/kl_dist": (experience.kl * mask).sum(1).cpu().numpy(),
            "objective/logprobs": experience.logprobs.cpu().numpy(),  # response positions only
            "objective/ref_logprobs": experience.ref_logprobs.cpu().numpy(),
            "ppo/policy/advantages": targets.advantages[mask].cpu().numpy(),
            "tokens/queries_len_mean": query_lengths.mean().item(),
            "tokens/queries_len_std": query_lengths.std().item() if len(query_lengths) > 1 else 0.0,
            "tokens/queries_dist": query_lengths.numpy(),
            "tokens/responses_len_mean": response_lengths.mean().item(),
            "tokens/responses_len_std": response_lengths.std().item() if len(response_lengths) > 1 else 0.0,
            "tokens/responses_dist": response_lengths.numpy(),
            "time/ppo/forward_pass": result.seconds["scoring/forwards"],
            "time/ppo/compute_rewards": result.seconds["scoring/advantages"],
            "time/ppo/optimize_step": result.seconds["update"],
        },
    )
    start = time.perf_counter()
    stats = legacy_stats(result.metrics, stats_means(result.update), extra)
    stats["time/ppo/calc_stats"] = time.perf_counter() - start
    stats["time/ppo/total"] = result.seconds["scoring"] + result.seconds["update"] + stats["time/ppo/calc_stats"]
    return stats


def legacy_stats(metrics: dict[str, float], stats_mean: dict[str, float], extra: dict) -> dict:
    """The stats dict legacy TRL's ``step()`` returned (its key names), beside fastppo's own names."""
    out = dict(metrics)
    vf_coef = extra["vf_coef"]
    out.update({
        "objective/kl": metrics["objective/kl"],
        "objective/kl_coef": extra["kl_coef"],
        "objective/entropy": metrics["objective/entropy"],
        "ppo/mean_non_score_reward": extra["mean_non_score_reward"],
        "ppo/mean_scores": extra["mean_scores"],
        "ppo/std_scores": extra["std_scores"],
        "ppo/loss/policy": stats_mean["pg_loss"],
        "ppo/loss/value": stats_mean["vf_loss"],
        "ppo/loss/total": stats_mean["pg_loss"] + vf_coef * stats_mean["vf_loss"],
        "ppo/policy/entropy": stats_mean["entropy"],
        "ppo/policy/approxkl": stats_mean["approxkl"],
        "ppo/policy/policykl": stats_mean["policykl"],
        "ppo/policy/clipfrac": stats_mean["pg_clipfrac"],
        "ppo/policy/advantages_mean": stats_mean["advantages_mean"],
        "ppo/policy/ratio": stats_mean["ratio"],  # legacy TRL: per-token ratios; here their mean
        "ppo/returns/mean": stats_mean["returns_mean"],
        "ppo/returns/var": stats_mean["returns_var"],
        "ppo/val/vpred": stats_mean["vpred_mean"],
        "ppo/val/error": stats_mean["vf_error"],
        "ppo/val/clipfrac": stats_mean["vf_clipfrac"],
        "ppo/val/mean": stats_mean["values_mean"],
        "ppo/val/var": stats_mean["values_var"],
        "ppo/val/var_explained": 1.0 - stats_mean["vf_error"] / stats_mean["returns_var"]
        if stats_mean["returns_var"] else float("nan"),
        "ppo/learning_rate": extra["learning_rate"],
    })
    out.update(extra["arrays"])
    return out


def stats_means(result: UpdateResult) -> dict[str, float]:
    """Mean of each statistic over the micro-batches that ran, on this process."""
    stats = result.stats.flatten(1)
    ran = torch.isfinite(stats)
    sums = torch.where(ran, stats, torch.zeros_like(stats)).sum(1)
    counts = ran.sum(1).clamp(min=1)
    return dict(zip(STAT_NAMES, (sums / counts).tolist()))


def legacy_log_stats(trainer, stats: dict, batch: dict, rewards, columns_to_log: Sequence[str]) -> None:
    """``trainer.log_stats()`` (``trainer``: a ``fastppo.legacy.PPOTrainer``): the rewards gathered from every
    process; on the main one the scalar stats and env/reward_* to the loggers and ``trainer.log_history``, at
    step ``trainer.current_step``, and the ``columns_to_log`` of each sample to samples.jsonl."""
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.stack([torch.as_tensor(r, dtype=torch.float32).reshape(()) for r in rewards])
    rewards = rewards.float().reshape(-1).to(trainer.device)
    if is_distributed():
        every_rank_arrives(trainer, "log_stats")
        gathered = [torch.empty_like(rewards) for _ in range(dist.get_world_size())]
        all_gather(gathered, rewards)
        rewards = torch.cat(gathered)
    if not trainer.dist.is_main:
        return
    if trainer.metrics_logger is None:
        trainer.metrics_logger = MetricsLogger(trainer.core_config, True, trainer.log)
    logs = {k: float(v) for k, v in stats.items() if _is_scalar(v)}
    logs["env/reward_mean"] = rewards.mean().item()
    logs["env/reward_std"] = rewards.std().item() if rewards.numel() > 1 else 0.0
    trainer.metrics_logger.log(logs, trainer.current_step)
    trainer.log_history.append({**logs, "step": trainer.current_step})
    columns = [c for c in columns_to_log if c in batch]
    if columns:
        with open(os.path.join(trainer.core_config.output_dir, "samples.jsonl"), "a") as f:
            for i, reward in enumerate(rewards.tolist()[: len(batch[columns[0]])]):
                row = {c: _text(batch[c][i]) for c in columns}
                f.write(json.dumps({"step": trainer.current_step, **row, "reward": reward}) + "\n")


# How long a rank waits for the others at a call every rank must make (log_stats): ranks leave step()'s
# collectives together, so a longer wait means a rank is not coming (the call sits under `if is_main:`).
RENDEZVOUS_TIMEOUT_S = float(os.environ.get("FASTPPO_RENDEZVOUS_TIMEOUT", "120"))


def every_rank_arrives(trainer, call: str) -> None:
    """Before a collective that only some ranks might reach: every rank checks in through the process
    group's key-value store (not a collective, so it cannot pair with another rank's unrelated one) and
    waits, at most ``RENDEZVOUS_TIMEOUT_S``, for the others' n-th check-in. A rank that never comes is an
    error naming the call, instead of a gather blocked forever."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError):  # pragma: no cover  (no reachable store: the plain gather)
        return
    counts = trainer.rendezvous_counts
    n = counts[call] = counts.get(call, 0) + 1
    key = f"fastppo/{call}/{n}/"
    store.set(key + str(dist.get_rank()), "1")
    try:
        store.wait([key + str(r) for r in range(dist.get_world_size())],
                   datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    except RuntimeError as e:  # torch's DistStoreError (a timeout) is one
        raise RuntimeError(
            f"{call}() must be called on every process (it gathers from all of them), but rank {dist.get_rank()} "
            f"waited {RENDEZVOUS_TIMEOUT_S:g} s for the others' call #{n}; call it outside any `if is_main_process:` "
            "(FASTPPO_RENDEZVOUS_TIMEOUT sets the wait)") from e


def _is_scalar(value) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, np.ndarray) and value.size == 1)


def _text(value) -> str:
    return value if isinstance(value, str) else str(value.tolist() if isinstance(value, torch.Tensor) else value)
