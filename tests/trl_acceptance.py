#!/usr/bin/env python
"""Run TRL's own PPO and GRPO tests and PPO example scripts against fastppo, out of tree.

    python tests/trl_acceptance.py [--trl026 /path/to/trl-v0.26.2] [--trl011 /path/to/trl-v0.11.4] \
        [--trl116 /path/to/trl-v1.16.0 [--trl116-env DIR]] [--workdir DIR] [--only NAME ...] [--timeout SECONDS]

A target runs when its checkout is given (``--only`` narrows them further). TRL 1.16's
``tests/test_grpo_trainer.py`` runs with ``GRPOConfig``/``GRPOTrainer`` from fastppo while its
other ``trl`` imports (``trl.import_utils``) stay TRL 1.16's, from ``--trl116-env`` (default
the environment's, ``bench/trl_envs.py``) put first on PYTHONPATH; the PPO and legacy targets get the PPO peer's
TRL 0.26.2 first instead (``--trl026-env``, default ``.trl026``). ``trl116-test_grpo_trainer-baseline``
runs the same file unchanged against TRL 1.16's own GRPOTrainer, on the same stand-ins and
exclusions, to tell a stand-in's limits from fastppo's; it runs only when ``--only`` names it.

TRL's files are copied into the work dir at run time (never into this repository)
and only their import lines change: TRL's PPO names come from fastppo, and the few
helpers TRL's test suite provides itself (``testing_utils``, ``testing_constants``,
``trl.core.respond_to_batch``) come from small stand-ins written here. There is no
Hub: every Hub id the targets load gets a tiny, randomly initialised local stand-in
at that same relative path inside the work dir, and every target runs with the work
dir as its current directory, so ``from_pretrained("gpt2")`` and
``load_dataset("trl-internal-testing/zen", ...)`` resolve to those directories.

Not a pytest file (pytest collects test_*.py only): it runs pytest itself, one
subprocess per target, and prints a summary table (also WORKDIR/summary.json).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from trl_envs import trl026_dir, trl1_dir  # noqa: E402
STANDIN_VERSION = 4  # bump when a stand-in's contents change, so cached work dirs rebuild

# --------------------------------------------------------------------------------------
# The targets
# --------------------------------------------------------------------------------------

# One line of TRL -> one line of fastppo (joined with ';' where it becomes two
# statements) so that line numbers in tracebacks still match TRL's file.
_TRL011_MAIN = ("from trl import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, "
                 "PPOTrainer, set_seed")
_FASTPPO011_MAIN = ("from fastppo.legacy import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed; "
                    "from trl_standins import AutoModelForSeq2SeqLMWithValueHead")
REWRITES_026_TEST = {
    "from trl.experimental.ppo import PPOConfig, PPOTrainer": "from fastppo import PPOConfig, PPOTrainer",
    "from trl.experimental.ppo.ppo_trainer import masked_mean, masked_var, masked_whiten":
        "from fastppo.kernels import masked_mean, masked_var, masked_whiten",
}
REWRITES_026_SCRIPT = {
    "from trl import ModelConfig, ScriptArguments, get_kbit_device_map, get_peft_config, get_quantization_config":
        "from fastppo.cli import ModelConfig, ScriptArguments, get_kbit_device_map, get_peft_config, "
        "get_quantization_config",
    "from trl.experimental.ppo import PPOConfig, PPOTrainer": "from fastppo import PPOConfig, PPOTrainer",
}
REWRITES_011_TEST = {
    _TRL011_MAIN: _FASTPPO011_MAIN,
    "from trl.core import respond_to_batch": "from trl_standins import respond_to_batch",
}
REWRITES_011_VHEAD = {
    "from trl import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, create_reference_model":
        "from fastppo.legacy import AutoModelForCausalLMWithValueHead, create_reference_model; "
        "from trl_standins import AutoModelForSeq2SeqLMWithValueHead",
}
REWRITES_011_SCRIPT = {
    _TRL011_MAIN: _FASTPPO011_MAIN,
    "from trl.core import LengthSampler": "from fastppo.legacy import LengthSampler",
    # transformers 5 removed the text-classification pipeline's `return_all_scores=True`, which
    # this script passes; a shim maps it to `top_k=None` (in label order). Not a TRL import, but
    # still only an import line, and the incompatibility is transformers', not fastppo's.
    "from transformers import AutoTokenizer, HfArgumentParser, is_torch_npu_available, is_torch_xpu_available, "
    "pipeline":
        "from transformers import AutoTokenizer, HfArgumentParser, is_torch_npu_available, "
        "is_torch_xpu_available; from trl_standins import pipeline",
}

# TRL 1.16's GRPO test: only the two names under test change; its other trl imports (trl.import_utils) stay
# TRL 1.16's, which the target has on its path (Target.trl_env), since they are TRL's helpers, not the API.
REWRITES_116_TEST = {"from trl import GRPOConfig, GRPOTrainer": "from fastppo import GRPOConfig, GRPOTrainer"}
REWRITES_116_RLOO = {"from trl import RLOOConfig, RLOOTrainer": "from fastppo import RLOOConfig, RLOOTrainer"}
ALLOW_TRL_116 = r"from trl\.(import_utils|rewards|data_utils|chat_template_utils) import "

OUT_OF_SCOPE = "encoder-decoder (seq2seq) value-head models are out of fastppo's scope"
# Tests that run, but whose assertions cannot hold on random stand-in weights. A (note, regex) entry notes
# only a failure whose message matches (another failure of that test is the trainer's own).
STANDIN_LIMITS = {
    "PPOTrainerTester::test_loss_trainer":
        "asserts loss constants (1.8226, 0.1260) computed from the real Hub checkpoint's weights",
    # TRL 1.16's GRPO tests that mock generate() with the real Qwen vocabulary's token ids (151643 = pad,
    # 151645 = <|im_end|>, ...): past the stand-ins' ~1.2k-token embeddings
    "TestGRPOTrainer::test_train_with_mask_truncated_completions":
        ("its mocked generate() returns the real Qwen vocabulary's token ids (151645, ...)", r"IndexError"),
}


@dataclass
class Target:
    name: str
    trl: str                      # "trl026", "trl011" or "trl116": which checkout the file comes from
    src: str                      # path inside that checkout
    dest: str                     # path inside the target dir (a package path for tests)
    rewrites: dict
    kind: str = "pytest"          # "pytest" or "script"
    out_of_scope: list = field(default_factory=list)   # regexes on "Class::test"
    args: list = field(default_factory=list)           # script flags ({out} = its output dir)
    saves_model: bool = True
    trl_env: bool = False         # run with TRL 1.16 (--trl116-env) first on PYTHONPATH
    allow_trl: str = ""           # regex: trl import lines that may stay (empty: none; the rest are shadowed)
    expect: dict = field(default_factory=dict)         # test-module name -> package it must come from
    baseline: bool = False        # TRL's own trainer under test: runs only when --only names it


TARGETS = [
    Target("trl026-test_ppo_trainer", "trl026", "tests/experimental/test_ppo_trainer.py",
           "trl_tests/experimental/test_ppo_trainer.py", REWRITES_026_TEST),
    Target("trl011-test_ppo_trainer", "trl011", "tests/test_ppo_trainer.py",
           "trl_tests/test_ppo_trainer.py", REWRITES_011_TEST,
           out_of_scope=[r"::test_\w+_\d+_t5$"]),  # parameterized T5 case
    Target("trl011-test_modeling_value_head", "trl011", "tests/test_modeling_value_head.py",
           "trl_tests/test_modeling_value_head.py", REWRITES_011_VHEAD,
           out_of_scope=[r"^Seq2Seq\w*::"]),
    Target("trl116-test_grpo_trainer", "trl116", "tests/test_grpo_trainer.py", "trl_tests/test_grpo_trainer.py",
           REWRITES_116_TEST, trl_env=True, allow_trl=ALLOW_TRL_116,
           expect={"GRPOConfig": "fastppo", "GRPOTrainer": "fastppo"}),
    # the same file unchanged, on TRL 1.16's own GRPOTrainer: what the stand-ins let pass (a fastppo failure
    # that also fails here is the stand-in's, or the test's, not fastppo's)
    Target("trl116-test_grpo_trainer-baseline", "trl116", "tests/test_grpo_trainer.py",
           "trl_tests/test_grpo_trainer.py", {}, trl_env=True, allow_trl=".",
           expect={"GRPOConfig": "trl", "GRPOTrainer": "trl"}, baseline=True),
    Target("trl116-test_rloo_trainer", "trl116", "tests/test_rloo_trainer.py", "trl_tests/test_rloo_trainer.py",
           REWRITES_116_RLOO, trl_env=True, allow_trl=ALLOW_TRL_116,
           expect={"RLOOConfig": "fastppo", "RLOOTrainer": "fastppo"}),
    Target("trl116-test_rloo_trainer-baseline", "trl116", "tests/test_rloo_trainer.py",
           "trl_tests/test_rloo_trainer.py", {}, trl_env=True, allow_trl=".",
           expect={"RLOOConfig": "trl", "RLOOTrainer": "trl"}, baseline=True),
    # The 0.26 scripts run their own docstring's command, with the sizes shrunk.
    Target("trl026-examples-ppo", "trl026", "examples/scripts/ppo/ppo.py", "ppo.py", REWRITES_026_SCRIPT,
           kind="script", args=[
               "--dataset_name", "trl-internal-testing/descriptiveness-sentiment-trl-style",
               "--dataset_train_split", "descriptiveness", "--learning_rate", "3e-6", "--output_dir", "{out}",
               "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
               "--per_device_eval_batch_size", "25", "--total_episodes", "8", "--num_ppo_epochs", "1",
               "--num_mini_batches", "1", "--local_rollout_forward_batch_size", "2", "--response_length", "8",
               "--model_name_or_path", "EleutherAI/pythia-1b-deduped", "--missing_eos_penalty", "1.0",
               "--report_to", "none"]),  # no --sft_model_path/--reward_model_path: PPOConfig's defaults, as TRL's
    Target("trl026-examples-ppo_tldr", "trl026", "examples/scripts/ppo/ppo_tldr.py", "ppo_tldr.py",
           REWRITES_026_SCRIPT, kind="script", args=[
               "--dataset_name", "trl-lib/tldr", "--dataset_test_split", "validation", "--learning_rate", "3e-6",
               "--output_dir", "{out}", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2",
               "--per_device_eval_batch_size", "8", "--total_episodes", "8", "--num_ppo_epochs", "1",
               "--response_length", "8", "--model_name_or_path", "EleutherAI/pythia-1b-deduped",
               "--sft_model_path", "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr",
               "--reward_model_path", "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr",
               "--missing_eos_penalty", "1.0", "--stop_token", "eos", "--eval_strategy", "steps",
               "--eval_steps", "100", "--report_to", "none"]),
    # PPOConfig's own defaults name the Hub ids (gpt2, stanfordnlp/imdb, lvwerra/distilbert-imdb);
    # the script trains one pass over the dataset and saves nothing, so only its exit code counts.
    Target("trl011-examples-ppo", "trl011", "examples/scripts/ppo.py", "ppo.py", REWRITES_011_SCRIPT,
           kind="script", args=["--batch_size", "4", "--mini_batch_size", "2"], saves_model=False),
]

# --------------------------------------------------------------------------------------
# Stand-in modules written next to the copied files (this harness's own code)
# --------------------------------------------------------------------------------------

STANDINS_PY = '''\
"""Stand-ins for TRL names fastppo does not provide (written by fastppo's tests/trl_acceptance.py)."""
import torch


def respond_to_batch(model, queries, txt_len=20, top_k=0, top_p=1.0):
    """Sample txt_len tokens after `queries` (batch, seq); return just the new tokens.
    (A test helper, not under test: fastppo has no such function.)"""
    ids = queries
    with torch.no_grad():
        for _ in range(txt_len):
            out = model(ids)
            logits = (out[0] if isinstance(out, tuple) else out.logits)[:, -1, :].float()
            if top_k > 0:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            if top_p < 1.0:
                probs, order = torch.softmax(logits, -1).sort(dim=-1, descending=True)
                drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set reaching top_p
                logits = logits.scatter(-1, order, logits.gather(-1, order).masked_fill(drop, float("-inf")))
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1)], dim=-1)
    return ids[:, -txt_len:]


class _OutOfScope:
    def __init__(self, what):
        self._what = what

    def __getattr__(self, name):
        raise NotImplementedError(f"{self._what}: seq2seq value-head models are out of fastppo's scope")

    def __call__(self, *args, **kwargs):
        self.__getattr__("__call__")


class AutoModelForSeq2SeqLMWithValueHead:
    """Loading works (TRL's PPO test setUp loads a T5 for every test); any use raises."""
    transformers_parent_class = None
    lm_head_namings = ()

    @classmethod
    def from_pretrained(cls, name, *args, **kwargs):
        return _OutOfScope(f"AutoModelForSeq2SeqLMWithValueHead({name!r})")


class _ReturnAllScores:
    """A text-classification pipeline that still takes the `return_all_scores=True` transformers 5
    removed (it now ignores it and returns the top label only): all scores, in label-id order."""

    def __init__(self, pipe):
        self._pipe = pipe

    def __getattr__(self, name):  # .model, .tokenizer, ...
        return getattr(self._pipe, name)

    def __call__(self, inputs, *args, return_all_scores=False, **kwargs):
        if not return_all_scores:
            return self._pipe(inputs, *args, **kwargs)
        outs = self._pipe(inputs, *args, top_k=None, **kwargs)
        if outs and isinstance(outs[0], dict):  # a single input
            outs = [outs]
        label2id = self._pipe.model.config.label2id  # TRL indexes the scores by label id
        return [sorted(o, key=lambda d: label2id[d["label"]]) for o in outs]


def pipeline(*args, **kwargs):
    import transformers

    return _ReturnAllScores(transformers.pipeline(*args, **kwargs))
'''

TESTING_UTILS_PY = '''\
"""Stand-in for TRL 0.26's tests/testing_utils.py (only what test_ppo_trainer.py imports)."""
import pytest
from transformers.utils import is_peft_available


class TrlTestCase:
    """Gives each test a fresh self.tmp_dir. An autouse fixture rather than setup_method,
    because the test classes define their own setup_method without calling super()."""

    @pytest.fixture(autouse=True)
    def _trl_tmp_dir(self, tmp_path):
        self.tmp_dir = str(tmp_path)
        yield


require_peft = pytest.mark.skipif(not is_peft_available(), reason="test requires peft")
'''

# Stand-in for TRL 1.16's tests/testing_utils.py: the names test_grpo_trainer.py imports, as skip marks on
# what is installed (the availability checks are transformers' own, or a module lookup).
TESTING_UTILS_116_PY = '''\
"""Stand-in for TRL 1.16's tests/testing_utils.py (only what test_grpo_trainer.py imports)."""
import importlib.util

import pytest
import torch
from transformers.testing_utils import torch_device
from transformers.utils import is_kernels_available, is_peft_available, is_vision_available


def _has(module):
    return importlib.util.find_spec(module) is not None


class TrlTestCase:
    @pytest.fixture(autouse=True)
    def _trl_tmp_dir(self, tmp_path):
        self.tmp_dir = str(tmp_path)
        yield


def is_ampere_or_newer(device_index=0):
    return torch.cuda.is_available() and torch.version.hip is None and \\
        torch.cuda.get_device_capability(device_index) >= (8, 0)


require_bitsandbytes = pytest.mark.skipif(not _has("bitsandbytes"), reason="test requires bitsandbytes")
require_jmespath = pytest.mark.skipif(not _has("jmespath"), reason="test requires jmespath")
require_kernels = pytest.mark.skipif(not is_kernels_available(), reason="test requires kernels")
require_liger_kernel = pytest.mark.skipif(not _has("liger_kernel"), reason="test requires liger-kernel")
require_peft = pytest.mark.skipif(not is_peft_available(), reason="test requires peft")
require_torch_accelerator = pytest.mark.skipif(torch_device in (None, "cpu"), reason="test requires accelerator")
require_vision = pytest.mark.skipif(not is_vision_available(), reason="test requires vision")
require_vllm = pytest.mark.skipif(not _has("vllm"), reason="test requires vllm")
'''

# The Hub endpoint is never reached: push tests are deselected and delete_repo is a no-op.
TESTING_CONSTANTS_PY = 'CI_HUB_USER = "offline-user"\nCI_HUB_USER_FULL_NAME = "Offline User"\n' \
                       'CI_HUB_ENDPOINT = "http://hub.invalid"\n'

CONFTEST_PY = '''\
"""Deselects the tests deselect.json names (recording them) and stubs the one Hub call; optionally keeps one
shard of the rest and bounds each test's time (trl_acceptance's --shard and --test-timeout)."""
import json
import os
import re
import signal

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_HERE, "deselect.json")) as f:
    _RULES = json.load(f)

try:  # TRL 0.11's PPO tests delete a Hub repo in tearDownClass; there is no Hub here
    import huggingface_hub
    huggingface_hub.HfApi.delete_repo = lambda self, *args, **kwargs: None
except ImportError:
    pass


@pytest.hookimpl(trylast=True)  # after -k, so that only the tests it kept are recorded as excluded
def pytest_collection_modifyitems(config, items):
    keep, dropped, record = [], [], []
    for item in items:
        key = item.nodeid.split("::", 1)[-1]  # "Class::test_name"
        rule = next((r for r in _RULES if re.search(r["pattern"], key)), None)
        if rule is None:
            keep.append(item)
        else:
            dropped.append(item)
            record.append({"test": key, "category": rule["category"], "reason": rule["reason"]})
    shard = os.environ.get("TRL_ACCEPTANCE_SHARD")  # "i/n": every n-th remaining test from the i-th (1-based)
    if shard:
        i, n = map(int, shard.split("/"))
        dropped += [t for k, t in enumerate(keep) if k % n != i - 1]  # not recorded: another shard runs them
        keep = [t for k, t in enumerate(keep) if k % n == i - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    with open(os.path.join(_HERE, "deselected.json"), "w") as f:
        json.dump(record, f, indent=1)


_TEST_TIMEOUT = float(os.environ.get("TRL_ACCEPTANCE_TEST_TIMEOUT") or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test over the limit fails with TimeoutError (raised in the main thread, where the training loop runs),
    so that one slow test cannot use up the whole target's time."""
    if not _TEST_TIMEOUT:
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"over the per-test limit of {_TEST_TIMEOUT:.0f}s (trl_acceptance --test-timeout)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, _TEST_TIMEOUT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
'''

# Appended to CONFTEST_PY for the TRL 1.16 targets.
CONFTEST_116_PY = '''

# What TRL 1.16's own tests/conftest.py does on a machine without an accelerator: TRL's configs default bf16=True,
# which transformers refuses on a CPU unless use_cpu is set. Only TRL's configs (the baseline run); fastppo's
# GRPOConfig runs bf16 autocast on a CPU by itself.
import sys


@pytest.fixture(autouse=True)
def _trl_configs_use_cpu(monkeypatch):
    base = sys.modules.get("trl.trainer.base_config")
    from transformers.testing_utils import torch_device

    if base is None or torch_device not in (None, "cpu"):
        return
    original = base._BaseConfig.__post_init__

    def post_init(self):
        self.use_cpu = True
        original(self)

    monkeypatch.setattr(base._BaseConfig, "__post_init__", post_init)


def pytest_collection_finish(session):
    """The names under test come from the package this run is for (TRL stays importable here, so a missed
    rewrite would otherwise test TRL silently)."""
    with open(os.path.join(_HERE, "expect.json")) as f:
        expect = json.load(f)
    for module in {item.module for item in session.items if getattr(item, "module", None)}:
        for name, package in expect.items():
            got = getattr(getattr(module, name, None), "__module__", "")
            if got.split(".")[0] != package:
                raise RuntimeError(f"{module.__name__}.{name} comes from {got!r}, not {package}")
'''

# Shadows the installed TRL (the venv has one) so that an import line the rewrite missed
# fails loudly instead of silently testing TRL itself.
NO_TRL_PY = 'raise ImportError("trl_acceptance: this run must not import TRL (an unrewritten import?)")\n'


def exclusion_rules(source: str) -> list[dict]:
    """Tests to deselect, found by reading the test file: push_to_hub tests (no Hub), multi-GPU
    tests, and tests calling a private method of a non-test object (not the public API)."""
    rules = []
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")):
                continue
            decorators = " ".join(ast.unparse(d) for d in fn.decorator_list)
            private = sorted({
                n.func.attr for n in ast.walk(fn)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr.startswith("_") and not n.func.attr.startswith("__")
                and not (isinstance(n.func.value, ast.Name) and n.func.value.id in ("self", "cls"))
            })
            if "push_to_hub" in fn.name:
                reason = "pushes to the Hugging Face Hub (none here)"
            elif "multi_accelerator" in decorators or "multi_gpu" in decorators or "multi_gpu" in fn.name:
                reason = "needs several GPUs"
            elif private:
                reason = f"calls private method {', '.join(private)} (not public API)"
            else:
                continue
            # methods may be inherited (VHeadModelTester), and parameterized adds _<i>_<case>
            rule = {"pattern": rf"(^|::){fn.name}(_\d+\w*)?$", "category": "excluded", "reason": reason}
            if rule not in rules:
                rules.append(rule)
    return rules


def _private_uses(fn) -> list[str]:
    """Private names a test reaches on another object: `trainer._x` (read or called) or patch.object(obj, "_x"),
    where obj is a plain name other than self/cls (the test's own helper classes use self._x: not TRL's)."""
    found = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id not in ("self", "cls"):
            found.add(n.attr)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "object" \
                and len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
            found.add(n.args[1].value)
    return sorted(a for a in found if a.startswith("_") and not a.startswith("__"))


def exclusion_rules_116(source: str) -> list[dict]:
    """TRL 1.16's GRPO tests to deselect, found by reading the file: what needs a GPU, vLLM, liger-kernel (Triton
    GPU kernels) or a vision-language model and its images; what reaches TRL's trainer internals (private
    attributes, a trainer built with object.__new__); and what never uses GRPOTrainer or GRPOConfig (transformers'
    own API contracts). The same rules serve the fastppo run and the TRL baseline, so their counts compare."""
    rules = []

    def add(pattern, reason):
        rules.append({"pattern": pattern, "category": "excluded", "reason": reason})

    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        class_marks = " ".join(ast.unparse(d) for d in cls.decorator_list)
        class_text = ast.unparse(cls)
        class_names = {n.id for n in ast.walk(cls) if isinstance(n, ast.Name)}  # code, not docstrings
        if "require_torch_accelerator" in class_marks or "mark.slow" in class_marks:
            add(rf"^{cls.name}::", "needs a GPU (TRL marks the class slow and require_torch_accelerator)")
            continue
        if "require_vision" in class_marks:
            add(rf"^{cls.name}::", "vision-language models with a processor and image datasets")
            continue
        if not class_names & {"GRPOTrainer", "GRPOConfig", "RLOOTrainer", "RLOOConfig"}:
            add(rf"^{cls.name}::", "never uses the trainer or its config (tests transformers' API)")
            continue
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")):
                continue
            marks = [ast.unparse(d) for d in fn.decorator_list]
            body = ast.unparse(fn)
            name = rf"^{cls.name}::{fn.name}"
            if "require_vllm" in marks or "use_vllm=True" in body:  # the bare decorators
                add(rf"{name}(\[.*\])?$", "needs vLLM")
            elif "require_liger_kernel" in marks or "use_liger_kernel=True" in body:
                add(rf"{name}(\[.*\])?$", "needs liger-kernel (Triton GPU kernels)")
            elif "object.__new__(GRPOTrainer)" in class_text or "object.__new__(RLOOTrainer)" in class_text:
                add(rf"{name}(\[.*\])?$", "builds TRL's trainer with object.__new__ and sets its private state")
            elif _private_uses(fn):
                add(rf"{name}(\[.*\])?$", f"reaches TRL's trainer internals ({', '.join(_private_uses(fn))})")
            elif "mock_generate" in body or "fake_generate" in body:
                add(rf"{name}(\[.*\])?$", "mocks transformers' generate() to dictate the completions (fastppo's "
                                          "sampler is its own decode loop and never calls it)")
            elif "training_step" in body:
                add(rf"{name}(\[.*\])?$", "wraps transformers' Trainer.training_step, a step of TRL's loop that "
                                          "fastppo's loop does not have")
            elif any("'use_liger_kernel'" in m or '"use_liger_kernel"' in m for m in marks):
                # parametrized over it: only its liger case (pytest ids join the values with -)
                add(rf"{name}\[(.+-)?True(-.+)?\]$", "needs liger-kernel (Triton GPU kernels)")
    return rules


# --------------------------------------------------------------------------------------
# Tiny local stand-ins for the Hub ids
# --------------------------------------------------------------------------------------

# Per architecture: a tiny config (a few KB of weights) in that config class's own names.
_LLAMA_LIKE = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512)
# TRL 1.16's GRPO tests: rotary positions as long as the real checkpoints' (32k), since GRPOConfig's default
# 512-token completions must fit after a prompt; they cost no weights
_LLAMA_32K = dict(_LLAMA_LIKE, max_position_embeddings=32768)
ARCH = {
    "gpt2": dict(n_embd=16, n_layer=2, n_head=4, n_positions=512),
    "gptj": dict(n_embd=16, n_layer=2, n_head=4, n_positions=512, rotary_dim=4),
    "codegen": dict(n_embd=16, n_layer=2, n_head=4, n_positions=512, n_ctx=512, rotary_dim=4),
    "gpt_neo": dict(hidden_size=16, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                    max_position_embeddings=512, window_size=256),
    "gpt_neox": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
                     max_position_embeddings=512),
    "opt": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, ffn_dim=32, word_embed_proj_dim=16,
                max_position_embeddings=512),
    "bloom": dict(hidden_size=16, n_layer=2, n_head=4),
    "llama": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "t5": dict(d_model=16, d_ff=32, d_kv=4, num_layers=2, num_decoder_layers=2, num_heads=4),
    "distilbert": dict(dim=16, hidden_dim=32, n_layers=2, n_heads=4, max_position_embeddings=512,
                       id2label={0: "NEGATIVE", 1: "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1}),
    # TRL 1.16's GRPO tests (the MoE ones with 4 experts, 2 per token; the hybrid one with a layer of each kind)
    "qwen3": dict(_LLAMA_32K, head_dim=4, tie_word_embeddings=False),
    "qwen3_moe": dict(_LLAMA_32K, head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "gemma2": dict(_LLAMA_32K, head_dim=4),  # ties its embeddings (TRL's cast_lm_head_to_fp32 test relies on it)
    "cohere2": dict(_LLAMA_32K, head_dim=4, layer_types=["sliding_attention", "full_attention"], sliding_window=64),
    "glm4_moe": dict(_LLAMA_32K, head_dim=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1),
    "gpt_oss": dict(_LLAMA_32K, head_dim=4, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=64),
    "nemotron_h": dict(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                       max_position_embeddings=32768, layers_block_type=["mamba", "attention", "mlp"],
                       mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=16, expand=2),
}
# Special tokens per tokenizer family, mimicking the real ones' roles (which exist, which is eos,
# whether there is a pad: GPT-2 and Pythia have none, so tests that add one still work).
TOKENIZERS = {
    "gpt2": dict(specials=["<|endoftext|>"], bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                 unk_token="<|endoftext|>"),
    "qwen": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>",
                 pad_token="<|endoftext|>", chat_template="chatml_tools", model_max_length=131072),
    # Llama 3.2: TRL's reward-model test sets pad_token = "<|finetune_right_pad_id|>", which must exist
    "llama3": dict(specials=["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|finetune_right_pad_id|>"], bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                   chat_template="llama3", model_max_length=131072),
    "bloom": dict(specials=["<unk>", "<s>", "</s>", "<pad>"], bos_token="<s>", eos_token="</s>",
                  unk_token="<unk>", pad_token="<pad>", padding_side="left"),
    "llama": dict(specials=["<unk>", "<s>", "</s>"], bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
    "opt": dict(specials=["<pad>", "</s>", "<unk>"], bos_token="</s>", eos_token="</s>", unk_token="<unk>",
                pad_token="<pad>"),
    "t5": dict(specials=["<pad>", "</s>", "<unk>"], eos_token="</s>", unk_token="<unk>", pad_token="<pad>"),
    # DistilBERT's forward takes no token_type_ids, so the tokenizer must not return them
    "bert": dict(specials=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], unk_token="[UNK]", pad_token="[PAD]",
                 cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                 model_input_names=["input_ids", "attention_mask"]),
}
# Chat templates in the real tokenizers' formats (conversational datasets need one; TRL's tests read no more of
# them than that): ChatML for Qwen, the header format for Llama 3.
CHAT_TEMPLATES = {
    "chatml": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "llama3": "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
              " + m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
}
_T = "trl-internal-testing/"
# hub id -> (model_type, head, tokenizer family, extra config). Heads: causal, seqcls (1 label), cls
# (the config's labels), base, seq2seq. Embedding rows follow the real checkpoints: TRL's
# scripts/generate_tiny_models.py sizes its tiny causal LMs to exactly len(tokenizer.vocab), so a
# test that adds "[PAD]" gets an id past the embedding (TRL never embeds pad ids); "pad_vocab"
# gives spare rows instead, as the full-size configs behind TRL's tiny reward models and Pythia have.
MODELS = {
    # TRL 0.26 tests/experimental/test_ppo_trainer.py and TRL 1.16 tests/test_grpo_trainer.py (32k positions, as
    # the real ones: GRPOConfig's default 512-token completions must fit after a prompt)
    _T + "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal", "qwen", {"max_position_embeddings": 32768}),
    _T + "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "seqcls", "qwen", {"pad_vocab": True,
                                                                                 "max_position_embeddings": 32768}),
    # TRL 0.11 tests/test_ppo_trainer.py (dummy-GPT2 gets a pad id: its adapter test runs it as a
    # batched sequence classifier, which needs one)
    _T + "dummy-GPT2-correct-vocab": ("gpt2", "causal", "gpt2", {"pad_token_id": 0}),
    _T + "tiny-BloomForCausalLM-correct-vocab": ("bloom", "causal", "bloom", {}),
    _T + "tiny-T5ForConditionalGeneration-correct-vocab": ("t5", "seq2seq", "t5", {}),
    "gpt2": ("gpt2", "causal", "gpt2", {}),
    # TRL 0.11 tests/test_modeling_value_head.py (causal part; ReferenceModelTest uses layer 4)
    _T + "tiny-random-CodeGenForCausalLM": ("codegen", "causal", "gpt2", {}),
    _T + "tiny-random-CodeGenForCausalLM-sharded": ("codegen", "causal", "gpt2", {"shard": True}),
    _T + "tiny-random-GPTJForCausalLM": ("gptj", "causal", "gpt2", {}),
    _T + "tiny-random-GPTNeoForCausalLM": ("gpt_neo", "causal", "gpt2", {}),
    _T + "tiny-random-GPTNeoXForCausalLM": ("gpt_neox", "causal", "gpt2", {}),
    _T + "tiny-random-GPTNeoXForCausalLM-safetensors": ("gpt_neox", "causal", "gpt2", {}),
    _T + "tiny-random-GPTNeoXForCausalLM-safetensors-sharded": ("gpt_neox", "causal", "gpt2", {"shard": True}),
    _T + "tiny-random-OPTForCausalLM": ("opt", "causal", "opt", {}),
    _T + "tiny-random-BloomForCausalLM": ("bloom", "causal", "bloom", {}),
    _T + "tiny-random-GPT2LMHeadModel": ("gpt2", "causal", "gpt2", {"n_layer": 5}),
    _T + "tiny-random-LlamaForCausalLM": ("llama", "causal", "llama", {}),
    _T + "tiny-random-GPT2Model": ("gpt2", "base", "gpt2", {}),
    # TRL 0.26 example scripts (the ids in their docstrings)
    "EleutherAI/pythia-1b-deduped": ("gpt_neox", "causal", "gpt2", {"pad_vocab": True}),
    # TRL 0.26 PPOConfig's default sft_model_path and reward_model_path (ppo.py's first command names neither)
    "EleutherAI/pythia-160m": ("gpt_neox", "causal", "gpt2", {"pad_vocab": True}),
    "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr": ("gpt_neox", "causal", "gpt2", {"pad_vocab": True}),
    "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr": ("gpt_neox", "seqcls", "gpt2", {"pad_vocab": True}),
    # TRL 0.11 example script: PPOConfig's default reward pipeline
    "lvwerra/distilbert-imdb": ("distilbert", "cls", "bert", {}),
    # TRL 1.16 tests/test_grpo_trainer.py (its text-only tests; the VLM, GPU and vLLM ones are excluded). The
    # tokenizer matters through its special tokens and chat template only, so the chat models share Qwen's.
    _T + "tiny-Qwen3ForCausalLM": ("qwen3", "causal", "qwen", {}),
    _T + "tiny-Qwen3ForSequenceClassification": ("qwen3", "seqcls", "qwen", {"pad_vocab": True}),
    _T + "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "causal", "qwen", {}),
    _T + "tiny-Gemma2ForCausalLM": ("gemma2", "causal", "qwen", {}),
    _T + "tiny-Cohere2ForCausalLM": ("cohere2", "causal", "qwen", {}),
    _T + "tiny-Glm4MoeForCausalLM": ("glm4_moe", "causal", "qwen", {}),
    _T + "tiny-GptOssForCausalLM": ("gpt_oss", "causal", "qwen", {}),
    _T + "tiny-NemotronHForCausalLM-nano": ("nemotron_h", "causal", "qwen", {}),
    _T + "tiny-LlamaForSequenceClassification-3.2": ("llama", "seqcls", "llama3", {"pad_vocab": True,
                                                                                  "max_position_embeddings": 32768}),
    # a model whose class lives in the checkpoint's own code (see REMOTE_CODE_PY): TRL's trust_remote_code test
    _T + "tiny-RemoteForCausalLM": ("qwen2", "causal", "qwen", {"remote_code": True, "max_position_embeddings": 32768}),
}
DATASETS = ["trl-internal-testing/zen", "trl-internal-testing/descriptiveness-sentiment-trl-style",
            "trl-lib/tldr", "stanfordnlp/imdb"]

# Vocabulary for generated English text (tokenizer training and the datasets' rows).
_WHO = ["I", "My sister", "The old man", "Our neighbour", "The teacher", "A friend of mine", "She", "He", "We"]
_DID = ["walked to", "looked at", "talked about", "thought about", "cleaned", "visited", "painted", "remembered"]
_WHAT = ["the garden", "the kitchen", "the small harbour", "the train station", "the library", "the market",
         "an old photograph", "the river", "the beach", "the office"]
_WHEN = ["before dinner.", "in the rain.", "after a long day at work.", "with a quiet smile.",
         "early in the morning.", "for the first time in years.", "while the sun went down."]
_GOOD = ["wonderful", "moving", "funny", "beautiful", "clever", "charming", "brilliant", "warm"]
_BAD = ["boring", "predictable", "awful", "dull", "confusing", "painful", "clumsy", "flat"]
_THINGS = ["acting", "story", "music", "dialogue", "ending", "camera work", "cast", "script"]
_SUBS = ["relationships", "AskReddit", "personalfinance", "cooking", "running", "travel"]


def _sentence(rng):
    return f"{rng.choice(_WHO)} {rng.choice(_DID)} {rng.choice(_WHAT)} {rng.choice(_WHEN)}"


def _review(rng, positive):
    words = _GOOD if positive else _BAD
    parts = [f"I watched this film {rng.choice(['last night', 'with my family', 'at the cinema', 'twice'])}."]
    while sum(map(len, parts)) < 240:  # TRL's script keeps reviews over 200 characters
        parts.append(f"The {rng.choice(_THINGS)} was {rng.choice(words)} and the {rng.choice(_THINGS)} "
                     f"felt {rng.choice(words)}.")
    return " ".join(parts)


def _zen_lines():
    import this  # the Zen of Python, ROT13-encoded in the standard library; prints it on import

    return [ln for ln in "".join(this.d.get(c, c) for c in this.s).splitlines()[2:] if ln.strip()]


def corpus(rng):
    text = [_sentence(rng) for _ in range(400)] + [_review(rng, i % 2 == 0) for _ in range(2) for i in range(40)]
    text += [f"This morning I went to the {w.split()[-1]}." for w in _WHAT] * 20  # TRL asserts 7 tokens here
    return text + _zen_lines()


def build_tokenizer(family: str, texts):
    """A GPT-2-style byte-level BPE (no unknown tokens, spaces survive decoding) trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = dict(TOKENIZERS[family])
    specials = spec.pop("specials")
    if spec.get("chat_template") == "chatml_tools":  # Qwen2.5's renders tools, as TRL's tool and environment tests need
        from fastppo.tools import CHATML_TOOL_TEMPLATE

        spec["chat_template"] = CHATML_TOOL_TEMPLATE
    elif "chat_template" in spec:
        spec["chat_template"] = CHAT_TEMPLATES[spec["chat_template"]]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1200, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core, **{"model_max_length": 512, **spec})


def build_model(model_type, head, tokenizer, extra, seed):
    import torch
    import transformers as tf

    extra = dict(extra)
    kwargs = {**ARCH[model_type], **{k: v for k, v in extra.items() if k not in ("shard", "pad_vocab", "remote_code")}}
    vocab = len(tokenizer)
    if extra.get("pad_vocab"):
        vocab = -(-(vocab + 1) // 128) * 128
    ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    kwargs = {**{k: v for k, v in ids.items() if v is not None}, **kwargs}
    if model_type == "t5":
        kwargs["decoder_start_token_id"] = tokenizer.pad_token_id
    if head == "seqcls":
        kwargs["num_labels"] = 1
    config = tf.AutoConfig.for_model(model_type, vocab_size=vocab, **kwargs)
    auto = {"causal": tf.AutoModelForCausalLM, "seqcls": tf.AutoModelForSequenceClassification,
            "cls": tf.AutoModelForSequenceClassification, "base": tf.AutoModel,
            "seq2seq": tf.AutoModelForSeq2SeqLM}[head]
    torch.manual_seed(seed)
    return auto.from_config(config)


# A model class shipped in the checkpoint's own code (auto_map), loadable only with trust_remote_code=True:
# Qwen2 under another name, so the weights saved from a Qwen2ForCausalLM load into it.
REMOTE_CODE_PY = '''\
"""A custom-code causal LM (written by fastppo's tests/trl_acceptance.py): Qwen2 under another name."""
from transformers import Qwen2Config, Qwen2ForCausalLM


class RemoteConfig(Qwen2Config):
    model_type = "remote"


class RemoteForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteConfig
'''


def make_remote_code(path):
    """Turn a saved Qwen2 checkpoint into a custom-code one: the module beside it, the config naming it."""
    with open(os.path.join(path, "modeling_remote.py"), "w") as f:
        f.write(REMOTE_CODE_PY)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(model_type="remote", architectures=["RemoteForCausalLM"],
                  auto_map={"AutoConfig": "modeling_remote.RemoteConfig",
                            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _write_dataset(path, splits: dict, config="default", more: dict | None = None):
    """A local dataset dir whose README declares the config (and `more` configs: name -> splits), as Hub
    datasets do."""
    entries = []
    for name, name_splits in {config: splits, **(more or {})}.items():
        files = []
        for split, rows in name_splits.items():
            rel = f"{name}/{split}.jsonl"
            os.makedirs(os.path.join(path, name), exist_ok=True)
            with open(os.path.join(path, rel), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            files.append(f"  - split: {split}\n    path: {rel}\n")
        entries.append(f"- config_name: {name}\n  data_files:\n{''.join(files)}")
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(f"---\nconfigs:\n{''.join(entries)}---\n")


# Where the real zen dataset cuts each aphorism into prompt and completion, in words: a test of TRL 1.16
# (test_prepare_input_called_with_correct_data) asserts the first prompts verbatim.
ZEN_PROMPT_WORDS = [4, 2, 3, 1, 4, 3, 1, 4, 3, 3, 2, 6, 6, 11, 2, 4, 7, 5, 5]


def build_datasets(workdir, rng):
    prompts = [" ".join(ln.split()[:n]) for ln, n in zip(_zen_lines(), ZEN_PROMPT_WORDS, strict=True)]
    zen = [{"prompt": p} for p in prompts]
    chat = [{"prompt": [{"role": "user", "content": f"How does the aphorism that starts '{p}' end?"}]}
            for p in prompts]
    # the real dataset's split: train_test_split(test_size=0.1, shuffle=False), so 17 train and 2 test rows
    _write_dataset(os.path.join(workdir, DATASETS[0]), {"train": zen[:-2], "test": zen[-2:]},
                   "standard_prompt_only", more={"conversational_prompt_only": {"train": chat[:-2], "test": chat[-2:]}})
    # ppo.py holds out the last 100 rows for eval
    _write_dataset(os.path.join(workdir, DATASETS[1]),
                   {"descriptiveness": [{"prompt": _sentence(rng)} for _ in range(132)]})
    posts = [{"prompt": f"SUBREDDIT: r/{rng.choice(_SUBS)}\n\nTITLE: {_sentence(rng)}\n\n"
                        f"POST: {_sentence(rng)} {_sentence(rng)} {_sentence(rng)}\n\nTL;DR:",
              "completion": " " + _sentence(rng)} for _ in range(48)]
    _write_dataset(os.path.join(workdir, DATASETS[2]), {"train": posts[:32], "validation": posts[32:]})
    reviews = [{"text": _review(rng, i % 2 == 0), "label": int(i % 2 == 0)} for i in range(24)]
    _write_dataset(os.path.join(workdir, DATASETS[3]), {"train": reviews[:16], "test": reviews[16:]})


def build_standins(workdir, rebuild=False):
    """Build (or reuse, when the marker matches) every model, tokenizer and dataset stand-in."""
    marker = os.path.join(workdir, ".standins.json")
    want = {"version": STANDIN_VERSION, "models": sorted(MODELS), "datasets": DATASETS}
    if not rebuild and os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == want:
                print(f"stand-ins: cached in {workdir}")
                return
    t0 = time.time()
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per saved model otherwise
    rng = random.Random(0)
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen
        texts = corpus(rng)
    for name in [*MODELS, *DATASETS]:
        shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    tokenizers = {fam: build_tokenizer(fam, texts) for fam in TOKENIZERS}
    for i, (hub_id, (model_type, head, fam, extra)) in enumerate(sorted(MODELS.items())):
        path = os.path.join(workdir, hub_id)
        model = build_model(model_type, head, tokenizers[fam], extra, seed=i)
        model.save_pretrained(path, **({"max_shard_size": "20KB"} if extra.get("shard") else {}))
        tokenizers[fam].save_pretrained(path)
        if extra.get("remote_code"):
            make_remote_code(path)
    with contextlib.redirect_stdout(io.StringIO()):
        build_datasets(workdir, rng)
    with open(marker, "w") as f:
        json.dump(want, f)
    print(f"stand-ins: built {len(MODELS)} models and {len(DATASETS)} datasets in {time.time() - t0:.0f}s")


# --------------------------------------------------------------------------------------
# Preparing and running a target
# --------------------------------------------------------------------------------------

def rewrite_imports(text: str, rewrites: dict, origin: str, allow_trl: str = "") -> str:
    lines, used = text.splitlines(keepends=True), set()
    for i, line in enumerate(lines):
        key = line.strip()
        if key in rewrites:
            lines[i] = line[: len(line) - len(line.lstrip())] + rewrites[key] + "\n"
            used.add(key)
    missing = set(rewrites) - used
    if missing:  # the TRL file changed: fail rather than silently test something else
        raise SystemExit(f"{origin}: expected import line(s) not found: {sorted(missing)}")
    out = "".join(lines)
    left = re.findall(r"^\s*(?:from|import)\s+trl\b.*$", out, re.MULTILINE)
    left = [ln for ln in left if not (allow_trl and re.match(allow_trl, ln.strip()))]
    if left:
        raise SystemExit(f"{origin}: TRL import(s) left after rewriting: {left}")
    return out


def prepare(target: Target, trl_dirs: dict, workdir: str) -> str:
    """Copy the target's file into WORKDIR/targets/NAME with its imports rewritten, plus the
    stand-in modules and (for tests) the deselection rules; return that dir."""
    tdir = os.path.join(workdir, "targets", target.name)
    shutil.rmtree(tdir, ignore_errors=True)
    src = os.path.join(trl_dirs[target.trl], target.src)
    with open(src) as f:
        source = f.read()
    # Hub ids the file or the flags name that have no stand-in here (today: the 0.11 seq2seq models, used by
    # out-of-scope tests alone, and 1.16's VLM, GPU and vLLM models and image datasets, used by excluded tests
    # alone); printed so that a changed TRL file shows up plainly.
    named = set(re.findall(r'"((?:trl-internal-testing|trl-lib|EleutherAI|cleanrl|lvwerra|stanfordnlp|Qwen|'
                           r'HuggingFaceTB)/[\w.-]+|gpt2)"', source + json.dumps(target.args)))
    missing = sorted(i for i in named if not os.path.isdir(os.path.join(workdir, i)))
    if missing:
        more = f", ... ({len(missing)} in all)" if len(missing) > 4 else ""
        print(f"    no stand-in for Hub id(s) named there: {', '.join(missing[:4])}{more}")
    files = {target.dest: rewrite_imports(source, target.rewrites, src, target.allow_trl),
             "trl_standins.py": STANDINS_PY}
    if not target.trl_env:  # with TRL 1.16 on the path, expect.json's check stands in for the shadow
        files["trl/__init__.py"] = NO_TRL_PY
    if target.kind == "pytest":
        rules = [{"pattern": p, "category": "out of scope", "reason": OUT_OF_SCOPE} for p in target.out_of_scope]
        rules += exclusion_rules_116(source) if target.trl == "trl116" else exclusion_rules(source)
        pkg = target.dest.split("/")[0]
        # every directory on the way down is a package, so TRL's relative imports resolve
        for d in range(1, target.dest.count("/") + 1):
            files["/".join(target.dest.split("/")[:d]) + "/__init__.py"] = ""
        files[f"{pkg}/testing_utils.py"] = TESTING_UTILS_116_PY if target.trl == "trl116" else TESTING_UTILS_PY
        files[f"{pkg}/testing_constants.py"] = TESTING_CONSTANTS_PY
        files["conftest.py"] = CONFTEST_PY + (CONFTEST_116_PY if target.trl == "trl116" else "")
        files["deselect.json"] = json.dumps(rules, indent=1)
        files["expect.json"] = json.dumps(target.expect)
        files["pytest.ini"] = "[pytest]\n"
    for rel, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(tdir, rel)), exist_ok=True)
        with open(os.path.join(tdir, rel), "w") as f:
            f.write(content)
    return tdir


def run_bounded(cmd, cwd, env, timeout, log_path) -> tuple[int | None, str, float]:
    """Run cmd in its own process group, output to log_path; kill the group on timeout."""
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    with open(log_path, errors="replace") as f:
        return rc, f.read(), time.time() - t0


def _first_error_line(element) -> str:
    msg = (element.get("message") or "").strip()
    text = element.text or ""
    if not msg or msg in ("collection failure",) or msg.startswith("failed on setup"):
        e_lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
        msg = e_lines[0] if e_lines else (msg or text.strip())
    lines = msg.splitlines()
    if lines and lines[0].endswith("Regex pattern did not match."):  # pytest.raises(match=): the message it got
        return " ".join(ln.strip() for ln in lines)[:400]
    return lines[0][:220] if lines else ""


def _outcomes_so_far(out: str) -> dict:
    """From a killed pytest -v log: the counts of the outcomes logged, the failures (their messages never got
    printed) and the test that was running."""
    done = re.findall(r"::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", out)
    counts = {key: sum(1 for _, o in done if o == key.upper()) for key in ("passed", "failed", "skipped", "error")}
    running = re.findall(r"::(\S+) *$", out.rstrip("\n").splitlines()[-1] if out.strip() else "")
    return {**counts, "last_line": f"killed at the target's time limit after {len(done)} test(s)"
                                   + (f"; running {running[0]}" if running else ""),
            "failures": [{"test": t, "outcome": o.lower(), "message": "(killed before pytest reported it; see the log)"}
                         for t, o in done if o in ("FAILED", "ERROR")]}


def run_pytest(target, tdir, env, workdir, timeout, keyword=None, tag="") -> dict:
    junit = os.path.join(workdir, "logs", f"{target.name}{tag}.xml")
    log = os.path.join(workdir, "logs", f"{target.name}{tag}.log")
    # -v: each outcome is logged as it happens, so a target killed at its time limit still tells what ran
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--tb=short", "-c",
           os.path.join(tdir, "pytest.ini"), "--rootdir", tdir, f"--basetemp={os.path.join(tdir, '.tmp')}",
           f"--junitxml={junit}", "-o", "faulthandler_timeout=600", os.path.join(tdir, target.dest),
           *(["-k", keyword] if keyword else [])]
    rc, out, secs = run_bounded(cmd, workdir, env, timeout, log)
    res = {"kind": "pytest", "seconds": round(secs), "log": log, "exit_code": rc, "failures": []}
    tail = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b|"
                                                       r"no tests ran", ln)]
    res["last_line"] = tail[-1].strip("= ") if tail else ""
    for key in ("passed", "failed", "skipped", "error"):
        m = re.search(rf"(\d+) {key}", res["last_line"])
        res[key] = int(m.group(1)) if m else 0
    if rc is None:  # killed: no summary line and no junit file; count the outcomes -v logged
        res.update(_outcomes_so_far(out))
    if os.path.exists(junit) and rc is not None:
        for case in ET.parse(junit).getroot().iter("testcase"):
            for tag in ("failure", "error"):
                el = case.find(tag)
                if el is not None:
                    name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
                    note, message = STANDIN_LIMITS.get(name), _first_error_line(el)
                    if isinstance(note, tuple):
                        note = note[0] if re.search(note[1], message) else None
                    res["failures"].append({"test": name, "outcome": tag, "message": message,
                                            **({"note": f"expected on stand-ins: {note}"} if note else {})})
    desel_path = os.path.join(tdir, "deselected.json")
    desel = []
    if os.path.exists(desel_path):
        with open(desel_path) as f:
            desel = json.load(f)
    res["excluded"] = [d for d in desel if d["category"] == "excluded"]
    res["out_of_scope"] = [d for d in desel if d["category"] == "out of scope"]
    res["status"] = "TIMEOUT" if rc is None else (
        "ok" if rc == 0 and res["passed"] and not res["failed"] and not res["error"] else "FAIL")
    return res


def run_script(target, tdir, env, workdir, timeout) -> dict:
    out_dir = os.path.join(workdir, "outputs", target.name)
    shutil.rmtree(out_dir, ignore_errors=True)
    log = os.path.join(workdir, "logs", f"{target.name}.log")
    args = [a.replace("{out}", out_dir) for a in target.args]
    rc, out, secs = run_bounded([sys.executable, os.path.join(tdir, target.dest), *args], workdir, env,
                                timeout, log)
    saved = os.path.isdir(out_dir) and (
        os.path.exists(os.path.join(out_dir, "adapter_config.json"))
        or (os.path.exists(os.path.join(out_dir, "config.json"))
            and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(out_dir))))
    ok = rc == 0 and (saved or not target.saves_model)
    errors = [ln.strip() for ln in out.splitlines() if re.match(r"^\w+(\.\w+)*(Error|Exception|Interrupt)\b", ln)]
    res = {"kind": "script", "seconds": round(secs), "log": log, "exit_code": rc, "command": args,
           "saved_model": saved if target.saves_model else "n/a (the script saves nothing)",
           "status": "TIMEOUT" if rc is None else ("ok" if ok else "FAIL"),
           "passed": int(ok), "failed": int(not ok), "skipped": 0, "error": 0, "excluded": [], "out_of_scope": []}
    if not ok:
        why = errors[-1] if errors else (out.strip().splitlines() or [""])[-1]
        if rc == 0:
            why = f"exit 0 but no saved model in {out_dir}"
        res["failures"] = [{"test": target.dest, "outcome": "failure", "message": why[:220]}]
    return res


def report(name, res):
    print(f"\n=== {name}: {res['status']} ({res['seconds']}s; log: {res['log']})")
    if res["kind"] == "pytest":
        fallback = f"(no summary line; exit {res['exit_code']})"
        print(f"    pytest: {res['last_line'] or fallback}")
    else:
        print(f"    exit code {res['exit_code']}, saved model: {res['saved_model']}")
    for f in res.get("failures", []):
        print(f"    {f['outcome'].upper():7} {f['test']}: {f['message']}" + (f"  [{f['note']}]" if "note" in f else ""))
    for label in ("excluded", "out_of_scope"):
        for d in res[label]:
            print(f"    {label.upper().replace('_', ' '):12} {d['test']}: {d['reason']}")


def main(argv=None) -> int:
    names = [t.name for t in TARGETS]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trl026", help="a TRL v0.26.2 checkout")
    p.add_argument("--trl011", help="a TRL v0.11.4 checkout")
    p.add_argument("--trl116", help="a TRL v1.16.0 checkout (its tests/ is what is read)")
    p.add_argument("--trl116-env", default=trl1_dir(),
                   help="where TRL 1.16 itself is installed (default: $FASTPPO_TRL1 or this environment's)")
    p.add_argument("--trl026-env", default=trl026_dir(),
                   help="where TRL 0.26.2 is installed for the PPO and legacy targets (default: $FASTPPO_TRL026 or "
                        ".trl026)")
    p.add_argument("--workdir", help="where stand-ins, copies, logs and outputs go (default: a fresh temp dir); "
                                     "reusing one reuses its stand-ins")
    p.add_argument("--only", action="append", choices=names, metavar="NAME",
                   help="run only this target (repeatable): " + ", ".join(names))
    p.add_argument("--timeout", type=int, default=900, help="seconds per target (default 900)")
    p.add_argument("--rebuild-standins", action="store_true")
    p.add_argument("-k", dest="keyword", help="pytest -k expression for the pytest targets (a sample of tests)")
    p.add_argument("--shard", metavar="I/N", help="run only every N-th test a pytest target keeps, from the I-th "
                                                   "(1-based): a target too slow for one --timeout runs in N calls")
    p.add_argument("--test-timeout", type=float, default=0,
                   help="seconds one test may take before it fails with TimeoutError (default: no limit)")
    args = p.parse_args(argv)
    trl_dirs = {k: os.path.abspath(v) for k in ("trl026", "trl011", "trl116") if (v := getattr(args, k))}
    chosen = [t for t in TARGETS if (t.name in args.only if args.only else not t.baseline)]
    lacking = sorted({t.trl for t in chosen if t.trl not in trl_dirs})
    if args.only and lacking:
        p.error(f"--only names a target whose checkout is not given: --{', --'.join(lacking)}")
    chosen = [t for t in chosen if t.trl in trl_dirs]
    if not chosen:
        p.error("no target to run: give --trl026, --trl011 and/or --trl116")
    shard = re.fullmatch(r"(\d+)/(\d+)", args.shard or "1/1")
    if not shard or not 0 < int(shard[1]) <= int(shard[2]):
        p.error(f"--shard {args.shard}: expected I/N with 1 <= I <= N")
    tag = f"-shard{shard[1]}of{shard[2]}" if args.shard else ""  # shards keep their own logs and summaries
    trl1_env = os.path.abspath(args.trl116_env)
    if any(t.trl_env for t in chosen) and not os.path.isfile(os.path.join(trl1_env, "trl", "__init__.py")):
        p.error(f"TRL 1.16 is not installed at {trl1_env}: pip install --no-deps --target {trl1_env} trl==1.16.0")

    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="trl_acceptance-"))
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    print(f"work dir: {workdir}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": os.path.join(workdir, ".hf_home"), "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "TRL_ACCEPTANCE_SHARD": args.shard or "", "TRL_ACCEPTANCE_TEST_TIMEOUT": str(args.test_timeout or "")}
    os.environ.update({k: env[k] for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")})
    build_standins(workdir, args.rebuild_standins)

    results = {}
    for target in chosen:
        print(f"\n--- running {target.name} ({target.trl}/{target.src})", flush=True)
        tdir = prepare(target, trl_dirs, workdir)
        # the target's remaining trl imports (and the baseline's trainer) come from its own TRL: 1.16 for the
        # GRPO/RLOO targets, 0.26.2 for the PPO and legacy ones
        first = trl1_env if target.trl_env else os.path.abspath(args.trl026_env)
        target_env = {**env, "PYTHONPATH": os.pathsep.join([first, *filter(None, [env.get("PYTHONPATH")])])}
        if target.kind == "pytest":
            results[target.name] = run_pytest(target, tdir, target_env, workdir, args.timeout, args.keyword, tag)
        else:
            results[target.name] = run_script(target, tdir, target_env, workdir, args.timeout)
        report(target.name, results[target.name])

    summary = os.path.join(workdir, f"summary{tag}.json")
    with open(summary, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nsummary (also {summary}):")
    print(f"{'target':34} {'status':8} {'passed':>6} {'failed':>6} {'skipped':>7} {'error':>5} "
          f"{'excluded':>8} {'out-of-scope':>12} {'secs':>5}")
    for name, r in results.items():
        print(f"{name:34} {r['status']:8} {r['passed']:6} {r['failed']:6} {r['skipped']:7} {r['error']:5} "
              f"{len(r['excluded']):8} {len(r['out_of_scope']):12} {r['seconds']:5}")
    return 0 if results and all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
