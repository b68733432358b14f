"""The pieces of a causal LM and the batch layouts every forward of the update runs on.

The pieces: the transformers model inside a value-head or PEFT wrapper (``causal_lm_of``, ``lm_of``), its
KV-cache keyword, its LM head (``lm_head_of``), the body and scalar head of a value or reward model
(``backbone_and_head``), ZeRO-3 gathers for reading weights (``gathered``), and log-probs from hidden states
through ``fused_token_logprobs`` (``token_logprobs_from_hidden``: the ``[tokens, vocab]`` logits never exist).

The layouts: ``Layout`` and ``make_layout`` cut a rollout's all-padding columns or pack its rows, so that the
decoder (``decoder_hidden``), the LM head and the value head compute nothing on padding.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from fastppo.errors import SettingsError
from fastppo.kernels import fused_token_logprobs
from fastppo.value_head import AutoModelForCausalLMWithValueHead, _cache_keyword

__all__ = ["Layout", "backbone_and_head", "cache_keyword", "causal_lm_of", "decoder_hidden", "gathered",
           "four_d_mask", "head_input", "lm_head_of", "lm_of", "make_layout", "make_shared_layout", "shared_mask_kind",
           "token_logprobs_from_hidden"]


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


def reads_last_token(seq_cls_model: nn.Module) -> bool:
    """Whether a sequence-classification model scores a sequence by its head on the last real token's hidden
    state: transformers' decoder classifiers (Llama, Qwen2, GPT-2, ...) name that head ``score``; encoders
    (BERT, DeBERTa, RoBERTa) name theirs ``classifier`` and read a pooler of the first token instead."""
    return isinstance(getattr(seq_cls_model, "score", None), nn.Linear)


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


def head_input(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The hidden states as the LM head's logits are to come out of them: a model that scales its logits (Cohere's
    ``logit_scale``, multiplied; Granite's ``logits_scaling``, divided) gets them through its hidden states
    instead, (s·h)·Wᵀ = s·(h·Wᵀ), so that the fused head's log-probs are the model's own. Soft-capped logits
    (Gemma 2) have no such form: ``loading``'s head check refuses them."""
    config = causal_lm_of(model).config
    scale = getattr(config, "logit_scale", None)
    divide = getattr(config, "logits_scaling", None)
    if scale is not None and scale != 1:
        return hidden * scale
    if divide is not None and divide != 1:
        return hidden / divide
    return hidden


# set on an LM head by loading.cast_lm_head_to_fp32 (TRL GRPO's cast_lm_head_to_fp32)
FP32_HEAD = "fastppo_fp32_logits"


def head_precision(model: nn.Module, hidden: torch.Tensor):
    """``hidden`` as the LM head multiplies it, and the autocast context to multiply it in: a head cast to fp32
    (``FP32_HEAD``) multiplies fp32 operands with autocast off, as TRL's cast head does; any other, ``hidden``
    as it is under the caller's autocast (the kernels' compute-dtype rule)."""
    if getattr(lm_head_of(model), FP32_HEAD, False):
        return hidden.float(), torch.autocast(hidden.device.type, enabled=False)
    return hidden, contextlib.nullcontext()


def token_logprobs_from_hidden(model, hidden, targets, temperature: float, return_entropy: bool):
    """Log-probs (and entropies) of ``targets`` from the decoder's hidden states through the LM head (its
    ``head_input`` scaling and ``head_precision`` applied here), fused: the ``[tokens, vocab]`` logits never
    exist."""
    hidden, precision = head_precision(model, head_input(model, hidden))
    head = lm_head_of(model)
    bias = getattr(head, "bias", None)
    with gathered(head.weight, bias), precision:  # the reference's head under ZeRO-3; a no-op otherwise
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
    # [R, L]; None when packed (transformers reads the segments off positions); [R, 1, L, L] when each row is a group
    # sharing its prompt (make_shared_layout: transformers passes a 4-D mask through as given)
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor  # [R, L]
    gather: torch.Tensor  # [n] hidden states predicting real response tokens
    targets: torch.Tensor  # [n] the response tokens they predict
    rows: torch.Tensor  # [n] where each lands in the [b, T] output
    cols: torch.Tensor  # [n]
    last: torch.Tensor  # [b] each row's last real token (a reward model reads it)
    shape: tuple[int, int]  # (b, T)
    history: object | None = None  # sampling.History: what preceded each token (Rollout.layout sets it)

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


def shared_mask_kind(model: nn.Module) -> str | None:
    """How a group's shared-prompt mask is given to ``model``'s attention: "bool" (sdpa: True attends), "additive"
    (eager attention adds it: 0 or the lowest float), or None where a 4-D mask cannot be given (flash attention,
    flex attention, other implementations): no sharing there."""
    return {"sdpa": "bool", "eager": "additive"}.get(getattr(causal_lm_of(model).config, "_attn_implementation", None))


def four_d_mask(allowed: torch.Tensor, mask_kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean 4-D attention mask (True: attend) as ``mask_kind``'s attention reads it: itself for sdpa ("bool"),
    0 or the dtype's lowest value for eager attention ("additive"), as transformers builds each."""
    if mask_kind == "bool":
        return allowed
    if mask_kind == "additive":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)
    raise ValueError(f"no 4-D attention mask for attention {mask_kind!r}")


def group_sharing(share_prompts: bool | None, group_size: int, model: nn.Module, rows_per_forward: int,
                  query_lengths: Sequence[int], response_lengths: Sequence[int], grouped: Callable[[], bool]):
    """How ``model``'s forwards over ``rows_per_forward`` rows at a time run each group's prompt once
    (``share_prompts``): (group size, mask kind, mask dtype) for ``make_shared_layout``, or None where they cannot or
    should not: sharing off, one completion per prompt, batches that would split a group, an attention that takes no
    group mask, rows that are not groups of one prompt (``grouped()``, asked last: it may sync the device), or, with
    ``share_prompts`` unset, a shared layout that would cost more (``shared_layout_saves_work``)."""
    k = group_size
    if share_prompts is False or k < 2 or rows_per_forward % k:
        return None
    kind = shared_mask_kind(model)
    if kind is None:
        return None
    if share_prompts is None and not shared_layout_saves_work(model, query_lengths, response_lengths, k):
        return None
    if not grouped():
        return None
    return k, kind, next(model.parameters()).dtype


def shared_layout_saves_work(model: nn.Module, query_lengths: Sequence[int], response_lengths: Sequence[int],
                             group_size: int) -> bool:
    """Whether ``make_shared_layout`` costs ``model`` fewer FLOPs than one row per completion: each token costs the
    decoder's weights twice (2 FLOPs per parameter, embeddings and LM head aside: the head runs on the same
    response tokens either way), each (query, key) pair of a row 4 · hidden · layers (QKᵀ and PV; an explicit mask
    is computed densely, so a row of L tokens costs L² pairs). The shared row saves (k − 1) copies of the prompt
    but its L² grows with k times the completions' length: long completions in large groups are cheaper unshared."""
    config = causal_lm_of(model).config
    per_token = 2 * sum(getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters()
                        if "embed" not in n and "lm_head" not in n)
    per_pair = 4 * config.hidden_size * config.num_hidden_layers
    rows = [q + r for q, r in zip(query_lengths, response_lengths)]
    unshared = sum(n * per_token + n * n * per_pair for n in rows)
    shared = 0
    for g in range(0, len(rows), group_size):
        n = query_lengths[g] + sum(response_lengths[g:g + group_size])
        shared += n * per_token + n * n * per_pair
    return shared < unshared


def make_shared_layout(query_responses: torch.Tensor, context_length: int, query_lengths: list[int],
                       response_lengths: list[int], group_size: int, mask_kind: str,
                       dtype: torch.dtype = torch.float32) -> Layout:
    """A layout of groups of ``group_size`` consecutive rows that share one prompt (the same real query tokens):
    one decoder row per group, its prompt once and then each completion, positions as each row alone has them
    (the prompt from 0, each completion after it), and a [G, 1, L, L] mask by which a prompt token attends to the
    prompt causally and a completion token to the prompt and, causally, its own completion only. Each token's
    attention, hence every hidden state, log-prob and gradient, is the unshared layout's up to rounding; the prompt
    runs once per group instead of ``group_size`` times (its activations' gradients summed by autograd). Padding at a
    row's end attends to itself only (finite, never read). ``mask_kind``: ``shared_mask_kind``'s; ``dtype``: the
    additive mask's. The outputs land as ``make_layout``'s, in the same order."""
    b, width = query_responses.shape
    k = group_size
    if k < 2 or b % k:
        raise ValueError(f"make_shared_layout: {b} rows are not groups of {k}")
    t = width - context_length
    device = query_responses.device
    groups = b // k
    spans = [(query_lengths[g * k], [response_lengths[g * k + j] for j in range(k)]) for g in range(groups)]
    if any(query_lengths[g * k + j] != ql for g, (ql, _) in enumerate(spans) for j in range(k)):
        raise ValueError("make_shared_layout: the rows of a group have prompts of different lengths")
    length = max(ql + sum(rls) for ql, rls in spans)
    positions = torch.zeros(groups, length, dtype=torch.long)
    segment = torch.full((groups, length), -2, dtype=torch.long)  # -1 the prompt, j completion j, -2 padding
    source, target_cols, gather, last = [], [], [], []
    for g, (ql, rls) in enumerate(spans):
        first = g * k
        source.append((first, context_length - ql, 0, ql))  # (row, from column, to column, count)
        positions[g, :ql] = torch.arange(ql)
        segment[g, :ql] = -1
        start = ql
        for j, rl in enumerate(rls):
            source.append((first + j, context_length, start, rl))
            positions[g, start:start + rl] = torch.arange(ql, ql + rl)
            segment[g, start:start + rl] = j
            # the hidden state that predicts completion token 0 is the prompt's last; token i's, completion token i-1
            gather.append(torch.cat([torch.tensor([g * length + ql - 1]),
                                     g * length + start + torch.arange(rl - 1)]) if rl else torch.empty(0, dtype=torch.long))
            last.append(g * length + (start + rl - 1 if rl else ql - 1))
            start += rl
    # the token ids move on the device (flat indices built here): no copy of the rollout to the host
    src_index = torch.cat([row * width + src + torch.arange(n) for row, src, _, n in source])
    dst_index = torch.cat([(row // k) * length + dst + torch.arange(n) for row, _, dst, n in source])
    ids = query_responses.new_zeros(groups * length)
    ids[dst_index.to(device)] = query_responses.reshape(-1)[src_index.to(device)]
    q = torch.arange(length)
    same = segment[:, :, None] == segment[:, None, :]
    causal = q[None, :, None] >= q[None, None, :]
    prompt_key = (segment == -1)[:, None, :]
    real_query = (segment != -2)[:, :, None]
    allowed = (real_query & causal & (same | prompt_key)) | (~real_query & torch.eye(length, dtype=torch.bool))
    mask = four_d_mask(allowed[:, None], mask_kind, dtype)
    rows, cols = [], []
    for i, rl in enumerate(response_lengths):
        rows.append(torch.full((rl,), i))
        cols.append(torch.arange(rl))
    rows_t, cols_t = torch.cat(rows).to(device), torch.cat(cols).to(device)
    targets = query_responses[rows_t, context_length + cols_t]
    return Layout(ids.view(groups, length), mask.to(device), positions.to(device), torch.cat(gather).to(device),
                  targets, rows_t, cols_t, torch.tensor(last, device=device), (b, t))


def decoder_hidden(model: nn.Module, layout: Layout) -> torch.Tensor:
    """[R·L, H] last hidden states of the decoder body (the LM head never runs here)."""
    decoder = causal_lm_of(model).get_decoder()
    hidden = decoder(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                     position_ids=layout.position_ids, use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])
