"""The four advantage estimators on SmolLM2-135M-Instruct (CPU), 20 iterations each, with a rule reward: the mean
score per iteration of each, as a JSON file and one plot (the figure in docs/usage.md).

    python bench/critic_free_curves.py --out bench/critic_free_curves.json --plot bench/critic_free_curves.png

Each estimator at its source's defaults (docs/usage.md, "Critic-free estimators"), otherwise the same settings: 8
completions per iteration (gae: 8 prompts × 1; rloo, grpo, reinforce_plus_plus: 2 prompts × 4), chat prompts,
stop on eos, response_length 16, T 1.0, lr 2e-5, 1 PPO epoch, no gradient checkpointing, seed 0. The reward is
``brevity`` below (minus the words of the completion): SmolLM2 runs on past 16 tokens on most of these prompts,
so the reward rises only if the policy learns to answer in fewer words and stop.
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


def run(estimator: str, iterations: int, output_dir: str) -> dict:
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
        learning_rate=2e-5, num_ppo_epochs=1, stop_token="eos", seed=0, logging_steps=1, save_strategy="no",
        num_sample_generations=0, gradient_checkpointing=False, disable_tqdm=True, report_to=[],
        local_rollout_forward_batch_size=BATCH,
    )
    history = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            history.append({"iteration": state.global_step, "score": logs["objective/scores"]})

    start = time.perf_counter()
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=path, reward_model=brevity,
                         train_dataset=dataset, callbacks=[Record()])
    trainer.train()
    return {"estimator": estimator, "num_generations": k, "seconds": time.perf_counter() - start,
            "value_model": trainer.value_model is not None, "reference": trainer.ref_model is not None,
            "history": history}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for r in results:
        ax.plot([h["iteration"] for h in r["history"]], [h["score"] for h in r["history"]], label=r["estimator"])
    ax.set_xlabel(f"iteration ({BATCH} completions each)")
    ax.set_ylabel("mean reward (− words per completion)")
    ax.set_title("SmolLM2-135M-Instruct, CPU: the four advantage estimators")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    parser.add_argument("--out", default="critic_free_curves.json")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    results = []
    for estimator in args.estimators:
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run(estimator, args.iterations, tmp))
        first, last = results[-1]["history"][:3], results[-1]["history"][-3:]
        print(f"{estimator}: mean score of the first 3 iterations {sum(h['score'] for h in first) / 3:.2f}, "
              f"of the last 3 {sum(h['score'] for h in last) / 3:.2f} ({results[-1]['seconds']:.0f} s)", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
