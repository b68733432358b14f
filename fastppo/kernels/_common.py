"""Dispatch and input validation shared by every kernel module.

Dispatch rule, decided here and nowhere else:
  * CUDA tensors run the Triton (or CUDA) kernel;
  * CPU tensors run the plain PyTorch reference (or the C++ op; the LM-head
    entry points a chunked PyTorch path, ``_lmhead``, no [N, V] logits);
  * with ``TRITON_INTERPRET=1`` in the environment, CPU tensors run the Triton
    kernel under Triton's interpreter (how CI checks kernels without a GPU);
  * except calls with a float64 input and a float argument (temperature, clip range...)
    that fp32 cannot hold exactly: they run the reference. Compiled Triton
    passes a Python float as fp32, so a temperature of 0.9 would arrive as
    0.90000004 and move an fp64 log-prob by 2e-7 (found on an H100); fp64 is
    what one asks for exact results, so it gets them. The rule holds under the
    interpreter too, so CI sees the same dispatch as a GPU.

Triton reads ``TRITON_INTERPRET`` when a kernel is *decorated*, so the variable
must be set before ``fastppo.kernels`` is first imported; we read it at call
time here so a test can still route a call to the reference path.

Also here: the launch helper every kernel module goes through (it sets the
CUDA device of the tensors, so a launch on ``cuda:1`` works whatever the
current device is, and rounds float arguments to fp32 so the interpreter sees
what a GPU sees), the double-backward refusal, autograd inside a custom op's
forward (``custom_ops.py``), and the tile-override hook ``bench/tune.py`` uses.
Importing this module changes nothing in Triton: the interpreter backport for
older Triton versions is installed by the test and bench setup
(``fastppo.kernels._interpreter``), not by the library.
"""
from __future__ import annotations

import contextlib
import math
import os
import struct
from collections.abc import Iterable

import torch

try:  # Triton ships with CUDA builds of torch on Linux; elsewhere it may be absent.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = tl = None
    HAS_TRITON = False

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
# Masks: bool, or 0/1 in any integer or float dtype (nonzero = real token).
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64) + FLOAT_DTYPES


def interpret_mode() -> bool:
    """True when Triton kernels should run on CPU tensors via the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def exact_in_fp32(value: float) -> bool:
    """Whether ``value`` survives a round trip through fp32 (how Triton passes a Python float)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0] == value
    except OverflowError:  # beyond fp32's range: some Python builds raise here instead of rounding to inf
        return False


def fp32_scalar(value: float) -> float:
    """``value`` rounded to fp32, as a Python float: what a compiled kernel receives for a float argument.

    ``launch`` passes every float argument through it, so Triton's interpreter (which keeps a Python
    float as fp64) computes with the value a GPU computes with; a product of two such arguments is
    formed on the host (``fp32_product``) or as tensor × scalar × scalar, never scalar × scalar
    inside a kernel (the interpreter would form it in fp64, a GPU in fp32).
    """
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond fp32's range: what the cast to fp32 gives
        return math.copysign(math.inf, value)


def fp32_product(a: float, b: float) -> float:
    """a·b as a GPU kernel forms it from two fp32 arguments: both rounded to fp32, the product rounded once."""
    return fp32_scalar(fp32_scalar(a) * fp32_scalar(b))  # exact in fp64, then one rounding


def use_triton(tensor: torch.Tensor, scalars: Iterable[float] = (), *others: torch.Tensor | None) -> bool:
    """Whether a call on ``tensor`` takes the Triton path (see module docstring); ``scalars``: the float
    arguments the kernel would be passed; ``others``: the call's other floating tensors (None allowed),
    whose dtypes count as ``tensor``'s does (an fp64 reference model beside an fp32 policy computes in fp64)."""
    if not HAS_TRITON:
        return False
    fp64 = any(t is not None and t.dtype == torch.float64 for t in (tensor, *others))
    if fp64 and not all(exact_in_fp32(float(x)) for x in scalars):
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


def _first_mismatch(tensors: dict, key):
    """(name, tensor, first name, first tensor) of the first non-None tensor whose ``key`` differs, or None."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    for name, t in items[1:]:
        if key(t) != key(items[0][1]):
            return name, t, *items[0]
    return None


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming the tensor whose device differs from the first one's."""
    bad = _first_mismatch(tensors, lambda t: t.device)
    if bad:
        name, t, first_name, first = bad
        raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; put them on one device")


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming the tensor whose shape differs from the first one's."""
    bad = _first_mismatch(tensors, lambda t: t.shape)
    if bad:
        name, t, first_name, first = bad
        raise ValueError(f"{name} has shape {tuple(t.shape)} but {first_name} has shape {tuple(first.shape)}; "
                         "they must match")


# Logits are divided by the temperature in fp32: far outside this range logits/T overflows (NaN log-probs)
# or underflows to a uniform distribution.
TEMPERATURE_RANGE = (1e-6, 1e6)


def check_temperature(temperature) -> float:
    """Temperatures divide logits: finite numbers in ``TEMPERATURE_RANGE``."""
    t = check_float("temperature", temperature, minimum=0.0, exclusive_minimum=True)
    low, high = TEMPERATURE_RANGE
    if not low <= t <= high:
        raise ValueError(f"temperature must be in [{low:g}, {high:g}], the supported range (far below it "
                         "logits / temperature in fp32 overflows to NaN, far above it every distribution is "
                         f"uniform), got {t}")
    return t


def check_bool(name: str, value) -> bool:
    """A flag must be a bool: a string like "false" is truthy and would silently turn it on."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_index_range(index: torch.Tensor, vocab_size: int, name: str = "index") -> None:
    """Range check for gather indices, on every device: the same call that raises here on a CPU must not return
    NaN rows on a GPU.

    On a CPU (and under the interpreter) a ``ValueError`` naming the range found, at once (the host sync is free
    there). On CUDA a device-side assertion, queued with no host sync (``torch._assert_async``): an index out of
    range fails the run at the next synchronisation, as ``torch.gather`` does with one, and like any CUDA
    device-side assert it ends the process's CUDA context. Call this before the kernels launch. Under
    ``torch.compile`` (any device) the same assertion, in the graph: a ``RuntimeError`` naming the range when the
    compiled step runs (reading the values on the host would break the graph).
    """
    if index.numel() == 0:
        return
    if index.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(((index >= 0) & (index < vocab_size)).all(),
                            f"fastppo.kernels: {name} values must lie in [0, {vocab_size})")
        return
    lo, hi = int(index.min()), int(index.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} values must lie in [0, {vocab_size}), got min {lo}, max {hi}")


# --------------------------------------------------------------------------- launching


def device_guard(device: torch.device):
    """``torch.cuda.device(device)`` for a CUDA device, a no-op context otherwise."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def launch(kernel, grid, device: torch.device, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` with ``device`` made current for the launch.

    Every Triton launch in ``fastppo.kernels`` goes through here (a test checks
    it): Triton launches on the *current* CUDA device, so without the guard a
    call on tensors of ``cuda:1`` from a process whose current device is 0
    would run on the wrong device.
    """
    args = tuple(fp32_scalar(a) if isinstance(a, float) else a for a in args)
    with device_guard(device):
        kernel[grid](*args, **meta)


def autograd_inside_op():
    """Autograd recording again inside a custom op's implementation (``custom_ops.py``), which runs below the
    autograd dispatch keys: for a forward that differentiates a piece of its own math (``ppo_loss``'s sequence
    level: ``clipped_surrogate`` by autograd on detached leaves). Use with ``torch.enable_grad()``."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def refuse_double_backward(name: str) -> None:
    """Raise in an autograd ``backward`` that builds no graph when a graph is asked for.

    ``torch.autograd.grad(..., create_graph=True)`` runs backward with grad mode on; a backward
    made of kernel launches would return gradients that silently carry no graph (a gradient
    penalty would lose its term), so it refuses instead.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: double backward (create_graph=True) is not supported by the fused kernel's backward; "
            f"differentiate {name}_reference (plain PyTorch, same arguments) twice instead")


# --------------------------------------------------------------------------- tile choices

# The names of every launch choice a tuner may vary, each returned by one tile
# function of one kernel module (``bench/tune.py`` times candidates for each).
TILE_NAMES = (
    "token_logprobs",  # logprobs._token_logprobs_tile: row forward kernel
    "softmax_dlogits",  # logprobs._softmax_dlogits_tile: elementwise dlogits kernels (both LM-head backwards)
    "fused_token_logprobs",  # logprobs._fused_token_logprobs_tile: fused forward
    "lmhead_forward_rows",  # logprobs._lmhead_forward_rows: rows per chunk of the GEMM-then-rows forward (0: fused)
    "fused_full_kl",  # kl._full_kl_tile: fused forward
    "lmhead_backward",  # _lmhead.bwd_chunk_cols: vocabulary columns per backward chunk
    "fused_ppo_policy_loss",  # ppo_loss._ppo_loss_tile: token chunk and row kernel
    "kl_penalty",  # kl._kl_penalty_tile
    "gae",  # gae._gae_tile
)
_TILE_OVERRIDES: dict[str, object] = {}


def tile_choice(name: str, default):
    """The tile a tile function returns: ``default``, unless a tuner overrides ``name``."""
    return _TILE_OVERRIDES.get(name, default)


@contextlib.contextmanager
def override_tile(name: str, tile):
    """Within the block, the tile function named ``name`` returns ``tile`` (for ``bench/tune.py``)."""
    if name not in TILE_NAMES:
        raise ValueError(f"name must be one of {', '.join(TILE_NAMES)}; got {name!r}")
    previous = _TILE_OVERRIDES.get(name)
    _TILE_OVERRIDES[name] = tile
    try:
        yield
    finally:
        if previous is None:
            del _TILE_OVERRIDES[name]
        else:
            _TILE_OVERRIDES[name] = previous


def check_float(name: str, x, *, minimum: float | None = None, maximum: float | None = None,
                exclusive_minimum: bool = False) -> float:
    """A finite Python number in [minimum, maximum] (``(minimum, ...`` with ``exclusive_minimum``), as a float."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}")
    x = float(x)
    low_ok = minimum is None or (x > minimum if exclusive_minimum else x >= minimum)
    if not (math.isfinite(x) and low_ok and (maximum is None or x <= maximum)):
        low = "" if minimum is None else f"{'>' if exclusive_minimum else '>='} {minimum}"
        high = "" if maximum is None else f"<= {maximum}"
        bounds = " and ".join(b for b in (low, high) if b)
        raise ValueError(f"{name} must be a finite number{' ' + bounds if bounds else ''}, got {x}")
    return x
