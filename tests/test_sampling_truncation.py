"""TRL GRPO's sampling settings (top_k, top_p, min_p, repetition_penalty): the sampler draws from transformers'
processed distribution (the same tokens as ``generate`` from the same random state), and the trained log-probs,
old and new, are that distribution's (checked against a full-logits reference, gradients included), so the first
ratio is exactly 1; ``generation_kwargs`` set them or are refused by name."""
from __future__ import annotations

import math

import datasets
import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import fastppo.sampling as S
from fastppo import GRPOConfig, GRPOTrainer
from fastppo.data import left_pad
from fastppo.errors import SettingsError
from fastppo.generation import Sampling, sample_responses
from fastppo.sampling import History, Truncation, process_logits, processed_token_logprobs, seen_tokens

pytestmark = pytest.mark.usefixtures("reference_path")


def random_lm(vocab=64, seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, pad_token_id=0, eos_token_id=1,
                                        bos_token_id=None)).eval()


def transformers_processed(logits, ids, temperature, t: Truncation):
    scores = RepetitionPenaltyLogitsProcessor(t.repetition_penalty)(ids, logits.clone())
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if t.top_k:
        scores = TopKLogitsWarper(t.top_k)(ids, scores)
    scores = TopPLogitsWarper(t.top_p)(ids, scores)
    return MinPLogitsWarper(t.min_p)(ids, scores) if t.min_p else scores


@pytest.mark.parametrize("seed", range(12))
def test_the_processed_logits_are_transformers(seed):
    g = torch.Generator().manual_seed(seed)
    v = 40
    logits = torch.randn(5, v, generator=g) * 3
    logits[0, :6] = logits[0, 0]  # ties at the top-k boundary are kept, as transformers keeps them
    ids = torch.randint(0, v, (5, 9), generator=g)
    t = Truncation(top_k=int(torch.randint(0, 12, (), generator=g)), top_p=0.3 + 0.7 * torch.rand((), generator=g).item(),
                   min_p=[None, 0.05, 0.3][seed % 3], repetition_penalty=[1.0, 1.3, 0.8][seed % 3])
    ours = process_logits(logits, 0.7, t, seen_tokens(ids, torch.ones_like(ids, dtype=torch.bool), v))
    theirs = transformers_processed(logits, ids, 0.7, t)
    assert torch.equal(ours.isinf(), theirs.isinf())
    torch.testing.assert_close(ours[~ours.isinf()], theirs[~theirs.isinf()], rtol=0, atol=1e-6)
    # the defaults are the plain distribution, bit for bit
    assert torch.equal(process_logits(logits, 0.7, Truncation(), None), logits / 0.7)


@pytest.mark.parametrize("truncation", [Truncation(top_k=5), Truncation(top_p=0.8, min_p=0.05),
                                        Truncation(top_k=20, top_p=0.9, repetition_penalty=1.4)])
def test_the_sampler_draws_the_tokens_generate_draws(truncation):
    """Same random state, same tokens as transformers' generate with the same processors (equal-length prompts:
    transformers' repetition penalty would also count left padding, which fastppo's does not)."""
    lm = random_lm()
    queries, mask = left_pad([[3, 4, 5, 3], [6, 7, 6, 6], [7, 8, 9, 10]], pad_id=0)
    torch.manual_seed(7)
    ours = sample_responses(lm, queries, mask, 10, Sampling(0.8, truncation=truncation), chunk=4)
    lm.generation_config = GenerationConfig()
    torch.manual_seed(7)
    gen = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=truncation.top_k,
                           top_p=truncation.top_p, min_p=truncation.min_p,
                           repetition_penalty=truncation.repetition_penalty, pad_token_id=0, eos_token_id=[])
    theirs = lm.generate(input_ids=queries, attention_mask=mask, generation_config=gen)[:, queries.shape[1]:]
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_the_trained_logprobs_are_the_processed_distributions(monkeypatch, penalty):
    """processed_token_logprobs (chunked, recomputed in the backward) against log_softmax of the processed full
    logits, with each token's own history; values, entropies and the gradients of hidden and weight, in float64."""
    monkeypatch.setattr(S, "CHUNK", 4)  # chunk boundaries inside the 11 tokens
    g = torch.Generator().manual_seed(3)
    b, c, t, v, h = 2, 3, 6, 30, 8
    ids = torch.randint(2, v, (b, c + t), generator=g)
    real = torch.ones(b, c + t, dtype=torch.bool)
    real[1, 0] = False  # left padding of the second prompt: not in its history
    real[1, c + 5:] = False  # the second response is 5 tokens
    history = History(ids, real, c)
    rows = torch.tensor([0] * 6 + [1] * 5)
    cols = torch.tensor(list(range(6)) + list(range(5)))
    targets = ids[rows, c + cols]
    hidden = torch.randn(len(rows), h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (2 * torch.randn(v, h, generator=g, dtype=torch.float64)).requires_grad_()
    truncation = Truncation(top_k=12, top_p=0.85, min_p=0.02, repetition_penalty=penalty)
    seen = history.seen(rows, cols, v) if penalty != 1.0 else None
    logp, entropy = processed_token_logprobs(hidden, weight, None, targets, 0.9, truncation, seen, True)
    # the reference: each token's full logits, its own history (the prompt's real tokens, the response before it)
    ref_logp, ref_entropy = [], []
    for i in range(len(rows)):
        r, col = rows[i].item(), cols[i].item()
        before = ids[r, :c + col][real[r, :c + col]]
        own = torch.zeros(v, dtype=torch.bool)
        own[before] = penalty != 1.0
        logits = (hidden[i] @ weight.T)[None]
        processed = process_logits(logits, 0.9, truncation, own[None])[0]
        # the drawn token stays in the kept set, at its penalised logit / T
        plain = process_logits(logits, 0.9, Truncation(repetition_penalty=penalty), own[None])[0]
        processed = torch.where(torch.arange(v) == targets[i], plain, processed)
        lp = processed.log_softmax(-1)
        ref_logp.append(lp[targets[i]])
        ref_entropy.append(-(lp.exp() * torch.where(lp.isinf(), 0.0, lp)).sum())
    ref_logp, ref_entropy = torch.stack(ref_logp), torch.stack(ref_entropy)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(logp).all()  # a drawn token the truncation would remove is kept
    assert (entropy < math.log(v) - 0.5).all()  # the truncation acts: below the full distribution's maximum
    w = torch.randn(len(rows), generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((w * logp).sum() + entropy.sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((w * ref_logp).sum() + ref_entropy.sum(), (hidden, weight))
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-10)


def zen():
    return datasets.Dataset.from_dict({"prompt": ["the movie was", "i think the plot is", "overall the cast",
                                                  "the ending felt"] * 4})


def test_a_grpo_run_samples_and_trains_the_processed_distribution(tmp_path, model_dir):
    """TRL's test_train_with_additional_generation_kwargs, and more: two passes over each generation batch, so the
    first pass's ratio is the scoring forward's against the update's: exactly 1."""
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=6, max_steps=4, num_iterations=2, learning_rate=1e-2, top_p=0.9,
                      top_k=10, min_p=0.01, repetition_penalty=1.1, bf16=False, gradient_checkpointing=False,
                      disable_tqdm=True, save_strategy="no", logging_steps=1, report_to="none")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
                          args=args, train_dataset=zen())
    assert trainer.actor_critic.truncation == Truncation(10, 0.9, 0.01, 1.1)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    assert len(rows) == 4 and all(math.isfinite(r["loss"]) for r in rows)  # a row per optimizer step, as TRL's
    # fastppo's own metrics of a generation batch: in the first row after it (as TRL's generation metrics)
    assert [r["train/skipped_steps"] for r in rows if "train/skipped_steps" in r] == [0, 0]
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())


def test_the_first_ratio_is_exactly_one(tmp_path, model_dir, monkeypatch):
    import fastppo.train as T

    ratios = []
    real = T.ppo_losses

    def recording(new_logprobs, new_values, entropy, inputs, *a, **k):
        mask = inputs.mask.bool()
        ratios.append((new_logprobs - inputs.old_logprobs)[mask].detach().abs().max().item())
        return real(new_logprobs, new_values, entropy, inputs, *a, **k)

    monkeypatch.setattr(T, "ppo_losses", recording)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=6, max_steps=2, num_iterations=2, top_k=8, top_p=0.8,
                      repetition_penalty=1.3, bf16=False, gradient_checkpointing=False, disable_tqdm=True,
                      save_strategy="no", report_to="none", learning_rate=1e-2)
    GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [1.0 * len(c) for c in completions],
                args=args, train_dataset=zen()).train()
    assert ratios[0] == 0.0  # the first pass over the first batch: new log-probs are the old ones, bit for bit
    assert ratios[1] > 0.0  # the second pass reads the stepped policy


@pytest.mark.parametrize("kwargs,message", [
    (dict(generation_kwargs={"num_beams": 2}), "generation_kwargs\\['num_beams'\\]=2: not supported"),
    (dict(generation_kwargs={"temperature": 0.5}), "generation_kwargs\\['temperature'\\]: set temperature"),
    (dict(generation_kwargs={"do_sample": False}), "generation_kwargs\\['do_sample'\\]=False: not supported"),
    (dict(generation_kwargs="{not json"), "generation_kwargs must be a JSON object"),
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(top_k=5, fused_policy_loss=True), "fused_policy_loss with top_k"),
])
def test_bad_sampling_settings_are_refused_by_name(tmp_path, kwargs, message):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), bf16=False, **kwargs)
    with pytest.raises(SettingsError, match=message):
        GRPOTrainer(model="unused", reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                    train_dataset=zen())


def test_generation_kwargs_set_the_sampling_settings(tmp_path, model_dir):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=1, bf16=False, gradient_checkpointing=False,
                      save_strategy="no", generation_kwargs='{"do_sample": true, "top_k": 7, "repetition_penalty": 1.2}')
    trainer = GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                          train_dataset=zen())
    assert trainer.actor_critic.truncation == Truncation(top_k=7, repetition_penalty=1.2)


def test_generation_kwargs_that_set_the_length_or_the_stop_are_honoured(tmp_path, model_dir):
    """TRL takes generation_kwargs last, so max_new_tokens overrides the completion length and eos_token_id the
    stop tokens (issue 60 item 5: both were refused as if they asked for beam search or greedy decoding)."""
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_steps=1, bf16=False, gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                      logging_steps=1, report_to="none",
                      generation_kwargs={"max_new_tokens": 3, "eos_token_id": [5, 7], "min_new_tokens": 0})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                          train_dataset=zen())
    assert trainer.config.response_length == trainer.args.max_completion_length == 3
    assert trainer.stop_ids == [5, 7]
    trainer.train()
    lengths = [r["completions/max_length"] for r in trainer.state.log_history if "completions/max_length" in r]
    assert lengths and max(lengths) <= 3


@pytest.mark.parametrize("kwargs,message", [
    (dict(generation_kwargs={"min_new_tokens": 2}), "generation_kwargs\\['min_new_tokens'\\]=2: not supported"),
    (dict(generation_kwargs={"stop_strings": ["\\n"]}), "generation_kwargs\\['stop_strings'\\]: .*set stop_token_id"),
    (dict(generation_kwargs={"max_length": 64}), "generation_kwargs\\['max_length'\\]: .*set max_completion_length"),
    (dict(generation_kwargs={"max_new_tokens": 0}), "generation_kwargs\\['max_new_tokens'\\] must be an integer >= 1"),
    (dict(generation_kwargs={"max_new_tokens": 8}, loss_type="dr_grpo"), "set max_completion_length=8 instead"),
    (dict(generation_kwargs={"eos_token_id": "eos"}), "generation_kwargs\\['eos_token_id'\\] must be a token id"),
])
def test_length_generation_kwargs_fastppo_cannot_honour_name_the_setting_to_use(tmp_path, kwargs, message):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), bf16=False, **kwargs)
    with pytest.raises(SettingsError, match=message):
        GRPOTrainer(model="unused", reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                    train_dataset=zen())


def test_the_graphed_decoder_draws_the_same_processed_tokens(model_dir):
    """The static-cache decode loop (the GPU's default, its step uncaptured here) applies the same processing and
    history: the eager loop's tokens, from the same random state."""
    from transformers import AutoModelForCausalLM

    from fastppo.static_decode import StaticDecoder

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    queries, mask = left_pad([[5, 6, 7, 5], [8, 9], [10, 11, 12]], pad_id=0)
    truncation = Truncation(top_k=6, top_p=0.9, repetition_penalty=1.5)
    torch.manual_seed(4)
    eager = sample_responses(lm, queries, mask, 8, Sampling(1.0, truncation=truncation), chunk=4)
    torch.manual_seed(4)
    static = sample_responses(lm, queries, mask, 8, Sampling(1.0, truncation=truncation), chunk=4,
                              decoder=StaticDecoder(lm, backend="cuda_graph", capture=False))
    assert torch.equal(eager, static)
    torch.manual_seed(4)
    plain = sample_responses(lm, queries, mask, 8, Sampling(1.0), chunk=4)
    assert not torch.equal(eager, plain)  # the processing changed what was drawn
