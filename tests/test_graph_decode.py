"""The CUDA graph decode (``compiled_decode_backend="cuda_graph"``): the model's eager step over static buffers,
captured once per bucket and replayed. On a CPU the same step runs uncaptured (``capture=False``), which checks
everything but the capture itself: the 4-D masks, the explicit cache position, the buffers' reuse across
rollouts. On CUDA it is captured, and the tokens must still be the eager sampler's for the same random state."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastppo import PPOConfig, PPOTrainer
from fastppo.errors import SettingsError
from fastppo.static_decode import (COMPILED_DECODE_MIN_ITERATIONS, StaticDecoder, compiled_decode_enabled,
                                   resolve_backend)
from test_static_decode import both_samplers, frequent_tokens, left_padded

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def graph_decoder(lm, device, said=None):
    return StaticDecoder(lm, backend="cuda_graph", capture=device == "cuda",
                         log=(said.append if said is not None else None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_same_tokens_as_eager_across_rollouts_and_weight_updates(model_dir, device, attention):
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention).to(device)
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    said: list[str] = []
    decoder = graph_decoder(lm, device, said)
    ids, mask = left_padded(5, 11, vocab, [0, 3, 7, 1, 10], device, gen)  # batch 5: a bucket of 8
    stops = frequent_tokens(lm, ids, mask)
    eager, graphed = both_samplers(lm, decoder, ids, mask, 12, stops, seed=1)
    assert torch.equal(graphed, eager)
    stopped = torch.isin(eager, torch.tensor(stops, device=device)).any(1)
    assert stopped.any() and not stopped.all(), "the stop id should end some rows and not others"
    (step,) = decoder._graphed.values()
    assert step._mask_kind == {"sdpa": "bool", "eager": "additive"}[attention]
    assert (step.graph is not None) == (device == "cuda"), step.capture_error
    # later rollouts: other prompts in the same buckets, no stop ids, weights changed in place (the optimizer's
    # update): the same graph replayed reads the new weights
    for seed, rows, width in ((2, 5, 11), (3, 7, 19), (4, 6, 30)):
        ids, mask = left_padded(rows, width, vocab, range(0, 2 * rows, 2), device, gen)
        eager, graphed = both_samplers(lm, decoder, ids, mask, 12, stops if seed != 3 else [], seed=seed)
        assert torch.equal(graphed, eager), (seed, rows, width)
        with torch.no_grad():
            for p in lm.parameters():
                p.add_(torch.randn(p.shape, generator=gen).to(device) * 0.05)
    assert list(decoder._graphed) == [(8, 64)] and decoder._graphed[(8, 64)] is step
    assert sum("the decode step (batch 8, cache 64 positions)" in s for s in said) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_weights_moved_elsewhere_are_captured_again(model_dir, device):
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    gen = torch.Generator().manual_seed(5)
    said: list[str] = []
    decoder = graph_decoder(lm, device, said)
    ids, mask = left_padded(4, 9, lm.config.vocab_size, [0, 2, 5, 8], device, gen)
    both_samplers(lm, decoder, ids, mask, 6, [], seed=0)
    first = decoder._graphed[(4, 64)]
    with torch.no_grad():  # new storage, as a checkpoint loaded with assign=True gives
        for p in lm.parameters():
            p.data = p.data + torch.randn(p.shape, generator=gen).to(device) * 0.05
    eager, graphed = both_samplers(lm, decoder, ids, mask, 6, [], seed=1)
    assert torch.equal(graphed, eager)
    assert decoder._graphed[(4, 64)] is not first
    assert any("weights moved" in s for s in said)


@pytest.mark.parametrize("device", DEVICES)
def test_under_bf16_autocast_in_separate_regions(model_dir, device):
    # the rollout's autocast region ends after each rollout and frees autocast's cached weight casts: a graph that
    # read them would replay garbage in the next region; it casts the weights itself, so each region's tokens are
    # the eager sampler's
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    gen = torch.Generator().manual_seed(3)
    decoder = graph_decoder(lm, device)
    for seed in (4, 5, 6):
        ids, mask = left_padded(4, 9, lm.config.vocab_size, [0, 2, 5, 8], device, gen)
        with torch.autocast(device, dtype=torch.bfloat16):
            eager, graphed = both_samplers(lm, decoder, ids, mask, 10, [], seed=seed)
        torch.empty(64 << 20, dtype=torch.uint8, device=device).fill_(0xFF)  # reuse whatever memory was freed
        assert torch.equal(graphed, eager), seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph capture needs CUDA")
def test_a_step_that_cannot_be_captured_is_said_and_runs_uncaptured(model_dir, monkeypatch):
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda")
    forward = lm.forward

    def syncing_forward(*args, **kwargs):  # a host sync: not capturable
        out = forward(*args, **kwargs)
        out.logits.sum().item()
        return out

    monkeypatch.setattr(lm, "forward", syncing_forward)
    said: list[str] = []
    decoder = graph_decoder(lm, "cuda", said)
    ids, mask = left_padded(4, 9, lm.config.vocab_size, [0, 2, 5, 8], "cuda", torch.Generator().manual_seed(2))
    eager, graphed = both_samplers(lm, decoder, ids, mask, 8, [], seed=3)
    assert torch.equal(graphed, eager)  # the draws after the failed capture work, and are the eager ones
    (step,) = decoder._graphed.values()
    assert step.graph is None and step.capture_error
    assert sum("could not be captured as a CUDA graph" in s for s in said) == 1
    torch.rand(3, device="cuda")  # the CUDA generator is out of capture mode for everyone after it


def test_the_backend_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cuda) == "cuda_graph" and resolve_backend("auto", cpu) == "inductor"
    assert resolve_backend("inductor", cuda) == "inductor"
    with pytest.raises(SettingsError, match="compiled_decode_backend='cuda_graph' needs a CUDA device"):
        resolve_backend("cuda_graph", cpu)
    with pytest.raises(SettingsError, match="compiled_decode_backend must be one of auto, cuda_graph, inductor"):
        resolve_backend("graphs", cuda)
    # the graph backend costs milliseconds: on for a short run; inductor's compile only for runs that win it back
    short = COMPILED_DECODE_MIN_ITERATIONS - 1
    assert compiled_decode_enabled(None, cuda, iterations=1, backend="cuda_graph") is True
    assert compiled_decode_enabled(None, cuda, iterations=1) is True  # auto on CUDA is the graph
    assert compiled_decode_enabled(None, cuda, iterations=short, backend="inductor") is False
    assert compiled_decode_enabled(True, cuda, iterations=1, backend="inductor") is True
    assert compiled_decode_enabled(None, cpu, backend="cuda_graph") is False  # off on a CPU: nothing to resolve
    with pytest.raises(SettingsError, match="needs a CUDA device"):
        compiled_decode_enabled(True, cpu, backend="cuda_graph")


@pytest.mark.parametrize("backend, compiled, match", [
    ("graphs", None, "compiled_decode_backend must be one of auto, cuda_graph, inductor, got 'graphs'"),
    ("cuda_graph", True, "compiled_decode_backend='cuda_graph' needs a CUDA device, and the policy is on cpu"),
])
def test_the_trainer_refuses_a_backend_it_cannot_run(tmp_path, model_dir, backend, compiled, match):
    args = PPOConfig(output_dir=str(tmp_path), sft_model_path=model_dir, reward_model_path=None,
                     compiled_decode=compiled, compiled_decode_backend=backend, per_device_train_batch_size=4,
                     gradient_accumulation_steps=1, response_length=8, total_episodes=8, save_strategy="no",
                     report_to=[], num_sample_generations=0, disable_tqdm=True, use_cpu=True)
    with pytest.raises(SettingsError, match=match):
        PPOTrainer(args=args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_prompt_is_prefilled_once_and_the_tokens_are_the_unshared_ones(model_dir, device, attention):
    """group_size k: one prefill row per prompt, its keys and values written to the group's k rows of the static
    cache (and to the bucket's padding rows: 3 prompts × 2 = 6 rows in a bucket of 8); the same random state draws
    what the unshared prefill draws, with stop ids that end some rows, and a chunk that splits a group (or rows that
    are not groups) prefills every row."""
    from fastppo.generation import Sampling, sample_responses

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention).to(device)
    gen = torch.Generator().manual_seed(13)
    ids, mask = left_padded(3, 10, lm.config.vocab_size, [0, 4, 7], device, gen)
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    stops = frequent_tokens(lm, ids, mask)
    decoder = graph_decoder(lm, device)
    prefill_rows: list[int] = []
    hook = lm.register_forward_pre_hook(
        lambda m, a, kw: prefill_rows.append(kw["input_ids"].shape[0]) if kw["input_ids"].shape[1] > 1 else None,
        with_kwargs=True)
    drawn = {}
    try:
        for group, chunk in ((1, 6), (2, 6), (1, 3), (2, 3)):
            prefill_rows.clear()
            torch.manual_seed(3)
            drawn[group, chunk] = sample_responses(lm, ids, mask, 12, Sampling(1.0, stops, 0), chunk, decoder=decoder,
                                                   group_size=group)
            drawn[group, chunk, "prefill"] = list(prefill_rows)
    finally:
        hook.remove()
    assert drawn[1, 6, "prefill"] == [8] and drawn[2, 6, "prefill"] == [3] and drawn[2, 3, "prefill"] == [4, 4]
    assert torch.equal(drawn[2, 6], drawn[1, 6])
    assert torch.equal(drawn[2, 3], drawn[1, 3])  # a chunk's draws come from the stream chunk by chunk
    stopped = torch.isin(drawn[1, 6], torch.tensor(stops, device=device)).any(1)
    assert stopped.any() and not stopped.all()
    assert not torch.equal(drawn[1, 6][0], drawn[1, 6][1])  # a group's rows draw apart after the shared prefill
