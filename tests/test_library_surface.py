"""The library surface under hostile but realistic use: every user object checked before work starts (or used
exactly as given), no run's outputs lost to another trainer or a resume, and errors that name what to do.
Each class of problem has the example that found it and at least one other member."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback)

from fastppo import PPOConfig, PPOTrainer, legacy
from fastppo import checkpoint as C
from fastppo.output_dir import RunLock, run_files
from helpers import quick_config
from fastppo.value_head import AutoModelForCausalLMWithValueHead
from fastppo.advantages import whiten_trained

pytestmark = pytest.mark.usefixtures("reference_path")


config = quick_config  # two iterations of 8 episodes


def length_reward(completions, **kw):
    return [float(len(c)) for c in completions]


def scalar_model(model_dir, labels=1, **config_changes):
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=labels)
    for key, value in config_changes.items():
        setattr(model.config, key, value)
    return model


# ---------------------------------------------------------------------------- user objects: checked, never altered


def test_a_two_label_reward_or_value_model_is_refused_in_memory_and_by_path(tmp_path, model_dir):
    """transformers' own report of the head mismatch is a log line fastppo's verbosity hides, then a RuntimeError
    saying 'look at the above report': fastppo names the model and the fix."""
    with pytest.raises(ValueError, match=r"reward model .* has 2 output labels .*num_labels=1"):
        PPOTrainer(args=config(tmp_path), reward_model=scalar_model(model_dir, labels=2))
    with pytest.raises(ValueError, match=r"value model .* has 3 output labels"):
        PPOTrainer(args=config(tmp_path), value_model=scalar_model(model_dir, labels=3), reward_model=length_reward)
    scalar_model(model_dir, labels=2).save_pretrained(tmp_path / "classifier")
    with pytest.raises(ValueError, match=r"reward model at .*classifier.* has 2 output labels"):
        PPOTrainer(args=config(tmp_path, reward_model_path=str(tmp_path / "classifier")))
    with pytest.raises(ValueError, match=r"value model at .*classifier.* has 2 output labels"):
        PPOTrainer(args=config(tmp_path, value_model_path=str(tmp_path / "classifier"), reward_fn=None),
                   reward_model=length_reward)


@pytest.mark.parametrize("which", ["policy", "value model"])
def test_float16_trainable_weights_are_refused_before_the_first_update(tmp_path, model_dir, which):
    """An fp16 policy object used to be wrecked by its first update (no loss scaling: KL 25, then NaN)."""
    kwargs = dict(reward_model=length_reward)
    if which == "policy":
        kwargs["model"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16)
    else:
        kwargs["value_model"] = scalar_model(model_dir).half()
    with pytest.raises(ValueError, match=f"the {which}'s trainable weights are float16.*float32 or bfloat16"):
        PPOTrainer(args=config(tmp_path), **kwargs)
    with pytest.raises(ValueError, match="the policy's trainable weights are float16"):  # --dtype float16, loaded
        from fastppo.cli import ModelConfig

        PPOTrainer(args=config(tmp_path), model_args=ModelConfig(dtype="float16"), reward_model=length_reward)


def test_frozen_float16_and_bf16_objects_are_used_as_given(tmp_path, model_dir):
    reward = scalar_model(model_dir).half()
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    trainer = PPOTrainer(args=config(tmp_path, total_episodes=8), model=policy, reward_model=reward)
    trainer.train()
    assert reward.dtype == torch.float16 and policy.dtype == torch.bfloat16  # never re-typed
    assert all(torch.isfinite(p).all() for p in policy.parameters())


def test_models_with_too_few_positions_are_refused_by_name(tmp_path, model_dir):
    reward = scalar_model(model_dir, max_position_embeddings=8)
    with pytest.raises(ValueError, match=r"exceeds the reward model's 8 positions"):
        PPOTrainer(args=config(tmp_path), reward_model=reward)
    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    ref.config.max_position_embeddings = 8
    with pytest.raises(ValueError, match=r"exceeds the reference model's 8 positions"):
        PPOTrainer(args=config(tmp_path), ref_model=ref, reward_model=length_reward)


def test_prompt_ids_outside_the_vocabulary_are_refused_before_any_model_loads(tmp_path, model_dir, monkeypatch):
    from fastppo import loading

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"input_ids": [5, 6, 7]}, {"input_ids": [5, len(tokenizer) + 10]}, {"input_ids": [5, -1]}]
    monkeypatch.setattr(loading, "build_models", lambda *a, **k: pytest.fail("models were built"))
    for bad in rows[1:]:
        with pytest.raises(ValueError, match=r"row 1 of column 'input_ids' holds token id .* outside the tokenizer's"):
            PPOTrainer(args=config(tmp_path), train_dataset=[rows[0], bad], reward_model=length_reward)


# ---------------------------------------------------------------------------- the math's meaningful range


def test_training_temperature_has_a_floor_where_ppo_still_means_something(tmp_path, model_dir):
    for low in (1e-6, 5e-3):
        with pytest.raises(ValueError, match=r"below 0.01, the lowest PPO trains at"):
            PPOTrainer(args=config(tmp_path, temperature=low))
    PPOTrainer(args=config(tmp_path, temperature=0.01))


def test_fewer_than_two_trained_tokens_whiten_to_zero_not_an_error():
    x = torch.randn(2, 5)
    one = torch.zeros(2, 5, dtype=torch.bool)
    one[1, 3] = True
    assert torch.equal(whiten_trained(x, one), torch.zeros_like(x))
    assert torch.equal(whiten_trained(x, one, shift_mean=False), x * one)  # the single value is kept as it is
    assert torch.equal(whiten_trained(x, torch.zeros_like(one)), torch.zeros_like(x))
    two = one.clone()
    two[0, 0] = True
    w = whiten_trained(x, two)
    assert torch.allclose(w[two], (x[two] - x[two].mean()) / x[two].std(), atol=1e-5) and not w[~two].any()


def test_a_batch_with_one_trained_token_updates(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_dir)
    trainer = legacy.PPOTrainer(legacy.PPOConfig(batch_size=1, mini_batch_size=1), model, None, tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    stats = trainer.step([torch.tensor([5, 6, 7])], [torch.tensor([8])], [torch.tensor(1.0)])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # a statistic of one sample (the scores' std, explained variance) is undefined, as in TRL; the losses are not
    assert all(math.isfinite(float(stats[k])) for k in ("ppo/loss/total", "ppo/loss/policy", "ppo/loss/value"))


# ---------------------------------------------------------------------------- no lost run


def test_two_trainers_on_one_output_dir_cannot_both_write_it(tmp_path, model_dir):
    first = PPOTrainer(args=config(tmp_path, total_episodes=8))
    # both built on an empty directory; the second as fastppo's command line builds it (from Python, a run after
    # another replaces it, as TRL's: test_output_dir_api.py)
    second = PPOTrainer(args=config(tmp_path, total_episodes=8), command_line=True)
    first.train()
    first.save_model()  # as a TRL script saves after train()
    model = (tmp_path / "out" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="already holds a run"):  # decided again when writing starts
        second.train()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == model
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 1


def test_an_output_dir_being_written_is_locked(tmp_path, model_dir):
    lock = RunLock(str(tmp_path / "out"))
    assert lock.acquire() is None  # as a run in another process would hold it
    trainer = PPOTrainer(args=config(tmp_path, total_episodes=8))
    with pytest.raises(ValueError, match=r"is being written by another run \(pid \d+"):
        trainer.train()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    lock.release()
    trainer.train()  # free again: the refused trainer was not spent by the refusal
    assert trainer.state.global_step == 1


def test_resuming_a_finished_run_never_replaces_its_final_model(tmp_path, model_dir):
    """The command line's job ends with a final model (the API's train() writes none): a resume never replaces it."""
    class SaveEach(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_save = True

    PPOTrainer(args=config(tmp_path, total_episodes=24), callbacks=[SaveEach()], command_line=True).train()  # 3
    out = tmp_path / "out"
    final, metrics = (out / "model.safetensors").read_bytes(), (out / "metrics.jsonl").read_text()
    assert C.finished_step(str(out)) == 3 and [s for s, _ in C.checkpoints(str(out))] == [1, 2, 3]
    with pytest.raises(ValueError, match="after iteration 3, and this run has 2 iteration"):  # smaller max_steps
        PPOTrainer(args=config(tmp_path, total_episodes=24, max_steps=2, resume_from_checkpoint="latest"),
                   command_line=True)
    with pytest.raises(ValueError, match=r"final model \(iteration 3\), newer than checkpoint-1"):
        PPOTrainer(args=config(tmp_path, total_episodes=24, resume_from_checkpoint=str(out / "checkpoint-1")),
                   command_line=True)
    assert (out / "model.safetensors").read_bytes() == final and (out / "metrics.jsonl").read_text() == metrics
    # a larger max_steps continues from the last iteration's checkpoint
    more = PPOTrainer(args=config(tmp_path, total_episodes=24, max_steps=4, resume_from_checkpoint="latest"),
                      command_line=True)
    more.train()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    # redoing from an old checkpoint goes into another directory, leaving this run whole
    PPOTrainer(args=config(tmp_path, name="redo", total_episodes=24,
                           resume_from_checkpoint=str(out / "checkpoint-1")), command_line=True).train()
    assert C.finished_step(str(tmp_path / "redo")) == 3 and C.finished_step(str(out)) == 4


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "model.safetensors"])
def test_a_truncated_checkpoint_file_is_named_and_latest_falls_back(tmp_path, model_dir, damaged):
    class CrashAfterSecondSave(TrainerCallback):  # a run killed after checkpoint-2: no final model
        def on_step_end(self, args, state, control, **kw):
            control.should_save = True

        def on_save(self, args, state, control, **kw):
            if state.global_step == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        PPOTrainer(args=config(tmp_path, total_episodes=24), callbacks=[CrashAfterSecondSave()]).train()
    out = tmp_path / "out"
    _truncate(out / "checkpoint-2" / damaged)
    with pytest.raises(OSError, match=f"checkpoint-2.*{damaged} is unreadable"):
        PPOTrainer(args=config(tmp_path, total_episodes=24, resume_from_checkpoint=str(out / "checkpoint-2")))
    resumed = PPOTrainer(args=config(tmp_path, total_episodes=24, resume_from_checkpoint="latest"))
    assert resumed._resume_path.endswith("checkpoint-1")


def test_a_run_that_fails_in_its_first_iteration_leaves_a_usable_directory(tmp_path, model_dir):
    def broken(completions, **kw):
        raise KeyError("score")

    with pytest.raises(RuntimeError, match="reward_fn .*broken.* raised KeyError"):
        PPOTrainer(args=config(tmp_path), reward_model=broken).train()
    out = tmp_path / "out"
    assert not (out / "metrics.jsonl").exists() and run_files(str(out)) == []
    PPOTrainer(args=config(tmp_path, total_episodes=8), reward_model=length_reward).train()  # same directory


def test_a_run_without_checkpoints_is_not_offered_a_resume(tmp_path, model_dir):
    PPOTrainer(args=config(tmp_path, total_episodes=8, save_strategy="no")).train()
    with pytest.raises(ValueError, match="it has no checkpoint to continue from: --overwrite_output_dir"):
        PPOTrainer(args=config(tmp_path, total_episodes=8), command_line=True)


# ---------------------------------------------------------------------------- reward functions and datasets


def test_a_reward_functions_column_missing_from_the_eval_set_is_refused_by_name(tmp_path, model_dir):
    seen = []

    def graded(prompts, completions, answer, **kw):
        seen.append(list(answer))
        return [float(a == "yes") for a in answer]

    train = [{"prompt": f"question {i}", "answer": "yes" if i % 2 else "no"} for i in range(8)]
    with pytest.raises(ValueError, match=r"requires 'answer', which eval_dataset does not have \(its columns: "
                                         r"\['prompt'\]\)"):
        PPOTrainer(args=config(tmp_path), reward_model=graded, train_dataset=train,
                   eval_dataset=[{"prompt": "question x"}])
    with pytest.raises(ValueError, match="requires 'answer', which train_dataset does not have"):
        PPOTrainer(args=config(tmp_path), reward_model=graded, train_dataset=[{"prompt": "q"}] * 8)
    trainer = PPOTrainer(args=config(tmp_path, per_device_eval_batch_size=2), reward_model=graded,
                         train_dataset=train, eval_dataset=[{"prompt": "q a", "answer": "yes"},
                                                            {"prompt": "q b", "answer": "no"}])
    trainer.generate_completions()  # the eval rows' columns reach the function
    assert seen[-1] == ["yes", "no"]


# ---------------------------------------------------------------------------- legacy loop


def test_legacy_generate_and_step_refuse_lengths_past_the_positions(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_dir)
    limit = model.pretrained_model.config.max_position_embeddings
    trainer = legacy.PPOTrainer(legacy.PPOConfig(batch_size=2, mini_batch_size=2), model, None, tokenizer)
    long_query = torch.randint(3, len(tokenizer), (limit - 4,))
    with pytest.raises(ValueError, match=rf"generate: the longest query \({limit - 4} tokens\) \+ max_new_tokens "
                                         rf"\(8\) = {limit + 4} exceeds the model's {limit} positions"):
        trainer.generate([long_query], max_new_tokens=8)
    with pytest.raises(ValueError, match=rf"step: a query \+ response of {limit + 1} tokens exceeds"):
        trainer.step([long_query, long_query[:3]], [torch.randint(3, 50, (5,)), torch.randint(3, 50, (2,))],
                     [1.0, 0.0])


WORKER = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from transformers import AutoTokenizer
    from fastppo import legacy
    from fastppo.value_head import AutoModelForCausalLMWithValueHead

    path = os.environ["MODEL_DIR"]
    tok = AutoTokenizer.from_pretrained(path)
    trainer = legacy.PPOTrainer(legacy.PPOConfig(batch_size=1, mini_batch_size=1),
                                AutoModelForCausalLMWithValueHead.from_pretrained(path), None, tok)
    query, response = [torch.tensor([5, 6, 7])], [torch.tensor([8, 9])]
    stats = trainer.step(query, response, [torch.tensor(1.0)])
    if dist.get_rank() == 0:  # the mistake: log_stats gathers from every rank
        trainer.log_stats(stats, {"query": ["q"], "response": ["r"]}, [torch.tensor(1.0)])
    else:
        import time; time.sleep(30)
""")


@pytest.mark.slow
def test_legacy_log_stats_on_one_rank_fails_in_bounded_time_naming_the_call(tmp_path, model_dir):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "MODEL_DIR": model_dir, "FASTPPO_RENDEZVOUS_TIMEOUT": "5", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode != 0
    assert "log_stats() must be called on every process" in result.stderr
    assert "rank 0 waited 5 s" in result.stderr


# ---------------------------------------------------------------------------- the command line's error contract


def test_main_guard_turns_only_usage_errors_into_exit_2():
    from fastppo.errors import MissingPathError, SettingsError, SettingsTypeError
    from fastppo.rewards import RewardFunctionError
    from fastppo.cli import main_guard

    def raising(error):
        def run():
            raise error
        return run

    for usage in (SettingsError("bad flag"), SettingsTypeError("bad type"), MissingPathError("no such dir")):
        with pytest.raises(SystemExit) as exit_info:
            main_guard(raising(usage))
        assert exit_info.value.code == 2
    # a bug in fastppo, or a failure that is not the user's input, keeps its traceback
    for bug in (ValueError("shape mismatch deep inside"), TypeError("NoneType"), KeyError("k"),
                RewardFunctionError("reward_fn 'm:f' raised TimeoutError: the API timed out")):
        with pytest.raises(type(bug)):
            main_guard(raising(bug))


def test_a_backend_timeout_in_a_collective_is_a_collective_timeout(monkeypatch):
    import pickle

    import torch.distributed as dist

    from fastppo import dist as fdist
    from fastppo.errors import CollectiveTimeout

    def raising(error):
        def collective(*args, **kwargs):
            raise error
        return collective

    monkeypatch.setattr(fdist, "is_distributed", lambda: True)
    timeout = dist.DistBackendError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 8000ms for recv\nmore")
    for name, call in (("all_reduce", lambda: fdist.all_reduce(torch.ones(1))),
                       ("all_reduce", lambda: fdist.all_reduce_min(torch.ones(1))),
                       ("barrier", fdist.barrier),
                       ("all_gather", lambda: fdist.all_gather([torch.ones(1)], torch.ones(1)))):
        monkeypatch.setattr(dist, name, raising(timeout))
        with pytest.raises(CollectiveTimeout) as info:
            call()
        assert info.value.collective == name and info.value.__cause__ is timeout
        assert info.value.detail == "[../gloo/transport/tcp/pair.cc:534] Timed out waiting 8000ms for recv"
        assert "--ddp_timeout" in str(info.value) and isinstance(info.value, RuntimeError)
    again = pickle.loads(pickle.dumps(info.value))  # torchrun's error records may carry it across processes
    assert (type(again), again.collective, str(again)) == (CollectiveTimeout, "all_gather", str(info.value))
    # any other failure of a collective passes through as the backend raised it
    for other in (RuntimeError("Connection closed by peer [127.0.0.1]:29500"), ValueError("bad op")):
        monkeypatch.setattr(dist, "all_reduce", raising(other))
        with pytest.raises(type(other)) as info:
            fdist.all_reduce(torch.ones(1))
        assert info.value is other


def test_main_guard_exits_1_on_a_collective_timeout_and_on_no_other_timeout(capsys):
    from fastppo.cli import main_guard
    from fastppo.errors import CollectiveTimeout

    def raising(error):
        def run():
            raise error
        return run

    config = PPOConfig(output_dir=None, ddp_timeout=8)
    with pytest.raises(SystemExit) as exit_info:
        main_guard(raising(CollectiveTimeout("barrier", "Timed out waiting 8000ms for recv")), lambda: config)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("fastppo.train: error: rank 0: a collective did not complete within --ddp_timeout 8 s")
    assert "(barrier: Timed out waiting 8000ms for recv)" in err and "Traceback" not in err
    # a timeout raised anywhere but a collective (a reward server, a download) is not a collective's: traceback
    for elsewhere in (RuntimeError("the reward server timed out"), RuntimeError("read timeout"),
                      TimeoutError("timed out")):
        with pytest.raises(type(elsewhere)):
            main_guard(raising(elsewhere), lambda: config)


def test_a_reward_function_error_names_the_function_and_keeps_its_traceback(tmp_path, model_dir):
    (tmp_path / "my_rewards.py").write_text("def flaky(completions, **kw):\n    return 1 / 0\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FASTPPO_CACHE": os.path.dirname(model_dir), "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-m", "fastppo.train", "--reward_fn", "my_rewards:flaky",
                             "--output_dir", str(tmp_path / "out"), "--total_episodes", "16", "--disable_tqdm", "true"],
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and 'my_rewards.py", line 2, in flaky' in result.stderr
    assert "reward_fn 'my_rewards:flaky' raised ZeroDivisionError" in result.stderr


# ---------------------------------------------------------------------------- found by the sweep (tests/library_sweep.py)


def test_a_given_tokenizer_without_pad_or_eos_is_refused_not_changed(tmp_path, model_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    with pytest.raises(ValueError, match="processing_class has no pad token and no eos token"):
        PPOTrainer(args=config(tmp_path), processing_class=tokenizer, model=AutoModelForCausalLM.from_pretrained(model_dir))
    assert len(tokenizer) == 3 and tokenizer.pad_token is None


def test_a_causal_lm_as_value_model_is_refused_by_name(tmp_path, model_dir):
    with pytest.raises(ValueError, match=r"the value model \(LlamaForCausalLM\) is not a sequence-classification"):
        PPOTrainer(args=config(tmp_path), value_model=AutoModelForCausalLM.from_pretrained(model_dir),
                   reward_model=length_reward)


def test_a_peft_model_with_a_peft_config_is_merged_then_adapted_as_trl_does(tmp_path, model_dir):
    import copy

    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    merged = copy.deepcopy(peft_model).merge_and_unload()
    trainer = PPOTrainer(args=config(tmp_path), model=peft_model, reward_model=length_reward,
                         peft_config=LoraConfig(r=4, target_modules=["v_proj"]))
    lm = trainer.policy.get_base_model()
    q = lm.model.layers[0].self_attn.q_proj
    assert not hasattr(q, "base_layer") and torch.equal(q.weight, merged.model.layers[0].self_attn.q_proj.weight)
    assert hasattr(lm.model.layers[0].self_attn.v_proj, "lora_A")  # the new adapter, where peft_config says


def test_a_users_optimizer_must_hold_every_trained_parameter(tmp_path, model_dir):
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"optimizer given does not hold \d+ trained parameter\(s\) \(value_model"):
        PPOTrainer(args=config(tmp_path), model=policy, reward_model=length_reward,
                   optimizers=(torch.optim.AdamW(policy.parameters()), None))
    value = scalar_model(model_dir)
    PPOTrainer(args=config(tmp_path), model=policy, value_model=value, reward_model=length_reward,
               optimizers=(torch.optim.AdamW([*policy.parameters(), *value.parameters()]), None))


def test_a_callback_must_be_a_trainer_callback(tmp_path, model_dir):
    with pytest.raises(TypeError, match="callbacks: <function .* is not a transformers.TrainerCallback"):
        PPOTrainer(args=config(tmp_path), callbacks=[lambda *a: None])


def test_a_model_directory_no_fastppo_run_wrote_is_never_overwritten(tmp_path, model_dir):
    import shutil

    own = tmp_path / "my-model"
    shutil.copytree(model_dir, own)
    before = sorted(os.listdir(own))
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"holds a model \(config.json.*that no fastppo run wrote.*use another output_dir"):
            PPOTrainer(args=config(tmp_path, name="my-model", sft_model_path=str(own), overwrite_output_dir=overwrite))
    assert sorted(os.listdir(own)) == before


def test_resuming_into_a_model_of_another_shape_is_refused_before_touching_it(tmp_path, model_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    class SaveOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = control.should_save = state.global_step == 1

    PPOTrainer(args=config(tmp_path), callbacks=[SaveOne()]).train()
    saved = AutoModelForCausalLM.from_pretrained(model_dir).config.to_dict()
    other = LlamaForCausalLM(LlamaConfig(**{**saved, "intermediate_size": saved["intermediate_size"] * 2}))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    trainer = PPOTrainer(args=config(tmp_path, resume_from_checkpoint="latest"), model=other,
                         reward_model=length_reward)
    with pytest.raises(ValueError, match=r"do not fit the LlamaForCausalLM given: shapes differ \(model\.layers"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # not a tensor written


def test_legacy_step_and_generate_refuse_what_is_not_a_token_count(model_dir):
    import numpy as np

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_dir)
    trainer = legacy.PPOTrainer(legacy.PPOConfig(batch_size=2, mini_batch_size=2), model, None, tokenizer)
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    with pytest.raises(ValueError, match=r"step: token id -100 in queries or responses"):
        trainer.step(queries, [torch.tensor([10, 11, -100]), torch.tensor([12])], [1.0, 0.0])
    with pytest.raises(ValueError, match="the length_sampler's draw must be an integer >= 1, got 0"):
        trainer.generate(queries, length_sampler=lambda: 0, return_prompt=False)
    out = trainer.generate(queries, max_new_tokens=np.int64(3), return_prompt=False)  # TRL's LengthSampler's type
    assert all(1 <= len(r) <= 3 for r in out)
