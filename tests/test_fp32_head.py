"""TRL GRPO's ``cast_lm_head_to_fp32``: the LM head's weights in fp32 and its logits from fp32 operands under a
16-bit autocast, in the sampler's forward and in the fused head alike; a tied embedding keeps the model's dtype
on its output; a copy (the reference) reads its own head; a PEFT adapter on the head is refused."""
from __future__ import annotations

import copy

import datasets
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from fastppo import GRPOConfig, GRPOTrainer
from fastppo.errors import SettingsError
from fastppo.layout import lm_head_of, make_layout, decoder_hidden, token_logprobs_from_hidden
from fastppo.loading import cast_lm_head_to_fp32

pytestmark = pytest.mark.usefixtures("reference_path")


def tiny_llama(tied: bool, dtype=torch.bfloat16, seed=3):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # a head whose logits are large enough for bf16 operands to round them visibly
        lm_head_of(model).weight.normal_(0, 2.0)
    return model.eval()


def fused_logprobs(model, ids):
    n = ids.shape[1]
    layout = make_layout(ids, 1, [1], [n - 1], packed=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = decoder_hidden(model, layout).index_select(0, layout.gather)
        return layout.scatter(token_logprobs_from_hidden(model, hidden, layout.targets, 1.0, False)), hidden


@pytest.mark.parametrize("tied", [False, True])
def test_the_cast_head_computes_fp32_logits_in_both_paths(tied):
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (1, 11))
    model = tiny_llama(tied, torch.float32)  # fp32 weights under a bf16 autocast: the head multiplies in bf16
    before, _ = fused_logprobs(model, ids)
    cast_lm_head_to_fp32(model)
    head = lm_head_of(model)
    got, hidden = fused_logprobs(model, ids)
    # the fp32 reference: the same hidden states through the fp32 head, in float64
    logits = hidden.double() @ head.weight.double().T
    expected = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    fp32_rounding = 1e-6 * logits.abs().max().item()  # fp32 accumulation over logits of this size
    assert (got[0].double() - expected).abs().max() < fp32_rounding
    assert (before[0].double() - expected).abs().max() > 100 * fp32_rounding  # bf16 operands before the cast
    # the sampler's forward (the head's own) computes the same fp32 logits under autocast
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids).logits
    assert out.dtype == torch.float32
    sampled = torch.log_softmax(out[0, :-1].double(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert (sampled - expected).abs().max() < fp32_rounding


def test_a_bf16_model_gets_an_fp32_head_and_a_tied_embedding_keeps_its_output_dtype():
    ids = torch.randint(0, 97, (1, 7))
    for tied in (False, True):
        model = tiny_llama(tied)
        cast_lm_head_to_fp32(model)
        assert lm_head_of(model).weight.dtype == torch.float32
        assert (model.get_input_embeddings().weight.dtype == torch.float32) == tied  # one tensor when tied
        assert model.get_input_embeddings()(ids).dtype == torch.bfloat16
        assert model(input_ids=ids).logits.dtype == torch.float32


def test_a_copy_reads_its_own_head():
    model = tiny_llama(False)
    cast_lm_head_to_fp32(model)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        lm_head_of(model).weight.mul_(3.0)
    ids = torch.randint(0, 97, (1, 7))
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        expected = ref.model(input_ids=ids).last_hidden_state.float() @ lm_head_of(ref).weight.T
        torch.testing.assert_close(ref(input_ids=ids).logits, expected)


def test_a_peft_adapter_on_the_head_is_refused():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(False, torch.float32), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(SettingsError, match="cast_lm_head_to_fp32=True is not supported when the lm_head carries"):
        cast_lm_head_to_fp32(model)


def test_grpo_trains_a_bf16_model_with_its_head_in_fp32(tmp_path, model_dir):
    """TRL's test of the setting, on a bf16 model: the head is fp32 after the trainer is built, and training moves
    every weight, the head included."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=5, max_steps=2, learning_rate=0.1, cast_lm_head_to_fp32=True, bf16=True,
                      gradient_checkpointing=False, disable_tqdm=True, save_strategy="no", report_to="none")
    data = datasets.Dataset.from_dict({"prompt": ["the movie was", "i think the plot is"] * 4})
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
                          args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(model_dir))
    assert trainer.model.lm_head.weight.dtype == torch.float32
    assert trainer.model.model.embed_tokens.weight.dtype == torch.bfloat16
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
