"""Every tensor argument of every public kernel function, in every layout, on both paths (issue 36).

One table: a row per (function, tensor argument). Each row is run with that one argument laid out as

* ``strided``: every other element of a wider tensor (last-dimension stride 2);
* ``offset``: a contiguous view that starts 5 elements into its storage;
* ``transposed``: the same values with the dimensions' memory order reversed (a tied, transposed LM head
  is the 2-D case); not for 1-D arguments;
* ``expanded``: the last dimension broadcast from one element (stride 0), read-only memory shared by every
  element, as ``torch.full((1,), x).expand(n)`` gives,

and compared, outputs and gradients, against float64 oracles written here from the definitions, on the
contiguous float64 copy of the same values. The Triton path runs under the interpreter on a CPU (shapes
are tiny: one call is a few tl.dot tiles). A new public function or tensor argument is covered by adding
its row to ``CASES``.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from fastppo.kernels import (clipped_surrogate, fused_full_kl, fused_ppo_policy_loss, fused_token_logprobs, gae,
                             kl_penalty, masked_mean, masked_var, masked_whiten, token_logprobs, truncate_at_stop)

from helpers import assert_close, assert_grad_close, triton_device_or_skip

N_B, N_T, H, V = 2, 3, 16, 20  # per-token grids [2, 3]; V not a multiple of the interpreter's 16-column tile


# ---------------------------------------------------------------------------- layouts


def strided(x):
    if x.dim() == 0:
        return None
    wide = x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])
    wide[..., ::2] = x
    return wide[..., ::2]


def offset(x):
    flat = x.new_zeros(x.numel() + 5)
    flat[5:] = x.reshape(-1)
    return flat[5:].view(x.shape)


def transposed(x):
    if x.dim() < 2:
        return None
    order = tuple(reversed(range(x.dim())))
    return x.permute(order).contiguous().permute(order)


def expanded(x):
    if x.dim() == 0 or x.shape[-1] < 2:
        return None
    return x.narrow(-1, 0, 1).expand(x.shape)


LAYOUTS = {"strided": strided, "offset": offset, "transposed": transposed, "expanded": expanded}


def check_layout(name: str, x: torch.Tensor) -> None:
    """The layout is what its name says (so a layout function cannot silently degrade to contiguous)."""
    if name == "strided":
        assert x.stride(-1) == 2
    elif name == "offset":
        assert x.storage_offset() == 5 and x.is_contiguous()
    elif name == "transposed":
        assert x.stride(0) == 1 and not x.is_contiguous()
    else:
        assert x.stride(-1) == 0


# ---------------------------------------------------------------------------- float64 oracles (the definitions)


def lm_logits(hidden, weight, bias=None):
    z = hidden @ weight.t()
    return z if bias is None else z + bias


def token_stats(z, index):
    """log p_i, H, log Σ p², Σ z / V, is_top1 of softmax(z) (z float64)."""
    log_p = z.log_softmax(-1)
    p = log_p.exp()
    return dict(logprobs=log_p.gather(-1, index.long()[..., None]).squeeze(-1), entropy=-(p * log_p).sum(-1),
                log_sum_sq_probs=(p * p).sum(-1).log(), mean_logits=z.mean(-1), is_top1=z.argmax(-1) == index)


def kl_k3(logp, ref):
    d = logp - ref
    return torch.exp(-d) + d - 1


def full_kl(z, y):
    log_p, log_q = z.log_softmax(-1), y.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def surrogate(logp, old, adv, eps):
    ratio = torch.exp(logp - old)
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)
    return torch.maximum(pg1, pg2), ratio, pg2 > pg1


def masked_surrogate(logprobs, old_logprobs, advantages, mask, eps=0.2):
    """``surrogate`` where mask is set; masked tokens: loss 0, their ρ and flag reported without gradient."""
    loss, ratio, clipped = surrogate(logprobs, old_logprobs, advantages, eps)
    return dict(loss=torch.where(mask, loss, 0.0), ratio=torch.where(mask, ratio, ratio.detach()), clipped=clipped)


def ppo_loss(hidden, weight, index, old_logprobs, advantages, mask, bias, eps=0.25, coef=0.01, temperature=0.5):
    stats = token_stats(lm_logits(hidden, weight, bias) / temperature, index)
    pg, ratio, clipped = surrogate(stats["logprobs"], old_logprobs, advantages, eps)
    real = mask != 0
    n = real.sum()
    loss = pg[real].sum() / n - coef * stats["entropy"][real].sum() / n
    return dict(loss=loss, logprobs=stats["logprobs"], ratio=ratio, clipped=clipped, entropy=stats["entropy"])


def gae_loop(rewards, values, mask, gamma, lam):
    m = mask != 0
    r, v = rewards * m, values * m
    adv = torch.zeros_like(r)
    for b in range(r.shape[0]):
        last, next_v = 0.0, 0.0
        for t in reversed(range(r.shape[1])):
            last = r[b, t] + gamma * next_v - v[b, t] + gamma * lam * last
            next_v = v[b, t]
            adv[b, t] = last
    return dict(advantages=adv * m, returns=(adv + v) * m)


def truncate_loop(responses, stop_ids, pad_id):
    B, T = responses.shape
    out, lengths, mask, has = responses.clone(), [], torch.zeros(B, T, dtype=torch.bool), []
    for b in range(B):
        row = responses[b].tolist()
        first = next((t for t, tok in enumerate(row) if tok in stop_ids.tolist()), None)
        n = T if first is None else first + 1
        out[b, n:] = pad_id
        mask[b, :n] = True
        lengths.append(n)
        has.append(first is not None)
    return dict(truncated=out, lengths=torch.tensor(lengths), mask=mask, has_stop=torch.tensor(has))


def masked_stats(x, mask):
    m = mask != 0
    n = m.sum()
    mean = x[m].sum() / n
    var = ((x - mean)[m] ** 2).sum() / (n - 1)
    return dict(mean=mean, var=var, white=(x - mean) / torch.sqrt(var + 1e-8))


# ---------------------------------------------------------------------------- the table


@dataclass
class Case:
    """One public function: its inputs, the call, its float64 oracle, what is differentiated, which paths."""

    inputs: Callable[[torch.Generator], dict]  # name -> tensor (float ones float32 or the index dtype)
    call: Callable[..., dict]  # the library call on those names -> named outputs
    oracle: Callable[..., dict]  # the same names, float64 -> named outputs
    grads: tuple[str, ...] = ()  # float arguments the outputs are differentiated against
    triton: bool = True  # has a Triton path (else the reference / C++ op only)


def _randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def _head(g, lead):
    return dict(hidden=_randn(g, *lead, H), weight=_randn(g, V, H, scale=2 / math.sqrt(H)), bias=_randn(g, V))


def _mask(g, *shape):
    m = torch.rand(*shape, generator=g) < 0.7
    m[..., 0] = True  # the expanded layout broadcasts the first column: a mask that selects something
    return m


CASES = {
    "token_logprobs": Case(
        inputs=lambda g: dict(logits=_randn(g, N_B, N_T, V, scale=2.0), index=torch.randint(0, V, (N_B, N_T), generator=g)),
        call=lambda logits, index: token_logprobs(logits, index, 0.5, outputs=("logprobs", "entropy"))._asdict(),
        oracle=lambda logits, index: {k: v for k, v in token_stats(logits / 0.5, index).items()
                                      if k in ("logprobs", "entropy")},
        grads=("logits",),
    ),
    "fused_token_logprobs": Case(
        inputs=lambda g: dict(**_head(g, (N_B * N_T,)), index=torch.randint(0, V, (N_B * N_T,), generator=g)),
        call=lambda hidden, weight, index, bias: fused_token_logprobs(
            hidden, weight, index, 0.5, bias=bias, outputs=("logprobs", "entropy", "log_sum_sq_probs",
                                                            "mean_logits", "is_top1"))._asdict(),
        oracle=lambda hidden, weight, index, bias: token_stats(lm_logits(hidden, weight, bias) / 0.5, index),
        grads=("hidden", "weight", "bias"),
    ),
    "kl_penalty": Case(
        inputs=lambda g: dict(logprobs=-torch.rand(N_B, N_T, generator=g) * 3 - 0.1,
                              ref_logprobs=-torch.rand(N_B, N_T, generator=g) * 3 - 0.1),
        call=lambda logprobs, ref_logprobs: dict(kl=kl_penalty(logprobs, ref_logprobs, "k3")),
        oracle=lambda logprobs, ref_logprobs: dict(kl=kl_k3(logprobs, ref_logprobs)),
        grads=("logprobs", "ref_logprobs"),
    ),
    "fused_full_kl": Case(
        inputs=lambda g: dict(**_head(g, (N_B, N_T)), **{f"ref_{k}": v for k, v in _head(g, (N_B, N_T)).items()}),
        call=lambda hidden, weight, bias, ref_hidden, ref_weight, ref_bias: dict(
            kl=fused_full_kl(hidden, weight, ref_hidden, ref_weight, 0.5, bias=bias, ref_bias=ref_bias)),
        oracle=lambda hidden, weight, bias, ref_hidden, ref_weight, ref_bias: dict(
            kl=full_kl(lm_logits(hidden, weight, bias) / 0.5, lm_logits(ref_hidden, ref_weight, ref_bias) / 0.5)),
        grads=("hidden", "weight", "bias"),
    ),
    "fused_ppo_policy_loss": Case(
        inputs=lambda g: dict(**_head(g, (N_B, N_T)), index=torch.randint(0, V, (N_B, N_T), generator=g),
                              old_logprobs=-torch.rand(N_B, N_T, generator=g) * 3 - 1.5,
                              advantages=_randn(g, N_B, N_T), mask=_mask(g, N_B, N_T)),
        call=lambda hidden, weight, index, old_logprobs, advantages, mask, bias: fused_ppo_policy_loss(
            hidden, weight, index, old_logprobs, advantages, mask, 0.25, 0.01, 0.5, bias=bias)._asdict(),
        oracle=ppo_loss,
        grads=("hidden", "weight", "bias"),
    ),
    "clipped_surrogate": Case(
        inputs=lambda g: dict(logprobs=-torch.rand(N_B, N_T, generator=g) * 3 - 0.1,
                              old_logprobs=-torch.rand(N_B, N_T, generator=g) * 3 - 0.1,
                              advantages=_randn(g, N_B, N_T), mask=_mask(g, N_B, N_T)),
        call=lambda logprobs, old_logprobs, advantages, mask: dict(zip(
            ("loss", "ratio", "clipped"), clipped_surrogate(logprobs, old_logprobs, advantages, 0.2, mask=mask))),
        oracle=masked_surrogate,
        grads=("logprobs",),
        triton=False,
    ),
    "gae": Case(
        inputs=lambda g: dict(rewards=_randn(g, N_B, 5), values=_randn(g, N_B, 5), mask=_mask(g, N_B, 5)),
        call=lambda rewards, values, mask: dict(zip(("advantages", "returns"), gae(rewards, values, mask, 0.9, 0.8))),
        oracle=lambda rewards, values, mask: gae_loop(rewards, values, mask, 0.9, 0.8),
    ),
    "truncate_at_stop": Case(
        inputs=lambda g: dict(responses=torch.randint(0, 6, (3, 7), generator=g),
                              stop_ids=torch.tensor([[2, 3], [3, 4]])),
        call=lambda responses, stop_ids: dict(zip(("truncated", "lengths", "mask", "has_stop"),
                                                  truncate_at_stop(responses, stop_ids, 9))),
        oracle=lambda responses, stop_ids: truncate_loop(responses, stop_ids.reshape(-1), 9),
        triton=False,
    ),
    "masked_stats": Case(
        inputs=lambda g: dict(x=_randn(g, N_B, 4, scale=3.0), mask=_mask(g, N_B, 4)),
        call=lambda x, mask: dict(mean=masked_mean(x, mask), var=masked_var(x, mask), white=masked_whiten(x, mask)),
        oracle=masked_stats,
        grads=("x",),
        triton=False,
    ),
}

ROWS = [(fn, arg) for fn, case in CASES.items() for arg in case.inputs(torch.Generator().manual_seed(0))]
_SAMPLE = {fn: case.inputs(torch.Generator().manual_seed(0)) for fn, case in CASES.items()}
# Every (row, layout, path) that applies: no transposed 1-D argument, no Triton path where a function has none.
PARAMS = [pytest.param(fn, arg, layout, path, id=f"{fn}-{arg}-{layout}-{path}")
          for fn, arg in ROWS for layout, lay in LAYOUTS.items() for path in ("reference", "triton")
          if lay(_SAMPLE[fn][arg]) is not None and (path == "reference" or CASES[fn].triton)]


def _float(t):
    return t.is_floating_point()


@pytest.mark.parametrize("fn, arg, layout, path", PARAMS)
def test_any_layout(fn, arg, layout, path, monkeypatch):
    case = CASES[fn]
    if path == "triton":
        device = triton_device_or_skip()
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device = torch.device("cpu")
    values = {k: v.to(device) for k, v in case.inputs(torch.Generator().manual_seed(zlib.crc32(
        f"{fn}-{arg}".encode()))).items()}
    laid = LAYOUTS[layout](values[arg])
    check_layout(layout, laid)
    values[arg] = laid
    args = {k: v.detach().requires_grad_(k in case.grads) for k, v in values.items()}
    oracle_args = {k: (v.detach().contiguous().cpu().double() if _float(v) else v.detach().contiguous().cpu())
                   .requires_grad_(k in case.grads) for k, v in values.items()}
    got = case.call(**args)
    want = case.oracle(**oracle_args)
    assert set(want) <= set(got)
    for name, expected in want.items():
        actual = got[name]
        if expected.dtype in (torch.bool, torch.int64):
            assert torch.equal(actual.cpu(), expected), (name, actual, expected)
        else:
            assert_close(actual, expected, torch.float32, extra_atol=2e-5)
    if not case.grads:
        return
    g = torch.Generator().manual_seed(1)
    float_outputs = [n for n, e in want.items() if e.is_floating_point() and got[n].requires_grad]
    weights = {n: torch.randn(want[n].shape, generator=g, dtype=torch.float64) for n in float_outputs}
    total = sum((got[n].double() * weights[n].to(device)).sum() for n in float_outputs)
    total_want = sum((want[n] * weights[n]).sum() for n in float_outputs)
    grads = torch.autograd.grad(total, [args[k] for k in case.grads])
    grads_want = torch.autograd.grad(total_want, [oracle_args[k] for k in case.grads])
    for name, actual, expected in zip(case.grads, grads, grads_want):
        assert actual.shape == expected.shape, name
        assert_grad_close(actual, expected, torch.float32, extra_atol=2e-5)
