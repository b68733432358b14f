"""TRL 1.16 GRPOTrainer's ``tools=``: scripted completions (the sampler replaced, as TRL's tests replace
``generate``) on a byte-level tokenizer whose chat template renders tool calls in Qwen's format. The episode's
tokens, which of them are trained, the messages the reward functions get, TRL's tool metrics, the round limit,
the length budget, async tools, and bad input."""
from __future__ import annotations

import asyncio
import math

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastppo import GRPOConfig, GRPOTrainer
from fastppo.errors import SettingsError
from fastppo.tools import ToolCalling
from tool_script import Counter, Script, byte_tokenizer, call, multiply, slow_add

pytestmark = pytest.mark.usefixtures("reference_path")

def make_trainer(tmp_path, tools, turns, reward=None, rows=3, trainer_kw=None, **kw):
    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 3 times 4?"}]] * rows})
    args = GRPOConfig(**{**dict(output_dir=str(tmp_path / "out"), num_generations=rows, per_device_train_batch_size=rows,
                                max_completion_length=200, max_steps=1, bf16=False, gradient_checkpointing=False,
                                report_to="none", disable_tqdm=True, save_strategy="no", learning_rate=0.1,
                                logging_steps=1), **kw})
    trainer = GRPOTrainer(model=model, processing_class=tok, args=args, train_dataset=data, tools=tools,
                          reward_funcs=reward or (lambda completions, **k: [float(len(c)) for c in completions]),
                          **(trainer_kw or {}))
    trainer._sample = Script(tok, turns)
    return trainer, tok


def test_an_episode_runs_each_call_and_trains_only_the_models_tokens(tmp_path):
    """TRL's test_train_with_tools: a valid call, a call with a wrong argument, plain text; then one more turn for the
    two that called. Their suffix (the tool turn and the next assistant header) is in the sequence, never trained."""
    seen = []

    def reward(completions, **kwargs):
        seen.append(completions)
        return [float(len(c)) for c in completions]

    first = [call("multiply", a=3, b=4) + "<|im_end|>", call("multiply", c=3) + "<|im_end|>",
             "I do not know.<|im_end|>"]
    trainer, tok = make_trainer(tmp_path, [multiply], [first, ["It is 12.<|im_end|>", "Sorry.<|im_end|>"]], reward)
    batch = trainer.rollout()
    assert trainer._sample.rows == [3, 2]
    completions = seen[0]
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "assistant"]
    assert completions[0][0]["tool_calls"] == [{"type": "function",
                                                "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]
    assert completions[0][1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert completions[0][2] == {"role": "assistant", "content": "It is 12."}
    assert completions[1][1]["content"] == "{'error': \"multiply() got an unexpected keyword argument 'c'\"}"
    assert completions[2] == [{"role": "assistant", "content": "I do not know."}]
    # the tokens: first turn, the template's suffix, the second turn; trained: the model's turns only
    rollout = batch.rollout
    _, ids = rollout.token_ids()
    first_ids = tok(first[0], add_special_tokens=False)["input_ids"]
    second_ids = tok("It is 12.<|im_end|>", add_special_tokens=False)["input_ids"]
    suffix = ids[0][len(first_ids):len(ids[0]) - len(second_ids)]
    assert ids[0][:len(first_ids)] == first_ids and ids[0][len(ids[0]) - len(second_ids):] == second_ids
    assert tok.decode(suffix) == "<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>" \
                                 "<|im_start|>assistant\n"  # this template's tool turn and assistant header
    trained = rollout.response_mask[0, :len(ids[0])].tolist()
    assert trained == [True] * len(first_ids) + [False] * len(suffix) + [True] * len(second_ids)
    assert rollout.response_mask[2, :len(ids[2])].all() and not rollout.response_mask[2, len(ids[2]):].any()
    # the second turn read the whole episode so far: prompt, first turn, the tool messages' tokens
    prompt = rollout.token_ids()[0][0]
    assert trainer._sample.contexts[1][0] == prompt + first_ids + suffix
    metrics = trainer.reward_logs.take_metrics(trainer.device)
    assert metrics == {"tools/call_frequency": pytest.approx(2 / 3), "tools/failure_frequency": pytest.approx(1 / 2)}


def test_a_training_step_logs_trls_tool_metrics_and_moves_the_weights(tmp_path):
    first = [call("multiply", a=3, b=4) + "<|im_end|>", call("multiply", c=3) + "<|im_end|>", "No.<|im_end|>"]
    trainer, _ = make_trainer(tmp_path, [multiply], [first, ["It is 12.<|im_end|>", "Sorry.<|im_end|>"]])
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    row = next(r for r in trainer.state.log_history if "loss" in r)
    assert row["tools/call_frequency"] == pytest.approx(2 / 3) and row["tools/failure_frequency"] == 0.5
    # TRL's lengths count the model's tokens only (the template's tool turn is not the model's)
    assert row["completions/min_length"] == len(trainer.tokenizer("No.<|im_end|>")["input_ids"])
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())


def test_malformed_calls_are_plain_text_and_run_nothing(tmp_path):
    """TRL's test_train_with_malformed_tool_calls: no name, another tag, unquoted keys: one turn each, no call."""
    first = ['<tool_call>\n{"arguments": {"a": 1}}\n</tool_call><|im_end|>',
             '<toolcall>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}\n</toolcall><|im_end|>',
             '<tool_call>\n{name: "multiply", arguments: {a: 1, b: 2}}\n</tool_call><|im_end|>']
    seen = []
    trainer, _ = make_trainer(tmp_path, [multiply], [first], lambda completions, **k: seen.append(completions) or
                              [0.0] * len(completions))
    trainer.rollout()
    assert trainer._sample.rows == [3]
    assert all(len(c) == 1 and "tool_calls" not in c[0] for c in seen[0])
    assert seen[0][1][0]["content"].startswith("<toolcall>")
    assert trainer.reward_logs.take_metrics(trainer.device) == {"tools/call_frequency": 0.0,
                                                                 "tools/failure_frequency": 0.0}


@pytest.mark.parametrize("limit,rounds", [(None, 3), (1, 1), (0, 0)])
def test_the_round_limit(tmp_path, limit, rounds):
    """A model that calls every turn: max_tool_calling_iterations rounds (None: until it stops calling); the last
    turn's call is left unrun."""
    again = call("multiply", a=2, b=2) + "<|im_end|>"
    turns = [[again] * 2, [again] * 2, [again] * 2, ["4.<|im_end|>"] * 2]
    trainer, _ = make_trainer(tmp_path, [multiply], turns, rows=2, max_tool_calling_iterations=limit,
                              max_completion_length=1500)
    trainer.rollout()
    assert trainer._sample.rows == [2] * (rounds + 1)
    assert trainer.reward_logs.take_metrics(trainer.device)["tools/call_frequency"] == rounds


def test_the_episode_stays_within_max_completion_length(tmp_path):
    """A round whose tool messages leave no room is rolled back for that row (its episode ends at the call); a turn
    after the tool messages is cut at the room left (and counts as truncated)."""
    first = call("multiply", a=3, b=4) + "<|im_end|>"
    tok = byte_tokenizer()
    calling = ToolCalling([multiply], tok)
    n_first = len(tok(first, add_special_tokens=False)["input_ids"])
    n_suffix = len(calling.suffix_ids([{"role": "tool", "name": "multiply", "content": "12"}]))
    budget = n_first + n_suffix + 3  # three tokens left for the second turn
    trainer, _ = make_trainer(tmp_path, [multiply], [[first] * 2, ["The answer is 12.<|im_end|>"] * 2], rows=2,
                              max_completion_length=budget)
    batch = trainer.rollout()
    _, ids = batch.rollout.token_ids()
    assert trainer._sample.rows == [2, 2]
    assert len(ids[0]) == budget and tok.decode(ids[0][-3:]) == "The"
    assert not batch.rollout.has_stop[0]  # cut: no stop token at its end
    assert batch.rollout.response_mask[0].tolist() == [True] * n_first + [False] * n_suffix + [True] * 3


def test_a_round_that_does_not_fit_is_rolled_back(tmp_path):
    first = call("multiply", a=3, b=4) + "<|im_end|>"
    tok = byte_tokenizer()
    budget = len(tok(first, add_special_tokens=False)["input_ids"]) + 5  # the tool messages alone are longer
    seen = []
    trainer, _ = make_trainer(tmp_path, [multiply], [[first] * 2], rows=2, max_completion_length=budget,
                              reward=lambda completions, **k: seen.append(completions) or [0.0, 0.0])
    batch = trainer.rollout()
    assert trainer._sample.rows == [2]  # no second turn
    assert [m["role"] for m in seen[0][0]] == ["assistant"]
    _, ids = batch.rollout.token_ids()
    assert ids[0] == tok(first, add_special_tokens=False)["input_ids"] and batch.rollout.has_stop[0]


def test_async_tools_and_two_calls_in_one_turn(tmp_path):
    seen = []
    first = [call("multiply", a=3, b=4) + call("slow_add", a=1, b=2) + "<|im_end|>", call("slow_add", a=5, b=5)
             + "<|im_end|>"]
    trainer, _ = make_trainer(tmp_path, [multiply, slow_add], [first, ["Done.<|im_end|>", "Ten.<|im_end|>"]], rows=2,
                              reward=lambda completions, **k: seen.append(completions) or [0.0, 0.0],
                              max_completion_length=600)
    trainer.rollout()
    assert [(m["name"], m["content"]) for m in seen[0][0] if m["role"] == "tool"] == [("multiply", "12"),
                                                                                       ("slow_add", "3")]
    assert seen[0][1][1]["content"] == "10"
    assert trainer.reward_logs.take_metrics(trainer.device)["tools/call_frequency"] == 1.5


def no_docstring(a: int) -> int:
    return a


@pytest.mark.parametrize("tools,message", [
    ([no_docstring], "tools: no_docstring has no JSON schema transformers can build"),
    (["multiply"], "tools: 'multiply' is not a function"),
    ([multiply, multiply], "two tools are named 'multiply'"),
    (multiply, "tools must be a list of functions"),
])
def test_bad_tools_are_refused_by_name(tools, message):
    with pytest.raises(SettingsError, match=message):
        ToolCalling(tools, byte_tokenizer())


def test_a_template_without_tools_and_text_prompts_are_refused(tmp_path):
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(SettingsError, match="does not support tool calling"):
        ToolCalling([multiply], byte_tokenizer(plain))
    tok = byte_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=2, bf16=False)
    with pytest.raises(SettingsError, match="tools need conversational prompts"):
        GRPOTrainer(model=model, processing_class=tok, args=args, tools=[multiply],
                    reward_funcs=lambda completions, **k: [0.0] * len(completions),
                    train_dataset=datasets.Dataset.from_dict({"prompt": ["What is 3 times 4?"] * 2}))


def env_trainer(tmp_path, turns, factory=Counter, data="rows", reward_funcs=None, **kw):
    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    dataset = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "Hi."}]] * 3}) if data == "rows" \
        else data
    args = GRPOConfig(**{**dict(output_dir=str(tmp_path / "out"), num_generations=3, per_device_train_batch_size=3,
                                max_completion_length=300, max_steps=1, bf16=False, gradient_checkpointing=False,
                                report_to="none", disable_tqdm=True, save_strategy="no", learning_rate=0.1,
                                logging_steps=1), **kw})
    trainer = GRPOTrainer(model=model, processing_class=tok, args=args, train_dataset=dataset,
                          environment_factory=factory, reward_funcs=reward_funcs)
    trainer._sample = Script(tok, turns)
    return trainer, tok


def test_each_rollout_has_its_own_environment_its_tools_and_its_reward(tmp_path):
    """TRL's test_train_with_environment_factory and test_train_with_environment_owned_reward: no reward_funcs (the
    environment's get_reward is the reward, named after its class), no dataset (max_steps), a valid call, an unknown
    tool, no call; each rollout's tool runs on its own instance; the reset's text ends the prompt."""
    first = [call("increment", step=1) + "<|im_end|>", call("decrement", step=1) + "<|im_end|>", "No.<|im_end|>"]
    trainer, tok = env_trainer(tmp_path, [first, ["Done.<|im_end|>", "Oops.<|im_end|>"]], data=None)
    assert trainer.reward_func_names == ["Counter"]
    batch = trainer.rollout()
    counts = [e.count for e in trainer.environments]
    assert counts == [1, 0, 0] and len({id(e) for e in trainer.environments}) == 3
    assert batch.reward_columns["Counter"].tolist() == [1.0, 0.0, 0.0]
    prompt = tok.decode(batch.rollout.token_ids()[0][0])
    assert "<|im_start|>user\n Count to one.<|im_end|>" in prompt  # the (empty) user turn, the reset's text after it
    assert '"name": "increment"' in prompt  # the method is shown as a tool
    metrics = trainer.reward_logs.take_metrics(trainer.device)
    assert metrics["tools/call_frequency"] == pytest.approx(2 / 3) and metrics["tools/failure_frequency"] == 0.5
    trainer._sample = Script(tok, [first, ["Done.<|im_end|>", "Oops.<|im_end|>"]])
    trainer.train()
    row = next(r for r in trainer.state.log_history if "loss" in r)
    assert row["rewards/Counter/mean"] == pytest.approx(1 / 3)


def test_environments_by_name_and_beside_reward_funcs(tmp_path):
    """A dict of factories chosen by each row's environment field (not passed to reset), and the get_reward of one
    class beside a reward function: the others' rollouts are not judged by it."""

    class Plain:
        def reset(self, **row):
            self.row = row

    data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "Hi."}]] * 4,
                                       "environment": ["count", "plain", "count", "plain"]})
    turns = [[call("increment", step=2) + "<|im_end|>", "No.<|im_end|>", "No.<|im_end|>", "No.<|im_end|>"],
             ["Done.<|im_end|>"]]
    trainer, _ = env_trainer(tmp_path, turns, factory={"count": Counter, "plain": Plain}, data=data,
                             reward_funcs=lambda completions, **k: [1.0] * len(completions), reward_weights=[0.5],
                             num_generations=2, per_device_train_batch_size=4, shuffle_dataset=False)
    assert trainer.reward_func_names == ["<lambda>", "Counter"] and trainer.config.reward_weights == [0.5, 1.0]
    batch = trainer.rollout()
    assert [type(e).__name__ for e in trainer.environments] == ["Counter", "Counter", "Plain", "Plain"]
    column = batch.reward_columns["Counter"].tolist()
    assert column[:2] == [2.0, 0.0] and all(v != v for v in column[2:])  # NaN: not judged
    assert "environment" not in trainer.environments[2].row and "prompt" in trainer.environments[2].row
    with pytest.raises(SettingsError, match="not among the environments"):
        trainer._reset_environments([{"prompt": [{"role": "user", "content": "x"}], "environment": "other"}])


@pytest.mark.parametrize("kwargs,message", [
    (dict(factory=None, data=None), "`train_dataset` is required unless an `environment_factory`"),
    (dict(factory={"a": Counter}, data=None), "requires a `train_dataset` with an `environment` column"),
    (dict(data=None, max_steps=-1), "set max_steps"),
    (dict(factory=lambda: object()), "must define a callable `reset`"),
])
def test_bad_environments_are_refused(tmp_path, kwargs, message):
    with pytest.raises(SettingsError, match=message):
        env_trainer(tmp_path, [], reward_funcs=lambda completions, **k: [0.0] * len(completions), **kwargs)


def rollout_trainer(tmp_path, rollout_func, reward=None, **kw):
    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    data = datasets.Dataset.from_dict({"prompt": ["2+2=", "3+3="]})
    args = GRPOConfig(**{**dict(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=4,
                                max_completion_length=32, max_steps=1, bf16=False, gradient_checkpointing=False,
                                report_to="none", disable_tqdm=True, save_strategy="no", learning_rate=0.1,
                                logging_steps=1, shuffle_dataset=False), **kw})
    return GRPOTrainer(model=model, processing_class=tok, args=args, train_dataset=data, rollout_func=rollout_func,
                       reward_funcs=reward or (lambda completions, **k: [float(len(c)) for c in completions])), tok


def test_a_rollout_func_writes_the_rollout(tmp_path):
    """TRL's rollout_func contract: called with the process's prompts (a group's copies side by side) and the
    trainer; its ids are the rollout, its env_mask's 0s are not trained, its extra fields reach the reward functions,
    and how far its log-probs are from π_θ_old is logged (TRL's sampling/ metrics)."""
    seen, given = [], []

    def rollout(prompts, trainer):
        given.append(list(prompts))
        tok = trainer.processing_class
        completion = tok(" 4 [env] ok<|im_end|>", add_special_tokens=False)["input_ids"]
        env = [1, 1] + [0] * 6 + [1] * (len(completion) - 8)
        return {"prompt_ids": [tok(p, add_special_tokens=False)["input_ids"] for p in prompts],
                "completion_ids": [completion] * len(prompts), "logprobs": [[-1.0] * len(completion)] * len(prompts),
                "env_mask": [env] * len(prompts), "answer": ["4", "4", "6", "6"], "source": "scripted"}

    def reward(completions, answer, source, **kwargs):
        seen.append((answer, source))
        return [1.0] * len(completions)

    trainer, tok = rollout_trainer(tmp_path, rollout, reward)
    batch = trainer.rollout()
    assert given == [["2+2=", "2+2=", "3+3=", "3+3="]]
    assert seen == [(["4", "4", "6", "6"], ["scripted"] * 4)]
    mask = batch.rollout.response_mask[0].tolist()
    assert mask[:2] == [True, True] and not any(mask[2:8]) and all(mask[8:batch.rollout.lengths[0]])
    assert batch.rollout.has_stop.all()
    trainer.train()
    row = next(r for r in trainer.state.log_history if "loss" in r)
    assert row["sampling/sampling_logp_difference/mean"] > 0 and math.isfinite(row["loss"])


@pytest.mark.parametrize("out,message", [
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 4}, "rollout_func must return keys \\['logprobs'\\]"),
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 3, "logprobs": None}, "'completion_ids' must hold one list "
                                                                             "per prompt \\(4\\)"),
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[99999]] * 4, "logprobs": None}, "outside the tokenizer's"),
    ([1, 2], "rollout_func must return a dict"),
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2, 3]] * 4, "logprobs": [[-1.0]] * 4}, "logprobs\\[0\\] holds 1 "
                                                                                         "values for 2"),
])
def test_a_bad_rollout_func_output_is_refused_by_name(tmp_path, out, message):
    trainer, _ = rollout_trainer(tmp_path, lambda prompts, trainer: out)
    with pytest.raises(SettingsError, match=message):
        trainer.rollout()


def test_a_rollout_func_writes_the_first_turn_and_tools_carry_it_on(tmp_path):
    """TRL's composition: the rollout_func's completion is the episode's first turn, the trainer's sampler writes
    the turns after its tool calls. The first turn is trained whole (an env_mask is then a column only, as in TRL),
    and the sampler's log-probs are known for the first turn only: NaN after it, left out of TRL's sampling/ metrics
    (TRL 1.16 itself fails here on its transformers generation, which returns none for the later turns)."""
    seen = []

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        texts = [tok.apply_chat_template(p, tools=[multiply], add_generation_prompt=True, tokenize=False)
                 for p in prompts]
        first = [tok(call("multiply", a=3, b=4) + "<|im_end|>", add_special_tokens=False)["input_ids"],
                 tok("No.<|im_end|>", add_special_tokens=False)["input_ids"]]
        return {"prompt_ids": [tok(t, add_special_tokens=False)["input_ids"] for t in texts], "completion_ids": first,
                "logprobs": [[-1.0] * len(ids) for ids in first], "env_mask": [[0] * len(ids) for ids in first]}

    def reward(completions, env_mask, **kwargs):
        seen.append((completions, env_mask))
        return [1.0, 0.0]

    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=200, max_steps=1, bf16=False, gradient_checkpointing=False,
                      report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=1)
    trainer = GRPOTrainer(model=model, processing_class=tok, args=args, tools=[multiply], rollout_func=rollout,
                          reward_funcs=reward, train_dataset=datasets.Dataset.from_dict(
                              {"prompt": [[{"role": "user", "content": "What is 3 times 4?"}]] * 2}))
    trainer._sample = Script(tok, [["It is 12.<|im_end|>"]] * 2)  # this rollout, then train()'s
    batch = trainer.rollout()
    assert trainer._sample.rows == [1]  # the sampler writes only the turn after the call
    completions, env_mask = seen[0]
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "assistant"]
    assert completions[0][1]["content"] == "12" and completions[1] == [{"role": "assistant", "content": "No."}]
    assert env_mask[0][0] == 0  # handed on as a column
    first = len(tok(call("multiply", a=3, b=4) + "<|im_end|>", add_special_tokens=False)["input_ids"])
    second = len(tok("It is 12.<|im_end|>", add_special_tokens=False)["input_ids"])
    length = int(batch.rollout.lengths[0])
    trained = batch.rollout.response_mask[0, :length].tolist()
    assert trained[:first] == [True] * first and trained[length - second:] == [True] * second
    assert not any(trained[first:length - second])  # the tool message's template tokens
    sampled = batch.sampling_logprobs
    assert sampled.shape == batch.rollout.responses.shape
    assert (sampled[0, :first] == -1.0).all() and sampled[0, first:].isnan().all()
    trainer.train()
    row = next(r for r in trainer.state.log_history if "loss" in r)
    assert math.isfinite(row["sampling/sampling_logp_difference/mean"]) and math.isfinite(row["loss"])


def test_tools_from_the_config_and_the_command_line(tmp_path, monkeypatch):
    """PPOConfig's tools ('module:function', the CLI's repeatable --tools) load the functions, as TRL GRPO's tools=;
    a spec that does not import is refused by name."""
    from fastppo import PPOConfig, PPOTrainer
    from helpers import cli_config

    assert cli_config(["--tools", "math:gcd", "--tools", "test_tools:multiply"]).tools == ["math:gcd",
                                                                                        "test_tools:multiply"]
    tok = byte_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096))
    data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "Hi."}]] * 2})

    def config(tools):
        return PPOConfig(output_dir=str(tmp_path / "out"), advantage_estimator="grpo", num_generations=2,
                         per_device_train_batch_size=2, response_length=8, stop_token="eos", tools=tools, bf16=False)

    trainer = PPOTrainer(args=config(["test_tools:multiply"]), processing_class=tok, model=model, train_dataset=data,
                         reward_model=lambda completions, **k: [0.0] * len(completions))
    assert trainer.tool_calling.tools == [multiply]
    assert '"name": "multiply"' in tok.decode(trainer.prompts[0])
    with pytest.raises(SettingsError, match="tools given twice"):
        PPOTrainer(args=config(["test_tools:multiply"]), processing_class=tok, model=model, train_dataset=data,
                   reward_model=lambda completions, **k: [0.0] * len(completions), tools=[multiply])
    with pytest.raises(SettingsError, match="tools 'no_such_module:f': cannot import module"):
        PPOTrainer(args=config(["no_such_module:f"]), processing_class=tok, model=model, train_dataset=data,
                   reward_model=lambda completions, **k: [0.0] * len(completions))


def test_an_async_get_reward_is_awaited(tmp_path):
    class AsyncCounter(Counter):
        async def get_reward(self) -> float:
            await asyncio.sleep(0.001)
            return float(self.count) + 0.5

    first = [call("increment", step=3) + "<|im_end|>", "No.<|im_end|>", "No.<|im_end|>"]
    trainer, _ = env_trainer(tmp_path, [first, ["Done.<|im_end|>"]], factory=AsyncCounter, data=None)
    batch = trainer.rollout()
    assert trainer.reward_func_names == ["AsyncCounter"]
    assert batch.reward_columns["AsyncCounter"].tolist() == [3.5, 0.5, 0.5]


def test_a_tool_that_hangs_returns_an_error_after_the_timeout(tmp_path):
    import time

    def stuck(seconds: float) -> str:
        """Sleeps.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "awake"

    async def stuck_async(seconds: float) -> str:
        """Sleeps, asynchronously.

        Args:
            seconds: How long.
        """
        await asyncio.sleep(seconds)
        return "awake"

    seen = []
    first = [call("stuck", seconds=5) + "<|im_end|>", call("stuck_async", seconds=5) + "<|im_end|>"]
    trainer, _ = make_trainer(tmp_path, [stuck, stuck_async], [first, ["Oh.<|im_end|>"] * 2], rows=2,
                              max_completion_length=600, tool_timeout=0.2,
                              reward=lambda completions, **k: seen.append(completions) or [0.0, 0.0])
    started = time.perf_counter()
    trainer.rollout()
    assert time.perf_counter() - started < 3
    assert seen[0][0][1]["content"] == "{'error': 'Tool stuck did not return within 0.2 s'}"
    assert seen[0][1][1]["content"] == "{'error': 'Tool stuck_async did not return within 0.2 s'}"
    assert trainer.reward_logs.take_metrics(trainer.device)["tools/failure_frequency"] == 1.0
    with pytest.raises(SettingsError, match="tool_timeout must be a number of seconds > 0"):
        ToolCalling([multiply], byte_tokenizer(), timeout=0)


def test_a_call_in_a_turn_that_ran_out_of_room_is_not_run(tmp_path):
    """A turn cut by the length budget (no stop token at its end) holds a whole call: it is not run (the tool turn
    of the template follows an ended turn)."""
    cut = call("multiply", a=3, b=4) + " and more text that runs out"
    tok = byte_tokenizer()
    budget = len(tok(cut, add_special_tokens=False)["input_ids"]) - 3
    trainer, _ = make_trainer(tmp_path, [multiply], [[cut] * 2], rows=2, max_completion_length=budget)
    batch = trainer.rollout()
    assert trainer._sample.rows == [2] and not batch.rollout.has_stop.any()
    assert trainer.reward_logs.take_metrics(trainer.device)["tools/call_frequency"] == 0.0


def test_environments_need_conversational_prompts(tmp_path):
    class Plain:
        def reset(self, **row):
            return " more"

    data = datasets.Dataset.from_dict({"prompt": ["a text prompt", "another"]})
    trainer, _ = env_trainer(tmp_path, [], factory=Plain, data=data, num_generations=2, per_device_train_batch_size=2,
                             reward_funcs=lambda completions, **k: [0.0] * len(completions))
    with pytest.raises(SettingsError, match="environment_factory needs conversational prompts"):
        trainer.rollout()


@pytest.mark.slow
def test_tool_episodes_on_two_processes(tmp_path):
    """torchrun, 2 CPU processes (DDP): one process's completions call a tool and sample twice, the other's once;
    neither waits on the other, and both log every process's calls over every process's completions."""
    import json
    import os
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_worker.py")
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           worker, "tools", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"tools{r}.json")) for r in range(2)]
    assert ranks[0]["rows"] == [2, 2] and ranks[1]["rows"] == [2]
    for rank in ranks:  # 2 calls among the 4 completions of both processes, none failed
        assert rank["call_frequency"] == pytest.approx(0.5) and rank["failure_frequency"] == 0.0
    assert ranks[0]["loss"] == ranks[1]["loss"]  # the step's loss, over every process


@pytest.mark.slow
def test_tool_episodes_under_zero3_without_gathered_weights(tmp_path):
    """ZeRO-3 on 2 CPU processes with ds3_gather_for_generation=False (every forward a collective): rank 0's
    completions call a tool, rank 1's do not; rank 1 joins rank 0's round with a throwaway row (the real sampler
    runs under the script on both), and both finish the step with the same loss and tool metrics. Without the
    synced rounds rank 0's second sampling waits on a collective rank 1 never joins (Gloo times out)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_worker.py")
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           worker, "tools_zero3", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"tools{r}.json")) for r in range(2)]
    assert [r["zero_stage"] for r in ranks] == [3, 3]
    assert ranks[0]["rows"] == [2, 2] and ranks[1]["rows"] == [2, 1]  # rank 1's second call: one throwaway row
    assert all(r["synced"] == [True, True] for r in ranks)
    for rank in ranks:
        assert rank["call_frequency"] == pytest.approx(0.5) and rank["failure_frequency"] == 0.0
    assert ranks[0]["loss"] == ranks[1]["loss"]


def test_episodes_are_trained_exactly_on_the_models_tokens(tmp_path):
    """Episodes of three, two and one turns in one batch: π_θ_old's log-probs of the model's tokens equal a plain
    forward of each whole episode (what the update's first ratio compares against), the KL is 0 on the tool
    messages' tokens and not on the model's, and the packed (padding-free) and padded layouts give the same."""
    from fastppo.train import Scoring, compute_experience

    turns = [[call("multiply", a=3, b=4) + "<|im_end|>", call("multiply", a=12, b=2) + "<|im_end|>",
              "Twenty-four.<|im_end|>"],
             [call("multiply", a=12, b=2) + "<|im_end|>", "It is 24.<|im_end|>"], ["24.<|im_end|>"]]
    trainer, tok = make_trainer(tmp_path, [multiply], turns, beta=0.04, temperature=0.7, max_completion_length=400)
    batch = trainer.rollout()
    assert trainer._sample.rows == [3, 2, 1]
    rollout = batch.rollout
    with torch.no_grad():  # a reference that differs from the policy: a KL to see
        for p in trainer.reference.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    experience = {packed: compute_experience(trainer.actor_critic, trainer.reference, rollout,
                                             Scoring(0.7, "k3", 2, packed=packed))
                  for packed in (False, True)}
    for a, b in zip(experience[False].__dict__.values(), experience[True].__dict__.values()):
        if a is not None:
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    prompts, completions = rollout.token_ids()
    trained, kl = rollout.response_mask, experience[True].kl
    model = trainer.actor_critic.policy
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float() / 0.7
        plain = logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        n = len(completion)
        mine = trained[i, :n]
        torch.testing.assert_close(experience[True].logprobs[i, :n][mine], plain[mine], atol=1e-5, rtol=1e-5)
        assert (kl[i, :n][~mine] == 0).all() and (kl[i, :n][mine] != 0).any()
    untrained = [int((~trained[i, :len(c)]).sum()) for i, c in enumerate(completions)]
    assert untrained[0] > untrained[1] > untrained[2] == 0  # two tool messages, one, none


STEP_TURNS = [[call("multiply", a=3, b=4) + "<|im_end|>", "No.<|im_end|>", call("multiply", a=1, b=2) + "<|im_end|>"],
              ["Twelve.<|im_end|>", "Two.<|im_end|>"]]  # one step's turns: two rows call, one does not


@pytest.mark.parametrize("setting", [
    dict(loss_type="grpo"), dict(loss_type="dr_grpo"), dict(loss_type="cispo", epsilon_high=5.0),
    dict(loss_type="sapo"), dict(loss_type="vespo"), dict(importance_sampling_level="sequence"),
    dict(beta=0.04, num_iterations=2), dict(scale_rewards="batch", mask_truncated_completions=True),
])
def test_tool_episodes_train_under_each_loss_setting(tmp_path, setting):
    """Every policy-loss setting reads the same train mask: two steps over tool episodes run, the loss is finite
    and the weights move."""
    trainer, _ = make_trainer(tmp_path, [multiply], STEP_TURNS * 2, max_steps=2, **setting)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    assert trainer.state.global_step == 2 and losses and all(math.isfinite(x) for x in losses)
    assert any(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus", "gae"])
def test_tool_episodes_train_under_each_estimator(tmp_path, estimator):
    """PPOConfig's estimators over tool episodes (gae with its value model: the tool messages are holes in the
    response, verl's multi-turn GAE), one iteration."""
    from transformers import LlamaForSequenceClassification

    from fastppo import PPOConfig, PPOTrainer

    tok = byte_tokenizer()
    torch.manual_seed(0)
    shape = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, num_labels=1)
    model = LlamaForCausalLM(shape)
    value = {"value_model": LlamaForSequenceClassification(shape)} if estimator == "gae" else {}
    k = 1 if estimator == "gae" else 3
    config = PPOConfig(output_dir=str(tmp_path / "out"), advantage_estimator=estimator, num_generations=k,
                       per_device_train_batch_size=3, response_length=200, stop_token="eos", bf16=False,
                       total_episodes=3, num_sample_generations=0, save_strategy="no", report_to=[],
                       disable_tqdm=True, gradient_checkpointing=False)
    trainer = PPOTrainer(args=config, processing_class=tok, model=model, tools=[multiply],
                         train_dataset=datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "3x4?"}]] * 3}),
                         reward_model=lambda completions, **kw: [float(len(c)) for c in completions], **value)
    trainer._sample = Script(tok, STEP_TURNS)
    trainer.train()
    assert trainer._sample.rows == [3, 2]
    assert (trainer.value_model is not None) == (estimator == "gae")
    row = next(r for r in trainer.state.log_history if "loss" in r or "loss/policy_avg" in r)
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))


def test_tool_episodes_with_lora_train_only_the_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, _ = make_trainer(tmp_path, [multiply], STEP_TURNS, trainer_kw={"peft_config": config})
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {n for n, p in before.items() if not torch.equal(p, trainer.model.get_parameter(n))}
    assert moved and all("lora_" in n for n in moved)


def test_a_resumed_tool_run_equals_the_whole_run(tmp_path):
    """Two steps of tool episodes, against one step, a checkpoint, and a resumed second step: bitwise equal."""
    from helpers import digest

    whole, _ = make_trainer(tmp_path / "whole", [multiply], STEP_TURNS * 2, max_steps=2, learning_rate=1e-2)
    whole.train()
    cut, _ = make_trainer(tmp_path / "cut", [multiply], STEP_TURNS, max_steps=2, learning_rate=1e-2,
                          save_strategy="steps", save_steps=1)
    cut._sample.turns = STEP_TURNS  # one step's turns only: the run stops when the script runs out
    with pytest.raises(IndexError):
        cut.train()
    resumed, _ = make_trainer(tmp_path / "cut", [multiply], STEP_TURNS, max_steps=2, learning_rate=1e-2,
                              resume_from_checkpoint="latest")
    resumed.train()
    assert resumed.state.global_step == 2 and resumed._sample.rows == [3, 2]
    assert digest(resumed.policy.state_dict()) == digest(whole.policy.state_dict())


def test_dynamic_sampling_over_tool_episodes_trains_the_kept_rounds_episodes(tmp_path, monkeypatch):
    """Dynamic sampling with tools: a round whose episodes all score alike (one message each) is dropped; the next
    round's episodes (one called the tool, wrongly, and answered) are the batch the update gets, the tool message's
    tokens in it untrained and the other rows' tokens all trained. TRL's tool metrics count every completion
    sampled: one call in six completions, and that call failed (a mean of the rounds' rates would say 0.5)."""
    import fastppo.train as T

    flat = ["No.<|im_end|>"] * 3
    spread = [call("multiply", c=3) + "<|im_end|>", "No.<|im_end|>", "I do not know.<|im_end|>"]
    reward = lambda completions, **k: [float(len(c)) for c in completions]  # noqa: E731  (messages per episode)
    trainer, tok = make_trainer(tmp_path, [multiply], [flat, spread, ["It is 12.<|im_end|>"]], reward,
                                dynamic_sampling=True)
    updated, update = [], T.ppo_update

    def spy(trained, batch, *args, **kwargs):
        updated.append(batch.rollout)
        return update(trained, batch, *args, **kwargs)

    monkeypatch.setattr(T, "ppo_update", spy)
    trainer.train()
    assert trainer._sample.rows == [3, 3, 1]  # round 1's turn; round 2's two turns
    row = next(r for r in trainer.state.log_history if "loss" in r)
    assert row["dynamic_sampling/generation_rounds"] == 2 and row["dynamic_sampling/frac_groups_dropped"] == 0.5
    assert row["tools/call_frequency"] == pytest.approx(1 / 6) and row["tools/failure_frequency"] == 1.0
    (rollout,) = updated
    _, completions = rollout.token_ids()
    texts = [tok.decode(c) for c in completions]
    assert texts[0].startswith(spread[0]) and texts[0].endswith("It is 12.<|im_end|>")
    assert texts[1:] == spread[1:]
    trained = rollout.response_mask
    assert not trained[0, :len(completions[0])].all() and trained[0, :len(completions[0])].any()
    assert all(trained[i, :len(completions[i])].all() for i in (1, 2))
