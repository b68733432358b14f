"""Time per tool-calling episode, fastppo beside TRL 1.16's GRPOTrainer, on the same scripted turns (CPU).

    PYTHONPATH=.:tests python bench/tool_episode_time.py [--rows 32] [--repeats 3] [--sleep 0.02]

Every row plays the same episode: two rounds of calls, each turn one call of ``lookup`` (a tool that waits
``--sleep`` seconds, as a call to a service does, sync or ``async``) and then an answer. The model's turns are
scripted (``generate`` replaced on TRL's side, the sampler on fastppo's, as ``tests/trl1_tool_episodes.py`` does),
so what is timed is everything else of a batch's episodes: parsing each turn, running the calls, the tool
messages' template tokens, the bookkeeping, and the rewards (TRL's ``_generate_and_score_completions``, fastppo's
``rollout()``). The two sides run alternately, ``--repeats`` times each, in one process; the median is reported,
with the process's peak RSS after each side's first run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

END = "<|im_end|>"
SLEEP = {"seconds": 0.02}


def lookup(key: str) -> str:
    """Looks a key up in a slow service.

    Args:
        key: The key.
    """
    time.sleep(SLEEP["seconds"])
    return key.upper()


async def lookup_async(key: str) -> str:
    """Looks a key up in a slow service.

    Args:
        key: The key.
    """
    await asyncio.sleep(SLEEP["seconds"])
    return key.upper()


def turns_of(rows: int, name: str) -> list[list[str]]:
    from tool_script import call

    return [[call(name, key="alpha") + END] * rows, [call(name, key="beta") + END] * rows, ["ALPHA BETA." + END] * rows]


def settings(out_dir: str, rows: int) -> dict:
    return dict(output_dir=out_dir, num_generations=rows, per_device_train_batch_size=rows, max_completion_length=600,
                bf16=False, report_to="none", shuffle_dataset=False, use_cpu=True)


def trl_side(tok, model, rows: int, tool, out_dir: str):
    import copy

    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    tok = copy.deepcopy(tok)
    tok.response_template = qwen3_template
    row = {"prompt": [{"role": "user", "content": "Look up alpha and beta."}]}
    trainer = GRPOTrainer(model=model, processing_class=tok, args=GRPOConfig(**settings(out_dir, rows)),
                          train_dataset=datasets.Dataset.from_list([row]), tools=[tool],
                          reward_funcs=lambda completions, **k: [float(len(c)) for c in completions])
    turns = turns_of(rows, tool.__name__)

    def run() -> float:
        calls = []

        def scripted(input_ids, **kwargs):
            ids = [tok(t, add_special_tokens=False)["input_ids"] for t in turns[len(calls)]]
            calls.append(len(ids))
            out = torch.full((len(ids), max(map(len, ids))), tok.pad_token_id, dtype=input_ids.dtype)
            for i, r in enumerate(ids):
                out[i, :len(r)] = torch.tensor(r)
            return torch.cat([input_ids, out], dim=-1)

        trainer.model.generate = scripted
        start = time.perf_counter()
        trainer._generate_and_score_completions([row] * rows)
        assert calls == [rows] * 3, calls
        return time.perf_counter() - start
    return run


def fastppo_side(tok, model, rows: int, tool, out_dir: str):
    import datasets
    from fastppo import GRPOConfig, GRPOTrainer
    from tool_script import Script

    row = {"prompt": [{"role": "user", "content": "Look up alpha and beta."}]}
    trainer = GRPOTrainer(model=model, processing_class=tok, train_dataset=datasets.Dataset.from_list([row] * 100),
                          args=GRPOConfig(**settings(out_dir, rows), disable_tqdm=True, gradient_checkpointing=False),
                          tools=[tool], reward_funcs=lambda completions, **k: [float(len(c)) for c in completions])
    turns = turns_of(rows, tool.__name__)

    def run() -> float:
        trainer._sample = Script(tok, turns)
        start = time.perf_counter()
        trainer.rollout()
        assert trainer._sample.rows == [rows] * 3, trainer._sample.rows
        return time.perf_counter() - start
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.02)
    args = parser.parse_args()
    SLEEP["seconds"] = args.sleep
    import trl

    from tool_script import byte_tokenizer
    from trl1_tool_episodes import tiny_model

    tok = byte_tokenizer()
    print(f"TRL {trl.__version__}; {args.rows} episodes of 2 tool rounds, each call waiting {args.sleep} s; "
          f"median of {args.repeats}")
    print("| tool | side | s per batch | ms per episode | vs TRL | process peak RSS MiB (both sides, one process) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for tool in (lookup, lookup_async):
        with tempfile.TemporaryDirectory() as tmp:
            sides = {"TRL 1.16": trl_side(tok, tiny_model(tok), args.rows, tool, tmp + "/trl"),
                     "fastppo": fastppo_side(tok, tiny_model(tok), args.rows, tool, tmp + "/fastppo")}
            times, peaks = {name: [] for name in sides}, {}
            for _ in range(args.repeats):
                for name, run in sides.items():
                    times[name].append(run())
                    peaks.setdefault(name, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            trl_time = statistics.median(times["TRL 1.16"])
            for name in sides:
                t = statistics.median(times[name])
                print(f"| {'async' if tool is lookup_async else 'sync'} | {name} | {t:.3f} | "
                      f"{1000 * t / args.rows:.1f} | {trl_time / t:.2f}× | {peaks[name]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
