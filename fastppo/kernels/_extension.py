"""Loading the C++/CUDA extension that registers ``torch.ops.fastppo.*``.

Three paths, tried in order, decided once per process:

* ``"aot"``: the binary ``fastppo._C`` built by ``setup.py`` at install time;
* ``"jit"``: compile ``csrc/`` now with ninja (cached under
  ``$XDG_CACHE_HOME/fastppo``, keyed by torch version and source hash), said once;
* ``"reference"``: no binary and no working compiler: the ops are registered
  from Python with the PyTorch reference as their implementation, and a warning
  says so.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

_SOURCE_NAMES = ("truncate_at_stop.h", "truncate_at_stop.cpp", "truncate_at_stop_cuda.cu")
_backend: str | None = None
_python_library = None  # keeps a Python-defined torch.library alive on the reference path


def _source_dir() -> Path | None:
    """The C++ sources: a copy inside the installed package, or the source tree's csrc/."""
    package_dir = Path(__file__).resolve().parent.parent
    for candidate in (package_dir / "_csrc", package_dir.parent / "csrc"):
        if all((candidate / name).is_file() for name in _SOURCE_NAMES):
            return candidate
    return None


def _cache_dir(sources: list[Path]) -> Path:
    digest = hashlib.sha256()
    for src in sources:
        digest.update(src.read_bytes())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastppo"
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info.major}{sys.version_info.minor}"
    path = root / f"ext-{tag}-{digest.hexdigest()[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _jit_compile() -> None:
    from torch.utils.cpp_extension import CUDA_HOME, load

    src_dir = _source_dir()
    if src_dir is None:
        raise RuntimeError("the C++ sources (csrc/) are not shipped with this install")
    sources = [src_dir / "truncate_at_stop.cpp"]
    with_cuda = torch.cuda.is_available() and torch.version.cuda is not None and CUDA_HOME is not None
    if with_cuda:
        sources.append(src_dir / "truncate_at_stop_cuda.cu")
    build_dir = _cache_dir(sources + [src_dir / "truncate_at_stop.h"])
    print(f"fastppo: compiling the C++ op (first use, cached in {build_dir})", file=sys.stderr)
    load(
        name="fastppo_C_jit",
        sources=[str(s) for s in sources],
        extra_cflags=["-O3", "-std=c++17"],
        extra_include_paths=[str(src_dir)],
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=False,
    )


def _register_reference(ops: dict[str, tuple[str, Callable]]) -> None:
    """Define the ops from Python, the reference implementation serving every device."""
    global _python_library
    _python_library = torch.library.Library("fastppo", "DEF")
    for name, (schema, fn) in ops.items():
        _python_library.define(schema)
        _python_library.impl(name, fn, "CompositeExplicitAutograd")


def load_extension(reference_ops: dict[str, tuple[str, Callable]]) -> str:
    """Make ``torch.ops.fastppo`` available; return the active path ("aot", "jit" or "reference")."""
    global _backend
    if _backend is not None:
        return _backend
    try:
        importlib.import_module("fastppo._C")
        _backend = "aot"
        return _backend
    except ImportError:
        pass
    try:
        _jit_compile()
        _backend = "jit"
    except Exception as err:  # no compiler, no headers, no sources: all end on the reference path
        warnings.warn(
            f"fastppo: the C++/CUDA extension is unavailable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "torch.ops.fastppo runs the PyTorch reference implementation instead",
            RuntimeWarning,
            stacklevel=3,
        )
        _register_reference(reference_ops)
        _backend = "reference"
    return _backend


def loaded() -> bool:
    """Whether ``torch.ops.fastppo`` is defined in this process already (by any of the three paths)."""
    return _backend is not None


def try_load_prebuilt() -> None:
    """Import the ahead-of-time binary if it is there (cheap); the JIT waits for first use."""
    global _backend
    if _backend is None:
        try:
            importlib.import_module("fastppo._C")
            _backend = "aot"
        except ImportError:
            pass
