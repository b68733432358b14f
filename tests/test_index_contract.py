"""One out-of-range-index contract for every LM-head entry point and every path: an index outside [0, V) (other
than ``ignore_index`` rows) is an error, never a NaN row. On a CPU, the PyTorch path and the Triton interpreter
raise a ValueError naming the range; on CUDA (a GPU session: ``TRITON_INTERPRET=0 pytest``) a device-side
assertion fails the call at the next synchronisation, checked in a subprocess since it ends that process's CUDA
context."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fastppo.kernels import fused_ppo_policy_loss, fused_token_logprobs, token_logprobs

V = 11
BAD = [("index == V", V, -100), ("index -1", -1, -100), ("-100 with ignore_index None", -100, None)]


def calls(bad: int, ignore_index, device):
    """Each entry point called with one bad index among good ones (fresh random inputs, a row of 5 tokens)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g).to(device)
    hidden = torch.randn(5, 6, generator=g).to(device)
    weight = torch.randn(V, 6, generator=g).to(device)
    index = torch.randint(0, V, (5,), generator=g).to(device)
    index[3] = bad
    old = -torch.rand(5, generator=g).to(device)
    advantages = torch.randn(5, generator=g).to(device)
    mask = torch.ones(5, dtype=torch.bool, device=device)
    yield "token_logprobs", lambda: token_logprobs(logits, index, 0.7, return_entropy=True, ignore_index=ignore_index)
    yield "fused_token_logprobs", lambda: fused_token_logprobs(hidden, weight, index, 0.7, ignore_index=ignore_index)
    if ignore_index is not None:  # the policy loss takes no ignore_index: its mask says which tokens count
        yield "fused_ppo_policy_loss", lambda: fused_ppo_policy_loss(hidden[None], weight, index[None], old[None],
                                                                     advantages[None], mask[None], cliprange=0.2)


@pytest.mark.parametrize("interpret", ["0", "1"], ids=["pytorch-path", "triton-interpreter"])
@pytest.mark.parametrize("what, bad, ignore_index", BAD, ids=[b[0] for b in BAD])
def test_an_out_of_range_index_is_refused_on_the_cpu(monkeypatch, interpret, what, bad, ignore_index):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    for name, call in calls(bad, ignore_index, "cpu"):
        with pytest.raises(ValueError, match=rf"index values must lie in \[0, {V}\)"):
            call()


def test_the_ignored_rows_are_not_out_of_range():
    for name, call in calls(-100, -100, "cpu"):
        if name != "fused_ppo_policy_loss":
            out = call()
            assert all(torch.isfinite(t).all() for t in (out if isinstance(out, tuple) else (out,))), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA branch of the contract needs a GPU")
@pytest.mark.parametrize("what, bad, ignore_index", BAD, ids=[b[0] for b in BAD])
def test_an_out_of_range_index_fails_on_cuda(what, bad, ignore_index):
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_index_contract import calls
        name = sys.argv[1]
        call = dict(calls({bad}, {ignore_index!r}, "cuda"))[name]
        try:
            out = call()
            torch.cuda.synchronize()
        except Exception as e:  # the device-side assertion, surfaced at the synchronisation
            print("REFUSED", type(e).__name__)
        else:
            print("RETURNED")
    """)
    names = [name for name, _ in calls(bad, ignore_index, "cpu")]
    for name in names:
        proc = subprocess.run([sys.executable, "-c", script, name], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, TRITON_INTERPRET="0"))
        assert "REFUSED" in proc.stdout, (name, proc.stdout[-2000:], proc.stderr[-2000:])
