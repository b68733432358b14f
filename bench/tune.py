"""Block-size sweeps for the Triton kernels, for a GPU session.

    python bench/tune.py fused_token_logprobs [--shape 8192 4096 128256] [--out tune.json]
    python bench/tune.py token_logprobs       [--shape 16 512 128256] [--passes fwd+bwd]
    python bench/tune.py fused_full_kl        [--shape 4096 4096 128256]
    python bench/tune.py KERNEL --smoke       # CPU, Triton interpreter, tiny shape: checks the tuner only

Each candidate replaces the kernel module's one tile function (``logprobs._fused_tile``,
``logprobs._row_block``, ``kl._full_kl_tile``: every launch decision lives there), is checked against
the reference on the same inputs, then timed (CUDA events, median). Candidates that fail to compile
(shared memory, registers) are listed as such. The table, fastest first, marks the current default;
``--out`` writes every row as JSON. A better tile goes into the tile function by hand, with the
before/after figures in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys

KERNELS = ("fused_token_logprobs", "token_logprobs", "fused_full_kl")
DEFAULT_SHAPES = {"fused_token_logprobs": (8192, 4096, 128256), "token_logprobs": (16, 512, 128256),
                  "fused_full_kl": (4096, 4096, 128256)}
SMOKE_SHAPES = {"fused_token_logprobs": (24, 40, 97), "token_logprobs": (2, 5, 97), "fused_full_kl": (16, 32, 97)}


def candidates(kernel: str, smoke: bool, L, K) -> list:
    """The tiles to try; under --smoke two the interpreter runs quickly."""
    if kernel == "fused_token_logprobs":
        if smoke:
            return [L.FusedTile(16, 16, 16, 1, 1), L.FusedTile(16, 32, 16, 1, 1)]
        return [L.FusedTile(*c) for c in itertools.product((64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4))]
    if kernel == "token_logprobs":
        if smoke:
            return [(32, 1), (64, 1)]
        return list(itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)))
    if smoke:
        return [K.FullKLTile(16, 32, 16, 1, 1), K.FullKLTile(16, 16, 16, 1, 1)]
    return [K.FullKLTile(*c) for c in itertools.product((64, 128), (64, 128), (32, 64), (4, 8), (2, 3))]


@contextlib.contextmanager
def tile_override(module, name: str, tile):
    original = getattr(module, name)
    setattr(module, name, lambda *args, **kwargs: tile)
    try:
        yield
    finally:
        setattr(module, name, original)


def problem(kernel: str, shape, device: str, backward: bool, L, K):
    """(call, reference outputs, tile function's module and name, the default tile)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if kernel == "token_logprobs":
        logits = torch.randn(shape, device=device, dtype=dtype).requires_grad_(backward)
        index = torch.randint(0, shape[-1], shape[:-1], device=device)

        def run(fn):
            return fn(logits, index, 1.0, return_entropy=True)
        ref_fn, fn, inputs = L.token_logprobs_reference, L.token_logprobs, (logits,)
        where, default = (L, "_row_block"), L._row_block(shape[-1], device == "cuda")
    elif kernel == "fused_token_logprobs":
        n, h, v = shape
        hidden = torch.randn(n, h, device=device, dtype=dtype).requires_grad_(backward)
        weight = (torch.randn(v, h, device=device, dtype=dtype) / h**0.5).requires_grad_(backward)
        index = torch.randint(0, v, (n,), device=device)

        def run(fn):
            return fn(hidden, weight, index, 1.0, return_entropy=True)
        ref_fn, fn, inputs = L.fused_token_logprobs_reference, L.fused_token_logprobs, (hidden, weight)
        where, default = (L, "_fused_tile"), L._fused_tile(dtype, torch.device(device))
    else:
        n, h, v = shape
        hidden = torch.randn(n, h, device=device, dtype=dtype).requires_grad_(backward)
        weight = (torch.randn(v, h, device=device, dtype=dtype) / h**0.5).requires_grad_(backward)
        ref_hidden, ref_weight = hidden.detach() + 0.1 * torch.randn_like(hidden), weight.detach()

        def run(fn):
            return fn(hidden, weight, ref_hidden, ref_weight, 1.0)
        ref_fn, fn, inputs = K.fused_full_kl_reference, K.fused_full_kl, (hidden, weight)
        where, default = (K, "_full_kl_tile"), K._full_kl_tile(torch.device(device))

    from benchutil import outputs_sum

    def call():
        out = run(fn)
        return torch.autograd.grad(outputs_sum(out), inputs) if backward else out

    def expected():
        out = run(ref_fn)
        return torch.autograd.grad(outputs_sum(out), inputs) if backward else out

    return call, expected(), where, default


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=KERNELS)
    parser.add_argument("--shape", type=int, nargs=3, help="N H V (fused kernels) or B T V (token_logprobs)")
    parser.add_argument("--passes", choices=("fwd", "fwd+bwd"), default="fwd")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="write every row as JSON here")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shape")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before fastppo.kernels decorates its kernels
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import importlib

    import torch

    from benchutil import assert_agrees, device_median

    L = importlib.import_module("fastppo.kernels.logprobs")
    K = importlib.import_module("fastppo.kernels.kl")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("tuning times compiled kernels: it needs a CUDA device (--smoke checks the tuner on a CPU)")
    shape = tuple(args.shape or (SMOKE_SHAPES if args.smoke else DEFAULT_SHAPES)[args.kernel])
    backward = args.passes == "fwd+bwd"
    call, expected, (module, name), default = problem(args.kernel, shape, device, backward, L, K)

    rows = []
    for tile in candidates(args.kernel, args.smoke, L, K):
        row = {"tile": list(tile), "default": tuple(tile) == tuple(default)}
        with tile_override(module, name, tile):
            try:
                assert_agrees(call(), expected, f"{args.kernel} {tuple(tile)}", atol_of_max=2e-2)
                row["median_s"] = device_median(call, device, repeats=1 if args.smoke else args.repeats,
                                                warmup=0 if args.smoke else 2)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or run is a result
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        rows.append(row)
        print(f"  {tuple(tile)}: " + (f"{row['median_s'] * 1e3:.3f} ms" if "median_s" in row else row["error"]),
              flush=True)

    timed = sorted((r for r in rows if "median_s" in r), key=lambda r: r["median_s"])
    default_row = next((r for r in rows if r["default"]), None)
    print(f"\n{args.kernel} {args.passes} shape={shape} on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}"
          f"{' (SMOKE: not a measurement)' if args.smoke else ''}; default tile {tuple(default)}"
          f"{'' if default_row else ' (not among the candidates)'}")
    for rank, r in enumerate(timed, 1):
        rel = f"{default_row['median_s'] / r['median_s']:.2f}x default" if default_row and "median_s" in default_row \
            else ""
        print(f"{rank:>3}. {str(tuple(r['tile'])):<28} {r['median_s'] * 1e3:>9.3f} ms  {rel}"
              + ("  <- default" if r["default"] else ""))
    failed = [r for r in rows if "error" in r]
    if failed:
        print(f"{len(failed)} candidate(s) failed to compile or run (see --out)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"kernel": args.kernel, "passes": args.passes, "shape": shape, "device": device,
                       "default": list(default), "rows": rows}, f, indent=1)
    return 0 if timed else 1


if __name__ == "__main__":
    sys.exit(main())
