"""Where fastppo's PPO update spends its time: torch.profiler's operator table for one update.

    python bench/profile_update.py                 # SmolLM2-135M-Instruct, issue 11's settings
    python bench/profile_update.py --variant fastppo-fast --model embedded

Runs ``trl_baseline.run_fastppo`` for two iterations and profiles the second iteration's steps 2-6
(``fastppo.train.ppo_iteration`` after its rollout: scoring, rewards, GAE, the PPO epochs and the metrics),
printing the top operators by self CPU time (on a GPU, by self CUDA time).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import trl_baseline as B  # noqa: E402
from fastppo import trainer as T  # noqa: E402


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
        with torch.profiler.profile(activities=activities) as prof:
            out = original(learner, config, sizes, lambda: batch, skip_masked)
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                        row_limit=args.rows))
        return out

    T.ppo_iteration = profiled  # the name the trainer calls
    base = B.SMOLLM2_CASE if args.model == "smollm2" else B.E2EConfig()
    cfg = dataclasses.replace(base, iterations=1, warmup_iterations=1)
    with tempfile.TemporaryDirectory() as out:
        B.run_fastppo(cfg, os.path.join(out, "run"), args.variant)


if __name__ == "__main__":
    main()
