"""Loading and preparing the models, and every check of a loaded model.

Loading: the tokenizer (with a pad token), the policy, reference, value and reward models from the trainer's
arguments, objects or paths (``build_models``: dtypes, PEFT, a frozen reference copy, each reward model's
tokenizer). Preparing: Liger, no dropout (``fastppo.dropout``), placement, frozen models frozen, activation
checkpointing (``prepare_models``). The checks of the models themselves, made once they are loaded (or, for the
positions, from their configs): the LM head the fused path relies on, scalar heads, trainable dtypes,
vocabularies, tokenizers, positions, packing, and a user's optimizer covering every trained parameter. The checks of
the settings alone, before anything loads, are ``fastppo.checks``'.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import types
from collections.abc import Callable

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from fastppo.aliases import given_name
from fastppo.dropout import disable_dropout
from fastppo.errors import LoadError, SettingsError
from fastppo.layout import (FP32_HEAD, backbone_and_head, causal_lm_of, decoder_hidden, lm_head_of, lm_of,
                            make_layout, reads_last_token, token_logprobs_from_hidden)
from fastppo.value_head import AutoModelForCausalLMWithValueHead, enable_checkpointing

__all__ = ["DTYPES", "POSITION_LIMIT_FIELDS", "apply_liger", "apply_peft", "build_models", "check_lm_head",
           "check_optimizer_covers", "check_packing", "check_positions", "check_scalar_head", "check_trainable_dtype",
           "check_value_tokenizer", "check_vocabulary", "disable_dropout", "embedding_rows", "ensure_pad_token",
           "frozen_copy", "is_peft", "load_causal_lm", "load_error", "load_seq_cls", "load_tokenizer",
           "position_limit", "prepare_models", "pretrained_kwargs", "reward_tokenizer", "same_vocabulary"]


# ============================================================================ loading


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


def from_pretrained_any_attention(load, path: str, model_args, kwargs: dict):
    """``load(path, **kwargs)``; where the model has no sdpa attention (DeBERTa, GPT-OSS) and sdpa was fastppo's
    default rather than the user's ``attn_implementation``, again with eager attention."""
    try:
        return load(path, **kwargs)
    except ValueError as e:
        if model_args.attn_implementation or "attention implementation" not in str(e):
            raise
        return load(path, **{**kwargs, "attn_implementation": "eager"})


def load_causal_lm(path: str, model_args, what: str, value_head: bool = False, frozen: bool = False,
                   bf16: bool = False) -> nn.Module:
    loader = AutoModelForCausalLMWithValueHead if value_head else AutoModelForCausalLM
    try:
        return from_pretrained_any_attention(loader.from_pretrained, path, model_args,
                                             pretrained_kwargs(model_args, frozen, bf16))
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
    kwargs = pretrained_kwargs(model_args, frozen, bf16)
    try:
        model, info = from_pretrained_any_attention(AutoModelForSequenceClassification.from_pretrained, path,
                                                    model_args, {**kwargs, "num_labels": 1,
                                                                 "output_loading_info": True})
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


def frozen_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """The reference: a frozen deep copy of the policy's language model (TRL's create_reference_model),
    in ``dtype`` when given (bf16 under bf16: it only runs forwards, at half the memory and bandwidth)."""
    ref = copy.deepcopy(lm_of(model))
    if dtype is not None:
        ref.to(dtype)
    return ref.eval().requires_grad_(False)


def apply_peft(policy: nn.Module, peft_config, model_args) -> nn.Module:
    """LoRA on the policy's language model (inside a value-head wrapper, the head stays fully trainable)."""
    from peft import LoraConfig, get_peft_model

    if peft_config is None:  # the flags (checks.check_settings has refused an lm_head target among them)
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


def _shares_value_head(config, model, value_model) -> bool:
    """Whether the value head sits on the policy's trunk: ``shared_value_head``, or a policy given as an
    ``AutoModelForCausalLMWithValueHead``; never when critic-free. Refuses a value model that would not be read."""
    shared = config.shared_value_head or isinstance(model, AutoModelForCausalLMWithValueHead)
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
    return shared


def build_models(bound: dict, config, model_args, policy_path: str | None, tokenizer, runtime,
                 largest_input_id: int = 0) -> tuple[nn.Module, nn.Module | None, nn.Module | None, list[nn.Module]]:
    """(policy, reference, value model, reward models) from the trainer's arguments (objects or paths),
    falling back to the config's paths; prepared and placed on ``runtime.device`` (``build.Runtime``).
    ``bound["rewards"]``: the run's ``fastppo.rewards.Reward`` list; each model among them is loaded (from its
    path) and told its tokenizer.

    The reference is None where the PEFT policy with its adapter disabled plays it; the value model
    is None where the value head sits on the policy's trunk (``shared_value_head``, or a policy passed as
    an ``AutoModelForCausalLMWithValueHead``)."""
    model, bf16, log = bound.get("model"), runtime.bf16, runtime.log
    loaded = set()  # the models fastppo loaded itself (it may resize those; a user's own, never)
    value_model = bound.get("value_model")
    shared = _shares_value_head(config, model, value_model)
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
    prepare_models(policy, ref_model, value_model, reward_models, tokenizer, config, runtime,
                   packed_rewards=list(same_tokens.values()))
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
    """None when the reward model reads the policy's token ids: a decoder classifier (``reads_last_token``) whose
    tokenizer, ``given`` (an object or a path) or found beside its weights, has the policy's vocabulary. Else the
    tokenizer with which the trainer re-tokenizes the text for the model's own forward: its own, or for an
    encoder with none found, the policy's.

    No tokenizer found for a decoder: one whose embedding has as many rows as the policy's is taken to share its
    tokenizer (said once); any other is refused: it would read ids of another vocabulary."""
    if isinstance(given, (str, os.PathLike)):  # a path, as processing_class takes one
        path, given = str(given), _tokenizer_at(str(given), model_args)
        if given is None:
            raise SettingsError(f"reward_processing_classes: no tokenizer could be loaded from {path!r} (for reward "
                                f"model {reward.name!r}); give a tokenizer object or a directory that holds one")
    own = given if given is not None else _tokenizer_at(
        reward.path or getattr(getattr(reward.model, "config", None), "_name_or_path", None), model_args)
    if own is None and not reads_last_token(reward.model):  # an encoder scores text: the policy's, re-tokenized
        own = tokenizer
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
    if same_vocabulary(own, tokenizer) and reads_last_token(reward.model):
        return None  # the policy's token ids, read at the last token: exact, and no decode
    if own.pad_token_id is None and own.eos_token_id is not None:
        own.pad_token = own.eos_token  # TRL GRPO's rule: the texts are right-padded with it, and masked
    if own.pad_token_id is None:
        raise SettingsError(f"reward model {reward.name!r}: its tokenizer has no pad token and no eos token to pad "
                            "with, and its texts are scored in right-padded batches; give it a pad token")
    # the model's own forward finds a decoder's last token by this id (TRL GRPO sets it the same way)
    reward.model.config.get_text_config().pad_token_id = own.pad_token_id
    if own is tokenizer or same_vocabulary(own, tokenizer):
        log(f"reward model {reward.name!r} is an encoder ({type(reward.model).__name__}): it scores the decoded text "
            "by its own forward (its pooler and head)")
    else:
        log(f"reward model {reward.name!r} has its own tokenizer ({len(own)} tokens, the policy's {len(tokenizer)}): "
            "it scores the decoded text re-tokenized with it, by its own forward")
    return own


# ============================================================================ preparing


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


def prepare_models(policy, ref_model, value_model, reward_models, tokenizer, config, runtime, packed_rewards=None):
    """Patch (Liger), zero dropout, place on ``runtime.device``, freeze the frozen ones. ``packed_rewards``: the
    reward models that read the rollout's rows (packed under padding_free; the rest, their own tokens); None: all."""
    device, log = runtime.device, runtime.log
    if config.use_liger_kernel:
        if device.type == "cuda":
            apply_liger([m for m in (policy, value_model) if m is not None], log)
        else:
            log("use_liger_kernel: Liger-Kernel's Triton kernels need a CUDA device; ignored on CPU")
    if getattr(config, "cast_lm_head_to_fp32", False):  # GRPOConfig's (TRL GRPO's): the policy's and reference's
        for model in (policy, ref_model):
            if model is not None:
                cast_lm_head_to_fp32(model)
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
                            *(("reward model", m) for m in (reward_models if packed_rewards is None
                                                            else packed_rewards))):
            if model is not None:
                check_packing(model, device, what)


def cast_lm_head_to_fp32(model: nn.Module) -> None:
    """TRL GRPO's ``cast_lm_head_to_fp32``: the LM head's weights become fp32 (a tied input embedding with them; its
    output keeps the model's dtype) and its logits are computed from fp32 operands with autocast off: in the
    sampler's forward (the head's own ``forward``) and in the fused head (``layout.FP32_HEAD``, read by
    ``layout.head_precision``)."""
    lm = causal_lm_of(model)
    head = lm_head_of(model)
    if hasattr(head, "base_layer"):  # a PEFT adapter on the head
        raise SettingsError("cast_lm_head_to_fp32=True is not supported when the lm_head carries a PEFT adapter "
                            "(target_modules includes lm_head): remove lm_head from the adapter's target modules, "
                            "or set cast_lm_head_to_fp32=False")
    if getattr(head, FP32_HEAD, False):
        return
    original = head.weight.dtype
    head.float()
    head.forward = types.MethodType(_fp32_logits, head)  # bound: a deep copy (the reference) reads its own weights
    setattr(head, FP32_HEAD, True)
    embeddings = lm.get_input_embeddings()
    if original != torch.float32 and embeddings is not None and embeddings.weight is head.weight:
        embeddings.register_forward_hook(lambda module, args, output: output.to(original))


def _fp32_logits(head: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    with torch.autocast(hidden_states.device.type, enabled=False):
        return nn.functional.linear(hidden_states.float(), head.weight.float(),
                                    None if head.bias is None else head.bias.float())


# ============================================================================ checks of the loaded models


def check_lm_head(model: nn.Module, vocab_size: int, device) -> None:
    """The fused path assumes logits = s·h·Wᵀ (+b), s a model's logit scale (``layout.head_input``). Models that
    soft-cap their logits (Gemma 2) or transform them otherwise break that: refuse them, saying by how much they
    differ and whether the model's forward is random (a dropout ``disable_dropout`` could not reach)."""
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
        if torch.allclose(got.float(), expected, atol=1e-3, rtol=1e-3):  # an fp64 policy gives fp64 log-probs
            return
        again = lm(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1].float()
    gap, random = (got.float() - expected).abs().max().item(), (again - logits).abs().max().item()
    cause = (f"two forwards of the same tokens differ by up to {random:.3g} in a logit, with every dropout fastppo "
             "knows (nn.Dropout modules, *dropout*/*pdrop fields of the modules and config) set to 0: something "
             "else in the forward is random" if random > 0 else
             "not dropout (it is disabled, and two forwards agree): soft-capping or another transform of the logits?")
    raise SettingsError(
        f"{type(causal_lm_of(model)).__name__}: log-probs from the last hidden state and the LM head do not match "
        f"the model's logits (up to {gap:.3g} apart on {n - 1} tokens; tolerance 1e-3): {cause}; fastppo's fused "
        "path cannot train it")


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
                if room > 0 else f"lower --{given_name(config, 'response_length')}")
        raise SettingsError(
            f"the longest prompt ({width} tokens) + {given_name(config, 'response_length')} "
            f"({config.response_length}) = "
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


def check_optimizer_covers(optimizer: torch.optim.Optimizer, actor_critic: nn.Module) -> None:
    """A user's optimizer must hold every trained parameter (the value model's too): one it lacks would never
    train, and nothing would say so."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left = [name for name, p in actor_critic.named_parameters() if p.requires_grad and id(p) not in held]
    if left:
        parts = sorted({name.split(".")[0] for name in left})
        raise SettingsError(
            f"optimizers: the optimizer given does not hold {len(left)} trained parameter(s) ({', '.join(parts)}: "
            f"{left[0]}, ...), which would never be updated; build it over the policy's and the value model's "
            "parameters (pass value_model= the object you give it), or pass optimizers=(None, None) for fastppo's "
            "AdamW over both")
