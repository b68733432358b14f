"""Multi-turn tool episodes sampled three ways on SmolLM2-135M-Instruct, the same episodes each way (issue 47,
item 5): ``EpisodeDecode`` (each chunk's episodes in one static KV cache of the compiled decode, a turn after tool
messages prefilling only them), the compiled decode prefilling each turn's contexts anew (fastppo before it), and
the eager sampler prefilling anew. The model's turns end at its frequent tokens and every ended turn "calls a tool"
whose message is 12-20 tokens (a scripted ``ToolCalling``), so each batch runs ``--rounds`` rounds.

Reports seconds per batch, the tokens prefilled, and how many static-cache buckets each compiled way used: each
bucket is one compile with inductor (37-48 s in a new process on an H200, bench/RESULTS.md) or one capture with
CUDA graphs, so a way that uses a new bucket each round compiles again each round. On a CPU the graph backend's
step runs uncaptured (no compile), which times the forwards alone; ``--device cuda`` captures it:

    python bench/episode_decode_time.py [--batches 3 --rows 8 --rounds 3 --budget 96 --device cpu]

With ``FASTPPO_SMOLLM2_SHAPE`` (random weights at SmolLM2's shape, ``e2e_common.smollm2_shaped_dir``) the model
samples almost uniformly: ``--stops 1024`` makes its turns end (bench/gpu_issue64.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))


class ScriptedCalls:
    """Every turn that ended calls a tool; its message's tokens depend on the row and the round."""

    def __init__(self, vocab: int):
        self.vocab, self.rounds = vocab, 0

    def parse(self, ids, prefix, tools=None) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [{"turn": len(ids)}]}

    def run(self, calls, tools=None):
        from fastppo.tools import ToolRound

        self.rounds += 1
        return ToolRound([None if c is None else [{"role": "tool", "content": f"{i}:{self.rounds}"}]
                          for i, c in enumerate(calls)], sum(c is not None for c in calls), 0)

    def suffix_ids(self, messages) -> list[int]:
        row, round_ = map(int, messages[0]["content"].split(":"))
        return [(31 * row + 7 * round_ + 5 * k) % (self.vocab - 100) + 50 for k in range(12 + (row + round_) % 9)]


def setup(args):
    """The model (its forward counting the tokens each prefill reads), the batches of prompts and the stop ids."""
    from transformers import AutoModelForCausalLM

    from e2e_common import smollm2_dir
    from fastppo.data import left_pad

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = torch.device(args.device)
    lm = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).to(device).eval()
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.batches):
        lengths = torch.randint(args.prompt_tokens // 2, args.prompt_tokens + 1, (args.rows,), generator=gen)
        batches.append([torch.randint(50, vocab - 100, (int(n),), generator=gen).tolist() for n in lengths])
    with torch.no_grad():  # stop ids: the tokens the model samples most after these prompts, so turns end early
        ids, mask = (t.to(device) for t in left_pad(batches[0], 0))
        probs = lm(input_ids=ids, attention_mask=mask).logits[:, -1].softmax(-1).mean(0)
        stops = probs.topk(args.stops).indices.tolist()
    forward = lm.forward
    prefilled = {"tokens": 0}

    def counting(*a, **kw):  # the tokens each prefill (a forward of more than one position) reads
        width = kw["input_ids"].shape[1]
        if width > 1:
            prefilled["tokens"] += int(kw["input_ids"].shape[0] * width)
        return forward(*a, **kw)

    lm.forward = counting
    return lm, batches, stops, prefilled


def three_ways(lm, stops, args):
    """Each way's episodes of a batch of prompts, and the two compiled ways' decoders."""
    from fastppo.data import left_pad
    from fastppo.episode_decode import EpisodeDecode
    from fastppo.generation import Sampling, cut_after_stop, sample_responses
    from fastppo.static_decode import StaticDecoder
    from fastppo.tools import TurnLimits, run_episodes

    device, sampling = lm.device, Sampling(1.0, stops, 0)
    limits = TurnLimits(args.budget, args.rounds, tuple(stops))

    def padded(prompts):
        return (t.to(device) for t in left_pad(prompts, 0))

    def cached_way(decoder):
        def episodes(prompts, seed):
            torch.manual_seed(seed)
            decode = EpisodeDecode(decoder, lm, *padded(prompts), args.budget, sampling)
            return run_episodes(ScriptedCalls(lm.config.vocab_size), prompts, decode.first_turn(), decode, limits)
        return episodes

    def anew_way(decoder):
        def sample(rows, contexts, suffixes, length):
            tokens = sample_responses(lm, *padded(contexts), length, sampling, len(contexts), decoder=decoder)
            return [cut_after_stop(row, stops) for row in tokens.tolist()]

        def episodes(prompts, seed):
            torch.manual_seed(seed)
            first = sample_responses(lm, *padded(prompts), args.budget, sampling, len(prompts), decoder=decoder)
            return run_episodes(ScriptedCalls(lm.config.vocab_size), prompts,
                                [cut_after_stop(r, stops) for r in first.tolist()], sample, limits)
        return episodes

    decoders = {name: StaticDecoder(lm, backend="cuda_graph", capture=device.type == "cuda")
                for name in ("cached", "compiled_anew")}
    return {"cached": cached_way(decoders["cached"]), "compiled_anew": anew_way(decoders["compiled_anew"]),
            "eager_anew": anew_way(None)}, decoders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=96)
    parser.add_argument("--prompt_tokens", type=int, default=120)
    parser.add_argument("--device", default="cpu", help="cuda: the graph backend's step captured (CUDA graphs)")
    parser.add_argument("--stops", type=int, default=24,
                        help="how many of the model's likeliest tokens after the prompts end a turn; a model with "
                             "random weights (a GPU lease's SmolLM2 shape) samples almost uniformly, so 24 of its "
                             "49,152 tokens end almost no turn: 1,024 ends about one token in 48")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lm, batches, stops, prefilled = setup(args)
    ways, decoders = three_ways(lm, stops, args)
    rows = {name: {"seconds": [], "prefilled_tokens": 0, "turns": 0} for name in ways}
    completions = {}
    with torch.no_grad():
        for b, prompts in enumerate(batches):
            for name, way in ways.items():  # interleaved: each batch through every way in turn
                prefilled["tokens"] = 0
                start = time.perf_counter()
                out = way(prompts, seed=b)
                if lm.device.type == "cuda":
                    torch.cuda.synchronize(lm.device)
                rows[name]["seconds"].append(time.perf_counter() - start)
                rows[name]["prefilled_tokens"] += prefilled["tokens"]
                rows[name]["turns"] += sum(sum(m["role"] == "assistant" for m in ms) for ms in out.messages)
                completions.setdefault(b, {})[name] = out.completions
    for name in decoders:
        rows[name]["buckets"] = sorted(decoders[name]._caches)
    result = {"model": "SmolLM2-135M-Instruct", "device": str(lm.device), "torch_threads": torch.get_num_threads(),
              "rows": args.rows, "rounds": args.rounds, "budget": args.budget, "prompt_tokens": args.prompt_tokens,
              "batches": args.batches, "ways": rows,
              "same_episodes": all(len({json.dumps(c) for c in by_way.values()}) == 1
                                   for by_way in completions.values())}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
