"""truncate_at_stop: cut generated responses at their first stop token.

The fast paths are the C++ (CPU) and CUDA ops in ``csrc/``, registered as
``torch.ops.fastppo.truncate_at_stop``; the reference at the end of the module
(the same section order as every kernel module: launchers, public, references)
is the oracle in tests and the implementation when no compiled op can be had.

For each row of ``responses`` [B, T]:
  * ``first`` = position of the first token in ``stop_ids`` (T if none);
  * ``truncated[t]`` = ``responses[t]`` for t <= first, ``pad_id`` after
    (the stop token is kept, it is part of the response the reward sees);
  * ``lengths`` = first + 1 (T without a stop token), ``mask`` = t < lengths,
    ``has_stop`` = a stop token was found.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fastppo.kernels import _extension
from fastppo.kernels._common import INDEX_DTYPES, check_same_device, check_tensor

# --------------------------------------------------------------------------- launchers (the compiled op)

_SCHEMA = "truncate_at_stop(Tensor responses, Tensor stop_ids, int pad_id) -> (Tensor, Tensor, Tensor, Tensor)"


def _fake_impl(responses: torch.Tensor, stop_ids: torch.Tensor, pad_id: int):
    B, T = responses.shape
    return (
        torch.empty_like(responses),
        responses.new_empty((B,), dtype=torch.int64),
        responses.new_empty((B, T), dtype=torch.bool),
        responses.new_empty((B,), dtype=torch.bool),
    )


_fake_registered = False


def _register_fake() -> None:
    """The op's fake (meta) implementation, once: what torch.compile traces the op with."""
    global _fake_registered
    if not _fake_registered:
        torch.library.register_fake("fastppo::truncate_at_stop")(_fake_impl)
        _fake_registered = True


def _ensure_op() -> str:
    backend = _extension.load_extension({"truncate_at_stop": (_SCHEMA, _truncate_reference_impl)})
    _register_fake()
    return backend


# --------------------------------------------------------------------------- public API


def extension_backend() -> str:
    """Which implementation backs ``torch.ops.fastppo``: "aot", "jit" or "reference".

    Loads (and on first use compiles) the extension if that has not happened yet.
    """
    return _ensure_op()


def _check_truncate_at_stop_args(responses, stop_ids, pad_id) -> tuple[torch.Tensor, torch.Tensor, int]:
    if isinstance(responses, torch.Tensor) and responses.is_floating_point():
        raise TypeError(f"responses must hold integer token ids (int32 or int64), got {responses.dtype}")
    check_tensor("responses", responses, ndim=2, dtypes=INDEX_DTYPES)
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise TypeError(f"pad_id must be an int, got {type(pad_id).__name__}")
    if not 0 <= pad_id <= torch.iinfo(torch.int64).max:
        raise ValueError(f"pad_id must be a token id in [0, 2**63), got {pad_id}")
    if responses.dtype == torch.int32 and pad_id > torch.iinfo(torch.int32).max:
        raise ValueError(f"pad_id {pad_id} does not fit in int32 responses")
    if isinstance(stop_ids, torch.Tensor):
        if stop_ids.is_floating_point() or stop_ids.dtype == torch.bool:
            raise TypeError(f"stop_ids must hold integer token ids, got {stop_ids.dtype}")
        check_same_device(responses=responses, stop_ids=stop_ids)
        stop_tensor = stop_ids.reshape(-1).to(torch.int64)
    else:
        ids = [stop_ids] if isinstance(stop_ids, int) and not isinstance(stop_ids, bool) else stop_ids
        if not isinstance(ids, Sequence) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError(f"stop_ids must be an int, a sequence of ints or an integer tensor, got {stop_ids!r}")
        big = [i for i in ids if not -(2**63) <= i < 2**63]
        if big:
            raise ValueError(f"stop_ids {big} do not fit in int64 (token ids are < 2**63)")
        stop_tensor = torch.tensor(list(ids), dtype=torch.int64, device=responses.device)
    if stop_tensor.numel() == 0:
        raise ValueError("stop_ids must name at least one token id, got none")
    return responses, stop_tensor, pad_id


def truncate_at_stop(responses: torch.Tensor, stop_ids: int | Sequence[int] | torch.Tensor, pad_id: int):
    """Truncate each response at its first stop token and build its padding mask, in one pass.

    Args:
        responses: [B, T] int32/int64 generated token ids (the response part of
            query+response, right side). Non-contiguous tensors are accepted.
        stop_ids: the stop token id, or several (e.g. Llama-3's eos and eot),
            as an int, a sequence of ints or an integer tensor.
        pad_id: id written after the stop token (>= 0).

    Returns:
        ``(truncated, lengths, mask, has_stop)``: ``truncated`` [B, T] same dtype
        as ``responses``, the first stop token kept and ``pad_id`` after it;
        ``lengths`` [B] int64 kept tokens per row (T when the row has no stop
        token); ``mask`` [B, T] bool, True on kept tokens; ``has_stop`` [B] bool.

    CPU tensors run the C++ op, CUDA tensors the CUDA op (one launch); see
    :func:`extension_backend` for which path is active.
    """
    responses, stop_tensor, pad_id = _check_truncate_at_stop_args(responses, stop_ids, pad_id)
    if not _fake_registered:  # registered at import when the built op is there (the usual case)
        if torch.compiler.is_compiling():
            raise RuntimeError("truncate_at_stop: the C++ op is not loaded yet (no ahead-of-time build; the JIT "
                               "build runs on first use); call fastppo.kernels.extension_backend() once before "
                               "torch.compile traces it")
        _ensure_op()
    return torch.ops.fastppo.truncate_at_stop(responses, stop_tensor, pad_id)


# --------------------------------------------------------------------------- references


def _truncate_reference_impl(responses: torch.Tensor, stop_ids: torch.Tensor, pad_id: int):
    B, T = responses.shape
    is_stop = torch.isin(responses, stop_ids)  # [B, T]
    has_stop = is_stop.any(dim=1)
    # first_true_indices: the smallest t with is_stop, T where there is none.
    positions = torch.arange(T, device=responses.device).expand(B, T)
    first = torch.where(is_stop, positions, T).min(dim=1).values if T > 0 else torch.zeros(B, dtype=torch.long, device=responses.device)
    lengths = torch.where(has_stop, first + 1, T).to(torch.int64)
    mask = positions < lengths.unsqueeze(1)
    truncated = torch.where(mask, responses, torch.full_like(responses, pad_id))
    return truncated, lengths, mask, has_stop


def truncate_at_stop_reference(responses: torch.Tensor, stop_ids: int | Sequence[int] | torch.Tensor, pad_id: int):
    """Plain PyTorch version of :func:`truncate_at_stop` (the oracle; same arguments and outputs)."""
    responses, stop_tensor, pad_id = _check_truncate_at_stop_args(responses, stop_ids, pad_id)
    return _truncate_reference_impl(responses, stop_tensor, pad_id)


_extension.try_load_prebuilt()
if _extension.loaded():  # the ahead-of-time op: its fake now, so a first call inside torch.compile traces
    _register_fake()
