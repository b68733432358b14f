"""fastppo.integrations.trl against the real TRL 1.x, in TRL 1.x's own environment.

The environment holds TRL 1.16 (the ``[trl]`` extra, part of ``[test]``; ``$FASTPPO_TRL1`` names another directory
instead) and the PPO peer's TRL 0.26.2 lives in ``.trl026`` (``bench/trl_envs.py``). The runs happen in subprocesses
with TRL 1.x's directory first on ``PYTHONPATH`` (``tests/trl1_grpo.py``), whatever the parent put there.
A missing TRL 1.x fails with the command that installs it: this is not skipped.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "tests" / "trl1_grpo.py"
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _trl_envs():
    spec = importlib.util.spec_from_file_location("trl_envs", ROOT / "bench" / "trl_envs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trl1_dir() -> Path:
    """The directory holding TRL 1.x (``bench/trl_envs.py``), or the test fails with the command that installs it."""
    envs = _trl_envs()
    if why := envs.trl1_missing():
        pytest.fail(why)
    return Path(envs.trl1_dir())


def run_in_trl1(tmp_path, *args, interpret: bool, cache) -> dict:
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(trl1_dir()), str(ROOT)]),
               TRITON_INTERPRET="1" if interpret else "0", FASTPPO_CACHE=str(cache))
    proc = subprocess.run([sys.executable, str(RUNNER), str(out), *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fastppo-cache")


def _max_metric_diff(a, b) -> tuple[float, str]:
    worst = (0.0, "")
    for la, lb in zip(a["logs"], b["logs"], strict=True):
        assert la.keys() == lb.keys()
        for k in la:
            worst = max(worst, (abs(la[k] - lb[k]), k))
    return worst


def _update_ratio(a, b) -> float:
    """|w_fastppo − w_trl| / |w_trl − w_0| over the trained weights: the runs' difference against the training's."""
    diff = sum(((a["weights"][k] - b["weights"][k]) ** 2).sum() for k in a["weights"]) ** 0.5
    moved = sum(((a["weights"][k] - a["initial"][k]) ** 2).sum() for k in a["weights"]) ** 0.5
    return float(diff / moved)


@pytest.mark.slow
@pytest.mark.parametrize("config, interpret, metric_tol, update_tol", [
    ("fp32", False, 1e-5, 1e-3),
    ("fp32", True, 1e-5, 1e-3),  # fastppo's Triton kernels (the interpreter) inside TRL's GRPO
    ("lora", False, 1e-5, 1e-3),
    # bf16 autocast: TRL rounds the logits to bf16, fastppo does not, so the two differ at bf16 rounding
    ("bf16", False, 2e-2, 0.5),
])
def test_grpo_trains_the_same_with_fastppos_kernels(tmp_path, cache, config, interpret, metric_tol, update_tol):
    record = run_in_trl1(tmp_path, "--config", config, interpret=interpret, cache=cache)
    trl_run, ours = record["trl"], record["fastppo"]
    assert trl_run["trl_version"].startswith("1.")
    # The seam was really taken: policy (log-probs + entropy) and reference model calls, every step.
    assert ours["fastppo_calls"] >= 6 and trl_run["fastppo_calls"] == 0
    assert ours["completions"] == trl_run["completions"] and len(ours["completions"]) > 0
    diff, name = _max_metric_diff(trl_run, ours)
    assert diff <= metric_tol, f"metric {name} differs by {diff}"
    ratio = _update_ratio(trl_run, ours)
    assert ratio <= update_tol, ratio
    assert any((trl_run["weights"][k] != trl_run["initial"][k]).any() for k in trl_run["weights"])  # it trained


@pytest.mark.slow
def test_the_seam_equals_trls_and_is_exact_in_bf16(tmp_path, cache):
    """TRL 1.16's _ChunkedLogProbFunction and fastppo's stand-in on the same inputs (soft-capped and plain): the
    same five outputs (TRL's definitions of the statistics included) and gradients; in bf16 fastppo's are closer
    to a float64 run on the same bf16 inputs than TRL's own (TRL rounds the logits to bf16)."""
    record = run_in_trl1(tmp_path, "--seam", interpret=True, cache=cache)
    assert len(record) == 4
    for case, rec in record.items():
        bf16 = case.startswith("torch.bfloat16")
        for i, name in enumerate(OUTPUTS):
            trl_out, ours, exact = (rec[k]["outputs"][i] for k in ("trl", "fastppo", "float64"))
            if name == "is_top1":
                assert torch.equal(ours, exact) and torch.equal(ours, trl_out), case
                continue
            ours_err = (ours - exact).abs().max().item()
            trl_err = (trl_out - exact).abs().max().item()
            assert ours_err <= 2e-5, (case, name, ours_err)
            if not bf16:
                assert (ours - trl_out).abs().max().item() <= 2e-5, (case, name)
            elif name != "mean_logits":  # the mean of the logits is not a softmax statistic: both are fine there
                assert ours_err < trl_err, (case, name, ours_err, trl_err)
        for i in range(3):
            ours, exact = rec["fastppo"]["grads"][i], rec["float64"]["grads"][i]
            scale = exact.abs().max().item()
            # bf16 gradients: the logits' gradient is formed in the operands' dtype (as autograd of a bf16
            # hidden @ W.T would) and the result is rounded to bf16; a few bf16 ulps of the largest entry
            tol = (2 ** -6 if bf16 else 1e-5) * scale
            assert (ours - exact).abs().max().item() <= tol, (case, i)


def test_apply_checks_the_version_refuses_trl_0x_and_undoes(tmp_path):
    """With the PPO peer's TRL 0.26 first on the path: refused with the reason. With TRL 1.x: patched, held twice,
    undone."""
    trl026 = _trl_envs().trl026_dir()
    refusal = ("from fastppo.integrations.trl import apply_fastppo_kernels_to_trl\n"
               "try:\n    apply_fastppo_kernels_to_trl()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", refusal], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([trl026, str(ROOT)]), TRITON_INTERPRET="0"))
    assert re.search(r"refused: .*TRL 1.x.s fused LM head .* the installed TRL is 0\.26", proc.stdout), \
        proc.stdout + proc.stderr[-3000:]
    script = (
        "import trl.trainer.utils as u, warnings\n"
        "from fastppo.integrations.trl import apply_fastppo_kernels_to_trl, FastppoChunkedLogProb\n"
        "orig = (u._ChunkedLogProbFunction, u.selective_log_softmax, u.entropy_from_logits)\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('error')\n"
        "    p = apply_fastppo_kernels_to_trl()\n"
        "again = apply_fastppo_kernels_to_trl()  # a second hold on the same routing, released on its own\n"
        "assert again is not p and again.active and p.active\n"
        "again.undo()\n"
        "assert p.active and u._ChunkedLogProbFunction is FastppoChunkedLogProb\n"
        "assert u._ChunkedLogProbFunction is FastppoChunkedLogProb and u.selective_log_softmax is not orig[1]\n"
        "import torch\n"
        "x, i = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3))\n"
        "m = torch.tensor([[1, 0, 1], [1, 1, 0]])\n"
        "got = u.selective_log_softmax(x, i, 0.7, m)\n"
        "want = orig[1](x, i, 0.7, m)\n"
        "assert torch.allclose(got, want, atol=1e-6), (got, want)\n"
        "assert torch.allclose(u.entropy_from_logits(x), orig[2](x), atol=1e-6)\n"
        "topk = torch.randint(0, 11, (2, 3, 4))\n"
        "assert torch.equal(u.selective_log_softmax(x, topk), orig[1](x, topk))  # TRL's own for top-K\n"
        "p.undo()\n"
        "assert (u._ChunkedLogProbFunction, u.selective_log_softmax, u.entropy_from_logits) == orig and not p.active\n"
        "with apply_fastppo_kernels_to_trl(fused_lm_head=False) as q:\n"
        "    assert u._ChunkedLogProbFunction is orig[0] and u.entropy_from_logits is not orig[2]\n"
        "assert u.entropy_from_logits is orig[2]\n"
        "print('ok', q)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(trl1_dir()), str(ROOT)]), TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok TRLKernelPatch(trl 1.16.0" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_the_trl1_bench_runs(tmp_path):
    """bench/trl1_logprobs.py --quick in TRL 1.x's environment: every implementation agrees before it is timed."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(trl1_dir()), str(ROOT)]), TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "trl1_logprobs.py"), "--quick", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "| fastppo / TRL |" in proc.stdout
    import json

    results = json.loads(out.read_text())
    assert len(results) == 4 and all(set(r["median_s"]) == {"fastppo", "trl 1.16.0"} for r in results)
    assert all(r["max_abs_err_logp"]["fastppo"] < 1e-5 for r in results)
