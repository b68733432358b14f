"""Every public kernel entry point under ``torch.compile``, forward and backward: the values and gradients of eager,
on both CPU paths (the Triton kernels through the interpreter, and the PyTorch path). Users compile their training
steps; a kernel reached from compiled code is a custom op (``fastppo/kernels/custom_ops.py``: traced as one op, no
graph break; ``tests/test_custom_ops.py`` compiles with ``fullgraph=True``), and the PyTorch math around it
compiles. On a GPU session (``TRITON_INTERPRET=0 pytest``) the same tests run the compiled Triton kernels on CUDA tensors (the reported failure: inductor inside ``token_logprobs``'s backward).

Backends: ``aot_eager`` for every entry point (dynamo and AOTAutograd, where the reported failure arose), inductor
for the LM-head ones (inductor compiles C++ on the CPU: a few seconds a case)."""
from __future__ import annotations

import pytest
import torch

from fastppo.kernels import (clip_sides, clipped_surrogate, fused_full_kl, fused_ppo_policy_loss,
                             fused_token_logprobs, gae, kl_penalty, masked_mean, masked_var, masked_whiten,
                             token_logprobs, truncate_at_stop)

PATHS = {"triton": "1", "pytorch": "0"}


@pytest.fixture(params=list(PATHS), autouse=True)
def path(request, monkeypatch):
    """The Triton kernels (interpreter on a CPU, compiled on CUDA) or the PyTorch path."""
    if request.param == "triton" and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif request.param == "pytorch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    return request.param


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def leaves(*shapes, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(*s, generator=g, dtype=torch.float32)).to(device()).requires_grad_()
            for s in shapes]


def outputs_and_grads(fn, inputs):
    """fn's tensor outputs and the gradients of a weighted sum of the differentiable ones w.r.t. ``inputs``."""
    out = fn(*inputs)
    flat = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    weights = torch.Generator().manual_seed(99)
    total = sum((t.float() * torch.rand(t.shape, generator=weights).to(t.device)).sum()
                for t in flat if t.requires_grad)
    grads = torch.autograd.grad(total, inputs, allow_unused=True) if isinstance(total, torch.Tensor) else ()
    return [t.detach() for t in flat], [g for g in grads if g is not None]


def assert_compiles_to_eager(fn, inputs, backend: str) -> None:
    want_out, want_grads = outputs_and_grads(fn, inputs)
    got_out, got_grads = outputs_and_grads(torch.compile(fn, backend=backend), inputs)
    assert len(got_out) == len(want_out) and len(got_grads) == len(want_grads)
    for got, want in zip(got_out + got_grads, want_out + want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


V, H = 37, 8


def lm_head_inputs(seed: int):
    hidden, weight, bias = leaves((3, 5, H), (V, H), (V,), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    index = torch.randint(0, V, (3, 5), generator=g).to(device())
    index[1, 4] = -100  # an ignored position (TRL's label padding)
    return hidden, weight, bias, index


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_token_logprobs(backend):
    """The reported case: ``torch.compile(lambda x, i: token_logprobs(x, i, 0.7, return_entropy=True))`` with a
    backward."""
    (logits,) = leaves((3, 5, V), seed=1, scale=3.0)
    index = lm_head_inputs(1)[3]
    assert_compiles_to_eager(lambda x: token_logprobs(x, index, 0.7, return_entropy=True), [logits], backend)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_token_logprobs(backend):
    hidden, weight, bias, index = lm_head_inputs(2)
    assert_compiles_to_eager(lambda h, w, b: fused_token_logprobs(h, w, index, 0.7, bias=b, return_entropy=True),
                             [hidden, weight, bias], backend)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_full_kl(backend):
    hidden, weight, bias, _ = lm_head_inputs(3)
    ref_hidden, ref_weight = (t.detach() for t in leaves((3, 5, H), (V, H), seed=4))
    assert_compiles_to_eager(lambda h, w, b: fused_full_kl(h, w, ref_hidden, ref_weight, 0.9, bias=b),
                             [hidden, weight, bias], backend)


@pytest.mark.parametrize("surrogate", ["clip", "cispo"])
def test_fused_ppo_policy_loss(surrogate):
    hidden, weight, bias, index = lm_head_inputs(5)
    index = index.clamp(min=0)
    g = torch.Generator().manual_seed(6)
    old = (-3 * torch.rand(3, 5, generator=g)).to(device())
    advantages = torch.randn(3, 5, generator=g).to(device())
    mask = (torch.rand(3, 5, generator=g) > 0.2).to(device())
    extra = dict(cliprange_high=5.0) if surrogate == "cispo" else dict(cliprange_high=0.28, delta=3.0)

    def loss(h, w, b):
        return fused_ppo_policy_loss(h, w, index, old, advantages, mask, 0.2, 0.01, 0.8, bias=b,
                                     surrogate=surrogate, **extra)

    assert_compiles_to_eager(loss, [hidden, weight, bias], "aot_eager")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "mse"])
def test_kl_penalty(estimator):
    logprobs, ref = leaves((4, 9), (4, 9), seed=7)
    assert_compiles_to_eager(lambda a, b: kl_penalty(a, b, estimator), [logprobs, ref], "aot_eager")


def test_gae_masked_statistics_and_surrogates():
    g = torch.Generator().manual_seed(8)
    rewards, values = (torch.randn(3, 6, generator=g).to(device()) for _ in range(2))
    mask = (torch.rand(3, 6, generator=g) > 0.25).to(device())
    mask[:, 0] = True
    assert_compiles_to_eager(lambda r, v: gae(r, v, mask, 0.99, 0.95), [rewards, values], "aot_eager")
    x, old, advantages = leaves((3, 6), (3, 6), (3, 6), seed=9)
    assert_compiles_to_eager(lambda a: (masked_mean(a, mask), masked_var(a, mask), masked_whiten(a, mask)), [x],
                             "aot_eager")
    assert_compiles_to_eager(lambda lp: clipped_surrogate(lp, old.detach(), advantages.detach(), 0.2, mask=mask,
                                                          cliprange_high=0.28), [x], "aot_eager")
    ratio = torch.exp(x.detach() - old.detach())
    assert_compiles_to_eager(lambda r: clip_sides(r, advantages.detach(), 0.2, 0.28), [ratio], "aot_eager")


def test_truncate_at_stop():
    g = torch.Generator().manual_seed(10)
    responses = torch.randint(0, 7, (4, 9), generator=g).to(device())
    got = torch.compile(lambda r: truncate_at_stop(r, [3, 5], 0), backend="aot_eager")(responses)
    for a, b in zip(got, truncate_at_stop(responses, [3, 5], 0)):
        assert torch.equal(a, b)
