"""TRL's GRPO and RLOO documentation examples, run on fastppo with only the import changed.

The code of each example is written here as TRL's docs write it (``docs/source/grpo_trainer.md``,
``rloo_trainer.md`` and ``paper_index.md`` of the stored TRL snapshot, commit f2cd577), with these swaps and no
others:

* ``from trl import ...`` -> ``from fastppo import ...``;
* the Hub model id -> a tiny local model: the embedded one (``fastppo.embedded.embedded_model_path()``) for
  standard-format prompts, and for conversational prompts and tools a byte-level model whose chat template is
  ``fastppo.tools.CHATML_TOOL_TEMPLATE`` (Qwen 2.5's tool format), saved to a directory and passed by path;
* ``load_dataset(<Hub name>)`` -> a small ``datasets.Dataset.from_dict`` with the columns the example reads;
* the run's size: ``SIZES`` (a batch of 4, groups of 2, 8 new tokens, ``max_steps=1``, ``logging_steps=1``, no
  report, no checkpoint, bf16 and gradient checkpointing off on a CPU), given to the example's own config or,
  where the example passes none, to a config of the trainer's class;
* the bodies the docs leave as ``...`` or undefined (``check_math_solution``, ``test_code_solution``, the
  format reward of the environment's ``Rewards`` section, the multi-environment tools), filled with a line each;
* ``trl.rewards.accuracy_reward`` (the quickstarts') needs ``math_verify``, not installed here: a stand-in with
  its signature (conversational ``completions``, the ``solution`` column, ``log_extra``) and its ``None`` for an
  unparseable solution; ``trl.rewards.get_soft_overlong_punishment`` is TRL 1.16's own, read from TRL 1.x's directory.

Tool calls by a random tiny model never happen, so the tool and environment examples replace the sampler with
scripted turns (``tests/tool_script.py``'s ``Script``, as ``tests/test_tools.py`` does): the example's own tools
and environments run on the calls. Every test checks that the run trained (``global_step == max_steps``, a log
row with a finite ``loss``) and that its reward sources were called; the examples that need what fastppo refuses
by design (vLLM, transformers' continuous batching, a vision-language dataset) check that the refusal names the
setting.
"""
from __future__ import annotations

import asyncio
import functools
import glob
import importlib.util
import inspect
import math
import random
import re

import datasets
import pandas as pd
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastppo import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from fastppo.errors import SettingsError
from test_trl1_integration import trl1_dir
from tool_script import Script, byte_tokenizer, call

pytestmark = pytest.mark.usefixtures("reference_path")

SIZES = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=1,
             logging_steps=1, report_to="none", bf16=False, gradient_checkpointing=False, disable_tqdm=True,
             save_strategy="no")
TRAINERS = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread for these tiny models (as the suite's subprocesses run with OMP_NUM_THREADS=1): on a
    shared 2-core machine OpenMP's spinning threads made the file 4x slower. Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def standard_model(model_dir):
    """The docs' "Qwen/Qwen2.5-0.5B-Instruct" for standard-format (plain text) prompts: the embedded model
    (``fastppo.embedded.embedded_model_path()``, built by conftest's ``model_dir`` into the module's own cache)."""
    return model_dir


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The docs' chat and tool-calling models ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen3-0.6B"): a tiny Llama on a
    byte-level tokenizer whose chat template renders tools and tool calls (fastppo.tools.CHATML_TOOL_TEMPLATE),
    saved with save_pretrained and passed by path, as a Hub id is."""
    path = tmp_path_factory.mktemp("chat-model")
    tok = byte_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                                             eos_token_id=tok.eos_token_id))
    tok.save_pretrained(path)
    model.save_pretrained(path)
    return str(path)


def sized(tmp_path, config_class=GRPOConfig, **kwargs):
    """The example's config with the run's size (SIZES) and an output directory under tmp_path."""
    return config_class(**{**SIZES, "output_dir": str(tmp_path / "out"), **kwargs})


def spy(fn, calls: list):
    """``fn`` recording each call's keywords in ``calls``; its name, signature and sync/async kind unchanged (the
    trainer reads the signature through ``__wrapped__`` and logs ``rewards/<__name__>``)."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped(*args, **kwargs):
            calls.append(kwargs)
            return await fn(*args, **kwargs)
    else:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            calls.append(kwargs)
            return fn(*args, **kwargs)
    return wrapped


def trained(trainer, *reward_names, steps=1) -> dict:
    """The run's last log row with a loss, after checking it trained ``steps`` optimizer steps and logged each
    reward's mean."""
    assert trainer.state.global_step == steps
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert rows, trainer.state.log_history
    row = rows[-1]
    assert math.isfinite(row["loss"])
    for name in reward_names:
        assert f"rewards/{name}/mean" in row, sorted(row)
    return row


def run_spied(kind, model, reward_func, dataset, tmp_path, **config) -> tuple[dict, list[dict]]:
    """A doc example's one reward function on TRAINERS[kind], one step, spied: (the row ``trained`` checks, the
    keywords of each of its calls)."""
    config_class, trainer_class = TRAINERS[kind]
    calls = []
    trainer = trainer_class(model=model, reward_funcs=spy(reward_func, calls), train_dataset=dataset,
                            args=sized(tmp_path, config_class, **config))
    trainer.train()
    return trained(trainer, reward_func.__name__), calls


def accuracy_reward(completions, solution, log_extra=None, **kwargs):
    """Stand-in for TRL 1.16's ``trl.rewards.accuracy_reward`` (which needs math_verify): its signature, its
    ``None`` (skip) for a solution it cannot parse and its three ``log_extra`` columns; the boxed answer compared
    as text where TRL's compares parsed LaTeX."""
    contents = [completion[0]["content"] for completion in completions]
    rewards, gold_parsed_strs, answer_parsed_strs = [], [], []
    for content, sol in zip(contents, solution, strict=True):
        gold = sol.strip().strip("$")
        if gold:
            match = re.search(r"\\boxed\{(.*?)\}", content)
            rewards.append(float(match is not None and match.group(1).strip() == gold))
            gold_parsed_strs.append(gold)
            answer_parsed_strs.append(match.group(1) if match else "[unparseable]")
        else:
            rewards.append(None)
            gold_parsed_strs.append("[unparseable]")
            answer_parsed_strs.append("[skipped]")
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", gold_parsed_strs)
        log_extra("answer_parsed", answer_parsed_strs)
    return rewards


def deepmath(n=4):
    """trl-lib/DeepMath-103K's columns: a conversational ``prompt`` and a ``solution``."""
    questions = ["What is 2 + 2?", "Compute 3 * 4.", "What is 10 - 7?", "Evaluate 6 / 2."]
    return datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": q}] for q in questions[:n]],
        "solution": ["4", "12", "3", "3"][:n],
    })


# ---------------------------------------------------------------------------------------------------------------
# Quick starts (grpo_trainer.md "Quick start", rloo_trainer.md "Quick start")


def test_grpo_quickstart_train_grpo_py(tmp_path, chat_model):
    calls = []
    reward = spy(accuracy_reward, calls)
    # train_grpo.py
    # from datasets import load_dataset
    # from trl import GRPOTrainer
    # from trl.rewards import accuracy_reward
    dataset = deepmath()  # load_dataset("trl-lib/DeepMath-103K", split="train")

    trainer = GRPOTrainer(
        model=chat_model,  # "Qwen/Qwen2.5-0.5B-Instruct"
        reward_funcs=reward,
        train_dataset=dataset,
        args=sized(tmp_path),
    )
    trainer.train()

    trained(trainer, "accuracy_reward")
    assert calls and len(calls[0]["completions"]) == 4
    assert calls[0]["completions"][0][0]["role"] == "assistant"  # conversational completions, as TRL's
    assert set(calls[0]["solution"]) <= {"4", "12", "3"}


def test_rloo_quickstart_train_rloo_py(tmp_path, chat_model):
    calls = []
    reward = spy(accuracy_reward, calls)
    # train_rloo.py
    # from trl import RLOOTrainer
    dataset = deepmath()  # load_dataset("trl-lib/DeepMath-103K", split="train")

    trainer = RLOOTrainer(
        model=chat_model,  # "Qwen/Qwen2-0.5B-Instruct"
        reward_funcs=reward,
        train_dataset=dataset,
        args=sized(tmp_path, RLOOConfig),
    )
    trainer.train()

    row = trained(trainer, "accuracy_reward")
    assert calls and "kl" in row  # RLOO's beta (0.05) is on: the KL in the reward is logged


# ---------------------------------------------------------------------------------------------------------------
# "Using a custom reward function", Examples 1 to 6 (the same in grpo_trainer.md and rloo_trainer.md): each
# example's function passed as "Passing the reward function to the trainer" shows, on both trainers


@pytest.mark.parametrize("kind", TRAINERS)
def test_example_1_reward_longer_completions_in_tokens(tmp_path, standard_model, kind):
    def reward_func(completion_ids, **kwargs):
        """Reward function that assigns higher scores to longer completions (in terms of token count)."""
        return [float(len(ids)) for ids in completion_ids]

    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    row, calls = run_spied(kind, standard_model, reward_func, dataset, tmp_path)
    assert row["rewards/reward_func/mean"] == pytest.approx(row["completions/mean_length"])  # tokens, as TRL counts
    # the keywords the docs list ("The function must accept the following as keyword arguments")
    assert {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"} <= set(calls[0])


def test_example_1_prompts_keyword_is_the_datasets_text(tmp_path, standard_model):
    """The docs' own check of Example 1 calls it with ``prompts = ["The sky is", "The sun is"]``: the prompts as
    the dataset holds them, which TRL passes (fastppo once passed the prompt tokens decoded again: the embedded
    word-level tokenizer, which knows none of 'The', 'sky', 'sun', gave ['is', ...])."""
    def reward_func(completion_ids, **kwargs):
        """Reward function that assigns higher scores to longer completions (in terms of token count)."""
        return [float(len(ids)) for ids in completion_ids]

    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    _, calls = run_spied("grpo", standard_model, reward_func, dataset, tmp_path)
    assert sorted(calls[0]["prompts"]) == ["The sky is"] * 2 + ["The sun is"] * 2
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in calls[0]["completion_ids"])


@pytest.mark.parametrize("kind", TRAINERS)
def test_example_1_1_reward_longer_completions_in_characters(tmp_path, standard_model, kind):
    def reward_func(completions, **kwargs):
        """Reward function that assigns higher scores to longer completions (in terms of character count)."""
        return [float(len(completion)) for completion in completions]

    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    row, calls = run_spied(kind, standard_model, reward_func, dataset, tmp_path)
    completions = calls[0]["completions"]
    assert all(isinstance(c, str) for c in completions)  # standard format: strings
    assert row["rewards/reward_func/mean"] == pytest.approx(sum(map(len, completions)) / len(completions))


@pytest.mark.parametrize("kind", TRAINERS)
def test_example_2_format_reward_conversational(tmp_path, chat_model, kind):
    def format_reward_func(completions, **kwargs):
        """Reward function that checks if the completion has a specific format."""
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        completion_contents = [completion[0]["content"] for completion in completions]
        matches = [re.match(pattern, content) for content in completion_contents]
        return [1.0 if match else 0.0 for match in matches]

    dataset = datasets.Dataset.from_dict({"prompt": [
        [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}],
        [{"role": "user", "content": "What is the result of (3 + 1) * 2?"}],
    ]})
    row, calls = run_spied(kind, chat_model, format_reward_func, dataset, tmp_path)
    assert row["rewards/format_reward_func/mean"] == 0.0  # a random model writes no <think> block
    prompts, completions = calls[0]["prompts"], calls[0]["completions"]
    assert prompts[0][-1]["role"] == "user" and completions[0][0]["role"] == "assistant"


@pytest.mark.parametrize("kind", TRAINERS)
def test_example_3_reward_based_on_a_reference(tmp_path, standard_model, kind):
    def reward_func(completions, ground_truth, **kwargs):
        # Regular expression to capture content inside \boxed{}
        matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
        contents = [match.group(1) if match else "" for match in matches]
        # Reward 1 if the content is the same as the ground truth, 0 otherwise
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

    dataset = datasets.Dataset.from_dict({
        "prompt": ["Problem: Solve the equation $2x + 3 = 7$. Solution:", "Problem: Solve the equation $3x - 5 = 10$."],
        "ground_truth": ["2", "5"],
    })
    _, calls = run_spied(kind, standard_model, reward_func, dataset, tmp_path)
    # each completion gets its own row's ground truth: a group of 2 shares one
    truths = calls[0]["ground_truth"]
    assert len(truths) == 4 and truths[0] == truths[1] and truths[2] == truths[3] and set(truths) == {"2", "5"}


@pytest.mark.parametrize("kind", TRAINERS)
def test_example_4_multi_task_reward_functions_with_none(tmp_path, standard_model, kind):
    """As written, the dataset's coding rows say ``task="code"`` and ``coding_reward_func`` tests ``t ==
    "coding"``: the coding rows get None from both functions (TRL 1.16: a warning; the rows are unscorable, left
    out of the baseline and of the logged reward, their advantage 0)."""
    config_class, trainer_class = TRAINERS[kind]

    def check_math_solution(prompt, completion):  # undefined in the docs
        return False

    def test_code_solution(prompt, completion):  # undefined in the docs
        return False

    # Define a dataset that contains both math and coding problems
    dataset = datasets.Dataset.from_list(
        [
            {"prompt": "What is 2+2?", "task": "math"},
            {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
            {"prompt": "What is 3*4?", "task": "math"},
            {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
        ]
    )

    # Math-specific reward function
    def math_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):
            if t == "math":
                # Calculate math-specific reward
                correct = check_math_solution(prompt, completion)
                reward = 1.0 if correct else -1.0
                rewards.append(reward)
            else:
                # Return None for non-math tasks
                rewards.append(None)
        return rewards

    # Coding-specific reward function
    def coding_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):
            if t == "coding":
                # Calculate coding-specific reward
                works = test_code_solution(prompt, completion)
                reward = 1.0 if works else -1.0
                rewards.append(reward)
            else:
                # Return None for non-coding tasks
                rewards.append(None)
        return rewards

    math_calls, coding_calls = [], []
    # Use both task-specific reward functions
    trainer = trainer_class(
        model=standard_model,  # "Qwen/Qwen2.5-0.5B-Instruct"
        reward_funcs=[spy(math_reward_func, math_calls), spy(coding_reward_func, coding_calls)],
        train_dataset=dataset,
        args=sized(tmp_path, config_class, per_device_train_batch_size=8),  # the 4 prompts in one batch
    )

    trainer.train()

    row = trained(trainer, "math_reward_func", "coding_reward_func")
    assert math_calls and coding_calls and sorted(math_calls[0]["task"]) == ["code"] * 4 + ["math"] * 4
    assert row["rewards/math_reward_func/mean"] == -1.0  # the math rows only (None is not averaged in)
    assert row["rewards/coding_reward_func/mean"] is None  # no row is "coding": None everywhere (TRL's log: None)
    # a completion every function left unjudged is left out of the reward's statistics, as TRL 1.16 leaves it
    assert row["reward"] == pytest.approx(-1.0)


@pytest.mark.parametrize("kind", TRAINERS)
def test_example_5_async_reward_functions_beside_a_sync_one(tmp_path, standard_model, kind):
    async def async_reward_func(prompts, completions, **kwargs):
        # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
        await asyncio.sleep(0.01)
        # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
        return [1.0 if completion else 0.0 for completion in completions]

    def reward_func(completion_ids, **kwargs):  # Example 1's, the list's sync member
        """Reward function that assigns higher scores to longer completions (in terms of token count)."""
        return [float(len(ids)) for ids in completion_ids]

    config_class, trainer_class = TRAINERS[kind]
    sync_calls, async_calls = [], []
    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    # "this list may include both synchronous and asynchronous functions"
    trainer = trainer_class(model=standard_model,
                            reward_funcs=[spy(reward_func, sync_calls), spy(async_reward_func, async_calls)],
                            train_dataset=dataset, args=sized(tmp_path, config_class))
    trainer.train()

    row = trained(trainer, "reward_func", "async_reward_func")
    assert sync_calls and async_calls
    expected = sum(1.0 if c else 0.0 for c in async_calls[0]["completions"]) / 4
    assert row["rewards/async_reward_func/mean"] == pytest.approx(expected)


@pytest.mark.parametrize("kind", TRAINERS)
def test_example_6_logging_extra_columns_and_metrics(tmp_path, standard_model, kind):
    def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
        extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
        extracted = [m.group(1) if m else None for m in extracted]
        rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

        if log_extra:
            log_extra("golden_answer", list(ground_truth))
            log_extra("extracted_answer", [e or "[none]" for e in extracted])

        if log_metric:
            log_metric("accuracy", sum(rewards) / len(rewards))

        return rewards

    dataset = datasets.Dataset.from_dict({
        "prompt": ["Problem: Solve the equation $2x + 3 = 7$. Solution:", "Problem: Solve the equation $3x - 5 = 10$."],
        "ground_truth": ["2", "5"],
    })
    # log_completions: the completions table log_extra adds its columns to
    row, calls = run_spied(kind, standard_model, reward_func, dataset, tmp_path, log_completions=True)
    assert callable(calls[0]["log_extra"]) and callable(calls[0]["log_metric"])
    assert row["accuracy"] == 0.0  # log_metric's scalar, under its own name
    tables = glob.glob(str(tmp_path / "out" / "completions" / "*.parquet"))
    assert len(tables) == 1
    table = pd.read_parquet(tables[0])
    assert sorted(table["golden_answer"]) == ["2", "2", "5", "5"]
    assert list(table["extracted_answer"]) == ["[none]"] * 4


# ---------------------------------------------------------------------------------------------------------------
# "Entropy regularization" (grpo_trainer.md) and DAPO's configuration with top_entropy_quantile (paper_index.md)


def length_reward(completion_ids, **kwargs):  # Example 1's reward, the "..." of the configuration examples
    return [float(len(ids)) for ids in completion_ids]


def test_static_entropy_regularization(tmp_path, standard_model):
    training_args = GRPOConfig(entropy_coef=0.05, **SIZES, output_dir=str(tmp_path / "out"))
    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    trainer = GRPOTrainer(model=standard_model, args=training_args, reward_funcs=length_reward, train_dataset=dataset)
    trainer.train()

    row = trained(trainer, "length_reward")
    # the docs' metrics: policy_loss (before the bonus) and entropy_coef, logged when entropy_coef is nonzero
    assert row["entropy_coef"] == pytest.approx(0.05)
    assert row["loss"] == pytest.approx(row["policy_loss"] - 0.05 * row["entropy"], abs=1e-4)


def test_adaptive_entropy_regularization(tmp_path, standard_model):
    training_args = GRPOConfig(
        entropy_coef=0.01,          # initial coefficient
        use_adaptive_entropy=True,
        entropy_target=5.0,         # target mean per-token entropy (nats); tune for your model
        entropy_coef_delta=0.005,   # step size per optimizer step
        entropy_coef_min=0.0,
        entropy_coef_max=1.0,
        **SIZES, output_dir=str(tmp_path / "out"),
    )
    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    trainer = GRPOTrainer(model=standard_model, args=training_args, reward_funcs=length_reward, train_dataset=dataset)
    trainer.train()

    row = trained(trainer, "length_reward")
    assert "policy_loss" in row
    # the coefficient after one optimizer step of the rule (TRL logs it after the update): +delta when the
    # entropy is at or below the target, -delta otherwise (the tiny model's is about 5.2 nats: -delta)
    assert row["entropy_coef"] == pytest.approx(0.015 if row["entropy"] <= 5.0 else 0.005)


def trl_other_rewards():
    """TRL 1.16's trl/rewards/other_rewards.py, loaded as a module of its own (it imports only the standard
    library), so that ``trl`` (the environment's TRL 0.26) is not touched."""
    spec = importlib.util.spec_from_file_location("trl116_other_rewards",
                                                  trl1_dir() / "trl" / "rewards" / "other_rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dapo_configuration_with_top_entropy_quantile(tmp_path, standard_model):
    get_soft_overlong_punishment = trl_other_rewards().get_soft_overlong_punishment
    training_args = GRPOConfig(
        # --- vanilla DAPO parameters (80/20 rule: section 5.2) --- #
        # Overlong Filtering
        mask_truncated_completions=True,
        # Token-level Loss
        loss_type="dapo",
        # Clip-Higher
        epsilon_high=0.28,  # DAPO paper: section 4.1
        epsilon=0.2,  # DAPO paper: section 4.1
        # Other parameters used
        per_device_train_batch_size=4,  # 512 in the paper
        num_generations=2,  # 16 in the paper
        max_completion_length=8,  # 20480 in the paper
        beta=0.0,  # section 2.3, DAPO paper
        # --- Gradients on the highest entropy tokens --- #
        top_entropy_quantile=0.2,
        **{k: v for k, v in SIZES.items() if k not in ("per_device_train_batch_size", "num_generations",
                                                         "max_completion_length")},
        output_dir=str(tmp_path / "out"),
    )
    # Soft Overlong Punishment
    sop_reward = get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)  # 20480 and 4096
    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    trainer = GRPOTrainer(
        model=standard_model,
        args=training_args,
        reward_funcs=[length_reward, sop_reward],
        train_dataset=dataset,
    )
    trainer.train()

    row = trained(trainer, "length_reward", "soft_overlong_punishment_reward")
    assert -1.0 <= row["rewards/soft_overlong_punishment_reward/mean"] <= 0.0
    assert {"clip_ratio/low_mean", "clip_ratio/high_mean", "entropy"} <= set(row)


# ---------------------------------------------------------------------------------------------------------------
# "Agent Training": Tools, Environments (grpo_trainer.md)


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def test_tools_example(tmp_path, chat_model):
    calls = []
    reward_func = spy(length_reward, calls)
    dataset = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 3 times 4?"}],
                                                     [{"role": "user", "content": "What is 3 plus 4?"}]]})
    trainer = GRPOTrainer(
        model=chat_model,
        tools=[multiply, async_add],
        reward_funcs=reward_func,
        train_dataset=dataset,
        args=sized(tmp_path, max_completion_length=200, shuffle_dataset=False),
    )
    first = [call("multiply", a=3, b=4) + "<|im_end|>", call("async_add", a=3, b=4) + "<|im_end|>",
             "I do not know.<|im_end|>", call("multiply", a=2) + "<|im_end|>"]
    trainer._sample = Script(trainer.processing_class, [first, ["12.<|im_end|>", "7.<|im_end|>", "Sorry.<|im_end|>"]])
    trainer.train()

    row = trained(trainer, "length_reward")
    assert trainer._sample.rows == [4, 3]  # three called a tool, one more turn each
    completions = calls[0]["completions"]
    assert completions[0][1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert completions[1][1] == {"role": "tool", "name": "async_add", "content": "7"}  # the async tool, awaited
    assert "error" in completions[3][1]["content"]  # a bad call's error goes back to the model, as TRL's
    assert row["tools/call_frequency"] == pytest.approx(3 / 4)
    assert row["tools/failure_frequency"] == pytest.approx(1 / 3)


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def test_environment_example_self_sampling_no_dataset(tmp_path, chat_model):
    random.seed(0)
    trainer = GRPOTrainer(
        model=chat_model,  # "Qwen/Qwen3-0.6B"
        args=sized(tmp_path, max_steps=1, chat_template_kwargs={"enable_thinking": False},  # max_steps=1000
                   max_completion_length=200),
        environment_factory=IncrementEnv,
    )
    first = [call("increment", step=s) + "<|im_end|>" for s in (1, 2, 3)] + ["No.<|im_end|>"]
    trainer._sample = Script(trainer.processing_class, [first, ["Done.<|im_end|>"] * 3])
    trainer.train()

    row = trained(trainer, "IncrementEnv")  # the environment owns the reward: named after its class
    environments = trainer.environments
    assert [env.counter for env in environments] == [1, 2, 3, 0]
    expected = sum(float(env.counter == env.target) for env in environments) / 4
    assert row["rewards/IncrementEnv/mean"] == pytest.approx(expected)
    prompt = trainer.processing_class.decode(trainer._sample.contexts[0][0])
    assert f"Increment the counter by {environments[0].target}." in prompt  # reset's string is the prompt
    assert '"name": "increment"' in prompt  # the public method is a tool; reset and get_reward are not
    assert '"name": "reset"' not in prompt and '"name": "get_reward"' not in prompt


def test_environment_example_with_an_external_dataset(tmp_path, chat_model):
    """The docs' ``increment`` here says "(see the full docstring above)" and has none: a tool without a docstring
    is refused by TRL (transformers' get_json_schema) as by fastppo, so it has the full docstring of above."""
    # Each row carries the prompt and the task data (here, the counter target to reach).
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
            "target": list(range(1, 7)),
        }
    )

    class IncrementEnv:
        def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
            self.counter = 0
            self.target = target

        def get_reward(self) -> float:
            return float(self.counter == self.target)

        def increment(self, step: int) -> int:  # exposed as a tool (see the full docstring above)
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            self.counter += step
            return self.counter

    trainer = GRPOTrainer(
        model=chat_model,  # "Qwen/Qwen3-0.6B"
        train_dataset=dataset,  # the dataset owns the task; the "target" column reaches reset(target=...)
        environment_factory=IncrementEnv,
        args=sized(tmp_path, max_completion_length=200, shuffle_dataset=False),
    )
    first = [call("increment", step=1) + "<|im_end|>", "No.<|im_end|>", call("increment", step=1) + "<|im_end|>",
             "No.<|im_end|>"]
    trainer._sample = Script(trainer.processing_class, [first, ["Done.<|im_end|>"] * 2])
    trainer.train()

    row = trained(trainer, "IncrementEnv")
    environments = trainer.environments
    assert [env.target for env in environments] == [1, 1, 2, 2]  # each group's row, unshuffled
    assert [env.counter for env in environments] == [1, 0, 1, 0]
    assert row["rewards/IncrementEnv/mean"] == pytest.approx(1 / 4)  # only the first reached its target


def test_environment_rewards_beside_reward_funcs(tmp_path, chat_model):
    calls = []

    def format_reward(completions, **kwargs):  # trainer-owned: scores the completion text
        return [1.0 if completion[-1]["content"].endswith(".") else 0.0 for completion in completions]  # "..."

    random.seed(0)
    trainer = GRPOTrainer(
        model=chat_model,  # "Qwen/Qwen3-0.6B"
        args=sized(tmp_path, max_steps=1, max_completion_length=200),  # GRPOConfig(max_steps=1000)
        reward_funcs=spy(format_reward, calls),  # trainer-owned: scores the completion
        environment_factory=IncrementEnv,    # env-owned: scores its internal state via `get_reward`
    )
    first = [call("increment", step=1) + "<|im_end|>", "No.<|im_end|>", "No<|im_end|>", "No.<|im_end|>"]
    trainer._sample = Script(trainer.processing_class, [first, ["Done.<|im_end|>"]])
    trainer.train()

    row = trained(trainer, "format_reward", "IncrementEnv")
    assert row["rewards/format_reward/mean"] == pytest.approx(3 / 4)
    # "the trainer passes an `environments` kwarg (one instance per completion)"
    assert [type(env).__name__ for env in calls[0]["environments"]] == ["IncrementEnv"] * 4
    environments = trainer.environments
    expected_env = sum(float(env.counter == env.target) for env in environments) / 4
    assert row["rewards/IncrementEnv/mean"] == pytest.approx(expected_env)
    assert row["reward"] == pytest.approx(3 / 4 + expected_env)  # all sources summed


def test_multiple_environments(tmp_path, chat_model):
    class CodingEnv:
        def reset(self, **kwargs) -> str:
            n = random.randint(1, 20)
            return f"Compute the {n}th Fibonacci number."

        def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
            """Run the given Python code and return its stdout.

            Args:
                code: The Python source to execute.

            Returns:
                The captured standard output.
            """
            return "55"  # "..."

    class GameEnv:
        def reset(self, **kwargs) -> str:
            return "Reach the goal tile."

        def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
            """Apply an action to the game and return the new observation.

            Args:
                action: One of "up", "down", "left", "right".

            Returns:
                The observation after the move.
            """
            return "You moved " + action + "."  # "..."

    calls = []

    def reward_func(completions, environments, **kwargs):  # "can branch on the environment type"
        return [1.0 if isinstance(env, CodingEnv) else 0.5 for env in environments]

    # The dataset only routes: each row picks the environment for that rollout
    dataset = datasets.Dataset.from_dict({"environment": ["coding", "game"] * 2})  # * 500

    trainer = GRPOTrainer(
        model=chat_model,  # "Qwen/Qwen3-0.6B"
        args=sized(tmp_path, chat_template_kwargs={"enable_thinking": False}, max_completion_length=200,
                   shuffle_dataset=False),
        train_dataset=dataset,
        reward_funcs=spy(reward_func, calls),
        environment_factory={"coding": CodingEnv, "game": GameEnv},
    )
    first = [call("run_code", code="print(55)") + "<|im_end|>", "No.<|im_end|>",
             call("move", action="up") + "<|im_end|>", call("run_code", code="x") + "<|im_end|>"]
    trainer._sample = Script(trainer.processing_class, [first, ["Done.<|im_end|>"] * 3])
    trainer.train()

    row = trained(trainer, "reward_func")
    assert [type(env).__name__ for env in calls[0]["environments"]] == ["CodingEnv", "CodingEnv", "GameEnv", "GameEnv"]
    assert row["rewards/reward_func/mean"] == pytest.approx(0.75)
    completions = calls[0]["completions"]
    assert completions[0][1] == {"role": "tool", "name": "run_code", "content": "55"}
    assert completions[2][1] == {"role": "tool", "name": "move", "content": "You moved up."}
    # only the rollout's own environment's tools: a game rollout calling run_code fails
    assert "error" in completions[3][1]["content"]
    prompts = [trainer.processing_class.decode(c) for c in trainer._sample.contexts[0]]
    assert '"name": "run_code"' in prompts[0] and '"name": "move"' not in prompts[0]
    assert '"name": "move"' in prompts[2] and '"name": "run_code"' not in prompts[2]
    assert "Reach the goal tile." in prompts[2]


# ---------------------------------------------------------------------------------------------------------------
# What fastppo refuses by design: vLLM (both modes), transformers' continuous batching, vision-language datasets


@pytest.mark.parametrize("settings,named", [
    (dict(use_vllm=True), "use_vllm"),  # Option 1: Colocate mode (the default vllm_mode)
    (dict(use_vllm=True, vllm_mode="server"), "use_vllm"),  # Option 2: Server mode
    (dict(use_transformers_continuous_batching=True,
          transformers_continuous_batching_config={"use_cuda_graph": False, "max_memory_percent": 0.4}),
     "use_transformers_continuous_batching"),
])
def test_refused_generation_backends_are_named(tmp_path, standard_model, settings, named):
    dataset = datasets.Dataset.from_dict({"prompt": ["The sky is", "The sun is"]})
    with pytest.raises(SettingsError, match=named):
        training_args = GRPOConfig(**settings, **SIZES, output_dir=str(tmp_path / "out"))
        GRPOTrainer(model=standard_model, args=training_args, reward_funcs=length_reward, train_dataset=dataset)


def test_a_vision_language_dataset_is_refused_by_its_column(tmp_path, chat_model):
    """"Vision-Language Model (VLM) Training", "Dataset Format": a ``prompt`` and an ``image`` column (PIL images)."""
    from PIL import Image

    dataset = datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]] * 2,
        "image": [Image.new("RGB", (8, 8)), Image.new("RGB", (8, 8))],
    })
    with pytest.raises(SettingsError, match="'image' column: a vision-language dataset"):
        GRPOTrainer(model=chat_model, args=sized(tmp_path), reward_funcs=length_reward, train_dataset=dataset)
