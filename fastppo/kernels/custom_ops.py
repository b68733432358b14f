"""fastppo's kernels as ``torch.library`` custom ops: what ``torch.compile(fullgraph=True)`` traces.

Every opaque step of the kernel library (a Triton launch, the chunked PyTorch LM head, whose loops and
``isneginf(bias).any()`` read data) is one op of the ``fastppo`` namespace with a fake implementation (shapes and
dtypes only: what dynamo and AOTAutograd trace it with) and, where it is differentiable, an autograd formula whose
backward is itself an op. The public functions keep their signatures and do their checks and shaping in Python
around the op, so a compiled training step that calls them is one graph, with the values and gradients of eager;
in eager the op runs the same code the autograd Functions it replaced ran (bitwise the same results).

Ops (``torch.ops.fastppo.<name>``; ``*_backward`` beside each differentiable one):

* ``chunked_lm_head_stats``, ``chunked_full_kl``: the chunked PyTorch LM head (``_lmhead``): ``fused_token_logprobs``,
  ``fused_full_kl`` and ``fused_ppo_policy_loss`` on a CPU;
* ``fused_token_logprobs``, ``fused_full_kl``, ``token_logprobs``, ``kl_penalty``, ``fused_ppo_policy_loss``,
  ``gae``: the Triton paths (CUDA; a CPU under ``TRITON_INTERPRET=1``);
* ``truncate_at_stop`` is the C++/CUDA op (``csrc/``, its fake in ``masking.py``).

Outputs a call did not ask for come back as empty tensors (a custom op returns no None) and are mapped back to
None by the caller (``present``). An op never returns one of its inputs, nor one tensor twice.

The ops are registered when ``fastppo.kernels`` is imported (this module is imported last by its ``__init__``);
callers reach them as ``torch.ops.fastppo.<name>``, so no kernel module imports this one.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from fastppo.kernels import kl as _kl
from fastppo.kernels import logprobs as _lp
from fastppo.kernels import ppo_loss as _ppo
from fastppo.kernels._common import refuse_double_backward
from fastppo.kernels.gae import _launch_gae_fwd  # (the package's name gae is the function)
from fastppo.kernels._lmhead import LM_HEAD_RANGE, ChunkPlan, LogitTransform, _chunked_backward
from fastppo.kernels._lmhead import _chunked_forward, _chunked_full_kl_backward, _chunked_full_kl_forward
from fastppo.kernels._lmhead import _materialised_full_kl, _materialised_stats, _neg_inf_logits_possible, _operands
from fastppo.kernels._lmhead import acc_dtype, no_autocast

NS = "fastppo"
_TENSORS6 = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


# name -> the Python function each op runs: for a TorchDispatchMode that measures or counts what runs inside an
# op (it sees the op as one call otherwise); ``body_of``.
_BODIES: dict = {}


def _op(name: str):
    def define(fn):
        _BODIES[name] = fn
        return torch.library.custom_op(f"{NS}::{name}", mutates_args=())(fn)
    return define


def body_of(func) -> Callable | None:
    """The Python implementation of ``func`` when it is one of these ops (an ``OpOverload`` as a
    ``__torch_dispatch__`` receives it), else None: a mode calls it under itself to see the aten ops inside."""
    return _BODIES.get(func.overloadpacket.__name__) if getattr(func, "namespace", None) == NS else None


def _fill(outputs, like: Tensor, dtypes) -> tuple[Tensor, ...]:
    """``outputs`` with None replaced by an empty tensor of its dtype, and a tensor seen before copied: an op
    returns no None and no two outputs share memory (a launcher's results may be rows of one buffer)."""
    seen, filled = set(), []
    for x, dtype in zip(outputs, dtypes):
        if x is None:
            x = like.new_empty(0, dtype=dtype)
        elif x.numel() and x.untyped_storage().data_ptr() in seen:  # e.g. rows of one [k, N] buffer
            x = x.clone()
        if x.numel():
            seen.add(x.untyped_storage().data_ptr())
        filled.append(x)
    return tuple(filled)


def _like(present: bool, like: Tensor, shape, dtype) -> Tensor:
    """A fake output: ``shape`` when ``present``, else the empty stand-in for None."""
    return like.new_empty(shape if present else (0,), dtype=dtype)


def _grads_like(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], needs) -> tuple[Tensor, Tensor, Tensor]:
    """The fake of an LM-head backward: gradients shaped as hidden, weight and bias, each empty unless needed."""
    return tuple(_like(need and t is not None, hidden, () if t is None else t.shape, hidden.dtype if t is None
                       else t.dtype) for t, need in zip((hidden, weight, bias), needs))


def _grads_out(grads, hidden, weight, bias) -> tuple[Tensor, Tensor, Tensor]:
    return _fill(grads, hidden, (hidden.dtype, weight.dtype, hidden.dtype if bias is None else bias.dtype))


def _needed(grads, needs) -> tuple:
    return tuple(g if need else None for g, need in zip(grads, needs))


def _stats_fake(hidden: Tensor, wants) -> _TENSORS6:
    """(logp, lse, entropy, log_sum_sq_probs, mean_logits, is_top1) of [N] rows; lse is always there."""
    n, acc = hidden.shape[0], acc_dtype(hidden.dtype)
    present = (wants[0], True, *wants[1:])
    return tuple(_like(p, hidden, (n,), torch.bool if i == 5 else acc) for i, p in enumerate(present))


def _stats_out(out, hidden: Tensor) -> _TENSORS6:
    acc = acc_dtype(hidden.dtype)
    return _fill(out, hidden, (acc,) * 5 + (torch.bool,))


def _setup_stats(ctx, hidden, weight, bias, index, wants, output, params) -> None:
    """The LM-head statistics' context: what the backward reads; the statistics and lse without gradient."""
    logp, lse, ent, sum_sq, mean, top1 = output
    ctx.save_for_backward(hidden, weight, bias, index, lse, ent if wants[1] else None)
    ctx.wants, ctx.params = tuple(wants), params
    ctx.set_materialize_grads(False)  # a None grad skips its term in (L5)
    ctx.mark_non_differentiable(lse, sum_sq, mean, top1, *(x for x, w in ((logp, wants[0]), (ent, wants[1]))
                                                            if not w))


def _stats_grads(ctx, g_logp, g_ent):
    """(g_logp, g_ent) of the outputs asked for (a compiled backward may pass zeros for one not asked for)."""
    return (g_logp if ctx.wants[0] else None), (g_ent if ctx.wants[1] else None)


# --------------------------------------------------------------------------- the chunked PyTorch LM head


@_op("chunked_lm_head_stats")
def chunked_lm_head_stats(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor, temperature: float,
                          softcap: Optional[float], logit_scale: float, wants: list[bool],
                          plan: list[int]) -> _TENSORS6:
    """(logp, lse, entropy, log_sum_sq_probs, mean_logits, is_top1) [N] of ``_lmhead._chunked_forward``."""
    transform, plan = LogitTransform(temperature, softcap, logit_scale), ChunkPlan(*plan)
    guard = _neg_inf_logits_possible(bias, transform)
    with no_autocast(hidden.device), torch.profiler.record_function(LM_HEAD_RANGE):
        ops = _operands(hidden, weight, bias, plan)
        out = _chunked_forward(ops, index, transform, tuple(wants), plan, guard)
    return _stats_out(out, hidden)


@chunked_lm_head_stats.register_fake
def _(hidden, weight, bias, index, temperature, softcap, logit_scale, wants, plan):
    return _stats_fake(hidden, wants)


@_op("chunked_lm_head_stats_backward")
def chunked_lm_head_stats_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor, lse: Tensor,
                                   ent: Optional[Tensor], g_logp: Optional[Tensor], g_ent: Optional[Tensor],
                                   temperature: float, softcap: Optional[float], logit_scale: float, plan: list[int],
                                   needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) of ``_lmhead._chunked_backward``, each empty unless needed."""
    transform, plan = LogitTransform(temperature, softcap, logit_scale), ChunkPlan(*plan)
    guard = _neg_inf_logits_possible(bias, transform)
    with no_autocast(hidden.device), torch.profiler.record_function(LM_HEAD_RANGE):
        ops = _operands(hidden, weight, bias, plan)
        grads = _chunked_backward(ops, weight, bias, index, lse, ent, g_logp, g_ent, transform, plan, guard,
                                  tuple(needs))
    return _grads_out(grads, hidden, weight, bias)


@chunked_lm_head_stats_backward.register_fake
def _(hidden, weight, bias, index, lse, ent, g_logp, g_ent, temperature, softcap, logit_scale, plan, needs):
    return _grads_like(hidden, weight, bias, needs)


def _chunked_stats_setup(ctx, inputs, output):
    hidden, weight, bias, index, temperature, softcap, logit_scale, wants, plan = inputs
    _setup_stats(ctx, hidden, weight, bias, index, wants, output, (temperature, softcap, logit_scale, plan))


def _chunked_stats_grad(ctx, g_logp, _g_lse, g_ent, *_statistics):
    hidden, weight, bias, index, lse, ent = ctx.saved_tensors
    g_logp, g_ent = _stats_grads(ctx, g_logp, g_ent)
    needs = ctx.needs_input_grad[:3]
    none = (None,) * 6
    if (g_logp is None and g_ent is None) or not any(needs):
        return (None, None, None, *none)
    temperature, softcap, logit_scale, plan = ctx.params
    if torch.is_grad_enabled():  # create_graph=True: a first backward that autograd can differentiate
        inputs = [x for x, need in zip((hidden, weight, bias), needs) if need]
        with torch.enable_grad(), no_autocast(hidden.device):
            logp, entropy = _materialised_stats(hidden, weight, bias, index,
                                                LogitTransform(temperature, softcap, logit_scale), g_ent is not None)
            pairs = [(o, g) for o, g in ((logp, g_logp), (entropy, g_ent)) if g is not None]
            grads = iter(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                             create_graph=True, allow_unused=True))
        return (*(next(grads) if need else None for need in needs), *none)
    grads = torch.ops.fastppo.chunked_lm_head_stats_backward(hidden, weight, bias, index, lse, ent, g_logp, g_ent,
                                                             temperature, softcap, logit_scale, plan, list(needs))
    return (*_needed(grads, needs), *none)


chunked_lm_head_stats.register_autograd(_chunked_stats_grad, setup_context=_chunked_stats_setup)


def _full_kl_acc(hidden: Tensor, ref_hidden: Tensor) -> torch.dtype:
    return torch.promote_types(acc_dtype(hidden.dtype), acc_dtype(ref_hidden.dtype))


def _neg_inf_bias(bias, ref_bias) -> bool:
    return any(b is not None and bool(torch.isneginf(b).any()) for b in (bias, ref_bias))


@_op("chunked_full_kl")
def chunked_full_kl(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ref_hidden: Tensor, ref_weight: Tensor,
                    ref_bias: Optional[Tensor], temperature: float, plan: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """(kl, lse_p, lse_q) [N] of ``_lmhead._chunked_full_kl_forward``."""
    acc, plan = _full_kl_acc(hidden, ref_hidden), ChunkPlan(*plan)
    guard = _neg_inf_bias(bias, ref_bias)
    with no_autocast(hidden.device):
        pol = _operands(hidden, weight, bias, plan, acc)
        ref = _operands(ref_hidden, ref_weight, ref_bias, plan, acc)
        return _chunked_full_kl_forward(pol, ref, temperature, plan, guard)


@chunked_full_kl.register_fake
def _(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature, plan):
    return tuple(hidden.new_empty(hidden.shape[0], dtype=_full_kl_acc(hidden, ref_hidden)) for _ in range(3))


@_op("chunked_full_kl_backward")
def chunked_full_kl_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ref_hidden: Tensor,
                             ref_weight: Tensor, ref_bias: Optional[Tensor], kl: Tensor, lse_p: Tensor, lse_q: Tensor,
                             g: Tensor, temperature: float, plan: list[int],
                             needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    acc, plan = _full_kl_acc(hidden, ref_hidden), ChunkPlan(*plan)
    guard = _neg_inf_bias(bias, ref_bias)
    with no_autocast(hidden.device):
        pol = _operands(hidden, weight, bias, plan, acc)
        ref = _operands(ref_hidden, ref_weight, ref_bias, plan, acc)
        grads = _chunked_full_kl_backward(pol, ref, weight, bias, kl, lse_p, lse_q, g, temperature, plan, guard,
                                          tuple(needs))
    return _grads_out(grads, hidden, weight, bias)


@chunked_full_kl_backward.register_fake
def _(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl, lse_p, lse_q, g, temperature, plan, needs):
    return _grads_like(hidden, weight, bias, needs)


def _full_kl_setup(ctx, inputs, output):
    hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature, *plan = inputs  # plan: the chunked op only
    kl, lse_p, lse_q = output
    ctx.save_for_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl, lse_p, lse_q)
    ctx.temperature, ctx.plan = temperature, (plan[0] if plan else None)
    ctx.mark_non_differentiable(lse_p, lse_q)


def _chunked_full_kl_grad(ctx, g, *_lse):
    hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl, lse_p, lse_q = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    none = (None,) * 5
    if not any(needs):
        return (None, None, None, *none)
    if torch.is_grad_enabled():  # create_graph=True: a first backward that autograd can differentiate
        inputs = [x for x, need in zip((hidden, weight, bias), needs) if need]
        with torch.enable_grad(), no_autocast(hidden.device):
            out = _materialised_full_kl(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, ctx.temperature,
                                        _full_kl_acc(hidden, ref_hidden))
            grads = iter(torch.autograd.grad(out, inputs, g, create_graph=True, allow_unused=True))
        return (*(next(grads) if need else None for need in needs), *none)
    grads = torch.ops.fastppo.chunked_full_kl_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl,
                                                       lse_p, lse_q, g, ctx.temperature, ctx.plan, list(needs))
    return (*_needed(grads, needs), *none)


chunked_full_kl.register_autograd(_chunked_full_kl_grad, setup_context=_full_kl_setup)


# --------------------------------------------------------------------------- the Triton paths


@_op("fused_token_logprobs")
def fused_token_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor, temperature: float,
                         cap_in: float, cap_out: float, has_softcap: bool, wants: list[bool]) -> _TENSORS6:
    """(logp, lse, entropy, log_sum_sq_probs, mean_logits, is_top1) [N] of the fused Triton forward."""
    head = _lp.HeadMath(temperature, cap_in, cap_out, has_softcap)
    logp, *rest = _lp._launch_fused_token_logprobs_fwd(hidden, weight, bias, index, head, tuple(wants))
    return _stats_out((logp if wants[0] else None, *rest), hidden)  # the launcher forms logp always


@fused_token_logprobs.register_fake
def _(hidden, weight, bias, index, temperature, cap_in, cap_out, has_softcap, wants):
    return _stats_fake(hidden, wants)


@_op("fused_token_logprobs_backward")
def fused_token_logprobs_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor, lse: Tensor,
                                  ent: Optional[Tensor], g_logp: Optional[Tensor], g_ent: Optional[Tensor],
                                  temperature: float, cap_in: float, cap_out: float, has_softcap: bool,
                                  needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    head = _lp.HeadMath(temperature, cap_in, cap_out, has_softcap)
    with no_autocast(hidden.device):  # a backward run under autocast must not demote its GEMMs
        grads = _lp._fused_token_logprobs_backward(
            hidden, weight, bias, index, lse, ent, None if g_logp is None else g_logp.contiguous(),
            None if g_ent is None else g_ent.contiguous(), head, tuple(needs))
    return _grads_out(grads, hidden, weight, bias)


@fused_token_logprobs_backward.register_fake
def _(hidden, weight, bias, index, lse, ent, g_logp, g_ent, temperature, cap_in, cap_out, has_softcap, needs):
    return _grads_like(hidden, weight, bias, needs)


def _fused_stats_setup(ctx, inputs, output):
    hidden, weight, bias, index, temperature, cap_in, cap_out, has_softcap, wants = inputs
    _setup_stats(ctx, hidden, weight, bias, index, wants, output, (temperature, cap_in, cap_out, has_softcap))


def _fused_stats_grad(ctx, g_logp, _g_lse, g_ent, *_statistics):
    refuse_double_backward("fused_token_logprobs")
    hidden, weight, bias, index, lse, ent = ctx.saved_tensors
    g_logp, g_ent = _stats_grads(ctx, g_logp, g_ent)
    needs = ctx.needs_input_grad[:3]
    none = (None,) * 6
    if (g_logp is None and g_ent is None) or not any(needs):
        return (None, None, None, *none)
    grads = torch.ops.fastppo.fused_token_logprobs_backward(hidden, weight, bias, index, lse, ent, g_logp, g_ent,
                                                            *ctx.params, list(needs))
    return (*_needed(grads, needs), *none)


fused_token_logprobs.register_autograd(_fused_stats_grad, setup_context=_fused_stats_setup)


@_op("token_logprobs")
def token_logprobs(logits: Tensor, index: Tensor, temperature: float,
                   compute_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, lse, entropy) [N] of the row kernel over given logits [N, V]."""
    logp, lse, ent = _lp._launch_token_logprobs_fwd(logits, index, temperature, compute_entropy)
    return _fill((logp, lse, ent), logits, (lse.dtype,) * 3)


@token_logprobs.register_fake
def _(logits, index, temperature, compute_entropy):
    n, acc = logits.shape[0], acc_dtype(logits.dtype)
    return tuple(_like(p, logits, (n,), acc) for p in (True, True, compute_entropy))


@_op("token_logprobs_backward")
def token_logprobs_backward(logits: Tensor, index: Tensor, lse: Tensor, ent: Optional[Tensor],
                            g_logp: Optional[Tensor], g_ent: Optional[Tensor], temperature: float) -> Tensor:
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    return _lp._launch_softmax_dlogits(logits, grad, index, lse, ent,
                                       None if g_logp is None else g_logp.contiguous(),
                                       None if g_ent is None else g_ent.contiguous(),
                                       _lp.HeadMath(temperature, 1.0, 1.0, False))


@token_logprobs_backward.register_fake
def _(logits, index, lse, ent, g_logp, g_ent, temperature):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _token_logprobs_setup(ctx, inputs, output):
    logits, index, temperature, compute_entropy = inputs
    logp, lse, ent = output
    ctx.save_for_backward(logits, index, lse, ent if compute_entropy else None)
    ctx.temperature, ctx.wants = temperature, (True, compute_entropy)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, *(() if compute_entropy else (ent,)))


def _token_logprobs_grad(ctx, g_logp, _g_lse, g_ent):
    refuse_double_backward("token_logprobs")
    logits, index, lse, ent = ctx.saved_tensors
    g_logp, g_ent = _stats_grads(ctx, g_logp, g_ent)
    if g_logp is None and g_ent is None:
        return None, None, None, None
    return torch.ops.fastppo.token_logprobs_backward(logits, index, lse, ent, g_logp, g_ent, ctx.temperature), \
        None, None, None


token_logprobs.register_autograd(_token_logprobs_grad, setup_context=_token_logprobs_setup)


@_op("fused_full_kl")
def fused_full_kl(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ref_hidden: Tensor, ref_weight: Tensor,
                  ref_bias: Optional[Tensor], temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(kl, lse_p, lse_q) [N] of the fused Triton forward."""
    return _kl._launch_full_kl_fwd(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature)


@fused_full_kl.register_fake
def _(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature):
    return tuple(hidden.new_empty(hidden.shape[0], dtype=_full_kl_acc(hidden, ref_hidden)) for _ in range(3))


@_op("fused_full_kl_backward")
def fused_full_kl_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ref_hidden: Tensor,
                           ref_weight: Tensor, ref_bias: Optional[Tensor], kl: Tensor, lse_p: Tensor, lse_q: Tensor,
                           g: Tensor, temperature: float, needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    with no_autocast(hidden.device):
        grads = _kl._full_kl_backward(g, hidden, weight, bias, ref_hidden, ref_weight, ref_bias, lse_p, lse_q, kl,
                                      temperature, tuple(needs))
    return _grads_out(grads, hidden, weight, bias)


@fused_full_kl_backward.register_fake
def _(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl, lse_p, lse_q, g, temperature, needs):
    return _grads_like(hidden, weight, bias, needs)


def _fused_full_kl_grad(ctx, g, *_lse):
    refuse_double_backward("fused_full_kl")
    hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl, lse_p, lse_q = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if not any(needs):
        return (None,) * 7
    grads = torch.ops.fastppo.fused_full_kl_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl,
                                                     lse_p, lse_q, g, ctx.temperature, list(needs))
    return (*_needed(grads, needs), None, None, None, None)  # the reference side is frozen: no gradient


fused_full_kl.register_autograd(_fused_full_kl_grad, setup_context=_full_kl_setup)


@_op("kl_penalty")
def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, code: int) -> Tensor:
    """The per-token KL estimate of the Triton kernel (``code``: ``kl._ESTIMATOR_CODE``)."""
    return _kl._launch_kl_penalty_fwd(logprobs, ref_logprobs, code)


@kl_penalty.register_fake
def _(logprobs, ref_logprobs, code):
    return logprobs.new_empty(logprobs.shape, dtype=_kl._kl_penalty_dtype(logprobs, ref_logprobs))


@_op("kl_penalty_backward")
def kl_penalty_backward(grad: Tensor, logprobs: Tensor, ref_logprobs: Tensor, code: int,
                        needs: list[bool]) -> tuple[Tensor, Tensor]:
    grads = _kl._launch_kl_penalty_bwd(grad, logprobs, ref_logprobs, code, *needs)
    return _fill(grads, logprobs, (logprobs.dtype, ref_logprobs.dtype))


@kl_penalty_backward.register_fake
def _(grad, logprobs, ref_logprobs, code, needs):
    return tuple(_like(need, t, t.shape, t.dtype) for t, need in zip((logprobs, ref_logprobs), needs))


def _kl_penalty_setup(ctx, inputs, output):
    logprobs, ref_logprobs, code = inputs
    ctx.save_for_backward(logprobs, ref_logprobs)
    ctx.code = code


def _kl_penalty_grad(ctx, grad):
    logprobs, ref_logprobs = ctx.saved_tensors
    need_dlogp, need_dref = ctx.needs_input_grad[:2]
    if torch.is_grad_enabled():
        # Double backward (create_graph=True): the same f'(d), in differentiable PyTorch ops.
        estimator = next(name for name, code in _kl._ESTIMATOR_CODE.items() if code == ctx.code)
        dtype = _kl._kl_penalty_dtype(logprobs, ref_logprobs)
        gd = grad.to(dtype) * _kl._kl_slope_math(logprobs.to(dtype) - ref_logprobs.to(dtype), estimator)
        return (gd.to(logprobs.dtype) if need_dlogp else None,
                (-gd).to(ref_logprobs.dtype) if need_dref else None, None)
    needs = (need_dlogp, need_dref)
    return (*_needed(torch.ops.fastppo.kl_penalty_backward(grad, logprobs, ref_logprobs, ctx.code, list(needs)),
                     needs), None)


kl_penalty.register_autograd(_kl_penalty_grad, setup_context=_kl_penalty_setup)


@_op("gae")
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float,
        skip_masked: bool) -> tuple[Tensor, Tensor]:
    """(advantages, returns) [B, T] fp32 of the Triton scan (no gradient: ``gae`` runs under no_grad)."""
    return _launch_gae_fwd(rewards, values, mask, gamma, lam, skip_masked)


@gae.register_fake
def _(rewards, values, mask, gamma, lam, skip_masked):
    return tuple(rewards.new_empty(rewards.shape, dtype=torch.float32) for _ in range(2))


@_op("fused_ppo_policy_loss")
def fused_ppo_policy_loss(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor, old: Tensor,
                          adv: Tensor, mask: Tensor, token_weights: Optional[Tensor], normalizer: Optional[Tensor],
                          entropy_weights: Optional[Tensor], temperature: float, cliprange: float,
                          cliprange_high: float, delta: Optional[float], entropy_coef: float, token_mean: bool,
                          sequence_lengths: Optional[list[int]], surrogate: str, sapo_temperatures: list[float],
                          level: str, vespo_gamma: list[float], off_policy_mask_threshold: Optional[float],
                          needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, logp, ratio, clipped, entropy, grad_hidden, grad_weight, grad_bias) of the Triton loss, the
    gradients formed in the forward for an upstream gradient of 1 (each empty unless ``needs`` says so); the
    arguments after ``temperature`` are ``ppo_loss.PolicyTerms``' fields."""
    terms = _ppo.PolicyTerms(cliprange, cliprange_high, delta, entropy_coef, token_mean, sequence_lengths,
                             token_weights, normalizer, entropy_weights, surrogate, tuple(sapo_temperatures), level,
                             tuple(vespo_gamma), off_policy_mask_threshold)
    loss, stats, grads = _ppo._launch_ppo_policy_loss(hidden, weight, bias, index, old, adv, mask, temperature,
                                                      terms, tuple(needs))
    acc = acc_dtype(hidden.dtype)
    return (*_fill((loss, *stats), hidden, (acc, acc, acc, torch.bool, acc)), *_grads_out(grads, hidden, weight, bias))


@fused_ppo_policy_loss.register_fake
def _(hidden, weight, bias, index, old, adv, mask, token_weights, normalizer, entropy_weights, temperature, cliprange,
      cliprange_high, delta, entropy_coef, token_mean, sequence_lengths, surrogate, sapo_temperatures, level,
      vespo_gamma, off_policy_mask_threshold, needs):
    n, acc = hidden.shape[0], acc_dtype(hidden.dtype)
    stats = tuple(hidden.new_empty((n,), dtype=torch.bool if i == 2 else acc) for i in range(4))
    return (hidden.new_empty((), dtype=acc), *stats, *_grads_like(hidden, weight, bias, needs))


def _ppo_setup(ctx, inputs, output):
    ctx.needs = tuple(inputs[-1])
    ctx.save_for_backward(*output[5:])
    ctx.mark_non_differentiable(*output[1:])


def _ppo_grad(ctx, g_loss, *_):
    # Formed in the forward from the inputs' values: they carry no graph for a second derivative.
    refuse_double_backward("fused_ppo_policy_loss")
    # The gradients were formed in the forward for an upstream gradient of 1: only scale them.
    grads = tuple(_ppo._scaled(g, g_loss) if need else None for g, need in zip(ctx.saved_tensors, ctx.needs))
    return (*grads, *(None,) * 20)


fused_ppo_policy_loss.register_autograd(_ppo_grad, setup_context=_ppo_setup)
