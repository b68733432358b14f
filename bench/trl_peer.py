"""TRL 0.26's PPOTrainer as the end-to-end peer: built on the shared case (``e2e_common``) and run for
the bench (``run_trl``), with the reward function wrapped as the reward *model* TRL takes
(:class:`RewardFnModel`) and TRL's per-iteration phases timed (``TrlPhases``).

TRL's ``PPOTrainer`` moved to ``trl.experimental.ppo`` in 0.26 (and is gone from TRL 1.x); this file
needs ``trl==0.26.*`` (from its own directory, ``.trl026``: ``trl_envs``) and runs with transformers 5.x.
"""
from __future__ import annotations

import time

from e2e_common import (
    E2EConfig,
    IterationClock,
    model_and_prompts,
    shared_settings,
    stamp_callback,
)
from trl_envs import use_trl026

use_trl026()  # before anything imports trl: the environment's TRL is 1.x, which has no PPOTrainer

TRL_IMPL_NAME = "reference: TRL 0.26 PPOTrainer"


# ============================================================================ the reward function as a TRL reward model


def trl_version() -> str | None:
    """The installed TRL version when it is a 0.26.x with ``trl.experimental.ppo``, else None."""
    try:
        import trl
        from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: F401
    except Exception:
        return None
    return trl.__version__ if trl.__version__.startswith("0.26.") else None


def _make_reward_fn_model():
    import torch
    import torch.nn as nn

    class _Output:
        """The one field of a transformers ``BaseModelOutput`` that TRL's ``get_reward`` reads."""

        def __init__(self, hidden):
            self.hidden_states = (hidden,)
            self.last_hidden_state = hidden

    class _DecodeAndScore(nn.Module):
        """Stands where a reward model's transformer body would: ids in, one "hidden" feature out.

        It decodes each row's query and response exactly as ``fastppo.train`` does for a reward
        function (real tokens only, ``skip_special_tokens=True``), calls the function, and puts each
        row's score at every position, so whichever position ``get_reward`` reads carries it.
        """

        def __init__(self, tokenizer, reward_fn, context_length: int):
            super().__init__()
            self.tokenizer, self.reward_fn, self.context_length = tokenizer, reward_fn, context_length

        def forward(self, input_ids, attention_mask=None, **ignored):  # position_ids, use_cache, ... unused
            c = self.context_length
            if input_ids.shape[1] < c:
                raise ValueError(f"RewardFnModel: sequence of {input_ids.shape[1]} tokens is shorter than its "
                                 f"query width {c}")
            if attention_mask is None:
                attention_mask = input_ids != self.tokenizer.pad_token_id
            ids, mask = input_ids.cpu(), attention_mask.bool().cpu()  # TRL maps pads to id 0 and masks them
            decode = lambda row, m: self.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)  # noqa: E731
            prompts = [decode(r, m) for r, m in zip(ids[:, :c], mask[:, :c])]
            completions = [decode(r, m) for r, m in zip(ids[:, c:], mask[:, c:])]
            scores = torch.as_tensor(self.reward_fn(prompts=prompts, completions=completions), dtype=torch.float32)
            if scores.shape != (input_ids.shape[0],) or not torch.isfinite(scores).all():
                raise ValueError(f"reward function returned {tuple(scores.shape)} / non-finite scores for "
                                 f"{input_ids.shape[0]} completions")
            hidden = scores.to(input_ids.device)[:, None, None].expand(-1, input_ids.shape[1], 1)
            return _Output(hidden)

    class RewardFnModel(nn.Module):
        """A fastppo reward *function* (``fn(prompts=, completions=) -> list[float]``, by default
        ``fastppo.rewards:positive_words``) as something TRL's PPOTrainer accepts as ``reward_model``.

        TRL 0.26 scores a rollout with ``trl.trainer.utils.get_reward(model, query_response, pad_id,
        context_length)``, which needs exactly two things of the model:

        * ``getattr(model, model.base_model_prefix)`` — a body called with ``input_ids`` (pads replaced
          by id 0), ``attention_mask``, ``position_ids``, ``output_hidden_states=True`` and returning an
          object with ``.hidden_states[-1]`` of shape [B, L, H];
        * ``model.score`` — a head mapping that to [B, L, 1]; TRL reads it at the last non-pad response
          token (``first_true_indices(response == pad) - 1 + context_length``).

        The body here decodes the ids and calls the very function fastppo calls, so the two trainers
        optimise the same reward by construction (whatever the rule is); ``score`` is the identity and
        the score sits at every position, so TRL's read-out position does not matter — also when the
        policy samples a pad id mid-response (TRL reads before it; the function, like fastppo's
        decode, sees the whole response minus special tokens).

        The query/response boundary: ``get_reward`` passes ``context_length`` to the read-out but not
        to the body, so the module is built for one query width and the baseline left-pads every
        query to that width (the longest prompt); the body checks the width it is given.
        """

        base_model_prefix = "reward_fn_body"

        def __init__(self, tokenizer, reward_fn, context_length: int):
            super().__init__()
            self.reward_fn_body = _DecodeAndScore(tokenizer, reward_fn, context_length)
            self.score = nn.Identity()

        def forward(self, input_ids, attention_mask=None, **kwargs):
            return self.score(self.reward_fn_body(input_ids, attention_mask).hidden_states[-1])

    return RewardFnModel


def reward_fn_model(tokenizer, context_length: int, reward_fn=None):
    """A :class:`RewardFnModel` around ``reward_fn`` (default: the embedded default's reward function)."""
    if reward_fn is None:
        import importlib

        from fastppo.embedded import DEFAULT_REWARD_FN

        module, _, name = DEFAULT_REWARD_FN.partition(":")
        reward_fn = getattr(importlib.import_module(module), name)
    return _make_reward_fn_model()(tokenizer, reward_fn, context_length)


# ============================================================================ the runner


class TrlPhases:
    """Seconds TRL 0.26's PPOTrainer spends per iteration in generation (``batch_generation``), scoring
    (the no-grad ``forward``/``get_reward`` calls), the update (the gradient ``forward`` calls and what
    follows them) and ``gc.collect``: its module's functions are wrapped with timers (what TRL logs has
    no phase split)."""

    def __init__(self):
        self.current = {"generation": 0.0, "scoring": 0.0, "gc": 0.0}
        self.per_iteration: list[dict] = []
        self.iteration_start = None

    def install(self):
        import gc

        import torch
        from trl.experimental.ppo import ppo_trainer as module

        def timed(fn, phase_of):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    phase = phase_of()
                    if phase:
                        self.current[phase] += time.perf_counter() - t0
            return wrapper

        module.batch_generation = timed(module.batch_generation, lambda: "generation")
        module.get_reward = timed(module.get_reward, lambda: "scoring" if not torch.is_grad_enabled() else None)
        module.forward = timed(module.forward, lambda: "scoring" if not torch.is_grad_enabled() else None)

        class _Gc:  # TRL calls gc.collect() through its module's `gc` name
            def __getattr__(self, name):
                return getattr(gc, name)

            collect = staticmethod(timed(gc.collect, lambda: "gc"))

        module.gc = _Gc()
        self.iteration_start = time.perf_counter()

    def close_iteration(self):
        now = time.perf_counter()
        total = now - self.iteration_start
        split = dict(self.current)
        split["update"] = total - sum(split.values())  # the PPO epochs, metrics and the rest of the iteration
        self.per_iteration.append(split)
        self.current = {k: 0.0 for k in self.current}
        self.iteration_start = now


def run_trl(cfg: E2EConfig, output_dir: str) -> dict:
    """Train TRL 0.26's PPOTrainer for ``cfg.total_iterations`` iterations; per-iteration stamps and metrics."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path, tokenizer, prompts, width, reward_path = model_and_prompts(cfg, output_dir)
    train_dataset = Dataset.from_dict({"input_ids": prompts})
    eval_dataset = Dataset.from_dict({"input_ids": prompts[: cfg.per_device_train_batch_size]})

    torch.manual_seed(cfg.seed)
    kwargs = dict(dtype=torch.float32, attn_implementation="sdpa")
    policy = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    ref_policy = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    value_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
    value_model.config.pad_token_id = tokenizer.pad_token_id
    if reward_path:
        reward_model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1, **kwargs)
    else:
        reward_model = reward_fn_model(tokenizer, width)

    # num_mini_batches: TRL steps its optimizer through accelerate's gradient accumulation
    # (every gradient_accumulation_steps micro-batches), fastppo once per minibatch; the two agree
    # when num_mini_batches == 1, so the bench keeps it there unless told otherwise.
    args = PPOConfig(
        **shared_settings(cfg, output_dir),
        exp_name="trl_baseline",
        stop_token="eos" if cfg.stop_on_eos else None,
        missing_eos_penalty=cfg.missing_eos_penalty,
        fp16=False,
        **({} if cfg.defaults else {"gradient_checkpointing": False, "save_strategy": "no"}),
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    clock = IterationClock()
    history: list[dict] = []
    phases = TrlPhases()
    trainer = PPOTrainer(
        args=args, processing_class=tokenizer, model=policy, ref_model=ref_policy, reward_model=reward_model,
        train_dataset=train_dataset, value_model=value_model, eval_dataset=eval_dataset,
        callbacks=[stamp_callback(clock, history, phases)],
    )
    # PrinterCallback (disable_tqdm) would print every metrics dict; the bench reports them itself.
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    phases.install()
    trainer.train()
    return {"start": clock.start, "stamps": clock.stamps, "history": history, "context_length": width,
            "phases": phases.per_iteration}
