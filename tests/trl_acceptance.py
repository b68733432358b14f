#!/usr/bin/env python
"""Run TRL's own PPO tests and example scripts against fastppo, out of tree.

    python tests/trl_acceptance.py --trl026 /path/to/trl-v0.26.2 --trl011 /path/to/trl-v0.11.4 \
        [--workdir DIR] [--only NAME ...] [--timeout SECONDS]

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

STANDIN_VERSION = 3  # bump when a stand-in's contents change, so cached work dirs rebuild

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

OUT_OF_SCOPE = "encoder-decoder (seq2seq) value-head models are out of fastppo's scope"
# Tests that run, but whose assertions cannot hold on random stand-in weights.
STANDIN_LIMITS = {
    "PPOTrainerTester::test_loss_trainer":
        "asserts loss constants (1.8226, 0.1260) computed from the real Hub checkpoint's weights",
}


@dataclass
class Target:
    name: str
    trl: str                      # "trl026" or "trl011": which checkout the file comes from
    src: str                      # path inside that checkout
    dest: str                     # path inside the target dir (a package path for tests)
    rewrites: dict
    kind: str = "pytest"          # "pytest" or "script"
    out_of_scope: list = field(default_factory=list)   # regexes on "Class::test"
    args: list = field(default_factory=list)           # script flags ({out} = its output dir)
    saves_model: bool = True


TARGETS = [
    Target("trl026-test_ppo_trainer", "trl026", "tests/experimental/test_ppo_trainer.py",
           "trl_tests/experimental/test_ppo_trainer.py", REWRITES_026_TEST),
    Target("trl011-test_ppo_trainer", "trl011", "tests/test_ppo_trainer.py",
           "trl_tests/test_ppo_trainer.py", REWRITES_011_TEST,
           out_of_scope=[r"::test_\w+_\d+_t5$"]),  # parameterized T5 case
    Target("trl011-test_modeling_value_head", "trl011", "tests/test_modeling_value_head.py",
           "trl_tests/test_modeling_value_head.py", REWRITES_011_VHEAD,
           out_of_scope=[r"^Seq2Seq\w*::"]),
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

# The Hub endpoint is never reached: push tests are deselected and delete_repo is a no-op.
TESTING_CONSTANTS_PY = 'CI_HUB_USER = "offline-user"\nCI_HUB_USER_FULL_NAME = "Offline User"\n' \
                       'CI_HUB_ENDPOINT = "http://hub.invalid"\n'

CONFTEST_PY = '''\
"""Deselects the tests deselect.json names (recording them) and stubs the one Hub call."""
import json
import os
import re

_HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_HERE, "deselect.json")) as f:
    _RULES = json.load(f)

try:  # TRL 0.11's PPO tests delete a Hub repo in tearDownClass; there is no Hub here
    import huggingface_hub
    huggingface_hub.HfApi.delete_repo = lambda self, *args, **kwargs: None
except ImportError:
    pass


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
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    with open(os.path.join(_HERE, "deselected.json"), "w") as f:
        json.dump(record, f, indent=1)
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


# --------------------------------------------------------------------------------------
# Tiny local stand-ins for the Hub ids
# --------------------------------------------------------------------------------------

# Per architecture: a tiny config (a few KB of weights) in that config class's own names.
_LLAMA_LIKE = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512)
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
}
# Special tokens per tokenizer family, mimicking the real ones' roles (which exist, which is eos,
# whether there is a pad: GPT-2 and Pythia have none, so tests that add one still work).
TOKENIZERS = {
    "gpt2": dict(specials=["<|endoftext|>"], bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                 unk_token="<|endoftext|>"),
    "qwen": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>",
                 pad_token="<|endoftext|>"),
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
_T = "trl-internal-testing/"
# hub id -> (model_type, head, tokenizer family, extra config). Heads: causal, seqcls (1 label), cls
# (the config's labels), base, seq2seq. Embedding rows follow the real checkpoints: TRL's
# scripts/generate_tiny_models.py sizes its tiny causal LMs to exactly len(tokenizer.vocab), so a
# test that adds "[PAD]" gets an id past the embedding (TRL never embeds pad ids); "pad_vocab"
# gives spare rows instead, as the full-size configs behind TRL's tiny reward models and Pythia have.
MODELS = {
    # TRL 0.26 tests/experimental/test_ppo_trainer.py
    _T + "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal", "qwen", {}),
    _T + "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "seqcls", "qwen", {"pad_vocab": True}),
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
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1200, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=512, **spec)


def build_model(model_type, head, tokenizer, extra, seed):
    import torch
    import transformers as tf

    extra = dict(extra)
    kwargs = {**ARCH[model_type], **{k: v for k, v in extra.items() if k not in ("shard", "pad_vocab")}}
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


def _write_dataset(path, splits: dict, config="default"):
    """A local dataset dir whose README declares the config, as Hub datasets do."""
    files = []
    for split, rows in splits.items():
        rel = f"{config}/{split}.jsonl"
        os.makedirs(os.path.join(path, config), exist_ok=True)
        with open(os.path.join(path, rel), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        files.append(f"  - split: {split}\n    path: {rel}\n")
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{''.join(files)}---\n")


def build_datasets(workdir, rng):
    zen = [{"prompt": ln.rsplit(" ", 1)[0]} for ln in _zen_lines()]  # the aphorism minus its last word
    _write_dataset(os.path.join(workdir, DATASETS[0]), {"train": zen[:-2], "test": zen[-2:]},
                   "standard_prompt_only")
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
    with contextlib.redirect_stdout(io.StringIO()):
        build_datasets(workdir, rng)
    with open(marker, "w") as f:
        json.dump(want, f)
    print(f"stand-ins: built {len(MODELS)} models and {len(DATASETS)} datasets in {time.time() - t0:.0f}s")


# --------------------------------------------------------------------------------------
# Preparing and running a target
# --------------------------------------------------------------------------------------

def rewrite_imports(text: str, rewrites: dict, origin: str) -> str:
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
    # Hub ids the file or the flags name that have no stand-in here (today: only the 0.11 seq2seq
    # models, used by out-of-scope tests alone); printed so that a changed TRL file shows up plainly.
    named = set(re.findall(r'"((?:trl-internal-testing|trl-lib|EleutherAI|cleanrl|lvwerra|stanfordnlp|Qwen)/'
                           r'[\w.-]+|gpt2)"', source + json.dumps(target.args)))
    missing = sorted(i for i in named if not os.path.isdir(os.path.join(workdir, i)))
    if missing:
        more = f", ... ({len(missing)} in all)" if len(missing) > 4 else ""
        print(f"    no stand-in for Hub id(s) named there: {', '.join(missing[:4])}{more}")
    files = {target.dest: rewrite_imports(source, target.rewrites, src), "trl_standins.py": STANDINS_PY,
             "trl/__init__.py": NO_TRL_PY}
    if target.kind == "pytest":
        rules = [{"pattern": p, "category": "out of scope", "reason": OUT_OF_SCOPE} for p in target.out_of_scope]
        rules += exclusion_rules(source)
        pkg = target.dest.split("/")[0]
        # every directory on the way down is a package, so TRL's relative imports resolve
        for d in range(1, target.dest.count("/") + 1):
            files["/".join(target.dest.split("/")[:d]) + "/__init__.py"] = ""
        files[f"{pkg}/testing_utils.py"] = TESTING_UTILS_PY
        files[f"{pkg}/testing_constants.py"] = TESTING_CONSTANTS_PY
        files["conftest.py"] = CONFTEST_PY
        files["deselect.json"] = json.dumps(rules, indent=1)
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
    return msg.splitlines()[0][:220] if msg else ""


def run_pytest(target, tdir, env, workdir, timeout) -> dict:
    junit = os.path.join(workdir, "logs", f"{target.name}.xml")
    log = os.path.join(workdir, "logs", f"{target.name}.log")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-c",
           os.path.join(tdir, "pytest.ini"), "--rootdir", tdir, f"--basetemp={os.path.join(tdir, '.tmp')}",
           f"--junitxml={junit}", "-o", "faulthandler_timeout=600", os.path.join(tdir, target.dest)]
    rc, out, secs = run_bounded(cmd, workdir, env, timeout, log)
    res = {"kind": "pytest", "seconds": round(secs), "log": log, "exit_code": rc, "failures": []}
    tail = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b|"
                                                       r"no tests ran", ln)]
    res["last_line"] = tail[-1].strip("= ") if tail else ""
    for key in ("passed", "failed", "skipped", "error"):
        m = re.search(rf"(\d+) {key}", res["last_line"])
        res[key] = int(m.group(1)) if m else 0
    if os.path.exists(junit) and rc is not None:
        for case in ET.parse(junit).getroot().iter("testcase"):
            for tag in ("failure", "error"):
                el = case.find(tag)
                if el is not None:
                    name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
                    note = STANDIN_LIMITS.get(name)
                    res["failures"].append({"test": name, "outcome": tag, "message": _first_error_line(el),
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
    p.add_argument("--trl026", required=True, help="a TRL v0.26.2 checkout")
    p.add_argument("--trl011", required=True, help="a TRL v0.11.4 checkout")
    p.add_argument("--workdir", help="where stand-ins, copies, logs and outputs go (default: a fresh temp dir); "
                                     "reusing one reuses its stand-ins")
    p.add_argument("--only", action="append", choices=names, metavar="NAME",
                   help="run only this target (repeatable): " + ", ".join(names))
    p.add_argument("--timeout", type=int, default=900, help="seconds per target (default 900)")
    p.add_argument("--rebuild-standins", action="store_true")
    args = p.parse_args(argv)

    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="trl_acceptance-"))
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    print(f"work dir: {workdir}")
    trl_dirs = {"trl026": os.path.abspath(args.trl026), "trl011": os.path.abspath(args.trl011)}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": os.path.join(workdir, ".hf_home"), "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    os.environ.update({k: env[k] for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME")})
    build_standins(workdir, args.rebuild_standins)

    results = {}
    for target in TARGETS:
        if args.only and target.name not in args.only:
            continue
        print(f"\n--- running {target.name} ({target.trl}/{target.src})", flush=True)
        tdir = prepare(target, trl_dirs, workdir)
        if target.kind == "pytest":
            results[target.name] = run_pytest(target, tdir, env, workdir, args.timeout)
        else:
            results[target.name] = run_script(target, tdir, env, workdir, args.timeout)
        report(target.name, results[target.name])

    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nsummary (also {os.path.join(workdir, 'summary.json')}):")
    print(f"{'target':34} {'status':8} {'passed':>6} {'failed':>6} {'skipped':>7} {'error':>5} "
          f"{'excluded':>8} {'out-of-scope':>12} {'secs':>5}")
    for name, r in results.items():
        print(f"{name:34} {r['status']:8} {r['passed']:6} {r['failed']:6} {r['skipped']:7} {r['error']:5} "
              f"{len(r['excluded']):8} {len(r['out_of_scope']):12} {r['seconds']:5}")
    return 0 if results and all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
