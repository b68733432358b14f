"""bench/long_completions.py: its model cannot sample eos (so every completion runs to the limit on both sides),
its bisection brackets the longest length that fits, its arguments are checked by name, and its smoke run trains
fastppo's and TRL 1.16's GRPOTrainer from the same script (slow: two child processes, mostly their imports)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import long_completions as lc  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTPPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _eos_draws(model, eos: int, seed: int = 0) -> int:
    """How many of 32 × 63 positions × 16 draws from the model's next-token distribution are eos."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (32, 63), generator=gen)
    with torch.no_grad():
        probs = model(input_ids=ids).logits.float().softmax(-1).reshape(-1, model.config.vocab_size)
    return int((torch.multinomial(probs, 16, replacement=True, generator=gen) == eos).sum())


def test_the_shape_cannot_sample_eos_where_plain_random_weights_would(cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = lc.shape_dir("tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos = tokenizer.eos_token_id
    assert (eos, len(tokenizer), model.config.vocab_size) == (2, 64, 64)  # one id per row of the head, no more
    assert tokenizer.decode([5, 17, 63]) == "w5 w17 w63"  # every sampled id is one word for the reward to count
    assert json.loads((Path(path) / "shape.json").read_text())["eos_margin"] > 1000
    assert _eos_draws(model, eos) == 0
    torch.manual_seed(0)  # the same shape with plain random weights: eos about one draw in 64
    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    assert _eos_draws(plain, eos) > 200


def test_the_shapes_have_the_published_sizes():
    from transformers import AutoConfig, AutoModelForCausalLM

    expected = {"smollm2-135m": 134_515_008, "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304}
    for shape, params in expected.items():
        spec = dict(lc.SHAPES[shape])
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec))
        assert sum(p.numel() for p in model.parameters()) == params, shape


def test_bisection_brackets_the_longest_length_that_fits():
    def under(limit):
        return lambda n: "fit" if n <= limit else "no fit"

    found = lc.bisect_longest(under(5000), start=1024, maximum=65536, resolution=256)
    assert (found["longest_fit"], found["first_no_fit"], found["complete"]) == (4864, 5120, True)
    assert [n for n, _ in found["tried"]] == [1024, 2048, 4096, 8192, 6144, 5120, 4608, 4864]
    down = lc.bisect_longest(under(3000), start=8192, maximum=65536, resolution=1024)
    assert (down["longest_fit"], down["first_no_fit"]) == (2048, 3072)
    assert lc.bisect_longest(under(10**6), 8192, 32768, 1024)["first_no_fit"] is None  # fits up to the maximum
    assert lc.bisect_longest(under(100), 1024, 65536, 512)["longest_fit"] is None  # nothing fits
    unknown = lc.bisect_longest(lambda n: "fit" if n < 4096 else "unknown", 1024, 65536, 256)
    assert (unknown["longest_fit"], unknown["first_no_fit"], unknown["complete"]) == (2048, None, False)
    budget = iter([1, 1, 0])
    timed = lc.bisect_longest(under(10**6), 1024, 65536, 256, time_left=lambda: next(budget))
    assert (timed["longest_fit"], len(timed["tried"]), timed["complete"]) == (2048, 2, False)


CHILDREN = {  # stand-ins for a side's child process: what each does, and the outcome a run of it records
    "sleep": ("import time; time.sleep(60)", "past the limit"),
    "oom": ("import sys; sys.stderr.write('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 9 GiB')\n"
            "sys.exit(1)", "out of memory"),
    "crash": ("raise ValueError('a bug')", "failed"),
}


@pytest.mark.parametrize("kind", list(CHILDREN))
def test_a_run_tells_out_of_memory_from_its_limit_and_from_a_failure(kind, tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text(CHILDREN[kind][0])
    monkeypatch.setattr(lc, "__file__", str(script))  # run() starts its own file as the child
    record = lc.run("fastppo", lc.LongCase(shape="tiny"), limit=3)
    assert record["outcome"] == CHILDREN[kind][1]
    assert record["wall_s"] < 30 and "result" not in record
    if kind == "crash":
        assert "ValueError: a bug" in record["error"]


@pytest.mark.parametrize("argv, message", [
    (["--shape", "llama-7b"], "--shape: unknown"),
    (["--lengths", "1k"], "--lengths must be comma-separated integers"),
    (["--lengths", "0"], "--lengths must be integers >= 1"),
    (["--sides", "fastppo,vllm"], "--sides: unknown"),
    (["--completions", "0"], "--completions must be >= 1"),
    (["--device", "cpu", "--sides", "fastppo,trl-liger"], "trl-liger: Liger's kernels"),
])
def test_bad_arguments_are_refused_by_name(argv, message):
    with pytest.raises(SystemExit, match=message):
        lc.main(argv)


@pytest.mark.slow
def test_smoke_trains_both_sides_from_one_script_to_the_full_length(tmp_path):
    """Both trainers, GRPOConfig's defaults but the sizes: every completion is the full 32 tokens on both sides
    (counted by the shared reward function), and the table, the records and the plot come out."""
    out = {k: tmp_path / f"long.{k}" for k in ("json", "md", "png")}
    env = dict(os.environ, FASTPPO_CACHE=os.environ.get("FASTPPO_CACHE", str(tmp_path / "cache")))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "long_completions.py"), "--smoke",
                           "--json", str(out["json"]), "--markdown", str(out["md"]), "--plot", str(out["png"])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    runs = json.loads(out["json"].read_text())["runs"]
    assert [(r["side"], r["length"], r["outcome"]) for r in runs] == [("fastppo", 32, "ok"), ("trl", 32, "ok")]
    for r in runs:
        res = r["result"]
        assert res["completions_per_call"] == [8] and res["completion_length_mean"] == [32.0], r["side"]
        assert res["process_maxrss_bytes"] > 0 and res["train_call_s"] > 0, r["side"]
        assert res["settings"]["bf16"] is True and res["settings"]["gradient_checkpointing"] is True, r["side"]
    assert runs[1]["result"]["settings"]["trl_version"].startswith("1.")
    table = out["md"].read_text()
    assert "| 32 | fastppo |" in table and "| 32 | trl |" in table and "peak RSS MiB" in table
    assert out["png"].stat().st_size > 0
