"""What TRL's users see of the two APIs, tested on fastppo's own terms: TRL 0.26's callback events and
control flags, the user's models never resized, and legacy TRL's trainer (its dispatch, default collator,
optimizer view, reference model and documented building blocks) against plain PyTorch computations."""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from fastppo import PPOConfig, PPOTrainer, legacy
from fastppo.cli import EMBEDDED_PRESET
from fastppo.value_head import AutoModelForCausalLMWithValueHead

pytestmark = pytest.mark.usefixtures("reference_path")


def small(tmp_path, **overrides) -> PPOConfig:
    base = {**EMBEDDED_PRESET, **dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_ppo_epochs=1, response_length=5, total_episodes=24, num_sample_generations=0, disable_tqdm=True,
        local_rollout_forward_batch_size=8, logging_steps=2, save_steps=10**6)}
    base.update(overrides)
    return PPOConfig(**base)


# ---------------------------------------------------------------------------- TRL 0.26: callbacks and control


class Events(TrainerCallback):
    def __init__(self, save_at: int | None = None):
        self.events, self.logs, self.save_at = [], [], save_at

    def on_step_begin(self, args, state, control, **kw):
        self.events.append(("step_begin", state.global_step))

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(state.global_step)
        logs["objective/scores"] = float("nan")  # a callback editing its logs changes nothing of the run's

    def on_step_end(self, args, state, control, **kw):
        self.events.append(("step_end", state.global_step))
        if state.global_step == self.save_at:
            control.should_save = True

    def on_save(self, args, state, control, **kw):
        self.events.append(("save", state.global_step))


def test_callbacks_see_trls_events_and_should_save_saves(tmp_path, model_dir):
    events = Events(save_at=1)
    trainer = PPOTrainer(args=small(tmp_path), callbacks=[events, Events])  # a class is instantiated, as TRL's
    trainer.train()
    assert events.logs == [1, 2, 3]  # on_log every iteration (TRL's loop calls self.log), not every logging_steps
    assert [e for e in events.events if e[0] == "step_begin"] == [("step_begin", 0), ("step_begin", 1),
                                                                  ("step_begin", 2)]
    assert ("save", 1) in events.events and (tmp_path / "out" / "checkpoint-1").is_dir()
    assert not (tmp_path / "out" / "checkpoint-2").exists()  # save_steps 10**6: only the callback's request
    assert all(math.isfinite(m["objective/scores"]) for m in trainer.state.log_history)
    assert any(isinstance(c, Events) and c is not events for c in trainer.callback_handler.callbacks)


def test_derived_sizes_are_written_into_the_config_as_trl_does(tmp_path, model_dir):
    trainer = PPOTrainer(args=small(tmp_path))
    assert (trainer.args.local_batch_size, trainer.args.batch_size, trainer.args.num_total_batches) == (8, 8, 3)


# ---------------------------------------------------------------------------- the user's models, as given


def test_a_pad_token_past_the_embedding_is_harmless_and_the_model_is_not_resized(tmp_path, model_dir):
    """TRL's own test adds a [PAD] token the model has no row for; padding is fed as id 0, so it runs."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = policy.get_input_embeddings().weight.shape[0]
    assert tokenizer.pad_token_id >= rows
    embedding = policy.get_input_embeddings().weight.detach().clone()
    trainer = PPOTrainer(args=small(tmp_path, total_episodes=8), processing_class=tokenizer, model=policy,
                         reward_model=lambda completions, **kw: [float(len(c)) for c in completions])
    trainer.train()
    assert policy.get_input_embeddings().weight.shape[0] == rows  # never resized
    assert not torch.equal(policy.get_input_embeddings().weight.detach(), embedding)  # trained in place


def test_a_prompt_token_past_the_embedding_is_refused_with_the_fix(tmp_path, model_dir):
    import datasets

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["zzzunseen"])
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    data = datasets.Dataset.from_dict({"prompt": ["the movie was zzzunseen"] * 8})
    with pytest.raises(ValueError, match=r"policy has \d+ embedding rows .*resize_token_embeddings"):
        PPOTrainer(args=small(tmp_path), processing_class=tokenizer, model=policy, train_dataset=data)


def test_a_value_head_model_and_a_value_model_together_are_refused(tmp_path, model_dir):
    from transformers import AutoModelForSequenceClassification

    with pytest.raises(ValueError, match="value_model is given too"):
        PPOTrainer(args=small(tmp_path), model=AutoModelForCausalLMWithValueHead.from_pretrained(model_dir),
                   value_model=AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1))


# ---------------------------------------------------------------------------- legacy TRL's trainer


@pytest.fixture
def legacy_parts(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_dir)
    queries = [torch.tensor(tokenizer(t)["input_ids"]) for t in ("the movie was", "overall the cast is")]
    responses = [torch.randint(3, len(tokenizer), (n,)) for n in (4, 6)]
    return tokenizer, model, queries, responses


def test_legacy_arguments_dispatch_and_the_users_objects_are_kept(legacy_parts):
    tokenizer, model, queries, responses = legacy_parts
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    trainer = PPOTrainer(legacy.PPOConfig(batch_size=2, mini_batch_size=1), model, None, tokenizer, optimizer=sgd)
    assert isinstance(trainer, legacy.PPOTrainer) and trainer.model is model
    assert trainer.optimizer.optimizer is sgd  # accelerate's view of the user's optimizer, as in legacy TRL
    # no reference given: a frozen copy (create_reference_model), not the policy itself
    assert trainer.ref_model is not model and not any(p.requires_grad for p in trainer.ref_model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.optimizer.zero_grad = partial(trainer.optimizer.zero_grad, set_to_none=False)  # as TRL's tests do
    stats = trainer.step(queries, responses, [1.0, 0.0])
    assert all(p.grad is not None for p in model.parameters())  # the rebound zero_grad is the one called
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    for key in ("ppo/policy/ratio", "ppo/policy/advantages", "time/ppo/forward_pass", "time/ppo/optimize_step"):
        assert key in stats, key


def test_legacy_default_collator_stacks_tuples_and_lists_ragged_dicts(legacy_parts):
    tokenizer, model, queries, responses = legacy_parts
    pairs = [(torch.arange(3) + i, torch.arange(2) + i) for i in range(4)]
    trainer = legacy.PPOTrainer(legacy.PPOConfig(batch_size=2, mini_batch_size=1), model, None, tokenizer,
                                dataset=pairs)
    q, r = next(iter(trainer.dataloader))  # torch's default_collate: a tuple of stacked tensors
    assert q.shape == (2, 3) and r.shape == (2, 2)
    ragged = [{"input_ids": torch.arange(n)} for n in (2, 3, 4, 5)]
    batch = next(iter(trainer.prepare_dataloader(ragged)))
    assert isinstance(batch["input_ids"], list) and len(batch["input_ids"]) == 2
    with pytest.raises(ValueError, match=r"batch_size \(3\) must be a multiple"):
        legacy.PPOConfig(batch_size=3, mini_batch_size=2)


def test_legacy_building_blocks_match_plain_pytorch(legacy_parts):
    tokenizer, model, queries, responses = legacy_parts
    tokenizer.pad_token = tokenizer.eos_token
    trainer = legacy.PPOTrainer(legacy.PPOConfig(batch_size=2, mini_batch_size=2, init_kl_coef=0.3), model, None,
                                tokenizer)
    inputs = trainer.prepare_model_inputs(queries, responses)
    assert inputs["input_ids"].shape == (2, max(len(q) + len(r) for q, r in zip(queries, responses)))
    with torch.no_grad():
        logprobs, logits, values, masks = trainer.batched_forward_pass(model, queries, responses, inputs,
                                                                       return_logits=True)
        plain_logits = model(**inputs)[0]
    plain = torch.log_softmax(plain_logits[:, :-1].double(), -1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
    torch.testing.assert_close(logprobs.double(), plain, atol=1e-5, rtol=1e-5)
    assert masks.sum(1).tolist() == [len(r) for r in responses]  # 1 exactly on the response tokens
    ref = logprobs - 0.1 * torch.rand_like(logprobs)
    rewards, non_score, kl = trainer.compute_rewards(torch.tensor([1.0, -2.0]), logprobs, ref, masks)
    torch.testing.assert_close(kl, logprobs - ref)
    torch.testing.assert_close(non_score, -0.3 * (logprobs - ref) * masks)
    last = [int(m.nonzero()[-1]) for m in masks]
    for row, (i, score) in enumerate(zip(last, (1.0, -2.0))):
        assert rewards[row, i] == pytest.approx(non_score[row, i].item() + score)
    values, advantages, returns = trainer.compute_advantages(values, rewards, masks)
    model.train()
    new_logits, _, vpreds = model(**inputs)
    new_logprobs = torch.log_softmax(new_logits[:, :-1], -1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
    policy_loss, value_loss, stats = trainer.loss(logprobs, values, new_logits[:, :-1], vpreds[:, :-1], new_logprobs,
                                                  masks, advantages, returns)
    m = masks.bool()
    ratio = torch.exp(new_logprobs - logprobs)
    expected_pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))[m].mean()
    torch.testing.assert_close(policy_loss, expected_pg, atol=1e-5, rtol=1e-5)
    v = vpreds[:, :-1]
    vclip = values + (v - values).clamp(-0.2, 0.2)
    expected_vf = 0.1 * 0.5 * torch.max((v - returns) ** 2, (vclip - returns) ** 2)[m].mean()
    torch.testing.assert_close(value_loss, expected_vf, atol=1e-5, rtol=1e-5)
    assert {"loss/policy", "loss/value", "loss/total", "policy/ratio", "val/var"} <= stats.keys()
    step = trainer.record_step_stats(0.3, masks=masks, kls=kl, logprobs=logprobs, ref_logprobs=ref,
                                     non_score_reward=non_score, scores=torch.tensor([1.0, -2.0]), queries=queries,
                                     responses=responses, train_stats={k: v[None] for k, v in stats.items()})
    assert step["objective/kl"].item() == pytest.approx(((logprobs - ref) * masks).sum(1).mean().item())
    assert step["tokens/responses_len_mean"] == 5.0 and "ppo/val/var_explained" in step


def test_legacy_train_minibatch_steps_the_optimizer(legacy_parts):
    tokenizer, model, queries, responses = legacy_parts
    tokenizer.pad_token = tokenizer.eos_token
    trainer = legacy.PPOTrainer(legacy.PPOConfig(batch_size=2, mini_batch_size=2, learning_rate=1e-2), model, None,
                                tokenizer)
    inputs = trainer.prepare_model_inputs(queries, responses)
    with torch.no_grad():
        old, _, values, masks = trainer.batched_forward_pass(model, queries, responses, inputs)
    advantages, returns = torch.randn_like(old), torch.randn_like(old)
    model.train()
    logits, _, vpreds = model(**inputs)
    new = torch.log_softmax(logits[:, :-1], -1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
    head = model.v_head.summary.weight.detach().clone()
    stats = trainer.train_minibatch(old, values, new, logits[:, :-1], vpreds[:, :-1], masks, advantages, returns)
    assert not torch.equal(head, model.v_head.summary.weight) and math.isfinite(stats["loss/total"].item())


def test_legacy_scheduler_view_no_dataset_warning_and_score_shapes(legacy_parts):
    tokenizer, model, queries, responses = legacy_parts
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    decay = torch.optim.lr_scheduler.ExponentialLR(sgd, gamma=0.5)
    with pytest.warns(UserWarning, match="No dataset is provided"):
        trainer = legacy.PPOTrainer(legacy.PPOConfig(batch_size=2, mini_batch_size=1), model, None, tokenizer,
                                    optimizer=sgd, lr_scheduler=decay)
    assert trainer.lr_scheduler.scheduler is decay  # accelerate's view, as legacy TRL's tests read it
    with pytest.raises(ValueError, match=r"each score must be a scalar tensor .*got shape \[1, 1\]"):
        trainer.step(queries, responses, [torch.tensor([[1.0]]), torch.tensor([[0.0]])])
    first = trainer.step(queries, responses, [torch.tensor([1.0]), torch.tensor([0.0])])  # 1-element: fine
    second = trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(0.0)])
    assert first["ppo/learning_rate"] == 0.01 and second["ppo/learning_rate"] == 0.005  # the user's schedule, stepped


def test_api_mixups_and_unsupported_flags_are_refused_by_name(tmp_path, model_dir):
    from fastppo.cli import ModelConfig, ScriptArguments, get_quantization_config, require_supported_model_args

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with pytest.raises(TypeError, match="args must be a fastppo.PPOConfig .*fastppo.legacy.PPOConfig"):
        PPOTrainer(args=legacy.PPOConfig(batch_size=2, mini_batch_size=2), processing_class=tokenizer)
    with pytest.raises(TypeError, match="config must be a fastppo.legacy.PPOConfig"):
        legacy.PPOTrainer(small(tmp_path), AutoModelForCausalLM.from_pretrained(model_dir), None, tokenizer)
    with pytest.raises(ValueError, match="--use_dora: DoRA is not supported"):
        require_supported_model_args(ModelConfig(use_dora=True))
    with pytest.raises(ValueError, match="--dataset_streaming"):
        require_supported_model_args(ModelConfig(), ScriptArguments(dataset_streaming=True))
    with pytest.raises(ValueError, match="load_in_4bit/load_in_8bit: quantised policies are not supported"):
        get_quantization_config(ModelConfig(load_in_4bit=True))
    for bad, message in ((dict(push_to_hub=True), "push_to_hub: pushing to the Hub is not supported"),
                         (dict(save_strategy="epoch"), "save_strategy"),
                         (dict(optim="adafactor"), "optim 'adafactor' is not supported")):
        with pytest.raises(ValueError, match=message):
            PPOTrainer(args=small(tmp_path, **bad))


# ---------------------------------------------------------------------------- hostile but plausible calls


def test_train_twice_is_refused_instead_of_running_at_lr_zero(tmp_path, model_dir):
    trainer = PPOTrainer(args=small(tmp_path, total_episodes=8))
    trainer.train()
    with pytest.raises(ValueError, match=r"train\(\) has already run all 1 iterations .*resume_from_checkpoint"):
        trainer.train()
    assert [m["step"] for m in trainer.state.log_history] == [1]


def test_resume_from_checkpoint_true_means_the_latest_one(tmp_path, model_dir):
    class StopAfterOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step >= 1
            control.should_save = state.global_step == 1

    PPOTrainer(args=small(tmp_path), callbacks=[StopAfterOne()]).train()
    resumed = PPOTrainer(args=small(tmp_path, resume_from_checkpoint=True))  # transformers' meaning
    assert resumed._resume_path.endswith("checkpoint-1")


def test_a_reward_function_editing_its_arguments_changes_nothing_logged(tmp_path, model_dir):
    seen = []

    def vandal(prompts, completions, **kwargs):
        scores = [float(len(c)) for c in completions]
        seen.append(list(completions))
        completions[:] = ["edited"] * len(completions)
        prompts.clear()
        return scores

    trainer = PPOTrainer(args=small(tmp_path, total_episodes=8), reward_model=vandal)
    batch = trainer.rollout()
    assert batch.completions == seen[0] and "edited" not in batch.completions and batch.prompts


def test_legacy_generate_refuses_meaningless_arguments(legacy_parts):
    tokenizer, model, queries, _ = legacy_parts
    trainer = legacy.PPOTrainer(legacy.PPOConfig(batch_size=2, mini_batch_size=2), model, None, tokenizer)
    for kwargs, message in ((dict(temperature=0.0), "generate: temperature"),
                            (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 1"),
                            (dict(batch_size=0), "batch_size must be an integer >= 1")):
        with pytest.raises(ValueError, match=message):
            trainer.generate(queries, return_prompt=False, **kwargs)
    assert len(trainer.generate(queries, return_prompt=False, max_new_tokens=3, do_sample=True)) == 2


def test_pre_tokenized_padding_is_not_prompt_text(tmp_path, model_dir):
    """``tokenizer(prompts, padding=True)`` gives padded input_ids with an attention_mask: only attended tokens."""
    import datasets

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    prompts = ["the movie was", "i think the whole plot of it is"] * 4
    encoded = tokenizer(prompts, padding=True)
    data = datasets.Dataset.from_dict({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})
    trainer = PPOTrainer(args=small(tmp_path), train_dataset=data)
    assert trainer.prompts[:2] == [tokenizer(p)["input_ids"] for p in prompts[:2]]
    assert all(tokenizer.pad_token_id not in p for p in trainer.prompts[:2])


@pytest.mark.parametrize("change", [dict(learning_rate=1e-3), dict(weight_decay=0.1), dict(adam_beta1=0.8)])
def test_resume_with_other_optimizer_settings_is_refused_not_announced(tmp_path, model_dir, change):
    """The saved optimizer and scheduler state would put the old values back: refuse, never 'applies from here'."""
    class SaveOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = control.should_save = state.global_step == 1

    PPOTrainer(args=small(tmp_path), callbacks=[SaveOne()]).train()
    with pytest.raises(ValueError, match=f"other optimizer or schedule settings \\({next(iter(change))}"):
        PPOTrainer(args=small(tmp_path, resume_from_checkpoint="latest", **change))
    PPOTrainer(args=small(tmp_path, resume_from_checkpoint="latest", max_grad_norm=0.5))  # not held in the state
