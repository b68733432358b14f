"""The compiled static-cache decode (``fastppo.static_decode``): the same tokens as the eager sampler for the same
random state, the same stop handling, the current weights read after they change, and no recompilation once a
bucket is compiled. On a CPU the step compiles with inductor (tens of seconds per model, once); on a GPU with
CUDA graphs. Each test compiles one bucket, so the module stays within a couple of minutes of CI."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastppo import PPOConfig, PPOTrainer
from fastppo.errors import SettingsError
from fastppo.generation import Sampling, sample_responses
from fastppo.static_decode import StaticDecoder, batch_bucket, compiled_decode_enabled

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def left_padded(rows: int, width: int, vocab: int, pads, device, generator):
    ids = torch.randint(3, vocab, (rows, width), generator=generator).to(device)
    mask = torch.ones(rows, width, dtype=torch.long, device=device)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return torch.where(mask.bool(), ids, 0), mask


def both_samplers(lm, decoder, ids, mask, length, stops, seed, temperature=1.0, chunk=None):
    out = []
    for dec in (None, decoder):
        torch.manual_seed(seed)
        out.append(sample_responses(lm, ids, mask, length, Sampling(temperature, stops, 0), chunk or ids.shape[0],
                                    decoder=dec))
    return out


def frequent_tokens(lm, ids, mask, k: int = 12) -> list[int]:
    """The ``k`` tokens the model samples most after these prompts: stop ids that end some rows early, not all."""
    logits = lm(input_ids=ids, attention_mask=mask).logits[:, -1]
    return logits.softmax(-1).mean(0).topk(k).indices.tolist()


def test_buckets_and_the_default():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert compiled_decode_enabled(None, torch.device("cpu")) is False
    assert compiled_decode_enabled(None, torch.device("cuda")) is True
    assert compiled_decode_enabled(True, torch.device("cpu")) is True
    assert compiled_decode_enabled(None, torch.device("cuda"), zero_stage=3) is False
    with pytest.raises(SettingsError, match="compiled_decode.*ZeRO-3"):
        compiled_decode_enabled(True, torch.device("cuda"), zero_stage=3)


def test_a_run_too_short_to_win_back_the_compile_samples_eagerly():
    """Unset on a GPU with the inductor backend, the compiled decode is on from COMPILED_DECODE_MIN_ITERATIONS
    rollouts (its compile of tens of seconds pays back after about 15-20 iterations on an H200); shorter runs sample
    eagerly and say why. Asked for, it compiles whatever the length."""
    from fastppo.static_decode import COMPILED_DECODE_MIN_ITERATIONS as MIN

    said = []
    cuda = torch.device("cuda")
    assert compiled_decode_enabled(None, cuda, iterations=MIN - 1, log=said.append, backend="inductor") is False
    assert said and f"{MIN - 1} iterations are too few" in said[0] and "compiled_decode=True" in said[0]
    assert compiled_decode_enabled(None, cuda, iterations=MIN, backend="inductor") is True
    assert compiled_decode_enabled(True, cuda, iterations=1, backend="inductor") is True
    assert compiled_decode_enabled(None, torch.device("cpu"), iterations=10**6) is False
    with pytest.raises(SettingsError, match="cache_bucket"):
        StaticDecoder(torch.nn.Linear(1, 1), cache_bucket=0)


def test_a_model_without_static_cache_support_is_refused_or_decodes_eagerly(tmp_path, model_dir, monkeypatch, caplog):
    # MPT declares no compiled static cache in transformers; a forward without logits_to_keep cannot take the step
    from transformers import MptConfig, MptForCausalLM

    mpt = MptForCausalLM(MptConfig(d_model=16, n_heads=2, n_layers=1, vocab_size=40, max_seq_len=32))
    llama = AutoModelForCausalLM.from_pretrained(model_dir)
    cuda = torch.device("cuda")  # the default's device; nothing runs on it here
    assert compiled_decode_enabled(None, cuda, lm=llama) is True
    with pytest.raises(SettingsError, match="compiled_decode: MptForCausalLM .*_can_compile_fullgraph"):
        compiled_decode_enabled(True, cuda, lm=mpt)
    with caplog.at_level(logging.INFO, logger="fastppo.static_decode"):
        assert compiled_decode_enabled(None, cuda, lm=mpt) is False
    assert "compiled decode off: MptForCausalLM" in caplog.text

    class NoKeep(torch.nn.Module):
        _can_compile_fullgraph = True

        def forward(self, input_ids, attention_mask=None, past_key_values=None):
            raise AssertionError("never called")

    with pytest.raises(SettingsError, match="NoKeep.forward takes no logits_to_keep"):
        compiled_decode_enabled(True, cuda, lm=NoKeep())
    # the trainer asks before anything runs, naming the policy's class
    monkeypatch.setattr(type(llama), "_can_compile_fullgraph", False)
    args = PPOConfig(output_dir=str(tmp_path), sft_model_path=model_dir, reward_model_path=None, compiled_decode=True,
                     per_device_train_batch_size=4, gradient_accumulation_steps=1, response_length=8,
                     total_episodes=8, save_strategy="no", report_to=[], num_sample_generations=0, disable_tqdm=True)
    with pytest.raises(SettingsError, match="compiled_decode: LlamaForCausalLM"):
        PPOTrainer(args=args)


@pytest.mark.parametrize("device", DEVICES)
def test_same_tokens_as_eager_no_recompile_and_the_current_weights(model_dir, device, caplog):
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    ids, mask = left_padded(5, 11, vocab, [0, 3, 7, 1, 10], device, gen)  # batch 5: padded to a bucket of 8
    stops = frequent_tokens(lm, ids, mask)
    decoder = StaticDecoder(lm)
    with caplog.at_level(logging.INFO, logger="fastppo.static_decode"):
        eager, compiled = both_samplers(lm, decoder, ids, mask, 12, stops, seed=1)
    assert torch.equal(compiled, eager)
    stopped = torch.isin(eager, torch.tensor(stops, device=device)).any(1)
    assert stopped.any() and not stopped.all(), "the stop id should end some rows and not others"
    assert (eager[:, -1] == 0).any()  # a stopped row is padded after its stop token
    assert list(decoder.compile_seconds) == [(8, 64)]

    # steady state: other prompts, another width and batch inside the same buckets, no stop ids, and weights
    # changed in place (as the optimizer does): no recompilation, still the eager tokens
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, rows, width in ((2, 5, 11), (3, 7, 19), (4, 6, 30)):
            ids, mask = left_padded(rows, width, vocab, range(0, 2 * rows, 2), device, gen)
            eager, compiled = both_samplers(lm, decoder, ids, mask, 12, stops if seed != 3 else [], seed=seed)
            assert torch.equal(compiled, eager), (seed, rows, width)
            with torch.no_grad():
                for p in lm.parameters():
                    p.add_(torch.randn(p.shape, generator=gen).to(device) * 0.05)
        assert (eager != 0).all() or seed != 3
    assert list(decoder.compile_seconds) == [(8, 64)]
    assert sum("the decode step (batch 8, cache 64" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_same_tokens_as_eager_on_smollm2_chat_prompts(smollm2, device):
    tokenizer = AutoTokenizer.from_pretrained(smollm2, padding_side="left")
    lm = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).to(device)
    questions = ["Reply with one word: yes or no?", "What is 2+2? Answer with a number only.", "Say hi.",
                 "Write a long story about the sea."]
    batch = tokenizer.apply_chat_template([[{"role": "user", "content": q}] for q in questions],
                                          add_generation_prompt=True, padding=True, return_tensors="pt",
                                          return_dict=True)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    eos = tokenizer.eos_token_id
    decoder = StaticDecoder(lm)
    for seed in (0, 1):
        eager, compiled = both_samplers(lm, decoder, ids * mask, mask, 24, [eos], seed=seed, temperature=0.7)
        assert torch.equal(compiled, eager), seed
    assert (eager == eos).any(), "a one-word answer should end in eos within 24 tokens"


# grpo: groups of 2 rows of one prompt, whose prompt the compiled decode prefills once (StaticDecoder.fill_shared)
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_the_trainer_with_compiled_decode_trains_exactly_as_without(tmp_path, model_dir, capsys, estimator,
                                                                   monkeypatch):
    grouped = {"advantage_estimator": "grpo", "num_generations": 2} if estimator == "grpo" else {}
    shared_fills = []
    fill = StaticDecoder.fill_shared
    monkeypatch.setattr(StaticDecoder, "fill_shared",
                        staticmethod(lambda *a: shared_fills.append(a[-1]) or fill(*a)))

    def train(compiled: bool):
        args = PPOConfig(output_dir=str(tmp_path / str(compiled)), sft_model_path=model_dir, reward_model_path=None,
                         compiled_decode=compiled, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                         num_ppo_epochs=1, response_length=8, total_episodes=12, seed=5, save_strategy="no",
                         report_to=[], num_sample_generations=0, disable_tqdm=True, stop_token="eos", **grouped)
        trainer = PPOTrainer(args=args)
        trainer.train()
        return trainer

    eager = train(False)
    assert eager._static_decoder is None
    console = capsys.readouterr().out  # what the eager loop's cache held, once per trainer
    assert console.count("eager decode: KV cache float32, 4 rows × ") == 1, console
    with torch._dynamo.config.patch(error_on_recompile=True):  # the first iteration compiles; the later two reuse it
        compiled = train(True)
    assert list(compiled._static_decoder.compile_seconds) == [(4, 64)]
    assert compiled._static_decoder._caches == {}  # freed after each rollout: no captured graph reads it on a CPU
    console = capsys.readouterr().out  # the compile time, once, on the trainer's console (not a hidden log record)
    assert console.count("the decode step (batch 4, cache 64 positions) in") == 1, console
    assert console.count("compiled decode: KV cache float32, 4 rows × 64 positions × 2 layers") == 1, console
    assert shared_fills == ([2] * 3 if estimator == "grpo" else [])  # each iteration's 2 prompts prefilled once
    for (name, a), b in zip(eager.actor_critic.state_dict().items(), compiled.actor_critic.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("device", DEVICES)
def test_under_bf16_autocast_keys_and_values_of_two_dtypes_are_cached(model_dir, device):
    # under bf16 autocast a Llama layer's keys leave the rotary embedding in fp32 and its values in bf16: the static
    # cache must hold both (transformers' StaticLayer alone raises in index_copy_), in bf16, the dtype attention reads
    # them in (fastppo.kv_cache), and the tokens stay the eager ones
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    ids, mask = left_padded(4, 9, lm.config.vocab_size, [0, 2, 5, 8], device, torch.Generator().manual_seed(3))
    decoder = StaticDecoder(lm)
    with torch.autocast(device, dtype=torch.bfloat16):
        eager, compiled = both_samplers(lm, decoder, ids, mask, 10, [], seed=4)
    assert torch.equal(compiled, eager)
    (cache,) = decoder._caches.values()
    assert {cache.layers[0].keys.dtype, cache.layers[0].values.dtype} == {torch.bfloat16}
