"""Measuring one end-to-end run in its own process (``trl_baseline.measure``, run by
``trl_baseline.measure_in_subprocess``): throughput from the per-iteration stamps, and peak memory; and
:func:`run_child`, which starts a GRPO side in its own process (bench/grpo_baseline.py,
bench/long_completions.py) and reads its summary, wall time and peak resident set.

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
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable

from e2e_common import REPO, E2EConfig
from trl_envs import trl1_dir

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


# ============================================================================ one GRPO side in its own process


def side_kind(side: str) -> str:
    """Which trainer a side runs: "trl" for TRL's sides (``trl``; ``trl-liger`` in bench/long_completions.py), else
    "fastppo"."""
    return "trl" if side.split("-")[0] == "trl" else "fastppo"


class ChildFailed(RuntimeError):
    """A side's child process that failed, or ran past its limit and was killed; ``out_of_memory`` tells a run
    that did not fit (CUDA's out-of-memory error, or a SIGKILL that was not the limit's: the kernel's OOM killer)."""

    def __init__(self, side: str, returncode: int, timed_out: bool, limit: float, wall_s: float, out: str, err: str):
        why = f"killed at its {limit:g} s limit" if timed_out else f"exit {returncode}"
        super().__init__(f"{side} run failed ({why}):\n{out[-3000:]}\n{err[-5000:]}")
        self.returncode, self.timed_out, self.wall_s, self.stderr = returncode, timed_out, wall_s, err
        self.out_of_memory = not timed_out and ("OutOfMemoryError" in err or "CUDA out of memory" in err
                                                or returncode == -9)


def run_child(side: str, case, script: str, timeout: float = 3600) -> dict:
    """One side in a fresh process, ``script --child SIDE --case JSON`` (``case``: a dataclass), which prints its
    summary as ``GRPO_RESULT <json>`` (``grpo_baseline.child``'s fields): that summary, plus the process's wall
    time and peak RSS (``os.wait4``). Past ``timeout`` the process is killed; any failure raises
    :class:`ChildFailed`."""
    env = dict(os.environ)
    # The caller's own entries stay behind the repository (a GPU machine's carried wheels live there); TRL 1.x
    # goes first for its side, so the TRL 0.26 such an entry may hold is never the one imported.
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = ([trl1_dir()] if side_kind(side) == "trl" else []) + [REPO] + inherited
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["TRITON_INTERPRET"] = "0"
    cmd = [sys.executable, os.path.abspath(script), "--child", side,
           "--case", json.dumps(dataclasses.asdict(case))]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        t0_unix = time.time()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, text=True)
        killed = threading.Event()

        def kill():
            killed.set()
            proc.kill()

        killer = threading.Timer(timeout, kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        out, err = stdout.read(), stderr.read()
    marker = "GRPO_RESULT "
    lines = [line for line in out.splitlines() if line.startswith(marker)]
    if proc.returncode != 0 or not lines:
        raise ChildFailed(side, proc.returncode, killed.is_set(), timeout, wall, out, err)
    result = json.loads(lines[-1][len(marker):])
    result["process_wall_s"] = wall
    result["process_maxrss_bytes"] = usage.ru_maxrss * 1024
    result["process_cpu_s"] = usage.ru_utime + usage.ru_stime  # CPU time of the child: user + system
    result["startup_to_imports_s"] = result["child_start_unix"] - t0_unix + result["imports_s"]
    result["launch_to_first_iteration_s"] = result["first_iteration_end_unix"] - t0_unix  # what a user waits for
    return result
