"""The compiled decode: the rollout's sampler with its per-token forward ``torch.compile``d over a static KV cache.

Why: one decode step of a small model is hundreds of small kernels (or, on a CPU, hundreds of Python-level
module calls) around a few GEMMs that read every weight once. On a GPU the step is launch-bound and CUDA
graphs over static buffers are the lever (``mode="reduce-overhead"``); on a CPU inductor fuses the
element-wise work between the GEMMs. Either needs every tensor the step touches to keep its shape from one
token to the next and from one rollout to the next, hence:

* ``transformers``' ``StaticCache``: keys and values preallocated at ``[batch, heads, cache_len, dim]`` and
  written in place; its fill level is a tensor, so the position a token goes to is data, not a shape;
* buckets: the batch is padded to a power of two (its extra rows repeat the last real row, so every row
  stays finite; their samples are dropped) and the cache length to a multiple of ``cache_bucket``. A
  rollout whose chunk and prompt width fall in the buckets already seen reuses the compiled step: no
  recompilation in a steady run (``tests/test_static_decode.py`` sets dynamo's ``error_on_recompile``);
* one ``StaticCache`` per bucket, kept and ``reset()`` between chunks: fresh buffers would be fresh
  static addresses, hence a re-recorded CUDA graph each time.

What stays eager, on purpose: the prompt's forward (the prefill: one call per chunk, its width changes
with every batch) and the token choice. The choice is ``generation.draw_tokens``, the eager sampler's own
code, run on the real rows only, so a chunk consumes the random stream exactly as the eager sampler does
and the same state draws the same tokens (the tests check this on the embedded model and on SmolLM2).
The step's logits differ from the eager loop's only by float rounding (fused kernels, the masked tail of
the static cache), which moves a draw only if the uniform lands within rounding distance of a
cumulative-probability boundary.
"""
from __future__ import annotations

import inspect
import logging
import time
import types

import torch
from transformers import StaticCache

from fastppo.errors import SettingsError
from fastppo.layout import cache_keyword, causal_lm_of

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BUCKET = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def batch_bucket(rows: int) -> int:
    """The batch a chunk of ``rows`` is padded to: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(rows - 1, 0).bit_length()


_PROMOTING_LAYERS: dict[type, type] = {}


def _promoting_layer_class(base: type) -> type:
    """``base`` (a static cache layer) storing keys and values in their promoted dtype. Under bf16 autocast a Llama
    layer's keys come out of the rotary embedding in fp32 while its values are bf16; ``StaticLayer`` allocates both
    in the keys' dtype and then refuses the values. Upcasting the values is exact, and attention casts both back to
    what the eager loop's ``DynamicCache`` (which keeps each as it comes) gives it: the same logits, the same tokens."""
    if base not in _PROMOTING_LAYERS:
        def update(self, key_states, value_states, *args, **kwargs):
            dtype = torch.promote_types(key_states.dtype, value_states.dtype)
            return base.update(self, key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

        _PROMOTING_LAYERS[base] = type(f"Promoting{base.__name__}", (base,), {"update": update})
    return _PROMOTING_LAYERS[base]


def _decode_step(lm, input_ids, attention_mask, position_ids, cache, keyword: str):
    # the last position's logits only: [B, V]; the cache under ``keyword`` (models.cache_keyword, a constant)
    return lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **{keyword: cache},
              use_cache=True, logits_to_keep=1).logits[:, -1]


class StaticDecoder:
    """The decode step of one model, compiled once per (batch bucket, cache length) and reused across rollouts.

    ``mode``: ``torch.compile``'s mode; ``None`` picks ``"reduce-overhead"`` (CUDA graphs) on CUDA and the
    default inductor mode elsewhere. ``compile_seconds`` holds the time each bucket's first step took
    (compilation included), and the first is reported once through ``log`` (the trainer's console; this
    module's logger at INFO when unset)."""

    def __init__(self, lm, *, mode: str | None = None, cache_bucket: int = DEFAULT_CACHE_BUCKET, log=None):
        if cache_bucket < 1:
            raise SettingsError(f"cache_bucket must be a positive number of positions, got {cache_bucket}")
        self.lm = lm
        self.log = log or logger.info
        self.mode = mode
        self.cache_bucket = cache_bucket
        self._step = None
        self._caches: dict[tuple[int, int], StaticCache] = {}
        self.compile_seconds: dict[tuple[int, int], float] = {}

    def _compiled_step(self, device: torch.device):
        if self._step is None:
            mode = self.mode if self.mode is not None else ("reduce-overhead" if device.type == "cuda" else None)
            # dynamo keeps compiled graphs, and counts recompilations against its limit (8), per code object: a
            # copy of the step's code per decoder keeps one model's graphs from evicting, or being counted as
            # recompilations of, another's (several trainers in one process, a policy and a sample-table model)
            step = types.FunctionType(_decode_step.__code__.replace(), _decode_step.__globals__, "_decode_step")
            self._step = torch.compile(step, mode=mode, dynamic=False)
        return self._step

    def _cache(self, rows: int, cache_len: int) -> StaticCache:
        key = (rows, cache_len)
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = StaticCache(config=self.lm.config, max_cache_len=cache_len)
            for layer in cache.layers:
                layer.__class__ = _promoting_layer_class(type(layer))
        else:
            cache.reset()
        return cache

    def cache_length(self, width: int, response_length: int) -> int:
        """The static cache length for prompts ``width`` wide and ``response_length`` new tokens."""
        return _round_up(width + response_length, self.cache_bucket)

    def step_logits(self, input_ids, attention_mask, position_ids, cache, key) -> torch.Tensor:
        """One decode step's last-position logits, through the compiled step (timed on a bucket's first call)."""
        step = self._compiled_step(input_ids.device)
        if input_ids.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
        keyword = cache_keyword(self.lm)
        if key in self.compile_seconds:
            return step(self.lm, input_ids, attention_mask, position_ids, cache, keyword)
        start = time.perf_counter()
        logits = step(self.lm, input_ids, attention_mask, position_ids, cache, keyword)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        self.compile_seconds[key] = time.perf_counter() - start
        if len(self.compile_seconds) == 1:
            self.log(f"compiled the decode step (batch {key[0]}, cache {key[1]} positions) in "
                     f"{self.compile_seconds[key]:.1f} s; later rollouts reuse it")
        return logits

    def prepare(self, queries, query_mask, response_length: int):
        """The chunk padded to its buckets: (input ids [R, W], the static attention mask [R, L] with the prompt's
        columns filled, position ids [R, W], the reset cache, the bucket key), R = ``batch_bucket(B)``."""
        b, width = queries.shape
        rows, cache_len = batch_bucket(b), self.cache_length(width, response_length)
        extra = rows - b
        if extra:  # repeat the last real row: finite activations everywhere, outputs dropped
            queries = torch.cat([queries, queries[-1:].expand(extra, -1)])
            query_mask = torch.cat([query_mask, query_mask[-1:].expand(extra, -1)])
        mask = query_mask.new_zeros(rows, cache_len)
        mask[:, :width] = query_mask
        positions = (query_mask.cumsum(1) - 1).clamp(min=0)
        return queries * query_mask, mask, positions, self._cache(rows, cache_len), (rows, cache_len)


def accepts_logits_to_keep(lm) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (a PEFT wrapper hands it to its base model)."""
    try:
        return "logits_to_keep" in inspect.signature(causal_lm_of(lm).forward).parameters
    except (TypeError, ValueError):
        return False


def why_not_static(lm) -> str | None:
    """None when ``lm`` can decode through a compiled static cache; else the reason, naming its class."""
    base = causal_lm_of(lm)
    name = type(base).__name__
    if not getattr(base, "_can_compile_fullgraph", False):
        return (f"{name} does not declare support for a compiled static KV cache (transformers' "
                "_can_compile_fullgraph is False for it)")
    if not accepts_logits_to_keep(base):
        return f"{name}.forward takes no logits_to_keep argument"
    return None


# Unset, the compiled decode is on for runs of at least this many rollouts: its compile (37-48 s in a new process
# on an H200) is won back by its faster steps after about 15-20 GRPO iterations at SmolLM2-135M's shape (k 8,
# 64-token completions; bench/RESULTS.md, issue 51); a shorter run samples eagerly.
COMPILED_DECODE_MIN_ITERATIONS = 20


def compiled_decode_enabled(requested: bool | None, device: torch.device, zero_stage: int | None = None,
                            lm=None, log=None, iterations: int | None = None) -> bool:
    """Whether the rollout samples through a ``StaticDecoder``: ``requested`` (the ``compiled_decode`` setting),
    or, unset, on for CUDA only, and there only for a run of ``iterations`` >= ``COMPILED_DECODE_MIN_ITERATIONS``
    rollouts (a shorter one would not win its compile back; it says so). Under ZeRO-3 the policy's weights are
    gathered into fresh storage for every rollout, so each would recompile: refused when asked for, off when
    unset. A model ``lm`` that cannot run over a compiled static cache is refused when asked for, and decodes
    eagerly when unset."""
    if zero_stage == 3:
        if requested:
            raise SettingsError("compiled_decode: not with DeepSpeed ZeRO-3, whose policy weights are re-gathered "
                                "into new storage for every rollout (each would compile the decode step again)")
        return False
    enabled = device.type == "cuda" if requested is None else bool(requested)
    if enabled and requested is None and iterations is not None and iterations < COMPILED_DECODE_MIN_ITERATIONS:
        (log or logger.info)(f"compiled decode off: {iterations} iterations are too few to win back its compile "
                             f"(tens of seconds; it pays from about {COMPILED_DECODE_MIN_ITERATIONS}); sampling "
                             "eagerly (compiled_decode=True compiles anyway)")
        return False
    reason = why_not_static(lm) if enabled and lm is not None else None
    if reason is not None:
        if requested:
            raise SettingsError(f"compiled_decode: {reason}; set compiled_decode to false to sample eagerly")
        (log or logger.info)(f"compiled decode off: {reason}; sampling eagerly")
        return False
    return enabled
