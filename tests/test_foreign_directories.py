"""Directories fastppo did not write (a transformers Trainer's SFT output, other files) are never taken for a
fastppo run: refused with what they are, never overwritten or deleted, also under ``--overwrite_output_dir``,
``save_model`` and legacy ``save_pretrained``; a directory is fastppo's only where fastppo's own marker is
(found by issue 35's hostile round)."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from fastppo import PPOTrainer
from fastppo import checkpoint as C
from fastppo.output_dir import fastppo_marker, foreign_files, remove_run_files, run_files
from helpers import quick_config

pytestmark = pytest.mark.usefixtures("reference_path")


config = functools.partial(quick_config, total_episodes=8)  # one iteration of 8 episodes


def length_reward(completions, **kw):
    return [float(len(c)) for c in completions]


def tree(path) -> dict[str, str]:
    """Every file under ``path`` with its content's hash: what a refusal must leave exactly as it was."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            with open(file, "rb") as f:
                out[os.path.relpath(file, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def sft_dir(model_dir, tmp_path_factory):
    """A real transformers Trainer's output (an SFT run): checkpoint-N/ with trainer_state.json, runs/, the final
    model.safetensors, training_args.bin and the tokenizer."""
    from transformers import Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("sft") / "sft-run"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(t)["input_ids"] for t in ["the movie was good", "i think the plot is great"] * 2]
    args = TrainingArguments(output_dir=str(out), max_steps=2, save_steps=1, per_device_train_batch_size=1,
                             report_to=["tensorboard"], logging_steps=1, use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                      train_dataset=datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}))
    trainer.train()
    trainer.save_model()
    tokenizer.save_pretrained(out)
    assert (out / "checkpoint-2" / "trainer_state.json").is_file() and (out / "runs").is_dir()
    return out


def _copy(src, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_a_transformers_trainers_output_is_never_taken_for_a_fastppo_run(tmp_path, sft_dir):
    """The example: with or without --overwrite_output_dir the run is refused before anything is written, the
    refusal names what it found and points to another --output_dir, never to the overwrite flag."""
    own = _copy(sft_dir, tmp_path, "sft")
    before = tree(own)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"holds a transformers/TRL Trainer's output \(checkpoint-1/ holding "
                                             r"trainer_state.json.*model.safetensors.*that no fastppo run wrote.*"
                                             r"overwrite_output_dir=True included: use another output_dir") as err:
            PPOTrainer(args=config(tmp_path, name="sft", overwrite_output_dir=overwrite), reward_model=length_reward)
        assert "to replace it" not in str(err.value)
    assert fastppo_marker(str(own)) is None and run_files(str(own)) == []
    remove_run_files(str(own))  # where no marker is, nothing is fastppo's to delete
    assert tree(own) == before


def test_the_command_line_refuses_a_trainers_output_with_the_overwrite_flag(tmp_path, sft_dir, model_dir):
    own = _copy(sft_dir, tmp_path, "sft")
    before = tree(own)
    proc = subprocess.run([sys.executable, "-m", "fastppo.train", "--output_dir", str(own), "--overwrite_output_dir",
                           "true", "--total_episodes", "8"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "transformers/TRL Trainer's output" in proc.stderr and "use another --output_dir" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert tree(own) == before


def test_other_directories_fastppo_did_not_write_are_refused(tmp_path, sft_dir, model_dir):
    """Other members: a Trainer's checkpoints alone (its run stopped before the final save), a downloaded model with
    a GGUF file, another tool's metrics.jsonl, and a fastppo run into which another trainer's checkpoint was put."""
    only_checkpoints = tmp_path / "ckpts"
    shutil.copytree(sft_dir / "checkpoint-1", only_checkpoints / "checkpoint-500")
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    (downloaded / "model.gguf").write_bytes(b"GGUF")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"loss": 1.0, "epoch": 0.5}\n')
    for name, fragment in (("ckpts", "a transformers/TRL Trainer's output (checkpoint-500/ holding trainer_state.json)"),
                           ("downloaded", "a model (model.gguf)"), ("logs", "files (metrics.jsonl)")):
        before = tree(tmp_path / name)
        for overwrite in (False, True):
            with pytest.raises(ValueError, match="use another output_dir") as err:
                PPOTrainer(args=config(tmp_path, name=name, overwrite_output_dir=overwrite), reward_model=length_reward)
            assert fragment in str(err.value)
        assert tree(tmp_path / name) == before
    # a fastppo run, then a Trainer's checkpoint put beside it: that checkpoint is never deleted or replaced
    PPOTrainer(args=config(tmp_path, name="mixed"), reward_model=length_reward).train()
    shutil.copytree(sft_dir / "checkpoint-1", tmp_path / "mixed" / "checkpoint-7")
    with pytest.raises(ValueError, match=r"another trainer's checkpoints|Trainer's output \(checkpoint-7/"):
        PPOTrainer(args=config(tmp_path, name="mixed", overwrite_output_dir=True), reward_model=length_reward)
    assert (tmp_path / "mixed" / "checkpoint-7" / "trainer_state.json").is_file()


def test_resuming_from_a_trainers_checkpoint_says_what_it_is(tmp_path, sft_dir):
    """A sibling: --resume_from_checkpoint naming a transformers Trainer's checkpoint-N said only 'not a complete
    fastppo checkpoint'; it says whose checkpoint it is and how to start PPO from its weights."""
    with pytest.raises(ValueError, match=r"a transformers/TRL Trainer's checkpoint .*--sft_model_path .*checkpoint-2"):
        PPOTrainer(args=config(tmp_path, resume_from_checkpoint=str(sft_dir / "checkpoint-2")),
                   reward_model=length_reward)
    assert not (tmp_path / "out").exists()


def test_save_model_and_legacy_save_pretrained_never_replace_anothers_model(tmp_path, sft_dir, model_dir):
    """The library's siblings: save_model(path) and the legacy API's save_pretrained(path) into a directory that
    holds a model no fastppo run wrote are refused; into their own earlier save, or a fresh directory, they write."""
    from fastppo.legacy import PPOConfig as LegacyConfig
    from fastppo.legacy import PPOTrainer as LegacyTrainer

    own = _copy(sft_dir, tmp_path, "sft")
    before = tree(own)
    trainer = PPOTrainer(args=config(tmp_path), reward_model=length_reward)
    with pytest.raises(ValueError, match=r"save_model: .*sft.* holds a transformers/TRL Trainer's output.*"
                                         "use another directory"):
        trainer.save_model(str(own))
    trainer.save_model(str(tmp_path / "final"))
    trainer.save_model(str(tmp_path / "final"))  # its own save: written again
    assert (tmp_path / "final" / C.CONFIG_FILE).is_file()
    legacy = LegacyTrainer(LegacyConfig(model_name=model_dir, batch_size=4, mini_batch_size=2,
                                        output_dir=str(tmp_path / "legacy")),
                           AutoModelForCausalLM.from_pretrained(model_dir), None, AutoTokenizer.from_pretrained(model_dir))
    with pytest.raises(ValueError, match="save_model: .*sft.* holds"):
        legacy.save_pretrained(str(own))
    with pytest.raises(ValueError, match="create_model_card: .*sft.* holds"):
        legacy.create_model_card(str(own))  # legacy TRL's model card: a README.md beside the weights
    legacy.save_pretrained(str(tmp_path / "legacy-model"))
    legacy.create_model_card(str(tmp_path / "legacy-model"))
    assert tree(own) == before


class _StopAfter(TrainerCallback):
    def __init__(self, step, save=True):
        self.step, self.save = step, save

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True
            control.should_save = self.save


def test_directories_fastppo_wrote_are_still_its_own(tmp_path, model_dir):
    """What fastppo writes is recognised by its own files, in every shape a run leaves: a finished run, one
    stopped after a checkpoint, one that crashed before its first checkpoint (metrics lines only), a save that a
    crash interrupted (.tmp-checkpoint-N holding RNG files). Every version wrote fastppo_config.json into each
    checkpoint and beside each final model (the command line's job writes one)."""
    PPOTrainer(args=config(tmp_path, name="done"), reward_model=length_reward, command_line=True).train()
    assert fastppo_marker(str(tmp_path / "done")) == C.CONFIG_FILE
    PPOTrainer(args=config(tmp_path, name="stopped", total_episodes=24),
               callbacks=[_StopAfter(1)], reward_model=length_reward).train()
    assert foreign_files(str(tmp_path / "stopped")) == []
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text(json.dumps({"objective/kl": 0.1, "episode": 8, "step": 1}) + "\n")
    torn = tmp_path / "torn"
    (torn / ".tmp-checkpoint-1").mkdir(parents=True)
    torch.save({}, torn / ".tmp-checkpoint-1" / "rng_state_0.pt")
    for name in ("done", "stopped", "crashed", "torn"):
        assert fastppo_marker(str(tmp_path / name)) is not None and foreign_files(str(tmp_path / name)) == []
        with pytest.raises(ValueError, match="already holds a run .*--overwrite_output_dir to replace it"):
            PPOTrainer(args=config(tmp_path, name=name), reward_model=length_reward, command_line=True)
    # the run that stopped after a checkpoint resumes; the crashed one is replaced with --overwrite_output_dir
    resumed = PPOTrainer(args=config(tmp_path, name="stopped", total_episodes=24, resume_from_checkpoint="latest"),
                         reward_model=length_reward)
    assert resumed._resume_path.endswith("checkpoint-1")
    (crashed / "notes.txt").write_text("the user's own file")
    PPOTrainer(args=config(tmp_path, name="crashed", overwrite_output_dir=True), reward_model=length_reward,
               command_line=True).train()
    assert (crashed / "notes.txt").read_text() == "the user's own file" and (crashed / C.CONFIG_FILE).is_file()
    assert len((crashed / "metrics.jsonl").read_text().splitlines()) == 1  # the new run's only
    # a fastppo checkpoint whose final model's config is missing (written last by earlier versions): the top-level
    # model files are not provably fastppo's, so the run is refused rather than guessed at
    os.remove(tmp_path / "done" / C.CONFIG_FILE)
    assert "model.safetensors" in foreign_files(str(tmp_path / "done"))
