"""DAPO's dynamic sampling (``fastppo.dynamic_sampling``) and overlong shaping: groups whose completions all score
the same never reach the update, the batch is refilled from the next prompts of the data order, a resume in the
middle of an epoch draws the same prompts, the bound on rounds trains or raises, two processes fill in step, bad
settings are refused by name before any model loads, nothing changes where nothing is dropped, and the overlong
punishment is TRL's ``get_soft_overlong_punishment``'s."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import datasets
import pytest
import torch
from transformers import TrainerCallback

import fastppo.loading as L
import fastppo.train as T
from fastppo import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from fastppo.checkpoint import checkpoints
from fastppo.dynamic_sampling import SamplingBoundReached, group_spread
from fastppo.errors import SettingsError
from fastppo.rewards import soft_overlong_penalty, soft_overlong_punishment
from helpers import cli_trainer, digest
from test_trl1_integration import ROOT, trl1_dir

pytestmark = pytest.mark.usefixtures("reference_path")

NOUNS = ("movie", "film", "story", "acting", "music", "ending", "plot", "cast")
# the data order (shuffle_dataset off): "flat" prompts get the same reward for every completion
KINDS = ("good", "flat", "flat", "good", "flat", "good", "good", "flat")
PROMPTS = [f"the {noun} was {kind}" for noun, kind in zip(NOUNS, KINDS)]
COLUMNS = ("dynamic_sampling/generation_rounds", "dynamic_sampling/frac_groups_dropped",
           "dynamic_sampling/groups_without_spread_trained", "dynamic_sampling/prompts_consumed")


def spread_unless_flat(prompts, completions, **kwargs):
    """0 for every completion of a flat prompt; 0, 1 within each other prompt's group (whatever was sampled)."""
    return [0.0 if p.endswith("flat") else float(i % 2) for i, p in enumerate(prompts)]


def always_spread(prompts, completions, **kwargs):
    return [float(i % 2) + 0.1 * len(c) for i, c in enumerate(completions)]


def args_for(tmp_path, name="out", **kw):
    base = dict(output_dir=str(tmp_path / name), num_generations=2, per_device_train_batch_size=4,
                max_completion_length=5, max_steps=2, logging_steps=1, save_strategy="no", bf16=False,
                disable_tqdm=True, gradient_checkpointing=False, report_to="none", learning_rate=1e-3, seed=5,
                shuffle_dataset=False, dynamic_sampling=True)
    return GRPOConfig(**{**base, **kw})


def data(times=2):
    return datasets.Dataset.from_dict({"prompt": PROMPTS * times})


def trained_prompts(monkeypatch, trainer_of) -> list[list[str]]:
    """Each update's prompts, one per group, as the update receives them (``ppo_update``'s batch)."""
    seen = []
    update = T.ppo_update

    def spy(trained, batch, *args, **kwargs):
        prompts, _ = batch.rollout.token_ids()
        texts = trainer_of().tokenizer.batch_decode(prompts, skip_special_tokens=True)
        seen.append(texts[::2])
        assert texts[::2] == texts[1::2]  # whole groups, side by side
        return update(trained, batch, *args, **kwargs)

    monkeypatch.setattr(T, "ppo_update", spy)
    return seen


def rows(trainer) -> list[dict]:
    return [r for r in trainer.state.log_history if "dynamic_sampling/generation_rounds" in r]


def named_accuracy(prompts, completions, **kwargs):
    return spread_unless_flat(prompts, completions)


@pytest.mark.parametrize("metric", ["reward", "named_accuracy"])
def test_groups_without_spread_never_reach_the_update_and_the_batch_refills_in_data_order(tmp_path, model_dir,
                                                                                        monkeypatch, metric):
    """Two groups a batch: the first round holds one flat group, which is dropped, and the next round's prompts
    refill it. With a named reward as the metric, the summed reward differs (the other reward spreads every
    group) and the named one decides."""
    rewards = spread_unless_flat if metric == "reward" else [named_accuracy, always_spread]
    holder = []
    seen = trained_prompts(monkeypatch, lambda: holder[0])
    trainer = GRPOTrainer(model=model_dir, reward_funcs=rewards, train_dataset=data(),
                          args=args_for(tmp_path, dynamic_sampling_metric=metric))
    holder.append(trainer)
    trainer.train()
    assert seen == [[PROMPTS[0], PROMPTS[3]], [PROMPTS[5], PROMPTS[6]]]
    assert [[r[c] for c in COLUMNS] for r in rows(trainer)] == [[2.0, 0.5, 0.0, 4.0], [2.0, 0.5, 0.0, 8.0]]
    assert all(r["dynamic_sampling/sampled_per_trained_token"] >= 1.0 for r in rows(trainer))
    if metric == "reward":  # every sampled completion's: a kept group's 0 and 1, a flat one's 0s
        assert [r["dynamic_sampling/sampled_reward_mean"] for r in rows(trainer)] == [0.25, 0.25]
    # the epoch counts every prompt drawn (16 prompts: 8 drawn), the episodes the completions trained
    assert (trainer.state.epoch, trainer.state.episode, trainer.prompt_batches_drawn) == (0.5, 8, 4)


def test_group_spread_reads_judged_completions_only():
    values = torch.tensor([1.0, 1.0, 0.1, 0.1 + 1e-7, float("nan"), 2.0, float("nan"), float("nan")])
    assert group_spread(values, 2).tolist() == [False, True, False, False]


def test_a_resume_in_the_middle_of_an_epoch_draws_the_same_prompts(tmp_path, model_dir, monkeypatch):
    """Saved after the first batch (two rounds drawn), resumed: the same next prompts, the same weights and rows
    as the run that went on."""
    seen = trained_prompts(monkeypatch, lambda: trainers[-1])
    trainers = [GRPOTrainer(model=model_dir, reward_funcs=spread_unless_flat, train_dataset=data(),
                            args=args_for(tmp_path, "whole", max_steps=3))]
    trainers[0].train()
    whole = seen[:]

    class StopAt1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 1

    trainers.append(GRPOTrainer(model=model_dir, reward_funcs=spread_unless_flat, train_dataset=data(),
                                callbacks=[StopAt1()],
                                args=args_for(tmp_path, "cut", max_steps=3, save_strategy="steps", save_steps=100)))
    trainers[1].train()
    assert [s for s, _ in checkpoints(str(tmp_path / "cut"))] == [1]
    trainers.append(GRPOTrainer(model=model_dir, reward_funcs=spread_unless_flat, train_dataset=data(),
                                args=args_for(tmp_path, "cut", max_steps=3, resume_from_checkpoint="latest")))
    trainers[2].train()
    assert seen[3:] == whole  # the cut run's first batch, then the resumed run's two
    resumed, first = trainers[2], trainers[0]
    assert (resumed.iterations_done, resumed.prompt_batches_drawn) == (3, 6) == (first.iterations_done,
                                                                                 first.prompt_batches_drawn)
    assert digest(resumed.policy.state_dict()) == digest(first.policy.state_dict())

    def logged(trainer):
        return [(r["step"], r["loss"], r["epoch"], *(r.get(c) for c in COLUMNS))
                for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    assert logged(resumed) == logged(first)


def test_nothing_to_drop_changes_nothing(tmp_path, model_dir):
    """Every group differs: the run with dynamic sampling is the run without it, bit for bit."""
    runs = []
    for on in (False, True):
        trainer = GRPOTrainer(model=model_dir, reward_funcs=always_spread, train_dataset=data(),
                              args=args_for(tmp_path, f"on{on}", dynamic_sampling=on))
        trainer.train()
        runs.append(trainer)
    assert digest(runs[0].policy.state_dict()) == digest(runs[1].policy.state_dict())
    assert [r["dynamic_sampling/generation_rounds"] for r in rows(runs[1])] == [1.0, 1.0]

    def logged(trainer):
        return [{k: v for k, v in r.items() if not k.startswith(("dynamic_sampling/", "time/")) and
                 k not in ("step_time", "eps", "train_runtime", "train_samples_per_second", "train_steps_per_second")}
                for r in trainer.state.log_history]
    assert logged(runs[0]) == logged(runs[1])


def flat_everywhere(prompts, completions, **kwargs):
    return [1.0] * len(prompts)


def test_the_bound_trains_on_what_was_collected_or_raises(tmp_path, model_dir, capsys):
    """No group ever differs: at dynamic_sampling_max_rounds the batch is completed with the earliest dropped
    groups (said and counted), or the run raises."""
    trainer = GRPOTrainer(model=model_dir, reward_funcs=flat_everywhere, train_dataset=data(),
                          args=args_for(tmp_path, dynamic_sampling_max_rounds=3))
    trainer.train()
    assert [[r[c] for c in COLUMNS] for r in rows(trainer)] == [[3.0, 1.0, 2.0, 6.0], [3.0, 1.0, 2.0, 12.0]]
    assert "0 of the 2 groups a batch needs differ in 'reward' after 3 generation rounds " \
           "(dynamic_sampling_max_rounds): the batch is completed with 2 groups" in capsys.readouterr().out
    strict = GRPOTrainer(model=model_dir, reward_funcs=flat_everywhere, train_dataset=data(),
                         args=args_for(tmp_path, "strict", dynamic_sampling_max_rounds=2,
                                       dynamic_sampling_at_bound="raise"))
    with pytest.raises(SamplingBoundReached, match=r"after 2 generation rounds \(dynamic_sampling_max_rounds\); "
                                                   "raise dynamic_sampling_max_rounds"):
        strict.train()
    assert strict.state.global_step == 0


@pytest.mark.parametrize("settings, message", [
    (dict(dynamic_sampling_metric="accuracy"), "dynamic_sampling_metric 'accuracy' is neither 'reward' .* nor one "
                                               "of this run's rewards \\(spread_unless_flat\\)"),
    (dict(dynamic_sampling_max_rounds=0), "dynamic_sampling_max_rounds must be a whole number of generation rounds "
                                          ">= 1"),
    (dict(overlong_buffer_len=6), "overlong_buffer_len must be a number of tokens from 0 \\(off\\) to "
                                  "max_completion_length \\(5\\)"),
    (dict(overlong_penalty_factor=-1.0), "overlong_penalty_factor must be >= 0"),
    (dict(dynamic_sampling_at_bound="skip"), "dynamic_sampling_at_bound must be 'train' or 'raise'"),
])
def test_bad_settings_are_refused_by_name_before_any_model_loads(tmp_path, model_dir, monkeypatch, settings,
                                                                 message):
    monkeypatch.setattr(L, "build_models", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SettingsError, match=message):
        GRPOTrainer(model=model_dir, reward_funcs=spread_unless_flat, train_dataset=data(),
                    args=args_for(tmp_path, **settings))


def test_an_estimator_without_groups_is_refused_in_the_library_and_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "build_models", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SettingsError, match="dynamic_sampling drops the groups .* advantage_estimator "
                                            "'reinforce_plus_plus' has no groups"):
        PPOTrainer(args=PPOConfig(output_dir=str(tmp_path / "ppo"), advantage_estimator="reinforce_plus_plus",
                                  dynamic_sampling=True, report_to="none"))
    with pytest.raises(SettingsError, match="advantage_estimator 'gae' has no groups"):
        cli_trainer(["--output_dir", str(tmp_path / "cli"), "--dynamic_sampling", "--report_to", "none"])
    with pytest.raises(SettingsError, match="dynamic_sampling_max_rounds must be"):
        cli_trainer(["--output_dir", str(tmp_path / "cli"), "--advantage_estimator", "grpo", "--dynamic_sampling",
                     "--dynamic_sampling_max_rounds", "0", "--report_to", "none"])


def zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(prompts)


def test_the_overlong_setting_and_reward_function_are_daposs_punishment(tmp_path, model_dir):
    """overlong_buffer_len adds the punishment to the summed reward; fastppo.rewards' reward function is its own
    column. Lengths 0-5 of max_completion_length 5, buffer 3: 0 up to 2 tokens, then -1/3, -2/3, -1."""
    lengths = torch.arange(0, 8)
    assert soft_overlong_penalty(lengths, 5, 3).tolist() == [0, 0, 0, -1 / 3, -2 / 3, -1, -1, -1]
    assert soft_overlong_penalty(lengths, 5, 3, 0.5).tolist() == [0, 0, 0, -1 / 6, -1 / 3, -0.5, -0.5, -0.5]
    assert soft_overlong_penalty(lengths, 5, 0).tolist() == [0] * 6 + [-1, -1]
    setting = GRPOTrainer(model=model_dir, reward_funcs=zero_reward, train_dataset=data(),
                          args=args_for(tmp_path, "setting", dynamic_sampling=False, overlong_buffer_len=3,
                                        overlong_penalty_factor=0.5))
    batch = setting.rollout()
    assert batch.scores.tolist() == soft_overlong_penalty(batch.rollout.lengths, 5, 3, 0.5).float().tolist()
    assert batch.rollout.lengths.max() > 2  # some completions are punished
    function = GRPOTrainer(model=model_dir, reward_funcs=soft_overlong_punishment(5, 3), train_dataset=data(),
                           args=args_for(tmp_path, "function", dynamic_sampling=False))
    batch = function.rollout()
    assert batch.reward_columns["soft_overlong_punishment_reward"].tolist() == \
        soft_overlong_penalty(batch.rollout.lengths, 5, 3).float().tolist()


TRL_OVERLONG = """
import json, sys
import datasets
from trl.rewards import get_soft_overlong_punishment
from fastppo import GRPOConfig, GRPOTrainer
from fastppo.rewards import soft_overlong_punishment
ids = [[7] * n for n in range(0, 14)]
out = {"trl": get_soft_overlong_punishment(10, 4)(ids), "ours": soft_overlong_punishment(10, 4)(ids)}
args = GRPOConfig(output_dir=sys.argv[2], num_generations=2, per_device_train_batch_size=4, max_completion_length=5,
                  bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True, max_steps=1)
trainer = GRPOTrainer(model=sys.argv[1], reward_funcs=get_soft_overlong_punishment(5, 3), args=args,
                      train_dataset=datasets.Dataset.from_dict({"prompt": ["the movie was", "the plot is"] * 2}))
batch = trainer.rollout()
out["column"] = batch.reward_columns["soft_overlong_punishment_reward"].tolist()
out["lengths"] = batch.rollout.lengths.tolist()
print(json.dumps(out))
"""


def test_trls_soft_overlong_punishment_is_fastppos_and_works_unchanged(tmp_path, model_dir):
    """TRL 1.16's own function (its environment) against fastppo's on lengths 0-13 of 10 with a cache of 4, and
    as a reward function of fastppo's GRPOTrainer: its column is fastppo's punishment of the completions' lengths."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(trl1_dir()), str(ROOT)]), TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", TRL_OVERLONG, model_dir, str(tmp_path / "trl")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ours"] == out["trl"] and min(out["trl"]) == -1.0 and out["trl"][7] == -0.25
    expected = soft_overlong_penalty(torch.tensor(out["lengths"]), 5, 3).float().tolist()
    assert out["column"] == expected and not all(math.isclose(v, 0.0) for v in expected)


def test_two_processes_fill_their_own_groups_in_step(tmp_path, model_dir):
    """torchrun, 2 CPU processes: rank 0's first group is flat, so both sample a second round (rank 1's surplus
    dropped); each trains its own kept group, both log the same rounds and counts, and the weights stay equal."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_worker.py")
    # this checkout's fastppo, whichever one the environment has installed
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           worker, "dynamic", str(tmp_path), model_dir], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"dynamic{r}.json")) for r in range(2)]
    assert ranks[0]["seen"] == [["the story was good"] * 2, ["the music was good"] * 2]
    assert ranks[1]["seen"] == [["the film was good"] * 2, ["the ending was good"] * 2]
    assert ranks[0]["rows"] == ranks[1]["rows"]
    assert [(r["dynamic_sampling/generation_rounds"], r["dynamic_sampling/frac_groups_dropped"],
             r["dynamic_sampling/prompts_consumed"], r["epoch"]) for r in ranks[0]["rows"]] == \
        [(2.0, 0.25, 4.0, 0.5), (1.0, 0.0, 6.0, 0.75)]
    assert ranks[0]["weights"] == ranks[1]["weights"]


def byte_model_and_tokenizer():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tool_script import byte_tokenizer

    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    return model, tok


class Judge:
    """An environment whose reward is its row's: 0 for a flat prompt, else alternating by the order of resets (a
    group's two rollouts differ)."""

    resets = 0

    def reset(self, **row):
        Judge.resets += 1
        self.prompt, self.order = row["prompt"][-1]["content"], Judge.resets

    def get_reward(self) -> float:
        return 0.0 if self.prompt.endswith("flat") else float(self.order % 2)


def test_environments_and_logged_columns_follow_the_kept_rows(tmp_path, monkeypatch):
    """environment_factory: each round resets its own instances (a later round takes fresh ones from the pool), the
    trainer's environments after a step are the kept rollouts', and a reward function's log_extra column is the
    kept rows' values."""
    model, tok = byte_model_and_tokenizer()

    def tagged(prompts, completions, log_extra, **kwargs):
        log_extra("prompt_text", [p[-1]["content"] for p in prompts])
        return [0.0] * len(prompts)

    data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    trainer = GRPOTrainer(model=model, processing_class=tok, train_dataset=data, environment_factory=Judge,
                          reward_funcs=tagged, args=args_for(tmp_path, max_steps=1, max_completion_length=4))
    tables = []
    monkeypatch.setattr(trainer, "_log_completions", lambda result, columns: tables.append(columns))
    trainer.train()
    kept = [PROMPTS[0]] * 2 + [PROMPTS[3]] * 2
    assert [e.prompt for e in trainer.environments] == kept
    assert tables == [{"prompt_text": kept}]
    assert rows(trainer)[0]["dynamic_sampling/generation_rounds"] == 2.0


def test_a_rollout_func_is_called_for_each_round(tmp_path, monkeypatch):
    """rollout_func: called with each round's prompts; its extra fields reach the rewards of that round; the kept
    groups' completions are trained."""
    model, tok = byte_model_and_tokenizer()
    given = []

    def rollout(prompts, trainer):
        given.append(list(prompts))
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [tok(f" {i}<|im_end|>")["input_ids"] for i in range(len(ids))],
                "logprobs": None, "flat": [p.endswith("flat") for p in prompts]}

    def reward(completions, flat, **kwargs):
        return [0.0 if f else float(i % 2) for i, f in enumerate(flat)]

    seen = trained_prompts(monkeypatch, lambda: trainer)
    trainer = GRPOTrainer(model=model, processing_class=tok, train_dataset=data(), rollout_func=rollout,
                          reward_funcs=reward, args=args_for(tmp_path, max_steps=1))
    trainer.train()
    assert given == [[PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, [PROMPTS[2]] * 2 + [PROMPTS[3]] * 2]
    assert seen == [[PROMPTS[0], PROMPTS[3]]]
