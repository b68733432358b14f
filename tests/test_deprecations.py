"""What the next transformers removes: fastppo's own calls raise no deprecation warning (the KV cache passed under
its current keyword, not ``past_key_values``)."""
from __future__ import annotations

import functools
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


@pytest.fixture
def fastppo_deprecations():
    """Every FutureWarning/DeprecationWarning raised by a call fastppo makes: one of fastppo's frames is on the
    stack, below no import (a warning's own stacklevel often points into torch's Module.__call__, so a module
    filter alone misses fastppo's calls): the list, as 'category: message (from module:line)'. Other warnings go
    where they went."""
    import warnings

    caught: list[str] = []
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
            warnings.simplefilter("always", category)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not issubclass(category, (FutureWarning, DeprecationWarning, PendingDeprecationWarning)):
                return shown(message, category, filename, lineno, file, line)
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith("warnings"):
                frame = frame.f_back
            source = (frame.f_globals.get("__name__", "") if frame is not None else "").split(".")[0]
            between = set()  # the libraries between the warning and fastppo's call
            while frame is not None:
                module = frame.f_globals.get("__name__", "")
                if module.startswith("importlib"):  # a library's import-time warning (torch.compile's first call
                    return None                      # imports inductor), not one of fastppo's calls
                if module == "fastppo" or module.startswith("fastppo."):
                    # fastppo's own call: the warning comes from the library fastppo called (through torch's
                    # Module.__call__ at most), not from a third library's use of it (peft reading a deprecated
                    # transformers property is peft's to change)
                    if between <= {source}:
                        caught.append(f"{category.__name__}: {message} (from {module}:{frame.f_lineno})")
                    return None
                if module not in ("torch.nn.modules.module", "torch.utils._contextlib", "functools", "contextlib"):
                    between.add(module.split(".")[0])
                frame = frame.f_back
            return None

        warnings.showwarning = show
        yield caught


def test_no_deprecation_warning_from_fastppos_calls(tmp_path, model_dir, fastppo_deprecations):
    """A short training run (the sampler, the policy/value forward, the reference, the update, a checkpoint and
    the final save), the legacy API's generate/step and value-head model with its cache, and the compiled decode
    step: on the installed transformers/torch/datasets/accelerate, none of fastppo's calls raises a FutureWarning
    or DeprecationWarning (transformers 5.2x warns on every forward given past_key_values; it goes in 5.40)."""
    from fastppo.generation import Sampling, sample_responses
    from fastppo.legacy import AutoModelForCausalLMWithValueHead
    from fastppo.legacy import PPOConfig as LegacyConfig
    from fastppo.legacy import PPOTrainer as LegacyTrainer
    from fastppo.layout import cache_keyword
    from fastppo.static_decode import StaticDecoder

    def train_and_save(trainer):  # as a TRL script: train(), then save_model()
        trainer.train()
        trainer.save_model()

    train_and_save(PPOTrainer(args=config(tmp_path, save_steps=1), reward_model=length_reward))
    # gradient checkpointing (TRL's default), LoRA, the value head on the policy's trunk, packed rows
    from peft import LoraConfig

    train_and_save(PPOTrainer(args=config(tmp_path, name="lora", gradient_checkpointing=True, padding_free=True),
                              peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                              reward_model=length_reward))
    train_and_save(PPOTrainer(args=config(tmp_path, name="shared", gradient_checkpointing=True,
                                          shared_value_head=True), reward_model=length_reward))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_dir)
    legacy = LegacyTrainer(LegacyConfig(model_name=model_dir, batch_size=4, mini_batch_size=2,
                                        output_dir=str(tmp_path / "legacy")), model, None, tokenizer)
    queries = [torch.tensor(tokenizer(q)["input_ids"]) for q in ["the movie was", "i think", "overall", "it"]]
    responses = legacy.generate(queries, return_prompt=False, min_length=-1, top_k=0, top_p=1.0, do_sample=True,
                                max_new_tokens=4, pad_token_id=tokenizer.eos_token_id)
    legacy.step(queries, responses, [torch.tensor(1.0)] * 4)
    ids = torch.tensor([tokenizer("the movie was good and fun")["input_ids"]])
    first = model(ids[:, :3], return_past_key_values=True)
    cont, _, _, cache = model(ids[:, 3:], first[3], torch.ones_like(ids), return_past_key_values=True)
    full = model(ids)[0]
    torch.testing.assert_close(cont, full[:, 3:], atol=1e-5, rtol=1e-5)  # the cache was passed and used
    assert cache is not None
    lm = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    mask = torch.ones_like(ids)
    eager = sample_responses(lm, ids, mask, 4, Sampling(1.0), 8)
    decoder = StaticDecoder(lm, cache_bucket=16)
    torch.manual_seed(0)
    first_tokens = sample_responses(lm, ids, mask, 3, Sampling(1.0), 8, decoder=decoder)
    assert eager.shape == (1, 4) and first_tokens.shape == (1, 3)
    assert fastppo_deprecations == [], "\n".join(fastppo_deprecations)
    import inspect

    assert cache_keyword(lm) in inspect.signature(type(lm).forward).parameters
