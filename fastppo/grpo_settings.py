"""TRL GRPO's settings of keywords, read into fastppo's: ``generation_kwargs`` (the sampling settings and the
length and stop settings among them set the config's own; any other key refused by name) and
``model_init_kwargs`` (how a model given by name loads: a ``ModelConfig``)."""
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
    """TRL's ``generation_kwargs`` (a dict, or its JSON from the command line), taken last as TRL's generation config
    takes them: the sampling settings among them set ``args``' own, and so do the keys that only change where a
    completion ends (``LENGTH_KWARGS``); every other key is refused by name, with the setting to use where one
    exists (fastppo samples with its own decode loop, and its log-probs must be those of the distribution it
    samples from)."""
    for key, value in (keywords_setting("generation_kwargs", args.generation_kwargs) or {}).items():
        if key in SAMPLING_KWARGS:
            setattr(args, key, value)
        elif key in LENGTH_KWARGS:
            LENGTH_KWARGS[key](args, value)
        elif key == "do_sample" and value is True:
            continue
        elif key in INSTEAD:
            raise SettingsError(f"generation_kwargs[{key!r}]: {INSTEAD[key]}")
        else:
            raise SettingsError(f"generation_kwargs[{key!r}]={value!r}: not supported (fastppo samples from the "
                                f"processed distribution of {', '.join(SAMPLING_KWARGS)} with its own decode loop, "
                                "and trains that distribution; beam search, other processors and greedy decoding "
                                "have no such log-probs)")


def _max_new_tokens(args, value) -> None:
    """TRL's ``max_new_tokens`` overrides the generation length: here the completion length, one setting
    (``max_completion_length``, PPO's ``response_length``). TRL's dr_grpo still divides by the configured
    ``max_completion_length`` while generating ``max_new_tokens``; fastppo has one length, so there the two must
    agree."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SettingsError(f"generation_kwargs['max_new_tokens'] must be an integer >= 1, got {value!r}")
    if args.loss_type == "dr_grpo" and value != args.max_completion_length:
        raise SettingsError(f"generation_kwargs['max_new_tokens']={value} with loss_type='dr_grpo': TRL would "
                            f"generate {value} tokens but normalise by max_completion_length="
                            f"{args.max_completion_length}; fastppo has one completion length: set "
                            f"max_completion_length={value} instead")
    args.max_completion_length = args.response_length = value


def _eos_token_id(args, value) -> None:
    """TRL's ``eos_token_id``: the tokens a completion ends at (one id or several), as ``stop_token_id``."""
    ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, (list, tuple)) or not ids or \
            not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise SettingsError(f"generation_kwargs['eos_token_id'] must be a token id or a list of them, got {value!r}")
    args.stop_token, args.stop_token_id = None, list(ids)


def _min_new_tokens(args, value) -> None:
    """TRL's ``min_new_tokens``: its default (0, None) changes nothing and is taken; any other value masks the stop
    tokens for the first tokens, a processed distribution fastppo does not train."""
    if value not in (0, None):
        raise SettingsError(f"generation_kwargs['min_new_tokens']={value!r}: not supported (it removes the stop "
                            "tokens from the first tokens' distribution, whose log-probs fastppo does not compute); "
                            "leave it unset, and reward length in a reward function if short completions are the "
                            "problem")


# generation_kwargs that only change a completion's length or where it stops: the setting of fastppo's they set
LENGTH_KWARGS = {"max_new_tokens": _max_new_tokens, "eos_token_id": _eos_token_id, "min_new_tokens": _min_new_tokens}
# generation_kwargs fastppo's sampler cannot honour but another setting of its does: what to set instead
INSTEAD = {
    "temperature": "set temperature instead (fastppo's log-probs read the temperature the completions are sampled at)",
    "max_length": "not supported; set max_completion_length instead (the completion's length; prompts keep theirs, "
                  "max_prompt_length cuts them)",
    "stop_strings": "not supported: fastppo's sampler stops at token ids, not strings: set stop_token_id (or "
                    "generation_kwargs' eos_token_id) to the ids of the stop text's tokens",
}


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
