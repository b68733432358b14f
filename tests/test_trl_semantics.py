"""TRL's flags with TRL's meanings: the docs' command lines, the PPOv2 EOS trick, the flags every TRL command
line may carry, the metrics as TRL defines them, legacy early stopping, the LM-head bias in the full KL, and
pad == eos tokenizers."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import shlex

import pytest
import torch

from fastppo import PPOConfig, PPOTrainer
from fastppo.cli import parse_args
from fastppo.sizes import derive_sizes
from helpers import make_trainer, small_config
from fastppo.train import Scoring, compute_experience, per_token_rewards
from fastppo.rollout import apply_eos_penalties
from fastppo.advantages import gae_advantages

pytestmark = pytest.mark.usefixtures("reference_path")


# one PPO epoch, three iterations, the rollout scored in one chunk of up to 64 rows
tiny = functools.partial(small_config, num_ppo_epochs=1, total_episodes=24, local_rollout_forward_batch_size=64)


def run(config, **kwargs) -> PPOTrainer:
    trainer = make_trainer(config, **kwargs)
    trainer.train()
    return trainer


# ---------------------------------------------------------------------------- TRL's docs, as they are

# TRL 0.26.2 docs/source/ppo_trainer.md, and PPOv2's (TRL 0.9.6 docs/source/ppov2_trainer.md), minus the
# script name; accelerate launch runs them on 8 processes.
TRL_026_MINIMAL = """--dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style
    --dataset_train_split descriptiveness --learning_rate 3e-6 --num_ppo_epochs 1 --num_mini_batches 1
    --output_dir models/minimal/ppo --per_device_train_batch_size 64 --gradient_accumulation_steps 1
    --total_episodes 10000 --model_name_or_path EleutherAI/pythia-1b-deduped
    --sft_model_path EleutherAI/pythia-1b-deduped --reward_model_path EleutherAI/pythia-1b-deduped
    --missing_eos_penalty 1.0"""
TRL_026_TLDR = """--output_dir models/minimal/ppo_tldr --learning_rate 3e-6 --per_device_train_batch_size 16
    --gradient_accumulation_steps 4 --total_episodes 1000000 --model_name_or_path EleutherAI/pythia-1b-deduped
    --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr
    --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr --local_rollout_forward_batch_size 16
    --missing_eos_penalty 1.0 --stop_token eos"""
PPOV2_TLDR = """--output_dir models/minimal/ppo_tldr_6.9b --learning_rate 3e-6 --per_device_train_batch_size 1
    --gradient_accumulation_steps 64 --total_episodes 100000 --model_name_or_path EleutherAI/pythia-6.9b-deduped
    --sft_model_path cleanrl/EleutherAI_pythia-6.9b-deduped__sft__tldr
    --reward_model_path cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr --local_rollout_forward_batch_size 2
    --non_eos_penalty --stop_token eos"""


@pytest.mark.parametrize("line, world, batch, iterations", [
    (TRL_026_MINIMAL, 8, 512, math.ceil(10000 / 512)),
    (TRL_026_TLDR, 8, 512, math.ceil(1000000 / 512)),
    (PPOV2_TLDR, 8, 512, math.ceil(100000 / 512)),
])
def test_trl_docs_command_lines_mean_the_same_here(line, world, batch, iterations):
    config = parse_args(shlex.split(line))[1]
    sizes = derive_sizes(config, world, num_prompts=1000)
    assert sizes.batch_size == batch and sizes.num_total_batches == iterations
    assert sizes.local_micro_batch_size == config.per_device_train_batch_size and sizes.num_mini_batches == 1
    assert config.learning_rate == 3e-6 and config.response_length == 53 and config.temperature == 0.7
    if "--non_eos_penalty" in line:
        assert config.non_eos_penalty and config.penalty_reward_value == -1.0 and config.stop_token == "eos"
    else:
        assert config.missing_eos_penalty == 1.0


def test_a_docs_command_line_runs_here_with_local_stand_ins(tmp_path, model_dir):
    """TRL 0.26's minimal example with the Hub names swapped for local copies and fewer episodes."""
    import datasets

    data = tmp_path / "prompts"
    datasets.DatasetDict({"descriptiveness": datasets.Dataset.from_dict(
        {"prompt": ["the movie was", "i think the plot is"] * 40})}).save_to_disk(data)
    line = (TRL_026_MINIMAL.replace("trl-internal-testing/descriptiveness-sentiment-trl-style", str(data))
            .replace("EleutherAI/pythia-1b-deduped", model_dir).replace("--total_episodes 10000", "--total_episodes 64")
            .replace("--reward_model_path " + model_dir, "--reward_fn fastppo.rewards:positive_words")
            .replace("models/minimal/ppo", str(tmp_path / "out")))
    from fastppo.cli import main

    main([*shlex.split(line), "--disable_tqdm", "true", "--num_sample_generations", "0"])
    metrics = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["episode"] for m in metrics] == [64]  # one iteration of 64 × 1 rows


# ---------------------------------------------------------------------------- the EOS tricks


def test_non_eos_penalty_replaces_and_missing_eos_penalty_subtracts():
    scores, stopped = torch.tensor([2.0, 3.0, -1.5]), torch.tensor([True, False, False])
    assert apply_eos_penalties(scores, stopped, None, True, -1.0).tolist() == [2.0, -1.0, -1.0]
    assert apply_eos_penalties(scores, stopped, 1.0, False, -1.0).tolist() == [2.0, 2.0, -2.5]
    assert apply_eos_penalties(scores, stopped, None, False, -1.0).tolist() == [2.0, 3.0, -1.5]


def test_non_eos_penalty_in_a_run(tmp_path, model_dir):
    seen = []

    def reward(completions, completion_ids, **kwargs):
        seen.append(completion_ids)
        return [10.0] * len(completions)

    trainer = run(tiny(tmp_path, stop_token="eos", non_eos_penalty=True, penalty_reward_value=-3.0,
                       total_episodes=8), reward_model=reward)
    eos = trainer.tokenizer.eos_token_id
    stopped = [ids[-1] == eos for ids in seen[0]]
    expected = sum(10.0 if s else -3.0 for s in stopped) / len(stopped)
    assert trainer.state.log_history[0]["objective/scores"] == pytest.approx(expected)


# ---------------------------------------------------------------------------- flags every TRL command line may carry


def test_warmup_and_the_logged_lr_is_the_one_used(tmp_path, model_dir):
    """lr is the rate of the iteration it is logged with (TRL logs before stepping the scheduler)."""
    plain = run(tiny(tmp_path / "plain", lr_scheduler_type="linear", total_episodes=24))
    assert [m["lr"] for m in plain.state.log_history] == pytest.approx([3e-3, 2e-3, 1e-3])  # never the next one, never 0
    warm = run(tiny(tmp_path / "warm", lr_scheduler_type="linear", total_episodes=32, warmup_steps=2))
    assert [m["lr"] for m in warm.state.log_history] == pytest.approx([0.0, 1.5e-3, 3e-3, 1.5e-3])
    fraction = {"warmup_ratio": 0.5} if "warmup_ratio" in PPOConfig.__dataclass_fields__ else {"warmup_steps": 0.5}
    ratio = run(tiny(tmp_path / "ratio", lr_scheduler_type="linear", total_episodes=32, **fraction))
    assert [m["lr"] for m in ratio.state.log_history] == pytest.approx([0.0, 1.5e-3, 3e-3, 1.5e-3])


def test_optim_and_adam_betas(tmp_path, model_dir):
    fused = PPOTrainer(args=tiny(tmp_path, adam_beta1=0.8, adam_beta2=0.95))
    assert fused.optimizer.defaults["fused"] and fused.optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    plain = PPOTrainer(args=tiny(tmp_path, optim="adamw_torch"))
    assert not plain.optimizer.defaults["fused"] and plain.optimizer.defaults["foreach"]
    # (an unsupported optim is refused: test_bad_input.py)


def test_dtype_loads_weights_in_that_dtype(tmp_path, model_dir):
    trainer = make_trainer(tiny(tmp_path, dtype="bfloat16"))
    for model in (trainer.policy, trainer.ref_model, trainer.value_model):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert parse_args(["--torch_dtype", "float16"])[2].dtype == "float16"  # TRL's older name


def test_frozen_models_in_bf16_under_bf16(tmp_path, model_dir):
    trainer = PPOTrainer(args=tiny(tmp_path, bf16=True, use_cpu=not torch.cuda.is_available()))  # transformers: bf16 on a CPU needs use_cpu
    assert {p.dtype for p in trainer.ref_model.parameters()} == {torch.bfloat16}  # forwards only
    assert {p.dtype for p in trainer.policy.parameters()} == {torch.float32}  # fp32 master weights


def test_revision_trust_remote_code_and_checkpointing_kwargs_reach_transformers(tmp_path, model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    calls = []
    for cls in (AutoModelForCausalLM, AutoTokenizer):
        original = cls.from_pretrained.__func__

        def spy(klass, *args, _original=original, **kwargs):
            calls.append(kwargs)
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    enabled = []
    name = ("activation_checkpointing_enable" if hasattr(PreTrainedModel, "activation_checkpointing_enable")
            else "gradient_checkpointing_enable")  # transformers 5 / 4
    original_gc = getattr(PreTrainedModel, name)

    keyword = name.replace("_enable", "_kwargs")

    def spy_gc(self, *args, **kwargs):
        enabled.append(args[0] if args else kwargs.get(keyword))
        return original_gc(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, name, spy_gc)
    make_trainer(tiny(tmp_path, sft_model_path=model_dir, model_revision="v1", trust_remote_code=True,
                      gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}))
    assert calls and all(c.get("revision") == "v1" and c.get("trust_remote_code") is True for c in calls)
    assert enabled and all(k == {"use_reentrant": True} for k in enabled)


def test_max_steps_logging_first_step_and_save_total_limit(tmp_path, model_dir):
    trainer = run(tiny(tmp_path, max_steps=5, total_episodes=800, logging_steps=3, logging_first_step=True,
                       save_steps=1, save_total_limit=2))
    assert trainer.state.global_step == 5  # max_steps overrides total_episodes
    assert [m["step"] for m in trainer.state.log_history] == [1, 2, 3, 4, 5]  # TRL logs every iteration
    logged = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 3, 5]  # fastppo's loggers: every logging_steps, the first and the last
    checkpoints = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-4", "checkpoint-5"]  # the newest 2 (the last iteration is checkpointed too)


# ---------------------------------------------------------------------------- metrics as TRL defines them


def test_ratio_threshold_zeroing_is_counted_and_logged_as_zero_loss(tmp_path, model_dir):
    trainer = PPOTrainer(args=tiny(tmp_path, ratio_threshold=1e-6, num_ppo_epochs=2, total_episodes=8))
    before = {k: v.clone() for k, v in trainer.actor_critic.state_dict().items()}
    trainer.train()
    m = trainer.state.log_history[0]
    assert m["train/ratio_skipped_microbatches"] == 2 * 2  # every micro-batch: 2 epochs × 2 micro-steps
    assert m["loss/policy_avg"] == 0.0 and m["loss/value_avg"] == 0.0
    for k, v in trainer.actor_critic.state_dict().items():
        assert torch.equal(v, before[k]), k  # zero gradients, zero Adam moments: no movement


def pad_is_eos_model(model_dir, tmp_path):
    """The embedded model with a tokenizer whose pad token is its eos token (SmolLM2, Llama 3, GPT-2 + pad=eos)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.pad_token_id = tok.eos_token_id
    path = tmp_path / "pad_is_eos"
    tok.save_pretrained(path)
    model.save_pretrained(path)
    return str(path), tok.eos_token_id


def test_pad_equal_to_eos_keeps_trains_and_scores_the_stop_token(tmp_path, model_dir, monkeypatch):
    path, eos = pad_is_eos_model(model_dir, tmp_path)
    seen = {}
    from fastppo import generation
    from fastppo import trainer as trainer_module

    sample = generation.sample_responses

    def with_stops(lm, queries, query_mask, response_length, sampling, chunk, *args, **options):
        """The sampler's output with an eos planted in rows 0, 2, 5 (a random tiny model rarely emits one)."""
        pad_id = sampling.pad_id
        out = sample(lm, queries, query_mask, response_length, dataclasses.replace(sampling, stop_ids=()), chunk,
                     *args, **options)
        out[out == eos] = eos + 1  # no stray eos: rows 1, 3, 4, 6, 7 run to the end
        for row, at in ((0, 3), (2, 0), (5, response_length - 1)):
            out[row, at] = eos
            out[row, at + 1:] = pad_id  # what the sampler writes after a stop: pad, which is eos here
        return out

    monkeypatch.setattr(trainer_module, "sample_responses", with_stops)  # the name the trainer calls

    def reward(completions, completion_ids, **kwargs):
        seen["ids"] = completion_ids
        return [float(len(c)) for c in completion_ids]

    cfg = tiny(tmp_path, sft_model_path=path, stop_token="eos", response_length=24, total_episodes=8,
               temperature=2.0)
    trainer = PPOTrainer(args=cfg, reward_model=reward)
    torch.manual_seed(3)
    batch = trainer.rollout()
    r = batch.rollout
    stopped = r.has_stop.tolist()
    assert stopped == [True, False, True, False, False, True, False, False]
    for i, ids in enumerate(seen["ids"]):
        length = r.response_lengths[i]
        assert len(ids) == length and (ids[-1] == eos) == stopped[i]  # the stop token is kept and scored
        assert r.response_mask[i, :length].all() and not r.response_mask[i, length:].any()  # and trained on
        assert (r.responses[i, length:] == eos).all()  # padding (== eos) after it is not part of the response
    assert batch.eos_count.item() == sum(stopped)  # eos tokens among real tokens only: never the padding
    experience = compute_experience(trainer.actor_critic, trainer.reference, r, Scoring(cfg.temperature, "k1", 8))
    rewards, _ = per_token_rewards(experience.kl, batch.scores, r.response_mask, r.score_index, 0.05)
    for i in range(len(stopped)):
        last = r.response_lengths[i] - 1
        assert rewards[i, last] != 0 and (rewards[i, last + 1:] == 0).all()  # the score sits on the stop token
    adv, _ = gae_advantages(rewards, experience.values, r.response_mask, 1.0, 0.95, False)
    assert (adv[~r.response_mask] == 0).all() and (adv[r.response_mask] != 0).all()
    trainer.train()
    assert trainer.state.log_history[0]["val/num_eos_tokens"] == 3  # the 3 stops, not the padding after them


# ---------------------------------------------------------------------------- legacy early stopping


@pytest.mark.parametrize("target_kl", [1e-12, 1e6])
def test_early_stopping_stops_the_epochs_on_the_policy_kl_legacy_semantics(tmp_path, model_dir, target_kl):
    from fastppo.sizes import derive_sizes as sizes_of
    from fastppo.metrics import STAT
    from fastppo.train import Targets, UpdateBatch, UpdateModel, ppo_update

    cfg = tiny(tmp_path, num_ppo_epochs=4, num_mini_batches=2, early_stopping=True, target_kl=target_kl,
               stop_token="eos", total_episodes=8)
    trainer = PPOTrainer(args=cfg)
    batch = trainer.rollout()
    r = batch.rollout
    experience = compute_experience(trainer.actor_critic, trainer.reference, r, Scoring(cfg.temperature, "k1", 8))
    rewards, nsr = per_token_rewards(experience.kl, torch.linspace(-2, 2, 8), r.response_mask, r.score_index, 0.05)
    adv, ret = gae_advantages(rewards, experience.values, r.response_mask, 1.0, 0.95, False)
    result = ppo_update(UpdateModel(trainer.actor_critic, trainer.optimizer),
                        UpdateBatch(r, experience, Targets(rewards, nsr, adv, ret)),
                        cfg, sizes_of(cfg, 1, 8), torch.Generator().manual_seed(0))
    # after each epoch: the policy KL (mean old − new) of its last minibatch against 1.5 × target_kl
    policykl = result.stats[STAT["policykl"], :, -1].nanmean(-1)
    expected = next((e + 1 for e in range(4) if policykl[e] > 1.5 * target_kl), 4)
    assert result.epochs_run == expected
    assert torch.isnan(result.stats[STAT["policykl"], expected:]).all()  # no epoch ran after the stop
    if target_kl > 1:
        assert result.epochs_run == 4


# ---------------------------------------------------------------------------- the full KL with a biased LM head


def test_full_kl_includes_the_lm_head_bias(tmp_path, model_dir):
    """Phi's LM head has a bias: the exact KL over the vocabulary must see it (it was dropped before)."""
    from transformers import AutoTokenizer, PhiConfig, PhiForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    phi = PhiForCausalLM(PhiConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, max_position_embeddings=64, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id))
    path = tmp_path / "phi"
    phi.save_pretrained(path)
    tok.save_pretrained(path)
    cfg = tiny(tmp_path, sft_model_path=str(path), kl_estimator="full", total_episodes=8)
    trainer = PPOTrainer(args=cfg)
    with torch.no_grad():  # move the policy's bias only: the KL to the reference is then all in the bias
        trainer.policy.lm_head.bias.add_(torch.randn_like(trainer.policy.lm_head.bias))
    batch = trainer.rollout()
    r = batch.rollout
    experience = compute_experience(trainer.actor_critic, trainer.reference, r, Scoring(cfg.temperature, "full", 8))
    with torch.no_grad():
        ids, mask, c = r.query_responses, r.attention_mask, r.context_length
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        logp = torch.log_softmax(trainer.policy(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, c - 1:-1]
                                 / cfg.temperature, -1)
        logq = torch.log_softmax(trainer.ref_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, c - 1:-1]
                                 / cfg.temperature, -1)
        exact = (logp.exp() * (logp - logq)).sum(-1) * r.response_mask
    assert exact.abs().max() > 1e-2
    torch.testing.assert_close(experience.kl, exact, atol=1e-4, rtol=1e-3)
