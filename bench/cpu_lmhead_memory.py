"""Time and peak memory of the LM-head log-probs + entropy on a CPU: fastppo's chunked PyTorch path beside TRL 1.x's
``_ChunkedLogProbFunction`` at its default vocabulary chunk (32,768) and at 4,096, each case in a fresh process.

TRL 1.x is the environment's (the ``[trl]`` extra, part of ``[test]``; see the README's test command):

    TRITON_INTERPRET=0 .venv/bin/python bench/cpu_lmhead_memory.py --rounds 3 [--json OUT]

Cases: two real heads over N tokens, Qwen2.5-0.5B's (N 1,024, H 896, V 151,936) and SmolLM2-135M's (N 2,048,
H 576, V 49,152), random weights; fp32 and bf16 operands (no autocast); "fwd" (log-probs + entropy, inputs not
requiring grad) and "fwd+bwd" (then the backward of Σ log p + Σ H into hidden and weight). Implementations:

* ``fastppo``: ``fused_token_logprobs(..., return_entropy=True)`` (on a CPU: ``_lmhead.chunked_lm_head_stats``);
* ``trl c=32768`` and ``trl c=4096``: ``_ChunkedLogProbFunction.apply(h, w, None, idx, 1.0, c, None, 1.0,
  ("entropy",))`` (on a CPU its torch fold of tiles of 4,096 tokens × c columns).

Each (case, implementation) runs in its own fresh process, every round, the order rotating per round; the
table gives medians over the rounds. In the process: the implementation is imported and run once on a tiny
head (thread pools, lazy imports), the inputs are allocated, then ``/proc/self/clear_refs`` resets the peak
RSS (VmHWM) and the one measured call runs. **Peak memory** is VmHWM after the call minus VmRSS just before
it: the resident memory the call added at its highest (its outputs and gradients included), the inputs not
counted. **Time** is that call's wall time. Each process also reports the CPU seconds the rest of the machine
used during its call (from /proc/stat less its own), so a row that shared the two cores says so.

**GEMM floor**, measured in its own process per head at the start of every round: the bare matmuls the
math needs, at this machine's best for them: forward 1 GEMM (hidden @ Wᵀ), forward + backward 4 (the forward's, its
recomputation in the backward, dlogits @ W and dlogitsᵀ @ hidden: both implementations recompute the logits
rather than keep [N, V]). Each of the three GEMM kinds is timed in fp32 as one [N, V]-sized product and as a
loop over 4,096-column chunks into a reused buffer (the faster counts; one timing after a warm-up per round),
and natively in bf16 (chunked, one timing: 4x slower than fp32 on this CPU, AVX-512 without AMX or
avx512_bf16); each kind's median over the rounds is taken, for bf16 rows the faster of fp32 on upcast
operands (exact; the upcast not counted) and native bf16.

**Accuracy**: after the measured call, each process compares its log-probs and entropies on the first 64
rows with a float64 computation on the same (rounded) operands.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HEADS = {"Qwen2.5-0.5B": (1024, 896, 151936), "SmolLM2-135M": (2048, 576, 49152)}
QUICK_HEADS = {"tiny": (300, 64, 5000)}
IMPLS = ("fastppo", "trl c=32768", "trl c=4096")
ORACLE_ROWS = 64


# --------------------------------------------------------------------------- measurement helpers (worker side)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all CPUs, idle and iowait excluded


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _implementation(name: str):
    import torch

    if name == "fastppo":
        from fastppo.kernels import fused_token_logprobs

        return lambda h, w, idx: fused_token_logprobs(h, w, idx, 1.0, return_entropy=True)
    import trl

    if not trl.__version__.startswith("1."):
        raise SystemExit(f"needs TRL 1.x (found TRL {trl.__version__} at {trl.__file__}): "
                         ".venv/bin/pip install -e '.[trl]'")
    import trl.trainer.utils  # noqa: F401  (its backward imports this at its first call: not inside the timing)
    from trl.trainer.utils import _ChunkedLogProbFunction

    chunk = int(name.split("=")[1])

    def call(h, w, idx):
        out = _ChunkedLogProbFunction.apply(h, w, None, idx, 1.0, chunk, None, 1.0, ("entropy",))
        return out[0], out[1]

    del torch
    return call


def _inputs(n, hdim, vocab, dtype, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hdim, generator=g, dtype=dtype)
    weight = torch.randn(vocab, hdim, generator=g, dtype=dtype).mul_(hdim ** -0.5)
    index = torch.randint(0, vocab, (n,), generator=g)
    return hidden, weight, index


def _run(fn, hidden, weight, index, backward: bool):
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    logp, ent = fn(h, w, index)
    if backward:
        (logp.sum() + ent.sum()).backward()
    return logp.detach(), ent.detach()


def worker_impl(args) -> dict:
    import torch

    dtype = getattr(torch, args.dtype)
    backward = args.passes == "fwd+bwd"
    fn = _implementation(args.impl)
    _run(fn, *_inputs(8, args.hdim, 300, dtype, seed=1), backward)  # warm-up on a tiny head
    hidden, weight, index = _inputs(args.n, args.hdim, args.vocab, dtype)
    gc.collect()
    _reset_peak()
    rss_before = _status_kib("VmRSS")
    busy0, own0 = _machine_busy_s(), _own_cpu_s()
    t0 = time.perf_counter()
    logp, ent = _run(fn, hidden, weight, index, backward)
    seconds = time.perf_counter() - t0
    foreign = (_machine_busy_s() - busy0) - (_own_cpu_s() - own0)
    peak_kib = _status_kib("VmHWM") - rss_before
    z = hidden[:ORACLE_ROWS].double() @ weight.double().T
    log_p = z.log_softmax(-1)
    want_logp = log_p.gather(-1, index[:ORACLE_ROWS, None])[:, 0]
    want_ent = -(log_p.exp() * log_p).sum(-1)
    return {"seconds": seconds, "peak_mib": peak_kib / 1024, "foreign_cpu_s": max(0.0, foreign),
            "err_logp": (logp[:ORACLE_ROWS].double() - want_logp).abs().max().item(),
            "err_entropy": (ent[:ORACLE_ROWS].double() - want_ent).abs().max().item()}


def _time_once(fn, warm: bool) -> float:
    if warm:
        fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker_floor(args) -> dict:
    """Each GEMM kind's time (module docstring) in fp32, chunked and whole (best of the two; a warm-up first),
    and natively in bf16 (chunked, once): {"float32": {kind: s}, "bfloat16": {kind: s}, "foreign_cpu_s": s}."""
    import torch

    n, hdim, vocab = args.n, args.hdim, args.vocab
    hidden, weight, _ = _inputs(n, hdim, vocab, torch.float32)
    cols = 4096
    busy0, own0 = _machine_busy_s(), _own_cpu_s()
    result = {}
    for gemm_dtype in (torch.float32, torch.bfloat16):
        h, w = hidden.to(gemm_dtype), weight.to(gemm_dtype)
        dlogits = torch.randn(n, vocab, dtype=gemm_dtype)
        buf = torch.empty(n * cols, dtype=gemm_dtype)
        gh = torch.empty(n, hdim, dtype=gemm_dtype)
        gw = torch.empty(vocab, hdim, dtype=gemm_dtype)

        def chunked(kind):
            for v0 in range(0, vocab, cols):
                v1 = min(vocab, v0 + cols)
                if kind == "fwd":
                    torch.mm(h, w[v0:v1].T, out=buf[:n * (v1 - v0)].view(n, v1 - v0))
                elif kind == "dx":
                    torch.mm(dlogits[:, v0:v1], w[v0:v1], out=gh)  # (a sum in the real backward: same FLOPs)
                else:
                    torch.mm(dlogits[:, v0:v1].T, h, out=gw[v0:v1])

        whole = {"fwd": lambda: h @ w.T, "dx": lambda: dlogits @ w, "dw": lambda: dlogits.T @ h}
        times = {}
        for kind in ("fwd", "dx", "dw"):
            if gemm_dtype == torch.float32:
                times[kind] = min(_time_once(lambda: chunked(kind), warm=True), _time_once(whole[kind], warm=True))
            else:  # 4x slower than fp32 on an AVX-512 CPU without AMX or avx512_bf16: once, to show it
                times[kind] = _time_once(lambda: chunked(kind), warm=False)
        result[str(gemm_dtype).replace("torch.", "")] = times
        del dlogits, buf, gh, gw, h, w
        gc.collect()
    result["foreign_cpu_s"] = max(0.0, (_machine_busy_s() - busy0) - (_own_cpu_s() - own0))
    return result


def _floor(floors: list[dict], dtype: str) -> dict:
    """fwd and fwd+bwd floors from the rounds' measurements: each kind's median over the rounds, for bf16 rows
    the faster of fp32 on upcast operands and native bf16."""
    kinds = {}
    for kind in ("fwd", "dx", "dw"):
        kinds[kind] = statistics.median(f["float32"][kind] for f in floors)
        if dtype != "float32":
            kinds[kind] = min(kinds[kind], statistics.median(f[dtype][kind] for f in floors))
    return {"fwd": kinds["fwd"], "fwd+bwd": 2 * kinds["fwd"] + kinds["dx"] + kinds["dw"]}


# --------------------------------------------------------------------------- driver


def _spawn(*worker_args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", *map(str, worker_args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt_mib(x: float) -> str:
    return f"{x:,.0f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one tiny head, fp32, 1 round (a smoke run)")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, n, hdim, vocab, dtype, passes, *impl = args.worker
        wargs = argparse.Namespace(n=int(n), hdim=int(hdim), vocab=int(vocab), dtype=dtype, passes=passes,
                                   impl=" ".join(impl))
        result = worker_floor(wargs) if kind == "floor" else worker_impl(wargs)
        print(json.dumps(result))
        return

    heads = QUICK_HEADS if args.quick else HEADS
    dtypes = ("float32",) if args.quick else ("float32", "bfloat16")
    rounds = 1 if args.quick else args.rounds
    cases = [(head, dtype, passes) for head in heads for dtype in dtypes for passes in ("fwd", "fwd+bwd")]
    runs = {(c, impl): [] for c in cases for impl in IMPLS}
    floors = {head: [] for head in heads}
    started = time.time()
    for r in range(rounds):
        for head in heads:
            floors[head].append(_spawn("floor", *heads[head], "float32", "fwd", "-"))
            print(f"round {r + 1} {head} GEMM floor: {floors[head][-1]}", flush=True)
        for c in cases:
            head, dtype, passes = c
            order = IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]  # rotate who goes first
            for impl in order:
                res = _spawn("impl", *heads[head], dtype, passes, impl)
                runs[c, impl].append(res)
                print(f"round {r + 1} {head} {dtype} {passes} {impl}: {res['seconds']:.3f} s, "
                      f"{res['peak_mib']:.0f} MiB, other CPU {res['foreign_cpu_s']:.1f} s", flush=True)
    elapsed = time.time() - started

    import torch

    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"{rounds} rounds, {elapsed / 60:.1f} min, {datetime.date.today()}")
    header = ("| head (N × H × V) | dtype | passes | implementation | time s | vs fastppo | % of GEMM floor | "
              "peak MiB | vs fastppo | max err log p / H | other CPU s |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    table = []
    for c in cases:
        head, dtype, passes = c
        n, hdim, vocab = heads[head]
        floor = _floor(floors[head], dtype)[passes]
        ours_t = statistics.median(x["seconds"] for x in runs[c, "fastppo"])
        ours_m = statistics.median(x["peak_mib"] for x in runs[c, "fastppo"])
        for impl in IMPLS:
            xs = runs[c, impl]
            t = statistics.median(x["seconds"] for x in xs)
            m = statistics.median(x["peak_mib"] for x in xs)
            row = {"head": head, "n": n, "hdim": hdim, "vocab": vocab, "dtype": dtype, "passes": passes,
                   "impl": impl, "seconds": t, "peak_mib": m, "floor_s": floor,
                   "err_logp": max(x["err_logp"] for x in xs), "err_entropy": max(x["err_entropy"] for x in xs),
                   "foreign_cpu_s": max(x["foreign_cpu_s"] for x in xs), "runs": xs}
            table.append(row)
            print(f"| {head} ({n:,} × {hdim} × {vocab:,}) | {dtype} | {passes} | {impl} | {t:.2f} | "
                  f"{t / ours_t:.2f}× | {100 * floor / t:.0f}% | {_fmt_mib(m)} | {m / ours_m:.2f}× | "
                  f"{row['err_logp']:.1e} / {row['err_entropy']:.1e} | {row['foreign_cpu_s']:.1f} |")
    print("\nGEMM floors (s): " + "; ".join(
        f"{head} {dtype}: fwd {_floor(floors[head], dtype)['fwd']:.3f}, "
        f"fwd+bwd {_floor(floors[head], dtype)['fwd+bwd']:.3f}" for head in heads for dtype in dtypes)
        + "; other CPU during the floor runs: "
        + ", ".join(f"{max(f['foreign_cpu_s'] for f in floors[head]):.1f} s" for head in heads))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "floors": floors, "torch": torch.__version__, "elapsed_s": elapsed}, f,
                      indent=1)


if __name__ == "__main__":
    main()
