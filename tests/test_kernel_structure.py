"""The kernel library's structure (issue 14): the rules that kept drifting when they lived in each module.

Source-level checks, cheap and exact: every launch guards its device (it goes
through ``_common.launch``), the LM-head core is defined once, every kernel
module has one section order, no Triton kernel loops with ``while``, every
tile choice is reachable by the tuner, and importing the library patches
nothing in Triton.
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fastppo.kernels as kernels
from fastppo.kernels._common import TILE_NAMES

KERNEL_DIR = Path(kernels.__file__).parent
MODULES = {p.stem: p.read_text() for p in sorted(KERNEL_DIR.glob("*.py"))}
KERNEL_MODULES = ("gae", "kl", "logprobs", "ppo_loss", "masking")
SECTION_ORDER = ("kernels", "launchers", "autograd", "public API", "references")
CORE = ("online_update", "online_expectation", "logits_tile", "softmax_dlogits", "merge_splits", "dot_precision",
        "sm_count", "mm_acc", "addmm_acc_", "vocab_chunked_backward", "split_plan", "acc_dtype")


def _functions(source: str):
    return [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]


def _is_triton_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def test_every_launch_goes_through_the_device_guard():
    # Triton launches on the current CUDA device: a bare kernel[grid](...) on tensors of cuda:1 runs on cuda:0.
    for name, source in MODULES.items():
        assert not re.search(r"\w_kernel\s*\[", source), f"{name}.py launches a kernel without _common.launch"
    assert "with device_guard(device):" in MODULES["_common"]


def test_the_lm_head_core_is_defined_once():
    for name, source in MODULES.items():
        if name == "_lmhead":
            continue
        defined = {fn.name.lstrip("_") for fn in _functions(source)}
        assert not defined & set(CORE), f"{name}.py defines its own {sorted(defined & set(CORE))}"
    lmhead = {fn.name for fn in _functions(MODULES["_lmhead"])}
    assert set(CORE) <= lmhead


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_one_section_order(module):
    found = re.findall(r"^# -{20,} (\w[\w ]*?)(?: \(.*\))?$", MODULES[module], flags=re.M)
    assert found and set(found) <= set(SECTION_ORDER), found
    assert found == sorted(found, key=SECTION_ORDER.index), f"{module}.py: sections {found}"
    assert found[-2:] == ["public API", "references"]


def test_triton_kernels_loop_with_range_not_while():
    # A while loop forgoes Triton's software pipelining; range() over runtime bounds works in every
    # interpreter once the test setup installs fastppo.kernels._interpreter.
    for name, source in MODULES.items():
        for fn in _functions(source):
            if _is_triton_jit(fn):
                assert not any(isinstance(n, ast.While) for n in ast.walk(fn)), f"{name}.{fn.name} has a while loop"


def test_every_tile_choice_is_named_once_for_the_tuner():
    uses = [m for source in MODULES.values() for m in re.findall(r'tile_choice\(\s*"(\w+)"', source)]
    assert sorted(uses) == sorted(TILE_NAMES)


def test_every_public_kernel_has_a_reference_beside_it():
    # plain PyTorch helpers (clipped_surrogate is itself the reference statement of the surrogate loss, clip_sides
    # its per-side clip flags)
    helpers = {"extension_backend", "masked_mean", "masked_var", "masked_whiten", "clipped_surrogate", "clip_sides",
               "check_temperature"}  # and the argument check every kernel taking a temperature shares
    public = [n for n in kernels.__all__ if callable(getattr(kernels, n)) and n[0].islower()]
    for name in public:
        if name.endswith("_reference") or name in helpers:
            continue
        assert f"{name}_reference" in kernels.__all__, name


def test_importing_the_library_patches_nothing_in_triton():
    code = ("import sys, fastppo.kernels; from triton.runtime import interpreter; "
            "print('fastppo.kernels._interpreter' in sys.modules, "
            "getattr(interpreter._patch_lang_tensor, '_fastppo_index', False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"TRITON_INTERPRET": "1", "PATH": "", "PYTHONPATH": str(KERNEL_DIR.parents[1])})
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
    assert all("_patch_lang_tensor" not in s for n, s in MODULES.items() if n != "_interpreter")
