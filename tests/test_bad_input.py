"""Bad input: a clear error naming the setting, before anything loads; nothing silently wrong.

One file per concern: the command line's flags, then the library's settings, models, data and reward
functions (``PPOTrainer``), a frozen rank, and the kernels' arguments.

Command-line cases run the real entry point (``python -m fastppo.train``) in a subprocess and assert the
exit code, that the message names the flag, and that no traceback is printed. "Before anything loads"
is proved with a model directory whose config and tokenizer are real but whose weights file is garbage:
a run that got as far as loading weights would fail with a load error instead of the expected one.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fastppo import PPOTrainer
from fastppo.rewards import RewardFunctionError
from helpers import make_trainer, small_config

pytestmark = pytest.mark.usefixtures("reference_path", "model_dir")  # model_dir: the embedded model, built once


@pytest.fixture(scope="module")
def unloadable(model_dir, tmp_path_factory):
    """The embedded model's config and tokenizer with a weights file that cannot load."""
    path = tmp_path_factory.mktemp("unloadable") / "model"
    shutil.copytree(model_dir, path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    return str(path)


def cli(args, tmp_path, timeout=120):
    env = dict(os.environ, TRITON_INTERPRET="0")
    args = [*args, "--output_dir", str(tmp_path / "out")] if "--output_dir" not in args else list(args)
    return subprocess.run([sys.executable, "-m", "fastppo.train", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def assert_refused(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr[-2000:])
    assert "could not load the policy" not in proc.stderr  # refused before any weight was read


# ---------------------------------------------------------------------------- the command line, before loading


SETTING_CASES = [  # flags, fragments the error must contain
    (["--max_grad_norm", "-1"], ["max_grad_norm must be >= 0", "flip the gradient's sign"]),
    (["--ratio_threshold", "0"], ["ratio_threshold must be > 0"]),
    (["--stop_token_id", "-5"], ["stop_token_id -5"]),
    (["--kl_coef", "-0.1"], ["kl_coef must be >= 0"]),
    (["--cliprange", "-0.2"], ["cliprange must be >= 0"]),
    (["--cliprange_value", "-1"], ["cliprange_value must be >= 0"]),
    (["--learning_rate", "0"], ["learning_rate must be > 0"]),
    (["--learning_rate", "-1e-5"], ["learning_rate must be > 0"]),
    (["--vf_coef", "nan"], ["vf_coef must be >= 0"]),
    (["--gamma", "1.5"], ["gamma must be in [0, 1]"]),
    (["--lam", "-0.1"], ["lam must be in [0, 1]"]),
    (["--temperature", "inf"], ["temperature must be a finite number > 0"]),
    (["--temperature", "1e-9"], ["temperature must be in"]),
    (["--lr_scheduler_type", "reduce_lr_on_plateau"], ["reduce_lr_on_plateau"]),
    (["--lr_scheduler_type", "cosine_with_min_lr"], ["cosine_with_min_lr", "min_lr"]),
    (["--response_length", "0"], ["response_length must be an integer >= 1"]),
    (["--non_eos_penalty", "--missing_eos_penalty", "1"], ["non_eos_penalty", "missing_eos_penalty"]),
]


def run_main(args, tmp_path, capsys):
    """The entry point in this process (what ``python -m fastppo.train`` calls): (exit code, stderr)."""
    from fastppo.cli import main

    args = [*args, "--output_dir", str(tmp_path / "out")] if "--output_dir" not in args else list(args)
    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("flags, fragments", SETTING_CASES, ids=[" ".join(c[0]) for c in SETTING_CASES])
def test_bad_setting_is_refused_before_loading(tmp_path, unloadable, flags, fragments, capsys):
    code, err = run_main(["--model_name_or_path", unloadable, *flags], tmp_path, capsys)
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert "could not load the policy" not in err  # refused before any weight was read


@pytest.mark.slow
@pytest.mark.parametrize("model, flags, fragment", [
    ("unloadable", ["--max_grad_norm", "-1"], "max_grad_norm must be >= 0"),
    ("embedded default", ["--response_length", "0"], "response_length must be an integer >= 1"),
])
def test_a_bad_setting_in_a_subprocess_exits_2_without_traceback(tmp_path, request, model, flags, fragment):
    model_flags = ["--model_name_or_path", request.getfixturevalue("unloadable")] if model == "unloadable" else []
    assert_refused(cli([*model_flags, *flags], tmp_path), fragment)


def test_an_abbreviated_flag_is_refused_naming_the_flag(capsys):
    from fastppo.cli import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--learning_rat", "3"])  # no abbreviation, a close match named
    assert e.value.code == 2 and "--learning_rate" in capsys.readouterr().err


@pytest.mark.slow
def test_output_dir_that_is_a_file_or_unwritable(tmp_path, unloadable):
    (tmp_path / "a_file").write_text("x")
    assert_refused(cli(["--model_name_or_path", unloadable, "--output_dir", str(tmp_path / "a_file")], tmp_path),
                   "--output_dir", "is a file")
    assert_refused(cli(["--model_name_or_path", unloadable, "--output_dir", "/proc/fastppo/out"], tmp_path),
                   "--output_dir", "not writable")


@pytest.mark.slow
def test_stop_token_id_outside_the_vocabulary(tmp_path, unloadable):
    assert_refused(cli(["--model_name_or_path", unloadable, "--stop_token_id", "999999"], tmp_path),
                   "stop_token_id 999999 is outside the tokenizer's vocabulary")


@pytest.mark.slow
@pytest.mark.parametrize("flags, fragments", [
    # the embedded Llama has 256 positions: a RoPE model would silently run past them
    (["--response_length", "250"], ["+ response_length (250)", "exceeds the model's 256 positions",
                                    "set --max_prompt_length 6"]),
    (["--response_length", "100000"], ["exceeds the model's 256 positions", "lower --response_length"]),
])
def test_prompt_plus_response_beyond_the_positions(tmp_path, unloadable, flags, fragments):
    proc = cli(["--model_name_or_path", unloadable, *flags], tmp_path, timeout=60)
    assert_refused(proc, *fragments)


@pytest.mark.slow
def test_unknown_flag_is_a_usage_error_naming_close_matches(tmp_path):
    proc = cli(["--per_device_batch_size", "8"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--per_device_batch_size" in proc.stderr and "--per_device_train_batch_size" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("contents, fragments", [
    ("", ["no prompts in", "empty"]),
    ('{"prompt": "a"}\n{"prompt": "b",}\n', ["prompts.jsonl, line 2", "not valid JSON"]),
])
def test_bad_dataset_file(tmp_path, unloadable, contents, fragments):
    data = tmp_path / "prompts.jsonl"
    data.write_text(contents)
    assert_refused(cli(["--model_name_or_path", unloadable, "--dataset_name", str(data)], tmp_path), *fragments)


@pytest.mark.slow
def test_trl_fields_without_a_meaning_are_accepted_and_logged(tmp_path, model_dir):
    proc = cli(["--eval_strategy", "steps", "--dataset_test_split", "test", "--do_eval", "--total_episodes", "64",
                "--response_length", "4", "--num_sample_generations", "0", "--disable_tqdm", "true"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--eval_strategy is a TrainingArguments field with no meaning in PPO: ignored" in proc.stdout
    assert "--do_eval is a TrainingArguments field with no meaning in PPO: ignored" in proc.stdout
    fp16 = cli(["--fp16"], tmp_path)
    assert fp16.returncode == 2 and "fp16 mixed precision is not supported" in fp16.stderr


# ---------------------------------------------------------------------------- the library: settings, models, rewards


tiny = functools.partial(small_config, num_ppo_epochs=1, total_episodes=8)  # one iteration of one epoch


def train(config) -> PPOTrainer:
    trainer = make_trainer(config)
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(response_length=0), "response_length must be an integer >= 1"),
        (dict(kl_estimator="k9"), "unknown kl_estimator 'k9'"),
        (dict(per_device_train_batch_size=3, gradient_accumulation_steps=1, num_mini_batches=2),
         "divisible by num_mini_batches"),
        (dict(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2),
         "whole number of per_device_train_batch_size micro-batches"),
        (dict(stop_token="eos", stop_token_id=[3]), "mutually exclusive"),
        (dict(reward_fn="no_colon"), "module:function"),
        (dict(reward_fn="fastppo.rewards:nope"), "has no function 'nope'"),
        (dict(temperature=0.0), "temperature must be a finite number > 0"),
        (dict(optim="adafactor"), "optim 'adafactor' is not supported"),
    ],
)
def test_bad_settings_fail_fast(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(tiny(tmp_path, **overrides))


def test_missing_model_path_fails_fast(tmp_path):
    with pytest.raises(FileNotFoundError, match="sft_model_path"):
        train(tiny(tmp_path, sft_model_path=str(tmp_path / "no-such-model")))


def test_dataset_without_text_column_lists_its_columns(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "a", "label": 1}) + "\n")
    with pytest.raises(ValueError, match=r"no column 'prompt'.*\['text', 'label'\]"):
        train(tiny(tmp_path, dataset_name=str(data)))


def test_missing_dataset_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such.jsonl"):
        train(tiny(tmp_path, dataset_name=str(tmp_path / "no-such.jsonl")))


def test_a_causal_lm_as_reward_model_is_refused(tmp_path, model_dir):
    """transformers loads a causal LM as sequence classification with a random score head (and warns);
    fastppo refuses such a reward model unless told otherwise."""
    with pytest.raises(ValueError, match=r"reward model .* has no trained scalar head \(score.weight missing"):
        PPOTrainer(args=tiny(tmp_path, reward_model_path=model_dir))
    with pytest.raises(ValueError, match=r"value model .* has no trained scalar head"):
        PPOTrainer(args=tiny(tmp_path, value_model_path=model_dir))
    trainer = PPOTrainer(args=tiny(tmp_path, reward_model_path=model_dir, allow_untrained_heads=True))
    assert trainer.reward_model is not None


@pytest.mark.parametrize("body, error, message", [
    ("raise RuntimeError('kaboom')", RuntimeError, "'bad_rewards:fn' raised RuntimeError: kaboom"),
    # NaN is "not judged" (TRL GRPO's); a completion no reward judged has no score
    ("return [float('nan')] * len(completions)", ValueError, r"no reward judged completion\(s\) \[0, 1"),
    ("return [float('inf')] * len(completions)", ValueError, "'bad_rewards:fn' returned infinite scores"),
    ("return [1.0]", ValueError, "'bad_rewards:fn' returned \\(1,\\) scores for 8 completions"),
    ("sys.exit(0)", RewardFunctionError, r"called sys\.exit\(0\)"),  # an error, not a successful exit
    ("sys.exit(3)", RewardFunctionError, r"called sys\.exit\(3\)"),
])
def test_bad_reward_fn_is_a_clear_error_and_no_update(tmp_path, monkeypatch, body, error, message):
    module = f"bad_rewards_{abs(hash(body))}"  # a fresh module per case (sys.modules caches by name)
    (tmp_path / f"{module}.py").write_text(f"import sys\ndef fn(prompts, completions):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(error, match=message.replace("bad_rewards", module)):
        train(tiny(tmp_path, reward_fn=f"{module}:fn"))
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_learned_position_model_refused_instead_of_crashing(tmp_path, model_dir):
    """GPT-2's learned positions would raise a bare IndexError inside generation past n_positions."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                       eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id))
    path = tmp_path / "gpt2"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with pytest.raises(ValueError, match=r"exceeds the model's 16 positions: set --max_prompt_length"):
        PPOTrainer(args=tiny(tmp_path, sft_model_path=str(path), response_length=12))
    trainer = PPOTrainer(args=tiny(tmp_path, sft_model_path=str(path), response_length=12, max_prompt_length=4))
    assert max(len(p) for p in trainer.prompts) == 4
    trainer.train()  # runs within its 16 positions


def test_long_prompts_truncated_and_empty_prompts_dropped_with_a_count(tmp_path, model_dir, capsys):
    rows = [{"prompt": "the movie was very good and the plot was fun"}, {"prompt": ""}, {"prompt": "the cast"},
            {"prompt": ""}] * 4
    trainer = PPOTrainer(args=tiny(tmp_path, max_prompt_length=3), train_dataset=rows)
    out = capsys.readouterr().out
    assert "dropped 8 empty prompt(s) of 16" in out
    assert "4 of 8 prompt(s) longer than max_prompt_length=3 keep their last 3 tokens" in out
    assert max(len(p) for p in trainer.prompts) == 3
    tail = trainer.tokenizer("the movie was very good and the plot was fun")["input_ids"][-3:]
    assert trainer.prompts[0] == tail


def test_scheduler_kwargs_make_cosine_with_min_lr_work(tmp_path, model_dir):
    trainer = PPOTrainer(args=tiny(tmp_path, lr_scheduler_type="cosine_with_min_lr", total_episodes=32,
                                   lr_scheduler_kwargs=json.dumps({"min_lr": 1e-4}), logging_steps=1))
    trainer.train()
    lrs = [m["lr"] for m in trainer.state.log_history]
    assert lrs[0] == pytest.approx(3e-3) and lrs[-1] >= 1e-4 and lrs == sorted(lrs, reverse=True)


# ---------------------------------------------------------------------------- distributed


FROZEN_WORKER = """
import os, sys, time
from fastppo import PPOConfig, PPOTrainer
from fastppo.cli import EMBEDDED_PRESET
config = PPOConfig(**{**EMBEDDED_PRESET, "output_dir": sys.argv[1], "per_device_train_batch_size": 4,
                      "gradient_accumulation_steps": 1, "num_ppo_epochs": 1, "response_length": 4,
                      "total_episodes": 800, "num_sample_generations": 0, "disable_tqdm": True, "ddp_timeout": 8,
                      "save_steps": 10**6})
trainer = PPOTrainer(args=config)
if int(os.environ["RANK"]) == 1:
    time.sleep(3600)  # a frozen rank: alive, silent (SIGSTOP behaves the same for rank 0, but torchrun then waits 30 s to kill it)
from fastppo.cli import main_guard
main_guard(trainer.train, lambda: config)
"""


@pytest.mark.slow
def test_frozen_rank_times_out_with_a_message_naming_the_rank(tmp_path, model_dir):
    (tmp_path / "worker.py").write_text(FROZEN_WORKER)
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "worker.py"), str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode != 0
    assert "rank 0" in out and "ddp_timeout" in out and "8 s" in out, out[-3000:]


def test_kernel_api_refuses_ambiguous_arguments():
    from fastppo.kernels import fused_token_logprobs, token_logprobs, truncate_at_stop

    logits, index = torch.randn(3, 11), torch.randint(0, 11, (3,))
    with pytest.raises(TypeError, match="return_entropy must be a bool"):
        token_logprobs(logits, index, return_entropy="false")  # a truthy string
    with pytest.raises(ValueError, match="temperature must be in"):
        token_logprobs(logits * 50, index, temperature=1e-30)  # logits / T overflows fp32: NaN log-probs
    hidden, weight = torch.randn(3, 5), torch.randn(11, 5)
    with pytest.raises(TypeError, match="compute_dtype must be one of"):
        fused_token_logprobs(hidden, weight, index, compute_dtype=torch.int32)
    with pytest.raises(TypeError, match="takes from 2 to 3 positional arguments"):
        token_logprobs(logits, index, 1.0, torch.ones(3, dtype=torch.bool))  # TRL's row_mask is not an option here
    with pytest.raises(ValueError, match="log_sum_sq_probs need the vocabulary pass of the fused LM head"):
        token_logprobs(logits, index, outputs=("logprobs", "log_sum_sq_probs"))
    with pytest.raises(ValueError, match="outputs must name one or more of"):
        fused_token_logprobs(hidden, weight, index, outputs=("log_probs",))  # TRL's spelling: ours is logprobs
    with pytest.raises(ValueError, match="not both"):
        fused_token_logprobs(hidden, weight, index, outputs=("entropy",), return_entropy=True)
    with pytest.raises(ValueError, match="index is required for the logprobs and is_top1 outputs"):
        fused_token_logprobs(hidden, weight, None, outputs=("entropy", "is_top1"))
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        fused_token_logprobs(hidden, weight, index, softcap=0.0)
    with pytest.raises(ValueError, match="logit_scale must be a finite number > 0"):
        fused_token_logprobs(hidden, weight, index, logit_scale=-1.0)
    with pytest.raises(TypeError, match="ignore_index must be an int or None"):
        fused_token_logprobs(hidden, weight, index, ignore_index=-100.0)
    with pytest.raises(ValueError, match=r"index values must lie in \[0, 11\), got min -5"):
        fused_token_logprobs(hidden, weight, torch.tensor([0, -5, -100]))  # -100 is ignored, -5 is not
    with pytest.raises(ValueError, match="stop_ids .* do not fit in int64"):
        truncate_at_stop(torch.randint(0, 5, (2, 4)), [2**64], 0)
    with pytest.raises(ValueError, match="pad_id must be a token id"):
        truncate_at_stop(torch.randint(0, 5, (2, 4)), [1], 2**64)
