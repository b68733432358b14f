#!/usr/bin/env bash
# One device call (at most ~545 s): install, the kernel tests on CUDA, the quick kernel benches, TRL 1.x's chunked
# LM head at the headline shapes, a profile of fastppo's update, GRPO beside TRL 1.16, end to end beside TRL 0.26
# at SmolLM2-135M's and Qwen2.5-0.5B's shapes, the token-budget micro-batches, an optional tile sweep, and a
# summary table printed last.
# Issue 51's run (time to the first iteration, GRPO at 256 tokens on both shapes, the compile and index tests):
#   GRPO_SHAPES="smollm2 qwen05" GRPO_LENGTH=256 GRPO_ITERATIONS=10 GRPO_SECONDS=200 GRPO_SIDE_SECONDS=65 \
#   BENCH_SECONDS=40 E2E_SECONDS=0 E2E05_SECONDS=0 PROFILE_SECONDS=0 UPDATE_BUDGET_SECONDS=0 bash bench/gpu_call1.sh
# Every stage runs under `timeout -s INT` (pytest then still writes its junit/benchmark JSON and summary), so
# logs always come back under $OUT, at most 8 files there:
#   call1.log (everything printed), tests.xml (junit), bench.json (pytest-benchmark), trl1.json, e2e-smollm2.json,
#   e2e-qwen05.json, tune.json (tile sweeps), summary.txt (the tables printed last).
#
#   bash bench/fetch_wheels.sh                       # here, beforehand: datasets, liger-kernel, trl 0.26.2, ...
#   (TRL 1.x in .trl1, as the README's test command installs it; the models' shapes in .gpu-carry, see below)
#   device run: bash bench/gpu_call1.sh   carry: [".whl", ".trl1", ".gpu-carry"]   timeout_s: 585
#
# .gpu-carry/smollm2-shape and .gpu-carry/qwen05-shape hold a config, tokenizer, chat template and
# generation_config (SmolLM2-135M-Instruct's; Qwen2.5-0.5B's config with SmolLM2's tokenizer); the models are built
# there with seeded random weights (e2e_common.smollm2_shaped_dir): same shapes, same work per token.
#
# Knobs (environment): BUDGET (545 s in all), TEST_WORKERS (16), TEST_SECONDS (80), TEST_FILES and TEST_K (the
# kernel test stage's files and pytest -k), BENCH_SECONDS (130), TRL1_SECONDS (35), PROFILE_SECONDS (60),
# GRPO_SECONDS (60 per shape), GRPO_ITERATIONS (6), GRPO_SIDES (fastppo,fastppo-eager,trl), GRPO_SHAPES (smollm2;
# "smollm2 qwen05" for both), GRPO_LENGTH (64), GRPO_SIDE_SECONDS (3600: each side's own limit), E2E_SECONDS (130),
# E2E05_SECONDS (150), UPDATE_BUDGET_SECONDS (45), TUNE_SECONDS (0, per sweep),
# TUNE_TARGETS ("lmhead_backward fused_token_logprobs"),
# BENCH_K (pytest -k for the benches; default leaves out the torch.compile peers, whose compiles alone would fill
# the stage, and the CPU cases), E2E_IMPLS / E2E05_IMPLS (fastppo,trl), E2E_LENGTH (53), TRL1_SHAPES (both V),
# TUNE_FUSED_SHAPE ("4096 4096 128256"). A stage gets what the budget has left, so the later ones may be skipped.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-545}
START=$SECONDS
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false FASTPPO_CACHE=/tmp/fastppo-cache
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
WORK=/tmp/gpu_call1
rm -rf "$WORK" && mkdir -p "$WORK"

# shellcheck source=bench/gpu_stages.sh
source "$(dirname "$0")/gpu_stages.sh"  # left, cap, stage

main() {
  # ------------------------------------------------------------------ a. install, build, environment
  if compgen -G ".whl/*.whl" >/dev/null; then
    stage 60 wheels python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  stage "$(cap 150 300)" build python3 -m pip install --no-build-isolation --no-deps -e .
  ls -la fastppo/_C*.so 2>&1
  echo "=== env"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 - <<'EOF' 2>&1
import importlib.metadata as md, os, platform
import torch, triton, transformers
def show(what, fn):
    try:
        print(what, fn())
    except Exception as err:  # noqa: BLE001 - every line is reported, also after one fails
        print(what, "FAILED:", type(err).__name__, str(err)[:300])
show("python", lambda: f"{platform.python_version()} | torch {torch.__version__} | triton {triton.__version__} | "
     f"transformers {transformers.__version__} | cuda {torch.version.cuda}")
show("device", lambda: f"{torch.cuda.get_device_name(0)} | SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
for m in ("datasets", "liger-kernel", "trl", "pytest", "pytest-xdist", "pytest-timeout", "pytest-benchmark",
          "hypothesis"):
    show(f"  {m}", lambda: md.version(m))
import fastppo, fastppo.kernels as k
from fastppo.kernels import truncate_at_stop, truncate_at_stop_reference
show("extension backend:", k.extension_backend)
show("CUDA kernel registered for fastppo::truncate_at_stop:",
     lambda: torch._C._dispatch_has_kernel_for_dispatch_key("fastppo::truncate_at_stop", "CUDA"))
show("binaries:", lambda: [f for f in os.listdir(os.path.dirname(fastppo.__file__)) if f.startswith("_C")])
def same():
    x = torch.randint(0, 50, (64, 300), device="cuda")
    got, want = truncate_at_stop(x, [3, 7], 0), truncate_at_stop_reference(x, [3, 7], 0)
    return all(torch.equal(a, b) for a, b in zip(got, want))
show("truncate_at_stop on CUDA equals the reference:", same)
EOF
  # Open finding 3 of the first lease (a worker segfault calling the op directly with pad_id < 0, JIT build):
  # does the AOT build crash too? In its own process, with Python's fault handler on.
  echo "=== the op called directly with pad_id -2 (must raise RuntimeError, not crash)"
  timeout 60 python3 -X faulthandler -c "import torch, fastppo.kernels as k; print('backend', k.extension_backend())
try:
    torch.ops.fastppo.truncate_at_stop(torch.ones(2, 3, dtype=torch.long), torch.tensor([1]), -2)
except RuntimeError as e:
    print('raised RuntimeError:', str(e).splitlines()[0])" 2>&1 | tail -25
  echo "=== exit ${PIPESTATUS[0]} (139 = segfault)"
  git rev-parse HEAD 2>&1; git status --short 2>&1 | head -10; date -u

  # ------------------------------------------------------------------ b. kernel tests on CUDA
  # The first lease's three open findings first (fp64 dispatch, the full KL's gradient at large logits, the op
  # called directly), then the rest of the kernel suite with what time is left.
  local xdist=() tmo=()
  python3 -c "import xdist" 2>/dev/null && xdist=(-n "${TEST_WORKERS:-16}")
  python3 -c "import pytest_timeout" 2>/dev/null && tmo=(--timeout 120)
  stage "$(cap 45 400)" tests-findings python3 -m pytest tests/test_fp64_dispatch.py tests/test_masking.py \
    "tests/test_kl.py::test_fused_full_kl_large_magnitude" \
    -q -rfEs "${tmo[@]}" -p no:cacheprovider --junitxml="$WORK/tests-findings.xml"
  local test_k=()
  [ -n "${TEST_K:-}" ] && test_k=(-k "$TEST_K")
  # shellcheck disable=SC2086
  stage "$(cap "${TEST_SECONDS:-80}" 320)" tests python3 -m pytest ${TEST_FILES:-tests/test_lmhead.py \
    tests/test_logprobs.py tests/test_logprobs_options.py tests/test_kl.py tests/test_ppo_loss.py tests/test_gae.py \
    tests/test_stats.py tests/test_policy_loss_options.py tests/test_compile.py tests/test_index_contract.py} \
    "${test_k[@]}" \
    -q -rfEs "${tmo[@]}" "${xdist[@]}" -p no:cacheprovider --junitxml="$OUT/tests.xml"

  # ------------------------------------------------------------------ c. quick kernel benches
  # The headline LM head first, so that a stage cut short loses the least-watched cases.
  stage "$(cap "${BENCH_SECONDS:-130}" 170)" bench python3 -m pytest \
    bench/bench_logprobs.py::test_fused_token_logprobs_gpu bench/bench_ppo_loss.py bench/bench_gae.py \
    bench/bench_masking.py bench/bench_logprobs.py::test_token_logprobs_gpu bench/bench_kl.py --quick \
    -k "${BENCH_K:-not compile and not _cpu}" -q -rs -p no:cacheprovider --benchmark-group-by=group \
    --benchmark-columns=median,iqr,rounds --benchmark-json="$OUT/bench.json"

  # ------------------------------------------------------------------ d. TRL 1.x's chunked LM head, headline shapes
  if [ -d .trl1 ]; then
    # shellcheck disable=SC2086
    PYTHONPATH=$PWD/.trl1:$PYTHONPATH stage "$(cap "${TRL1_SECONDS:-35}" 135)" trl1-lmhead python3 \
      bench/trl1_logprobs.py ${TRL1_SHAPES:---shape 8192 4096 128256 --shape 8192 4096 151936} --dtype bf16 \
      --rounds 5 \
      --json "$OUT/trl1.json" | tee "$WORK/trl1.log"
  fi

  # ------------------------------------------------------------------ e. where the update's GPU time goes
  # The eager sampler: the profiled steps are the update's, and it spares the decode's compile.
  FASTPPO_SMOLLM2_SHAPE=$PWD/.gpu-carry/smollm2-shape stage "$(cap "${PROFILE_SECONDS:-60}" 5)" profile-update \
    python3 bench/profile_update.py --model smollm2 --variant fastppo-eager --rows 25 | tee "$WORK/profile.log"

  # ------------------------------------------------------------------ f. GRPO beside TRL 1.16's GRPOTrainer
  # One stage per model shape (GRPO_SHAPES), each side of it under its own limit (GRPO_SIDE_SECONDS): a side that
  # runs past it is reported and left out, and the others still run.
  if [ -d .trl1 ]; then
    for shape in ${GRPO_SHAPES:-smollm2}; do
      FASTPPO_SMOLLM2_SHAPE=$PWD/.gpu-carry/$shape-shape stage "$(cap "${GRPO_SECONDS:-60}" 5)" "grpo-$shape" \
        python3 bench/grpo_baseline.py --rounds 1 --iterations "${GRPO_ITERATIONS:-6}" --betas 0 \
        --sides "${GRPO_SIDES:-fastppo,fastppo-eager,trl}" --prompts_per_step 8 --num_generations 8 \
        --max_completion_length "${GRPO_LENGTH:-64}" --side_seconds "${GRPO_SIDE_SECONDS:-3600}" \
        --json "$WORK/grpo-$shape.json" | tee -a "$WORK/grpo.log"
    done
  fi

  # ------------------------------------------------------------------ g. end to end beside TRL 0.26, bf16 both
  local e2e=(--model smollm2 --per_device_train_batch_size 16 --gradient_accumulation_steps 1 --num_ppo_epochs 4
    --learning_rate 3e-6 --temperature 0.7 --stop_on_eos true --missing_eos_penalty 1.0 --iterations 2
    --warmup_iterations 1 --threads 0 --local_rollout_forward_batch_size 16 --response_length "${E2E_LENGTH:-53}")
  FASTPPO_SMOLLM2_SHAPE=$PWD/.gpu-carry/smollm2-shape stage "$(cap "${E2E_SECONDS:-130}" 5)" e2e-smollm2 \
    python3 bench/trl_baseline.py "${e2e[@]}" --impl "${E2E_IMPLS:-fastppo,trl}" --json "$OUT/e2e-smollm2.json" \
    | tee "$WORK/e2e-smollm2.log"
  FASTPPO_SMOLLM2_SHAPE=$PWD/.gpu-carry/qwen05-shape stage "$(cap "${E2E05_SECONDS:-150}" 5)" e2e-qwen05 \
    python3 bench/trl_baseline.py "${e2e[@]}" --impl "${E2E05_IMPLS:-fastppo,trl}" --json "$OUT/e2e-qwen05.json" \
    | tee "$WORK/e2e-qwen05.log"

  # ------------------------------------------------------------------ h. token-budget micro-batches (the update alone)
  FASTPPO_SMOLLM2_SHAPE=$PWD/.gpu-carry/smollm2-shape stage "$(cap "${UPDATE_BUDGET_SECONDS:-45}" 5)" \
    update-budget python3 bench/update_budget.py --budgets 0 1024 4096 --rounds 2 --out "$WORK/budget.json" \
    | tee "$WORK/budget.log"

  # ------------------------------------------------------------------ i. tile sweeps (each to its own JSON)
  # TUNE_TARGETS: which sweeps, in order, each given what TUNE_SECONDS and the budget leave (the fused forward
  # at TUNE_FUSED_SHAPE, every other target at its own default shape).
  if [ "${TUNE_SECONDS:-0}" -gt 0 ]; then
    local target shape
    for target in ${TUNE_TARGETS:-lmhead_backward fused_token_logprobs}; do
      shape=()
      # shellcheck disable=SC2206
      [ "$target" = fused_token_logprobs ] && shape=(--shape ${TUNE_FUSED_SHAPE:-4096 4096 128256})
      stage "$(cap "$TUNE_SECONDS" 8)" "tune-$target" python3 bench/tune.py "$target" "${shape[@]}" --repeats 10 \
        --out "$WORK/tune_$target.json"
    done
  fi
}

summary() {
  python3 - "$OUT" "$WORK" <<'EOF'
import glob, json, os, re, sys
import xml.etree.ElementTree as ET

out, work = sys.argv[1], sys.argv[2]
print("\n##### summary")
if os.path.exists(f"{work}/stages"):
    print("stages (name, exit, seconds):", "; ".join(" ".join(l.split()) for l in open(f"{work}/stages")))
# tests
for junit in (f"{work}/tests-findings.xml", f"{out}/tests.xml"):
    try:
        root = ET.parse(junit).getroot()
        cases = list(root.iter("testcase"))
        failed = [(c, e) for c in cases for e in c if e.tag in ("failure", "error")]
        skipped = [c for c in cases if any(e.tag == "skipped" for e in c)]
        print(f"{os.path.basename(junit)}: {len(cases)} cases, "
              f"{len(cases) - len({id(c) for c, _ in failed}) - len(skipped)} passed, "
              f"{len(failed)} failed/errors, {len(skipped)} skipped")
        for c, e in failed:
            msg = (e.get("message") or "").strip().splitlines()
            print(f"  {e.tag.upper()} {c.get('classname')}::{c.get('name')}: {msg[0][:200] if msg else ''}")
    except Exception as err:  # noqa: BLE001
        print(f"{os.path.basename(junit)}: no junit XML:", type(err).__name__, err)
# benches
try:
    data = json.load(open(f"{out}/bench.json"))
    groups = {}
    for b in data["benchmarks"]:
        med = b.get("extra_info", {}).get("median_s") or b["stats"]["median"]
        groups.setdefault(b["group"], []).append((b["name"].split("[")[0] if b["name"].startswith("test_") else
                                                  b["name"], med, b.get("extra_info", {}).get("graph_median_s")))
    print(f"benches: {len(data['benchmarks'])} records")
    print(f"  {'group':<88} {'impl':<36} {'median ms':>10} {'vs ref':>7} {'graph ms':>9}")
    for g, rows in sorted(groups.items()):
        ref = next((m for n, m, _ in rows if n == "reference"), None) or next(
            (m for n, m, _ in rows if n.startswith("reference")), None)
        for n, m, graph in rows:
            print(f"  {g[:88]:<88} {n[:36]:<36} {m * 1e3:>10.3f} {(f'{ref / m:.2f}x' if ref else '-'):>7} "
                  f"{(f'{graph * 1e3:.4f}' if graph else '-'):>9}")
except Exception as err:  # noqa: BLE001
    print("benches: no JSON:", type(err).__name__, err)
# tile sweeps
merged = {}
for path in sorted(glob.glob(f"{work}/tune_*.json")):
    d = json.load(open(path))
    merged.setdefault("env", {k: v for k, v in d.items() if k != "targets"})
    merged.setdefault("targets", {}).update(d["targets"])
if merged:
    json.dump(merged, open(f"{out}/tune.json", "w"), indent=1)
for target, res in merged.get("targets", {}).items():
    timed = sorted((r for r in res["rows"] if "median_s" in r), key=lambda r: r["median_s"])
    default = next((r for r in res["rows"] if r["default"] and "median_s" in r), None)
    if timed:
        best = timed[0]
        print(f"tune {target} {res['passes']} shape={res['shape']}: default {res['default']} "
              f"{default['median_s'] * 1e3 if default else float('nan'):.3f} ms; best {best['tile']} "
              f"{best['median_s'] * 1e3:.3f} ms ({default['median_s'] / best['median_s'] if default else 0:.2f}x); "
              f"{sum('error' in r for r in res['rows'])} of {len(res['rows'])} failed")
# a sweep cut off by its timeout wrote no JSON: its candidates from the log
log = open(f"{out}/call1.log", errors="replace").read() if os.path.exists(f"{out}/call1.log") else ""
for target in os.environ.get("TUNE_TARGETS", "lmhead_backward fused_token_logprobs").split():
    if target not in merged.get("targets", {}):
        rows = re.findall(rf"^  {target} (.+?): ([0-9.]+) ms$", log, flags=re.M)
        if rows:
            best = min(rows, key=lambda r: float(r[1]))
            print(f"tune {target} (cut off, from the log): first {rows[0][0]} {rows[0][1]} ms (the default); "
                  f"best so far {best[0]} {best[1]} ms of {len(rows)} timed")
# TRL 1.x's chunked LM head, and end to end: the tables each script printed
for name, start in (("trl1.log", "device:"), ("e2e-smollm2.log", "config:"), ("e2e-qwen05.log", "config:"),
                    ("profile.log", "steps 2-6"), ("grpo.log", "|"), ("budget.log", "smollm2:")):
    path = f"{work}/{name}"
    if os.path.exists(path):
        text = open(path, errors="replace").read()
        print(f"\n--- {name}")
        print(text[text.find(start):] if start in text else text[-3000:])
EOF
}

main 2>&1 | tee "$OUT/call1.log"
summary 2>&1 | tee "$OUT/summary.txt" | tee -a "$OUT/call1.log"
echo "total $((SECONDS - START))s"
