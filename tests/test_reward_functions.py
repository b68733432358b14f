"""Reward functions called as TRL 1.16's GRPOTrainer calls them: ``async def`` functions awaited together, the
keywords TRL passes (``trainer_state``, ``log_extra``, ``log_metric``, the dataset's other columns as lists), a
conversational dataset's prompts as its message lists and completions as assistant messages, None and NaN as "not
judged"; what the functions log reaches the metrics and the sample table."""
from __future__ import annotations

import asyncio
import functools
import json
import math

import pytest
import torch

from fastppo.rewards import RewardFunctionError, call_reward_fns
from helpers import make_trainer, small_config

pytestmark = pytest.mark.usefixtures("reference_path")

small = functools.partial(small_config, total_episodes=16, num_sample_generations=0)


def test_async_reward_functions_run_together():
    """Each of two async functions waits for the other to have started: run one after another, the first would
    wait forever (here: time out and fail); run together, both finish."""
    started = {}

    async def first(prompts, completions, **kwargs):
        started["first"].set()
        await asyncio.wait_for(started["second"].wait(), 5)
        return [1.0] * len(completions)

    async def second(prompts, completions, **kwargs):
        started["second"].set()
        await asyncio.wait_for(started["first"].wait(), 5)
        return [2.0] * len(completions)

    def plain(prompts, completions, **kwargs):
        return [3.0] * len(completions)

    async def make_events():
        return {"first": asyncio.Event(), "second": asyncio.Event()}

    from fastppo import rewards

    rewards.run_concurrently([])  # the background loop exists: events are made on it
    started.update(asyncio.run_coroutine_threadsafe(make_events(), rewards._LOOP).result())
    out = call_reward_fns([("a", first), ("p", plain), ("b", second)], ["x", "y"], ["u", "v"], "cpu")
    assert [o.tolist() for o in out] == [[1.0, 1.0], [3.0, 3.0], [2.0, 2.0]]


def test_an_async_function_that_raises_or_an_async_callable_object():
    async def broken(prompts, completions, **kwargs):
        raise KeyError("gold")

    class Judge:
        async def __call__(self, prompts, completions, **kwargs):
            return [None, 0.5]

    with pytest.raises(RewardFunctionError, match="reward_fn 'broken' raised KeyError"):
        call_reward_fns([("broken", broken)], ["x", "y"], ["u", "v"], "cpu")
    (scores,) = call_reward_fns([("judge", Judge())], ["x", "y"], ["u", "v"], "cpu")
    assert math.isnan(scores[0]) and scores[1] == 0.5


def test_the_keywords_trl_passes_and_what_the_functions_log(tmp_path, model_dir):
    """trainer_state is the trainer's own state (its global_step moves between calls); log_metric's values are
    logged as the iteration's mean; log_extra's column goes to the sample table and samples.jsonl."""
    steps, seen, means = [], {}, []

    def watcher(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
        steps.append(trainer_state.global_step)
        seen.update(kwargs)
        means.append(float(sum(len(c) for c in completions)) / len(completions))
        log_metric("watcher/length", means[-1])
        log_metric("watcher/length", 0.0)
        log_extra("chars", [len(c) for c in completions])
        return [float(len(c)) for c in completions]

    trainer = make_trainer(small(tmp_path, num_sample_generations=2), reward_model=watcher)
    assert trainer.reward_logs is not None
    trainer.train()
    assert steps == [0, 1]  # called in iteration 1 (no step taken yet), then 2
    assert {"prompt_ids", "completion_ids"} <= set(seen) and "trainer_state" not in seen
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    samples = [json.loads(line) for line in open(tmp_path / "out" / "samples.jsonl")]
    assert len(rows) == 2
    for row, mean in zip(rows, means):  # the mean of the iteration's two calls
        assert row["watcher/length"] == pytest.approx(mean / 2)
    assert samples and all(row["extra"]["chars"] == len(row["response"]) for row in samples)
    assert trainer.state.log_history[0]["watcher/length"] == pytest.approx(
        rows[0]["watcher/length"])


def test_a_conversational_dataset_gives_message_lists(tmp_path, model_dir):
    """TRL's documented format reward reads ``completion[0]["content"]``; the prompts are the dataset's rows."""
    import datasets
    from transformers import AutoTokenizer

    rows = [[{"role": "user", "content": p}] for p in ("the movie was", "the plot is", "i think the cast")] * 6
    dataset = datasets.Dataset.from_dict({"prompt": rows, "answer": ["a", "b", "c"] * 6})
    seen = {}

    def format_reward(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [1.0 if c[0]["content"].strip() else 0.0 for c in completions]

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant {% endif %}")
    trainer = make_trainer(small(tmp_path), processing_class=tok, reward_model=format_reward, train_dataset=dataset)
    batch = trainer.rollout()
    assert all(p in rows for p in seen["prompts"])
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in seen["completions"])
    assert [c[0]["content"] for c in seen["completions"]] == batch.completions
    assert isinstance(seen["answer"], list)
    # fastppo's own rules read message lists too
    from fastppo.rewards import completion_length, positive_words

    assert positive_words([], seen["completions"]) == positive_words([], batch.completions)
    assert completion_length([], seen["completions"]) == completion_length([], batch.completions)
    torch.testing.assert_close(batch.scores, torch.tensor([1.0 if c.strip() else 0.0 for c in batch.completions]))


def test_a_function_that_requires_the_prompt_column_is_told_to_read_prompts(tmp_path, model_dir):
    """TRL GRPO passes the prompt as prompts=, not its dataset column: asking for ``prompt`` is refused before any
    model loads, saying so (it would fail mid-run)."""
    import datasets

    from fastppo.errors import SettingsError

    def wants_prompt(prompt, completions, **kwargs):
        return [0.0] * len(completions)

    dataset = datasets.Dataset.from_dict({"prompt": ["the movie was", "the plot is"] * 8})
    with pytest.raises(SettingsError, match="requires 'prompt', a column reward functions are not passed"):
        make_trainer(small(tmp_path), reward_model=wants_prompt, train_dataset=dataset)
