"""The four advantage estimators on SmolLM2-135M-Instruct (CPU), 20 iterations each, with a rule reward: the mean
score per iteration of each, as a JSON file and one plot (the figure in docs/usage.md).

    python bench/critic_free_curves.py --out bench/critic_free_curves.json --plot bench/critic_free_curves.png

Each estimator at its source's defaults (docs/usage.md, "Critic-free estimators"), otherwise the same settings: 8
completions per iteration (gae: 8 prompts × 1; rloo, grpo, reinforce_plus_plus: 2 prompts × 4), chat prompts,
stop on eos, response_length 16, T 1.0, lr 2e-5, 1 PPO epoch, no gradient checkpointing, seed 0. The reward is
``brevity`` below (minus the words of the completion): SmolLM2 runs on past 16 tokens on most of these prompts,
so the reward rises only if the policy learns to answer in fewer words and stop.

TRL GRPO's policy losses, each on grpo (``--loss_types``; ``--num_ppo_epochs 2`` so that the ratios move off 1,
where every surrogate has the same gradient; cispo at ScaleRL's ε_max 5.0, the others at TRL's defaults):

    python bench/critic_free_curves.py --estimators --loss_types dapo cispo sapo vespo --num_ppo_epochs 2 \
        --out bench/loss_type_curves.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

ESTIMATORS = ("gae", "rloo", "grpo", "reinforce_plus_plus")
BATCH, GROUP = 8, 4


def brevity(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """Minus the number of words of each completion: a rule reward SmolLM2 can move within a few iterations."""
    return [-float(len(c.split())) for c in completions]


LOSS_TYPES = ("bnpo", "dapo", "grpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo")
LOSS_TYPE_SETTINGS = {"cispo": {"epsilon_high": 5.0}}  # ScaleRL's ε_max (TRL's default, ε, caps every ratio)


def run(estimator: str, iterations: int, output_dir: str, loss_type: str | None = None, epochs: int = 1) -> dict:
    import datasets
    from transformers import AutoTokenizer, TrainerCallback

    from e2e_common import CHAT_PROMPTS, smollm2_dir
    from fastppo import PPOConfig, PPOTrainer

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    k = 1 if estimator == "gae" else GROUP
    dataset = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in CHAT_PROMPTS]})
    config = PPOConfig(
        output_dir=output_dir, advantage_estimator=estimator, num_generations=k, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1, max_steps=iterations, response_length=16, temperature=1.0,
        learning_rate=2e-5, num_ppo_epochs=epochs, stop_token="eos", seed=0, logging_steps=1, save_strategy="no",
        num_sample_generations=0, gradient_checkpointing=False, disable_tqdm=True, report_to=[],
        local_rollout_forward_batch_size=BATCH,
        **({} if loss_type is None else {"loss_type": loss_type, **LOSS_TYPE_SETTINGS.get(loss_type, {})}),
    )
    history = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            history.append({"iteration": state.global_step, "score": logs["objective/scores"]})

    start = time.perf_counter()
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=path, reward_model=brevity,
                         train_dataset=dataset, callbacks=[Record()])
    trainer.train()
    label = estimator if loss_type is None else f"{estimator}/{loss_type}"
    return {"estimator": label, "loss_type": config.loss_type, "num_ppo_epochs": epochs, "num_generations": k,
            "seconds": time.perf_counter() - start,
            "value_model": trainer.value_model is not None, "reference": trainer.ref_model is not None,
            "history": history}


def save_curves(path: str, lines: list[tuple[str, list, list, float]], xlabel: str, ylabel: str | None,
                title: str) -> None:
    """One plot of ``lines`` (label, x, y, alpha) as a PNG: the bench's curve figures share this look."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, xs, ys, alpha in lines:
        ax.plot(xs, ys, label=label, alpha=alpha)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot(results: list[dict], path: str) -> None:
    save_curves(path, [(r["estimator"], [h["iteration"] for h in r["history"]], [h["score"] for h in r["history"]], 1.0)
                       for r in results],
                f"iteration ({BATCH} completions each)", "mean reward (− words per completion)",
                "SmolLM2-135M-Instruct, CPU: " + ", ".join(r["estimator"] for r in results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--estimators", nargs="*", default=list(ESTIMATORS), choices=ESTIMATORS)
    parser.add_argument("--loss_types", nargs="*", default=[], choices=LOSS_TYPES,
                        help="also grpo with each of these loss_types")
    parser.add_argument("--num_ppo_epochs", type=int, default=1)
    parser.add_argument("--out", default="critic_free_curves.json")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    results = []
    runs = [(e, None) for e in args.estimators] + [("grpo", t) for t in args.loss_types]
    for estimator, loss_type in runs:
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run(estimator, args.iterations, tmp, loss_type, args.num_ppo_epochs))
        first, last = results[-1]["history"][:3], results[-1]["history"][-3:]
        print(f"{results[-1]['estimator']}: mean score of the first 3 iterations {sum(h['score'] for h in first) / 3:.2f}, "
              f"of the last 3 {sum(h['score'] for h in last) / 3:.2f} ({results[-1]['seconds']:.0f} s)", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
