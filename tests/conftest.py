"""Test-session setup.

Triton decides at decoration time whether a kernel is interpreted, so
TRITON_INTERPRET must be in the environment before ``fastppo.kernels`` is
imported. On a CPU machine we turn it on so the Triton kernels are exercised;
on a GPU machine run ``TRITON_INTERPRET=0 pytest tests/`` to test the compiled
kernels on CUDA tensors.
"""
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from fastppo.kernels._common import interpret_mode  # noqa: E402


@pytest.fixture
def triton_device() -> torch.device:
    """The device on which a kernel call takes the Triton path, or skip."""
    if torch.cuda.is_available() and not interpret_mode():
        return torch.device("cuda")
    if interpret_mode():
        return torch.device("cpu")
    pytest.skip("the Triton path needs a CUDA GPU or TRITON_INTERPRET=1")


@pytest.fixture
def reference_path(monkeypatch):
    """Route CPU calls to the PyTorch reference even when the interpreter is on."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
