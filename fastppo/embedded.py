"""The embedded default: a tiny causal LM and tokenizer built locally, and the built-in prompts.

``python -m fastppo.train`` with no flags trains this model on the built-in
prompt set against ``fastppo.rewards:positive_words``: no download, minutes on
a CPU. The model and tokenizer are written once with ``save_pretrained`` to a
cache directory and then loaded by the trainer through the same
``from_pretrained`` path as any Hugging Face checkpoint.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fastppo.rewards import DEFAULT_REWARD_FN, NEGATIVE_WORDS, POSITIVE_WORDS  # noqa: F401  (re-exported)

EMBEDDED_VERSION = 1  # bump when the vocabulary or the architecture changes
PROMPTS_PATH = str(resources.files("fastppo") / "builtin_prompts.jsonl")

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
_PROMPT_WORDS = (
    "the movie film story acting music ending plot cast director script soundtrack dialogue camera work "
    "first half sequel book show performance villain hero was is felt seemed looked sounded honestly i "
    "think my friend said overall to be fair"
).split()
_FILLER_WORDS = (
    "a an and but or so very quite really too not it this that they we you he she of in on at with for "
    "as by from about than then just also still even only more most less some many much all every one "
    "two three time day night year way thing people man woman world life part place end scene scenes "
    "actor actors story stories line lines kind sort bit lot rather pretty fairly almost nearly mostly "
    "long short old new young big small little high low long hard easy real true strange odd quiet loud "
    "dark light fast late early again always never often sometimes here there now today yesterday"
).split()


def vocabulary() -> list[str]:
    """Special tokens first, then every word the prompts and the reward use, then filler."""
    words = [PAD, EOS, UNK]
    for w in (*_PROMPT_WORDS, *POSITIVE_WORDS, *NEGATIVE_WORDS, *_FILLER_WORDS):
        if w not in words:
            words.append(w)
    return words


def build_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over ``vocabulary()``."""
    vocab = {w: i for i, w in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, model_max_length=256
    )


def build_model(tokenizer, seed: int = 0):
    """A randomly initialised 2-layer Llama with hidden size 64 (~60k parameters)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def cache_dir() -> str:
    root = os.environ.get("FASTPPO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastppo"
    )
    return os.path.join(root, f"embedded-tiny-llama-v{EMBEDDED_VERSION}")


def embedded_model_path() -> str:
    """Directory holding the embedded model and tokenizer, built on first use.

    Each process builds into a private temporary directory and renames it into
    place, so ranks started together by torchrun never see a half-written copy
    (the build is deterministic, so whichever rename wins holds the same files).
    """
    path = cache_dir()
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(path))
    try:
        tokenizer = build_tokenizer()
        tokenizer.save_pretrained(tmp)
        build_model(tokenizer).save_pretrained(tmp)
        if not os.path.isfile(os.path.join(tmp, "config.json")):
            # transformers writes checkpoints on rank 0 only once torch.distributed is initialised
            raise RuntimeError("embedded_model_path() must run before torch.distributed.init_process_group")
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
