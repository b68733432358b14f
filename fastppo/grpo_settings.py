"""TRL GRPO's settings of keywords, read into fastppo's: ``generation_kwargs`` (the sampling settings among them set
the config's own; any other key refused by name) and ``model_init_kwargs`` (how a model given by name loads: a
``ModelConfig``)."""
from __future__ import annotations

import json

from fastppo.errors import SettingsError
from fastppo.script_args import ModelConfig


# generation_kwargs TRL passes to the sampler that fastppo honours: the processed distribution's settings (they
# override the fields of the same name, as TRL's generation config takes them last), and do_sample=True
SAMPLING_KWARGS = ("top_k", "top_p", "min_p", "repetition_penalty")


def keywords_setting(name: str, value) -> dict | None:
    """A setting of keywords (TRL's ``generation_kwargs``, ``model_init_kwargs``): a dict, None, or its JSON from the
    command line; anything else refused by name."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SettingsError(f"{name} must be a JSON object, got {value!r}: {e}") from None
    if value is not None and not isinstance(value, dict):
        raise SettingsError(f"{name} must be a dict of keywords, got {value!r}")
    return value


def apply_generation_kwargs(args) -> None:
    """TRL's ``generation_kwargs`` (a dict, or its JSON from the command line): the sampling settings among them set
    ``args``' own; every other key is refused by name (fastppo samples with its own decode loop, and its log-probs
    must be those of the distribution it samples from)."""
    for key, value in (keywords_setting("generation_kwargs", args.generation_kwargs) or {}).items():
        if key in SAMPLING_KWARGS:
            setattr(args, key, value)
        elif key == "do_sample" and value is True:
            continue
        elif key == "temperature":
            raise SettingsError("generation_kwargs['temperature']: set temperature instead (fastppo's log-probs "
                                "read the temperature the completions are sampled at)")
        else:
            raise SettingsError(f"generation_kwargs[{key!r}]={value!r}: not supported (fastppo samples from the "
                                f"processed distribution of {', '.join(SAMPLING_KWARGS)} with its own decode loop, "
                                "and trains that distribution; beam search, other processors and greedy decoding "
                                "have no such log-probs)")


# TRL GRPO's model_init_kwargs (from_pretrained's keywords for a model given by name) -> the ModelConfig field
MODEL_INIT_KEYS = {"revision": "model_revision", "trust_remote_code": "trust_remote_code",
                   "attn_implementation": "attn_implementation", "dtype": "dtype", "torch_dtype": "dtype"}


def model_args_of(args, model) -> ModelConfig:
    """How a model given by name loads: ``trust_remote_code`` and TRL's ``model_init_kwargs`` (a dict, or its JSON
    from the command line), as from_pretrained keywords (``MODEL_INIT_KEYS``; dtype unset: fastppo's default, fp32
    for the policy, as TRL's). A key fastppo does not pass is refused by name; with a model object they are ignored,
    as TRL ignores them (GRPOTrainer warns, as TRL does)."""
    kwargs = keywords_setting("model_init_kwargs", args.model_init_kwargs)
    fields = {"trust_remote_code": args.trust_remote_code}
    if not isinstance(model, str):
        return ModelConfig(**fields)
    for key, value in (kwargs or {}).items():
        if key == "device_map" and value is None:  # TRL's own value under DDP and DeepSpeed: fastppo places models
            continue
        if key not in MODEL_INIT_KEYS:
            raise SettingsError(f"model_init_kwargs[{key!r}]: not supported (fastppo loads a model by name with "
                                f"{', '.join(sorted(MODEL_INIT_KEYS))}; for other from_pretrained keywords, load the "
                                "model yourself and pass it)")
        if value is not None:
            fields[MODEL_INIT_KEYS[key]] = str(value).removeprefix("torch.") if key.endswith("dtype") else value
    return ModelConfig(**fields)
