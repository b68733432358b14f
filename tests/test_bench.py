"""The bench suite itself: every case runs (``--smoke``: the GPU cases' code on the CPU through
the Triton interpreter, tiny shapes) and reports what it promises, so a bench that only a GPU
session would exercise cannot rot unseen. Timings are not checked: a smoke run measures nothing.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNEL_GROUPS = ("logprobs: token_logprobs", "logprobs: fused_token_logprobs", "kl: kl_penalty", "kl: fused_full_kl",
                 "ppo_loss: fused_ppo_policy_loss", "gae:", "truncate_at_stop")


def run_bench(tmp_path, *args, paths=("bench/",), timeout=900):
    env = dict(os.environ, TRITON_INTERPRET="0", FASTPPO_CACHE=os.environ.get("FASTPPO_CACHE", str(tmp_path / "cache")))
    cmd = [sys.executable, "-m", "pytest", *paths, "-p", "no:cacheprovider", "-q", "-rs", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def installed(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - any import failure means the peer's cases skip
        return False
    return True


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench")
    out = tmp_path / "bench.json"
    proc = run_bench(tmp_path, "--smoke", f"--benchmark-json={out}")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_smoke_run_covers_every_kernel_with_its_reference(smoke_run):
    stdout, report = smoke_run
    rows = {(b["group"], b["name"]) for b in report["benchmarks"]}
    groups = {g for g, _ in rows}
    impls = {g: {name for group, name in rows if group == g} for g in groups}
    for g, names in impls.items():  # every kernel group has the baseline its speedups are relative to
        if g.startswith("e2e"):
            continue  # its reference, TRL, is a peer that may be missing: test_end_to_end_runs_both_trainers
        assert any(name.startswith("reference") for name in names), f"{g}: no reference row"
    for prefix in KERNEL_GROUPS:  # every kernel is timed beside its reference
        assert any(g.startswith(prefix) and any(n.startswith("fastppo") for n in names) for g, names in impls.items()), \
            f"no bench group starting with {prefix!r} times fastppo"
    # Both GAE semantics, fwd and fwd+bwd, with and without entropy.
    assert any("skip_masked=True" in g for g in groups) and any("skip_masked=False" in g for g in groups)
    assert any("fwd+bwd" in g for g in groups) and any("+entropy" in g for g in groups)
    assert "fastppo bench summary" in stdout and "SMOKE RUN" in stdout


def test_gpu_cases_record_their_floor(smoke_run):
    _, report = smoke_run
    fastppo_rows = [b for b in report["benchmarks"] if b["name"].startswith("fastppo") and "N=" in b["group"]]
    assert fastppo_rows
    for b in fastppo_rows:
        assert b["extra_info"]["floor_s"] > 0, b["group"]
    # The PPO loss is timed beside both unfused paths, against the bare three GEMMs.
    ppo = {b["name"] for b in report["benchmarks"] if b["group"].startswith("ppo_loss:")}
    assert ppo == {"reference", "fastppo fused_token_logprobs + loss", "fastppo triton"}


def test_each_record_carries_quantiles_and_versions(smoke_run):
    _, report = smoke_run
    import torch

    for b in report["benchmarks"]:
        info = b["extra_info"]
        assert 0 < info["p20_s"] <= info["median_s"] <= info["p80_s"], b["group"]
        assert info["torch_version"] == torch.__version__ and info["triton_version"] and info["device"], b["group"]


@pytest.mark.parametrize("module, impl", [
    ("liger_kernel", "liger flce"),
    ("liger_kernel", "liger fused_selective_log_softmax"),
    ("trl", "trl selective_log_softmax"),
])
def test_peers_run_where_installed(smoke_run, module, impl):
    if not installed(module):
        pytest.skip(f"{module} is not installed")
    _, report = smoke_run
    assert any(b["name"] == impl for b in report["benchmarks"]), f"{impl} did not run"


def test_end_to_end_runs_every_trainer(smoke_run):
    if not installed("trl"):
        pytest.skip("trl is not installed")
    _, report = smoke_run
    e2e = {b["name"]: b for b in report["benchmarks"] if b["group"].startswith("e2e")}
    assert set(e2e) == {"fastppo.train", "fastppo.train --shared_value_head --padding_free",
                        "reference: TRL 0.26 PPOTrainer"}
    for b in e2e.values():
        assert b["extra_info"]["episodes_per_s_median"] > 0


def test_without_a_gpu_the_gpu_cases_skip_with_a_reason(tmp_path):
    proc = run_bench(tmp_path, "--quick", "--benchmark-disable", paths=("bench/bench_masking.py",))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "GPU case: needs a CUDA device" in proc.stdout
    assert "2 passed" in proc.stdout  # the CPU cases: reference and the C++ op


def test_tuner_checks_and_times_every_tile_choice(tmp_path):
    from fastppo.kernels._common import TILE_NAMES

    out = tmp_path / "tune.json"
    proc = subprocess.run([sys.executable, "bench/tune.py", "all", "--smoke", "--passes", "fwd+bwd", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["targets"]) == set(TILE_NAMES)  # every tile function of every kernel
    for target, result in report["targets"].items():
        rows = result["rows"]
        assert len(rows) == 2 and all(r["median_s"] > 0 for r in rows), (target, rows)
        assert sum(r["default"] for r in rows) == 1, target  # the current tile is among those timed
    assert proc.stdout.count("<- default") == len(TILE_NAMES)


def test_tuner_without_a_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, "bench/tune.py", "token_logprobs"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr


def test_update_operator_count_sees_both_updates():
    # Both trainers' updates are found and counted (a phase switch that never fired would count nothing), and the
    # report's totals are the per-operator counts' sums.
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import count_update_ops

    # the trainers' CPU paths, not the Triton interpreter the kernel tests run (12 s against 150)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "bench/count_update_ops.py", "--model", "embedded", "--rows", "5"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    totals = re.search(r"fastppo ([\d,]+) \(\+ [\d,]+ views\), TRL ([\d,]+)", proc.stdout)
    assert totals, proc.stdout
    fast, trl = (int(x.replace(",", "")) for x in totals.groups())
    assert fast > 1000 and trl > 1000  # 4 epochs of forward, backward and optimizer steps each
    assert proc.stdout.count("\n| ") == 2 + 5  # the header, its rule and --rows operators
    counts = {"fastppo": {"mm": 3, "view": 9, "_local_scalar_dense": 1}, "trl": {"mm": 2, "cat": 2}}
    text = count_update_ops.report(counts, rows=2)
    assert "fastppo 4 (+ 9 views), TRL 4 (+ 0 views), fastppo / TRL 1.00" in text and "fastppo 1, TRL 0" in text
