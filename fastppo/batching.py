"""How one epoch's rows are cut for the PPO update (``train.ppo_update``): minibatches as TRL slices them,
micro-batches by row count (optionally grouped by length) or by a token budget (verl's and OpenRLHF's dynamic
batching). Which rows go together only: how their losses are weighted so that any cut gives the same
gradient is ``update_steps.step_token_weights``."""
from __future__ import annotations

from collections.abc import Sequence

from fastppo.sizes import Sizes

__all__ = ["micro_batches", "scoring_rows", "token_budget_batches"]


def micro_batches(order: list[int], sizes: Sizes, lengths: Sequence[int], group_by_length: bool,
                  group_size: int = 1) -> list[list[list[int]]]:
    """The rows of each micro-batch of each minibatch of one epoch, from the epoch's random order.

    Minibatches are consecutive slices of the order (TRL's). ``group_by_length``: within a minibatch,
    rows of similar length share a micro-batch (less padding to compute on); the minibatch, and so
    the optimizer step's rows, is the same random draw. ``group_size`` > 1: the order holds groups of that many
    consecutive rows (a shared prompt's), which stay together, sorted by their summed length.
    """
    out = []
    for mb in range(sizes.num_mini_batches):
        rows = order[mb * sizes.local_mini_batch_size : (mb + 1) * sizes.local_mini_batch_size]
        if group_by_length and sizes.micro_steps > 1:
            groups = [rows[i:i + group_size] for i in range(0, len(rows), group_size)]
            rows = [r for g in sorted(groups, key=lambda g: sum(lengths[r] for r in g)) for r in g]
        out.append([rows[k * sizes.local_micro_batch_size : (k + 1) * sizes.local_micro_batch_size]
                    for k in range(sizes.micro_steps)])
    return out


def token_budget_batches(rows: list[int], query_lengths: Sequence[int], response_lengths: Sequence[int], budget: int,
                         packed: bool) -> list[list[int]]:
    """``rows`` regrouped into micro-batches of at most ``budget`` tokens (a row longer than that alone), few of
    them: packed (``padding_free``: a micro-batch costs its rows' summed lengths), first-fit decreasing; padded
    (rows × (longest query + longest response): the columns a layout keeps), longest rows first, each joining
    the last micro-batch while it fits and the micro-batch stays at least half real tokens. Either way a
    micro-batch's memory and compute are at most twice its real tokens', never rows × the longest row of the
    step: a long completion does not widen the short ones into its micro-batch."""
    size = {r: query_lengths[r] + response_lengths[r] for r in rows}
    ordered = sorted(rows, key=lambda r: (-size[r], r))
    batches: list[list[int]] = []
    if packed:
        room: list[int] = []
        for r in ordered:
            fit = next((i for i, free in enumerate(room) if size[r] <= free), None)
            if fit is None:
                batches.append([r])
                room.append(budget - size[r])
            else:
                batches[fit].append(r)
                room[fit] -= size[r]
        return batches
    for r in ordered:
        if batches:
            grown = batches[-1] + [r]
            width = max(query_lengths[i] for i in grown) + max(response_lengths[i] for i in grown)
            if len(grown) * width <= min(budget, 2 * sum(size[i] for i in grown)):
                batches[-1] = grown
                continue
        batches.append([r])
    return batches


def scoring_rows(rows_per_forward: int, query_lengths: Sequence[int], response_lengths: Sequence[int],
                 budget: int | None, micro_rows: int | bool | None = None, group_size: int = 1) -> int:
    """Rows per no-grad scoring forward (π_θ_old's, the reference's) over a rollout of these lengths:
    ``rows_per_forward`` (``local_rollout_forward_batch_size``), or fewer where that many rows, padded to the
    rollout's longest query + longest response, would hold more tokens than an update micro-batch: ``budget``
    (``max_tokens_per_micro_batch``), else ``micro_rows`` rows (None or False: no bound). Their peak then follows
    the update's micro-batch, not the batch: a critic-free run passes its micro-batch's rows (TRL GRPO runs these
    forwards per_device_train_batch_size rows at a time), PPO none (TRL PPO runs local_rollout_forward_batch_size
    rows). Whole groups of ``group_size`` rows (a shared prompt's) where a group fits."""
    width = max(query_lengths) + max(response_lengths)
    tokens = budget if budget is not None else micro_rows * width if micro_rows else None
    if tokens is None or tokens // width >= rows_per_forward:
        return rows_per_forward
    rows = max(1, tokens // width)
    return rows - rows % group_size if rows >= group_size > 1 else rows
