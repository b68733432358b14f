"""Sampling responses from the policy."""
from __future__ import annotations

import torch
import torch.nn as nn


@torch.no_grad()
def sample_responses(lm, queries, query_mask, response_length: int, temperature: float,
                     stop_ids: list[int], pad_id: int, chunk: int) -> torch.Tensor:
    """[B, T] sampled tokens (T = response_length), pure sampling with a KV cache.

    top_k=0 and top_p=1 keep the sampling distribution softmax(logits/T), the one scored later.
    Each row stops at its first stop id (pad after it); with no stop ids exactly T tokens
    (``eos_token_id=[]`` keeps transformers from stopping at the model's own eos).
    """
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=response_length, min_new_tokens=0, do_sample=True, temperature=temperature,
        top_k=0, top_p=1.0, eos_token_id=list(stop_ids), pad_token_id=pad_id, use_cache=True,
    )
    out = []
    for i in range(0, queries.shape[0], chunk):
        q, m = queries[i : i + chunk], query_mask[i : i + chunk]
        seq = lm.generate(input_ids=q, attention_mask=m, generation_config=gen)
        resp = seq[:, q.shape[1]:]
        if resp.shape[1] < response_length:  # every row stopped early
            resp = nn.functional.pad(resp, (0, response_length - resp.shape[1]), value=pad_id)
        out.append(resp)
    return torch.cat(out)


@torch.no_grad()
def generate_with_kwargs(lm, queries, query_mask, kwargs: dict, pad_id: int, stop_ids: list[int]) -> torch.Tensor:
    """[B, T] new tokens from ``transformers``' generate with exactly the caller's ``kwargs``: the checkpoint's
    generation_config is set aside for the call, so none of its fields (top_k, repetition_penalty, ...) leak in."""
    from transformers import GenerationConfig

    gen = GenerationConfig(**{"pad_token_id": pad_id, "eos_token_id": list(stop_ids), **kwargs})
    saved = lm.generation_config
    lm.generation_config = GenerationConfig()
    try:
        seq = lm.generate(input_ids=queries, attention_mask=query_mask, generation_config=gen)
    finally:
        lm.generation_config = saved
    return seq[:, queries.shape[1]:]


def stop_ids_of(config, tokenizer) -> list[int]:
    """The token ids a response stops at: eos with ``stop_token='eos'``, else ``stop_token_id`` (or none)."""
    if config.stop_token == "eos":
        if tokenizer.eos_token_id is None:
            raise ValueError("stop_token='eos' but the tokenizer has no eos token; pass --stop_token_id")
        return [tokenizer.eos_token_id]
    return list(config.stop_token_id or [])
