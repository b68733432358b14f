"""The same scripted tool-calling episodes through TRL 1.16's GRPOTrainer and fastppo's: what each builds.

Run in TRL 1.x's own environment (``tests/test_trl1_tool_episodes.py`` starts it with TRL 1.16 first on
``PYTHONPATH``):

    PYTHONPATH=.trl1:.:tests python tests/trl1_tool_episodes.py OUT.json

Each scenario (``SCENARIOS``) is a list of turns, each the texts the model writes for the rows that are still
going (the first turn: every row; a later one: the rows whose last turn called a tool, in row order). TRL's side
is its unedited ``GRPOTrainer`` with ``model.generate`` replaced by the script, as TRL's own tool tests do; its
``_generate_and_score_completions`` runs on the batch, and its ``_generate`` (prompt ids, completion ids,
``tool_mask``, completions as messages) and ``_calculate_rewards`` (one column per reward source) are recorded.
fastppo's side is its ``GRPOTrainer`` with the sampler replaced by the same script (``tool_script.Script``); its
``rollout()`` gives the prompt ids, the episode's ids and train mask, and the reward columns. fastppo runs twice:
parsing the turns with the tokenizer's ``response_template`` (TRL's Qwen 3 one, which TRL's side needs too) and
with fastppo's own ``<tool_call>`` parser (the template unset). A reward function on every side records the
prompts and completions (messages) it is handed.

The tokenizer is ``tool_script.byte_tokenizer`` (byte-level, a ChatML template that renders tool calls in
Qwen's format), the model a tiny random Llama (the model's outputs are never used: the script writes every turn).
"""
from __future__ import annotations

import copy
import json
import math
import sys
import tempfile
from unittest.mock import patch

import datasets
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tool_script import Counter, Script, byte_tokenizer, call, multiply, slow_add

END = "<|im_end|>"


def divide(a: int, b: int) -> float:
    """Divides two integers.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


class Plain:
    """An environment without tools or reward."""

    def reset(self, **row):
        return None


# name -> (tools, environment_factory, dataset rows, num_generations, config overrides, turns)
SCENARIOS = {
    "tools": ([multiply, divide], None, [{"prompt": [{"role": "user", "content": "What is 3 times 4?"}]}], 6, {}, [
        [call("multiply", a=3, b=4) + END,
         call("multiply", a=3, c=4) + END,  # a wrong argument name
         call("divide", a=1, b=0) + END,  # a tool that raises
         '<tool_call>\n{"name": "multiply", "arguments": {"a": 3,}\n</tool_call>' + END,  # malformed JSON
         "I do not know." + END,
         call("multiply", a=2, b=2) + END],
        [call("multiply", a=2, b=5) + call("multiply", a=1, b=1) + END,  # two calls in one turn
         call("add", a=1, b=2) + END,  # an unknown tool
         "Cannot divide." + END,
         "It is 4." + END],
        ["It is 10 and 1." + END, "Sorry." + END],
    ]),
    "async": ([slow_add], None, [{"prompt": [{"role": "user", "content": "Add 1 and 2."}]}], 2, {}, [
        [call("slow_add", a=1, b=2) + END, "No." + END],
        ["Three." + END],
    ]),
    "round_limit": ([multiply], None, [{"prompt": [{"role": "user", "content": "Multiply."}]}], 2,
                    {"max_tool_calling_iterations": 1}, [
        [call("multiply", a=2, b=3) + END, "No." + END],
        [call("multiply", a=6, b=1) + END],  # asks for a second round: the limit leaves it unrun
    ]),
    "length_budget": ([multiply], None, [{"prompt": [{"role": "user", "content": "Multiply."}]}], 2,
                      {"max_completion_length": 100}, [
        [call("multiply", a=2, b=3) + END,  # 77 tokens: with its tool message it would pass 100: the round is rolled back
         "Six." + END],
    ]),
    "environment": ([], Counter, [{"prompt": [{"role": "user", "content": "Hi."}]}], 3, {}, [
        [call("increment", step=1) + END, call("increment", step=2) + call("increment", step=3) + END, "No." + END],
        [call("increment", step=1) + END, "Done." + END],  # the first row's counter keeps its state: 1 + 1
        ["Done." + END],
    ]),
    "environments_by_name": ([], {"count": Counter, "plain": Plain},
                             [{"prompt": [{"role": "user", "content": "Hi."}], "environment": "count"},
                              {"prompt": [{"role": "user", "content": "Hey."}], "environment": "plain"}], 2, {}, [
        [call("increment", step=2) + END, "No." + END, "No." + END, "Fine." + END],
        ["Done." + END],
    ]),
    # TRL 1.16's environment-routed rows: no prompt column (each prompt an empty user message reset() writes)
    "environment_routed": ([], {"count": Counter, "plain": Plain}, [{"environment": "count"}, {"environment": "plain"}],
                           2, {}, [
        [call("increment", step=2) + END, "No." + END, "No." + END, "Fine." + END],
        ["Done." + END],
    ]),
}
# the scenarios whose reward functions record what they are handed beside the environments' own rewards
RECORDED_BESIDE_ENVIRONMENTS = {"environments_by_name", "environment_routed"}


# with a rollout_func: it writes each row's first turn (its prompt rendered with the environment's tool, as a
# rollout_func renders them), the trainer's generation the turns after a tool call
ROLLOUT_FUNC_SCENARIOS = {"rollout_func_environment"}
SCENARIOS["rollout_func_environment"] = ([], Counter, [{"prompt": [{"role": "user", "content": "Hi."}]}], 2, {}, [
    [call("increment", step=4) + END, "No." + END],
    ["Done." + END],
])


def first_turns(tok, turns: list[str]):
    """A rollout_func writing ``turns`` after the prompts it is handed (after the environments' reset)."""
    def rollout_func(prompts, trainer):
        texts = [tok.apply_chat_template(p, tools=[Counter().increment], add_generation_prompt=True, tokenize=False)
                 for p in prompts]
        prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        completion_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in turns]
        # no sampler log-probs: TRL's transformers generation has none for the later turns, and with the first
        # turn's given TRL 1.16 fails in _tool_call_loop (post_tool_logprobs is None)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
    return rollout_func


def tiny_model(tok):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))


def recorder(seen: list):
    def record_completions(prompts, completions, **kwargs):
        seen.append((prompts, completions))
        return [float(len(c)) for c in completions]
    return record_completions


def settings(out_dir: str, rows: int, k: int, overrides: dict) -> dict:
    return {**dict(output_dir=out_dir, num_generations=k, per_device_train_batch_size=rows * k,
                   max_completion_length=600, bf16=False, report_to="none", shuffle_dataset=False, use_cpu=True),
            **overrides}


def clean(value):
    """JSON-able, NaN as None."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def run_trl(name: str, tok, out_dir: str) -> dict:
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    tools, factory, rows, k, overrides, turns = SCENARIOS[name]
    tok = copy.deepcopy(tok)
    tok.response_template = qwen3_template
    seen, record = [], {}
    dataset = datasets.Dataset.from_list(rows)
    args = GRPOConfig(**settings(out_dir, len(rows), k, overrides))
    reward_funcs = [recorder(seen)] if factory is None or name in RECORDED_BESIDE_ENVIRONMENTS else None
    custom = name in ROLLOUT_FUNC_SCENARIOS
    trainer = GRPOTrainer(model=tiny_model(tok), processing_class=tok, args=args, train_dataset=dataset,
                          reward_funcs=reward_funcs, tools=tools or None, environment_factory=factory,
                          rollout_func=first_turns(tok, turns[0]) if custom else None)
    calls = [None] if custom else []  # the rollout_func wrote the first turn

    def scripted_generate(input_ids, **kwargs):
        texts = turns[len(calls)]
        calls.append(input_ids.shape[0])
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, ids))
        out = torch.full((len(ids), width), tok.pad_token_id, dtype=input_ids.dtype)
        for i, row in enumerate(ids):
            out[i, :len(row)] = torch.tensor(row)
        return torch.cat([input_ids, out], dim=-1)

    generate, rewards = trainer._generate, trainer._calculate_rewards

    def recording_generate(prompts):
        result = generate(prompts)
        record["prompt_ids"], record["completion_ids"], record["mask"], record["completions"] = \
            [list(map(int, x)) for x in result[0]], [list(map(int, x)) for x in result[1]], \
            [list(map(int, x)) for x in result[2]], result[3]
        return result

    def recording_rewards(*a, **kw):
        out = rewards(*a, **kw)
        record["rewards"] = clean(out.tolist())
        return out

    trainer._generate, trainer._calculate_rewards = recording_generate, recording_rewards
    inputs = [row for row in rows for _ in range(k)]
    with patch.object(trainer.model, "generate", side_effect=scripted_generate):
        trainer._generate_and_score_completions(inputs)
    metrics = trainer._metrics["train"]
    record.update(rows_per_call=[len(rows) * k if c is None else c for c in calls], reward_completions=seen[0][1] if seen else None,
                  reward_prompts=seen[0][0] if seen else None,
                  call_frequency=metrics["tools/call_frequency"][-1] if tools or factory else None,
                  failure_frequency=metrics["tools/failure_frequency"][-1] if tools or factory else None,
                  reward_names=list(trainer.reward_func_names))
    return record


def run_fastppo(name: str, tok, out_dir: str, response_template) -> dict:
    from fastppo import GRPOConfig, GRPOTrainer

    tools, factory, rows, k, overrides, turns = SCENARIOS[name]
    tok = copy.deepcopy(tok)
    tok.response_template = response_template
    seen = []
    args = GRPOConfig(**settings(out_dir, len(rows), k, overrides), max_steps=1, disable_tqdm=True,
                      gradient_checkpointing=False)
    reward_funcs = [recorder(seen)] if factory is None or name in RECORDED_BESIDE_ENVIRONMENTS else None
    custom = name in ROLLOUT_FUNC_SCENARIOS
    trainer = GRPOTrainer(model=tiny_model(tok), processing_class=tok, args=args,
                          train_dataset=datasets.Dataset.from_list(rows), reward_funcs=reward_funcs,
                          tools=tools or None, environment_factory=factory,
                          rollout_func=first_turns(tok, turns[0]) if custom else None)
    trainer._sample = Script(tok, turns[1:] if custom else turns)
    batch = trainer.rollout()
    prompts, completions = batch.rollout.token_ids()
    mask = [batch.rollout.response_mask[i, :len(c)].int().tolist() for i, c in enumerate(completions)]
    metrics = trainer.reward_logs.take_metrics(trainer.device)
    columns = [batch.reward_columns[n].tolist() for n in trainer.reward_func_names]
    return {"prompt_ids": prompts, "completion_ids": completions, "mask": mask,
            "rewards": clean([list(r) for r in zip(*columns)]),
            "rows_per_call": [len(rows) * k] * custom + trainer._sample.rows,
            "reward_completions": seen[0][1] if seen else None,
            "reward_prompts": seen[0][0] if seen else None,
            "call_frequency": metrics.get("tools/call_frequency"),
            "failure_frequency": metrics.get("tools/failure_frequency"),
            "reward_names": list(trainer.reward_func_names)}


def main(out: str) -> None:
    import trl

    from trl.chat_template_utils import qwen3_template

    tok = byte_tokenizer()
    record = {"trl_version": trl.__version__, "scenarios": {}}
    for name in SCENARIOS:
        with tempfile.TemporaryDirectory() as tmp:
            record["scenarios"][name] = {
                "trl": run_trl(name, tok, tmp + "/trl"),
                "fastppo": run_fastppo(name, tok, tmp + "/fastppo", qwen3_template),
                "fastppo_own_parser": run_fastppo(name, tok, tmp + "/own", None)}
    with open(out, "w") as f:
        json.dump(record, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
