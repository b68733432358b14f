"""fastppo's LM-head kernels inside TRL 1.x, with one call (in the style of Liger's ``apply_liger_kernel_to_*``).

    from fastppo.integrations.trl import apply_fastppo_kernels_to_trl

    patch = apply_fastppo_kernels_to_trl()
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    trainer.train()
    patch.undo()  # or use the patch as a context manager

What it routes (TRL 1.16's seams; the call refuses a TRL whose seams differ):

* ``trl.trainer.utils._ChunkedLogProbFunction``: the per-token log-probabilities, entropy
  and statistics of TRL's fused LM head (``add_fused_lm_head``), which GRPO, RLOO, DPO, KTO
  and SFT use. ``add_fused_lm_head``'s forward looks the name up on every call, so the patch
  applies to trainers built before it as well. Each call becomes one
  ``fastppo.kernels.fused_token_logprobs`` (soft-cap, logit scale, temperature, TRL's output
  selection, TRL's compute-dtype rule); TRL's ``chunk_size`` is not used (fastppo's kernel
  tiles the vocabulary itself).
* ``selective_log_softmax``, ``entropy_from_logits`` and ``selective_log_softmax_and_entropy``
  of ``trl.trainer.utils``, and the same functions wherever a loaded ``trl`` module imported
  them by name; a trainer module imported while the patch is on imports fastppo's. Top-K
  gathers (``index`` with a K axis) go to TRL's own function.

Patches nest: a call while one is on, with the same options, returns another hold on it, and
TRL's objects come back when the last hold is undone (leaving an inner ``with`` block keeps the
outer one's routing); a call with other options is refused, naming the active patch. The last
``undo()`` puts TRL's objects back in every loaded module that holds one of fastppo's, however
late it was imported (``trl.experimental.cpo``, ``orpo``, a module of yours).

Differences a user can see: fastppo's results are fp32 for 16-bit inputs (TRL rounds the
logits of a bf16 GEMM to bf16 before its fp32 softmax, and its logits helpers return bf16),
so bf16 runs differ from TRL's own at bf16 rounding and are closer to float64
(``bench/trl1_logprobs.py``, ``bench/cpu_lmhead_memory.py`` and ``tests/test_trl1_integration.py`` measure
both).
"""
from __future__ import annotations

import importlib
import inspect
import sys
import warnings

from packaging.version import Version

from fastppo.kernels import fused_token_logprobs, token_logprobs

TESTED_TRL_VERSION = "1.16.0"
# The seam's parameters in TRL 1.16 (after ctx); another TRL with the same ones is accepted with a warning.
SEAM_PARAMETERS = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
                   "logit_scale", "outputs")
# TRL's names of the seam's outputs, in its order, and fastppo's names for them.
TRL_OUTPUTS = {"log_probs": "logprobs", "entropy": "entropy", "log_sum_sq_probs": "log_sum_sq_probs",
               "mean_logits": "mean_logits", "is_top1": "is_top1"}
HELPERS = ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy")


class FastppoChunkedLogProb:
    """Stands where TRL 1.x has ``_ChunkedLogProbFunction``: the same ``apply`` signature and 5-tuple, computed by
    ``fused_token_logprobs``. Gradients flow through log_probs and entropy; the other three are statistics."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=tuple(TRL_OUTPUTS)):
        unknown = [n for n in outputs if n not in TRL_OUTPUTS]
        if unknown:
            raise ValueError(f"TRL asked the fused LM head for {unknown}; fastppo.integrations.trl knows "
                             f"{', '.join(TRL_OUTPUTS)} (TRL {TESTED_TRL_VERSION})")
        ours = ("logprobs", *(TRL_OUTPUTS[n] for n in outputs if n != "log_probs"))
        stats = fused_token_logprobs(hidden, weight, targets, float(temperature), bias=bias, outputs=ours,
                                     softcap=final_logit_softcapping, logit_scale=float(logit_scale))
        return stats.logprobs, stats.entropy, stats.log_sum_sq_probs, stats.mean_logits, stats.is_top1


def _rows_form(logits, index) -> bool:
    """Whether the call gathers one token per row (fastppo's form) rather than TRL's top-K form."""
    return index is not None and index.ndim == logits.ndim - 1


def _masked(index, row_mask):
    """TRL's row_mask (0 = skip the row) as fastppo's ignore_index: (index, ignore_index)."""
    if row_mask is None:
        return index, None
    return index.masked_fill(row_mask == 0, -1), -1


def _make_helpers(originals: dict):
    def selective_log_softmax(logits, index, temperature=1.0, row_mask=None):
        if not _rows_form(logits, index):
            return originals["selective_log_softmax"](logits, index, temperature, row_mask)
        if temperature <= 0:
            raise ValueError("temperature must be positive")
        index, ignore = _masked(index, row_mask)
        return token_logprobs(logits, index, float(temperature), ignore_index=ignore)

    def entropy_from_logits(logits, chunk_size=128):
        return token_logprobs(logits, None, outputs=("entropy",)).entropy

    def selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=True, temperature=1.0,
                                          row_mask=None):
        if not _rows_form(logits, index):
            return originals["selective_log_softmax_and_entropy"](logits, index, entropy_requires_grad,
                                                                  temperature, row_mask)
        if temperature <= 0:
            raise ValueError("temperature must be positive")
        index, ignore = _masked(index, row_mask)
        logp, entropy = token_logprobs(logits, index, float(temperature), return_entropy=True, ignore_index=ignore)
        return logp, entropy if entropy_requires_grad else entropy.detach()

    return {"selective_log_softmax": selective_log_softmax, "entropy_from_logits": entropy_from_logits,
            "selective_log_softmax_and_entropy": selective_log_softmax_and_entropy}


class _Routing:
    """The routing in place: TRL's objects it replaced, fastppo's objects standing for them, and how many patches
    (holds) keep it on. Restoring puts TRL's objects back wherever fastppo's are, however late that was."""

    def __init__(self, trl_version: str, options: dict, replaced: list[tuple[object, str, object]], ours: dict):
        self.trl_version = trl_version
        self.options = options  # apply's keyword arguments
        self.replaced = replaced  # (module, attribute, TRL's object), set at apply
        self.ours = ours  # name -> (fastppo's object, TRL's object)
        self.holds = 0
        self.restored = False

    def names(self) -> list[str]:
        return sorted({f"{m.__name__}.{n}" for m, n, _ in self.replaced})

    def restore(self) -> None:
        """TRL's objects back: the attributes set at apply, then every attribute of every loaded module that
        holds one of fastppo's objects (a module that imported a helper by name while the routing was on, such
        as ``trl.experimental.cpo``, or under another name), except fastppo's own modules and the public name
        ``FastppoChunkedLogProb`` (a user's import of it). Module dictionaries are read directly, so a lazy
        module's ``__getattr__`` imports nothing."""
        for module, name, original in reversed(self.replaced):
            setattr(module, name, original)
        back = {id(mine): (mine, original) for mine, original in self.ours.values()}
        for module_name, module in list(sys.modules.items()):
            if module_name == "fastppo" or str(module_name).startswith("fastppo."):
                continue
            try:
                attributes = vars(module)
            except TypeError:
                continue
            for name, value in list(attributes.items()):
                pair = back.get(id(value))
                if pair is not None and pair[0] is value and name != FastppoChunkedLogProb.__name__:
                    setattr(module, name, pair[1])
        self.replaced = []
        self.restored = True


class TRLKernelPatch:
    """A hold on the routing ``apply_fastppo_kernels_to_trl`` set up. ``undo()`` (or leaving its ``with`` block)
    releases this hold, once; TRL's own objects come back when the last hold is released, so nested blocks
    leave the outer one's routing in place."""

    def __init__(self, routing: _Routing):
        self._routing = routing
        self._held = True
        routing.holds += 1

    @property
    def trl_version(self) -> str:
        return self._routing.trl_version

    @property
    def options(self) -> dict:
        return dict(self._routing.options)

    @property
    def replaced(self) -> list[tuple[object, str, object]]:
        return list(self._routing.replaced) if self.active else []

    @property
    def active(self) -> bool:
        return self._held and not self._routing.restored and _routing is self._routing

    def undo(self) -> None:
        global _routing
        if not self._held:
            return
        self._held = False
        routing = self._routing
        routing.holds -= 1
        if routing.holds <= 0 and not routing.restored:
            routing.restore()
            if _routing is routing:
                _routing = None

    def __enter__(self) -> TRLKernelPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        names = self._routing.names()
        options = ", ".join(f"{k}={v}" for k, v in self._routing.options.items())
        state = f"{self._routing.holds} hold(s)" if self.active else "undone"
        return f"TRLKernelPatch(trl {self.trl_version}, {options}, {state}, {len(names)} names: {', '.join(names)})"


_routing: _Routing | None = None


def _check_trl():
    """The installed TRL and its ``trl.trainer.utils``, or a clear error when fastppo does not know its seams."""
    try:
        trl = importlib.import_module("trl")
    except ImportError as err:
        raise ImportError(f"fastppo.integrations.trl needs TRL 1.x (tested with {TESTED_TRL_VERSION}): "
                          f"pip install trl=={TESTED_TRL_VERSION}") from err
    version = Version(trl.__version__)
    if version.major != 1:
        raise RuntimeError(f"fastppo.integrations.trl patches TRL 1.x's fused LM head (tested with "
                           f"{TESTED_TRL_VERSION}); the installed TRL is {trl.__version__}. TRL 0.x has no such "
                           "seam: use fastppo.kernels.token_logprobs in place of selective_log_softmax there")
    utils = importlib.import_module("trl.trainer.utils")
    seam = getattr(utils, "_ChunkedLogProbFunction", None)
    if seam is None or not hasattr(seam, "forward"):
        raise RuntimeError(f"TRL {trl.__version__} has no trl.trainer.utils._ChunkedLogProbFunction, the seam "
                           f"fastppo.integrations.trl replaces (tested with TRL {TESTED_TRL_VERSION})")
    params = tuple(inspect.signature(seam.forward).parameters)[1:]
    if params != SEAM_PARAMETERS:
        raise RuntimeError(f"TRL {trl.__version__}'s _ChunkedLogProbFunction.forward takes {params}; fastppo knows "
                           f"{SEAM_PARAMETERS} (TRL {TESTED_TRL_VERSION}) and will not guess")
    if str(version) != TESTED_TRL_VERSION:
        warnings.warn(f"fastppo.integrations.trl was tested with TRL {TESTED_TRL_VERSION}; TRL {trl.__version__} "
                      "has the same seam and is patched", stacklevel=3)
    return trl, utils


def apply_fastppo_kernels_to_trl(*, fused_lm_head: bool = True, logits_helpers: bool = True) -> TRLKernelPatch:
    """Route TRL 1.x's fused-LM-head log-probs/entropy (``fused_lm_head``) and its logits helpers
    (``logits_helpers``) through ``fastppo.kernels``; returns the patch, whose ``undo()`` reverts it.

    Calls nest: while a routing is on, another call with the same options returns a new hold on it (its
    ``undo()`` or ``with`` block ends only that hold), and TRL's objects come back when the last hold is undone.
    A call with other options is refused, naming the active patch (undo it first to change what is routed).
    """
    global _routing
    options = {"fused_lm_head": bool(fused_lm_head), "logits_helpers": bool(logits_helpers)}
    if _routing is not None:
        if _routing.options != options:
            active = ", ".join(f"{k}={v}" for k, v in _routing.options.items())
            asked = ", ".join(f"{k}={v}" for k, v in options.items())
            raise RuntimeError(
                f"fastppo's kernels are already routed into TRL {_routing.trl_version} with {active} "
                f"({_routing.holds} hold(s) on {', '.join(_routing.names())}); this call asks for {asked}. "
                "Undo the active patch (leave its with block) before applying other options")
        return TRLKernelPatch(_routing)
    trl, utils = _check_trl()
    originals = {}
    ours = {}
    if fused_lm_head:
        originals["_ChunkedLogProbFunction"] = utils._ChunkedLogProbFunction
        ours["_ChunkedLogProbFunction"] = FastppoChunkedLogProb
    if logits_helpers:
        helpers = {name: getattr(utils, name) for name in HELPERS if hasattr(utils, name)}
        originals.update(helpers)
        ours.update({k: v for k, v in _make_helpers(helpers).items() if k in helpers})
    replaced: list[tuple[object, str, object]] = []
    # every loaded trl module that holds TRL's object under its name (trl.trainer.utils, and the trainer modules
    # that imported it by name); modules imported later import fastppo's from trl.trainer.utils
    for module in [m for n, m in list(sys.modules.items()) if n == "trl" or n.startswith("trl.")]:
        attributes = vars(module)
        for name, original in originals.items():
            if attributes.get(name) is original:
                replaced.append((module, name, original))
                setattr(module, name, ours[name])
    _routing = _Routing(trl.__version__, options, replaced, {k: (ours[k], originals[k]) for k in ours})
    return TRLKernelPatch(_routing)


def remove_fastppo_kernels_from_trl() -> None:
    """Undo the routing, if any, whatever holds are left (each of them becomes inactive)."""
    global _routing
    if _routing is not None:
        _routing.restore()
        _routing = None


__all__ = ["FastppoChunkedLogProb", "TESTED_TRL_VERSION", "TRLKernelPatch", "apply_fastppo_kernels_to_trl",
           "remove_fastppo_kernels_from_trl"]
