"""The console as transformers' Trainer shows it to TRL's users (``fastppo/console.py``): a tqdm bar over the global
steps with its ETA on standard error (none under ``disable_tqdm``), the lines on standard output kept off it, and
each logged step's line in TRL's names: TRL GRPO's for a critic-free run (per-token ``entropy``, ``reward``), TRL
0.26 PPO's for PPO, each value the log_history row's own."""
from __future__ import annotations

import math
import re
import sys

import pytest
from rich.console import Console
from tqdm.auto import tqdm

from fastppo import GRPOConfig, GRPOTrainer
from fastppo.console import StdoutBesideBar, step_line
from helpers import cli_trainer, make_trainer, small_config
from test_grpo_trainer import length_penalty, tutorial_dataset

pytestmark = pytest.mark.usefixtures("reference_path")

# tqdm's frame at the end: "100%|██████████| 2/2 [00:01<00:00,  1.50it/s]" (elapsed<remaining, the ETA)
BAR_AT_END = r"100%\|[^|]*\| {n}/{n} \[\d\d:\d\d<\d\d:\d\d, +[\d.]+(it/s|s/it)\]"


def step_lines(out: str, prefix: str) -> list[dict[str, str]]:
    """The console's logged-step lines (``[fastppo] <prefix> k/n episode e: name value ...``) as name -> value."""
    rows = []
    for line in out.splitlines():
        match = re.match(rf"\[fastppo\] {prefix} \d+/\d+ episode \d+: (.*)$", line)
        if match:
            words = match.group(1).split()
            rows.append(dict(zip(words[::2], words[1::2])))
    return rows


def grpo_run(tmp_path, model_dir, disable_tqdm: bool) -> GRPOTrainer:
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=2, logging_steps=1, bf16=False, disable_tqdm=disable_tqdm,
                      gradient_checkpointing=False, save_strategy="no", report_to="none")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=length_penalty, args=args, train_dataset=tutorial_dataset())
    trainer.train()
    return trainer


def test_a_grpo_run_shows_trls_names_and_a_bar_over_its_optimizer_steps(tmp_path, model_dir, capsys):
    trainer = grpo_run(tmp_path, model_dir, disable_tqdm=False)
    out, err = capsys.readouterr()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    shown = step_lines(out, "step")
    assert len(shown) == len(rows) == 2
    first = shown[0]
    # TRL GRPO's names, in TRL's order of interest, each the row's value as ProgressCallback formats it (.4g)
    assert list(first)[:5] == ["reward", "reward_std", "entropy", "loss", "grad_norm"]
    for line, row in zip(shown, rows):
        assert all(line[name] == f"{row[name]:.4g}" for name in line)
    # per-token entropy (at most ln V nats), not TRL PPO's per-completion sum
    assert 0 < float(first["entropy"]) <= math.log(len(trainer.processing_class))
    assert "scores" not in out and "objective/" not in out
    # the bar: on standard error, over the 2 optimizer steps, with its ETA; standard output holds the lines alone
    assert re.search(BAR_AT_END.format(n=2), err), err[-2000:]
    assert "\r" not in out and "it/s" not in out and "s/it" not in out


def test_disable_tqdm_shows_the_lines_and_no_bar(tmp_path, model_dir, capsys):
    trainer = grpo_run(tmp_path, model_dir, disable_tqdm=True)
    out, err = capsys.readouterr()
    assert len(step_lines(out, "step")) == trainer.state.global_step == 2
    assert "it/s" not in err and "s/it" not in err and "|" not in err


def test_cli_critic_free_and_ppo_lines(tmp_path, model_dir, capsys):
    """The command line's critic-free mode counts iterations as TRL 0.26's loop does and shows TRL GRPO's names;
    PPO shows TRL 0.26's (objective/entropy: a completion's sum, the value TRL's PPO logs)."""
    cli = cli_trainer(["--advantage_estimator", "rloo", "--num_generations", "2", "--output_dir", str(tmp_path / "cli"),
                       "--total_episodes", "16", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps",
                       "1", "--response_length", "4", "--num_sample_generations", "0", "--logging_steps", "1",
                       "--save_strategy", "no"])
    cli.train()
    out, err = capsys.readouterr()
    shown = step_lines(out, "iter")
    rows = cli.state.log_history[:len(shown)]
    assert len(shown) == 2 and list(shown[0])[:5] == ["reward", "reward_std", "entropy", "kl", "loss"]
    for line, row in zip(shown, rows):
        assert all(line[name] == f"{row[name]:.4g}" for name in line)
    assert re.search(BAR_AT_END.format(n=2), err), err[-2000:]

    ppo = make_trainer(small_config(tmp_path, disable_tqdm=False, num_ppo_epochs=1))
    ppo.train()
    out, err = capsys.readouterr()
    shown = step_lines(out, "iter")
    rows = [r for r in ppo.state.log_history if "objective/scores" in r]
    assert len(shown) == len(rows) == 2
    assert list(shown[0]) == ["objective/scores", "objective/kl", "objective/entropy", "loss/value_avg"]
    for line, row in zip(shown, rows):
        assert all(line[name] == f"{row[name]:.4g}" for name in line)
    assert re.search(BAR_AT_END.format(n=2), err), err[-2000:]


def test_a_line_printed_while_the_bar_is_live_does_not_land_in_it(capsys):
    """The console's write clears the bar and draws it again after it (tqdm.write's way); a plain write would
    append the line to the bar's frame."""
    bar = tqdm(total=4, file=sys.stderr, ncols=60, mininterval=0)
    bar.update(1)
    before = capsys.readouterr().err
    Console(file=StdoutBesideBar()).print("[fastppo] step 1/4", markup=False, highlight=False)
    out, err = capsys.readouterr()
    bar.close()
    assert out == "[fastppo] step 1/4\n"
    # cleared (carriage return, blanks, carriage return), then the same frame drawn again
    assert err.startswith("\r" + " " * 10) and err.rstrip().endswith(before.strip().split("\r")[-1].strip())


def test_step_line_leaves_out_what_the_row_lacks():
    assert step_line({"loss": 0.5, "entropy": 3.14159, "reward": None}, critic_free=True) == "entropy 3.142 loss 0.5"
    assert step_line({"objective/scores": 12.345678, "objective/entropy": 125.1}, critic_free=False) == \
        "objective/scores 12.35 objective/entropy 125.1"


def test_a_config_made_after_a_trainer_started_keeps_transformers_default_bar(tmp_path):
    """TrainingArguments' disable_tqdm defaults from transformers' verbosity; a trainer sets it to ERROR while it
    runs, and a later config still reads the level the user left (TRL's: a bar, at transformers' WARNING)."""
    from transformers.utils import logging as hf_logging

    from fastppo import library_log

    level = hf_logging.get_verbosity()
    try:
        hf_logging.set_verbosity_warning()
        library_log.quieting_transformers(hf_logging.get_verbosity())  # what each trainer's start does
        hf_logging.set_verbosity_error()
        assert GRPOConfig(output_dir=str(tmp_path)).disable_tqdm is False
        hf_logging.set_verbosity(hf_logging.CRITICAL)  # the user's own choice after it: honoured
        assert GRPOConfig(output_dir=str(tmp_path)).disable_tqdm is True
    finally:
        hf_logging.set_verbosity(level)
