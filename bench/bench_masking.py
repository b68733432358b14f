"""truncate_at_stop: the C++ (CPU) and CUDA ops against the PyTorch reference."""
import pytest
import torch

from benchutil import requires_cuda
from fastppo.kernels import truncate_at_stop, truncate_at_stop_reference

STOP_IDS = [2, 3]  # eos + eot, Llama-3 style


def responses(B, T, device):
    # ~1 stop token per 256 positions: most rows stop somewhere, some never do.
    x = torch.randint(4, 32000, (B, T), device=device)
    stops = torch.rand(B, T, device=device) < 1 / 256
    return torch.where(stops, torch.full_like(x, 2), x)


@pytest.mark.parametrize("impl", ["reference", "fastppo C++"])
def test_truncate_at_stop_cpu(measure, quick, impl):
    B, T = (512, 1024) if quick else (4096, 1024)
    x = responses(B, T, "cpu")
    fn = truncate_at_stop if impl != "reference" else truncate_at_stop_reference
    measure(lambda: fn(x, STOP_IDS, 0), group=f"truncate_at_stop cpu B={B} T={T} int64", impl=impl, device="cpu")


@requires_cuda
@pytest.mark.parametrize("impl", ["reference", "fastppo CUDA"])
def test_truncate_at_stop_cuda(measure, copy_bandwidth, impl):
    B, T = 1024, 4096
    x = responses(B, T, "cuda")
    fn = truncate_at_stop if impl != "reference" else truncate_at_stop_reference
    # Floor: read the ids once, write ids + bool mask.
    bytes_moved = x.numel() * (8 + 8 + 1)
    measure(lambda: fn(x, STOP_IDS, 0), group=f"truncate_at_stop cuda B={B} T={T} int64", impl=impl, device="cuda",
            floor_s=bytes_moved / copy_bandwidth)
