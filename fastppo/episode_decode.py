"""A chunk's multi-turn episodes decoded in one static KV cache: the compiled decode carried across tool calls.

Between two turns the cache keeps the episode so far, and the next turn's context costs one prefill of what the
cache lacks: the tool messages' template tokens and the token the sampler drew last (a turn's stop token is drawn,
never fed). The cache is the first turn's bucket, sized for two budgets past the prompts (``prepare``'s response
length), so every turn of every round runs the one compiled step of that bucket: nothing recompiles or recaptures
from turn to turn. It needs a cache that keeps every column (``StaticDecoder.keeps_every_column``: no sliding
window, whose span the masked-out columns would count against).

The rows share the cache's columns, so each row's columns are kept apart by the attention mask: a row's tokens lie
where it wrote them, and what a stopped or idle row was fed meanwhile is masked out. A continuing row's positions
count its own tokens only; an idle row's (and the bucket's padding rows') stay where they were. Where the columns
left would not hold a round (turns of unequal lengths leave gaps), the cache is refilled with each row's whole
context (one prefill of at most prompt + budget columns); a round after that needs the longest context plus the
largest room, at most the prompts' width and two budgets, which is what the cache holds.

A turn's tokens are drawn from the same distribution as a fresh prefill of the whole episode gives, and, within a
chunk, the draws are made over the same rows in the same order as ``tools.run_episodes``' re-prefilling sampler
makes them (the rows that go on, the others left out), so the same random state draws the same tokens up to
rounding. (Over several chunks the order differs: the re-prefilling sampler draws every chunk's first turn before
any round.)"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from fastppo.generation import (Sampling, StaticRows, TokenDraw, cut_after_stop, decode_static, evaluating,
                                prefill_static, prompt_history, stop_tensor)
from fastppo.layout import cache_keyword
from fastppo.static_decode import StaticDecoder, takes_cache_position


class EpisodeDecode:
    """The episodes of one chunk of left-padded prompts ``queries`` [B, W], each within ``budget`` completion
    tokens. ``first_turn()`` samples every row's first turn; each call then continues the rows named after their
    tool messages (``tools.run_episodes``' sampler)."""

    def __init__(self, decoder: StaticDecoder, lm, queries, query_mask, budget: int, sampling: Sampling,
                 group_size: int = 1):
        if sampling.synced:
            raise ValueError("EpisodeDecode samples one process's episodes: not synced across processes")
        if not decoder.keeps_every_column():
            raise ValueError(f"EpisodeDecode needs a static cache that keeps every column; "
                             f"{type(lm).__name__}'s has sliding-window or indexed layers")
        self.decoder, self.lm, self.budget, self.group_size = decoder, lm, budget, group_size
        self.rows, self.width = queries.shape
        self.stop_ids, self.truncation = list(sampling.stop_ids), sampling.truncation
        self.query_mask = query_mask
        inputs, mask, positions, cache, key = decoder.prepare(queries, query_mask, 2 * budget)
        self.state = StaticRows(inputs, mask, positions, cache, key)
        self.draw = TokenDraw(sampling, stop_tensor(sampling.stop_ids, queries))
        self.column = self.width  # the next cache column written
        # each row's tokens drawn but not in the cache yet (a turn's last token), fed before its next context
        self.unfed: list[list[int]] = [[] for _ in range(self.rows)]

    @torch.no_grad()
    def first_turn(self) -> list[list[int]]:
        """Every row's first turn after its prompt, cut after its stop token, within the budget."""
        state = self.state
        with evaluating(self.lm):
            logits = prefill_static(self.decoder, self.lm, state.inputs, state.mask, state.positions, state.cache,
                                    self.rows, self.group_size)
            self.draw.seen = prompt_history(state.inputs[:self.rows], self.query_mask, self.truncation,
                                            logits.shape[-1])
            return self._decode(logits, list(range(self.rows)), self.budget)

    @torch.no_grad()
    def __call__(self, rows: list[int], contexts: list[list[int]], suffixes: list[list[int]],
                 length: int) -> list[list[int]]:
        """The next turn of each of ``rows`` (up to ``length`` tokens, cut after its stop token): ``contexts`` are
        their whole episodes so far (prompt, turns, tool messages), ``suffixes`` the tool messages' tokens that end
        them."""
        ahead = [self.unfed[i] + s for i, s in zip(rows, suffixes)]
        with evaluating(self.lm):
            if self.column + max(map(len, ahead)) + length > self.state.mask.shape[1]:
                logits = self._refill(rows, contexts)
            else:
                logits = self._prefill(rows, ahead)
            if self.truncation is not None and self.truncation.repetition_penalty != 1.0:
                self._see(rows, contexts)
            return self._decode(logits, rows, length)

    def _prefill(self, rows: list[int], ahead: list[list[int]]) -> torch.Tensor:
        """Feeds each row's tokens ``ahead`` into the cache's next columns, right-aligned (so each row's last token
        is the chunk's last column); the other rows feed masked-out ids at their last position. Returns the last
        column's logits."""
        state, device = self.state, self.state.inputs.device
        count, width = state.inputs.shape[0], max(map(len, ahead))
        last = state.positions[:, -1:]
        inputs = torch.zeros(count, width, dtype=state.inputs.dtype, device=device)
        positions = last.expand(count, width).clone()
        state.mask[:, self.column:self.column + width] = 0
        for i, ids in zip(rows, ahead):
            n = len(ids)
            inputs[i, width - n:] = torch.tensor(ids, dtype=inputs.dtype, device=device)
            positions[i, width - n:] = last[i] + 1 + torch.arange(n, device=device)
            state.mask[i, self.column + width - n:self.column + width] = 1
        extra = ({"cache_position": torch.arange(self.column, self.column + width, device=device)}
                 if takes_cache_position(self.lm) else {})
        logits = self.lm(input_ids=inputs, attention_mask=state.mask[:, :self.column + width], position_ids=positions,
                         **{cache_keyword(self.lm): state.cache}, use_cache=True, logits_to_keep=1,
                         **extra).logits[:, -1]
        state.inputs, state.positions = inputs, positions
        self.column += width
        for i in rows:
            self.unfed[i] = []
        return logits

    def _refill(self, rows: list[int], contexts: list[list[int]]) -> torch.Tensor:
        """The cache emptied and refilled with every row's whole context, left-padded (a row that does not go on
        holds one of the others': never sampled); returns the last column's logits."""
        whole = [None] * self.rows
        for i, ids in zip(rows, contexts):
            whole[i] = ids
        whole = [torch.tensor(ids if ids is not None else contexts[0]) for ids in whole]
        ids = pad_sequence(whole, batch_first=True, padding_value=0, padding_side="left")
        mask = pad_sequence([torch.ones_like(t) for t in whole], batch_first=True, padding_value=0,
                            padding_side="left")
        device, cache_len = self.state.inputs.device, self.state.mask.shape[1]
        inputs, full_mask, positions, cache, key = self.decoder.prepare(ids.to(device), mask.to(device),
                                                                          cache_len - ids.shape[1])
        if key != self.state.key:
            raise RuntimeError(f"the refilled episode cache's bucket {key} is not the first turn's {self.state.key}")
        self.state = StaticRows(inputs, full_mask, positions, cache, key)
        self.column = ids.shape[1]
        self.unfed = [[] for _ in range(self.rows)]
        return prefill_static(self.decoder, self.lm, inputs, full_mask, positions, cache, self.rows)

    def _see(self, rows: list[int], contexts: list[list[int]]) -> None:
        """The repetition penalty's record of each continuing row's tokens: its whole context (a stopped row was
        fed the pad id meanwhile, which its record must not hold)."""
        for i, ids in zip(rows, contexts):
            self.draw.seen[i] = False
            self.draw.seen[i, torch.tensor(ids, device=self.draw.seen.device)] = True

    def _decode(self, logits, rows: list[int], length: int) -> list[list[int]]:
        """Up to ``length`` tokens for ``rows`` (the others done from the start, their positions left where they
        are); each row's columns past what it wrote itself are masked out after, its position set to its own last
        token, and its last drawn token kept to feed next."""
        state, start = self.state, self.column
        device = state.inputs.device
        done = torch.ones(self.rows, dtype=torch.bool, device=device)
        done[rows] = False
        tokens, fed = decode_static(self.decoder, state, logits, start, length, done, self.draw,
                                    torch.tensor(rows, device=device))
        self.column = start + fed
        turns, going_on = {}, set(rows)
        for i, row in enumerate(tokens.tolist()):
            if i not in going_on:
                state.mask[i, start:self.column] = 0
                continue
            turn = cut_after_stop(row, self.stop_ids)
            ended = bool(turn) and turn[-1] in self.stop_ids
            written = min(fed, len(turn) - ended)  # a token is fed as itself until its row stops
            state.mask[i, start + written:self.column] = 0
            state.positions[i, -1] += written - fed
            self.unfed[i] = turn[written:]
            turns[i] = turn
        return [turns[i] for i in rows]
