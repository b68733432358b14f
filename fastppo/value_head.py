"""Legacy TRL's (<= 0.11) value-head model: ``AutoModelForCausalLMWithValueHead``, a causal LM with a scalar
head (``ValueHead``) on its own trunk, in legacy TRL's checkpoint format; reading a saved head back
(``read_value_head``, from a directory, the Hub or beside a PEFT adapter); legacy TRL's
``create_reference_model``.

It also holds the few pieces of a causal LM that the wrapper itself calls and that know nothing of it (whether a
model has an LM head, the KV-cache keyword of a model class, the cache a forward returned, activation
checkpointing): the bottom of the model modules, so ``fastppo.layout`` (which unwraps this wrapper) and everything
above import it and it imports none of them.
"""
from __future__ import annotations

import copy
import functools
import inspect
import json
import os
import warnings

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.utils import cached_file, is_peft_available

from fastppo.errors import SettingsError, SettingsTypeError

__all__ = ["AutoModelForCausalLMWithValueHead", "HEAD_FILES", "HEAD_INDEXES", "HUB_KWARGS", "LAYER_PATTERNS",
           "LM_PREFIX", "V_HEAD_INIT_STRATEGIES", "VALUE_HEAD_FILE", "VALUE_HEAD_PREFIX", "ValueHead", "cache_of",
           "create_reference_model", "enable_checkpointing", "has_lm_head", "read_value_head"]

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
            # the installed transformers' name
            kwargs[_cache_keyword(type(_base_model(self.pretrained_model)))] = past_key_values
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
        enable_checkpointing(_base_model(self.pretrained_model), gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        _base_model(self.pretrained_model).gradient_checkpointing_disable()

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


# ---------------------------------------------------------------- pieces of a causal LM the wrapper calls


def _base_model(lm: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``lm`` itself without one)."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


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


def enable_checkpointing(model: nn.Module, kwargs: dict | None) -> None:
    """Activation checkpointing under its transformers 5 name, or its 4.x name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 4.x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
