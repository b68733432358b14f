"""Triton-interpreter backport for the test and bench setup (never imported by the library).

Triton's interpreter before 3.9 (3.6 is what GPU images ship) turns a scalar
(a shape-(1,) array) into a Python index with ``int(array)``, which NumPy 2.4
refuses, so ``range(0, n, BLOCK)`` over a runtime bound fails under
``TRITON_INTERPRET=1``. Triton 3.9 squeezes first; :func:`install` makes older
interpreters do the same. It touches the interpreter only, never compiled
kernels, and does nothing on Triton 3.9+.

Second, on every Triton version: the interpreter keeps a float argument as a
Python float (fp64), where a compiled kernel receives it as fp32. A product of
two float arguments inside a kernel (γ·λ, cap_in·cap_out) is then formed in fp64
under the interpreter and in fp32 on a GPU, and CI would not see what a GPU
computes. :func:`install` makes the interpreter pass a float argument as an fp32
scalar, as a GPU does (issue 36).

Called from ``tests/conftest.py``, ``bench/conftest.py`` and ``bench/tune.py
--smoke``: the places that choose to run kernels through the interpreter.
Importing ``fastppo.kernels`` patches nothing (tests/test_kernel_structure.py).
"""
from __future__ import annotations


def install() -> bool:
    """Install the backports where they are needed; True when the index backport was installed by this call."""
    _install_fp32_float_args()
    return _install_index_backport()


def _install_fp32_float_args() -> bool:
    """Float kernel arguments become fp32 scalars under the interpreter, as they are for a compiled kernel."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - no Triton
        return False
    convert = getattr(interpreter, "_implicit_cvt", None)
    if convert is None or getattr(convert, "_fastppo_fp32", False) or not hasattr(interpreter, "TensorHandle"):
        return False

    def _implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    _implicit_cvt._fastppo_fp32 = True
    interpreter._implicit_cvt = _implicit_cvt
    return True


def _install_index_backport() -> bool:
    try:
        import triton
        from triton.runtime import interpreter

        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except (ImportError, ValueError):  # pragma: no cover - no Triton, or an unparsable version
        return False
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if (major, minor) >= (3, 9) or patch is None or getattr(patch, "_fastppo_index", False):
        return False

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._fastppo_index = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True
