"""Every Triton kernel compiles for an H100 (sm_90), without a GPU.

The interpreter runs kernels as NumPy and does not type-check loops, constexpr
branches or dot shapes; a real compile does. Each kernel is compiled with the
arguments its launcher passes at the headline shape and the tile its launcher
would pick on CUDA, read from the module's tile function (so a retuned tile is
what gets compiled), specialised by Triton's own binder exactly as a real launch
is (an int below 2^31 arrives as i32, a stride of 1 as a constexpr; issue 36:
declaring strides i64 compiled a path no real call takes). The compiled TTIR is
then checked for offsets formed in int32: no product of a stride or a row count,
and no product of an offset tensor, in 32 bits. The launches and the compile are
bench/sm90_compile.py's (which also reports each kernel's registers and occupancy).
"""
import os
import subprocess
import sys
import textwrap

import pytest

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch

    sys.path.insert(0, "bench")
    import sm90_compile as S
    from sm90_compile import C, CUDA, G, K, L, N, P, V

    BAD = []

    def compile(launch):
        kernel = S.compile_for_sm90(launch)
        BAD.extend(f"{launch.kernel.__name__}: {b}" for b in S.i32_products(kernel.asm["ttir"]))
        print("compiled", launch.kernel.__name__, S.tile_label(launch))

    # bf16 inputs (fp32 accumulators) and fp64 inputs (gradcheck's dtype: fp64 accumulators and dot, which
    # Triton 3.6 rejected while tl.dot's out_dtype defaulted to fp32)
    for dtype in (torch.bfloat16, torch.float64):
        # logprobs.py: logits [N, V] contiguous
        compile(S.token_logprobs_launch(dtype, L._token_logprobs_tile(V, CUDA)))
        dlogits = C.softmax_dlogits_tile(V, CUDA)
        chunk = C.bwd_chunk_cols(N, V, CUDA)
        # upstream grads may be None; the soft-cap's (L7) factor on and off; a chunk of the chunked backward
        for has_g_logp, has_g_ent, softcap in ((True, True, False), (True, False, False), (False, True, False),
                                               (True, True, True)):
            compile(S.softmax_dlogits_launch(dtype, dlogits, chunk, has_g_logp, has_g_ent, softcap))
        tiles_per_split = 16
        # the plain forward on a contiguous head, and soft-capped with every statistic on a tied, transposed
        # head ([V, H] with strides (1, V): (H - 1)*V passes 2^31 at these sizes)
        for extras in (False, True):
            compile(S.fused_token_logprobs_launch(dtype, L._fused_token_logprobs_tile(dtype, CUDA), tiles_per_split,
                                                  bias=True, softcap=extras, all_stats=extras, tied_head=extras))

        # kl.py: the exact full-vocabulary KL (tied, transposed policy head; contiguous reference head)
        compile(S.full_kl_launch(dtype, K._full_kl_tile(dtype, CUDA), tiles_per_split, bias=True, tied_head=True))
        compile(S.full_kl_dlogits_launch(dtype, dlogits, chunk))

        # ppo_loss.py: both passes (with the gradient, both reductions) and the statistics-only forward, plain
        # and with every option (token weights and normaliser, entropy weights, delta), and each surrogate
        tile = P._ppo_loss_tile(N, V, CUDA)
        for token_mean, needs_grad, options in ((True, True, False), (False, True, False), (True, False, False),
                                                (True, True, True)):
            compile(S.ppo_loss_rows_launch(dtype, tile, token_mean, needs_grad, options))
        for surrogate in ("cispo", "sapo"):  # TRL GRPO's loss_types of those names: their own constexpr branch
            compile(S.ppo_loss_rows_launch(dtype, tile, True, True, True, surrogate))

    # kl.py: elementwise estimators, every estimator code, fp32 and fp64 accumulators (the long k3 series)
    pen = K._kl_penalty_tile(CUDA)
    for dtype in (torch.bfloat16, torch.float64):
        for est in range(4):
            compile(S.kl_penalty_fwd_launch(dtype, pen, est, n=N * 512))
            compile(S.kl_penalty_bwd_launch(dtype, pen, est, has_dref=True, n=N * 512))

    # gae.py: both semantics, at a batch of one row per program and one of several
    for skip in (False, True):
        for B in (512, 8192):
            compile(S.gae_launch(G._gae_tile(B, 4096, CUDA), B, 4096, skip))
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
