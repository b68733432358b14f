"""Tile sweeps for every launch choice of the Triton kernels, for a GPU session.

    python bench/tune.py fused_token_logprobs [--shape 8192 4096 128256] [--passes fwd+bwd] [--out tune.json]
    python bench/tune.py gae kl_penalty       # several targets in one run
    python bench/tune.py all                  # every target at its default shape
    python bench/tune.py all --smoke          # CPU, Triton interpreter, tiny shapes: checks the tuner only

A target is one tile name of ``fastppo.kernels._common.TILE_NAMES``, i.e. one
tile function (every launch decision of a kernel lives in one):

    token_logprobs          logprobs._token_logprobs_tile       the row forward (B T V)
    softmax_dlogits         _lmhead.softmax_dlogits_tile        the elementwise dlogits kernels, timed fwd+bwd (B T V)
    fused_token_logprobs    logprobs._fused_token_logprobs_tile the fused forward (N H V)
    lmhead_forward_rows     logprobs._lmhead_forward_rows       rows per GEMM of the GEMM-then-rows forward, 0 the
                                                                fused kernel (N H V)
    fused_full_kl           kl._full_kl_tile                    the fused full-KL forward (N H V)
    lmhead_backward         _lmhead.bwd_chunk_cols              vocabulary columns per backward chunk, fwd+bwd (N H V)
    fused_ppo_policy_loss   ppo_loss._ppo_loss_tile             token chunk and row kernel, fwd+bwd (N H V)
    kl_penalty              kl._kl_penalty_tile                 both k3 kernels (B T)
    gae                     gae._gae_tile                       the scan (B T)

Each candidate is installed with ``_common.override_tile`` (the one hook every tile function
answers to), checked against the reference on the same inputs, then timed (CUDA events, median,
p20/p80). Candidates that fail to compile (shared memory, registers) are listed as such. The
table, fastest first, marks the current default; ``--out`` writes every row as JSON. A better tile
goes into the tile function by hand, with the before/after figures in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import sys
from contextlib import nullcontext
from typing import NamedTuple

TARGETS = ("token_logprobs", "softmax_dlogits", "fused_token_logprobs", "lmhead_forward_rows", "fused_full_kl",
           "lmhead_backward", "fused_ppo_policy_loss", "kl_penalty", "gae")
ALWAYS_BACKWARD = ("softmax_dlogits", "lmhead_backward", "fused_ppo_policy_loss")
DEFAULT_SHAPES = {"token_logprobs": (16, 512, 128256), "softmax_dlogits": (16, 512, 128256),
                  "fused_token_logprobs": (8192, 4096, 128256), "lmhead_forward_rows": (8192, 4096, 128256),
                  "fused_full_kl": (4096, 4096, 128256),
                  "lmhead_backward": (8192, 4096, 128256), "fused_ppo_policy_loss": (8192, 4096, 128256),
                  "kl_penalty": (512, 4096), "gae": (512, 4096)}
SMOKE_SHAPES = {"token_logprobs": (2, 5, 97), "softmax_dlogits": (2, 5, 97), "fused_token_logprobs": (24, 40, 97),
                "lmhead_forward_rows": (24, 40, 97),
                "fused_full_kl": (16, 32, 97), "lmhead_backward": (24, 40, 97), "fused_ppo_policy_loss": (20, 32, 97),
                "kl_penalty": (3, 50), "gae": (3, 37)}


class Problem(NamedTuple):
    call: object  # zero-argument: the timed call, returning the outputs it checks
    expected: object  # the reference's outputs on the same inputs
    default: object  # the tile the tile function picks at this shape
    grid: list  # the GPU candidates
    backward: bool  # whether the timed call includes the backward (GAE never does)


def candidate_grid(target: str) -> list:
    """The GPU candidates swept for ``target``: tiles of its tile function's type (lmhead_backward:
    vocabulary columns per chunk). Needs no device: bench/sm90_compile.py compiles them on a CPU."""
    if target == "lmhead_backward":
        return [1024, 2048, 4096, 8192, 16384, 32768]
    if target == "lmhead_forward_rows":  # 0: the fused kernel; else [rows, V] fp32 logits a GEMM
        return [0, 256, 512, 1024, 2048, 4096]
    C, G, P = (importlib.import_module(f"fastppo.kernels.{m}") for m in ("_lmhead", "gae", "ppo_loss"))
    tile_type, axes = {  # one tuple of values per field of the tile, every combination a candidate
        "token_logprobs": (C.RowTile, ((1024, 2048, 4096, 8192), (4, 8, 16))),
        "softmax_dlogits": (C.RowTile, ((256, 512, 1024, 2048, 4096), (2, 4, 8))),
        "kl_penalty": (C.RowTile, ((256, 512, 1024, 2048, 4096), (2, 4, 8))),
        "gae": (G.GAETile, ((1, 2, 4, 8), (128, 256, 512, 1024, 2048), (2, 4, 8))),
        "fused_full_kl": (C.LMHeadTile, ((64, 128), (64, 128), (32, 64), (4, 8), (2, 3))),
        # chunk rows up to the headline N: fewer chunks, fewer passes over the fp32 [V, H] weight-gradient sum
        # (an estimated 34 GB of its traffic at the default 1,040 rows, N 8,192)
        "fused_ppo_policy_loss": (P.PPOLossTile, ((256, 512, 1024, 2048, 4096, 8192), (2048, 4096, 8192), (8, 16))),
        "fused_token_logprobs": (C.LMHeadTile, ((64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4))),
    }[target]
    return [tile_type(*values) for values in itertools.product(*axes)]


def problem(target: str, shape, device: str, backward: bool) -> Problem:
    import torch

    from benchutil import bench_dtype, outputs_sum

    # modules, not the functions of the same name that fastppo.kernels exports (gae)
    C, G, K, L, P = (importlib.import_module(f"fastppo.kernels.{m}") for m in ("_lmhead", "gae", "kl", "logprobs",
                                                                               "ppo_loss"))

    dev, dtype = torch.device(device), bench_dtype(device)
    backward = backward or target in ALWAYS_BACKWARD
    inputs = ()

    if target in ("token_logprobs", "softmax_dlogits"):
        logits = torch.randn(shape, device=device, dtype=dtype).requires_grad_(backward)
        index = torch.randint(0, shape[-1], shape[:-1], device=device)
        inputs = (logits,)
        run = lambda fn: fn(logits, index, 1.0, return_entropy=True)  # noqa: E731
        fn, ref_fn = L.token_logprobs, L.token_logprobs_reference
        if target == "token_logprobs":
            default = L._token_logprobs_tile(shape[-1], dev)
        else:
            default = C.softmax_dlogits_tile(shape[-1], dev)
    elif target in ("kl_penalty", "gae"):
        x, y = torch.randn(shape, device=device), torch.randn(shape, device=device)
        if target == "kl_penalty":
            x, y = -(x.abs() + 0.1), -(y.abs() + 0.1)
            x.requires_grad_(backward)
            inputs = (x,)
            run = lambda fn: fn(x, y, "k3")  # noqa: E731
            fn, ref_fn = K.kl_penalty, K.kl_penalty_reference
            default = K._kl_penalty_tile(dev)
        else:
            backward = False  # targets, never differentiated
            mask = torch.rand(shape, device=device) > 0.1
            run = lambda fn: fn(x, y, mask, 0.99, 0.95)  # noqa: E731
            fn, ref_fn = G.gae, G.gae_reference
            default = G._gae_tile(*shape, dev)
    else:
        n, h, v = shape
        hidden = torch.randn(n, h, device=device, dtype=dtype).requires_grad_(backward)
        weight = (torch.randn(v, h, device=device, dtype=dtype) / h**0.5).requires_grad_(backward)
        index = torch.randint(0, v, (n,), device=device)
        inputs = (hidden, weight)
        if target == "fused_full_kl":
            ref_hidden, ref_weight = hidden.detach() + 0.1 * torch.randn_like(hidden), weight.detach()
            run = lambda fn: fn(hidden, weight, ref_hidden, ref_weight, 1.0)  # noqa: E731
            fn, ref_fn = K.fused_full_kl, K.fused_full_kl_reference
            default = K._full_kl_tile(dtype, dev)
        elif target == "fused_ppo_policy_loss":
            with torch.no_grad():
                old = L.fused_token_logprobs(hidden, weight, index) + 0.2 * torch.randn(n, device=device)
            adv, mask = torch.randn(n, device=device), torch.rand(n, device=device) > 0.1
            run = lambda fn: fn(hidden, weight, index, old, adv, mask, 0.2, 0.01).loss  # noqa: E731
            fn, ref_fn = P.fused_ppo_policy_loss, P.fused_ppo_policy_loss_reference
            default = P._ppo_loss_tile(n, v, dev)
        else:  # fused_token_logprobs, lmhead_forward_rows, lmhead_backward
            run = lambda fn: fn(hidden, weight, index, 1.0, return_entropy=True)  # noqa: E731
            fn, ref_fn = L.fused_token_logprobs, L.fused_token_logprobs_reference
            default = {"fused_token_logprobs": lambda: L._fused_token_logprobs_tile(dtype, dev),
                       "lmhead_forward_rows": lambda: L._lmhead_forward_rows(v, dev, torch.float32),
                       "lmhead_backward": lambda: C.bwd_chunk_cols(n, v, dev)}[target]()

    def with_grad(out):
        return torch.autograd.grad(outputs_sum(out), inputs) if backward else out

    return Problem(lambda: with_grad(run(fn)), with_grad(run(ref_fn)), default, candidate_grid(target),
                   backward or target in ALWAYS_BACKWARD)


def smoke_candidates(target: str, default) -> list:
    """The default and one variant, each quick under the interpreter."""
    if target == "lmhead_backward":
        return [default, 32]
    if target == "lmhead_forward_rows":  # the fused kernel, then 5 rows a GEMM (several chunks at N 24)
        return [default, 5]
    if target in ("fused_token_logprobs", "fused_full_kl"):
        return [default, default._replace(block_v=32 if default.block_v != 32 else 16)]
    if target == "gae":
        return [default, default._replace(block_t=16)]
    if target == "fused_ppo_policy_loss":
        return [default, default._replace(chunk_rows=16, block_v=64)]
    return [default, default._replace(block_v=64)]


def sweep(target: str, shape, device: str, backward: bool, smoke: bool, repeats: int) -> dict:
    from benchutil import assert_agrees, device_times, quantiles
    from fastppo.kernels._common import override_tile

    prob = problem(target, shape, device, backward)
    candidates = smoke_candidates(target, prob.default) if smoke else list(dict.fromkeys([prob.default, *prob.grid]))
    rows = []
    for tile in candidates:
        row = {"tile": list(tile) if isinstance(tile, tuple) else tile, "default": tile == prob.default}
        # the fused forward's tiles are timed on the fused kernel, which is not CUDA's default forward
        fused_only = override_tile("lmhead_forward_rows", 0) if target == "fused_token_logprobs" else nullcontext()
        with override_tile(target, tile), fused_only:
            try:
                assert_agrees(prob.call(), prob.expected, f"{target} {tile}", atol_of_max=2e-2)
                row.update(quantiles(device_times(prob.call, device, repeats=1 if smoke else repeats,
                                                  warmup=0 if smoke else 2)))
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or run is a result
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        rows.append(row)
        print(f"  {target} {tile}: " + (f"{row['median_s'] * 1e3:.3f} ms" if "median_s" in row else row["error"]),
              flush=True)
    return {"shape": list(shape), "default": list(prob.default) if isinstance(prob.default, tuple) else prob.default,
            "passes": "fwd+bwd" if prob.backward else "fwd", "rows": rows}


def report(target: str, result: dict, device_name: str, smoke: bool) -> None:
    rows = result["rows"]
    timed = sorted((r for r in rows if "median_s" in r), key=lambda r: r["median_s"])
    default_row = next((r for r in rows if r["default"]), None)
    print(f"\n{target} {result['passes']} shape={tuple(result['shape'])} on {device_name}"
          f"{' (SMOKE: not a measurement)' if smoke else ''}; default tile {result['default']}")
    for rank, r in enumerate(timed, 1):
        rel = f"{default_row['median_s'] / r['median_s']:.2f}x default" if default_row and "median_s" in default_row \
            else ""
        mark = "  <- default" if r["default"] else ""
        print(f"{rank:>3}. {str(r['tile']):<28} {r['median_s'] * 1e3:>9.3f} ms "
              f"(p20 {r['p20_s'] * 1e3:.3f}, p80 {r['p80_s'] * 1e3:.3f})  {rel}{mark}")
    failed = [r for r in rows if "error" in r]
    if failed:
        print(f"{len(failed)} candidate(s) failed to compile or run (see --out)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="+", choices=(*TARGETS, "all"), metavar="TARGET",
                        help=f"one or more of {', '.join(TARGETS)}, or all")
    parser.add_argument("--shape", type=int, nargs="+", help="N H V, B T V or B T (one target only)")
    parser.add_argument("--passes", choices=("fwd", "fwd+bwd"), default="fwd")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="write every row as JSON here")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = parser.parse_args(argv)
    targets = TARGETS if "all" in args.targets else tuple(dict.fromkeys(args.targets))
    if args.shape and len(targets) != 1:
        parser.error("--shape goes with one target")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before fastppo.kernels decorates its kernels
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    if args.smoke:
        from fastppo.kernels import _interpreter

        _interpreter.install()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("tuning times compiled kernels: it needs a CUDA device (--smoke checks the tuner on a CPU)")
    from benchutil import versions

    env = versions()
    results = {}
    for target in targets:
        shape = tuple(args.shape or (SMOKE_SHAPES if args.smoke else DEFAULT_SHAPES)[target])
        results[target] = sweep(target, shape, device, args.passes == "fwd+bwd", args.smoke, args.repeats)
        report(target, results[target], env["device"], args.smoke)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device_type": device, **env, "targets": results}, f, indent=1)
    return 0 if all(any("median_s" in r for r in res["rows"]) for res in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
