"""The compiled decode: the rollout's sampler with its per-token forward replayed as a CUDA graph, or
``torch.compile``d, over a static KV cache.

Why: one decode step of a small model is hundreds of small kernels (or, on a CPU, hundreds of Python-level
module calls) around a few GEMMs that read every weight once. On a GPU the step is launch-bound and CUDA
graphs over static buffers are the lever; on a CPU inductor fuses the element-wise work between the GEMMs.
Two backends (``compiled_decode_backend``):

* ``"cuda_graph"`` (the CUDA default): the model's own eager step is run once and captured once per bucket as
  a ``torch.cuda.CUDAGraph``, then replayed. Nothing is compiled, so a new process pays milliseconds, not
  inductor's tens of seconds (37-48 s at SmolLM2-135M's shape on an H200: ``bench/RESULTS.md``). The step takes
  a 4-D attention mask (transformers passes a 4-D mask through as given, so no mask is built on the host) and
  an explicit cache position where the model's forward takes one; it is captured with autocast's weight cache
  off, so the graph casts the weights it reads itself instead of reading casts that autocast frees when the
  rollout ends. A capture that fails is reported once and that bucket runs the same step uncaptured.
* ``"inductor"``: ``torch.compile`` (``mode="reduce-overhead"``, CUDA graphs of inductor's fused kernels, on a
  GPU; the default inductor mode elsewhere, the only backend on a CPU).

Either needs every tensor the step touches to keep its shape from one token to the next and from one rollout
to the next, hence:

* ``transformers``' ``StaticCache``: keys and values preallocated at ``[batch, heads, cache_len, dim]`` and
  written in place; its fill level is a tensor, so the position a token goes to is data, not a shape;
* buckets: the batch is padded to a power of two (its extra rows repeat the last real row, so every row
  stays finite; their samples are dropped) and the cache length to a multiple of ``cache_bucket``. A
  rollout whose chunk and prompt width fall in the buckets already seen reuses the compiled step: no
  recompilation in a steady run (``tests/test_static_decode.py`` sets dynamo's ``error_on_recompile``);
* one ``StaticCache`` per bucket, ``reset()`` between chunks. Where a captured CUDA graph reads it (the
  ``cuda_graph`` backend captured, or inductor's CUDA graphs on CUDA) it is kept between rollouts: fresh buffers
  would be fresh static addresses, hence a re-recorded graph each time. Everywhere else (a CPU, an uncaptured
  step) nothing holds its addresses, and ``release()`` frees it after each rollout, so the update runs without
  it; within a rollout a new bucket frees the last one's. A captured graph also reads the weights at the
  addresses they had: the optimizer updates them in place, and a weight moved elsewhere (a checkpoint loaded
  with ``assign``, a re-wrapped model) drops every graph, to be captured again;
* the cache in the model's compute dtype (``fastppo.kv_cache``: bf16 under bf16 autocast, where the keys would
  otherwise be kept in fp32), sized to the chunk: its rows' bucket × (prompt width + this rollout's new tokens,
  rounded up to ``cache_bucket``). What it holds is said once per bucket (dtype, rows × positions × layers, MiB).

What stays eager, on purpose: the prompt's forward (the prefill: one call per chunk, its width changes
with every batch) and the token choice. The choice is ``generation.draw_tokens``, the eager sampler's own
code, run on the real rows only, so a chunk consumes the random stream exactly as the eager sampler does
and the same state draws the same tokens (the tests check this on the embedded model and on SmolLM2).
The step's logits differ from the eager loop's only by float rounding (fused kernels, the masked tail of
the static cache), which moves a draw only if the uniform lands within rounding distance of a
cumulative-probability boundary.
"""
from __future__ import annotations

import contextlib
import inspect
import time
import types

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

try:  # the static layers whose columns are not the positions one to one (names as in transformers 5.x)
    from transformers.cache_utils import StaticSlidingWindowLayer as _Sliding
    _WINDOWED_STATIC_LAYERS: tuple[type, ...] = (_Sliding,)
except ImportError:  # pragma: no cover - older transformers
    _WINDOWED_STATIC_LAYERS = ()
try:
    from transformers.cache_utils import StaticIndexedLayer as _Indexed
    _WINDOWED_STATIC_LAYERS += (_Indexed,)
except ImportError:  # pragma: no cover
    pass

from fastppo.errors import SettingsError
from fastppo.kv_cache import compute_dtype_layers, describe
from fastppo.layout import cache_keyword, causal_lm_of, four_d_mask, shared_mask_kind
from fastppo.library_log import library_logger

logger = library_logger(__name__)

DEFAULT_CACHE_BUCKET = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def batch_bucket(rows: int) -> int:
    """The batch a chunk of ``rows`` is padded to: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(rows - 1, 0).bit_length()


def _decode_step(lm, input_ids, attention_mask, position_ids, cache, keyword: str):
    # the last position's logits only: [B, V]; the cache under ``keyword`` (models.cache_keyword, a constant)
    return lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **{keyword: cache},
              use_cache=True, logits_to_keep=1).logits[:, -1]


BACKENDS = ("auto", "cuda_graph", "inductor")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``compiled_decode_backend`` on ``device``: ``"auto"`` is ``"cuda_graph"`` on CUDA, ``"inductor"`` elsewhere;
    ``"cuda_graph"`` off CUDA is refused (there is no graph to capture)."""
    if backend not in BACKENDS:
        raise SettingsError(f"compiled_decode_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "cuda_graph" if device.type == "cuda" else "inductor"
    if backend == "cuda_graph" and device.type != "cuda":
        raise SettingsError(f"compiled_decode_backend='cuda_graph' needs a CUDA device, and the policy is on "
                            f"{device.type}; use 'inductor' (or 'auto')")
    return backend


def _weight_addresses(lm) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in (*lm.parameters(), *lm.buffers()))


class GraphedStep:
    """One bucket's decode step over static buffers: its inputs are copied into them, and the step is run (the
    bucket's first call, and every call where ``capture`` is off or failed) or replayed as the CUDA graph captured
    right after that first run. The replayed logits live in the graph's memory, valid until the next step."""

    def __init__(self, lm, cache, keyword: str, input_ids, attention_mask, *, capture: bool, log):
        self.lm, self.cache, self.keyword, self.log = lm, cache, keyword, log
        self.input_ids = input_ids.clone()
        self.position_ids = torch.zeros_like(input_ids)
        # transformers passes a 4-D mask through as given, so none is built (and no padding check synced) inside
        # the graph: sdpa reads a boolean one (True: attend), eager attention adds a float one (0 or the dtype's
        # lowest), as transformers builds each; the one query attends to every column the 2-D mask keeps (later
        # columns are still 0 there). Other attention implementations get the 2-D mask.
        self._mask_kind = shared_mask_kind(lm) or "2d"
        self._mask_dtype = next(lm.parameters()).dtype
        self.mask = self._shaped(attention_mask).clone()
        self.cache_position = (torch.zeros(1, dtype=torch.long, device=input_ids.device)
                               if takes_cache_position(lm) else None)
        self.capture = capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_logits: torch.Tensor | None = None
        self.capture_error: str | None = None

    def _shaped(self, mask2d: torch.Tensor) -> torch.Tensor:
        if self._mask_kind == "2d":
            return mask2d
        return four_d_mask(mask2d.bool()[:, None, None, :], self._mask_kind, self._mask_dtype)

    def _load(self, input_ids, attention_mask, position_ids, cache_position: int) -> None:
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        self.mask.copy_(self._shaped(attention_mask))
        if self.cache_position is not None:
            self.cache_position.fill_(cache_position)

    def _run(self) -> torch.Tensor:
        extra = {} if self.cache_position is None else {"cache_position": self.cache_position}
        return self.lm(input_ids=self.input_ids, attention_mask=self.mask, position_ids=self.position_ids,
                       **{self.keyword: self.cache}, use_cache=True, logits_to_keep=1, **extra).logits[:, -1]

    def __call__(self, input_ids, attention_mask, position_ids, cache_position: int) -> torch.Tensor:
        self._load(input_ids, attention_mask, position_ids, cache_position)
        if self.graph is not None:
            self.graph.replay()
            return self.graph_logits
        if not self.capture or self.capture_error is not None:
            return self._run()
        return self._run_and_capture()

    def _run_and_capture(self) -> torch.Tensor:
        device = self.input_ids.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # the real step, eagerly: it also makes the stream's library handles
            logits = self._run()
        torch.cuda.current_stream(device).wait_stream(side)
        # Capturing records the step's kernels without running them, so the cache is left as the real step wrote
        # it. Autocast's weight cache is off inside: the graph casts the weights itself, where a cached cast would
        # be freed when the rollout's autocast region ends and then read as garbage by the next replay.
        autocast = (torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
                    if torch.is_autocast_enabled("cuda") else contextlib.nullcontext())
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=side), autocast:
                graph_logits = self._run()
        except Exception as err:  # noqa: BLE001 - any failure to capture leaves the uncaptured step, said once
            _release_generator_after_failed_capture(device)
            self.capture_error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            self.log(f"compiled decode: the decode step could not be captured as a CUDA graph "
                     f"({self.capture_error}); this bucket decodes over the static cache without a graph")
            return logits
        self.graph, self.graph_logits = graph, graph_logits
        return logits


def _release_generator_after_failed_capture(device: torch.device) -> None:
    """torch leaves the default CUDA generator in capture mode when a capture fails (``CUDAGraph.capture_end`` raises
    before it hands the generator back), and every eager random draw after that raises "Offset increment outside
    graph capture" (seen on an H200, torch 2.11): the sampler's next ``multinomial`` would end the run. A capture
    that succeeds hands the generator back, so one of a single tiny kernel is made and dropped."""
    with torch.cuda.device(device):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.ones(1, device=device).add_(1)
        del graph


def _forward_parameters(lm) -> set[str]:
    try:
        return set(inspect.signature(causal_lm_of(lm).forward).parameters)
    except (TypeError, ValueError):
        return set()


class StaticDecoder:
    """The decode step of one model over a static KV cache, captured (``backend="cuda_graph"``) or compiled
    (``"inductor"``) once per (batch bucket, cache length), and reused across rollouts.

    ``backend``: ``compiled_decode_backend`` (``"auto"``: a CUDA graph on CUDA, inductor elsewhere); ``mode``:
    ``torch.compile``'s mode for inductor; ``None`` picks ``"reduce-overhead"`` (CUDA graphs) on CUDA and the
    default inductor mode elsewhere. ``compile_seconds`` holds the time each bucket's first step took (its
    compile or capture included), and the first is reported once through ``log`` (the trainer's console; this
    module's logger at INFO when unset)."""

    def __init__(self, lm, *, backend: str = "auto", mode: str | None = None,
                 cache_bucket: int = DEFAULT_CACHE_BUCKET, log=None, capture: bool | None = None):
        if cache_bucket < 1:
            raise SettingsError(f"cache_bucket must be a positive number of positions, got {cache_bucket}")
        if backend not in BACKENDS:
            raise SettingsError(f"compiled_decode_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.lm = lm
        self.log = log or logger.info
        self.backend = backend
        self.mode = mode
        self.cache_bucket = cache_bucket
        # capture=False runs the cuda_graph backend's static step uncaptured (any device): the tests check its
        # tokens where no GPU is
        self._capture = capture
        self._step = None
        self._caches: dict[tuple[int, int], StaticCache] = {}
        self._cache_dtypes: dict[tuple[int, int], torch.dtype | None] = {}  # the autocast dtype each was made under
        self._described: set[tuple[int, int]] = set()
        self._graphed: dict[tuple[int, int], GraphedStep] = {}
        self._addresses: tuple[int, ...] | None = None
        self.compile_seconds: dict[tuple[int, int], float] = {}
        self._keeps_every_column: bool | None = None

    def backend_on(self, device: torch.device) -> str:
        """The backend this decoder runs on ``device`` (``"auto"`` resolved; an uncaptured decoder runs the graph
        backend's step anywhere)."""
        if self.backend == "cuda_graph" and self._capture is False:
            return "cuda_graph"
        return resolve_backend(self.backend, device)

    def _compiled_step(self, device: torch.device):
        if self._step is None:
            mode = self.mode if self.mode is not None else ("reduce-overhead" if device.type == "cuda" else None)
            # dynamo keeps compiled graphs, and counts recompilations against its limit (8), per code object: a
            # copy of the step's code per decoder keeps one model's graphs from evicting, or being counted as
            # recompilations of, another's (several trainers in one process, a policy and a sample-table model)
            step = types.FunctionType(_decode_step.__code__.replace(), _decode_step.__globals__, "_decode_step")
            self._step = torch.compile(step, mode=mode, dynamic=False)
        return self._step

    def _cache(self, rows: int, cache_len: int, device: torch.device) -> StaticCache:
        key = (rows, cache_len)
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        if key in self._caches and self._cache_dtypes[key] != autocast:  # its dtype, and its graph's casts, differ
            self._drop(key)
        cache = self._caches.get(key)
        if cache is None:
            for other in [k for k in self._caches if not self._holds_addresses(k, device)]:
                self._drop(other)  # one bucket's cache at a time where nothing captured reads it
            cache = self._caches[key] = compute_dtype_layers(
                StaticCache(config=self.lm.config, max_cache_len=cache_len), self.lm)
            self._cache_dtypes[key] = autocast
        else:
            cache.reset()
        return cache

    def _holds_addresses(self, key: tuple[int, int], device: torch.device) -> bool:
        """Whether a captured graph reads the bucket's cache at its addresses: a captured CUDA graph, or inductor on
        CUDA (its modes that record CUDA graphs re-record for a new address)."""
        if self.backend_on(device) == "inductor":
            return device.type == "cuda"
        step = self._graphed.get(key)
        return step is not None and step.graph is not None

    def _drop(self, key: tuple[int, int]) -> None:
        self._caches.pop(key, None)
        self._cache_dtypes.pop(key, None)
        step = self._graphed.get(key)
        if step is not None and step.graph is not None:  # a graph of another autocast state
            del self._graphed[key]
            self.compile_seconds.pop(key, None)

    def release(self) -> None:
        """Frees the static caches no captured graph reads (``_holds_addresses``): called between rollouts, so the
        update runs without them. The kept ones stay for the next rollout's replays."""
        for key, cache in list(self._caches.items()):
            device = next((layer.keys.device for layer in cache.layers if getattr(layer, "keys", None) is not None),
                          None)
            if device is None or not self._holds_addresses(key, device):
                self._drop(key)

    def _describe(self, key: tuple[int, int], cache: StaticCache, device: torch.device) -> None:
        """Says what the bucket's cache holds, once per bucket (after its prefill, when its layers exist)."""
        if key in self._described:
            return
        self._described.add(key)
        kept = "kept between rollouts: a captured graph reads it" if self._holds_addresses(key, device) else \
            "freed after each rollout"
        self.log(f"compiled decode: {describe(cache)} ({kept})")

    def keeps_every_column(self) -> bool:
        """Whether the model's static cache holds every column it is given (no sliding-window or indexed layer, whose
        positions are not the columns one to one): ``can_fill_shared`` of an unfilled cache, whose layers allocate
        nothing until their first update. Asked once per rollout and per chunk, answered once per decoder."""
        if self._keeps_every_column is None:
            self._keeps_every_column = self.can_fill_shared(StaticCache(config=self.lm.config, max_cache_len=1))
        return self._keeps_every_column

    @staticmethod
    def can_fill_shared(cache: StaticCache) -> bool:
        """Whether ``fill_shared`` can write this cache: every layer a plain full-attention static layer (a sliding
        window's or an indexed layer's positions are not the prompt's columns one to one)."""
        return all(isinstance(layer, StaticLayer) and not isinstance(layer, _WINDOWED_STATIC_LAYERS)
                   for layer in cache.layers)

    @staticmethod
    def fill_shared(cache: StaticCache, prefill, rows: int, bucket: int, group_size: int) -> torch.Tensor:
        """Writes the keys and values of ``prefill`` (a dynamic cache of one row per prompt, ``rows // group_size``
        prompts) into the reset static ``cache`` of ``bucket`` rows: each prompt's to its ``group_size`` consecutive
        rows, and the bucket's padding rows past ``rows`` the last prompt's (``prepare`` repeats the last real row
        there). Returns the index of each static row's prompt, to spread the prefill's logits the same way. The
        layers' own ``update`` writes them, so the fill level and dtype promotion are what a prefill leaves."""
        if len(prefill.layers) != len(cache.layers):
            raise RuntimeError(f"the prefill filled {len(prefill.layers)} cache layers; the static cache has "
                               f"{len(cache.layers)}")
        device = prefill.layers[0].keys.device
        index = torch.arange(rows, device=device) // group_size
        index = torch.cat([index, index[-1:].expand(bucket - rows)])
        positions = torch.arange(prefill.layers[0].keys.shape[-2], device=device)
        for static, layer in zip(cache.layers, prefill.layers):
            static.update(layer.keys[index], layer.values[index], {"cache_position": positions})
        return index

    def cache_length(self, width: int, response_length: int) -> int:
        """The static cache length for prompts ``width`` wide and ``response_length`` new tokens."""
        return _round_up(width + response_length, self.cache_bucket)

    def step_logits(self, input_ids, attention_mask, position_ids, cache, key, cache_position: int) -> torch.Tensor:
        """One decode step's last-position logits (timed on a bucket's first call). ``cache_position``: the cache
        column this token is written to (the graph backend passes it where the model's forward takes one)."""
        device = input_ids.device
        first = key not in self.compile_seconds
        start = time.perf_counter()
        if self.backend_on(device) == "cuda_graph":
            step = self._graphed.get(key)
            if step is None:
                step = self._graphed[key] = GraphedStep(
                    self.lm, cache, cache_keyword(self.lm), input_ids, attention_mask, log=self.log,
                    capture=device.type == "cuda" if self._capture is None else self._capture)
            if step.graph is None:
                step.cache = cache  # uncaptured: the bucket's cache of this rollout (``release`` freed the last one)
            logits = step(input_ids, attention_mask, position_ids, cache_position)
        else:
            step = self._compiled_step(device)
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
            logits = step(self.lm, input_ids, attention_mask, position_ids, cache, cache_keyword(self.lm))
        if first:
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
            self.compile_seconds[key] = time.perf_counter() - start
            if len(self.compile_seconds) == 1:
                verb = "captured" if self.backend_on(device) == "cuda_graph" else "compiled"
                self.log(f"{verb} the decode step (batch {key[0]}, cache {key[1]} positions) in "
                         f"{self.compile_seconds[key]:.1f} s; later rollouts reuse it")
        self._describe(key, cache, device)
        return logits

    def _check_weights(self) -> None:
        """Drops the captured graphs when a weight or buffer no longer lives where they read it."""
        if self.backend == "inductor":
            return  # dynamo's guards see moved weights themselves
        addresses = _weight_addresses(self.lm)
        if self._addresses is not None and addresses != self._addresses and self._graphed:
            self.log("compiled decode: the policy's weights moved since the decode step was captured; capturing "
                     "it again")
            self._graphed.clear()
            self.compile_seconds.clear()
        self._addresses = addresses

    def prepare(self, queries, query_mask, response_length: int):
        """The chunk padded to its buckets: (input ids [R, W], the static attention mask [R, L] with the prompt's
        columns filled, position ids [R, W], the reset cache, the bucket key), R = ``batch_bucket(B)``."""
        self._check_weights()
        b, width = queries.shape
        rows, cache_len = batch_bucket(b), self.cache_length(width, response_length)
        extra = rows - b
        if extra:  # repeat the last real row: finite activations everywhere, outputs dropped
            queries = torch.cat([queries, queries[-1:].expand(extra, -1)])
            query_mask = torch.cat([query_mask, query_mask[-1:].expand(extra, -1)])
        mask = query_mask.new_zeros(rows, cache_len)
        mask[:, :width] = query_mask
        positions = (query_mask.cumsum(1) - 1).clamp(min=0)
        return queries * query_mask, mask, positions, self._cache(rows, cache_len, queries.device), (rows, cache_len)


def takes_cache_position(lm) -> bool:
    """Whether the model's forward takes ``cache_position`` (transformers before 5.2x); later ones count the cache's
    columns themselves."""
    return "cache_position" in _forward_parameters(lm)


def accepts_logits_to_keep(lm) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (a PEFT wrapper hands it to its base model)."""
    return "logits_to_keep" in _forward_parameters(lm)


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


# Unset, the inductor backend's compiled decode is on for runs of at least this many rollouts: its compile (37-48 s
# in a new process on an H200) is won back by its faster steps after about 15-20 GRPO iterations at SmolLM2-135M's
# shape (k 8, 64-token completions; bench/RESULTS.md, issue 51); a shorter run samples eagerly. The CUDA graph
# backend is captured in milliseconds and has no such floor.
COMPILED_DECODE_MIN_ITERATIONS = 20


def compiled_decode_enabled(requested: bool | None, device: torch.device, zero_stage: int | None = None,
                            lm=None, log=None, iterations: int | None = None, backend: str = "auto") -> bool:
    """Whether the rollout samples through a ``StaticDecoder``: ``requested`` (the ``compiled_decode`` setting),
    or, unset, on for CUDA only, and there, with the inductor ``backend``, only for a run of ``iterations`` >=
    ``COMPILED_DECODE_MIN_ITERATIONS`` rollouts (a shorter one would not win its compile back; it says so). Under
    ZeRO-3 the policy's weights are gathered into fresh storage for every rollout, so each would recompile (or
    recapture): refused when asked for, off when unset. A model ``lm`` that cannot run over a static cache is
    refused when asked for, and decodes eagerly when unset. ``backend`` is checked against ``device``."""
    if zero_stage == 3:
        if requested:
            raise SettingsError("compiled_decode: not with DeepSpeed ZeRO-3, whose policy weights are re-gathered "
                                "into new storage for every rollout (each would compile the decode step again)")
        return False
    enabled = device.type == "cuda" if requested is None else bool(requested)
    if not enabled:
        return False
    resolved = resolve_backend(backend, device)
    if (requested is None and resolved == "inductor" and iterations is not None
            and iterations < COMPILED_DECODE_MIN_ITERATIONS):
        (log or logger.info)(f"compiled decode off: {iterations} iterations are too few to win back inductor's "
                             f"compile (tens of seconds; it pays from about {COMPILED_DECODE_MIN_ITERATIONS}); "
                             "sampling eagerly (compiled_decode=True compiles anyway)")
        return False
    reason = why_not_static(lm) if lm is not None else None
    if reason is not None:
        if requested:
            raise SettingsError(f"compiled_decode: {reason}; set compiled_decode to false to sample eagerly")
        (log or logger.info)(f"compiled decode off: {reason}; sampling eagerly")
        return False
    return True
