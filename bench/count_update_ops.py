"""How many aten operators one PPO update dispatches, fastppo beside TRL 0.26.2, counted per operator.

    python bench/count_update_ops.py                     # SmolLM2-135M-Instruct, the GPU lease's step-3 settings
    python bench/count_update_ops.py --model embedded    # the tiny Llama

On a GPU a 135M-parameter update is host-bound: every operator is a kernel launch, so the number of operators
is the cost to compare. This counts them on any machine: each trainer runs one iteration (in a fresh process,
under a ``TorchDispatchMode`` that counts every aten call, the backward's included), and the calls made during
the update are kept: fastppo's ``fastppo.train.ppo_update``; TRL's from its first gradient-enabled policy
forward (``trl.experimental.ppo.ppo_trainer.forward``) to the next rollout (its epoch loop and the statistics
after it). View and metadata operators, which launch no kernel, are counted apart.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

# operators that only make a new view or tensor header (no kernel on a GPU)
VIEWS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "reshape", "detach", "alias", "as_strided", "t", "transpose",
    "permute", "unsqueeze", "squeeze", "expand", "slice", "select", "split", "split_with_sizes", "unbind",
    "unflatten", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "_record_function_enter_new", "_record_function_exit", "contiguous"})
SYNCS = ("_local_scalar_dense", "nonzero", "masked_select")  # operators that wait for the device


def count_child(impl: str, model: str) -> dict[str, int]:
    """One iteration of ``impl`` in this process; the update's operator counts."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastppo.kernels import custom_ops

    import trl_baseline as B
    from e2e_common import E2EConfig

    phase = ["rollout"]
    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            body = custom_ops.body_of(func)  # a fastppo custom op: count the aten operators inside it
            if body is not None:
                with self:
                    return body(*args, **(kwargs or {}))
            if phase[0] == "update":
                counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    if impl == "trl":
        import trl.experimental.ppo.ppo_trainer as trl_ppo

        forward, generation = trl_ppo.forward, trl_ppo.batch_generation

        def counted_forward(*a, **k):
            if torch.is_grad_enabled():  # the update's policy forward (the rollout's run under no_grad)
                phase[0] = "update"
            return forward(*a, **k)

        def counted_generation(*a, **k):
            phase[0] = "rollout"
            return generation(*a, **k)

        trl_ppo.forward, trl_ppo.batch_generation = counted_forward, counted_generation
    else:
        import fastppo.train as fastppo_train

        update = fastppo_train.ppo_update

        def counted_update(*a, **k):
            phase[0] = "update"
            try:
                return update(*a, **k)
            finally:
                phase[0] = "rollout"

        fastppo_train.ppo_update = counted_update
    cfg = E2EConfig(model=model, per_device_train_batch_size=16, gradient_accumulation_steps=1, num_ppo_epochs=4,
                    learning_rate=3e-6, temperature=0.7, stop_on_eos=model == "smollm2",
                    missing_eos_penalty=1.0 if model == "smollm2" else None, iterations=1, warmup_iterations=0,
                    threads=0, local_rollout_forward_batch_size=16, response_length=53)
    with tempfile.TemporaryDirectory() as out, Count():
        B.RUNNERS[impl](cfg, out)
    return dict(counts)


def report(by_impl: dict[str, dict[str, int]], rows: int) -> str:
    fast, trl = by_impl["fastppo"], by_impl["trl"]
    kernels = {k: sum(v for op, v in c.items() if op not in VIEWS) for k, c in by_impl.items()}
    views = {k: sum(v for op, v in c.items() if op in VIEWS) for k, c in by_impl.items()}
    syncs = {k: sum(c.get(op, 0) for op in SYNCS) for k, c in by_impl.items()}
    lines = [f"operators in one update: fastppo {kernels['fastppo']:,} (+ {views['fastppo']:,} views), TRL "
             f"{kernels['trl']:,} (+ {views['trl']:,} views), fastppo / TRL {kernels['fastppo'] / kernels['trl']:.2f}; "
             f"device waits ({', '.join(SYNCS)}): fastppo {syncs['fastppo']}, TRL {syncs['trl']}",
             "", "| operator | fastppo | TRL |", "| --- | ---: | ---: |"]
    ops = sorted((op for op in set(fast) | set(trl) if op not in VIEWS),
                 key=lambda op: -abs(fast.get(op, 0) - trl.get(op, 0)))
    lines += [f"| {op} | {fast.get(op, 0):,} | {trl.get(op, 0):,} |" for op in ops[:rows]]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "embedded"), default="smollm2")
    p.add_argument("--rows", type=int, default=20, help="operators shown, largest difference first")
    p.add_argument("--child", choices=("fastppo", "trl"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("COUNTS " + json.dumps(count_child(args.child, args.model)), flush=True)
        return
    by_impl = {}
    for impl in ("fastppo", "trl"):  # each in a fresh process: the two patch different modules
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", impl, "--model", args.model],
                              capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("COUNTS ")]
        if proc.returncode or not lines:
            raise SystemExit(f"{impl} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        by_impl[impl] = json.loads(lines[-1][len("COUNTS "):])
    print(report(by_impl, args.rows))


if __name__ == "__main__":
    main()
