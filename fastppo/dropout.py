"""Turning off every dropout a model has.

fastppo's rollout and training forwards must agree (the first PPO ratio is exactly 1), so no forward may be random.
Dropout hides in three places: ``nn.Dropout`` modules (GPT-2's), a probability an attention module copied from its
config at construction and hands to its attention function (transformers' ``LlamaAttention`` passes
``dropout=0.0 if not self.training else self.attention_dropout``, with no module to find), and the config itself,
read by models that look it up at forward time. All three are zeroed.
"""
from __future__ import annotations

import torch.nn as nn

__all__ = ["disable_dropout", "is_dropout_field"]


def is_dropout_field(name: str) -> bool:
    """A dropout probability by its name, as transformers' models and configs spell them: ``attention_dropout``,
    ``hidden_dropout``, ``dropout``, ``dropout_rate``, ``attention_probs_dropout_prob``, ``attn_pdrop``,
    ``resid_pdrop``, ``embd_pdrop``."""
    return "dropout" in name or name.endswith("pdrop")


def _zero_fields(owner) -> None:
    for name, value in list(vars(owner).items()):
        # floats only: a flag such as ESM's ``token_dropout`` is a bool, and a module is handled as a module
        if is_dropout_field(name) and isinstance(value, float) and not isinstance(value, bool):
            setattr(owner, name, 0.0)


def _configs(config, seen: set[int]):
    """``config`` and every config nested in it (a multimodal model's ``text_config``), each once."""
    if id(config) in seen:
        return
    seen.add(id(config))
    yield config
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            yield from _configs(value, seen)


def disable_dropout(model: nn.Module) -> None:
    """p = 0 everywhere (TRL zeroes the ``nn.Dropout`` modules; fastppo also the probabilities attention modules
    and configs hold): with dropout on, the rollout and training forwards differ."""
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):  # Dropout, Dropout1d/2d/3d, AlphaDropout
            module.p = 0.0
        _zero_fields(module)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for each in _configs(config, seen):
                _zero_fields(each)
