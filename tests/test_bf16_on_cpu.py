"""``--bf16`` on a machine without CUDA, and legacy TRL's ``mixed_precision="bf16"``: bf16 autocast there, said in
the log."""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastppo import PPOTrainer
from helpers import quick_config

pytestmark = pytest.mark.usefixtures("reference_path")


config = functools.partial(quick_config, total_episodes=8)  # one iteration of 8 episodes


def length_reward(completions, **kw):
    return [float(len(c)) for c in completions]


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA does with --bf16")
def test_bf16_on_a_cpu_is_bf16_autocast_there(tmp_path, model_dir):
    """The example: `--bf16 true` on a CPU was refused with transformers' 'You need to assign use_cpu', while
    docs/performance.md recommends --bf16 on CPUs. It now runs bf16 autocast on the CPU, as use_cpu would, and leaves the
    config as given. Other members: bf16_full_eval, the command line, and --use_cpu given as well."""
    for flags in ({"bf16": True}, {"bf16_full_eval": True}, {"bf16": True, "use_cpu": True}):
        made = config(tmp_path, **flags)
        assert made.device.type == "cpu" and made.use_cpu == flags.get("use_cpu", False)
    trainer = PPOTrainer(args=config(tmp_path, bf16=True), reward_model=length_reward)
    assert trainer.bf16 and trainer.ref_model.dtype == torch.bfloat16  # the frozen reference in bf16 (docs/migrating.md)
    with trainer.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    state = trainer.train()
    assert state.global_step == 1 and all(math.isfinite(v) for k, v in state.log_history[-1].items()
                                          if isinstance(v, float))
    proc = subprocess.run([sys.executable, "-m", "fastppo.train", "--output_dir", str(tmp_path / "cli"), "--bf16",
                           "true", "--total_episodes", "16", "--num_sample_generations", "0"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "use_cpu" not in proc.stderr and (tmp_path / "cli" / "model.safetensors").is_file()


def test_legacy_mixed_precision_bf16_is_bf16_autocast(tmp_path, model_dir):
    """A sibling: legacy TRL asks for bf16 through its Accelerator (accelerator_kwargs={"mixed_precision": "bf16"});
    fastppo's legacy adapter dropped it silently and trained in fp32. It is bf16 autocast now (on a CPU too), and
    fp16 is refused as --fp16 is."""
    from fastppo.errors import SettingsError
    from fastppo.legacy import PPOConfig as LegacyConfig
    from fastppo.legacy import PPOTrainer as LegacyTrainer

    def legacy(**kwargs):
        return LegacyTrainer(LegacyConfig(model_name=model_dir, batch_size=4, mini_batch_size=2,
                                          output_dir=str(tmp_path / "legacy"), **kwargs),
                             AutoModelForCausalLM.from_pretrained(model_dir), None, AutoTokenizer.from_pretrained(model_dir))

    assert legacy(accelerator_kwargs={"mixed_precision": "bf16"}).runtime.bf16
    assert not legacy().runtime.bf16 and not legacy(accelerator_kwargs={"mixed_precision": "no"}).runtime.bf16
    with pytest.raises(SettingsError, match="mixed_precision='fp16'.*use 'bf16'"):
        legacy(accelerator_kwargs={"mixed_precision": "fp16"})
