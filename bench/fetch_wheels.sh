#!/usr/bin/env bash
# Run here (with registry access) before a GPU lease: downloads the wheels the GPU image lacks into
# .whl/ (git-ignored), for its Python 3.12. Carry `.whl` in the device call; gpu_session.sh
# installs them. The image already has accelerate, peft, pytest-benchmark, hypothesis, pyarrow,
# pandas, xxhash, fsspec and huggingface-hub (the device tool's KINDS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl datasets dill multiprocess liger-kernel trl==0.26.2
# TRL 1.16 (the GRPO peer) apart, in .whl/trl1, so that the .whl/*.whl the calls install (TRL 0.26.2 among them)
# never mixes with it: bench/gpu_issue64.sh installs it into a directory of its own (bench/trl_envs.py's FASTPPO_TRL1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl/trl1 trl==1.16.0
ls -la .whl && du -sh .whl
