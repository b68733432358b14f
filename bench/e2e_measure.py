"""Measuring one end-to-end run in its own process (``trl_baseline.measure``, run by
``trl_baseline.measure_in_subprocess``): throughput from the per-iteration stamps, and peak memory.

Throughput is measured per iteration from timestamps taken inside the training loop, after
``warmup_iterations`` discarded iterations; model loading, the final checkpoint and plots are outside
the timed window.

Peak memory (:class:`PeakMemory`): on CUDA ``torch.cuda.max_memory_allocated`` (reset before the trainer
is built); on CPU the process's peak resident set (VmHWM from /proc/self/status, reset via
/proc/self/clear_refs after the imports where the kernel allows it) minus the resident set at that point
— so it counts models, optimizer state, activations and the allocator's slack, not the
Python/torch/transformers imports.
"""
from __future__ import annotations

import dataclasses
import importlib
import tempfile
from collections.abc import Callable, Iterable

from e2e_common import E2EConfig

# ============================================================================ peak memory


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """The memory baseline, taken when built (after the imports); then the peak growth above it."""

    def __init__(self):
        import resource

        import torch

        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.base_cuda = torch.cuda.memory_allocated()
        self.reset = _reset_peak_rss()
        self.base_rss = _rss_kib("VmRSS")
        self.base_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def rss_delta_bytes(self) -> int | None:
        """Peak resident set since the baseline minus the baseline's, or None where it cannot be known."""
        import resource

        peak_rss = _rss_kib("VmHWM") if self.reset else None
        if peak_rss is None:  # no clear_refs: ru_maxrss is the lifetime peak; valid when training raised it
            peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            if peak_rss <= self.base_max:
                peak_rss = None
        return None if peak_rss is None or self.base_rss is None else (peak_rss - self.base_rss) * 1024

    def cuda_delta_bytes(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated() - self.base_cuda


# ============================================================================ one run


def _preimport(names: Iterable[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def measure(impl: str, cfg: E2EConfig, runner: Callable[[E2EConfig, str], dict], preimports: Iterable[str]) -> dict:
    """Run ``runner(cfg, output_dir)`` (trainer ``impl``) in this process and summarise: episodes/s over the
    timed iterations, peak memory, and the per-iteration ``objective/scores`` / ``objective/kl`` trends.
    ``preimports``: the modules the run imports, imported before the memory baseline."""
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    import transformers  # noqa: F401  (imports before the memory baseline)

    _preimport(preimports)
    memory = PeakMemory()
    with tempfile.TemporaryDirectory(prefix=f"e2e-{impl}-") as out:
        run = runner(cfg, out)
    rss_delta = memory.rss_delta_bytes()
    history, stamps = run["history"], run["stamps"]
    if len(stamps) != cfg.total_iterations or len(history) != cfg.total_iterations:
        raise RuntimeError(f"{impl}: expected {cfg.total_iterations} iterations, got {len(stamps)} stamps and "
                           f"{len(history)} metric rows")
    t0 = run["start"] if cfg.warmup_iterations == 0 else stamps[cfg.warmup_iterations - 1]
    timed = stamps[-1] - t0
    iter_times = [b - a for a, b in zip([run["start"], *stamps[:-1]], stamps)]
    summary = {
        "impl": impl,
        "config": dataclasses.asdict(cfg),
        "device": "cuda" if memory.cuda else "cpu",
        "threads": torch.get_num_threads(),
        "episodes_per_s": cfg.batch_size * cfg.iterations / timed,
        "timed_s": timed,
        "iteration_s": iter_times,
        "peak_rss_delta_bytes": rss_delta,
        "scores": [m["objective/scores"] for m in history],
        "kl": [m["objective/kl"] for m in history],
        "entropy": [m["objective/entropy"] for m in history],
        "context_length": run["context_length"],
    }
    if impl.startswith("fastppo"):
        summary["time_split_s"] = {k: [m[f"time/{k}"] for m in history]
                                   for k in ("generation", "reward", "scoring", "update") if f"time/{k}" in history[0]}
    elif run.get("phases"):
        summary["time_split_s"] = {k: [p[k] for p in run["phases"]] for k in run["phases"][0]}
    if memory.cuda:
        summary["peak_cuda_bytes"] = memory.cuda_delta_bytes()
        summary["device_name"] = torch.cuda.get_device_name()
    return summary
