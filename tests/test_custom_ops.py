"""fastppo's kernels as ``torch.library`` custom ops (``fastppo/kernels/custom_ops.py``, issue 64).

Each op: ``torch.library.opcheck`` on small random inputs (odd shapes, an ignored or masked row), which checks its
schema, its fake against the real implementation, and its autograd registration; then ``torch.compile`` with
``fullgraph=True`` (the ``aot_eager`` backend: dynamo and AOTAutograd, cheap on a CPU; ``tests/test_compile.py``
runs inductor over the LM-head entry points) over a small step calling the public function, whose values and
gradients must equal eager's exactly. On a CPU the Triton paths run under the interpreter (``TRITON_INTERPRET=1``, the test setup's default); a GPU session
(``TRITON_INTERPRET=0``) runs them on CUDA tensors."""
from __future__ import annotations

import pytest
import torch

import fastppo.kernels  # noqa: F401  (registers torch.ops.fastppo.*)
from fastppo.kernels import (fused_full_kl, fused_ppo_policy_loss, fused_token_logprobs, gae, kl_penalty,
                             token_logprobs, truncate_at_stop)
from fastppo.kernels._common import interpret_mode

OPS = torch.ops.fastppo
V, H = 37, 8  # odd vocabulary and hidden sizes; 13 rows


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def triton_or_skip() -> None:
    if not (torch.cuda.is_available() or interpret_mode()):
        pytest.skip("the Triton paths need CUDA or TRITON_INTERPRET=1")


@pytest.fixture(params=["pytorch", "triton"])
def path(request, monkeypatch):
    """The chunked PyTorch path (a CPU without the interpreter) or the Triton one."""
    if request.param == "pytorch":
        if torch.cuda.is_available():
            pytest.skip("the PyTorch path is the CPU's")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    else:
        triton_or_skip()
    torch._dynamo.reset()
    return request.param


def randn(*shape, seed: int, grad: bool = True, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device()).requires_grad_(grad)


def lm_head(seed: int, rows: int = 13):
    hidden, weight, bias = randn(rows, H, seed=seed), randn(V, H, seed=seed + 1), randn(V, seed=seed + 2)
    g = torch.Generator().manual_seed(seed + 3)
    index = torch.randint(0, V, (rows,), generator=g).to(device())
    return hidden, weight, bias, index


def check_compiled(fn, inputs) -> None:
    """``fn`` compiled with fullgraph=True (aot_eager): its outputs and the gradients of a weighted sum of them
    equal eager's exactly."""
    def run(f):
        outs = [o for o in f(*inputs) if o is not None]
        weights = torch.Generator().manual_seed(7)
        total = sum((o.double() * torch.rand(o.shape, generator=weights, dtype=torch.float64).to(o.device)).sum()
                    for o in outs if o.requires_grad)
        return [o.detach() for o in outs], list(torch.autograd.grad(total, inputs))

    want = run(fn)
    got = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def opcheck(op, args, kwargs=None) -> None:
    torch.library.opcheck(op, args, kwargs)


# ---------------------------------------------------------------------------- fused_token_logprobs


def test_fused_token_logprobs_ops(path):
    hidden, weight, bias, index = lm_head(1)
    for wants in ([True, True, False, False, False], [False, True, True, True, True]):
        if path == "pytorch":
            opcheck(OPS.chunked_lm_head_stats, (hidden, weight, bias, index, 0.7, None, 1.0, wants, [5, 9]))
            opcheck(OPS.chunked_lm_head_stats, (hidden, weight, None, index, 0.7, 3.0, 0.5, wants, [13, 16]))
        else:
            opcheck(OPS.fused_token_logprobs, (hidden, weight, bias, index, 0.7, 1.0, 1.0, False, wants))
            opcheck(OPS.fused_token_logprobs, (hidden, weight, None, index, 1.0, 0.5 / 3.0, 3.0 / 0.7, True, wants))


def test_fused_token_logprobs_compiles_without_a_graph_break(path):
    hidden, weight, bias, index = lm_head(2)
    index = index.view(13)
    index[4] = -100  # an ignored row

    def step(h, w, b):
        return fused_token_logprobs(h, w, index, 0.7, bias=b, return_entropy=True)

    check_compiled(step, [hidden, weight, bias])

    def capped(h, w, b):
        return tuple(fused_token_logprobs(h, w, index, 0.9, bias=b, softcap=2.5, logit_scale=0.8,
                                          outputs=("logprobs", "entropy", "log_sum_sq_probs", "is_top1")))

    check_compiled(capped, [hidden, weight, bias])


# ---------------------------------------------------------------------------- fused_full_kl


def test_fused_full_kl_ops(path):
    hidden, weight, bias, _ = lm_head(4)
    ref_hidden, ref_weight, ref_bias, _ = (t.detach() if isinstance(t, torch.Tensor) else t for t in lm_head(8))
    if path == "pytorch":
        opcheck(OPS.chunked_full_kl, (hidden, weight, bias, ref_hidden, ref_weight, ref_bias, 0.9, [6, 10]))
        opcheck(OPS.chunked_full_kl, (hidden, weight, None, ref_hidden, ref_weight, None, 1.0, [13, 37]))
    else:
        opcheck(OPS.fused_full_kl, (hidden, weight, bias, ref_hidden, ref_weight, ref_bias, 0.9))


def test_fused_full_kl_compiles_without_a_graph_break(path):
    hidden, weight, bias, _ = lm_head(5)
    ref_hidden, ref_weight = randn(13, 5, seed=9, grad=False), randn(V, 5, seed=10, grad=False)
    check_compiled(lambda h, w, b: (fused_full_kl(h, w, ref_hidden, ref_weight, 0.9, bias=b),),
                   [hidden, weight, bias])


# ---------------------------------------------------------------------------- fused_ppo_policy_loss


def ppo_inputs(seed: int):
    hidden, weight, bias, index = lm_head(seed, rows=12)
    g = torch.Generator().manual_seed(seed + 4)
    old = (-3 * torch.rand(12, generator=g)).to(device())
    advantages = torch.randn(12, generator=g).to(device())
    mask = (torch.rand(12, generator=g) > 0.3).to(device())
    mask[5] = False  # a masked row
    return hidden, weight, bias, index, old, advantages, mask


def test_fused_ppo_policy_loss_op():
    """The Triton path's op (the PyTorch path is ``chunked_lm_head_stats`` and plain PyTorch)."""
    triton_or_skip()
    hidden, weight, bias, index, old, advantages, mask = ppo_inputs(11)
    base = (hidden, weight, bias, index, old, advantages, mask, None, None, None, 0.8, 0.2, 0.28, 3.0, 0.01, True,
            None, "clip", [1.0, 1.05], "token", [2.0, 3.0, 3.0, 2.0], None, [True, True, True])
    opcheck(OPS.fused_ppo_policy_loss, base)
    sequence = list(base)
    sequence[13], sequence[16], sequence[19] = None, [5, 7], "sequence"  # GSPO over two sequences
    opcheck(OPS.fused_ppo_policy_loss, tuple(sequence))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fused_ppo_policy_loss_compiles_without_a_graph_break(path, level):
    hidden, weight, bias, index, old, advantages, mask = ppo_inputs(12)

    def step(h, w, b):
        out = fused_ppo_policy_loss(h.view(3, 4, H), w, index.view(3, 4), old.view(3, 4), advantages.view(3, 4),
                                    mask.view(3, 4), 0.2, 0.01, 0.8, bias=b, cliprange_high=0.28,
                                    importance_sampling_level=level)
        return out.loss, out.logprobs, out.ratio, out.entropy

    check_compiled(step, [hidden, weight, bias])


# ---------------------------------------------------------------------------- the other Triton ops


def test_token_logprobs_op_and_compile():
    triton_or_skip()
    logits, index = randn(13, V, seed=13, scale=3.0), lm_head(13)[3]
    for entropy in (True, False):
        opcheck(OPS.token_logprobs, (logits, index, 0.7, entropy))
    index = index.clone()
    index[2] = -100
    check_compiled(lambda x: token_logprobs(x, index, 0.7, return_entropy=True), [logits])


def test_kl_penalty_op_and_compile():
    triton_or_skip()
    logprobs, ref = randn(3, 7, seed=14), randn(3, 7, seed=15)
    opcheck(OPS.kl_penalty, (logprobs, ref, 2))
    for estimator in ("k1", "k3", "mse"):
        check_compiled(lambda a, b: (kl_penalty(a, b, estimator),), [logprobs, ref])


def test_gae_op_and_compile():
    triton_or_skip()
    rewards, values = randn(3, 11, seed=16, grad=False), randn(3, 11, seed=17, grad=False)
    mask = (torch.rand(3, 11, generator=torch.Generator().manual_seed(18)) > 0.25).to(device())
    for skip_masked in (False, True):
        opcheck(OPS.gae, (rewards, values, mask, 0.99, 0.95, skip_masked))
    step = torch.compile(lambda r, v: gae(r, v, mask, 0.99, 0.95), fullgraph=True, backend="aot_eager")
    for got, want in zip(step(rewards, values), gae(rewards, values, mask, 0.99, 0.95)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------- the C++ op


def test_truncate_at_stop_op_and_compile():
    responses = torch.randint(0, 7, (4, 9), generator=torch.Generator().manual_seed(19)).to(device())
    stop = torch.tensor([3, 5], device=device())
    opcheck(OPS.truncate_at_stop.default, (responses, stop, 0))
    step = torch.compile(lambda r: truncate_at_stop(r, [3, 5], 0), fullgraph=True, backend="aot_eager")
    for got, want in zip(step(responses), truncate_at_stop(responses, [3, 5], 0)):
        assert torch.equal(got, want)
