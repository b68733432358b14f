"""End-to-end and unit tests of fastppo/train.py on tiny local models (CPU, reference kernels).

Every run here is offline: the embedded tiny Llama is built into a per-session cache and other
models are built in tmp_path. The distributed test lives in test_train_distributed.py.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from fastppo import embedded
from fastppo.train import (
    STAT_NAMES,
    AdaptiveKLController,
    PolicyAndValue,
    PPOConfig,
    Reference,
    call_reward_fn,
    compute_advantages,
    derive_sizes,
    generate_responses,
    left_pad,
    load_models,
    load_tokenizer,
    make_rollout,
    parse_args,
    per_token_rewards,
    position_ids_of,
    ppo_losses,
    ppo_update,
    prompt_batches,
    reward_model_scores,
    score_rollout,
    train,
)

pytestmark = pytest.mark.usefixtures("reference_path")

TRL_METRICS = (
    "eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
    "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
    "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr", "episode",
)
EXTRA_METRICS = ("time/generation", "time/scoring", "time/update", "train/skipped_steps")


@pytest.fixture(scope="session", autouse=True)
def embedded_cache(tmp_path_factory):
    """Build the embedded model once per session, outside the user's cache."""
    old = os.environ.get("FASTPPO_CACHE")
    os.environ["FASTPPO_CACHE"] = str(tmp_path_factory.mktemp("fastppo-cache"))
    path = embedded.embedded_model_path()
    yield path
    if old is None:
        os.environ.pop("FASTPPO_CACHE", None)
    else:
        os.environ["FASTPPO_CACHE"] = old


def tiny(tmp_path, **overrides) -> PPOConfig:
    """A run of a few seconds: 8 episodes per iteration, 6-token responses."""
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_ppo_epochs=2, response_length=6, total_episodes=16, num_sample_generations=0, disable_tqdm=True,
        local_rollout_forward_batch_size=8, save_steps=10**6, logging_steps=1,
    )
    base.update(overrides)
    return PPOConfig(**base)


def write_module(tmp_path, monkeypatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


# ---------------------------------------------------------------------------- flags and sizes


def test_help_lists_every_flag_with_help(capsys):
    import dataclasses

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(PPOConfig):
        assert f"--{f.name}" in out, f.name
        assert f.metadata.get("help"), f"{f.name} has no help text"


def test_trl_defaults_unless_embedded():
    from fastppo.train import EMBEDDED_DEFAULTS, TRL_DEFAULTS

    # A command line with a real model gets TRL's defaults.
    trl_style = parse_args(["--model_name_or_path", "some/model"])
    assert {k: getattr(trl_style, k) for k in TRL_DEFAULTS} == TRL_DEFAULTS
    # The embedded default has its own, but a value set explicitly is kept, even TRL's.
    embedded_run = parse_args(["--gradient_accumulation_steps", "1"])
    assert embedded_run.gradient_accumulation_steps == 1
    assert embedded_run.learning_rate == EMBEDDED_DEFAULTS["learning_rate"] != TRL_DEFAULTS["learning_rate"]


@pytest.mark.parametrize("argv, expected", [([], None), (["--bf16"], True), (["--bf16", "false"], False),
                                            (["--bf16", "--seed", "3"], True)])
def test_bf16_flag_bare_or_with_value(argv, expected):
    assert parse_args(argv).bf16 is expected


def test_trl_command_line_parses():
    config = parse_args([
        "--sft_model_path", "x", "--reward_model_path", "y", "--stop_token", "eos", "--missing_eos_penalty", "1.0",
        "--kl_coef", "0.1", "--num_mini_batches", "2", "--stop_token_id", "5", "7", "--adap_kl_ctrl",
        "--target", "3", "--horizon", "500", "--report_to", "tensorboard",
    ])
    assert config.stop_token == "eos" and config.stop_token_id == [5, 7]
    assert config.adaptive_kl and config.target_kl == 3.0 and config.kl_horizon == 500.0
    assert config.report_to == ["tensorboard"]


def test_derive_sizes():
    s = derive_sizes(PPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_mini_batches=2,
                               total_episodes=100), world_size=2, num_prompts=10)
    assert (s.local_batch_size, s.batch_size, s.local_mini_batch_size, s.micro_steps) == (16, 32, 8, 2)
    assert s.num_total_batches == 3
    with pytest.raises(ValueError, match="divisible by num_mini_batches"):
        derive_sizes(PPOConfig(per_device_train_batch_size=3, gradient_accumulation_steps=1, num_mini_batches=2),
                     1, 100)
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be divisible"):
        derive_sizes(PPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=2),
                     1, 100)


def test_prompt_batches_shard_disjointly_with_equal_counts():
    streams = [prompt_batches(10, 3, rank, 2, seed=1) for rank in range(2)]
    first = [[next(s) for _ in range(3)] for s in streams]
    epoch0 = [sum(b, [])[:5] for b in first]  # each rank's shard of epoch 0 has 10 // 2 = 5 prompts
    assert not set(epoch0[0]) & set(epoch0[1])
    assert all(len(b) == 3 for batches in first for b in batches)


def test_left_pad_and_positions():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, multiple_of=4)
    assert ids.tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    assert position_ids_of(mask).tolist() == [[0, 0, 1, 2], [0, 0, 0, 0]]


# ---------------------------------------------------------------------------- the algorithm's pieces


def test_per_token_rewards_put_the_score_on_the_last_real_token():
    kl = torch.ones(2, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rewards, nsr = per_token_rewards(kl, torch.tensor([3.0, 5.0]), mask, torch.tensor([2, 4]), kl_coef=0.5)
    assert rewards.tolist() == [[-0.5, 2.5, 0.0, 0.0], [-0.5, -0.5, -0.5, 4.5]]
    assert nsr.tolist() == [[-0.5, -0.5, 0.0, 0.0], [-0.5] * 4]


def test_advantages_are_whitened_over_real_tokens_only():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rewards = torch.randn(2, 4) * mask
    adv, ret = compute_advantages(rewards, torch.randn(2, 4) * mask, mask, 1.0, 0.95, whiten_rewards=False)
    assert adv[0, 3] == 0
    assert abs(adv[mask].mean().item()) < 1e-5 and abs(adv[mask].std().item() - 1) < 1e-3


def test_ppo_losses_at_ratio_one():
    logp = torch.randn(3, 5)
    adv, ret, values = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    loss, stats = ppo_losses(logp, values, torch.rand(3, 5), logp, values, adv, ret, mask, 0.2, 0.2, 0.1, 0.0, 10.0)
    s = dict(zip(STAT_NAMES, stats.tolist()))
    assert s["ratio"] == 1.0 and s["approxkl"] == 0.0 and s["pg_clipfrac"] == 0.0 and s["vf_clipfrac"] == 0.0
    torch.testing.assert_close(s["pg_loss"], -adv.mean().item())
    torch.testing.assert_close(s["vf_loss"], 0.5 * ((values - ret) ** 2).mean().item())


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
    with pytest.raises(ValueError, match="'m:nan' returned non-finite"):
        call_reward_fn(lambda prompts, completions: [float("nan")], "m:nan", ["a"], ["b"], "cpu")
    with pytest.raises(ValueError, match=r"'m:short' returned \(1,\) scores for 2 completions"):
        call_reward_fn(lambda prompts, completions: [1.0], "m:short", ["a", "a"], ["b", "c"], "cpu")


# ---------------------------------------------------------------------------- one rollout, by hand


def build_rollout(config: PPOConfig, model_path: str, n: int = 8):
    """Models, a rollout of n prompts, scored; what train() does for steps 1-2."""
    tokenizer = load_tokenizer(model_path, print)
    policy, ref_model, value_model, _ = load_models(config, model_path, tokenizer, torch.device("cpu"), print)
    module = PolicyAndValue(policy, value_model)
    prompts = [tokenizer(p)["input_ids"] for p in ["the movie was", "i think the plot is", "overall the cast"] * 3]
    queries, qmask = left_pad(prompts[:n], tokenizer.pad_token_id)
    module.eval()
    responses = generate_responses(policy, queries, qmask, config.response_length, config.temperature, [],
                                   tokenizer.pad_token_id, chunk=config.local_rollout_forward_batch_size)
    rollout = make_rollout(queries, qmask, responses, [], tokenizer.pad_token_id)
    score_rollout(module, Reference(ref_model, policy), rollout, config.temperature, config.kl_estimator,
                  config.local_rollout_forward_batch_size)
    return module, rollout


def test_first_ratio_is_one(tmp_path, embedded_cache):
    """Rollout scoring and the training forward share kernel and layout: ρ = 1 before any step,
    even with a different chunking (8 rows scored together, 4 trained together, shuffled)."""
    config = tiny(tmp_path, local_rollout_forward_batch_size=8, per_device_train_batch_size=4, temperature=0.7)
    module, rollout = build_rollout(config, embedded_cache)
    module.train()
    rows = torch.tensor([5, 2, 7, 0])
    new_logprobs, _, new_values, _ = module(
        rollout.query_responses[rows], rollout.attention_mask[rows], rollout.position_ids[rows],
        rollout.context_length, config.temperature, return_entropy=True,
    )
    torch.testing.assert_close(new_logprobs, rollout.logprobs[rows], atol=1e-6, rtol=0)
    ratio = torch.exp(new_logprobs - rollout.logprobs[rows])
    assert (ratio - 1).abs().max().item() < 1e-5
    torch.testing.assert_close(new_values, rollout.values[rows], atol=1e-6, rtol=0)


def test_update_decreases_both_losses_on_its_batch(tmp_path, embedded_cache):
    config = tiny(tmp_path, num_ppo_epochs=6, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                  learning_rate=3e-3)
    module, rollout = build_rollout(config, embedded_cache)
    scores = torch.linspace(-1, 1, 8)
    rewards, _ = per_token_rewards(rollout.kl, scores, rollout.response_mask, rollout.lengths, 0.05)
    adv, ret = compute_advantages(rewards, rollout.values, rollout.response_mask, 1.0, 0.95, False)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=config.learning_rate)
    sizes = derive_sizes(config, 1, 8)
    result = ppo_update(module, optimizer, rollout, adv, ret, config, sizes, torch.Generator().manual_seed(0))
    pg, vf = result.stats[STAT_NAMES.index("pg_loss")], result.stats[STAT_NAMES.index("vf_loss")]
    assert pg[-1].mean() < pg[0].mean() - 1e-3
    assert vf[-1].mean() < vf[0].mean()
    assert result.skipped_steps == 0 and result.optimizer_steps == 6


def test_nonfinite_loss_skips_the_step_and_keeps_weights(tmp_path, embedded_cache, capsys):
    config = tiny(tmp_path, num_ppo_epochs=2, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    module, rollout = build_rollout(config, embedded_cache)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    adv = torch.full_like(rollout.values, float("nan"))
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    result = ppo_update(module, optimizer, rollout, adv, rollout.values, config, derive_sizes(config, 1, 8),
                        torch.Generator().manual_seed(0))
    assert result.skipped_steps == 2 and result.optimizer_steps == 0
    assert "step skipped" in capsys.readouterr().out
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not optimizer.state  # AdamW moments never saw the NaN gradients


def test_reward_model_is_read_at_the_last_real_token(tmp_path, embedded_cache):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.from_pretrained(embedded_cache, num_labels=1)
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
    config = tiny(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=2, num_ppo_epochs=4,
                  response_length=8, total_episodes=32 * 14, learning_rate=3e-3, local_rollout_forward_batch_size=32)
    history = train(config).history
    scores = [m["objective/scores"] for m in history]
    print("scores", [round(x, 2) for x in scores])
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 1.0, scores


def test_every_metric_present_finite_and_outputs_written(tmp_path):
    config = tiny(tmp_path, total_episodes=24, save_steps=2, num_sample_generations=2, report_to=["tensorboard"])
    result = train(config)
    assert len(result.history) == 3
    for m in result.history:
        assert set(TRL_METRICS + EXTRA_METRICS) <= set(m), set(TRL_METRICS + EXTRA_METRICS) - set(m)
        assert all(math.isfinite(v) for v in m.values()), m
    assert [m["episode"] for m in result.history] == [8, 16, 24]
    out = tmp_path / "out"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["episode"] for line in lines] == [8, 16, 24]
    assert (out / "curves.png").stat().st_size > 0
    assert (out / "samples.jsonl").exists()
    assert any((out / "runs").rglob("events.out.tfevents.*"))
    # checkpoints: every save_steps and at the end, loadable by transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    for path in (out / "checkpoint-2", out):
        policy = AutoModelForCausalLM.from_pretrained(path)
        AutoModelForSequenceClassification.from_pretrained(path / "value_model")
        AutoTokenizer.from_pretrained(path)
    final = dict(result.policy.named_parameters())
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p, final[name].detach(), atol=0, rtol=0)


def test_adaptive_kl_moves_beta_toward_target_in_a_run(tmp_path):
    run = train(tiny(tmp_path, adaptive_kl=True, kl_coef=0.1, target_kl=1e-4, kl_horizon=100, total_episodes=32,
                     learning_rate=1e-2))
    betas = [m["kl_coef"] for m in run.history]
    kls = [m["objective/kl"] for m in run.history]
    assert kls[0] == 0.0  # policy == reference before the first update
    assert betas[1] < betas[0]  # KL 0 is below the target: β went down after iteration 1
    assert all(k > 1e-4 for k in kls[1:]) and betas[-1] > betas[1]  # then above it: β goes up


@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_kl_estimators_run(tmp_path, estimator):
    history = train(tiny(tmp_path, kl_estimator=estimator, total_episodes=16, learning_rate=1e-2)).history
    assert history[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)
    assert history[1]["objective/kl"] > 0


def test_peft_run_trains_adapters_and_uses_the_base_as_reference(tmp_path, embedded_cache):
    from transformers import AutoModelForCausalLM

    config = tiny(tmp_path, use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"],
                  learning_rate=1e-2, total_episodes=24)
    result = train(config)
    kls = [m["objective/kl"] for m in result.history]
    assert kls[0] == 0.0 and kls[-1] > 0  # the reference is the base model, adapter off
    out = tmp_path / "out"
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(embedded_cache)
    trained_base = result.policy.get_base_model()
    for name, p in base.named_parameters():
        if "lm_head" in name or "embed" in name or "norm" in name or "mlp" in name:
            torch.testing.assert_close(p, dict(trained_base.named_parameters())[name].detach())
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # transformers loads base + adapter
    assert any("lora" in n for n, _ in reloaded.named_parameters())


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_stop_token_and_local_dataset_files(tmp_path, fmt):
    import datasets

    data = tmp_path / f"prompts.{fmt}"
    rows = {"question": ["the movie was", "the plot is"] * 8, "id": list(range(16))}
    if fmt == "jsonl":
        datasets.Dataset.from_dict(rows).to_json(data)
    else:
        datasets.Dataset.from_dict(rows).to_parquet(data)
    history = train(tiny(tmp_path, dataset_name=str(data), dataset_text_field="question", stop_token="eos",
                         missing_eos_penalty=1.0, pad_to_multiple_of=8)).history
    assert len(history) == 2 and all(m["val/num_eos_tokens"] >= 0 for m in history)


def test_reward_model_path_run(tmp_path, embedded_cache):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    rm_dir = tmp_path / "rm"
    cfg = AutoConfig.from_pretrained(embedded_cache, num_labels=1)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(embedded_cache).save_pretrained(rm_dir)
    history = train(tiny(tmp_path, reward_model_path=str(rm_dir), value_model_path=str(rm_dir))).history
    assert all(math.isfinite(m["objective/scores"]) for m in history)


# ---------------------------------------------------------------------------- bad input


def test_missing_model_path_fails_fast(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_name_or_path"):
        train(tiny(tmp_path, model_name_or_path=str(tmp_path / "no-such-model")))


def test_dataset_without_text_column_lists_its_columns(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "a", "label": 1}) + "\n")
    with pytest.raises(ValueError, match=r"no column 'prompt'.*\['text', 'label'\]"):
        train(tiny(tmp_path, dataset_name=str(data)))


def test_missing_dataset_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such.jsonl"):
        train(tiny(tmp_path, dataset_name=str(tmp_path / "no-such.jsonl")))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(response_length=0), "response_length must be >= 1"),
        (dict(kl_estimator="k9"), "unknown kl_estimator 'k9'"),
        (dict(per_device_train_batch_size=3, gradient_accumulation_steps=1, num_mini_batches=2),
         "divisible by num_mini_batches"),
        (dict(stop_token="eos", stop_token_id=[3]), "mutually exclusive"),
        (dict(reward_fn="no_colon"), "module:function"),
        (dict(reward_fn="fastppo.rewards:nope"), "has no function 'nope'"),
        (dict(temperature=0.0), "temperature must be > 0"),
    ],
)
def test_bad_flags_fail_fast(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(tiny(tmp_path, **overrides))


@pytest.mark.parametrize(
    "body, error, message",
    [
        ("raise RuntimeError('kaboom')", RuntimeError, "'bad_rewards:fn' raised RuntimeError: kaboom"),
        ("return [float('nan')] * len(completions)", ValueError, "'bad_rewards:fn' returned non-finite"),
        ("return [1.0]", ValueError, "'bad_rewards:fn' returned \\(1,\\) scores for 8 completions"),
    ],
)
def test_bad_reward_fn_is_a_clear_error_and_no_update(tmp_path, monkeypatch, body, error, message):
    module = f"bad_rewards_{abs(hash(body))}"  # a fresh module per case (sys.modules caches by name)
    write_module(tmp_path, monkeypatch, module, f"def fn(prompts, completions):\n    {body}\n")
    with pytest.raises(error, match=message.replace("bad_rewards", module)):
        train(tiny(tmp_path, reward_fn=f"{module}:fn"))
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("arch", ["gpt2", "phi"])
def test_other_architectures_and_a_tokenizer_without_pad_token(tmp_path, embedded_cache, capsys, arch):
    """GPT-2 (tied LM head, learned positions) and Phi (LM head with bias), with a tokenizer that has
    no pad token: the run adds one (eos), says so, and keeps the first ratio at 1."""
    from transformers import GPT2Config, GPT2LMHeadModel, PhiConfig, PhiForCausalLM, PreTrainedTokenizerFast

    src = load_tokenizer(embedded_cache, print)
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
    model_dir = tmp_path / arch
    no_pad.save_pretrained(model_dir)
    model.save_pretrained(model_dir)
    history = train(tiny(tmp_path, model_name_or_path=str(model_dir), stop_token="eos", num_ppo_epochs=1,
                         gradient_accumulation_steps=1, per_device_train_batch_size=8)).history
    assert len(history) == 2
    assert history[0]["val/ratio"] == pytest.approx(1.0, abs=1e-5)  # one epoch, one step: ρ is 1 throughout
    assert "no pad token: using its eos token" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_reports_bad_input_without_traceback(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-m", "fastppo.train", "--response_length", "0", "--output_dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2
    assert "response_length must be >= 1" in proc.stderr and "Traceback" not in proc.stderr
