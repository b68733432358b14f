"""SFT-style data sets given as prompts: a ``messages`` column or tokenized rows that hold the assistant's answer give
the prompt before that answer, never the answer itself, in train and eval sets and files alike."""
from __future__ import annotations

import functools
import json

import datasets
import pytest
from transformers import AutoTokenizer

from fastppo import PPOTrainer
from helpers import quick_config

pytestmark = pytest.mark.usefixtures("reference_path")


config = functools.partial(quick_config, total_episodes=8)  # one iteration of 8 episodes


def length_reward(completions, **kw):
    return [float(len(c)) for c in completions]


TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")


def _chat_tokenizer(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _template_ids(tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def _turn(role, content):
    return {"role": role, "content": content}


def test_an_sft_chat_set_gives_prompts_without_the_assistants_answer(tmp_path, model_dir, capsys):
    """The example: a `messages` column of user and assistant turns. Every prompt was the whole conversation,
    the assistant's answer included; now it is the turns before the answer with the generation prompt (TRL GRPO's
    rule), the reward function sees no answer in its prompts, and the log says how many rows were cut, once."""
    tokenizer = _chat_tokenizer(model_dir)
    rows = [{"messages": [_turn("user", q), _turn("assistant", "great fun")]}
            for q in ("the movie was", "i think the plot is", "overall the cast", "the ending felt")] * 2
    seen = []

    def reward(prompts, completions, **kw):
        seen.extend(prompts)
        return [float(len(c)) for c in completions]

    trainer = PPOTrainer(args=config(tmp_path, dataset_text_field="messages"), processing_class=tokenizer,
                         model=model_dir, reward_model=reward, train_dataset=rows)
    assert trainer.prompts == [_template_ids(tokenizer, r["messages"][:1]) for r in rows]
    assert tokenizer.convert_tokens_to_ids("great") not in sum(trainer.prompts, [])
    out = capsys.readouterr().out
    assert out.count("end in an assistant turn") == 1 and "train_dataset: 8 of 8 conversation(s)" in out
    trainer.train()
    assert seen and not any("great fun" in p for p in seen)


def test_other_chat_rows_eval_sets_and_files_are_cut_the_same_way(tmp_path, model_dir, capsys):
    """Other members: a multi-turn conversation keeps its earlier answers and loses the last; a conversation
    that ends in a user turn (a prompt already) is unchanged and not counted; the eval_dataset and a dataset file
    go through the same rule; rows that are only an answer leave no prompt and are dropped with a count."""
    from fastppo.data import prompt_messages

    tokenizer = _chat_tokenizer(model_dir)
    multi = [_turn("system", "be good"), _turn("user", "the movie was"), _turn("assistant", "great"),
             _turn("user", "and the plot"), _turn("assistant", "fun")]
    open_ended = [_turn("user", "the ending felt")]
    assert prompt_messages(multi) == (multi[:4], True) and prompt_messages(open_ended) == (open_ended, False)
    rows = [{"messages": multi}, {"messages": open_ended}] * 4
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"messages": [_turn("assistant", "great")]}]))
    trainer = PPOTrainer(args=config(tmp_path, dataset_text_field="messages"), processing_class=tokenizer,
                         model=model_dir, reward_model=length_reward, train_dataset=str(path), eval_dataset=rows)
    want = [_template_ids(tokenizer, multi[:4]), _template_ids(tokenizer, open_ended)] * 4
    assert trainer.prompts == want and trainer.eval_prompts == want
    out = capsys.readouterr().out
    assert "train_dataset: 5 of 9 conversation(s)" in out and "eval_dataset: 4 of 8 conversation(s)" in out
    assert "dropped 1 empty prompt(s) of 9" in out


def test_an_sft_tokenized_set_gives_the_tokens_before_its_answer(tmp_path, model_dir, capsys):
    """Another member: token ids of prompt + answer with TRL SFT's completion_mask (or transformers'
    assistant_masks) were taken whole as the prompt; now the prompt is the tokens before the answer's first."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt, answer = tokenizer("the movie was")["input_ids"], tokenizer("great fun")["input_ids"]
    for column in ("completion_mask", "assistant_masks"):
        rows = {"input_ids": [prompt + answer] * 6 + [prompt] * 2,
                column: [[0] * len(prompt) + [1] * len(answer)] * 6 + [[0] * len(prompt)] * 2}
        trainer = PPOTrainer(args=config(tmp_path), reward_model=length_reward,
                             train_dataset=datasets.Dataset.from_dict(rows))
        assert trainer.prompts == [prompt] * 8
        assert f"train_dataset: 6 of 8 row(s) mark answer tokens in {column!r}" in capsys.readouterr().out
