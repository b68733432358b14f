"""This machine's two ceilings, measured: the GEMM rate at the shapes PPO's update runs and the memory read
bandwidth; and the two fractions every end-to-end figure is placed against.

    python bench/machine_limits.py [--model smollm2] [--tokens 1280] [--json limits.json]

* GEMM rate: ``torch.mm`` at the update's own shapes: [tokens, hidden] × [hidden, out] for the attention
  projections, the MLP and the LM head of the model (fp32 on a CPU, bf16 on a GPU: the dtype each trainer
  computes in), forward and both backward products, median of repeats. This is the rate the update could
  reach if it were nothing but its GEMMs.
* Read bandwidth: ``tensor.sum()`` over a buffer much larger than the last-level cache (bytes read once
  per pass): what a decode step that reads every weight once can reach.

The fractions (:func:`update_fraction`, :func:`decode_fraction`): the update's achieved FLOP rate (its
matmul FLOPs, 6 per parameter per token for forward and backward, plus the same for the value model,
over its measured time) against the GEMM rate; and the time to read the policy's weights once against
the measured time of one decode step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device, repeats: int = 7, warmup: int = 2) -> float:
    # on a GPU each timing covers 20 back-to-back calls: one call at these shapes is tens of microseconds, as
    # short as the host's launch and synchronisation, which would otherwise be what gets measured
    inner = 20 if device.type == "cuda" else 1
    for _ in range(warmup * inner):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def update_gemm_shapes(config, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of the update's GEMMs per layer and the LM head, forward and the two backward products each."""
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or h // heads
    forward = [(tokens, h, h), (tokens, h, 2 * kv * head_dim), (tokens, h, h), (tokens, h, 2 * inter),
               (tokens, inter, h), (tokens, h, v)]
    shapes = []
    for m, k, n in forward:  # y = x W: dX = dY Wᵀ ([m, n] × [n, k]), dW = Xᵀ dY ([k, m] × [m, n])
        shapes += [(m, k, n), (m, n, k), (k, m, n)]
    return shapes


def gemm_rate(shapes, device, dtype) -> dict:
    """FLOP/s of ``torch.mm`` summed over ``shapes`` (each timed alone), and the per-shape rates."""
    total_flops = total_s = 0.0
    rows = []
    for m, k, n in dict.fromkeys(shapes):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = _median_seconds(lambda: torch.mm(a, b), device)
        flops = 2.0 * m * k * n * shapes.count((m, k, n))
        total_flops += flops
        total_s += seconds * shapes.count((m, k, n))
        rows.append({"m": m, "k": k, "n": n, "flop_per_s": 2.0 * m * k * n / seconds})
    return {"flop_per_s": total_flops / total_s, "shapes": rows, "dtype": str(dtype)}


def read_bandwidth(device, gib: float = 1.0) -> float:
    """Bytes per second read by ``sum`` over a ``gib``-GiB fp32 buffer (far beyond the caches)."""
    x = torch.rand(int(gib * 2**30) // 4, device=device)
    seconds = _median_seconds(lambda: x.sum(), device, repeats=5, warmup=1)
    return x.numel() * 4 / seconds


def bench_dtype(device) -> torch.dtype:
    """The dtype the benches compute in: bf16 (autocast) on a GPU, fp32 on a CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def weight_bytes(n_params: int, device) -> int:
    """The bytes a decode step reads to see every weight once, in :func:`bench_dtype`."""
    return n_params * bench_dtype(device).itemsize


def measure(config, tokens: int, device=None) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = bench_dtype(device)
    gemm = gemm_rate(update_gemm_shapes(config, tokens), device, dtype)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(), "tokens": tokens, "gemm_flop_per_s": gemm["flop_per_s"],
            "gemm_dtype": gemm["dtype"], "gemm_shapes": gemm["shapes"],
            "read_bytes_per_s": read_bandwidth(device, 4.0 if device.type == "cuda" else 1.0)}


def update_flops(n_params: int, tokens: int, epochs: int, value_params: int | None = None) -> float:
    """Matmul FLOPs of one PPO update: 6 per parameter per token (forward 2, backward 4), policy and value model,
    every epoch (attention's own products are left out: at these lengths they are a few percent)."""
    return 6.0 * (n_params + (value_params if value_params is not None else n_params)) * tokens * epochs


def update_fraction(update_seconds: float, flops: float, limits: dict) -> float:
    """The update's achieved FLOP rate over this machine's GEMM rate at its shapes."""
    return flops / update_seconds / limits["gemm_flop_per_s"]


def decode_fraction(step_seconds: float, weight_bytes: int, limits: dict) -> float:
    """The time to read the weights once (the decode step's floor) over the measured time of a decode step."""
    return weight_bytes / limits["read_bytes_per_s"] / step_seconds


def main(argv=None):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from transformers import AutoConfig

    from e2e_common import smollm2_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="'smollm2' or a model directory")
    p.add_argument("--tokens", type=int, default=1280, help="rows of the update's GEMMs (micro-batch × sequence)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    config = AutoConfig.from_pretrained(smollm2_dir() if args.model == "smollm2" else args.model)
    result = measure(config, args.tokens)
    print(f"{result['device']} ({result['threads']} threads): GEMM at the update's shapes "
          f"{result['gemm_flop_per_s'] / 1e9:.1f} GFLOP/s ({result['gemm_dtype']}), read bandwidth "
          f"{result['read_bytes_per_s'] / 1e9:.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
