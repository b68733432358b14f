"""The samplers' KV caches (``fastppo.kv_cache``): under bf16 autocast they hold bf16 keys and values (not the fp32
keys the rotary embedding hands them) and give the same logits, bit for bit, as a cache that keeps what it is given;
the static decode frees its caches between rollouts where no captured graph reads them, and says what they hold."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from fastppo.generation import Sampling, sample_responses
from fastppo.layout import cache_keyword
from fastppo.kv_cache import casts_to_compute_dtype, compute_dtype_layers, describe, new_dynamic_cache, stored_dtype
from fastppo.static_decode import StaticDecoder
from test_static_decode import both_samplers, left_padded


def tiny(model_dir, attention: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)


def decode_logits(lm, cache, ids, mask, steps: int = 4) -> torch.Tensor:
    """The prefill's and ``steps`` greedy decode steps' last logits [steps + 1, B, V] over ``cache``."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = []
    logits = lm(input_ids=ids, attention_mask=mask, position_ids=positions, **{cache_keyword(lm): cache},
                use_cache=True).logits[:, -1]
    for _ in range(steps):
        out.append(logits)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        positions = positions[:, -1:] + 1
        logits = lm(input_ids=logits.argmax(-1, keepdim=True), attention_mask=mask, position_ids=positions,
                    **{cache_keyword(lm): cache}, use_cache=True).logits[:, -1]
    out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_under_bf16_autocast_the_caches_hold_bf16_and_the_logits_are_unchanged(model_dir, attention):
    lm = tiny(model_dir, attention)
    ids, mask = left_padded(3, 7, lm.config.vocab_size, [0, 2, 4], "cpu", torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        as_given = DynamicCache(config=lm.config)  # transformers' own: fp32 keys, bf16 values
        reference = decode_logits(lm, as_given, ids, mask)
        dynamic = new_dynamic_cache(lm)
        static = compute_dtype_layers(StaticCache(config=lm.config, max_cache_len=16), lm)
        promoted = compute_dtype_layers(StaticCache(config=lm.config, max_cache_len=16), lm, cast=False)
        runs = {name: decode_logits(lm, c, ids, mask) for name, c in
                (("dynamic", dynamic), ("static", static), ("promoted", promoted))}
    assert as_given.layers[0].keys.dtype == torch.float32  # what the compute dtype saves
    for cache in (dynamic, static):
        assert {t.dtype for layer in cache.layers for t in (layer.keys, layer.values)} == {torch.bfloat16}
    assert promoted.layers[0].keys.dtype == torch.float32
    torch.testing.assert_close(runs["dynamic"], reference, rtol=0, atol=0)
    # the static cache's masked tail changes the sum's shape, not a value: equal to the promoted static cache's
    torch.testing.assert_close(runs["static"], runs["promoted"], rtol=0, atol=0)


def test_outside_autocast_or_with_another_attention_the_dtype_is_kept(model_dir):
    lm = tiny(model_dir)
    keys, values = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.bfloat16)
    assert stored_dtype(keys, values, cast=True) == torch.float32  # no autocast: promoted
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert stored_dtype(keys, values, cast=True) == torch.bfloat16
        assert stored_dtype(keys, values, cast=False) == torch.float32
    assert casts_to_compute_dtype(lm)
    lm.config._attn_implementation = "flash_attention_2"  # reads the cache with its own casts: left as it comes
    assert not casts_to_compute_dtype(lm)
    with torch.no_grad():
        cache = new_dynamic_cache(tiny(model_dir))
        decode_logits(tiny(model_dir), cache, *left_padded(2, 5, lm.config.vocab_size, [0, 1], "cpu",
                                                             torch.Generator().manual_seed(2)), steps=1)
    assert cache.layers[0].keys.dtype == torch.float32


def test_describe_says_dtype_rows_positions_layers_and_mib(model_dir):
    lm = tiny(model_dir)
    cache = compute_dtype_layers(StaticCache(config=lm.config, max_cache_len=64), lm)
    assert describe(cache) == "KV cache empty"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lm(input_ids=torch.ones(4, 3, dtype=torch.long), **{cache_keyword(lm): cache}, use_cache=True)
    c = lm.config
    mib = 4 * 64 * c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2 / 2**20
    assert describe(cache) == f"KV cache bfloat16, 4 rows × 64 positions × {c.num_hidden_layers} layers, {mib:.1f} MiB"


def test_the_static_decode_frees_its_caches_between_rollouts_where_no_graph_reads_them(model_dir):
    # the cuda_graph backend uncaptured (what runs without a GPU): nothing holds the caches' addresses
    lm = tiny(model_dir)
    said: list[str] = []
    decoder = StaticDecoder(lm, backend="cuda_graph", capture=False, log=said.append)
    gen = torch.Generator().manual_seed(5)
    ids, mask = left_padded(4, 9, lm.config.vocab_size, [0, 2, 5, 8], "cpu", gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager, static = both_samplers(lm, decoder, ids, mask, 10, [], seed=4)
    assert torch.equal(static, eager)
    (key,) = decoder._caches
    assert key == (4, 64)
    c = lm.config
    mib = 4 * 64 * c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2 / 2**20
    assert [s for s in said if "KV cache" in s] == [f"compiled decode: KV cache bfloat16, 4 rows × 64 positions × 2 layers, {mib:.1f} MiB "
                    "(freed after each rollout)"]
    decoder.release()
    assert decoder._caches == {}
    # the next rollout makes a fresh cache, and draws the eager sampler's tokens again; a second bucket in one rollout
    # frees the first's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager, static = both_samplers(lm, decoder, ids, mask, 10, [], seed=6)
        assert torch.equal(static, eager)
        wide, wide_mask = left_padded(2, 70, lm.config.vocab_size, [0, 3], "cpu", gen)
        eager, static = both_samplers(lm, decoder, wide, wide_mask, 6, [], seed=7)
        assert torch.equal(static, eager)
    assert list(decoder._caches) == [(2, 128)]
    assert sum("KV cache" in s for s in said) == 2  # once per bucket
    # a bucket whose step a CUDA graph replays keeps its cache (the graph reads its addresses)
    decoder._graphed[(2, 128)].graph = object()
    decoder.release()
    assert list(decoder._caches) == [(2, 128)]


def test_a_cache_made_under_autocast_is_not_reused_outside_it(model_dir):
    lm = tiny(model_dir)
    decoder = StaticDecoder(lm, backend="cuda_graph", capture=False)
    ids, mask = left_padded(2, 5, lm.config.vocab_size, [0, 1], "cpu", torch.Generator().manual_seed(8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sample_responses(lm, ids, mask, 4, Sampling(1.0, [], 0), 2, decoder=decoder)
    assert next(iter(decoder._caches.values())).layers[0].keys.dtype == torch.bfloat16
    eager, static = both_samplers(lm, decoder, ids, mask, 4, [], seed=9)  # fp32, in the same bucket
    assert torch.equal(static, eager)
    assert next(iter(decoder._caches.values())).layers[0].keys.dtype == torch.float32
