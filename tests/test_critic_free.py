"""The critic-free estimators (``advantage_estimator`` rloo, grpo, reinforce_plus_plus): each formula against a
float64 reference written from its source's definition (TRL's RLOOTrainer and GRPOTrainer, verl's REINFORCE++),
the in-loss KL (``beta``), grouped samples (``num_generations``), no value model, the settings' refusals, and the
trainer end to end: the library, the CLI, resume, LoRA and two torchrun processes."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

from fastppo import PPOConfig
from fastppo.sizes import derive_sizes
from fastppo.errors import SettingsError
from fastppo.metrics import STAT, STAT_NAMES
from fastppo.train import per_token_rewards
from fastppo.advantages import estimate_advantages, grpo_advantages, reinforce_plus_plus_advantages, rloo_advantages
from helpers import cli_trainer, digest, make_trainer, metrics_without_clock, small_config, grid_losses

pytestmark = pytest.mark.usefixtures("reference_path")


# ---------------------------------------------------------------------------- float64 references


def rloo_reference(rewards: list[float], k: int) -> list[float]:
    """RLOO (Ahmadian et al. 2024; TRL's RLOOTrainer): each sample against the mean of its k − 1 siblings."""
    out = []
    for g in range(0, len(rewards), k):
        group = rewards[g:g + k]
        out += [r - (sum(group) - r) / (k - 1) for r in group]
    return out


def grpo_reference(rewards: list[float], k: int, scale: str) -> list[float]:
    """GRPO (TRL's GRPOTrainer): (r − group mean) / (std + 1e-4), std unbiased over the group or the batch."""
    def std(xs):
        m = sum(xs) / len(xs)
        return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5

    out = []
    for g in range(0, len(rewards), k):
        group = rewards[g:g + k]
        mean = sum(group) / k
        s = {"group": std(group), "batch": std(rewards), "none": None}[scale]
        out += [(r - mean) / (s + 1e-4) if s is not None else r - mean for r in group]
    return out


def reinforce_pp_reference(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """verl's REINFORCE++: G_t = R_t + γ·G_{t+1} over the response, whitened over the batch's trained tokens
    (unbiased variance, eps 1e-8), 0 off them. In float64, by loops."""
    b, t = rewards.shape
    returns = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        running = 0.0
        for j in reversed(range(t)):
            running = float(rewards[i, j]) + gamma * running
            returns[i, j] = running
    picked = [float(returns[i, j]) for i in range(b) for j in range(t) if mask[i, j]]
    mean = sum(picked) / len(picked)
    var = sum((x - mean) ** 2 for x in picked) / (len(picked) - 1)
    return (returns - mean) / (var + 1e-8) ** 0.5 * mask.double()


# ---------------------------------------------------------------------------- the estimators


@hsettings(max_examples=40, deadline=None)
@given(k=st.integers(2, 6), groups=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_rloo_is_reward_minus_the_mean_of_the_other_samples(k, groups, seed):
    rewards = torch.randn(groups * k, generator=torch.Generator().manual_seed(seed)) * 3 + 1
    got = rloo_advantages(rewards, k)
    torch.testing.assert_close(got.double(), torch.tensor(rloo_reference(rewards.double().tolist(), k), dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    # the leave-one-out advantage is k / (k − 1) times the group-centred reward: a sum of zero per group
    assert got.view(-1, k).sum(1).abs().max() < 1e-4


@hsettings(max_examples=40, deadline=None)
@given(k=st.integers(2, 6), groups=st.integers(1, 4), scale=st.sampled_from(["group", "batch", "none"]),
       seed=st.integers(0, 2**31 - 1))
def test_grpo_against_its_definition(k, groups, scale, seed):
    rewards = torch.randn(groups * k, generator=torch.Generator().manual_seed(seed)) * 2 - 0.5
    got = grpo_advantages(rewards, k, scale)
    want = torch.tensor(grpo_reference(rewards.double().tolist(), k, scale), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator,scale", [("rloo", "group"), ("grpo", "group"), ("grpo", "batch"),
                                             ("grpo", "none")])
def test_a_group_of_equal_rewards_has_advantage_zero_not_nan(estimator, scale):
    rewards = torch.tensor([2.5, 2.5, 2.5, 2.5, 1.0, -1.0, 3.0, 0.0])  # group 1 all equal
    adv = rloo_advantages(rewards, 4) if estimator == "rloo" else grpo_advantages(rewards, 4, scale)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:4], torch.zeros(4))
    assert adv[4:].abs().sum() > 0
    # and a batch where every reward is equal (no spread even over the batch)
    flat = torch.full((8,), 0.7)
    for out in (rloo_advantages(flat, 4), grpo_advantages(flat, 4, scale)):
        assert torch.isfinite(out).all() and out.abs().max() < 1e-6


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_against_verls_definition(gamma):
    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 3, 7, 2]
    mask = torch.zeros(5, 7, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    rewards = torch.randn(5, 7, generator=g) * mask  # a KL-shaped reward on every trained token
    rewards[torch.arange(5), torch.tensor(lengths) - 1] += torch.randn(5, generator=g) * 4  # the score
    adv, returns = reinforce_plus_plus_advantages(rewards, mask, gamma)
    torch.testing.assert_close(adv.double(), reinforce_pp_reference(rewards, mask, gamma), rtol=1e-5, atol=1e-5)
    assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))
    # whitened: mean 0 and unbiased variance 1 over the trained tokens
    assert abs(adv[mask].mean().item()) < 1e-5 and abs(adv[mask].var().item() - 1) < 1e-4
    # a batch with a single trained token has no spread: 0, not NaN
    one = torch.zeros(2, 3, dtype=torch.bool)
    one[0, 0] = True
    out, _ = reinforce_plus_plus_advantages(torch.randn(2, 3) * one, one, gamma)
    assert torch.equal(out, torch.zeros(2, 3))


def test_group_estimators_score_the_kl_shaped_sequence_reward_on_trained_tokens_only():
    """rloo/grpo's sequence reward is the score minus kl_coef·Σ_t KL_t (TRL RLOO's KL in the reward); the
    sequence advantage goes to every trained token of its row and nowhere else."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([4, 2, 6, 1, 3, 6, 5, 2])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    kl = torch.randn(8, 6, generator=g).abs() * mask
    scores = torch.randn(8, generator=g) * 2
    rewards, _ = per_token_rewards(kl, scores, mask, lengths - 1, 0.3)
    for estimator, fn in (("rloo", lambda r: rloo_reference(r, 4)), ("grpo", lambda r: grpo_reference(r, 4, "group"))):
        config = PPOConfig(output_dir=None, advantage_estimator=estimator, num_generations=4)
        adv, returns = estimate_advantages(estimator, rewards, None, mask, config)
        assert returns is None
        sequence = (scores.double() - 0.3 * (kl.double() * mask).sum(1)).tolist()
        want = torch.tensor(fn(sequence), dtype=torch.float64)[:, None] * mask
        torch.testing.assert_close(adv.double(), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- the loss: KL in the loss, no critic


def grpo_loss_reference(logp, old, ref, adv, mask, eps, beta, correction):
    """TRL GRPO's token loss at loss_type dapo on one batch: mean over trained tokens of
    −min(ρA, clip(ρ, 1±ε)A) + β·k3·(ρ if correction), k3 = e^{ref−logp} − (ref − logp) − 1. float64."""
    ratio = torch.exp(logp - old)
    pg = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = pg + beta * (k3 * ratio if correction else k3)
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("correction", [True, False])
def test_the_in_loss_kl_and_no_value_terms_against_trl_grpos_definition(correction):
    g = torch.Generator().manual_seed(7)
    b, t = 6, 5
    mask = torch.arange(t)[None, :] < torch.tensor([5, 3, 1, 4, 5, 2])[:, None]
    old = -torch.rand(b, t, generator=g) * 3 - 0.1
    logp = (old + torch.randn(b, t, generator=g) * 0.4) * mask  # ratios well outside 1 ± 0.2, both sides
    ref = old + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, 1, generator=g).expand(b, t) * mask  # one advantage per sequence, both signs
    logp64 = logp.double().requires_grad_()
    want = grpo_loss_reference(logp64, old.double(), ref.double(), adv.double(), mask.double(), 0.2, 0.04,
                               correction)
    want.backward()
    new = logp.clone().requires_grad_()
    loss, stats = grid_losses(new, None, torch.rand(b, t), old, None, adv, None, mask, cliprange=0.2,
                             cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0, ratio_threshold=10.0,
                             ref_logprobs=ref, beta=0.04, kl_loss_type="k3", bias_correction_kl=correction)
    loss.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(new.grad.double(), logp64.grad, rtol=1e-5, atol=1e-7)
    s = dict(zip(STAT_NAMES, stats.tolist()))
    ratio = torch.exp(logp - old)
    assert 0 < s["pg_clipfrac"] < 1 and (ratio[mask] > 1.2).any() and (ratio[mask] < 0.8).any()
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    assert s["kl_loss"] == pytest.approx(((k3 * ratio if correction else k3) * mask).sum().item() / mask.sum().item(),
                                         rel=1e-5)
    for name in ("vf_loss", "vf_clipfrac", "returns_mean", "vpred_mean", "values_mean"):
        assert s[name] != s[name], name  # NaN: not computed, so not averaged into any metric
    # beta 0: the loss is the clipped surrogate alone
    plain, stats0 = grid_losses(logp, None, torch.rand(b, t), old, None, adv, None, mask, cliprange=0.2,
                               cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0, ratio_threshold=10.0,
                               ref_logprobs=ref, beta=0.0)
    torch.testing.assert_close(plain.double(), grpo_loss_reference(logp.double(), old.double(), ref.double(),
                                                                   adv.double(), mask.double(), 0.2, 0.0, correction))
    assert stats0[STAT["kl_loss"]].isnan()


# ---------------------------------------------------------------------------- settings


def test_each_estimators_defaults_are_its_sources():
    assert (PPOConfig(output_dir=None).num_generations, PPOConfig(output_dir=None).kl_coef) == (1, 0.05)
    grpo = PPOConfig(output_dir=None, advantage_estimator="grpo")
    assert (grpo.num_generations, grpo.kl_coef, grpo.beta, grpo.scale_rewards) == (8, 0.0, 0.0, "group")
    assert not grpo.needs_reference and grpo.critic_free  # TRL GRPO at beta 0 loads no reference
    rloo = PPOConfig(output_dir=None, advantage_estimator="rloo")
    assert (rloo.num_generations, rloo.kl_coef) == (2, 0.05) and rloo.needs_reference
    assert PPOConfig(output_dir=None, advantage_estimator="reinforce_plus_plus").num_generations == 1
    assert PPOConfig(output_dir=None, advantage_estimator="grpo", kl_coef=0.1).kl_coef == 0.1  # given: kept
    assert PPOConfig(output_dir=None, scale_rewards=False).scale_rewards == "none"  # TRL's bool spelling
    assert PPOConfig(output_dir=None, scale_rewards="true").scale_rewards == "group"


@pytest.mark.parametrize("kwargs,message", [
    (dict(advantage_estimator="grpo", num_generations=1), "num_generations 1 leaves nothing to compare"),
    (dict(advantage_estimator="rloo", num_generations=1), "num_generations 1 leaves nothing to compare"),
    (dict(advantage_estimator="ppo"), "unknown advantage_estimator 'ppo'"),
    (dict(advantage_estimator="grpo", scale_rewards="std"), "scale_rewards must be one of group, batch, none"),
    (dict(advantage_estimator="grpo", beta=-0.1), "beta must be >= 0"),
    (dict(advantage_estimator="grpo", beta=0.1, fused_policy_loss=True), "beta .* fused_policy_loss"),
    (dict(advantage_estimator="grpo", beta=0.1, kl_loss_type="full"), "kl_loss_type must be one of"),
    (dict(advantage_estimator="rloo", value_model_path="some/model"), "value_model_path: .*critic-free"),
    (dict(advantage_estimator="grpo", shared_value_head=True), "shared_value_head: .*critic-free"),
    (dict(advantage_estimator="grpo", num_generations=0), "num_generations must be an integer >= 1"),
    # a KL controller scales β by a factor: from grpo's kl_coef 0 it stays 0 while a reference runs every iteration
    (dict(advantage_estimator="grpo", num_generations=2, adaptive_kl=True),
     "adaptive_kl scales kl_coef .* and kl_coef is 0 .* advantage_estimator 'grpo'"),
    (dict(kl_coef=0.0, adaptive_kl=True), "adaptive_kl scales kl_coef"),
])
def test_bad_settings_are_refused_naming_the_setting(tmp_path, kwargs, message):
    with pytest.raises(SettingsError, match=message):
        make_trainer(small_config(tmp_path, **kwargs))


def test_legacy_adaptive_kl_from_zero_runs_without_a_controller(tmp_path):
    """Legacy TRL's adap_kl_ctrl defaults to True; with init_kl_coef 0 its β stays 0, which is no controller."""
    from fastppo.legacy import PPOConfig as LegacyConfig

    core = LegacyConfig(model_name="m", init_kl_coef=0.0, batch_size=4, mini_batch_size=2,
                        output_dir=str(tmp_path)).to_core()
    assert core.kl_coef == 0 and not core.adaptive_kl
    core = LegacyConfig(model_name="m", init_kl_coef=0.1, batch_size=4, mini_batch_size=2,
                        output_dir=str(tmp_path)).to_core()
    assert core.kl_coef == 0.1 and core.adaptive_kl


def test_an_epoch_is_a_pass_over_the_prompts_not_over_completions(tmp_path, model_dir):
    """state.epoch and state.num_train_epochs in prompts (TRL's meaning): 16 prompts, 4 completions each, 8
    completions an iteration; num_train_epochs 1 is 8 iterations, after which state.epoch is 1 (it was 4)."""
    import datasets

    prompts = [f"the movie {w}" for w in ("was", "is", "felt", "seemed")] * 4
    config = small_config(tmp_path, advantage_estimator="grpo", num_generations=4, total_episodes=None,
                          num_train_epochs=1, num_ppo_epochs=1, response_length=3)
    trainer = make_trainer(config, train_dataset=datasets.Dataset.from_dict({"prompt": prompts}))
    assert trainer.sizes.num_total_batches == 8
    trainer.train()
    assert trainer.state.num_train_epochs == pytest.approx(1.0)
    assert trainer.state.epoch == pytest.approx(1.0)


def test_num_generations_must_divide_the_batch_and_counts_completions(tmp_path):
    config = small_config(tmp_path, advantage_estimator="grpo", num_generations=3)  # batch 4 × 2 = 8
    with pytest.raises(SettingsError, match=r"num_generations \(3 completions per prompt\) must divide the rollout "
                                            r"batch per process .* = 8"):
        derive_sizes(config, 1, 100)
    sizes = derive_sizes(small_config(tmp_path, advantage_estimator="grpo", num_generations=4, total_episodes=None,
                                      num_train_epochs=1), 1, 10)
    assert (sizes.local_prompts, sizes.num_generations) == (2, 4)
    assert sizes.num_total_batches == 5  # 10 prompts × 4 completions / 8 per iteration: TRL GRPO's count


def test_a_value_model_or_a_value_head_model_is_refused_without_a_critic(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from fastppo import AutoModelForCausalLMWithValueHead

    value = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    with pytest.raises(SettingsError, match="value_model is given, but advantage_estimator 'rloo' is critic-free"):
        make_trainer(small_config(tmp_path, advantage_estimator="rloo"), value_model=value)
    head = AutoModelForCausalLMWithValueHead(AutoModelForCausalLM.from_pretrained(model_dir))
    with pytest.raises(SettingsError, match="pass its language model"):
        make_trainer(small_config(tmp_path, advantage_estimator="grpo", num_generations=4), model=head)


# ---------------------------------------------------------------------------- the trainer


small = functools.partial(small_config, total_episodes=16)  # two iterations of 8 completions


def prompt_length_reward(prompts, completions, **kwargs):
    """Depends on the prompt only: every sample of a group gets the same score."""
    return [float(len(p.split())) for p in prompts]


@hsettings(max_examples=200, deadline=None)
@given(k=st.integers(2, 16), value=st.floats(-1e6, 1e6, width=32), others=st.integers(0, 2**31 - 1))
def test_equal_rewards_give_advantages_of_exactly_zero(k, value, others):
    """Any float32 reward shared by a group: every estimator's advantages there are exactly 0, beside a group that
    differs. (float32 group means an ulp off, divided by std + 1e-4, gave ~1e-3: a full AdamW step for a reward
    that says nothing about the completions.)"""
    from fastppo.advantages import gdpo_advantages

    g = torch.Generator().manual_seed(others)
    rewards = torch.cat([torch.full((k,), value, dtype=torch.float32), torch.randn(k, generator=g) * 3 + value])
    outs = [rloo_advantages(rewards, k), *(grpo_advantages(rewards, k, scale) for scale in ("group", "batch", "none")),
            gdpo_advantages(torch.stack([rewards, 2 * rewards], 1), torch.tensor([1.0, 0.5]), k)]
    for out in outs[:4]:
        assert out.dtype == torch.float32 and torch.equal(out[:k], torch.zeros(k)), out[:k]
    # GDPO: each reward normalised in its group (0 in the equal group), the sum then centred on the whole batch (as
    # TRL's), so the equal group's completions get one and the same advantage
    gdpo = outs[4]
    assert torch.isfinite(gdpo).all() and torch.equal(gdpo[:k], gdpo[:1].expand(k))


def completion_length_reward(prompts, completions, **kwargs):
    return [float(len(c.split())) for c in completions]


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_a_prompt_only_reward_leaves_the_policy_unchanged_a_completion_reward_moves_it(tmp_path, model_dir,
                                                                                        estimator):
    """The group baseline cancels whatever all k samples of a prompt share (no KL: kl_coef 0)."""
    kwargs = dict(advantage_estimator=estimator, num_generations=4, kl_coef=0.0)
    trainer = make_trainer(small(tmp_path / "p", **kwargs), reward_model=prompt_length_reward)
    start = digest(trainer.policy.state_dict())
    trainer.train()
    assert digest(trainer.policy.state_dict()) == start
    history = [m for m in trainer.state.log_history if "objective/scores" in m]
    assert len({m["objective/scores"] for m in history}) >= 1 and all(m["policy/clipfrac_avg"] == 0 for m in history)
    moved = make_trainer(small(tmp_path / "c", **kwargs), reward_model=completion_length_reward)
    moved.train()
    assert digest(moved.policy.state_dict()) != start


def test_grouped_samples_share_their_prompt_and_differ(tmp_path, model_dir):
    trainer = make_trainer(small(tmp_path, advantage_estimator="grpo", num_generations=4, response_length=8))
    batch = trainer.rollout()
    rollout = batch.rollout
    c = rollout.context_length
    queries = rollout.query_responses[:, :c]
    assert torch.equal(queries[0], queries[3]) and torch.equal(queries[4], queries[7])
    assert not torch.equal(queries[0], queries[4])  # two different prompts per iteration (8 / 4)
    responses = rollout.query_responses[:, c:]
    assert len({tuple(r.tolist()) for r in responses[:4]}) > 1  # k independent samples, not one repeated


@pytest.mark.parametrize("estimator", ["rloo", "grpo", "reinforce_plus_plus"])
def test_critic_free_runs_have_no_value_model_anywhere(tmp_path, model_dir, estimator):
    trainer = make_trainer(small(tmp_path, advantage_estimator=estimator, num_generations=4, save_steps=1))
    assert trainer.value_model is None and not trainer.actor_critic.critic
    policy_params = {id(p) for p in trainer.policy.parameters()}
    assert all(id(p) in policy_params for group in trainer.optimizer.param_groups for p in group["params"])
    trainer.train()
    out = tmp_path / "out"
    assert not (out / "value_model").exists() and not (out / "checkpoint-2" / "value_model").exists()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows and all("loss/value_avg" not in m and "val/clipfrac_avg" not in m for m in rows)
    assert all(m["policy/entropy_avg"] == m["policy/entropy_avg"] for m in rows)  # the policy terms are there
    # grpo at its defaults (beta 0, kl_coef 0) never holds or runs a reference; the others keep TRL's KL
    if estimator == "grpo":
        assert trainer.ref_model is None and trainer.reference is None
        assert all("objective/kl" not in m for m in rows)
    else:
        assert trainer.ref_model is not None and all(m["objective/kl"] == m["objective/kl"] for m in rows)


def test_beta_puts_the_kl_in_the_loss_and_logs_it(tmp_path, model_dir):
    trainer = make_trainer(small(tmp_path, advantage_estimator="grpo", num_generations=4, beta=0.1))
    assert trainer.ref_model is not None
    trainer.train()
    rows = [m for m in trainer.state.log_history if "objective/scores" in m]
    assert all(m["kl"] >= 0 and m["objective/kl"] == m["objective/kl"] for m in rows)
    assert rows[-1]["kl"] > 0  # the policy moved away from the reference in the first iteration's update


def test_gae_with_num_generations_is_still_gae(tmp_path, model_dir):
    """num_generations is orthogonal to the estimator: GAE over grouped samples keeps its value model."""
    trainer = make_trainer(small(tmp_path, num_generations=2))
    trainer.train()
    assert trainer.value_model is not None
    assert all("loss/value_avg" in m for m in trainer.state.log_history if "objective/scores" in m)


def test_lora_and_the_cli(tmp_path, model_dir):
    trainer = make_trainer(small(tmp_path / "lora", advantage_estimator="rloo", num_generations=4, use_peft=True,
                                 lora_target_modules=["q_proj", "v_proj"], lora_r=4))
    trainer.train()  # the reference is the policy with its adapter off (kl_coef 0.05 for rloo)
    assert trainer.ref_model is None and trainer.reference is not None and trainer.value_model is None
    cli = cli_trainer(["--advantage_estimator", "reinforce_plus_plus", "--num_generations", "2", "--output_dir",
                       str(tmp_path / "cli"), "--total_episodes", "16", "--per_device_train_batch_size", "8",
                       "--gradient_accumulation_steps", "1", "--response_length", "6", "--num_sample_generations",
                       "0", "--beta", "0.05", "--kl_loss_type", "k2", "--scale_rewards", "false"])
    assert (cli.config.advantage_estimator, cli.config.num_generations, cli.config.beta,
            cli.config.kl_loss_type, cli.config.scale_rewards) == ("reinforce_plus_plus", 2, 0.05, "k2", "none")
    assert cli.value_model is None
    cli.train()
    assert (tmp_path / "cli" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_critic_free_run_resumes_bitwise_and_a_checkpoint_of_another_estimator_is_refused(tmp_path, model_dir,
                                                                                            estimator):
    from test_resume import stop_after

    kwargs = dict(advantage_estimator=estimator, num_generations=4, beta=0.05, total_episodes=32, save_steps=2)
    whole = make_trainer(small(tmp_path / "whole", **kwargs))
    whole.train()
    first = make_trainer(small(tmp_path / "cut", **kwargs), callbacks=[stop_after(2)])
    first.train()
    resumed = make_trainer(small(tmp_path / "cut", **kwargs, resume_from_checkpoint="latest"))
    resumed.train()
    assert digest(resumed.actor_critic.state_dict()) == digest(whole.actor_critic.state_dict())
    assert (metrics_without_clock(tmp_path / "cut" / "out" / "metrics.jsonl")
            == metrics_without_clock(tmp_path / "whole" / "out" / "metrics.jsonl"))
    with pytest.raises(SettingsError, match="advantage_estimator: checkpoint .*, now 'gae'"):
        make_trainer(small(tmp_path / "cut", total_episodes=32, resume_from_checkpoint="latest"))


@pytest.mark.slow
@pytest.mark.parametrize("estimator,extra", [("grpo", {"scale_rewards": "batch", "beta": 0.05}),
                                             ("reinforce_plus_plus", {}),
                                             ("grpo", {"loss_type": "cispo", "epsilon_high": 1.1,
                                                       "top_entropy_quantile": 0.5,
                                                       "off_policy_mask_threshold": 0.01})])
def test_torchrun_two_processes_keep_identical_weights(tmp_path, estimator, extra):
    """The batch-wide statistics (grpo's batch std, REINFORCE++'s whitening, top_entropy_quantile's quantile over
    both processes' tokens) are all-reduced or gathered: both ranks step with the same gradient and end
    bit-equal."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ppo_worker.py")
    config = dict(_save_final=True, advantage_estimator=estimator, num_generations=2, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, num_ppo_epochs=2, response_length=6, total_episodes=24,
                  num_sample_generations=0, disable_tqdm=True, local_rollout_forward_batch_size=8,
                  learning_rate=1e-2, logging_steps=1, **extra)
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1",
               FASTPPO_CACHE=os.environ.get("FASTPPO_CACHE", str(tmp_path / "cache")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", worker,
           json.dumps(config), str(tmp_path / "out"), "0", "fresh"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    weights = [torch.load(tmp_path / "out" / f"final{r}.pt") for r in range(2)]
    assert weights[0]["value"] is None and weights[1]["value"] is None
    assert [m["episode"] for m in weights[0]["log_history"]] == [8, 16, 24]
    for name, p in weights[0]["policy"].items():
        torch.testing.assert_close(p, weights[1]["policy"][name], atol=0, rtol=0, msg=name)


@pytest.mark.slow
def test_zero3_without_a_value_model_matches_ddp(tmp_path, monkeypatch):
    """DeepSpeed ZeRO-3 on 2 CPU ranks with grpo and beta (the reference partitioned, no value model under the
    engine): the consolidated policy equals plain DDP's to the reduction-order tolerance of test_deepspeed."""
    from safetensors.torch import load_file

    from test_deepspeed import ATOL, SETTINGS, ZERO3, needs_deepspeed, torchrun

    if needs_deepspeed.args[0]:
        pytest.skip(needs_deepspeed.kwargs["reason"])
    monkeypatch.setenv("FASTPPO_CACHE", os.environ.get("FASTPPO_CACHE", str(tmp_path / "cache")))
    settings = {**SETTINGS, "advantage_estimator": "grpo", "num_generations": 2, "beta": 0.05, "kl_coef": 0.0,
                "kl_estimator": "k3", "adaptive_kl": False, "_nan_iteration": 0, "save_steps": 500}
    torchrun(tmp_path, tmp_path / "ddp", settings)
    output = torchrun(tmp_path, tmp_path / "z3", {**settings, "deepspeed": ZERO3})
    assert "ZeRO-3" in output
    for run in ("ddp", "z3"):
        assert not (tmp_path / run / "value_model").exists()
    ddp, z3 = (load_file(tmp_path / run / "model.safetensors") for run in ("ddp", "z3"))
    assert ddp.keys() == z3.keys()
    assert max((ddp[k] - z3[k]).abs().max().item() for k in ddp) < ATOL


@pytest.mark.parametrize("extra", [{}, {"beta": 0.1}, {"padding_free": True, "gradient_accumulation_steps": 2}],
                         ids=["beta0", "beta", "packed-accumulated"])
def test_one_epoch_of_one_minibatch_needs_no_forward_of_the_old_policy(tmp_path, model_dir, monkeypatch, extra):
    """TRL GRPO's num_iterations-1 shortcut: π_θ_old's log-probs come from the update's own forward (each sample is
    computed once, at θ_old): the same weights and metrics bit for bit as with step 2's forward, one forward less."""
    import fastppo.train as T

    kwargs = dict(advantage_estimator="grpo", num_generations=4, num_ppo_epochs=1, total_episodes=24, **extra)
    calls = []
    forward = T.compute_experience

    def counted(*args, **kw):
        calls.append(args[3].policy)
        return forward(*args, **kw)

    monkeypatch.setattr(T, "compute_experience", counted)
    fast = make_trainer(small(tmp_path / "fast", **kwargs))
    assert T.old_logprobs_in_update(fast.config)
    fast.train()
    assert calls and not any(calls)
    monkeypatch.setattr(T, "old_logprobs_in_update", lambda config: False)
    calls.clear()
    slow = make_trainer(small(tmp_path / "slow", **kwargs))
    slow.train()
    assert calls and all(calls)
    if not extra.get("padding_free"):
        assert digest(fast.policy.state_dict()) == digest(slow.policy.state_dict())
        assert (metrics_without_clock(tmp_path / "fast" / "out" / "metrics.jsonl")
                == metrics_without_clock(tmp_path / "slow" / "out" / "metrics.jsonl"))
    else:  # step 2 packs other rows together than the micro-batches do: its log-probs differ in the last bits
        for name, p in fast.policy.state_dict().items():
            torch.testing.assert_close(p, slow.policy.state_dict()[name], rtol=1e-4, atol=2e-5)
    # and where something reads the old log-probs before the update, step 2 runs them
    for other in (dict(num_ppo_epochs=2), dict(kl_coef=0.05), dict(advantage_estimator="gae"),
                  dict(num_mini_batches=2), dict(fused_policy_loss=True)):
        assert not T.old_logprobs_in_update(PPOConfig(output_dir=None, **{**kwargs, **other}))


def test_an_empty_reward_list_and_settings_a_critic_free_run_never_reads(tmp_path, model_dir, capsys):
    with pytest.raises(SettingsError, match="reward_model is an empty list"):
        make_trainer(small(tmp_path / "empty"), reward_model=[])
    make_trainer(small(tmp_path / "notes", advantage_estimator="grpo", num_generations=4, whiten_rewards=True,
                       vf_coef=0.5, gamma=0.9))
    out = capsys.readouterr().out
    for name in ("whiten_rewards", "vf_coef", "gamma"):
        assert f"--{name} has no effect with advantage_estimator 'grpo'" in out
    make_trainer(small(tmp_path / "gae", whiten_rewards=True, gamma=0.9))  # GAE reads them: no note
    assert "has no effect" not in capsys.readouterr().out
