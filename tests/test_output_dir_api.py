"""An output_dir holding an earlier fastppo run, through the TRL API (issue 60 items 6 and 7): TRL's resume pattern
(``train(resume_from_checkpoint=...)`` on a trainer built on that directory) continues exactly; a script run twice
starts afresh, replacing only the earlier run's own files, as TRL's Trainer writes over an earlier run; fastppo's
command line keeps its guard; each speaks its caller's words (keywords to Python, flags to the command line)."""
from __future__ import annotations

import json
import shutil

import datasets
import pytest
from transformers import TrainerCallback

from fastppo import GRPOConfig, GRPOTrainer, PPOTrainer
from fastppo.checkpoint import checkpoints
from fastppo.errors import SettingsError
from helpers import digest, quick_config

pytestmark = pytest.mark.usefixtures("reference_path")


def prompts():
    return datasets.Dataset.from_dict({"prompt": ["the movie was", "i think the plot is", "overall the cast",
                                                  "the ending felt"] * 4})


def length_reward(completions, **kwargs):
    return [0.1 * len(c) for c in completions]


def grpo_args(out, **kw):
    base = dict(output_dir=str(out), num_generations=4, per_device_train_batch_size=8, max_completion_length=4,
                max_steps=4, logging_steps=1, save_strategy="steps", save_steps=2, bf16=False, disable_tqdm=True,
                gradient_checkpointing=False, report_to="none", learning_rate=1e-3, seed=3)
    return GRPOConfig(**{**base, **kw})


def grpo(model_dir, out, callbacks=None, **kw):
    return GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=prompts(), callbacks=callbacks,
                       args=grpo_args(out, **kw))


class StopAt2(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= 2


def steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trls_resume_pattern_continues_the_run_exactly(tmp_path, model_dir):
    """GRPOTrainer(args=GRPOConfig(output_dir=d)) on a directory holding checkpoint-2, then
    train(resume_from_checkpoint=path or True): the constructor refused the directory, so train() was never
    reached. Now the resume is decided again at train(), and is the uninterrupted run's, bit for bit."""
    whole = grpo(model_dir, tmp_path / "whole")
    whole.train()
    grpo(model_dir, tmp_path / "cut", callbacks=[StopAt2()]).train()
    assert [s for s, _ in checkpoints(str(tmp_path / "cut"))] == [2]
    shutil.copytree(tmp_path / "cut", tmp_path / "cut_true")
    for name, resume in (("cut", str(tmp_path / "cut" / "checkpoint-2")), ("cut_true", True)):
        resumed = grpo(model_dir, tmp_path / name)  # no resume in the config: TRL's users give it to train()
        assert resumed._resume_path is None
        resumed.train(resume_from_checkpoint=resume)
        assert resumed.state.global_step == 4 and resumed._resume_path.endswith("checkpoint-2")
        assert digest(resumed.policy.state_dict()) == digest(whole.policy.state_dict())
        assert steps(tmp_path / name) == [1, 2, 3, 4]


def test_a_trl_script_run_twice_starts_afresh_and_keeps_the_users_files(tmp_path, model_dir, capsys):
    out = tmp_path / "out"
    grpo(model_dir, out).train()
    assert [s for s, _ in checkpoints(str(out))] == [2, 4] and steps(out) == [1, 2, 3, 4]
    (out / "notes.txt").write_text("the user's own file")
    again = grpo(model_dir, out, max_steps=2)  # TRL's GRPOConfig has no overwrite_output_dir: none is needed
    assert [s for s, _ in checkpoints(str(out))] == [2, 4]  # building a trainer deletes nothing
    capsys.readouterr()
    again.train()
    log = capsys.readouterr().out
    assert again.state.global_step == 2  # never resumed unasked
    assert "held an earlier fastppo run" in log and "starting afresh" in log and "resume_from_checkpoint=True" in log
    # the earlier run's files are gone with it (its checkpoint-4 would be the next resume's "latest"), the user's kept
    assert [s for s, _ in checkpoints(str(out))] == [2] and steps(out) == [1, 2]
    assert (out / "notes.txt").read_text() == "the user's own file"


def test_ppotrainer_from_python_replaces_an_earlier_run_and_the_command_line_refuses_it(tmp_path, model_dir, capsys):
    PPOTrainer(args=quick_config(tmp_path, total_episodes=8)).train()
    with pytest.raises(SettingsError, match=r"--output_dir '.*' already holds a run .*--resume_from_checkpoint latest"):
        PPOTrainer(args=quick_config(tmp_path, total_episodes=8), command_line=True)
    trainer = PPOTrainer(args=quick_config(tmp_path, total_episodes=8))  # built, as TRL's would be
    capsys.readouterr()
    trainer.train()
    assert "output_dir='" in capsys.readouterr().out and steps(tmp_path / "out") == [1]


def test_messages_speak_the_callers_words(tmp_path, model_dir):
    """A directory no fastppo run wrote is refused either way; to a Python caller in keywords, to the command line
    in flags."""
    mine = tmp_path / "out"
    mine.mkdir()
    (mine / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(SettingsError, match=r"^output_dir='.*' holds a model .*overwrite_output_dir=True included: "
                                            r"use another output_dir$"):
        PPOTrainer(args=quick_config(tmp_path))
    with pytest.raises(SettingsError, match=r"^--output_dir '.*' holds a model .*--overwrite_output_dir included: "
                                            r"use another --output_dir$"):
        PPOTrainer(args=quick_config(tmp_path), command_line=True)


def weight_files(out) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*.safetensors"))


def test_train_saves_per_save_strategy_as_trl_and_save_model_saves_the_model(tmp_path, model_dir):
    """Through the TRL API ``train()`` writes what transformers' Trainer writes (issue 63 item 7): under
    save_strategy="no" no weights at all; under "steps" a checkpoint every save_steps optimizer steps and one at
    the last step (transformers' DefaultFlowCallback), and no final model beside them. ``save_model()`` then saves
    the model as ``Trainer.save_model``: weights, config and tokenizer into output_dir (or the path given), loadable
    with ``from_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    none = tmp_path / "none"
    grpo(model_dir, none, save_strategy="no", max_steps=2).train()
    assert weight_files(none) == [] and checkpoints(str(none)) == []
    out = tmp_path / "steps"
    trainer = grpo(model_dir, out, max_steps=3)  # save_steps=2: step 2, and the last step
    trainer.train()
    assert [s for s, _ in checkpoints(str(out))] == [2, 3]
    assert weight_files(out) == ["checkpoint-2/model.safetensors", "checkpoint-3/model.safetensors"]
    trained = digest(trainer.policy.state_dict())
    for path in (None, tmp_path / "elsewhere"):
        trainer.save_model(None if path is None else str(path))
        path = path or out
        assert digest(AutoModelForCausalLM.from_pretrained(path).state_dict()) == trained
        assert AutoTokenizer.from_pretrained(path).pad_token_id == trainer.processing_class.pad_token_id
    assert digest(AutoModelForCausalLM.from_pretrained(out / "checkpoint-3").state_dict()) == trained
