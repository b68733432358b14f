"""DAPO's dynamic sampling on the task of ``bench/same_run_curves.py`` (SmolLM2-135M-Instruct, single-digit addition
in a chat prompt, reward 1 when the completion's last number is the sum; its settings): fastppo's GRPOTrainer with
``dynamic_sampling`` off and on, seeds 0..S-1 per side, the runs interleaved, each in its own process.

    python bench/dynamic_sampling_curves.py --steps 60 --seeds 3 --out RUNS.json --plot CURVES.png
    python bench/dynamic_sampling_curves.py --model DIR --steps 3 --seeds 1   # another model (with a chat template)
    python bench/dynamic_sampling_curves.py --off-from SAME_RUN.json ...  # "off": same_run_curves' fastppo runs

The "off" runs are fastppo's runs of ``same_run_curves.py`` (the same settings, seeds and task; dynamic sampling off
is bitwise the run it was before the setting existed), so ``--off-from`` takes them from its ``--out`` file in place
of running them again.

Each optimizer step (one generation batch) records the reward of every completion sampled (off: ``reward``; on:
``dynamic_sampling/sampled_reward_mean``, the dropped groups' completions too, so that both sides measure the
policy alike, where ``reward`` would be the kept groups'), the prompts drawn so far, the completion tokens sampled
so far and the seconds since ``train()`` began (a callback's clock at each log row). ``--plot`` draws the reward
against each of the three, each side's seed mean with its range; the summary prints, for each, the mean reward of
the last 10 rows within the smallest budget every run reached, per side: whether dynamic sampling learns faster per
prompt, per sampled token and per second on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

from same_run_curves import SETTINGS, addition_prompts, correct_sum, train_clock  # noqa: E402  (the same task and sizes)

SIDES = {"off": {}, "on": {"dynamic_sampling": True}}
AXES = (("prompts", "prompts drawn"), ("tokens", "completion tokens sampled"), ("seconds", "seconds of train()"))
WINDOW = 10  # rows averaged at a budget


def child(side: str, seed: int, steps: int, out: str, model: str | None = None) -> None:
    """One run (in its own process) with dynamic sampling ``side`` ("off" or "on"), of SmolLM2 or ``model``."""
    from datasets import Dataset

    from e2e_common import smollm2_dir
    from fastppo import GRPOConfig, GRPOTrainer

    prompts, answers = addition_prompts()
    clock = train_clock()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=os.path.join(tmp, "out"), max_steps=steps, seed=seed, **SETTINGS, **SIDES[side])
        trainer = GRPOTrainer(model=model or smollm2_dir(), reward_funcs=correct_sum, args=args, callbacks=[clock],
                              train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}))
        trainer.train()
    completions = args.per_device_train_batch_size * args.steps_per_generation  # one process
    prompts_per_batch = completions // args.num_generations
    rows, tokens = [], 0.0
    for row in trainer.state.log_history:
        if "loss" not in row or "completions/mean_length" not in row:
            continue
        trained = row["completions/mean_length"] * completions
        tokens += trained * row.get("dynamic_sampling/sampled_per_trained_token", 1.0)
        rows.append({"step": row["step"], "seconds": clock.seconds.get(row["step"]), "tokens": tokens,
                     "prompts": row.get("dynamic_sampling/prompts_consumed", row["step"] * prompts_per_batch),
                     "reward": row.get("dynamic_sampling/sampled_reward_mean", row["reward"]),
                     "trained_reward": row["reward"], "rounds": row.get("dynamic_sampling/generation_rounds", 1.0),
                     "frac_reward_zero_std": row.get("frac_reward_zero_std")})
    with open(out, "w") as f:
        json.dump({"side": side, "seed": seed, "steps": steps, "rows": rows}, f)


def off_from_same_run(record: dict) -> dict:
    """A fastppo run of ``same_run_curves.py`` as an "off" run: every completion sampled is trained on, so its
    prompts and tokens follow from the step and the mean completion length."""
    completions = SETTINGS["per_device_train_batch_size"]  # steps_per_generation = 1, one process
    rows, tokens = [], 0.0
    for row in record["rows"]:
        tokens += row["completions/mean_length"] * completions
        rows.append({"step": row["step"], "seconds": row["seconds"], "tokens": tokens, "reward": row["reward"],
                     "prompts": row["step"] * completions // SETTINGS["num_generations"],
                     "trained_reward": row["reward"], "rounds": 1.0, "frac_reward_zero_std": None})
    return {"side": "off", "seed": record["seed"], "steps": record["steps"], "rows": rows}


def run(side: str, seed: int, steps: int, model: str | None = None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", side, str(seed), str(steps), out,
                           *([model] if model else [])], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{side} seed {seed} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def reward_at(run: dict, axis: str, budget: float) -> float:
    """The mean reward of the last ``WINDOW`` rows of ``run`` within ``budget`` on ``axis``."""
    within = [row["reward"] for row in run["rows"] if row[axis] <= budget][-WINDOW:]
    return sum(within) / len(within) if within else float("nan")


def summary(runs: list[dict]) -> list[str]:
    lines = [f"{r['side']:3s} seed {r['seed']}: {len(r['rows'])} steps, {r['rows'][-1]['prompts']:.0f} prompts, "
             f"{r['rows'][-1]['tokens']:.0f} tokens sampled, {r['rows'][-1]['seconds']:.0f} s; reward of the last "
             f"{WINDOW} steps {sum(row['reward'] for row in r['rows'][-WINDOW:]) / min(WINDOW, len(r['rows'])):.3f}; "
             f"{sum(row['rounds'] for row in r['rows']) / len(r['rows']):.2f} rounds per step" for r in runs]
    sides = sorted({r["side"] for r in runs})
    for axis, label in AXES:
        budget = min(r["rows"][-1][axis] for r in runs)  # the smallest budget every run reached
        means = {side: [reward_at(r, axis, budget) for r in runs if r["side"] == side] for side in sides}
        lines.append(f"at {budget:.0f} {label}: " + "; ".join(
            f"{side} {sum(v) / len(v):.3f} (seeds {', '.join(f'{x:.3f}' for x in v)})" for side, v in means.items()))
    return lines


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(AXES), figsize=(15, 3.8))
    for ax, (axis, label) in zip(axes, AXES):
        for side, color in (("off", "tab:orange"), ("on", "tab:blue")):
            mine = [r for r in runs if r["side"] == side]
            if not mine:
                continue
            # each seed's own x values differ: the seeds' mean and range on the first seed's x, interpolated
            grid = np.array([row[axis] for row in mine[0]["rows"]], dtype=float)
            series = np.array([np.interp(grid, [row[axis] for row in r["rows"]], [row["reward"] for row in r["rows"]])
                               for r in mine])
            ax.plot(grid, series.mean(0), color=color, label=f"dynamic sampling {side} ({len(mine)} seeds)")
            ax.fill_between(grid, series.min(0), series.max(0), color=color, alpha=0.2)
        ax.set_xlabel(label)
        ax.set_ylabel("reward of every sampled completion")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], *sys.argv[6:7])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--model", default=None, help="a model directory in place of SmolLM2-135M-Instruct")
    p.add_argument("--off-from", default=None,
                   help="same_run_curves.py's --out file: its fastppo runs are the \"off\" runs (not run again)")
    a = p.parse_args()
    runs, reused = [], {}
    if a.off_from:
        with open(a.off_from) as f:
            reused = {r["seed"]: off_from_same_run(r) for r in json.load(f)["runs"]
                      if r["side"] == "fastppo" and r["steps"] == a.steps}
    for seed in range(a.seeds):
        for side in a.sides:  # interleaved: a slow stretch of the machine falls on both sides
            runs.append(reused[seed] if side == "off" and seed in reused else run(side, seed, a.steps, a.model))
            print(summary(runs[-1:])[0], flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump({"settings": SETTINGS, "sides": SIDES, "runs": runs}, f)
    print("\n".join(summary(runs)))
    if a.plot:
        plot(runs, a.plot)


if __name__ == "__main__":
    main()
