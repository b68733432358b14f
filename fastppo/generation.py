"""Sampling responses from the policy: y_t ~ softmax(logits_t / T), exactly (or, with TRL GRPO's top_k, top_p, min_p
and repetition_penalty, the processed distribution of ``fastppo.sampling``, which the trained log-probs read).

The rollout's own decode loop over the model's KV cache, instead of ``transformers``' ``generate``:

* the distribution is softmax(logits / temperature) and nothing else. ``generate`` merges the
  checkpoint's ``generation_config.json`` into the one it is given (transformers 5: every field left
  unset; 4.5x: every field equal to the global default), so a ``top_k``, ``top_p``, ``min_p`` or
  ``repetition_penalty`` that a released checkpoint ships would silently become part of the
  sampler, while the old log-probs are recomputed under plain softmax(logits/T): the first ratio
  still reads 1, but the policy gradient and every sampled KL estimate are biased;
* only the last position's logits are computed (``logits_to_keep=1``), never [B, L, V];
* the loop ends as soon as every row has emitted a stop token.

Token choice is ``torch.multinomial`` over the same fp32 probabilities as ``generate``'s
sampling, so with the same random state the two draw the same tokens.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import GenerationConfig

from fastppo.dist import all_reduce_min
from fastppo.errors import SettingsError
from fastppo.kv_cache import describe, new_dynamic_cache
from fastppo.layout import cache_keyword
from fastppo.sampling import Truncation, process_logits, seen_tokens
from fastppo.static_decode import StaticDecoder, accepts_logits_to_keep


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: y ~ softmax(logits / ``temperature``), or ``truncation``'s processed distribution
    (``sampling.process_logits``; a repetition penalty reads each row's real prompt tokens and the tokens drawn so
    far); a row ends at its first of ``stop_ids`` and holds ``pad_id`` after it (with no stop ids every row runs to
    the length asked). ``synced``: a chunk's loop ends only when every process's rows have stopped (one all-reduce
    per token; DeepSpeed ZeRO-3 without gathered weights, where each forward is a collective); every process must
    then sample the same number of chunks."""

    temperature: float = 1.0
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0
    synced: bool = False
    truncation: Truncation | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))


@torch.no_grad()
def sample_responses(lm, queries, query_mask, response_length: int, sampling: Sampling, chunk: int,
                     decoder: StaticDecoder | None = None, group_size: int = 1,
                     log: Callable[[str], None] | None = None) -> torch.Tensor:
    """[B, T] sampled tokens (T = ``response_length``), ``chunk`` rows at a time, drawn as ``sampling`` says.

    ``decoder``: a ``static_decode.StaticDecoder`` of ``lm``; each token's forward then runs compiled over its
    static KV cache, and the same random state draws the same tokens.

    ``group_size``: where each ``group_size`` consecutive rows of a chunk hold one prompt (``prompt_groups``), the
    eager loop runs each prompt's forward (the prefill) once and copies its KV cache to the group's rows: the first
    token's logits are the unshared prefill's up to rounding (measured: 1.2e-7 on the embedded model, in fp32), the
    later ones the same, so a draw moves only where the uniform lands within rounding of a boundary. The compiled
    decode does the same: the group's prompt prefilled once, its keys and values written to the group's rows of the
    static cache (``StaticDecoder.fill_shared``).

    The KV cache is kept in the model's compute dtype (``fastppo.kv_cache``); ``log``: told what the eager loop's
    first chunk's cache held at its end (the decoder says what its static caches hold itself)."""
    with evaluating(lm):
        out = []
        for i in range(0, queries.shape[0], chunk):
            rows = (lm, queries[i : i + chunk], query_mask[i : i + chunk], response_length, sampling, group_size)
            out.append(_sample_chunk(*rows, log=log if i == 0 else None) if decoder is None
                       else _sample_chunk_static(decoder, *rows))
    return torch.cat(out)


@contextlib.contextmanager
def evaluating(lm):
    """``lm`` in eval mode for a decode, its own mode after: in training mode with gradient checkpointing
    transformers silently turns the KV cache off, and a decode loop that feeds one token at a time then forgets the
    prompt."""
    training = lm.training
    lm.eval()
    try:
        yield
    finally:
        lm.train(training)


def _all_stopped(done: torch.Tensor, synced: bool) -> bool:
    if not synced:
        return bool(done.all())

    return bool(all_reduce_min(done.all().float()))


def draw_tokens(logits, temperature: float, done, stops, pad_id: int, synced: bool, truncation=None, seen=None):
    """One token per row, y ~ softmax(logits / T) in fp32 (``truncation``: the processed logits, ``seen`` [B, V]
    the tokens each row holds, updated in place); a row already ``done`` gets ``pad_id``. Returns (tokens [B],
    done after them, whether every row has now stopped)."""
    probs = nn.functional.softmax(process_logits(logits, temperature, truncation, seen), dim=-1)
    token = torch.multinomial(probs, num_samples=1).squeeze(1)
    token = torch.where(done, torch.full_like(token, pad_id), token)
    if seen is not None:
        seen[torch.arange(token.shape[0], device=token.device), token] = True  # a done row's pad is never read
    if stops is None:
        return token, done, False
    done = done | torch.isin(token, stops)
    return token, done, _all_stopped(done, synced)  # one host sync per token: the loop ends once every row stopped


def cut_after_stop(tokens: list[int], stop_ids: list[int]) -> list[int]:
    """A sampled row up to and including its first stop token (the sampler pads after it)."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[:i + 1]
    return tokens


def stop_tensor(stop_ids, like) -> torch.Tensor | None:
    """The stop ids as a tensor beside ``like`` (None: none)."""
    return torch.tensor(stop_ids, dtype=like.dtype, device=like.device) if stop_ids else None


def prompt_history(queries, query_mask, truncation, vocab: int):
    """[B, V] the prompt's real tokens, where a repetition penalty reads them; else None."""
    if truncation is None or truncation.repetition_penalty == 1.0:
        return None
    return seen_tokens(queries, query_mask.bool(), vocab)


def prompt_groups(queries, query_mask, group_size: int) -> int:
    """``group_size`` where every ``group_size`` consecutive rows hold one prompt (the same real tokens, the same
    padding), else 1."""
    b = queries.shape[0]
    if group_size < 2 or b % group_size:
        return 1
    ids = (queries * query_mask).view(b // group_size, group_size, -1)
    mask = query_mask.view(b // group_size, group_size, -1)
    return group_size if bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all()) else 1


def _sample_chunk(lm, queries, query_mask, response_length: int, sampling: Sampling,
                  group_size: int = 1, log: Callable[[str], None] | None = None) -> torch.Tensor:
    b = queries.shape[0]
    keep = {"logits_to_keep": 1} if accepts_logits_to_keep(lm) else {}
    cache = new_dynamic_cache(lm)
    keyword = cache_keyword(lm)  # cache (transformers 5.2x on) or past_key_values (earlier)
    mask = query_mask
    positions = (query_mask.cumsum(1) - 1).clamp(min=0)  # a left-padded prompt starts at position 0
    inputs = queries * query_mask  # padding is never attended: fed as id 0 (TRL's), whatever the pad id
    tokens = torch.full((b, response_length), sampling.pad_id, dtype=queries.dtype, device=queries.device)
    done = torch.zeros(b, dtype=torch.bool, device=queries.device)
    if response_length == 0:
        return tokens
    # the prefill: each prompt once, its cache copied g times, where every layer of the cache can be copied (a hybrid
    # model's linear-attention or SSM layers, NemotronH's, cannot)
    repeatable = all(hasattr(layer, "batch_repeat_interleave") for layer in getattr(cache, "layers", ()))
    g = prompt_groups(queries, query_mask, group_size) if repeatable else 1
    logits = lm(input_ids=inputs[::g], attention_mask=mask[::g], position_ids=positions[::g], **{keyword: cache},
                use_cache=True, **keep).logits[:, -1]
    if g > 1:
        cache.batch_repeat_interleave(g)
        logits = logits.repeat_interleave(g, 0)
    draw = TokenDraw(sampling, stop_tensor(sampling.stop_ids, queries),
                     prompt_history(queries, query_mask, sampling.truncation, logits.shape[-1]))
    for t in range(response_length):
        tokens[:, t], done, finished = draw(logits, done)
        if finished or t + 1 == response_length:
            break
        inputs = torch.where(done, 0, tokens[:, t])[:, None]  # a stopped row's input is never read again
        mask = torch.cat([mask, mask.new_ones(b, 1)], 1)
        positions = positions[:, -1:] + 1
        logits = lm(input_ids=inputs, attention_mask=mask, position_ids=positions, **{keyword: cache},
                    use_cache=True, **keep).logits[:, -1]
    if log is not None:
        log(f"eager decode: {describe(cache)} (grown one position per token, freed after the chunk)")
    return tokens


def _sample_chunk_static(decoder: StaticDecoder, lm, queries, query_mask, response_length: int, sampling: Sampling,
                         group_size: int = 1) -> torch.Tensor:
    """``_sample_chunk`` with the prompt's forward eager into the decoder's static cache and every later token's
    forward through its compiled step; rows past ``B`` are the bucket's padding and are never sampled."""
    b, width = queries.shape
    inputs, mask, positions, cache, key = decoder.prepare(queries, query_mask, response_length)
    logits = prefill_static(decoder, lm, inputs, mask, positions, cache, b, group_size)
    draw = TokenDraw(sampling, stop_tensor(sampling.stop_ids, queries),
                     prompt_history(queries, query_mask, sampling.truncation, logits.shape[-1]))
    done = torch.zeros(b, dtype=torch.bool, device=queries.device)
    tokens, _ = decode_static(decoder, StaticRows(inputs, mask, positions, cache, key), logits, width,
                              response_length, done, draw)
    return tokens


def prefill_static(decoder: StaticDecoder, lm, inputs, mask, positions, cache, rows: int,
                   group_size: int = 1) -> torch.Tensor:
    """The last position's logits [R, V] of the prompts ``inputs`` [R, W] (``decoder.prepare``'s), their keys and
    values written into the static ``cache``. Where each ``group_size`` consecutive rows of the first ``rows`` hold
    one prompt, each prompt's forward runs once, into a dynamic cache whose rows are then written g times."""
    width = inputs.shape[1]
    g = prompt_groups(inputs[:rows], mask[:rows, :width], group_size) if decoder.can_fill_shared(cache) else 1
    if g > 1:
        prefill = new_dynamic_cache(lm)
        logits = lm(input_ids=inputs[:rows:g], attention_mask=mask[:rows:g, :width], position_ids=positions[:rows:g],
                    **{cache_keyword(lm): prefill}, use_cache=True, logits_to_keep=1).logits[:, -1]
        return logits[decoder.fill_shared(cache, prefill, rows, inputs.shape[0], g)]
    return lm(input_ids=inputs, attention_mask=mask[:, :width], position_ids=positions,
              **{cache_keyword(lm): cache}, use_cache=True, logits_to_keep=1).logits[:, -1]


@dataclass
class StaticRows:
    """A chunk's rows in the decoder's static cache: the last inputs fed [R, W], the attention mask over the cache's
    columns [R, L], the last positions fed [R, W], the cache and its bucket key."""

    inputs: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    cache: object
    key: tuple[int, int]


@dataclass
class TokenDraw:
    """How ``draw_tokens`` draws for a chunk: ``sampling``'s settings, its stop ids as a tensor (None: none) and the
    tokens each row holds (read by a repetition penalty; None without one)."""

    sampling: Sampling
    stops: torch.Tensor | None
    seen: torch.Tensor | None = None

    def __call__(self, logits, done, rows: torch.Tensor | None = None):
        """``draw_tokens`` over every row, or over ``rows`` only (the others get the pad id and keep their ``done``):
        the random state then moves as a chunk of those rows alone would move it."""
        s = self.sampling
        if rows is None:
            return draw_tokens(logits, s.temperature, done, self.stops, s.pad_id, s.synced, s.truncation, self.seen)
        seen = None if self.seen is None else self.seen[rows]
        drawn, drawn_done, finished = draw_tokens(logits[rows], s.temperature, done[rows], self.stops, s.pad_id,
                                                  s.synced, s.truncation, seen)
        if seen is not None:
            self.seen[rows] = seen
        tokens = torch.full_like(done, s.pad_id, dtype=drawn.dtype).index_copy_(0, rows, drawn)
        return tokens, done.index_copy(0, rows, drawn_done), finished


def decode_static(decoder: StaticDecoder, state: StaticRows, logits, column: int, length: int, done,
                  draw: TokenDraw, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Up to ``length`` tokens for the rows not ``done`` (the first ``B`` of ``done``'s; a done row draws the pad id)
    after ``logits``, each token fed through the compiled step into cache column ``column`` + t; ``rows``: draw for
    these rows only (``TokenDraw``). Returns the tokens [B, length] and how many of them were fed (the last one drawn
    never is); ``state``'s inputs and positions are the last fed, and its mask keeps every fed column for every
    row. With ``rows``, only their positions move on: the others' stay where their own tokens ended."""
    b = done.shape[0]
    advance = 1 if rows is None else torch.zeros_like(state.positions[:, -1:]).index_fill_(0, rows, 1)
    tokens = torch.full((b, length), draw.sampling.pad_id, dtype=state.inputs.dtype, device=state.inputs.device)
    fed = 0
    for t in range(length):
        tokens[:, t], done, finished = draw(logits[:b], done, rows)
        if finished or t + 1 == length:
            break
        state.inputs = state.inputs[:, -1:].clone()  # the padding rows feed their own last input again
        state.inputs[:b, 0] = torch.where(done, 0, tokens[:, t])
        state.mask[:, column + t] = 1
        state.positions = state.positions[:, -1:] + advance
        logits = decoder.step_logits(state.inputs, state.mask, state.positions, state.cache, state.key,
                                     cache_position=column + t)
        fed = t + 1
    return tokens, fed


@torch.no_grad()
def generate_with_kwargs(lm, queries, query_mask, kwargs: dict, pad_id: int, stop_ids: list[int]) -> torch.Tensor:
    """[B, T] new tokens from ``transformers``' generate with exactly the caller's ``kwargs``: the checkpoint's
    generation_config is set aside for the call, so none of its fields (top_k, repetition_penalty, ...) leak in."""
    gen = GenerationConfig(**{"pad_token_id": pad_id, "eos_token_id": list(stop_ids), **kwargs})
    saved = lm.generation_config
    lm.generation_config = GenerationConfig()
    try:
        seq = lm.generate(input_ids=queries * query_mask, attention_mask=query_mask, generation_config=gen)
    finally:
        lm.generation_config = saved
    return seq[:, queries.shape[1]:]


def stop_ids_of(config, tokenizer) -> list[int]:
    """The token ids a response stops at: eos with ``stop_token='eos'``, else ``stop_token_id`` (or none),
    each checked to be in the tokenizer's vocabulary."""
    if config.stop_token == "eos":
        if tokenizer.eos_token_id is None:
            raise SettingsError("stop_token='eos' but the tokenizer has no eos token; pass --stop_token_id")
        return [tokenizer.eos_token_id]
    ids = config.stop_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])  # TRL's type is one int
    vocab = None if tokenizer is None else len(tokenizer)
    for token in ids:
        if vocab is not None and not 0 <= token < vocab:
            raise SettingsError(f"stop_token_id {token} is outside the tokenizer's vocabulary (0..{vocab - 1}): "
                                "responses would never stop")
    return ids
