"""Every Triton kernel compiles for an H100 (sm_90), without a GPU.

The interpreter runs kernels as NumPy and does not type-check loops, constexpr
branches or dot shapes; a real compile does. Each kernel is compiled with the
arguments its launcher passes at the headline shape and the tile its launcher
would pick on CUDA, read from the module's tile function (so a retuned tile is
what gets compiled), specialised by Triton's own binder exactly as a real launch
is (an int below 2^31 arrives as i32, a stride of 1 as a constexpr; issue 36:
declaring strides i64 compiled a path no real call takes). The compiled TTIR is
then checked for offsets formed in int32: no product of a stride or a row count,
and no product of an offset tensor, in 32 bits.
"""
import os
import subprocess
import sys
import textwrap

import pytest

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import importlib
    import re

    import torch
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    # modules, not the functions of the same name that fastppo.kernels exports
    G, K, L, P, C = (importlib.import_module(f"fastppo.kernels.{m}") for m in ("gae", "kl", "logprobs", "ppo_loss",
                                                                               "_lmhead"))
    CUDA = torch.device("cuda")
    TARGET = GPUTarget("cuda", 90, 32)
    BACKEND = CUDABackend(TARGET)
    N, H, V = 8192, 4096, 128256  # the headline shape: the tiles the launchers pick there
    BAD = []

    def ptr(dtype):
        # what a launch passes for a tensor: its dtype and a 16-byte-aligned address (a meta tensor has both)
        return torch.empty(1, dtype=dtype, device="meta")

    def i32_products(ttir):
        # products formed in 32 bits of a stride or a row count (they pass 2^31 at real sizes), or of a tensor
        # of offsets: every such offset must be formed in int64
        bad = []
        for a, b, ty in re.findall(r"arith\\.muli (%[\\w.#]+), (%[\\w.#]+) : ([^ ]+)", ttir):
            if ty.endswith("xi32>") or (ty == "i32" and any(o.startswith(("%stride", "%N")) for o in (a, b))):
                bad.append(f"{a} * {b} : {ty}")
        return bad

    def compile(fn, args, **meta):
        # The specialisation a real launch with these arguments gets (Triton's own binder: i32 for an int
        # below 2^31, a constexpr for a stride of 1, divisibility by 16), compiled for sm_90.
        binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
        bound, specialization, options = binder(*args, **meta)
        options, signature, constexprs, attrs = fn._pack_args(BACKEND, meta, bound, specialization, options)
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
        BAD.extend(f"{fn.__name__}: {b}" for b in i32_products(kernel.asm["ttir"]))
        print("compiled", fn.__name__, {k: v for k, v in signature.items() if v != "constexpr"})

    # bf16 inputs (fp32 accumulators) and fp64 inputs (gradcheck's dtype: fp64 accumulators and dot, which
    # Triton 3.6 rejected while tl.dot's out_dtype defaulted to fp32)
    for dtype in (torch.bfloat16, torch.float64):
        acc = C.acc_dtype(dtype)
        ACC = dict(ACC_DTYPE=C.tl_dtype(acc))
        dot = dict(DOT_PRECISION=C.dot_precision(dtype, CUDA), DOT_UPCAST=C.dot_upcast(dtype, acc, CUDA))
        x, a, i64 = ptr(dtype), ptr(acc), ptr(torch.int64)

        # logprobs.py: logits [N, V] contiguous
        row = L._token_logprobs_tile(V, CUDA)
        compile(L._token_logprobs_fwd_kernel, (x, V, i64, a, a, a, V, 0.7),
                COMPUTE_ENTROPY=True, BLOCK_V=row.block_v, num_warps=row.num_warps, **ACC)
        dlogits = C.softmax_dlogits_tile(V, CUDA)
        chunk = C.bwd_chunk_cols(N, V, CUDA)
        # upstream grads may be None; the soft-cap's (L7) factor on and off; a chunk of the chunked backward
        for has_g_logp, has_g_ent, softcap in ((True, True, False), (True, False, False), (False, True, False),
                                               (True, True, True)):
            compile(L._softmax_dlogits_kernel, (a, chunk, x, chunk, i64, a, a, a, a, 3 * chunk, chunk, 0.7, 0.3, 2.0),
                    HAS_G_LOGP=has_g_logp, HAS_G_ENT=has_g_ent, HAS_SOFTCAP=softcap, BLOCK_V=dlogits.block_v,
                    num_warps=dlogits.num_warps, **ACC)
        tile = L._fused_token_logprobs_tile(dtype, CUDA)
        plan = (2, 16)  # splits, tiles per split
        # the plain forward on a contiguous head, and soft-capped with every statistic on a tied, transposed
        # head ([V, H] with strides (1, V): (H − 1)·V passes 2^31 at these sizes)
        for extras, (swv, swh) in ((False, (H, 1)), (True, (1, V))):
            compile(L._fused_token_logprobs_fwd_kernel,
                    (x, H, 1, x, swv, swh, x, 1, i64, *(a,) * 7, N, V, H, 0.7, 0.3, 2.0, plan[1]),
                    HAS_BIAS=True, HAS_SOFTCAP=extras, COMPUTE_ENTROPY=True, COMPUTE_SUM_SQ=extras,
                    COMPUTE_SUM_Z=extras, COMPUTE_TOP1=extras, BLOCK_N=tile.block_n, BLOCK_V=tile.block_v,
                    BLOCK_H=tile.block_h, num_warps=tile.num_warps, num_stages=tile.num_stages, **dot, **ACC)

        # kl.py: the exact full-vocabulary KL (tied, transposed policy head; contiguous reference head)
        tile = K._full_kl_tile(dtype, CUDA)
        compile(K._full_kl_fwd_kernel,
                (x, H, 1, x, 1, V, x, 1, x, H, 1, x, H, 1, x, 1, *(a,) * 5, N, V, H, H, 0.7, plan[1]),
                HAS_BIAS=True, HAS_REF_BIAS=True, REF_DOT_PRECISION=dot["DOT_PRECISION"],
                REF_DOT_UPCAST=dot["DOT_UPCAST"], BLOCK_N=tile.block_n, BLOCK_V=tile.block_v,
                BLOCK_H=tile.block_h, num_warps=tile.num_warps, num_stages=tile.num_stages, **dot, **ACC)
        compile(K._full_kl_dlogits_kernel, (a, chunk, a, chunk, x, chunk, a, a, a, a, chunk, 0.7),
                BLOCK_V=dlogits.block_v, num_warps=dlogits.num_warps, **ACC)

        # ppo_loss.py: both passes (with the gradient, both reductions) and the statistics-only forward, plain
        # and with every option (token weights and normaliser, entropy weights, δ)
        tile = P._ppo_loss_tile(N, V, CUDA)
        for token_mean, needs_grad, options in ((True, True, False), (False, True, False), (True, False, False),
                                                (True, True, True)):
            compile(P._ppo_policy_loss_rows_kernel,
                    (a, V, x, V, i64, ptr(torch.float32), ptr(torch.float32), ptr(torch.bool), a, a, a, a,
                     a, a, ptr(torch.bool), a, a, V, 0.7, 0.75, 1.25, 1.5, 0.01),
                    TOKEN_MEAN=token_mean, WEIGHTED=options, ENTROPY_WEIGHTED=options, HAS_DELTA=options,
                    NEEDS_GRAD=needs_grad, BLOCK_V=tile.block_v, num_warps=tile.num_warps, **ACC)

    # kl.py: elementwise estimators, every estimator code, fp32 and fp64 (the long k3 series)
    pen = K._kl_penalty_tile(CUDA)
    for dtype, acc in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        x, a = ptr(dtype), ptr(acc)
        for est in range(4):
            compile(K._kl_penalty_fwd_kernel, (x, x, a, N * 512), EST=est, ACC_DTYPE=C.tl_dtype(acc),
                    BLOCK=pen.block_v, num_warps=pen.num_warps)
            compile(K._kl_penalty_bwd_kernel, (a, x, x, x, x, N * 512), EST=est, HAS_DLOGP=True, HAS_DREF=True,
                    ACC_DTYPE=C.tl_dtype(acc), BLOCK=pen.block_v, num_warps=pen.num_warps)

    # gae.py: both semantics, at a batch of one row per program and one of several
    for skip in (False, True):
        for B in (512, 8192):
            tile = G._gae_tile(B, 4096, CUDA)
            compile(G._gae_fwd_kernel,
                    (ptr(torch.float32), ptr(torch.bfloat16), ptr(torch.bool), ptr(torch.float32),
                     ptr(torch.float32), B, 4096, 4096, 4096, 4096, 4096, 0.99, 0.9405),
                    SKIP_MASKED=skip, BLOCK_B=tile.block_b, BLOCK_T=tile.block_t, num_warps=tile.num_warps)
    assert not BAD, "offsets formed in int32: " + "; ".join(BAD)
    print("all compiled")
    """
)


def test_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # decorate as real JIT kernels
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "all compiled" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
