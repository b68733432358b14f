"""truncate_at_stop: the C++ (CPU) and CUDA ops against the PyTorch reference.

Run: ``pytest bench/bench_masking.py --benchmark-group-by=group``. The CPU case runs anywhere
(``--quick``: B=512); the CUDA case runs at B=1024, T=4096 (``--smoke``: its code on the CPU).
Floor (CUDA, ``% floor``): reading the ids once and writing the ids and the bool mask, at the
measured copy bandwidth.
"""
import pytest
import torch

from benchutil import assert_agrees
from fastppo.kernels import truncate_at_stop, truncate_at_stop_reference

STOP_IDS = [2, 3]  # eos + eot, Llama-3 style


def responses(B, T, device):
    # ~1 stop token per 256 positions: most rows stop somewhere, some never do.
    x = torch.randint(4, 32000, (B, T), device=device)
    stops = torch.rand(B, T, device=device) < 1 / 256
    return torch.where(stops, torch.full_like(x, 2), x)


def _impl(impl):
    return truncate_at_stop_reference if impl == "reference" else truncate_at_stop


@pytest.mark.parametrize("impl", ["reference", "fastppo C++"])
def test_truncate_at_stop_cpu(measure, quick, impl):
    B, T = (512, 1024) if quick else (4096, 1024)
    x = responses(B, T, "cpu")
    fn = _impl(impl)
    assert_agrees(fn(x, STOP_IDS, 0), truncate_at_stop_reference(x, STOP_IDS, 0), impl, atol=0, rtol=0)
    measure(lambda: fn(x, STOP_IDS, 0), group=f"truncate_at_stop cpu B={B} T={T} int64", impl=impl, device="cpu")


@pytest.mark.parametrize("impl", ["reference", "fastppo"])
def test_truncate_at_stop_gpu(measure, gpu_device, copy_bandwidth, masking_shape, impl):
    B, T = masking_shape
    x = responses(B, T, gpu_device)
    fn = _impl(impl)
    if impl == "fastppo":  # --smoke runs this case on the CPU, where the op is the C++ one
        impl = "fastppo CUDA" if gpu_device == "cuda" else "fastppo C++"
    assert_agrees(fn(x, STOP_IDS, 0), truncate_at_stop_reference(x, STOP_IDS, 0), impl, atol=0, rtol=0)
    bytes_moved = x.numel() * (8 + 8 + 1)
    measure(lambda: fn(x, STOP_IDS, 0), group=f"truncate_at_stop {gpu_device} B={B} T={T} int64", impl=impl,
            device=gpu_device, floor_s=bytes_moved / copy_bandwidth)
