"""Where fastppo's PPO update spends its time: torch.profiler's operator table for one update.

    python bench/profile_update.py                 # SmolLM2-135M-Instruct, issue 11's settings
    python bench/profile_update.py --variant fastppo-fast --model embedded

Runs ``trl_baseline.run_fastppo`` for two iterations and profiles the second iteration's steps 2-6
(``fastppo.train.ppo_iteration`` after its rollout: scoring, rewards, GAE, the PPO epochs and the metrics),
printing the top operators by self CPU time (on a GPU, by self CUDA time, then the kernels launched and the
GPU's busy time beside the wall time), then, on a CPU, where the profiled time goes by kind: the LM head's GEMMs (a product with a vocabulary-sized dimension), the other GEMMs (the trunk and the
value model), attention, the optimizer step, the other operators, and the time inside no operator (Python and
dispatch: the profiled wall time less the operators' self time).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import trl_baseline as B  # noqa: E402
from fastppo import trainer as T  # noqa: E402


GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
ATTENTION = ("aten::_scaled_dot_product", "aten::scaled_dot_product")
OPTIMIZER = ("aten::_fused_adamw", "aten::_foreach_", "Optimizer.step")


def kind_of(event, vocab: int) -> str:
    """The kind of a profiled operator: inside the chunked LM head's range (fastppo.kernels._lmhead.LM_HEAD_RANGE),
    or a product with a vocabulary-sized dimension (an LM head run whole), else by its name."""
    from fastppo.kernels._lmhead import LM_HEAD_RANGE

    name, parent, head = event.name, event.cpu_parent, False
    while parent is not None and not head:
        head, parent = parent.name == LM_HEAD_RANGE, parent.cpu_parent
    if head or (name in GEMMS and any(vocab in s for s in event.input_shapes or [] if s)):
        return "LM head (its GEMMs and the softmax statistics)"
    if name in GEMMS:
        return "other GEMMs (trunk, value model)"
    if name.startswith(ATTENTION):
        return "attention"
    if name.startswith(OPTIMIZER):
        return "optimizer step"
    return "other operators (norms, activations, copies, losses, ...)"


def kinds_report(events, wall: float, vocab: int, seconds: dict) -> str:
    """Self CPU time by kind of operator, beside the profiled wall time (steps 2-6 of one iteration)."""
    totals: dict[str, float] = {}
    for e in events:
        if e.name.startswith(("Optimizer.step", "autograd::engine", "fastppo.")) or e.device_type.name != "CPU":
            continue  # wrappers and ranges: their self time is Python, counted below
        k = kind_of(e, vocab)
        totals[k] = totals.get(k, 0.0) + e.self_cpu_time_total / 1e6
    totals["inside no operator (Python, dispatch)"] = max(0.0, wall - sum(totals.values()))
    lines = [f"steps 2-6 of one iteration, profiled: {wall:.2f} s wall (update {seconds.get('update', 0):.2f} s, "
             f"scoring {seconds.get('scoring', 0):.2f} s; the profiler's own overhead included)"]
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:<58} {v:7.2f} s  {100 * v / wall:5.1f}%")
    return "\n".join(lines)


def gpu_busy_report(events, wall: float, seconds: dict) -> str:
    """How many kernels the profiled steps launched and how long the GPU ran them, beside the wall time: a GPU
    busy for a small part of the wall is waiting on the host (launches, Python, syncs), not on arithmetic."""
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    return (f"steps 2-6 of one iteration, profiled: {wall:.2f} s wall (update {seconds.get('update', 0):.2f} s, "
            f"scoring {seconds.get('scoring', 0):.2f} s); {len(kernels)} GPU kernels and copies, {busy:.3f} s of "
            f"GPU time ({100 * busy / wall:.1f}% of the wall)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "embedded"), default="smollm2")
    p.add_argument("--variant", choices=tuple(B.FASTPPO_VARIANTS), default="fastppo")
    p.add_argument("--rows", type=int, default=30, help="operators to print")
    args = p.parse_args(argv)

    original, calls = T.ppo_iteration, []
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])

    def profiled(learner, config, sizes, collect, skip_masked=False):
        calls.append(None)
        if len(calls) != 2:  # the first iteration warms up
            return original(learner, config, sizes, collect, skip_masked)
        batch = collect()  # step 1 (generation) runs outside the profile
        with torch.profiler.profile(activities=activities, record_shapes=not cuda) as prof:
            t0 = time.perf_counter()
            out = original(learner, config, sizes, lambda: batch, skip_masked)
            wall = time.perf_counter() - t0
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                        row_limit=args.rows))
        if cuda:
            print(gpu_busy_report(prof.events(), wall, out.seconds))
        else:
            vocab = learner.actor_critic.policy.config.vocab_size
            print(kinds_report(prof.events(), wall, vocab, out.seconds))
        return out

    T.ppo_iteration = profiled  # the name the trainer calls
    base = B.SMOLLM2_CASE if args.model == "smollm2" else B.E2EConfig()
    cfg = dataclasses.replace(base, iterations=1, warmup_iterations=1)
    with tempfile.TemporaryDirectory() as out:
        B.run_fastppo(cfg, os.path.join(out, "run"), args.variant)


if __name__ == "__main__":
    main()
