"""A group's prompt run once (``share_prompts``, ``fastppo.layout.make_shared_layout``): one decoder row per group, the
prompt and then each completion, a mask by which each completion sees the prompt and itself only. The reference's
log-probs (and the full KL's hidden states) must be the unshared layout's: to 1e-12 in float64 under sdpa, to
rounding in float32 under eager attention, on ragged prompts, ragged completions, groups of 2 to 5."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from fastppo import GRPOConfig, GRPOTrainer
from fastppo.actor_critic import PolicyAndValue, Reference
from fastppo.config import PPOConfig
from fastppo.errors import SettingsError
from fastppo.layout import decoder_hidden, shared_mask_kind, token_logprobs_from_hidden
from fastppo.train import assemble, compute_experience, reference_sharing
from test_grpo_trainer import LengthReward, tutorial_dataset

_MODELS: dict = {}


def model(model_dir, dtype, attention):
    key = (dtype, attention)
    if key not in _MODELS:
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)
    return _MODELS[key]


def grouped_rollout(vocab, k, prompt_lengths, response_lengths, seed, width=None, t=None):
    """Groups of k rows sharing a left-padded prompt (its real length per group), ragged responses."""
    gen = torch.Generator().manual_seed(seed)
    groups = len(prompt_lengths)
    c = width or max(prompt_lengths) + 2
    t = t or max(response_lengths)
    queries = torch.randint(3, vocab, (groups, c), generator=gen)
    mask = torch.zeros(groups, c, dtype=torch.long)
    for g, ql in enumerate(prompt_lengths):
        mask[g, c - ql:] = 1
    queries, mask = (queries * mask).repeat_interleave(k, 0), mask.repeat_interleave(k, 0)
    responses = torch.randint(3, vocab, (groups * k, t), generator=gen)
    real = torch.zeros(groups * k, t, dtype=torch.bool)
    for i, rl in enumerate(response_lengths):
        real[i, :rl] = True
    return assemble(queries, mask, responses * real, real, torch.zeros(groups * k, dtype=torch.bool))


def logprobs(lm, layout):
    with torch.no_grad():
        hidden = decoder_hidden(lm, layout).index_select(0, layout.gather)
        return layout.scatter(token_logprobs_from_hidden(lm, hidden, layout.targets, 1.0, False)), hidden


@settings(max_examples=12, deadline=None)
@given(k=st.integers(2, 5), groups=st.integers(1, 3), data=st.data())
def test_shared_layout_gives_the_unshared_log_probs_in_float64(model_dir, k, groups, data):
    lm = model(model_dir, torch.float64, "sdpa")
    prompts = data.draw(st.lists(st.integers(1, 9), min_size=groups, max_size=groups))
    responses = data.draw(st.lists(st.integers(1, 7), min_size=groups * k, max_size=groups * k))
    rollout = grouped_rollout(lm.config.vocab_size, k, prompts, responses, seed=data.draw(st.integers(0, 99)))
    want, want_hidden = logprobs(lm, rollout.layout(None, False))
    shared = rollout.layout(None, shared=(k, "bool", torch.float64))
    got, hidden = logprobs(lm, shared)
    assert shared.input_ids.shape[0] == groups  # one decoder row per group
    assert shared.input_ids.shape[1] == max(p + sum(responses[g * k:(g + 1) * k]) for g, p in enumerate(prompts))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=1e-12)  # the full KL pairs these up
    assert rollout.groups_share_prompts(k)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_layout_in_float32_and_both_attentions(model_dir, attention):
    lm = model(model_dir, torch.float32, attention)
    rollout = grouped_rollout(lm.config.vocab_size, 3, [4, 9], [6, 1, 3, 2, 5, 4], seed=1)
    want, _ = logprobs(lm, rollout.layout(None, False))
    got, _ = logprobs(lm, rollout.layout(None, shared=(3, shared_mask_kind(lm), torch.float32)))
    assert shared_mask_kind(lm) == {"sdpa": "bool", "eager": "additive"}[attention]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert want.abs().max() > 1.0  # real log-probs, not zeros


def test_rows_that_are_not_groups_of_one_prompt_are_not_shared(model_dir):
    rollout = grouped_rollout(64, 2, [3, 5], [2, 2, 3, 1], seed=2)
    assert rollout.groups_share_prompts(2) and not rollout.groups_share_prompts(4) and not rollout.groups_share_prompts(3)
    q = rollout.query_responses.clone()
    q[1, rollout.context_length - 1] += 1  # the second row of the first group now has another prompt
    other = assemble(q[:, :rollout.context_length], rollout.attention_mask[:, :rollout.context_length],
                     q[:, rollout.context_length:], rollout.response_mask, rollout.has_stop)
    assert not other.groups_share_prompts(2)
    config = PPOConfig(output_dir=None, advantage_estimator="grpo", num_generations=2, beta=0.04)
    lm = model(model_dir, torch.float32, "sdpa")
    reference = Reference(lm, lm)
    assert reference_sharing(config, reference, rollout, chunk=4) == (2, "bool", torch.float32)
    assert reference_sharing(config, reference, other, chunk=4) is None
    assert reference_sharing(config, reference, rollout, chunk=3) is None  # a chunk would split a group
    assert reference_sharing(config, None, rollout, chunk=4) is None
    off = PPOConfig(output_dir=None, advantage_estimator="grpo", num_generations=2, beta=0.04, share_prompts=False)
    assert reference_sharing(off, reference, rollout, chunk=4) is None


def test_compute_experience_with_the_shared_reference_and_the_full_kl(model_dir):
    policy = model(model_dir, torch.float64, "sdpa")
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype) * 0.02)
    rollout = grouped_rollout(policy.config.vocab_size, 4, [5, 2, 8], [3, 1, 4, 2, 6, 5, 1, 2, 3, 3, 4, 2], seed=4)
    actor = PolicyAndValue(policy, None, critic=False)
    for estimator in ("k3", "full"):
        plain = compute_experience(actor, Reference(ref, policy), rollout, 1.0, estimator, chunk=8)
        shared = compute_experience(actor, Reference(ref, policy), rollout, 1.0, estimator, chunk=8,
                                    shared=(4, "bool", torch.float64))
        torch.testing.assert_close(shared.ref_logprobs, plain.ref_logprobs, rtol=0, atol=1e-12)
        torch.testing.assert_close(shared.kl, plain.kl, rtol=0, atol=1e-12)
        assert plain.kl.abs().max() > 1e-4  # the reference differs from the policy


def odd_tokens(completion_ids, **kwargs):  # varies within a group: the weights move, and π_θ leaves π_ref
    return [float(sum(t % 2 for t in ids)) for ids in completion_ids]


def test_a_grpo_run_with_the_reference_shared_trains_as_without(tmp_path, model_dir):
    def run(share):
        args = GRPOConfig(output_dir=str(tmp_path / str(share)), num_generations=4, per_device_train_batch_size=8,
                          max_completion_length=6, max_steps=2, logging_steps=1, bf16=False, disable_tqdm=True,
                          gradient_checkpointing=False, save_strategy="no", report_to="none", beta=0.04,
                          learning_rate=1e-3, share_prompts=share, seed=3)
        trainer = GRPOTrainer(model=model_dir, reward_funcs=odd_tokens, args=args, train_dataset=tutorial_dataset())
        trainer.train()
        return trainer

    shared, plain = run(None), run(False)
    kl = [[row["kl"] for row in t.state.log_history if "kl" in row and "train_runtime" not in row]
          for t in (shared, plain)]
    assert kl[1][-1] > 0
    assert kl[0] == pytest.approx(kl[1], rel=1e-4, abs=1e-7)
    for (name, a), b in zip(shared.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_share_prompts_settings_are_checked(tmp_path, model_dir, monkeypatch):
    with pytest.raises(SettingsError, match="share_prompts shares a group's prompt, and num_generations is 1"):
        GRPOTrainer(model=model_dir, reward_funcs=LengthReward(), train_dataset=tutorial_dataset(), args=GRPOConfig(
            output_dir=str(tmp_path / "a"), num_generations=1, per_device_train_batch_size=4, share_prompts=True,
            bf16=False, report_to="none"))
    import fastppo.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "shared_mask_kind", lambda model: None)  # as for flash attention
    with pytest.raises(SettingsError, match="share_prompts: the reference model's attention"):
        GRPOTrainer(model=model_dir, reward_funcs=LengthReward(), train_dataset=tutorial_dataset(), args=GRPOConfig(
            output_dir=str(tmp_path / "b"), num_generations=4, per_device_train_batch_size=8, share_prompts=True,
            max_completion_length=8,
            beta=0.04, bf16=False, report_to="none"))
