"""The setup helpers of ``PPOTrainer``'s constructor: its tokenizer (given, or the model's), its tools (TRL GRPO's
``tools`` and environments' methods), the check of the models that share each group's prompt, and the derived
sizes written into the config (``fill_derived_sizes``, legacy's too)."""
from __future__ import annotations

from fastppo import loading as L
from fastppo.config import PPOConfig, as_list
from fastppo.errors import SettingsError
from fastppo.layout import shared_mask_kind
from fastppo.rewards import load_reward_fn
from fastppo.sizes import Sizes
from fastppo.tools import ToolCalling


def load_tokenizer(processing_class, model, policy_path: str | None, model_args, log):
    """The tokenizer: the one given (an object, or a path to load), else the model's (its path, or the object's
    ``_name_or_path``), with a pad token ensured."""
    tokenizer = processing_class
    given_tokenizer = tokenizer is not None and not isinstance(tokenizer, str)
    if isinstance(tokenizer, str):
        tokenizer = L.load_tokenizer(tokenizer, model_args, log)
    if tokenizer is None:
        tokenizer_path = model_args.model_name_or_path or policy_path or getattr(
            getattr(model, "config", None), "_name_or_path", None)
        if not tokenizer_path:
            raise SettingsError("processing_class (the tokenizer) is required when model is an object")
        tokenizer = L.load_tokenizer(tokenizer_path, model_args, log)
    L.ensure_pad_token(tokenizer, log, given=given_tokenizer)
    return tokenizer


def tool_calling(tools, environments, config: PPOConfig, tokenizer, stop_ids: list[int]) -> ToolCalling | None:
    """TRL GRPO's tools: shown to the model by the chat template, called in the rollout (fastppo.tools); the
    config's --tools ("module:function") where none are passed; None without tools or environments."""
    if tools and config.tools:
        raise SettingsError(f"tools given twice: as the trainer's tools= and as the config's tools "
                            f"{as_list(config.tools)}; give them in one place")
    if tools is None and config.tools:
        tools = [load_reward_fn(spec, "tools") for spec in as_list(config.tools)]
    every_tool = list(tools or []) + [t for e in (environments.tools.values() if environments else ()) for t in e]
    if not every_tool:
        return None
    calling = ToolCalling(list(tools or []), tokenizer, config.chat_template_kwargs, config.tool_timeout)
    if not stop_ids:
        raise SettingsError("tools: a tool call ends the model's turn at its eos token; set stop_token='eos'")
    return calling


def check_models_share_prompts(actor_critic, reference) -> None:
    """share_prompts=True: every model that reads the shared rows (the reference, the policy, a value model)
    takes the group mask, or the run is refused by name."""
    critic = actor_critic.critic
    for what, model in (("reference model", None if reference is None else reference.model),
                        ("policy", actor_critic.policy),
                        ("value model", actor_critic.value_model if critic else None)):
        if model is not None and shared_mask_kind(model) is None:
            raise SettingsError(f"share_prompts: the {what}'s attention "
                                f"({getattr(model.config, '_attn_implementation', None)!r}) takes no group "
                                "mask (sdpa and eager do); leave share_prompts unset or false")


def fill_derived_sizes(config: PPOConfig, sizes: Sizes) -> None:
    """TRL's trainer writes the derived sizes into its config; so does fastppo. A value the user set that
    disagrees is refused: TRL would overwrite it silently (legacy TRL's batch_size meant something else)."""
    derived = dict(world_size=sizes.world_size, local_batch_size=sizes.local_batch_size, batch_size=sizes.batch_size,
                   micro_batch_size=sizes.local_micro_batch_size * sizes.world_size,
                   local_mini_batch_size=sizes.local_mini_batch_size, mini_batch_size=sizes.mini_batch_size,
                   num_total_batches=sizes.num_total_batches)
    for name, value in derived.items():
        given = getattr(config, name)
        if given is not None and given != value:
            raise SettingsError(
                f"{name}={given} disagrees with the value derived from the batch flags ({value}); TRL 0.26 derives "
                f"{name} from per_device_train_batch_size, gradient_accumulation_steps, num_mini_batches and the "
                "number of processes: leave it unset (legacy TRL's batch_size/mini_batch_size are "
                "fastppo.legacy.PPOConfig's)")
        setattr(config, name, value)
    if config.total_episodes is None:
        config.total_episodes = sizes.num_total_batches * sizes.batch_size
