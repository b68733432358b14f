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
from fastppo.train import Scoring, compute_experience
from fastppo.sharing import reference_sharing
from fastppo.rollout import assemble
from test_grpo_trainer import tutorial_dataset

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
        plain = compute_experience(actor, Reference(ref, policy), rollout, Scoring(1.0, estimator, 8))
        shared = compute_experience(actor, Reference(ref, policy), rollout,
                                    Scoring(1.0, estimator, 8, shared=(4, "bool", torch.float64)))
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

    shared, plain = run(True), run(False)
    kl = [[row["kl"] for row in t.state.log_history if "kl" in row and "train_runtime" not in row]
          for t in (shared, plain)]
    assert kl[1][-1] > 0
    assert kl[0] == pytest.approx(kl[1], rel=1e-4, abs=1e-7)
    # the update's forward and backward share too: fp32 rounding apart, which Adam turns into steps of up to the
    # learning rate on the few entries whose gradient is near 0 (measured: 2 of 4,096 entries, 8e-6 apart)
    for (name, a), b in zip(shared.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.parametrize("dtype,attention,atol", [(torch.float64, "sdpa", 1e-12), (torch.float32, "eager", 2e-5),
                                                  (torch.float32, "sdpa", 2e-5)])
def test_the_update_forward_and_backward_with_shared_prompts_equal_unshared(model_dir, dtype, attention, atol,
                                                                             monkeypatch):
    """The trained forward (``PolicyAndValue``, the update's call) on the shared layout: the same log-probs and
    entropies, and every parameter's gradient of a loss that weights each token differently, as the unshared
    layout's (autograd sums each prompt activation's gradient over its group). Ragged left-padded prompts,
    ragged completions, 3 groups of 4; float64 to 1e-12, float32 to rounding (relative to each gradient's scale).

    In float64, transformers' ``LlamaRMSNorm`` still computes in float32 (it upcasts to float32, not to float64):
    each token's forward is the same either way (1e-12), but the group's summed gradients pass through that float32
    norm in another order, 1e-7 of their scale apart. The float64 case runs a norm that keeps float64."""
    if dtype == torch.float64:
        from transformers.models.llama import modeling_llama

        def float64_norm(self, hidden_states):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
        monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", float64_norm)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)
    actor = PolicyAndValue(lm, None, critic=False)
    rollout = grouped_rollout(lm.config.vocab_size, 4, [5, 2, 8], [3, 1, 4, 2, 6, 5, 1, 2, 3, 3, 4, 2], seed=5)
    weights = torch.randn(rollout.response_mask.shape, generator=torch.Generator().manual_seed(6), dtype=dtype)
    results = []
    for shared in (None, (4, shared_mask_kind(lm), dtype)):
        lm.zero_grad()
        out = actor(rollout.layout(None, shared=shared), 0.8, return_entropy=True)
        mask = rollout.response_mask
        ((out.logprobs * weights * mask).sum() + 0.1 * (out.entropy * mask).sum()).backward()
        results.append((out.logprobs.detach(), out.entropy.detach(),
                        {n: p.grad.clone() for n, p in lm.named_parameters()}))
    (logp, ent, grads), (s_logp, s_ent, s_grads) = results
    torch.testing.assert_close(s_logp, logp, rtol=0, atol=atol)
    torch.testing.assert_close(s_ent, ent, rtol=0, atol=atol)
    for name, g in grads.items():
        scale = g.abs().max().item()
        assert scale > 0, name  # every parameter takes part
        torch.testing.assert_close(s_grads[name], g, rtol=0, atol=atol * max(scale, 1.0), msg=name)


def test_grpo_updates_share_prompts_only_where_they_can(model_dir):
    """update_sharing: micro-batches and minibatches of whole groups, no token budget, a value model whose attention
    takes the policy's mask."""
    from fastppo.sizes import derive_sizes
    from fastppo.sharing import update_sharing

    lm = model(model_dir, torch.float32, "sdpa")
    rollout = grouped_rollout(lm.config.vocab_size, 2, [3, 5], [2, 2, 3, 1], seed=2)

    def sharing(value_model=None, **kw):
        config = PPOConfig(output_dir=None, advantage_estimator="grpo", num_generations=2,
                           **{"per_device_train_batch_size": 4, **kw})
        actor = (type("Critic", (), {"critic": True, "policy": lm, "value_model": value_model})() if value_model
                 else PolicyAndValue(lm, None, False))
        return update_sharing(config, derive_sizes(config, 1, 8), actor, rollout)

    assert sharing() == (2, "bool", torch.float32)
    # a value model reads the same layout: the same mask kind and dtype, or no sharing
    assert sharing(value_model=model(model_dir, torch.float32, "sdpa")) == (2, "bool", torch.float32)
    assert sharing(value_model=model(model_dir, torch.float32, "eager")) is None
    assert sharing(value_model=model(model_dir, torch.float64, "sdpa")) is None
    assert sharing(max_tokens_per_micro_batch=64) is None
    assert sharing(share_prompts=False) is None
    assert sharing(per_device_train_batch_size=1, gradient_accumulation_steps=4) is None  # micro-batches of one row
    assert sharing(per_device_train_batch_size=2, gradient_accumulation_steps=2) == (2, "bool", torch.float32)


@pytest.mark.parametrize("prompt,completion,k,shares", [
    (39, 64, 8, True),  # bench/grpo_baseline.py's chat prompts
    (500, 64, 8, True),  # a long prompt
    (39, 16, 4, True),
    (39, 256, 16, False),  # long completions in a large group: the shared row's L² outgrows the prompt saved
    (10, 200, 16, False),
])
def test_the_prompt_is_shared_where_it_saves_work(prompt, completion, k, shares):
    """share_prompts unset shares where the shared layout costs fewer FLOPs (SmolLM2-135M's shape, on the meta
    device: no weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastppo.layout import shared_layout_saves_work

    shape = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3)
    with torch.device("meta"):
        lm = LlamaForCausalLM(shape)
    assert shared_layout_saves_work(lm, [prompt] * k, [completion] * k, k) is shares



def test_the_sampler_prefills_each_prompt_once_and_draws_the_same_tokens(model_dir):
    """The eager decode with group_size k: one prefill row per prompt, its KV cache copied to the group's k rows;
    the same random state draws the same tokens as the unshared prefill. Rows that are not groups of one prompt
    (a chunk that splits a group, or other prompts) prefill every row."""
    from fastppo.generation import Sampling, prompt_groups, sample_responses

    lm = model(model_dir, torch.float32, "sdpa")
    rollout = grouped_rollout(lm.config.vocab_size, 4, [5, 2], [1] * 8, seed=8)
    c = rollout.context_length
    queries, mask = rollout.query_responses[:, :c], rollout.attention_mask[:, :c]
    prefill_rows = []
    hook = lm.register_forward_pre_hook(lambda m, a, kw: prefill_rows.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        drawn = {}
        for group, chunk in ((1, 8), (4, 8), (1, 6), (4, 6)):
            prefill_rows.clear()
            torch.manual_seed(0)
            drawn[group, chunk] = sample_responses(lm, queries, mask, 12, Sampling(1.0), chunk, group_size=group)
            drawn[group, chunk, "prefill"] = [s[0] for s in prefill_rows if s[1] > 1]
    finally:
        hook.remove()
    assert drawn[1, 8, "prefill"] == [8] and drawn[4, 8, "prefill"] == [2] and drawn[4, 6, "prefill"] == [6, 2]
    assert torch.equal(drawn[4, 8], drawn[1, 8]) and torch.equal(drawn[4, 6], drawn[1, 6])
    assert prompt_groups(queries, mask, 4) == 4 and prompt_groups(queries[1:5], mask[1:5], 4) == 1


def test_a_reward_model_on_the_policys_tokens_scores_each_prompt_once(model_dir):
    """A sequence-classification reward model on the policy's token ids, read at each completion's last token: the
    shared layout's scores are the unshared ones (float64: 1e-12), with a third of the decoder tokens here."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from fastppo.rewards import reward_model_scores

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(model_dir, num_labels=1), dtype=torch.float64).eval()
    rollout = grouped_rollout(rm.config.vocab_size, 4, [9, 6], [2, 1, 3, 2, 3, 3, 1, 2], seed=9)
    plain = reward_model_scores(rm, rollout, 8)
    shared = reward_model_scores(rm, rollout, 4, shared=(4, shared_mask_kind(rm), torch.float64))
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-12)
    assert plain.std() > 0  # the rows score differently
    assert rollout.layout(None, shared=(4, "bool", torch.float64)).input_ids.numel() * 2 < \
        rollout.layout(None, False).input_ids.numel()


def test_a_lora_policys_update_shares_the_prompt_with_the_same_adapter_gradients(model_dir):
    """A PEFT (LoRA) policy in the trained forward: the adapter's gradients on the shared layout are the unshared
    ones (float32, to rounding of each gradient's scale)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=False))
    actor = PolicyAndValue(lm, None, critic=False)
    rollout = grouped_rollout(base.config.vocab_size, 3, [4, 7], [2, 5, 1, 3, 3, 2], seed=10)
    grads = []
    for shared in (None, (3, shared_mask_kind(lm), torch.float32)):
        lm.zero_grad()
        out = actor(rollout.layout(None, shared=shared), 1.0)
        (out.logprobs * rollout.response_mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in lm.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[0])
    for name, g in grads[0].items():
        scale = g.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=2e-5 * max(scale, 1.0), msg=name)


def test_a_cache_whose_layers_cannot_be_copied_prefills_every_row(model_dir, monkeypatch):
    """A hybrid model's cache layers (NemotronH's linear attention) have no batch_repeat_interleave: the sampler then
    prefills every row, and draws what it draws unshared."""
    from transformers.cache_utils import DynamicLayer

    from fastppo.generation import Sampling, sample_responses

    lm = model(model_dir, torch.float32, "sdpa")
    rollout = grouped_rollout(lm.config.vocab_size, 4, [5, 2], [1] * 8, seed=8)
    c = rollout.context_length
    queries, mask = rollout.query_responses[:, :c], rollout.attention_mask[:, :c]
    torch.manual_seed(0)
    want = sample_responses(lm, queries, mask, 6, Sampling(1.0), 8)
    monkeypatch.delattr(DynamicLayer, "batch_repeat_interleave")
    rows = []
    hook = lm.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        torch.manual_seed(0)
        got = sample_responses(lm, queries, mask, 6, Sampling(1.0), 8, group_size=4)
    finally:
        hook.remove()
    assert rows[0][0] == 8 and torch.equal(got, want)



DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_the_trained_forward_and_every_gradient_are_the_unshared_ones_on_each_device(model_dir, device):
    """The update's forward (``PolicyAndValue``: on CUDA the fused Triton log-prob and entropy kernels over the
    shared layout's gathered rows) and the backward through it: log-probs, entropies and each parameter's gradient
    equal to the unshared layout's to float32 rounding, on each device."""
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    actor = PolicyAndValue(lm, None, critic=False)
    plain = grouped_rollout(lm.config.vocab_size, 4, [6, 3], [5, 2, 7, 1, 3, 3, 6, 4], seed=11)
    rollout = assemble(*(t.to(device) for t in (plain.query_responses[:, :plain.context_length],
                                                plain.attention_mask[:, :plain.context_length],
                                                plain.query_responses[:, plain.context_length:],
                                                plain.response_mask, plain.has_stop)))
    results = []
    for shared in (None, (4, shared_mask_kind(lm), torch.float32)):
        lm.zero_grad()
        out = actor(rollout.layout(None, shared=shared), 0.7, return_entropy=True)
        loss = (out.logprobs * rollout.response_mask).sum() + 0.1 * (out.entropy * rollout.response_mask).sum()
        loss.backward()
        results.append((out.logprobs.detach(), out.entropy.detach(), {n: p.grad.clone() for n, p in
                                                                       lm.named_parameters()}))
    (want_lp, want_ent, want_grads), (lp, ent, grads) = results
    mask = rollout.response_mask
    torch.testing.assert_close(lp[mask], want_lp[mask], rtol=0, atol=2e-5)
    torch.testing.assert_close(ent[mask], want_ent[mask], rtol=0, atol=2e-5)
    assert want_lp[mask].abs().max() > 1.0
    for name, g in want_grads.items():
        scale = g.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(grads[name], g, rtol=0, atol=2e-5 * max(scale, 1.0), msg=name)


@pytest.mark.parametrize("critic", ["value_model", "value_head"])
def test_gae_values_and_their_gradients_with_shared_prompts_equal_unshared(model_dir, critic):
    """GAE with k completions per prompt: the value of every response state (a separate value model's forward over
    the same shared layout, or a value head on the policy's trunk), the log-probs, and every parameter's gradient of
    a loss that mixes them, equal to the unshared layout's (float32, to rounding of each gradient's scale). The
    first state of each completion is the prompt's last position, one value for the whole group."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from fastppo.value_head import AutoModelForCausalLMWithValueHead

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if critic == "value_model":
        value_model = AutoModelForSequenceClassification.from_config(
            AutoConfig.from_pretrained(model_dir, num_labels=1), dtype=torch.float32)
        actor, trained = PolicyAndValue(lm, value_model, critic=True), [lm, value_model]
    else:
        policy = AutoModelForCausalLMWithValueHead(lm).eval()  # its head's dropout off, as the trainer's
        actor, trained = PolicyAndValue(policy, None, critic=True), [policy]
    rollout = grouped_rollout(lm.config.vocab_size, 3, [6, 2], [4, 1, 5, 2, 3, 3], seed=12)
    weights = torch.randn(rollout.response_mask.shape, generator=torch.Generator().manual_seed(13))
    results = []
    for shared in (None, (3, "bool", torch.float32)):
        for m in trained:
            m.zero_grad()
        out = actor(rollout.layout(None, shared=shared), 0.9)
        mask = rollout.response_mask
        ((out.logprobs * weights * mask).sum() + ((out.values - weights) ** 2 * mask).sum()).backward()
        results.append((out.logprobs.detach(), out.values.detach(),
                        {n: p.grad.clone() for m in trained for n, p in m.named_parameters() if p.grad is not None}))
    (logp, values, grads), (s_logp, s_values, s_grads) = results
    mask = rollout.response_mask
    torch.testing.assert_close(s_logp[mask], logp[mask], rtol=0, atol=2e-5)
    torch.testing.assert_close(s_values[mask], values[mask], rtol=0, atol=2e-5)
    assert values[mask].std() > 0 and torch.equal(values[0::3, 0], values[0::3, 0])
    torch.testing.assert_close(values[1::3, 0], values[0::3, 0], rtol=0, atol=2e-6)  # one first state per group
    assert s_grads.keys() == grads.keys() and any("score" in n or "v_head" in n for n in grads)
    for name, g in grads.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(s_grads[name], g, rtol=0, atol=2e-5 * max(scale, 1.0), msg=name)


def test_a_ppo_run_with_k_completions_shares_its_value_model_and_trains_as_without(tmp_path, model_dir):
    """PPO (GAE, a value model) with num_generations 2: the update and π_θ_old's forward share each group's prompt
    (``update_sharing``), and the run trains as the unshared one (float32 rounding apart)."""
    from fastppo import PPOTrainer

    def run(share):
        args = PPOConfig(output_dir=str(tmp_path / str(share)), sft_model_path=model_dir, reward_model_path=None,
                         num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                         num_ppo_epochs=2, response_length=6, total_episodes=8, seed=4, save_strategy="no",
                         report_to=[], num_sample_generations=0, disable_tqdm=True, share_prompts=share,
                         learning_rate=1e-3)
        trainer = PPOTrainer(args=args)
        shared_calls = []
        import fastppo.train as train_module
        original = train_module.update_sharing
        try:
            train_module.update_sharing = lambda *a: shared_calls.append(original(*a)) or shared_calls[-1]
            trainer.train()
        finally:
            train_module.update_sharing = original
        return trainer, shared_calls

    (shared, calls), (plain, plain_calls) = run(True), run(False)
    assert calls and all(c is not None and c[0] == 2 for c in calls) and all(c is None for c in plain_calls)
    for (name, a), b in zip(shared.actor_critic.state_dict().items(), plain.actor_critic.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=name)


def test_share_prompts_true_refuses_a_value_model_whose_attention_takes_no_group_mask(tmp_path, model_dir):
    """The value model reads the update's shared layout: share_prompts=True with a value model whose attention
    takes no 4-D mask is refused by name at construction (unset, it runs unshared)."""
    import datasets
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from fastppo import PPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = datasets.Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in ["a b", "c d e"] * 4]})
    value_model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(model_dir, num_labels=1))
    value_model.config._attn_implementation = "flex_attention"
    for share, refused in ((True, True), (None, False)):
        args = PPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=4,
                         response_length=4, total_episodes=8, report_to=[], save_strategy="no", share_prompts=share)
        build = lambda: PPOTrainer(args=args, processing_class=tokenizer,  # noqa: E731
                                   model=AutoModelForCausalLM.from_pretrained(model_dir), ref_model=None,
                                   reward_model=lambda completions, **kw: [1.0] * len(completions),
                                   train_dataset=dataset, value_model=value_model)
        if refused:
            with pytest.raises(SettingsError, match="share_prompts: the value model's attention"):
                build()
        else:
            build()
