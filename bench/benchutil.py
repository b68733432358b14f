"""Helpers shared by the bench modules (the fixtures live in conftest.py).

The shapes every case runs at live here, in one table per mode:

* ``full`` (a GPU, the default): the shapes users have, per the bench issue;
* ``quick`` (``--quick``): the kernels issue's headline shapes only on a GPU,
  small CPU shapes so a CPU run takes a couple of minutes;
* ``smoke`` (``--smoke``): tiny shapes for running the GPU cases' code on the
  CPU through the Triton interpreter. Its timings mean nothing; it exists so
  that CI exercises every case (adapters, peers, floors, the summary) on a
  machine without a GPU.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

HAS_CUDA = torch.cuda.is_available()

# The kernels issue's headline shapes.
HEADLINE_LM_HEAD = (8192, 4096, 128256)  # (tokens N, hidden H, vocab V)
HEADLINE_LOGITS = (16, 512, 128256)  # [B, T, V]: N = 8192 tokens

SHAPES = {
    # fused_token_logprobs: (N, H, V)
    "lm_head": {
        "full": [HEADLINE_LM_HEAD] + [(n, h, v) for n in (4096, 16384) for h in (2048, 4096)
                                      for v in (32000, 128256, 151936)],
        "quick": [HEADLINE_LM_HEAD],
        "smoke": [(24, 40, 97)],
    },
    # token_logprobs: logits [B, T, V]
    "logits": {
        "full": [HEADLINE_LOGITS, (16, 512, 32000), (16, 512, 151936)],
        "quick": [HEADLINE_LOGITS],
        "smoke": [(2, 5, 97)],
    },
    # fused_full_kl: (N, H, V)
    "full_kl": {
        "full": [(4096, 2048, 32000), (4096, 4096, 128256)],
        "quick": [(4096, 4096, 128256)],
        "smoke": [(16, 32, 97)],
    },
    # kl_penalty: [B, T]
    "penalty": {
        "full": [(64, 4096), (512, 4096)],
        "quick": [(512, 4096)],
        "smoke": [(3, 50)],
    },
    # gae: (B, T)
    "gae": {
        "full": [(b, t) for b in (64, 512) for t in (512, 4096, 32768)],
        "quick": [(512, 4096)],
        "smoke": [(3, 37)],
    },
    # truncate_at_stop on the GPU: (B, T)
    "masking": {
        "full": [(1024, 4096)],
        "quick": [(1024, 4096)],
        "smoke": [(4, 64)],
    },
}


def shape_id(shape) -> str:
    return "x".join(str(s) for s in shape)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}[dtype]


@dataclass
class Result:
    impl: str
    median_s: float
    peak_bytes: int | None
    floor_s: float | None = None
    note: str = ""


@dataclass
class Registry:
    groups: dict[str, list[Result]] = field(default_factory=lambda: defaultdict(list))
    smoke: bool = False


REGISTRY = Registry()


def cuda_event_median(fn, repeats: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def device_median(fn, device: str, repeats: int = 10, warmup: int = 1) -> float:
    """Median seconds per call: CUDA events on a GPU, the wall clock on the CPU."""
    if torch.device(device).type == "cuda":
        return cuda_event_median(fn, repeats=repeats, warmup=warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def outputs_sum(out):
    """Sum of every output: the scalar a fwd+bwd case differentiates (upstream gradients of ones)."""
    return sum(o.float().sum() for o in out) if isinstance(out, tuple) else out.float().sum()


def with_backward(fn, inputs, backward: bool):
    """``fn`` itself, or, with ``backward``, a call that also takes the gradients to ``inputs``."""
    if not backward:
        return fn
    return lambda: torch.autograd.grad(outputs_sum(fn()), inputs)


def assert_agrees(got, expected, what: str, atol: float = 0.1, rtol: float = 0.02,
                  atol_of_max: float | None = None) -> None:
    """A bench case times only an implementation that computes the right thing.

    The default tolerance is loose on purpose: bf16 peers (TRL's bf16
    log_softmax) are a few 1e-2 off in log-space; a wrong index, sign or
    normaliser is not. ``atol_of_max`` sets each output's absolute tolerance to
    that fraction of its largest expected magnitude (for gradients, whose scale
    depends on the shape).
    """
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(got) == len(expected), f"{what}: {len(got)} outputs, expected {len(expected)}"
    for g, e in zip(got, expected):
        g, e = g.detach().float(), e.detach().float()
        tol = atol if atol_of_max is None else atol_of_max * e.abs().max().item()
        torch.testing.assert_close(g, e, atol=tol, rtol=rtol,
                                   msg=lambda m: f"{what} disagrees with the reference: {m}")
