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

import contextlib
import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

HAS_CUDA = torch.cuda.is_available()

# The kernels issue's headline shapes.
HEADLINE_LM_HEAD = (8192, 4096, 128256)  # (tokens N, hidden H, vocab V)
HEADLINE_LOGITS = (16, 512, 128256)  # [B, T, V]: N = 8192 tokens


@contextlib.contextmanager
def fused_forward():
    """Inside the block, fused_token_logprobs's forward is the fused Triton kernel (on CUDA its default is the
    GEMM-then-rows forward: the fused one is timed beside it)."""
    # imported here: conftest imports this module before --smoke sets TRITON_INTERPRET, which Triton reads when
    # fastppo.kernels is first imported
    from fastppo.kernels._common import override_tile

    with override_tile("lmhead_forward_rows", 0):
        yield


SHAPES = {
    # fused_token_logprobs: (N, H, V)
    "lm_head": {
        "full": [HEADLINE_LM_HEAD] + [(n, h, v) for n in (4096, 16384) for h in (2048, 4096)
                                      for v in (32000, 128256, 151936)],
        # the second vocabulary (Qwen2.5's) beside Llama 3's
        "quick": [HEADLINE_LM_HEAD, (8192, 4096, 151936)],
        "smoke": [(24, 40, 97)],
    },
    # token_logprobs: logits [B, T, V]
    "logits": {
        "full": [HEADLINE_LOGITS, (16, 512, 32000), (16, 512, 151936)],
        "quick": [HEADLINE_LOGITS],
        "smoke": [(2, 5, 97)],
    },
    # fused_ppo_policy_loss: (N, H, V)
    "ppo_loss": {
        "full": [HEADLINE_LM_HEAD, (4096, 2048, 32000), (4096, 4096, 151936)],
        "quick": [HEADLINE_LM_HEAD],
        "smoke": [(20, 32, 97)],
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
    graph_s: float | None = None  # the same call's GPU work alone, as a CUDA-graph replay (short calls only)


@dataclass
class Registry:
    groups: dict[str, list[Result]] = field(default_factory=lambda: defaultdict(list))
    smoke: bool = False


REGISTRY = Registry()


def bench_dtype(device) -> torch.dtype:
    """The dtype a GPU case runs in: bf16 on CUDA (what users have), fp32 on the CPU (--smoke: the
    interpreter's bf16 is NumPy's, and nothing is timed there anyway)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def cuda_event_times(fn, repeats: int = 50, warmup: int = 5) -> list[float]:
    """Seconds per call of ``fn``, one CUDA-event measurement per repeat."""
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
    return times


# A call timed by events alone below this also times the host's launch work (Python, Triton's launcher, the
# argument checks): the GPU idles until the launch arrives. Such a call is also timed as a CUDA-graph replay.
GRAPH_TIMING_BELOW_S = 1e-3


def cuda_graph_times(fn, repeats: int = 20, calls: int = 10) -> list[float] | None:
    """Seconds per call of ``fn``'s GPU work alone: ``calls`` calls captured into one CUDA graph, replayed and
    timed by CUDA events, so no host launch overhead is in the figure. None when ``fn`` cannot be captured (a
    host sync, a CPU tensor, memory): the call-time figure then stands alone."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            fn()  # warm-up on the capture's side stream, as capture asks
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        times = cuda_event_times(graph.replay, repeats=repeats, warmup=2)
    except Exception:  # noqa: BLE001 - any capture failure means "not capturable", reported as None
        torch.cuda.synchronize()
        return None
    finally:
        del graph
    return [t / calls for t in times]


def device_times(fn, device: str, repeats: int = 10, warmup: int = 1) -> list[float]:
    """Seconds per call: CUDA events on a GPU, the wall clock on the CPU."""
    if torch.device(device).type == "cuda":
        return cuda_event_times(fn, repeats=repeats, warmup=warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def device_median(fn, device: str, repeats: int = 10, warmup: int = 1) -> float:
    return statistics.median(device_times(fn, device, repeats, warmup))


def quantiles(times: list[float]) -> dict:
    """median, p20 and p80 of ``times`` (every bench record carries all three)."""
    if len(times) == 1:
        return dict(median_s=times[0], p20_s=times[0], p80_s=times[0])
    cuts = statistics.quantiles(times, n=10, method="inclusive")
    return dict(median_s=statistics.median(times), p20_s=cuts[1], p80_s=cuts[7])


def versions() -> dict:
    """torch and triton versions and the device name, for each bench record."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = None
    device = torch.cuda.get_device_name() if HAS_CUDA else (platform.processor() or platform.machine())
    return dict(torch_version=torch.__version__, triton_version=triton_version, device=device)


def gemm_floor(device: str, forward, backward=None, repeats: int = 10) -> float:
    """Median seconds of the bare GEMMs an LM-head case cannot avoid, timed in the same run: the
    logits GEMM ``h @ w.T`` of each (h, w) in ``forward``, plus, for ``backward=(h, w)``, the two
    gradient GEMMs dX @ w and dXᵀ @ h (dX has the first logits' shape and dtype)."""
    def gemms():
        with torch.no_grad():
            logits = [h @ w.t() for h, w in forward]
            if backward is not None:
                h, w = backward
                logits[0] @ w
                logits[0].t() @ h
            return logits

    return device_median(gemms, device, repeats=repeats)


class ReplayClock:
    """A pytest-benchmark timer that replays durations measured elsewhere: round k lasts ``durations[k]``.

    For runs pytest-benchmark cannot time itself (subprocesses), through its public marker instead of
    its private ``_timer``::

        CLOCK = ReplayClock()

        @pytest.mark.benchmark(timer=CLOCK)
        def test_x(benchmark):
            CLOCK.load(durations)
            benchmark.pedantic(lambda: None, rounds=len(durations), iterations=1, warmup_rounds=0)
    """

    __name__ = "replayed durations (measured outside pytest-benchmark)"

    def __init__(self):
        self.load([])

    def load(self, durations) -> None:
        self._durations, self._t, self._running = iter(list(durations)), 0.0, False

    def __call__(self) -> float:
        if self._running:
            self._t += next(self._durations)
        self._running = not self._running
        return self._t


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
