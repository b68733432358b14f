"""What fits: a memory model of one GRPO step on one device, fastppo's way (fp32 weights under bf16 autocast, AdamW,
the fused LM head), with the figure TRL's unfused head adds beside it.

    python bench/memory_model.py            # the table of docs/performance.md ("What fits")

The step's peak is the larger of its two phases, over what the run always holds:

* held: the weights, their gradients and AdamW's two moments, 4 + 4 + 8 bytes per parameter (fp32), and autocast's
  bf16 copies of the weights during a forward (2 bytes per parameter);
* sampling: the KV cache, 2 (K and V) × layers × KV heads × head dim × 2 bytes (bf16: ``fastppo.kv_cache``) per
  position, for the sampler's rows (``local_rollout_forward_batch_size``) × (prompt + completion) positions;
* update: one micro-batch's activations, per token (layer sizes in elements; bytes, as autograd saves them under
  bf16 autocast with an fp32 residual stream, sdpa attention):
  - without gradient checkpointing, per layer 26·H + 4·(heads × head dim) + 4·(KV heads × head dim) + 8·I (the
    fp32 residual, two RMSNorms' inputs and outputs, each linear's bf16 input, sdpa's q, k, v and output, the MLP's
    gate, up, SiLU and product), plus 28·H outside the layers (embedding, final norm, the head's input);
  - with it, per layer 4·H (each layer's fp32 input, which the checkpoints keep), plus one layer recomputed with its
    backward in flight, 34·H + 4·(heads × head dim) + 4·(KV heads × head dim) + 12·I;
  - the fused head's chunk of fp32 logits, N·C ≈ 2²⁵ floats (128 MiB) whatever the length, where an unfused head (TRL
    without Liger) keeps the [tokens × V] logits for the backward: 2·V bytes per token in bf16, before the fp32
    log-softmax and the gradient that follow it.

The per-token coefficients are measured (``tests/test_memory_model.py`` holds a small Llama's peak, through
``helpers.LiveBytes``, to them), and the model is held to the H200 rows of bench/RESULTS.md at 256 tokens.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

GiB = 2**30
MiB = 2**20
HEAD_CHUNK_BYTES = 4 * 2**25  # the fused head's fp32 logits chunk (fastppo/kernels/_lmhead.py: N·C ≈ 2²⁵)


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes, as its config.json names them."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = True
    qkv_bias: bool = False

    def parameters(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h + (q + 2 * kv) * self.qkv_bias
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h


SHAPES = {s.name: s for s in (
    Shape("SmolLM2-135M", 30, 576, 1536, 9, 3, 64, 49152),
    Shape("Qwen2.5-0.5B", 24, 896, 4864, 14, 2, 64, 151936, qkv_bias=True),
    Shape("Qwen2.5-1.5B", 28, 1536, 8960, 12, 2, 128, 151936, qkv_bias=True),
    Shape("Qwen2.5-7B", 28, 3584, 18944, 28, 4, 128, 152064, tied=False, qkv_bias=True),
)}


def layer_activation_bytes(s: Shape) -> int:
    """One layer's saved activations per token, without checkpointing."""
    return 26 * s.hidden + 4 * s.heads * s.head_dim + 4 * s.kv_heads * s.head_dim + 8 * s.intermediate


def activation_bytes_per_token(s: Shape, checkpointing: bool) -> int:
    """An update micro-batch's activations per token (the head's chunk aside)."""
    if not checkpointing:
        return s.layers * layer_activation_bytes(s) + 28 * s.hidden
    recompute = 34 * s.hidden + 4 * s.heads * s.head_dim + 4 * s.kv_heads * s.head_dim + 12 * s.intermediate
    return s.layers * 4 * s.hidden + recompute


def kv_bytes_per_position(s: Shape, dtype_bytes: int = 2) -> int:
    """The KV cache per row and position: K and V of every layer."""
    return 2 * s.layers * s.kv_heads * s.head_dim * dtype_bytes


@dataclass(frozen=True)
class Step:
    """One GRPO step's memory, in bytes, by part."""

    held: int  # weights, gradients, AdamW moments (16 bytes per parameter)
    autocast_weights: int  # bf16 copies of the weights during a forward
    activations: int  # one update micro-batch's
    head: int  # the fused head's logits chunk
    kv_cache: int  # the sampler's, at the end of its rollout
    unfused_logits: int  # what an unfused head keeps for the backward (bf16 [tokens × V]): not in fastppo's peak
    kept_cache: bool  # the cache held through the update (a captured CUDA graph reads it)

    @property
    def update(self) -> int:
        return self.activations + self.head + (self.kv_cache if self.kept_cache else 0)

    @property
    def peak(self) -> int:
        return self.held + self.autocast_weights + max(self.kv_cache, self.update)


def grpo_step(s: Shape, prompt: int, completion: int, micro_rows: int = 8, sampler_rows: int = 64,
              checkpointing: bool = True, kept_cache: bool = False, kv_dtype_bytes: int = 2) -> Step:
    """The memory of a GRPO step whose completions all run to ``completion`` tokens after ``prompt``-token prompts:
    update micro-batches of ``micro_rows`` rows, the sampler's chunks of ``sampler_rows`` rows."""
    p, row = s.parameters(), prompt + completion
    return Step(held=16 * p, autocast_weights=2 * p,
                activations=micro_rows * row * activation_bytes_per_token(s, checkpointing),
                head=HEAD_CHUNK_BYTES, kv_cache=sampler_rows * row * kv_bytes_per_position(s, kv_dtype_bytes),
                unfused_logits=micro_rows * completion * 2 * s.vocab, kept_cache=kept_cache)


LENGTHS = (1024, 4096, 8192, 16384)
PROMPT = 256


def table(lengths=LENGTHS, prompt: int = PROMPT) -> str:
    """docs/performance.md's table: each shape at each completion length, 8 prompts × 8 completions, update
    micro-batches of 8 rows (TRL GRPO's per_device_train_batch_size), the sampler's 64 rows, GiB."""
    lines = ["| shape | params | completion | held (16 B/param) | activations, 8 rows, checkpointed (not) | "
             "KV cache, 64 rows, bf16 | TRL's bf16 logits, 8 rows | fastppo peak (cache freed / kept) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in SHAPES.values():
        for t in lengths:
            on, off = grpo_step(s, prompt, t), grpo_step(s, prompt, t, checkpointing=False)
            kept = grpo_step(s, prompt, t, kept_cache=True)
            lines.append(f"| {s.name} | {s.parameters() / 1e9:.2f} B | {t:,} | {on.held / GiB:.1f} | "
                         f"{on.activations / GiB:.1f} ({off.activations / GiB:.1f}) | {on.kv_cache / GiB:.1f} | "
                         f"{on.unfused_logits / GiB:.1f} | {on.peak / GiB:.1f} / {kept.peak / GiB:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per row")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="completion lengths")
    args = parser.parse_args()
    print(table(tuple(args.lengths), args.prompt))
