"""Every Triton kernel compiles for an H100 (sm_90), without a GPU.

The interpreter runs kernels as NumPy and does not type-check loops, constexpr
branches or dot shapes; a real compile does. Each kernel is compiled with the
dtypes its launcher passes and the tile its launcher would pick on CUDA, read
from the module's tile function (so a retuned tile is what gets compiled).
"""
import os
import subprocess
import sys
import textwrap

import pytest

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import importlib

    import torch
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget

    # modules, not the functions of the same name that fastppo.kernels exports
    G, K, L, P, C = (importlib.import_module(f"fastppo.kernels.{m}") for m in ("gae", "kl", "logprobs", "ppo_loss",
                                                                               "_lmhead"))
    CUDA = torch.device("cuda")
    N, H, V = 8192, 4096, 128256  # the headline shape: the tiles the launchers pick there

    def compile(fn, types, consts, **options):
        sig = dict(types, **{k: "constexpr" for k in consts})
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        print("compiled", fn.__name__, consts)

    def lm_head(prefix, x):  # hidden, weight, bias of one LM head, as logits_tile reads them
        return {f"{prefix}h_ptr": x, f"stride_{prefix}hn": "i64", f"stride_{prefix}hh": "i64", f"{prefix}w_ptr": x,
                f"stride_{prefix}wv": "i64", f"stride_{prefix}wh": "i64", f"{prefix}b_ptr": x}

    # bf16 inputs (fp32 accumulators) and fp64 inputs (gradcheck's dtype: fp64 accumulators and dot, which
    # Triton 3.6 rejected while tl.dot's out_dtype defaulted to fp32)
    for dtype, x, acc in ((torch.bfloat16, "*bf16", "*fp32"), (torch.float64, "*fp64", "*fp64")):
        ACC = dict(ACC_DTYPE=tl.float64 if dtype == torch.float64 else tl.float32)
        dot = dict(DOT_PRECISION=C.dot_precision(dtype, CUDA), DOT_UPCAST=C.dot_upcast(dtype, C.acc_dtype(dtype), CUDA))

        # logprobs.py
        row = L._token_logprobs_tile(V, CUDA)
        compile(L._token_logprobs_fwd_kernel,
                dict(x_ptr=x, stride_xn="i64", idx_ptr="*i64", logp_ptr=acc, lse_ptr=acc, ent_ptr=acc, n_cols="i32",
                     temperature="fp32"),
                dict(COMPUTE_ENTROPY=True, BLOCK_V=row.block_v, **ACC), num_warps=row.num_warps)
        dlogits = C.softmax_dlogits_tile(V, CUDA)
        # upstream grads may be None; the soft-cap's (L7) factor on and off
        for has_g_logp, has_g_ent, softcap in ((True, True, False), (True, False, False), (False, True, False),
                                               (True, True, True)):
            compile(L._softmax_dlogits_kernel,
                    dict(x_ptr=acc, stride_xn="i64", dx_ptr=x, stride_dxn="i64", idx_ptr="*i64", lse_ptr=acc,
                         ent_ptr=acc, g_logp_ptr=acc, g_ent_ptr=acc, col_offset="i32", n_cols="i32",
                         temperature="fp32", cap_in="fp32", cap_out="fp32"),
                    dict(HAS_G_LOGP=has_g_logp, HAS_G_ENT=has_g_ent, HAS_SOFTCAP=softcap, BLOCK_V=dlogits.block_v,
                         **ACC),
                    num_warps=dlogits.num_warps)
        tile = L._fused_token_logprobs_tile(dtype, CUDA)
        for extras in (False, True):  # the plain forward, and soft-capped with every statistic of the pass
            compile(L._fused_token_logprobs_fwd_kernel,
                    dict(lm_head("", x), idx_ptr="*i64", m_ptr=acc, s_ptr=acc, t_ptr=acc, pick_ptr=acc, q_ptr=acc,
                         zsum_ptr=acc, before_ptr=acc, N="i32", V="i32", H="i32", temperature="fp32",
                         cap_in="fp32", cap_out="fp32", tiles_per_split="i32"),
                    dict(HAS_BIAS=True, HAS_SOFTCAP=extras, COMPUTE_ENTROPY=True, COMPUTE_SUM_SQ=extras,
                         COMPUTE_SUM_Z=extras, COMPUTE_TOP1=extras, BLOCK_N=tile.block_n, BLOCK_V=tile.block_v,
                         BLOCK_H=tile.block_h, **dot, **ACC), num_warps=tile.num_warps, num_stages=tile.num_stages)

        # kl.py: the exact full-vocabulary KL, forward statistics and the backward's dlogits
        tile = K._full_kl_tile(dtype, CUDA)
        compile(K._full_kl_fwd_kernel,
                dict(lm_head("", x), **lm_head("r", x), m_p_ptr=acc, s_p_ptr=acc, a_ptr=acc, m_q_ptr=acc,
                     s_q_ptr=acc, N="i32", V="i32", H="i32", H_REF="i32", temperature="fp32", tiles_per_split="i32"),
                dict(HAS_BIAS=True, HAS_REF_BIAS=True, REF_DOT_PRECISION=dot["DOT_PRECISION"],
                     REF_DOT_UPCAST=dot["DOT_UPCAST"], BLOCK_N=tile.block_n, BLOCK_V=tile.block_v,
                     BLOCK_H=tile.block_h, **dot, **ACC), num_warps=tile.num_warps, num_stages=tile.num_stages)
        compile(K._full_kl_dlogits_kernel,
                dict(x_ptr=acc, stride_xn="i64", y_ptr=acc, stride_yn="i64", dx_ptr=x, stride_dxn="i64",
                     lse_p_ptr=acc, lse_q_ptr=acc, kl_ptr=acc, g_ptr=acc, n_cols="i32", temperature="fp32"),
                dict(BLOCK_V=dlogits.block_v, **ACC), num_warps=dlogits.num_warps)

        # ppo_loss.py: both passes (with the gradient, both reductions) and the statistics-only forward
        tile = P._ppo_loss_tile(N, V, CUDA)
        for token_mean, needs_grad in ((True, True), (False, True), (True, False)):
            compile(P._ppo_policy_loss_rows_kernel,
                    dict(x_ptr=acc, stride_xn="i64", dx_ptr=x, stride_dxn="i64", idx_ptr="*i64", old_ptr="*fp32",
                         adv_ptr="*fp32", mask_ptr="*i1", count_ptr=acc, logp_ptr=acc, ratio_ptr=acc,
                         clipped_ptr="*i1", ent_ptr=acc, loss_ptr=acc, n_cols="i32", temperature="fp32",
                         clip_low="fp32", clip_high="fp32", entropy_coef="fp32"),
                    dict(TOKEN_MEAN=token_mean, NEEDS_GRAD=needs_grad, BLOCK_V=tile.block_v, **ACC),
                    num_warps=tile.num_warps)

    # kl.py: elementwise estimators, every estimator code
    pen = K._kl_penalty_tile(CUDA)
    for est in range(4):
        compile(K._kl_penalty_fwd_kernel, dict(logp_ptr="*bf16", ref_ptr="*bf16", out_ptr="*fp32", n="i32"),
                dict(EST=est, BLOCK=pen.block_v), num_warps=pen.num_warps)
        compile(K._kl_penalty_bwd_kernel,
                dict(grad_ptr="*fp32", logp_ptr="*bf16", ref_ptr="*bf16", dlogp_ptr="*bf16", dref_ptr="*bf16", n="i32"),
                dict(EST=est, HAS_DLOGP=True, HAS_DREF=True, BLOCK=pen.block_v), num_warps=pen.num_warps)

    # gae.py: both semantics, at a batch of one row per program and one of several
    for skip in (False, True):
        for B in (512, 8192):
            tile = G._gae_tile(B, 4096, CUDA)
            compile(G._gae_fwd_kernel,
                    dict(rewards_ptr="*fp32", values_ptr="*bf16", mask_ptr="*i1", adv_ptr="*fp32", ret_ptr="*fp32",
                         B="i32", T="i32", stride_r="i32", stride_v="i32", stride_m="i32", stride_o="i32",
                         gamma="fp32", lam="fp32"),
                    dict(SKIP_MASKED=skip, BLOCK_B=tile.block_b, BLOCK_T=tile.block_t), num_warps=tile.num_warps)
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
