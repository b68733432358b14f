"""gae: the Triton reverse scan against the reference Python loop over t.

Run: ``pytest bench/bench_gae.py --benchmark-group-by=group`` (GPU cases skip
without CUDA). Target (issue 3): at B=512, T=4096 the kernel is >= 100x the
reference loop, which is what TRL and verl run (one small op per step of t).

Inputs are fp32 rewards and values with random right-padded lengths (plus
interior holes for ``skip_masked``), gamma=0.99, lam=0.95. Before timing, each
CUDA case checks the kernel against the float64 reference on the same inputs.

Floor (``% floor``): reading rewards, values, mask (4+4+1 B) and writing two
fp32 outputs (8 B) per token once, at the measured copy bandwidth.
"""
import pytest
import torch

from benchutil import REGISTRY, Result, requires_cuda
from fastppo.kernels import gae, gae_reference

GAMMA, LAM = 0.99, 0.95
BYTES_PER_TOKEN = 4 + 4 + 1 + 4 + 4


def make_inputs(B, T, skip_masked, device):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if skip_masked:
        mask &= torch.rand(B, T, generator=g) > 0.1
    return rewards.to(device), values.to(device), mask.to(device)


def group_name(B, T, skip_masked, device):
    return f"gae: B={B} T={T} skip_masked={skip_masked} {device} fp32"


def test_gae_reference_cpu(measure):
    B, T = 64, 512
    rewards, values, mask = make_inputs(B, T, False, "cpu")
    measure(lambda: gae_reference(rewards, values, mask, GAMMA, LAM),
            group=group_name(B, T, False, "cpu"), impl="reference", device="cpu")


@requires_cuda
@pytest.mark.parametrize("skip_masked", [False, True])
@pytest.mark.parametrize("T", [512, 4096, 32768])
@pytest.mark.parametrize("B", [64, 512])
@pytest.mark.parametrize("impl", ["reference", "fastppo triton"])
def test_gae_cuda(measure, benchmark, copy_bandwidth, impl, B, T, skip_masked):
    rewards, values, mask = make_inputs(B, T, skip_masked, "cuda")
    group = group_name(B, T, skip_masked, "cuda")
    if impl == "fastppo triton":
        got = gae(rewards, values, mask, GAMMA, LAM, skip_masked=skip_masked)  # also JIT-compiles
        expected = gae_reference(rewards.double(), values.double(), mask, GAMMA, LAM, skip_masked=skip_masked)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g.double(), e, atol=1e-4, rtol=1e-5)
        measure(lambda: gae(rewards, values, mask, GAMMA, LAM, skip_masked=skip_masked),
                group=group, impl=impl, device="cuda", floor_s=B * T * BYTES_PER_TOKEN / copy_bandwidth)
        return

    def call():
        out = gae_reference(rewards, values, mask, GAMMA, LAM, skip_masked=skip_masked)
        torch.cuda.synchronize()
        return out

    if T <= 4096:
        measure(call, group=group, impl=impl, device="cuda", rounds=3)
        return
    # ~1 s per call: `measure` would add 55 CUDA-event runs on top, so time the
    # few rounds here and file the result in the summary table directly.
    benchmark.group, benchmark.name = group, impl
    benchmark.pedantic(call, rounds=2, iterations=1, warmup_rounds=0)
    benchmark.extra_info["device"] = torch.cuda.get_device_name()
    REGISTRY.groups[group].append(Result(impl, benchmark.stats.stats.median, None))
