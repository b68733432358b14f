"""Registers, spills, shared memory and H100 occupancy of every Triton kernel, compiled for sm_90 on a CPU.

    python bench/sm90_compile.py [--out table.md] [--json rows.json]

Each kernel is compiled (no GPU needed) for the launch its launcher makes at the headline shape
(N=8192, H=4096, V=128256, bf16) with the tile its tile function picks on CUDA and with every
candidate bench/tune.py sweeps for it. ptxas -v on the PTX gives registers per thread and spill
bytes, Triton's metadata (plus any static) the shared memory per CTA; CTAs per SM on an H100 follow.
tests/test_gpu_compile.py compiles its launches through the same functions.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import NamedTuple
from unittest import mock

# Triton reads TRITON_INTERPRET when a kernel is decorated: it must be unset before fastppo.kernels is imported,
# or the kernels are the interpreter's and nothing compiles.
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fastppo, from any directory

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend, get_ptxas, sm_arch_from_capability  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

import tune  # noqa: E402  (bench/ is on sys.path: this file's directory, or the test's insert)

# modules, not the functions of the same name that fastppo.kernels exports
C, G, K, L, P = (importlib.import_module(f"fastppo.kernels.{m}") for m in ("_lmhead", "gae", "kl", "logprobs",
                                                                           "ppo_loss"))
CUDA = torch.device("cuda")  # tile functions only read the device type: no GPU is touched
TARGET = GPUTarget("cuda", 90, 32)
BACKEND = CUDABackend(TARGET)
N, H, V = 8192, 4096, 128256  # the headline shape: the tiles the launchers pick there
SEQUENCES, POSITIONS = tune.DEFAULT_SHAPES["gae"]  # kl_penalty's and GAE's [B, T] (tune.py's default shape)


# --------------------------------------------------------------------------- compiling without a GPU


class Launch(NamedTuple):
    """One kernel launch as a launcher makes it: the @triton.jit function, its arguments and its meta-parameters."""

    kernel: object
    args: tuple
    meta: dict


def ptr(dtype: torch.dtype) -> torch.Tensor:
    """What a launch passes for a tensor: its dtype and a 16-byte-aligned address (a meta tensor has both)."""
    return torch.empty(1, dtype=dtype, device="meta")


def compile_for_sm90(launch: Launch):
    """The kernel a real launch with these arguments compiles, for sm_90: Triton's own binder specialises
    them (i32 for an int below 2^31, a constexpr for a stride of 1, divisibility by 16), so the compile
    takes the path a real call takes, not one that declared types would (issue 36)."""
    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound, specialization, options = binder(*launch.args, **launch.meta)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, launch.meta, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def i32_products(ttir: str) -> list[str]:
    """Products formed in 32 bits of a stride or a row count (they pass 2^31 at real sizes), or of a tensor
    of offsets, in a kernel's TTIR: every such offset must be formed in int64."""
    bad = []
    for a, b, ty in re.findall(r"arith\.muli (%[\w.#]+), (%[\w.#]+) : ([^ ]+)", ttir):
        if ty.endswith("xi32>") or (ty == "i32" and any(o.startswith(("%stride", "%N")) for o in (a, b))):
            bad.append(f"{a} * {b} : {ty}")
    return bad


# --------------------------------------------------------------------------- the launches, as the launchers make them
# Each builder mirrors one launcher's call (fastppo/kernels/*.py, ``launch(...)``); its defaults are the call
# bench/tune.py times at the headline shape, its flags the variants tests/test_gpu_compile.py also compiles.


class Precision(NamedTuple):
    """The pointers and constexprs that follow from an input dtype, derived as the launchers derive them."""

    x: torch.Tensor  # an input-dtype tensor (logits, hidden states, weights, gradients out)
    acc: torch.Tensor  # an accumulation-dtype tensor (statistics, logits chunks)
    acc_meta: dict  # ACC_DTYPE
    dot_meta: dict  # DOT_PRECISION, DOT_UPCAST


def precision(dtype: torch.dtype) -> Precision:
    acc = C.acc_dtype(dtype)
    return Precision(ptr(dtype), ptr(acc), dict(ACC_DTYPE=C.tl_dtype(acc)),
                     dict(DOT_PRECISION=C.dot_precision(dtype, CUDA), DOT_UPCAST=C.dot_upcast(dtype, acc, CUDA)))


def row_meta(tile) -> dict:
    return dict(BLOCK_V=tile.block_v, num_warps=tile.num_warps)


def lmhead_meta(tile) -> dict:
    return dict(BLOCK_N=tile.block_n, BLOCK_V=tile.block_v, BLOCK_H=tile.block_h, num_warps=tile.num_warps,
                num_stages=tile.num_stages)


def token_logprobs_launch(dtype, tile, compute_entropy=True) -> Launch:
    """logprobs' row forward over contiguous logits [N, V]."""
    p, i64 = precision(dtype), ptr(torch.int64)
    return Launch(L._token_logprobs_fwd_kernel, (p.x, V, i64, p.acc, p.acc, p.acc, V, 0.7),
                  dict(COMPUTE_ENTROPY=compute_entropy, **row_meta(tile), **p.acc_meta))


def softmax_dlogits_launch(dtype, tile, chunk, has_g_logp=True, has_g_ent=True, softcap=False) -> Launch:
    """The dlogits (L5) of one vocabulary chunk [N, chunk] of the chunked LM-head backward (fp32 logits in,
    the model's dtype out); the upstream gradients may be None, the soft-cap's (L7) factor on or off."""
    p, i64 = precision(dtype), ptr(torch.int64)
    return Launch(L._softmax_dlogits_kernel,
                  (p.acc, chunk, p.x, chunk, i64, p.acc, p.acc, p.acc, p.acc, 3 * chunk, chunk, 0.7, 0.3, 2.0),
                  dict(HAS_G_LOGP=has_g_logp, HAS_G_ENT=has_g_ent, HAS_SOFTCAP=softcap, **row_meta(tile),
                       **p.acc_meta))


def fused_token_logprobs_launch(dtype, tile, tiles_per_split, bias=False, softcap=False, all_stats=False,
                                tied_head=False) -> Launch:
    """The fused forward; ``tied_head``: the weight is a transposed [H, V] embedding, strides (1, V), where
    (H − 1)·V passes 2^31; ``all_stats``: every statistic beside the entropy."""
    p, i64 = precision(dtype), ptr(torch.int64)
    weight_strides = (1, V) if tied_head else (H, 1)
    bias_args = (p.x, 1) if bias else (p.x, 0)  # no bias: the launcher passes the weight and stride 0
    return Launch(L._fused_token_logprobs_fwd_kernel,
                  (p.x, H, 1, p.x, *weight_strides, *bias_args, i64, *(p.acc,) * 7, N, V, H, 0.7, 0.3, 2.0,
                   tiles_per_split),
                  dict(HAS_BIAS=bias, HAS_SOFTCAP=softcap, COMPUTE_ENTROPY=True, COMPUTE_SUM_SQ=all_stats,
                       COMPUTE_SUM_Z=all_stats, COMPUTE_TOP1=all_stats, **lmhead_meta(tile), **p.dot_meta,
                       **p.acc_meta))


def full_kl_launch(dtype, tile, tiles_per_split, bias=False, tied_head=False) -> Launch:
    """kl's fused full-vocabulary forward; ``tied_head``: the policy's weight transposed (strides (1, V)),
    the reference's contiguous; ``bias``: both heads have one."""
    p = precision(dtype)
    weight_strides = (1, V) if tied_head else (H, 1)
    bias_args = (p.x, 1) if bias else (p.x, 0)
    return Launch(K._full_kl_fwd_kernel,
                  (p.x, H, 1, p.x, *weight_strides, *bias_args, p.x, H, 1, p.x, H, 1, *bias_args,
                   *(p.acc,) * 5, N, V, H, H, 0.7, tiles_per_split),
                  dict(HAS_BIAS=bias, HAS_REF_BIAS=bias, REF_DOT_PRECISION=p.dot_meta["DOT_PRECISION"],
                       REF_DOT_UPCAST=p.dot_meta["DOT_UPCAST"], **lmhead_meta(tile), **p.dot_meta, **p.acc_meta))


def full_kl_dlogits_launch(dtype, tile, chunk) -> Launch:
    """kl's dlogits (K2) of one vocabulary chunk of its chunked backward."""
    p = precision(dtype)
    return Launch(K._full_kl_dlogits_kernel,
                  (p.acc, chunk, p.acc, chunk, p.x, chunk, p.acc, p.acc, p.acc, p.acc, chunk, 0.7),
                  dict(**row_meta(tile), **p.acc_meta))


def ppo_loss_rows_launch(dtype, tile, token_mean=True, needs_grad=True, options=False, surrogate="clip") -> Launch:
    """ppo_loss's row kernel over a chunk of fp32 logits [rows, V]; ``options``: token weights and
    normaliser, entropy weights and δ (the clipped surrogate's); ``surrogate``: one of ppo_loss.SURROGATES the row
    kernel takes (clip, cispo, sapo). The tile's chunk_rows is the host's: it changes no compile."""
    p, f32, mask = precision(dtype), ptr(torch.float32), ptr(torch.bool)
    a = p.acc
    return Launch(P._ppo_policy_loss_rows_kernel,
                  (a, V, p.x, V, ptr(torch.int64), f32, f32, mask, a, a, a, a, a, a, mask, a, a, V,
                   0.7, 0.75, 1.25, 1.5, 0.01, 1.0, 1.05),
                  dict(TOKEN_MEAN=token_mean, WEIGHTED=options, ENTROPY_WEIGHTED=options,
                       HAS_DELTA=options and surrogate == "clip", SURROGATE=P.SURROGATES.index(surrogate),
                       NEEDS_GRAD=needs_grad, **row_meta(tile), **p.acc_meta))


def kl_penalty_fwd_launch(dtype, tile, estimator=2, n=SEQUENCES * POSITIONS) -> Launch:
    """kl's elementwise estimator (code 2: k3) over n log-probs."""
    p = precision(dtype)
    return Launch(K._kl_penalty_fwd_kernel, (p.x, p.x, p.acc, n),
                  dict(EST=estimator, BLOCK=tile.block_v, num_warps=tile.num_warps, **p.acc_meta))


def kl_penalty_bwd_launch(dtype, tile, estimator=2, has_dref=False, n=SEQUENCES * POSITIONS) -> Launch:
    """Its backward, into the policy's log-probs (and the reference's with ``has_dref``)."""
    p = precision(dtype)
    return Launch(K._kl_penalty_bwd_kernel, (p.acc, p.x, p.x, p.x, p.x, n),
                  dict(EST=estimator, HAS_DLOGP=True, HAS_DREF=has_dref, BLOCK=tile.block_v,
                       num_warps=tile.num_warps, **p.acc_meta))


def gae_launch(tile, sequences=SEQUENCES, positions=POSITIONS, skip_masked=False) -> Launch:
    """gae's scan over contiguous [B, T] rewards (fp32), values (bf16) and mask."""
    f32, t = ptr(torch.float32), positions
    return Launch(G._gae_fwd_kernel,
                  (f32, ptr(torch.bfloat16), ptr(torch.bool), f32, f32, sequences, t, t, t, t, t, 0.99, 0.9405),
                  dict(SKIP_MASKED=skip_masked, BLOCK_B=tile.block_b, BLOCK_T=tile.block_t, num_warps=tile.num_warps))


# --------------------------------------------------------------------------- every kernel at the headline shape


class KernelCase(NamedTuple):
    """One @triton.jit entry point, the tune.py target whose candidates it is compiled with, its default."""

    name: str  # module.kernel
    target: str  # tune.py's target (a tile name of fastppo.kernels._common.TILE_NAMES)
    default: object  # the tile its launcher picks on CUDA at the headline shape
    launch: Callable[[object], Launch]  # a tile -> the headline launch with it


def h100_tiles_per_split(tile) -> int:
    """Vocabulary tiles per program of the fused forwards at N rows on an H100: split_plan asks the device
    for its SM count, and there is none here, so it is answered for an H100 SXM."""
    with mock.patch.object(C, "sm_count", lambda device: H100.sms):
        return C.split_plan(N, V, tile, CUDA).tiles_per_split


def headline_cases(dtype=torch.bfloat16) -> list[KernelCase]:
    """Every kernel a launcher calls, in the launch bench/tune.py times. lmhead_backward's candidates
    (vocabulary columns per chunk, all ≥ 1024) give _softmax_dlogits_kernel the same tile as its default
    chunk does (softmax_dlogits_tile caps it at 1024 columns), so they add no compile of their own."""
    chunk = C.bwd_chunk_cols(N, V, CUDA)
    dlogits = C.softmax_dlogits_tile(chunk, CUDA)  # the tile the chunked backward's launch asks for
    return [
        KernelCase("logprobs._token_logprobs_fwd_kernel", "token_logprobs", L._token_logprobs_tile(V, CUDA),
                   lambda t: token_logprobs_launch(dtype, t)),
        KernelCase("logprobs._softmax_dlogits_kernel", "softmax_dlogits", dlogits,
                   lambda t: softmax_dlogits_launch(dtype, t, chunk)),
        KernelCase("logprobs._fused_token_logprobs_fwd_kernel", "fused_token_logprobs",
                   L._fused_token_logprobs_tile(dtype, CUDA),
                   lambda t: fused_token_logprobs_launch(dtype, t, h100_tiles_per_split(t))),
        KernelCase("kl._full_kl_fwd_kernel", "fused_full_kl", K._full_kl_tile(C.acc_dtype(dtype), CUDA),
                   lambda t: full_kl_launch(dtype, t, h100_tiles_per_split(t))),
        KernelCase("kl._full_kl_dlogits_kernel", "softmax_dlogits", dlogits,
                   lambda t: full_kl_dlogits_launch(dtype, t, chunk)),
        KernelCase("ppo_loss._ppo_policy_loss_rows_kernel", "fused_ppo_policy_loss", P._ppo_loss_tile(N, V, CUDA),
                   lambda t: ppo_loss_rows_launch(dtype, t)),
        KernelCase("kl._kl_penalty_fwd_kernel", "kl_penalty", K._kl_penalty_tile(CUDA),
                   lambda t: kl_penalty_fwd_launch(dtype, t)),
        KernelCase("kl._kl_penalty_bwd_kernel", "kl_penalty", K._kl_penalty_tile(CUDA),
                   lambda t: kl_penalty_bwd_launch(dtype, t)),
        KernelCase("gae._gae_fwd_kernel", "gae", G._gae_tile(SEQUENCES, POSITIONS, CUDA), gae_launch),
    ]


# --------------------------------------------------------------------------- resources and occupancy


class SMLimits(NamedTuple):
    """What one streaming multiprocessor holds (CUDA occupancy rules for compute capability 9.0)."""

    sms: int = 132  # H100 SXM
    registers: int = 65536
    register_unit: int = 256  # registers are allocated per warp, in units of 256
    shared_bytes: int = 228 * 1024
    reserved_shared_per_cta: int = 1024  # the driver's, per resident CTA
    max_shared_per_cta: int = 227 * 1024  # above it the launch fails
    max_ctas: int = 32
    max_warps: int = 64


H100 = SMLimits()


class Resources(NamedTuple):
    registers: int  # per thread
    spill_bytes: int  # spill stores + spill loads
    shared_bytes: int  # per CTA: Triton's allocation plus any static shared memory


def ptxas_resources(kernel) -> Resources:
    """ptxas -v's account of the compiled kernel. The CompiledKernel's own n_regs and n_spills are read
    when the cubin is loaded, which needs a GPU; ptxas allocates the same from the PTX with Triton's flags
    (make_cubin in triton/backends/nvidia/compiler.py: the register allocator's level is one of them)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        cmd = [get_ptxas(TARGET.arch).path, "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(TARGET.arch)}", src, "-o", os.path.join(tmp, "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    static_shared = re.search(r"(\d+) bytes smem", log)  # absent when 0: Triton allocates its shared memory itself
    static_bytes = int(static_shared.group(1)) if static_shared else 0
    return Resources(registers, stores + loads, kernel.metadata.shared + static_bytes)


def ctas_per_sm(res: Resources, num_warps: int, sm: SMLimits = H100) -> tuple[int, str]:
    """CTAs resident on one SM at once, and the resources that bound them (several where they tie)."""
    regs_per_warp = math.ceil(res.registers * 32 / sm.register_unit) * sm.register_unit
    fits = res.shared_bytes <= sm.max_shared_per_cta
    bounds = {
        "registers": sm.registers // regs_per_warp // num_warps,
        "shared memory": sm.shared_bytes // (res.shared_bytes + sm.reserved_shared_per_cta) if fits else 0,
        "warps": sm.max_warps // num_warps,
        "CTA slots": sm.max_ctas,
    }
    ctas = min(bounds.values())
    return ctas, ", ".join(name for name, bound in bounds.items() if bound == ctas)


# --------------------------------------------------------------------------- the table


def tile_label(launch: Launch) -> str:
    """The tile's constexprs (BLOCK sizes), the part of a launch a tile chooses besides warps and stages."""
    return " ".join(f"{k}={v}" for k, v in launch.meta.items() if k.startswith("BLOCK"))


def measure(case: KernelCase, tile) -> dict:
    """One row: the launch with ``tile`` compiled for sm_90, its resources and occupancy, or why it failed."""
    launch = case.launch(tile)
    row = {"kernel": case.name, "target": case.target, "tile": tile_label(launch),
           "warps": launch.meta["num_warps"], "stages": launch.meta.get("num_stages")}
    try:
        kernel = compile_for_sm90(launch)
        res = ptxas_resources(kernel)
    except Exception as e:  # noqa: BLE001 - a candidate that does not compile is a row of the table
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:160]
        return row
    ctas, limiter = ctas_per_sm(res, launch.meta["num_warps"])
    row.update(stages=kernel.metadata.num_stages, registers=res.registers, spill_bytes=res.spill_bytes,
               shared_bytes=res.shared_bytes, ctas_per_sm=ctas, limited_by=limiter)
    return row


def case_rows(case: KernelCase) -> list[dict]:
    """The default first, then each candidate tune.py sweeps for the case's target that compiles differently
    (ppo_loss's chunk_rows, for one, is the host's: candidates differing only there are one compile)."""
    rows, seen = [], set()
    for tile in [case.default, *tune.candidate_grid(case.target)]:
        launch = case.launch(tile)
        key = (tile_label(launch), launch.meta["num_warps"], launch.meta.get("num_stages"))
        if key in seen:
            continue
        seen.add(key)
        row = measure(case, tile)
        row["default"] = not rows
        rows.append(row)
        print(f"  {case.name} {row['tile']} warps={row['warps']} stages={row['stages']}: "
              + (row["error"] if "error" in row else f"{row['registers']} regs, {row['ctas_per_sm']} CTAs/SM"),
              file=sys.stderr, flush=True)
    return rows


def shared_size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB"  # a row kernel's few bytes of reduction scratch


def markdown(rows: list[dict]) -> str:
    lines = ["| kernel | tile | warps | stages | registers | spill bytes | shared memory | CTAs/SM | default? |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            cells = ["—"] * 4 + [f"does not compile: {r['error']}".replace("|", "/")]
        else:
            over = r["shared_bytes"] > H100.max_shared_per_cta
            ctas = "0 (over 227 KiB: does not launch)" if over else f"{r['ctas_per_sm']} ({r['limited_by']})"
            cells = [r["registers"], r["spill_bytes"], shared_size(r["shared_bytes"]), ctas]
        lines.append("| " + " | ".join(map(str, [r["kernel"], r["tile"], r["warps"], r["stages"] or "—", *cells,
                                                   "default" if r["default"] else ""])) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the markdown table here (else stdout)")
    parser.add_argument("--json", help="write every row as JSON here")
    args = parser.parse_args(argv)
    rows = [row for case in headline_cases() for row in case_rows(case)]
    table = markdown(rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    else:
        print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": "sm_90 (H100 occupancy)", "shape": {"N": N, "H": H, "V": V},
                       "triton_version": triton.__version__, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows if r["default"]) else 1


if __name__ == "__main__":
    sys.exit(main())
