"""The implementations fastppo is timed against, each behind an adapter with fastppo's calling
convention, so a bench case can swap one for another.

Each peer is imported lazily; :func:`require` skips the case, with the reason, where the peer is
not installed or cannot run here. Adapters return what the matching fastppo op returns
(log-probabilities, not losses), so a case can check them against the reference before timing.
"""
from __future__ import annotations

import importlib

import pytest
import torch


def require(module: str, attr: str):
    """``module.attr``, or skip the case saying why it is unavailable."""
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # not installed, or its import needs CUDA/triton
        pytest.skip(f"peer {module}.{attr} is unavailable: {type(e).__name__}: {e}")


def compiled(fn, device: str):
    """``torch.compile(fn)``; on the CPU (--smoke) only traced (backend "eager"), to keep CI fast."""
    return torch.compile(fn, backend="inductor" if torch.device(device).type == "cuda" else "eager")


# --------------------------------------------------------------------------- [.., V] logits -> log-probs


def trl_token_logprobs(logits, index, temperature=1.0, return_entropy=False):
    """TRL 0.2x: ``selective_log_softmax`` (a loop over the batch dimension) and, for the entropy, a
    second pass, ``entropy_from_logits`` (chunks of 128 rows), as its trainers call them."""
    selective_log_softmax = require("trl.trainer.utils", "selective_log_softmax")
    entropy_from_logits = require("trl.trainer.utils", "entropy_from_logits")
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = selective_log_softmax(logits, index)
    return (logprobs, entropy_from_logits(logits)) if return_entropy else logprobs


def liger_selective_logprobs(logits_one_longer, index, temperature=1.0):
    """Liger-Kernel's ``fused_selective_log_softmax`` (forward only, no gradient, no entropy).

    It takes logits [B, T + 1, V] (the causal LM's, one position longer than the ids) and scores
    positions 0..T-1 against ``index`` [B, T]: the same B·T rows of work as the others."""
    fused_selective_log_softmax = require("liger_kernel.ops.grpo_loss", "fused_selective_log_softmax")
    return fused_selective_log_softmax(logits_one_longer, index, temperature)


def flash_attn_token_logprobs(logits, index, temperature=1.0):
    """flash-attn's Triton cross-entropy (per-row losses = −log-probabilities); no entropy."""
    cross_entropy_loss = require("flash_attn.ops.triton.cross_entropy", "cross_entropy_loss")
    vocab = logits.shape[-1]
    losses, _ = cross_entropy_loss(logits.reshape(-1, vocab), index.reshape(-1), logit_scale=1.0 / temperature)
    return -losses.view(index.shape)


# --------------------------------------------------------------------------- hidden, LM head -> log-probs


def liger_flce_logprobs(hidden, weight, index):
    """Liger-Kernel's fused linear cross-entropy, reduction="none" (per-token −log-probabilities).

    No entropy, temperature 1 only. Its reduction="none" backward scales every row by the *first*
    upstream gradient, so a fwd+bwd case must use uniform upstream gradients (the bench's are)."""
    loss_cls = require("liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss")
    return -loss_cls(reduction="none")(weight, hidden, index)
