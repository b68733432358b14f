"""The "what fits" model (``bench/memory_model.py``): its per-token activation coefficients against a small Llama's
peak under bf16 autocast (``helpers.LiveBytes``, the slope over the batch so that weights and gradients cancel), its
step against the H200 measurements of bench/RESULTS.md at 256 tokens, and docs/performance.md's table as it
computes it."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import LiveBytes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from memory_model import MiB, SHAPES, Shape, activation_bytes_per_token, grpo_step, table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measured_bytes_per_token(s: Shape, checkpointing: bool, width: int = 256) -> float:
    """The peak's growth per token of a forward and backward under bf16 autocast, from 4 to 8 rows of ``width``."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         head_dim=s.head_dim, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peaks = []
    for rows in (4, 8):
        ids = torch.randint(0, s.vocab, (rows, width))
        with LiveBytes() as live, torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
            hidden.float().pow(2).mean().backward()  # a loss on the fp32 hidden states, as the fused head's input
        model.zero_grad(set_to_none=True)
        peaks.append(live.peak)
    return (peaks[1] - peaks[0]) / (4 * width)


SMALL = Shape("small", 6, 128, 352, 4, 2, 32, 256)


def test_activations_per_token_are_the_measured_ones():
    assert measured_bytes_per_token(SMALL, False) == pytest.approx(activation_bytes_per_token(SMALL, False), rel=0.03)
    # checkpointed, the model is a bound: the peak falls a little before every saved layer input and the recomputed
    # layer's whole backward are alive at once (measured 0.83-0.96 of it on three shapes)
    ratio = measured_bytes_per_token(SMALL, True) / activation_bytes_per_token(SMALL, True)
    assert 0.8 <= ratio <= 1.0, ratio


# bench/RESULTS.md, fourth lease (H200, GRPO, 64 completions of 256 tokens after chat prompts of at most 39 tokens, one
# micro-batch of 64 rows, no gradient checkpointing, fp32 weights under bf16 autocast): peak CUDA MiB
@pytest.mark.parametrize("shape, kept_cache, measured", [("SmolLM2-135M", False, 20159),  # eager decode
                                                         ("Qwen2.5-0.5B", True, 38416)])  # graph decode, fp32 cache
def test_the_step_is_the_gpu_measurement(shape, kept_cache, measured):
    step = grpo_step(SHAPES[shape], 39, 256, micro_rows=64, sampler_rows=64, checkpointing=False,
                     kept_cache=kept_cache, kv_dtype_bytes=4)
    assert step.peak / MiB == pytest.approx(measured, rel=0.06)


def test_the_parameter_counts_are_the_models():
    assert [round(s.parameters() / 1e6) for s in SHAPES.values()] == [135, 494, 1544, 7616]


def test_docs_hold_the_table_the_model_computes():
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        assert table() in f.read()
