"""End-to-end and unit tests of fastppo/train.py on tiny local models (CPU, reference kernels).

Every run here is offline: the embedded tiny Llama is built once into a cache private to this module
(conftest's ``model_dir``) and other models are built in tmp_path. The distributed test lives in
test_train_distributed.py; bad input (flags, models, data, reward functions) in test_bad_input.py.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import make_trainer, small_config, grid_losses
from fastppo.cli import ModelConfig
from fastppo.config import PPOConfig
from fastppo.data import left_pad, prompt_batches
from fastppo.loading import load_tokenizer
from fastppo.metrics import STAT, STAT_NAMES
from fastppo.rewards import call_reward_fn, reward_model_scores
from fastppo.sizes import derive_sizes
from fastppo.trainer import PPOTrainer
from fastppo.train import Scoring, Targets, UpdateBatch, UpdateModel, compute_experience, per_token_rewards, ppo_update
from fastppo.controllers import AdaptiveKLController
from fastppo.rollout import make_rollout
from fastppo.advantages import gae_advantages

pytestmark = pytest.mark.usefixtures("reference_path", "model_dir")  # model_dir: the embedded model, built once

TRL_METRICS = (
    "eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
    "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
    "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr", "episode",
)
EXTRA_METRICS = ("time/generation", "time/scoring", "time/update", "train/skipped_steps")


def train(config) -> PPOTrainer:
    trainer = make_trainer(config)
    trainer.train()
    return trainer


def history(trainer: PPOTrainer) -> list[dict]:
    return trainer.state.log_history


# ---------------------------------------------------------------------------- flags and sizes


def test_prompt_batches_shard_disjointly_with_equal_counts():
    streams = [prompt_batches(10, 3, rank, 2, seed=1) for rank in range(2)]
    first = [[next(s) for _ in range(3)] for s in streams]
    epoch0 = [sum(b, [])[:5] for b in first]  # each rank's shard of epoch 0 has 10 // 2 = 5 prompts
    assert not set(epoch0[0]) & set(epoch0[1])
    assert all(len(b) == 3 for batches in first for b in batches)
    assert sorted(sum(epoch0, [])) != sum(epoch0, [])  # shuffled
    # shuffle_dataset=False (TRL GRPO's): the dataset's order, still sharded, epoch after epoch
    ordered = [prompt_batches(10, 3, rank, 2, seed=1, shuffle=False) for rank in range(2)]
    assert [next(ordered[0]) for _ in range(4)] == [[0, 2, 4], [6, 8, 0], [2, 4, 6], [8, 0, 2]]
    assert next(ordered[1]) == [1, 3, 5]


def test_left_pad_and_positions():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, multiple_of=4)
    assert ids.tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    assert ((mask.cumsum(1) - 1).clamp(min=0)).tolist() == [[0, 0, 1, 2], [0, 0, 0, 0]]


# ---------------------------------------------------------------------------- the algorithm's pieces


def test_per_token_rewards_put_the_score_on_the_last_real_token():
    kl = torch.ones(2, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rewards, nsr = per_token_rewards(kl, torch.tensor([3.0, 5.0]), mask, torch.tensor([1, 3]), kl_coef=0.5)
    assert rewards.tolist() == [[-0.5, 2.5, 0.0, 0.0], [-0.5, -0.5, -0.5, 4.5]]
    assert nsr.tolist() == [[-0.5, -0.5, 0.0, 0.0], [-0.5] * 4]


def test_advantages_are_whitened_over_real_tokens_only():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rewards = torch.randn(2, 4) * mask
    adv, ret = gae_advantages(rewards, torch.randn(2, 4) * mask, mask, 1.0, 0.95, whiten_rewards=False)
    assert adv[0, 3] == 0
    assert abs(adv[mask].mean().item()) < 1e-5 and abs(adv[mask].std().item() - 1) < 1e-3


def test_ppo_losses_at_ratio_one():
    logp = torch.randn(3, 5)
    adv, ret, values = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    loss, stats = grid_losses(logp, values, torch.rand(3, 5), logp, values, adv, ret, mask, cliprange=0.2,
                             cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0, ratio_threshold=10.0)
    s = dict(zip(STAT_NAMES, stats.tolist()))
    assert s["ratio"] == 1.0 and s["approxkl"] == 0.0 and s["pg_clipfrac"] == 0.0 and s["vf_clipfrac"] == 0.0
    torch.testing.assert_close(s["pg_loss"], -adv.mean().item())
    torch.testing.assert_close(s["vf_loss"], 0.5 * ((values - ret) ** 2).mean().item())


def test_ppo_losses_with_a_single_trained_token():
    """One trained token in a micro-batch (batch 1, the stop token first) is a step, not an error: its
    variance statistics are NaN (dropped from the logged means), the loss is finite."""
    logp, adv, ret, values = (torch.randn(1, 4) for _ in range(4))
    mask = torch.tensor([[True, False, False, False]])
    loss, stats = grid_losses(logp + 0.1, values, torch.rand(1, 4), logp, values, adv, ret, mask, cliprange=0.2,
                             cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0,
                             ratio_threshold=10.0)
    s = dict(zip(STAT_NAMES, stats.tolist()))
    assert torch.isfinite(loss) and math.isnan(s["returns_var"]) and math.isnan(s["values_var"])
    assert s["ratio"] == pytest.approx(math.exp(0.1), rel=1e-6)


def test_adaptive_kl_controller_moves_beta_toward_target():
    up = AdaptiveKLController(0.1, target=1.0, horizon=100)
    up.update(current_kl=5.0, n_steps=10)  # error clipped to +0.2
    assert up.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    down = AdaptiveKLController(0.1, target=1.0, horizon=100)
    down.update(current_kl=0.9, n_steps=10)
    assert down.value == pytest.approx(0.1 * (1 - 0.1 * 10 / 100))


def test_stop_token_truncation_in_rollout():
    queries, qmask = left_pad([[3, 4], [5]], pad_id=0)
    responses = torch.tensor([[7, 1, 8, 9], [7, 8, 9, 10]])
    r = make_rollout(queries, qmask, responses, stop_ids=[1], pad_id=0)
    assert r.responses.tolist() == [[7, 1, 0, 0], [7, 8, 9, 10]]
    assert r.lengths.tolist() == [2, 4] and r.has_stop.tolist() == [True, False]
    assert r.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]]


def test_reward_fn_validation_names_the_function():
    ok = call_reward_fn(lambda prompts, completions: [1.0] * len(completions), "m:f", ["a"], ["b"], "cpu")
    assert ok.tolist() == [1.0]
    with pytest.raises(RuntimeError, match="'m:boom' raised ZeroDivisionError"):
        call_reward_fn(lambda prompts, completions: 1 / 0, "m:boom", ["a"], ["b"], "cpu")
    with pytest.raises(ValueError, match="'m:inf' returned infinite scores at rows \\[1\\]"):
        call_reward_fn(lambda prompts, completions: [1.0, float("-inf")], "m:inf", ["a", "a"], ["b", "c"], "cpu")
    # None and NaN: not judged (TRL GRPO's meaning), NaN in the column
    assert call_reward_fn(lambda prompts, completions: [None, float("nan"), 2.0], "m:none", ["a"] * 3,
                          ["b"] * 3, "cpu").isnan().tolist() == [True, True, False]
    with pytest.raises(ValueError, match=r"'m:short' returned \(1,\) scores for 2 completions"):
        call_reward_fn(lambda prompts, completions: [1.0], "m:short", ["a", "a"], ["b", "c"], "cpu")


# ---------------------------------------------------------------------------- one rollout, by hand


def build_rollout(config: PPOConfig, n: int = 8):
    """A trainer on the embedded model and one scored rollout of n prompts (its steps 1-2)."""
    trainer = PPOTrainer(args=config)
    prompts = [trainer.tokenizer(p)["input_ids"] for p in ["the movie was", "i think the plot is", "overall the cast"] * 3]
    batch = trainer.rollout(prompts[:n])
    experience = compute_experience(trainer.actor_critic, trainer.reference, batch.rollout, Scoring(
        config.temperature, config.kl_estimator, config.local_rollout_forward_batch_size))
    return trainer, batch.rollout, experience


def targets_for(rollout, experience, scores):
    rewards, nsr = per_token_rewards(experience.kl, scores, rollout.response_mask, rollout.score_index, 0.05)
    adv, ret = gae_advantages(rewards, experience.values, rollout.response_mask, 1.0, 0.95, False)
    return Targets(rewards, nsr, adv, ret)


def test_first_ratio_is_one(tmp_path, model_dir):
    """Rollout scoring and the training forward share kernel and layout: ρ = 1 before any step,
    even with a different chunking (8 rows scored together, 4 trained together, shuffled)."""
    config = small_config(tmp_path, local_rollout_forward_batch_size=8, per_device_train_batch_size=4, temperature=0.7)
    trainer, rollout, experience = build_rollout(config)
    module = trainer.actor_critic
    module.train()
    rows = torch.tensor([5, 2, 7, 0])
    new_logprobs, _, new_values, _, _ = module(rollout.layout(rows.tolist()), config.temperature, return_entropy=True)
    torch.testing.assert_close(new_logprobs, experience.logprobs[rows], atol=1e-6, rtol=0)
    ratio = torch.exp(new_logprobs - experience.logprobs[rows])
    assert (ratio - 1).abs().max().item() < 1e-5
    torch.testing.assert_close(new_values * rollout.response_mask[rows], experience.values[rows], atol=1e-6, rtol=0)


def test_update_decreases_both_losses_on_its_batch(tmp_path, model_dir):
    config = small_config(tmp_path, num_ppo_epochs=6, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                          learning_rate=3e-3)
    trainer, rollout, experience = build_rollout(config)
    targets = targets_for(rollout, experience, torch.linspace(-1, 1, 8))
    module = trainer.actor_critic
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=config.learning_rate)
    sizes = derive_sizes(config, 1, 8)
    result = ppo_update(UpdateModel(module, optimizer), UpdateBatch(rollout, experience, targets), config, sizes,
                        torch.Generator().manual_seed(0))
    pg, vf = result.stats[STAT["pg_loss"]], result.stats[STAT["vf_loss"]]
    assert pg[-1].mean() < pg[0].mean() - 1e-3
    assert vf[-1].mean() < vf[0].mean()
    assert result.skipped_steps == 0 and result.optimizer_steps == 6


def test_reward_model_is_read_at_the_last_real_token(tmp_path, model_dir):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.from_pretrained(model_dir, num_labels=1)
    rm = AutoModelForSequenceClassification.from_config(cfg).eval()
    queries, qmask = left_pad([[3, 4, 5], [6]], pad_id=0)
    rollout = make_rollout(queries, qmask, torch.tensor([[7, 1, 9], [8, 9, 10]]), stop_ids=[1], pad_id=0)
    got = reward_model_scores(rm, rollout, chunk=1)
    with torch.no_grad():
        alone = [rm(input_ids=torch.tensor([seq])).logits[0, 0] for seq in ([3, 4, 5, 7, 1], [6, 8, 9, 10])]
    torch.testing.assert_close(got, torch.stack(alone), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- whole runs


@pytest.mark.slow
def test_scores_rise_on_a_learnable_reward(tmp_path):
    config = small_config(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=2, num_ppo_epochs=4,
                          response_length=8, total_episodes=32 * 14, learning_rate=3e-3,
                          local_rollout_forward_batch_size=32)
    history = [m for m in train(config).state.log_history]
    scores = [m["objective/scores"] for m in history]
    print("scores", [round(x, 2) for x in scores])
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 1.0, scores


def test_every_metric_present_finite_and_outputs_written(tmp_path):
    config = small_config(tmp_path, total_episodes=24, save_steps=2, num_sample_generations=2,
                          report_to=["tensorboard"])
    result = train(config)
    assert len(history(result)) == 3
    for m in history(result):
        assert set(TRL_METRICS + EXTRA_METRICS) <= set(m), set(TRL_METRICS + EXTRA_METRICS) - set(m)
        assert all(math.isfinite(v) for v in m.values()), m
    assert [m["episode"] for m in history(result)] == [8, 16, 24]
    out = tmp_path / "out"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["episode"] for line in lines] == [8, 16, 24]
    assert (out / "curves.png").stat().st_size > 0
    assert (out / "samples.jsonl").exists()
    assert any((out / "runs").rglob("events.out.tfevents.*"))
    # checkpoints: every save_steps and at the end, loadable by transformers; no final model beside them (as TRL's
    # train(): a script saves it with save_model())
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    assert not (out / "model.safetensors").exists() and not (out / "value_model").exists()
    for path in (out / "checkpoint-2", out / "checkpoint-3"):
        policy = AutoModelForCausalLM.from_pretrained(path)
        AutoModelForSequenceClassification.from_pretrained(path / "value_model")
        AutoTokenizer.from_pretrained(path)
    final = dict(result.policy.named_parameters())
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p, final[name].detach(), atol=0, rtol=0)


def test_adaptive_kl_moves_beta_toward_target_in_a_run(tmp_path):
    run = train(small_config(tmp_path, adaptive_kl=True, kl_coef=0.1, kl_target=1e-4, kl_horizon=100, total_episodes=32,
                             learning_rate=1e-2))
    betas = [m["kl_coef"] for m in history(run)]
    kls = [m["objective/kl"] for m in history(run)]
    assert kls[0] == 0.0  # policy == reference before the first update
    assert betas[1] < betas[0]  # KL 0 is below the target: β went down after iteration 1
    assert all(k > 1e-4 for k in kls[1:]) and betas[-1] > betas[1]  # then above it: β goes up


@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_kl_estimators_run(tmp_path, estimator):
    runs = history(train(small_config(tmp_path, kl_estimator=estimator, total_episodes=16, learning_rate=1e-2)))
    assert runs[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)
    assert runs[1]["objective/kl"] > 0


def test_peft_run_trains_adapters_and_uses_the_base_as_reference(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM

    config = small_config(tmp_path, use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"],
                          learning_rate=1e-2, total_episodes=24)
    result = train(config)
    kls = [m["objective/kl"] for m in history(result)]
    assert kls[0] == 0.0 and kls[-1] > 0  # the reference is the base model, adapter off
    result.save_model()
    out = tmp_path / "out"
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    trained_base = result.policy.get_base_model()
    for name, p in base.named_parameters():
        if "lm_head" in name or "embed" in name or "norm" in name or "mlp" in name:
            torch.testing.assert_close(p, dict(trained_base.named_parameters())[name].detach())
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # transformers loads base + adapter
    assert any("lora" in n for n, _ in reloaded.named_parameters())


def test_peft_with_an_explicit_ref_model_uses_it(tmp_path, model_dir):
    """TRL keeps a ref_model the caller passes, PEFT or not; only ref_model=None means the adapter-off policy."""
    from transformers import AutoModelForCausalLM

    pytest.importorskip("peft")
    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = make_trainer(small_config(tmp_path, use_peft=True, lora_r=4, lora_alpha=8,
                                        lora_target_modules=["q_proj", "v_proj"]), ref_model=ref)
    assert trainer.ref_model is ref and not any(p.requires_grad for p in ref.parameters())
    assert make_trainer(small_config(tmp_path, output_dir=str(tmp_path / "none"), use_peft=True, lora_r=4,
                                     lora_target_modules=["q_proj"])).ref_model is None


def test_a_peft_config_with_an_lm_head_adapter_is_refused(tmp_path, model_dir):
    peft = pytest.importorskip("peft")
    with pytest.raises(ValueError, match="peft_config: target_modules may not include lm_head"):
        PPOTrainer(args=small_config(tmp_path), peft_config=peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_stop_token_and_local_dataset_files(tmp_path, fmt):
    import datasets

    data = tmp_path / f"prompts.{fmt}"
    rows = {"question": ["the movie was", "the plot is"] * 8, "id": list(range(16))}
    if fmt == "jsonl":
        datasets.Dataset.from_dict(rows).to_json(data)
    else:
        datasets.Dataset.from_dict(rows).to_parquet(data)
    runs = history(train(small_config(tmp_path, dataset_name=str(data), dataset_text_field="question", stop_token="eos",
                                      missing_eos_penalty=1.0, pad_to_multiple_of=8)))
    assert len(runs) == 2 and all(m["val/num_eos_tokens"] >= 0 for m in runs)


def test_reward_model_path_run(tmp_path, model_dir):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    rm_dir = tmp_path / "rm"
    cfg = AutoConfig.from_pretrained(model_dir, num_labels=1)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(rm_dir)
    runs = history(train(small_config(tmp_path, reward_model_path=str(rm_dir), value_model_path=str(rm_dir))))
    assert all(math.isfinite(m["objective/scores"]) for m in runs)


@pytest.mark.parametrize("arch", ["gpt2", "phi"])
def test_other_architectures_and_a_tokenizer_without_pad_token(tmp_path, model_dir, capsys, arch):
    """GPT-2 (tied LM head, learned positions) and Phi (LM head with bias), with a tokenizer that has
    no pad token: the run adds one (eos), says so, and keeps the first ratio at 1."""
    from transformers import GPT2Config, GPT2LMHeadModel, PhiConfig, PhiForCausalLM, PreTrainedTokenizerFast

    src = load_tokenizer(model_dir, ModelConfig(), print)
    no_pad = PreTrainedTokenizerFast(tokenizer_object=src.backend_tokenizer, eos_token="<eos>", unk_token="<unk>")
    assert no_pad.pad_token is None
    v, eos = len(no_pad), no_pad.eos_token_id
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=v, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                           eos_token_id=eos, bos_token_id=eos))
    else:
        model = PhiForCausalLM(PhiConfig(vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=64, eos_token_id=eos,
                                         bos_token_id=eos, pad_token_id=None))
    arch_dir = tmp_path / arch
    no_pad.save_pretrained(arch_dir)
    model.save_pretrained(arch_dir)
    runs = history(train(small_config(tmp_path, sft_model_path=str(arch_dir), stop_token="eos", num_ppo_epochs=1,
                                      gradient_accumulation_steps=1, per_device_train_batch_size=8)))
    assert len(runs) == 2
    assert runs[0]["val/ratio"] == pytest.approx(1.0, abs=1e-5)  # one epoch, one step: ρ is 1 throughout
    assert "no pad token: using its eos token" in capsys.readouterr().out
