"""An agentic toy whose reward rises only by reading the tool's answer, on SmolLM2-135M-Instruct (CPU), trained by
fastppo's ``GRPOTrainer`` and by TRL 1.16's (the same script, the import swapped) with ``environment_factory=``.

The environment holds a random 3-digit code per game (a dataset column, so each game's differs); its one tool,
``get_code``, returns it. The reward: 1 when the first number the model writes after the tool's answer is the code,
0.2 for a game with a well-formed call that did not copy it, 0 without a call (the 0.2 teaches the call format
first, as ``bench/guess_number_curve.py`` does). The code is not in the prompt, so without reading the tool's answer
a game earns 0.2 at most. Writes the reward and TRL's tool metrics per step as JSON, and with ``--plot`` one figure
of both trainers' runs (the figure in docs/migrating.md):

    python bench/lookup_code_curve.py --trainer fastppo --out bench/lookup_code_fastppo.json
    python bench/lookup_code_curve.py --trainer trl --out bench/lookup_code_trl.json
    python bench/lookup_code_curve.py --plot bench/lookup_code_curve.png \\
        --runs bench/lookup_code_fastppo.json bench/lookup_code_trl.json

``--trainer trl`` needs TRL 1.x in the environment (``bench/trl_envs.py``). SmolLM2's own chat template renders no
tools, so the tokenizer gets ``fastppo.tools.CHATML_TOOL_TEMPLATE`` (Qwen 2.5's tool format); TRL's side also needs
a ``response_template`` to parse the calls (TRL's Qwen 3 one, which reads the same ``<tool_call>`` blocks; TRL's
``add_response_schema`` knows only the templates it ships). The prompt holds one played game as an example.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

RULES = "Read the secret code with get_code, then tell me the code."
EXAMPLE_CODES = (730, 215)  # the example games' codes; no game draws them, so copying an example earns nothing
NUMBER = re.compile(r"\d+")
SAMPLES: list = []  # the last batch's (code, text after the tool's answer), for the JSON


class CodeLookup:
    """One game: ``reset`` takes the row's code; ``get_code`` is the tool."""

    def reset(self, code: int, **row) -> str:
        self.code, self.calls = code, 0
        return ""

    def get_code(self) -> str:
        """Read the secret code."""
        self.calls += 1
        return str(self.code)


def answer_after_tool(completion) -> str:
    """The assistant's text after the first tool answer ('' when there is none): only there can the code be read."""
    if not isinstance(completion, list):
        return ""
    seen_tool, text = False, []
    for message in completion:
        if message.get("role") == "tool":
            seen_tool = True
        elif seen_tool and message.get("role") == "assistant":
            text.append(message.get("content") or "")
    return " ".join(text)


def code_reward(completions, environments, **kwargs) -> list[float]:
    """1 when the first number written after the tool's answer is the game's code, 0.2 for a call that did not copy
    it, 0 without a call."""
    rewards = []
    SAMPLES[:] = []
    for completion, env in zip(completions, environments):
        text = answer_after_tool(completion)
        SAMPLES.append((env.code, env.calls, text))
        numbers = NUMBER.findall(text)
        rewards.append(1.0 if env.calls and numbers and int(numbers[0]) == env.code else 0.2 if env.calls else 0.0)
    return rewards


def example_games() -> list[dict]:
    """Two played games before the question: the call format and the copy shown by example. With one, SmolLM2-135M
    copies the example's final answer instead of calling (no call in 12 samples); with two, 3 to 4 of its 12
    samples call, and most of the others write a ``<tool_response>`` block themselves, a made-up code."""
    def game(code):
        return [{"role": "user", "content": RULES},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "get_code", "arguments": {}}}]},
                {"role": "tool", "name": "get_code", "content": str(code)},
                {"role": "assistant", "content": f"The code is {code}."}]
    return game(EXAMPLE_CODES[0]) + game(EXAMPLE_CODES[1])


def run(trainer_name: str, steps: int, output_dir: str, prompts_per_step: int, k: int, learning_rate: float,
        temperature: float, max_completion_length: int) -> dict:
    import datasets
    from transformers import AutoTokenizer, TrainerCallback

    from e2e_common import smollm2_dir
    from fastppo.tools import CHATML_TOOL_TEMPLATE

    if trainer_name == "trl":
        import trl
        from trl import GRPOConfig, GRPOTrainer
        from trl.chat_template_utils import qwen3_template
        version = f"TRL {trl.__version__}"
    else:
        import fastppo
        from fastppo import GRPOConfig, GRPOTrainer
        version = f"fastppo {getattr(fastppo, '__version__', '')}".strip()

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML_TOOL_TEMPLATE  # SmolLM2's own renders no tools
    if trainer_name == "trl":
        tokenizer.response_template = qwen3_template  # TRL parses calls only through one
    rng = random.Random(0)
    rows = steps * prompts_per_step
    codes = [c for c in rng.sample(range(100, 1000), rows + 2) if c not in EXAMPLE_CODES][:rows]
    dataset = datasets.Dataset.from_dict({
        "prompt": [example_games() + [{"role": "user", "content": RULES}]] * rows, "code": codes})
    config = GRPOConfig(
        output_dir=output_dir, num_generations=k, per_device_train_batch_size=prompts_per_step * k,
        max_completion_length=max_completion_length, max_tool_calling_iterations=2, temperature=temperature,
        learning_rate=learning_rate, beta=0.0, max_steps=steps, logging_steps=1, save_strategy="no", seed=0,
        bf16=False, gradient_checkpointing=False, disable_tqdm=True, report_to="none", shuffle_dataset=False)
    history = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "reward" in logs:
                called = [calls > 0 for _, calls, _ in SAMPLES]
                copied = [bool(calls) and NUMBER.findall(text)[:1] == [str(code)] for code, calls, text in SAMPLES]
                history.append({"step": state.global_step, "reward": logs["reward"],
                                "called": sum(called) / len(called), "copied": sum(copied) / len(copied),
                                "reward_std": logs.get("reward_std"),
                                "call_frequency": logs.get("tools/call_frequency"),
                                "failure_frequency": logs.get("tools/failure_frequency"),
                                "entropy": logs.get("entropy"),
                                "completion_length": logs.get("completions/mean_length"),
                                "seconds": time.perf_counter() - start, "samples": list(SAMPLES)})
                print(history[-1], flush=True)

    trainer = GRPOTrainer(model=path, processing_class=tokenizer, args=config, train_dataset=dataset,
                          reward_funcs=[code_reward], environment_factory=CodeLookup, callbacks=[Record()])
    start = time.perf_counter()
    trainer.train()
    return {"trainer": version, "model": "SmolLM2-135M-Instruct", "steps": steps,
            "prompts_per_step": prompts_per_step, "num_generations": k, "learning_rate": learning_rate,
            "temperature": temperature, "max_completion_length": max_completion_length,
            "seconds": time.perf_counter() - start, "history": history}


def summary(result: dict) -> str:
    history = result["history"]
    later = history[1:]
    mean = lambda key: sum(h[key] for h in later) / len(later)  # noqa: E731
    return (f"{result['trainer']}: reward at step 1 {history[0]['reward']:.2f}, over steps 2-{history[-1]['step']} "
            f"{mean('reward'):.2f} (tools/call_frequency {history[0]['call_frequency']:.2f}, then "
            f"{mean('call_frequency'):.2f}; episodes that wrote the code {mean('copied'):.2f}); "
            f"{result['seconds'] / len(history):.0f} s per step{' (' + result['stopped'] + ')' if 'stopped' in result else ''}")


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for result, color in zip(results, ["tab:blue", "tab:orange"]):
        steps = [h["step"] for h in result["history"]]
        for ax, key in zip(axes, ["reward", "call_frequency", "entropy"]):
            label = result["trainer"] + (f" (stopped at step {steps[-1]})" if "stopped" in result else "")
            ax.plot(steps, [h[key] for h in result["history"]], color=color, marker=".", label=label)
    for ax, title in zip(axes, ["reward (1 code copied, 0.2 call only)", "tools/call_frequency", "entropy"]):
        ax.set_title(title)
        ax.set_xlabel(f"step ({results[0]['prompts_per_step']} game × {results[0]['num_generations']} completions)")
        ax.grid(alpha=0.3)
    axes[0].axhline(0.2, color="grey", ls=":", lw=1)
    axes[0].legend()
    fig.suptitle("look up a random code and copy it, SmolLM2-135M-Instruct, 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=["fastppo", "trl"], default="fastppo")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts_per_step", type=int, default=1)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max_completion_length", type=int, default=64, help="the episode: the call (26 tokens), the tool's answer in the template (25) and the reply (9) need 60; a round that would not fit is dropped")
    parser.add_argument("--out", default=None, help="JSON of the run")
    parser.add_argument("--plot", default=None, help="a figure of the runs in --runs")
    parser.add_argument("--runs", nargs="*", default=[], help="JSON files of earlier runs to plot")
    args = parser.parse_args()
    if args.plot:
        results = []
        for name in args.runs:
            with open(name) as f:
                results.append(json.load(f))
        for result in results:
            print(summary(result))
        plot(results, args.plot)
        return
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.trainer, args.steps, tmp, args.prompts_per_step, args.num_generations, args.learning_rate,
                     args.temperature, args.max_completion_length)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(summary(result))


if __name__ == "__main__":
    main()
