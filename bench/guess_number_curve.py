"""A toy agentic task no single turn solves, trained with TRL 1.16's ``environment_factory=`` on SmolLM2-135M-Instruct
(CPU): the environment holds a hidden number from 1 to ``HIGHEST`` and its one tool, ``guess``, answers "higher",
"lower" or "correct". The reward is the environment's ``get_reward``: 1 once a guess was correct, 0.25 for a game
with well-formed guesses that never found it, 0 without one (the quarter teaches the call format first). One guess
finds the number a quarter of the time; the policy earns more only by reading the answer and guessing again.
Writes the reward and TRL's tool metrics per step as JSON and one plot (the figure in docs/migrating.md):

    python bench/guess_number_curve.py --out bench/guess_number_curve.json --plot bench/guess_number_curve.png

SmolLM2's own chat template renders no tools, so the tokenizer gets ``fastppo.tools.CHATML_TOOL_TEMPLATE``, a
short one in Qwen 2.5's tool format, as a user would give it; the prompt holds one played game as an example (SmolLM2-135M writes a well-formed call in about one
sample of ten without it, in about a third with it).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

HIGHEST = 4
RULES = (f"I am thinking of a number from 1 to {HIGHEST}. Find it with the guess tool: it answers higher, lower or "
         "correct.")
class GuessNumber:
    """One game: ``reset`` takes the row's hidden number; ``guess`` is the tool; ``get_reward`` scores the game."""

    def reset(self, target: int, **row) -> str:
        self.target, self.found, self.guesses = target, False, 0
        return ""

    def guess(self, n: int) -> str:
        """Guess the hidden number.

        Args:
            n: Your guess, a whole number from 1 to 4.
        """
        self.guesses += 1
        self.found = self.found or n == self.target
        return "correct" if n == self.target else ("higher" if self.target > n else "lower")

    def get_reward(self) -> float:
        return 1.0 if self.found else 0.25 if self.guesses else 0.0


def example_game() -> list[dict]:
    """One played game (hidden number 3) before the question: the call format shown by example."""
    def turn(n):
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "guess", "arguments": {"n": n}}}]}
    return [{"role": "user", "content": RULES},
            turn(2), {"role": "tool", "name": "guess", "content": "higher"},
            turn(3), {"role": "tool", "name": "guess", "content": "correct"},
            {"role": "assistant", "content": "Found it: 3."}]


def run(steps: int, output_dir: str, prompts_per_step: int, k: int, learning_rate: float, temperature: float = 1.0,
        epsilon_high: float | None = None) -> dict:
    import datasets
    from transformers import AutoTokenizer, TrainerCallback

    from e2e_common import smollm2_dir
    from fastppo import GRPOConfig, GRPOTrainer
    from fastppo.tools import CHATML_TOOL_TEMPLATE

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML_TOOL_TEMPLATE  # SmolLM2's own renders no tools
    rng = random.Random(0)
    rows = steps * prompts_per_step
    dataset = datasets.Dataset.from_dict({
        "prompt": [example_game() + [{"role": "user", "content": "New number. " + RULES}]] * rows,
        "target": [rng.randint(1, HIGHEST) for _ in range(rows)]})
    config = GRPOConfig(
        output_dir=output_dir, num_generations=k, per_device_train_batch_size=prompts_per_step * k,
        max_completion_length=96, max_tool_calling_iterations=3, temperature=temperature, learning_rate=learning_rate,
        epsilon_high=epsilon_high,
        beta=0.0, max_steps=steps, logging_steps=1, save_strategy="no", seed=0, bf16=False,
        gradient_checkpointing=False, disable_tqdm=True, report_to="none")
    history = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "reward" in logs:
                history.append({"step": state.global_step, "reward": logs["reward"],
                                "call_frequency": logs.get("tools/call_frequency"),
                                "failure_frequency": logs.get("tools/failure_frequency"),
                                "completion_length": logs.get("completions/mean_length")})
                print(history[-1], flush=True)

    start = time.perf_counter()
    trainer = GRPOTrainer(model=path, processing_class=tokenizer, args=config, train_dataset=dataset,
                          environment_factory=GuessNumber, callbacks=[Record()])
    trainer.train()
    return {"model": "SmolLM2-135M-Instruct", "steps": steps, "prompts_per_step": prompts_per_step,
            "num_generations": k, "learning_rate": learning_rate, "temperature": temperature,
            "epsilon_high": epsilon_high, "highest": HIGHEST,
            "seconds": time.perf_counter() - start, "history": history}


def plot(result: dict, path: str) -> None:
    from critic_free_curves import save_curves

    history = result["history"]
    steps = [h["step"] for h in history]
    save_curves(path, [("reward (get_reward: 1 found, 0.25 guessed)", steps, [h["reward"] for h in history], 1.0),
                       ("tools/call_frequency", steps, [h["call_frequency"] for h in history], 0.7),
                       ("tools/failure_frequency", steps, [h["failure_frequency"] for h in history], 0.7)],
                f"step ({result['prompts_per_step']} games × {result['num_generations']} completions)", None,
                f"guess a number from 1 to {result['highest']}, SmolLM2-135M-Instruct, CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts_per_step", type=int, default=1)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--epsilon_high", type=float, default=None, help="clip-higher (DAPO's remedy for the "
                        "entropy collapse that leaves a group's completions all alike); unset: epsilon")
    parser.add_argument("--out", default="guess_number_curve.json")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.steps, tmp, args.prompts_per_step, args.num_generations, args.learning_rate,
                     args.temperature, args.epsilon_high)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    first, last = result["history"][:5], result["history"][-5:]
    print(f"mean reward of the first 5 steps {sum(h['reward'] for h in first) / len(first):.2f}, of the last 5 "
          f"{sum(h['reward'] for h in last) / len(last):.2f} ({result['seconds']:.0f} s)")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
