"""gae: the Triton reverse scan against the reference Python loop over t.

Run: ``pytest bench/bench_gae.py --benchmark-group-by=group`` (GPU cases skip without CUDA;
``--smoke`` runs their code on the CPU). Target (kernels issue): at B=512, T=4096 the kernel is
>= 100x the reference loop, which is what TRL and verl run (one small op per step of t).

Inputs are fp32 rewards and values with random right-padded lengths (plus interior holes for
``skip_masked``), gamma=0.99, lam=0.95. Before timing, each case checks the kernel against the
float64 reference on the same inputs.

Floor (``% floor``): reading rewards, values, mask (4+4+1 B) and writing two fp32 outputs (8 B)
per token once, at the measured copy bandwidth.
"""
import pytest
import torch

from fastppo.kernels import gae, gae_reference

GAMMA, LAM = 0.99, 0.95
BYTES_PER_TOKEN = 4 + 4 + 1 + 4 + 4
SEMANTICS = pytest.mark.parametrize("skip_masked", [False, True], ids=["trl", "verl-skip_masked"])


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


@SEMANTICS
def test_gae_reference_cpu(measure, skip_masked):
    B, T = 64, 512
    rewards, values, mask = make_inputs(B, T, skip_masked, "cpu")
    measure(lambda: gae_reference(rewards, values, mask, GAMMA, LAM, skip_masked=skip_masked),
            group=group_name(B, T, skip_masked, "cpu"), impl="reference", device="cpu")


@SEMANTICS
@pytest.mark.parametrize("impl", ["reference", "fastppo triton"])
def test_gae_gpu(measure, gpu_device, copy_bandwidth, gae_shape, impl, skip_masked):
    B, T = gae_shape
    rewards, values, mask = make_inputs(B, T, skip_masked, gpu_device)
    group = group_name(B, T, skip_masked, gpu_device)
    if impl == "fastppo triton":
        got = gae(rewards, values, mask, GAMMA, LAM, skip_masked=skip_masked)  # also JIT-compiles
        expected = gae_reference(rewards.double(), values.double(), mask, GAMMA, LAM, skip_masked=skip_masked)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g.double(), e, atol=1e-4, rtol=1e-5)
        measure(lambda: gae(rewards, values, mask, GAMMA, LAM, skip_masked=skip_masked),
                group=group, impl=impl, device=gpu_device, floor_s=B * T * BYTES_PER_TOKEN / copy_bandwidth)
        return

    def call():
        out = gae_reference(rewards, values, mask, GAMMA, LAM, skip_masked=skip_masked)
        if gpu_device == "cuda":
            torch.cuda.synchronize()
        return out

    # Long sequences take ~1 s per call: a few wall-clock rounds, without the CUDA-event re-timing.
    measure(call, group=group, impl=impl, device=gpu_device, rounds=3 if T <= 4096 else 2, event_timing=T <= 4096)
