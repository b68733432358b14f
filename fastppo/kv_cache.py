"""The samplers' KV caches: keys and values kept in the model's compute dtype, and what a cache holds, in one line.

Under autocast the weights stay fp32 and the matmuls run in the autocast dtype, so a Llama layer's keys leave the
rotary embedding in fp32 (fp32 hidden states times fp32 cos and sin) while its values leave a bf16 projection. A
cache that keeps them as they come holds fp32 keys (transformers' ``StaticLayer`` refuses the bf16 values; upcast,
it holds both in fp32: twice the memory of the compute dtype). Yet sdpa and eager attention read the cache only
through ops on autocast's lower-precision list (``scaled_dot_product_attention``, ``matmul``), which cast both to
the autocast dtype first: keys and values stored already cast are what the attention would read, bit for bit, at
half the memory and half the bytes each decode step reads. Other attention implementations (flash, flex, a hub
kernel) may read them otherwise, so their caches keep the promoted dtype; so does every cache outside autocast,
where keys and values arrive in the model's own dtype.
"""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["compute_dtype_layers", "describe", "new_dynamic_cache", "stored_dtype"]

# the attention implementations whose reads of the cache are autocast's lower-precision ops (transformers' names)
AUTOCAST_READS = ("sdpa", "eager")


def casts_to_compute_dtype(lm) -> bool:
    """Whether ``lm``'s attention reads its cache through autocast's casts (``AUTOCAST_READS``): then the cache may
    store keys and values in the autocast dtype. ``lm.config`` is the base model's through PEFT's wrappers."""
    return getattr(getattr(lm, "config", None), "_attn_implementation", None) in AUTOCAST_READS


def stored_dtype(key_states: torch.Tensor, value_states: torch.Tensor, cast: bool) -> torch.dtype:
    """The dtype a cache layer keeps: the autocast dtype where ``cast`` and autocast is on for the keys' device,
    else the two dtypes promoted (exact: the attention casts both to what the eager loop's cache gives it)."""
    device = key_states.device.type
    if cast and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(key_states.dtype, value_states.dtype)


_LAYER_CLASSES: dict[tuple[type, bool], type] = {}
_BASE_OF: dict[type, type] = {}  # each made class's base


def _layer_class(base: type, cast: bool) -> type:
    """``base`` (a cache layer class) storing its keys and values in ``stored_dtype``."""
    if (base, cast) not in _LAYER_CLASSES:
        def update(self, key_states, value_states, *args, **kwargs):
            dtype = stored_dtype(key_states, value_states, cast)
            return base.update(self, key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

        name = f"{'ComputeDtype' if cast else 'Promoting'}{base.__name__}"
        _LAYER_CLASSES[base, cast] = made = type(name, (base,), {"update": update})
        _BASE_OF[made] = base
    return _LAYER_CLASSES[base, cast]


def compute_dtype_layers(cache, lm, cast: bool | None = None):
    """``cache`` (a static or dynamic cache of ``lm``) with each layer storing ``stored_dtype``; a dynamic cache
    without layers yet makes them so too. ``cast``: whether the autocast dtype may be stored (unset: where ``lm``'s
    attention reads the cache through autocast's casts; False keeps the promoted dtype). Returns the cache."""
    cast = casts_to_compute_dtype(lm) if cast is None else cast
    for layer in cache.layers:
        layer.__class__ = _layer_class(_BASE_OF.get(type(layer), type(layer)), cast)
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = _layer_class(DynamicLayer, cast)
    return cache


def new_dynamic_cache(lm) -> DynamicCache:
    """An empty dynamic cache of ``lm`` (its layer types from its config where transformers takes one), its layers
    in the compute dtype."""
    cache = (DynamicCache(config=lm.config) if "config" in inspect.signature(DynamicCache).parameters
             else DynamicCache())
    return compute_dtype_layers(cache, lm)


def describe(cache) -> str:
    """What ``cache`` holds, one line: dtype, rows × positions × layers (positions: the longest layer's), MiB of its
    keys and values."""
    tensors = [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, torch.Tensor) and t.dim() == 4]
    if not tensors:
        return "KV cache empty"
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    rows = max(t.shape[0] for t in tensors)
    positions = max(t.shape[2] for t in tensors)
    mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    return (f"KV cache {'/'.join(dtypes)}, {rows} rows × {positions} positions × {len(tensors) // 2} layers, "
            f"{mib:.1f} MiB")
