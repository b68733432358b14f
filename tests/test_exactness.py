"""The fast paths compute what the plain ones do: the sampler draws from softmax(logits/T) exactly (and the
same tokens as transformers' generate), packed rows equal padded rows, padding columns are cut, the fused
policy loss trains like the unfused one, and the update loop never waits for the device."""
from __future__ import annotations

import functools

import pytest
import torch

from fastppo.config import PPOConfig
from fastppo.sizes import derive_sizes
from fastppo.data import left_pad
from fastppo.generation import Sampling, sample_responses
from fastppo.trainer import PPOTrainer
from fastppo.batching import micro_batches
from fastppo.advantages import gae_advantages
from fastppo.train import (Scoring, Targets, UpdateBatch, UpdateModel, compute_experience, per_token_rewards,
                           ppo_update)

from helpers import small_config

pytestmark = pytest.mark.usefixtures("reference_path")


config = functools.partial(small_config, response_length=8, stop_token="eos")


PROMPTS = ["the movie was", "i think the plot is", "overall the cast", "the ending felt very", "honestly",
           "my friend said the music was", "the show", "to be fair the villain seemed"]


# ---------------------------------------------------------------------------- the sampler


def random_lm(vocab=64, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, pad_token_id=0, eos_token_id=1,
                                      bos_token_id=None))
    return lm.eval()


def test_sampler_computes_last_position_logits_only_under_lora_too():
    """A LoRA policy (PEFT's forward takes **kwargs) still gets logits_to_keep=1: the prefill never makes
    [rows, prompt, vocab] logits."""
    peft = pytest.importorskip("peft")
    from fastppo.generation import Sampling, sample_responses

    lm = peft.get_peft_model(random_lm(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    seen = []
    lm.get_base_model().register_forward_hook(lambda module, args, out: seen.append(out.logits.shape[1]))
    queries = torch.randint(2, 64, (3, 7))
    sample_responses(lm, queries, torch.ones_like(queries), 4, Sampling(1.0), 8)
    assert seen and set(seen) == {1}


@pytest.mark.parametrize("stop_ids", [[], [1], [1, 5]])
def test_sampler_draws_the_tokens_generate_draws(stop_ids):
    """Same random state, same tokens as transformers' generate with plain sampling (and a neutral
    generation_config): the sampler is generate's distribution, minus everything a checkpoint can add."""
    from transformers import GenerationConfig

    lm = random_lm()
    queries, mask = left_pad([[3, 4, 5], [6], [7, 8], [9, 10, 11, 12]], pad_id=0)
    torch.manual_seed(123)
    ours = sample_responses(lm, queries, mask, 12, Sampling(0.7, stop_ids, 0), chunk=4)
    lm.generation_config = GenerationConfig()
    torch.manual_seed(123)
    gen = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                           eos_token_id=stop_ids, pad_token_id=0)
    theirs = lm.generate(input_ids=queries, attention_mask=mask, generation_config=gen)[:, queries.shape[1]:]
    n = theirs.shape[1]
    assert torch.equal(ours[:, :n], theirs)
    assert (ours[:, n:] == 0).all()  # generate stopped when every row had stopped; so did we, padding the rest


def test_sampler_ignores_the_checkpoints_generation_config():
    """A checkpoint shipping top_k=20, top_p=0.5, repetition_penalty=1.3: the samples still follow the full
    softmax(logits/T) (most of them outside the top 20 of a near-uniform model), where generate would not."""
    from transformers import GenerationConfig

    lm = random_lm(vocab=256)
    lm.generation_config = GenerationConfig(top_k=20, top_p=0.5, repetition_penalty=1.3, do_sample=True)
    n = 2000
    queries = torch.tensor([[3, 4, 5]]).repeat(n, 1)
    mask = torch.ones_like(queries)
    with torch.no_grad():
        logits = lm(input_ids=queries[:1]).logits[0, -1].float()
    probs = torch.softmax(logits, -1)
    top20 = set(probs.topk(20).indices.tolist())
    outside = 1 - probs[list(top20)].sum().item()
    assert outside > 0.5  # a near-uniform model: most mass is outside the top 20

    torch.manual_seed(0)
    first = sample_responses(lm, queries, mask, 1, Sampling(1.0), chunk=n)[:, 0]
    frac = sum(t not in top20 for t in first.tolist()) / n
    assert abs(frac - outside) < 4 * (outside * (1 - outside) / n) ** 0.5, (frac, outside)
    # chi-square over the 16 most likely tokens and the rest, against the model's probabilities
    counts = torch.bincount(first, minlength=probs.numel()).float()
    top = probs.topk(16).indices
    observed = torch.cat([counts[top], (n - counts[top].sum()).reshape(1)])
    expected = torch.cat([probs[top], (1 - probs[top].sum()).reshape(1)]) * n
    chi2 = (((observed - expected) ** 2) / expected).sum().item()
    assert chi2 < 40.0, chi2  # 16 degrees of freedom: p < 1e-3 above 39.3

    torch.manual_seed(0)
    leaked = lm.generate(input_ids=queries, attention_mask=mask, max_new_tokens=1)[:, -1]
    assert all(t in top20 for t in leaked.tolist())  # generate applies the checkpoint's top_k: the test can fail


# ---------------------------------------------------------------------------- layouts


def scored(tmp_path, **overrides):
    trainer = PPOTrainer(args=config(tmp_path, **overrides))
    ids = [trainer.tokenizer(p)["input_ids"] for p in PROMPTS]
    torch.manual_seed(7)
    batch = trainer.rollout(ids)
    return trainer, batch


def test_response_columns_end_at_the_longest_real_response(tmp_path, model_dir):
    trainer, batch = scored(tmp_path, response_length=40)
    r = batch.rollout
    assert r.response_mask.shape[1] == max(r.response_lengths) <= 40
    assert list(r.response_lengths) == r.lengths.tolist()
    assert r.response_mask.sum(1).tolist() == list(r.response_lengths)


def test_packed_rows_equal_padded_rows_forward_and_gradients(tmp_path, model_dir):
    trainer, batch = scored(tmp_path, response_length=10)
    rollout = batch.rollout
    assert len(set(rollout.query_lengths)) > 1 and len(set(rollout.response_lengths)) > 1  # real padding to skip
    module = trainer.actor_critic
    outputs = {}
    for packed in (False, True):
        module.zero_grad()
        logp, ent, values, _, _ = module(rollout.layout(None, packed), 0.9, return_entropy=True)
        mask = rollout.response_mask
        ((logp * mask).sum() + 0.3 * (ent * mask).sum() + (values * mask).square().sum()).backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        outputs[packed] = (logp.detach(), ent.detach(), values.detach(), grads)
    for a, b in zip(outputs[False][:3], outputs[True][:3]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert outputs[False][3].keys() == outputs[True][3].keys() and outputs[True][3]
    for name, g in outputs[False][3].items():
        torch.testing.assert_close(g, outputs[True][3][name], atol=1e-4, rtol=1e-4, msg=name)


def test_packed_scoring_and_reward_model_equal_padded(tmp_path, model_dir):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from fastppo.rewards import reward_model_scores

    trainer, batch = scored(tmp_path)
    rm = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(model_dir, num_labels=1)).eval()
    padded = compute_experience(trainer.actor_critic, trainer.reference, batch.rollout, Scoring(1.0, "k3", 3))
    packed = compute_experience(trainer.actor_critic, trainer.reference, batch.rollout,
                                Scoring(1.0, "k3", 5, packed=True))
    for a, b in zip(padded.__dict__.values(), packed.__dict__.values()):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(reward_model_scores(rm, batch.rollout, 3, False),
                               reward_model_scores(rm, batch.rollout, 8, True), atol=2e-5, rtol=2e-5)


def test_a_model_that_cannot_keep_packed_rows_apart_is_refused(tmp_path, model_dir):
    """--padding_free checks at start that every model keeps packed rows apart, and refuses one that
    does not (here a policy whose decoder ignores the position ids) before any training."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from fastppo.loading import check_packing

    reward = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    check_packing(reward, torch.device("cpu"), "reward model")  # sdpa on transformers 5 reads the positions
    lm = AutoModelForCausalLM.from_pretrained(model_dir)
    decoder = lm.get_decoder()
    original = decoder.forward

    def ignore_positions(*args, position_ids=None, **kwargs):  # an implementation that mixes packed rows
        return original(*args, **kwargs)

    decoder.forward = ignore_positions
    PPOTrainer(args=config(tmp_path, output_dir=str(tmp_path / "padded")), model=lm)  # padded rows: fine
    with pytest.raises(ValueError, match="padding_free: the policy .*attend to each other"):
        PPOTrainer(args=config(tmp_path, padding_free=True), model=lm)


def test_micro_batches_group_rows_of_similar_length_within_each_minibatch():
    cfg = PPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=4, num_mini_batches=2,
                    total_episodes=8)
    sizes = derive_sizes(cfg, 1, 8)
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    order = [0, 1, 2, 3, 4, 5, 6, 7]
    grouped = micro_batches(order, sizes, lengths, group_by_length=True)
    assert grouped == [[[1, 3], [2, 0]], [[5, 7], [6, 4]]]  # same minibatches, sorted inside
    plain = micro_batches(order, sizes, lengths, group_by_length=False)
    assert plain == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


# ---------------------------------------------------------------------------- the update loop


def prepared_update(tmp_path, fused: bool, optimizer_fused: bool = True, **overrides):
    """Everything ppo_update needs for one scored rollout, and a function that runs it."""
    trainer, batch = scored(tmp_path, fused_policy_loss=fused, entropy_coef=0.05, **overrides)
    rollout = batch.rollout
    experience = compute_experience(trainer.actor_critic, trainer.reference, rollout, Scoring(1.0, "k1", 8))
    rewards, nsr = per_token_rewards(experience.kl, torch.linspace(-1, 1, 8), rollout.response_mask,
                                     rollout.score_index, 0.05)
    adv, ret = gae_advantages(rewards, experience.values, rollout.response_mask, 1.0, 0.95, False)
    module = trainer.actor_critic
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2,
                                  fused=optimizer_fused)
    cfg = trainer.config
    sizes = derive_sizes(cfg, 1, 8)

    def run():
        batch = UpdateBatch(rollout, experience, Targets(rewards, nsr, adv, ret))
        return ppo_update(UpdateModel(module, optimizer), batch, cfg, sizes, torch.Generator().manual_seed(0))

    return module, run


def update_once(tmp_path, fused: bool, optimizer_fused: bool = True, **overrides):
    module, run = prepared_update(tmp_path, fused, optimizer_fused, **overrides)
    return module, run()


def test_fused_policy_loss_trains_like_the_unfused_loss(tmp_path, model_dir):
    plain, plain_result = update_once(tmp_path / "a", fused=False)
    fused, fused_result = update_once(tmp_path / "b", fused=True)
    torch.testing.assert_close(plain_result.stats, fused_result.stats, atol=1e-5, rtol=1e-4, equal_nan=True)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_update_loop_never_waits_for_the_device(tmp_path, model_dir, monkeypatch):
    """With fused AdamW the loop's only host transfers are the epochs' permutations, which are drawn on the
    host: no .item()/.tolist() of a loss, a norm or a statistic (on a GPU each would stall the stream)."""
    _, run = prepared_update(tmp_path, fused=False, num_ppo_epochs=3)
    calls = []
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls.append((_name, self.dtype, tuple(self.shape)))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    result = run()
    monkeypatch.undo()
    assert calls == [("tolist", torch.int64, (8,))] * 3, calls  # one permutation per epoch, nothing else
    assert float(result.skipped_steps) == 0


@pytest.mark.parametrize("optimizer_fused", [True, False])
def test_non_finite_steps_are_skipped_on_the_device_or_host(tmp_path, model_dir, optimizer_fused, capsys):
    trainer, batch = scored(tmp_path)
    rollout = batch.rollout
    experience = compute_experience(trainer.actor_critic, trainer.reference, rollout, Scoring(1.0, "k1", 8))
    nan = torch.full_like(experience.values, float("nan"))
    module = trainer.actor_critic
    before = {k: v.clone() for k, v in module.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2,
                                  fused=optimizer_fused)
    batch = UpdateBatch(rollout, experience, Targets(nan, nan, nan, experience.values))
    result = ppo_update(UpdateModel(module, optimizer), batch, trainer.config, derive_sizes(trainer.config, 1, 8),
                        torch.Generator().manual_seed(0))
    assert float(result.skipped_steps) == 2 and float(result.optimizer_steps) == 0
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k
    if not optimizer_fused:  # skipped on the host: said, and AdamW's moments never saw the NaN gradients
        assert "step skipped" in capsys.readouterr().out
        assert not optimizer.state
    for state in optimizer.state.values():  # fused: the moments exist but never moved
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_sampling_is_the_same_in_train_mode_under_gradient_checkpointing(model_dir):
    """transformers drops the KV cache of a model in train mode with gradient checkpointing on; the sampler must
    not follow it into decoding without the prompt (it samples in eval mode, and restores the caller's mode)."""
    from transformers import AutoModelForCausalLM

    from fastppo.data import left_pad
    from fastppo.generation import Sampling, sample_responses

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    queries, mask = left_pad([[5, 6, 7, 8], [9, 10]], 0)
    torch.manual_seed(3)
    expected = sample_responses(model.eval(), queries, mask, 6, Sampling(1.0), 8)
    model.gradient_checkpointing_enable()
    model.train()
    torch.manual_seed(3)
    assert torch.equal(sample_responses(model, queries, mask, 6, Sampling(1.0), 8), expected)
    assert model.training
