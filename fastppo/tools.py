"""Tool calls in a rollout (TRL 1.16 GRPOTrainer's ``tools=``): the model's turn is parsed for tool calls, each call
is run, its result appended as a tool message, and the model goes on, up to ``max_tool_calling_iterations`` rounds.

As TRL does it (``grpo_trainer.py``'s ``_tool_call_loop``):

* the tools reach the model through the chat template (``apply_chat_template(tools=...)``: transformers builds each
  one's JSON schema from its type hints and docstring); the template must render a whole tool-calling exchange;
* a turn is parsed with the tokenizer's ``parse_response`` where it has a ``response_template`` (or the older
  ``response_schema``), else with fastppo's parser of the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  format (Qwen's and Hermes'); a turn that does not parse is plain text (no call is run or counted);
* a call of an unknown tool, one whose arguments the function refuses, and one that raises return
  ``{'error': '...'}`` to the model as its result (TRL's strings) and count as failures; every call's result is
  ``str(result)`` in a ``{"role": "tool", "name": ..., "content": ...}`` message; async tools run together;
* the next turn's input is the episode's token ids so far plus the template's tokens for the tool messages (the
  difference of a rendered conversation with and without them: the tool turn and the next assistant header), never
  a re-tokenized conversation, so the tokens trained are the tokens sampled;
* those template tokens are in the sequence and in attention but never in the loss, the advantage or the KL (the
  rollout's train mask), and the episode as a whole stays within ``max_completion_length``: a round that would
  overflow it is rolled back for that row, and a last turn is cut at what is left.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from fastppo.data import chat_token_ids
from fastppo.errors import SettingsError
from fastppo.rewards import run_concurrently

# fastppo's parser of Qwen's and Hermes' tool calls, for a tokenizer without a response template of its own
TOOL_CALL = re.compile(r"<tool_call>\s*(.+?)\s*</tool_call>", re.S)

# A short ChatML template that renders tools in Qwen 2.5's format (the tools' schemas in a system turn, each call a
# <tool_call> JSON block, each result a user turn holding a <tool_response>), which fastppo's parser reads: for a model
# whose own template renders no tools (SmolLM2's), set as ``tokenizer.chat_template``
CHATML_TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def check_tools(tools) -> list[Callable]:
    """The ``tools`` list, each a function (sync or ``async``) whose JSON schema transformers can build (type hints
    and a docstring describing every argument): refused by name otherwise."""
    from transformers.utils import get_json_schema

    if not isinstance(tools, (list, tuple)):
        raise SettingsError(f"tools must be a list of functions, got {type(tools).__name__}")
    names = set()
    for tool in tools:
        if not callable(tool) or not hasattr(tool, "__name__"):
            raise SettingsError(f"tools: {tool!r} is not a function (a tool is a function with type hints and a "
                                "docstring)")
        try:
            get_json_schema(tool)
        except Exception as e:  # transformers' own reason: a missing docstring, type hint or argument description
            raise SettingsError(f"tools: {tool.__name__} has no JSON schema transformers can build: {e}") from None
        if tool.__name__ in names:
            raise SettingsError(f"tools: two tools are named {tool.__name__!r}; the model calls a tool by its name")
        names.add(tool.__name__)
    return list(tools)


@dataclass
class ToolRound:
    """One round's tool messages per row (None: the row made no call), and the calls and failures counted."""

    messages: list[list[dict] | None]
    calls: int
    failures: int


class ToolCalling:
    """The tools of a run and what the tokenizer's chat template makes of them: parsing a turn, running its calls,
    and the token ids of the tool messages."""

    def __init__(self, tools: list[Callable], tokenizer, chat_template_kwargs: dict | None = None,
                 timeout: float | None = None):
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise SettingsError(f"tool_timeout must be a number of seconds > 0, or unset, got {timeout!r}")
        self.timeout = timeout  # a call still running then is a failure the model reads (fastppo's; TRL has none)
        self.tools = check_tools(tools)
        self.tokenizer = tokenizer
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.by_name = {tool.__name__: tool for tool in self.tools}
        if getattr(tokenizer, "chat_template", None) is None:
            raise SettingsError("tools need the tokenizer's chat template (it shows the tools to the model); this "
                                "tokenizer has none (fastppo.tools.CHATML_TOOL_TEMPLATE is one for a ChatML model)")
        if not self._renders_tool_calls():
            raise SettingsError("The provided chat template does not support tool calling. The template must be able "
                                "to render a full tool-calling conversation (user -> assistant with tool_calls -> "
                                "tool). fastppo.tools.CHATML_TOOL_TEMPLATE is one that does (Qwen 2.5's tool format, "
                                "which fastppo parses): set tokenizer.chat_template to it for a ChatML model.")
        self.parses_itself = (getattr(tokenizer, "response_template", None) is not None
                              or getattr(tokenizer, "response_schema", None) is not None)
        if not self.parses_itself and "<tool_call>" not in self._render(SAMPLE_EXCHANGE[:2]):
            raise SettingsError("the chat template writes tool calls in a format fastppo does not parse, and the "
                                "tokenizer has no response_template: set tokenizer.response_template (transformers' "
                                "format) for it")

    # ------------------------------------------------------------------ the chat template

    def _render(self, messages, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **{**self.template_kwargs, **kwargs})

    def _renders_tool_calls(self) -> bool:
        """TRL's test: a user → assistant with a tool call → tool exchange renders with the call's name, argument
        and the tool's output in it."""
        try:
            text = self._render(SAMPLE_EXCHANGE)
        except Exception:
            return False
        return all(marker in text for marker in ("sentinel_tool", "sentinel_key", "sentinel_value", "sentinel_out"))

    def prompt_ids(self, messages: list[dict], tools: list[Callable] | None = None) -> list[int]:
        """A conversational prompt with the tools (default: the run's) shown to the model, and the generation
        prompt (no tools: none shown, as TRL renders ``tools or None``)."""
        return self._ids(messages, tools=(self.tools if tools is None else tools) or None, add_generation_prompt=True)

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The template's tokens after a tool-calling turn's end-of-sequence token: the tool messages and the next
        assistant turn's header (the difference of a conversation rendered without and with them)."""
        calling = [{"role": "user", "content": "dummy"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]}]
        before = self._ids(calling, add_generation_prompt=False)
        after = self._ids(calling + tool_messages, add_generation_prompt=True)
        eos = self.tokenizer.eos_token_id
        ends = [i for i, t in enumerate(before) if t == eos]
        if ends:  # the template's own text after the turn's eos ("\n") comes back in the suffix
            before = before[:ends[-1] + 1]
        if after[:len(before)] != before:
            raise SettingsError("the chat template renders a tool-calling turn differently once tool messages follow "
                                "it; fastppo cannot append tool results to the sampled tokens")
        return after[len(before):]

    def _ids(self, messages, **kwargs) -> list[int]:
        return chat_token_ids(self.tokenizer, messages, **{**self.template_kwargs, **kwargs})

    # ------------------------------------------------------------------ a turn

    def parse(self, ids: list[int], prefix: list[int], tools: list[Callable] | None = None) -> dict:
        """The assistant message of a turn's token ids (``prefix``: what came before it; ``tools``: the row's, default
        the run's): its content and tool calls (each ``{"type": "function", "function": {"name", "arguments"}}``); a
        turn that does not parse is plain text."""
        try:
            if self.parses_itself:
                parsed = self.tokenizer.parse_response(ids, prefix=prefix,
                                                       tools=self.tools if tools is None else tools)
                if parsed is None:
                    raise ValueError("nothing parsed")
                parsed = dict(parsed)
            else:
                parsed = self._parse_tool_call_tags(ids)
            content = parsed.get("content")
            if isinstance(content, str) and self.tokenizer.eos_token:
                parsed["content"] = content.removesuffix(self.tokenizer.eos_token)
            parsed["content"] = parsed.get("content") or ""
            if "tool_calls" in parsed:
                parsed["tool_calls"] = [_checked_call(call) for call in parsed["tool_calls"]]
            return parsed
        except (ValueError, TypeError, KeyError):
            return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}

    def _parse_tool_call_tags(self, ids: list[int]) -> dict:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if self.tokenizer.eos_token:
            text = text.split(self.tokenizer.eos_token)[0]
        calls = [json.loads(body) for body in TOOL_CALL.findall(text)]  # a malformed one: the turn is plain text
        message = {"role": "assistant", "content": TOOL_CALL.sub("", text).strip()}
        if calls:
            message["tool_calls"] = [{"type": "function", "function": call} for call in calls]
        return message

    def run(self, calls: list[list[dict] | None], tools: list[list[Callable]] | None = None) -> ToolRound:
        """Each row's calls run (the plain tools one after another, the ``async`` ones of every row together), and
        their tool messages in the calls' order. ``tools``: each row's (an environment's methods bound to the row's
        instance), default the run's."""
        results: list[list | None] = [None if row is None else [None] * len(row) for row in calls]
        waiting, failures, count = [], 0, 0
        for r, row in enumerate(calls):
            for c, call in enumerate(row or []):
                count += 1
                name = call.get("function", {}).get("name", call.get("name", "unknown"))
                if call.get("type") != "function":
                    results[r][c] = (name, {"error": f"Unsupported tool call type: {call.get('type')}"})
                    failures += 1
                    continue
                tool = (self.by_name if tools is None else {t.__name__: t for t in tools[r]}).get(name)
                try:
                    if tool is None:
                        raise ValueError(f"Tool {name} not found.")
                    out = _call(tool, call["function"]["arguments"], self.timeout)
                except Exception as e:  # the model reads what went wrong, as TRL reports it
                    results[r][c] = (name, {"error": str(e)})
                    failures += 1
                    continue
                if inspect.isawaitable(out):
                    waiting.append((r, c, name, out))
                else:
                    results[r][c] = (name, out)
        for (r, c, name, _), out in zip(waiting, run_concurrently([w[3] for w in waiting])):
            if isinstance(out, BaseException):
                out, failures = {"error": str(out)}, failures + 1
            results[r][c] = (name, out)
        messages = [None if row is None else [{"role": "tool", "name": name, "content": str(out)}
                                              for name, out in row] for row in results]
        return ToolRound(messages, count, failures)


def _call(tool: Callable, arguments, timeout: float | None):
    """``tool(**arguments)``; with a ``timeout``, a plain tool runs in a daemon thread and one still running then
    raises ``TimeoutError`` (the thread is left to finish on its own), and an ``async`` one is awaited for as long."""
    if timeout is None:
        return tool(**arguments)
    if inspect.iscoroutinefunction(tool):
        async def bounded():
            try:
                return await asyncio.wait_for(tool(**arguments), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"Tool {tool.__name__} did not return within {timeout} s") from None

        return bounded()
    box: dict = {}

    def target():
        try:
            box["out"] = tool(**arguments)
        except BaseException as e:  # raised again in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"fastppo-tool-{tool.__name__}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"Tool {tool.__name__} did not return within {timeout} s")
    if "error" in box:
        raise box["error"]
    return box["out"]


def _checked_call(call) -> dict:
    """A parsed tool call as TRL accepts it: a dict whose ``function`` names the tool; no arguments are ``{}``."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict) \
            or not isinstance(call["function"].get("name"), str):
        raise ValueError(f"malformed tool call {call!r}")
    call = {"type": call.get("type", "function"), "function": dict(call["function"])}
    if call["function"].get("arguments") is None:
        call["function"]["arguments"] = {}
    return call


# a tool-calling exchange with markers, to see that a chat template renders each part of it
SAMPLE_EXCHANGE = [
    {"role": "user", "content": "sentinel_user"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "sentinel_tool", "arguments": {"sentinel_key": "sentinel_value"}}}]},
    {"role": "tool", "name": "sentinel_tool", "content": "sentinel_out"},
]


class TurnSampler(Protocol):
    """Writes the next turn of each of ``rows`` (up to ``length`` tokens, cut after its stop token) after its whole
    episode so far, ``contexts`` (prompt, turns, tool messages), whose last tokens are ``suffixes`` (the tool
    messages' tokens that round appended): a sampler that prefills every context anew reads ``contexts``, one that
    keeps each episode in its KV cache (``episode_decode.EpisodeDecode``) feeds ``suffixes``."""

    def __call__(self, rows: list[int], contexts: list[list[int]], suffixes: list[list[int]],
                 length: int) -> list[list[int]]: ...


@dataclass
class Episodes:
    """Each row's completion over every turn (the model's tokens and the template's tool-message tokens), which of
    its tokens the model wrote (1) or the template did (0), its messages (the assistant turns and the tool
    results), and the tool calls run and failed on this process."""

    completions: list[list[int]]
    model_tokens: list[list[int]]
    messages: list[list[dict]]
    calls: int
    failures: int

    @staticmethod
    def joined(parts: list[Episodes]) -> Episodes:
        """The episodes of consecutive chunks of rows as one."""
        return Episodes([c for p in parts for c in p.completions], [m for p in parts for m in p.model_tokens],
                        [m for p in parts for m in p.messages], sum(p.calls for p in parts),
                        sum(p.failures for p in parts))


@dataclass(frozen=True)
class TurnLimits:
    """What bounds an episode: ``budget`` completion tokens over every turn, at most ``max_rounds`` rounds of tool
    calls (None: no limit), and the stop ids that end a turn (a turn that did not end at one ran out of room, and
    its calls are not run: the template's tool turn follows an ended turn)."""

    budget: int
    max_rounds: int | None
    stop_ids: tuple[int, ...] = ()


def run_episodes(calling: ToolCalling, prompts: list[list[int]], first: list[list[int]], sample: TurnSampler,
                 limits: TurnLimits, tools: list[list[Callable]] | None = None, synced: bool = False,
                 device=None) -> Episodes:
    """Rounds of tool calls after each row's first turn ``first`` (cut after its stop token): the calls of every row
    that made some are run, the tool messages' tokens appended, and ``sample`` writes the next turns (each cut after
    its stop token), until no row calls a tool or ``limits.max_rounds`` rounds ran. The whole completion stays
    within ``limits.budget`` tokens: a round whose tool messages would leave no room is rolled back for that row,
    and a turn is cut at the room left. ``synced`` (ZeRO-3, where every forward is a collective): every process runs
    the same rounds, sampling one throwaway row when it has none of its own (``device``: where the process group's
    collectives run). ``tools``: each row's (default: the run's)."""
    from fastppo import dist as fdist

    completions = [list(ids) for ids in first]
    model_tokens = [[1] * len(ids) for ids in first]
    row_tools = [None] * len(first) if tools is None else tools
    messages = [[calling.parse(ids, prefix, row_tools[i])] for i, (ids, prefix) in enumerate(zip(first, prompts))]
    calls = failures = rounds = 0
    budget, max_rounds, ended = limits.budget, limits.max_rounds, set(limits.stop_ids)

    def calls_tools(message: dict, turn: list[int]) -> bool:
        return bool(message.get("tool_calls")) and (not ended or (bool(turn) and turn[-1] in ended))

    pending = [i for i, m in enumerate(messages) if calls_tools(m[-1], first[i])]
    while max_rounds is None or rounds < max_rounds:
        if not _anywhere(bool(pending), synced, fdist, device):
            break
        done = calling.run([messages[i][-1]["tool_calls"] if i in pending else None for i in range(len(first))],
                           tools)
        calls, failures = calls + done.calls, failures + done.failures
        contexts, rows, rooms, suffixes = [], [], [], []
        for i in pending:
            suffix = calling.suffix_ids(done.messages[i])
            room = budget - len(completions[i]) - len(suffix)
            if room <= 0:  # no room for the tool results and a turn after them: this row's round is rolled back
                continue
            messages[i] += done.messages[i]
            completions[i] += suffix
            model_tokens[i] += [0] * len(suffix)
            contexts.append(prompts[i] + completions[i])
            rows.append(i)
            rooms.append(room)
            suffixes.append(suffix)
        length = max(rooms, default=0)
        if synced:  # every process samples the same number of tokens' forwards
            length = int(fdist.all_reduce(torch.tensor([float(length)], device=device),
                                          torch.distributed.ReduceOp.MAX).item())
        turns = sample(rows, contexts or [prompts[0]], suffixes, length) if (contexts or synced) and length > 0 \
            else []
        pending = []
        for i, room, turn in zip(rows, rooms, turns):
            turn = turn[:room]
            completions[i] += turn
            model_tokens[i] += [1] * len(turn)
            if turn:
                messages[i].append(calling.parse(turn, prompts[i] + completions[i][:len(completions[i]) - len(turn)],
                                                 row_tools[i]))
                if calls_tools(messages[i][-1], turn):
                    pending.append(i)
        rounds += 1
    return Episodes(completions, model_tokens, messages, calls, failures)


def _anywhere(flag: bool, synced: bool, fdist, device) -> bool:
    if not synced:
        return flag
    return bool(fdist.all_reduce(torch.tensor([float(flag)], device=device), torch.distributed.ReduceOp.MAX).item())
