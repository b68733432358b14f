"""TRL's ``ScriptArguments`` and ``ModelConfig`` (same names, defaults and meanings): the dataset and model flags a
script parses beside ``PPOConfig`` (``HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))``, as TRL's
``ppo.py``); the trainer takes a ``ModelConfig`` too. ``fastppo.cli`` exports them under TRL's names."""
from __future__ import annotations

from dataclasses import dataclass, field

from fastppo.errors import SettingsError



@dataclass
class ScriptArguments:
    """The dataset flags of TRL's scripts (``trl.ScriptArguments``: same names, defaults and meanings)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Prompt dataset: a Hub name or a local file/directory (jsonl, json, parquet, arrow, csv, or "
                  "a save_to_disk directory). Unset: fastppo's built-in prompt set."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Dataset configuration name (load_dataset's name=)."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    dataset_test_split: str = field(
        default="test",
        metadata={"help": "Split the sample tables are drawn from (eval_dataset), when the dataset has it."},
    )
    dataset_streaming: bool = field(
        default=False, metadata={"help": "Stream the dataset (not supported by PPO's prompt sampler: refused)."}
    )
    gradient_checkpointing_use_reentrant: bool = field(
        default=False, metadata={"help": "use_reentrant of gradient checkpointing (TRL 0.26)."}
    )
    ignore_bias_buffers: bool = field(
        default=False, metadata={"help": "TRL's DDP workaround for bool buffers (no effect in fastppo)."}
    )


@dataclass
class ModelConfig:
    """How the models load (``trl.ModelConfig``: same names, defaults and meanings)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The tokenizer, and the policy unless --sft_model_path names another: a local directory or "
                  "a Hub id. Unset (and no --sft_model_path): fastppo's embedded tiny model."},
    )
    model_revision: str = field(default="main", metadata={"help": "Model revision (branch, tag or commit)."})
    dtype: str | None = field(
        default=None,
        metadata={"help": "Load every model's weights in this dtype. Unset: fp32 for the trained models and, under "
                  "bf16, bf16 for the frozen reference and reward models.",
                  "choices": ["auto", "bfloat16", "float16", "float32"]},
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow models with their own modeling code."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention implementation: sdpa (unset), eager or flash_attention_2."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters on the policy."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt (default: peft's choice for the architecture)."}
    )
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "LoRA on parameters (not supported: refused)."}
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules to train fully beside the adapters (not supported: refused)."}
    )
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "PEFT task type (PPO's policy: CAUSAL_LM)."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA."})
    use_dora: bool = field(default=False, metadata={"help": "DoRA (not supported: refused)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "8-bit weights (not supported: refused)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "4-bit weights (not supported: refused)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit quantisation type.",
                                                              "choices": ["fp4", "nf4"]})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Nested 4-bit quantisation."})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "4-bit storage dtype."})
    torch_dtype: str | None = field(default=None, metadata={"help": "Older name of --dtype."})

    def __post_init__(self):
        if self.torch_dtype and not self.dtype:
            self.dtype = self.torch_dtype
        if self.load_in_8bit and self.load_in_4bit:
            raise SettingsError("load_in_8bit and load_in_4bit are exclusive; set one")
