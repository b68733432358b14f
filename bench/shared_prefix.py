"""The reference model's forward with each group's prompt run once (``share_prompts``) beside the unshared forward:
SmolLM2-135M-Instruct (or the embedded model), groups of k completions sharing a prompt, the log-probs of both held
equal, the time and the decoder tokens of each. ``--update``: the update's forward and backward instead (the
trained module, ``PolicyAndValue`` without a critic, and a loss over every response token), with the FLOP rate.

    python bench/shared_prefix.py                          # SmolLM2, k 8, 64-token completions, prompts 39 and 500
    python bench/shared_prefix.py --update --repeats 3     # the update's forward and backward
    python bench/shared_prefix.py --model embedded --repeats 1 --prompts 8 --completion 4 --groups 1   # a smoke run

Each case: ``--groups`` groups of ``--k`` rows, every prompt ``P`` tokens (left-padded to the widest), completions
of ``--completion`` tokens less a few per row (ragged); the reference is the policy's weights in fp32 under
``torch.inference_mode`` (``fastppo.actor_critic.Reference``, as ``compute_experience`` runs it), timed as the
median of ``--repeats`` forwards after one warm-up, in one process, the two layouts interleaved.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def grouped_rollout(vocab: int, k: int, groups: int, prompt: int, completion: int, seed: int = 0):
    from fastppo.rollout import assemble

    gen = torch.Generator().manual_seed(seed)
    queries = torch.randint(3, vocab, (groups, prompt), generator=gen).repeat_interleave(k, 0)
    mask = torch.ones_like(queries)
    responses = torch.randint(3, vocab, (groups * k, completion), generator=gen)
    real = torch.ones(groups * k, completion, dtype=torch.bool)
    for row in range(groups * k):
        real[row, completion - row % 4:] = False  # ragged: up to 3 tokens shorter
    return assemble(queries, mask, responses * real, real, torch.zeros(groups * k, dtype=torch.bool))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "embedded"), default="smollm2")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--prompts", type=int, nargs="+", default=[39, 500])
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--update", action="store_true", help="time the update's forward and backward instead")
    p.add_argument("--against_fp64", action="store_true",
                   help="also each layout's largest log-prob error against the unshared forward in float64")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from fastppo.actor_critic import Reference
    from fastppo.layout import shared_mask_kind

    if args.model == "smollm2":
        from e2e_common import smollm2_dir

        path = smollm2_dir()
    else:
        from fastppo.embedded import embedded_model_path

        path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = Reference(model, model)
    if args.update:
        return update(model, args)
    shared = (args.k, shared_mask_kind(model), torch.float32)
    print(f"model {args.model}: {type(model).__name__}, attention {model.config._attn_implementation}, "
          f"torch threads {torch.get_num_threads()}; k {args.k}, {args.groups} groups, completions "
          f"{args.completion - 3}-{args.completion} tokens, median of {args.repeats}")
    exact = Reference(*(2 * [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()])) \
        if args.against_fp64 else None
    print("| prompt tokens | unshared ms | shared ms | speed-up | decoder tokens unshared | shared | "
          "max abs log-prob difference |" + (" unshared vs fp64 | shared vs fp64 |" if exact else ""))
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if exact else ""))
    for prompt in args.prompts:
        rollout = grouped_rollout(model.config.vocab_size, args.k, args.groups, prompt, args.completion)
        layouts = {"unshared": rollout.layout(None, False), "shared": rollout.layout(None, shared=shared)}
        times: dict[str, list[float]] = {name: [] for name in layouts}
        outputs = {}
        with torch.inference_mode():
            for name, layout in layouts.items():  # warm-up
                outputs[name] = reference(layout, 1.0)[0]
            for _ in range(args.repeats):
                for name, layout in layouts.items():
                    start = time.perf_counter()
                    reference(layout, 1.0)
                    times[name].append(time.perf_counter() - start)
        plain, fast = (statistics.median(times[n]) for n in ("unshared", "shared"))
        tokens = {n: int(layouts[n].input_ids.numel()) for n in layouts}
        diff = (outputs["unshared"] - outputs["shared"]).abs().max().item()
        row = (f"| {prompt} | {plain * 1e3:.0f} | {fast * 1e3:.0f} | {plain / fast:.2f}x | {tokens['unshared']} | "
               f"{tokens['shared']} | {diff:.1e} |")
        if exact is not None:
            with torch.inference_mode():
                truth = exact(layouts["unshared"], 1.0)[0]
            row += "".join(f" {(outputs[n].double() - truth).abs().max().item():.1e} |" for n in layouts)
        print(row, flush=True)


def update(model, args) -> None:
    """The update's forward and backward on each layout: time, decoder tokens (a perfect sharing computes each group's
    prompt once and every completion token once: the shared layout's real tokens), and the FLOP rate of the linear
    layers (6 FLOPs per non-embedding parameter and decoder token, forward and backward, and the LM head's 6·H·V per
    response token; attention left out, so the rate is a floor)."""
    from fastppo.actor_critic import PolicyAndValue
    from fastppo.layout import shared_mask_kind

    actor = PolicyAndValue(model, None, critic=False)
    shared = (args.k, shared_mask_kind(model), torch.float32)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    head = model.config.hidden_size * model.config.vocab_size
    print(f"update (forward + backward), model {args.model}, torch threads {torch.get_num_threads()}; k {args.k}, "
          f"{args.groups} groups, completions {args.completion - 3}-{args.completion} tokens, median of {args.repeats}")
    print("| prompt tokens | layout | ms | speed-up | decoder tokens (padded) | real | GFLOP/s (linear layers) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for prompt in args.prompts:
        rollout = grouped_rollout(model.config.vocab_size, args.k, args.groups, prompt, args.completion)
        layouts = {"unshared": rollout.layout(None, False), "shared": rollout.layout(None, shared=shared)}
        times: dict[str, list[float]] = {name: [] for name in layouts}

        def step(layout):
            model.zero_grad(set_to_none=True)
            out = actor(layout, 1.0, return_entropy=True)
            mask = rollout.response_mask
            ((out.logprobs * mask).sum() + 0.01 * (out.entropy * mask).sum()).backward()

        for layout in layouts.values():  # warm-up
            step(layout)
        for _ in range(args.repeats):
            for name, layout in layouts.items():
                start = time.perf_counter()
                step(layout)
                times[name].append(time.perf_counter() - start)
        responses = int(rollout.response_mask.sum())
        real = {"unshared": sum(q + r for q, r in zip(rollout.query_lengths, rollout.response_lengths)),
                "shared": args.groups * prompt + responses}
        base = statistics.median(times["unshared"])
        for name, layout in layouts.items():
            t = statistics.median(times[name])
            flops = 6 * params * real[name] + 6 * head * responses
            print(f"| {prompt} | {name} | {t * 1e3:.0f} | {base / t:.2f}x | {int(layout.input_ids.numel())} | "
                  f"{real[name]} | {flops / t / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
