"""Step 1's records: ``Rollout`` (one iteration's samples laid out as x+y, with the trained-token mask and the real
lengths on the host), how it is made from sampled or given tokens (``make_rollout``, ``assemble``), the stop and
mask helpers the scoring and the loss read (``eos_count``, ``contains_stop``, ``apply_eos_penalties``,
``trained_mask``), and ``ScoredRollout``, step 1's output with its scores. The algorithm (``fastppo.train``), the
trainers and the legacy adapter read them; scoring needs nothing of the algorithm."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastppo.kernels import truncate_at_stop
from fastppo.layout import make_layout, make_shared_layout
from fastppo.sampling import History


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

    def layout(self, rows: Sequence[int] | None = None, packed: bool = False, shared: tuple[int, str, torch.dtype] |
               None = None):
        """The model layout of ``rows`` (default: all): see ``fastppo.layout.Layout``. ``shared`` (group size, mask
        kind, mask dtype): each group of consecutive rows, which share their prompt, as one decoder row
        (``make_shared_layout``)."""
        rows = range(self.query_responses.shape[0]) if rows is None else rows
        index = torch.as_tensor(list(rows), device=self.query_responses.device)
        ids = self.query_responses.index_select(0, index)
        args = (ids, self.context_length, [self.query_lengths[r] for r in rows], [self.response_lengths[r] for r in rows])
        layout = make_layout(*args, packed) if shared is None else make_shared_layout(*args, *shared)
        # what preceded each token, for a repetition penalty of the sampled distribution (sampling.History)
        return dataclasses.replace(layout, history=History(ids, self.attention_mask, self.context_length, index))

    def groups_share_prompts(self, k: int) -> bool:
        """Whether each ``k`` consecutive rows hold one prompt (the trainer draws each prompt k times side by side; a
        caller's own samples may not): the same real query tokens, checked once (one device sync)."""
        b = self.query_responses.shape[0]
        if k < 2 or b % k or any(len(set(self.query_lengths[g:g + k])) > 1 for g in range(0, b, k)):
            return False
        queries = (self.query_responses[:, :self.context_length] * self.attention_mask[:, :self.context_length])
        grouped = queries.view(b // k, k, -1)
        return bool((grouped == grouped[:, :1]).all())


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


def trained_mask(rollout: Rollout, mask_truncated_completions: bool) -> torch.Tensor:
    """[B, T] the tokens the loss reads: the rollout's trained tokens, less every token of a completion that ended
    without a stop token when ``mask_truncated_completions`` (DAPO's overlong filtering, TRL GRPO's name). Their
    rewards still count in their group's statistics, as in TRL."""
    if not mask_truncated_completions:
        return rollout.response_mask
    return rollout.response_mask & rollout.has_stop[:, None]


@dataclass(frozen=True)
class ScoredRollout:
    """Step 1's output: the samples, their scores r(x, y), texts and timing (``PPOTrainer.rollout()``)."""

    rollout: Rollout
    scores: torch.Tensor  # [B] after the missing-eos penalty (TRL's objective/scores)
    eos_count: torch.Tensor  # eos tokens among the real response tokens (TRL's val/num_eos_tokens)
    prompts: list[str] | None = None
    completions: list[str] | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    reward_columns: dict[str, torch.Tensor] = field(default_factory=dict)  # each reward's [B] (NaN: not judged)
    # [B, T] the log-probs a caller's sampler reported (TRL GRPO's rollout_func), NaN where it reported none
    sampling_logprobs: torch.Tensor | None = None


def take_rows(parts: Sequence[ScoredRollout], picks: Sequence[tuple[int, int]], pad_id: int,
              eos_id: int | None) -> ScoredRollout:
    """One scored rollout of the rows ``picks`` ((part, row) pairs, in their order) of ``parts``, which may differ
    in their widths: each row's prompt left-padded to the widest context of the parts it draws on, its response
    right-padded to the longest response picked (``assemble``); one part whole, in order, is that part itself. The
    phases' seconds are every part's sums; the sampler's log-probs, where a part has them, NaN-padded."""
    first = picks[0][0]
    if len(parts) == 1 and [r for _, r in picks] == list(range(len(parts[0].scores))):
        return parts[0]
    used = sorted({p for p, _ in picks})
    model = parts[first].rollout.query_responses
    n, c = len(picks), max(parts[p].rollout.context_length for p in used)
    t = max(1, max(parts[p].rollout.response_lengths[r] for p, r in picks))
    queries = torch.full((n, c), pad_id, dtype=model.dtype, device=model.device)
    query_mask = torch.zeros((n, c), dtype=torch.long, device=model.device)
    responses = torch.full((n, t), pad_id, dtype=model.dtype, device=model.device)
    real = torch.zeros((n, t), dtype=torch.bool, device=model.device)
    train = torch.zeros((n, t), dtype=torch.bool, device=model.device)
    has_stop = torch.zeros(n, dtype=torch.bool, device=model.device)
    logged = [parts[p].sampling_logprobs is not None for p in used]
    sampled = torch.full((n, t), float("nan"), device=model.device) if any(logged) else None
    for p in used:
        part = parts[p].rollout
        into = torch.tensor([i for i, (q, _) in enumerate(picks) if q == p], device=model.device)
        rows = torch.tensor([r for q, r in picks if q == p], device=model.device)
        cp, tp = part.context_length, min(part.response_mask.shape[1], t)
        queries[into, c - cp:] = part.query_responses[rows, :cp]
        query_mask[into, c - cp:] = part.attention_mask[rows, :cp].long()
        responses[into, :tp] = part.query_responses[rows, cp:cp + tp]
        real[into, :tp] = part.attention_mask[rows, cp:cp + tp].bool()
        train[into, :tp] = part.response_mask[rows, :tp]
        has_stop[into] = part.has_stop[rows]
        if sampled is not None and parts[p].sampling_logprobs is not None:
            sampled[into, :tp] = parts[p].sampling_logprobs[rows, :tp].to(sampled.dtype)
    rollout = assemble(queries, query_mask, responses, real, has_stop, train)
    texts = [parts[p].prompts is not None for p in used]
    seconds: dict[str, float] = {}
    for p in range(len(parts)):
        for phase, value in parts[p].seconds.items():
            seconds[phase] = seconds.get(phase, 0.0) + value
    return ScoredRollout(
        rollout, torch.stack([parts[p].scores[r] for p, r in picks]), eos_count(rollout, eos_id),
        [parts[p].prompts[r] for p, r in picks] if all(texts) else None,
        [parts[p].completions[r] for p, r in picks] if all(texts) else None, seconds,
        {name: torch.stack([parts[p].reward_columns[name][r] for p, r in picks])
         for name in parts[first].reward_columns},
        None if sampled is None else sampled[:, :rollout.response_mask.shape[1]])
