"""Shared machinery for ``pytest bench/``.

Every case goes through :func:`measure`, which
  * times the call with pytest-benchmark (on CUDA each call ends with a
    synchronize so the wall clock covers the kernels) and, on CUDA, also with
    CUDA events, median of many runs;
  * records peak extra device memory (``torch.cuda.max_memory_allocated`` above
    what was allocated before the call) on CUDA;
  * records an optional physical floor (bare GEMM time, or bytes moved divided by
    the measured copy bandwidth) so a figure reads as a fraction of the limit;
  * files the result under its group for the summary table printed at the end:
    each implementation's time and memory relative to the group's reference.

Run ``pytest bench/ --benchmark-group-by=group`` for pytest-benchmark's tables,
``--quick`` for small CPU shapes, ``--benchmark-json=out.json`` for raw data.
"""
from __future__ import annotations

import os

import pytest
import torch

# Benchmarks measure the real paths: never the Triton interpreter.
os.environ.setdefault("TRITON_INTERPRET", "0")

from benchutil import HAS_CUDA, REGISTRY, Result, cuda_event_median, peak_extra_bytes


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", help="small shapes so a CPU run takes a couple of minutes")


@pytest.fixture(scope="session")
def quick(request) -> bool:
    return request.config.getoption("--quick")


@pytest.fixture(scope="session")
def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    if not HAS_CUDA:
        pytest.skip("copy bandwidth is measured on a CUDA device")
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    seconds = cuda_event_median(lambda: y.copy_(x), repeats=20)
    return 2 * x.numel() / seconds


@pytest.fixture
def measure(benchmark):
    """``measure(fn, group=, impl=, device=, floor_s=None, rounds=None)``.

    ``impl`` names the implementation; the one named "reference..." is the
    group's baseline. ``device`` is where ``fn`` runs ("cpu" or "cuda").
    ``rounds`` switches to a fixed number of rounds for slow cases.
    """

    def run(fn, *, group: str, impl: str, device: str, floor_s: float | None = None, rounds: int | None = None,
            note: str = ""):
        benchmark.group = group
        benchmark.name = impl
        on_cuda = torch.device(device).type == "cuda"
        if on_cuda:
            def call():
                out = fn()
                torch.cuda.synchronize()
                return out
        else:
            call = fn
        if rounds is None:
            benchmark(call)
        else:
            benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=1)
        median = benchmark.stats.stats.median
        peak = None
        if on_cuda:
            # Slow cases (fixed rounds) get as many event timings as rounds, not 50.
            median = cuda_event_median(fn) if rounds is None else cuda_event_median(fn, repeats=max(rounds, 3), warmup=1)
            peak = peak_extra_bytes(fn)
            benchmark.extra_info["cuda_event_median_s"] = median
            benchmark.extra_info["peak_extra_bytes"] = peak
            benchmark.extra_info["device"] = torch.cuda.get_device_name()
        if floor_s is not None:
            benchmark.extra_info["floor_s"] = floor_s
            benchmark.extra_info["fraction_of_floor"] = floor_s / median
        REGISTRY.groups[group].append(Result(impl, median, peak, floor_s, note))

    return run


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-4 else f"{s * 1e6:.1f} us"


def _fmt_bytes(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f} MiB"


def pytest_terminal_summary(terminalreporter):
    if not REGISTRY.groups:
        return
    write = terminalreporter.write_line
    write("")
    write("fastppo bench summary (speedup and memory relative to each group's 'reference' row)")
    header = f"{'group':<46} {'impl':<26} {'median':>11} {'speedup':>8} {'peak mem':>11} {'mem ratio':>9} {'% floor':>8}"
    write(header)
    write("-" * len(header))
    for group, results in sorted(REGISTRY.groups.items()):
        ref = next((r for r in results if r.impl.startswith("reference")), None)
        for r in results:
            speed = f"{ref.median_s / r.median_s:.2f}x" if ref else "-"
            mem = f"{r.peak_bytes / ref.peak_bytes:.3f}" if ref and ref.peak_bytes and r.peak_bytes is not None else "-"
            floor = f"{100 * r.floor_s / r.median_s:.0f}%" if r.floor_s else "-"
            write(f"{group:<46} {r.impl:<26} {_fmt_time(r.median_s):>11} {speed:>8} {_fmt_bytes(r.peak_bytes):>11} {mem:>9} {floor:>8}")
