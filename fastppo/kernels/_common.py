"""Dispatch and input validation shared by every kernel module.

Dispatch rule, decided here and nowhere else:
  * CUDA tensors run the Triton (or CUDA) kernel;
  * CPU tensors run the plain PyTorch reference (or the C++ op);
  * with ``TRITON_INTERPRET=1`` in the environment, CPU tensors run the Triton
    kernel under Triton's interpreter (how CI checks kernels without a GPU).

Triton reads ``TRITON_INTERPRET`` when a kernel is *decorated*, so the variable
must be set before ``fastppo.kernels`` is first imported; we read it at call
time here so a test can still route a call to the reference path.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

import torch

try:  # Triton ships with CUDA builds of torch on Linux; elsewhere it may be absent.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = tl = None
    HAS_TRITON = False


def _interpreter_index_backport() -> None:
    """Let older Triton interpreters (3.6 here) loop over runtime bounds with NumPy >= 2.4.

    That interpreter turns a scalar (a shape-(1,) array) into a Python index
    with ``int(array)``, which NumPy 2.4 refuses, so ``range(0, n, BLOCK)``
    fails under TRITON_INTERPRET=1 (Triton 3.6 is what GPU images ship).
    Triton 3.9 squeezes first; this does the same on older ones. It touches
    the interpreter only, never compiled kernels, and nothing on Triton 3.9+.
    """
    try:
        from triton.runtime import interpreter
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except (ImportError, ValueError):  # pragma: no cover
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if (major, minor) >= (3, 9) or patch is None or getattr(patch, "_fastppo_index", False):
        return

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._fastppo_index = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


if HAS_TRITON:
    _interpreter_index_backport()

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
# Masks: bool, or 0/1 in any integer or float dtype (nonzero = real token).
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64) + FLOAT_DTYPES


def interpret_mode() -> bool:
    """True when Triton kernels should run on CPU tensors via the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a call on ``tensor`` takes the Triton path (see module docstring)."""
    if not HAS_TRITON:
        return False
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and interpret_mode()


def check_tensor(
    name: str,
    x,
    *,
    ndim: int | Iterable[int] | None = None,
    min_ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
) -> None:
    """Raise TypeError/ValueError naming ``name`` when ``x`` is not as expected."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if x.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({allowed}), got {str(x.dtype).replace('torch.', '')}")
    if ndim is not None:
        allowed_ndim = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.dim() not in allowed_ndim:
            raise ValueError(f"{name} must be {'/'.join(map(str, allowed_ndim))}-D, got shape {tuple(x.shape)}")
    if min_ndim is not None and x.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(x.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming the tensor whose device differs from the first one's."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; put them on one device")


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming the tensor whose shape differs from the first one's."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but {first_name} has shape {tuple(first.shape)}; they must match")


def check_temperature(temperature) -> float:
    """Temperatures divide logits: they must be finite numbers > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    temperature = float(temperature)
    if not (temperature > 0.0) or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return temperature


def check_index_range(index: torch.Tensor, vocab_size: int, name: str = "index") -> None:
    """Range check for gather indices.

    Costs one host sync, so it runs only on the reference path and under the
    interpreter; on CUDA the kernels mask out-of-range loads instead of faulting
    and users who need the check can call this function themselves.
    """
    if index.numel() == 0:
        return
    lo, hi = int(index.min()), int(index.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} values must lie in [0, {vocab_size}), got min {lo}, max {hi}")
