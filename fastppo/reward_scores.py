"""Step 1's scores from the run's list of rewards (TRL GRPO's ``reward_funcs``): functions, reward models on the
policy's token ids, and reward models with their own tokenizer on the decoded text re-tokenized; their weighted
sum (``reward_weights``) and each one's column for the logs.

The pieces they are made of (calling one function, reading one model, the rules the embedded default trains on)
are ``fastppo.rewards``'; this module only lists and combines them.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from fastppo.config import as_list, user_path
from fastppo.data import prompt_messages
from fastppo.errors import SettingsError, SettingsTypeError
from fastppo.library_log import library_logger
from fastppo.rewards import (DEFAULT_REWARD_FN, call_reward_fns, load_reward_fn, own_forward_scores,
                             reward_fn_columns, reward_fn_name, reward_model_scores)

logger = library_logger(__name__)


@dataclass
class Reward:
    """One reward of the run's list: a function, or a sequence-classification model (an object, or a path the
    trainer loads). ``tokenizer`` is the model's own where it is not the policy's (None: the policy's token ids
    are the model's input, unchanged); the trainer sets it once the model is loaded."""

    name: str
    weight: float = 1.0
    fn: Callable | None = None
    model: nn.Module | None = None
    path: str | None = None
    tokenizer: object | None = None


def reward_name(entry) -> str:
    """TRL GRPO's name of a reward in its logs: a function's name (a ``functools.partial``'s function's; a callable
    object's ``__name__``, else its class name), a model's checkpoint directory name."""
    if isinstance(entry, nn.Module):
        return (getattr(getattr(entry, "config", None), "_name_or_path", "") or type(entry).__name__).rstrip(
            "/").split("/")[-1] or type(entry).__name__
    if callable(entry):
        while isinstance(entry, functools.partial):
            entry = entry.func
        return getattr(entry, "__name__", type(entry).__name__)
    if ":" in entry and not os.path.exists(entry):
        return entry.partition(":")[2]
    return entry.rstrip("/").split("/")[-1]


def unique_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name_2``, ``name_3`` ... the first not in ``taken`` (which it joins): each reward keeps a
    column and a log of its own, even beside one whose own name is ``name_2``."""
    unique, n = name, 1
    while unique in taken:
        n += 1
        unique = f"{name}_{n}"
    taken.add(unique)
    return unique


def resolve_rewards(reward, config) -> list[Reward]:
    """The run's rewards from the trainer's ``reward_model`` argument (a model, a function, ``"module:function"``,
    a path, or a list mixing them) or, without one, the config's reward model paths then reward functions; the
    default rule without any. ``reward_weights`` in the same order (TRL GRPO's); names made unique."""
    if isinstance(reward, (list, tuple)) and not reward:  # not "no reward given": the default would train silently
        raise SettingsError("reward_model is an empty list: give at least one reward (a function, a model or a path)")
    unused = [spec for spec in as_list(config.reward_fn) if as_list(reward) and spec not in as_list(reward)]
    if unused:  # the argument wins; the config's functions would be dropped without a word
        raise SettingsError(f"reward_fn {', '.join(map(repr, unused))} is set in the config and reward_model= is given "
                            "too, which takes its place: give every reward in one of them (a list mixes functions "
                            "and models; reward_weights in its order)")
    entries = as_list(reward) or as_list(user_path(config.reward_model_path)) + as_list(config.reward_fn) or [DEFAULT_REWARD_FN]
    weights = config.reward_weights if config.reward_weights is not None else [1.0] * len(entries)
    if len(weights) != len(entries):
        raise SettingsError(f"reward_weights has {len(weights)} weight(s) for {len(entries)} reward(s) "
                            f"({', '.join(reward_name(e) for e in entries)}); give one per reward, in that order")
    rewards, taken = [], set()
    for entry, weight in zip(entries, weights):
        if entry is None or not (isinstance(entry, (nn.Module, str)) or callable(entry)):
            raise SettingsTypeError(f"reward_model must be a model, a function or a path (or a list of them), got "
                                    f"{type(entry).__name__}")
        name = unique_name(reward_name(entry), taken)
        if isinstance(entry, nn.Module):
            rewards.append(Reward(name, float(weight), model=entry))
        elif callable(entry):
            rewards.append(Reward(name, float(weight), fn=entry))
        elif ":" in entry and not os.path.exists(entry):
            rewards.append(Reward(name, float(weight), fn=load_reward_fn(entry)))
        else:
            rewards.append(Reward(name, float(weight), path=entry))
    return rewards


def processing_classes_by_name(classes, rewards) -> dict:
    """TRL GRPO's ``reward_processing_classes``: one tokenizer (for a single reward) or a list aligned with the
    rewards (None: the reward's own, found beside it) -> {reward name: tokenizer}."""
    if classes is None:
        return {}
    if not isinstance(classes, (list, tuple)):
        classes = [classes]
    if len(classes) != len(rewards):
        raise SettingsError(f"reward_processing_classes has {len(classes)} entries, which must match the "
                            f"{len(rewards)} reward(s) ({', '.join(r.name for r in rewards)}); give one per reward "
                            "(None where not needed)")
    return {r.name: c for r, c in zip(rewards, classes) if c is not None}


def combine_rewards(columns: dict[str, torch.Tensor], weights: dict[str, float], unjudged_allowed: bool = False,
                    describe=None) -> torch.Tensor:
    """[B] Σ wᵢ·rᵢ over the rewards that judged each completion (TRL GRPO's nansum). A completion no reward judged
    has no score: with ``unjudged_allowed`` (the group estimators, as TRL GRPO and RLOO) its score is NaN, left out
    of its group's statistics, its advantage 0, and a warning shows the first such row (``describe(row)``: its
    prompt, completion and columns), as TRL's does; otherwise refused, naming the rows."""
    stacked = torch.stack([columns[name] * weights[name] for name in columns], 1)
    unjudged = torch.isnan(stacked).all(1).nonzero().flatten().tolist()
    if unjudged and not unjudged_allowed:
        raise SettingsError(f"no reward judged completion(s) {unjudged[:8]} (every reward function returned None or "
                            f"NaN for them: {', '.join(columns)}); a completion needs at least one score")
    if unjudged:
        logger.warning(f"All reward functions returned None for the following kwargs:\n"
                       f"{describe(unjudged[0]) if describe else {'row': unjudged[0]}}\n"
                       f"Please ensure that at least one reward function returns a valid reward. "
                       f"({len(unjudged)} completion(s) of {len(stacked)} unjudged: no score, advantage 0)")
    return torch.where(torch.isnan(stacked).all(1), float("nan"), stacked.nansum(1))


def retokenized_scores(reward: Reward, texts: list[str], completions: list[str], messages: list | None,
                       chunk: int, device) -> torch.Tensor:
    """[B] the score of a reward model with its own tokenizer, of the text it would score alone: conversational
    prompts (``messages``: the prompts' turns, a trailing assistant answer cut) + the completion as an assistant
    turn through its chat template, else ``texts`` (prompt + completion decoded together by the policy's tokenizer,
    so the spacing between them is the one the policy wrote); read by the model's own forward on its own tokens
    (``own_forward_scores``: TRL GRPO's rule for reward models, right-padded, no added special tokens)."""
    tok = reward.tokenizer
    texts = list(texts)
    for i, completion in enumerate(completions):
        turns = messages[i] if messages is not None else None
        if is_conversation(turns):
            turns = prompt_messages(turns)[0] + [{"role": "assistant", "content": completion}]
            texts[i] = tok.apply_chat_template(turns, tokenize=False)
    return own_forward_scores(reward.model, tok, texts, chunk, reward.name, device)


def is_conversation(value) -> bool:
    """A chat row: a non-empty list of messages (dicts)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def check_model_scores(name: str, scores: torch.Tensor) -> torch.Tensor:
    """A reward model's scores, refused when any is NaN or infinite (a model has no "not judged": that is a reward
    function's None), naming the model and the rows."""
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        raise SettingsError(f"reward model {name!r} gave non-finite scores at rows {bad[:8]} (e.g. "
                            f"{scores[bad[0]].item()}): its weights or its dtype overflow on these completions; "
                            "refusing to update on them")
    return scores


@dataclass(frozen=True)
class RewardScoring:
    """How a run's rewards are read: the dataset column holding a row's prompt (``text_field``), the reward
    models' rows per forward (``chunk``), packed or padded, on ``device``; ``unjudged_allowed``: a completion no
    reward judged is allowed (the advantage estimator leaves it out) rather than refused."""

    text_field: str
    chunk: int
    packed: bool
    device: torch.device
    unjudged_allowed: bool = False


def score_rewards(rewards: list[Reward], rollout, tokenizer, rows, scoring: RewardScoring,
                  context: dict | None = None, completion_messages: list[list[dict]] | None = None,
                  sharing: Callable | None = None, prompt_turns: list[list[dict]] | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str] | None, list[str] | None]:
    """Step 1's scores: each reward on the rollout (a model on the policy's token ids, or on its own tokens when it
    has its own tokenizer; the functions on the texts, as TRL GRPO calls them, ``context``'s keywords added:
    ``trainer_state``, ``log_extra``, ``log_metric``), then Σ wᵢ·rᵢ (``combine_rewards``). Returns (scores [B],
    each reward's column [B] by name (NaN where a function did not judge), prompts, completions (texts, when
    decoded)). ``completion_messages``: each completion's messages where the rollout made them (its assistant turns
    and tool results), what a function of conversational data gets as its completion. ``sharing(model)``: how a
    reward model on the policy's token ids runs each group's prompt once (``sharing.prompt_sharing``), or None.
    ``prompt_turns``: the prompts the policy continued, as messages, where the trainer made them (an environment's
    reset text added); else a chat row's turns before its trailing assistant answer (``data.prompt_messages``, the
    prompt the policy was given). What a function of conversational data gets as ``prompts`` (TRL's meaning); the
    whole row, its answer too, stays its own column (``messages``, say)."""
    columns, prompts, completions, texts = {}, None, None, None
    if any(r.fn is not None or r.tokenizer is not None for r in rewards):  # else no decode at all
        prompt_ids, completion_ids = rollout.token_ids()
        prompts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if any(r.tokenizer is not None for r in rewards):  # prompt + completion as one text: the spacing the policy wrote
        texts = tokenizer.batch_decode([p + c for p, c in zip(prompt_ids, completion_ids)], skip_special_tokens=True)
    field = scoring.text_field
    messages = list(rows[field]) if rows is not None and field in rows.column_names else None
    if prompt_turns is None and messages is not None:  # never the row's reference answer as the prompt
        prompt_turns = [prompt_messages(m)[0] if is_conversation(m) else m for m in messages]
    functions = [r for r in rewards if r.fn is not None]
    if functions:  # all at once: the async ones run together
        chat = prompt_turns is not None and all(is_conversation(m) for m in prompt_turns)
        # TRL GRPO: a conversational row's prompt messages; a text row's own text (not its tokens decoded again:
        # a tokenizer need not round-trip it)
        texts_given = messages is not None and all(isinstance(m, str) for m in messages)
        scored = call_reward_fns(
            [(reward_fn_name(r.fn), r.fn) for r in functions],
            prompt_turns if chat else messages if texts_given else prompts,
            (completion_messages or [[{"role": "assistant", "content": c}] for c in completions]) if chat
            else completions, scoring.device,
            **reward_fn_columns(prompt_ids, completion_ids, rows), **(context or {}))
        columns.update((r.name, column) for r, column in zip(functions, scored))
    for reward in rewards:
        if reward.fn is not None:
            continue
        if reward.tokenizer is None:  # the policy's tokenizer: its token ids, read at the last token, no decode
            shared = None if sharing is None else sharing(reward.model)
            columns[reward.name] = check_model_scores(reward.name, reward_model_scores(
                reward.model, rollout, scoring.chunk, scoring.packed, shared))
        else:
            columns[reward.name] = check_model_scores(reward.name, retokenized_scores(
                reward, texts, completions, prompt_turns, scoring.chunk, scoring.device))
    columns = {r.name: columns[r.name] for r in rewards}  # reward_weights' order: the sum's order
    if len(rewards) == 1 and rewards[0].weight == 1.0 and not torch.isnan(columns[rewards[0].name]).any():
        return columns[rewards[0].name], columns, prompts, completions  # one reward: its scores, bit for bit

    def describe(row: int) -> dict:  # TRL's warning: the row's prompt, completion and dataset columns
        shown = {} if rows is None else {k: v for k, v in rows[row].items()}
        return {**shown, "prompt": None if prompts is None else prompts[row],
                "completion": None if completions is None else completions[row]}

    return (combine_rewards(columns, {r.name: r.weight for r in rewards}, scoring.unjudged_allowed, describe),
            columns, prompts, completions)
