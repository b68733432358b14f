"""Scripted tool-calling turns for the tests: a byte-level tokenizer whose chat template renders tool calls in Qwen
2.5's format, two tools, a call's text, and ``Script``, which stands in for the sampler (as TRL's tests stand in for
``generate``): each call returns the next turn's texts."""
from __future__ import annotations

import asyncio
import json

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from fastppo.tools import CHATML_TOOL_TEMPLATE

TEMPLATE = CHATML_TOOL_TEMPLATE  # Qwen 2.5's tool format in a short ChatML template


def byte_tokenizer(template=TEMPLATE):
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # one order every time
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = template
    return tok


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


async def slow_add(a: int, b: int) -> int:
    """Adds two integers, slowly.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0.01)
    return a + b


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class Script:
    """The sampler replaced: each call returns the next turn's texts, one per row it is asked for."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.rows, self.contexts = tok, turns, [], []

    def __call__(self, queries, mask, length, temperature, synced):
        texts = self.turns[len(self.rows)]
        self.rows.append(queries.shape[0])
        self.contexts.append([q[m.bool()].tolist() for q, m in zip(queries, mask)])
        assert queries.shape[0] == len(texts)
        out = torch.full((len(texts), length), self.tok.pad_token_id)
        for i, text in enumerate(texts):
            ids = self.tok(text, add_special_tokens=False)["input_ids"][:length]
            out[i, :len(ids)] = torch.tensor(ids)
        return out


class Counter:
    """An environment: a counter the model raises with its tool; the reward is the count."""

    def __init__(self):
        self.count, self.resets = 0, []

    def reset(self, **row):
        self.count = 0
        self.resets.append(row)
        return " Count to one."

    def increment(self, step: int) -> int:
        """Raises the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)
