"""Models: loading the policy, reference, value and reward models; the actor-critic forward the
scoring and training passes share; the legacy value head on the policy's own trunk.

Every log-prob comes from the decoder's last hidden state and the LM-head weight through
``fused_token_logprobs``: the ``[tokens, vocab]`` logits never exist, and the scoring and the
training forward run the same module on the same layout (so the first PPO ratio is exactly 1).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import inspect
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          PreTrainedModel)
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.utils import cached_file, is_peft_available

from fastppo.errors import LoadError, SettingsError, SettingsTypeError
from fastppo.kernels import PPOPolicyLossOutput, fused_ppo_policy_loss, fused_token_logprobs

VALUE_HEAD_PREFIX = "v_head."
VALUE_HEAD_FILE = "v_head.safetensors"  # where a PEFT policy's value head goes (the weights file holds the adapter)
LM_PREFIX = "pretrained_model."  # the wrapper's LM as nn.Module names it; legacy TRL's state dicts leave it out

# Where a saved head may be, searched in this order: fastppo's file beside a PEFT adapter, the LM's own
# weights (legacy TRL and fastppo write v_head.* into them), then the shards an index maps v_head.* to.
HEAD_FILES = (VALUE_HEAD_FILE, "model.safetensors", "pytorch_model.bin")
HEAD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# from_pretrained's arguments that say where a checkpoint is: they also locate its head and adapter files
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
V_HEAD_INIT_STRATEGIES = (None, "normal")
# legacy TRL's layer names for num_shared_layers, tried in this order (GPT-2/J, OPT, GPT-NeoX, Llama-likes)
LAYER_PATTERNS = ("transformer.h.{layer}", "model.decoder.layers.{layer}", "gpt_neox.layers.{layer}",
                  "model.layers.{layer}")


# ============================================================================ the value head on the trunk (legacy TRL)


class ValueHead(nn.Module):
    """A scalar per position from the trunk's last hidden state (legacy TRL's ``v_head``: ``summary``
    is Linear(hidden, 1) in fp32; its dropout is zeroed like every dropout in PPO training)."""

    def __init__(self, hidden_size: int, dropout: float | None = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.summary = nn.Linear(hidden_size, 1, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(self.dropout(hidden).to(self.summary.weight.dtype)).squeeze(-1)


def _hidden_size(config) -> int:
    # OPT-350m projects its hidden states down to word_embed_proj_dim before the LM head
    return getattr(config, "word_embed_proj_dim", None) or config.hidden_size


def _summary_dropout(config, kwargs: dict) -> float | None:
    """Legacy TRL's rule: the LM config's ``summary_dropout_prob`` wherever the config has one (even None),
    else the keyword argument, else 0.1."""
    if hasattr(config, "summary_dropout_prob"):
        return config.summary_dropout_prob
    return kwargs.get("summary_dropout_prob", 0.1)


def has_lm_head(model: nn.Module) -> bool:
    names = AutoModelForCausalLMWithValueHead.lm_head_namings
    if any(hasattr(model, name) for name in names):
        return True
    get_head = getattr(model, "get_output_embeddings", None)  # an LM head under another name
    return get_head is not None and get_head() is not None


def _is_supported_model(obj) -> bool:
    """A transformers model, or a PEFT model around one (legacy TRL takes exactly these)."""
    base = obj.get_base_model() if isinstance(obj, nn.Module) and hasattr(obj, "get_base_model") else obj
    return isinstance(base, PreTrainedModel)


def _check_device_map(model: nn.Module) -> bool:
    """True when the LM is spread by a ``device_map`` (legacy TRL's ``is_sequential_parallel``); offloading
    to the CPU or disk is refused as legacy TRL refuses it (the head would run where no weights are)."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map is None:
        return False
    places = {str(d) for d in device_map.values()}
    if "disk" in places or ("cpu" in places and len(places) > 1):
        raise SettingsError("the model is offloaded to the CPU or disk (hf_device_map: "
                         f"{sorted(places)}): offloading is not supported for value-head models")
    return True


def _current_device() -> int | str:
    # legacy TRL's: this process's local GPU index, or "cpu"
    return int(os.environ.get("LOCAL_RANK", "0")) if torch.cuda.is_available() else "cpu"


def _legacy_layout(state: dict) -> dict:
    """A wrapper state dict in legacy TRL's layout (the LM's own keys, ``v_head.*``) whichever layout it
    came in (nn.Module's ``pretrained_model.*`` is accepted too)."""
    return {k.removeprefix(LM_PREFIX): v for k, v in state.items()}


class AutoModelForCausalLMWithValueHead(nn.Module):
    """A causal LM with a value head on its own trunk: one network, one forward for log-probs and values.

    Legacy TRL's (<= 0.11) class of the same name, with its checkpoint format: ``state_dict()`` is the
    LM's state dict plus ``v_head.summary.weight``/``bias``, and ``save_pretrained`` writes exactly that
    (plain transformers loads the directory as the LM and ignores the head); ``from_pretrained`` reads a
    head back from ``model.safetensors``, ``pytorch_model.bin``, their sharded indexes or, beside a PEFT
    adapter, ``v_head.safetensors``.
    """

    transformers_parent_class = AutoModelForCausalLM
    lm_head_namings = ["lm_head", "embed_out", "output_layer"]  # a list, as legacy TRL's: code extends it
    supported_args = ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")

    def __init__(self, pretrained_model: nn.Module, **kwargs):
        """``kwargs``: the value head's (``supported_args``)."""
        super().__init__()
        unknown = sorted(set(kwargs) - set(self.supported_args))
        if unknown:
            raise SettingsTypeError(f"AutoModelForCausalLMWithValueHead got unexpected keyword arguments {unknown}; the "
                            f"value head takes {list(self.supported_args)}")
        if not has_lm_head(pretrained_model):
            raise SettingsError(f"{type(pretrained_model).__name__} does not have a language model head (none of "
                             f"{self.lm_head_namings}): wrap a causal LM (AutoModelForCausalLM), not a bare "
                             "base model (AutoModel)")
        self.pretrained_model = pretrained_model
        self.v_head = ValueHead(_hidden_size(pretrained_model.config),
                                _summary_dropout(pretrained_model.config, kwargs))
        self._init_weights(**kwargs)
        self.is_sequential_parallel = _check_device_map(pretrained_model)
        self.v_head.to(next(pretrained_model.parameters()).device)
        self.current_device = _current_device()
        self.is_loaded_in_8bit = getattr(pretrained_model, "is_loaded_in_8bit", False)
        self.is_loaded_in_4bit = getattr(pretrained_model, "is_loaded_in_4bit", False)
        self.supports_rm_adapter = False  # from_pretrained(reward_adapter=...) sets these and ``score``
        self.rm_adapter_name = None
        self.policy_adapter_name = "default"

    def _init_weights(self, **kwargs) -> None:
        """``v_head_init_strategy``: None keeps nn.Linear's random init; "normal" draws the weight from
        N(0, ``v_head_initializer_range`` (0.2)) and zeroes the bias."""
        strategy = kwargs.get("v_head_init_strategy")
        if strategy not in V_HEAD_INIT_STRATEGIES:
            raise SettingsError(f"v_head_init_strategy={strategy!r}: expected one of {list(V_HEAD_INIT_STRATEGIES)}")
        if strategy == "normal":
            with torch.no_grad():
                self.v_head.summary.weight.normal_(mean=0.0, std=kwargs.get("v_head_initializer_range", 0.2))
                self.v_head.summary.bias.zero_()

    @property
    def config(self):
        return self.pretrained_model.config

    @property
    def is_peft_model(self) -> bool:
        return hasattr(self.pretrained_model, "disable_adapter")

    @classmethod
    def _split_kwargs(cls, kwargs: dict) -> tuple[dict, dict]:
        """(the value head's kwargs, the rest: transformers' from_pretrained's)."""
        head = {k: v for k, v in kwargs.items() if k in cls.supported_args}
        return head, {k: v for k, v in kwargs.items() if k not in cls.supported_args}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> AutoModelForCausalLMWithValueHead:
        """From a directory or Hub id (a saved ``v_head`` is loaded back; a PEFT adapter directory loads its
        base and the adapter, trainable only with ``is_trainable=True``) or from a transformers model.

        ``kwargs``: the value head's (``supported_args``); ``peft_config`` (a new adapter on the LM);
        ``is_trainable``; ``reward_adapter`` (a PEFT reward model's adapter, loaded frozen beside the policy's
        on a PEFT model, for ``compute_reward_score``) and ``reward_adapter_name``; the rest go to
        transformers' ``from_pretrained`` (``torch_dtype`` is read as ``dtype``)."""
        peft_config = kwargs.pop("peft_config", None)
        is_trainable = kwargs.pop("is_trainable", False)
        reward_adapter = kwargs.pop("reward_adapter", None)
        reward_adapter_name = kwargs.pop("reward_adapter_name", "reward_adapter")
        if reward_adapter is not None and not isinstance(reward_adapter, str):
            raise SettingsError("reward_adapter should be a local path or Hub id of a reward-modeling adapter, but is "
                             f"{type(reward_adapter).__name__}")
        _check_peft_config(peft_config)
        head_kwargs, lm_kwargs = cls._split_kwargs(kwargs)
        if "torch_dtype" in lm_kwargs and "dtype" not in lm_kwargs:
            lm_kwargs["dtype"] = lm_kwargs.pop("torch_dtype")  # transformers' new name for it
        source = pretrained_model_name_or_path
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        if isinstance(source, str):
            lm, head_state = cls._load_lm(source, model_args, lm_kwargs, is_trainable, peft_config), None
        elif _is_supported_model(source):
            if lm_kwargs or model_args:
                warnings.warn(f"from_pretrained: {sorted(lm_kwargs) or 'positional arguments'} ignored: they are "
                              "for loading, and a model object is already loaded", stacklevel=2)
            lm, head_state = source, source.state_dict()  # a head attached to it is read back, as legacy TRL
        else:
            raise SettingsError("pretrained_model_name_or_path should be a path, a Hub id or a transformers "
                             f"PreTrainedModel (or a PEFT model around one), but is {type(source).__name__}")
        if peft_config is not None and not hasattr(lm, "disable_adapter"):
            lm = _get_peft_model(lm, peft_config)
        _check_not_prompt_learning(lm)
        model = cls(lm, **head_kwargs)
        if reward_adapter is not None:
            model._add_reward_adapter(reward_adapter, reward_adapter_name, lm_kwargs.get("token"))
        if head_state is None:
            head_state = read_value_head(source, prefixed=True, **_hub_kwargs(lm_kwargs))
        if head_state:
            model.post_init(head_state)
        return model

    def _add_reward_adapter(self, adapter: str, name: str, token) -> None:
        """Legacy TRL's reward adapter: a PEFT sequence-classification adapter loaded frozen beside the policy's
        on the same base, with its score head as ``self.score`` (frozen, in the LM's dtype)."""
        if not self.is_peft_model:
            raise SettingsError("reward_adapter can only be used with a PEFT model: pass peft_config, or a PeftModel")
        self.pretrained_model.load_adapter(adapter, name, is_trainable=False)
        self.pretrained_model.train()
        weight, bias = _score_head(adapter, token)
        lm_param = next(self.pretrained_model.parameters())
        self.score = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        self.score.to(device=lm_param.device, dtype=getattr(self.pretrained_model, "dtype", lm_param.dtype))
        self.score.load_state_dict({"weight": weight} if bias is None else {"weight": weight, "bias": bias})
        self.score.requires_grad_(False)
        self.supports_rm_adapter, self.rm_adapter_name = True, name

    def compute_reward_score(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        """[B, L, num_labels] scores of the reward adapter (legacy TRL's): the reward adapter on, the
        ``score`` head on the last hidden states, then the policy's adapter back on (the LM is left in eval
        mode, as legacy TRL leaves it)."""
        if not self.supports_rm_adapter:
            raise SettingsError("this model has no reward adapter: load it with from_pretrained(..., reward_adapter=)")
        self.pretrained_model.set_adapter(self.rm_adapter_name)
        self.pretrained_model.eval()
        try:
            with torch.no_grad():
                out = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask,
                                            output_hidden_states=True, return_dict=True, **kwargs)
                scores = self.score(out.hidden_states[-1].to(self.score.weight.dtype))
        finally:
            self.pretrained_model.set_adapter(self.policy_adapter_name)
            self.pretrained_model.eval()
        return scores

    @classmethod
    def _load_lm(cls, path: str, model_args, lm_kwargs: dict, is_trainable: bool, peft_config) -> nn.Module:
        """The LM at ``path``; a PEFT adapter directory: its base model with the adapter on it (legacy TRL's)."""
        adapter_config = _resolve(path, "adapter_config.json", _hub_kwargs(lm_kwargs)) if is_peft_available() else None
        if adapter_config is None:
            return cls.transformers_parent_class.from_pretrained(path, *model_args, **lm_kwargs)
        from peft import PeftConfig, PeftModel  # optional dependency: imported only where an adapter is

        if peft_config is not None:
            warnings.warn(f"peft_config ignored: {path!r} holds a trained adapter, which is loaded", stacklevel=3)
        base_path = PeftConfig.from_pretrained(os.path.dirname(adapter_config)).base_model_name_or_path
        base = cls.transformers_parent_class.from_pretrained(base_path, *model_args, **lm_kwargs)
        return PeftModel.from_pretrained(base, path, is_trainable=is_trainable, token=lm_kwargs.get("token"))

    def post_init(self, state_dict: dict) -> None:
        """Loads the ``v_head.*`` entries of a whole-model state dict into the head (legacy TRL's; the
        other entries are ignored, and so is a head missing from it)."""
        head = {k[len(VALUE_HEAD_PREFIX):]: v for k, v in state_dict.items() if k.startswith(VALUE_HEAD_PREFIX)}
        if head:
            self.v_head.load_state_dict(head, strict=False)

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, return_past_key_values=False,
                **kwargs):
        """(lm_logits fp32, loss, value [B, L] fp32), and the past key values with ``return_past_key_values``:
        legacy TRL's outputs, in its argument order."""
        kwargs["output_hidden_states"] = True
        if past_key_values is not None and not self._prefix_tuning():  # prefix tuning supplies its own
            kwargs[cache_keyword(self.pretrained_model)] = past_key_values  # the installed transformers' name
        out = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        device = self.v_head.summary.weight.device
        value = self.v_head(out.hidden_states[-1].to(device))
        logits, loss = out.logits.float(), out.loss
        if self.is_sequential_parallel:  # legacy TRL returns everything on the head's device under a device_map
            logits, loss = logits.to(device), None if loss is None else loss.to(device)
        return (logits, loss, value, cache_of(out)) if return_past_key_values else (logits, loss, value)

    def _prefix_tuning(self) -> bool:
        config = getattr(self.pretrained_model, "active_peft_config", None) if self.is_peft_model else None
        return getattr(config, "peft_type", None) == "PREFIX_TUNING"

    def generate(self, *args, **kwargs):
        return self.pretrained_model.generate(*args, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        enable_checkpointing(causal_lm_of(self), gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        causal_lm_of(self).gradient_checkpointing_disable()

    def enable_input_require_grads(self):
        self.pretrained_model.enable_input_require_grads()

    # --------------------------------------------------------------- state dicts: legacy TRL's layout

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        """The LM's state dict (its own key names) plus ``v_head.summary.weight``/``bias``: legacy TRL's layout,
        also as a submodule (the wrapper's ``pretrained_model.`` is dropped under any prefix). Unlike legacy
        TRL, a PEFT model's entries are kept: they are what load_state_dict and DeepSpeed restore."""
        state = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        inner = prefix + LM_PREFIX
        for key in [k for k in state if k.startswith(prefix)]:  # this module's entries (the dict's tail): renamed
            state[prefix + key[len(inner):] if key.startswith(inner) else key] = state.pop(key)
        return state

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # legacy TRL's layout (and nn.Module's, ``pretrained_model.*``) loads: a key that names none of this
        # wrapper's own modules (v_head, score) is the LM's, and gets its module name back
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if key[len(prefix):].split(".", 1)[0] not in self._modules:
                state_dict[prefix + LM_PREFIX + key[len(prefix):]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # --------------------------------------------------------------- saving

    def save_pretrained(self, save_directory: str, state_dict: dict | None = None, **kwargs) -> None:
        """The LM's files with ``v_head.*`` in its weights (legacy TRL's layout), or a PEFT adapter with
        ``v_head.safetensors`` beside it. ``kwargs`` go to the LM's ``save_pretrained`` (``max_shard_size``...).
        ``state_dict``: this wrapper's whole state (either layout) to write instead of the modules' own
        tensors (DeepSpeed ZeRO-3 gathers it: the modules then hold partitions)."""
        state = _legacy_layout(self.state_dict() if state_dict is None else state_dict)
        head = {k: v.detach().contiguous() for k, v in state.items() if k.startswith(VALUE_HEAD_PREFIX)}
        if not self.is_peft_model:
            self.pretrained_model.save_pretrained(save_directory, state_dict=state, **kwargs)
            return
        adapter = None if state_dict is None else {k: v for k, v in state.items() if k not in head}
        self.pretrained_model.save_pretrained(save_directory, **({} if adapter is None else {"state_dict": adapter}),
                                              **kwargs)
        if kwargs.get("is_main_process", True):
            save_file(head, os.path.join(save_directory, VALUE_HEAD_FILE))

    def push_to_hub(self, *args, **kwargs):
        raise NotImplementedError("AutoModelForCausalLMWithValueHead.push_to_hub is not supported: call "
                                  "save_pretrained(directory) and upload that directory (huggingface_hub's "
                                  "upload_folder, or `hf upload`); from_pretrained reads the head back from it")


def _score_head(adapter: str, token) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias or None) of the ``score`` head saved with a reward-modeling adapter."""
    for name in ("adapter_model.bin", "adapter_model.safetensors"):
        file = _resolve(adapter, name, {"token": token})
        if file is not None:
            break
    else:
        raise SettingsError(f"reward_adapter: no adapter_model.bin or adapter_model.safetensors in {adapter!r}")
    state = load_file(file) if file.endswith(".safetensors") else torch.load(file, map_location="cpu",
                                                                              weights_only=True)
    score = {k.rsplit(".", 1)[-1]: v for k, v in state.items() if "score" in k}
    if "weight" not in score:
        raise SettingsError(f"reward_adapter: the adapter in {adapter!r} holds no score head (a SEQ_CLS adapter saves "
                         "one)")
    return score["weight"], score.get("bias")


def _check_peft_config(peft_config) -> None:
    if peft_config is None:
        return
    if not is_peft_available():
        raise SettingsError("peft_config: the peft package is not installed (pip install peft)")
    from peft import PeftConfig  # optional dependency: imported only when asked for

    if not isinstance(peft_config, PeftConfig):  # ValueError, as legacy TRL raises (callers catch it)
        raise SettingsError(f"peft_config should be a peft.PeftConfig, but is {type(peft_config).__name__}")


def _get_peft_model(model: nn.Module, peft_config) -> nn.Module:
    from peft import get_peft_model  # optional dependency: _check_peft_config saw it installed

    return get_peft_model(model, peft_config)


def _check_not_prompt_learning(model: nn.Module) -> None:
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        raise SettingsError(f"peft_config: {type(config).__name__} (prompt learning) is not supported for PPO training")


def _hub_kwargs(lm_kwargs: dict) -> dict:
    return {k: v for k, v in lm_kwargs.items() if k in HUB_KWARGS}


def _resolve(path: str, filename: str, hub_kwargs: dict) -> str | None:
    """The local file ``filename`` of a checkpoint directory or Hub repo (downloaded, or from the cache),
    or None where it has none."""
    try:
        return cached_file(path, filename, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **hub_kwargs)
    except (OSError, ValueError):  # no such repo or an id that is not one: no head there (legacy TRL's reading)
        return None


def _head_tensors(file: str) -> dict[str, torch.Tensor]:
    """The ``v_head.*`` tensors of one weights file, reading no other tensor from it."""
    if file.endswith(".safetensors"):
        with safe_open(file, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith(VALUE_HEAD_PREFIX)}
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a pre-zip-format pickle cannot be memory-mapped
        state = torch.load(file, map_location="cpu", weights_only=True)
    return {k: v for k, v in state.items() if k.startswith(VALUE_HEAD_PREFIX)}


def _sharded_head(path: str, index: str, hub_kwargs: dict) -> dict[str, torch.Tensor]:
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    head = {}
    for shard in sorted({file for key, file in weight_map.items() if key.startswith(VALUE_HEAD_PREFIX)}):
        file = _resolve(path, shard, hub_kwargs)
        head.update(_head_tensors(file) if file else {})
    return head


def read_value_head(path: str, prefixed: bool = False, **hub_kwargs) -> dict[str, torch.Tensor] | None:
    """The ``v_head.*`` tensors of a saved checkpoint (a directory, or a Hub id as transformers resolves it;
    ``hub_kwargs``: ``revision``, ``cache_dir``, ``local_files_only``...), with the prefix removed unless
    ``prefixed``; None when it has none."""
    head = {}
    for name in HEAD_FILES:
        file = _resolve(path, name, hub_kwargs)
        head = _head_tensors(file) if file else {}
        if head:
            break
    for index in HEAD_INDEXES if not head else ():
        file = _resolve(path, index, hub_kwargs)
        head = _sharded_head(path, file, hub_kwargs) if file else {}
        if head:
            break
    if not head:
        return None
    return head if prefixed else {k[len(VALUE_HEAD_PREFIX):]: v for k, v in head.items()}


def create_reference_model(model: nn.Module, num_shared_layers: int | None = None,
                           pattern: str | None = None) -> nn.Module:
    """A frozen copy of ``model`` (legacy TRL's ``create_reference_model``): a deep copy in eval mode whose
    every parameter has requires_grad=False.

    ``num_shared_layers``: the parameters before that layer (the embeddings and layers 0..n-1) are "shared"
    in legacy TRL's sense: frozen in ``model`` too, so they stay equal to the reference's copies. As in
    legacy TRL the copy is whole (it holds its own tensors): tying them would let a dtype or device move of
    either model (DeepSpeed's bf16 cast, say) silently change the other. ``pattern``: the layer's name
    with a ``{layer}`` placeholder (e.g. "transformer.h.{layer}") where the built-in ones do not fit.
    """
    if is_deepspeed_zero3_enabled():
        raise SettingsError("DeepSpeed ZeRO-3 is enabled, and create_reference_model cannot copy partitioned "
                         "parameters: load the reference model with from_pretrained instead")
    shared = [] if num_shared_layers is None else _shared_parameter_names(model, num_shared_layers, pattern)
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    for name in shared:
        model.get_parameter(name).requires_grad_(False)
    return ref.eval()


def _shared_parameter_names(model: nn.Module, num_shared_layers: int, pattern: str | None) -> list[str]:
    """The names of ``model``'s parameters before layer ``num_shared_layers`` (legacy TRL's split: every
    parameter registered before the first whose name contains the layer's pattern)."""
    names = [n for n, _ in model.named_parameters()]
    candidates = [pattern] if pattern is not None else LAYER_PATTERNS
    markers = [c.format(layer=num_shared_layers) for c in candidates]
    first = next((i for marker in markers for i, name in enumerate(names) if marker in name), None)
    if first is not None:
        return names[:first]
    if pattern is not None:  # legacy TRL warns and freezes the whole model here, leaving nothing to train
        raise SettingsError(f"pattern={pattern!r}: no parameter name contains {markers[0]!r} "
                         f"(num_shared_layers={num_shared_layers}); check it for a typo")
    raise SettingsError(f"num_shared_layers={num_shared_layers}: layer pattern could not be matched: no parameter "
                     f"name contains any of {markers} (the model has fewer layers, or names them otherwise: "
                     "pass pattern=, e.g. 'transformer.h.{layer}')")


# ============================================================================ the pieces of a causal LM


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers CausalLM inside a value-head wrapper and/or a PEFT wrapper (LoRA stays active)."""
    if isinstance(model, AutoModelForCausalLMWithValueHead):
        model = model.pretrained_model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cache_keyword(model: nn.Module) -> str:
    """The keyword the model's forward takes its KV cache under: ``cache`` (transformers 5.2x on, where
    ``past_key_values`` warns that it goes in 5.40) or ``past_key_values`` (earlier transformers, such as 5.17, and
    models whose own code still names it so). Read from the causal LM's forward signature, once per class."""
    return _cache_keyword(type(causal_lm_of(model)))


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        params = {}
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    # a forward of **kwargs only: the name the installed transformers' own models take
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def cache_of(output):
    """The KV cache a forward returned (``cache`` from transformers 5.2x on, ``past_key_values`` before)."""
    for name in ("cache", "past_key_values"):
        if name in output:
            return output[name]
    return None


def lm_of(model: nn.Module) -> nn.Module:
    """The language model to generate with (PEFT wrapper kept), without a value-head wrapper."""
    return model.pretrained_model if isinstance(model, AutoModelForCausalLMWithValueHead) else model


def lm_head_of(model: nn.Module) -> nn.Module:
    head = causal_lm_of(model).get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise SettingsError(f"{type(model).__name__} has no linear output embedding (LM head)")
    return head


def backbone_and_head(seq_cls_model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Body and scalar head of an AutoModelForSequenceClassification (value or reward model)."""
    backbone = getattr(seq_cls_model, seq_cls_model.base_model_prefix, None)
    head = getattr(seq_cls_model, "score", None) or getattr(seq_cls_model, "classifier", None)
    if backbone is None or head is None:
        raise SettingsError(f"{type(seq_cls_model).__name__}: cannot find its body and 'score' head")
    return backbone, head


def gathered(*params):
    """A context in which ``params`` are whole, for reading weights directly outside their module's forward.

    Only DeepSpeed ZeRO-3 parameters that are partitioned right now are all-gathered (every process must
    enter the context) and released at its end; anything else (plain tensors, ZeRO-2, parameters an
    enclosing forward already gathered) makes it a no-op. Never around a training forward: releasing a
    weight autograd saved breaks the backward (ZeRO-3 gathers those through its external parameters)."""
    missing = [p for p in params if p is not None and getattr(p, "ds_status", None) is not None
               and p.ds_status.name != "AVAILABLE"]
    if not missing:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(missing, modifier_rank=None)


def token_logprobs_from_hidden(model, hidden, targets, temperature: float, return_entropy: bool):
    head = lm_head_of(model)
    bias = getattr(head, "bias", None)
    with gathered(head.weight, bias):  # the reference's head under ZeRO-3; a no-op otherwise
        return fused_token_logprobs(
            hidden,
            head.weight.to(hidden.dtype),
            targets,
            temperature,
            bias=None if bias is None else bias.to(hidden.dtype),
            return_entropy=return_entropy,
            ignore_index=None,  # the layout gathers real response tokens only: nothing to mask, no extra pass
        )


# ============================================================================ batch layouts: no compute on padding


@dataclass(frozen=True)
class Layout:
    """How ``b`` rows of a rollout go through a decoder, and where the outputs land.

    The decoder runs on ``input_ids`` [R, L]: the rows with their all-padding columns cut (R = b), or,
    packed (``padding_free``), their real tokens in one sequence (R = 1) whose positions restart at
    every row. Only the hidden states that predict real response tokens are kept (``gather``, flat
    indices into R·L), so the LM head, the value head and every per-token op run on real tokens only;
    ``scatter`` lays their [n] results out as the [b, T] response grid (0 elsewhere).
    """

    input_ids: torch.Tensor  # [R, L]
    attention_mask: torch.Tensor | None  # [R, L]; None when packed (transformers reads the segments off positions)
    position_ids: torch.Tensor  # [R, L]
    gather: torch.Tensor  # [n] hidden states predicting real response tokens
    targets: torch.Tensor  # [n] the response tokens they predict
    rows: torch.Tensor  # [n] where each lands in the [b, T] output
    cols: torch.Tensor  # [n]
    last: torch.Tensor  # [b] each row's last real token (a reward model reads it)
    shape: tuple[int, int]  # (b, T)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(self.shape)
        return out.index_put_((self.rows, self.cols), values)

    def pick(self, grid: torch.Tensor) -> torch.Tensor:
        """The [n] entries of a [b, T] grid at this layout's real response tokens."""
        return grid[self.rows, self.cols]


def make_layout(query_responses: torch.Tensor, context_length: int, query_lengths: list[int],
                response_lengths: list[int], packed: bool) -> Layout:
    """The layout of the given rows (``query_responses`` [b, C + T], left-padded queries, right-padded
    responses) from their real lengths, known on the host: the index tensors are built there and
    copied once, so no step of the update waits on the device."""
    b, width = query_responses.shape
    t = width - context_length
    device = query_responses.device
    flat, positions, gather, rows, cols, last = [], [], [], [], [], []
    if packed:
        offset = 0
        for i, (ql, rl) in enumerate(zip(query_lengths, response_lengths)):
            start = i * width + context_length - ql
            flat.append(torch.arange(start, start + ql + rl))
            positions.append(torch.arange(ql + rl))
            gather.append(torch.arange(offset + ql - 1, offset + ql - 1 + rl))
            last.append(offset + ql + rl - 1)
            offset += ql + rl
        index = torch.cat(flat).to(device, non_blocking=True)
        input_ids = query_responses.reshape(-1).index_select(0, index)[None]
        attention_mask = None
        position_ids = torch.cat(positions)[None].to(device, non_blocking=True)
    else:
        lq, lr = max(query_lengths), max(response_lengths)
        columns = slice(context_length - lq, context_length + lr)
        real = torch.zeros(b, lq + lr, dtype=torch.long)
        for i, (ql, rl) in enumerate(zip(query_lengths, response_lengths)):
            real[i, lq - ql : lq + rl] = 1
            gather.append(torch.arange(i * (lq + lr) + lq - 1, i * (lq + lr) + lq - 1 + rl))
            last.append(i * (lq + lr) + lq + rl - 1)
        attention_mask = real.to(device, non_blocking=True)
        # padding is never attended; it is fed as id 0 (as TRL does), so a pad id past the embedding is harmless
        input_ids = query_responses[:, columns] * attention_mask
        position_ids = (real.cumsum(1) - 1).clamp(min=0).to(device, non_blocking=True)
    for i, rl in enumerate(response_lengths):
        rows.append(torch.full((rl,), i))
        cols.append(torch.arange(rl))
    rows_t, cols_t = torch.cat(rows).to(device), torch.cat(cols).to(device)
    targets = query_responses[rows_t, context_length + cols_t]
    return Layout(input_ids, attention_mask, position_ids, torch.cat(gather).to(device), targets, rows_t, cols_t,
                  torch.tensor(last, device=device), (b, t))


def decoder_hidden(model: nn.Module, layout: Layout) -> torch.Tensor:
    """[R·L, H] last hidden states of the decoder body (the LM head never runs here)."""
    decoder = causal_lm_of(model).get_decoder()
    hidden = decoder(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                     position_ids=layout.position_ids, use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


# ============================================================================ the two forwards of PPO


class ActorCriticOutput(NamedTuple):
    """``PolicyAndValue.forward``'s output: [b, T] grids, 0 off the real response tokens."""

    logprobs: torch.Tensor  # log π(y_t) (with the fused loss: its values, the gradient being in policy_loss.loss)
    entropy: torch.Tensor | None  # H of π(·|s_t), when asked for (always with the fused loss)
    values: torch.Tensor | None  # V(s_t), fp32 (None without a critic)
    hidden: torch.Tensor | None  # [n, H] the last hidden states of the real response tokens, when asked for
    policy_loss: PPOPolicyLossOutput | None  # fused_ppo_policy_loss's output, when it ran


class PolicyAndValue(nn.Module):
    """What DDP wraps: one forward gives the policy's log-probs (and entropy) of the real response
    tokens and the value of every response state, so every trained parameter, the LM head included,
    is used inside ``forward`` and DDP syncs all their gradients.

    ``value_model=None``: the policy is an ``AutoModelForCausalLMWithValueHead`` and the values come
    from its ``v_head`` on the same hidden states as the log-probs (one trunk, one forward).
    ``policy_loss`` (a dict of ``fused_ppo_policy_loss``'s arguments as [b, T] grids) runs the fused loss
    from the hidden states; its output comes back beside the grids (``ActorCriticOutput``).
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module | None, critic: bool = True):
        super().__init__()
        if critic and value_model is None and not isinstance(policy, AutoModelForCausalLMWithValueHead):
            raise ValueError("without a value model the policy must be an AutoModelForCausalLMWithValueHead")
        self.policy = policy
        self.value_model = value_model
        self.critic = critic  # False: critic-free estimators; no value is computed (values come back None)

    def forward(self, layout: Layout, temperature: float, return_entropy: bool = False, return_hidden: bool = False,
                policy_loss: dict | None = None) -> ActorCriticOutput:
        hidden = decoder_hidden(self.policy, layout).index_select(0, layout.gather)  # [n, H]
        fused = None
        if policy_loss is None:
            out = token_logprobs_from_hidden(self.policy, hidden, layout.targets, temperature, return_entropy)
            logprobs, entropy = out if return_entropy else (out, None)
        else:
            fused = fused_policy_loss(self.policy, hidden, layout, temperature, **policy_loss)
            logprobs, entropy = fused.logprobs, fused.entropy
        logprobs = layout.scatter(logprobs)
        entropy = None if entropy is None else layout.scatter(entropy)
        if not self.critic:
            values = None
        elif self.value_model is None:
            values = self.policy.v_head(hidden).float()
        else:
            backbone, head = backbone_and_head(self.value_model)
            value_hidden = backbone(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                                    position_ids=layout.position_ids, use_cache=False).last_hidden_state
            values = head(value_hidden.reshape(-1, value_hidden.shape[-1]).index_select(0, layout.gather))
            values = values.squeeze(-1).float()
        return ActorCriticOutput(logprobs, entropy, None if values is None else layout.scatter(values),
                                 hidden if return_hidden else None, fused)


def fused_policy_loss(model, hidden, layout: Layout, temperature: float, old_logprobs, advantages, mask, cliprange,
                      entropy_coef, **options):
    """``fused_ppo_policy_loss`` on the layout's real tokens (its [b, T] grids picked there, ``options``' among
    them; its other keyword-only settings as they are): the gradient is formed in the forward."""
    head = lm_head_of(model)
    bias = getattr(head, "bias", None)
    options = {k: layout.pick(v) if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in options.items()}
    return fused_ppo_policy_loss(
        hidden, head.weight.to(hidden.dtype), layout.targets, layout.pick(old_logprobs), layout.pick(advantages),
        layout.pick(mask), cliprange, entropy_coef, temperature, bias=None if bias is None else bias.to(hidden.dtype),
        **options,
    )


class Reference:
    """log π_ref of the response tokens: a frozen copy, or the PEFT policy with its adapter disabled."""

    def __init__(self, ref_model: nn.Module | None, policy: nn.Module):
        self.ref_model = ref_model
        self.policy = policy

    def _context(self):
        return lm_of(self.policy).disable_adapter() if self.ref_model is None else contextlib.nullcontext()

    @torch.no_grad()
    def __call__(self, layout: Layout, temperature, with_hidden=False):
        model = self.policy if self.ref_model is None else self.ref_model
        with self._context():
            hidden = decoder_hidden(model, layout).index_select(0, layout.gather)
            logprobs = token_logprobs_from_hidden(model, hidden, layout.targets, temperature, False)
        head = lm_head_of(model) if with_hidden else None
        return layout.scatter(logprobs), (hidden, head) if with_hidden else None


# ============================================================================ loading and preparing


def enable_checkpointing(model: nn.Module, kwargs: dict | None) -> None:
    """Activation checkpointing under its transformers 5 name, or its 4.x name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 4.x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_dropout(model: nn.Module) -> None:
    """p = 0 everywhere (TRL does the same): with dropout on, the rollout and training forwards differ."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "attn_pdrop", "hidden_dropout", "resid_pdrop", "embd_pdrop", "dropout"):
        if config is not None and isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def check_lm_head(model: nn.Module, vocab_size: int, device) -> None:
    """The fused path assumes logits = h·Wᵀ (+b). Models that rescale or soft-cap logits break that: refuse them."""
    lm = lm_of(model)
    ids = torch.arange(min(8, vocab_size), device=device).unsqueeze(0)
    mask = torch.ones_like(ids)
    pos = torch.arange(ids.shape[1], device=device).unsqueeze(0)
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        n = ids.shape[1]
        layout = make_layout(ids, 1, [1], [n - 1], packed=False)
        got = layout.scatter(token_logprobs_from_hidden(
            model, decoder_hidden(model, layout).index_select(0, layout.gather), layout.targets, 1.0, False))
    if not torch.allclose(got, expected, atol=1e-3, rtol=1e-3):
        raise SettingsError(
            f"{type(causal_lm_of(model)).__name__}: log-probs from the last hidden state and the LM head do not "
            "match the model's logits (logit scaling or soft-capping?); fastppo's fused path cannot train it"
        )


def load_error(what: str, path: str, e: Exception) -> Exception:
    return LoadError(f"could not load the {what} from {path!r}: {e}")


def load_tokenizer(path: str, model_args, log: Callable[[str], None]):
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision,
                                                  trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise load_error("tokenizer", path, e) from e
    return tokenizer


def ensure_pad_token(tokenizer, log: Callable[[str], None], given: bool = False) -> None:
    """A tokenizer without a pad token pads with its eos token (TRL's scripts do the same), and we say so.
    Without an eos token either, one fastppo loaded gets a new '<pad>'; one the user passed is refused (a new
    token would change their tokenizer). Padding is fed to the models as id 0: nothing is resized."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
        log(f"tokenizer has no pad token: using its eos token {tokenizer.eos_token!r} "
            f"(id {tokenizer.eos_token_id}) for padding")
    elif given:
        raise SettingsError("processing_class has no pad token and no eos token: give it one "
                            "(tokenizer.add_special_tokens({'pad_token': '[PAD]'}); padding is fed to the models as "
                            "id 0, so no embedding needs to grow)")
    else:
        tokenizer.add_special_tokens({"pad_token": "<pad>"})
        log(f"tokenizer has no pad or eos token: added pad token '<pad>' (id {tokenizer.pad_token_id}); padding "
            "is fed to the models as id 0, so no embedding is resized")


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "auto": "auto"}


def pretrained_kwargs(model_args, frozen: bool = False, bf16: bool = False) -> dict:
    """Keyword arguments of every from_pretrained call. Weights in ``--dtype`` when given; else fp32 for
    the trained models and, under bf16, bf16 for the frozen ones (they only run forwards in bf16)."""
    dtype = DTYPES[model_args.dtype] if model_args.dtype else (torch.bfloat16 if frozen and bf16 else torch.float32)
    kwargs = dict(attn_implementation=model_args.attn_implementation or "sdpa", dtype=dtype,
                  revision=model_args.model_revision, trust_remote_code=model_args.trust_remote_code)
    if model_args.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        kwargs["attn_implementation"] = "sdpa"
    return kwargs


def load_causal_lm(path: str, model_args, what: str, value_head: bool = False, frozen: bool = False,
                   bf16: bool = False) -> nn.Module:
    loader = AutoModelForCausalLMWithValueHead if value_head else AutoModelForCausalLM
    try:
        return loader.from_pretrained(path, **pretrained_kwargs(model_args, frozen, bf16))
    except (OSError, ValueError) as e:
        raise load_error(what, path, e) from e


def load_seq_cls(path: str, model_args, tokenizer, what: str, fresh_head_ok: bool, frozen: bool = False,
                 bf16: bool = False) -> nn.Module:
    """An AutoModelForSequenceClassification with one label. A checkpoint without a trained scalar head
    (a causal LM, say) gets a random one from transformers: refused unless ``fresh_head_ok``."""
    try:
        saved = AutoConfig.from_pretrained(path, revision=model_args.model_revision,
                                           trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise load_error(what, path, e) from e
    if any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in saved.architectures or ()) \
            and saved.num_labels != 1:  # transformers' own report of the mismatch is a log line, then a RuntimeError
        raise SettingsError(_labels_message(what, saved.num_labels, f"at {path!r}"))
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, output_loading_info=True, **pretrained_kwargs(model_args, frozen, bf16))
    except (OSError, ValueError) as e:
        raise load_error(what, path, e) from e
    _, head = backbone_and_head(model)
    head_names = {n for n, m in model.named_modules() if m is head}
    fresh = [k for k in info.get("missing_keys", ()) if any(k.startswith(h + ".") for h in head_names)]
    if fresh and not fresh_head_ok:
        raise SettingsError(
            f"the {what} at {path!r} has no trained scalar head ({', '.join(sorted(fresh))} missing from the "
            "checkpoint: it is not a sequence-classification model), so its output would be noise; pass a trained "
            "one, or --allow_untrained_heads to train on it anyway"
        )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def _labels_message(what: str, labels: int, where: str) -> str:
    return (f"the {what} {where} has {labels} output labels (a classifier); PPO needs one scalar per sequence "
            f"(num_labels=1): pass a reward model trained with num_labels=1, or wrap yours so that it returns "
            f"one score (a reward function: reward_model=fn(prompts, completions, **kw))")


def check_scalar_head(model: nn.Module, what: str) -> None:
    """A reward or value model object must output one number per position: a 2-label classifier's
    logits are not a reward (and would be read as [B, 2] scores)."""
    try:
        _, head = backbone_and_head(model)
    except SettingsError:
        raise SettingsError(f"the {what} ({type(model).__name__}) is not a sequence-classification model (no 'score' "
                            "or 'classifier' head): pass an AutoModelForSequenceClassification with num_labels=1, or "
                            "its path") from None
    rows = head.weight.shape[0] if hasattr(head, "weight") else getattr(head, "out_features", 1)
    if rows != 1:
        raise SettingsError(_labels_message(what, rows, f"({type(model).__name__})"))


def check_trainable_dtype(models: dict[str, nn.Module | None]) -> None:
    """fp16 weights cannot be trained here: PPO's update would run on them with no loss scaling and no fp32
    master copy (the first step overflows: KL 25, scores 0, then NaN probabilities in generation). bf16
    weights train (as given), fp16 frozen models (reference, reward) only run forwards and are fine."""
    for what, model in models.items():
        if model is None:
            continue
        half = sorted({n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad
                       and p.dtype == torch.float16})
        if half:
            raise SettingsError(
                f"the {what}'s trainable weights are float16: fastppo trains without fp16 loss scaling, so its "
                f"first update would overflow; load it in float32 or bfloat16 (from_pretrained(..., "
                f"dtype=torch.float32), --dtype float32/bfloat16) or call .float() on it, and use --bf16 for "
                "mixed precision")


def frozen_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """The reference: a frozen deep copy of the policy's language model (TRL's create_reference_model),
    in ``dtype`` when given (bf16 under bf16: it only runs forwards, at half the memory and bandwidth)."""
    ref = copy.deepcopy(lm_of(model))
    if dtype is not None:
        ref.to(dtype)
    return ref.eval().requires_grad_(False)


def apply_liger(models, log) -> None:
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        log("use_liger_kernel: liger_kernel is not installed; going on without it")
        return
    for model in models:
        try:
            _apply_liger_kernel_to_instance(model=causal_lm_of(model) if hasattr(model, "pretrained_model") else model)
        except Exception as e:  # unsupported architecture: Liger raises or warns
            log(f"use_liger_kernel: could not patch {type(model).__name__}: {e}")


def apply_peft(policy: nn.Module, peft_config, model_args) -> nn.Module:
    """LoRA on the policy's language model (inside a value-head wrapper, the head stays fully trainable)."""
    from peft import LoraConfig, get_peft_model

    if peft_config is None:  # the flags (validate_config has refused an lm_head target among them)
        peft_config = LoraConfig(
            r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
            target_modules=model_args.lora_target_modules, task_type="CAUSAL_LM",
            use_rslora=getattr(model_args, "use_rslora", False),
        )
    elif "lm_head" in (getattr(peft_config, "target_modules", None) or ()):
        raise SettingsError("peft_config: target_modules may not include lm_head: log-probs are computed from the LM "
                         "head weight directly, so an adapter on it would be ignored")
    if isinstance(policy, AutoModelForCausalLMWithValueHead):
        policy.pretrained_model = get_peft_model(policy.pretrained_model, peft_config)
        return policy
    return get_peft_model(policy, peft_config)


def is_peft(model: nn.Module) -> bool:
    return hasattr(lm_of(model), "disable_adapter")


def embedding_rows(model: nn.Module) -> int:
    return causal_lm_of(model).get_input_embeddings().weight.shape[0]


def check_vocabulary(models: dict[str, nn.Module | None], tokenizer, loaded: set[str], largest_input_id: int,
                     log) -> None:
    """Every token a model reads must have an embedding row. Padding never reaches a model (its positions are
    fed as id 0, as TRL does), so a tokenizer with an added pad token beyond the embedding is fine; what must
    fit are the real inputs: the prompts' and stop tokens (``largest_input_id``) and, for the models that read
    the policy's samples, every id the policy can generate. A model fastppo loaded itself is resized to the
    tokenizer (and it says so); a model the user passed is never changed behind their back: refused, with
    the fix."""
    policy = models["policy"]
    for what, model in models.items():
        if model is None:
            continue
        need = largest_input_id + 1
        if what != "policy":  # it reads the policy's samples: any id the policy's head can produce
            need = max(need, lm_head_of(policy).weight.shape[0])
        rows = embedding_rows(model)
        if rows >= need:
            continue
        if what in loaded:
            causal_lm_of(model).resize_token_embeddings(max(need, len(tokenizer)))
            log(f"{what}: embeddings resized from {rows} to {max(need, len(tokenizer))} tokens")
        else:
            raise SettingsError(
                f"the {what} has {rows} embedding rows but reads token ids up to {need - 1} (the prompts', the stop "
                f"tokens' or the policy's samples); fastppo does not resize a model you pass: call "
                f"model.resize_token_embeddings({max(need, len(tokenizer))}) on it first, or use a tokenizer and "
                "models that share one vocabulary")


def prepare_models(policy, ref_model, value_model, reward_models, tokenizer, config, device, log):
    """Patch (Liger), zero dropout, place, freeze the frozen ones."""
    if config.use_liger_kernel:
        if device.type == "cuda":
            apply_liger([m for m in (policy, value_model) if m is not None], log)
        else:
            log("use_liger_kernel: Liger-Kernel's Triton kernels need a CUDA device; ignored on CPU")
    for model in (policy, ref_model, value_model, *reward_models):
        if model is not None:
            disable_dropout(model)
            model.to(device)
    for frozen in (ref_model, *reward_models):
        if frozen is not None:
            frozen.eval().requires_grad_(False)
    if config.gradient_checkpointing:
        kwargs = config.gradient_checkpointing_kwargs or {"use_reentrant": False}
        for model in (causal_lm_of(policy), value_model):
            if model is not None:
                enable_checkpointing(model, kwargs)
    check_lm_head(policy, len(tokenizer), device)
    if config.padding_free:  # every forward of these models runs on packed rows
        for what, model in (("policy", policy), ("reference model", ref_model), ("value model", value_model),
                            *(("reward model", m) for m in reward_models)):
            if model is not None:
                check_packing(model, device, what)


def build_models(bound: dict, config, model_args, policy_path: str | None, tokenizer, bf16: bool, device, log,
                 largest_input_id: int = 0) -> tuple[nn.Module, nn.Module | None, nn.Module | None, list[nn.Module]]:
    """(policy, reference, value model, reward models) from the trainer's arguments (objects or paths),
    falling back to the config's paths; prepared and placed on ``device``. ``bound["rewards"]``: the run's
    ``fastppo.rewards.Reward`` list; each model among them is loaded (from its path) and told its tokenizer.

    The reference is None where the PEFT policy with its adapter disabled plays it; the value model
    is None where the value head sits on the policy's trunk (``shared_value_head``, or a policy passed as
    an ``AutoModelForCausalLMWithValueHead``)."""
    model = bound.get("model")
    loaded = set()  # the models fastppo loaded itself (it may resize those; a user's own, never)
    shared = config.shared_value_head or isinstance(model, AutoModelForCausalLMWithValueHead)
    value_model = bound.get("value_model")
    if config.critic_free:
        why = f"advantage_estimator {config.advantage_estimator!r} is critic-free (no value model)"
        if value_model is not None:
            raise SettingsError(f"value_model is given, but {why}: pass value_model=None, or use "
                                "advantage_estimator='gae'")
        if isinstance(model, AutoModelForCausalLMWithValueHead):
            raise SettingsError(f"model is an AutoModelForCausalLMWithValueHead, but {why}: pass its language model "
                                "(model.pretrained_model), or use advantage_estimator='gae'")
        shared = False
    if isinstance(model, AutoModelForCausalLMWithValueHead) and isinstance(value_model, nn.Module):
        raise SettingsError("model is an AutoModelForCausalLMWithValueHead (its value head is on its trunk) and "
                            "value_model is given too: pass one of them (a plain causal LM with value_model, or "
                            "the value-head model alone)")
    if isinstance(model, nn.Module):
        policy = model
        if bound.get("peft_config") is not None and is_peft(model) and not isinstance(model,
                                                                                  AutoModelForCausalLMWithValueHead):
            # TRL 0.26's rule: a PeftModel given with a peft_config has its adapter merged, then gets the new one
            log("model is a PeftModel and peft_config is given: its adapter is merged into the base weights "
                "(merge_and_unload, as TRL does) and peft_config's adapter is trained on top")
            policy = model.merge_and_unload()
        if shared and not isinstance(policy, AutoModelForCausalLMWithValueHead):
            policy = AutoModelForCausalLMWithValueHead(policy)
    else:
        policy = load_causal_lm(policy_path, model_args, "policy", value_head=shared)
        loaded.add("policy")
    ref_model = bound.get("ref_model")
    if ref_model is not None and ref_model is model:
        raise SettingsError("model and ref_model are the same object: pass a copy, or None for a frozen copy")
    if isinstance(ref_model, str):
        ref_model = load_causal_lm(ref_model, model_args, "reference model", frozen=True, bf16=bf16)
        loaded.add("reference model")
    peft_config = bound.get("peft_config")
    want_peft = peft_config is not None or model_args.use_peft
    if not config.needs_reference:  # no KL anywhere (TRL GRPO at beta 0): π_ref is never read, so never held
        if ref_model is not None:
            log("ref_model is not used: no KL is computed (kl_coef and beta are 0)")
        ref_model = None
    elif ref_model is None and not (is_peft(policy) or want_peft):
        ref_model = frozen_copy(policy, torch.bfloat16 if bf16 and not model_args.dtype else None)
        if "policy" in loaded:
            loaded.add("reference model")
    # under PEFT no ref_model means the policy with its adapter disabled; a given one is used, as TRL does
    value_model = None if shared else value_model
    if not shared and not config.critic_free and not isinstance(value_model, nn.Module):
        explicit = value_model or config.value_model_path
        value_path = explicit or policy_path or getattr(causal_lm_of(policy).config, "_name_or_path", None)
        # the policy's weights with a fresh head is the default value model (TRL's); a path given for it
        # must hold a trained head (a reward model, TRL's example) unless the user says otherwise
        value_model = load_seq_cls(value_path, model_args, tokenizer, "value model",
                                   fresh_head_ok=not explicit or config.allow_untrained_heads)
        loaded.add("value model")
        if "value model" in loaded and explicit:  # a value model reads the policy's tokens: never another's
            check_value_tokenizer(value_path, tokenizer, model_args)
    reward_models = []
    rewards = [r for r in bound.get("rewards") or () if r.fn is None]  # fastppo.reward_scores.Reward: the models
    label = {r.name: "reward model" if len(rewards) == 1 else f"reward model {r.name!r}" for r in rewards}
    for reward in rewards:  # each model among the rewards, loaded here from its path and told its tokenizer
        what = label[reward.name]
        if reward.model is None:
            reward.model = load_seq_cls(reward.path, model_args, tokenizer, what,
                                        fresh_head_ok=config.allow_untrained_heads, frozen=True, bf16=bf16)
            loaded.add(what)
        reward.tokenizer = reward_tokenizer(reward, bound.get("reward_processing_classes", {}).get(reward.name),
                                            tokenizer, policy, model_args, log)
        reward_models.append(reward.model)
    for what, scalar in (("value model", value_model), *((label[r.name], r.model) for r in rewards)):
        if scalar is not None and what not in loaded:
            check_scalar_head(scalar, what)
    # a reward model with its own tokenizer reads its own ids: the policy's vocabulary is none of its business
    same_tokens = {label[r.name]: r.model for r in rewards if r.tokenizer is None}
    check_trainable_dtype({"policy": policy, "value model": value_model})
    check_vocabulary({"policy": policy, "reference model": ref_model, "value model": value_model, **same_tokens},
                     tokenizer, loaded, largest_input_id, log)
    if want_peft and not is_peft(policy):
        policy = apply_peft(policy, peft_config, model_args)
    prepare_models(policy, ref_model, value_model, reward_models, tokenizer, config, device, log)
    return policy, ref_model, value_model, reward_models


def same_vocabulary(a, b) -> bool:
    """Two tokenizers give the same ids to the same tokens (compared by vocabulary, not by object)."""
    return len(a) == len(b) and a.get_vocab() == b.get_vocab()


def _tokenizer_at(path: str | None, model_args):
    if not path:
        return None
    try:
        return AutoTokenizer.from_pretrained(path, revision=model_args.model_revision,
                                             trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def reward_tokenizer(reward, given, tokenizer, policy, model_args, log):
    """None when the reward model reads the policy's token ids (its tokenizer, ``given`` or found beside its
    weights, has the policy's vocabulary); else its own tokenizer, with which the trainer re-tokenizes the text.

    No tokenizer found: a model whose embedding has as many rows as the policy's is taken to share its
    tokenizer (said once); any other is refused: it would read ids of another vocabulary."""
    own = given if given is not None else _tokenizer_at(
        reward.path or getattr(getattr(reward.model, "config", None), "_name_or_path", None), model_args)
    if own is None:
        rows, policy_rows = embedding_rows(reward.model), embedding_rows(policy)
        if rows != policy_rows:
            raise SettingsError(
                f"reward model {reward.name!r}: no tokenizer found for it (none beside its weights, none in "
                f"reward_processing_classes) and its vocabulary ({rows} rows) is not the policy's ({policy_rows}): "
                "it cannot read the policy's token ids; pass its tokenizer (PPOTrainer(reward_processing_classes="
                "[tokenizer]) or save it beside the model)")
        log(f"reward model {reward.name!r}: no tokenizer beside it; its vocabulary has the policy's size "
            f"({rows}), so it reads the policy's token ids (pass reward_processing_classes if it is another's)")
        return None
    if same_vocabulary(own, tokenizer):
        return None
    if own.pad_token_id is None and own.eos_token_id is not None:
        own.pad_token = own.eos_token  # padding never reaches the model (it is masked); the id only fills rows
    log(f"reward model {reward.name!r} has its own tokenizer ({len(own)} tokens, the policy's {len(tokenizer)}): "
        "it scores the decoded text re-tokenized with it")
    return own


def check_value_tokenizer(path: str, tokenizer, model_args) -> None:
    """The value model reads the policy's token ids: one whose checkpoint ships another tokenizer is refused."""
    own = _tokenizer_at(path, model_args)
    if own is not None and not same_vocabulary(own, tokenizer):
        raise SettingsError(
            f"the value model at {path!r} has its own tokenizer ({len(own)} tokens, the policy's {len(tokenizer)}), "
            "but a value model reads the policy's token ids (one value per policy token); start it from a model "
            "of the policy's tokenizer (--value_model_path), leave it unset (the policy's weights with a fresh "
            "head), or use a critic-free --advantage_estimator")


POSITION_LIMIT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def position_limit(model_config) -> int | None:
    """The number of positions a model's config says it has (None: not stated)."""
    return next((getattr(model_config, f) for f in POSITION_LIMIT_FIELDS
                 if isinstance(getattr(model_config, f, None), int)), None)


def check_positions(model_or_path, config, model_args, longest_prompt: int, what: str = "model") -> None:
    """Prompt + response must fit the model's positions, checked from its config (the policy's before any
    weight loads, the other models' once built): a learned-position model (GPT-2) would crash inside
    generation or scoring, a RoPE one silently run past its limit."""
    if isinstance(model_or_path, nn.Module):
        inner = getattr(model_or_path, "pretrained_model", model_or_path)
        model_config = getattr(inner, "config", None) or causal_lm_of(model_or_path).config
    else:
        try:
            model_config = AutoConfig.from_pretrained(model_or_path, revision=model_args.model_revision,
                                                      trust_remote_code=model_args.trust_remote_code)
        except (OSError, ValueError) as e:
            raise load_error("policy's config", model_or_path, e) from e
    limit = position_limit(model_config)
    if limit is None:
        return
    width = longest_prompt
    if config.pad_to_multiple_of:
        width = -(-width // config.pad_to_multiple_of) * config.pad_to_multiple_of
    if width + config.response_length > limit:
        room = limit - config.response_length
        hint = (f"set --max_prompt_length {room} (or less) to keep each prompt's last tokens"
                if room > 0 else "lower --response_length")
        raise SettingsError(
            f"the longest prompt ({width} tokens) + response_length ({config.response_length}) = "
            f"{width + config.response_length} exceeds the {what}'s {limit} positions: {hint}"
        )


def check_packing(model: nn.Module, device, what: str = "policy") -> None:
    """``padding_free`` packs rows into one sequence and relies on the attention implementation to keep
    them apart (transformers reads the segments off restarting position ids): refuse it where it does not."""
    is_scalar_model = getattr(model, "score", None) is not None or getattr(model, "classifier", None) is not None
    body = backbone_and_head(model)[0] if is_scalar_model else causal_lm_of(model).get_decoder()
    vocab = body.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, vocab, (n,), generator=gen).to(device) for n in (5, 4))
    with torch.no_grad():
        alone = [body(input_ids=x[None], use_cache=False).last_hidden_state[0] for x in (a, b)]
        packed = body(input_ids=torch.cat([a, b])[None], use_cache=False,
                      position_ids=torch.cat([torch.arange(5), torch.arange(4)]).to(device)[None]).last_hidden_state[0]
    if not torch.allclose(torch.cat(alone).float(), packed.float(), atol=1e-3, rtol=1e-3):
        raise SettingsError(
            f"padding_free: the {what} ({type(model).__name__} with attn_implementation="
            f"{body.config._attn_implementation!r}) lets packed rows attend to each other; use "
            "flash_attention_2, sdpa or eager on a transformers version that reads packed positions, or drop "
            "--padding_free"
        )
