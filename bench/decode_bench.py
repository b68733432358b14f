"""Generation alone: fastppo's eager sampler, its compiled static-cache decode, and TRL 0.26's ``batch_generation``
(``generate`` as TRL's PPOTrainer calls it), on the same model, prompts and random state; with this machine's
read-bandwidth floor beside each step.

    python bench/decode_bench.py [--lengths 24 53] [--batches 8 16] [--reps 3] [--json out.json]

Per (response_length, batch): seconds per iteration's generation (the batch's chunks, one chunk here =
``local_rollout_forward_batch_size`` = batch) and per decode step (the generated columns), median of
``--reps`` after one untimed call; the compiled decode's first call (compilation) is reported apart.
Every call starts from the same seed, samples at temperature 0.7 and stops at eos, so all three draw the
same tokens (the eager and compiled samplers are checked to; TRL's generate draws from the same
probabilities). Under CUDA the three run under bf16 autocast, as both trainers' rollouts do with bf16.

``floor``: the time to read the policy's weights once at the measured read bandwidth
(``machine_limits.read_bandwidth``), the least a decode step can take at these batch sizes; ``floor
share`` is floor / measured step.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, seed: int):
    import torch

    torch.manual_seed(seed)
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def run(lengths, batches, reps: int, temperature: float = 0.7, seed: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import machine_limits
    from e2e_common import chat_prompts, smollm2_dir
    from fastppo.generation import Sampling, sample_responses
    from fastppo.static_decode import StaticDecoder

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    prompts, width = chat_prompts(tokenizer)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    weight_bytes = machine_limits.weight_bytes(sum(p.numel() for p in lm.parameters()), device)
    bandwidth = machine_limits.read_bandwidth(device, 4.0 if device.type == "cuda" else 1.0)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())
    try:
        from trl.trainer.utils import batch_generation
    except ImportError:
        batch_generation = None
    decoder = StaticDecoder(lm)
    rows = []
    for length in lengths:
        for batch in batches:
            ids = torch.tensor([prompts[i % len(prompts)] for i in range(batch)], device=device)
            mask = (torch.arange(width, device=device)[None] >= (ids != pad).long().argmax(1)[:, None]).long()
            impls = {
                "eager": lambda: sample_responses(lm, ids, mask, length, Sampling(temperature, [eos], pad), batch),
                "compiled": lambda: sample_responses(lm, ids, mask, length, Sampling(temperature, [eos], pad), batch,
                                                     decoder=decoder),
            }
            if batch_generation is not None:  # TRL's call: the checkpoint's generation_config merged in, as in TRL
                gen = GenerationConfig(max_new_tokens=length, temperature=temperature + 1e-7, top_k=0.0, top_p=1.0,
                                       do_sample=True)
                queries = torch.where(mask.bool(), ids, pad)
                impls["trl-0.26"] = lambda: batch_generation(lm, queries, batch, pad, gen)[0][:, width:]
            row = {"response_length": length, "batch": batch}
            with torch.no_grad(), autocast:
                first, _ = _timed(impls["compiled"], device, seed)
                row["compiled_first_call_s"] = first
                outputs = {}
                for name, fn in impls.items():
                    _timed(fn, device, seed)  # warm-up (and, for "compiled", a second bucket check)
                    times = []
                    for r in range(reps):
                        seconds, out = _timed(fn, device, seed)
                        times.append(seconds)
                    outputs[name] = out
                    steps = int((out != pad).any(0).nonzero().max()) + 1 if (out != pad).any() else 1
                    row[name] = {"iteration_s": statistics.median(times), "steps": steps,
                                 "step_s": statistics.median(times) / steps}
            row["compiled_equals_eager"] = bool(torch.equal(outputs["compiled"], outputs["eager"]))
            if "trl-0.26" in outputs:
                trl_out = outputs["trl-0.26"]
                row["trl_equals_eager"] = bool(trl_out.shape == outputs["eager"].shape
                                               and torch.equal(trl_out, outputs["eager"]))
            row["floor_step_s"] = weight_bytes / bandwidth
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(), "model": path, "prompt_width": width,
            "read_bytes_per_s": bandwidth, "weight_bytes": weight_bytes,
            "compile_seconds": {f"{k[0]}x{k[1]}": v for k, v in decoder.compile_seconds.items()}, "rows": rows}


def table(result: dict) -> str:
    names = [n for n in ("eager", "compiled", "trl-0.26") if n in result["rows"][0]]
    head = ("| length | batch | " + " | ".join(f"{n} s/iter | {n} ms/step" for n in names)
            + " | compiled vs eager | eager vs TRL | floor ms/step (share of compiled) | same tokens |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in result["rows"]:
        cells = [f"{r[n]['iteration_s']:.3f} | {1e3 * r[n]['step_s']:.2f}" for n in names]
        speed = r["eager"]["iteration_s"] / r["compiled"]["iteration_s"]
        vs_trl = (f"{r['trl-0.26']['iteration_s'] / r['eager']['iteration_s']:.2f}x" if "trl-0.26" in r else "-")
        floor = f"{1e3 * r['floor_step_s']:.2f} ({r['floor_step_s'] / r['compiled']['step_s']:.0%})"
        same = f"compiled {r['compiled_equals_eager']}" + (f", TRL {r['trl_equals_eager']}" if "trl_equals_eager" in r
                                                           else "")
        lines.append(f"| {r['response_length']} | {r['batch']} | " + " | ".join(cells)
                     + f" | {speed:.2f}x | {vs_trl} | {floor} | {same} |")
    compile_s = ", ".join(f"{k}: {v:.1f} s" for k, v in result["compile_seconds"].items())
    return "\n".join(lines) + f"\n\ncompile (first step of each bucket, batch x cache length): {compile_s}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[24, 53])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    result = run(args.lengths, args.batches, args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{result['device']} ({result['threads']} threads), prompt width {result['prompt_width']}, read bandwidth "
          f"{result['read_bytes_per_s'] / 1e9:.1f} GB/s, weights {result['weight_bytes'] / 1e6:.0f} MB")
    print(table(result))


if __name__ == "__main__":
    main()
