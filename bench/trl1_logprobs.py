"""fastppo's fused log-prob(+entropy) beside TRL 1.x's ``_ChunkedLogProbFunction`` and Liger's, on the same shapes.

TRL 1.x is the environment's (the ``[trl]`` extra, part of ``[test]``; see the README's test command):

    .venv/bin/python bench/trl1_logprobs.py [--quick] [--json OUT]

Cases: SmolLM2-135M's LM head (H = 576, V = 49,152) over N tokens, forward (log-probs + entropy, the GRPO
policy call) and forward + backward, fp32 and bf16 operands. Implementations, run interleaved, each checked
against a float64 run first:

* ``fastppo``: ``fused_token_logprobs(..., outputs=("logprobs", "entropy"))`` (on a CPU the chunked PyTorch path
  of ``fastppo/kernels/_lmhead.py``, no [N, V] logits; it was the reference path, fp32 logits of the whole batch,
  when bench/RESULTS.md's first table of this script was measured; on CUDA the GEMM-then-rows forward and the
  chunked backward, since the third lease; the fused Triton forward before it);
* ``trl``: TRL 1.x's ``_ChunkedLogProbFunction`` (chunk 4,096 × ``--chunk``; on a CPU its torch fold);
* ``liger``: Liger-Kernel's fused linear cross-entropy, reduction "none", log-probs only (CUDA only);
* ``fastppo fused forward`` (CUDA only): ``fastppo`` with its forward the fused Triton kernel (its default
  until the third lease).

Each time is the median of ``--rounds`` rounds; the floor column is the bare GEMMs (hidden @ Wᵀ forward,
plus dlogits @ W and dlogitsᵀ @ hidden backward) at this machine's measured GEMM rate for that dtype.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchutil import fused_forward
from fastppo.kernels import fused_token_logprobs


def _trl_seam():
    import trl
    from trl.trainer.utils import _ChunkedLogProbFunction

    if not trl.__version__.startswith("1."):
        raise SystemExit(f"needs TRL 1.x (found TRL {trl.__version__} at {trl.__file__}): "
                         ".venv/bin/pip install -e '.[trl]'")
    return trl.__version__, _ChunkedLogProbFunction


def implementations(device: torch.device, chunk: int):
    version, seam = _trl_seam()

    def fastppo(h, w, idx):
        out = fused_token_logprobs(h, w, idx, 1.0, outputs=("logprobs", "entropy"))
        return out.logprobs, out.entropy

    def trl(h, w, idx):
        out = seam.apply(h, w, None, idx, 1.0, chunk, None, 1.0, ("log_probs", "entropy"))
        return out[0], out[1]

    impls = {"fastppo": fastppo, f"trl {version}": trl}
    if device.type == "cuda":
        def fastppo_fused_forward(h, w, idx):  # the forward the fused Triton kernel
            with fused_forward():
                return fastppo(h, w, idx)

        impls["fastppo fused forward"] = fastppo_fused_forward
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            liger_loss = LigerFusedLinearCrossEntropyLoss(reduction="none")

            def liger(h, w, idx):
                return -liger_loss(w, h, idx), None

            impls["liger flce"] = liger
        except ImportError:
            pass
    return impls


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def gemm_rate(n: int, hdim: int, vocab: int, dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of the forward GEMM of this shape, the best of 3."""
    a = torch.randn(n, hdim, device=device, dtype=dtype)
    b = torch.randn(vocab, hdim, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        a @ b.T
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * hdim * vocab / best


def bench_case(impls, n, hdim, vocab, dtype, device, backward: bool, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, hdim, generator=g).to(device, dtype)
    weight = (torch.randn(vocab, hdim, generator=g) / hdim**0.5).to(device, dtype)
    index = torch.randint(0, vocab, (n,), generator=g).to(device)
    h64, w64 = hidden.double(), weight.double()
    z = h64 @ w64.T
    exact = torch.log_softmax(z, -1).gather(-1, index[:, None].cpu() if device.type == "cpu" else index[:, None])[:, 0]
    del z
    calls, errors = {}, {}
    for name, fn in impls.items():
        logp, _ = fn(hidden, weight, index)
        errors[name] = (logp.double() - exact).abs().max().item()

        def call(fn=fn):
            h = hidden.detach().requires_grad_(backward)
            w = weight.detach().requires_grad_(backward)
            logp, ent = fn(h, w, index)
            if backward:
                loss = logp.sum() + (ent.sum() if ent is not None else 0)
                loss.backward()

        call()  # warm-up (and JIT on CUDA)
        calls[name] = call
    times = {name: [] for name in calls}
    for _ in range(rounds):  # interleaved: each round times every implementation once
        for name, call in calls.items():
            _sync(device)
            t0 = time.perf_counter()
            call()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    flops = 2 * n * hdim * vocab * (3 if backward else 1)
    floor = flops / gemm_rate(n, hdim, vocab, dtype, device)
    return {"n": n, "hdim": hdim, "vocab": vocab, "dtype": str(dtype).replace("torch.", ""),
            "passes": "fwd+bwd" if backward else "fwd", "gemm_floor_s": floor,
            "median_s": {k: statistics.median(v) for k, v in times.items()}, "max_abs_err_logp": errors}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 rounds (CI's smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=4096, help="TRL's vocabulary chunk (its trainers pass 4,096)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--shape", type=int, nargs=3, action="append", metavar=("N", "H", "V"),
                        help="a shape to time instead of SmolLM2's head (repeatable), e.g. 8192 4096 128256")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), action="append",
                        help="only these operand dtypes (repeatable; default both)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = args.shape or ([(64, 64, 1000)] if args.quick else [(512, 576, 49152), (2048, 576, 49152)])
    dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in args.dtype or ("fp32", "bf16")]
    rounds = 2 if args.quick else args.rounds
    impls = implementations(device, args.chunk)
    results = []
    for n, hdim, vocab in shapes:
        for dtype in dtypes:
            for backward in (False, True):
                results.append(bench_case(impls, n, hdim, vocab, dtype, device, backward, rounds))
    names = list(impls)
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| N | dtype | passes | " + " | ".join(f"{n} ms" for n in names) + " | fastppo / TRL | GEMM floor ms "
          "| fastppo % floor | max err log p (" + ", ".join(names) + ") |")
    print("|" + "---|" * (7 + len(names)))
    for r in results:
        t = r["median_s"]
        trl_name = names[1]
        print(f"| {r['n']} | {r['dtype']} | {r['passes']} | " + " | ".join(f"{t[n] * 1e3:.1f}" for n in names)
              + f" | {t['fastppo'] / t[trl_name]:.2f} | {r['gemm_floor_s'] * 1e3:.1f} | "
              f"{100 * r['gemm_floor_s'] / t['fastppo']:.0f}% | "
              + ", ".join(f"{r['max_abs_err_logp'][n]:.1e}" for n in names) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
