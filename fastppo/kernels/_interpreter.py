"""Triton-interpreter backport for the test and bench setup (never imported by the library).

Triton's interpreter before 3.9 (3.6 is what GPU images ship) turns a scalar
(a shape-(1,) array) into a Python index with ``int(array)``, which NumPy 2.4
refuses, so ``range(0, n, BLOCK)`` over a runtime bound fails under
``TRITON_INTERPRET=1``. Triton 3.9 squeezes first; :func:`install` makes older
interpreters do the same. It touches the interpreter only, never compiled
kernels, and does nothing on Triton 3.9+.

Called from ``tests/conftest.py``, ``bench/conftest.py`` and ``bench/tune.py
--smoke``: the places that choose to run kernels through the interpreter.
Importing ``fastppo.kernels`` patches nothing (tests/test_kernel_structure.py).
"""
from __future__ import annotations


def install() -> bool:
    """Install the backport where it is needed; True when it was installed by this call."""
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
