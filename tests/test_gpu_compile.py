"""Every Triton kernel compiles for an H100 (sm_90), without a GPU.

The interpreter runs kernels as NumPy and does not type-check loops, constexpr
branches or dot shapes; a real compile does. Each kernel is compiled with the
dtypes and block sizes its launcher picks on CUDA.
"""
import os
import subprocess
import sys
import textwrap

import pytest

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    import importlib
    # modules, not the functions of the same name that fastppo.kernels exports
    G, K, L = (importlib.import_module(f"fastppo.kernels.{m}") for m in ("gae", "kl", "logprobs"))

    def compile(fn, types, consts, **options):
        sig = dict(types, **{k: "constexpr" for k in consts})
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        print("compiled", fn.__name__, consts)

    # logprobs.py, as launched for bf16 inputs (fp32 accumulators) and fp64 inputs (gradcheck's dtype: fp64
    # accumulators and dot, which Triton 3.6 rejected while tl.dot's out_dtype defaulted to fp32)
    for x, out, tl_acc, fused_tile, fused_warps in (("*bf16", "*fp32", tl.float32, (64, 128, 64), 8),
                                                    ("*fp64", "*fp64", tl.float64, (32, 32, 16), 4)):
        acc = dict(ACC_DTYPE=tl_acc)
        compile(L._token_logprobs_fwd_kernel,
                dict(X=x, stride_x="i64", IDX="*i64", LOGP=out, LSE=out, ENT=out, n_cols="i32", temperature="fp32"),
                dict(COMPUTE_ENTROPY=True, BLOCK_V=4096, **acc), num_warps=8)
        compile(L._token_logprobs_bwd_kernel,
                dict(X=out, stride_x="i64", DX=x, stride_dx="i64", IDX="*i64", LSE=out, ENT=out, G_LOGP=out,
                     G_ENT=out, col_offset="i32", n_cols="i32", temperature="fp32"),
                dict(HAS_G_LOGP=True, HAS_G_ENT=True, BLOCK_V=1024, **acc), num_warps=4)
        block_n, block_v, block_h = fused_tile
        compile(L._fused_logprobs_fwd_kernel,
                dict(HID=x, stride_hn="i64", stride_hh="i64", W=x, stride_wv="i64", stride_wh="i64", B=x,
                     IDX="*i64", M_OUT=out, S_OUT=out, T_OUT=out, PICK_OUT=out, N="i32", V="i32", H="i32",
                     temperature="fp32", tiles_per_split="i32"),
                dict(HAS_BIAS=True, COMPUTE_ENTROPY=True, DOT_PRECISION="ieee", DOT_UPCAST=False, BLOCK_N=block_n,
                     BLOCK_V=block_v, BLOCK_H=block_h, **acc), num_warps=fused_warps, num_stages=3)

    # kl.py: elementwise estimators, every estimator code
    for est in range(4):
        compile(K._kl_penalty_fwd_kernel, dict(logp_ptr="*bf16", ref_ptr="*bf16", out_ptr="*fp32", n="i32"),
                dict(EST=est, BLOCK=1024), num_warps=4)
        compile(K._kl_penalty_bwd_kernel,
                dict(grad_ptr="*fp32", logp_ptr="*bf16", ref_ptr="*bf16", dlogp_ptr="*bf16", dref_ptr="*bf16", n="i32"),
                dict(EST=est, HAS_DLOGP=True, HAS_DREF=True, BLOCK=1024), num_warps=4)
    # kl.py: exact full-vocabulary KL, forward statistics and backward dlogits (the CUDA tile of _full_kl_config)
    full_kl_args = dict(h_ptr="*bf16", w_ptr="*bf16", rh_ptr="*bf16", rw_ptr="*bf16")
    dims = dict(N="i32", V="i32", H="i32", H_REF="i32")
    strides = dict(stride_h="i64", stride_w="i64", stride_rh="i64", stride_rw="i64", inv_t="fp32")
    tile = dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=64, DOT_P="ieee", DOT_Q="ieee", UP_P=False, UP_Q=False)
    compile(K._full_kl_fwd_kernel, dict(full_kl_args, part_ptr="*fp32", **dims, **strides, tiles_per_split="i32"),
            tile, num_warps=4, num_stages=3)
    compile(K._full_kl_dlogits_kernel,
            dict(full_kl_args, lse_p_ptr="*fp32", lse_q_ptr="*fp32", kl_ptr="*fp32", grad_ptr="*fp32",
                 dx_ptr="*bf16", **dims, v_begin="i32", chunk_v="i32", **strides),
            tile, num_warps=4, num_stages=3)
    # gae.py: both semantics, one row and four rows per program
    for skip in (False, True):
        for block_b in (1, 4):
            compile(G._gae_kernel,
                    dict(rewards_ptr="*fp32", values_ptr="*bf16", mask_ptr="*i1", adv_ptr="*fp32", ret_ptr="*fp32",
                         B="i32", T="i32", stride_r="i32", stride_v="i32", stride_m="i32", stride_o="i32",
                         gamma="fp32", lam="fp32"),
                    dict(SKIP_MASKED=skip, BLOCK_B=block_b, BLOCK_T=512), num_warps=4)
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
