"""Long completions: one GRPO script, its import swapped (``from trl import GRPOConfig, GRPOTrainer`` against
``from fastppo import GRPOConfig, GRPOTrainer``), GRPOConfig's defaults except the sizes, at a model's shape with
random weights, from a few hundred to thousands of completion tokens: ``train()``'s time, seconds per iteration,
completion tokens per second and the peak memory (the process's resident set on a CPU, ``max_memory_allocated`` on
CUDA), each side in its own fresh process (``e2e_measure.run_child``), the side order alternating from one
length to the next; ``--bisect``: the longest completion each side fits (issue 61, items 4 and 5).

    python bench/long_completions.py --device cpu --shape smollm2-135m --lengths 256,512,1024,2048 \\
        --prompts 1 --completions 4 --json long.json --markdown long.md --plot long.png      # the CPU job
    python bench/long_completions.py --device cuda --shape qwen2.5-0.5b --lengths 1024,4096,8192 \\
        --prompts 8 --completions 8 --sides fastppo,trl,trl-liger --side_seconds 300
    python bench/long_completions.py --device cuda --shape qwen2.5-0.5b --prompts 8 --completions 8 --bisect
    python bench/long_completions.py --smoke          # a tiny shape, both sides, a few seconds of training (a test)

The script, the same on both sides (``build``): ``GRPOConfig(output_dir, per_device_train_batch_size=prompts ×
completions, num_generations=completions, max_completion_length, max_steps)``; on a CPU also ``use_cpu=True``,
which TRL's config demands there (its default ``bf16=True`` is then bf16 autocast on the CPU, on both sides;
``--fp32`` sets ``bf16=False`` on both); ``use_liger_kernel=True`` for the ``trl-liger`` side. Nothing else is
set: gradient checkpointing, β 0 (no reference model), one optimizer step per generation batch, TRL's
``dapo`` loss are each trainer's defaults, and every fastppo speed setting is its default (the table's settings
say which were on). ``train()`` is timed whole; fastppo's ``train()`` also saves the final model and plots its
curves (TRL's saves nothing within 500 steps), which is timed apart and shown.

The model (``shape_dir``): the shape's config written here (no download) with seeded random weights and a
word-level tokenizer of exactly the vocabulary's size (``w<i>`` words; pad, unk and eos among them), so that every
sampled id decodes to one word and the shared reward (``grpo_baseline.minus_word_count``) records each
completion's length. Random weights seldom sample eos, but at tens of thousands of tokens a row would stop early,
so eos is made unreachable, the same for both trainers: hidden dimension 0 of the residual stream is a constant
channel (every token's embedding holds +0.05 there and no layer writes to it: row 0 of each ``o_proj`` and
``down_proj`` is zero), and eos's tied embedding row is -1e5 in that dimension, so after the final norm eos's
logit sits thousands below every other (``eos_margin``, checked when the directory is built). Every completion
runs to ``max_completion_length``: the tables' "tokens per completion" column shows it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import grpo_baseline as gb  # noqa: E402
from e2e_measure import ChildFailed, run_child  # noqa: E402
from trl_envs import trl1_missing  # noqa: E402

SHAPE_VERSION = 1  # bump when a shape's config, the tokenizer or the eos channel changes
SIDES = ("fastppo", "trl", "trl-liger")
# The shapes' configs (the published ones' sizes; max_position_embeddings raised to 131,072 on every shape: with
# RoPE no weight depends on it, and fastppo refuses a prompt + completion longer than the config says)
_LLAMA = dict(model_type="llama", hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
              initializer_range=0.02)
_QWEN2 = dict(model_type="qwen2", hidden_act="silu", tie_word_embeddings=True, initializer_range=0.02,
              rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
              use_sliding_window=False)
SHAPES = {
    "tiny": dict(_LLAMA, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "smollm2-135m": dict(_LLAMA, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "qwen2.5-0.5b": dict(_QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(_QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
}
PAD, UNK, EOS = "<pad>", "<unk>", "</s>"  # ids 0, 1, 2
CHANNEL, CHANNEL_VALUE, EOS_DEPTH = 0, 0.05, 1e5


# ============================================================================ the model: a shape, random weights


def cache_root() -> str:
    root = os.environ.get("FASTPPO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastppo")
    return os.path.join(root, "long-completions")


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer with exactly ``vocab_size`` ids: pad, unk and eos, then ``w3`` ... ``w<V-1>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, UNK: 1, EOS: 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, unk_token=UNK, eos_token=EOS,
                                   model_max_length=1 << 20)


def unreachable_eos(model, eos_id: int) -> None:
    """Make ``eos_id`` impossible to sample (module docstring): a constant residual channel no layer writes, and
    eos's tied embedding row deep below zero in it."""
    import torch

    layers = model.model.layers
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, CHANNEL] = CHANNEL_VALUE
        embedding[eos_id] = 0.0
        embedding[eos_id, CHANNEL] = -EOS_DEPTH
        for layer in layers:
            for out in (layer.self_attn.o_proj, layer.mlp.down_proj):
                out.weight[CHANNEL] = 0.0
                if out.bias is not None:
                    out.bias[CHANNEL] = 0.0


def eos_margin(model, eos_id: int, seed: int = 0) -> float:
    """The smallest gap between the largest logit and eos's over a few random positions (nats: eos is e^-gap as
    likely as the likeliest token)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, 16), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids.to(model.device)).logits.float()
    return float((logits.max(-1).values - logits[..., eos_id]).min())


def shape_dir(shape: str, seed: int = 0) -> str:
    """The shape's checkpoint (config, random weights with eos unreachable, tokenizer, generation config), built
    once into the cache and renamed into place complete."""
    if shape not in SHAPES:
        raise SystemExit(f"--shape: unknown {shape!r}; choose from {', '.join(SHAPES)}")
    path = os.path.join(cache_root(), f"{shape}-seed{seed}-v{SHAPE_VERSION}")
    if os.path.isfile(os.path.join(path, "shape.json")):
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, max_position_embeddings=131072,
                                  pad_token_id=0, eos_token_id=2, bos_token_id=None)
    tokenizer = build_tokenizer(config.vocab_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the 1.5B's initialisation is minutes on a CPU
    with torch.random.fork_rng(devices=[0] if device == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    unreachable_eos(model, tokenizer.eos_token_id)
    margin = eos_margin(model, tokenizer.eos_token_id, seed)
    if margin < 100:
        raise RuntimeError(f"{shape}: eos is only {margin:.1f} nats below the likeliest token; completions could stop")
    model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=2, bos_token_id=None)
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{shape}-", dir=cache_root())
    try:
        model.cpu().save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        params = sum(p.numel() for p in model.parameters())
        with open(os.path.join(tmp, "shape.json"), "w") as f:
            json.dump({"shape": shape, "seed": seed, "parameters": params, "eos_margin": margin}, f)
        os.rename(tmp, path)
    except OSError:  # another process renamed its copy into place first
        if not os.path.isfile(os.path.join(path, "shape.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ============================================================================ the case and the script both sides run


@dataclass
class LongCase:
    """One run; every field means the same for both sides. ``iterations``: optimizer steps = generation batches."""

    shape: str = "smollm2-135m"
    max_completion_length: int = 256
    num_generations: int = 4  # completions per prompt
    prompts: int = 1  # prompts per step
    iterations: int = 1
    prompt_tokens: int = 64
    device: str = "cpu"
    fp32: bool = False  # bf16=False on both sides (else GRPOConfig's default bf16=True)
    threads: int = 0  # torch.set_num_threads in the child; 0: torch's default
    seed: int = 0

    @property
    def completions(self) -> int:
        return self.prompts * self.num_generations

    def describe(self) -> str:
        precision = "bf16=False (fp32)" if self.fp32 else "GRPOConfig's bf16=True (bf16 autocast over fp32 weights)"
        return (f"random weights (eos unreachable), {self.device}, {precision}; "
                f"{self.prompts} prompt(s) of {self.prompt_tokens} tokens × {self.num_generations} completions, "
                f"{self.iterations} step(s); GRPOConfig's defaults otherwise")


def dataset(case: LongCase):
    """``prompts × iterations`` text prompts of ``prompt_tokens`` words each (no prompt repeats)."""
    import random

    from datasets import Dataset

    rng = random.Random(case.seed)
    vocab = SHAPES[case.shape]["vocab_size"]
    return Dataset.from_dict({"prompt": [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(case.prompt_tokens))
                                         for _ in range(case.prompts * case.iterations)]})


def build(case: LongCase, output_dir: str, side: str, clock):
    """The GRPO script, its import the only difference between the sides (and Liger's switch for trl-liger)."""
    if side == "fastppo":
        from fastppo import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    sizes = dict(output_dir=output_dir, per_device_train_batch_size=case.completions,
                 num_generations=case.num_generations, max_completion_length=case.max_completion_length,
                 max_steps=case.iterations)
    if case.device == "cpu":
        sizes["use_cpu"] = True
    if case.fp32:
        sizes["bf16"] = False
    if side == "trl-liger":
        sizes["use_liger_kernel"] = True
    args = GRPOConfig(**sizes)
    trainer = GRPOTrainer(model=shape_dir(case.shape, case.seed), reward_funcs=gb.minus_word_count, args=args,
                          train_dataset=dataset(case), callbacks=[gb._callback(clock)])
    return trainer, settings_of(side, trainer, args)


def settings_of(side: str, trainer, args) -> dict:
    """What each side ran with, read after construction: the defaults a user gets."""
    common = {"bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing, "beta": args.beta,
              "loss_type": args.loss_type, "steps_per_generation": args.steps_per_generation}
    if side != "fastppo":
        import trl

        return {"trl_version": trl.__version__, **common, "use_liger_kernel": args.use_liger_kernel,
                "generation": "transformers generate" + (" (vLLM)" if args.use_vllm else ""),
                "cache_implementation": args.cache_implementation}
    from fastppo.train import old_logprobs_in_update

    config = trainer.config
    return {**common, "compiled_decode": bool(trainer._compiled_decode),
            "compiled_decode_backend": config.compiled_decode_backend, "padding_free": config.padding_free,
            "share_prompts": config.share_prompts, "max_tokens_per_micro_batch": config.max_tokens_per_micro_batch,
            "group_by_length": config.group_by_length, "fused_policy_loss": config.fused_policy_loss,
            "old log-prob forward": not old_logprobs_in_update(config)}


BUILDERS = {side: build for side in SIDES}


# ============================================================================ running the sides


def run(side: str, case: LongCase, limit: float) -> dict:
    """One side's run, in its own process: a record with the outcome (ok, out of memory, past the limit, failed)."""
    record = {"shape": case.shape, "length": case.max_completion_length, "side": side, "case": dataclasses.asdict(case)}
    try:
        result = run_child(side, case, __file__, timeout=limit)
    except ChildFailed as e:
        outcome = ("past the limit" if e.timed_out else "out of memory" if e.out_of_memory else "failed")
        return {**record, "outcome": outcome, "wall_s": e.wall_s, "limit_s": limit,
                "error": "\n".join(e.stderr.strip().splitlines()[-12:])}
    return {**record, "outcome": "ok", "wall_s": result["process_wall_s"], "limit_s": limit, "result": result}


def peak_bytes(result: dict) -> int:
    return result["cuda_peak_bytes"] if result.get("cuda_peak_bytes") is not None else result["process_maxrss_bytes"]


def per_iteration_s(result: dict) -> float:
    its = result["iteration_s"]
    return statistics.median(its[1:] or its)  # the first (warm-up) left out when there are more


def tokens_per_s(result: dict) -> float | None:
    lengths = [x for x in result["completion_length_mean"] if x is not None]
    n = statistics.mean(result["completions_per_call"])
    return None if not lengths else n * statistics.mean(lengths) / per_iteration_s(result)


def bisect_longest(fits, start: int, maximum: int, resolution: int, time_left=lambda: 1.0) -> dict:
    """The longest length ``fits(n)`` ("fit", "no fit" or "unknown") accepts: doubling from ``start`` (halving if
    it does not fit) to bracket it, then halving the bracket down to ``resolution``. Stops at an "unknown" or when
    ``time_left()`` is not positive; returns the bracket as far as it got."""
    fit, no_fit, tried = None, None, []

    def attempt(n: int) -> str | None:
        if time_left() <= 0:
            return None
        outcome = fits(n)
        tried.append((n, outcome))
        return outcome

    n = start
    while True:  # bracket: up while it fits, down while it does not
        outcome = attempt(n)
        if outcome not in ("fit", "no fit"):
            return {"longest_fit": fit, "first_no_fit": no_fit, "complete": False, "tried": tried}
        if outcome == "fit":
            fit = n
            if no_fit is not None or n * 2 > maximum:
                break
            n *= 2
        else:
            no_fit = n
            if fit is not None or n // 2 < resolution:
                break
            n //= 2
    while fit is not None and no_fit is not None and no_fit - fit > resolution:
        mid = max(fit + resolution, (fit + no_fit) // 2 // resolution * resolution)
        if mid >= no_fit:
            break
        outcome = attempt(mid)
        if outcome not in ("fit", "no fit"):
            return {"longest_fit": fit, "first_no_fit": no_fit, "complete": False, "tried": tried}
        fit, no_fit = (mid, no_fit) if outcome == "fit" else (fit, mid)
    return {"longest_fit": fit, "first_no_fit": no_fit, "complete": True, "tried": tried}


def bisect_side(side: str, case: LongCase, args, save) -> dict:
    """:func:`bisect_longest` for one side, each try a one-step run in its own process, under the side's own
    budget (``--bisect_seconds``); every try's record kept."""
    deadline = time.monotonic() + args.bisect_seconds
    records: list[dict] = []

    def fits(n: int) -> str:
        limit = min(args.side_seconds, deadline - time.monotonic())
        record = run(side, dataclasses.replace(case, max_completion_length=n, iterations=1), limit)
        records.append(record)
        print(f"bisect {side:<10} {n:>6} tokens: {record['outcome']} after {record['wall_s']:.1f} s", flush=True)
        save()
        return {"ok": "fit", "out of memory": "no fit"}.get(record["outcome"], "unknown")

    found = bisect_longest(fits, args.bisect_start, args.bisect_max, args.bisect_resolution,
                           lambda: deadline - time.monotonic() - 5)
    return {"side": side, "shape": case.shape, "completions": case.completions, **found, "tries": records}


# ============================================================================ the tables and the plot


def _mib(b) -> str:
    return "–" if b is None else f"{b / 2**20:,.0f}"


def format_tables(data: dict) -> str:
    """The runs' table per shape and case, then the bisections', then each side's settings."""
    lines: list[str] = []
    groups: dict[str, list[dict]] = {}
    for r in data["runs"]:
        c = r["case"]
        key = (f"{r['shape']}, {c['prompts']} prompt(s) × {c['num_generations']} completions, {c['device']}, "
               f"{'fp32' if c['fp32'] else 'bf16 default'}, {c['iterations']} step(s)")
        groups.setdefault(key, []).append(r)
    for key, runs in groups.items():
        cuda = any(r.get("result", {}).get("cuda_peak_bytes") is not None for r in runs)
        memory = "peak CUDA MiB" if cuda else "peak RSS MiB"
        lines += [f"### {key}", "", f"| completion tokens | side | train() s | of it, fastppo's final save + plot s "
                  f"| s/iteration | vs TRL | completion tokens/s | {memory} | vs TRL | process s "
                  f"| tokens per completion |", "| ---: | --- |" + " ---: |" * 9]
        for length in sorted({r["length"] for r in runs}):
            at = [r for r in runs if r["length"] == length]
            trl = next((r["result"] for r in at if r["side"] == "trl" and r["outcome"] == "ok"), None)
            for r in at:
                if r["outcome"] != "ok":
                    why = r["outcome"] + (f" ({r['limit_s']:.0f} s)" if r["outcome"] == "past the limit" else "")
                    lines.append(f"| {length:,} | {r['side']} | {why} |" + " – |" * 7 + f" {r['wall_s']:.1f} | – |")
                    continue
                res = r["result"]
                it = per_iteration_s(res)
                tps = tokens_per_s(res)
                lengths = [x for x in res["completion_length_mean"] if x is not None]
                lines.append("| " + " | ".join([
                    f"{length:,}", r["side"], f"{res['train_call_s']:.1f}",
                    f"{sum(res['extra_s'].values()):.1f}" if res["extra_s"] else "–", f"{it:.2f}",
                    "1" if r["side"] == "trl" else ("–" if trl is None else f"{per_iteration_s(trl) / it:.2f}×"),
                    "–" if tps is None else f"{tps:,.0f}", _mib(peak_bytes(res)),
                    "1" if r["side"] == "trl" else
                    ("–" if trl is None else f"{peak_bytes(res) / peak_bytes(trl):.2f}"),
                    f"{res['process_wall_s']:.1f}", f"{statistics.mean(lengths):.0f}" if lengths else "–"]) + " |")
        lines += ["", "vs TRL: TRL's s/iteration over the side's (above 1: faster); memory: the side's peak over "
                  "TRL's. s/iteration: the median after the first iteration, or the only one (warm-up included).", ""]
    if data.get("bisect"):
        lines += ["### The longest completion that fits", "",
                  "| shape | completions | side | longest that fit | shortest that did not | tries (tokens: outcome, "
                  "process s, peak MiB) |", "| --- | ---: | --- | ---: | ---: | --- |"]
        for b in data["bisect"]:
            tries = "; ".join(f"{t['length']:,}: {t['outcome']}, {t['wall_s']:.0f} s"
                              + (f", {_mib(peak_bytes(t['result']))} MiB" if t.get("result") else "")
                              for t in b["tries"])
            fit = "none tried" if b["longest_fit"] is None else f"{b['longest_fit']:,}"
            lines.append(f"| {b['shape']} | {b['completions']} | {b['side']} | {fit}"
                         f"{'' if b['complete'] else ' (stopped early)'} | "
                         f"{'none tried' if b['first_no_fit'] is None else format(b['first_no_fit'], ',')} | {tries} |")
        lines.append("")
    settings: dict[str, dict] = {}
    for r in data["runs"]:
        if r["outcome"] == "ok":
            settings.setdefault(r["side"], r["result"]["settings"])
    if settings:
        lines += ["Settings each side ran with (read from its config after construction; nothing set beyond the "
                  "sizes):", ""]
        lines += [f"* **{side}**: " + "; ".join(f"{k}: {v}" for k, v in s.items()) for side, s in settings.items()]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: str) -> None:
    """Peak memory and train() time against completion length, one line per shape and side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, sec) = plt.subplots(1, 2, figsize=(11, 4.2))
    lines: dict[tuple, list] = {}
    for r in data["runs"]:
        if r["outcome"] == "ok":
            n = r["case"]["prompts"] * r["case"]["num_generations"]
            lines.setdefault((r["shape"], n, r["side"]), []).append(r)
    for (shape, n, side), runs in sorted(lines.items()):
        runs.sort(key=lambda r: r["length"])
        xs = [r["length"] for r in runs]
        label = f"{side} ({shape}, {n} completions)"
        mem.plot(xs, [peak_bytes(r["result"]) / 2**30 for r in runs], marker="o", label=label)
        sec.plot(xs, [r["result"]["train_call_s"] for r in runs], marker="o", label=label)
    cuda = any(r.get("result", {}).get("cuda_peak_bytes") is not None for r in data["runs"])
    for ax, title in ((mem, f"peak {'CUDA memory' if cuda else 'resident set'} (GiB)"), (sec, "train() (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("completion tokens")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    mem.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ============================================================================ command line


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{name} must be integers >= 1, got {text!r}")
    return values


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--shape", default="smollm2-135m", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--lengths", default="256,512,1024,2048", help="completion lengths (max_completion_length)")
    p.add_argument("--completions", type=int, default=4, help="completions per prompt (num_generations)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per step")
    p.add_argument("--prompt_tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=1, help="optimizer steps (= generation batches) per run")
    p.add_argument("--sides", default="fastppo,trl", help=f"comma-separated, from {', '.join(SIDES)}")
    p.add_argument("--fp32", action="store_true", help="bf16=False on both sides (not GRPOConfig's default)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's default)")
    p.add_argument("--side_seconds", type=float, default=3600, help="each run's own limit; past it, left out")
    p.add_argument("--bisect", action="store_true", help="find the longest completion each side fits (no table "
                   "of lengths): doubling from --bisect_start, then halving the bracket to --bisect_resolution")
    p.add_argument("--bisect_start", type=int, default=8192)
    p.add_argument("--bisect_max", type=int, default=65536)
    p.add_argument("--bisect_resolution", type=int, default=1024)
    p.add_argument("--bisect_seconds", type=float, default=1800, help="each side's budget for all its tries")
    p.add_argument("--json", help="write the records here (rewritten after every run)")
    p.add_argument("--markdown", help="write the tables here (rewritten after every run)")
    p.add_argument("--plot", help="write the plot (PNG) here at the end")
    p.add_argument("--append", action="store_true", help="add to the records already in --json")
    p.add_argument("--smoke", action="store_true",
                   help="the tiny shape, 2 prompts × 4 completions of 32 tokens, one step, both sides (a test)")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = _parse(argv)
    if args.child:
        result = gb.child(args.child, LongCase(**json.loads(args.case)), BUILDERS)
        print("GRPO_RESULT " + json.dumps(result), flush=True)
        return
    if args.smoke:
        args.shape, args.lengths, args.prompts, args.completions, args.steps = "tiny", "32", 2, 4, 1
        args.prompt_tokens, args.device = 8, "cpu"
    shapes = [s for s in args.shape.split(",") if s]
    lengths = _ints(args.lengths, "--lengths")
    sides = [s for s in args.sides.split(",") if s]
    for name, bad in (("--shape", [s for s in shapes if s not in SHAPES]),
                      ("--sides", [s for s in sides if s not in SIDES])):
        if bad:
            raise SystemExit(f"{name}: unknown {bad}; choose from {', '.join(SHAPES if name == '--shape' else SIDES)}")
    for name in ("completions", "prompts", "prompt_tokens", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if "trl-liger" in sides and device != "cuda":
        raise SystemExit("--sides trl-liger: Liger's kernels are Triton kernels and need --device cuda")
    if any(s.startswith("trl") for s in sides) and (why := trl1_missing()):
        raise SystemExit(why)
    data = {"runs": [], "bisect": []}
    if args.append and args.json and os.path.isfile(args.json):
        with open(args.json) as f:
            data = json.load(f)

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(format_tables(data))

    for shape in shapes:
        print(f"{shape}: {shape_dir(shape)}", flush=True)  # built once here, so that no child's time includes it
    base = LongCase(num_generations=args.completions, prompts=args.prompts, iterations=args.steps,
                    prompt_tokens=args.prompt_tokens, device=device, fp32=args.fp32, threads=args.threads)
    print(f"case: {', '.join(shapes)}'s shape, {base.describe()}; sides {', '.join(sides)}"
          + ("  [SMOKE RUN: measures nothing]" if args.smoke else ""), flush=True)
    if args.bisect:
        for shape in shapes:
            for side in sides:
                data["bisect"].append(bisect_side(side, dataclasses.replace(base, shape=shape), args, save))
                save()
    else:
        done = len({(r["shape"], r["length"]) for r in data["runs"]})  # the side order alternates on from there
        for shape in shapes:
            for length in lengths:
                order = sides if done % 2 == 0 else sides[::-1]
                done += 1
                for side in order:
                    case = dataclasses.replace(base, shape=shape, max_completion_length=length)
                    record = run(side, case, args.side_seconds)
                    data["runs"].append(record)
                    save()
                    res = record.get("result")
                    print(f"{shape} {length:>6} {side:<10} {record['outcome']}: " + (
                        f"train() {res['train_call_s']:.1f} s, peak {_mib(peak_bytes(res))} MiB, process "
                        f"{res['process_wall_s']:.1f} s" if res else f"after {record['wall_s']:.1f} s\n"
                        + record.get("error", "")), flush=True)
    save()
    print()
    print(format_tables(data))
    if args.plot and data["runs"]:
        plot(data, args.plot)


if __name__ == "__main__":
    main()
