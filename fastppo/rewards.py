"""Rewards: rule-based reward functions (``--reward_fn fastppo.rewards:NAME``), calling a reward
function or a reward model on completions, and legacy TRL's score scaling.

The trainer calls a reward function once per rollout batch, as TRL 1.16's GRPOTrainer does, and expects
one float (or None: not judged) per completion::

    fn(prompts=list, completions=list, prompt_ids=list[list[int]], completion_ids=list[list[int]],
       trainer_state=TrainerState, log_extra=fn(column, values), log_metric=fn(name, value),
       **dataset_columns) -> list[float | None] | torch.Tensor

``prompts[i]`` is the decoded query and ``completions[i]`` the decoded response (special tokens
skipped, cut after the stop token, which ``completion_ids[i]`` keeps); for a conversational dataset,
as TRL passes them, the row's prompt messages and ``[{"role": "assistant", "content": text}]``. The
dataset's other columns come as lists. An ``async def`` function is awaited, together with the other
async ones. A function without ``**kwargs`` gets only the keywords it names.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import threading
from collections.abc import Callable

import torch

from fastppo.dist import all_reduce
from fastppo.errors import SettingsError, SettingsTypeError
from fastppo.layout import backbone_and_head
from fastppo.loading import position_limit

# The reward function the embedded default trains on (and any run given no reward model or function).
DEFAULT_REWARD_FN = "fastppo.rewards:positive_words"

# A toy sentiment lexicon: the embedded default's task is TRL's classic
# "make GPT-2 write positive movie reviews", with a word count in place of a
# sentiment classifier so it runs offline and its optimum is obvious.
POSITIVE_WORDS = (
    "good", "great", "excellent", "wonderful", "amazing", "brilliant", "beautiful", "lovely",
    "superb", "fantastic", "delightful", "charming", "perfect", "moving", "fun", "best",
)
NEGATIVE_WORDS = (
    "bad", "awful", "terrible", "boring", "dull", "poor", "weak", "ugly",
    "horrible", "worst", "painful", "annoying", "stupid", "messy", "flat", "slow",
)
_POSITIVE = frozenset(POSITIVE_WORDS)
_NEGATIVE = frozenset(NEGATIVE_WORDS)


def completion_text(completion) -> str:
    """A completion's text: the string, or a conversational completion's messages' contents joined."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in completion)
    return completion


def positive_words(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """#positive − #negative words of each completion (``POSITIVE_WORDS`` / ``NEGATIVE_WORDS``).

    The optimum is a completion made only of positive words: its score is its length in words
    (``response_length`` for the embedded default). A count, not a fraction, so that each word
    is worth more than TRL's default KL penalty (β = 0.05) costs and the optimum stays clear.
    """
    scores = []
    for completion in completions:
        words = completion_text(completion).lower().split()
        scores.append(float(sum(w in _POSITIVE for w in words) - sum(w in _NEGATIVE for w in words)))
    return scores


def completion_length(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """Number of words of each completion (a trivially learnable reward for tests)."""
    return [float(len(completion_text(c).split())) for c in completions]


def soft_overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (its Eq. 13; verl's ``overlong_buffer``, TRL's
    ``get_soft_overlong_punishment``) of completions of ``lengths`` tokens, in float64::

        L <= L_max − B:          0
        L_max − B < L <= L_max:  −(L − (L_max − B)) / B · factor
        L > L_max:               −factor

    Past ``max_length`` verl's line goes on falling and TRL's stops at −1; a trainer's completions never pass
    ``response_length``, so the two agree on them. ``buffer`` 0: −factor past ``max_length`` only (TRL's)."""
    lengths = lengths.double()
    if buffer == 0:
        return torch.where(lengths > max_length, -float(factor), 0.0).double()
    exceed = lengths - (max_length - buffer)
    return torch.clamp(-exceed / buffer * factor, min=-float(factor), max=0.0)


def overlong_shaped(scores: torch.Tensor, lengths: torch.Tensor, max_length: int, buffer: int,
                    factor: float) -> torch.Tensor:
    """``scores`` with ``soft_overlong_penalty`` added (the setting ``overlong_buffer_len``; 0: ``scores`` as given)."""
    if not buffer:
        return scores
    return scores + soft_overlong_penalty(lengths, max_length, buffer, factor).to(scores.device, scores.dtype)


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment as a reward function (``soft_overlong_punishment``): each completion's
    ``soft_overlong_penalty``, from its ``completion_ids`` (its tokens up to and including the stop token, as TRL
    counts them). A class, not a closure, so that it pickles, as TRL's does; its ``__name__`` is TRL's, so its
    metrics are logged under the same name."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int, penalty_factor: float = 1.0):
        if not 0 <= soft_punish_cache <= max_completion_len:
            raise SettingsError(f"soft_punish_cache must be from 0 to max_completion_len ({max_completion_len}), got "
                                f"{soft_punish_cache}")
        self.max_completion_len, self.soft_punish_cache = max_completion_len, soft_punish_cache
        self.penalty_factor = penalty_factor

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        return soft_overlong_penalty(lengths, self.max_completion_len, self.soft_punish_cache,
                                     self.penalty_factor).tolist()


def soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int,
                             penalty_factor: float = 1.0) -> SoftOverlongPunishment:
    """TRL's ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`` (the same values) with verl's
    ``penalty_factor``: a reward function for ``reward_funcs``. The setting ``overlong_buffer_len`` adds the same
    penalty to the summed reward without a reward column of its own."""
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache, penalty_factor)


# ============================================================================ scoring completions


class RewardFunctionError(RuntimeError):
    """The user's reward function raised."""


def load_reward_fn(spec: str, what: str = "reward_fn") -> Callable:
    """``module:function`` to the function (``what``: the setting that named it, for the errors)."""
    module_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SettingsError(f"{what} {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise SettingsError(f"{what} {spec!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def reward_fn_name(fn: Callable) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _accepted_kwargs(fn: Callable, kwargs: dict) -> dict:
    """All of ``kwargs`` for a function with ``**kwargs`` (TRL's GRPO convention), else the ones it names."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins, some C callables: pass everything
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


def call_reward_fn(fn: Callable, name: str, prompts: list, completions: list, device, **columns) -> torch.Tensor:
    """[B] fp32 scores from one reward function (``call_reward_fns`` with one)."""
    return call_reward_fns([(name, fn)], prompts, completions, device, **columns)[0]


def call_reward_fns(functions: list[tuple[str, Callable]], prompts: list, completions: list, device,
                    **columns) -> list[torch.Tensor]:
    """[B] fp32 scores from each ``(name, function)``, called as TRL 1.16's GRPOTrainer calls reward functions:
    keywords ``prompts``, ``completions`` and the ``columns`` (``prompt_ids``, ``completion_ids``, the dataset rows'
    other columns as lists, ``trainer_state``, ``log_extra``, ``log_metric``); a function without ``**kwargs`` gets
    only the ones it names. The plain functions run one after another, then the ``async`` ones together on a
    background event loop (as TRL runs them). None or NaN: the function does not judge that completion (NaN in its
    column). Any failure, a wrong length or an infinite score is an error that names the function."""
    # copies: a function that edits its arguments in place must not change the samples the run logs
    shared = dict(prompts=list(prompts), completions=list(completions),
                  **{k: list(v) if isinstance(v, list) else v for k, v in columns.items()})
    results: dict[int, object] = {}
    waiting = []  # (index, name, coroutine): an async function's call returns its coroutine, not yet run
    try:
        for i, (name, fn) in enumerate(functions):
            kwargs = _accepted_kwargs(fn, shared)
            out = _invoke(name, lambda: fn(**kwargs))
            if inspect.isawaitable(out):
                waiting.append((i, name, out))
            else:
                results[i] = out
    except RewardFunctionError:  # a plain function failed: the coroutines made before it are never run
        for _, _, coroutine in waiting:
            getattr(coroutine, "close", lambda: None)()
        raise
    if waiting:
        for (i, name, _), out in zip(waiting, run_concurrently([c for _, _, c in waiting])):
            if isinstance(out, BaseException):
                raise _failure(name, out) from out
            results[i] = out
    return [_scores_of(results[i], name, completions, device) for i, (name, _) in enumerate(functions)]


def _invoke(name: str, call: Callable):
    try:
        return call()
    except (SystemExit, Exception) as e:  # sys.exit() in a reward function must not end the run as a success
        raise _failure(name, e) from e


def _failure(name: str, e: BaseException) -> RewardFunctionError:
    if isinstance(e, SystemExit):
        return RewardFunctionError(f"reward_fn {name!r} called sys.exit({e.code!r}); a reward function must return "
                                   "scores")
    return RewardFunctionError(f"reward_fn {name!r} raised {type(e).__name__}: {e}")


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def run_concurrently(awaitables: list) -> list:
    """Each awaitable's result (or the exception it raised), run together on one background event loop, made once
    per process in a daemon thread (TRL's way: it works the same whether or not the caller has a loop running,
    as a notebook has)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="fastppo-async", daemon=True).start()

    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(gather(), _LOOP).result()


def _scores_of(out, name: str, completions: list, device) -> torch.Tensor:
    """A function's return value as [B] fp32 scores: NaN where it returned None or NaN (not judged); refused when
    it is not one number per completion, or holds an infinity."""
    try:
        if not isinstance(out, torch.Tensor):
            out = [math.nan if x is None else x for x in list(out)]
        scores = torch.as_tensor(out, dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise SettingsTypeError(f"reward_fn {name!r} must return a list of floats or a tensor, got "
                                f"{type(out).__name__}") from e
    scores = scores.reshape(-1) if scores.dim() > 1 and scores.numel() == len(completions) else scores
    if scores.dim() != 1 or scores.shape[0] != len(completions):
        raise SettingsError(
            f"reward_fn {name!r} returned {tuple(scores.shape)} scores for {len(completions)} completions; "
            "expected one float per completion"
        )
    bad = torch.isinf(scores).nonzero().flatten().tolist()
    if bad:
        raise SettingsError(
            f"reward_fn {name!r} returned infinite scores at rows {bad[:8]} (e.g. {scores[bad[0]].item()}) for "
            f"completion {completions[bad[0]]!r}; refusing to update on them (None or NaN: not judged)"
        )
    return scores.to(device)


def reward_model_scores(reward_model, rollout, chunk: int, packed: bool = False,
                        shared: tuple | None = None) -> torch.Tensor:
    """[B] score of a sequence-classification model, read at each row's last real token (the stop token
    when there is one); its head runs on those B hidden states only. ``shared`` (``sharing.prompt_sharing``, with
    ``chunk`` a multiple of its group size): each group's prompt runs once."""
    backbone, head = backbone_and_head(reward_model)
    scores = []
    with torch.inference_mode():
        for i in range(0, rollout.query_responses.shape[0], chunk):
            layout = rollout.layout(range(i, min(i + chunk, rollout.query_responses.shape[0])), packed, shared=shared)
            hidden = backbone(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                              position_ids=layout.position_ids, use_cache=False).last_hidden_state
            last = hidden.reshape(-1, hidden.shape[-1]).index_select(0, layout.last)
            scores.append(head(last).squeeze(-1).float())
        out = torch.cat(scores)
    return out.clone()


def own_forward_scores(model, tokenizer, texts: list[str], chunk: int, name: str, device) -> torch.Tensor:
    """[B] the scores of a reward model with its own tokenizer, as TRL 1.16's GRPOTrainer computes them:
    ``model(**tokenizer(texts, padding=True, padding_side="right", add_special_tokens=False)).logits[:, 0]``, the
    model's own forward, so every pooler and head (BERT's pooler, DeBERTa's ContextPooler, a decoder's last
    non-pad token) is the model's; in chunks of ``chunk`` texts. A text longer than the model's learned positions
    is refused (it would index past them), naming the row."""
    limit = learned_positions(model)
    scores = []
    with torch.inference_mode():
        for start in range(0, len(texts), chunk):
            inputs = tokenizer(texts[start:start + chunk], return_tensors="pt", padding=True, padding_side="right",
                               add_special_tokens=False)
            lengths = inputs["attention_mask"].sum(1)
            empty = (lengths == 0).nonzero().flatten().tolist()
            if empty:
                raise SettingsError(f"reward model {name!r}: completion(s) {[start + i for i in empty[:8]]} are no "
                                    "token at all in its own tokenizer (nothing to score)")
            if limit is not None and int(lengths.max()) > limit:
                row = int(lengths.argmax())
                raise SettingsError(
                    f"reward model {name!r} reads at most {limit} positions, and completion {start + row} is "
                    f"{int(lengths[row])} tokens in its own tokenizer (prompt and completion, as it scores them): "
                    "lower max_prompt_length or max_completion_length, or use a reward model with more positions")
            scores.append(model(**inputs.to(device)).logits[:, 0].float())
    return torch.cat(scores).clone()


def learned_positions(model) -> int | None:
    """The positions a model can read, where its embedding of absolute positions bounds them (None: not
    bounded, or not stated; DeBERTa's relative attention with ``position_biased_input=False`` reads any
    length)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "position_biased_input", True) is False:
        return None
    return position_limit(config)


# what every call passes beside the dataset's columns (TRL GRPO's, and the prompts' token ids)
PASSED_ALWAYS = ("prompts", "completions", "prompt_ids", "completion_ids", "trainer_state", "log_extra", "log_metric")


def check_reward_fn_columns(fn: Callable, name: str, dataset, what: str, passed: tuple[str, ...] = ()) -> None:
    """Before any model loads: each keyword the reward function requires (no default) must be a column of
    every dataset it will be called on (the eval set's too), else it would fail mid-run. ``passed``: keywords the
    run passes beside ``PASSED_ALWAYS`` (``environments`` where there are some)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.name not in PASSED_ALWAYS + passed and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    withheld = [c for c in required if c in NOT_PASSED]
    if withheld:  # TRL GRPO's rule: the prompt and the completion come as ``prompts`` and ``completions``
        raise SettingsError(f"reward_fn {name!r} requires {', '.join(map(repr, withheld))}, a column reward functions "
                            "are not passed (as in TRL GRPO): read prompts= and completions= instead")
    missing = [c for c in required if c not in (dataset.column_names if dataset is not None else ())]
    if missing:
        columns = list(dataset.column_names) if dataset is not None else []
        raise SettingsError(f"reward_fn {name!r} requires {', '.join(map(repr, missing))}, which {what} does not have "
                            f"(its columns: {columns}); add the column to {what}, or give the parameter a default")


# dataset columns a reward function does not get (TRL GRPO's rule: the prompt and the completion come as texts)
NOT_PASSED = ("prompt", "completion", "completion_ids", "prompts", "completions")


def reward_fn_columns(prompt_ids: list[list[int]], completion_ids: list[list[int]], rows=None) -> dict:
    """The keywords a reward function gets beside the texts: ``prompt_ids`` and ``completion_ids`` (real
    tokens; the completion up to and including its stop token) and the dataset ``rows``' other columns."""
    columns = {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
    if rows is not None:
        for name in rows.column_names:
            if name not in columns and name not in NOT_PASSED:
                columns[name] = list(rows[name])  # a list, as TRL passes it (datasets returns a Column)
    return columns


# ============================================================================ score transforms (legacy TRL)


class RunningMoments:
    """Running mean and std of the scores over all processes (legacy TRL use_score_scaling)."""

    def __init__(self):
        self.mean, self.var, self.std, self.count = 0.0, 1.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> None:
        xs = xs.double()
        sums = torch.stack([xs.sum(), torch.tensor(float(xs.numel()), dtype=torch.float64, device=xs.device)])
        all_reduce(sums)
        n = sums[1].item()
        batch_mean = sums[0].item() / n
        sq = ((xs - batch_mean) ** 2).sum().reshape(1)
        all_reduce(sq)
        batch_var = sq.item() / n
        delta, total = batch_mean - self.mean, self.count + n
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        # the unbiased std; of a single score it is undefined: inf, as TRL's (that lone score scales to 0, not by ~1e7)
        self.std = math.sqrt(self.var * total / (total - 1)) if total > 1 else math.inf
        self.count = total

    def state_dict(self) -> dict:
        return dict(mean=self.mean, var=self.var, std=self.std, count=self.count)

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.std, self.count = state["mean"], state["var"], state["std"], state["count"]


def transform_scores(scores, use_score_scaling: bool, use_score_norm: bool, score_clip: float | None,
                     moments: RunningMoments | None, clip_range=None) -> torch.Tensor:
    """Legacy TRL score scaling / normalisation (running moments, this batch included) and clipping, to
    [−score_clip, score_clip] or to ``clip_range`` (min, max: TRL RLOO's reward_clip_range)."""
    if use_score_scaling:
        if torch.isnan(scores).any():
            raise SettingsError("use_score_scaling: a completion no reward judged has no score to scale by the "
                                "running moments; return a score for every completion, or drop use_score_scaling")
        moments.update(scores)
        scale = moments.std + torch.finfo(scores.dtype).eps
        scores = (scores - moments.mean) / scale if use_score_norm else scores / scale
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    if clip_range is not None:
        scores = scores.clamp(float(clip_range[0]), float(clip_range[1]))
    return scores
