"""The same GRPO run on TRL 1.16 and fastppo, curve for curve: SmolLM2-135M-Instruct (the real weights) on a task
generated here (single-digit addition, a chat prompt, reward 1 when the last number of the completion is the sum:
the model restates the question, "7 + 1 = 8", about 3 times in 10 at the start), TRL GRPO's defaults except the
sizes, learning rate, step count and β (0.04, for a KL curve: TRL logs none at its default 0), each trainer sampling for itself, seeds
0..S-1 per side, the runs interleaved, each in its own process (TRL's with TRL 1.16's directory first: ``trl_envs``).

    python bench/same_run_curves.py --steps 60 --seeds 3 --out RUNS.json --plot CURVES.png

``--out`` is rewritten after every run, and a run it already holds (side, seed, steps) is not run again, so a long
measurement can go in pieces (``--seeds``/``--sides`` choose them).

Records each run's ``log_history`` rows (reward, kl, entropy, completions/mean_length per optimizer step), its
``train()`` seconds and peak RSS; ``--plot`` draws each side's mean with its seeds' range, and the summary prints
the last 10 steps' mean reward of each run and whether fastppo's mean lies within TRL's seed range.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
from trl_envs import trl1_dir  # noqa: E402

SETTINGS = dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=16, learning_rate=1e-5,
                beta=0.04, logging_steps=1, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
                dataloader_num_workers=0, use_cpu=True)
CURVES = ("reward", "kl", "entropy", "completions/mean_length")


def addition_prompts(n: int = 200, seed: int = 1234) -> tuple[list, list]:
    draw = random.Random(seed)
    pairs = [(draw.randrange(10), draw.randrange(10)) for _ in range(n)]
    prompts = [[{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}] for a, b in pairs]
    return prompts, [str(a + b) for a, b in pairs]


def correct_sum(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's last number is the sum, else 0.0."""
    out = []
    for completion, truth in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        found = re.findall(r"-?\d+", text)
        out.append(1.0 if found and found[-1] == truth else 0.0)
    return out


def train_clock():
    """A callback (built where transformers is imported) that notes the seconds since ``train()`` began at each
    optimizer step's log row: ``.seconds[step]``."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.start, self.seconds = None, {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.seconds[state.global_step] = time.perf_counter() - self.start

    return Clock()


def child(side: str, seed: int, steps: int, out: str) -> None:
    """One run (in its own process): ``side`` is "trl" or "fastppo"."""
    from datasets import Dataset

    from e2e_common import smollm2_dir

    if side == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from fastppo import GRPOConfig, GRPOTrainer
    prompts, answers = addition_prompts()
    clock = train_clock()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=os.path.join(tmp, "out"), max_steps=steps, seed=seed, **SETTINGS)
        trainer = GRPOTrainer(model=smollm2_dir(), reward_funcs=correct_sum, args=args, callbacks=[clock],
                              train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}))
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    rows = [{**{k: row.get(k) for k in (*CURVES, "step")}, "seconds": clock.seconds.get(row["step"])}
            for row in trainer.state.log_history if "loss" in row]
    record = {"side": side, "seed": seed, "steps": steps, "train_seconds": seconds, "rows": rows,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    with open(out, "w") as f:
        json.dump(record, f)


def run(side: str, seed: int, steps: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        ([trl1_dir()] if side == "trl" else []) + [REPO]),
        TRL_EXPERIMENTAL_SILENCE="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", side, str(seed), str(steps), out],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{side} seed {seed} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def summary(runs: list[dict]) -> list[str]:
    lines, last = [], {}
    for r in runs:
        rewards = [row["reward"] for row in r["rows"]][-10:]
        last.setdefault(r["side"], []).append(sum(rewards) / len(rewards))
        first = [row["reward"] for row in r["rows"]][:10]
        lines.append(f"{r['side']:8s} seed {r['seed']}: reward first 10 steps {sum(first) / len(first):.3f}, last 10 "
                     f"{last[r['side']][-1]:.3f}; {r['train_seconds'] / r['steps']:.2f} s/step; peak RSS "
                     f"{r['peak_rss_mib']:.0f} MiB")
    if "trl" in last and "fastppo" in last:
        mean = sum(last["fastppo"]) / len(last["fastppo"])
        low, high = min(last["trl"]), max(last["trl"])
        lines.append(f"fastppo's last-10 mean reward {mean:.3f}; TRL's seeds' range [{low:.3f}, {high:.3f}]: "
                     + ("within" if low <= mean <= high else "OUTSIDE"))
    return lines


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(16, 3.6))
    for ax, key in zip(axes, CURVES):
        for side, color in (("trl", "tab:orange"), ("fastppo", "tab:blue")):
            mine = [r for r in runs if r["side"] == side]
            if not mine:
                continue
            steps = [row["step"] for row in mine[0]["rows"]]
            series = [[row[key] if row[key] is not None else float("nan") for row in r["rows"]] for r in mine]
            mean = [sum(v) / len(v) for v in zip(*series)]
            ax.plot(steps, mean, color=color, label=f"{'TRL 1.16' if side == 'trl' else 'fastppo'} ({len(mine)} seeds)")
            ax.fill_between(steps, [min(v) for v in zip(*series)], [max(v) for v in zip(*series)], color=color,
                            alpha=0.2)
        ax.set_title(key)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sides", nargs="+", default=["trl", "fastppo"])
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--first-seed", type=int, default=0)
    a = p.parse_args()
    runs = []
    if a.out and os.path.exists(a.out):
        with open(a.out) as f:
            runs = json.load(f)["runs"]
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for side in a.sides:  # interleaved: a slow stretch of the machine falls on both sides
            if any((r["side"], r["seed"], r["steps"]) == (side, seed, a.steps) for r in runs):
                continue
            runs.append(run(side, seed, a.steps))
            print(summary(runs[-1:])[0], flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump({"settings": SETTINGS, "runs": runs}, f)
    print("\n".join(summary(runs)))
    if a.plot:
        plot(runs, a.plot)


if __name__ == "__main__":
    main()
