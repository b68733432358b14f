"""Legacy TRL's ``PPOTrainer.generate()`` (``fastppo.legacy``): responses for one query or a list of them,
sampled exactly from softmax(logits / temperature) by fastppo's sampler unless the keyword arguments ask for
other processing (top_k, top_p, ...), which transformers' ``generate`` then honours; the reference's too on
request."""
from __future__ import annotations

import contextlib
import numbers

import torch

from fastppo.data import left_pad
from fastppo.errors import SettingsError
from fastppo.generation import Sampling, generate_with_kwargs, sample_responses
from fastppo.kernels import check_temperature
from fastppo.layout import causal_lm_of, lm_of
from fastppo.loading import position_limit

# generate() kwargs whose given value keeps sampling exactly softmax(logits / temperature)
_NEUTRAL = {
    "do_sample": (True,), "top_k": (0, 0.0, None), "top_p": (1.0, None), "min_length": (-1, 0, None),
    "min_new_tokens": (0, None), "num_beams": (1, None), "num_return_sequences": (1, None),
    "repetition_penalty": (1.0, None), "typical_p": (1.0, None), "min_p": (None, 0.0), "use_cache": (True, False),
}
_PASSED_THROUGH = ("max_new_tokens", "temperature", "pad_token_id", "eos_token_id")


def _is_exact(kwargs: dict) -> bool:
    return all(k in _PASSED_THROUGH or (k in _NEUTRAL and v in _NEUTRAL[k]) for k, v in kwargs.items())


def legacy_generate(trainer, query_tensor, length_sampler, batch_size: int, return_prompt: bool,
                    generate_ref_response: bool, remove_padding: bool, kwargs: dict):
    batch_size = positive_int(batch_size, "generate: batch_size")
    if "max_new_tokens" in kwargs:  # numpy integers too: TRL's LengthSampler draws them
        kwargs = {**kwargs, "max_new_tokens": positive_int(kwargs["max_new_tokens"], "generate: max_new_tokens")}
    if kwargs.get("do_sample", True) and "temperature" in kwargs:
        try:  # sampling divides the logits by it: the kernels' range, one message
            check_temperature(kwargs["temperature"])
        except (TypeError, ValueError) as e:
            raise SettingsError(f"generate: temperature: {e} (for greedy decoding pass do_sample=False)") from None
    single = isinstance(query_tensor, torch.Tensor)
    if single and query_tensor.dim() != 1:
        raise SettingsError(f"generate: query_tensor must be 1-D (one query) or a list of them, got shape "
                         f"{tuple(query_tensor.shape)}")
    queries = [query_tensor] if single else list(query_tensor)
    if not queries or not all(isinstance(q, torch.Tensor) and q.dim() == 1 and len(q) for q in queries):
        raise SettingsError("generate: query_tensor must be a non-empty 1-D tensor or a list of them")
    models = [lm_of(trainer.policy)]
    if generate_ref_response:
        models.append(None)  # the reference: a frozen copy, or the policy with its adapter disabled
    outputs = []
    for model in models:
        rows = []
        for i in range(0, len(queries), batch_size):
            chunk = queries[i : i + batch_size]
            step_kwargs = dict(kwargs)
            if length_sampler is not None:
                step_kwargs["max_new_tokens"] = positive_int(length_sampler(), "generate: the length_sampler's draw")
            rows += _generate_chunk(trainer, model, chunk, step_kwargs, return_prompt, remove_padding and not single)
        outputs.append(rows[0].unsqueeze(0) if single else rows)
    return tuple(outputs) if generate_ref_response else outputs[0]


def positive_int(value, what: str) -> int:
    """An integer >= 1 (Python's or NumPy's; not a bool, not a float), as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise SettingsError(f"{what} must be an integer >= 1, got {value!r}")
    return int(value)


@torch.no_grad()
def _generate_chunk(trainer, model, queries: list[torch.Tensor], kwargs: dict, return_prompt: bool,
                    cut_after_eos: bool) -> list[torch.Tensor]:
    tok = trainer.tokenizer
    pad = kwargs.get("pad_token_id", tok.pad_token_id)
    eos = kwargs.get("eos_token_id", tok.eos_token_id)
    stop_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    ids, mask = left_pad([q.tolist() for q in queries], pad)
    ids, mask = ids.to(trainer.device), mask.to(trainer.device)
    context = contextlib.nullcontext()
    if model is None:
        if trainer.reference_model is not None:
            model = trainer.reference_model
        else:
            model = lm_of(trainer.policy)
            context = model.disable_adapter()
    max_new = kwargs.get("max_new_tokens", 20)
    limit = position_limit(causal_lm_of(model).config)
    if limit is not None and ids.shape[1] + max_new > limit:  # the 0.26 API refuses the same lengths
        raise SettingsError(f"generate: the longest query ({ids.shape[1]} tokens) + max_new_tokens ({max_new}) = "
                            f"{ids.shape[1] + max_new} exceeds the model's {limit} positions; shorten the queries "
                            "or lower max_new_tokens (or the length_sampler's range)")
    with context, trainer.autocast():
        if _is_exact(kwargs):
            responses = sample_responses(model, ids, mask, max_new,
                                         Sampling(float(kwargs.get("temperature", 1.0)), stop_ids, pad), len(queries))
        else:
            responses = generate_with_kwargs(model, ids, mask, kwargs, pad, stop_ids)
    out = []
    for q, r in zip(queries, responses):
        r = r.to(q.device)
        if cut_after_eos and stop_ids:
            hits = torch.isin(r, torch.tensor(stop_ids, device=r.device)).nonzero()
            if len(hits):
                r = r[: hits[0, 0] + 1]
        out.append(torch.cat([q, r]) if return_prompt else r)
    return out
