"""A sweep of fastppo's library surface with hostile but realistic inputs, each outcome classified.

    python tests/library_sweep.py [--only SUBSTR] [--json out.json] [--list]

Not a pytest module (its name does not start with ``test_``): a standalone script that runs every case
in this process, each in its own temporary output_dir, on the embedded tiny Llama (built offline into a
private cache), with one or two PPO iterations of 4 episodes, and prints one row per case:

    case | expected | outcome | detail

Outcomes:
  refused  an exception whose message names the argument/object the case is about (the script records its
           type and first line); "off-target:" in the detail when a refusal named something else (CRASH)
  ok       it ran, and the case's own check of the result passed
  WRONG    it ran, but the case's check found a silently wrong result (or a refusal was the only right
           answer and none came)
  LOST     a previous run's outputs (or the user's own files) were destroyed or replaced
  CRASH    an exception that is not a clear refusal (IndexError/KeyError/AttributeError..., or a message
           that does not name what the case is about, e.g. from deep inside torch)
  HANG     the case ran past its time limit (SIGALRM; a watchdog thread ends the sweep if even that fails)

``expected`` is what a correct library does: ``refused``, ``ok``, or ``ok|refused`` where either is right
(the case then checks the result if it ran). A ``!`` marks a row whose outcome is not an expected one.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field

# CPU tensors take the PyTorch reference path (the tests' ``reference_path``); the embedded model is built
# into a cache private to this sweep, so ~/.cache/fastppo is neither read nor written.
os.environ["TRITON_INTERPRET"] = "0"
_SWEEP_ROOT = tempfile.mkdtemp(prefix="fastppo-sweep-")
os.environ.setdefault("FASTPPO_CACHE", os.path.join(_SWEEP_ROOT, "cache"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,  # noqa: E402
                          AutoTokenizer, TrainerCallback)

from fastppo import PPOConfig, PPOTrainer, legacy  # noqa: E402
from fastppo.cli import EMBEDDED_PRESET, ModelConfig  # noqa: E402
from fastppo.embedded import embedded_model_path  # noqa: E402
from fastppo.value_head import AutoModelForCausalLMWithValueHead  # noqa: E402

transformers.logging.set_verbosity_error()
datasets.disable_progress_bars()


# ============================================================================ outcomes and the case registry


class Wrong(Exception):
    """The case ran and its check found a silently wrong result."""


class Lost(Exception):
    """A previous run's outputs (or the user's files) were destroyed."""


class Crash(Exception):
    """A case's own finding that is a crash (with more said than the exception it wraps)."""


class Hang(BaseException):
    """Raised by SIGALRM: the case ran past its limit (a BaseException, so no ``except Exception`` eats it)."""


# exception types that are never a clear refusal, whatever their message says
CRASH_TYPES = (IndexError, KeyError, AttributeError, AssertionError, ZeroDivisionError, NameError,
               UnboundLocalError, NotImplementedError, RecursionError, StopIteration)


@dataclass
class Case:
    name: str
    group: str
    expected: str  # "refused", "ok" or "ok|refused"
    names: tuple  # any of these (lower-case) in the message makes an exception a refusal
    fn: object
    timeout: int = 90


@dataclass
class Result:
    name: str
    group: str
    expected: str
    outcome: str
    detail: str
    seconds: float
    error_type: str | None = None
    traceback: str | None = None
    log_tail: list = field(default_factory=list)

    @property
    def matches(self) -> bool:
        return self.outcome in self.expected.split("|")


CASES: list[Case] = []
_GROUP = ["?"]


def group(name: str) -> None:
    _GROUP[0] = name


def case(name: str, expected: str = "ok", names=(), timeout: int = 90):
    def register(fn):
        CASES.append(Case(name, _GROUP[0], expected, tuple(n.lower() for n in names), fn, timeout))
        return fn
    return register


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def classify(exc: BaseException, names: tuple) -> tuple[str, str]:
    """(outcome, detail) of an exception that escaped a case."""
    kind = type(exc).__name__
    line = first_line(exc)
    if isinstance(exc, Hang):
        return "HANG", line
    if isinstance(exc, Wrong):
        return "WRONG", line
    if isinstance(exc, Lost):
        return "LOST", line
    if isinstance(exc, Crash):
        return "CRASH", line
    where = _raising_frame(exc)
    if isinstance(exc, CRASH_TYPES):
        return "CRASH", f"{kind}: {line} [{where}]"
    foreign = "site-packages" in _raising_path(exc) and type(exc).__module__.split(".")[0] != "fastppo"
    if foreign and not isinstance(exc, (ValueError, TypeError, OSError)):
        return "CRASH", f"{kind} raised inside a dependency: {line} [{where}]"
    message = str(exc).lower()
    if names and not any(n in message for n in names):
        return "CRASH", f"off-target: {kind}: {line} [{where}]"
    return "refused", f"{kind}: {line}"


def _raising_path(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename if tb is not None else ""


def _raising_frame(exc: BaseException) -> str:
    """file:function of the innermost frame of the exception (where it was raised)."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return "?"
    code = last.tb_frame.f_code
    path = code.co_filename
    for marker in ("site-packages" + os.sep, os.sep + "fastppo" + os.sep):
        if marker in path:
            path = path.split(marker, 1)[1] if marker.startswith("site") else "fastppo/" + path.split(marker, 1)[1]
            break
    return f"{path}:{code.co_name}"


# ============================================================================ shared fixtures


class Ctx:
    """What one case gets: its temporary directory and builders of the tiny models and configs."""

    def __init__(self, tmp: str, model_dir: str):
        self.tmp = tmp
        self.model_dir = model_dir

    def path(self, *parts) -> str:
        return os.path.join(self.tmp, *parts)

    def cfg(self, name: str = "out", **overrides) -> PPOConfig:
        base = {**EMBEDDED_PRESET, **dict(
            output_dir=self.path(name), per_device_train_batch_size=4, gradient_accumulation_steps=1,
            num_ppo_epochs=1, response_length=4, total_episodes=8, num_sample_generations=0, disable_tqdm=True,
            local_rollout_forward_batch_size=8, logging_steps=1, save_steps=10**6, report_to="none")}
        base.update(overrides)
        return PPOConfig(**base)

    def tok(self):
        return AutoTokenizer.from_pretrained(self.model_dir)

    def lm(self, **kwargs):
        return AutoModelForCausalLM.from_pretrained(self.model_dir, **kwargs)

    def vlm(self):
        return AutoModelForCausalLMWithValueHead.from_pretrained(self.model_dir)

    def scalar(self, labels: int = 1, **config_changes):
        model = AutoModelForSequenceClassification.from_pretrained(self.model_dir, num_labels=labels)
        for key, value in config_changes.items():
            setattr(model.config, key, value)
        return model

    def small_vocab(self, kind: str, vocab: int = 50):
        """A model of the embedded architecture with only ``vocab`` embedding rows (another tokenizer's)."""
        config = AutoConfig.from_pretrained(self.model_dir)
        config.vocab_size = vocab
        if kind == "lm":
            return AutoModelForCausalLM.from_config(config)
        config.num_labels = 1
        return AutoModelForSequenceClassification.from_config(config)

    def trainer(self, cfg=None, **kwargs):
        return PPOTrainer(args=cfg if cfg is not None else self.cfg(), **kwargs)

    def legacy(self, batch_size=2, mini_batch_size=2, model=None, ref_model=None, **kwargs):
        config = legacy.PPOConfig(batch_size=batch_size, mini_batch_size=mini_batch_size, learning_rate=1e-3,
                                  output_dir=self.path("legacy"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return legacy.PPOTrainer(config, model if model is not None else self.vlm(), ref_model, self.tok(),
                                     **kwargs)


def length_reward(completions, **kw):
    from fastppo.rewards import completion_text  # chat data: completions are message lists, as TRL passes them

    return [float(len(completion_text(c).split())) for c in completions]


def metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def finite_metrics(trainer) -> None:
    """Every logged scalar of the run is finite (a NaN/inf metric means the run went silently wrong)."""
    for row in trainer.state.log_history:
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise Wrong(f"non-finite metrics at step {row.get('step')}: {bad[:4]}")


def params_finite(model) -> None:
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise Wrong("non-finite weights after training")


def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before: dict, model) -> list[str]:
    now = model.state_dict()
    return [k for k, v in before.items() if not torch.equal(v, now[k])]


def must_refuse(what: str):
    """Reached when a call that only a refusal answers correctly has returned."""
    raise Wrong(f"accepted: {what}")


class Refusals(ValueError):
    """Every call of a folded case was refused: their first lines, joined."""


def all_refused(calls, names) -> str:
    """Run each ``(label, fn[, names])``: each must be refused (a refusal naming ``names``); an accepted call is
    WRONG, a crash is re-raised as it is (the case is then a CRASH)."""
    lines = []
    for label, fn, *own in calls:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            outcome, detail = classify(e, tuple(n.lower() for n in (own or [names])[0]) if own else names)
            if outcome != "refused":
                raise
            lines.append(f"{label}: {first_line(e)[:60]}")
        else:
            raise Wrong(f"accepted: {label}")
    raise Refusals(" | ".join(lines))


def file_bytes(path: str) -> bytes | None:
    return open(path, "rb").read() if os.path.isfile(path) else None


def truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


class SaveEach(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        control.should_save = True


class CrashAfterSave(TrainerCallback):
    """A run killed right after checkpoint-``at`` (no final model)."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        control.should_save = True

    def on_save(self, args, state, control, **kw):
        if state.global_step == self.at:
            raise KeyboardInterrupt


def killed_run(ctx, at: int = 2, total: int = 3) -> str:
    """An output_dir left by a run killed after checkpoint-``at`` of ``total`` iterations."""
    try:
        ctx.trainer(ctx.cfg(total_episodes=4 * total), callbacks=[CrashAfterSave(at)]).train()
    except KeyboardInterrupt:
        pass
    else:
        raise RuntimeError("setup: the run was not interrupted")
    return ctx.path("out")


def finished_run(ctx, iterations: int = 2, **overrides) -> str:
    """A run as a TRL script leaves it: train() (a checkpoint each iteration), then save_model()."""
    t = ctx.trainer(ctx.cfg(total_episodes=4 * iterations, **overrides), callbacks=[SaveEach()])
    t.train()
    t.save_model()
    return ctx.path("out")


# ============================================================================ 1. objects given to PPOTrainer
group("objects")


@case("reward_model: fewer embedding rows than the vocab", "refused", ["reward model", "embedding"])
def _(ctx):
    reward = ctx.small_vocab("cls")
    t = ctx.trainer(ctx.cfg(total_episodes=4), reward_model=reward)
    t.train()
    must_refuse(f"a reward model with {reward.config.vocab_size} rows reads the policy's samples (ids < 185)")


@case("ref_model: fewer embedding rows than the vocab", "refused", ["reference model", "embedding"])
def _(ctx):
    ctx.trainer(ctx.cfg(total_episodes=4), ref_model=ctx.small_vocab("lm"), reward_model=length_reward).train()
    must_refuse("a reference with 50 rows scores the policy's samples")


@case("reward_model: 2-label classifier by path (reward_model=path)", "refused", ["reward model", "labels"])
def _(ctx):
    ctx.scalar(labels=2).save_pretrained(ctx.path("cls2"))
    ctx.trainer(reward_model=ctx.path("cls2")).train()
    must_refuse("a 2-label reward model by path")


@case("value_model: 2-label classifier by path (value_model=path)", "refused", ["value model", "labels"])
def _(ctx):
    ctx.scalar(labels=2).save_pretrained(ctx.path("cls2"))
    ctx.trainer(value_model=ctx.path("cls2"), reward_model=length_reward).train()
    must_refuse("a 2-label value model by path")


@case("model: fp16 policy object", "refused", ["policy", "float16"])
def _(ctx):
    policy = ctx.lm(dtype=torch.float16)
    t = ctx.trainer(processing_class=ctx.tok(), model=policy, reward_model=length_reward)
    t.train()
    params_finite(policy)
    must_refuse("fp16 trainable policy weights (no loss scaling)")


@case("value_model: fp16 object", "refused", ["value model", "float16"])
def _(ctx):
    value = ctx.scalar().half()
    ctx.trainer(value_model=value, reward_model=length_reward).train()
    params_finite(value)
    must_refuse("fp16 trainable value weights")


@case("model: bf16 policy object trains as given", "ok", ["bfloat16", "policy"])
def _(ctx):
    policy = ctx.lm(dtype=torch.bfloat16)
    rows = policy.get_input_embeddings().weight.shape
    before = snapshot(policy)
    t = ctx.trainer(processing_class=ctx.tok(), model=policy, reward_model=length_reward)
    t.train()
    finite_metrics(t)
    params_finite(policy)
    if policy.dtype != torch.bfloat16:
        raise Wrong(f"policy re-typed to {policy.dtype}")
    if policy.get_input_embeddings().weight.shape != rows:
        raise Wrong("policy embedding resized")
    if not changed(before, policy):
        raise Wrong("policy weights unchanged after training (trainer trained a copy?)")
    return "bf16 kept, trained in place"


@case("model: value-head model together with value_model", "refused", ["value_model", "value head"])
def _(ctx):
    ctx.trainer(processing_class=ctx.tok(), model=ctx.vlm(), value_model=ctx.scalar(),
                reward_model=length_reward).train()
    must_refuse("two value functions (v_head and value_model)")


@case("model is ref_model (same object)", "refused", ["ref_model"])
def _(ctx):
    policy = ctx.lm()
    ctx.trainer(processing_class=ctx.tok(), model=policy, ref_model=policy, reward_model=length_reward).train()
    must_refuse("the reference is the trained policy itself (KL always 0)")


@case("processing_class: tokenizer without a pad token", "ok", ["pad"])
def _(ctx):
    tok = ctx.tok()
    tok.pad_token = None
    policy = ctx.lm()
    rows = policy.get_input_embeddings().weight.shape[0]
    t = ctx.trainer(processing_class=tok, model=policy, reward_model=length_reward)
    t.train()
    finite_metrics(t)
    if policy.get_input_embeddings().weight.shape[0] != rows:
        raise Wrong("the user's policy was resized")
    note = f"user's tokenizer now has pad_token={tok.pad_token!r}" if tok.pad_token is not None else "tokenizer untouched"
    return f"trained; {note}"


@case("processing_class: tokenizer without pad and eos tokens", "ok|refused", ["pad", "eos"])  # refused: not changed
def _(ctx):
    tok = ctx.tok()
    tok.pad_token = None
    tok.eos_token = None
    policy = ctx.lm()
    rows = policy.get_input_embeddings().weight.shape[0]
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        t = ctx.trainer(processing_class=tok, model=policy, reward_model=length_reward)
        t.train()
    finite_metrics(t)
    resized = policy.get_input_embeddings().weight.shape[0] != rows
    if resized:
        raise Wrong("the user's policy was resized")
    if "resized" in log.getvalue():
        raise Wrong("the log says 'model embeddings are resized to match' but no model was resized")
    return f"trained; pad added as id {tok.pad_token_id}, embedding kept at {rows} rows"


@case("model: policy with max_position_embeddings < prompt + response", "refused", ["position"])
def _(ctx):
    policy = ctx.lm()
    policy.config.max_position_embeddings = 6
    ctx.trainer(processing_class=ctx.tok(), model=policy, reward_model=length_reward).train()
    must_refuse("prompt + response_length past the policy's 6 positions")


@case("reward_model: max_position_embeddings < prompt + response", "refused", ["reward model", "position"])
def _(ctx):
    ctx.trainer(reward_model=ctx.scalar(max_position_embeddings=6)).train()
    must_refuse("prompt + response past the reward model's 6 positions")


@case("reward fn: raises", "refused", ["reward_fn", "broken"])
def _(ctx):
    def broken(completions, **kw):
        raise KeyError("score")

    ctx.trainer(reward_model=broken).train()
    must_refuse("a raising reward function")


@case("reward fn: returns NaN for every completion", "refused", ["no reward judged", "none or nan"])
def _(ctx):  # NaN is "not judged" (TRL GRPO's); a completion no reward judged has no score
    ctx.trainer(reward_model=lambda completions, **kw: [float("nan")] * len(completions)).train()
    must_refuse("NaN scores")


@case("reward fn: returns an infinity", "refused", ["reward_fn", "infinite"])
def _(ctx):
    ctx.trainer(reward_model=lambda completions, **kw: [float("inf")] * len(completions)).train()
    must_refuse("infinite scores")


@case("reward fn: returns a [B,1] tensor", "ok|refused", ["reward_fn", "shape", "scores"])
def _(ctx):
    given = []

    def column(completions, **kw):
        scores = torch.arange(len(completions), dtype=torch.float32)[:, None]
        given.append(scores.mean().item())
        return scores

    t = ctx.trainer(ctx.cfg(total_episodes=4), reward_model=column)
    t.train()
    logged = t.state.log_history[0]["objective/scores"]
    if abs(logged - given[0]) > 1e-5:
        raise Wrong(f"objective/scores {logged} != mean of the returned scores {given[0]}")
    return "flattened; objective/scores matches"


@case("reward fn: mutates prompts/completions/ids in place", "ok", ["reward_fn"])
def _(ctx):
    seen = []

    def vandal(prompts, completions, prompt_ids, completion_ids, **kw):
        seen.append((list(prompts), list(completions)))
        scores = [float(len(c)) for c in completions]
        completions[:] = ["edited"] * len(completions)
        prompts.clear()
        for ids in (*prompt_ids, *completion_ids):
            if isinstance(ids, list):
                ids.append(3)
                ids[0] = 4
        return scores

    t = ctx.trainer(ctx.cfg(total_episodes=4, num_sample_generations=1), reward_model=vandal)
    t.train()
    finite_metrics(t)
    rows = metrics(ctx.path("out", "samples.jsonl"))
    logged = [(r["query"], r["response"]) for r in rows]
    want = list(zip(*seen[0]))[: len(logged)]
    if not logged:
        raise Wrong("no samples logged")
    if logged != want:
        raise Wrong(f"logged samples differ from what the function was given: {logged[0]} vs {want[0]}")
    return f"{len(logged)} logged samples unchanged"


@case("reward fn: requires a column the eval_dataset lacks", "refused", ["answer", "eval_dataset"])
def _(ctx):
    def graded(prompts, completions, answer, **kw):
        return [float(a == "yes") for a in answer]

    train = [{"prompt": f"the movie was {w}", "answer": "yes"} for w in ("good", "bad", "fun", "dull")]
    t = ctx.trainer(ctx.cfg(num_sample_generations=1, per_device_eval_batch_size=2), reward_model=graded,
                    train_dataset=train, eval_dataset=[{"prompt": "the plot is"}, {"prompt": "the cast"}])
    t.train()
    must_refuse("the eval set cannot be scored by this function")


@case("value_model: a causal LM object (vocab-sized head)", "refused", ["value model"])
def _(ctx):
    ctx.trainer(value_model=ctx.lm(), reward_model=length_reward).train()
    must_refuse("a causal LM's 185 logits read as the value")


@case("model: a PeftModel together with another peft_config", "ok|refused", ["peft"])
def _(ctx):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(ctx.lm(), LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    wanted = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    t = ctx.trainer(processing_class=ctx.tok(), model=policy, reward_model=length_reward, peft_config=wanted)
    ranks = {m.r.get("default") for m in t.policy.modules() if hasattr(m, "r") and isinstance(m.r, dict)}
    if ranks != {8}:
        raise Wrong(f"peft_config (r=8 on q,v) silently ignored: the policy's LoRA ranks are {ranks} "
                    "(TRL 0.26 merges the given adapter and applies peft_config)")
    return "peft_config applied"


@case("optimizers: a user optimizer over the policy only", "ok|refused", ["optimizer", "value"])
def _(ctx):
    policy = ctx.lm()
    value = ctx.scalar()
    before = snapshot(value)
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = ctx.trainer(processing_class=ctx.tok(), model=policy, value_model=value, reward_model=length_reward,
                        optimizers=(torch.optim.AdamW(policy.parameters(), lr=1e-3), None))
        t.train()
    if changed(before, value):
        return "value model trained"
    said = log.getvalue() + " ".join(str(w.message) for w in caught)
    if "optimizer" in said.lower() and "value" in said.lower():
        return "value model not in the optimizer, and the run said so"
    raise Wrong("the value model never trained (the optimizer holds none of its parameters) and nothing said so")


# ============================================================================ 2. datasets
group("datasets")


def _padded(ctx, side: str):
    tok = ctx.tok()
    tok.padding_side = side
    prompts = ["the movie was", "i think the whole plot of it is", "overall the cast", "the ending felt"] * 2
    enc = tok(prompts, padding=True)
    data = datasets.Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    t = ctx.trainer(train_dataset=data, reward_model=length_reward)
    want = [tok(p)["input_ids"] for p in prompts]
    if t.prompts != want:
        raise Wrong(f"prompts keep padding: {t.prompts[0]} vs {want[0]}")
    t.train()
    finite_metrics(t)
    return "padding stripped by attention_mask; trained"


@case("pre-tokenized, left-padded + attention_mask", "ok", ["input_ids", "attention_mask"])
def _(ctx):
    return _padded(ctx, "left")


@case("pre-tokenized: token id >= vocab size", "refused", ["vocabulary", "token id"])
def _(ctx):
    ctx.trainer(train_dataset=[{"input_ids": [5, 6, 7]}, {"input_ids": [5, 10_000]}] * 4,
                reward_model=length_reward).train()
    must_refuse("token id 10000 past a 185-token vocabulary")


@case("pre-tokenized: -100 (label padding) in input_ids", "refused", ["vocabulary", "token id"])
def _(ctx):
    ctx.trainer(train_dataset=[{"input_ids": [5, 6, 7, -100]}] * 8, reward_model=length_reward).train()
    must_refuse("id -100")


@case("some empty prompts are dropped", "ok", ["prompt"])
def _(ctx):
    rows = [{"prompt": p} for p in ("the movie was", "", "i think", "", "the cast is", "overall")]
    t = ctx.trainer(train_dataset=rows, reward_model=length_reward)
    if any(len(p) == 0 for p in t.prompts) or len(t.prompts) != 4:
        raise Wrong(f"prompts after dropping empties: {t.prompts}")
    t.train()
    finite_metrics(t)
    return "2 empty prompts dropped, trained"


@case("empty datasets.Dataset", "refused", ["empty", "no prompts"])
def _(ctx):
    ctx.trainer(train_dataset=datasets.Dataset.from_dict({"prompt": []}), reward_model=length_reward).train()
    must_refuse("zero rows")


@case("chat messages, tokenizer with a chat template", "ok", ["chat"])
def _(ctx):
    tok = ctx.tok()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    rows = [{"prompt": [{"role": "user", "content": c}]} for c in ("the movie was", "i think the plot is")] * 4
    t = ctx.trainer(processing_class=tok, model=ctx.lm(), train_dataset=rows, reward_model=length_reward)
    texts = tok.batch_decode(t.prompts[:2])
    if texts != ["the movie was", "i think the plot is"]:
        raise Wrong(f"chat prompts tokenized as {texts}")
    t.train()
    finite_metrics(t)
    return "template applied, trained"


@case("list of dicts with a text column", "ok", ["prompt"])
def _(ctx):
    rows = [{"prompt": "the movie was", "id": i} for i in range(8)]
    t = ctx.trainer(train_dataset=rows, reward_model=length_reward)
    t.train()
    finite_metrics(t)
    if len(t.prompts) != 8:
        raise Wrong(f"{len(t.prompts)} prompts from 8 rows")
    return "8 prompts, trained"


@case("missing text column (and no input_ids)", "refused", ["column"])
def _(ctx):
    ctx.trainer(train_dataset=[{"question": "the movie was"}] * 8, reward_model=length_reward).train()
    must_refuse("no prompt column")


# ============================================================================ 3. config values
group("config")


@case("temperature 1e-6 and 1e-3", "refused", ["temperature"])
def _(ctx):
    return all_refused([(f"T={t}", lambda t=t: ctx.trainer(ctx.cfg(temperature=t, total_episodes=4)).train())
                        for t in (1e-6, 1e-3)], ("temperature",))


@case("temperature 0.01 trains with finite metrics", "ok", ["temperature"])
def _(ctx):
    t = ctx.trainer(ctx.cfg(temperature=0.01))
    t.train()
    finite_metrics(t)
    return f"kl {t.state.log_history[-1]['objective/kl']:.3g}"


@case("response_length 0", "refused", ["response_length"])
def _(ctx):
    ctx.trainer(ctx.cfg(response_length=0)).train()
    must_refuse("no response tokens to train")


@case("learning_rate 0", "refused", ["learning_rate"])
def _(ctx):
    ctx.trainer(ctx.cfg(learning_rate=0.0)).train()
    must_refuse("lr 0 (docs/usage.md says learning_rate <= 0 is refused)")


@case("num_mini_batches not dividing the batch", "refused", ["num_mini_batches"])
def _(ctx):
    ctx.trainer(ctx.cfg(num_mini_batches=3)).train()
    must_refuse("4 rows into 3 minibatches")


@case("total_episodes smaller than one batch", "ok|refused", ["total_episodes", "batch"])
def _(ctx):
    t = ctx.trainer(ctx.cfg(total_episodes=3))
    t.train()
    if t.state.global_step != 1:
        raise Wrong(f"{t.state.global_step} iterations for 3 episodes with a batch of 4 (TRL: ceil = 1)")
    return f"1 iteration, {t.state.episode} episodes"


@case("dtype float16 via model_args", "refused", ["float16"])
def _(ctx):
    ctx.trainer(model_args=ModelConfig(dtype="float16"), reward_model=length_reward).train()
    must_refuse("fp16 trainable weights via --dtype")


# ============================================================================ 4. callbacks
group("callbacks")


class Recorder(TrainerCallback):
    instances: list = []

    def __init__(self):
        Recorder.instances.append(self)
        self.events = []

    def on_train_begin(self, args, state, control, **kw):
        self.events.append("train_begin")

    def on_log(self, args, state, control, logs=None, **kw):
        self.events.append("log")


@case("callbacks: a class instead of an instance", "ok", ["callback"])
def _(ctx):
    Recorder.instances.clear()
    t = ctx.trainer(callbacks=[Recorder])
    t.train()
    if len(Recorder.instances) != 1 or Recorder.instances[0].events.count("log") != 2:
        raise Wrong(f"instances {len(Recorder.instances)}, events "
                    f"{Recorder.instances[0].events if Recorder.instances else None}")
    return "instantiated once, saw train_begin and 2 logs"


@case("callbacks: on_log edits its logs", "ok", ["callback"])
def _(ctx):
    class Editor(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            logs["objective/scores"] = float("nan")
            logs.pop("objective/kl", None)
            logs["injected"] = 1.0

    t = ctx.trainer(callbacks=[Editor()])
    t.train()
    rows = metrics(ctx.path("out", "metrics.jsonl"))
    for where, data in (("metrics.jsonl", rows), ("log_history", t.state.log_history)):
        for row in data:
            if not math.isfinite(row["objective/scores"]) or "objective/kl" not in row or "injected" in row:
                raise Wrong(f"a callback's edit reached {where}: {sorted(row)[:5]}")
    return "metrics.jsonl and log_history unchanged"


@case("callbacks: should_training_stop after iteration 1 of 3", "ok", ["callback"])
def _(ctx):
    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step >= 1

    t = ctx.trainer(ctx.cfg(total_episodes=12), callbacks=[Stop()])
    t.train()
    out = ctx.path("out")
    problems = []
    if t.state.global_step != 1:
        problems.append(f"global_step {t.state.global_step}")
    if len(metrics(os.path.join(out, "metrics.jsonl"))) != 1:
        problems.append("metrics rows != 1")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        problems.append("train() wrote a final model (TRL's writes save_strategy's checkpoints only)")
    if not os.path.isdir(os.path.join(out, "checkpoint-1")):
        problems.append("no checkpoint-1 to continue from")
    if problems:
        raise Wrong("; ".join(problems))
    return "stopped at 1, checkpoint-1 to continue from"


@case("callbacks: should_save at iteration 1", "ok", ["callback"])
def _(ctx):
    saves = []

    class Save(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_save = state.global_step == 1

        def on_save(self, args, state, control, **kw):
            saves.append(state.global_step)

    ctx.trainer(ctx.cfg(total_episodes=12), callbacks=[Save()]).train()
    if not os.path.isdir(ctx.path("out", "checkpoint-1")) or 1 not in saves:
        raise Wrong(f"checkpoint-1 missing or on_save not called ({saves})")
    return f"checkpoint-1 written, on_save at {saves}"


@case("callbacks: a plain function, not a TrainerCallback", "refused", ["callback"])
def _(ctx):
    t = ctx.trainer(callbacks=[lambda *a, **k: None])
    t.train()
    must_refuse("a function as a callback (its events cannot be called)")


# ============================================================================ 5. lifecycle and resume
group("lifecycle")


@case("train() twice on one trainer", "refused", ["train()"])
def _(ctx):
    t = ctx.trainer()
    t.train()
    try:
        t.train()
    finally:
        steps = [m["step"] for m in t.state.log_history]
        if steps != [1, 2]:
            raise Wrong(f"log_history steps after the second train(): {steps}")
    must_refuse("a second train() on a spent schedule")


@case("two trainers on one output_dir, both trained", "ok", ["afresh"])
def _(ctx):
    # from Python, as TRL's Trainer: the second run replaces the first's files (fastppo's command line refuses)
    first, second = ctx.trainer(), ctx.trainer()
    first.train()
    out = ctx.path("out")
    steps = [row["step"] for row in metrics(os.path.join(out, "metrics.jsonl"))]
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("the user's own file")
    second.train()
    if [row["step"] for row in metrics(os.path.join(out, "metrics.jsonl"))] != steps:
        raise Wrong("the second run's metrics.jsonl mixes in the first's lines")
    if file_bytes(os.path.join(out, "notes.txt")) != b"the user's own file":
        raise Lost("the user's own file beside the first run was deleted by the second")
    return "the second run started afresh; the user's own file kept"


@case("resume_from_checkpoint=True continues from the latest", "ok", ["checkpoint"])
def _(ctx):
    class StopAt1(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = control.should_save = state.global_step == 1

    ctx.trainer(ctx.cfg(total_episodes=12), callbacks=[StopAt1()]).train()
    t = ctx.trainer(ctx.cfg(total_episodes=12, resume_from_checkpoint=True))
    t.train()
    steps = [m["step"] for m in metrics(ctx.path("out", "metrics.jsonl"))]
    if steps != [1, 2, 3]:
        raise Wrong(f"metrics steps after resuming: {steps}")
    return "steps [1, 2, 3]"


@case("resume with a changed learning_rate", "refused", ["learning_rate"])
def _(ctx):
    killed_run(ctx, at=1, total=2)
    ctx.trainer(ctx.cfg(total_episodes=8, learning_rate=1e-4, resume_from_checkpoint="latest")).train()
    must_refuse("the saved optimizer state would put the old lr back")


@case("resume a finished run with smaller max_steps", "refused", ["max_steps", "nothing is left"])
def _(ctx):
    out = finished_run(ctx, iterations=3)
    model = file_bytes(os.path.join(out, "model.safetensors"))
    try:
        ctx.trainer(ctx.cfg(total_episodes=12, max_steps=2, resume_from_checkpoint="latest")).train()
    finally:
        if file_bytes(os.path.join(out, "model.safetensors")) != model:
            raise Lost("the finished run's final model was replaced")
    must_refuse("max_steps already reached")


@case("resume a finished run with larger max_steps", "ok", ["max_steps"])
def _(ctx):
    out = finished_run(ctx, iterations=2)
    ctx.trainer(ctx.cfg(total_episodes=8, max_steps=3, resume_from_checkpoint="latest")).train()
    steps = [m["step"] for m in metrics(os.path.join(out, "metrics.jsonl"))]
    if steps != [1, 2, 3]:
        raise Wrong(f"metrics steps {steps}")
    return "continued to step 3"


def _damaged(ctx, name: str) -> str:
    """A run killed after checkpoint-2 of 3, then ``name`` in checkpoint-2 truncated: resuming by path must be
    refused naming the file; 'latest' must skip checkpoint-2 and continue from checkpoint-1."""
    out = killed_run(ctx, at=2, total=3)
    truncate(os.path.join(out, "checkpoint-2", name))
    try:
        ctx.trainer(ctx.cfg(total_episodes=12, resume_from_checkpoint=os.path.join(out, "checkpoint-2"))).train()
    except Exception as e:  # noqa: BLE001
        outcome, detail = classify(e, (name.lower(),))
        if outcome != "refused":
            raise
        by_path = f"by path: {type(e).__name__} names {name}"
    else:
        raise Wrong(f"resumed from a checkpoint with a truncated {name}")
    t = ctx.trainer(ctx.cfg(total_episodes=12, resume_from_checkpoint="latest"))
    if not str(t._resume_path).endswith("checkpoint-1"):
        raise Wrong(f"{by_path}; but latest resolved to {t._resume_path}")
    t.train()
    steps = [m["step"] for m in metrics(os.path.join(out, "metrics.jsonl"))]
    if steps != [1, 2, 3]:
        raise Wrong(f"{by_path}; metrics steps after the fallback: {steps}")
    return f"{by_path}; 'latest' fell back to checkpoint-1 and trained to 3"


@case("truncated trainer_state.pt in the latest checkpoint", "ok", ["trainer_state.pt"])
def _(ctx):
    return _damaged(ctx, "trainer_state.pt")


@case("truncated model.safetensors in the latest checkpoint", "ok", ["model.safetensors"])
def _(ctx):
    return _damaged(ctx, "model.safetensors")


@case("a failed first iteration leaves the output_dir usable", "ok", ["output_dir"])
def _(ctx):
    def broken(completions, **kw):
        raise RuntimeError("reward server down")

    try:
        ctx.trainer(reward_model=broken).train()
    except Exception as e:  # noqa: BLE001
        if "reward server down" not in str(e):
            raise
    else:
        raise Wrong("the broken reward function did not stop the run")
    t = ctx.trainer(reward_model=length_reward)
    t.train()
    return "same directory trained afterwards"


@case("overwrite_output_dir where output_dir is the user's own model dir", "refused",
      ["output_dir", "model"])
def _(ctx):
    mine = ctx.path("mymodel")
    shutil.copytree(ctx.model_dir, mine)
    original = file_bytes(os.path.join(mine, "model.safetensors"))
    try:
        ctx.trainer(ctx.cfg(name="mymodel", overwrite_output_dir=True), model=mine, processing_class=mine,
                    reward_model=length_reward).train()
    finally:
        if file_bytes(os.path.join(mine, "model.safetensors")) != original:
            raise Lost("the user's source checkpoint (not a fastppo run) was deleted/replaced by "
                       "overwrite_output_dir")
    return "trained; the source checkpoint's weights survived"


@case("resume with a policy object of another shape", "refused", ["policy", "checkpoint"])
def _(ctx):
    killed_run(ctx, at=1, total=2)
    config = AutoConfig.from_pretrained(ctx.model_dir)
    config.intermediate_size = 96
    other = AutoModelForCausalLM.from_config(config)
    before = snapshot(other)
    try:
        ctx.trainer(ctx.cfg(total_episodes=8, resume_from_checkpoint="latest"), processing_class=ctx.tok(),
                    model=other, reward_model=length_reward).train()
    except Exception as e:  # noqa: BLE001
        touched = changed(before, other)
        if touched and classify(e, ("policy", "checkpoint"))[0] != "refused":
            raise Crash(f"{type(e).__name__} from {_raising_frame(e)} ({first_line(e)}), after overwriting "
                        f"{len(touched)} of the user's policy tensors with the checkpoint's") from e
        raise
    must_refuse("checkpoint weights of another shape")


# ============================================================================ 6. legacy generate()/step()
group("legacy")


def _qr(ctx):
    tok = ctx.tok()
    queries = [torch.tensor(tok(t)["input_ids"]) for t in ("the movie was", "overall the cast is")]
    responses = [torch.tensor([10, 11, 12, 13]), torch.tensor([20, 21, 22, 23, 24, 25])]
    return queries, responses


def _step_scores(ctx, scores, want_mean):
    q, r = _qr(ctx)
    stats = ctx.legacy().step(q, r, scores)
    got = float(stats["ppo/mean_scores"])
    if abs(got - want_mean) > 1e-5:
        raise Wrong(f"ppo/mean_scores {got} != {want_mean}")
    bad = [k for k in ("ppo/loss/total", "ppo/loss/policy", "ppo/loss/value") if not math.isfinite(float(stats[k]))]
    if bad:
        raise Wrong(f"non-finite {bad}")
    return f"mean_scores {got}"


@case("step: scores as a tensor of shape [2]", "ok|refused", ["scores"])
def _(ctx):
    return _step_scores(ctx, torch.tensor([1.0, 3.0]), 2.0)


@case("step: scores as a tensor of shape [B,1]", "ok|refused", ["scores"])
def _(ctx):
    return _step_scores(ctx, torch.tensor([[1.0], [3.0]]), 2.0)


@case("step: scores as python floats", "ok", ["scores"])
def _(ctx):
    return _step_scores(ctx, [1.0, 3.0], 2.0)


@case("generate: temperature=0.0 / max_new_tokens=-1 / batch_size=0", "refused",
      ["temperature", "max_new_tokens", "batch_size"])
def _(ctx):
    q, _ = _qr(ctx)
    trainer = ctx.legacy()
    calls = [("temperature=0.0", dict(temperature=0.0, max_new_tokens=3), "temperature"),
             ("max_new_tokens=-1", dict(max_new_tokens=-1), "max_new_tokens"),
             ("batch_size=0", dict(batch_size=0, max_new_tokens=3), "batch_size")]
    return all_refused([(label, lambda kw=kw: trainer.generate(q, return_prompt=False, **kw), name)
                        for label, kw, name in calls], ())


@case("generate: query + max_new_tokens past the positions", "refused", ["position"])
def _(ctx):
    trainer = ctx.legacy()
    limit = trainer.model.pretrained_model.config.max_position_embeddings
    trainer.generate([torch.randint(3, 150, (limit - 2,))], max_new_tokens=8)
    must_refuse("generation past the model's positions")


@case("step: query + response past the positions", "refused", ["position"])
def _(ctx):
    trainer = ctx.legacy()
    limit = trainer.model.pretrained_model.config.max_position_embeddings
    trainer.step([torch.randint(3, 150, (limit - 2,)), torch.tensor([5, 6])],
                 [torch.randint(3, 150, (6,)), torch.tensor([7, 8])], [1.0, 0.0])
    must_refuse("a sample past the model's positions")


@case("step: response_masks all zeros", "refused", ["response_masks", "train on"])
def _(ctx):
    q, r = _qr(ctx)
    trainer = ctx.legacy()
    before = snapshot(trainer.model)
    stats = trainer.step(q, r, [1.0, 0.0], response_masks=[torch.zeros(len(x)) for x in r])
    params_finite(trainer.model)
    if changed(before, trainer.model):
        raise Wrong("weights changed with every token masked out")
    must_refuse(f"nothing to train on (loss {float(stats['ppo/loss/total'])})")


@case("step: -100 padding ids in a response", "refused", ["token", "response"])
def _(ctx):
    q, r = _qr(ctx)
    r[1] = torch.tensor([20, 21, 22, -100, -100, -100])
    ctx.legacy().step(q, r, [1.0, 0.0])
    must_refuse("negative token ids")


@case("dataset of tuple rows, no collator", "ok", ["collat", "dataset"])
def _(ctx):
    pairs = [(torch.arange(3) + i, torch.arange(2) + i) for i in range(4)]
    trainer = ctx.legacy(dataset=pairs)
    batch = next(iter(trainer.dataloader))
    if not (isinstance(batch, (tuple, list)) and batch[0].shape == (2, 3) and batch[1].shape == (2, 2)):
        raise Wrong(f"batch {type(batch).__name__} {[getattr(b, 'shape', None) for b in batch]}")
    return "tuple of stacked tensors"


@case("num_shared_layers=1 without ref_model", "ok", ["num_shared_layers"])
def _(ctx):
    model = ctx.vlm()
    trainer = ctx.legacy(model=model, num_shared_layers=1)
    q, r = _qr(ctx)
    before = snapshot(model)
    trainer.step(q, r, [1.0, -1.0])
    moved = changed(before, model)
    shared = [k for k in moved if "embed_tokens" in k or ".layers.0." in k]
    if shared:
        raise Wrong(f"shared (frozen) parameters changed: {shared[:3]}")
    if not moved:
        raise Wrong("nothing trained")
    ref = dict(trainer.ref_model.named_parameters())
    pol = dict(model.named_parameters())
    diff = [k for k in ref if (".layers.0." in k or "embed_tokens" in k) and k in pol and not torch.equal(ref[k], pol[k])]
    if diff:
        raise Wrong(f"reference's shared layers differ from the policy's: {diff[:2]}")
    return f"layers < 1 frozen; {len(moved)} tensors trained"


@case("num_shared_layers=1 with a ref_model", "ok", ["num_shared_layers"])
def _(ctx):
    model, ref = ctx.vlm(), ctx.vlm()
    config = legacy.PPOConfig(batch_size=2, mini_batch_size=2, learning_rate=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = legacy.PPOTrainer(config, model, ref, ctx.tok(), num_shared_layers=1)
    if not any("num_shared_layers" in str(w.message) for w in caught):
        raise Wrong("no warning that num_shared_layers is ignored")
    if trainer.ref_model is not ref:
        raise Wrong("the given ref_model was not used")
    q, r = _qr(ctx)
    trainer.step(q, r, [1.0, -1.0])
    return "warned, given reference used"


@case("generate: length_sampler returning 0", "refused", ["max_new_tokens", "length"])
def _(ctx):
    q, _ = _qr(ctx)
    out = ctx.legacy().generate(q, length_sampler=lambda: 0, return_prompt=False)
    must_refuse(f"0 new tokens (got lengths {[len(x) for x in out]})")


@case("generate: max_new_tokens as a numpy int (np.random.choice)", "ok", ["max_new_tokens"])
def _(ctx):
    import numpy as np

    q, _ = _qr(ctx)
    out = ctx.legacy().generate(q, return_prompt=False, max_new_tokens=np.int64(3))
    if len(out) != 2 or any(len(x) > 3 or len(x) == 0 for x in out):
        raise Wrong(f"response lengths {[len(x) for x in out]}")
    return "accepted"


# ============================================================================ the runner


def run_case(c: Case, model_dir: str) -> Result:
    tmp = tempfile.mkdtemp(prefix="case-", dir=_SWEEP_ROOT)
    ctx = Ctx(tmp, model_dir)
    log = io.StringIO()
    start = time.perf_counter()
    outcome, detail, etype, tb = "ok", "", None, None

    def on_alarm(signum, frame):
        raise Hang(f"ran past {c.timeout} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(c.timeout)
    torch.manual_seed(0)
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = c.fn(ctx)
        detail = value if isinstance(value, str) else ""
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001  (the classification is the point)
        outcome, detail = classify(e, c.names)
        etype = type(e).__name__
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        shutil.rmtree(tmp, ignore_errors=True)
    tail = [line for line in log.getvalue().splitlines() if line.strip()][-15:]
    return Result(c.name, c.group, c.expected, outcome, detail, time.perf_counter() - start, etype, tb, tail)


def table(results: list[Result]) -> str:
    w = max([len(r.name) for r in results] + [4])
    lines = [f"  {'case':<{w}} | {'expected':<10} | {'outcome':<8} | detail", "-" * (w + 60)]
    group_name = None
    for r in results:
        if r.group != group_name:
            group_name = r.group
            lines.append(f"[{group_name}]")
        mark = " " if r.matches else "!"
        detail = r.detail if len(r.detail) <= 160 else r.detail[:157] + "..."
        lines.append(f"{mark} {r.name:<{w}} | {r.expected:<10} | {r.outcome:<8} | {detail}")
    counts = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    lines.append("-" * (w + 60))
    lines.append(f"{len(results)} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                 + f"; {sum(not r.matches for r in results)} not as expected")
    return "\n".join(lines)


def write_json(path: str | None, results: list[Result], finished: bool) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"finished": finished, "torch": torch.__version__, "transformers": transformers.__version__,
                   "results": [r.__dict__ | {"matches": r.matches} for r in results]}, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[],
                        help="run only cases whose name or group contains this (case-insensitive; repeatable)")
    parser.add_argument("--json", help="write the results (with tracebacks and log tails) to this file")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--verbose", "-v", action="store_true", help="print each non-ok case's traceback")
    args = parser.parse_args(argv)
    selected = [c for c in CASES if not args.only or any(
        s.lower() in c.name.lower() or s.lower() == c.group for s in args.only)]
    if args.list:
        for c in selected:
            print(f"[{c.group}] {c.name}  (expected {c.expected})")
        return 0
    torch.set_num_threads(1)
    model_dir = embedded_model_path()
    results: list[Result] = []
    current: list = [None, 0.0]

    def watchdog():  # SIGALRM cannot interrupt a call blocked in C: end the sweep with what it has
        while True:
            time.sleep(5)
            c, since = current
            if c is not None and time.perf_counter() - since > c.timeout + 60:
                results.append(Result(c.name, c.group, c.expected, "HANG", "blocked; SIGALRM did not interrupt it",
                                       time.perf_counter() - since))
                print(table(results), flush=True)
                write_json(args.json, results, finished=False)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    sweep_start = time.perf_counter()
    for i, c in enumerate(selected, 1):
        current[:] = [c, time.perf_counter()]
        r = run_case(c, model_dir)
        current[:] = [None, 0.0]
        results.append(r)
        print(f"[{i}/{len(selected)}] {'  ' if r.matches else '! '}{r.outcome:<8} {r.name} ({r.seconds:.1f}s)",
              file=sys.stderr, flush=True)
        if args.verbose and r.outcome not in ("ok", "refused") and r.traceback:
            print(r.traceback, file=sys.stderr)
    print(table(results))
    print(f"sweep: {time.perf_counter() - sweep_start:.0f} s")
    write_json(args.json, results, finished=True)
    shutil.rmtree(_SWEEP_ROOT, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
