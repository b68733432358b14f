"""Helpers shared by the bench modules (the fixtures live in conftest.py)."""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="GPU case: needs a CUDA device")


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


def peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
