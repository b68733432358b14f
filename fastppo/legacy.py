"""Legacy TRL's (<= 0.11) loop helpers for ``PPOTrainer``: ``dataloader``, ``generate``, ``log_stats`` and the
``accelerator`` attributes user loops read. The algorithm itself is ``PPOTrainer.step`` in ``train.py``."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

# generate() kwargs whose given value keeps sampling exactly softmax(logits / temperature)
_NEUTRAL = {
    "do_sample": (True,), "top_k": (0, 0.0, None), "top_p": (1.0, None), "min_length": (-1, 0, None),
    "min_new_tokens": (0, None), "num_beams": (1, None), "num_return_sequences": (1, None),
    "repetition_penalty": (1.0, None), "typical_p": (1.0, None), "min_p": (None, 0.0), "use_cache": (True, False),
}
_PASSED_THROUGH = ("max_new_tokens", "temperature", "pad_token_id", "eos_token_id")


_TRL_PARAMETERS = ("args", "processing_class", "model", "ref_model", "reward_model", "train_dataset", "value_model",
                   "data_collator", "eval_dataset", "optimizers", "callbacks", "peft_config")
_LEGACY_PARAMETERS = ("config", "model", "ref_model", "tokenizer", "dataset", "optimizer", "data_collator",
                      "num_shared_layers", "lr_scheduler", "training_data_collator")
_LEGACY_ONLY = frozenset(_LEGACY_PARAMETERS) - frozenset(_TRL_PARAMETERS)
_TRL_ONLY = frozenset(_TRL_PARAMETERS) - frozenset(_LEGACY_PARAMETERS)


def bind_arguments(args: tuple, kwargs: dict) -> tuple[str, dict]:
    """Which of TRL's two PPOTrainer signatures a call uses, and its arguments by name.

    Legacy (TRL <= 0.11): ``PPOTrainer(config, model, ref_model, tokenizer, dataset=...)``; TRL 0.26:
    ``PPOTrainer(args, processing_class, model, ref_model, reward_model, train_dataset, value_model, ...)``.
    A legacy-only keyword, or a model (not a tokenizer) in second position, means legacy.
    """
    legacy = bool(_LEGACY_ONLY & kwargs.keys()) or (len(args) >= 2 and isinstance(args[1], nn.Module))
    if legacy and _TRL_ONLY & kwargs.keys():
        raise TypeError(f"PPOTrainer: {sorted(_TRL_ONLY & kwargs.keys())} (TRL 0.26's constructor) cannot be mixed "
                        f"with {sorted(_LEGACY_ONLY & kwargs.keys()) or 'a model in second position'} (legacy TRL's)")
    names = _LEGACY_PARAMETERS if legacy else _TRL_PARAMETERS
    if len(args) > len(names):
        raise TypeError(f"PPOTrainer takes at most {len(names)} positional arguments, got {len(args)}")
    bound = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in names:
            raise TypeError(f"PPOTrainer got an unexpected keyword argument {name!r} "
                            f"({'legacy' if legacy else 'TRL 0.26'} signature: {', '.join(names)})")
        if name in bound:
            raise TypeError(f"PPOTrainer got multiple values for argument {name!r}")
        bound[name] = value
    return ("legacy" if legacy else "trl"), bound


class AcceleratorView:
    """The ``trainer.accelerator`` attributes legacy loops read (device, ranks, unwrap_model, print)."""

    def __init__(self, state):
        self._state = state

    device = property(lambda self: self._state.device)
    num_processes = property(lambda self: self._state.world_size)
    process_index = property(lambda self: self._state.rank)
    local_process_index = property(lambda self: self._state.local_rank)
    is_main_process = property(lambda self: self._state.rank == 0)
    is_local_main_process = property(lambda self: self._state.local_rank == 0)

    @staticmethod
    def unwrap_model(model):
        return getattr(model, "module", model)

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    @staticmethod
    def wait_for_everyone() -> None:
        from fastppo.dist import barrier

        barrier()


def check_step_inputs(queries, responses, scores, response_masks, n: int, device) -> torch.Tensor:
    """The scores of legacy ``step()``'s arguments as a [B] tensor; a clear error for anything malformed."""
    for name, value in (("queries", queries), ("responses", responses)):
        if not isinstance(value, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in value):
            raise TypeError(f"step: {name} must be a list of 1-D token tensors")
        if len(value) != n:
            raise ValueError(f"step: batch_size is {n} but {name} has {len(value)} samples")
        if any(t.dim() != 1 for t in value):
            raise ValueError(f"step: every tensor in {name} must be 1-D (one sample's tokens)")
    if any(len(t) == 0 for t in queries):
        raise ValueError("step: every query needs at least one token")
    if isinstance(scores, torch.Tensor):
        scores = scores.reshape(-1)
    else:
        scores = torch.stack([torch.as_tensor(s, dtype=torch.float32).reshape(()) for s in scores])
    if scores.numel() != n:
        raise ValueError(f"step: batch_size is {n} but scores has {scores.numel()} values")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("step: scores must be finite")
    if response_masks is not None:
        if len(response_masks) != n or any(len(m) != len(r) for m, r in zip(response_masks, responses)):
            raise ValueError("step: response_masks needs one mask per response, as long as that response")
    return scores.float().to(device)



def legacy_step_stats(metrics: dict, out: dict, rollout, vf_coef: float) -> dict:
    """``step()``'s return value: legacy TRL's stats keys (arrays included) beside TRL 0.26's names."""
    from fastppo.kernels import masked_mean
    from fastppo.metrics import legacy_stats, stats_means

    experience, targets, scores = out["experience"], out["targets"], out["final_scores"]
    mask = rollout.response_mask
    query_lengths = rollout.attention_mask[:, : rollout.context_length].sum(1).float().cpu()
    response_lengths = rollout.lengths.float().cpu()
    extra = dict(
        vf_coef=vf_coef, kl_coef=out["kl_coef"], learning_rate=out["lr"],
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
            "time/ppo/forward_pass": out["seconds"]["scoring"],
            "time/ppo/optimize_step": out["seconds"]["update"],
        },
    )
    return legacy_stats(metrics, stats_means(out["result"]), extra)


def _collate_lists(rows: list[dict]) -> dict:
    return {key: [row[key] for row in rows] for key in rows[0]}


def legacy_dataloader(dataset, config, state, collator: Callable | None):
    """DataLoader over ``dataset``: ``batch_size`` rows per process, shuffled (seeded), last batch dropped.

    Without a collator, a batch is a dict of lists (legacy TRL's docs pass exactly this collator;
    torch's default one cannot stack variable-length prompts)."""
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    class EpochSampler(DistributedSampler):
        """Reshuffles on every pass, as accelerate's prepared loader (legacy TRL's) does by calling
        set_epoch; a plain DistributedSampler repeats its first order forever."""

        def __iter__(self):
            order = super().__iter__()  # drawn now, from seed + epoch
            self.set_epoch(self.epoch + 1)
            return order

    if state.world_size > 1:
        sampler = EpochSampler(dataset, num_replicas=state.world_size, rank=state.rank, shuffle=True,
                               seed=config.seed, drop_last=True)
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(config.seed))
    return DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, drop_last=True,
                      collate_fn=collator or _collate_lists)


def _is_exact(kwargs: dict) -> bool:
    return all(k in _PASSED_THROUGH or (k in _NEUTRAL and v in _NEUTRAL[k]) for k, v in kwargs.items())


def legacy_generate(trainer, query_tensor, length_sampler, batch_size: int, return_prompt: bool,
                    generate_ref_response: bool, remove_padding: bool, kwargs: dict):
    from fastppo.models import lm_of

    single = isinstance(query_tensor, torch.Tensor)
    if single and query_tensor.dim() != 1:
        raise ValueError(f"generate: query_tensor must be 1-D (one query) or a list of them, got shape "
                         f"{tuple(query_tensor.shape)}")
    queries = [query_tensor] if single else list(query_tensor)
    if not queries or not all(isinstance(q, torch.Tensor) and q.dim() == 1 and len(q) for q in queries):
        raise ValueError("generate: query_tensor must be a non-empty 1-D tensor or a list of them")
    models = [lm_of(trainer.policy)]
    if generate_ref_response:
        models.append(None)  # the reference: a frozen copy, or the policy with its adapter disabled
    outputs = []
    for model in models:
        rows = []
        for i in range(0, len(queries), batch_size):
            chunk = queries[i : i + batch_size]
            step_kwargs = dict(kwargs)
            if length_sampler is not None:
                step_kwargs["max_new_tokens"] = int(length_sampler())
            rows += _generate_chunk(trainer, model, chunk, step_kwargs, return_prompt, remove_padding and not single)
        outputs.append(rows[0].unsqueeze(0) if single else rows)
    return tuple(outputs) if generate_ref_response else outputs[0]


@torch.no_grad()
def _generate_chunk(trainer, model, queries: list[torch.Tensor], kwargs: dict, return_prompt: bool,
                    cut_after_eos: bool) -> list[torch.Tensor]:
    import contextlib

    from fastppo.data import left_pad
    from fastppo.generation import generate_with_kwargs, sample_responses

    tok = trainer.tokenizer
    pad = kwargs.get("pad_token_id", tok.pad_token_id)
    eos = kwargs.get("eos_token_id", tok.eos_token_id)
    stop_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    ids, mask = left_pad([q.tolist() for q in queries], pad)
    ids, mask = ids.to(trainer.device), mask.to(trainer.device)
    context = contextlib.nullcontext()
    if model is None:
        if trainer.ref_model is not None:
            model = trainer.ref_model
        else:
            from fastppo.models import lm_of

            model = lm_of(trainer.policy)
            context = model.disable_adapter()
    max_new = kwargs.get("max_new_tokens", 20)
    with context, trainer.autocast():
        if _is_exact(kwargs):
            responses = sample_responses(model, ids, mask, max_new, float(kwargs.get("temperature", 1.0)),
                                         stop_ids, pad, len(queries))
        else:
            responses = generate_with_kwargs(model, ids, mask, kwargs, pad, stop_ids)
    out = []
    for q, r in zip(queries, responses):
        r = r.to(q.device)
        if cut_after_eos and stop_ids:
            hits = torch.isin(r, torch.tensor(stop_ids, device=r.device)).nonzero()
            if len(hits):
                r = r[: hits[0, 0] + 1]
        out.append(torch.cat([q, r]) if return_prompt else r)
    return out


def legacy_log_stats(trainer, stats: dict, batch: dict, rewards, columns_to_log: Sequence[str]) -> None:
    import json
    import os

    from fastppo.dist import is_distributed
    from fastppo.metrics import MetricsLogger

    if not isinstance(rewards, torch.Tensor):
        rewards = torch.stack([torch.as_tensor(r, dtype=torch.float32).reshape(()) for r in rewards])
    rewards = rewards.float().reshape(-1).to(trainer.device)
    if is_distributed():
        import torch.distributed as dist

        gathered = [torch.empty_like(rewards) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, rewards)
        rewards = torch.cat(gathered)
    if not trainer.dist.is_main:
        return
    if trainer._logger is None:
        trainer._logger = MetricsLogger(trainer.config, True, trainer.log)
    logs = {k: float(v) for k, v in stats.items() if _is_scalar(v)}
    logs["env/reward_mean"] = rewards.mean().item()
    logs["env/reward_std"] = rewards.std().item() if rewards.numel() > 1 else 0.0
    trainer._logger.log(logs, trainer.state.global_step)
    trainer.state.log_history.append({**logs, "step": trainer.state.global_step})
    columns = [c for c in columns_to_log if c in batch]
    if columns:
        with open(os.path.join(trainer.config.output_dir, "samples.jsonl"), "a") as f:
            for i, reward in enumerate(rewards.tolist()[: len(batch[columns[0]])]):
                row = {c: _text(batch[c][i]) for c in columns}
                f.write(json.dumps({"step": trainer.state.global_step, **row, "reward": reward}) + "\n")


def _is_scalar(value) -> bool:
    import numpy as np

    return isinstance(value, (int, float)) or (isinstance(value, np.ndarray) and value.size == 1)


def _text(value) -> str:
    return value if isinstance(value, str) else str(value.tolist() if isinstance(value, torch.Tensor) else value)
