"""The distribution the rollout samples from when TRL GRPO's sampling settings are set, and the log-probs of it.

TRL GRPO samples with transformers' ``generate`` (or vLLM), which processes the logits before drawing: the
``repetition_penalty`` on the raw logits of every token already in the sequence (a positive logit divided by it,
a negative one multiplied), then the temperature, then ``top_k`` (the k largest logits, ties kept), ``top_p``
(the smallest set of most likely tokens whose probability reaches p) and ``min_p`` (tokens at least min_p times
the most likely one's probability); each keeps at least one token. TRL's old and new log-probs are then
softmax(logits / T) of the model, not of that processed distribution: the completions come from one distribution
and the ratio, the KL and the policy gradient are computed under another: TRL 1.16's ``grpo_trainer.py`` passes the
settings to the sampler only (vLLM's at lines 1131-1135, transformers' generation config at 1160-1165), while
``_get_per_token_logps_and_entropies`` (line 1419) takes its log-probs from the model's own forward
(``outputs.log_probs``, line 1500) with no processing; its vLLM importance-sampling correction is the one place
the sampler's own log-probs enter.

fastppo draws from the processed distribution (``process_logits``) and trains it: every log-prob of the policy,
old and new, is log softmax of the processed logits at the token (``processed_token_logprobs``), so the first
ratio is exactly 1 and the gradient is that of the distribution that sampled. The history the penalty reads is
the prompt's real tokens (not its padding, which transformers' processor also counts) and the completion's
tokens before the position. The reference's log-probs stay softmax(logits / T), as TRL's.

Computing it needs each token's [V] logits: ``processed_token_logprobs`` makes them ``CHUNK`` tokens at a time,
multiplied in fp32 (an fp64 policy: fp64), and recomputes each chunk in the backward (activation checkpointing),
so the [tokens × V] logits never exist at once, but they are not fused as the default path's are. A token the sampler drew is
always kept: where the training forward's rounding puts it just outside the kept set, it is added back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from fastppo.errors import SettingsError

CHUNK = 256  # tokens whose [V] logits exist at once in processed_token_logprobs


@dataclass(frozen=True)
class Truncation:
    """TRL GRPO's sampling settings (GRPOConfig's ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``; their
    defaults leave the distribution alone)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    @property
    def active(self) -> bool:
        return self != Truncation()

    @classmethod
    def of(cls, config) -> Truncation:
        """The config's settings, checked (a PPOConfig has none: the plain distribution)."""
        settings = cls(**{name: getattr(config, name, getattr(cls(), name))
                          for name in ("top_k", "top_p", "min_p", "repetition_penalty")})
        settings.check()
        return settings

    def check(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SettingsError(f"top_k must be an integer >= 0 (0: no top-k), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise SettingsError(f"top_p must be in (0, 1] (1: no nucleus), got {self.top_p!r}")
        if self.min_p is not None and not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise SettingsError(f"min_p must be in [0, 1] or unset, got {self.min_p!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            raise SettingsError(f"repetition_penalty must be a finite number > 0 (1: none), got "
                                f"{self.repetition_penalty!r}")


def process_logits(logits: torch.Tensor, temperature: float, truncation: Truncation | None,
                   seen: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] fp32 (fp64: fp64) logits of the sampled distribution: softmax of the result is what the sampler draws from.
    ``seen``: [N, V] bool, the tokens already in each row's sequence (read only with a repetition penalty).
    Without ``truncation`` (or with its defaults) this is logits / temperature, exactly."""
    scaled, removed = _scaled_and_removed(logits, temperature, truncation, seen)
    return scaled if removed is None else scaled.masked_fill(removed, -math.inf)


def _scaled_and_removed(logits, temperature, truncation, seen):
    """(the penalised logits / temperature, the tokens the truncations remove, or None), in fp32 (fp64 stays)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if truncation is None or not truncation.active:
        return logits / temperature, None
    if truncation.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("repetition_penalty needs the tokens already in each sequence (seen)")
        penalised = torch.where(logits < 0, logits * truncation.repetition_penalty,
                                logits / truncation.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    logits = logits / temperature
    removed = torch.zeros_like(logits, dtype=torch.bool)
    if truncation.top_k:
        kth = torch.topk(logits, min(truncation.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        removed |= logits < kth
    if truncation.top_p < 1.0:
        # ascending order: the tokens whose cumulative probability stays at or below 1 − p go (the last one stays)
        ordered, order = torch.sort(logits.masked_fill(removed, -math.inf), dim=-1)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1.0 - truncation.top_p
        drop[..., -1] = False
        removed |= drop.scatter(-1, order, drop)
    if truncation.min_p is not None and truncation.min_p > 0:
        probs = logits.masked_fill(removed, -math.inf).softmax(-1)
        removed |= probs < truncation.min_p * probs.max(-1, keepdim=True).values
    return logits, removed


def seen_tokens(ids: torch.Tensor, real: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V] bool: the tokens of each row of ``ids`` [N, L] where ``real`` [N, L] is true."""
    counts = torch.zeros(ids.shape[0], vocab, dtype=torch.int32, device=ids.device)
    return counts.scatter_add_(1, ids.long(), real.int()) > 0


def _chunk_logprobs(hidden, weight, bias, targets, temperature, truncation, seen, return_entropy):
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32 operands, or an fp64 policy's own
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    scaled, removed = _scaled_and_removed(logits, temperature, truncation, seen)
    if removed is not None:  # the drawn token is kept: a boundary token the two forwards' rounding moved stays in
        scaled = scaled.masked_fill(removed.scatter(-1, targets[:, None], False), -math.inf)
    logp = scaled.log_softmax(-1)
    token = logp.gather(-1, targets[:, None]).squeeze(-1)
    if not return_entropy:
        return token
    kept = torch.isfinite(logp)  # 0 · log 0 is 0, and its gradient too (a where after the product would be NaN)
    return token, -(logp.exp() * torch.where(kept, logp, torch.zeros_like(logp))).sum(-1)


def processed_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, temperature: float, truncation: Truncation,
                             seen: torch.Tensor | None, return_entropy: bool):
    """Log-probs (and entropies) of ``targets`` [n] under the processed distribution, from the head's input
    ``hidden`` [n, H] and its ``weight`` [V, H] (``bias``); ``seen`` [n, V] bool, each token's history (with a
    repetition penalty). ``CHUNK`` tokens at a time, each chunk recomputed in the backward."""
    outs = []
    for start in range(0, hidden.shape[0], CHUNK):
        part = slice(start, start + CHUNK)
        args = (weight, bias, targets[part], temperature, truncation, None if seen is None else seen[part],
                return_entropy)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            outs.append(checkpoint(_chunk_logprobs, hidden[part], *args, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(hidden[part], *args))
    if not return_entropy:
        return torch.cat(outs) if outs else hidden.new_zeros(0, dtype=torch.float32)
    if not outs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


@dataclass(frozen=True)
class History:
    """What a layout's rows held before each response token (the repetition penalty's history): the rows'
    ``query_responses`` [b, L], where they are real (``real``, or the rollout's attention mask and the layout's rows
    in it: ``index``, read only when a penalty asks), and the context length C (response column c follows the
    positions before C + c)."""

    ids: torch.Tensor
    real: torch.Tensor
    context_length: int
    index: torch.Tensor | None = None  # the rows of ``real`` that are the layout's (None: all, in order)

    def seen(self, rows: torch.Tensor, cols: torch.Tensor, vocab: int) -> torch.Tensor:
        """[n, V] bool: for each token (row, response column), the real tokens before it."""
        real = (self.real if self.index is None else self.real.index_select(0, self.index)).bool()
        before = torch.arange(self.ids.shape[1], device=self.ids.device)[None] < (self.context_length + cols)[:, None]
        return seen_tokens(self.ids.index_select(0, rows), real.index_select(0, rows) & before, vocab)
